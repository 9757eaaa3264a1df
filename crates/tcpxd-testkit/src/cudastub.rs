//! The CUDA stand-in (`tools/realplugin/cudastub`, `libtcpxd_cudastub.so`) as a child process's
//! `libcuda.so.1`: eight "GPUs" over host memory with A3's PCI bus ids, on which the emulation's
//! CUDA mode and the daemon's GPU data path without kernels (the `d2d` and `host` unpackers) run.
//!
//! The dynamic loader reads `LD_LIBRARY_PATH` when a process starts, so the stand-in serves
//! child processes only: a test starts the daemon (or re-runs itself) with [`child_env`].
//!
//! ```ignore
//! let mut cmd = std::process::Command::new(tcpxd_testkit::workspace_bin("tcpxd"));
//! cmd.envs(tcpxd_testkit::cudastub::child_env(8));
//! ```

use std::path::PathBuf;

/// The stand-in's library the workspace build made (`cargo nextest run --workspace` and `cargo
/// build --workspace` build it; it is a workspace member, not a default one).
pub fn library() -> PathBuf {
    let profile = super::profile_dir();
    let newest = [
        profile.join("libtcpxd_cudastub.so"),
        profile.join("deps").join("libtcpxd_cudastub.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max_by_key(|(modified, _)| *modified);
    match newest {
        Some((_, p)) => p,
        None => panic!(
            "libtcpxd_cudastub.so not found in {}; build it with `cargo build -p tcpxd-cudastub`",
            profile.display()
        ),
    }
}

/// A directory holding `libcuda.so.1` and `libcuda.so`, links to [`library`]
/// (`target/<profile>/cudastub/`), made once and replaced atomically when the library moved.
pub fn lib_dir() -> PathBuf {
    let lib = library();
    let dir = super::profile_dir().join("cudastub");
    std::fs::create_dir_all(&dir).expect("cudastub dir");
    for name in ["libcuda.so.1", "libcuda.so"] {
        let link = dir.join(name);
        if std::fs::read_link(&link).ok().as_deref() == Some(lib.as_path()) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&lib, &tmp).expect("link the stand-in");
        std::fs::rename(&tmp, &link).expect("place the stand-in");
    }
    dir
}

/// The environment for a child process that should see `gpus` stand-in GPUs (1..=8 take A3's
/// bus ids in order: 0000:04:00.0, 05, 0a, 0b, 84, 85, 8a, 8b) as its CUDA driver:
/// `LD_LIBRARY_PATH` with [`lib_dir`] first, `TCPXD_CUDASTUB_DEVICES`.
pub fn child_env(gpus: usize) -> Vec<(String, String)> {
    let dir = lib_dir();
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", dir.display()),
        _ => dir.display().to_string(),
    };
    vec![
        ("LD_LIBRARY_PATH".into(), path),
        ("TCPXD_CUDASTUB_DEVICES".into(), gpus.to_string()),
    ]
}
