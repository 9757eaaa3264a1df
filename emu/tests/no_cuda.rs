//! `TCPXEMU_BOUNCE=cuda` where CUDA cannot run: `init` fails with ncclSystemError and a WARN
//! saying why, and every later call fails. (On a machine with CUDA the test has nothing to check.)

use nccl_net_tcpxemu::abi;
use std::ffi::c_int;
use std::sync::Mutex;

static LOGS: Mutex<Vec<(i32, String)>> = Mutex::new(Vec::new());

fn hook(level: i32, msg: &str) {
    LOGS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((level, msg.to_string()));
}

#[test]
fn cuda_mode_without_cuda_fails_init() {
    // SAFETY: probing for the driver library only; dropped at once.
    if unsafe { libloading::Library::new("libcuda.so.1") }.is_ok() {
        return;
    }
    // SAFETY: the only test in this process; nothing else reads the environment concurrently.
    unsafe {
        std::env::set_var("TCPXEMU_BOUNCE", "cuda");
        std::env::set_var("NCCL_DYNAMIC_CHUNK_SIZE", "524288");
    }
    nccl_net_tcpxemu::set_log_hook(Some(hook));
    let t = nccl_net_tcpxemu::plugin_table();
    // SAFETY: init accepts a NULL logger.
    assert_eq!(unsafe { (t.init.unwrap())(None) }, abi::NCCL_SYSTEM_ERROR);
    // SAFETY: as above; a second init fails the same way.
    assert_eq!(unsafe { (t.init.unwrap())(None) }, abi::NCCL_SYSTEM_ERROR);
    {
        let logs = LOGS.lock().unwrap_or_else(|e| e.into_inner());
        let warn = logs
            .iter()
            .find(|(_, m)| m.contains("TCPXEMU_BOUNCE=cuda but the CUDA mode cannot run here"))
            .expect("no WARN about the CUDA mode");
        assert_eq!(warn.0, abi::NCCL_LOG_WARN);
        assert!(warn.1.contains("libcuda.so.1"), "{}", warn.1);
    }
    let mut n: c_int = -1;
    // SAFETY: out-parameter.
    assert_eq!(unsafe { (t.devices.unwrap())(&mut n) }, abi::NCCL_SYSTEM_ERROR);
    let mut handle = [0u8; 128];
    let mut lc = std::ptr::null_mut();
    // SAFETY: a 128-byte handle and an out-pointer.
    let rc = unsafe { (t.listen.unwrap())(0, handle.as_mut_ptr().cast(), &mut lc) };
    assert_eq!(rc, abi::NCCL_SYSTEM_ERROR);
    assert!(lc.is_null());
}
