//! Cases where the plugin must enforce its own rules (the owners' `*_unchecked` calls skip
//! tcpxd's checks): at most 16 outstanding requests, `test` and `irecvConsumed` in order.

use std::time::Instant;

use super::harness::{Ctx, err, expect_empty, land_and_check, pattern};
use tcpxd::net::{NetError, RequestId, abi};

/// Expects a plugin error with `code` whose lines mention `words`.
fn expect_plugin_error<T>(
    r: Result<T, NetError>,
    code: i32,
    words: &str,
    what: &str,
) -> Result<String, String> {
    match r {
        Ok(_) => Err(format!("{what} was accepted; the plugin must refuse it")),
        Err(e) => match e.plugin_code() {
            Some(c) if c == code => {
                let said = e.plugin_lines().join(" | ");
                if said.contains(words) {
                    Ok(format!("{} \"{said}\"", abi::result_name(c)))
                } else {
                    Ok(format!(
                        "{} (log did not say \"{words}\": \"{said}\")",
                        abi::result_name(c)
                    ))
                }
            }
            _ => Err(format!(
                "{what}: expected {} from the plugin, got: {e}",
                abi::result_name(code)
            )),
        },
    }
}

pub(super) fn case_request_limit(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(17 * 4096)?;
    let mut sends: Vec<RequestId> = Vec::new();
    let mut recvs: Vec<RequestId> = Vec::new();
    for k in 0..16 {
        let data = pattern(k as u64, 4096);
        p.src.write(k * 4096, &data).map_err(|e| e.to_string())?;
        sends.push(
            p.send
                .isend(&p.smh, k * 4096, 4096, k as i32)
                .map_err(err("isend"))?
                .ok_or("isend deferred")?,
        );
    }
    let send_17 = expect_plugin_error(
        p.send.isend_unchecked(&p.smh, 16 * 4096, 4096, 16),
        abi::NCCL_INTERNAL_ERROR,
        "unable to allocate requests",
        "a 17th outstanding isend",
    )?;
    for k in 0..16 {
        recvs.push(
            p.recv
                .irecv(&p.rmh, k * 4096, 4096, k as i32)
                .map_err(err("irecv"))?
                .ok_or("irecv deferred")?,
        );
    }
    let recv_17 = expect_plugin_error(
        p.recv.irecv_unchecked(&p.rmh, 16 * 4096, 4096, 16),
        abi::NCCL_INTERNAL_ERROR,
        "unable to allocate requests",
        "a 17th outstanding irecv",
    )?;
    // The 16 posted pairs still complete, and every slot comes back.
    let deadline = Instant::now() + ctx.opts.case_timeout;
    for (k, rid) in recvs.iter().enumerate() {
        loop {
            if Instant::now() > deadline {
                return Err(format!(
                    "request {k} of 16 did not complete after the refused 17th"
                ));
            }
            if let Some(id) = p.send.oldest() {
                p.send.test(id).map_err(err("send test"))?;
            }
            if let Some(c) = p.recv.test(*rid).map_err(err("recv test"))? {
                land_and_check(&p, c, k * 4096, &pattern(k as u64, 4096))?;
                break;
            }
        }
    }
    for rid in recvs {
        p.recv.consume(rid).map_err(err("irecvConsumed"))?;
    }
    while let Some(id) = p.send.oldest() {
        p.send.test(id).map_err(err("send test"))?;
    }
    expect_empty(&p)?;
    Ok(format!(
        "17th isend: {send_17}; 17th irecv: {recv_17}; the 16 before it completed and all slots came back"
    ))
}

