//! Gathers ahead (`EngineConfig::gather_ahead` for GPU sources, `host_gather_ahead` for host
//! ones) through the simulator, which hands the plugin at most `send_window` sends per lane as
//! the driver does: block WRITEs and READs post their gathered sends a window ahead, plain
//! transfers keep the window, each memory takes its own setting, and the bytes land exact.
//! Scatters ahead (`EngineConfig::scatter_ahead`): the receiver posts its receives in pieces
//! beyond `recv_window` (the daemon's driver holds them until the plugin has a slot; the
//! simulator's plugin takes them all), plain receives keep the window.

use super::*;
use crate::blocks::{IndexArray, Layout};

const BLOCKS: u32 = 200;
const BLOCK: u32 = 1000;
const STRIDE: u64 = 1024;
const SIZE: usize = 1 << 18;

fn scatter_cfg(scatter_ahead: usize) -> EngineConfig {
    EngineConfig {
        recv_window: 2,
        credits: 2,
        scatter_ahead,
        ..small_chunks()
    }
}

fn ahead_cfg(gather_ahead: usize) -> EngineConfig {
    EngineConfig {
        send_window: 2,
        gather_ahead,
        host_gather_ahead: gather_ahead,
        ..small_chunks()
    }
}

/// Node 0's buffer 1 and node 1's buffer 2, each with a list of `BLOCKS` strided blocks; the
/// source side (`src`) filled with a pattern, the other zeroed.
fn lists(s: &mut Sim, src: usize) -> (u64, u64) {
    s.buffer(0, 1, SIZE, if src == 0 { 9 } else { 0 });
    s.buffer(1, 2, SIZE, if src == 1 { 9 } else { 0 });
    let strided = |first| Layout::Strided {
        first,
        stride: STRIDE,
        len: BLOCK,
        count: BLOCKS,
    };
    let a = s.nodes[0].eng.register_blocks(1, strided(3)).unwrap();
    let b = s.nodes[1].eng.register_blocks(2, strided(17)).unwrap();
    (a, b)
}

/// The destination after source block `k` went to destination block `BLOCKS - 1 - k`.
fn expected(src: &[u8], src_first: u64, dst: &[u8], dst_first: u64) -> Vec<u8> {
    let mut want = dst.to_vec();
    for k in 0..u64::from(BLOCKS) {
        let (so, d) = (
            src_first + k * STRIDE,
            dst_first + (u64::from(BLOCKS) - 1 - k) * STRIDE,
        );
        want[d as usize..][..BLOCK as usize].copy_from_slice(&src[so as usize..][..BLOCK as usize]);
    }
    want
}

/// The engine's posted sends of `node` (all lanes), and the sends the plugin holds and the
/// driver holds back.
fn sends(s: &Sim, node: usize) -> (usize, usize, usize) {
    let posted = s.nodes[node]
        .eng
        .peer_counters(P)
        .unwrap()
        .send
        .iter()
        .map(|l| l.posted)
        .sum();
    let plugin = s.wires[node]
        .iter()
        .map(|w| w.sends.len() + w.send_done_pending)
        .sum();
    let held = s.wires[node].iter().map(|w| w.deferred.len()).sum();
    (posted, plugin, held)
}

/// The engine's posted receives of `node` (all lanes).
fn recvs(s: &Sim, node: usize) -> usize {
    s.nodes[node]
        .eng
        .peer_counters(P)
        .unwrap()
        .recv
        .iter()
        .map(|l| l.posted)
        .sum()
}

/// Starts a block WRITE (node 0's list to node 1's, reversed) or READ (node 1's to node 0's).
fn start_blocks(s: &mut Sim, read: bool, a: u64, b: u64) -> TransferId {
    let srcs = IndexArray::from_indices(&(0..BLOCKS).collect::<Vec<_>>());
    let dsts = IndexArray::from_indices(&(0..BLOCKS).rev().collect::<Vec<_>>());
    let remote = |s: &Sim, indices: IndexArray| RemoteBlocks {
        list_id: b,
        access_key: s.nodes[1].eng.buffer_key(2).unwrap(),
        blocks: 0,
        block_len: 0,
        indices,
    };
    let (now, deadline) = (s.now, s.now + Duration::from_secs(60));
    if read {
        let spec = BlockSpec {
            local_list: a,
            local_indices: dsts,
            peer: P,
            remote: remote(s, srcs),
        };
        s.nodes[0].eng.start_read_blocks(spec, deadline, now).unwrap()
    } else {
        let spec = BlockSpec {
            local_list: a,
            local_indices: srcs,
            peer: P,
            remote: remote(s, dsts),
        };
        s.nodes[0]
            .eng
            .start_write_blocks(spec, b"ahead".to_vec(), deadline, now)
            .unwrap()
    }
}

