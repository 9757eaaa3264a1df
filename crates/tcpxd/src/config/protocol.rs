//! `transfer.protocol` and the settings of its `auto` mode (`transfer.eager_lanes`,
//! `transfer.eager_max_bytes`): docs/CONFIG.md.

use super::{ConfigError, DaemonArgs, FileTransfer};

/// How a node receives (docs/CONFIG.md, `transfer.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferProtocol {
    /// Receive credits kept posted on every lane; data follows its header with no round trip.
    Eager,
    /// Offer, accept, then the data: receives are posted into the destination itself.
    Rendezvous,
    /// Both, per transfer: credits on `eager_lanes` extra lanes per device for transfers of at
    /// most `eager_max_bytes`, rendezvous on the `lanes_per_device` lanes for larger ones.
    Auto,
}

impl TransferProtocol {
    pub const DEFAULT: TransferProtocol = TransferProtocol::Auto;

    pub fn parse(field: &str, v: &str) -> Result<TransferProtocol, ConfigError> {
        match v.trim() {
            "eager" => Ok(TransferProtocol::Eager),
            "rendezvous" => Ok(TransferProtocol::Rendezvous),
            "auto" => Ok(TransferProtocol::Auto),
            other => Err(ConfigError::Invalid(format!(
                "{field}: {other:?} is not \"eager\", \"rendezvous\" or \"auto\""
            ))),
        }
    }

    /// The setting's own word: "eager", "rendezvous" or "auto".
    pub fn as_str(self) -> &'static str {
        match self {
            TransferProtocol::Eager => "eager",
            TransferProtocol::Rendezvous => "rendezvous",
            TransferProtocol::Auto => "auto",
        }
    }

    /// The engine's form.
    pub fn engine(self) -> crate::engine::Protocol {
        match self {
            TransferProtocol::Eager => crate::engine::Protocol::Eager,
            TransferProtocol::Rendezvous => crate::engine::Protocol::Rendezvous,
            TransferProtocol::Auto => crate::engine::Protocol::Auto,
        }
    }
}

/// `transfer.gpu_credits` (docs/CONFIG.md): whether `auto`'s credit receives land in GPU memory,
/// so that transfers into this node's GPU buffers take credits at any size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuCredits {
    /// On when the node has a GPU (and `transfer.protocol` is `auto`).
    Auto,
    On,
    Off,
}

impl GpuCredits {
    pub fn parse(field: &str, v: &str) -> Result<GpuCredits, ConfigError> {
        match v.trim() {
            "auto" => Ok(GpuCredits::Auto),
            "on" => Ok(GpuCredits::On),
            "off" => Ok(GpuCredits::Off),
            other => Err(ConfigError::Invalid(format!(
                "{field}: {other:?} is not \"auto\", \"on\" or \"off\""
            ))),
        }
    }

    /// Whether credit receives land in GPU memory on a node with `gpus` GPUs receiving by
    /// `protocol`.
    pub fn resolve(self, protocol: TransferProtocol, gpus: usize) -> bool {
        protocol == TransferProtocol::Auto
            && match self {
                GpuCredits::Auto => gpus > 0,
                GpuCredits::On => true,
                GpuCredits::Off => false,
            }
    }
}

/// `transfer.credit_budget_bytes` lies in 4096..=this (4 GiB: RxDM's bounce pool per GPU).
pub const MAX_CREDIT_BUDGET_BYTES: u64 = 4 << 30;

/// `transfer.eager_lanes`' default: one eager lane per device, besides the rendezvous lanes.
pub const DEFAULT_EAGER_LANES: u32 = 1;
/// At most this many eager lanes per device.
pub const MAX_EAGER_LANES: u32 = 4;
/// `transfer.eager_max_bytes` lies in 1..=this (1 GiB).
pub const MAX_EAGER_MAX_BYTES: u64 = 1 << 30;

/// `transfer.protocol` with its `auto` settings, resolved (flags over environment over file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProtocolSettings {
    pub protocol: TransferProtocol,
    /// Eager lanes per device under `auto` (opened in addition to `lanes_per_device`).
    pub eager_lanes: u32,
    /// Under `auto`: transfers of at most this many bytes (in total) towards this node go eager.
    pub eager_max_bytes: u64,
    /// Under `auto`: credit receives in GPU memory (`transfer.gpu_credits`).
    pub gpu_credits: GpuCredits,
    /// Bytes of un-consumed chunks a sender may have per credit lane when they land in GPU
    /// memory (`transfer.credit_budget_bytes`).
    pub credit_budget_bytes: u64,
    /// Plain transfers of fewer than two chunks per lane take chunks halved down to no less
    /// than this (`transfer.spread_min_chunk_bytes`); 0: off.
    pub spread_min_chunk_bytes: u32,
    /// Chunks per lane a spread plan aims at (`transfer.spread_chunks_per_lane`).
    pub spread_chunks_per_lane: u32,
}

