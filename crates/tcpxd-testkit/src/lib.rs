//! What the workspace's tests share, so that each crate's `tests/` and unit tests find the built
//! pieces and make their scratch files the same way:
//!
//! - where the build put things: [`profile_dir`], [`workspace_bin`] (another package's binary,
//!   e.g. the daemon's tests running `tcpxctl`), [`emulation_library`] and
//!   [`emulation_plugin_path`] (the emulation's `libnccl_net_tcpxemu.so`, or the plugin a run
//!   names in `TCPXD_TEST_PLUGIN`);
//! - [`cudastub`]: the CUDA stand-in as a child process's `libcuda.so.1` (eight "GPUs" over host
//!   memory, A3's PCI bus ids) for GPU-path tests on machines without a GPU;
//! - [`ScratchDir`], a temporary file or directory removed when the test ends, passed or not;
//! - [`Rng`], a seeded generator for randomised tests, replayable from its seed, whose bytes are
//!   the shared test pattern (`tcpxd-pattern`).
//!
//! A dev-dependency only; it depends on no crate of the workspace but `tcpxd-pattern`.

use std::path::{Path, PathBuf};

pub mod cudastub;

/// The build's profile directory (`target/<profile>`), where Cargo puts the workspace's binaries
/// and libraries: the directory above this test executable's `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test binary>
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// The binary `name` the workspace built (`cargo build` and `cargo nextest run --workspace` build
/// every member's; `cargo test -p <package>` builds only its own package's, so a test of one
/// package that runs another's binary says how to build it).
pub fn workspace_bin(name: &str) -> PathBuf {
    let path = profile_dir().join(name);
    assert!(
        path.is_file(),
        "{} not found; build it with `cargo build --bin {name}`",
        path.display()
    );
    path
}

/// The emulation plugin's library, `libnccl_net_tcpxemu.so`, built alongside the tests
/// (`cargo test`/`cargo nextest run` build every workspace member).
pub fn emulation_library() -> PathBuf {
    let profile = profile_dir();
    let deps = profile.join("deps");
    // Both copies exist after a workspace build; a build of one package refreshes only the one in
    // deps/, so the newer of the two is the current plugin.
    let newest = [
        profile.join("libnccl_net_tcpxemu.so"),
        deps.join("libnccl_net_tcpxemu.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max_by_key(|(modified, _)| *modified);
    match newest {
        Some((_, p)) => p,
        None => panic!(
            "libnccl_net_tcpxemu.so not found in {}; build it with `cargo build -p tcpxemu`",
            profile.display()
        ),
    }
}

/// The plugin file the tests load: the one named by `TCPXD_TEST_PLUGIN` (tools/realplugin/run.sh
/// sets it to Google's real plugin), else [`emulation_library`].
pub fn emulation_plugin_path() -> PathBuf {
    match std::env::var_os("TCPXD_TEST_PLUGIN") {
        Some(p) => PathBuf::from(p),
        None => emulation_library(),
    }
}

/// A file or directory of a test under the temp dir, removed when dropped (a test that panics, or
/// never stops what it started, leaves nothing behind in /tmp).
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Takes charge of `path` (which need not exist yet).
    pub fn new(path: PathBuf) -> ScratchDir {
        ScratchDir(path)
    }

    /// A fresh path under the temp dir, unique to this process and `tag`
    /// (`<temp>/<prefix>-<tag>-<pid>`), with nothing left there from an earlier run.
    pub fn fresh(prefix: &str, tag: &str) -> ScratchDir {
        let path = std::env::temp_dir().join(format!("{prefix}-{tag}-{}", std::process::id()));
        remove(&path);
        ScratchDir(path)
    }
}

fn remove(path: &Path) {
    if path.is_dir() {
        std::fs::remove_dir_all(path).ok();
    } else {
        std::fs::remove_file(path).ok();
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        remove(&self.0);
    }
}

/// A seeded generator for randomised tests (SplitMix64, `tcpxd-pattern`'s): a failure replays
/// from its seed.
#[derive(Debug, Clone)]
pub struct Rng(tcpxd_pattern::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(tcpxd_pattern::SplitMix64::new(seed))
    }

    /// The next word.
    #[allow(clippy::should_implement_trait)] // a generator, not an iterator
    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }

    /// Puts `v` in a random order (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }

    /// `n` bytes of the shared test pattern, from a seed this generator draws.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        tcpxd_pattern::seeded_vec(self.next(), n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_dir_holds_this_test_binary_s_deps() {
        let exe = std::env::current_exe().unwrap();
        assert_eq!(exe.parent().unwrap(), profile_dir().join("deps"));
    }

    #[test]
    fn a_missing_binary_names_the_build_command() {
        let err = std::panic::catch_unwind(|| workspace_bin("no-such-tcpxd-binary")).unwrap_err();
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.contains("cargo build --bin no-such-tcpxd-binary"), "{msg}");
    }

    #[test]
    fn a_scratch_path_is_removed_when_dropped_file_or_directory() {
        let dir = ScratchDir::fresh("tcpxd-testkit", "dir");
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("a/b/f"), b"x").unwrap();
        let path = dir.to_path_buf();
        drop(dir);
        assert!(!path.exists());

        let file = ScratchDir::fresh("tcpxd-testkit", "file");
        std::fs::write(&*file, b"y").unwrap();
        let path = file.to_path_buf();
        drop(file);
        assert!(!path.exists());

        // Nothing there, nothing to do.
        drop(ScratchDir::fresh("tcpxd-testkit", "never-made"));
    }

    #[test]
    fn a_fresh_scratch_path_clears_what_an_earlier_run_left() {
        let path = std::env::temp_dir().join(format!("tcpxd-testkit-left-{}", std::process::id()));
        std::fs::write(&path, b"old").unwrap();
        let fresh = ScratchDir::fresh("tcpxd-testkit", "left");
        assert_eq!(*fresh, *path);
        assert!(!fresh.exists());
    }

    #[test]
    fn the_generator_replays_from_its_seed() {
        let (mut a, mut b) = (Rng::new(9), Rng::new(9));
        assert_eq!(
            (0..8).map(|_| a.next()).collect::<Vec<_>>(),
            (0..8).map(|_| b.next()).collect::<Vec<_>>()
        );
        assert_eq!(a.bytes(100), b.bytes(100));
        assert_ne!(a.bytes(100), a.bytes(100), "each call draws a new seed");
        assert_eq!(a.below(0), 0);
        for n in [1, 2, 7, 1 << 40] {
            assert!(a.below(n) < n);
        }
        let mut v: Vec<u32> = (0..50).collect();
        a.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..50).collect::<Vec<_>>(),
            "a shuffle keeps every element"
        );
        assert_ne!(v, sorted, "50 elements stay in order once in 50! shuffles");
    }
}
