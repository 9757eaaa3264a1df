//! `transfer.inline_max_bytes`, `transfer.inline_window_bytes`, `transfer.inline_gpu`,
//! `transfer.inline_gpu_in_flight`: small transfers carried inline on the control connection
//! (engine `inline.rs`; docs/CONFIG.md).

use clap::Args;

use super::{ConfigError, FileTransfer};
use crate::engine::{DEFAULT_INLINE_GPU_IN_FLIGHT, DEFAULT_INLINE_WINDOW_BYTES, MAX_INLINE_BYTES};

/// `transfer.inline_max_bytes`' default: transfers of at most 64 KiB in total go inline, as many
/// as `auto` sends eager (measured on the 2-core VM: p50 0.57-0.64x main's at 4-64 KiB one at a
/// time, GB/s 0.98-2.1x with 8 in flight; docs/BENCHMARKS.md, "Session 23, inline").
pub const DEFAULT_INLINE_MAX_BYTES: u64 = 64 * 1024;

/// `transfer.inline_gpu`'s default: on (session 24). Session 23 left it off: its synchronous
/// device copies held the pollers, so eight 64 KiB transfers in flight moved 0.66-1.08x the
/// lanes' rate. Session 24 made the copies asynchronous (poller/inline_copies.rs) and sends a
/// GPU transfer inline only while none of the pairing's other offers is on the lanes (engine
/// `inline.rs`); on two H200s (`benches/inline_gpu_async.sh`) one at a time it is 0.41-0.53x
/// the lanes' p50 at 4-64 KiB (0.75-1.02x the raw plugin path's). docs/BENCHMARKS.md, session 24.
pub const DEFAULT_INLINE_GPU: bool = true;

/// The largest `transfer.inline_gpu_in_flight`.
pub const MAX_INLINE_GPU_IN_FLIGHT: u64 = 1024;

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
    /// Inline transfers may read GPU sources and write into GPU memory a peer announced (their
    /// device copies asynchronous through pinned staging): `on` or `off`. Default: on.
    #[arg(long, env = "TCPXD_INLINE_GPU", value_name = "on|off")]
    pub inline_gpu: Option<String>,
    /// Inline transfers touching GPU memory sent to one peer and not yet answered, at most (one
    /// past it takes the lanes at once) (0..=1024; 0: none inline). Default: 1.
    #[arg(long, env = "TCPXD_INLINE_GPU_IN_FLIGHT")]
    pub inline_gpu_in_flight: Option<u64>,
}

/// The largest `transfer.inline_window_bytes` (64 MiB).
pub const MAX_INLINE_WINDOW_BYTES: u64 = 64 << 20;

/// The settings, resolved (flags over environment over file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InlineSettings {
    pub max_bytes: u64,
    pub window_bytes: u64,
    pub gpu: bool,
    pub gpu_in_flight: u64,
}

impl Default for InlineSettings {
    fn default() -> Self {
        InlineSettings {
            max_bytes: DEFAULT_INLINE_MAX_BYTES,
            window_bytes: DEFAULT_INLINE_WINDOW_BYTES,
            gpu: DEFAULT_INLINE_GPU,
            gpu_in_flight: DEFAULT_INLINE_GPU_IN_FLIGHT,
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
        (None, None) => (
            "transfer.inline_gpu",
            if DEFAULT_INLINE_GPU { "on" } else { "off" },
        ),
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
    let (field, gpu_in_flight) = pick(
        "--inline-gpu-in-flight",
        args.inline_gpu_in_flight,
        "transfer.inline_gpu_in_flight",
        file.inline_gpu_in_flight,
        DEFAULT_INLINE_GPU_IN_FLIGHT,
    );
    if gpu_in_flight > MAX_INLINE_GPU_IN_FLIGHT {
        return Err(ConfigError::Invalid(format!(
            "{field}: {gpu_in_flight} transfers is outside 0..={MAX_INLINE_GPU_IN_FLIGHT}"
        )));
    }
    Ok(InlineSettings {
        max_bytes,
        window_bytes,
        gpu,
        gpu_in_flight,
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
            "inline_max_bytes = 0\ninline_window_bytes = 8192\ninline_gpu = \"off\"\n\
             inline_gpu_in_flight = 0\n",
        )
        .unwrap();
        assert_eq!(
            (s.max_bytes, s.window_bytes, s.gpu, s.gpu_in_flight),
            (0, 8192, false, 0)
        );
        let args = InlineArgs {
            inline_max_bytes: Some(4096),
            inline_gpu: Some("off".into()),
            inline_gpu_in_flight: Some(3),
            ..InlineArgs::default()
        };
        let s = resolve_with(
            args,
            "inline_max_bytes = 0\ninline_gpu = \"on\"\ninline_gpu_in_flight = 8\n",
        )
        .unwrap();
        assert_eq!((s.max_bytes, s.gpu, s.gpu_in_flight), (4096, false, 3));
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
        let e = resolve_with(InlineArgs::default(), "inline_gpu_in_flight = 1025\n").unwrap_err();
        assert!(
            e.contains("transfer.inline_gpu_in_flight") && e.contains("0..=1024"),
            "{e}"
        );
    }

    #[test]
    fn gpu_inline_is_on_by_default_one_transfer_in_flight_and_may_be_turned_off() {
        let s = resolve_with(InlineArgs::default(), "").unwrap();
        assert_eq!((s.gpu, s.gpu_in_flight), (true, 1));
        let s = resolve_with(InlineArgs::default(), "inline_gpu = \"off\"\n").unwrap();
        assert_eq!((s.gpu, s.gpu_in_flight), (false, 1));
    }
}