#[test]
fn block_receives_are_posted_a_window_ahead_and_land_byte_exact() {
    every_mode(block_receives_are_posted_a_window_ahead_in_mode);
}

fn block_receives_are_posted_a_window_ahead_in_mode() {
    for (read, ahead) in [(false, 3), (true, 3), (false, 0), (true, 0)] {
        let mut s = Sim::new(1, scatter_cfg(ahead), 60 + u64::from(read));
        let src = usize::from(read);
        let (a, b) = lists(&mut s, src);
        let (sb, db) = if read { (2, 1) } else { (1, 2) };
        let (sf, df) = if read { (17, 3) } else { (3, 17) };
        let want = expected(&s.nodes[src].bufs[&sb], sf, &s.nodes[1 - src].bufs[&db], df);
        let t = start_blocks(&mut s, read, a, b);
        // No receive completes: a rendezvous receiver posts window + ahead receives in pieces
        // (an eager one lands in its credits instead).
        s.hold_data = true;
        s.run();
        let posted = recvs(&s, 1 - src);
        if mode_now() == Protocol::Rendezvous {
            assert_eq!(posted, 2 + ahead, "read {read}");
        } else {
            assert!(posted <= 2 + ahead, "{:?} read {read}: {posted}", mode_now());
        }
        s.hold_data = false;
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "{:?} read {read}: {}", mode_now(), o.message);
        assert!(
            s.nodes[1 - src].bufs[&db] == want,
            "{:?} read {read}: the destination differs",
            mode_now()
        );
        assert_eq!(recvs(&s, 1 - src), 0);
        s.assert_idle();
    }
}

#[test]
fn plain_transfers_keep_the_receive_window() {
    let mut s = Sim::new(1, scatter_cfg(3), 8);
    s.buffer(0, 1, SIZE, 5);
    s.buffer(1, 2, SIZE, 0);
    let t = s.write(0, 1, 0, 2, 0, SIZE as u64);
    s.hold_data = true;
    s.run();
    assert_eq!(recvs(&s, 1), 2);
    s.hold_data = false;
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), SIZE as u64));
    s.assert_idle();
}

#[test]
fn block_transfers_gather_a_window_ahead_and_land_byte_exact() {
    every_mode(block_transfers_gather_a_window_ahead_in_mode);
}

fn block_transfers_gather_a_window_ahead_in_mode() {
    for (read, ahead) in [(false, 3), (true, 3), (false, 0), (true, 0)] {
        let mut s = Sim::new(1, ahead_cfg(ahead), 40 + u64::from(read));
        // The sender: node 0 for a WRITE, node 1 (the holder) for a READ.
        let src = usize::from(read);
        let (a, b) = lists(&mut s, src);
        let srcs = IndexArray::from_indices(&(0..BLOCKS).collect::<Vec<_>>());
        let dsts = IndexArray::from_indices(&(0..BLOCKS).rev().collect::<Vec<_>>());
        let remote = |s: &Sim, list: u64, indices: IndexArray| RemoteBlocks {
            list_id: list,
            access_key: s.nodes[1].eng.buffer_key(2).unwrap(),
            blocks: 0,
            block_len: 0,
            indices,
        };
        let (sb, db) = if read { (2, 1) } else { (1, 2) };
        let (sf, df) = if read { (17, 3) } else { (3, 17) };
        let want = expected(&s.nodes[src].bufs[&sb], sf, &s.nodes[1 - src].bufs[&db], df);
        let (now, deadline) = (s.now, s.now + Duration::from_secs(60));
        let t = if read {
            let spec = BlockSpec {
                local_list: a,
                local_indices: dsts,
                peer: P,
                remote: remote(&s, b, srcs),
            };
            s.nodes[0].eng.start_read_blocks(spec, deadline, now).unwrap()
        } else {
            let spec = BlockSpec {
                local_list: a,
                local_indices: srcs,
                peer: P,
                remote: remote(&s, b, dsts),
            };
            s.nodes[0]
                .eng
                .start_write_blocks(spec, b"ahead".to_vec(), deadline, now)
                .unwrap()
        };
        // No send completes: the engine posts window + ahead gathered sends, the plugin holds
        // the window's worth and the driver the rest (none with no gathers ahead).
        s.hold_data = true;
        s.run();
        assert_eq!(
            sends(&s, src),
            (2 + ahead, 2, ahead),
            "{:?} read {read}",
            mode_now()
        );
        s.hold_data = false;
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "{:?} read {read}: {}", mode_now(), o.message);
        assert!(
            s.nodes[1 - src].bufs[&db] == want,
            "{:?} read {read}: the destination differs",
            mode_now()
        );
        // Every chunk of ~200 KB in 4 KiB chunks was gathered.
        assert!(
            s.nodes[src].pieces.gathers >= 49,
            "{}",
            s.nodes[src].pieces.gathers
        );
        assert_eq!(sends(&s, src), (0, 0, 0));
        s.assert_idle();
    }
}

