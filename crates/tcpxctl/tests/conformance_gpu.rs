//! The conformance suite on CUDA buffers, against the emulation in CUDA mode (its default where a
//! GPU exists): received bytes land in the emulation's GPU bounce buffer and the suite gathers
//! them with the unpack kernel. Needs a GPU: `cargo test --release --test conformance_gpu -- --ignored`.

use tcpxctl::conformance::{self, Options, TestMemory};
use tcpxd::net::Plugin;

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test conformance_gpu -- --ignored"]
fn gpu_emulation_conforms_with_cuda_buffers() {
    // SAFETY: one test in this file, run in its own process before the plugin exists.
    unsafe {
        std::env::set_var("TCPXEMU_BOUNCE", "cuda");
        std::env::set_var("TCPXEMU_DEVICES", "2");
        std::env::set_var("TCPXEMU_DEV1_FRAGMENTS", "odd");
    }
    tcpxd::logging::init("warn");
    let plugin = Plugin::builtin_emulation().expect("built-in emulation in CUDA mode");
    let report = conformance::run(
        &plugin,
        &Options {
            memory: TestMemory::Cuda(0),
            wraparound_requests: 1000,
            ..Options::default()
        },
    );
    println!("{report}");
    assert!(
        report.passed(),
        "conformance failures: {:?}",
        report.failures().collect::<Vec<_>>()
    );
    let ca = report.cases.iter().find(|c| c.name == "connect_accept").unwrap();
    assert!(ca.detail.contains("bounce buffer in GPU memory"), "{}", ca.detail);
}
