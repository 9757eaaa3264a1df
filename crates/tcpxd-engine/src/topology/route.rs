//! Which lanes a transfer takes between two nodes' topologies: a GPU's bytes leave through its
//! NIC(s), with that GPU current on the send comm, and arrive on the destination GPU's NIC(s), on
//! a receive comm listened for under that GPU; host memory may use every NIC (its comms opened
//! under a GPU each NIC serves). Both sides compute the same routes from the same two
//! topologies (exchanged at pairing), so they agree on every lane without asking.

use super::Topology;

/// Where a transfer's bytes are on one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Memory {
    Host,
    /// On the GPU with this CUDA ordinal.
    Gpu(u32),
}

/// One end of a lane: a NIC (its position in that node's [`Topology::nics`]) and the GPU current
/// when its comm is opened (`None`: the node has no GPU for that NIC, nothing is made current).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub nic: usize,
    pub gpu: Option<u32>,
}

/// A lane: sent from `send` on the sending node, received at `recv` on the receiving node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Route {
    pub send: Endpoint,
    pub recv: Endpoint,
}

/// The ends memory may use on a node: a GPU's own NICs under that GPU; for host memory every
/// NIC, under the first GPU it serves (`Topology::listen_gpu`). Empty for a GPU the node does
/// not have.
fn ends(topo: &Topology, mem: Memory) -> Vec<Endpoint> {
    match mem {
        Memory::Gpu(g) => topo
            .nics_of(g)
            .iter()
            .map(|&nic| Endpoint { nic, gpu: Some(g) })
            .collect(),
        Memory::Host => (0..topo.nics.len())
            .map(|nic| Endpoint {
                nic,
                gpu: topo.listen_gpu(nic),
            })
            .collect(),
    }
}

/// The lanes from `src` on the sender (`sender`'s topology) to `dst` on the receiver: the
/// sender's ends paired with the receiver's in turn, as many lanes as the longer list (one GPU
/// with one NIC to one GPU with one NIC: one lane; host to host over four NICs each: four, NIC
/// i to NIC i). Empty when either side has no such GPU.
pub fn routes(sender: &Topology, receiver: &Topology, src: Memory, dst: Memory) -> Vec<Route> {
    let s = ends(sender, src);
    let r = ends(receiver, dst);
    if s.is_empty() || r.is_empty() {
        return Vec::new();
    }
    (0..s.len().max(r.len()))
        .map(|k| Route {
            send: s[k % s.len()],
            recv: r[k % r.len()],
        })
        .collect()
}
