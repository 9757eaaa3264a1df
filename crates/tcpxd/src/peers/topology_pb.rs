//! The topology a node announces at pairing (`PeerTopology` in the handshake, fields 10): its
//! NICs and each GPU's NICs, from which both sides plan the lanes of each memory pair
//! (`engine::topology::LaneCatalogue`).

use crate::api::proto::peer as pb;
use crate::engine::topology::{SummaryGpu, Topology, TopologySummary};
use crate::poller::{LaneInfo, PeerTopology};

/// The most lanes per route a peer may announce.
const MAX_LANES_PER_ROUTE: u32 = 64;

/// The node's topology as sent to peers, with its lanes per route as a receiver.
pub(super) fn topology_to_pb(t: &Topology, lanes_per_route: u32) -> pb::PeerTopology {
    let s = t.summary();
    pb::PeerTopology {
        lanes_per_route,
        nics: s.nics,
        gpus: s
            .gpus
            .into_iter()
            .map(|g| pb::PeerTopologyGpu {
                ordinal: g.ordinal,
                pci_bus_id: g.pci_bus_id,
                nics: g.nics,
            })
            .collect(),
    }
}

/// The peer's topology from its handshake, checked (the message names the field). A handshake
/// without one describes a node without GPUs whose NICs are the devices its lanes name, with
/// its lanes spread evenly over them.
pub(super) fn topology_from_pb(
    t: Option<&pb::PeerTopology>,
    lanes: &[LaneInfo],
) -> Result<PeerTopology, String> {
    if let Some(t) = t
        && !(1..=MAX_LANES_PER_ROUTE).contains(&t.lanes_per_route)
    {
        return Err(format!(
            "topology.lanes_per_route: {} (1 to {MAX_LANES_PER_ROUTE} allowed)",
            t.lanes_per_route
        ));
    }
    let summary = match t {
        Some(t) => TopologySummary {
            nics: t.nics.clone(),
            gpus: t
                .gpus
                .iter()
                .map(|g| SummaryGpu {
                    ordinal: g.ordinal,
                    pci_bus_id: g.pci_bus_id.clone(),
                    nics: g.nics.clone(),
                })
                .collect(),
        },
        None => {
            let mut devices: Vec<i32> = lanes.iter().map(|l| l.device).collect();
            devices.sort_unstable();
            devices.dedup();
            TopologySummary {
                nics: devices.iter().map(|d| format!("device {d}")).collect(),
                gpus: Vec::new(),
            }
        }
    };
    let lanes_per_route = match t {
        Some(t) => t.lanes_per_route,
        None => (lanes.len() / summary.nics.len().max(1)).clamp(1, MAX_LANES_PER_ROUTE as usize) as u32,
    };
    Ok(PeerTopology {
        topology: Topology::from_summary(&summary)?,
        lanes_per_route,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(gpus: u32, nics: i32) -> Topology {
        Topology::synthetic(gpus, nics).unwrap()
    }

    #[test]
    fn a_topology_survives_the_wire() {
        let t = node(8, 4);
        let back = topology_from_pb(Some(&topology_to_pb(&t, 3)), &[]).unwrap();
        assert_eq!(back.topology.summary(), t.summary());
        assert_eq!(back.lanes_per_route, 3);
    }

    #[test]
    fn without_one_the_peer_has_the_devices_of_its_lanes_and_no_gpus() {
        let lanes: Vec<LaneInfo> = (0..6)
            .map(|i| LaneInfo {
                lane: i,
                device: (i % 2) as i32,
            })
            .collect();
        let t = topology_from_pb(None, &lanes).unwrap();
        assert_eq!(
            (t.topology.nics.len(), t.topology.gpus.len(), t.lanes_per_route),
            (2, 0, 3)
        );
    }

    #[test]
    fn a_bad_one_is_refused_naming_the_field() {
        let mut pb = topology_to_pb(&node(2, 2), 2);
        pb.gpus[1].nics = vec![7];
        let e = topology_from_pb(Some(&pb), &[]).unwrap_err();
        assert!(e.starts_with("topology.gpus[1].nics"), "{e}");
        let e = topology_from_pb(Some(&topology_to_pb(&node(2, 2), 0)), &[]).unwrap_err();
        assert!(e.starts_with("topology.lanes_per_route: 0"), "{e}");
    }
}
