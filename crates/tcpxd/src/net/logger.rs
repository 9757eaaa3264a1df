//! The plugin's logger: a C shim (`logger.c`) formats each variadic call and hands the line to
//! [`tcpxd_plugin_log_sink`], which forwards it to `tracing` (target `tcpxd::plugin`) and keeps the
//! most recent lines so an error can carry the plugin's own words.

use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_int, c_ulong};
use std::sync::Mutex;

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
    next_seq: u64,
    lines: VecDeque<PluginLine>,
}

static RECENT: Mutex<Recent> = Mutex::new(Recent {
    next_seq: 0,
    lines: VecDeque::new(),
});

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

/// Called by the C shim for every line the plugin logs.
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
    match level {
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

fn record(level: i32, text: String) {
    let mut recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
    let seq = recent.next_seq;
    recent.next_seq += 1;
    if recent.lines.len() == KEPT_LINES {
        recent.lines.pop_front();
    }
    recent.lines.push_back(PluginLine { seq, level, text });
}

/// The sequence number the next plugin line will get: take it before a call, then ask
/// [`lines_since`] for what the plugin said during it.
pub fn mark() -> u64 {
    RECENT.lock().unwrap_or_else(|e| e.into_inner()).next_seq
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
}
