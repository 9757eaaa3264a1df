//! The lanes of one direction of a pairing, by memory pair: the lane catalogue.
//!
//! A transfer from memory `src` on the sending node to memory `dst` on the receiving node may
//! use only the lanes of its group `(src, dst)`: `per_route` rendezvous lanes for each of
//! [`routes`]`(sender, receiver, src, dst)` and `eager_per_route` eager (credit) lanes per route
//! after them (their credit receives land in the route's destination GPU with GPU credits, else
//! in host slots: `crate::routes`). A group's lanes are consecutive lane numbers, each lane's
//! route the group's routes taken in turn, so a chunk plan rotating over a group's range spreads its chunks over the routes' NICs
//! exactly as today's layout spreads them over devices.
//!
//! # Why both sides agree on every lane
//!
//! The catalogue is a function of four values only: the sender's topology, the receiver's
//! topology (each node's own, and the peer's as exchanged at pairing, [`TopologySummary`]) and
//! the receiver's `per_route` (announced in its handshake like its lane count today) and
//! `eager_per_route` (`crate::routes::ROUTED_EAGER_PER_ROUTE`, the same on every node). The
//! sender builds it for its send lanes as `build(own, peer's, …)`, the
//! receiver for its receive lanes as `build(peer's, own, …)`: the same arguments in the same
//! places. Groups are laid out in a fixed order — sources Host then the sender's GPUs by
//! ordinal, for each the destinations Host then the receiver's GPUs by ordinal — and
//! [`routes`] is deterministic, so lane `L` has the same group, kind and route on both sides and
//! an offer or header needs no new field: its first lane names the group. A summary survives
//! the wire unchanged ([`Topology::summary`] / [`Topology::from_summary`] round-trip the parts
//! routes read: NIC count, GPU ordinals, each GPU's NICs), which a unit test checks.
//!
//! Lanes open on first use (`lane_life`), so a pair of 8-GPU nodes with 8 × 8 GPU groups opens
//! only the groups its transfers use. Nodes without GPUs have one group `(Host, Host)`; with the
//! same NIC count on both sides its lanes are today's layout (lane `i` on NIC `i % nics`).

use std::ops::Range;

use super::{Binding, GpuInfo, Memory, NicInfo, Route, Topology, routes};

/// Largest topology a peer may announce: NICs and GPUs.
pub const MAX_SUMMARY_NICS: usize = 64;
pub const MAX_SUMMARY_GPUS: usize = 64;

/// What a node tells its peer of its topology at pairing: what [`routes`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologySummary {
    /// The NICs in use, in the node's order (their names, for messages).
    pub nics: Vec<String>,
    /// Each GPU: ordinal, PCI bus id (for messages) and its NICs (positions in `nics`).
    pub gpus: Vec<SummaryGpu>,
}

/// One GPU of a [`TopologySummary`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummaryGpu {
    pub ordinal: u32,
    pub pci_bus_id: String,
    pub nics: Vec<u32>,
}

impl Topology {
    /// The summary sent to peers.
    pub fn summary(&self) -> TopologySummary {
        TopologySummary {
            nics: self.nics.iter().map(|n| n.name.clone()).collect(),
            gpus: self
                .gpus
                .iter()
                .zip(&self.bindings)
                .map(|(g, b)| SummaryGpu {
                    ordinal: g.ordinal,
                    pci_bus_id: g.pci_bus_id.clone(),
                    nics: b.nics.iter().map(|&n| n as u32).collect(),
                })
                .collect(),
        }
    }

    /// A peer's topology from its summary, checked: 1 to 64 NICs, at most 64 GPUs with distinct
    /// ordinals, each with 1 to 64 NICs among those announced. The message names the field.
    pub fn from_summary(s: &TopologySummary) -> Result<Topology, String> {
        if s.nics.is_empty() || s.nics.len() > MAX_SUMMARY_NICS {
            return Err(format!(
                "topology.nics: {} NICs (1 to {MAX_SUMMARY_NICS} allowed)",
                s.nics.len()
            ));
        }
        if s.gpus.len() > MAX_SUMMARY_GPUS {
            return Err(format!(
                "topology.gpus: {} GPUs (at most {MAX_SUMMARY_GPUS} allowed)",
                s.gpus.len()
            ));
        }
        let mut gpus = Vec::with_capacity(s.gpus.len());
        let mut bindings = Vec::with_capacity(s.gpus.len());
        for (i, g) in s.gpus.iter().enumerate() {
            if s.gpus[..i].iter().any(|o| o.ordinal == g.ordinal) {
                return Err(format!("topology.gpus[{i}]: GPU {} twice", g.ordinal));
            }
            if g.nics.is_empty() || g.nics.len() > MAX_SUMMARY_NICS {
                return Err(format!(
                    "topology.gpus[{i}].nics: {} NICs (1 to {MAX_SUMMARY_NICS} allowed)",
                    g.nics.len()
                ));
            }
            if let Some(n) = g.nics.iter().find(|&&n| n as usize >= s.nics.len()) {
                return Err(format!(
                    "topology.gpus[{i}].nics: NIC {n} is not one of the {} announced",
                    s.nics.len()
                ));
            }
            gpus.push(GpuInfo {
                ordinal: g.ordinal,
                pci_bus_id: g.pci_bus_id.clone(),
                place: None,
            });
            bindings.push(Binding {
                nics: g.nics.iter().map(|&n| n as usize).collect(),
                relation: "peer".into(),
            });
        }
        let nics = s
            .nics
            .iter()
            .enumerate()
            .map(|(i, name)| NicInfo {
                device: i as i32,
                name: name.clone(),
                pci_path: None,
                place: None,
            })
            .collect();
        Ok(Topology {
            source: if gpus.is_empty() { "none" } else { "peer" },
            gpus,
            nics,
            bindings,
        })
    }
}

