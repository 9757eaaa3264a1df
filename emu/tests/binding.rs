//! The GPU <-> NIC binding (reference/TCPX_PLUGIN_ABI.md §8) in the CUDA mode, on the CUDA
//! stand-in's eight A3 GPUs (tools/realplugin/cudastub): each NIC's `pciPath`, the default
//! `a3vm` map, a comm listened for under a GPU its NIC serves moving CUDA bytes exactly, and one
//! under a GPU its NIC does not serve failing its CUDA receive with the plugin's "rx no cmsg"
//! (the comm fails; with `TCPXEMU_FAILSTOP=exit` the process exits 1), while host-memory receives
//! on it still work.
//!
//! Each test re-runs itself as a child process with the stand-in as `libcuda.so.1`
//! (`tcpxd_testkit::cudastub::child_env`): the loader reads `LD_LIBRARY_PATH` at start, and the
//! plugin reads its environment once per process.

mod common;
use common::*;
use cudarc::driver::sys;
use std::ffi::{CStr, c_int, c_void};
use std::process::Command;
use std::ptr;

const CHILD: &str = "TCPXEMU_BINDING_TEST_CHILD";
const PAGES: usize = 1024;

/// In the parent: run test `name` in a child on the stand-in; returns (exit code, stderr).
fn in_child(name: &str, extra: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .envs(tcpxd_testkit::cudastub::child_env(8))
        .envs(extra.iter().copied())
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), stderr)
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// The child's plugin: CUDA mode (on the stand-in), four NICs, small bounce pools.
fn env() {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "65536"),
        ("NCCL_NSOCKS_PERTHREAD", "2"),
        ("TCPXEMU_DEVICES", "4"),
        ("TCPXEMU_BOUNCE", "cuda"),
        ("TCPXEMU_BOUNCE_PAGES", "1024"),
        ("TCPXEMU_SEED", "7"),
        ("TCPXEMU_TEST_ECHO", "1"),
    ]);
    assert!(cuda_mode(), "the stand-in must give the emulation its CUDA mode");
}

fn ok(what: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// Make GPU `ordinal`'s primary context current on this thread (as the daemon does before
/// listen / connect).
fn make_current(ordinal: c_int) {
    let mut dev: sys::CUdevice = 0;
    let mut ctx: sys::CUcontext = ptr::null_mut();
    // SAFETY: cuInit ran (the plugin's init, CUDA mode); out-parameters on the stack.
    unsafe {
        ok("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal));
        ok(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
        );
        ok("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
    }
}

/// "Device" memory of the current GPU holding `bytes`, registered as NCCL_PTR_CUDA on `comm`.
struct CudaBuf {
    addr: u64,
    mh: *mut c_void,
    comm: *mut c_void,
}

fn cuda_buf(comm: *mut c_void, bytes: &[u8]) -> CudaBuf {
    let mut addr: sys::CUdeviceptr = 0;
    // SAFETY: out-parameter; a context is current (make_current).
    unsafe {
        ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut addr, bytes.len()));
        ok(
            "cuMemcpyHtoD",
            sys::cuMemcpyHtoD_v2(addr, bytes.as_ptr().cast(), bytes.len()),
        );
    }
    let mut mh: *mut c_void = ptr::null_mut();
    // SAFETY: a live comm; the range is device memory of the current context.
    let r = unsafe {
        (t().regMr.unwrap())(
            comm,
            addr as *mut c_void,
            bytes.len() as c_int,
            abi::NCCL_PTR_CUDA,
            &mut mh,
        )
    };
    assert_eq!(r, 0, "regMr(NCCL_PTR_CUDA)");
    CudaBuf { addr, mh, comm }
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        // SAFETY: registered on `comm` by cuda_buf, freed once.
        unsafe {
            (t().deregMr.unwrap())(self.comm, self.mh);
            sys::cuMemFree_v2(self.addr);
        }
    }
}

