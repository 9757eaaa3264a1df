//! `DescribeNode`: what a client hands out so that other nodes can reach this one (node id, the
//! advertised peer addresses every descriptor carries), and what the node runs (version, plugin,
//! network devices, GPUs, which transfers it carries inline).

use tokio::sync::OnceCell;
use tonic::Status;

use std::sync::Arc;

use super::proto::v1 as pb;
use crate::engine::topology::Topology;
use crate::net::{Plugin, PluginSource};

/// The request forms DescribeNode lists in `features`: WritePrepared/ReadPrepared's outer sums
/// and index windows; WriteBatch/ReadBatch's packed `ranges` (api/batch_ranges.rs);
/// `register_client_memory`'s `reattach_id` (api/host_memory.rs); the local session's
/// `register_batch` and its packed answer (api/register_batch.rs).
pub const FEATURES: &[&str] = &[
    "prepared_outer_indices",
    "prepared_index_windows",
    "batch_ranges",
    "reattach_client_memory",
    "register_batch",
    // (reg-async) `register_batch.packed_answer` (api/register_batch.rs).
    "register_packed",
    // (notify-ctl) A WRITE of one zero-byte entry carrying a notification: a notification alone,
    // control messages only between daemons (peer protocol 10, engine notice.rs).
    "notification_alone",
    // (inline) Small transfers carried whole on the control connection between daemons
    // (transfer.inline_max_bytes; peer protocol 11, engine inline.rs).
    "inline_small_transfers",
    // (shmring) The framed session's `attach_board`: transfers' ends published in memory the
    // client maps (api/local/board.rs); refused where `runtime.shared_completions` is off.
    "shared_completions",
    // (reqring) The framed session's `attach_request_ring`: requests written in memory the
    // daemon's poller reads (api/local/ring.rs); refused where `runtime.request_ring` is off.
    "request_ring",
];

/// What the daemon knows of itself, gathered at start-up (GPUs on first ask).
pub struct NodeFacts {
    pub peer_addresses: Vec<String>,
    pub plugin_name: String,
    pub plugin_path: String,
    pub devices: Vec<pb::NetDevice>,
    pub lanes_per_device: u32,
    pub chunk_bytes: u32,
    /// Which NIC(s) serve each GPU, as the data path uses it.
    pub topology: Arc<Topology>,
    /// How this node receives, with `auto`'s eager lanes and threshold.
    pub protocol: crate::config::ProtocolSettings,
    /// Which transfers this node carries inline on the control connection (`transfer.inline_*`;
    /// the defaults until the daemon sets what it resolved).
    pub inline: crate::config::inline::InlineSettings,
    /// This process's instance (new at every start: clients re-attach when it changes).
    pub instance_id: String,
    /// `runtime.reattach_grace_s` when a state directory keeps registrations, else 0.
    pub reattach_grace_s: u32,
    gpus: OnceCell<Vec<pb::GpuDevice>>,
}

impl NodeFacts {
    /// `devices`: the plugin devices the daemon uses for lanes.
    pub fn new(
        plugin: &Plugin,
        devices: &[i32],
        topology: Arc<Topology>,
        peer_addresses: Vec<String>,
        lanes_per_device: u32,
        chunk_bytes: u32,
        protocol: crate::config::ProtocolSettings,
    ) -> NodeFacts {
        NodeFacts {
            peer_addresses,
            plugin_name: plugin.name().to_string(),
            plugin_path: match plugin.source() {
                PluginSource::Library(p) => p.display().to_string(),
                PluginSource::InProcess(_) => "built-in emulation".to_string(),
            },
            devices: plugin
                .devices()
                .iter()
                .filter(|d| devices.contains(&d.dev))
                .map(|d| pb::NetDevice {
                    index: d.dev,
                    name: d.name.clone(),
                    pci_path: d.pci_path.clone().unwrap_or_default(),
                    speed_mbps: d.speed_mbps,
                    host_memory: d.supports_host(),
                    cuda_memory: d.supports_cuda(),
                    unpack: d.uses_unpack(),
                })
                .collect(),
            lanes_per_device,
            chunk_bytes,
            topology,
            protocol,
            inline: crate::config::inline::InlineSettings::default(),
            instance_id: hex::encode(rand::random::<[u8; 16]>()),
            reattach_grace_s: 0,
            gpus: OnceCell::new(),
        }
    }

