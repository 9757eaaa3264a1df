//! A transfer's entries split per memory pair (issue #37): on a routed pairing a WRITE or READ
//! whose ranges lie in several memories on one side is sent as several parts, one per (source
//! memory, destination memory), so that each part takes only its own pair's lanes
//! (`routes.rs`) — GPU bytes never cross another GPU's NIC nor host bounce pages because a
//! neighbouring range of the same batch was elsewhere.
//!
//! - **What a part is.** One offer (WRITE) or read request (READ) of the transfer towards one
//!   peer, exactly as a transfer of one peer made it before: the peer sees ordinary offers and
//!   read requests, and chooses their lanes from their source and its destinations as for any
//!   other (credits or rendezvous by each part's own rules). A transfer already had one part
//!   per peer; it now has one per peer and memory pair, all under its one id.
//! - **Knowing the far side's memory.** This node knows its own buffers' memory. The peer's
//!   is known for the buffers it announced as GPU memory (`GpuCredits`, with `gpu_credits`);
//!   a peer with no GPU has host memory only. Any other peer buffer is a part of its own (one
//!   buffer is one memory), so each part's far side is one memory whatever it turns out to be,
//!   up to [`MAX_SPLIT_PARTS`] parts towards a peer (past that, such buffers share one part per
//!   local memory). A pairing that is not routed keeps one part per peer.
//! - **One transfer.** Progress counts each byte once (each byte is in one part); the first
//!   part to fail fails the transfer and cancels the others (`fail_transfer`), every slot and
//!   credit coming back as for any cancelled offer; one deadline and one cancel cover all.
//!   A pairing's transfer counters count the transfer once however many parts it has there.
//! - **Notification.** A WRITE with one part towards a peer carries it on its offer, as before.
//!   With several, no part carries it: it is kept and, once every part of the transfer finished
//!   OK, sent as [`PeerMsg::Notify`] naming the destination buffers (after every part's `Done`
//!   on the one ordered control stream, so the peer reads it after every byte landed), as a
//!   prepared transfer's is (`prepared/mod.rs`); dropped on failure or cancel.

use std::collections::HashSet;

use super::*;
use crate::topology::Memory;

/// The most parts towards one peer a transfer is split into by remote buffers of memory not
/// known here: a batch naming more such buffers (of one local memory) has them in one part
/// per local memory instead, which the peer receives as into host memory when they are in
/// several memories (GPU buffers it announced stay apart). Each part costs an offer (and an
/// accept) on the control stream: a batch over thousands of remote buffers must not cost
/// thousands.
pub const MAX_SPLIT_PARTS: usize = 64;

/// One side of a part: a memory known here, a peer buffer whose memory is not, or (past
/// [`MAX_SPLIT_PARTS`]) any peer buffer whose memory is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Side {
    Known(Memory),
    Buffer(u64),
    Unknown,
}

type PartKey = (PeerIdx, Side, Side);

impl Engine {
    /// The parts of a transfer: entry indices grouped by peer and, on a routed pairing, by
    /// memory pair; parts in order of first appearance, entries in order. The local side is
    /// a WRITE's source and a READ's destination: the key is the same for both.
    pub(super) fn group_by_route(&self, specs: &[EntrySpec]) -> Vec<(PeerIdx, Vec<usize>)> {
        // One peer, local buffer and remote buffer throughout (a one-entry batch, a plain
        // batch between two buffers): one part, whatever the keys, without the maps
        // (session 33, pollcpu: five allocations a transfer start fewer).
        if let Some(first) = specs.first()
            && specs.iter().all(|s| {
                (s.peer, s.local_buffer, s.remote.buffer_id)
                    == (first.peer, first.local_buffer, first.remote.buffer_id)
            })
        {
            return vec![(first.peer, (0..specs.len()).collect())];
        }
        let parts = self.group_parts(specs, &HashSet::new());
        let mut per_peer: HashMap<PeerIdx, usize> = HashMap::new();
        for ((p, _, _), _) in &parts {
            *per_peer.entry(*p).or_default() += 1;
        }
        let over: HashSet<PeerIdx> = per_peer
            .into_iter()
            .filter(|&(_, n)| n > MAX_SPLIT_PARTS)
            .map(|(p, _)| p)
            .collect();
        let parts = if over.is_empty() {
            parts
        } else {
            self.group_parts(specs, &over)
        };
        parts.into_iter().map(|((p, _, _), v)| (p, v)).collect()
    }

    /// Entries grouped by [`Engine::part_key`], the remote buffers of unknown memory of the
    /// peers in `collapse` taken as one.
    fn group_parts(&self, specs: &[EntrySpec], collapse: &HashSet<PeerIdx>) -> Vec<(PartKey, Vec<usize>)> {
        let mut parts: Vec<(PartKey, Vec<usize>)> = Vec::new();
        let mut index: HashMap<PartKey, usize> = HashMap::new();
        // A batch names the same peer and buffers many times in a row: the key of a run of the
        // same (peer, local buffer, remote buffer) is worked out once.
        let mut last: Option<((PeerIdx, u64, u64), usize)> = None;
        for (i, s) in specs.iter().enumerate() {
            let run = (s.peer, s.local_buffer, s.remote.buffer_id);
            let at = match last {
                Some((r, at)) if r == run => at,
                _ => {
                    let mut key = self.part_key(s);
                    if matches!(key.2, Side::Buffer(_)) && collapse.contains(&s.peer) {
                        key.2 = Side::Unknown;
                    }
                    let at = *index.entry(key).or_insert_with(|| {
                        parts.push((key, Vec::new()));
                        parts.len() - 1
                    });
                    last = Some((run, at));
                    at
                }
            };
            parts[at].1.push(i);
        }
        parts
    }

    /// The part an entry belongs to: its peer, its local memory and its remote side (both
    /// host memory on a pairing that is not routed).
    fn part_key(&self, s: &EntrySpec) -> PartKey {
        let host = Side::Known(Memory::Host);
        let Some(p) = self.peers.get(&s.peer).filter(|p| p.routes.is_some()) else {
            return (s.peer, host, host);
        };
        let local = Side::Known(self.memory_of(s.local_buffer));
        let peer_has_gpus = p.topology.as_ref().is_some_and(|t| !t.gpus.is_empty());
        let remote = if !peer_has_gpus {
            host
        } else {
            match p.gpu_dests.get(&s.remote.buffer_id) {
                Some(Some(gpu)) => Side::Known(Memory::Gpu(*gpu)),
                Some(None) => host,
                None => Side::Buffer(s.remote.buffer_id),
            }
        };
        (s.peer, local, remote)
    }

    /// A WRITE's notification for `peer`, whose entries are in `parts` parts: carried on the
    /// offer (returned) when there is one part; otherwise kept until the transfer finished OK
    /// (the module's doc), naming the destination buffers once each, in order.
    pub(super) fn split_notification(
        &mut self,
        id: TransferId,
        peer: PeerIdx,
        parts: usize,
        notification: &[u8],
        buffers: impl Iterator<Item = u64>,
    ) -> Vec<u8> {
        if parts <= 1 || notification.is_empty() {
            return notification.to_vec();
        }
        let mut seen = std::collections::HashSet::new();
        let buffers = buffers.filter(|b| seen.insert(*b)).collect();
        self.keep_notice(id, peer, notification.to_vec(), Vec::new(), buffers);
        Vec::new()
    }
}
