//! Owed credits riding with the `Done` on a simulated pair (`credits.rs`, "Liveness"; issue
//! #38): a spread transfer of two chunks a credit lane sends no `Credits` message before its
//! `Done`, and every mix the rule must survive — small transfers behind a large one, many in
//! flight both ways, WRITEs and READs interleaved, cancels, the peer lost — completes (or
//! fails cleanly) with every credit back.

use super::gpu_credits::gpu_cfg;
use super::spread::spread_cfg;
use super::*;

const KIB: u64 = 1024;

#[test]
fn a_spread_transfer_one_at_a_time_returns_its_credits_in_its_done_only() {
    for seed in 60..70 {
        // Two GPU credit lanes, 16 KiB chunks spread down to 8 KiB: 32 KiB goes as four
        // chunks, two a lane (as 1 MiB does on the H200 with 512 KiB chunks and 128 KiB min).
        let mut s = Sim::new(2, spread_cfg(4096), seed);
        s.gpu_buffer(1, 2, 1 << 20, 0, 0);
        s.gpu_buffer(0, 4, 1 << 20, 0, 0);
        s.buffer(0, 1, 1 << 20, 5);
        s.buffer(1, 5, 1 << 20, 6);
        s.run();
        let before = s.credit_msgs;
        for k in 0..20u64 {
            let at = k * 32 * KIB;
            let t = s.write(0, 1, at, 2, at, 32 * KIB);
            s.run();
            assert_eq!(s.outcome(0, t).code, Code::Ok);
            assert!(s.same((0, 1, at), (1, 2, at), 32 * KIB));
            // A READ into GPU memory: node 0 receives the data, and owes the credits.
            let r = s.read(0, 5, at, 4, at, 32 * KIB);
            s.run();
            assert_eq!(s.outcome(0, r).code, Code::Ok);
            assert!(s.same((1, 5, at), (0, 4, at), 32 * KIB));
        }
        assert_eq!(
            s.credit_msgs, before,
            "seed {seed}: no `Credits` message, every credit in a `Done`"
        );
        s.assert_idle();
    }
}

#[test]
fn a_done_ahead_of_its_credits_receive_lets_the_sender_reuse_only_consumed_credits() {
    // The `Done` goes before the batch's credit receives are posted again (`SendNow`), so with
    // the driver's re-posts late (`Sim::late_reposts`: held, posted at random later steps) the
    // sender's next sends reach the plugin before their receives. The sim checks on every step
    // that a lane's unmatched sends never outnumber the receives asked for and not yet posted:
    // a credit the sender holds is always a consumed chunk's (its bounce memory the plugin's
    // again), never one still landing. One at a time, spread and by byte budget, WRITEs and
    // READs into GPU memory: byte-exact, every credit back, no `Credits` message.
    // Few credits a lane (two; the budget's 48 KiB is three 16 KiB chunks), so the sender's
    // next transfers need the credits the last `Done` returned.
    let few = |cfg: EngineConfig| EngineConfig { credits: 2, ..cfg };
    for (name, cfg) in [("spread", few(spread_cfg(4096))), ("budget", few(gpu_cfg()))] {
        for seed in 90..96 {
            let mut s = Sim::new(2, cfg.clone(), seed);
            s.late_reposts = true;
            buffers(&mut s);
            let before = s.credit_msgs;
            // Each transfer starts as soon as the one before finished (a client one at a time),
            // whatever the receiver's driver has still to post.
            let until_finished = |s: &mut Sim, node: usize, t: TransferId| {
                while !s.nodes[node].finished.contains_key(&t) {
                    assert!(s.step(), "{name} seed {seed}: quiet before {t} finished");
                }
            };
            for k in 0..16u64 {
                let at = k * 32 * KIB;
                let t = s.write(0, 1, at, 2, at, 32 * KIB);
                until_finished(&mut s, 0, t);
                assert_eq!(s.outcome(0, t).code, Code::Ok, "{name} seed {seed}");
                assert!(s.same((0, 1, at), (1, 2, at), 32 * KIB), "{name} seed {seed}");
            }
            let writes = s.early_sends;
            assert!(
                writes > 0,
                "{name} seed {seed}: no WRITE's send came before its receive"
            );
            // READs into GPU memory: node 0 receives, posts its credit receives late and owes.
            for k in 0..16u64 {
                let at = k * 32 * KIB;
                let r = s.read(0, 5, at, 4, at, 32 * KIB);
                until_finished(&mut s, 0, r);
                assert_eq!(s.outcome(0, r).code, Code::Ok, "{name} seed {seed}");
                assert!(s.same((1, 5, at), (0, 4, at), 32 * KIB), "{name} seed {seed}");
            }
            s.run();
            assert!(
                s.early_sends > writes,
                "{name} seed {seed}: no READ's send came before its receive"
            );
            if name == "spread" {
                assert_eq!(s.credit_msgs, before, "seed {seed}: every credit in a `Done`");
            }
            s.assert_idle();
        }
    }
}

