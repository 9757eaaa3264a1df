//! Inline GPU copies off the driver's thread (`inline.rs`, "GPU copies off the driver's
//! thread"): a GPU source's payload gathered asynchronously is sent only once the driver reports
//! it; a payload landing in GPU memory ends its transfer only once reported; many such copies
//! overlap; cancel, deadline, a reader's cancel and peer loss while a copy runs end the transfer
//! once, send nothing, return the window and GPU count when the copy ends; the copies keep their
//! buffers in use (a release waits for them).

use super::inline::finish_copy;
use super::*;
use crate::topology::Memory;

/// Both nodes take 4096 bytes inline (window 1 MiB), GPU inline on, eight GPU transfers at once.
fn cfg() -> EngineConfig {
    EngineConfig {
        inline_max_bytes: 4096,
        inline_window_bytes: 1 << 20,
        inline_gpu: true,
        inline_gpu_in_flight: 8,
        ..small_chunks()
    }
}

/// Node 0's buffer 1 and node 1's buffer 2, both GPU memory, both nodes' copies held.
fn gpu_pair(seed: u64) -> Sim {
    let mut s = Sim::new(1, cfg(), seed);
    s.buffer(0, 1, 1 << 16, 1);
    s.buffer(1, 2, 1 << 16, 0);
    s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(0));
    s.nodes[1].eng.set_buffer_memory(2, Memory::Gpu(1));
    for n in &mut s.nodes {
        n.copies = Some(Default::default());
    }
    s
}

fn held(s: &Sim, i: usize) -> usize {
    s.nodes[i].copies.as_ref().map_or(0, |c| c.len())
}

fn inline_messages(s: &Sim, to: usize) -> usize {
    s.ctrl[to]
        .iter()
        .filter(|m| matches!(m, PeerMsg::Inline { .. }))
        .count()
}

#[test]
fn eight_gpu_copies_overlap_and_each_transfer_ends_only_after_its_copies() {
    let mut s = gpu_pair(31);
    let ts: Vec<TransferId> = (0..8u64)
        .map(|k| s.write(0, 1, k * 4096, 2, k * 4096 + 3, 4000))
        .collect();
    s.run();
    // Every payload is being copied out at once; none is on the wire yet.
    assert_eq!(held(&s, 0), 8);
    assert_eq!(s.nodes[0].eng.inline_copies_in_flight(), 8);
    assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), 8);
    assert_eq!(inline_messages(&s, 1), 0);
    assert_eq!(
        s.nodes[0].eng.buffer_users(1),
        Some(16),
        "the offers' and the copies' uses"
    );
    // The copies end: the messages go, and the receiver's landings are all under way at once.
    for _ in 0..8 {
        finish_copy(&mut s, 0, Ok(()));
    }
    assert_eq!(s.nodes[0].eng.inline_copies_in_flight(), 0);
    s.run();
    assert_eq!(held(&s, 1), 8);
    assert_eq!(s.nodes[1].eng.inline_copies_in_flight(), 8);
    assert!(s.nodes[1].eng.buffer_users(2).unwrap() >= 8);
    assert!(
        ts.iter().all(|t| !s.nodes[0].finished.contains_key(t)),
        "no Done before a landing"
    );
    assert!(s.ctrl[0].iter().all(|m| !matches!(m, PeerMsg::Done { .. })));
    for (k, &t) in (0u64..).zip(&ts) {
        finish_copy(&mut s, 1, Ok(()));
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        assert!(s.same((0, 1, k * 4096), (1, 2, k * 4096 + 3), 4000));
    }
    for i in 0..2 {
        assert_eq!(s.nodes[i].eng.inline_copies_in_flight(), 0);
        assert_eq!(s.nodes[i].eng.inline_gpu_in_flight(P), 0);
        assert_eq!(s.nodes[i].eng.inline_outstanding(P), 0);
    }
    s.assert_idle();
}

#[test]
fn a_failed_gather_fails_the_write_and_a_failed_landing_is_reported() {
    let mut s = gpu_pair(32);
    let t = s.write(0, 1, 0, 2, 0, 4096);
    s.run();
    finish_copy(&mut s, 0, Err("device fault".into()));
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::FailedPrecondition);
    assert!(o.message.contains("device fault"), "{}", o.message);
    assert_eq!(inline_messages(&s, 1), 0);
    let t = s.write(0, 1, 0, 2, 0, 4096);
    s.run();
    finish_copy(&mut s, 0, Ok(()));
    s.run();
    finish_copy(&mut s, 1, Err("device fault".into()));
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Internal);
    for i in 0..2 {
        assert_eq!(s.nodes[i].eng.inline_copies_in_flight(), 0);
        assert_eq!(s.nodes[i].eng.inline_gpu_in_flight(P), 0);
    }
    s.assert_idle();
}