pub(super) fn case_test_order(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(8192)?;
    for k in 0..2 {
        p.src
            .write(k * 4096, &pattern(100 + k as u64, 4096))
            .map_err(|e| e.to_string())?;
    }
    p.send
        .isend(&p.smh, 0, 4096, 0)
        .map_err(err("isend"))?
        .ok_or("deferred")?;
    let s1 = p
        .send
        .isend(&p.smh, 4096, 4096, 1)
        .map_err(err("isend"))?
        .ok_or("deferred")?;
    let r0 = p
        .recv
        .irecv(&p.rmh, 0, 4096, 0)
        .map_err(err("irecv"))?
        .ok_or("deferred")?;
    let r1 = p
        .recv
        .irecv(&p.rmh, 4096, 4096, 1)
        .map_err(err("irecv"))?
        .ok_or("deferred")?;
    let send_msg = expect_plugin_error(
        p.send.test_unchecked(s1),
        abi::NCCL_INTERNAL_ERROR,
        "test called with invalid request",
        "test on the second send before the first",
    )?;
    let recv_msg = expect_plugin_error(
        p.recv.test_unchecked(r1),
        abi::NCCL_INTERNAL_ERROR,
        "test called with invalid request",
        "test on the second receive before the first",
    )?;
    let deadline = Instant::now() + ctx.opts.case_timeout;
    let mut pending = vec![(r0, 0usize), (r1, 1usize)];
    pending.reverse();
    while let Some(&(rid, k)) = pending.last() {
        if Instant::now() > deadline {
            return Err("requests did not complete after the refused out-of-order tests".into());
        }
        if let Some(id) = p.send.oldest() {
            p.send.test(id).map_err(err("send test"))?;
        }
        if let Some(c) = p.recv.test(rid).map_err(err("recv test"))? {
            land_and_check(&p, c, k * 4096, &pattern(100 + k as u64, 4096))?;
            p.recv.consume(rid).map_err(err("irecvConsumed"))?;
            pending.pop();
        }
    }
    while let Some(id) = p.send.oldest() {
        p.send.test(id).map_err(err("send test"))?;
    }
    expect_empty(&p)?;
    Ok(format!(
        "send: {send_msg}; recv: {recv_msg}; in-order tests then completed both"
    ))
}

pub(super) fn case_consume_order(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(3 * 4096)?;
    let mut rids = Vec::new();
    for k in 0..2 {
        p.src
            .write(k * 4096, &pattern(200 + k as u64, 4096))
            .map_err(|e| e.to_string())?;
        rids.push(
            p.recv
                .irecv(&p.rmh, k * 4096, 4096, 0)
                .map_err(err("irecv"))?
                .ok_or("deferred")?,
        );
        p.send
            .isend(&p.smh, k * 4096, 4096, 0)
            .map_err(err("isend"))?
            .ok_or("deferred")?;
    }
    let deadline = Instant::now() + ctx.opts.case_timeout;
    for (k, rid) in rids.iter().enumerate() {
        loop {
            if Instant::now() > deadline {
                return Err("receives did not complete".into());
            }
            if let Some(id) = p.send.oldest() {
                p.send.test(id).map_err(err("send test"))?;
            }
            if let Some(c) = p.recv.test(*rid).map_err(err("recv test"))? {
                land_and_check(&p, c, k * 4096, &pattern(200 + k as u64, 4096))?;
                break;
            }
        }
    }
    // A third receive, posted and not complete.
    let r2 = p
        .recv
        .irecv(&p.rmh, 2 * 4096, 4096, 0)
        .map_err(err("irecv"))?
        .ok_or("deferred")?;
    let second_first = expect_plugin_error(
        p.recv.consume_unchecked(rids[1]),
        abi::NCCL_INTERNAL_ERROR,
        "",
        "irecvConsumed of the second completed receive before the first",
    )?;
    p.recv
        .consume(rids[0])
        .map_err(err("irecvConsumed of the oldest"))?;
    let incomplete = expect_plugin_error(
        p.recv.consume_unchecked(r2),
        abi::NCCL_INTERNAL_ERROR,
        "",
        "irecvConsumed of a receive that has not completed",
    )?;
    p.recv
        .consume(rids[1])
        .map_err(err("irecvConsumed of the second"))?;
    // Complete the third so the comm ends clean.
    p.src
        .write(2 * 4096, &pattern(202, 4096))
        .map_err(|e| e.to_string())?;
    p.send
        .isend(&p.smh, 2 * 4096, 4096, 0)
        .map_err(err("isend"))?
        .ok_or("deferred")?;
    loop {
        if Instant::now() > deadline {
            return Err("third receive did not complete".into());
        }
        if let Some(id) = p.send.oldest() {
            p.send.test(id).map_err(err("send test"))?;
        }
        if let Some(c) = p.recv.test(r2).map_err(err("recv test"))? {
            land_and_check(&p, c, 2 * 4096, &pattern(202, 4096))?;
            p.recv.consume(r2).map_err(err("irecvConsumed"))?;
            break;
        }
    }
    while let Some(id) = p.send.oldest() {
        p.send.test(id).map_err(err("send test"))?;
    }
    expect_empty(&p)?;
    Ok(format!(
        "out of order: {second_first}; not complete: {incomplete}; in-order consumption works"
    ))
}