#[test]
fn plain_transfers_keep_the_send_window() {
    every_mode(plain_transfers_keep_the_send_window_in_mode);
}

fn plain_transfers_keep_the_send_window_in_mode() {
    let mut s = Sim::new(1, ahead_cfg(3), 7);
    s.buffer(0, 1, SIZE, 5);
    s.buffer(1, 2, SIZE, 0);
    let t = s.write(0, 1, 0, 2, 0, SIZE as u64);
    s.hold_data = true;
    s.run();
    assert_eq!(sends(&s, 0), (2, 2, 0), "{:?}", mode_now());
    s.hold_data = false;
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), SIZE as u64));
    assert_eq!(s.nodes[0].pieces.gathers, 0);
    s.assert_idle();
}

#[test]
fn host_and_gpu_sources_gather_ahead_by_their_own_settings() {
    every_mode(host_and_gpu_sources_gather_ahead_in_mode);
}

fn host_and_gpu_sources_gather_ahead_in_mode() {
    // GPU sources 1 ahead, host sources 3 (the simulator's buffers are host memory unless the
    // engine is told otherwise, as the daemon tells it at registration).
    for (gpu, ahead) in [(false, 3), (true, 1)] {
        let cfg = EngineConfig {
            send_window: 2,
            gather_ahead: 1,
            host_gather_ahead: 3,
            ..small_chunks()
        };
        let mut s = Sim::new(1, cfg, 50 + u64::from(gpu));
        let (a, b) = lists(&mut s, 0);
        if gpu {
            s.nodes[0]
                .eng
                .set_buffer_memory(1, crate::topology::Memory::Gpu(0));
        }
        let want = expected(&s.nodes[0].bufs[&1], 3, &s.nodes[1].bufs[&2], 17);
        let t = start_blocks(&mut s, false, a, b);
        s.hold_data = true;
        s.run();
        assert_eq!(sends(&s, 0), (2 + ahead, 2, ahead), "{:?} gpu {gpu}", mode_now());
        s.hold_data = false;
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "{:?} gpu {gpu}: {}", mode_now(), o.message);
        assert!(
            s.nodes[1].bufs[&2] == want,
            "{:?} gpu {gpu}: the destination differs",
            mode_now()
        );
        assert_eq!(sends(&s, 0), (0, 0, 0));
        s.assert_idle();
    }
}

#[test]
fn block_receives_consumed_out_of_order_free_their_places_and_land_byte_exact() {
    every_mode(block_receives_consumed_out_of_order_in_mode);
}

/// Scatter receives reported consumed in random order (`Engine::on_scatter_consumed`: the
/// daemon's copies of a lane's chunks end out of order): each consumed one makes room for the
/// next receive at once, the engine never has more than `recv_window + scatter_ahead` of a
/// lane's receives posted, and the bytes land exact with every count back to zero.
fn block_receives_consumed_out_of_order_in_mode() {
    for (read, ahead) in [(false, 3), (true, 3), (false, 0), (true, 1)] {
        let mut s = Sim::new(1, scatter_cfg(ahead), 80 + u64::from(read) + ahead as u64);
        s.scatter_any_order = true;
        let src = usize::from(read);
        let (a, b) = lists(&mut s, src);
        let (sb, db) = if read { (2, 1) } else { (1, 2) };
        let (sf, df) = if read { (17, 3) } else { (3, 17) };
        let want = expected(&s.nodes[src].bufs[&sb], sf, &s.nodes[1 - src].bufs[&db], df);
        let t = start_blocks(&mut s, read, a, b);
        let mut steps = 0;
        let mut out_of_order = 0;
        while s.step() {
            steps += 1;
            assert!(steps < 1_000_000, "no quiescence");
            let posted = recvs(&s, 1 - src);
            assert!(
                posted <= 2 + ahead,
                "{:?} read {read}: {posted} posted",
                mode_now()
            );
            out_of_order += s.wires[src].iter().filter(|w| w.scattered.len() > 1).count();
        }
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "{:?} read {read}: {}", mode_now(), o.message);
        assert!(
            s.nodes[1 - src].bufs[&db] == want,
            "{:?} read {read}: the destination differs",
            mode_now()
        );
        if mode_now() == Protocol::Rendezvous && ahead > 0 {
            assert!(
                out_of_order > 0,
                "read {read}: no two scatters were ever pending at once"
            );
        }
        assert_eq!(recvs(&s, 1 - src), 0);
        s.assert_idle();
    }
}
