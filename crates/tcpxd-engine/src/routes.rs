//! Rendezvous lanes chosen by the memory pair (issue #37): a transfer from memory `src` on the
//! sender to `dst` on the receiver goes only on the lanes of its group in the pairing's lane
//! catalogue ([`LaneCatalogue`], `topology/catalogue.rs`), each lane a route — sent on the
//! source GPU's NIC under that GPU, received on the destination GPU's NIC under that GPU.
//!
//! # Lane numbering
//!
//! A routed pairing's lanes are the catalogue's only (peer protocol 7): lane `k` each way is
//! catalogue lane `k`. The receiver's layout (its handshake's lane list, and under `auto` the
//! split its `ReceiveMode` announces) still says how it receives — whether it keeps credits —
//! but its lanes are neither allocated, opened, listed nor exported on a routed pairing; before
//! protocol 7 they came first (`0..layout`) and were never used. Both sides compute the
//! catalogue from the same two topologies (exchanged at pairing) and the receiver's
//! `lanes_per_route` (its `lanes_per_device`, announced with its topology), so lane `L` is the
//! same route on both sides: see the catalogue's module doc.
//!
//! # Who picks the group
//!
//! The sender knows its source memory, the receiver its destination's. So a routed offer's
//! `first_lane` names a lane of a group whose source is the offer's source memory (the first
//! lane of `(src, Host)`); the receiver takes `src` from it, `dst` from its destination buffers,
//! picks the first lane inside group `(src, dst)`'s rendezvous lanes and names it in its
//! `Accept`; it queues its receives on that group's lanes, and the sender queues its sends on
//! the same lanes when the accept arrives (the same `ChunkPlan` from the same inputs). An accept
//! naming a lane outside a group of the offer's source is a protocol violation. A transfer
//! whose ranges lie in more than one memory on a side is split into parts of one memory pair
//! each (`route_parts.rs`); an offer that still has several (a peer buffer whose memory the
//! sender could not know is a part of its own, so only an offer from another implementation)
//! counts as host memory there (host routes use every NIC, each comm opened under a GPU that
//! NIC serves).
//!
//! # Eager (credit) transfers
//!
//! Each group also has [`ROUTED_EAGER_PER_ROUTE`] eager lanes per route after its rendezvous
//! lanes. A receiver that keeps credits (auto, eager) posts them on each such lane when it opens,
//! as on the layout's eager lanes, and the sender holds the credits its `ReceiveMode` announced
//! on each; they land in the route's destination GPU with GPU credits (the lane's receive GPU
//! is the destination GPU), in host slots for a host destination. The sender picks the group
//! without a round trip: its source memory, and the destination memory it learned from the
//! receiver's `GpuCredits` (each GPU buffer's ordinal; a buffer not announced is host memory);
//! the header's `first_lane` names a lane of that group's eager lanes. The receiver checks the
//! lane is an eager lane of a group whose destination is host memory or the destinations' GPU
//! (host when it cannot tell) and fails the pairing otherwise, as for accepts. Whether a side
//! keeps credits at all is its layout's split (its `ReceiveMode`): a routed eager lane keeps
//! credits when the receiver's layout has eager lanes. Without a topology on this node, or with
//! no GPU on either side, a pairing is not routed: its lanes are the layout's, as before.

use super::*;
use crate::topology::{LaneCatalogue, Memory, Route, Topology};

/// The most routed lanes a direction of a pairing may have (8 GPUs over 4 NICs with 2 + 2 lanes per
/// route: 528); a pairing whose topologies would need more is refused.
pub const MAX_ROUTED_LANES: u32 = 4096;

/// Eager lanes per route of every memory pair. Two, as the rendezvous lanes a route has by
/// default: with GPU credits a large transfer into GPU memory runs on these, and on the H200 one
/// lane held 256 MiB at 0.85x the raw path's rate where two reached 0.96-0.99x (session 18,
/// docs/BENCHMARKS.md). Both sides use this constant: no handshake field. They are opened only
/// when used.
pub const ROUTED_EAGER_PER_ROUTE: u32 = 2;

/// Why a routed offer is refused: the code and the message.
pub(crate) type Refusal = (Code, String);

