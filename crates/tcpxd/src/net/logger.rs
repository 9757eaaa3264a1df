//! The plugin's logger: a C shim (`logger.c`) formats each variadic call and hands the line to
//! `tcpxd_plugin_log_sink`, which forwards it to `tracing` (target `tcpxd::plugin`) and keeps the
//! most recent lines so an error can carry the plugin's own words. Repeated lines are rate limited
//! per call site and counted ([`super::log_limit`]).

use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_int, c_ulong};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::abi;

/// How many recent plugin lines are kept for error reports.
const KEPT_LINES: usize = 512;

/// One line the plugin logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginLine {
    /// Monotonic sequence number across the process.
    pub seq: u64,
    /// NCCL log level (`NCCL_LOG_WARN`, `NCCL_LOG_INFO`, …).
    pub level: i32,
    /// The formatted message.
    pub text: String,
}

struct Recent {
    lines: VecDeque<PluginLine>,
}

static RECENT: Mutex<Recent> = Mutex::new(Recent {
    lines: VecDeque::new(),
});

/// The sequence number the next kept line gets: taken under `RECENT`'s lock, read without it by
/// [`mark`] (every plugin call takes a mark: a lock there cost each `test` of the poller's pass).
static NEXT_SEQ: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" {
    fn tcpxd_plugin_logger(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    );
}

/// The `ncclDebugLogger_t` to hand to a plugin's `init`.
pub fn logger_fn() -> abi::ncclDebugLogger_t {
    Some(tcpxd_plugin_logger)
}

/// Called by the C shim before it formats a line: nonzero when the line is dropped unformatted —
/// a trace line while nothing records `tcpxd::plugin` at trace level (such lines are never kept
/// for errors either: see [`tcpxd_plugin_log_sink`]). The line still counts in
/// `tcpxd_plugin_log_lines_total`. The emulation logs two per request (posted, done), so this
/// saves the poller a `vsnprintf`, a copy and the rate limiter's lock and hashing twice a request.
#[unsafe(no_mangle)]
extern "C" fn tcpxd_plugin_log_skip(level: c_int) -> c_int {
    let skip =
        level == abi::NCCL_LOG_TRACE && !tracing::enabled!(target: "tcpxd::plugin", tracing::Level::TRACE);
    if skip {
        super::log_limit::count_unformatted(level);
    }
    c_int::from(skip)
}

/// Whether the logger keeps a line at `level` (counted as [`tcpxd_plugin_log_skip`] counts a
/// line it drops): the built-in emulation's gate (`nccl_net_tcpxemu::set_log_gate`), which then
/// formats only the lines kept.
pub(crate) fn keeps(level: i32) -> bool {
    tcpxd_plugin_log_skip(level) == 0
}

/// Called by the C shim for every line the plugin logs (and [`tcpxd_plugin_log_skip`] keeps).
#[unsafe(no_mangle)]
extern "C" fn tcpxd_plugin_log_sink(
    level: c_int,
    _flags: c_ulong,
    file: *const c_char,
    line: c_int,
    msg: *const c_char,
) {
    let text = if msg.is_null() {
        String::new()
    } else {
        // SAFETY: the shim passes a NUL-terminated buffer it formatted on its own stack.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .trim_end()
            .to_owned()
    };
    let file = if file.is_null() {
        "?".into()
    } else {
        // SAFETY: the plugin passes `__FILE__`, a static NUL-terminated string.
        unsafe { CStr::from_ptr(file) }.to_string_lossy()
    };
    // Repeated lines (the real plugin warns on every host receive) are counted, not logged, past
    // a burst per call site (log_limit.rs); they are still kept below, so an error raised during
    // a flood carries the plugin's words.
    let logged =
        super::log_limit::admit(level, &file, line, &text, emit_summary) == super::log_limit::Verdict::Emit;
    match level {
        _ if !logged => {}
        abi::NCCL_LOG_WARN | abi::NCCL_LOG_ABORT => {
            tracing::warn!(target: "tcpxd::plugin", %file, line, "{text}")
        }
        abi::NCCL_LOG_VERSION => tracing::info!(target: "tcpxd::plugin", %file, line, "{text}"),
        abi::NCCL_LOG_INFO => tracing::debug!(target: "tcpxd::plugin", %file, line, "{text}"),
        _ => tracing::trace!(target: "tcpxd::plugin", %file, line, "{text}"),
    }
    if level == abi::NCCL_LOG_TRACE {
        return;
    }
    record(level, text);
}

/// Logs a rate-limited call site's summary at the level of the lines it stands for.
pub(super) fn emit_summary(s: &super::log_limit::Summary) {
    let (file, line, suppressed) = (&s.file, s.line, s.suppressed);
    match s.level {
        abi::NCCL_LOG_WARN | abi::NCCL_LOG_ABORT => {
            tracing::warn!(target: "tcpxd::plugin", %file, line, suppressed, "{s}")
        }
        abi::NCCL_LOG_VERSION => tracing::info!(target: "tcpxd::plugin", %file, line, suppressed, "{s}"),
        abi::NCCL_LOG_INFO => tracing::debug!(target: "tcpxd::plugin", %file, line, suppressed, "{s}"),
        _ => tracing::trace!(target: "tcpxd::plugin", %file, line, suppressed, "{s}"),
    }
}

