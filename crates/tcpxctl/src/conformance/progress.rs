//! Where a request moves: only inside `test`, one more request per call (`send_progress`,
//! `recv_progress`). In Google's plugin (google/nccl-plugin-gpudirecttcpx `4b8ea7f`,
//! src/net_tcpx.cc) `tcpxIsend_v5` (898–919) only queues the request and `tcpxTest` (1311) runs
//! `tcpxCommProgress` (1099), which activates at most one posted request per call (1158–1180)
//! and hands the oldest active one's chunks to the socket threads (1182–1226). So sends posted
//! and never tested never move, and after `k` test calls on a send comm at most `k` of its sends
//! can have reached the receiver.

use std::time::{Duration, Instant};

use super::harness::{Ctx, err, expect_empty, land_and_check, pattern};
use tcpxd::net::RequestId;

/// Sends posted on the comm.
const SENDS: usize = 4;
/// Each small enough to be one chunk (any `NCCL_DYNAMIC_CHUNK_SIZE` the suite runs under).
const LEN: usize = 4096;
/// How long the receiver is polled with no send tested.
const QUIET: Duration = Duration::from_millis(100);
/// How long the receiver is polled after each send test before the next one.
const SETTLE: Duration = Duration::from_millis(50);

pub(super) fn case_send_progress(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(SENDS * LEN)?;
    for k in 0..SENDS {
        p.src
            .write(k * LEN, &pattern(300 + k as u64, LEN))
            .map_err(|e| e.to_string())?;
        p.dst.write(k * LEN, &[0u8; LEN]).map_err(|e| e.to_string())?;
    }
    for k in 0..SENDS {
        p.send
            .isend(&p.smh, k * LEN, LEN, k as i32)
            .map_err(err("isend"))?
            .ok_or("isend deferred")?;
    }
    let mut rids: Vec<RequestId> = Vec::new();
    for k in 0..SENDS {
        rids.push(
            p.recv
                .irecv(&p.rmh, k * LEN, LEN, k as i32)
                .map_err(err("irecv"))?
                .ok_or("irecv deferred")?,
        );
    }
    // Posted, never tested: nothing moves, however long the receiver waits.
    let quiet_until = Instant::now() + QUIET;
    while Instant::now() < quiet_until {
        if p.recv.test(rids[0]).map_err(err("recv test"))?.is_some() {
            return Err(format!(
                "a receive completed though no send was tested: isend moved data (within {} ms)",
                QUIET.as_millis()
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // One send test at a time; the receiver polled in between: at no point more receives
    // complete than send tests were made.
    let deadline = Instant::now() + ctx.opts.case_timeout;
    let (mut tests, mut completed) = (0usize, 0usize);
    while completed < SENDS {
        if Instant::now() > deadline {
            return Err(format!(
                "{completed} of {SENDS} receives completed after {tests} send tests"
            ));
        }
        if let Some(id) = p.send.oldest() {
            p.send.test(id).map_err(err("send test"))?;
            tests += 1;
        }
        let settle_until = Instant::now() + SETTLE;
        while completed < SENDS && Instant::now() < settle_until {
            let rid = rids[completed];
            match p.recv.test(rid).map_err(err("recv test"))? {
                Some(c) => {
                    let k = completed;
                    land_and_check(&p, c, k * LEN, &pattern(300 + k as u64, LEN))?;
                    p.recv.consume(rid).map_err(err("irecvConsumed"))?;
                    completed += 1;
                    if completed > tests {
                        return Err(format!(
                            "{completed} receives completed after {tests} send test(s): one test \
                             moved more than one posted send"
                        ));
                    }
                }
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
    while let Some(id) = p.send.oldest() {
        if Instant::now() > deadline {
            return Err("the sends did not complete after their receives".into());
        }
        p.send.test(id).map_err(err("send test"))?;
    }
    expect_empty(&p)?;
    Ok(format!(
        "no receive in {} ms with {SENDS} sends posted untested; then {SENDS} receives after \
         {tests} send tests, never more than the tests made",
        QUIET.as_millis()
    ))
}

/// Receives posted.
const RECVS: usize = 3;

/// The receive side: each `test` on a receive comm activates at most one more posted receive and
/// queues the oldest active one's chunks (src/net_tcpx.cc 1158–1180, 1227–1304). With every
/// sender's byte already on the wire, after `k` receive tests at most `k` receives can have
/// landed. Observable where receives land in place (host memory on the real plugin, the
/// emulation's direct mode); bounce receives show nothing before they complete.
pub(super) fn case_recv_progress(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(RECVS * LEN)?;
    let expect: Vec<Vec<u8>> = (0..RECVS).map(|k| pattern(400 + k as u64, LEN)).collect();
    for (k, e) in expect.iter().enumerate() {
        p.src.write(k * LEN, e).map_err(|e| e.to_string())?;
        p.dst.write(k * LEN, &[0u8; LEN]).map_err(|e| e.to_string())?;
    }
    for k in 0..RECVS {
        p.send
            .isend(&p.smh, k * LEN, LEN, k as i32)
            .map_err(err("isend"))?
            .ok_or("isend deferred")?;
    }
    // Every send out before any receive is posted (each completes once written).
    let deadline = Instant::now() + ctx.opts.case_timeout;
    while let Some(id) = p.send.oldest() {
        if Instant::now() > deadline {
            return Err("the sends did not complete with no receive posted".into());
        }
        p.send.test(id).map_err(err("send test"))?;
    }
    let mut rids: Vec<RequestId> = Vec::new();
    for k in 0..RECVS {
        rids.push(
            p.recv
                .irecv(&p.rmh, k * LEN, LEN, k as i32)
                .map_err(err("irecv"))?
                .ok_or("irecv deferred")?,
        );
    }
    std::thread::sleep(SETTLE);
    let landed = |p: &super::harness::Pair| -> Result<usize, String> {
        let mut n = 0;
        for (k, e) in expect.iter().enumerate() {
            if p.dst.to_vec(k * LEN, LEN)? == *e {
                n += 1;
            }
        }
        Ok(n)
    };
    let before = landed(&p)?;
    if before > 0 {
        return Err(format!("{before} receive(s) landed before any receive test"));
    }
    let (mut tests, mut direct) = (0usize, false);
    for (k, rid) in rids.iter().enumerate() {
        loop {
            if Instant::now() > deadline {
                return Err(format!("receive {k} of {RECVS} did not complete"));
            }
            let done = p.recv.test(*rid).map_err(err("recv test"))?;
            tests += 1;
            std::thread::sleep(Duration::from_millis(10));
            let n = landed(&p)?;
            if n > tests {
                return Err(format!(
                    "{n} receives landed after {tests} receive test(s): one test moved more than \
                     one posted receive"
                ));
            }
            if let Some(c) = done {
                direct |= land_and_check(&p, c, k * LEN, &expect[k])?.direct;
                p.recv.consume(*rid).map_err(err("irecvConsumed"))?;
                break;
            }
        }
    }
    expect_empty(&p)?;
    Ok(if direct {
        format!(
            "{RECVS} receives of bytes already sent, in place: {tests} receive tests, never more \
             landed than tests made"
        )
    } else {
        format!(
            "{RECVS} receives in {tests} tests; they land in bounce pages, seen only once \
             complete (gathered): run in direct mode to check this"
        )
    })
}
