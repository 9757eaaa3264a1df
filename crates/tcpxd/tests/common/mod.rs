#![allow(dead_code)] // each test binary uses a different part of the shared helpers

//! Shared by the daemon's integration tests: where the emulation plugin and tcpxctl were built.

use std::path::PathBuf;

/// The emulation plugin built alongside the tests (`cargo test`/`cargo nextest run` build every
/// workspace member), or the plugin named by `TCPXD_TEST_PLUGIN`.
pub fn emulation_plugin_path() -> PathBuf {
    if let Some(p) = std::env::var_os("TCPXD_TEST_PLUGIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test binary>
    let deps = exe.parent().expect("deps dir");
    let profile = deps.parent().expect("profile dir");
    // Both copies exist after a workspace build; a build of one package refreshes only the one in
    // deps/, so the newer of the two is the current plugin.
    let newest = [
        profile.join("libnccl_net_tcpxemu.so"),
        deps.join("libnccl_net_tcpxemu.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max_by_key(|(modified, _)| *modified);
    if let Some((_, p)) = newest {
        return p;
    }
    panic!(
        "libnccl_net_tcpxemu.so not found next to {}; build it with `cargo build -p tcpxemu`",
        exe.display()
    );
}
/// The `tcpxctl` the workspace built beside this package's `tcpxd` (`cargo build` and
/// `cargo nextest run --workspace` build both; `cargo test -p tcpxd` alone does not rebuild it).
pub fn tcpxctl_bin() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_tcpxd")).with_file_name("tcpxctl");
    assert!(
        path.is_file(),
        "{} not found; build it with `cargo build -p tcpxctl`",
        path.display()
    );
    path
}

pub mod batches;
pub mod daemons;
pub mod framed;
pub mod procs;
pub mod scrape;
