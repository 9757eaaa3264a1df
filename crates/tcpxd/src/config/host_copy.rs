//! `transfer.host_copy_spinners`, `transfer.host_copy_routine`, `transfer.host_copy_split`: how
//! the block chunks' host copy helpers work besides their count and spin (`net::host_copies`,
//! docs/CONFIG.md, docs/BLOCKS.md); and `transfer.host_gather_ahead`, how far ahead of the
//! plugin's window their gathers run.

use std::time::Duration;

use clap::Args;

use super::{AutoOrNumber, ConfigError, FileTransfer};
use crate::net::copy_routines::CopyRoutine;
use crate::net::host_copies::{AUTO_SPINNERS, HelperPolicy, HelperSpin, MAX_HOST_COPY_THREADS, MAX_SPIN_US};

/// `transfer.host_copy_routine`'s default: `stream` (session 23, the 16-core H200 host, 4096 × 16 KiB, 10
/// alternating rounds: scattered ÷ contiguous 0.81 / 0.78 WRITE / READ with 8 helpers, one spinning,
/// against 0.77 / 0.75 with `plain` and 0.70 / 0.68 for main's defaults; docs/BENCHMARKS.md).
pub const DEFAULT_ROUTINE: CopyRoutine = CopyRoutine::Stream;

/// The flags (and their environment variables).
#[derive(Debug, Clone, Default, Args)]
pub struct HostCopyArgs {
    /// How many copy helpers (the first ones, which chunks go to first) may spin for their next
    /// chunk; the others sleep between chunks (`auto`: 1; 0..=64). Default: auto.
    #[arg(long, env = "TCPXD_HOST_COPY_SPINNERS", value_name = "auto|N")]
    pub host_copy_spinners: Option<String>,
    /// How the helpers copy a chunk's pieces: `plain`, `prefetch` (the next piece's
    /// source prefetched while one is copied), `stream` (as prefetch, a scatter's targets written
    /// non-temporally) or `stream-all` (as stream, a gather's staging slot and a landing slot's
    /// zeroing too). Default: stream.
    #[arg(
        long,
        env = "TCPXD_HOST_COPY_ROUTINE",
        value_name = "plain|prefetch|stream|stream-all"
    )]
    pub host_copy_routine: Option<String>,
    /// Whether a chunk is cut across the helpers that have nothing under way (`on`) or always
    /// goes whole to one (`off`). Default: on.
    #[arg(long, env = "TCPXD_HOST_COPY_SPLIT", value_name = "on|off")]
    pub host_copy_split: Option<String>,
    /// Block sends from host memory gathered ahead of `send_window` per lane (0..=16): their
    /// gathers run on the copy helpers while the plugin holds the window's sends; each send
    /// lane's host staging ring has `send_window` + this many slots. Default: 12 (0 without copy
    /// helpers).
    #[arg(long, env = "TCPXD_HOST_GATHER_AHEAD", value_name = "N")]
    pub host_gather_ahead: Option<usize>,
}

/// `transfer.host_gather_ahead` (flag beats file), bounded as `transfer.gather_ahead`. Unset:
/// [`crate::engine::DEFAULT_HOST_GATHER_AHEAD`] where there are copy helpers (`threads`), 0
/// where the poller copies alone: its gathers ahead would only be copied earlier, on the thread
/// that tests and posts (the emulation sends a chunk only inside a test), overlapping nothing
/// (the 2-core VM, no helpers: 0.63 / 0.62 against 0.67 / 0.64 with none ahead, session 24).
pub(super) fn resolve_gather_ahead(
    args: &HostCopyArgs,
    file: &FileTransfer,
    threads: usize,
) -> Result<usize, ConfigError> {
    let n = args
        .host_gather_ahead
        .or(file.host_gather_ahead)
        .unwrap_or(if threads > 0 {
            crate::engine::DEFAULT_HOST_GATHER_AHEAD
        } else {
            0
        });
    if n > super::MAX_GATHER_AHEAD {
        return Err(ConfigError::Invalid(format!(
            "transfer.host_gather_ahead: {n} is over {max} (0 to {max} allowed; each send lane stages \
             send_window + host_gather_ahead chunks of host memory)",
            max = super::MAX_GATHER_AHEAD
        )));
    }
    Ok(n)
}

/// `transfer.host_copy_spin_us` (`flag`: `--host-copy-spin-us`'s word): `auto` follows
/// `runtime.spin` (`spin`).
pub(super) fn resolve_spin(
    flag: Option<&str>,
    file: &FileTransfer,
    spin: bool,
) -> Result<HelperSpin, ConfigError> {
    let (what, v) = match (flag, &file.host_copy_spin_us) {
        (Some(v), _) => ("--host-copy-spin-us", AutoOrNumber::Word(v.to_owned())),
        (None, Some(v)) => ("transfer.host_copy_spin_us", v.clone()),
        (None, None) => ("", AutoOrNumber::Word("auto".into())),
    };
    Ok(
        match v.resolve(what, MAX_SPIN_US).map_err(ConfigError::Invalid)? {
            None => HelperSpin::auto(spin),
            Some(us) => HelperSpin {
                max: Duration::from_micros(us),
            },
        },
    )
}

/// The helpers' policy, `spin` already resolved (`transfer.host_copy_spin_us`).
pub(super) fn resolve(
    args: &HostCopyArgs,
    file: &FileTransfer,
    spin: HelperSpin,
) -> Result<HelperPolicy, ConfigError> {
    let spinners = match (&args.host_copy_spinners, &file.host_copy_spinners) {
        (Some(v), _) => {
            AutoOrNumber::Word(v.clone()).resolve("--host-copy-spinners", MAX_HOST_COPY_THREADS as u64)
        }
        (None, Some(v)) => v.resolve("transfer.host_copy_spinners", MAX_HOST_COPY_THREADS as u64),
        (None, None) => Ok(None),
    }
    .map_err(ConfigError::Invalid)?
    .map_or(AUTO_SPINNERS, |n| n as usize);
    let routine = match (&args.host_copy_routine, &file.host_copy_routine) {
        (Some(v), _) => CopyRoutine::parse("--host-copy-routine", v.trim()).map_err(ConfigError::Invalid)?,
        (None, Some(v)) => {
            CopyRoutine::parse("transfer.host_copy_routine", v.trim()).map_err(ConfigError::Invalid)?
        }
        (None, None) => DEFAULT_ROUTINE,
    };
    let split = match (&args.host_copy_split, &file.host_copy_split) {
        (Some(v), _) => on_off("--host-copy-split", v)?,
        (None, Some(v)) => on_off("transfer.host_copy_split", v)?,
        (None, None) => true,
    };
    Ok(HelperPolicy {
        spin,
        spinners,
        routine,
        split,
    })
}

fn on_off(what: &str, v: &str) -> Result<bool, ConfigError> {
    match v.trim() {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(ConfigError::Invalid(format!(
            "{what}: {other:?} (on or off allowed)"
        ))),
    }
}
