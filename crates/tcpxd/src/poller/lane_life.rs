//! The driver's side of a lane's life (`engine::lane_life`, peer protocol 6): listening for a
//! receive lane the peer asked for and sending it the handle, connecting a send lane to the
//! handle the peer sent, and closing a lane both sides found idle; and of a pairing's
//! (`engine::pair_life`, peer protocol 7): closing one both sides found idle. Each listen, connector and
//! close runs with the lane's GPU current (the plugin takes a comm's GPU from it at listen and
//! connect; its close frees the comm's device queue under that GPU and, built on the CUDA runtime,
//! leaves it current); the accept and
//! connect steps that follow are the pass's (`drive.rs`), bounded by the connect timeout.

use std::collections::HashMap;
use std::time::Instant;

use super::{PeerLink, Poller, RecvLaneState, SendLaneState, blocks};
use crate::engine::{PairLife, PeerIdx, PeerMsg};
use crate::lanes::{GpuStage, RecvQueue, Tag};
use crate::net::ConnectHandle;

impl Poller {
    /// `Action::ListenLane`: listen for receive lane `lane` under its GPU, tell the peer the
    /// handle (on the control stream, in order with the engine's messages), then accept.
    pub(super) fn listen_lane(&mut self, peer: PeerIdx, lane: u32) -> Result<(), String> {
        let deadline = Instant::now() + self.cfg.connect_timeout;
        let Some(p) = self.peers.get_mut(&peer) else {
            return Ok(());
        };
        let Some(l) = p.recv.get_mut(lane as usize) else {
            return Err(format!(
                "lane {lane}: the peer asked for a lane this node does not have"
            ));
        };
        crate::topology::make_current(l.gpu).map_err(|e| format!("listen for lane {lane}: {e}"))?;
        let listen = self
            .plugin
            .listen(l.device)
            .map_err(|e| format!("listen for lane {lane} on device {}: {e}", l.device))?;
        let handle = listen.handle().0.to_vec();
        l.state = RecvLaneState::Accepting(listen, deadline);
        opened(&mut p.recv_opened, lane);
        tracing::debug!(peer = %p.node_id, lane, device = l.device, gpu = ?l.gpu, "lane listened for");
        self.send_control(peer, PeerMsg::LaneListening { lane, handle });
        Ok(())
    }

    /// `Action::ConnectLane`: connect send lane `lane` to the peer's handle under its GPU.
    pub(super) fn connect_lane(&mut self, peer: PeerIdx, lane: u32, handle: &[u8]) -> Result<(), String> {
        let deadline = Instant::now() + self.cfg.connect_timeout;
        let Some(p) = self.peers.get_mut(&peer) else {
            return Ok(());
        };
        let Some(l) = p.send.get_mut(lane as usize) else {
            return Err(format!(
                "lane {lane}: a handle for a lane this node does not have"
            ));
        };
        let handle =
            ConnectHandle::from_bytes(handle).map_err(|e| format!("lane {lane}: the peer's handle: {e}"))?;
        crate::topology::make_current(l.gpu).map_err(|e| format!("connect lane {lane}: {e}"))?;
        let c = self
            .plugin
            .connector(l.device, &handle)
            .map_err(|e| format!("connect lane {lane} on device {}: {e}", l.device))?;
        l.state = SendLaneState::Connecting(c, deadline);
        opened(&mut p.send_opened, lane);
        tracing::debug!(peer = %p.node_id, lane, device = l.device, gpu = ?l.gpu, "lane connecting");
        Ok(())
    }

