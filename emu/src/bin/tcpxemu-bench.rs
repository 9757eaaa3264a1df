//! tcpxemu-bench: the emulation plugin alone, host to host over loopback, in one process.
//!
//! For every (mode, sockets, message size) case the bench re-runs itself as a child process
//! (the plugin reads its environment once per process), which sets `NCCL_NSOCKS_PERTHREAD`,
//! `NCCL_SOCKET_NTHREADS`, `NCCL_DYNAMIC_CHUNK_SIZE` and `TCPXEMU_HOST_RECV` before `init`,
//! connects one comm pair through `plugin_table()`, registers host buffers and streams
//! `--bytes` with `--window` (default 16) requests in flight: one thread posts sends, testing
//! the oldest after each post and then until it is done, another posts receives, tests the oldest and calls `irecvConsumed` after each
//! bounce receive. Modes:
//! - `bounce`: fragments land in shuffled host bounce pages; the bench checks each fragment list
//!   covers the message (sum of lengths) but does not copy; the final window is gathered and
//!   compared.
//! - `bounce-gather`: as `bounce`, plus a host gather of every fragment into the destination
//!   (what a CPU consumer would pay).
//! - `direct`: `TCPXEMU_HOST_RECV=direct`, bytes land in the destination.
//!
//! At the end the destination windows are compared byte for byte with the sources (each of the
//! window's source buffers carries a distinct pattern), so a fast-but-wrong plugin fails.
//! Output: a table on stdout, and JSON lines with `--json-out FILE`.

use nccl_net_tcpxemu::abi::{self, loadMeta, ncclNetDeviceHandle_v7_t, netUnpackMeta, unpackNetDeviceHandle};
use std::ffi::{c_int, c_void};
use std::io::Write;
use std::process::{Command, ExitCode};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const USAGE: &str = "\
usage: tcpxemu-bench [options]
  --bytes N          bytes streamed per case (default 1073741824; suffixes k, m, g)
  --msg-size LIST    message sizes, comma list (default 4m; at most 8m: 2048 fragments)
  --sockets LIST     data sockets per comm, comma list (default 4; 1..=64, >8 must be a multiple of 8)
  --modes LIST       bounce,bounce-gather,direct (default all three)
  --window N         requests in flight per side, 1..=16 (default 16)
  --chunk N          NCCL_DYNAMIC_CHUNK_SIZE (default 512k)
  --json-out FILE    append one JSON line per case
  --timeout-s N      give up a case after N seconds (default 300)
  --poll MODE        what a driver thread does after a test that is not done: sleep (default:
                     sleep 10 us, so two driver threads do not starve the plugin's socket threads
                     on small machines), yield (sched_yield), spin (busy, as NCCL's proxy does)
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Bounce,
    BounceGather,
    Direct,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Bounce => "bounce",
            Mode::BounceGather => "bounce-gather",
            Mode::Direct => "direct",
        }
    }
    fn parse(s: &str) -> Result<Mode, String> {
        match s {
            "bounce" => Ok(Mode::Bounce),
            "bounce-gather" => Ok(Mode::BounceGather),
            "direct" => Ok(Mode::Direct),
            _ => Err(format!("unknown mode {s:?} (bounce, bounce-gather, direct)")),
        }
    }
}

