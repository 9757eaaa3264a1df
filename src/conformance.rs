//! The plugin conformance suite: checks that a `ncclNetPlugin_v7` behaves as the GPUDirect-TCPX
//! plugin does (reference/TCPX_PLUGIN_ABI.md), through tcpxd's own plugin layer.
//!
//! It runs against any plugin: the emulation in CI, the real `libnccl-net.so` on an A3 node (as
//! `tcpxctl conformance --plugin PATH`). Each case runs on its own comms, on every device, under a
//! watchdog, so a hanging plugin shows up as a failed case rather than a hung suite.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::gpu::{DeviceRegion, Gpu};
use crate::net::{
    self, HostRegion, MemHandle, NetError, Plugin, RecvComm, RecvCompletion, Region, RequestId, SendComm, abi,
};
use crate::unpack::{UnpackImpl, UnpackJob, Unpacker};

mod nccl;

/// Where the suite's test buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestMemory {
    /// Host memory (`NCCL_PTR_HOST` registrations).
    Host,
    /// GPU memory on this CUDA device (`NCCL_PTR_CUDA`): received bytes are gathered from the
    /// plugin's GPU bounce buffer by the unpack kernel.
    Cuda(usize),
}

/// A test buffer in host or GPU memory.
#[derive(Clone)]
enum TestBuf {
    Host(Arc<HostRegion>),
    Cuda(Arc<DeviceRegion>),
}

impl TestBuf {
    fn new(mem: &MemCtx, len: usize) -> Result<TestBuf, String> {
        match mem {
            MemCtx::Host => Ok(TestBuf::Host(Arc::new(
                HostRegion::new(len).map_err(|e| e.to_string())?,
            ))),
            MemCtx::Cuda(gpu) => Ok(TestBuf::Cuda(Arc::new(
                gpu.alloc(len).map_err(|e| e.to_string())?,
            ))),
        }
    }

    fn region(&self) -> Arc<dyn Region> {
        match self {
            TestBuf::Host(r) => r.clone(),
            TestBuf::Cuda(r) => r.clone(),
        }
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
        match self {
            TestBuf::Host(r) => r.write(offset, data).map_err(|e| e.to_string()),
            TestBuf::Cuda(r) => r.write(offset as u64, data).map_err(|e| e.to_string()),
        }
    }

    fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, String> {
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
type GpuUnpacker = (Arc<Gpu>, std::sync::Mutex<Box<dyn Unpacker>>);

/// The memory side of a case: nothing for host memory, the GPU for CUDA memory.
#[derive(Clone)]
enum MemCtx {
    Host,
    Cuda(Arc<Gpu>),
}

/// What to run and how long to wait.
#[derive(Debug, Clone)]
pub struct Options {
    /// Devices to run the per-device cases on; all of the plugin's when `None`.
    pub devices: Option<Vec<i32>>,
    /// Time allowed for one connect/accept (the real plugin sleeps up to 5 s after accept).
    pub connect_timeout: Duration,
    /// Time after which a case counts as hung.
    pub case_timeout: Duration,
    /// Requests streamed through one comm pair in the wrap-around case.
    pub wraparound_requests: usize,
    /// Only cases whose name contains this string.
    pub filter: Option<String>,
    /// Where the test buffers live.
    pub memory: TestMemory,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            devices: None,
            connect_timeout: Duration::from_secs(30),
            case_timeout: Duration::from_secs(120),
            wraparound_requests: 3000,
            filter: None,
            memory: TestMemory::Host,
        }
    }
}

/// One case's outcome on one device.
#[derive(Debug, Clone)]
pub struct CaseResult {
    pub name: &'static str,
    pub dev: Option<i32>,
    pub passed: bool,
    /// What was observed (on success) or what went wrong (on failure).
    pub detail: String,
    pub elapsed: Duration,
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct Report {
    pub plugin: String,
    pub source: String,
    pub cases: Vec<CaseResult>,
}

impl Report {
    pub fn passed(&self) -> bool {
        !self.cases.is_empty() && self.cases.iter().all(|c| c.passed)
    }

