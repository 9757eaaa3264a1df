//! Rate limit for the plugin's log lines: Google's plugin logs a warning on every host-memory
//! receive ("requested receive on host mem buffer"), tens of thousands of lines a second under
//! load. Each call site (file and line) may log [`BURST`] lines per [`WINDOW`]; the rest of that
//! window are counted, not logged, and one summary line per site says how many were held back and
//! what the last one said. Nothing is dropped silently: every line counts in
//! `tcpxd_plugin_log_lines_total`, every held-back one in `tcpxd_plugin_log_suppressed_total`, and
//! every held-back window ends in a summary (from the next line of that site, or from a
//! background flush when the site falls quiet).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus::core::Collector;
use prometheus::{IntCounterVec, Opts};

use super::abi;

/// Lines per call site per window logged as they come.
pub const BURST: u64 = 10;
/// The window, and how often the background flush looks for quiet sites.
pub const WINDOW: Duration = Duration::from_secs(10);

/// What to do with one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Emit,
    Suppress,
}

/// One call site's window that held lines back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub file: String,
    pub line: i32,
    pub level: i32,
    /// Lines of the window in all, logged and held back.
    pub seen: u64,
    pub suppressed: u64,
    /// How long the window lasted.
    pub over: Duration,
    /// The last held-back line's text.
    pub last_text: String,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "plugin line repeated: {} of {} in {:.1}s not logged ({}:{}; last: {})",
            self.suppressed,
            self.seen,
            self.over.as_secs_f64(),
            self.file,
            self.line,
            self.last_text
        )
    }
}

struct Site {
    file: String,
    level: i32,
    start: Instant,
    seen: u64,
    suppressed: u64,
    last_text: String,
}

impl Site {
    fn close(&mut self, line: i32, now: Instant) -> Option<Summary> {
        let summary = (self.suppressed > 0).then(|| Summary {
            file: self.file.clone(),
            line,
            level: self.level,
            seen: self.seen,
            suppressed: self.suppressed,
            over: now.saturating_duration_since(self.start),
            last_text: std::mem::take(&mut self.last_text),
        });
        self.start = now;
        self.seen = 0;
        self.suppressed = 0;
        summary
    }
}

/// Per-call-site windows; time is passed in, so tests drive it.
pub struct Limiter {
    burst: u64,
    window: Duration,
    sites: HashMap<String, HashMap<i32, Site>>,
}

impl Limiter {
    pub fn new(burst: u64, window: Duration) -> Limiter {
        Limiter {
            burst,
            window,
            sites: HashMap::new(),
        }
    }

    /// Decides one line; also returns the summary of the site's previous window when this line
    /// opens a new one and that window held lines back.
    pub fn admit(
        &mut self,
        now: Instant,
        level: i32,
        file: &str,
        line: i32,
        text: &str,
    ) -> (Verdict, Option<Summary>) {
        // Borrowed lookups: no allocation per line once a site is known.
        if !self
            .sites
            .get(file)
            .is_some_and(|lines| lines.contains_key(&line))
        {
            self.sites.entry(file.to_string()).or_default();
        }
        let lines = self.sites.get_mut(file).expect("inserted above");
        let site = lines.entry(line).or_insert_with(|| Site {
            file: file.to_string(),
            level,
            start: now,
            seen: 0,
            suppressed: 0,
            last_text: String::new(),
        });
        let closed = if now.saturating_duration_since(site.start) >= self.window {
            site.close(line, now)
        } else {
            None
        };
        site.seen += 1;
        if site.seen <= self.burst {
            (Verdict::Emit, closed)
        } else {
            site.suppressed += 1;
            site.last_text.clear();
            site.last_text.push_str(text);
            (Verdict::Suppress, closed)
        }
    }

    /// Closes every window older than the window length, returning those that held lines back;
    /// sites quiet for a whole window are forgotten.
    pub fn flush(&mut self, now: Instant) -> Vec<Summary> {
        let window = self.window;
        let mut out = Vec::new();
        for lines in self.sites.values_mut() {
            lines.retain(|line, site| {
                if now.saturating_duration_since(site.start) < window {
                    return true;
                }
                let idle = site.seen == 0;
                out.extend(site.close(*line, now));
                !idle
            });
        }
        self.sites.retain(|_, lines| !lines.is_empty());
        out.sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
        out
    }

    /// Call sites being tracked.
    pub fn sites(&self) -> usize {
        self.sites.values().map(HashMap::len).sum()
    }
}

static LIMITER: Mutex<Option<Limiter>> = Mutex::new(None);
static FLUSHER: std::sync::Once = std::sync::Once::new();

const LEVELS: [(&str, usize); 6] = [
    ("none", 0),
    ("version", 1),
    ("warn", 2),
    ("info", 3),
    ("abort", 4),
    ("trace", 5),
];
static LINES: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];
static SUPPRESSED: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

