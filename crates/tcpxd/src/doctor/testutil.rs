//! Fake machines for the doctor's unit tests: a temporary root to build /proc, /sys and /dev in,
//! an environment map, canned command output and a fixed memlock limit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{Host, Rlimit, RunOutput, Runner};

/// A temporary directory removed on drop.
pub struct TempRoot(pub PathBuf);

impl TempRoot {
    pub fn new(tag: &str) -> TempRoot {
        let p = std::env::temp_dir().join(format!(
            "tcpxd-doctor-{tag}-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempRoot(p)
    }

    /// Writes `text` at `abs` under the root, creating directories.
    pub fn write(&self, abs: &str, text: &str) -> PathBuf {
        let p = self.0.join(abs.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        p
    }

    pub fn mkdir(&self, abs: &str) -> PathBuf {
        let p = self.0.join(abs.trim_start_matches('/'));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    /// A relative symlink at `abs` pointing at `target_abs` (both under the root), as sysfs has.
    pub fn symlink(&self, abs: &str, target_abs: &str) {
        let link = self.0.join(abs.trim_start_matches('/'));
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let depth = Path::new(abs).parent().unwrap().components().count() - 1;
        let rel = format!("{}{}", "../".repeat(depth), target_abs.trim_start_matches('/'));
        std::os::unix::fs::symlink(rel, link).unwrap();
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Canned answers by program name; programs without one are "not installed".
#[derive(Default)]
pub struct FakeRunner {
    pub answers: Mutex<HashMap<String, RunOutput>>,
}

impl FakeRunner {
    pub fn answer(&self, program_and_args: &str, success: bool, stdout: &str) {
        self.answers.lock().unwrap().insert(
            program_and_args.to_string(),
            RunOutput {
                success,
                stdout: stdout.to_string(),
                stderr: if success {
                    String::new()
                } else {
                    stdout.to_string()
                },
            },
        );
    }
}

impl Runner for FakeRunner {
    fn run(&self, program: &str, args: &[&str]) -> std::io::Result<RunOutput> {
        let key = std::iter::once(program)
            .chain(args.iter().copied())
            .collect::<Vec<_>>()
            .join(" ");
        self.answers
            .lock()
            .unwrap()
            .get(&key)
            .cloned()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    }
}

pub fn host(root: &TempRoot, env: &[(&str, &str)], runner: Arc<FakeRunner>, memlock: Rlimit) -> Host {
    Host {
        root: root.0.clone(),
        env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        runner,
        memlock: Box::new(move || Ok(memlock)),
        probe_cuda: false,
    }
}

pub fn simple_host(root: &TempRoot, env: &[(&str, &str)]) -> Host {
    host(root, env, Arc::new(FakeRunner::default()), (None, None))
}
