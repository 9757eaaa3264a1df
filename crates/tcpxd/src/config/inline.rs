//! `transfer.inline_max_bytes`, `transfer.inline_window_bytes`, `transfer.inline_gpu`: small
//! transfers carried inline on the control connection (engine `inline.rs`; docs/CONFIG.md).

use clap::Args;

use super::{ConfigError, FileTransfer};
use crate::engine::{DEFAULT_INLINE_WINDOW_BYTES, MAX_INLINE_BYTES};

/// `transfer.inline_max_bytes`' default: transfers of at most 64 KiB in total go inline, as many
/// as `auto` sends eager (measured on the 2-core VM: p50 0.57-0.64x main's at 4-64 KiB one at a
/// time, GB/s 0.98-2.1x with 8 in flight; docs/BENCHMARKS.md, "Session 23, inline").
pub const DEFAULT_INLINE_MAX_BYTES: u64 = 64 * 1024;

/// The flags (and their environment variables).
#[derive(Debug, Clone, Default, Args)]
pub struct InlineArgs {
    /// Transfers of at most this many bytes in total go inline on the control connection, no
    /// lane touched (0..=1048576; 0: off; a pairing uses the smaller of both nodes' limits).
    /// Default: 65536.
    #[arg(long, env = "TCPXD_INLINE_MAX_BYTES")]
    pub inline_max_bytes: Option<u64>,
    /// Inline bytes sent to one peer and not yet answered, at most (a transfer that would pass
    /// it takes the lanes at once) (4096..=67108864). Default: 262144.
    #[arg(long, env = "TCPXD_INLINE_WINDOW_BYTES")]
    pub inline_window_bytes: Option<u64>,
    /// Inline transfers may read GPU sources (a synchronous copy on the poller) and write into
    /// GPU memory a peer announced: `on` or `off`. Default: off.
    #[arg(long, env = "TCPXD_INLINE_GPU", value_name = "on|off")]
    pub inline_gpu: Option<String>,
}

/// The largest `transfer.inline_window_bytes` (64 MiB).
pub const MAX_INLINE_WINDOW_BYTES: u64 = 64 << 20;

/// The settings, resolved (flags over environment over file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InlineSettings {
    pub max_bytes: u64,
    pub window_bytes: u64,
    pub gpu: bool,
}

impl Default for InlineSettings {
    fn default() -> Self {
        InlineSettings {
            max_bytes: DEFAULT_INLINE_MAX_BYTES,
            window_bytes: DEFAULT_INLINE_WINDOW_BYTES,
            gpu: false,
        }
    }
}

pub(super) fn resolve(args: &InlineArgs, file: &FileTransfer) -> Result<InlineSettings, ConfigError> {
    let pick = |flag: &'static str, a: Option<u64>, key: &'static str, f: Option<u64>, d: u64| match (a, f) {
        (Some(v), _) => (flag, v),
        (None, Some(v)) => (key, v),
        (None, None) => (key, d),
    };
    let (field, max_bytes) = pick(
        "--inline-max-bytes",
        args.inline_max_bytes,
        "transfer.inline_max_bytes",
        file.inline_max_bytes,
        DEFAULT_INLINE_MAX_BYTES,
    );
    if max_bytes > MAX_INLINE_BYTES {
        return Err(ConfigError::Invalid(format!(
            "{field}: {max_bytes} bytes is outside 0..={MAX_INLINE_BYTES}"
        )));
    }
    let (field, window_bytes) = pick(
        "--inline-window-bytes",
        args.inline_window_bytes,
        "transfer.inline_window_bytes",
        file.inline_window_bytes,
        DEFAULT_INLINE_WINDOW_BYTES,
    );
    if !(4096..=MAX_INLINE_WINDOW_BYTES).contains(&window_bytes) {
        return Err(ConfigError::Invalid(format!(
            "{field}: {window_bytes} bytes is outside 4096..={MAX_INLINE_WINDOW_BYTES}"
        )));
    }
    let (field, gpu) = match (&args.inline_gpu, &file.inline_gpu) {
        (Some(v), _) => ("--inline-gpu", v.as_str()),
        (None, Some(v)) => ("transfer.inline_gpu", v.as_str()),
        (None, None) => ("transfer.inline_gpu", "off"),
    };
    let gpu = match gpu {
        "on" => true,
        "off" => false,
        other => {
            return Err(ConfigError::Invalid(format!(
                "{field}: {other:?} is not one of on, off"
            )));
        }
    };
    Ok(InlineSettings {
        max_bytes,
        window_bytes,
        gpu,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve_with(args: InlineArgs, file: &str) -> Result<InlineSettings, String> {
        let file: FileTransfer = toml::from_str(file).expect("toml");
        resolve(&args, &file).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_file_and_flags_in_that_order() {
        assert_eq!(
            resolve_with(InlineArgs::default(), "").unwrap(),
            InlineSettings::default()
        );
        let s = resolve_with(
            InlineArgs::default(),
            "inline_max_bytes = 0\ninline_window_bytes = 8192\ninline_gpu = \"on\"\n",
        )
        .unwrap();
        assert_eq!((s.max_bytes, s.window_bytes, s.gpu), (0, 8192, true));
        let args = InlineArgs {
            inline_max_bytes: Some(4096),
            inline_gpu: Some("off".into()),
            ..InlineArgs::default()
        };
        let s = resolve_with(args, "inline_max_bytes = 0\ninline_gpu = \"on\"\n").unwrap();
        assert_eq!((s.max_bytes, s.gpu), (4096, false));
    }

    #[test]
    fn out_of_range_values_name_the_field_and_the_limit() {
        let e = resolve_with(InlineArgs::default(), "inline_max_bytes = 2097152\n").unwrap_err();
        assert!(
            e.contains("transfer.inline_max_bytes") && e.contains("1048576"),
            "{e}"
        );
        let args = InlineArgs {
            inline_window_bytes: Some(100),
            ..InlineArgs::default()
        };
        let e = resolve_with(args, "").unwrap_err();
        assert!(e.contains("--inline-window-bytes") && e.contains("4096"), "{e}");
        let e = resolve_with(InlineArgs::default(), "inline_gpu = \"maybe\"\n").unwrap_err();
        assert!(e.contains("transfer.inline_gpu") && e.contains("maybe"), "{e}");
    }
}
