//! Steal time: CPU time the hypervisor gave to others while this (virtual) machine wanted it.
//! On a busy cloud host it comes in bursts and slows every thread at once, the plugin's and the
//! benchmark's alike; a bench row records how much of the machine's CPU time was stolen while the
//! row ran, so a slow row on a busy host says so (`steal_share` in the JSON, a column in the
//! table when any row saw some).

use std::time::Duration;

/// The machine's CPU time, summed over its CPUs, in the kernel's clock ticks (`USER_HZ`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTicks {
    pub steal: u64,
    /// user, nice, system, idle, iowait, irq, softirq and steal together.
    pub total: u64,
}

/// Stolen CPU time over an interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Steal {
    /// Stolen CPU time, summed over the machine's CPUs.
    pub stolen: Duration,
    /// The stolen share of all the machine's CPU time in the interval (0 to 1).
    pub share: f64,
}

/// Parses `/proc/stat`'s first line (`cpu  user nice system idle iowait irq softirq steal ...`).
pub fn parse_proc_stat(text: &str) -> Option<CpuTicks> {
    let line = text.lines().next()?;
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = fields.take(8).map(str::parse).collect::<Result<_, _>>().ok()?;
    if v.len() < 8 {
        return None;
    }
    Some(CpuTicks {
        steal: v[7],
        total: v.iter().sum(),
    })
}

/// The machine's CPU time now; `None` where `/proc/stat` is missing (not Linux).
pub fn now() -> Option<CpuTicks> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// The steal between two readings, with `hz` ticks per second.
pub fn between(start: CpuTicks, end: CpuTicks, hz: u64) -> Steal {
    let stolen = end.steal.saturating_sub(start.steal);
    let total = end.total.saturating_sub(start.total);
    Steal {
        stolen: Duration::from_secs_f64(stolen as f64 / hz.max(1) as f64),
        share: if total == 0 {
            0.0
        } else {
            stolen as f64 / total as f64
        },
    }
}

/// The steal since `start` (from [`now`]); `None` when either reading is missing.
pub fn since(start: Option<CpuTicks>) -> Option<Steal> {
    Some(between(start?, now()?, USER_HZ))
}

/// The unit of `/proc/stat`: 100 ticks a second on every Linux architecture the daemon runs on
/// (x86-64, aarch64), where the kernel's ABI fixes it.
const USER_HZ: u64 = 100;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_first_line() {
        let t = "cpu  10 2 30 400 5 6 7 50 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\nintr 1\n";
        assert_eq!(
            parse_proc_stat(t),
            Some(CpuTicks {
                steal: 50,
                total: 510
            })
        );
        // Old kernels without the steal field, another first line, garbage: nothing.
        assert_eq!(parse_proc_stat("cpu  1 2 3 4 5 6 7\n"), None);
        assert_eq!(parse_proc_stat("cpu0 1 2 3 4 5 6 7 8\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 x 3 4 5 6 7 8\n"), None);
        assert_eq!(parse_proc_stat(""), None);
    }

    #[test]
    fn steal_between_two_readings() {
        let a = CpuTicks {
            steal: 100,
            total: 10_000,
        };
        let b = CpuTicks {
            steal: 125,
            total: 11_000,
        };
        let s = between(a, b, 100);
        assert_eq!(s.stolen, Duration::from_millis(250));
        assert!((s.share - 0.025).abs() < 1e-12);
        // No time passed, or counters that went backwards: nothing stolen.
        assert_eq!(between(b, b, 100).share, 0.0);
        assert_eq!(between(b, a, 100).stolen, Duration::ZERO);
    }

    #[test]
    fn this_machine_reads_where_linux() {
        if cfg!(target_os = "linux") {
            let a = now().expect("/proc/stat");
            assert!(a.total > 0 && a.steal <= a.total);
            assert!(since(Some(a)).is_some());
        }
        assert!(since(None).is_none());
    }
}
