//! The devmem shim (tools/realplugin/devmem-shim) against this fake RxDM in `a3vm` mode, without
//! Google's plugin: each test builds the shim with `cc`, re-runs itself with it preloaded
//! (`LD_PRELOAD`) and makes the calls the plugin's CUDA path makes (docs/CONFORMANCE.md, "The
//! kernel interfaces of the plugin's CUDA path"), checking what comes back byte for byte.
//!
//! Loopback stands for the NICs: the fake's table names eth1 = 127.0.0.11 and eth3 = 127.0.0.13,
//! so a flow to 127.0.0.11 "arrives on eth1".

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tcpxd_fake_rxdm::{
    Answer, Binding, FakeRxdm, FlowSteerNtupleProto, FlowSteerRuleRequest, INSTALL_SOCKET, OK_FRAME, Payload,
    SocketAddress, TCP_V4_FLOW, UnixSocketProto, frame, read_frame,
};
use tcpxd_testkit::ScratchDir;

const MSG_SOCK_DEVMEM: i32 = 0x200_0000;
const SO_DEVMEM_DONTNEED: i32 = 97;
const SCM_DEVMEM_OFFSET: i32 = 99;
/// `_IOW('b', 2, struct dma_buf_create_pages_info)` (32 bytes).
const DMA_BUF_CREATE_PAGES: u64 = (1 << 30) | (32 << 16) | ((b'b' as u64) << 8) | 2;
const ROLE: &str = "TCPXD_DEVMEM_SHIM_TEST_ROLE";
const PAGE: usize = 4096;

/// Builds the shim into `dir` with the C compiler (as devmem-shim/build.sh does, less -Werror:
/// another compiler's new warning is not this test's failure).
fn build_shim(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../devmem-shim/devmem_shim.c");
    let out = dir.join("libtcpxd-devmem-shim.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-std=gnu11", "-shared", "-fPIC", "-o"])
        .arg(&out)
        .arg(&src)
        .args(["-ldl", "-lpthread"])
        .status()
        .unwrap_or_else(|e| panic!("running {cc} to build the devmem shim: {e}"));
    assert!(st.success(), "building {} failed", src.display());
    out
}

/// Runs this test again in a child with the shim preloaded and `role` set; panics with its
/// output unless it passed.
fn run_child(test: &str, role: &str, dir: &Path, envs: &[(&str, String)]) {
    let shim = build_shim(dir);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("LD_PRELOAD", &shim)
        .env("TCPXD_DEVMEM_DIR", dir)
        .env(ROLE, role)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the child ({role}) failed:\n{text}");
    assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
}

fn a3vm_on_loopback(dir: &Path) -> FakeRxdm {
    let nics = vec![
        ("eth1".to_string(), IpAddr::from([127, 0, 0, 11])),
        ("eth3".to_string(), IpAddr::from([127, 0, 0, 13])),
    ];
    FakeRxdm::start_bound(dir, Answer::Ok, Some(Binding::a3vm(nics)), None).unwrap()
}

/// Installs a rule for the flow `src -> dst` naming `gpu`, as the plugin's accept does.
fn install(dir: &Path, src: SocketAddr, dst: SocketAddr, gpu: &str) {
    let addr = |a: SocketAddr| SocketAddress {
        ip_address: Some(a.ip().to_string()),
        port: Some(i32::from(a.port())),
    };
    let rule = UnixSocketProto {
        payload: Some(Payload::FlowSteerRuleRequest(FlowSteerRuleRequest {
            flow_steer_ntuple: Some(FlowSteerNtupleProto {
                flow_type: Some(TCP_V4_FLOW),
                src: Some(addr(src)),
                dst: Some(addr(dst)),
            }),
            queue_id: None,
            gpu_pci_addr: Some(gpu.to_string()),
        })),
    };
    let mut s = UnixStream::connect(dir.join(INSTALL_SOCKET)).unwrap();
    s.write_all(&frame(&rule)).unwrap();
    let body = read_frame(&mut s).unwrap().expect("an answer");
    assert_eq!(body, OK_FRAME[2..].to_vec(), "the fake answered the rule Ok.");
}

/// A connected pair: (the sender, the receiver accepted on `listen_ip`).
fn flow(listen_ip: [u8; 4]) -> (TcpStream, TcpStream) {
    let l = TcpListener::bind((IpAddr::from(listen_ip), 0)).unwrap();
    let tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (rx, _) = l.accept().unwrap();
    (tx, rx)
}

