//! Setting peers up and tearing everything down: the lanes a handshake announces, a pairing (its
//! lanes closed until first use: `engine::lane_life`, driven in `lane_life.rs`) and its engine
//! peer; the end of a drain and the shutdown that fails what is left and closes every comm.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use super::{
    LaneInfo, PeerChannels, PeerSlot, Poller, RecvLane, RecvLaneState, SendLane, SendLaneState, blocks,
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

    /// The lanes this node receives on from a peer, as the handshake announces them (peer
    /// protocol 6: none is listened for until the peer first sends on it, `Action::ListenLane`).
    /// The listening comms are none: the caller's `PrepareLanes` keeps an empty set.
    pub(super) fn open_listens(&mut self) -> Result<(Vec<ListenComm>, Vec<LaneInfo>), String> {
        let infos = self
            .lane_devices()
            .into_iter()
            .enumerate()
            .map(|(lane, device)| LaneInfo {
                lane: lane as u32,
                device,
            })
            .collect();
        Ok((Vec::new(), infos))
    }

    /// A pairing: its control stream is up at once, its lanes are closed until first use
    /// (`engine::lane_life`). `remote`: the lanes the peer receives on (our send lanes).
    pub(super) fn add_peer(
        &mut self,
        node_id: String,
        listens: Vec<ListenComm>,
        remote: Vec<LaneInfo>,
        topology: super::PeerTopology,
        channels: PeerChannels,
    ) -> Result<PeerIdx, String> {
        if remote.is_empty() || remote.len() > 64 {
            return Err(format!(
                "the peer offered {} lanes (1 to 64 allowed)",
                remote.len()
            ));
        }
        drop(listens);
        let devices = self.lane_devices();
        let peer_gpus = topology.topology.gpus.len();
        let idx = self.engine.add_peer_routed(
            &node_id,
            remote.len() as u32,
            devices.len() as u32,
            topology.topology,
            topology.lanes_per_route,
        )?;
        let (send_lanes, recv_lanes) = self.engine.lane_counts(idx);
        // A routed lane's comm is on its route's NIC under its route's GPU; a layout lane's on
        // the layout's device under a GPU that device serves.
        let nic_device = |nic: usize| self.cfg.topology.nics[nic].device;
        let send = (0..send_lanes)
            .map(|i| {
                let (device, gpu) = match self.engine.send_lane_route(idx, i) {
                    Some(r) => (nic_device(r.send.nic), r.send.gpu),
                    None => {
                        let device = devices[i as usize % devices.len()];
                        (device, self.device_gpu(device))
                    }
                };
                SendLane {
                    device,
                    gpu,
                    state: SendLaneState::Closed,
                    handles: HashMap::new(),
                    deferred: VecDeque::new(),
                    tag: Tag::default(),
                    staging: blocks::SendStaging::default(),
                }
            })
            .collect::<Vec<_>>();
        let recv = (0..recv_lanes)
            .map(|i| {
                let (device, gpu) = match self.engine.recv_lane_route(idx, i) {
                    Some(r) => (nic_device(r.recv.nic), r.recv.gpu),
                    None => {
                        let device = devices[i as usize % devices.len()];
                        (device, self.device_gpu(device))
                    }
                };
                (device, gpu)
            })
            .map(|(device, gpu)| RecvLane {
                device,
                gpu,
                state: RecvLaneState::Closed,
                handles: HashMap::new(),
                queue: RecvQueue::default(),
                deferred: VecDeque::new(),
                landing_slots: None,
                credit_seq: 0,
                scatter: blocks::RecvScatter::default(),
            })
            .collect::<Vec<_>>();
        tracing::info!(peer = %node_id, send_lanes = send.len(), recv_lanes = recv.len(), peer_gpus, "peer paired, waiting for its first message");
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