    pub fn failures(&self) -> impl Iterator<Item = &CaseResult> {
        self.cases.iter().filter(|c| !c.passed)
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "conformance of {} ({})", self.plugin, self.source)?;
        writeln!(f, "{:<22} {:>4} {:<5} {:>9}  detail", "case", "dev", "", "time")?;
        for c in &self.cases {
            let dev = c.dev.map(|d| d.to_string()).unwrap_or_else(|| "-".into());
            writeln!(
                f,
                "{:<22} {:>4} {:<5} {:>7.1}ms  {}",
                c.name,
                dev,
                if c.passed { "ok" } else { "FAIL" },
                c.elapsed.as_secs_f64() * 1e3,
                c.detail
            )?;
        }
        let failed = self.failures().count();
        write!(
            f,
            "{} cases: {} passed, {} failed",
            self.cases.len(),
            self.cases.len() - failed,
            failed
        )
    }
}

type CaseFn = fn(&Ctx) -> Result<String, String>;

/// Cases run on every device, in this order.
const DEVICE_CASES: &[(&str, CaseFn)] = &[
    ("connect_accept", case_connect_accept),
    ("host_registration", case_host_registration),
    ("sizes", case_sizes),
    ("fifo_tags_ignored", case_fifo_tags_ignored),
    ("request_limit", case_request_limit),
    ("test_order", case_test_order),
    ("consume_order", case_consume_order),
    ("ring_wraparound", case_ring_wraparound),
    ("nccl_ring", nccl::case_ring_traffic),
    ("close_outstanding", case_close_outstanding),
    ("peer_close", case_peer_close),
    ("dead_listener", case_dead_listener),
];

/// Runs the suite.
pub fn run(plugin: &Arc<Plugin>, opts: &Options) -> Report {
    let mut cases = Vec::new();
    let wanted = |name: &str| opts.filter.as_deref().is_none_or(|f| name.contains(f));
    if wanted("properties") {
        let start = Instant::now();
        let (passed, detail) = match check_properties(plugin) {
            Ok(d) => (true, d),
            Err(e) => (false, e),
        };
        cases.push(CaseResult {
            name: "properties",
            dev: None,
            passed,
            detail,
            elapsed: start.elapsed(),
        });
    }
    if wanted("nccl_pat") {
        let start = Instant::now();
        let (passed, detail) = match nccl::check_pat(plugin) {
            Ok(d) => (true, d),
            Err(e) => (false, e),
        };
        cases.push(CaseResult {
            name: "nccl_pat",
            dev: None,
            passed,
            detail,
            elapsed: start.elapsed(),
        });
    }
    let devices = opts
        .devices
        .clone()
        .unwrap_or_else(|| plugin.devices().iter().map(|d| d.dev).collect());
    let mem = match opts.memory {
        TestMemory::Host => MemCtx::Host,
        TestMemory::Cuda(device) => match Gpu::open(device) {
            Ok(gpu) => MemCtx::Cuda(gpu),
            Err(e) => {
                cases.push(CaseResult {
                    name: "cuda_memory",
                    dev: None,
                    passed: false,
                    detail: format!("GPU {device}: {e}"),
                    elapsed: Duration::ZERO,
                });
                return Report {
                    plugin: plugin.name().to_string(),
                    source: plugin.source().to_string(),
                    cases,
                };
            }
        },
    };
    for dev in devices {
        for &(name, case) in DEVICE_CASES {
            if !wanted(name) {
                continue;
            }
            let ctx = Ctx {
                plugin: plugin.clone(),
                dev,
                opts: opts.clone(),
                mem: mem.clone(),
            };
            let start = Instant::now();
            let (passed, detail) = run_with_watchdog(ctx, case, opts.case_timeout);
            tracing::info!(case = name, dev, passed, "{detail}");
            cases.push(CaseResult {
                name,
                dev: Some(dev),
                passed,
                detail,
                elapsed: start.elapsed(),
            });
        }
    }
    Report {
        plugin: plugin.name().to_string(),
        source: plugin.source().to_string(),
        cases,
    }
}

