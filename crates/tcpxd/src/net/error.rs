//! The plugin layer's error type: every failure names what was attempted, and failures the plugin
//! reported carry its `ncclResult_t` and the lines it logged meanwhile.

use std::path::PathBuf;
use std::time::Duration;

use super::abi;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("plugin file {path} does not exist")]
    FileMissing { path: PathBuf },

    #[error("plugin {path} could not be loaded: {reason}")]
    NotLoadable { path: PathBuf, reason: String },

    #[error(
        "plugin {path} does not export `ncclNetPlugin_v7` (tcpxd needs a v7 NCCL net plugin such as GPUDirect-TCPX): {reason}"
    )]
    SymbolMissing { path: PathBuf, reason: String },

    #[error("plugin {plugin}: its v7 table has no `{function}` function")]
    MissingFunction { plugin: String, function: &'static str },

    #[error(
        "plugin {plugin}: device {dev} reports unpack device version {found:#x}, but tcpxd (like NCCL) requires {expected:#x}"
    )]
    DeviceVersion {
        plugin: String,
        dev: i32,
        found: i32,
        expected: i32,
    },

    #[error("{call} failed with {} ({code}){}", abi::result_name(*.code), fmt_lines(.lines))]
    Plugin {
        call: &'static str,
        code: abi::ncclResult_t,
        lines: Vec<String>,
    },

    #[error("{what} did not complete within {timeout:?}{}", fmt_lines(.lines))]
    Timeout {
        what: String,
        timeout: Duration,
        lines: Vec<String>,
    },

    #[error("window full: {outstanding} requests outstanding on this comm (the plugin allows {limit})")]
    WindowFull { outstanding: usize, limit: usize },

    #[error("request {id} is not {expected} on its comm")]
    OutOfOrder { id: u64, expected: &'static str },

    #[error("request {id} is unknown on this comm")]
    UnknownRequest { id: u64 },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("unpack ring: {0}")]
    Ring(String),
}

impl NetError {
    /// The plugin's `ncclResult_t`, when the plugin itself reported the failure.
    pub fn plugin_code(&self) -> Option<abi::ncclResult_t> {
        match self {
            NetError::Plugin { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The plugin's own log lines attached to this error.
    pub fn plugin_lines(&self) -> &[String] {
        match self {
            NetError::Plugin { lines, .. } | NetError::Timeout { lines, .. } => lines,
            _ => &[],
        }
    }
}

fn fmt_lines(lines: &[String]) -> String {
    if lines.is_empty() {
        String::new()
    } else {
        format!("; plugin said: {}", lines.join(" | "))
    }
}

pub type NetResult<T> = Result<T, NetError>;
