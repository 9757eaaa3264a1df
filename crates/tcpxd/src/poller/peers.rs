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

impl SendLane {
    /// A lane on `device` under `gpu`, closed: no comm, nothing registered or queued.
    fn closed(device: i32, gpu: Option<u32>) -> SendLane {
        SendLane {
            device,
            gpu,
            state: SendLaneState::Closed,
            epoch: 0,
            handles: HashMap::new(),
            deferred: VecDeque::new(),
            sent_early: 0,
            tag: Tag::default(),
            staging: blocks::SendStaging::default(),
        }
    }

    /// Everything the lane holds (its comm, registrations, queues, staging rings), leaving it
    /// closed.
    pub(super) fn take(&mut self) -> SendLane {
        let epoch = self.epoch;
        let mut taken = std::mem::replace(self, SendLane::closed(self.device, self.gpu));
        // The next comm handed to the lane thread is a new generation still.
        self.epoch = epoch;
        taken.epoch = epoch;
        taken
    }
}

impl RecvLane {
    /// A lane on `device` under `gpu`, closed: no comm, nothing registered, posted or recorded.
    fn closed(device: i32, gpu: Option<u32>) -> RecvLane {
        RecvLane {
            device,
            gpu,
            state: RecvLaneState::Closed,
            epoch: 0,
            handles: HashMap::new(),
            queue: RecvQueue::default(),
            deferred: VecDeque::new(),
            landing_slots: None,
            landing_on_gpu: false,
            credit_seq: 0,
            scatter: blocks::RecvScatter::default(),
            rules: None,
        }
    }

