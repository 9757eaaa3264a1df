//! The pure engine's cost per transfer (issue #38, session 27): two engines back to back with
//! the daemon's default configuration on a GPU pair (protocol auto, two rendezvous lanes and one
//! credit lane, credit receives in GPU memory, 16 credits, GPU inline for one transfer in flight),
//! 64 KiB WRITEs from GPU 0 into GPU 1, 16 in flight, driven by a lean driver that moves no
//! bytes, and each engine entry point the poller calls timed apart: ns per transfer by call.
//!
//! Not a test of behaviour (the other tests are) and no timed assertion: run it in release,
//!
//! ```text
//! cargo test --release -p tcpxd-engine -- --ignored --nocapture engine_cost_per_transfer
//! ```
//!
//! (`TCPXD_ENGINE_PERF_TRANSFERS` sets the count, 200,000 by default). It prints a table: the
//! calls the receiving daemon's passes make (`on_recv_landed`, `on_recv_consumed`,
//! `on_send_done`, `on_message`, `poll_action`, `on_tick`) and the sender's, in ns per
//! transfer, once with inline on (the daemon's default) and once off (every transfer on the
//! credit lane). Each call costs one more clock read (~20–30 ns here) than it would untimed.

use super::*;
use crate::topology::Memory;
use std::collections::VecDeque;

/// The daemon's engine configuration on one GPU a side (`daemon.rs`, `config.rs` defaults):
/// protocol auto, `lanes_per_device` 2, `eager_lanes` 1, 512 KiB chunks, send window 12,
/// receive window and credits 16, eager up to 64 KiB, GPU credits (a GPU node), 32 MiB credit
/// budget, spread from 128 KiB, inline up to 64 KiB with GPU inline for one transfer in flight.
fn daemon_cfg(inline: bool) -> EngineConfig {
    EngineConfig {
        protocol: Protocol::Auto,
        lanes_per_device: 2,
        eager_lanes: 1,
        send_window: 12,
        recv_window: 16,
        credits: 16,
        gpu_credits: true,
        spread_min_chunk: 128 << 10,
        host_gather_ahead: crate::config::DEFAULT_HOST_GATHER_AHEAD,
        inline_max_bytes: if inline { 64 << 10 } else { 0 },
        inline_gpu: inline,
        ..EngineConfig::default()
    }
}

/// The entry points timed, in the table's order.
const CALLS: [&str; 7] = [
    "on_recv_landed",
    "on_recv_consumed",
    "on_send_done",
    "on_message",
    "poll_action",
    "on_tick",
    "start_write",
];

#[derive(Clone, Copy, PartialEq)]
enum Posted {
    Credit,
    Recv,
}

/// One node and what its driver holds.
struct Side {
    eng: Engine,
    /// Per lane this node sends on: sends posted, not yet matched.
    sends: Vec<VecDeque<()>>,
    /// Per lane this node receives on: receives posted (credit or rendezvous), not yet matched.
    recvs: Vec<VecDeque<Posted>>,
    /// Per receive lane: landed credit receives whose `Land` came, to report consumed.
    consume: Vec<u32>,
    spent: [Duration; CALLS.len()],
    calls: [u64; CALLS.len()],
}

impl Side {
    fn timed<T>(&mut self, call: usize, f: impl FnOnce(&mut Engine) -> T) -> T {
        let t = Instant::now();
        let r = f(&mut self.eng);
        self.spent[call] += t.elapsed();
        self.calls[call] += 1;
        r
    }
}

struct Run {
    sides: [Side; 2],
    ctrl: [VecDeque<PeerMsg>; 2],
    finished: u64,
    started: u64,
}

const SIZE: u64 = 64 << 10;
const IN_FLIGHT: u64 = 16;

