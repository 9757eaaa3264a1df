//! Shared by the daemon's integration tests: daemons in process and as processes, the framed
//! local session, metrics scrapes (where the build put the plugin and the tools: `tcpxd-testkit`).

pub mod batches;
pub mod blocks;
pub mod daemons;
pub mod fake_lanes;
pub mod framed;
pub mod gpus;
pub mod hold;
pub mod peer_stats;
pub mod procs;
pub mod scrape;
pub mod untimed;
pub mod windows;

/// The name libtest knows a test by in this binary (`net_blocks::child_round_trip`), for a test
/// that runs another of its own tests in a child process with `--exact`: `module` is the
/// caller's `module_path!()` (`suite::net_blocks`), whose crate name the test names leave out.
pub fn test_name(module: &str, test: &str) -> String {
    let module = module.split_once("::").map_or("", |(_, rest)| rest);
    if module.is_empty() {
        test.to_string()
    } else {
        format!("{module}::{test}")
    }
}