    /// Everything the lane holds (its comm, registrations, posted receives, landing and scatter
    /// rings, flow-steering rules' record), leaving it closed.
    pub(super) fn take(&mut self) -> RecvLane {
        let epoch = self.epoch;
        let mut taken = std::mem::replace(self, RecvLane::closed(self.device, self.gpu));
        // The next comm handed to the lane thread is a new generation still.
        self.epoch = epoch;
        taken.epoch = epoch;
        taken
    }
}

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
                SendLane::closed(device, gpu)
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
            .map(|(device, gpu)| RecvLane::closed(device, gpu))
            .collect::<Vec<_>>();
        tracing::info!(peer = %node_id, send_lanes = send.len(), recv_lanes = recv.len(), peer_gpus, "peer paired, waiting for its first message");
        self.peers.insert(
            idx,
            PeerSlot {
                node_id,
                control: channels.control,
                direct: None,
                stream_ended: None,
                link: channels.link,
                send,
                recv,
                send_opened: Vec::new(),
                recv_opened: Vec::new(),
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

    /// Fails whatever is left and closes every comm, waiting for the closes no longer than the
    /// engine says ([`crate::engine::Engine::close_by`]).
    pub(super) fn shutdown_now(&mut self) {
        for id in self.engine.active_transfer_ids() {
            self.engine
                .cancel(id, Code::Unavailable, "the daemon is shutting down");
        }
        self.run_actions();
        self.send_answers();
        // No host copy may still read a comm's bounce pages once the comms close.
        self.host_copies.quiesce();
        let by = self.engine.close_by(Instant::now());
        // The lane thread ends and hands its comms back: closed with the poller's own.
        let threaded = self.lanes.as_mut().map(|t| t.stop()).unwrap_or_default();
        close_comms(
            threaded,
            std::mem::take(&mut self.peers),
            std::mem::take(&mut self.prepared),
            std::mem::take(&mut self.buffers),
            by,
        );
        tracing::debug!("poller stopped");
    }
}

/// Closes every comm on a thread of its own and waits for it until `by`. A plugin's close can
/// block for ever: Google's `tcpxClose` joins the comm's helper threads, which look at their
/// stop flag only when idle, and a helper carrying a request with bytes left (a receive whose
/// sender stopped at the same moment, a send its receiver no longer takes) is never idle
/// (src/net_tcpx.cc, `persistentSocketThread`). Send lanes close first, every peer's: their
/// sockets' end is what ends the peer's receives on them. What is not closed by `by` is left
/// to the process's exit, with the memory it may still write into (`buffers`, the lanes' own),
/// so no plugin thread ever writes into memory given back. Each lane's comm closes with the GPU
/// it was opened under current ([`drop_under`]).
fn close_comms(
    threaded: Vec<super::lane_thread::Handed>,
    peers: std::collections::BTreeMap<PeerIdx, PeerSlot>,
    prepared: HashMap<u64, Vec<ListenComm>>,
    buffers: crate::engine::idhash::IdMap<u64, std::sync::Arc<crate::buffers::BufferEntry>>,
    by: Instant,
) {
    let (done, closed) = std::sync::mpsc::channel::<()>();
    let comms = threaded.len() + peers.values().map(|p| p.send.len() + p.recv.len()).sum::<usize>();
    let close = move || {
        let mut peers = peers;
        // Send lanes first (their sockets' end ends the peer's receives), receive lanes with
        // the poller's own below.
        let (send_threaded, recv_threaded): (Vec<_>, Vec<_>) = threaded
            .into_iter()
            .partition(|l| matches!(l, super::lane_thread::Handed::Send(_)));
        for l in send_threaded {
            drop_under(l.gpu(), l);
        }
        // Each lane's comm under the GPU it was opened under, as `close_apart`.
        for p in peers.values_mut() {
            for l in std::mem::take(&mut p.send) {
                let gpu = l.gpu.filter(|_| !matches!(l.state, SendLaneState::Closed));
                drop_under(gpu, l);
            }
        }
        for l in recv_threaded {
            drop_under(l.gpu(), l);
        }
        for p in peers.values_mut() {
            for l in std::mem::take(&mut p.recv) {
                let gpu = l.gpu.filter(|_| !matches!(l.state, RecvLaneState::Closed));
                drop_under(gpu, l);
            }
        }
        drop(peers);
        drop(prepared);
        drop(buffers);
        let _ = done.send(());
    };
    if let Err(e) = std::thread::Builder::new()
        .name("tcpxd-close".into())
        .spawn(close)
    {
        // The closure went with the error: the comms were closed on this thread.
        tracing::warn!("could not start a thread to close the comms ({e}): closed here");
        return;
    }
    let wait = by.saturating_duration_since(Instant::now());
    if closed
        .recv_timeout(wait)
        .is_err_and(|e| e == std::sync::mpsc::RecvTimeoutError::Timeout)
    {
        tracing::warn!(
            comms,
            waited_ms = wait.as_millis() as u64,
            "the plugin did not close the lanes' comms within the drain's grace period (a request \
             still under way on a comm whose peer stopped too): left to the process's exit"
        );
    }
}

/// Closes a failed pairing's lanes (`peer` names it in logs) on one of the daemon's closer
/// threads ([`super::closer`]: a few at most, whatever the failures), waited for by nobody: the
/// poller goes on at once. A plugin's close can block for as long as the peer hangs (see
/// [`close_comms`]); meanwhile the lanes' comms keep the memory their requests may
/// still write into (`net::comm`'s keep-alive), and the flow-steering rules' record goes after
/// the close that removed them (each lane drops its fields in order). Send lanes close first:
/// their sockets' end is what ends the peer's receives on them. Each open lane goes with the GPU
/// its comm was opened under current (the plugin's close of a CUDA comm frees that GPU's memory).
pub(super) fn close_apart(peer: String, send: Vec<SendLane>, recv: Vec<RecvLane>) {
    let comms = send.len() + recv.len();
    let close = move || {
        let started = Instant::now();
        for l in send {
            let gpu = l.gpu.filter(|_| !matches!(l.state, SendLaneState::Closed));
            drop_under(gpu, l);
        }
        for l in recv {
            let gpu = l.gpu.filter(|_| !matches!(l.state, RecvLaneState::Closed));
            drop_under(gpu, l);
        }
        tracing::debug!(%peer, comms, took_ms = started.elapsed().as_millis() as u64, "failed pairing's comms closed");
    };
    super::closer::Closers::global().run(Box::new(close));
}

/// Drops a lane (closing its comm) with GPU `gpu` current on this thread; without it where it
/// cannot be made current (logged).
fn drop_under<L>(gpu: Option<u32>, lane: L) {
    if let Err(e) = crate::topology::make_current(gpu) {
        tracing::warn!("closing a lane's comm: {e}");
    }
    drop(lane);
}

/// The flow-steering rules Google's plugin installed for a receive comm just accepted on
/// `at` (its data listen address) under GPU `gpu`: one per data socket, (peer → `at`).
pub(super) fn lane_flows(
    topology: &crate::engine::topology::Topology,
    gpu: Option<u32>,
    at: std::net::SocketAddr,
) -> Vec<crate::rx_rules::Flow> {
    let pci = gpu.and_then(|g| {
        topology
            .gpus
            .iter()
            .find(|i| i.ordinal == g)
            .map(|i| crate::rx_rules::plugin_pci(&i.pci_bus_id))
    });
    crate::rx_rules::accepted_on(at)
        .into_iter()
        .map(|(src, dst)| crate::rx_rules::Flow {
            src,
            dst,
            gpu: pci.clone(),
        })
        .collect()
}