fn pair(cfg: &EngineConfig) -> Run {
    let lanes = LaneLayout::of(cfg).lanes();
    let mk = |other: &str| {
        let mut eng = Engine::new(cfg.clone());
        let p = eng.add_peer(other, lanes, lanes);
        assert_eq!(p, P);
        for l in 0..lanes {
            eng.on_lane_ready(P, l, true);
            eng.on_lane_ready(P, l, false);
        }
        Side {
            eng,
            sends: (0..lanes).map(|_| VecDeque::new()).collect(),
            recvs: (0..lanes).map(|_| VecDeque::new()).collect(),
            consume: vec![0; lanes as usize],
            spent: [Duration::ZERO; CALLS.len()],
            calls: [0; CALLS.len()],
        }
    };
    let mut r = Run {
        sides: [mk("node-b"), mk("node-a")],
        ctrl: [VecDeque::new(), VecDeque::new()],
        finished: 0,
        started: 0,
    };
    // 16 MiB source on GPU 0, destination on GPU 1 (the bench's buffers).
    for (i, (id, gpu)) in [(1u64, 0u32), (2, 1)].into_iter().enumerate() {
        r.sides[i].eng.add_buffer(id, 16 << 20, key(id as u8)).unwrap();
        r.sides[i].eng.set_buffer_memory(id, Memory::Gpu(gpu));
    }
    r
}

impl Run {
    fn start(&mut self, now: Instant) {
        let spec = WriteSpec {
            local_buffer: 1,
            local_offset: (self.started % 256) * SIZE,
            peer: P,
            remote: RemoteRange {
                buffer_id: 2,
                access_key: key(2),
                offset: (self.started % 256) * SIZE,
                length: SIZE,
            },
        };
        self.started += 1;
        self.sides[0]
            .timed(6, |e| {
                e.start_write(vec![spec], Vec::new(), now + Duration::from_secs(60), now)
            })
            .expect("a write starts");
    }

    /// Every action of node `i`, carried out as the poller would, moving no bytes.
    fn drain(&mut self, i: usize) {
        while let Some(a) = self.sides[i].timed(4, Engine::poll_action) {
            match a {
                Action::Control { msg, .. } => self.ctrl[1 - i].push_back(msg),
                Action::PostSend { lane, .. } => self.sides[i].sends[lane as usize].push_back(()),
                Action::PostCredit { lane, .. } => {
                    self.sides[i].recvs[lane as usize].push_back(Posted::Credit)
                }
                Action::PostRecv { lane, .. } => self.sides[i].recvs[lane as usize].push_back(Posted::Recv),
                Action::Land { lane, .. } => self.sides[i].consume[lane as usize] += 1,
                Action::SendInline {
                    offer,
                    sources,
                    gather,
                    ..
                } => {
                    let len: u64 = sources.iter().map(|s| s.2).sum();
                    if gather && !self.sides[i].eng.on_inline_gathered(offer.offer_id, Ok(())) {
                        continue;
                    }
                    self.ctrl[1 - i].push_back(PeerMsg::Inline {
                        offer,
                        payload: vec![0; len as usize],
                    });
                }
                Action::LandInline { offer, payload, .. } => {
                    let len = payload.len() as u64;
                    self.sides[i].eng.on_inline_landed(P, offer, len, Ok(()));
                }
                Action::Finished { outcome, .. } => {
                    assert_eq!(outcome.code, Code::Ok, "{outcome:?}");
                    assert_eq!(i, 0, "only the writer finishes transfers");
                    self.finished += 1;
                }
                Action::Progress { .. }
                | Action::Notify { .. }
                | Action::BufferIdle { .. }
                | Action::SendNow { .. } => {}
                other => panic!("an action this driver does not carry out: {other:?}"),
            }
        }
    }

