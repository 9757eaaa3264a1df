//! The conformance suite against the emulation plugin loaded by path (dlopen), as CI runs it:
//! two devices, the second with odd-sized unaligned fragments, four sockets per comm.

use tcpxctl::conformance::{self, Options};
use tcpxd::net::Plugin;

#[test]
fn emulation_conforms_when_loaded_by_path() {
    // SAFETY: nextest runs each test in its own process and this file has one test, so no other
    // thread reads the environment while it is written; the plugin is not loaded yet.
    unsafe {
        std::env::remove_var("NCCL_DYNAMIC_CHUNK_SIZE");
        std::env::remove_var("NCCL_PAT_ENABLE");
        std::env::remove_var("NCCL_ALGO");
        std::env::remove_var("TCPXEMU_PAT_GUARD");
        std::env::set_var("TCPXEMU_DEVICES", "2");
        std::env::set_var("TCPXEMU_DEV1_FRAGMENTS", "odd");
        std::env::set_var("NCCL_NSOCKS_PERTHREAD", "2");
        std::env::set_var("NCCL_SOCKET_NTHREADS", "2");
    }
    tcpxd::logging::init("warn");
    let path = tcpxd_testkit::emulation_plugin_path();
    let plugin = Plugin::load(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    assert_eq!(
        std::env::var("NCCL_DYNAMIC_CHUNK_SIZE").as_deref(),
        Ok("524288"),
        "the loader must set NCCL_DYNAMIC_CHUNK_SIZE before init when it is unset"
    );
    assert_eq!(plugin.devices().len(), 2);
    assert_eq!(
        std::env::var("NCCL_PAT_ENABLE").as_deref(),
        Ok("0"),
        "the emulation's init turns NCCL's PAT algorithm off when nobody chose (issue #14)"
    );
    let report = conformance::run(&plugin, &Options::default());
    println!("{report}");
    let failed: Vec<String> = report
        .failures()
        .map(|c| format!("{} (dev {:?}): {}", c.name, c.dev, c.detail))
        .collect();
    assert!(report.passed(), "conformance failures:\n{}", failed.join("\n"));
    // Every per-device case ran on both devices, plus the two global cases.
    assert_eq!(report.cases.len(), 2 + 2 * 14);
    assert!(report.cases.iter().any(|c| c.name == "nccl_pat" && c.passed));
}