#[derive(Debug, Clone, Copy)]
struct Frag {
    offset: u32,
    size: u32,
    token: u32,
}

/// What the plugin's `gpudirectTCPXRecv` sees: receives with MSG_SOCK_DEVMEM until `want` bytes
/// came, returning the devmem fragments and whether any receive had no control message.
fn devmem_receive(rx: &TcpStream, user: &mut [u8]) -> (Vec<Frag>, bool) {
    let want = user.len();
    // SAFETY: arithmetic on a length only.
    let space = unsafe { libc::CMSG_SPACE(12) } as usize;
    let mut control = vec![0u64; 1024 * space / 8];
    let (mut got, mut frags, mut bare) = (0usize, Vec::new(), false);
    let deadline = Instant::now() + Duration::from_secs(20);
    while got < want {
        assert!(Instant::now() < deadline, "{got} of {want} bytes in 20 s");
        let mut iov = libc::iovec {
            iov_base: user[got..].as_mut_ptr().cast(),
            iov_len: want - got,
        };
        // SAFETY: a zeroed msghdr over our own buffers, alive for the call; the cmsgs read back
        // lie inside `control` (CMSG_FIRSTHDR / CMSG_NXTHDR bound them by msg_controllen).
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = control.len() * 8;
            let n = libc::recvmsg(rx.as_raw_fd(), &mut msg, MSG_SOCK_DEVMEM | libc::MSG_DONTWAIT);
            if n < 0 {
                let e = std::io::Error::last_os_error();
                assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            assert!(n > 0, "the sender closed early");
            let mut sum = 0usize;
            let mut cm = libc::CMSG_FIRSTHDR(&msg);
            if cm.is_null() {
                bare = true;
            }
            while !cm.is_null() {
                assert_eq!(
                    ((*cm).cmsg_level, (*cm).cmsg_type),
                    (libc::SOL_SOCKET, SCM_DEVMEM_OFFSET)
                );
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(cm).cast::<[u32; 3]>());
                frags.push(Frag {
                    offset: v[0],
                    size: v[1],
                    token: v[2],
                });
                sum += v[1] as usize;
                cm = libc::CMSG_NXTHDR(&msg, cm);
            }
            assert!(
                bare || sum == n as usize,
                "fragments {sum} bytes, the receive {n}"
            );
            got += n as usize;
        }
    }
    (frags, bare)
}