fn level_index(level: i32) -> usize {
    match level {
        abi::NCCL_LOG_VERSION => 1,
        abi::NCCL_LOG_WARN => 2,
        abi::NCCL_LOG_INFO => 3,
        abi::NCCL_LOG_ABORT => 4,
        abi::NCCL_LOG_TRACE => 5,
        _ => 0,
    }
}

/// The process-wide decision for one plugin line (the plugin is process-wide too); summaries of
/// closed windows go out through `emit_summary` (the logger's; the background flush, started by
/// the first line held back, keeps the one that call gave). Abort lines are never held back.
pub fn admit(level: i32, file: &str, line: i32, text: &str, emit_summary: fn(&Summary)) -> Verdict {
    let i = level_index(level);
    LINES[i].fetch_add(1, Ordering::Relaxed);
    if level == abi::NCCL_LOG_ABORT {
        return Verdict::Emit;
    }
    let (verdict, closed) = {
        let mut guard = LIMITER.lock().unwrap_or_else(|e| e.into_inner());
        let limiter = guard.get_or_insert_with(|| Limiter::new(BURST, WINDOW));
        limiter.admit(Instant::now(), level, file, line, text)
    };
    if let Some(s) = closed {
        emit_summary(&s);
    }
    if verdict == Verdict::Suppress {
        SUPPRESSED[i].fetch_add(1, Ordering::Relaxed);
        FLUSHER.call_once(|| {
            let _ = std::thread::Builder::new()
                .name("tcpxd-plugin-log-flush".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(WINDOW);
                        let summaries = LIMITER
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .as_mut()
                            .map(|l| l.flush(Instant::now()))
                            .unwrap_or_default();
                        for s in &summaries {
                            emit_summary(s);
                        }
                    }
                });
        });
    }
    verdict
}

/// Counts a line dropped before it was formatted (`logger.rs`, `tcpxd_plugin_log_skip`): no
/// call site window, no summary — nobody would read either.
pub fn count_unformatted(level: i32) {
    LINES[level_index(level)].fetch_add(1, Ordering::Relaxed);
}

/// Lines the plugin logged and lines held back, per level name, since the process started.
pub fn totals() -> Vec<(&'static str, u64, u64)> {
    LEVELS
        .iter()
        .map(|&(name, i)| {
            (
                name,
                LINES[i].load(Ordering::Relaxed),
                SUPPRESSED[i].load(Ordering::Relaxed),
            )
        })
        .filter(|&(_, lines, _)| lines > 0)
        .collect()
}