/// A routed pairing's two catalogues: its lanes each way.
#[derive(Debug, Clone)]
pub(crate) struct PeerRoutes {
    /// Our send lanes' (to the peer).
    out: LaneCatalogue,
    /// Our receive lanes' (from the peer).
    inn: LaneCatalogue,
}

/// The memory all of `buffers` are in, or host memory when they are in more than one.
fn common_memory(mems: impl Iterator<Item = Memory>) -> Memory {
    let mut it = mems;
    let Some(first) = it.next() else {
        return Memory::Host;
    };
    if it.all(|m| m == first) {
        first
    } else {
        Memory::Host
    }
}

impl PeerRoutes {
    /// Whether our send lane `lane` is a routed eager lane.
    pub(crate) fn send_eager(&self, lane: u32) -> bool {
        self.out.is_eager(lane)
    }

    /// The memory pair of our send lane `lane`'s group (`None`: past the catalogue).
    pub(crate) fn send_memory(&self, lane: u32) -> Option<(Memory, Memory)> {
        let g = self.out.group_of(lane)?;
        Some((g.src, g.dst))
    }

    /// The memory pair of our receive lane `lane`'s group (`None`: past the catalogue).
    pub(crate) fn recv_memory(&self, lane: u32) -> Option<(Memory, Memory)> {
        let g = self.inn.group_of(lane)?;
        Some((g.src, g.dst))
    }

    /// Whether our receive lane `lane` is a routed eager lane.
    pub(crate) fn recv_eager(&self, lane: u32) -> bool {
        self.inn.is_eager(lane)
    }
}

impl Peer {
    /// Whether our send lane `lane` is towards the peer's credits: one of the layout's eager
    /// lanes, or on a routed pairing a routed eager lane of a peer that keeps credits.
    pub(crate) fn send_lane_eager(&self, lane: u32) -> bool {
        let (_, eager) = self.send_split();
        match &self.routes {
            Some(r) => !eager.is_empty() && r.send_eager(lane),
            None => eager.contains(&lane),
        }
    }

    /// Whether our receive lane `lane` keeps credits: one of the layout's eager lanes, or on a
    /// routed pairing a routed eager lane when this node keeps credits.
    pub(crate) fn recv_lane_eager(&self, lane: u32) -> bool {
        let (_, eager) = self.recv_split();
        match &self.routes {
            Some(r) => !eager.is_empty() && r.recv_eager(lane),
            None => eager.contains(&lane),
        }
    }
}

impl Engine {
    /// This node's topology: pairings added with [`Engine::add_peer_routed`] route their
    /// rendezvous lanes by it.
    pub fn set_topology(&mut self, topology: Topology) {
        self.topology = Some(topology);
    }

    /// Where a buffer's memory is (host memory unless said otherwise; set once, at registration):
    /// picks a routed pairing's lanes, and GPU memory is told to peers when `gpu_credits` is on,
    /// so their transfers into it may take credits at any size (`streams.rs`). Unknown ids:
    /// nothing.
    pub fn set_buffer_memory(&mut self, id: u64, memory: Memory) {
        let Some(b) = self.buffers.get_mut(&id) else {
            return;
        };
        b.memory = memory;
        if let Memory::Gpu(gpu) = memory {
            self.announce_gpu_buffer(id, gpu);
        }
    }