fn dontneed(rx: &TcpStream, tokens: &[(u32, u32)]) -> std::io::Result<()> {
    // SAFETY: the option value is our own array of {u32, u32} pairs, its length passed.
    let r = unsafe {
        libc::setsockopt(
            rx.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_DEVMEM_DONTNEED,
            tokens.as_ptr().cast(),
            std::mem::size_of_val(tokens) as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn a_steered_flow_lands_in_its_gpus_pages_and_others_get_no_devmem_cmsg() {
    let test = "a_steered_flow_lands_in_its_gpus_pages_and_others_get_no_devmem_cmsg";
    if std::env::var(ROLE).is_ok() {
        return receive_child();
    }
    let dir = ScratchDir::fresh("devmem-shim", "recv");
    let _rxdm = a3vm_on_loopback(&dir);
    run_child(test, "recv", &dir, &[]);
    // The shim's statistics at the child's exit: both steered flows' bytes landed in GPU 0's
    // memory, and no page is still out (the second flow's went back when its socket closed).
    let stats = std::fs::read_dir(&*dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with("devmem-stats."))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .expect("the shim's statistics");
    let landed = 2 * (3 * PAGE + 100);
    assert!(
        stats.contains(&format!("pool 0000:04:00.0 landed {landed} pages_in_use 0 ")),
        "{stats}"
    );
    assert!(stats.contains("no_cmsg_bytes 12488 "), "{stats}");
}

fn receive_child() {
    let dir = PathBuf::from(std::env::var("TCPXD_DEVMEM_DIR").unwrap());
    let pool = std::fs::read(dir.join("gpumem-0000:04:00.0"))
        .map(|b| b.len())
        .unwrap();
    let data = tcpxd_pattern::seeded_vec(5, 3 * PAGE + 100);

    // Arrives on eth1 (127.0.0.11), rule naming GPU 0 (eth1's): into GPU 0's pages.
    let (mut tx, rx) = flow([127, 0, 0, 11]);
    install(
        &dir,
        tx.local_addr().unwrap(),
        rx.local_addr().unwrap(),
        "0000:04:00.0",
    );
    tx.write_all(&data).unwrap();
    let mut user = vec![0u8; data.len()];
    let (frags, bare) = devmem_receive(&rx, &mut user);
    assert!(!bare, "every receive of a steered flow carries devmem cmsgs");
    assert!(user.iter().all(|&b| b == 0), "no byte lands in the user buffer");
    let mem = std::fs::read(dir.join("gpumem-0000:04:00.0")).unwrap();
    assert_eq!(mem.len(), pool);
    let mut at = 0usize;
    for f in &frags {
        assert!(f.size as usize <= PAGE && f.offset as usize % PAGE == 0, "{f:?}");
        assert_eq!(f.token as usize, f.offset as usize / PAGE, "{f:?}");
        let (o, n) = (f.offset as usize, f.size as usize);
        assert_eq!(&mem[o..o + n], &data[at..at + n], "fragment {f:?}");
        at += n;
    }
    assert_eq!(at, data.len());
    // Every page goes back once; a token not held is refused.
    let tokens: Vec<(u32, u32)> = frags.iter().map(|f| (f.token, 1)).collect();
    dontneed(&rx, &tokens).unwrap();
    let again = dontneed(&rx, &tokens[..1]).unwrap_err();
    assert_eq!(again.raw_os_error(), Some(libc::EINVAL));
    // Another steered flow whose pages are never returned: they go back when it closes.
    let (mut tx2, rx2) = flow([127, 0, 0, 11]);
    install(
        &dir,
        tx2.local_addr().unwrap(),
        rx2.local_addr().unwrap(),
        "0000:04:00.0",
    );
    tx2.write_all(&data).unwrap();
    let mut user = vec![0u8; data.len()];
    let (frags2, _) = devmem_receive(&rx2, &mut user);
    assert_eq!(frags2.iter().map(|f| f.size as usize).sum::<usize>(), data.len());
    drop(rx2);

    // Arrives on eth3 (127.0.0.13) but its rule names GPU 0, so RxDM filed it under eth1: the
    // bytes land in the user buffer with no devmem cmsg (on A3: "rx no cmsg").
    let (mut tx, rx) = flow([127, 0, 0, 13]);
    install(
        &dir,
        tx.local_addr().unwrap(),
        rx.local_addr().unwrap(),
        "0000:04:00.0",
    );
    tx.write_all(&data).unwrap();
    let mut user = vec![0u8; data.len()];
    let (frags, bare) = devmem_receive(&rx, &mut user);
    assert!(bare && frags.is_empty());
    assert_eq!(user, data);

    // No rule at all: the same.
    let (mut tx, rx) = flow([127, 0, 0, 13]);
    tx.write_all(&data[..100]).unwrap();
    let mut user = vec![0u8; 100];
    let (frags, bare) = devmem_receive(&rx, &mut user);
    assert!(bare && frags.is_empty());
    assert_eq!(user, data[..100]);
    // Tokens on a flow that never had devmem are refused.
    assert!(dontneed(&rx, &[(0, 1)]).is_err());
}

#[test]
fn a_send_with_a_dma_buf_cmsg_sends_the_dma_bufs_bytes() {
    let test = "a_send_with_a_dma_buf_cmsg_sends_the_dma_bufs_bytes";
    if std::env::var(ROLE).is_ok() {
        return send_child();
    }
    let dir = ScratchDir::fresh("devmem-shim", "send");
    std::fs::create_dir_all(&dir).unwrap();
    let lib = tcpxd_testkit::cudastub::library();
    run_child(
        test,
        "send",
        &dir,
        &[
            ("TCPXD_TEST_CUDASTUB", lib.display().to_string()),
            ("TCPXD_DEVMEM_NIC_PCI", "tcpxdshim0=0000:77:00.0".into()),
        ],
    );
}

type CuInit = extern "C" fn(u32) -> i32;
type CuMemAlloc = extern "C" fn(*mut u64, usize) -> i32;
type CuMemcpyHtoD = extern "C" fn(u64, *const libc::c_void, usize) -> i32;
type CuGetHandle = extern "C" fn(*mut libc::c_void, u64, usize, i32, u64) -> i32;

fn sym<T: Copy>(lib: *mut libc::c_void, name: &std::ffi::CStr) -> T {
    // SAFETY: a symbol of the stand-in we loaded, of the type its CUDA declaration has.
    unsafe {
        let p = libc::dlsym(lib, name.as_ptr());
        assert!(!p.is_null(), "{name:?} not in the stand-in");
        std::mem::transmute_copy(&p)
    }
}

fn send_child() {
    let path = std::ffi::CString::new(std::env::var("TCPXD_TEST_CUDASTUB").unwrap()).unwrap();
    // SAFETY: loading the stand-in, globally (the shim looks up its dma-buf table there).
    let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!lib.is_null(), "dlopen the CUDA stand-in");
    let cu_init: CuInit = sym(lib, c"cuInit");
    let alloc: CuMemAlloc = sym(lib, c"cuMemAlloc_v2");
    let htod: CuMemcpyHtoD = sym(lib, c"cuMemcpyHtoD_v2");
    let handle: CuGetHandle = sym(lib, c"cuMemGetHandleForAddressRange");
    assert_eq!(cu_init(0), 0);
    let data = tcpxd_pattern::seeded_vec(9, 4 * PAGE);
    let mut d = 0u64;
    assert_eq!(alloc(&mut d, data.len()), 0);
    assert_eq!(htod(d, data.as_ptr().cast(), data.len()), 0);
    // regMr: a dma-buf of pages 1..3, then the pages fd the plugin sends with.
    let mut dmabuf: libc::c_int = -1;
    assert_eq!(
        handle(
            (&mut dmabuf as *mut libc::c_int).cast(),
            d + PAGE as u64,
            2 * PAGE,
            1,
            0
        ),
        0
    );
    let mut info = [0u8; 32];
    info[24..28].copy_from_slice(&dmabuf.to_ne_bytes());
    // SAFETY: the ioctl's argument is our own 32-byte dma_buf_create_pages_info.
    let pages = unsafe { libc::ioctl(dmabuf, DMA_BUF_CREATE_PAGES as _, info.as_mut_ptr()) };
    assert!(
        pages >= 0,
        "DMA_BUF_CREATE_PAGES: {}",
        std::io::Error::last_os_error()
    );
    let (tx, mut rx) = flow([127, 0, 0, 1]);
    // SAFETY: not a dma-buf: refused as the kernel refuses an ioctl a file does not know.
    let r = unsafe { libc::ioctl(tx.as_raw_fd(), DMA_BUF_CREATE_PAGES as _, info.as_mut_ptr()) };
    assert_eq!(
        (r, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::ENOTTY))
    );

    let send = |off: i32, len: usize| -> isize {
        let junk = vec![0xEEu8; len];
        let mut iov = libc::iovec {
            iov_base: junk.as_ptr() as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: arithmetic on a length only.
        let space = unsafe { libc::CMSG_SPACE(8) } as usize;
        let mut control = vec![0u64; space.div_ceil(8)];
        // SAFETY: a zeroed msghdr over our own buffers alive for the call; the cmsg is written
        // inside `control` (CMSG_FIRSTHDR of a buffer of CMSG_SPACE(8) bytes).
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space;
            let cm = libc::CMSG_FIRSTHDR(&msg);
            (*cm).cmsg_level = libc::SOL_SOCKET;
            (*cm).cmsg_type = SCM_DEVMEM_OFFSET;
            (*cm).cmsg_len = libc::CMSG_LEN(8) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(cm).cast::<[i32; 2]>(), [pages, off]);
            libc::sendmsg(tx.as_raw_fd(), &msg, 0)
        }
    };
    // The bytes sent are the dma-buf's from the offset (page 1 of the allocation + 1000), not
    // the iovec's.
    assert_eq!(send(1000, 3000), 3000);
    let mut got = vec![0u8; 3000];
    std::io::Read::read_exact(&mut rx, &mut got).unwrap();
    assert_eq!(got, data[PAGE + 1000..PAGE + 4000]);
    // Past the dma-buf's end: refused, nothing sent.
    assert_eq!(send(2 * PAGE as i32 - 10, 20), -1);
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EFAULT));

    // A NIC without a PCI device (a veth) gets the PCI path the map gives it.
    let p = std::ffi::CString::new("/sys/class/net/tcpxdshim0/device").unwrap();
    // SAFETY: realpath allocating its answer (freed below), on a NUL-terminated path.
    let r = unsafe { libc::realpath(p.as_ptr(), std::ptr::null_mut()) };
    assert!(!r.is_null());
    // SAFETY: the NUL-terminated string realpath allocated, freed once.
    let text = unsafe { std::ffi::CStr::from_ptr(r) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: realpath's allocation, freed once.
    unsafe { libc::free(r.cast()) };
    assert_eq!(text, "/sys/devices/pci0000:00/0000:77:00.0");
}
