//! What the cases are built from: test buffers in host or GPU memory, a connected comm pair per
//! case, batches driven to completion, and the check of each receive's fragments and bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Options;
use tcpxd::gpu::{DeviceRegion, Gpu};
use tcpxd::net::{
    self, HostRegion, MemHandle, NetError, Plugin, RecvComm, RecvCompletion, Region, SendComm, abi,
};
use tcpxd::unpack::{UnpackImpl, UnpackJob, Unpacker};

/// A test buffer in host or GPU memory.
#[derive(Clone)]
pub(super) enum TestBuf {
    Host(Arc<HostRegion>),
    Cuda(Arc<DeviceRegion>),
}

impl TestBuf {
    pub(super) fn new(mem: &MemCtx, len: usize) -> Result<TestBuf, String> {
        match mem {
            MemCtx::Host => Ok(TestBuf::Host(Arc::new(
                HostRegion::new(len).map_err(|e| e.to_string())?,
            ))),
            MemCtx::Cuda(gpu) => Ok(TestBuf::Cuda(Arc::new(
                gpu.alloc(len).map_err(|e| e.to_string())?,
            ))),
        }
    }

    pub(super) fn region(&self) -> Arc<dyn Region> {
        match self {
            TestBuf::Host(r) => r.clone(),
            TestBuf::Cuda(r) => r.clone(),
        }
    }

    pub(super) fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
        match self {
            TestBuf::Host(r) => r.write(offset, data).map_err(|e| e.to_string()),
            TestBuf::Cuda(r) => r.write(offset as u64, data).map_err(|e| e.to_string()),
        }
    }

    pub(super) fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, String> {
        match self {
            TestBuf::Host(r) => r.to_vec(offset, len).map_err(|e| e.to_string()),
            TestBuf::Cuda(r) => {
                let mut v = vec![0u8; len];
                r.read(offset as u64, &mut v).map_err(|e| e.to_string())?;
                Ok(v)
            }
        }
    }
}

/// A GPU and the unpacker a case gathers CUDA receives with.
pub(super) type GpuUnpacker = (Arc<Gpu>, std::sync::Mutex<Box<dyn Unpacker>>);

/// The memory side of a case: nothing for host memory, the GPU for CUDA memory.
#[derive(Clone)]
pub(super) enum MemCtx {
    Host,
    Cuda(Arc<Gpu>),
}

pub(super) struct Ctx {
    pub(super) plugin: Arc<Plugin>,
    pub(super) dev: i32,
    pub(super) opts: Options,
    pub(super) mem: MemCtx,
}

/// A connected send/recv comm pair on one device, with a registered host region on each side.
pub(super) struct Pair {
    pub(super) send: SendComm,
    pub(super) recv: RecvComm,
    pub(super) src: TestBuf,
    pub(super) dst: TestBuf,
    pub(super) smh: MemHandle,
    pub(super) rmh: MemHandle,
    /// For CUDA memory: the GPU unpacker gathering received fragments.
    pub(super) unpacker: Option<GpuUnpacker>,
}

impl Ctx {
    pub(super) fn pair(&self, region_len: usize) -> Result<Pair, String> {
        let (send, recv) = net::loopback_pair(&self.plugin, self.dev, self.opts.connect_timeout)
            .map_err(|e| e.to_string())?;
        let src = TestBuf::new(&self.mem, region_len)?;
        let dst = TestBuf::new(&self.mem, region_len)?;
        let smh = send.register(src.region()).map_err(|e| e.to_string())?;
        let rmh = recv.register(dst.region()).map_err(|e| e.to_string())?;
        let unpacker = match &self.mem {
            MemCtx::Host => None,
            MemCtx::Cuda(gpu) => {
                // The daemon's unpacker (UCCL_TCPX_UNPACK_IMPL: `d2d` where no kernel can load,
                // as on the CUDA stand-in), as the credit cases take it.
                let u = std::env::var("UCCL_TCPX_UNPACK_IMPL")
                    .ok()
                    .and_then(|v| v.parse::<UnpackImpl>().ok())
                    .unwrap_or_default()
                    .build(gpu)
                    .map_err(|e| e.to_string())?;
                Some((gpu.clone(), std::sync::Mutex::new(u)))
            }
        };
        Ok(Pair {
            send,
            recv,
            src,
            dst,
            smh,
            rmh,
            unpacker,
        })
    }
}

pub(super) fn err(context: &str) -> impl Fn(NetError) -> String + '_ {
    move |e| format!("{context}: {e}")
}

/// Deterministic test bytes: a different stream for every seed (the daemon's seeded fill
/// pattern, `tcpxd::buffers::seeded_bytes`, from position 0).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    tcpxd::buffers::seeded_bytes(seed, 0, &mut out);
    out
}

/// What one completed receive looked like in the ring.
#[derive(Debug, Default, Clone)]
pub(super) struct Landed {
    pub(super) fragments: usize,
    pub(super) bytes: usize,
    pub(super) max_frag: u32,
    /// Fragments not in ascending `src_off` order (evidence of scattered bounce pages).
    pub(super) shuffled: bool,
    pub(super) direct: bool,
}