#[test]
fn cancel_deadline_and_peer_loss_while_gathering_end_once_and_send_nothing() {
    for how in ["cancel", "deadline", "peer loss"] {
        let mut s = gpu_pair(33);
        let t = s.write(0, 1, 0, 2, 0, 4096);
        s.run();
        assert_eq!(held(&s, 0), 1, "{how}");
        let code = match how {
            "cancel" => {
                assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "by the test"));
                Code::Cancelled
            }
            "deadline" => {
                let late = s.now + Duration::from_secs(61);
                s.nodes[0].eng.on_tick(late);
                Code::DeadlineExceeded
            }
            _ => {
                s.nodes[0].eng.on_peer_failed(P, "the test broke it");
                Code::Unavailable
            }
        };
        s.run();
        // The transfer ended at once, exactly once ...
        assert_eq!(s.outcome(0, t).code, code, "{how}");
        assert!(!s.nodes[0].eng.cancel(t, Code::Cancelled, "again"), "{how}");
        // ... but the copy still runs: its buffer stays in use, nothing said to the peer.
        assert_eq!(s.nodes[0].eng.inline_copies_in_flight(), 1, "{how}");
        assert!(s.nodes[0].eng.buffer_users(1).unwrap() >= 1, "{how}");
        assert!(
            !s.nodes[0].eng.watch_buffer(1),
            "{how}: a release waits for the copy"
        );
        assert!(
            s.ctrl[1]
                .iter()
                .all(|m| !matches!(m, PeerMsg::CancelOffer { .. })),
            "{how}"
        );
        if how != "peer loss" {
            assert_eq!(
                s.nodes[0].eng.inline_gpu_in_flight(P),
                1,
                "{how}: counted until the copy ends"
            );
        }
        finish_copy(&mut s, 0, Ok(()));
        assert_eq!(inline_messages(&s, 1), 0, "{how}: nothing sent after the cancel");
        if how == "peer loss" {
            s.ctrl[1].clear();
        }
        s.run();
        assert_eq!(
            s.nodes[0].idle,
            vec![1],
            "{how}: the release goes on once the copy ended"
        );
        assert_eq!(s.nodes[0].eng.buffer_users(1), Some(0), "{how}");
        assert_eq!(s.nodes[0].eng.inline_copies_in_flight(), 0, "{how}");
        assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), 0, "{how}");
        assert_eq!(s.nodes[0].eng.inline_outstanding(P), 0, "{how}");
        assert!(s.nodes[0].eng.is_idle(), "{how}");
        assert_eq!(s.nodes[1].eng.inline_copies_in_flight(), 0, "{how}");
        if how != "peer loss" {
            s.nodes[0].copies = None;
            s.nodes[1].copies = None;
            let t = s.write(0, 1, 0, 2, 0, 4096);
            s.run();
            assert_eq!(s.outcome(0, t).code, Code::Ok, "{how}");
            assert!(s.same((0, 1, 0), (1, 2, 0), 4096), "{how}");
            s.assert_idle();
        }
    }
}

#[test]
fn a_readers_cancel_while_the_holder_gathers_sends_nothing() {
    let mut s = gpu_pair(34);
    // Node 1 reads node 0's GPU buffer 1 into its buffer 2: node 0 is the holder.
    let t = s.read(1, 1, 0, 2, 0, 4096);
    s.run();
    assert_eq!(held(&s, 0), 1);
    assert!(s.nodes[1].eng.cancel(t, Code::Cancelled, "by the test"));
    s.run();
    assert_eq!(s.outcome(1, t).code, Code::Cancelled);
    assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), 1, "until the copy ends");
    finish_copy(&mut s, 0, Ok(()));
    assert_eq!(inline_messages(&s, 1), 0);
    s.run();
    assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), 0);
    s.assert_idle();
}

#[test]
fn cancel_and_peer_loss_while_landing_keep_the_destination_until_the_copy_ends() {
    for how in ["sender cancels", "peer loss"] {
        let mut s = gpu_pair(35);
        let t = s.write(0, 1, 0, 2, 0, 4096);
        s.run();
        finish_copy(&mut s, 0, Ok(()));
        s.run();
        assert_eq!(held(&s, 1), 1, "{how}: landing");
        match how {
            "sender cancels" => {
                assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "by the test"));
                s.run();
                assert_eq!(s.outcome(0, t).code, Code::Cancelled);
            }
            _ => {
                s.nodes[1].eng.on_peer_failed(P, "the test broke it");
                s.nodes[0].eng.on_peer_failed(P, "the test broke it");
                s.ctrl = Default::default();
                s.run();
            }
        }
        assert!(
            !s.nodes[1].eng.watch_buffer(2),
            "{how}: a release waits for the copy"
        );
        assert_eq!(s.nodes[1].eng.inline_copies_in_flight(), 1, "{how}");
        finish_copy(&mut s, 1, Ok(()));
        if how == "peer loss" {
            s.ctrl = Default::default();
        }
        s.run();
        assert_eq!(s.nodes[1].idle, vec![2], "{how}");
        assert_eq!(s.nodes[1].eng.buffer_users(2), Some(0), "{how}");
        assert_eq!(s.nodes[1].eng.inline_copies_in_flight(), 0, "{how}");
        assert!(
            s.nodes[1].notes.is_empty(),
            "{how}: no notification after a cancel"
        );
        if how != "peer loss" {
            s.assert_idle();
        }
    }
}