/// `transfer.spread_min_chunk_bytes` unless set: 64 KiB. On two H200s (session 26,
/// `benches/onemib_device.sh`, A B C C B A) spreading at 128 KiB took 1 MiB one at a time from
/// 471–493 µs p50 to 414–435 and 256 KiB from 347–358 to 296–320, READ and WRITE, GPU 0 → 0 and
/// 0 → 1, with 16 MiB unchanged (0.98–1.03): the two 512 KiB chunks of a 1 MiB transfer had used
/// two of the plugin's data sockets, four of 256 KiB use four, each unpacked while the next lands.
/// Since session 32 a transfer is spread only while it is alone on the pairing's lanes, and the
/// floor is 64 KiB (128 KiB as two chunks, 256 KiB as four): on two H200s
/// (`benches/spreadfloor_device.sh`, three rounds) 128–256 KiB one at a time 1.06–1.40× faster
/// p50, and 128 KiB–1 MiB at 8 in flight 1.07–1.15× the rate, against spreading every transfer
/// at 128 KiB.
pub const DEFAULT_SPREAD_MIN_CHUNK_BYTES: u64 = 64 << 10;

/// `transfer.spread_chunks_per_lane` unless set: two, session 26's plan (1 MiB as four 256 KiB
/// chunks on two lanes). Four (eight of 128 KiB, every data socket of both lanes' comms) was
/// 0.93–1.03× at 1 MiB one at a time and 0.79–0.82× with 8 in flight on one H200 (session 32,
/// onemib3, `benches/onemib3_device.sh`).
pub const DEFAULT_SPREAD_CHUNKS_PER_LANE: u32 = crate::engine::plan::SPREAD_CHUNKS_PER_LANE;