    /// A pairing whose lanes follow the memory pair. `send_lanes` / `recv_lanes`: the layout
    /// lanes, as [`Engine::add_peer`] (on a routed pairing they say only how each side
    /// receives: its lanes are the catalogue's, `routes.rs`); `peer_topology` and
    /// `peer_lanes_per_route` what the peer announced at pairing. Not routed (as `add_peer`)
    /// without a topology here or with no GPU on either side.
    pub fn add_peer_routed(
        &mut self,
        node_id: &str,
        send_lanes: u32,
        recv_lanes: u32,
        peer_topology: Topology,
        peer_lanes_per_route: u32,
    ) -> Result<PeerIdx, String> {
        let routes = match &self.topology {
            Some(own) if !(own.gpus.is_empty() && peer_topology.gpus.is_empty()) => Some(PeerRoutes {
                out: LaneCatalogue::build(own, &peer_topology, peer_lanes_per_route, ROUTED_EAGER_PER_ROUTE),
                inn: LaneCatalogue::build(
                    &peer_topology,
                    own,
                    self.cfg.lanes_per_device,
                    ROUTED_EAGER_PER_ROUTE,
                ),
            }),
            _ => None,
        };
        let (routed_send, routed_recv) = routes.as_ref().map_or((0, 0), |r| (r.out.lanes(), r.inn.lanes()));
        if routed_send.max(routed_recv) > MAX_ROUTED_LANES {
            return Err(format!(
                "the two topologies ({} and {} GPUs, {} and {} NICs) need {} routed lanes a direction, more than {MAX_ROUTED_LANES}",
                self.topology.as_ref().map_or(0, |t| t.gpus.len()),
                peer_topology.gpus.len(),
                self.topology.as_ref().map_or(0, |t| t.nics.len()),
                peer_topology.nics.len(),
                routed_send.max(routed_recv)
            ));
        }
        // A routed pairing has the catalogue's lanes only: the layout's would never be used.
        let (send_alloc, recv_alloc) = match &routes {
            Some(_) => (routed_send, routed_recv),
            None => (send_lanes, recv_lanes),
        };
        let idx = self.add_peer_lanes(node_id, send_lanes, recv_lanes, send_alloc, recv_alloc);
        let p = &mut self.peers[&idx];
        p.routes = routes;
        p.topology = Some(peer_topology);
        Ok(idx)
    }

    /// A pairing's lane counts (send, receive): the layout's, or on a routed pairing the
    /// catalogue's.
    pub fn lane_counts(&self, peer: PeerIdx) -> (u32, u32) {
        self.peers
            .get(&peer)
            .map_or((0, 0), |p| (p.send.len() as u32, p.recv.len() as u32))
    }

    /// A send lane's route (`None`: the pairing is not routed).
    pub fn send_lane_route(&self, peer: PeerIdx, lane: u32) -> Option<Route> {
        let r = self.peers.get(&peer)?.routes.as_ref()?;
        r.out.route(lane)
    }

    /// A receive lane's route (`None`: the pairing is not routed).
    pub fn recv_lane_route(&self, peer: PeerIdx, lane: u32) -> Option<Route> {
        let r = self.peers.get(&peer)?.routes.as_ref()?;
        r.inn.route(lane)
    }

    /// The destination memory of a routed receive lane's group (`None`: the pairing is not routed): a credit lane into host memory lands in host slots.
    pub fn recv_lane_memory(&self, peer: PeerIdx, lane: u32) -> Option<Memory> {
        let r = self.peers.get(&peer)?.routes.as_ref()?;
        r.inn.group_of(lane).map(|g| g.dst)
    }

    /// Sender: the `first_lane` a routed rendezvous offer carries (naming its source memory),
    /// `None` for a pairing that is not routed.
    pub(crate) fn routed_offer_lane(&self, peer: PeerIdx, sources: &[(u64, u64)]) -> Option<u32> {
        let r = self.peers.get(&peer)?.routes.as_ref()?;
        let src = common_memory(sources.iter().map(|(b, _)| self.memory_of(*b)));
        let g = r.out.group(src, Memory::Host).ok()?;
        Some(g.rendezvous.start)
    }

    /// Receiver: the lanes and first lane of a routed offer to these destinations (`None`: the
    /// pairing is not routed). The error is the code and reason to refuse it: a `first_lane`
    /// that names no rendezvous lane is invalid (as on the layout), a memory pair without lanes
    /// a failed precondition.
    pub(crate) fn routed_recv_lanes(
        &mut self,
        peer: PeerIdx,
        first_lane: u32,
        dests: &[(u64, u64)],
        chunks: u64,
    ) -> Result<Option<(u32, Range<u32>)>, Refusal> {
        let dst = common_memory(dests.iter().map(|(b, _)| self.memory_of(*b)));
        let p = &mut self.peers[&peer];
        let Some(r) = p.routes.as_ref() else {
            return Ok(None);
        };
        let src = r
            .inn
            .group_of(first_lane)
            .filter(|g| g.rendezvous.contains(&first_lane))
            .map(|g| g.src)
            .ok_or_else(|| {
                (
                    Code::InvalidArgument,
                    format!(
                        "first_lane {first_lane} is not a rendezvous lane of the routed lanes 0..{}",
                        r.inn.lanes()
                    ),
                )
            })?;
        let g = r
            .inn
            .group(src, dst)
            .map_err(|e| (Code::FailedPrecondition, e.to_string()))?;
        let lanes = g.rendezvous.clone();
        let count = lanes.end - lanes.start;
        let at = p.next_routed_lane % count;
        p.next_routed_lane = ((u64::from(at) + chunks) % u64::from(count)) as u32;
        Ok(Some((lanes.start + at, lanes)))
    }

