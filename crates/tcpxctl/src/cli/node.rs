//! `tcpxctl describe`: the daemon's node id, the peer addresses its descriptors carry, version,
//! plugin, network devices and GPUs, which transfers it carries inline (DescribeNode).

use serde_json::{Value, json};

use crate::cli::error::{CliError, emit};
use crate::client::{ApiClient, format_bytes};
use tcpxd::api::proto::v1::{DescribeNodeRequest, NodeDescription};

pub async fn describe(client: &mut ApiClient, json: bool) -> Result<(), CliError> {
    let n = client
        .describe_node(DescribeNodeRequest {})
        .await
        .map_err(|status| CliError::Rpc {
            what: "describing the node".to_string(),
            status,
        })?
        .into_inner();
    if json {
        emit(&format!("{}\n", node_json(&n)))
    } else {
        emit(&node_text(&n))
    }
}

pub fn node_json(n: &NodeDescription) -> Value {
    json!({
        "node_id": n.node_id,
        "peer_addresses": n.peer_addresses,
        "version": n.version,
        "plugin_name": n.plugin_name,
        "plugin_path": n.plugin_path,
        "lanes_per_device": n.lanes_per_device,
        "transfer_protocol": n.transfer_protocol,
        "eager_lanes_per_device": n.eager_lanes_per_device,
        "eager_max_bytes": n.eager_max_bytes,
        "chunk_bytes": n.chunk_bytes,
        "inline_max_bytes": n.inline_max_bytes,
        "inline_window_bytes": n.inline_window_bytes,
        "inline_gpu": n.inline_gpu,
        "inline_gpu_in_flight": n.inline_gpu_in_flight,
        "peer_protocol_version": n.peer_protocol_version,
        "local_session": n.local_session,
        "devices": n.devices.iter().map(|d| json!({
            "index": d.index,
            "name": d.name,
            "pci_path": d.pci_path,
            "speed_mbps": d.speed_mbps,
            "host_memory": d.host_memory,
            "cuda_memory": d.cuda_memory,
            "unpack": d.unpack,
        })).collect::<Vec<_>>(),
        "gpus": n.gpus.iter().map(|g| json!({
            "ordinal": g.ordinal,
            "name": g.name,
            "pci_bus_id": g.pci_bus_id,
            "total_memory_bytes": g.total_memory_bytes,
            "compute_capability": format!("{}.{}", g.compute_capability_major, g.compute_capability_minor),
        })).collect::<Vec<_>>(),
        "topology_source": n.topology_source,
        "gpu_nics": n.gpu_nics.iter().map(|m| json!({
            "gpu_ordinal": m.gpu_ordinal,
            "gpu_pci_bus_id": m.gpu_pci_bus_id,
            "nic_devices": m.nic_devices,
            "nic_names": m.nic_names,
            "relation": m.relation,
        })).collect::<Vec<_>>(),
    })
}

/// The lanes this node opens per device towards each peer, in each direction, and what each kind
/// carries: GetStats lists them in this order (the rendezvous lanes, then the eager ones).
fn lanes_text(n: &NodeDescription) -> String {
    match n.transfer_protocol.as_str() {
        "auto" => format!(
            "{} rendezvous + {} eager per device (receiving: transfer protocol auto, eager up to {})",
            n.lanes_per_device,
            n.eager_lanes_per_device,
            format_bytes(n.eager_max_bytes)
        ),
        "" => format!("{} per device", n.lanes_per_device),
        p => format!(
            "{} per device (receiving: transfer protocol {p})",
            n.lanes_per_device
        ),
    }
}

/// Which transfers the node carries inline on a pairing's control connection (`transfer.inline_*`).
fn inline_text(n: &NodeDescription) -> String {
    if n.inline_window_bytes == 0 {
        // A daemon older than these fields: the feature says whether it inlines at all.
        return if n.features.iter().any(|f| f == "inline_small_transfers") {
            "on (limits not reported by this daemon)".to_string()
        } else {
            "off".to_string()
        };
    }
    if n.inline_max_bytes == 0 {
        return "off (transfer.inline_max_bytes 0)".to_string();
    }
    let gpu = if !n.inline_gpu {
        "host memory only".to_string()
    } else {
        format!(
            "GPU memory too, {} such unanswered per peer",
            n.inline_gpu_in_flight
        )
    };
    format!(
        "up to {} a transfer, {} unanswered per peer, {gpu}",
        format_bytes(n.inline_max_bytes),
        format_bytes(n.inline_window_bytes)
    )
}

