//! How much host memory a registration may fault in: what the node has available (the kernel's
//! `MemAvailable`, and under a cgroup v2 memory limit, the limit less what the cgroup uses), less
//! a reserve kept free (`transfer.host_memory_reserve_bytes`), less what other registrations are
//! faulting in at that moment.
//!
//! The daemon faults every page of a host buffer in at registration (`net::memory::populate`).
//! Past what the node has, that ends in the kernel's OOM killer, and the process it picks is the
//! one holding the most memory: the daemon, with every client's transfers. A registration that
//! would not fit is refused instead, with RESOURCE_EXHAUSTED and the figures, and nothing is
//! allocated. The figure is a reading, not a reservation (another process may take the memory
//! next), so the reserve is what absorbs the difference.
//!
//! # State
//! `pending`: the bytes admitted and still being faulted in. An [`Admitted`] adds its bytes under
//! the lock that checks them and takes them away when dropped, after its population, when the
//! kernel's own figures show them; so two registrations at once cannot both be admitted against
//! the same free memory.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::engine::{Code, EngineError};

/// `transfer.host_memory_reserve_bytes`'s default: 1 GiB kept free.
pub const DEFAULT_RESERVE: u64 = 1 << 30;

/// Reads the memory a registration may use now, in bytes (`None`: unknown, so not limited).
type Probe = Box<dyn Fn() -> Option<u64> + Send + Sync>;

/// The check before a registration faults host memory in (module doc).
pub struct Headroom {
    reserve: u64,
    pending: Mutex<u64>,
    probe: Probe,
}

impl std::fmt::Debug for Headroom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Headroom")
            .field("reserve", &self.reserve)
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}

/// Bytes admitted by [`Headroom::admit`]; they stop counting as pending when this is dropped.
#[derive(Debug)]
#[must_use = "the bytes count as pending only while this is held: drop it once they are faulted in"]
pub struct Admitted<'a> {
    headroom: &'a Headroom,
    bytes: u64,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let mut pending = self.headroom.pending.lock().unwrap_or_else(|e| e.into_inner());
        *pending = pending.saturating_sub(self.bytes);
    }
}

impl Headroom {
    /// This node's memory, as the kernel reports it, keeping `reserve` bytes free.
    pub fn system(reserve: u64) -> Headroom {
        Headroom::with_probe(reserve, Box::new(|| available(Path::new("/"))))
    }

    /// A headroom that reads its figure from `probe` (tests).
    pub fn with_probe(reserve: u64, probe: Probe) -> Headroom {
        Headroom {
            reserve,
            pending: Mutex::new(0),
            probe,
        }
    }

    /// What the check would read now: (the memory available, `None` when unreadable; the reserve
    /// kept free). The metrics page shows both (`tcpxd_host_memory_*_bytes`).
    pub fn reading(&self) -> (Option<u64>, u64) {
        ((self.probe)(), self.reserve)
    }

    /// Admits `bytes` about to be faulted in, or refuses them naming `field`.
    pub fn admit(&self, field: &str, bytes: u64) -> Result<Admitted<'_>, EngineError> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if bytes > 0
            && let Some(available) = (self.probe)()
        {
            let room = available.saturating_sub(self.reserve).saturating_sub(*pending);
            if bytes > room {
                return Err(EngineError::new(
                    Code::ResourceExhausted,
                    format!(
                        "{field}: faulting in {bytes} bytes would leave less than {} bytes of this node's \
                         memory free ({available} bytes available, {} being faulted in by other \
                         registrations; transfer.host_memory_reserve_bytes keeps {} free): at most {room} \
                         bytes fit now",
                        self.reserve, *pending, self.reserve
                    ),
                ));
            }
        }
        *pending += bytes;
        Ok(Admitted {
            headroom: self,
            bytes,
        })
    }
}

/// The memory this process may still fault in: `MemAvailable`, and under a cgroup v2 memory
/// limit (`memory.max` of this process's cgroup, below `root`), no more than the limit less the
/// cgroup's `memory.current`. `None` where `/proc/meminfo` cannot be read.
pub fn available(root: &Path) -> Option<u64> {
    let read = |p: &Path| std::fs::read_to_string(root.join(p.strip_prefix("/").unwrap_or(p))).ok();
    let meminfo = mem_available(&read(Path::new("/proc/meminfo"))?)?;
    let cgroup = read(Path::new("/proc/self/cgroup")).and_then(|c| cgroup_dir(&c));
    let limit = cgroup.and_then(|dir| {
        let max = read(&dir.join("memory.max"))?;
        let current = read(&dir.join("memory.current"))?;
        cgroup_room(&max, &current)
    });
    Some(limit.map_or(meminfo, |l| l.min(meminfo)))
}