pub(super) fn resolve(args: &DaemonArgs, file: &FileTransfer) -> Result<ProtocolSettings, ConfigError> {
    let protocol = match (&args.transfer_protocol, &file.protocol) {
        (Some(v), _) => TransferProtocol::parse("--transfer-protocol", v)?,
        (None, Some(v)) => TransferProtocol::parse("transfer.protocol", v)?,
        (None, None) => TransferProtocol::DEFAULT,
    };
    let (lanes_field, eager_lanes) = match (args.eager_lanes, file.eager_lanes) {
        (Some(v), _) => ("--eager-lanes", v),
        (None, Some(v)) => ("transfer.eager_lanes", v),
        (None, None) => ("transfer.eager_lanes", DEFAULT_EAGER_LANES),
    };
    if !(1..=MAX_EAGER_LANES).contains(&eager_lanes) {
        return Err(ConfigError::Invalid(format!(
            "{lanes_field}: {eager_lanes} is outside 1..={MAX_EAGER_LANES} (eager lanes per device)"
        )));
    }
    let (max_field, eager_max_bytes) = match (args.eager_max_bytes, file.eager_max_bytes) {
        (Some(v), _) => ("--eager-max-bytes", v),
        (None, Some(v)) => ("transfer.eager_max_bytes", v),
        (None, None) => ("transfer.eager_max_bytes", crate::engine::DEFAULT_EAGER_MAX_BYTES),
    };
    if !(1..=MAX_EAGER_MAX_BYTES).contains(&eager_max_bytes) {
        return Err(ConfigError::Invalid(format!(
            "{max_field}: {eager_max_bytes} bytes is outside 1..={MAX_EAGER_MAX_BYTES}"
        )));
    }
    let gpu_credits = match (&args.gpu_credits, &file.gpu_credits) {
        (Some(v), _) => GpuCredits::parse("--gpu-credits", v)?,
        (None, Some(v)) => GpuCredits::parse("transfer.gpu_credits", v)?,
        (None, None) => GpuCredits::Auto,
    };
    let (budget_field, credit_budget_bytes) = match (args.credit_budget_bytes, file.credit_budget_bytes) {
        (Some(v), _) => ("--credit-budget-bytes", v),
        (None, Some(v)) => ("transfer.credit_budget_bytes", v),
        (None, None) => (
            "transfer.credit_budget_bytes",
            crate::engine::DEFAULT_CREDIT_BUDGET_BYTES,
        ),
    };
    if !(4096..=MAX_CREDIT_BUDGET_BYTES).contains(&credit_budget_bytes) {
        return Err(ConfigError::Invalid(format!(
            "{budget_field}: {credit_budget_bytes} bytes is outside 4096..={MAX_CREDIT_BUDGET_BYTES}"
        )));
    }
    let (spread_field, spread) = match (args.spread_min_chunk_bytes, file.spread_min_chunk_bytes) {
        (Some(v), _) => ("--spread-min-chunk-bytes", v),
        (None, Some(v)) => ("transfer.spread_min_chunk_bytes", v),
        (None, None) => ("transfer.spread_min_chunk_bytes", DEFAULT_SPREAD_MIN_CHUNK_BYTES),
    };
    let spread_min_chunk_bytes = match spread {
        0 => 0,
        v => crate::engine::plan::check_chunk_bytes(v)
            .map_err(|e| ConfigError::Invalid(format!("{spread_field}: {e} (or 0: off)")))?,
    };
    let (per_lane_field, spread_chunks_per_lane) =
        match (args.spread_chunks_per_lane, file.spread_chunks_per_lane) {
            (Some(v), _) => ("--spread-chunks-per-lane", v),
            (None, Some(v)) => ("transfer.spread_chunks_per_lane", v),
            (None, None) => ("transfer.spread_chunks_per_lane", DEFAULT_SPREAD_CHUNKS_PER_LANE),
        };
    let max = crate::engine::plan::MAX_SPREAD_CHUNKS_PER_LANE;
    if !(1..=max).contains(&spread_chunks_per_lane) {
        return Err(ConfigError::Invalid(format!(
            "{per_lane_field}: {spread_chunks_per_lane} is outside 1..={max} (chunks per lane a spread transfer aims at)"
        )));
    }
    Ok(ProtocolSettings {
        protocol,
        eager_lanes,
        eager_max_bytes,
        gpu_credits,
        credit_budget_bytes,
        spread_min_chunk_bytes,
        spread_chunks_per_lane,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve_with(args: DaemonArgs, file: &str) -> Result<ProtocolSettings, ConfigError> {
        let file: FileTransfer = toml::from_str(file).expect("toml");
        resolve(&args, &file)
    }

    #[test]
    fn gpu_credits_and_their_budget_resolve_and_name_the_field_when_bad() {
        let s = resolve_with(
            DaemonArgs::default(),
            "gpu_credits = \"off\"\ncredit_budget_bytes = 8192\n",
        )
        .unwrap();
        assert_eq!((s.gpu_credits, s.credit_budget_bytes), (GpuCredits::Off, 8192));
        let args = DaemonArgs {
            gpu_credits: Some("on".into()),
            ..Default::default()
        };
        assert_eq!(
            resolve_with(args, "gpu_credits = \"off\"\n").unwrap().gpu_credits,
            GpuCredits::On
        );
        let e = resolve_with(DaemonArgs::default(), "gpu_credits = \"yes\"\n").unwrap_err();
        assert!(e.to_string().contains("transfer.gpu_credits: \"yes\""), "{e}");
        let e = resolve_with(DaemonArgs::default(), "credit_budget_bytes = 100\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("transfer.credit_budget_bytes: 100 bytes is outside"),
            "{e}"
        );
        // Auto: on with a GPU, under transfer.protocol = auto only.
        assert!(GpuCredits::Auto.resolve(TransferProtocol::Auto, 1));
        assert!(!GpuCredits::Auto.resolve(TransferProtocol::Auto, 0));
        assert!(!GpuCredits::On.resolve(TransferProtocol::Rendezvous, 8));
        assert!(GpuCredits::On.resolve(TransferProtocol::Auto, 0));
    }

    #[test]
    fn auto_and_its_settings_resolve_flags_over_file_with_defaults() {
        let s = resolve_with(DaemonArgs::default(), "").unwrap();
        assert_eq!(
            s,
            ProtocolSettings {
                protocol: TransferProtocol::DEFAULT,
                eager_lanes: 1,
                eager_max_bytes: 65536,
                gpu_credits: GpuCredits::Auto,
                credit_budget_bytes: 32 << 20,
                spread_min_chunk_bytes: 65536,
                spread_chunks_per_lane: 2,
            }
        );
        let s = resolve_with(
            DaemonArgs::default(),
            "protocol = \"auto\"\neager_lanes = 2\neager_max_bytes = 1048576\n",
        )
        .unwrap();
        assert_eq!(
            (s.protocol, s.eager_lanes, s.eager_max_bytes),
            (TransferProtocol::Auto, 2, 1 << 20)
        );
        let args = DaemonArgs {
            transfer_protocol: Some("eager".into()),
            eager_lanes: Some(3),
            eager_max_bytes: Some(4096),
            ..Default::default()
        };
        let s = resolve_with(args, "protocol = \"auto\"\neager_lanes = 2\n").unwrap();
        assert_eq!(
            (s.protocol, s.eager_lanes, s.eager_max_bytes),
            (TransferProtocol::Eager, 3, 4096)
        );
    }

    #[test]
    fn bad_values_name_the_setting_and_the_limit() {
        let msg = |args: DaemonArgs, file: &str| resolve_with(args, file).unwrap_err().to_string();
        let e = msg(DaemonArgs::default(), "protocol = \"fast\"\n");
        assert!(e.contains("transfer.protocol") && e.contains("auto"), "{e}");
        let e = msg(DaemonArgs::default(), "eager_lanes = 0\n");
        assert!(e.contains("transfer.eager_lanes") && e.contains("1..=4"), "{e}");
        let e = msg(DaemonArgs::default(), "eager_max_bytes = 0\n");
        assert!(
            e.contains("transfer.eager_max_bytes") && e.contains("1073741824"),
            "{e}"
        );
        let e = msg(
            DaemonArgs {
                eager_max_bytes: Some(2 << 30),
                ..Default::default()
            },
            "",
        );
        assert!(e.contains("--eager-max-bytes"), "{e}");
        let e = msg(
            DaemonArgs {
                eager_lanes: Some(5),
                ..Default::default()
            },
            "",
        );
        assert!(e.contains("--eager-lanes") && e.contains("5"), "{e}");
    }

    #[test]
    fn spread_min_chunk_is_64k_by_default_a_chunk_size_or_zero_and_flags_win() {
        let s = resolve(&DaemonArgs::default(), &FileTransfer::default()).unwrap();
        assert_eq!(
            s.spread_min_chunk_bytes, 65536,
            "on by default since session 26's H200 rows, 64 KiB since session 32's"
        );
        let s = resolve_with(DaemonArgs::default(), "spread_min_chunk_bytes = 262144\n").unwrap();
        assert_eq!(s.spread_min_chunk_bytes, 262144);
        let s = resolve_with(DaemonArgs::default(), "spread_min_chunk_bytes = 0\n").unwrap();
        assert_eq!(s.spread_min_chunk_bytes, 0, "0: off");
        let args = DaemonArgs {
            spread_min_chunk_bytes: Some(0),
            ..DaemonArgs::default()
        };
        let s = resolve_with(args, "spread_min_chunk_bytes = 131072\n").unwrap();
        assert_eq!(s.spread_min_chunk_bytes, 0, "the flag wins: off");
        let e = resolve_with(DaemonArgs::default(), "spread_min_chunk_bytes = 100\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("transfer.spread_min_chunk_bytes")
                && e.contains("4096..=4194304")
                && e.contains("0: off"),
            "{e}"
        );
        let args = DaemonArgs {
            spread_min_chunk_bytes: Some(8 << 20),
            ..DaemonArgs::default()
        };
        let e = resolve(&args, &FileTransfer::default()).unwrap_err().to_string();
        assert!(e.contains("--spread-min-chunk-bytes"), "{e}");
    }

    #[test]
    fn spread_chunks_per_lane_is_two_by_default_one_to_sixteen_and_flags_win() {
        let s = resolve(&DaemonArgs::default(), &FileTransfer::default()).unwrap();
        assert_eq!(s.spread_chunks_per_lane, 2);
        let s = resolve_with(DaemonArgs::default(), "spread_chunks_per_lane = 4\n").unwrap();
        assert_eq!(s.spread_chunks_per_lane, 4);
        let args = DaemonArgs {
            spread_chunks_per_lane: Some(8),
            ..DaemonArgs::default()
        };
        let s = resolve_with(args, "spread_chunks_per_lane = 4\n").unwrap();
        assert_eq!(s.spread_chunks_per_lane, 8, "the flag wins");
        for bad in [0, 17] {
            let e = resolve_with(
                DaemonArgs::default(),
                &format!("spread_chunks_per_lane = {bad}\n"),
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("transfer.spread_chunks_per_lane") && e.contains("1..=16"),
                "{e}"
            );
        }
        let args = DaemonArgs {
            spread_chunks_per_lane: Some(0),
            ..DaemonArgs::default()
        };
        let e = resolve(&args, &FileTransfer::default()).unwrap_err().to_string();
        assert!(e.contains("--spread-chunks-per-lane"), "{e}");
    }
}