/// Checks a completed receive's fragment list (cover `[0, expect_len)` exactly, no overlap, each
/// ≤ 4096 bytes), gathers it and compares the destination with `expect`.
pub(super) fn land_and_check(
    p: &Pair,
    c: RecvCompletion,
    offset: usize,
    expect: &[u8],
) -> Result<Landed, String> {
    let frags = p.recv.fragments(c.id).map_err(err("reading the fragment list"))?;
    let mut landed = Landed {
        fragments: frags.len(),
        direct: frags.is_empty() && !expect.is_empty(),
        ..Landed::default()
    };
    if !frags.is_empty() {
        let mut spans: Vec<(u64, u64)> = frags
            .iter()
            .map(|f| (f.dst_off, f.dst_off + u64::from(f.len)))
            .collect();
        landed.bytes = frags.iter().map(|f| f.len as usize).sum();
        landed.max_frag = frags.iter().map(|f| f.len).max().unwrap_or(0);
        landed.shuffled = frags.windows(2).any(|w| w[1].src_off < w[0].src_off);
        if frags
            .iter()
            .any(|f| f.len == 0 || f.len as usize > abi::SLICE_PAGE_SIZE)
        {
            return Err(format!(
                "a fragment is empty or longer than 4096 bytes: {frags:?}"
            ));
        }
        spans.sort_unstable();
        let mut cursor = 0u64;
        for (s, e) in spans {
            if s != cursor {
                return Err(format!(
                    "fragments leave a gap or overlap at offset {cursor} (next starts at {s})"
                ));
            }
            cursor = e;
        }
        if cursor != expect.len() as u64 {
            return Err(format!(
                "fragments cover {cursor} bytes, the sender sent {}",
                expect.len()
            ));
        }
        match (&p.unpacker, &p.dst) {
            (Some((gpu, unpacker)), TestBuf::Cuda(dst)) => {
                gpu.bind_to_thread().map_err(|e| e.to_string())?;
                let (ring, q) = p.recv.completed(c.id).map_err(err("completed receive"))?;
                let frags = ring.fragments(q).map_err(err("fragment list"))?;
                let job = UnpackJob {
                    frags: ring.fragment_list(q).map_err(err("fragment list"))?,
                    bounce: ring.bounce_span(frags),
                    dst: dst
                        .subspan(offset as u64, expect.len() as u64)
                        .map_err(|e| e.to_string())?,
                    exact: true,
                };
                let mut u = unpacker.lock().unwrap_or_else(|e| e.into_inner());
                u.push(&job).map_err(|e| format!("GPU unpack: {e}"))?;
                if let Some(t) = u.submit().map_err(|e| format!("GPU unpack: {e}"))? {
                    u.wait(&t).map_err(|e| format!("GPU unpack: {e}"))?;
                }
            }
            _ => {
                p.recv.unpack_host(c.id).map_err(err("host unpack"))?;
            }
        }
    }
    let got = p.dst.to_vec(offset, expect.len()).map_err(|e| e.to_string())?;
    if let Some(i) = got.iter().zip(expect).position(|(a, b)| a != b) {
        return Err(format!(
            "byte {i} of {} differs: got {:#04x}, sent {:#04x}",
            expect.len(),
            got[i],
            expect[i]
        ));
    }
    Ok(landed)
}

/// Drives one in-order batch: `sizes[k]` bytes from `src` offset `offs[k]` to the same offset of
/// `dst`, with send tags `stags` and receive tags `rtags`. Everything is posted first (≤ 16).
pub(super) fn exchange(
    p: &mut Pair,
    jobs: &[(usize, usize, i32, i32)],
    timeout: Duration,
) -> Result<Vec<Landed>, String> {
    let mut recvs = Vec::new();
    for &(off, len, stag, rtag) in jobs {
        let data = pattern((off as u64) << 20 | len as u64, len);
        p.src.write(off, &data).map_err(|e| e.to_string())?;
        p.dst.write(off, &vec![0xEE; len]).map_err(|e| e.to_string())?;
        let r = p
            .recv
            .irecv(&p.rmh, off, len, rtag)
            .map_err(err("irecv"))?
            .ok_or("irecv deferred")?;
        p.send
            .isend(&p.smh, off, len, stag)
            .map_err(err("isend"))?
            .ok_or("isend deferred")?;
        recvs.push((r, off, data));
    }
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut next_recv = 0;
    while next_recv < recvs.len() {
        if Instant::now() > deadline {
            return Err(format!("transfers not done after {timeout:?}"));
        }
        if let Some(id) = p.send.oldest() {
            p.send.test(id).map_err(err("send test"))?;
        }
        let (rid, off, data) = &recvs[next_recv];
        if let Some(c) = p.recv.test(*rid).map_err(err("recv test"))? {
            out.push(land_and_check(p, c, *off, data)?);
            p.recv.consume(*rid).map_err(err("irecvConsumed"))?;
            next_recv += 1;
        } else {
            std::thread::yield_now();
        }
    }
    while let Some(id) = p.send.oldest() {
        if Instant::now() > deadline {
            return Err("sends not done after their receives completed".into());
        }
        p.send.test(id).map_err(err("send test"))?;
    }
    expect_empty(p)?;
    Ok(out)
}

pub(super) fn expect_empty(p: &Pair) -> Result<(), String> {
    if p.send.outstanding() != 0 || p.recv.outstanding() != 0 {
        return Err(format!(
            "slots not back to zero: {} sends, {} receives outstanding",
            p.send.outstanding(),
            p.recv.outstanding()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_deterministic_and_seed_dependent() {
        assert_eq!(pattern(1, 64), pattern(1, 64));
        assert_ne!(pattern(1, 64), pattern(2, 64));
        assert_eq!(pattern(3, 0).len(), 0);
    }
}
