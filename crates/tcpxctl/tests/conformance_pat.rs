//! The `nccl_pat` conformance case against the emulation with its PAT guard off
//! (`TCPXEMU_PAT_GUARD=0`), i.e. behaving as the real plugin does: nothing keeps NCCL 2.24+ off
//! PAT, so the case must fail and say what to export (issue #14). The emulation before the guard
//! existed fails it the same way.

use tcpxctl::conformance::{self, Options};
use tcpxd::net::Plugin;

#[test]
fn nccl_pat_fails_without_the_guard_and_passes_once_the_operator_sets_it() {
    // SAFETY: one test in this file, run in its own process before the plugin exists.
    unsafe {
        std::env::set_var("TCPXEMU_PAT_GUARD", "0");
        std::env::remove_var("NCCL_PAT_ENABLE");
        std::env::remove_var("NCCL_ALGO");
    }
    tcpxd::logging::init("warn");
    let plugin = Plugin::builtin_emulation().expect("built-in emulation");
    assert!(std::env::var_os("NCCL_PAT_ENABLE").is_none(), "the guard is off");
    let opts = Options {
        filter: Some("nccl_pat".into()),
        ..Options::default()
    };
    let report = conformance::run(&plugin, &opts);
    assert_eq!(report.cases.len(), 1, "{report}");
    let case = &report.cases[0];
    assert!(!case.passed, "{}", case.detail);
    assert!(case.detail.contains("NCCL_PAT_ENABLE=0"), "{}", case.detail);

    // What an operator does on an A3 node with the real plugin.
    // SAFETY: still the only thread of this test that touches the environment; the plugin's
    // helper threads (none are running: no comm was created) do not read it.
    unsafe { std::env::set_var("NCCL_PAT_ENABLE", "0") };
    let report = conformance::run(&plugin, &opts);
    assert!(report.passed(), "{report}");
}
