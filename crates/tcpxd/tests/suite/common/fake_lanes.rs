//! The lanes a fake peer (a raw peer-service client, the hostile tests') must name to a daemon:
//! on a pairing that is not routed, the daemon's layout lanes (an offer's `first_lane` among
//! its rendezvous lanes, a header's among its eager lanes); on a routed one (either side has
//! GPUs: a daemon on the CUDA stand-in, or a fake peer announcing GPUs) the lanes of the memory
//! pair's group in the lane catalogue both sides build from the two topologies
//! (`engine::topology::LaneCatalogue`, `routes.rs`: since peer protocol 7 a routed pairing's
//! lanes are the catalogue's only, numbered from 0). Computed here from the handshake as the
//! daemon computes it, with the engine's own catalogue, so the hostile messages are built from
//! what the pairing really uses.

use tcpxd::api::proto::peer as ppb;
use tcpxd::engine::ROUTED_EAGER_PER_ROUTE;
use tcpxd::engine::topology::{LaneCatalogue, Memory, SummaryGpu, Topology, TopologySummary};

/// A fake peer's view of its pairing with a daemon (host memory on both sides).
#[derive(Debug, Clone)]
pub struct FakeLanes {
    /// Either side has GPUs: the pairing's lanes follow the memory pair.
    pub routed: bool,
    /// The daemon's receive lanes from the fake: its layout's (its handshake's), or on a routed
    /// pairing its catalogue's.
    pub lanes: u32,
    /// A rendezvous offer's `first_lane` from host memory to host memory.
    pub offer_lane: u32,
    /// The lanes such an offer's accept may name: the routed (host, host) group's rendezvous
    /// lanes, or the daemon's layout lanes.
    pub offer_lanes: std::ops::Range<u32>,
    /// An eager header's first lane into host memory, when the daemon's eager lanes start at
    /// `eager_first_lane` of its layout (its ReceiveMode's; 0 for an `eager` daemon).
    routed_eager: Option<u32>,
    /// The routed (host, host) group's eager lanes, first and end.
    routed_eager_end: Option<u32>,
}

/// A topology as the peer wire carries it.
fn topology(t: &ppb::PeerTopology) -> Topology {
    Topology::from_summary(&TopologySummary {
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
    })
    .expect("a topology the daemon announced")
}

/// A topology announcing `gpus` GPUs on one NIC (`eth0`), each GPU served by it: what a fake
/// peer sends to make its pairing routed on a daemon without GPUs.
pub fn gpu_topology(gpus: u32) -> ppb::PeerTopology {
    ppb::PeerTopology {
        nics: vec!["eth0".into()],
        gpus: (0..gpus)
            .map(|g| ppb::PeerTopologyGpu {
                ordinal: g,
                pci_bus_id: format!("0000:{:02x}:00.0", g + 4),
                nics: vec![0],
            })
            .collect(),
        lanes_per_route: 1,
    }
}

impl FakeLanes {
    /// From the fake's handshake and the daemon's answer. A handshake without a topology is a
    /// node without GPUs whose NICs are the devices its lanes name (as the daemon reads it).
    pub fn of(req: &ppb::HandshakeRequest, resp: &ppb::HandshakeResponse) -> FakeLanes {
        let daemon = resp.topology.as_ref().expect("the daemon announces its topology");
        let ours = req.topology.clone().unwrap_or_else(|| {
            let mut devices: Vec<i32> = req.lanes.iter().map(|l| l.device).collect();
            devices.sort_unstable();
            devices.dedup();
            ppb::PeerTopology {
                nics: devices.iter().map(|d| format!("device {d}")).collect(),
                gpus: Vec::new(),
                lanes_per_route: 1,
            }
        });
        let layout = resp.lanes.len() as u32;
        let routed = !(daemon.gpus.is_empty() && ours.gpus.is_empty());
        if req.topology.is_none()
            && let Some(want) = super::daemons::expect_routed()
        {
            assert_eq!(routed, want, "the daemon's GPUs: {daemon:?}");
        }
        if !routed {
            return FakeLanes {
                routed,
                lanes: layout,
                offer_lane: 0,
                offer_lanes: 0..layout,
                routed_eager: None,
                routed_eager_end: None,
            };
        }
        // The daemon receives: the catalogue from us (sender) to it, by its lanes per route.
        let c = LaneCatalogue::build(
            &topology(&ours),
            &topology(daemon),
            daemon.lanes_per_route,
            ROUTED_EAGER_PER_ROUTE,
        );
        let g = c.group(Memory::Host, Memory::Host).expect("host to host");
        FakeLanes {
            routed,
            lanes: c.lanes(),
            offer_lane: g.rendezvous.start,
            offer_lanes: g.rendezvous.clone(),
            routed_eager: Some(g.eager.start),
            routed_eager_end: Some(g.eager.end),
        }
    }

    /// An eager header's first lane into host memory: the routed group's first eager lane, or
    /// the layout's `eager_first_lane` (the daemon's ReceiveMode).
    pub fn header_lane(&self, eager_first_lane: u32) -> u32 {
        self.routed_eager.unwrap_or(eager_first_lane)
    }

    /// `first_lane`s no offer may name: past the daemon's lanes, and on a routed pairing its
    /// group's first and last eager lane (no rendezvous lane of a group).
    pub fn bad_offer_lanes(&self) -> Vec<u32> {
        let mut v = vec![self.lanes, self.lanes + 1, 1000.max(self.lanes + 2), u32::MAX];
        if self.routed {
            v.extend(self.routed_eager);
            v.extend(self.routed_eager_end.map(|e| e - 1));
        } else if self.lanes < 64 {
            v.push(64);
        }
        v.sort_unstable();
        v.dedup();
        v
    }
}
