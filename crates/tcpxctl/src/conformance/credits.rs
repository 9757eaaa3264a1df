//! `credit_landing`: what the daemon's credits on GPU lanes rest on (docs/ARCHITECTURE.md, "What
//! a CUDA receive may name"): a CUDA receive may name a landing registration smaller than what it
//! receives — the payload lands in the GPU's bounce pages, the posted destination is never
//! written, and the unpack alone decides where the bytes go. Needs CUDA test memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::harness::{Ctx, MemCtx, Pair, TestBuf, err, land_and_check, pattern};
use tcpxd::engine::MAX_CHUNK_BYTES;
use tcpxd::net::{self, Region};
use tcpxd::unpack::UnpackImpl;

/// The landing registration: one page.
const LANDING: usize = 4096;
/// What the untouched landing page holds.
const SENTINEL: u8 = 0xA5;

/// Four credit receives of 4 MiB (the largest chunk) posted at the start of a one-page CUDA
/// registration; the sender sends 4 MiB, 4 KiB, 1 MiB + 123 bytes and 1 byte. Each completes
/// with fragments covering what was sent (at most 2048 of at most 4 KiB), is unpacked from the
/// bounce pages into a destination of its own, byte-exact, and consumed; the page is untouched.
pub(super) fn case_credit_landing(ctx: &Ctx) -> Result<String, String> {
    let MemCtx::Cuda(gpu) = &ctx.mem else {
        return Err("needs CUDA test memory (--cuda N)".into());
    };
    gpu.bind_to_thread().map_err(|e| e.to_string())?;
    let (send, recv) =
        net::loopback_pair(&ctx.plugin, ctx.dev, ctx.opts.connect_timeout).map_err(|e| e.to_string())?;
    let posted = MAX_CHUNK_BYTES as usize;
    let sizes = [posted, 4096, (1 << 20) + 123, 1];
    let offs: Vec<usize> = sizes
        .iter()
        .scan(0usize, |at, &s| {
            let o = *at;
            *at += s.next_multiple_of(4096);
            Some(o)
        })
        .collect();
    let total = offs[3] + 4096;
    let src = TestBuf::Cuda(Arc::new(gpu.alloc(total).map_err(|e| e.to_string())?));
    let dst = TestBuf::Cuda(Arc::new(gpu.alloc(total).map_err(|e| e.to_string())?));
    let landing = Arc::new(gpu.alloc(LANDING).map_err(|e| e.to_string())?);
    landing
        .write(0, &[SENTINEL; LANDING])
        .map_err(|e| e.to_string())?;
    let smh = send.register(src.region()).map_err(err("regMr CUDA source"))?;
    let rmh = recv
        .register(landing.clone() as Arc<dyn Region>)
        .map_err(err("regMr CUDA landing page"))?;
    // The daemon's unpacker (UCCL_TCPX_UNPACK_IMPL: `d2d` where no kernel can load).
    let unpack_impl: UnpackImpl = std::env::var("UCCL_TCPX_UNPACK_IMPL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_default();
    let unpacker = unpack_impl.build(gpu).map_err(|e| e.to_string())?;
    let mut p = Pair {
        send,
        recv,
        src,
        dst,
        smh,
        rmh,
        unpacker: Some((gpu.clone(), std::sync::Mutex::new(unpacker))),
    };
    let mut recvs = Vec::new();
    for (k, (&off, &len)) in offs.iter().zip(&sizes).enumerate() {
        let data = pattern(0xC4ED17 + k as u64, len);
        p.src.write(off, &data).map_err(|e| e.to_string())?;
        let r = p
            .recv
            .irecv(&p.rmh, 0, posted, k as i32)
            .map_err(err("a 4 MiB credit receive naming a one-page registration"))?
            .ok_or("irecv deferred")?;
        recvs.push((r, off, data));
    }
    for (k, (&off, &len)) in offs.iter().zip(&sizes).enumerate() {
        p.send
            .isend(&p.smh, off, len, k as i32)
            .map_err(err("isend"))?
            .ok_or("isend deferred")?;
    }
    let timeout = ctx.opts.case_timeout.min(Duration::from_secs(60));
    let deadline = Instant::now() + timeout;
    let (mut next, mut most) = (0, 0);
    while next < recvs.len() {
        if Instant::now() > deadline {
            return Err(format!(
                "{next} of {} credit receives done after {timeout:?}",
                recvs.len()
            ));
        }
        if let Some(id) = p.send.oldest() {
            p.send.test(id).map_err(err("send test"))?;
        }
        let (rid, off, data) = &recvs[next];
        match p.recv.test(*rid).map_err(err("recv test"))? {
            Some(c) => {
                let landed = land_and_check(&p, c, *off, data).map_err(|e| {
                    format!(
                        "the {}-byte chunk into a {posted}-byte credit receive: {e}",
                        data.len()
                    )
                })?;
                if landed.direct {
                    return Err(
                        "a CUDA receive landed in place; its posted destination must never be written".into(),
                    );
                }
                most = most.max(landed.fragments);
                p.recv.consume(*rid).map_err(err("irecvConsumed"))?;
                next += 1;
            }
            None => std::thread::yield_now(),
        }
    }
    while let Some(id) = p.send.oldest() {
        if Instant::now() > deadline {
            return Err("sends not done after their receives completed".into());
        }
        p.send.test(id).map_err(err("send test"))?;
    }
    let mut page = vec![0u8; LANDING];
    landing.read(0, &mut page).map_err(|e| e.to_string())?;
    if let Some(i) = page.iter().position(|&b| b != SENTINEL) {
        return Err(format!(
            "byte {i} of the landing registration was written ({:#04x}): a CUDA receive's posted \
             destination must never be written",
            page[i]
        ));
    }
    if most > 2048 {
        return Err(format!("a request took {most} fragments; the plugin allows 2048"));
    }
    Ok(format!(
        "{} receives of {posted} bytes naming one {LANDING}-byte registration took {:?} bytes \
         byte-exact from bounce pages (at most {most} fragments each); the registration untouched",
        sizes.len(),
        sizes
    ))
}
