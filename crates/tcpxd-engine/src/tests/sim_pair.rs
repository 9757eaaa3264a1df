//! How a simulated pair is made: two engines wired back to back (of one configuration under the
//! protocol `every_mode` runs, or each of its own; lanes open or opened on first use; routed by
//! memory pair when the nodes have topologies), their buffers, and the configurations the tests
//! share.

use super::*;

impl Sim {
    /// Two engines of the configuration `cfg`, under the protocol `every_mode` runs (unless
    /// `cfg` names one other than rendezvous), `lanes` lanes each way (plus the eager lanes of
    /// auto).
    pub(super) fn new(lanes: u32, mut cfg: EngineConfig, seed: u64) -> Sim {
        if cfg.protocol == Protocol::Rendezvous {
            cfg.protocol = mode_now();
            if cfg.protocol == Protocol::Auto {
                cfg.eager_max_bytes = SIM_EAGER_MAX;
            }
        }
        Sim::pair(lanes, [cfg.clone(), cfg], seed)
    }

    /// Two engines of their own configurations (a mixed pair: say an auto node and an eager
    /// one). Node i's receive lanes are the other's send lanes.
    pub(super) fn pair(lanes: u32, cfgs: [EngineConfig; 2], seed: u64) -> Sim {
        Sim::pair_opened(lanes, cfgs, seed, true)
    }

    /// Like [`Sim::pair`], every lane closed until its first use (`lane_life.rs`).
    pub(super) fn pair_lazy(lanes: u32, cfgs: [EngineConfig; 2], seed: u64) -> Sim {
        Sim::pair_opened(lanes, cfgs, seed, false)
    }

    fn pair_opened(lanes: u32, cfgs: [EngineConfig; 2], seed: u64, open: bool) -> Sim {
        Sim::pair_topologies(lanes, cfgs, seed, open, None)
    }

    /// Like [`Sim::pair_lazy`], each node with a topology (node i's `topologies[i]`), the
    /// pairing's rendezvous lanes routed by memory pair (`routes.rs`).
    pub(super) fn pair_routed(
        lanes: u32,
        cfgs: [EngineConfig; 2],
        seed: u64,
        topologies: [crate::topology::Topology; 2],
    ) -> Sim {
        Sim::pair_topologies(lanes, cfgs, seed, false, Some(topologies))
    }

    fn pair_topologies(
        lanes: u32,
        cfgs: [EngineConfig; 2],
        seed: u64,
        open: bool,
        topologies: Option<[crate::topology::Topology; 2]>,
    ) -> Sim {
        let layout = [recv_lanes(lanes, &cfgs[0]), recv_lanes(lanes, &cfgs[1])];
        let mut recv = layout;
        let mk = |i: usize, other: &str, recv: &mut [u32; 2]| {
            let mut eng = Engine::new(cfgs[i].clone());
            let p = match &topologies {
                None => eng.add_peer(other, layout[1 - i], layout[i]),
                Some(t) => {
                    eng.set_topology(t[i].clone());
                    let per_route = cfgs[1 - i].lanes_per_device;
                    let p = eng
                        .add_peer_routed(other, layout[1 - i], layout[i], t[1 - i].clone(), per_route)
                        .unwrap();
                    recv[i] = eng.lane_counts(p).1;
                    p
                }
            };
            assert_eq!(p, P);
            for l in 0..recv[1 - i] {
                if open {
                    eng.on_lane_ready(P, l, true);
                }
            }
            for l in 0..recv[i] {
                if open {
                    eng.on_lane_ready(P, l, false);
                }
            }
            Node {
                eng,
                bufs: HashMap::new(),
                finished: HashMap::new(),
                notes: Vec::new(),
                noted_buffers: Vec::new(),
                closed: Vec::new(),
                pairing: Vec::new(),
                progress: HashMap::new(),
                idle: Vec::new(),
                pieces: PieceStats::default(),
                unpacked: 0,
                dropped: 0,
                drop_posts: 0,
                emptied_live: 0,
                copies: None,
            }
        };
        let nodes = [mk(0, "node-b", &mut recv), mk(1, "node-a", &mut recv)];
        let mut sim = Sim {
            nodes,
            ctrl: [VecDeque::new(), VecDeque::new()],
            // Lanes carrying bytes from node i: the other's receive lanes.
            wires: [
                (0..recv[1]).map(|_| LaneSim::default()).collect(),
                (0..recv[0]).map(|_| LaneSim::default()).collect(),
            ],
            rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            now: Instant::now(),
            cfg: cfgs[0].clone(),
            hold_data: false,
            scatter_any_order: false,
            opened: [0; 2],
            closed_lanes: [0; 2],
            credit_msgs: [0; 2],
            late_reposts: false,
            early_sends: 0,
        };
        // Pairing: each side's ReceiveMode (and credit receives) before any transfer.
        sim.drain();
        for i in 0..2 {
            while let Some(msg) = sim.ctrl[i].pop_front() {
                sim.nodes[i].eng.on_message(P, msg, sim.now);
            }
        }
        sim.drain();
        sim
    }

    pub(super) fn buffer(&mut self, node: usize, id: u64, size: usize, fill: u8) {
        self.nodes[node]
            .eng
            .add_buffer(id, size as u64, key(id as u8))
            .unwrap();
        // `fill` 0 gives zeros (a clean destination); anything else a recognisable pattern.
        let data: Vec<u8> = (0..size)
            .map(|i| {
                if fill == 0 {
                    0
                } else {
                    fill.wrapping_add((i % 251) as u8)
                }
            })
            .collect();
        self.nodes[node].bufs.insert(id, data);
    }
}

/// The peer's pairing message (it receives by rendezvous); this engine's own is dropped.
pub(super) fn rendezvous_peer(eng: &mut Engine, p: PeerIdx) {
    eng.on_message(
        p,
        PeerMsg::ReceiveMode {
            credits: 0,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            eager_first_lane: 0,
            eager_max_bytes: 0,
        },
        Instant::now(),
    );
    while eng.poll_action().is_some() {}
}

pub(super) fn small_chunks() -> EngineConfig {
    EngineConfig {
        chunk_bytes: MIN_CHUNK_BYTES,
        ..EngineConfig::default()
    }
}