/// The lanes of one memory pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneGroup {
    pub src: Memory,
    pub dst: Memory,
    /// The routes its lanes take, in turn.
    pub routes: Vec<Route>,
    /// Its rendezvous lanes (`per_route` × routes).
    pub rendezvous: Range<u32>,
    /// Its eager lanes (`eager_per_route` × routes).
    pub eager: Range<u32>,
}

/// Why a memory pair has no lanes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CatalogueError {
    #[error("GPU {gpu} is not one of the {side}'s GPUs ({known})")]
    UnknownGpu {
        side: &'static str,
        gpu: u32,
        known: String,
    },
}

/// One direction's lanes, grouped by memory pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneCatalogue {
    groups: Vec<LaneGroup>,
    /// Each lane's route, by lane number.
    lanes: Vec<Route>,
    /// Whether each lane is an eager lane, by lane number.
    eager: Vec<bool>,
    sender_gpus: Vec<u32>,
    receiver_gpus: Vec<u32>,
}

fn memories(t: &Topology) -> impl Iterator<Item = Memory> + '_ {
    std::iter::once(Memory::Host).chain(t.gpus.iter().map(|g| Memory::Gpu(g.ordinal)))
}

fn ordinals(t: &Topology) -> Vec<u32> {
    let mut v: Vec<u32> = t.gpus.iter().map(|g| g.ordinal).collect();
    v.sort_unstable();
    v
}

impl LaneCatalogue {
    /// The catalogue of the lanes from `sender` to `receiver` (see the module doc for the order).
    /// `per_route` is at least 1.
    pub fn build(
        sender: &Topology,
        receiver: &Topology,
        per_route: u32,
        eager_per_route: u32,
    ) -> LaneCatalogue {
        let per_route = per_route.max(1);
        let (mut s_mem, mut r_mem): (Vec<Memory>, Vec<Memory>) =
            (memories(sender).collect(), memories(receiver).collect());
        s_mem[1..].sort_unstable_by_key(|m| match m {
            Memory::Gpu(g) => *g,
            Memory::Host => 0,
        });
        r_mem[1..].sort_unstable_by_key(|m| match m {
            Memory::Gpu(g) => *g,
            Memory::Host => 0,
        });
        let mut groups = Vec::new();
        let mut lanes = Vec::new();
        let mut eager_lanes = Vec::new();
        for &src in &s_mem {
            for &dst in &r_mem {
                let rs = routes(sender, receiver, src, dst);
                let n = rs.len() as u32;
                let start = lanes.len() as u32;
                let rendezvous = start..start + per_route * n;
                let eager_count = eager_per_route * n;
                let eager = rendezvous.end..rendezvous.end + eager_count;
                for k in 0..(per_route * n + eager_count) {
                    lanes.push(rs[(k % n) as usize]);
                    eager_lanes.push(k >= per_route * n);
                }
                groups.push(LaneGroup {
                    src,
                    dst,
                    routes: rs,
                    rendezvous,
                    eager,
                });
            }
        }
        LaneCatalogue {
            groups,
            lanes,
            eager: eager_lanes,
            sender_gpus: ordinals(sender),
            receiver_gpus: ordinals(receiver),
        }
    }

    /// Lanes in all (the direction's lane count).
    pub fn lanes(&self) -> u32 {
        self.lanes.len() as u32
    }

    /// Every group, in lane order.
    pub fn groups(&self) -> &[LaneGroup] {
        &self.groups
    }

    /// A lane's route (`None` past the last lane).
    pub fn route(&self, lane: u32) -> Option<Route> {
        self.lanes.get(lane as usize).copied()
    }

    /// Whether a lane is one of its group's eager lanes.
    pub fn is_eager(&self, lane: u32) -> bool {
        self.eager.get(lane as usize).copied().unwrap_or(false)
    }

    /// The group a lane belongs to.
    pub fn group_of(&self, lane: u32) -> Option<&LaneGroup> {
        self.groups
            .iter()
            .find(|g| g.rendezvous.contains(&lane) || g.eager.contains(&lane))
    }

    /// The lanes of memory pair `(src, dst)`; an error names a GPU either side lacks.
    pub fn group(&self, src: Memory, dst: Memory) -> Result<&LaneGroup, CatalogueError> {
        for (side, mem, known) in [
            ("sender", src, &self.sender_gpus),
            ("receiver", dst, &self.receiver_gpus),
        ] {
            if let Memory::Gpu(g) = mem
                && !known.contains(&g)
            {
                let known = if known.is_empty() {
                    "it has none".to_string()
                } else {
                    known.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                };
                return Err(CatalogueError::UnknownGpu { side, gpu: g, known });
            }
        }
        Ok(self
            .groups
            .iter()
            .find(|g| g.src == src && g.dst == dst)
            .expect("every known memory pair has a group"))
    }
}