#[derive(Debug, Clone)]
struct Opts {
    bytes: u64,
    msg_sizes: Vec<u64>,
    sockets: Vec<u32>,
    modes: Vec<Mode>,
    window: usize,
    chunk: u64,
    json_out: Option<String>,
    timeout: Duration,
    poll: Poll,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Poll {
    Sleep,
    Yield,
    Spin,
}

impl Poll {
    fn name(self) -> &'static str {
        match self {
            Poll::Sleep => "sleep",
            Poll::Yield => "yield",
            Poll::Spin => "spin",
        }
    }
    fn parse(s: &str) -> Result<Poll, String> {
        match s {
            "sleep" => Ok(Poll::Sleep),
            "yield" => Ok(Poll::Yield),
            "spin" => Ok(Poll::Spin),
            _ => Err(format!("unknown poll mode {s:?} (sleep, yield, spin)")),
        }
    }
    /// Back off after a test that was not done.
    fn wait(self) {
        match self {
            Poll::Sleep => std::thread::sleep(Duration::from_micros(10)),
            Poll::Yield => std::thread::yield_now(),
            Poll::Spin => std::hint::spin_loop(),
        }
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_lowercase()) {
        Some('k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("bad size {s:?}"))
}

fn parse_args(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        bytes: 1 << 30,
        msg_sizes: vec![4 << 20],
        sockets: vec![4],
        modes: vec![Mode::Bounce, Mode::BounceGather, Mode::Direct],
        window: 16,
        chunk: 512 << 10,
        json_out: None,
        timeout: Duration::from_secs(300),
        poll: Poll::Sleep,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--bytes" => o.bytes = parse_size(&val()?)?,
            "--msg-size" => o.msg_sizes = val()?.split(',').map(parse_size).collect::<Result<_, _>>()?,
            "--sockets" => {
                o.sockets = val()?
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse::<u32>()
                            .map_err(|_| format!("bad socket count {s:?}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--modes" => {
                o.modes = val()?
                    .split(',')
                    .map(|s| Mode::parse(s.trim()))
                    .collect::<Result<_, _>>()?
            }
            "--window" => o.window = val()?.parse().map_err(|_| "bad --window".to_string())?,
            "--chunk" => o.chunk = parse_size(&val()?)?,
            "--json-out" => o.json_out = Some(val()?),
            "--timeout-s" => {
                o.timeout = Duration::from_secs(val()?.parse().map_err(|_| "bad --timeout-s".to_string())?)
            }
            "--poll" => o.poll = Poll::parse(&val()?)?,
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    if !(1..=16).contains(&o.window) {
        return Err("--window must be 1..=16".into());
    }
    for &m in &o.msg_sizes {
        if m == 0 || m > 8 << 20 {
            return Err(format!(
                "--msg-size {m}: must be 1..=8388608 (2048 fragments of 4 KiB)"
            ));
        }
    }
    for &s in &o.sockets {
        if s == 0 || s > 64 || (s > 8 && s % 8 != 0) {
            return Err(format!("--sockets {s}: 1..=8, or a multiple of 8 up to 64"));
        }
    }
    if o.chunk == 0 || o.chunk > u64::from(u32::MAX) {
        return Err("--chunk must be 1..=4294967295".into());
    }
    Ok(o)
}

/// One case's result.
struct Outcome {
    msgs: u64,
    bytes: u64,
    secs: f64,
    /// CPU seconds (user + system, every thread of the process) spent while streaming.
    cpu: f64,
    /// Context switches (voluntary + involuntary) while streaming.
    switches: u64,
}

/// (CPU seconds, context switches) of this process so far.
fn usage() -> (f64, u64) {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF and a live out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (
        tv(ru.ru_utime) + tv(ru.ru_stime),
        (ru.ru_nvcsw + ru.ru_nivcsw) as u64,
    )
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("tcpxemu-bench: {e}");
            }
            eprint!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("tcpxemu-bench: cannot find my own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut json = match &o.json_out {
        Some(f) => match std::fs::OpenOptions::new().create(true).append(true).open(f) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("tcpxemu-bench: --json-out {f}: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    println!(
        "{:<14} {:>7} {:>10} {:>9} {:>10} {:>8} {:>9} {:>9}",
        "mode", "sockets", "msg_bytes", "GB/s", "us/msg", "msgs", "cpu_s/GB", "csw/msg"
    );
    let mut failed = false;
    for &mode in &o.modes {
        for &socks in &o.sockets {
            for &msg in &o.msg_sizes {
                let (nsocks, nthreads) = if socks <= 8 { (socks, 1) } else { (8, socks / 8) };
                let out = Command::new(&exe)
                    .arg("--child")
                    .arg(mode.name())
                    .arg(msg.to_string())
                    .arg(o.bytes.to_string())
                    .arg(o.window.to_string())
                    .arg(o.timeout.as_secs().to_string())
                    .arg(o.poll.name())
                    .env("NCCL_NSOCKS_PERTHREAD", nsocks.to_string())
                    .env("NCCL_SOCKET_NTHREADS", nthreads.to_string())
                    .env("NCCL_DYNAMIC_CHUNK_SIZE", o.chunk.to_string())
                    .env("TCPXEMU_BOUNCE", "host")
                    .env(
                        "TCPXEMU_HOST_RECV",
                        if mode == Mode::Direct { "direct" } else { "bounce" },
                    )
                    .output();
                let out = match out {
                    Ok(out) => out,
                    Err(e) => {
                        eprintln!("tcpxemu-bench: cannot run a case: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let stdout = String::from_utf8_lossy(&out.stdout);
                let line = stdout.lines().find_map(|l| l.strip_prefix("RESULT "));
                let parsed = line.and_then(|l| {
                    let v: Vec<&str> = l.split_whitespace().collect();
                    Some(Outcome {
                        msgs: v.first()?.parse().ok()?,
                        bytes: v.get(1)?.parse().ok()?,
                        secs: v.get(2)?.parse().ok()?,
                        cpu: v.get(3)?.parse().ok()?,
                        switches: v.get(4)?.parse().ok()?,
                    })
                });
                let Some(r) = parsed.filter(|_| out.status.success()) else {
                    failed = true;
                    eprintln!(
                        "tcpxemu-bench: case {} sockets {socks} msg {msg} FAILED ({}):\n{}{}",
                        mode.name(),
                        out.status,
                        stdout,
                        String::from_utf8_lossy(&out.stderr)
                    );
                    continue;
                };
                let gbps = r.bytes as f64 / r.secs / 1e9;
                let us = r.secs * 1e6 / r.msgs as f64;
                let cpu_gb = r.cpu / (r.bytes as f64 / 1e9);
                let csw = r.switches as f64 / r.msgs as f64;
                println!(
                    "{:<14} {:>7} {:>10} {:>9.3} {:>10.1} {:>8} {:>9.3} {:>9.1}",
                    mode.name(),
                    socks,
                    msg,
                    gbps,
                    us,
                    r.msgs,
                    cpu_gb,
                    csw
                );
                if let Some(f) = json.as_mut() {
                    let line = format!(
                        "{{\"bench\":\"tcpxemu\",\"mode\":\"{}\",\"sockets\":{socks},\"msg_bytes\":{msg},\
                         \"window\":{},\"chunk\":{},\"msgs\":{},\"bytes\":{},\"secs\":{:.6},\"gbps\":{:.4},\
                         \"us_per_msg\":{:.2},\"cpu_s_per_gb\":{:.4},\"csw_per_msg\":{:.2},\"poll\":\"{}\",\"verified\":true}}",
                        mode.name(),
                        o.window,
                        o.chunk,
                        r.msgs,
                        r.bytes,
                        r.secs,
                        gbps,
                        us,
                        cpu_gb,
                        csw,
                        o.poll.name()
                    );
                    if let Err(e) = writeln!(f, "{line}") {
                        eprintln!("tcpxemu-bench: --json-out: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn t() -> &'static abi::ncclNet_v7_t {
    nccl_net_tcpxemu::plugin_table()
}

fn check(what: &str, rc: abi::ncclResult_t) -> Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("{what} returned {rc}"))
    }
}

/// A plugin pointer moved to the other driver thread.
#[derive(Clone, Copy)]
struct P(*mut c_void);
// SAFETY: comms, memory handles and requests are plain pointers the plugin makes thread-safe
// (each comm serialises its own calls); only one thread drives each comm.
unsafe impl Send for P {}

fn child(args: &[String]) -> ExitCode {
    match run_case(args) {
        Ok(r) => {
            println!(
                "RESULT {} {} {:.9} {:.6} {}",
                r.msgs, r.bytes, r.secs, r.cpu, r.switches
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("ERROR {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_case(args: &[String]) -> Result<Outcome, String> {
    let bad = || "bad child arguments".to_string();
    let mode = Mode::parse(args.first().ok_or_else(bad)?)?;
    let msg: usize = args.get(1).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let total: u64 = args.get(2).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let window: usize = args.get(3).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let timeout = Duration::from_secs(args.get(4).and_then(|s| s.parse().ok()).ok_or_else(bad)?);
    let poll = Poll::parse(args.get(5).ok_or_else(bad)?)?;
    let msgs = total.div_ceil(msg as u64).max(window as u64);

    // SAFETY: the plugin table's init accepts a NULL logger; the environment was set by the
    // parent before this process started.
    check("init", unsafe { (t().init.unwrap())(None) })?;

    // Listen / connect / accept, driven from this thread as NCCL's proxy does.
    let mut handle = [0u8; 128];
    let mut lc: *mut c_void = ptr::null_mut();
    // SAFETY: a 128-byte handle buffer and an out-pointer.
    check("listen", unsafe {
        (t().listen.unwrap())(0, handle.as_mut_ptr().cast(), &mut lc)
    })?;
    let mut dev_handle = Box::new(ncclNetDeviceHandle_v7_t {
        netDeviceType: -1,
        netDeviceVersion: -1,
        handle: ptr::null_mut(),
        size: 0,
        needsProxyProgress: -1,
    });
    let (mut sc, mut rc): (*mut c_void, *mut c_void) = (ptr::null_mut(), ptr::null_mut());
    let start = Instant::now();
    while sc.is_null() || rc.is_null() {
        if start.elapsed() > Duration::from_secs(30) {
            return Err("connect/accept did not finish in 30 s".into());
        }
        if sc.is_null() {
            // SAFETY: the same handle buffer on every call.
            check("connect", unsafe {
                (t().connect.unwrap())(0, handle.as_mut_ptr().cast(), &mut sc, ptr::null_mut())
            })?;
        }
        if rc.is_null() {
            let mut storage: *mut ncclNetDeviceHandle_v7_t = &mut *dev_handle;
            // SAFETY: a live listen comm and caller-owned device-handle storage.
            check("accept", unsafe {
                (t().accept.unwrap())(lc, &mut rc, &mut storage)
            })?;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: the listen comm, closed once.
    check("closeListen", unsafe { (t().closeListen.unwrap())(lc) })?;

    // One buffer of `window` messages per side; message i uses window slot i % window.
    let span = msg * window;
    let mut src = vec![0u8; span];
    for (w, c) in src.chunks_mut(msg).enumerate() {
        tcpxd_pattern::seeded_bytes(w as u64 + 1, 0, c);
    }
    let mut dst = vec![0u8; span];
    let reg = |comm: *mut c_void, buf: &mut [u8]| -> Result<*mut c_void, String> {
        let mut mh = ptr::null_mut();
        // SAFETY: a live comm and a host buffer that outlives the registration.
        check("regMr", unsafe {
            (t().regMr.unwrap())(
                comm,
                buf.as_mut_ptr().cast(),
                buf.len() as c_int,
                abi::NCCL_PTR_HOST,
                &mut mh,
            )
        })?;
        Ok(mh)
    };
    let smh = reg(sc, &mut src)?;
    let rmh = reg(rc, &mut dst)?;
    let uh: Option<unpackNetDeviceHandle> = if mode == Mode::Direct {
        None
    } else {
        // SAFETY: host mode: accept filled the storage with a host pointer to the 24-byte handle,
        // alive until closeRecv.
        Some(unsafe { ptr::read(dev_handle.handle as *const unpackNetDeviceHandle) })
    };

    let (src_p, smh_p, sc_p) = (P(src.as_mut_ptr().cast()), P(smh), P(sc));
    let (cpu0, csw0) = usage();
    let began = Instant::now();
    let sender = std::thread::spawn(move || -> Result<(), String> {
        let (src_p, smh_p, sc_p) = (src_p, smh_p, sc_p);
        let mut reqs = std::collections::VecDeque::with_capacity(16);
        let mut posted = 0u64;
        let mut done = 0u64;
        let start = Instant::now();
        while done < msgs {
            while posted < msgs && reqs.len() < window {
                let w = (posted % window as u64) as usize;
                let mut req = ptr::null_mut();
                // SAFETY: slot w of the registered source buffer.
                let p = unsafe { src_p.0.cast::<u8>().add(w * msg) };
                check("isend", unsafe {
                    (t().isend.unwrap())(sc_p.0, p.cast(), msg as c_int, 0, smh_p.0, &mut req)
                })?;
                reqs.push_back(req);
                posted += 1;
                // A posted send moves only in a test (one more request per call, as in Google's
                // plugin): test the oldest after each post, as tcpxd and NCCL's proxy do.
                let (mut d, mut sizes) = (0, -1);
                // SAFETY: the oldest in-flight request of this comm.
                check("test(send)", unsafe {
                    (t().test.unwrap())(reqs[0], &mut d, &mut sizes)
                })?;
                if d == 1 {
                    reqs.pop_front();
                    done += 1;
                }
            }
            if reqs.is_empty() {
                continue;
            }
            let (mut d, mut sizes) = (0, -1);
            // SAFETY: the oldest in-flight request of this comm.
            check("test(send)", unsafe {
                (t().test.unwrap())(reqs[0], &mut d, &mut sizes)
            })?;
            if d == 1 {
                reqs.pop_front();
                done += 1;
            } else {
                if start.elapsed() > timeout {
                    return Err(format!("send side timed out after {done} messages"));
                }
                poll.wait();
            }
        }
        Ok(())
    });

    let recv_result = (|| -> Result<(), String> {
        let mut reqs = std::collections::VecDeque::with_capacity(16);
        let mut posted = 0u64;
        let mut done = 0u64;
        while done < msgs {
            while posted < msgs && reqs.len() < window {
                let w = (posted % window as u64) as usize;
                let mut req = ptr::null_mut();
                // SAFETY: slot w of the registered destination buffer; one-entry arrays.
                let mut data: *mut c_void = unsafe { dst.as_mut_ptr().add(w * msg) }.cast();
                let mut size = msg as c_int;
                let mut tag = 0;
                let mut mh = rmh;
                check("irecv", unsafe {
                    (t().irecv.unwrap())(rc, 1, &mut data, &mut size, &mut tag, &mut mh, &mut req)
                })?;
                reqs.push_back((req, (posted % 16) as usize, w));
                posted += 1;
            }
            let (req, q, w) = reqs[0];
            let (mut d, mut sizes) = (0, -1);
            // SAFETY: the oldest in-flight request of this comm.
            check("test(recv)", unsafe {
                (t().test.unwrap())(req, &mut d, &mut sizes)
            })?;
            if d != 1 {
                if began.elapsed() > timeout {
                    return Err(format!("receive side timed out after {done} messages"));
                }
                poll.wait();
                continue;
            }
            if let Some(h) = &uh {
                let gather = mode == Mode::BounceGather || done + window as u64 >= msgs;
                consume_fragments(h, q, &mut dst[w * msg..(w + 1) * msg], gather)?;
                // SAFETY: the oldest completed receive of this comm.
                check("irecvConsumed", unsafe {
                    (t().irecvConsumed.unwrap())(rc, 1, req)
                })?;
            } else {
                // Direct receives take a ring slot too; irecvConsumed is still required.
                // SAFETY: as above.
                check("irecvConsumed", unsafe {
                    (t().irecvConsumed.unwrap())(rc, 1, req)
                })?;
            }
            reqs.pop_front();
            done += 1;
        }
        Ok(())
    })();
    let send_result = sender
        .join()
        .map_err(|_| "the send thread panicked".to_string())?;
    let secs = began.elapsed().as_secs_f64();
    let (cpu1, csw1) = usage();
    recv_result?;
    send_result?;

    if src != dst {
        let at = src.iter().zip(&dst).position(|(a, b)| a != b).unwrap_or(0);
        return Err(format!(
            "payload mismatch: first differing byte at {at} of the {span}-byte window"
        ));
    }
    // SAFETY: registrations and comms made above, each released once.
    unsafe {
        check("deregMr", (t().deregMr.unwrap())(sc, smh))?;
        check("deregMr", (t().deregMr.unwrap())(rc, rmh))?;
        check("closeSend", (t().closeSend.unwrap())(sc))?;
        check("closeRecv", (t().closeRecv.unwrap())(rc))?;
    }
    Ok(Outcome {
        msgs,
        bytes: msgs * msg as u64,
        secs,
        cpu: cpu1 - cpu0,
        switches: csw1 - csw0,
    })
}

/// Check slot `q`'s fragment list covers `dst.len()` bytes; with `gather`, copy every fragment
/// from the bounce pages into `dst`.
fn consume_fragments(
    h: &unpackNetDeviceHandle,
    q: usize,
    dst: &mut [u8],
    gather: bool,
) -> Result<(), String> {
    let meta: *mut netUnpackMeta = h.meta;
    // SAFETY: cnt[q] inside the live ring, read with acquire as a consumer must.
    let n =
        unsafe { AtomicU64::from_ptr(ptr::addr_of_mut!((*meta).cnt[q])) }.load(Ordering::Acquire) as usize;
    if n > abi::NET_UNPACK_MAX_SLICE_PAGES {
        return Err(format!("cnt[{q}] = {n} > 2048"));
    }
    let mut covered = 0u64;
    for i in 0..n {
        // SAFETY: entries 0..cnt[q] were published before cnt[q] (release/acquire).
        let f: loadMeta = unsafe { ptr::read(ptr::addr_of!((*meta).mem[q][i])) };
        covered += u64::from(f.len);
        if gather {
            let (d, l) = (f.dst_off as usize, f.len as usize);
            if d + l > dst.len() || l > 4096 {
                return Err(format!("fragment {i} of slot {q} out of range: {f:?}"));
            }
            // SAFETY: src_off + len lies in the plugin's host bounce buffer (alive until
            // closeRecv); the destination range was checked above.
            unsafe {
                ptr::copy_nonoverlapping(
                    h.bounce_buf.cast::<u8>().add(f.src_off as usize),
                    dst.as_mut_ptr().add(d),
                    l,
                )
            };
        }
    }
    if covered != dst.len() as u64 {
        return Err(format!(
            "slot {q}: fragments cover {covered} bytes of a {}-byte message",
            dst.len()
        ));
    }
    Ok(())
}