    /// `Action::CloseLane`: both sides found the lane idle. Its registrations go first, then the
    /// comm (a receive lane's idle credit receives with it); the next open starts afresh.
    pub(super) fn close_lane(&mut self, peer: PeerIdx, lane: u32, send: bool) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        // Block kernels may still read a staging ring or a scatter table: let them finish.
        let on_gpu = if send {
            p.send.get(lane as usize).is_some_and(|l| l.staging.on_gpu())
        } else {
            p.recv.get(lane as usize).is_some_and(|l| l.scatter.on_gpu())
        };
        if on_gpu {
            self.stages.values_mut().for_each(GpuStage::quiesce_blocks);
        }
        // Host copies queued on helpers may still read its bounce pages or write its slots.
        self.host_copies.quiesce();
        // The comm closes under the GPU it was opened under, as every close does
        // (`peers::drop_under`).
        let gpu = if send {
            p.send.get(lane as usize).and_then(|l| l.gpu)
        } else {
            p.recv.get(lane as usize).and_then(|l| l.gpu)
        };
        if let Err(e) = crate::topology::make_current(gpu) {
            tracing::warn!(peer = %p.node_id, lane, send, "closing an idle lane's comm: {e}");
        }
        if send {
            if let Some(l) = p.send.get_mut(lane as usize) {
                // A comm the lane thread drives closes there, under the same GPU, after the
                // sends it was told of (`lane_thread.rs`).
                if let (super::SendLaneState::Threaded(_), Some(t)) = (&l.state, &self.lanes) {
                    t.send(
                        l.gpu,
                        super::lane_thread::ToLanes::Close {
                            key: (peer, lane),
                            epoch: l.epoch,
                            apart: false,
                        },
                    );
                }
                l.handles = HashMap::new();
                l.deferred.clear();
                l.staging = blocks::SendStaging::default();
                l.tag = Tag::default();
                l.state = SendLaneState::Closed;
            }
        } else if let Some(l) = p.recv.get_mut(lane as usize) {
            // A comm the lane thread drives closes there, after the receives it was told of.
            if let (RecvLaneState::Threaded { .. }, Some(t)) = (&l.state, &self.lanes) {
                t.send(
                    l.gpu,
                    super::lane_thread::ToLanes::CloseRecv {
                        key: (peer, lane),
                        epoch: l.epoch,
                        apart: false,
                    },
                );
            }
            l.scatter = blocks::RecvScatter::default();
            l.handles = HashMap::new();
            l.landing_slots = None;
            l.landing_on_gpu = false;
            l.credit_seq = 0;
            l.deferred.clear();
            l.queue = RecvQueue::default();
            l.state = RecvLaneState::Closed;
        }
        tracing::debug!(peer = %p.node_id, lane, send, "idle lane closed");
    }

    /// `Action::Pairing`: the link follows the pairing's life. Closed (both sides agreed it is
    /// idle): every lane still open closes, the control stream ends once the messages already
    /// queued (the answer) are out, and the pairing reads idle, not failed; its stream's end and
    /// anything after it are ignored (the engine's pairing is closed).
    pub(super) fn pairing_life(&mut self, peer: PeerIdx, life: PairLife) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let link = match life {
            PairLife::Live => PeerLink::Up,
            PairLife::Closing => PeerLink::Closing,
            PairLife::Closed => PeerLink::Idle,
        };
        if life == PairLife::Closed {
            p.control = tokio::sync::mpsc::unbounded_channel().0;
            // The answer may still be in the direct connection's buffer: sent, then shut.
            if let Some(mut d) = p.direct.take() {
                d.close(super::direct::CLOSE_FLUSH);
            }
            let (send, recv) = (p.send.len() as u32, p.recv.len() as u32);
            let open_send: Vec<u32> = (0..send)
                .filter(|&l| !matches!(p.send[l as usize].state, SendLaneState::Closed))
                .collect();
            let open_recv: Vec<u32> = (0..recv)
                .filter(|&l| !matches!(p.recv[l as usize].state, RecvLaneState::Closed))
                .collect();
            for lane in open_send {
                self.close_lane(peer, lane, true);
            }
            for lane in open_recv {
                self.close_lane(peer, lane, false);
            }
            let p = &self.peers[&peer];
            tracing::info!(peer = %p.node_id, "pairing closed when idle (both sides agreed); the next use pairs again");
        }
        if let Some(p) = self.peers.get(&peer) {
            p.link.send_replace(link);
        }
    }
}

/// Lists `lane` among a direction's lanes ever opened (once).
fn opened(list: &mut Vec<usize>, lane: u32) {
    let lane = lane as usize;
    if !list.contains(&lane) {
        list.push(lane);
    }
}
