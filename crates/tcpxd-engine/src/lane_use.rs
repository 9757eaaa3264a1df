//! The lanes of a pairing that are in use, so that the work done per event and per pass is
//! proportional to them rather than to the pairing's lane count.
//!
//! A routed pairing has the catalogue's lanes (`routes.rs`): with eight GPUs and host memory on
//! each side, 81 memory pairs of four lanes each, up to 528 a direction on A3's four NICs. A
//! transfer uses its memory pair's lanes only, so a workload between two GPUs touches four of
//! them; yet `pump` (after every completion, credit return and start), `lanes_idle` (every
//! poller pass) and the credits owed (every batch of actions) walked every lane. On the CUDA
//! stand-in's eight GPUs (324 lanes a direction), with 8 transfers of 4 or 64 KiB in flight,
//! walking the lanes in use took ~15% off the daemon's p50 (docs/BENCHMARKS.md, "Session 23,
//! gpu-inflight").
//!
//! [`LanesInUse`] lists each direction's lanes that have ever held work on this pairing: a lane
//! is marked when a chunk is queued on it, a header's chunk announced on it, or it is opened.
//! The list only grows (a pairing's lanes in use are few; a new pairing starts empty), so no
//! lane with work can be missed by a removal. Every scan that looks for work walks the list;
//! what only counts or reports (GetStats, the pairing's idle scan) still walks every lane. The
//! lane scan (`tick_lanes`, every 100 ms) checks the list is complete: a lane with work that is
//! not marked is marked then (and is a bug, asserted in debug builds).

/// One direction's lanes in use, in the order they were first used.
#[derive(Debug, Clone, Default)]
pub(crate) struct LanesInUse {
    list: Vec<u32>,
    marked: Vec<bool>,
}

impl LanesInUse {
    /// Marks `lane` in use (again: nothing changes). True when it was not marked before.
    pub(crate) fn mark(&mut self, lane: u32) -> bool {
        let i = lane as usize;
        if i >= self.marked.len() {
            self.marked.resize(i + 1, false);
        }
        if self.marked[i] {
            return false;
        }
        self.marked[i] = true;
        self.list.push(lane);
        true
    }

    /// The lanes in use, in the order they were first used.
    pub(crate) fn lanes(&self) -> &[u32] {
        &self.list
    }
}

impl super::Lane {
    /// Whether the lane holds anything a scan for work must see: chunks queued or posted, a
    /// header's chunks announced, data landed or being unpacked, credits owed, or a comm.
    pub(crate) fn has_work(&self) -> bool {
        !self.queue.is_empty()
            || !self.posted.is_empty()
            || !self.targets.is_empty()
            || !self.landed.is_empty()
            || !self.unpacking.is_empty()
            || self.recv_credits.owed() > 0
            || self.life != crate::lane_life::Life::Closed
    }
}

impl super::Peer {
    /// Marks our send (`send`) or receive lane `lane` in use; a lane the pairing does not have
    /// is not listed.
    pub(crate) fn mark_used(&mut self, lane: u32, send: bool) {
        let (n, used) = if send {
            (self.send.len(), &mut self.send_used)
        } else {
            (self.recv.len(), &mut self.recv_used)
        };
        if (lane as usize) < n {
            used.mark(lane);
        }
    }

    /// The lanes of both directions that held work.
    pub(crate) fn lanes_in_use(&self) -> impl Iterator<Item = &super::Lane> {
        let send = self.send_used.lanes().iter().map(|&i| &self.send[i as usize]);
        send.chain(self.recv_used.lanes().iter().map(|&i| &self.recv[i as usize]))
    }

    /// Marks every lane with work that is not marked yet (the lane scan's check), returning how
    /// many were missing: always 0 unless a path that gives a lane work forgot to mark it.
    pub(crate) fn mark_lanes_with_work(&mut self) -> usize {
        let mut missing = 0;
        for (i, l) in self.send.iter().enumerate() {
            if l.has_work() && self.send_used.mark(i as u32) {
                missing += 1;
            }
        }
        for (i, l) in self.recv.iter().enumerate() {
            if l.has_work() && self.recv_used.mark(i as u32) {
                missing += 1;
            }
        }
        missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_is_listed_once_in_the_order_first_used() {
        let mut u = LanesInUse::default();
        assert!(u.lanes().is_empty());
        assert!(u.mark(300));
        assert!(u.mark(4));
        assert!(!u.mark(300), "marked already");
        assert!(u.mark(0));
        assert_eq!(u.lanes(), &[300, 4, 0]);
    }
}