    /// The CUDA devices, read once (the driver's first use can take a while: off the runtime).
    async fn gpus(&self) -> Result<Vec<pb::GpuDevice>, Status> {
        self.gpus
            .get_or_try_init(|| async {
                let list = tokio::task::spawn_blocking(crate::gpu::list_devices)
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?
                    .map_err(|e| Status::internal(format!("listing CUDA devices: {e}")))?;
                Ok::<_, Status>(
                    list.into_iter()
                        .map(|g| pb::GpuDevice {
                            ordinal: g.ordinal as u32,
                            name: g.name,
                            pci_bus_id: g.pci_bus_id,
                            total_memory_bytes: g.total_memory,
                            compute_capability_major: g.compute_capability.0.max(0) as u32,
                            compute_capability_minor: g.compute_capability.1.max(0) as u32,
                        })
                        .collect(),
                )
            })
            .await
            .cloned()
    }

    /// The `DescribeNode` answer.
    pub async fn describe(&self, node_id: &str) -> Result<pb::NodeDescription, Status> {
        Ok(pb::NodeDescription {
            node_id: node_id.to_string(),
            peer_addresses: self.peer_addresses.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            plugin_name: self.plugin_name.clone(),
            plugin_path: self.plugin_path.clone(),
            devices: self.devices.clone(),
            gpus: self.gpus().await?,
            lanes_per_device: self.lanes_per_device,
            chunk_bytes: self.chunk_bytes,
            peer_protocol_version: crate::peers::PROTOCOL_VERSION,
            local_session: super::local::frame::PROTOCOL.to_string(),
            features: FEATURES.iter().map(|f| f.to_string()).collect(),
            gpu_nics: gpu_nics(&self.topology),
            topology_source: self.topology.source.to_string(),
            transfer_protocol: self.protocol.protocol.as_str().to_string(),
            eager_lanes_per_device: self.auto().map_or(0, |p| p.eager_lanes),
            eager_max_bytes: self.auto().map_or(0, |p| p.eager_max_bytes),
            instance_id: self.instance_id.clone(),
            reattach_grace_s: self.reattach_grace_s,
            inline_max_bytes: self.inline.max_bytes,
            inline_window_bytes: self.inline.window_bytes,
            inline_gpu: self.inline.gpu,
            // At most MAX_INLINE_GPU_IN_FLIGHT (1024): config/inline.rs refuses more.
            inline_gpu_in_flight: u32::try_from(self.inline.gpu_in_flight).unwrap_or(u32::MAX),
        })
    }

    /// The protocol settings when `auto` (the only mode with eager lanes of their own).
    fn auto(&self) -> Option<&crate::config::ProtocolSettings> {
        Some(&self.protocol).filter(|p| p.protocol == crate::config::TransferProtocol::Auto)
    }
}

/// Each GPU with its NICs, as `DescribeNode` shows them.
pub fn gpu_nics(t: &Topology) -> Vec<pb::GpuNics> {
    t.gpus
        .iter()
        .zip(&t.bindings)
        .map(|(g, b)| pb::GpuNics {
            gpu_ordinal: g.ordinal,
            gpu_pci_bus_id: g.pci_bus_id.clone(),
            nic_devices: b.nics.iter().map(|&n| t.nics[n].device).collect(),
            nic_names: b.nics.iter().map(|&n| t.nics[n].name.clone()).collect(),
            relation: b.relation.clone(),
        })
        .collect()
}