fn run_with_watchdog(ctx: Ctx, case: CaseFn, timeout: Duration) -> (bool, String) {
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("conformance-case".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&ctx)));
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return (false, format!("could not start the case thread: {e}"));
    }
    match rx.recv_timeout(timeout) {
        Ok(Ok(Ok(detail))) => (true, detail),
        Ok(Ok(Err(why))) => (false, why),
        Ok(Err(_)) => (false, "the case panicked".into()),
        Err(_) => (
            false,
            format!("hung: no result after {timeout:?} (thread left behind)"),
        ),
    }
}

struct Ctx {
    plugin: Arc<Plugin>,
    dev: i32,
    opts: Options,
    mem: MemCtx,
}

/// A connected send/recv comm pair on one device, with a registered host region on each side.
struct Pair {
    send: SendComm,
    recv: RecvComm,
    src: TestBuf,
    dst: TestBuf,
    smh: MemHandle,
    rmh: MemHandle,
    /// For CUDA memory: the GPU unpacker gathering received fragments.
    unpacker: Option<GpuUnpacker>,
}

impl Ctx {
    fn pair(&self, region_len: usize) -> Result<Pair, String> {
        let (send, recv) = net::loopback_pair(&self.plugin, self.dev, self.opts.connect_timeout)
            .map_err(|e| e.to_string())?;
        let src = TestBuf::new(&self.mem, region_len)?;
        let dst = TestBuf::new(&self.mem, region_len)?;
        let smh = send.register(src.region()).map_err(|e| e.to_string())?;
        let rmh = recv.register(dst.region()).map_err(|e| e.to_string())?;
        let unpacker = match &self.mem {
            MemCtx::Host => None,
            MemCtx::Cuda(gpu) => {
                let u = UnpackImpl::default().build(gpu).map_err(|e| e.to_string())?;
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

fn err(context: &str) -> impl Fn(NetError) -> String + '_ {
    move |e| format!("{context}: {e}")
}

/// Deterministic test bytes: a different stream for every seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// What one completed receive looked like in the ring.
#[derive(Debug, Default, Clone)]
struct Landed {
    fragments: usize,
    bytes: usize,
    max_frag: u32,
    /// Fragments not in ascending `src_off` order (evidence of scattered bounce pages).
    shuffled: bool,
    direct: bool,
}

/// Checks a completed receive's fragment list (cover `[0, expect_len)` exactly, no overlap, each
/// ≤ 4096 bytes), gathers it and compares the destination with `expect`.
fn land_and_check(p: &Pair, c: RecvCompletion, offset: usize, expect: &[u8]) -> Result<Landed, String> {
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
fn exchange(
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

fn expect_empty(p: &Pair) -> Result<(), String> {
    if p.send.outstanding() != 0 || p.recv.outstanding() != 0 {
        return Err(format!(
            "slots not back to zero: {} sends, {} receives outstanding",
            p.send.outstanding(),
            p.recv.outstanding()
        ));
    }
    Ok(())
}

fn check_properties(plugin: &Plugin) -> Result<String, String> {
    let devs = plugin.devices();
    if devs.is_empty() {
        return Err("the plugin reports no devices".into());
    }
    let mut problems = Vec::new();
    for d in devs {
        if d.name.is_empty() {
            problems.push(format!("dev {}: empty name", d.dev));
        }
        if d.max_recvs != 1 {
            problems.push(format!(
                "dev {}: maxRecvs {} (TCPX reports 1)",
                d.dev, d.max_recvs
            ));
        }
        if !d.uses_unpack() {
            problems.push(format!(
                "dev {}: netDeviceType {} (TCPX reports UNPACK = 1)",
                d.dev, d.net_device_type
            ));
        }
        if !(d.supports_host() && d.supports_cuda()) {
            problems.push(format!(
                "dev {}: ptrSupport {:#x} (TCPX reports HOST|CUDA)",
                d.dev, d.ptr_support
            ));
        }
        if d.speed_mbps <= 0 || d.max_comms <= 0 {
            problems.push(format!(
                "dev {}: speed {} / maxComms {}",
                d.dev, d.speed_mbps, d.max_comms
            ));
        }
    }
    let chunk = std::env::var("NCCL_DYNAMIC_CHUNK_SIZE").unwrap_or_default();
    if chunk.parse::<u64>().unwrap_or(0) == 0 {
        problems.push("NCCL_DYNAMIC_CHUNK_SIZE is not set to a positive value".into());
    }
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    let list: Vec<String> = devs
        .iter()
        .map(|d| {
            format!(
                "{}={} {}Mbps ptr={:#x}",
                d.dev, d.name, d.speed_mbps, d.ptr_support
            )
        })
        .collect();
    Ok(format!(
        "{} device(s) [{}], unpack v{:#x}, maxRecvs 1, NCCL_DYNAMIC_CHUNK_SIZE={chunk}",
        devs.len(),
        list.join(", "),
        devs[0].net_device_version
    ))
}

fn case_connect_accept(ctx: &Ctx) -> Result<String, String> {
    let start = Instant::now();
    let mut listen = ctx.plugin.listen(ctx.dev).map_err(err("listen"))?;
    let handle = listen.handle();
    let used = handle.0.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let mut connector = ctx.plugin.connector(ctx.dev, &handle).map_err(err("connector"))?;
    let first_connect = connector.step().map_err(err("first connect call"))?;
    let first_accept = listen.accept_step().map_err(err("first accept call"))?;
    if first_connect.is_some() || first_accept.is_some() {
        return Err(format!(
            "connect/accept are not non-blocking: first calls returned a comm (connect: {}, accept: {})",
            first_connect.is_some(),
            first_accept.is_some()
        ));
    }
    let deadline = Instant::now() + ctx.opts.connect_timeout;
    let (mut send, mut recv) = (None, None);
    let mut calls = 1;
    while send.is_none() || recv.is_none() {
        if Instant::now() > deadline {
            return Err(format!("not connected after {:?}", ctx.opts.connect_timeout));
        }
        if send.is_none() {
            send = connector.step().map_err(err("connect"))?;
        }
        if recv.is_none() {
            recv = listen.accept_step().map_err(err("accept"))?;
        }
        calls += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    let recv: RecvComm = recv.expect("set");
    let dh = recv
        .device_handle()
        .ok_or("accept left the device handle empty")?;
    if (
        dh.netDeviceType,
        dh.netDeviceVersion,
        dh.size,
        dh.needsProxyProgress,
    ) != (
        abi::NCCL_NET_DEVICE_UNPACK,
        abi::NCCL_NET_DEVICE_UNPACK_VERSION,
        24,
        1,
    ) || dh.handle.is_null()
    {
        return Err(format!(
            "device handle is {dh:?}, expected {{1, 7, <ptr>, 24, 1}}"
        ));
    }
    let ring = match recv.unpack_ring() {
        Ok(r) if r.bounce_is_host_readable() => "unpack ring and bounce buffer in host memory",
        Ok(_) => "unpack ring host-mapped, bounce buffer in GPU memory",
        Err(_) => "unpack handle in device memory",
    };
    Ok(format!(
        "non-blocking on both sides, ready after {calls} rounds in {:.1} ms; handle uses {used} of 128 bytes; device handle {{1, 7, ptr, 24, 1}}; {ring}",
        start.elapsed().as_secs_f64() * 1e3
    ))
}

fn case_host_registration(ctx: &Ctx) -> Result<String, String> {
    let p = ctx.pair(1 << 20)?;
    // A second registration of the same memory on each side, dropped (deregistered) at once.
    let again = p
        .send
        .register(p.src.region())
        .map_err(err("second regMr on the send comm"))?;
    drop(again);
    let again = p
        .recv
        .register(p.dst.region())
        .map_err(err("second regMr on the recv comm"))?;
    drop(again);
    let small: Arc<dyn Region> = TestBuf::new(&ctx.mem, 1)?.region();
    let small_mh = p.send.register(small).map_err(err("regMr of a 1-byte region"))?;
    drop(small_mh);
    let mut p = p;
    exchange(&mut p, &[(0, 4096, 1, 1)], ctx.opts.case_timeout).map(|_| {
        "regMr/deregMr of host memory on send and recv comms; data moves through the registrations".into()
    })
}

fn case_sizes(ctx: &Ctx) -> Result<String, String> {
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

fn case_fifo_tags_ignored(ctx: &Ctx) -> Result<String, String> {
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

fn case_request_limit(ctx: &Ctx) -> Result<String, String> {
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

fn case_test_order(ctx: &Ctx) -> Result<String, String> {
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

fn case_consume_order(ctx: &Ctx) -> Result<String, String> {
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

fn case_ring_wraparound(ctx: &Ctx) -> Result<String, String> {
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

fn case_close_outstanding(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(16 * 65536)?;
    for k in 0..8 {
        p.send
            .isend(&p.smh, k * 65536, 65536, 0)
            .map_err(err("isend"))?
            .ok_or("deferred")?;
    }
    for k in 0..4 {
        p.recv
            .irecv(&p.rmh, k * 65536, 65536, 0)
            .map_err(err("irecv"))?
            .ok_or("deferred")?;
    }
    // Let some data move, then close both sides with requests outstanding.
    for _ in 0..50 {
        if let Some(id) = p.send.oldest() {
            let _ = p.send.test(id);
        }
        if let Some(id) = p.recv.oldest_pending() {
            let _ = p.recv.test(id);
        }
    }
    let (so, ro) = (p.send.outstanding(), p.recv.outstanding());
    let start = Instant::now();
    let Pair {
        send, recv, smh, rmh, ..
    } = p;
    drop(smh);
    drop(send);
    drop(rmh);
    drop(recv);
    Ok(format!(
        "closed with {so} sends and {ro} receives outstanding in {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    ))
}

fn case_peer_close(ctx: &Ctx) -> Result<String, String> {
    let mut p = ctx.pair(65536)?;
    let rid = p
        .recv
        .irecv(&p.rmh, 0, 65536, 0)
        .map_err(err("irecv"))?
        .ok_or("deferred")?;
    let Pair {
        send, smh, mut recv, ..
    } = p;
    drop(smh);
    drop(send);
    let start = Instant::now();
    let deadline = start + ctx.opts.connect_timeout;
    loop {
        match recv.test(rid) {
            Err(e) => {
                return Ok(format!(
                    "pending receive failed {:.1} ms after the sender closed: {e}",
                    start.elapsed().as_secs_f64() * 1e3
                ));
            }
            Ok(Some(_)) => return Err("a receive completed although the sender sent nothing".into()),
            Ok(None) if Instant::now() > deadline => {
                return Err(format!(
                    "a pending receive still waits {:?} after its sender closed",
                    ctx.opts.connect_timeout
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

fn case_dead_listener(ctx: &Ctx) -> Result<String, String> {
    let listen = ctx.plugin.listen(ctx.dev).map_err(err("listen"))?;
    let handle = listen.handle();
    drop(listen);
    let timeout = ctx.opts.connect_timeout.min(Duration::from_secs(15));
    let start = Instant::now();
    let r = ctx.plugin.connect(ctx.dev, &handle, timeout);
    let took = start.elapsed();
    match r {
        Ok(_) => Err("connect to a closed listener succeeded".into()),
        Err(NetError::Timeout { .. }) => Ok(format!(
            "the plugin kept retrying; tcpxd's connect timeout ended it after {:.1} s",
            took.as_secs_f64()
        )),
        Err(e) => Ok(format!("failed in {:.1} ms: {e}", took.as_secs_f64() * 1e3)),
    }
}

/// Renders the report as JSON lines (one object per case) for machines.
pub fn report_json_lines(report: &Report) -> String {
    report
        .cases
        .iter()
        .map(|c| {
            serde_json::json!({
                "plugin": report.plugin,
                "source": report.source,
                "case": c.name,
                "dev": c.dev,
                "passed": c.passed,
                "elapsed_ms": c.elapsed.as_secs_f64() * 1e3,
                "detail": c.detail,
            })
            .to_string()
                + "\n"
        })
        .collect()
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