    /// Sender: the lanes of an accepted routed offer, from the first lane the receiver chose
    /// (`Ok(None)`: not routed, the offer's own lanes stand). The error is a protocol violation.
    pub(crate) fn routed_send_lanes(
        &self,
        peer: PeerIdx,
        sources: &[(u64, u64)],
        chosen: Option<u32>,
    ) -> Result<Option<(u32, Range<u32>)>, String> {
        let Some(r) = self.peers.get(&peer).and_then(|p| p.routes.as_ref()) else {
            return Ok(None);
        };
        let src = common_memory(sources.iter().map(|(b, _)| self.memory_of(*b)));
        let lane = chosen.ok_or("an accept of a routed offer names no first lane")?;
        let g = r
            .out
            .group_of(lane)
            .filter(|g| g.rendezvous.contains(&lane))
            .filter(|g| g.src == src)
            .ok_or_else(|| {
                format!(
                    "accepted first lane {lane} is not a rendezvous lane of the offer's source memory {src:?}"
                )
            })?;
        Ok(Some((lane, g.rendezvous.clone())))
    }

    /// Sender: the eager lanes of an eager transfer from `sources` to the peer's buffers named in
    /// `ranges` (`None`: the pairing is not routed, the layout's eager lanes stand). The
    /// destination memory is what the peer announced (`GpuCredits`), host memory otherwise.
    pub(crate) fn routed_eager_send_lanes(
        &self,
        peer: PeerIdx,
        sources: &[(u64, u64)],
        ranges: &Ranges,
    ) -> Option<Range<u32>> {
        let p = self.peers.get(&peer)?;
        let r = p.routes.as_ref()?;
        let src = common_memory(sources.iter().map(|(b, _)| self.memory_of(*b)));
        let dst = common_memory(ranges.buffers().map(|d| {
            p.gpu_dests
                .get(&d)
                .copied()
                .flatten()
                .map_or(Memory::Host, Memory::Gpu)
        }));
        let g = r
            .out
            .group(src, dst)
            .or_else(|_| r.out.group(src, Memory::Host))
            .or_else(|_| r.out.group(Memory::Host, Memory::Host))
            .ok()?;
        Some(g.eager.clone())
    }

    /// Receiver: the eager lanes a routed header's chunks take (`Ok(None)`: the pairing is not
    /// routed, the layout's eager lanes stand). `first_lane` must be an eager lane of a group
    /// whose destination is host memory or the destinations' own memory (any group when one
    /// of them is not a buffer here: the header is refused and its chunks consumed unpacked).
    /// The error is a protocol violation.
    pub(crate) fn routed_eager_recv_lanes(
        &self,
        peer: PeerIdx,
        first_lane: u32,
        ranges: &Ranges,
    ) -> Result<Option<Range<u32>>, String> {
        let Some(r) = self.peers.get(&peer).and_then(|p| p.routes.as_ref()) else {
            return Ok(None);
        };
        let unknown = ranges.buffers().any(|d| !self.buffers.contains_key(&d));
        let dst = common_memory(ranges.buffers().map(|d| self.memory_of(d)));
        let g = Some(first_lane)
            .filter(|&k| r.inn.is_eager(k))
            .and_then(|k| r.inn.group_of(k))
            .filter(|g| unknown || g.dst == Memory::Host || g.dst == dst)
            .ok_or_else(|| {
                format!(
                    "first_lane {first_lane} is not an eager lane of a routed group into {dst:?} or host memory"
                )
            })?;
        Ok(Some(g.eager.clone()))
    }

    pub(crate) fn memory_of(&self, buffer: u64) -> Memory {
        self.buffers.get(&buffer).map_or(Memory::Host, |b| b.memory)
    }
}