/// Buffers of both nodes: 0's host 1 and GPU 4, 1's GPU 2 and host 5, 4 MiB each.
fn buffers(s: &mut Sim) {
    s.gpu_buffer(1, 2, 4 << 20, 0, 0);
    s.gpu_buffer(0, 4, 4 << 20, 0, 0);
    s.buffer(0, 1, 4 << 20, 5);
    s.buffer(1, 5, 4 << 20, 6);
    s.run();
}

/// A large WRITE, then small WRITEs and READs both ways while it goes, a few steps apart:
/// `(node, transfer, (from node, buffer, offset), (to node, buffer, offset), len)`.
type Started = Vec<(usize, TransferId, (usize, u64, u64), (usize, u64, u64), u64)>;

fn start_mix(s: &mut Sim) -> Started {
    let mut out: Started = Vec::new();
    let large = 2 << 20;
    out.push((0, s.write(0, 1, 0, 2, 0, large), (0, 1, 0), (1, 2, 0), large));
    for k in 0..12u64 {
        for _ in 0..s.rand(30) {
            s.step();
        }
        // 4 KiB to 60 KiB and a few bytes, each its own 64 KiB region past the large one.
        let len = 4 * KIB * (1 + s.rand(15) as u64) + s.rand(3) as u64;
        let at = (2 << 20) + k * 64 * KIB;
        let t = match k % 4 {
            0 => (0, s.write(0, 1, at, 2, at, len), (0, 1, at), (1, 2, at), len),
            1 => (0, s.read(0, 5, at, 4, at, len), (1, 5, at), (0, 4, at), len),
            2 => (
                1,
                s.write(1, 5, at, 4, at + (1 << 20), len),
                (1, 5, at),
                (0, 4, at + (1 << 20)),
                len,
            ),
            _ => (
                1,
                s.read(1, 1, at, 2, at + (1 << 20), len),
                (0, 1, at),
                (1, 2, at + (1 << 20)),
                len,
            ),
        };
        out.push(t);
    }
    out
}

/// Spread at four chunks a lane (`transfer.spread_chunks_per_lane`): a lane owes up to four
/// credits a transfer, so mid-transfer `Credits` messages keep the sender going.
fn spread4() -> EngineConfig {
    EngineConfig {
        spread_chunks_per_lane: 4,
        ..spread_cfg(4096)
    }
}

#[test]
fn small_transfers_behind_a_large_one_and_many_both_ways_all_land() {
    for (name, cfg) in [
        ("spread", spread_cfg(4096)),
        ("spread4", spread4()),
        ("budget", gpu_cfg()),
    ] {
        for seed in 70..78 {
            let mut s = Sim::new(2, cfg.clone(), seed);
            // Half the seeds with the credit receives posted late (the `Done` ahead of them).
            s.late_reposts = seed % 2 == 1;
            buffers(&mut s);
            let started = start_mix(&mut s);
            s.run();
            for (node, t, from, to, len) in started {
                assert_eq!(s.outcome(node, t).code, Code::Ok, "{name} seed {seed}");
                assert!(s.same(from, to, len), "{name} seed {seed}: byte-exact");
            }
            s.assert_idle();
        }
    }
}

#[test]
fn cancels_and_a_lost_peer_amid_the_mix_return_every_credit() {
    for (name, cfg) in [
        ("spread", spread_cfg(4096)),
        ("spread4", spread4()),
        ("budget", gpu_cfg()),
    ] {
        for seed in 80..88 {
            let mut s = Sim::new(2, cfg.clone(), seed);
            s.late_reposts = seed % 2 == 1;
            buffers(&mut s);
            let started = start_mix(&mut s);
            // Every third cancelled where it stands, by the node that started it.
            for (node, t, ..) in started.iter().step_by(3) {
                s.nodes[*node].eng.cancel(*t, Code::Cancelled, "client cancelled");
            }
            s.run();
            for (i, (node, t, from, to, len)) in started.iter().enumerate() {
                let code = s.outcome(*node, *t).code;
                if i % 3 == 0 {
                    assert!(
                        matches!(code, Code::Cancelled | Code::Ok),
                        "{name} seed {seed}: {code:?}"
                    );
                } else {
                    assert_eq!(code, Code::Ok, "{name} seed {seed}");
                    assert!(s.same(*from, *to, *len), "{name} seed {seed}: byte-exact");
                }
            }
            s.assert_idle();
            // The same mix, the pairing lost part way: every transfer ends, nothing stays held.
            let started = start_mix(&mut s);
            for _ in 0..s.rand(60) {
                s.step();
            }
            for i in 0..2 {
                s.nodes[i].eng.on_peer_failed(P, "lane 2: connection reset");
            }
            s.drain();
            for (node, t, ..) in started {
                let code = s.outcome(node, t).code;
                assert!(
                    matches!(code, Code::Unavailable | Code::Ok),
                    "{name} seed {seed}: {code:?}"
                );
            }
            for n in &s.nodes {
                let e = &n.eng;
                assert!(
                    e.is_idle() && e.lanes_idle() && e.posted() == (0, 0),
                    "{name} seed {seed}"
                );
                for b in n.bufs.keys() {
                    assert_eq!(e.buffer_users(*b), Some(0), "{name} seed {seed}: buffer {b}");
                }
            }
        }
    }
}
