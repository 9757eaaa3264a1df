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
}

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
    Ok(ProtocolSettings {
        protocol,
        eager_lanes,
        eager_max_bytes,
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
    fn auto_and_its_settings_resolve_flags_over_file_with_defaults() {
        let s = resolve_with(DaemonArgs::default(), "").unwrap();
        assert_eq!(
            s,
            ProtocolSettings {
                protocol: TransferProtocol::DEFAULT,
                eager_lanes: 1,
                eager_max_bytes: 65536
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
}
