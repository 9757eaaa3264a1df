//! Logging through the `ncclDebugLogger_t` NCCL hands to `init`, plus an optional Rust hook.
//!
//! The logger is C-variadic; it is always called with the format `"%s"` and the message as the
//! single argument, so a message can never be taken for a format string.

use crate::abi;
use std::ffi::{CStr, CString, c_int};
use std::fmt;
use std::sync::RwLock;

/// A Rust-side observer of every log line: `(level, message)`. Levels are NCCL's
/// (`abi::NCCL_LOG_WARN` = 2, `NCCL_LOG_INFO` = 3, `NCCL_LOG_TRACE` = 5).
pub type LogHook = fn(level: i32, msg: &str);

/// Whether a line at `level` would be kept by the logger given to `init` (`false`: dropped). The
/// in-process host that gave that logger installs it ([`set_log_gate`]) so that a line nobody
/// keeps is never formatted: the emulation logs a trace line per request posted and done, and
/// formatting each (a `String`, a `CString`) cost the caller's thread on every `test`.
pub type LogGate = fn(level: i32) -> bool;

static LOGGER: RwLock<abi::ncclDebugLogger_t> = RwLock::new(None);
static HOOK: RwLock<Option<LogHook>> = RwLock::new(None);
static GATE: RwLock<Option<LogGate>> = RwLock::new(None);

/// Replace the NCCL logger (`None` = log nothing through C).
pub(crate) fn set_logger(f: abi::ncclDebugLogger_t) {
    *LOGGER.write().unwrap_or_else(|e| e.into_inner()) = f;
}

/// Install (or remove) a Rust hook that receives every line the plugin logs, in addition to the
/// logger given to `init`. Meant for in-process users (tests, the daemon's built-in emulation),
/// which cannot define a C-variadic function in stable Rust. Process-wide.
pub fn set_log_hook(hook: Option<LogHook>) {
    *HOOK.write().unwrap_or_else(|e| e.into_inner()) = hook;
}

/// Install (or remove) the gate: lines it refuses are neither formatted nor passed to the logger
/// given to `init` (a hook set with [`set_log_hook`] still sees every line). Process-wide.
pub fn set_log_gate(gate: Option<LogGate>) {
    *GATE.write().unwrap_or_else(|e| e.into_inner()) = gate;
}

pub(crate) fn emit(level: c_int, file: &'static CStr, line: u32, args: fmt::Arguments<'_>) {
    let hook = *HOOK.read().unwrap_or_else(|e| e.into_inner());
    let mut logger = *LOGGER.read().unwrap_or_else(|e| e.into_inner());
    if logger.is_some()
        && let Some(keeps) = *GATE.read().unwrap_or_else(|e| e.into_inner())
        && !keeps(level)
    {
        logger = None;
    }
    if logger.is_none() && hook.is_none() {
        return;
    }
    let msg = fmt::format(args);
    if let Some(h) = hook {
        h(level, &msg);
    }
    if let Some(f) = logger {
        let c = CString::new(msg.replace('\0', "")).unwrap_or_default();
        // SAFETY: `f` is the logger NCCL passed to init, a C-variadic function taking
        // (level, flags, file, line, fmt, ...). We pass a NUL-terminated file name, the literal
        // format "%s" and one NUL-terminated string argument, all alive for the call.
        unsafe {
            f(
                level,
                abi::NCCL_NET,
                file.as_ptr(),
                line as c_int,
                c"%s".as_ptr(),
                c.as_ptr(),
            )
        };
    }
}

macro_rules! log_at {
    ($level:expr, $($arg:tt)*) => {{
        const FILE: &::std::ffi::CStr =
            match ::std::ffi::CStr::from_bytes_with_nul(concat!(file!(), "\0").as_bytes()) {
                Ok(c) => c,
                Err(_) => c"tcpxemu",
            };
        $crate::log::emit($level, FILE, line!(), format_args!($($arg)*))
    }};
}

macro_rules! warn {
    ($($arg:tt)*) => { log_at!($crate::abi::NCCL_LOG_WARN, $($arg)*) };
}
macro_rules! info {
    ($($arg:tt)*) => { log_at!($crate::abi::NCCL_LOG_INFO, $($arg)*) };
}
macro_rules! trace {
    ($($arg:tt)*) => { log_at!($crate::abi::NCCL_LOG_TRACE, $($arg)*) };
}