fn record(level: i32, text: String) {
    let mut recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
    // Under the lock: the lines stay in sequence order.
    let seq = NEXT_SEQ.fetch_add(1, Ordering::AcqRel);
    if recent.lines.len() == KEPT_LINES {
        recent.lines.pop_front();
    }
    recent.lines.push_back(PluginLine { seq, level, text });
}

/// The sequence number the next plugin line will get: take it before a call, then ask
/// [`lines_since`] for what the plugin said during it.
pub fn mark() -> u64 {
    NEXT_SEQ.load(Ordering::Acquire)
}

/// Warnings (and worse) the plugin logged since `mark`, oldest first. When it logged no warning,
/// its last few informational lines instead, so an error is never without context.
pub fn lines_since(mark: u64) -> Vec<String> {
    let recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
    let since: Vec<&PluginLine> = recent.lines.iter().filter(|l| l.seq >= mark).collect();
    let warnings: Vec<String> = since
        .iter()
        .filter(|l| l.level == abi::NCCL_LOG_WARN || l.level == abi::NCCL_LOG_ABORT)
        .map(|l| l.text.clone())
        .collect();
    if !warnings.is_empty() {
        return warnings;
    }
    since.iter().rev().take(4).rev().map(|l| l.text.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shim_formats_variadic_arguments() {
        let before = mark();
        // SAFETY: calling our own shim with a format string and matching arguments.
        unsafe {
            tcpxd_plugin_logger(
                abi::NCCL_LOG_WARN,
                abi::NCCL_NET,
                c"test.c".as_ptr(),
                7,
                c"unable to allocate requests (%d of %s)".as_ptr(),
                17 as c_int,
                c"16".as_ptr(),
            );
        }
        let lines = lines_since(before);
        assert!(
            lines.contains(&"unable to allocate requests (17 of 16)".to_string()),
            "{lines:?}"
        );
    }

    fn trace_lines() -> u64 {
        super::super::log_limit::totals()
            .into_iter()
            .find(|&(name, _, _)| name == "trace")
            .map_or(0, |(_, n, _)| n)
    }

    #[test]
    fn trace_lines_nobody_reads_are_counted_not_formatted() {
        // No subscriber here: `tcpxd::plugin` traces are off.
        let before = trace_lines();
        assert_eq!(tcpxd_plugin_log_skip(abi::NCCL_LOG_TRACE), 1);
        assert!(trace_lines() > before, "a skipped line still counts");
        for level in [
            abi::NCCL_LOG_WARN,
            abi::NCCL_LOG_INFO,
            abi::NCCL_LOG_ABORT,
            abi::NCCL_LOG_VERSION,
        ] {
            assert_eq!(
                tcpxd_plugin_log_skip(level),
                0,
                "level {level} is always formatted"
            );
        }
        // Through the shim: dropped before the sink, so nothing is kept.
        let mark = mark();
        // SAFETY: calling our own shim with a format string and a matching argument.
        unsafe {
            tcpxd_plugin_logger(
                abi::NCCL_LOG_TRACE,
                abi::NCCL_NET,
                c"trace.c".as_ptr(),
                3,
                c"recv seq %d done".as_ptr(),
                5 as c_int,
            );
        }
        assert!(lines_since(mark).is_empty());
        // With a subscriber that records plugin traces, they are formatted and forwarded.
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            assert_eq!(tcpxd_plugin_log_skip(abi::NCCL_LOG_TRACE), 0);
            assert!(
                keeps(abi::NCCL_LOG_TRACE),
                "the emulation's gate follows the subscriber"
            );
        });
    }

    #[test]
    fn the_emulations_gate_keeps_what_the_shim_keeps_and_counts_what_it_drops() {
        let before = trace_lines();
        assert!(
            !keeps(abi::NCCL_LOG_TRACE),
            "no subscriber: trace lines are not formatted"
        );
        assert!(trace_lines() > before, "a line the gate drops still counts");
        assert!(keeps(abi::NCCL_LOG_WARN));
        assert!(keeps(abi::NCCL_LOG_INFO));
    }

    #[test]
    fn lines_held_back_by_the_rate_limit_still_reach_errors() {
        let warn = |n: c_int| {
            // SAFETY: calling our own shim with a format string and a matching argument.
            unsafe {
                tcpxd_plugin_logger(
                    abi::NCCL_LOG_WARN,
                    abi::NCCL_NET,
                    c"flood.c".as_ptr(),
                    9,
                    c"requested receive on host mem buffer %d".as_ptr(),
                    n,
                )
            }
        };
        for n in 0..super::super::log_limit::BURST as c_int {
            warn(n);
        }
        let before = mark();
        warn(999);
        assert_eq!(
            lines_since(before),
            vec!["requested receive on host mem buffer 999".to_string()],
            "a line past the burst is not logged but is kept"
        );
    }
}
