//! The conformance suite against the emulation linked in-process, in the real plugin's direct
//! host-receive mode (host receives land in place, `cnt` stays 0).

use tcpxctl::conformance::{self, Options};
use tcpxd::net::Plugin;

#[test]
fn builtin_emulation_conforms_with_direct_host_receives() {
    // SAFETY: one test in this file, run in its own process before the plugin exists.
    unsafe {
        std::env::set_var("TCPXEMU_HOST_RECV", "direct");
        std::env::set_var("NCCL_DYNAMIC_CHUNK_SIZE", "131072");
    }
    tcpxd::logging::init("warn");
    let plugin = Plugin::builtin_emulation().expect("built-in emulation");
    let report = conformance::run(&plugin, &Options::default());
    println!("{report}");
    assert!(
        report.passed(),
        "conformance failures: {:?}",
        report.failures().collect::<Vec<_>>()
    );
    let sizes = report
        .cases
        .iter()
        .find(|c| c.name == "sizes")
        .expect("sizes case");
    assert!(sizes.detail.contains("land in place"), "{}", sizes.detail);
    assert_eq!(
        std::env::var("NCCL_DYNAMIC_CHUNK_SIZE").as_deref(),
        Ok("131072"),
        "an operator's value is kept"
    );
}
