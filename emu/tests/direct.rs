//! Direct host receives (TCPXEMU_HOST_RECV=direct): the real plugin's host-memory behaviour.
//! `TCPXEMU_BOUNCE` is left at auto: host mode here, CUDA mode on a GPU machine, where host
//! receives are direct as well.

mod common;
use common::*;

fn env() {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "524288"),
        ("TCPXEMU_HOST_RECV", "direct"),
        ("NCCL_NSOCKS_PERTHREAD", "3"),
    ]);
}

#[test]
fn direct_roundtrip_lands_in_destination() {
    env();
    let mut p = pair(0);
    for (i, size) in [0usize, 1, 4097, 1 << 20, (2 << 20) + 5].into_iter().enumerate() {
        let (_, frags) = roundtrip(&mut p, size, 50 + i as u64, false);
        assert!(frags.is_empty());
    }
    let info = logs_matching("requested receive on host mem buffer");
    assert!(info.len() >= 5);
    assert!(info.iter().all(|(level, _)| *level == abi::NCCL_LOG_INFO));
}

#[test]
fn auto_picks_host_mode_without_cuda() {
    env();
    // SAFETY: probing for the driver library only (as the plugin does); dropped at once.
    let have_cuda = unsafe { libloading::Library::new("libcuda.so.1") }.is_ok();
    if !have_cuda {
        assert!(logs_contain(
            "bounce=host (TCPXEMU_BOUNCE=auto: libcuda.so.1 cannot be loaded"
        ));
        // CUDA registration fails clearly in host mode.
        let p = pair(0);
        let mut mh = std::ptr::null_mut();
        // SAFETY: regMr only records (or rejects) the range; nothing is dereferenced.
        let rc =
            unsafe { (t().regMr.unwrap())(p.recv, 0x20000 as *mut _, 4096, abi::NCCL_PTR_CUDA, &mut mh) };
        assert_eq!(rc, abi::NCCL_INTERNAL_ERROR);
        assert!(logs_contain("needs the CUDA mode of the emulation"));
    }
}

#[test]
fn direct_oversized_send_lands_only_posted_bytes() {
    env();
    let mut p = pair(0);
    let mut sb = reg(p.send, seeded_vec(77, 10_000));
    let mut rb = reg(p.recv, vec![0xEEu8; 10_000]);
    let s = isend(&p, &mut sb, 10_000, 0).unwrap();
    let (r, q) = irecv(&mut p, &mut rb, 4096, 0).unwrap();
    drive(s, r).unwrap();
    assert!(logs_contain(
        "receiver adopting sender's size 10000 > posted 4096"
    ));
    assert!(rb.data[..4096] == sb.data[..4096]);
    assert!(
        rb.data[4096..].iter().all(|&b| b == 0xEE),
        "bytes beyond the posted size were written"
    );
    assert_eq!(cnt(&p, q), 0);
    assert_eq!(consumed(&p, r), 0);
    // The stream stays in step afterwards.
    roundtrip(&mut p, 12_345, 78, false);
    drop(sb);
    drop(rb);
}
