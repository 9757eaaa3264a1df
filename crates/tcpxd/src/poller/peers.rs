//! Setting peers up and tearing everything down: the listening comms a handshake exchanges, a
//! pairing's lanes (connectors and accepts, set up by the pass) and its engine peer; the end of
//! a drain and the shutdown that fails what is left and closes every comm.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use super::{
    LaneHandleInfo, PeerChannels, PeerSlot, Poller, RecvLane, RecvLaneState, SendLane, SendLaneState, blocks,
};
use crate::engine::{Code, PeerIdx};
use crate::lanes::{RecvQueue, Tag};
use crate::net::ListenComm;

impl Poller {
    /// The device of each lane this node listens on, as the engine's lane layout says.
    fn lane_devices(&self) -> Vec<i32> {
        let layout = self.engine.layout();
        (0..layout.lanes())
            .map(|i| self.cfg.devices[layout.device_index(i)])
            .collect()
    }

    /// The GPU to make current when opening a comm on device `dev`: the first GPU its NIC serves
    /// in the topology (`None` without GPUs, or for a NIC that serves none).
    pub(super) fn device_gpu(&self, dev: i32) -> Option<u32> {
        let t = &self.cfg.topology;
        t.nic_position(dev).and_then(|n| t.listen_gpu(n))
    }

    pub(super) fn open_listens(&mut self) -> Result<(Vec<ListenComm>, Vec<LaneHandleInfo>), String> {
        let mut listens = Vec::new();
        let mut infos = Vec::new();
        for (lane, dev) in self.lane_devices().into_iter().enumerate() {
            // The plugin takes the listen comm's GPU from the CUDA device current now.
            crate::topology::make_current(self.device_gpu(dev))
                .map_err(|e| format!("listen on device {dev}: {e}"))?;
            let l = self
                .plugin
                .listen(dev)
                .map_err(|e| format!("listen on device {dev}: {e}"))?;
            infos.push(LaneHandleInfo {
                lane: lane as u32,
                device: dev,
                handle: l.handle(),
            });
            listens.push(l);
        }
        Ok((listens, infos))
    }

    pub(super) fn add_peer(
        &mut self,
        node_id: String,
        listens: Vec<ListenComm>,
        remote: Vec<LaneHandleInfo>,
        channels: PeerChannels,
    ) -> Result<PeerIdx, String> {
        if remote.is_empty() || remote.len() > 64 {
            return Err(format!(
                "the peer offered {} lanes (1 to 64 allowed)",
                remote.len()
            ));
        }
        let deadline = Instant::now() + self.cfg.connect_timeout;
        let devices = self.lane_devices();
        let mut send = Vec::new();
        for (i, r) in remote.iter().enumerate() {
            let dev = devices[i % devices.len()];
            let gpu = self.device_gpu(dev);
            crate::topology::make_current(gpu)
                .map_err(|e| format!("connect lane {i} on device {dev}: {e}"))?;
            let c = self
                .plugin
                .connector(dev, &r.handle)
                .map_err(|e| format!("connect lane {i} on device {dev}: {e}"))?;
            send.push(SendLane {
                device: dev,
                gpu,
                state: SendLaneState::Connecting(c, deadline),
                handles: HashMap::new(),
                deferred: VecDeque::new(),
                tag: Tag::default(),
                staging: blocks::SendStaging::default(),
            });
        }
        let recv = listens
            .into_iter()
            .map(|l| RecvLane {
                device: l.dev(),
                gpu: self.device_gpu(l.dev()),
                state: RecvLaneState::Accepting(l, deadline),
                handles: HashMap::new(),
                queue: RecvQueue::default(),
                deferred: VecDeque::new(),
                landing_slots: None,
                landing_on_gpu: false,
                credit_seq: 0,
                scatter: blocks::RecvScatter::default(),
            })
            .collect::<Vec<_>>();
        let idx = self
            .engine
            .add_peer(&node_id, send.len() as u32, recv.len() as u32);
        tracing::info!(peer = %node_id, send_lanes = send.len(), recv_lanes = recv.len(), "peer lanes connecting");
        self.peers.insert(
            idx,
            PeerSlot {
                node_id,
                control: channels.control,
                link: channels.link,
                send,
                recv,
                up: false,
                failed: false,
            },
        );
        Ok(idx)
    }

    /// During a drain: true when the thread should stop (the engine says when: its grace
    /// period's end fails what is left at `on_tick`).
    pub(super) fn check_drain(&mut self) -> bool {
        if self.drain.is_none() {
            return false;
        }
        let Some(report) = self.engine.is_drained(Instant::now()) else {
            return false;
        };
        if let Some(reply) = self.drain.take() {
            let _ = reply.send(report);
        }
        self.shutdown_now();
        true
    }

    /// Fails whatever is left and closes every comm.
    pub(super) fn shutdown_now(&mut self) {
        for id in self.engine.active_transfer_ids() {
            self.engine
                .cancel(id, Code::Unavailable, "the daemon is shutting down");
        }
        self.run_actions();
        self.peers.clear();
        self.prepared.clear();
        tracing::debug!("poller stopped");
    }
}