/// `tcpxd_plugin_log_lines_total{level}` and `tcpxd_plugin_log_suppressed_total{level}`, read at
/// each scrape.
pub fn metric_families() -> Vec<prometheus::proto::MetricFamily> {
    let lines = IntCounterVec::new(
        Opts::new(
            "tcpxd_plugin_log_lines_total",
            "Lines the net plugin logged, by level",
        ),
        &["level"],
    )
    .expect("valid metric");
    let held = IntCounterVec::new(
        Opts::new(
            "tcpxd_plugin_log_suppressed_total",
            "Plugin lines counted but not logged (past the per-call-site rate limit), by level",
        ),
        &["level"],
    )
    .expect("valid metric");
    // `warn` always (at 0 before the plugin's first warning), so neither family is ever empty:
    // the text encoder refuses a family without samples.
    lines.with_label_values(&["warn"]);
    held.with_label_values(&["warn"]);
    for (level, n, s) in totals() {
        lines.with_label_values(&[level]).inc_by(n);
        held.with_label_values(&[level]).inc_by(s);
    }
    let mut out = lines.collect();
    out.extend(held.collect());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(10);

    #[test]
    fn a_burst_is_logged_then_the_rest_are_counted() {
        let mut l = Limiter::new(3, W);
        let t0 = Instant::now();
        let verdicts: Vec<Verdict> = (0..1000)
            .map(|i| {
                l.admit(
                    t0 + Duration::from_micros(i),
                    2,
                    "net_tcpx.cc",
                    1200,
                    "requested receive on host mem buffer",
                )
                .0
            })
            .collect();
        assert_eq!(verdicts.iter().filter(|v| **v == Verdict::Emit).count(), 3);
        assert_eq!(&verdicts[..3], &[Verdict::Emit; 3]);
        assert_eq!(verdicts.iter().filter(|v| **v == Verdict::Suppress).count(), 997);
    }

    #[test]
    fn the_next_window_opens_with_a_summary_of_the_last() {
        let mut l = Limiter::new(2, W);
        let t0 = Instant::now();
        for i in 0..5 {
            l.admit(t0 + Duration::from_millis(i), 2, "f.cc", 7, &format!("line {i}"));
        }
        let (v, s) = l.admit(t0 + W + Duration::from_millis(1), 2, "f.cc", 7, "line 5");
        assert_eq!(v, Verdict::Emit, "a new window logs again");
        let s = s.expect("the held-back window is summarised");
        assert_eq!((s.seen, s.suppressed, s.line, s.level), (5, 3, 7, 2));
        assert_eq!(s.last_text, "line 4");
        assert!(s.over >= W);
        assert_eq!(
            s.to_string(),
            format!(
                "plugin line repeated: 3 of 5 in {:.1}s not logged (f.cc:7; last: line 4)",
                s.over.as_secs_f64()
            )
        );
    }

    #[test]
    fn call_sites_are_limited_apart() {
        let mut l = Limiter::new(1, W);
        let t0 = Instant::now();
        assert_eq!(l.admit(t0, 2, "a.cc", 1, "x").0, Verdict::Emit);
        assert_eq!(l.admit(t0, 2, "a.cc", 1, "x").0, Verdict::Suppress);
        assert_eq!(
            l.admit(t0, 2, "a.cc", 2, "y").0,
            Verdict::Emit,
            "another line of the same file"
        );
        assert_eq!(l.admit(t0, 2, "b.cc", 1, "z").0, Verdict::Emit, "another file");
        assert_eq!(l.sites(), 3);
    }

    #[test]
    fn a_quiet_site_is_summarised_by_the_flush_then_forgotten() {
        let mut l = Limiter::new(1, W);
        let t0 = Instant::now();
        for _ in 0..4 {
            l.admit(t0, 2, "a.cc", 1, "flood");
        }
        l.admit(t0, 3, "b.cc", 9, "once");
        assert!(
            l.flush(t0 + W / 2).is_empty(),
            "nothing closes before the window ends"
        );
        let out = l.flush(t0 + W);
        assert_eq!(out.len(), 1, "only the site that held lines back: {out:?}");
        assert_eq!(
            (out[0].file.as_str(), out[0].seen, out[0].suppressed),
            ("a.cc", 4, 3)
        );
        assert_eq!(l.sites(), 2, "both had lines in the closed window");
        assert!(
            l.flush(t0 + 2 * W).is_empty(),
            "a window without lines says nothing"
        );
        assert_eq!(l.sites(), 0, "sites quiet for a whole window are forgotten");
    }

    #[test]
    fn a_window_under_the_burst_summarises_nothing() {
        let mut l = Limiter::new(5, W);
        let t0 = Instant::now();
        for i in 0..5 {
            assert_eq!(
                l.admit(t0 + Duration::from_millis(i), 3, "a.cc", 1, "x").0,
                Verdict::Emit
            );
        }
        assert_eq!(l.admit(t0 + W, 3, "a.cc", 1, "x"), (Verdict::Emit, None));
    }

    #[test]
    fn the_families_encode_before_any_plugin_line() {
        let families = metric_families();
        assert_eq!(families.len(), 2);
        assert!(families.iter().all(|f| !f.get_metric().is_empty()));
        let mut out = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &families, &mut out).expect("encodes");
    }

    #[test]
    fn the_process_wide_limiter_counts_every_line_and_never_holds_back_aborts() {
        let before = totals();
        let get = |t: &[(&str, u64, u64)], level: &str| {
            t.iter()
                .find(|(l, _, _)| *l == level)
                .map_or((0, 0), |&(_, n, s)| (n, s))
        };
        let emitted = (0..(BURST + 25))
            .filter(|_| admit(abi::NCCL_LOG_WARN, "limit_test.cc", 4242, "flood", |_| {}) == Verdict::Emit)
            .count() as u64;
        assert!(emitted <= BURST, "at most a burst logged: {emitted}");
        for _ in 0..(BURST + 5) {
            assert_eq!(
                admit(abi::NCCL_LOG_ABORT, "limit_test.cc", 4243, "fatal", |_| {}),
                Verdict::Emit
            );
        }
        let after = totals();
        let (w0, s0) = get(&before, "warn");
        let (w1, s1) = get(&after, "warn");
        assert!(w1 - w0 >= BURST + 25, "every warning counted");
        assert!(s1 - s0 >= BURST + 25 - emitted, "every held-back warning counted");
        assert_eq!(get(&after, "abort").1, 0, "aborts are never held back");
        let text: String = {
            let mut out = Vec::new();
            prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &metric_families(), &mut out)
                .unwrap();
            String::from_utf8(out).unwrap()
        };
        assert!(
            text.contains("tcpxd_plugin_log_suppressed_total{level=\"warn\"}"),
            "{text}"
        );
        assert!(
            text.contains("tcpxd_plugin_log_lines_total{level=\"abort\"}"),
            "{text}"
        );
    }
}