/// Post a CUDA send and a CUDA receive of `size` bytes on `p`; returns the receive's result.
fn cuda_transfer(
    p: &mut Pair,
    src: &CudaBuf,
    dst: &CudaBuf,
    size: usize,
) -> (*mut c_void, Result<(), abi::ncclResult_t>) {
    let mut sreq: *mut c_void = ptr::null_mut();
    // SAFETY: live comm and registration; the range lies inside it.
    let r = unsafe {
        (t().isend.unwrap())(
            p.send,
            src.addr as *mut c_void,
            size as c_int,
            0,
            src.mh,
            &mut sreq,
        )
    };
    assert_eq!(r, 0, "isend");
    let mut rreq: *mut c_void = ptr::null_mut();
    let (mut data, mut sizes, mut tags, mut mhs) = (dst.addr as *mut c_void, size as c_int, 0, dst.mh);
    // SAFETY: one-entry arrays on the stack; live comm and registration.
    let r = unsafe { (t().irecv.unwrap())(p.recv, 1, &mut data, &mut sizes, &mut tags, &mut mhs, &mut rreq) };
    assert_eq!(r, 0, "irecv");
    p.recvs_posted += 1;
    (rreq, drive(sreq, rreq))
}

#[test]
fn nics_report_a3_pci_paths_and_serve_gpu_pairs() {
    if !is_child() {
        let (code, stderr) = in_child("nics_report_a3_pci_paths_and_serve_gpu_pairs", &[]);
        assert_eq!(code, Some(0), "child stderr:\n{stderr}");
        return;
    }
    env();
    let want = [
        "/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0/0000:06:00.0",
        "/sys/devices/pci0000:00/0000:00:02.0/0000:09:00.0/0000:0c:00.0",
        "/sys/devices/pci0000:80/0000:80:01.0/0000:83:00.0/0000:86:00.0",
        "/sys/devices/pci0000:80/0000:80:02.0/0000:89:00.0/0000:8c:00.0",
    ];
    for (d, path) in want.iter().enumerate() {
        let mut props = std::mem::MaybeUninit::<abi::ncclNetProperties_v7_t>::zeroed();
        // SAFETY: out-parameter.
        assert_eq!(
            unsafe { (t().getProperties.unwrap())(d as c_int, props.as_mut_ptr()) },
            0
        );
        // SAFETY: filled by getProperties; pciPath is a static C string of the plugin.
        let got = unsafe { CStr::from_ptr(props.assume_init().pciPath) };
        assert_eq!(got.to_str().unwrap(), *path);
    }
    // RxDM's a3vm table, by the stand-in's A3 bus ids.
    for (d, gpus) in [
        "0000:04:00.0,0000:05:00.0",
        "0000:0a:00.0,0000:0b:00.0",
        "0000:84:00.0,0000:85:00.0",
        "0000:8a:00.0,0000:8b:00.0",
    ]
    .iter()
    .enumerate()
    {
        assert!(
            logs_contain(&format!("dev{d} tcpxemu{d} 127.0.0.{}", d + 1))
                && logs_contain(&format!("pci={} gpus={gpus} ", want[d])),
            "init line for dev{d}"
        );
    }
}

