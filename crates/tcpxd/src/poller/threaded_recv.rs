//! The engine's receive actions for a receive lane a lane thread drives (`runtime.lane_thread`,
//! `lane_thread/recv.rs`): each becomes one order on the thread of the lane's GPU, carrying what
//! the receive's unpack will need there — the destination's entry, a block chunk's pieces (fixed
//! now: the engine's plan of an offer does not change), the offer's [`Lands`] flag. The poller's
//! own lanes take the paths in `actions.rs` as before.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::blocks::{self, ScatterTo};
use super::lane_thread::{LandTo, Lands, RecvInto, RecvOrder, ToLanes};
use super::{Poller, RecvLaneState};
use crate::buffers::BufferEntry;
use crate::engine::PeerIdx;
use crate::engine::blocks::Segment;

impl Poller {
    /// The GPU and generation of receive lane `lane` when a lane thread drives it (`None`: the
    /// poller does, or the lane is gone).
    fn threaded_recv(&self, peer: PeerIdx, lane: u32) -> Option<(Option<u32>, u64)> {
        let l = self.peers.get(&peer)?.recv.get(lane as usize)?;
        matches!(l.state, RecvLaneState::Threaded { .. }).then_some((l.gpu, l.epoch))
    }

    fn order_recv(&self, peer: PeerIdx, lane: u32, (gpu, epoch): (Option<u32>, u64), order: RecvOrder) {
        if let Some(t) = &self.lanes {
            t.send(
                gpu,
                ToLanes::Recv {
                    key: (peer, lane),
                    epoch,
                    order,
                },
            );
        }
    }

    /// The flag of an offer whose receives go to a lane thread (made with its first).
    fn lands_flag(&mut self, peer: PeerIdx, offer: u64) -> Lands {
        let engine = &self.engine;
        self.lands
            .entry((peer, offer))
            .or_insert_with(|| Arc::new(AtomicBool::new(engine.recv_lands(peer, offer))))
            .clone()
    }

    fn entry(&self, buffer: u64) -> Result<Arc<BufferEntry>, String> {
        self.buffers
            .get(&buffer)
            .cloned()
            .ok_or_else(|| format!("buffer {buffer} vanished"))
    }

    /// A block chunk's pieces, as the engine plans them now.
    fn pieces(&self, peer: PeerIdx, offer: u64, wire: u64, len: u32) -> Result<Vec<Segment>, String> {
        let mut segs = Vec::new();
        blocks::collect(
            self.engine.recv_pieces(peer, offer, wire, len),
            &mut segs,
            "received",
            offer,
            wire,
            len,
        )
        .map(|()| segs)
    }

    /// `PostRecv` on a threaded lane (`None`: the lane is not threaded).
    pub(super) fn thread_post_recv(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offset: u64,
        len: u32,
        offer: u64,
    ) -> Option<Result<(), String>> {
        let th = self.threaded_recv(peer, lane)?;
        let entry = match self.entry(buffer) {
            Ok(e) => e,
            Err(why) => return Some(Err(format!("lane {lane} receive: {why}"))),
        };
        let lands = self.lands_flag(peer, offer);
        // A buffer registered by address: the chunk lands in the lane's landing ring and is
        // scattered into the client's pages (one piece) once complete.
        let into = if entry.attached.is_some() {
            RecvInto::Scatter {
                entry,
                to: ScatterTo {
                    buffer,
                    offer,
                    wire: 0,
                    direct: Some(offset),
                },
                pieces: Ok(vec![blocks::whole(offset, len)]),
                lands,
            }
        } else {
            RecvInto::Buffer { entry, offset, lands }
        };
        self.order_recv(peer, lane, th, RecvOrder::Post { into, len });
        Some(Ok(()))
    }

    /// `PostScatterRecv` on a threaded lane.
    pub(super) fn thread_post_scatter_recv(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offer: u64,
        wire: u64,
        len: u32,
    ) -> Option<Result<(), String>> {
        let th = self.threaded_recv(peer, lane)?;
        let entry = match self.entry(buffer) {
            Ok(e) => e,
            Err(why) => return Some(Err(format!("lane {lane} block receive: {why}"))),
        };
        let pieces = self.pieces(peer, offer, wire, len);
        let lands = self.lands_flag(peer, offer);
        let into = RecvInto::Scatter {
            entry,
            to: ScatterTo {
                buffer,
                offer,
                wire,
                direct: None,
            },
            pieces,
            lands,
        };
        self.order_recv(peer, lane, th, RecvOrder::Post { into, len });
        Some(Ok(()))
    }

    /// `PostDropRecv` on a threaded lane.
    pub(super) fn thread_post_drop_recv(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        len: u32,
    ) -> Option<Result<(), String>> {
        let th = self.threaded_recv(peer, lane)?;
        self.order_recv(
            peer,
            lane,
            th,
            RecvOrder::Post {
                into: RecvInto::Drop,
                len,
            },
        );
        Some(Ok(()))
    }

    /// `PostCredit` on a threaded lane (`gpu_landing`: as the poller's `post_credit` decides).
    pub(super) fn thread_post_credit(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        len: u32,
        gpu_landing: bool,
    ) -> Option<Result<(), String>> {
        let th = self.threaded_recv(peer, lane)?;
        let credits = u64::from(self.cfg.engine.credits);
        let into = RecvInto::Credit { credits, gpu_landing };
        self.order_recv(peer, lane, th, RecvOrder::Post { into, len });
        Some(Ok(()))
    }

    /// `Land` on a threaded lane.
    pub(super) fn thread_land(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: Option<u64>,
        offset: u64,
        len: u32,
    ) -> Option<Result<(), String>> {
        let th = self.threaded_recv(peer, lane)?;
        let to = match buffer.map(|b| self.entry(b)) {
            None => LandTo::Discard,
            Some(Ok(entry)) => LandTo::Buffer { entry, offset, len },
            Some(Err(why)) => LandTo::Failed(why),
        };
        self.order_recv(peer, lane, th, RecvOrder::Land(to));
        Some(Ok(()))
    }

    /// `LandScatter` on a threaded lane.
    pub(super) fn thread_land_scatter(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offer: u64,
        wire: u64,
        len: u32,
    ) -> Option<Result<(), String>> {
        let th = self.threaded_recv(peer, lane)?;
        let pieces = self.pieces(peer, offer, wire, len);
        let to = match self.entry(buffer) {
            Ok(entry) => LandTo::Scatter {
                entry,
                to: ScatterTo {
                    buffer,
                    offer,
                    wire,
                    direct: None,
                },
                len,
                pieces,
            },
            Err(why) => LandTo::Failed(why),
        };
        self.order_recv(peer, lane, th, RecvOrder::Land(to));
        Some(Ok(()))
    }
}