    /// One pass of each node, as the poller's: messages in, completions applied, actions run.
    fn pass(&mut self, now: Instant) {
        for i in 0..2 {
            while let Some(msg) = self.ctrl[i].pop_front() {
                self.sides[i].timed(3, |e| e.on_message(P, msg, now));
            }
            self.drain(i);
            // The wire: each send posted by the other node meets the receive posted here.
            let lanes = self.sides[i].recvs.len();
            for lane in 0..lanes {
                while !self.sides[1 - i].sends[lane].is_empty() && !self.sides[i].recvs[lane].is_empty() {
                    self.sides[1 - i].sends[lane].pop_front();
                    let posted = self.sides[i].recvs[lane].pop_front().unwrap();
                    self.sides[1 - i].timed(2, |e| e.on_send_done(P, lane as u32));
                    match posted {
                        Posted::Credit => self.sides[i].timed(0, |e| e.on_recv_landed(P, lane as u32, now)),
                        Posted::Recv => {
                            self.sides[i].timed(1, |e| e.on_recv_consumed(P, lane as u32, Ok(())))
                        }
                    }
                }
            }
            self.drain(i);
            for lane in 0..lanes {
                for _ in 0..std::mem::take(&mut self.sides[i].consume[lane]) {
                    self.sides[i].timed(1, |e| e.on_recv_consumed(P, lane as u32, Ok(())));
                }
            }
            self.sides[i].timed(5, |e| e.on_tick(now));
            self.drain(i);
        }
    }
}

/// Runs `transfers` WRITEs, 16 in flight; returns the sides' time and calls by entry point.
fn run(cfg: &EngineConfig, transfers: u64) -> ([[Duration; CALLS.len()]; 2], [[u64; CALLS.len()]; 2]) {
    let mut r = pair(cfg);
    let now = Instant::now();
    for _ in 0..4 {
        r.pass(now);
    }
    let mut passes = 0u64;
    while r.finished < transfers {
        while r.started < transfers && r.started - r.finished < IN_FLIGHT {
            r.start(now);
        }
        r.pass(now);
        passes += 1;
        assert!(passes < 100 * transfers + 1000, "no progress");
    }
    (
        [r.sides[0].spent, r.sides[1].spent],
        [r.sides[0].calls, r.sides[1].calls],
    )
}

#[test]
fn a_short_run_of_the_cost_harness_finishes_every_transfer() {
    // The harness itself (not its timings): every transfer ends Ok under both configurations.
    for inline in [true, false] {
        let (_, calls) = run(&daemon_cfg(inline), 200);
        assert_eq!(calls[0][6], 200, "every write started");
        if !inline {
            // Every chunk on the credit lane: one landing and one consume a transfer.
            assert_eq!(calls[1][0], 200, "a credit receive landed per transfer");
        }
    }
}

#[test]
#[ignore = "a benchmark: run in release with --ignored --nocapture"]
fn engine_cost_per_transfer() {
    let n: u64 = std::env::var("TCPXD_ENGINE_PERF_TRANSFERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    println!(
        "\nThe pure engine, 64 KiB WRITEs GPU 0 -> GPU 1, 16 in flight, {n} transfers (ns per transfer; calls per transfer)"
    );
    for inline in [true, false] {
        // A short warm-up run, then the measured one.
        run(&daemon_cfg(inline), n / 10);
        let (spent, calls) = run(&daemon_cfg(inline), n);
        for (side, name) in [(1, "receiver"), (0, "sender")] {
            let total: Duration = spent[side].iter().sum();
            let cells: Vec<String> = CALLS
                .iter()
                .enumerate()
                .filter(|&(c, _)| calls[side][c] > 0)
                .map(|(c, call)| {
                    format!(
                        "{call} {:.0} ({:.2})",
                        spent[side][c].as_nanos() as f64 / n as f64,
                        calls[side][c] as f64 / n as f64
                    )
                })
                .collect();
            println!(
                "inline {:<3} {name:<8} all {:>6.0} ns: {}",
                if inline { "on" } else { "off" },
                total.as_nanos() as f64 / n as f64,
                cells.join(", ")
            );
        }
    }
}