pub fn node_text(n: &NodeDescription) -> String {
    let mut s = format!(
        "node            {}\npeer addresses  {}\nversion         {} (peer protocol {})\nplugin          {} ({})\nlanes           {}, chunks of {}\ninline          {}\n",
        n.node_id,
        if n.peer_addresses.is_empty() {
            "none".to_string()
        } else {
            n.peer_addresses.join(", ")
        },
        n.version,
        n.peer_protocol_version,
        n.plugin_name,
        n.plugin_path,
        lanes_text(n),
        format_bytes(n.chunk_bytes as u64),
        inline_text(n),
    );
    for d in &n.devices {
        let mut kinds = Vec::new();
        if d.host_memory {
            kinds.push("host");
        }
        if d.cuda_memory {
            kinds.push("cuda");
        }
        if d.unpack {
            kinds.push("unpack");
        }
        s.push_str(&format!(
            "nic {:<11} {} {} Mb/s [{}]{}\n",
            d.index,
            d.name,
            d.speed_mbps,
            kinds.join(","),
            if d.pci_path.is_empty() {
                String::new()
            } else {
                format!(" {}", d.pci_path)
            }
        ));
    }
    if n.gpus.is_empty() {
        s.push_str("gpus            none\n");
    }
    for g in &n.gpus {
        s.push_str(&format!(
            "gpu {:<11} {} {} sm_{}{} {}\n",
            g.ordinal,
            g.name,
            format_bytes(g.total_memory_bytes),
            g.compute_capability_major,
            g.compute_capability_minor,
            g.pci_bus_id
        ));
    }
    if !n.gpu_nics.is_empty() {
        s.push_str(&format!("topology        {}\n", n.topology_source));
    }
    for m in &n.gpu_nics {
        s.push_str(&format!(
            "gpu {:<11} {} -> {} ({})\n",
            m.gpu_ordinal,
            m.gpu_pci_bus_id,
            m.nic_names.join("+"),
            m.relation
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use tcpxd::api::proto::v1::GpuNics;

    #[test]
    fn each_gpus_nics_are_shown() {
        let n = NodeDescription {
            node_id: "a".into(),
            topology_source: "a3vm".into(),
            gpu_nics: vec![GpuNics {
                gpu_ordinal: 5,
                gpu_pci_bus_id: "0000:85:00.0".into(),
                nic_devices: vec![2],
                nic_names: vec!["eth3".into()],
                relation: "a3vm".into(),
            }],
            ..Default::default()
        };
        let text = node_text(&n);
        assert!(text.contains("topology        a3vm\n"), "{text}");
        assert!(
            text.contains("gpu 5           0000:85:00.0 -> eth3 (a3vm)\n"),
            "{text}"
        );
        let j = node_json(&n);
        assert_eq!(j["topology_source"], "a3vm");
        assert_eq!(j["gpu_nics"][0]["nic_devices"][0], 2);
        // Without GPUs, no topology lines.
        assert!(!node_text(&NodeDescription::default()).contains("topology"));
    }

    #[test]
    fn describe_counts_every_lane_stats_lists() {
        let mut n = NodeDescription {
            node_id: "a".into(),
            lanes_per_device: 2,
            chunk_bytes: 512 << 10,
            transfer_protocol: "auto".into(),
            eager_lanes_per_device: 1,
            eager_max_bytes: 64 << 10,
            ..Default::default()
        };
        let text = node_text(&n);
        assert!(
            text.contains("lanes           2 rendezvous + 1 eager per device (receiving: transfer protocol auto, eager up to 64.00 KiB), chunks of 512.00 KiB\n"),
            "{text}"
        );
        assert_eq!(node_json(&n)["eager_lanes_per_device"], 1);
        n.transfer_protocol = "rendezvous".into();
        n.eager_lanes_per_device = 0;
        assert!(
            node_text(&n).contains("lanes           2 per device (receiving: transfer protocol rendezvous)")
        );
        n.transfer_protocol.clear();
        assert!(node_text(&n).contains("lanes           2 per device, chunks"));
    }

    #[test]
    fn describe_shows_the_inline_limits() {
        let mut n = NodeDescription {
            node_id: "a".into(),
            inline_max_bytes: 64 << 10,
            inline_window_bytes: 256 << 10,
            features: vec!["inline_small_transfers".into()],
            ..Default::default()
        };
        let text = node_text(&n);
        assert!(
            text.contains("inline          up to 64.00 KiB a transfer, 256.00 KiB unanswered per peer, host memory only\n"),
            "{text}"
        );
        n.inline_gpu = true;
        n.inline_gpu_in_flight = 2;
        assert!(
            node_text(&n).contains(", GPU memory too, 2 such unanswered per peer\n"),
            "{}",
            node_text(&n)
        );
        let j = node_json(&n);
        assert_eq!(j["inline_max_bytes"], 64 << 10);
        assert_eq!(j["inline_window_bytes"], 256 << 10);
        assert_eq!(j["inline_gpu"], true);
        assert_eq!(j["inline_gpu_in_flight"], 2);
        n.inline_max_bytes = 0;
        assert!(node_text(&n).contains("inline          off (transfer.inline_max_bytes 0)\n"));
        // Older daemons: no limits reported; the feature says whether they inline at all.
        n.inline_window_bytes = 0;
        assert!(node_text(&n).contains("inline          on (limits not reported by this daemon)\n"));
        n.features.clear();
        assert!(node_text(&n).contains("inline          off\n"));
    }
}