#[test]
fn a_comm_under_a_gpu_its_nic_serves_moves_cuda_bytes() {
    if !is_child() {
        let (code, stderr) = in_child("a_comm_under_a_gpu_its_nic_serves_moves_cuda_bytes", &[]);
        assert_eq!(code, Some(0), "child stderr:\n{stderr}");
        return;
    }
    env();
    make_current(2);
    let mut p = pair_with(1, 1, true);
    assert!(logs_contain(
        "listen on dev1 tcpxemu1 (/sys/devices/pci0000:00/0000:00:02.0/0000:09:00.0/0000:0c:00.0) \
         under GPU 0000:0a:00.0 (GPU 2): served by this NIC"
    ));
    let size = 300_000;
    let want = seeded_vec(11, size);
    let src = cuda_buf(p.send, &want);
    let dst = cuda_buf(p.recv, &vec![0u8; size]);
    let (rreq, r) = cuda_transfer(&mut p, &src, &dst, size);
    r.expect("the CUDA receive on a served GPU completes");
    // The bytes sit in the bounce buffer (GPU 2's, the listen comm's): gather them as a consumer.
    let h = unpack_handle(&p);
    let n = cnt(&p, 0) as usize;
    assert!(n >= size / 4096);
    let bounce = read_device(h.bounce_buf as u64, PAGES * 4096);
    let mut got = vec![0u8; size];
    for f in fragments(&p, 0) {
        let (s, d, l) = (f.src_off as usize, f.dst_off as usize, f.len as usize);
        got[d..d + l].copy_from_slice(&bounce[s..s + l]);
    }
    assert!(
        got == want,
        "bytes gathered from the bounce buffer differ from the source"
    );
    assert_eq!(
        read_device(dst.addr, size),
        vec![0u8; size],
        "a CUDA receive never lands in the destination"
    );
    assert_eq!(consumed(&p, rreq), 0);
    drop(src);
    drop(dst);
}

#[test]
fn a_comm_under_a_gpu_its_nic_does_not_serve_fails_with_rx_no_cmsg() {
    if !is_child() {
        let (code, stderr) = in_child(
            "a_comm_under_a_gpu_its_nic_does_not_serve_fails_with_rx_no_cmsg",
            &[],
        );
        assert_eq!(code, Some(0), "child stderr:\n{stderr}");
        return;
    }
    env();
    // GPU 0 is eth1's (dev0); dev2 serves GPUs 4 and 5.
    make_current(0);
    let mut p = pair_with(2, 2, true);
    assert!(logs_contain(
        "under GPU 0000:04:00.0 (GPU 0): NOT served by this NIC"
    ));
    // Host-memory receives are plain receives, on A3 too: they work on this comm.
    roundtrip(&mut p, 70_000, 3, false);
    let size = 65536;
    let src = cuda_buf(p.send, &seeded_vec(5, size));
    let dst = cuda_buf(p.recv, &vec![0u8; size]);
    let (_, r) = cuda_transfer(&mut p, &src, &dst, size);
    assert_eq!(r, Err(abi::NCCL_SYSTEM_ERROR));
    let lines = logs_matching("rx no cmsg");
    assert!(!lines.is_empty());
    assert!(
        lines[0].1.starts_with("tcpxemu: fatal, 127.0.0.3:") && lines[0].1.contains(" rx no cmsg ("),
        "{lines:?}"
    );
    assert!(
        lines[0]
            .1
            .contains("GPU 0000:04:00.0 (GPU 0) is not served by dev2"),
        "{lines:?}"
    );
    // The comm stays failed.
    let mut b = reg(p.recv, vec![0u8; 16]);
    assert!(irecv(&mut p, &mut b, 16, 0).is_err());
    drop(b);
    drop(src);
    drop(dst);
}

#[test]
fn failstop_exit_makes_the_mis_bound_receive_exit_the_process() {
    if !is_child() {
        let (code, stderr) = in_child(
            "failstop_exit_makes_the_mis_bound_receive_exit_the_process",
            &[("TCPXEMU_FAILSTOP", "exit")],
        );
        assert_eq!(code, Some(1), "child stderr:\n{stderr}");
        assert!(stderr.contains(" rx no cmsg ("), "{stderr}");
        assert!(
            stderr.contains("exit(1), as the real plugin does here"),
            "{stderr}"
        );
        return;
    }
    env();
    make_current(7);
    let mut p = pair_with(0, 0, true);
    let size = 8192;
    let src = cuda_buf(p.send, &seeded_vec(9, size));
    let dst = cuda_buf(p.recv, &vec![0u8; size]);
    let (_, r) = cuda_transfer(&mut p, &src, &dst, size);
    eprintln!("child: the receive returned {r:?} instead of exiting the process");
    std::process::exit(3);
}
