//! Cases that move data: every size class byte-exact, FIFO matching whatever the tags, and
//! thousands of requests around the 16-slot unpack ring.

use std::time::Instant;

use super::harness::{Ctx, err, exchange, expect_empty, land_and_check, pattern};
use tcpxd::net::abi;

pub(super) fn case_sizes(ctx: &Ctx) -> Result<String, String> {
    const SIZES: [usize; 7] = [0, 1, 4095, 4096, 4097, 512 << 10, 4 << 20];
    let mut p = ctx.pair((4 << 20) + 8192)?;
    let mut notes = Vec::new();
    let mut shuffled = false;
    let mut direct = false;
    for (k, &size) in SIZES.iter().enumerate() {
        // Offset by one page and check the guard bytes around the destination stay untouched.
        let off = 4096;
        p.dst.write(off - 16, &[0xA5; 16]).map_err(|e| e.to_string())?;
        let landed = exchange(&mut p, &[(off, size, k as i32, k as i32)], ctx.opts.case_timeout)
            .map_err(|e| format!("size {size}: {e}"))?;
        let l = &landed[0];
        if p.dst.to_vec(off - 16, 16).map_err(|e| e.to_string())? != [0xA5; 16] {
            return Err(format!(
                "size {size}: bytes before the destination were overwritten"
            ));
        }
        let after = p.dst.to_vec(off + size, 16).map_err(|e| e.to_string())?;
        if size < (4 << 20) && after != [0u8; 16] {
            return Err(format!(
                "size {size}: bytes after the destination were overwritten"
            ));
        }
        shuffled |= l.shuffled;
        direct |= l.direct;
        if size == 4 << 20 {
            notes.push(format!(
                "4 MiB in {} fragments (max {} B)",
                l.fragments, l.max_frag
            ));
        }
    }
    if p.send.sizes_written() + p.recv.sizes_written() != 0 {
        return Err("test wrote *sizes (TCPX never does)".into());
    }
    if direct {
        notes.push("host receives land in place (cnt = 0)".into());
    } else {
        notes.push(format!(
            "bounce pages scattered: {}",
            if shuffled { "yes" } else { "no" }
        ));
    }
    Ok(format!(
        "sizes 0,1,4095,4096,4097,512K,4M byte-exact; test never wrote *sizes; {}",
        notes.join("; ")
    ))
}

pub(super) fn case_fifo_tags_ignored(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(64 << 10)?;
    // Sends tagged 40,30,20,10 with distinct sizes; receives tagged 10,20,30,40. FIFO matching
    // pairs the k-th send with the k-th receive whatever the tags say.
    let jobs = [
        (0, 1000, 40, 10),
        (8192, 2000, 30, 20),
        (16384, 3000, 20, 30),
        (24576, 4000, 10, 40),
    ];
    let landed = exchange(&mut p, &jobs, ctx.opts.case_timeout)?;
    let how = if landed.iter().all(|l| l.direct) {
        "in place"
    } else {
        "with fragment lists covering exactly each sender's size"
    };
    Ok(format!(
        "4 requests with reversed tags matched in posting order, {how}"
    ))
}

pub(super) fn case_ring_wraparound(ctx: &Ctx) -> Result<String, String> {
    const STRIDE: usize = 16 << 10;
    let n = ctx.opts.wraparound_requests;
    let mut p = ctx.pair(abi::MAX_REQUESTS * STRIDE)?;
    let size_of = |k: usize| if k % 97 == 0 { 0 } else { 1 + (k * 7919) % STRIDE };
    let (mut posted_s, mut posted_r, mut done) = (0usize, 0usize, 0usize);
    let mut rids = std::collections::VecDeque::new();
    let mut bytes = 0usize;
    let mut fragments = 0usize;
    let deadline = Instant::now() + ctx.opts.case_timeout;
    while done < n {
        if Instant::now() > deadline {
            return Err(format!("stalled after {done} of {n} requests"));
        }
        while posted_s < n && p.send.can_post() {
            let (off, len) = ((posted_s % abi::MAX_REQUESTS) * STRIDE, size_of(posted_s));
            p.src
                .write(off, &pattern(posted_s as u64, len))
                .map_err(|e| e.to_string())?;
            match p.send.isend(&p.smh, off, len, 7).map_err(err("isend"))? {
                Some(_) => posted_s += 1,
                None => break,
            }
        }
        while posted_r < n && p.recv.can_post() {
            let off = (posted_r % abi::MAX_REQUESTS) * STRIDE;
            match p.recv.irecv(&p.rmh, off, STRIDE, 7).map_err(err("irecv"))? {
                Some(id) => {
                    rids.push_back((id, posted_r));
                    posted_r += 1;
                }
                None => break,
            }
        }
        if let Some(id) = p.send.oldest() {
            p.send.test(id).map_err(err("send test"))?;
        }
        if let Some(&(id, k)) = rids.front() {
            if let Some(c) = p.recv.test(id).map_err(err("recv test"))? {
                // Posted for STRIDE bytes, the receive adopts the sender's (smaller) size.
                let len = size_of(k);
                let off = (k % abi::MAX_REQUESTS) * STRIDE;
                let l = land_and_check(&p, c, off, &pattern(k as u64, len))
                    .map_err(|e| format!("request {k}: {e}"))?;
                p.recv.consume(id).map_err(err("irecvConsumed"))?;
                rids.pop_front();
                bytes += len;
                fragments += l.fragments;
                done += 1;
            }
        }
    }
    while let Some(id) = p.send.oldest() {
        p.send.test(id).map_err(err("send test"))?;
    }
    expect_empty(&p)?;
    Ok(format!(
        "{n} requests ({} laps of the 16-slot ring, {bytes} bytes, {fragments} fragments) byte-exact; slots back to zero",
        n / abi::MAX_REQUESTS
    ))
}