/// `MemAvailable` of `/proc/meminfo`'s text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The cgroup v2 folder of this process (`0::/path` in `/proc/self/cgroup`).
fn cgroup_dir(cgroup: &str) -> Option<PathBuf> {
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(Path::new("/sys/fs/cgroup").join(path.trim().trim_start_matches('/')))
}

/// A cgroup's `memory.max` less its `memory.current`; `None` without a limit (`max`).
fn cgroup_room(max: &str, current: &str) -> Option<u64> {
    let max: u64 = max.trim().parse().ok()?;
    let current: u64 = current.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn fake(reserve: u64, available: u64) -> (Headroom, Arc<AtomicU64>) {
        let avail = Arc::new(AtomicU64::new(available));
        let a = avail.clone();
        let h = Headroom::with_probe(reserve, Box::new(move || Some(a.load(Ordering::Relaxed))));
        (h, avail)
    }

    #[test]
    fn admits_what_fits_above_the_reserve_and_counts_it_until_dropped() {
        let (h, _) = fake(100, 1000);
        let a = h.admit("host.size", 600).unwrap();
        // 1000 available, 100 kept, 600 pending: 300 fit.
        let e = h.admit("host.size", 301).unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        for part in [
            "host.size",
            "301 bytes",
            "1000 bytes available",
            "600 being faulted in",
            "at most 300",
        ] {
            assert!(e.message.contains(part), "{part}: {}", e.message);
        }
        assert!(
            e.message.contains("transfer.host_memory_reserve_bytes"),
            "{}",
            e.message
        );
        let b = h.admit("host.size", 300).unwrap();
        drop((a, b));
        assert_eq!(*h.pending.lock().unwrap(), 0);
        assert!(h.admit("host.size", 900).is_ok());
        assert!(h.admit("host.size", 901).is_err());
        assert!(h.admit("host.size", 0).is_ok(), "nothing to fault in always fits");
    }

    #[test]
    fn an_unknown_figure_limits_nothing() {
        let h = Headroom::with_probe(DEFAULT_RESERVE, Box::new(|| None));
        assert!(h.admit("host.size", u64::MAX / 2).is_ok());
    }

    #[test]
    fn reads_meminfo_and_a_cgroup_limit() {
        let meminfo =
            "MemTotal:       24684900 kB\nMemFree:        18524484 kB\nMemAvailable:   21812000 kB\n";
        assert_eq!(mem_available(meminfo), Some(21_812_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(
            cgroup_dir("0::/kubepods.slice/pod1/tcpxd\n"),
            Some(PathBuf::from("/sys/fs/cgroup/kubepods.slice/pod1/tcpxd"))
        );
        assert_eq!(cgroup_dir("12:memory:/x\n"), None, "cgroup v1: no limit read");
        assert_eq!(cgroup_room("max\n", "123\n"), None);
        assert_eq!(cgroup_room("8589934592\n", "1073741824\n"), Some(7 << 30));
        assert_eq!(cgroup_room("100\n", "200\n"), Some(0));

        // A whole tree: the cgroup's room is below MemAvailable, so it is the figure.
        let root = tempdir();
        let cg = root.join("sys/fs/cgroup/system.slice/tcpxd.service");
        std::fs::create_dir_all(root.join("proc/self")).unwrap();
        std::fs::create_dir_all(&cg).unwrap();
        std::fs::write(root.join("proc/meminfo"), meminfo).unwrap();
        std::fs::write(root.join("proc/self/cgroup"), "0::/system.slice/tcpxd.service\n").unwrap();
        std::fs::write(cg.join("memory.max"), "4294967296\n").unwrap();
        std::fs::write(cg.join("memory.current"), "1073741824\n").unwrap();
        assert_eq!(available(&root), Some(3 << 30));
        std::fs::write(cg.join("memory.max"), "max\n").unwrap();
        assert_eq!(available(&root), Some(21_812_000 * 1024));
        std::fs::remove_file(root.join("proc/meminfo")).unwrap();
        assert_eq!(available(&root), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn this_machine_has_a_figure() {
        assert!(available(Path::new("/")).is_some_and(|b| b > 0));
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("tcpxd-headroom-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
