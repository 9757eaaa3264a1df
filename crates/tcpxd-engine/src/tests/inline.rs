//! Small transfers inline on the control connection (`inline.rs`): the bytes in the header, no
//! lane, credit or landing slot touched; checked before any byte lands; the window, the limits
//! and a peer that takes none send by the lanes; cancel, deadline and peer loss return everything.

use super::*;
use crate::topology::Memory;

/// The simulator's `SendInline`: the payload gathered from the sender's buffers (a source buffer
/// the simulator does not have cannot be read: the engine is told), sent on control. A gathered
/// payload (GPU sources) is held while the node defers its copies (`Node::copies`), else
/// reported gathered at once.
pub(super) fn sim_send(s: &mut Sim, i: usize, offer: Offer, sources: Vec<(u64, u64, u64)>, gather: bool) {
    let mut payload = Vec::new();
    for (b, off, len) in sources {
        let Some(buf) = s.nodes[i].bufs.get(&b) else {
            s.nodes[i]
                .eng
                .on_inline_unsent(offer.offer_id, &format!("buffer {b} cannot be read"));
            return;
        };
        payload.extend_from_slice(&buf[off as usize..][..len as usize]);
    }
    if gather {
        if let Some(held) = &mut s.nodes[i].copies {
            held.push_back(SimCopy::Gather { offer, payload });
            return;
        }
        if !s.nodes[i].eng.on_inline_gathered(offer.offer_id, Ok(())) {
            return;
        }
    }
    s.ctrl[1 - i].push_back(PeerMsg::Inline { offer, payload });
}

/// The simulator's `LandInline`: copied only while the transfer lands, then reported (held,
/// copied and reported later, while the node defers its copies).
pub(super) fn sim_land(s: &mut Sim, i: usize, offer: u64, dests: Vec<(u64, u64, u64)>, payload: Vec<u8>) {
    let n = &mut s.nodes[i];
    if n.eng.recv_lands(P, offer) {
        if let Some(held) = &mut n.copies {
            held.push_back(SimCopy::Land {
                offer,
                dests,
                payload,
            });
            return;
        }
        copy_in(n, &dests, &payload);
    }
    n.eng.on_inline_landed(P, offer, payload.len() as u64, Ok(()));
}

fn copy_in(n: &mut Node, dests: &[(u64, u64, u64)], payload: &[u8]) {
    let mut at = 0usize;
    for &(b, off, len) in dests {
        let dst = n.bufs.get_mut(&b).expect("a checked destination");
        dst[off as usize..][..len as usize].copy_from_slice(&payload[at..][..len as usize]);
        at += len as usize;
    }
    assert_eq!(at, payload.len(), "the destinations cover the payload");
}

/// A driver's asynchronous inline copy the simulator holds (`Node::copies`).
#[derive(Debug)]
pub(super) enum SimCopy {
    Gather {
        offer: Offer,
        payload: Vec<u8>,
    },
    Land {
        offer: u64,
        dests: Vec<(u64, u64, u64)>,
        payload: Vec<u8>,
    },
}

/// Ends node `i`'s oldest held copy (`Err`: it failed): a gathered payload is sent if the
/// engine says so, a landed one written and reported.
pub(super) fn finish_copy(s: &mut Sim, i: usize, result: Result<(), String>) {
    let copy = s.nodes[i]
        .copies
        .as_mut()
        .and_then(|c| c.pop_front())
        .expect("a held copy");
    match copy {
        SimCopy::Gather { offer, payload } => {
            if s.nodes[i].eng.on_inline_gathered(offer.offer_id, result) {
                s.ctrl[1 - i].push_back(PeerMsg::Inline { offer, payload });
            }
        }
        SimCopy::Land {
            offer,
            dests,
            payload,
        } => {
            let n = &mut s.nodes[i];
            if result.is_ok() {
                copy_in(n, &dests, &payload);
            }
            n.eng.on_inline_landed(P, offer, payload.len() as u64, result);
        }
    }
}

/// Both nodes take up to `max` bytes inline, window `window`.
fn inline_cfg(max: u64, window: u64) -> EngineConfig {
    EngineConfig {
        inline_max_bytes: max,
        inline_window_bytes: window,
        ..small_chunks()
    }
}

/// Bytes and chunks every lane of both nodes carried.
fn lane_traffic(s: &Sim) -> u64 {
    s.nodes
        .iter()
        .map(|n| {
            let c = n.eng.peer_counters(P).unwrap();
            c.send
                .iter()
                .chain(&c.recv)
                .map(|l| l.bytes + l.chunks)
                .sum::<u64>()
        })
        .sum()
}

fn sent_inline(s: &Sim, node: usize) -> (u64, u64) {
    let c = s.nodes[node].eng.peer_counters(P).unwrap();
    (c.sent_inline, c.received_inline)
}

#[test]
fn inline_writes_and_reads_land_byte_exact_with_control_messages_only() {
    every_mode(inline_in_mode);
}

fn inline_in_mode() {
    let mut s = Sim::new(2, inline_cfg(4096, 1 << 20), 11);
    s.buffer(0, 1, 16384, 1);
    s.buffer(0, 3, 16384, 0);
    s.buffer(1, 2, 16384, 0);
    s.buffer(1, 4, 16384, 7);
    let writes: Vec<(TransferId, u64, u64)> = [(0u64, 1u64), (100, 4000), (8192, 4096)]
        .into_iter()
        .map(|(off, len)| (s.write(0, 1, off, 2, off + 1, len), off, len))
        .collect();
    let r = s.read(0, 4, 50, 3, 60, 4096);
    s.run();
    for &(t, off, len) in &writes {
        let o = s.outcome(0, t);
        assert_eq!((o.code, o.landed), (Code::Ok, len), "{o:?}");
        assert!(s.same((0, 1, off), (1, 2, off + 1), len));
    }
    assert_eq!(s.outcome(0, r).code, Code::Ok);
    assert!(s.same((1, 4, 50), (0, 3, 60), 4096));
    // The notifications come after their bytes, one per WRITE, in the order sent.
    let ids: Vec<u64> = s.nodes[1].notes.iter().map(|n| n.0).collect();
    assert_eq!(ids, writes.iter().map(|w| w.0.0).collect::<Vec<_>>());
    assert_eq!(lane_traffic(&s), 0, "no lane carried anything");
    assert_eq!(sent_inline(&s, 0), (3, 1));
    assert_eq!(sent_inline(&s, 1), (1, 3));
    let c = s.nodes[0].eng.peer_counters(P).unwrap();
    assert_eq!((c.sent_eager, c.sent_rendezvous, c.received_eager), (0, 0, 0));
    assert_eq!((c.transfers_ok, c.transfers_failed), (4, 0));
    assert_eq!(s.nodes[0].eng.inline_outstanding(P), 0);
    assert_eq!(s.nodes[1].eng.inline_outstanding(P), 0);
    s.assert_idle();
}

#[test]
fn a_batch_of_several_ranges_goes_inline_as_their_bytes_in_order() {
    let mut s = Sim::new(1, inline_cfg(4096, 1 << 20), 3);
    s.buffer(0, 1, 8192, 9);
    s.buffer(1, 2, 8192, 0);
    s.buffer(1, 5, 8192, 0);
    let spec = |loff: u64, remote: u64, roff: u64, length: u64| WriteSpec {
        local_buffer: 1,
        local_offset: loff,
        peer: P,
        remote: RemoteRange {
            buffer_id: remote,
            access_key: key(remote as u8),
            offset: roff,
            length,
        },
    };
    let deadline = s.now + Duration::from_secs(60);
    // One buffer each side (coalesced), then two remote buffers (range by range).
    let one = vec![spec(0, 2, 4000, 10), spec(700, 2, 0, 1000), spec(30, 2, 2000, 7)];
    let two = vec![spec(5000, 2, 6000, 100), spec(6000, 5, 3, 2000)];
    let mut ids = Vec::new();
    for specs in [one.clone(), two.clone()] {
        ids.push(
            s.nodes[0]
                .eng
                .start_write(specs, Vec::new(), deadline, s.now)
                .unwrap(),
        );
    }
    s.run();
    for (t, specs) in ids.into_iter().zip([one, two]) {
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        for w in specs {
            let r = &w.remote;
            assert!(s.same((0, 1, w.local_offset), (1, r.buffer_id, r.offset), r.length));
        }
    }
    assert_eq!(lane_traffic(&s), 0);
    assert_eq!(sent_inline(&s, 0), (2, 0));
    s.assert_idle();
}

#[test]
fn past_the_limit_with_no_limit_or_a_peer_that_takes_none_the_lanes_carry_it() {
    every_mode(lanes_in_mode);
}

fn lanes_in_mode() {
    // (sender's limit, receiver's limit, bytes): none goes inline.
    for (mine, theirs, len) in [
        (4096, 4096, 4097),
        (0, 4096, 10),
        (4096, 0, 10),
        (4096, 65536, 8000),
    ] {
        let mut s = Sim::pair(
            2,
            [inline_cfg(mine, 1 << 20), inline_cfg(theirs, 1 << 20)].map(|c| EngineConfig {
                protocol: mode_now(),
                eager_max_bytes: SIM_EAGER_MAX,
                ..c
            }),
            4,
        );
        s.buffer(0, 1, 16384, 1);
        s.buffer(1, 2, 16384, 0);
        let t = s.write(0, 1, 0, 2, 0, len);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        assert!(s.same((0, 1, 0), (1, 2, 0), len));
        assert_eq!(sent_inline(&s, 0), (0, 0), "{mine} {theirs} {len}");
        assert!(lane_traffic(&s) > 0);
        s.assert_idle();
    }
}

#[test]
fn a_transfer_past_the_window_takes_the_lanes_at_once() {
    let mut s = Sim::new(1, inline_cfg(4096, 8192), 5);
    s.buffer(0, 1, 16384, 1);
    s.buffer(1, 2, 16384, 0);
    let ts: Vec<TransferId> = (0..3u64)
        .map(|k| s.write(0, 1, k * 4096, 2, k * 4096, 4096))
        .collect();
    s.drain();
    assert_eq!(
        s.nodes[0].eng.inline_outstanding(P),
        8192,
        "two inline, the window full"
    );
    let c = s.nodes[0].eng.peer_counters(P).unwrap();
    assert_eq!((c.sent_inline, c.sent_eager + c.sent_rendezvous), (2, 1));
    s.run();
    for t in ts {
        assert_eq!(s.outcome(0, t).code, Code::Ok);
    }
    assert!(s.same((0, 1, 0), (1, 2, 0), 12288));
    assert_eq!(
        s.nodes[0].eng.inline_outstanding(P),
        0,
        "the window is free again"
    );
    // With the window free, the next one goes inline again.
    let t = s.write(0, 1, 0, 2, 0, 4096);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert_eq!(sent_inline(&s, 0), (3, 0));
    s.assert_idle();
}

#[test]
fn gpu_sources_and_announced_gpu_destinations_go_inline_only_with_inline_gpu() {
    for gpu in [false, true] {
        let cfg = EngineConfig {
            inline_gpu: gpu,
            ..inline_cfg(4096, 1 << 20)
        };
        let mut s = Sim::new(1, cfg, 6);
        s.buffer(0, 1, 8192, 1);
        s.buffer(1, 2, 8192, 0);
        s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(0));
        let t = s.write(0, 1, 0, 2, 0, 4096);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        assert!(s.same((0, 1, 0), (1, 2, 0), 4096));
        assert_eq!(sent_inline(&s, 0).0, u64::from(gpu), "inline_gpu {gpu}");
        s.assert_idle();
    }
}

#[test]
fn cancel_deadline_and_peer_loss_before_the_answer_return_everything() {
    for how in ["cancel", "deadline", "peer loss"] {
        let mut s = Sim::new(1, inline_cfg(4096, 1 << 20), 8);
        s.buffer(0, 1, 8192, 1);
        s.buffer(1, 2, 8192, 0);
        let t = s.write(0, 1, 0, 2, 0, 4096);
        // The inline message is on its way: the sender has not had the answer yet.
        s.drain();
        assert_eq!(s.nodes[0].eng.inline_outstanding(P), 4096);
        assert_eq!(s.nodes[0].eng.buffer_users(1), Some(1));
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
                s.ctrl[1].clear();
                Code::Unavailable
            }
        };
        s.run();
        assert_eq!(s.outcome(0, t).code, code, "{how}");
        assert_eq!(s.nodes[0].eng.inline_outstanding(P), 0, "{how}");
        assert_eq!(s.nodes[0].eng.buffer_users(1), Some(0), "{how}");
        assert!(s.nodes[0].eng.is_idle(), "{how}");
        if how != "peer loss" {
            // The receiver answered the message before the cancel: its bytes landed and the
            // held offer ended with that answer.
            assert!(s.same((0, 1, 0), (1, 2, 0), 4096));
            s.assert_idle();
        }
    }
}

// ---- one engine, messages by hand: the receiver's order and refusals, the sender's faults -----

const PEER: PeerIdx = PeerIdx(0);

/// A receiver taking 4096 bytes inline, buffer 2 (4096 bytes, key 2) registered.
fn receiver() -> Engine {
    let mut e = Engine::new(EngineConfig {
        inline_max_bytes: 4096,
        max_notification: 16,
        ..small_chunks()
    });
    assert_eq!(e.add_peer("sender", 1, 1), PEER);
    e.add_buffer(2, 4096, key(2)).unwrap();
    rendezvous_peer(&mut e, PEER);
    e
}

fn inline_msg(ranges: Vec<RemoteRange>, payload: usize, note: &[u8]) -> PeerMsg {
    PeerMsg::Inline {
        offer: Offer {
            offer_id: 9,
            read_id: 0,
            chunk_bytes: MIN_CHUNK_BYTES,
            first_lane: 0,
            ranges: ranges.into(),
            notification: note.to_vec(),
            deadline_ms: 1000,
            blocks: None,
            coalesced: false,
            transfer_id: 77,
            announced: None,
        },
        payload: vec![5; payload],
    }
}

fn range(buffer_id: u64, access: u8, offset: u64, length: u64) -> RemoteRange {
    RemoteRange {
        buffer_id,
        access_key: key(access),
        offset,
        length,
    }
}

fn actions(e: &mut Engine) -> Vec<Action> {
    std::iter::from_fn(|| e.poll_action()).collect()
}

#[test]
fn the_receiver_lands_then_answers_done_then_notifies() {
    let mut e = receiver();
    e.on_message(
        PEER,
        inline_msg(vec![range(2, 2, 0, 10), range(2, 2, 100, 20)], 30, b"hi"),
        Instant::now(),
    );
    let a = actions(&mut e);
    assert_eq!(a.len(), 1, "only the landing before the bytes are in: {a:?}");
    let Action::LandInline {
        offer,
        dests,
        payload,
        ..
    } = &a[0]
    else {
        panic!("{a:?}")
    };
    assert_eq!(
        (*offer, dests.clone(), payload.len()),
        (9, vec![(2, 0, 10), (2, 100, 20)], 30)
    );
    assert!(e.recv_lands(PEER, 9));
    assert_eq!(
        e.buffer_users(2),
        Some(2),
        "in use while it lands (once per range)"
    );
    e.on_inline_landed(PEER, 9, 30, Ok(()));
    let a = actions(&mut e);
    assert!(
        matches!(
            &a[0],
            Action::Control {
                msg: PeerMsg::Done { offer_id: 9, .. },
                ..
            }
        ),
        "{a:?}"
    );
    assert!(
        matches!(&a[1], Action::Notify { transfer_id: 77, payload, buffers, .. } if payload == b"hi" && buffers.iter().all(|&b| b == 2)),
        "{a:?}"
    );
    // The `Done` on the wire at once, after the notification is handed over.
    assert!(
        matches!(&a[2], Action::SendNow { peer } if *peer == PEER),
        "{a:?}"
    );
    assert_eq!(a.len(), 3, "{a:?}");
    assert_eq!(e.buffer_users(2), Some(0));
    assert!(e.is_idle());
    let c = e.peer_counters(PEER).unwrap();
    assert_eq!(
        (c.received_inline, c.received_eager, c.received_rendezvous),
        (1, 0, 0)
    );
}

#[test]
fn refused_inline_transfers_land_nothing_and_name_the_range() {
    let cases: Vec<(PeerMsg, Code, u32, &str)> = vec![
        (
            inline_msg(vec![range(2, 2, 0, 8), range(2, 3, 8, 8)], 16, b""),
            Code::PermissionDenied,
            1,
            "ranges[1]: wrong access key",
        ),
        (
            inline_msg(vec![range(3, 3, 0, 8)], 8, b""),
            Code::NotFound,
            0,
            "ranges[0]: buffer 3 does not exist",
        ),
        (
            inline_msg(vec![range(2, 2, 4090, 8)], 8, b""),
            Code::InvalidArgument,
            0,
            "ranges[0].offset",
        ),
        (
            inline_msg(vec![range(2, 2, 0, 8)], 8, &[1; 17]),
            Code::InvalidArgument,
            0,
            "notification of 17 bytes exceeds 16",
        ),
        (
            inline_msg(vec![range(2, 2, 0, 8)], 7, b""),
            Code::InvalidArgument,
            0,
            "payload: 7 bytes inline for ranges of 8 bytes",
        ),
        (
            inline_msg(vec![range(2, 2, 0, 4096), range(2, 2, 0, 1)], 4097, b""),
            Code::InvalidArgument,
            0,
            "exceeds this node's inline limit of 4096",
        ),
    ];
    for (msg, code, index, words) in cases {
        let mut e = receiver();
        e.on_message(PEER, msg, Instant::now());
        let a = actions(&mut e);
        match &a[..] {
            [
                Action::Control {
                    msg:
                        PeerMsg::Reject {
                            offer_id: 9,
                            code: c,
                            message,
                            range_index,
                        },
                    ..
                },
            ] => {
                assert_eq!((*c, *range_index), (code, index), "{message}");
                assert!(message.contains(words), "{message}");
            }
            other => panic!("{words}: {other:?}"),
        }
        assert!(!e.recv_lands(PEER, 9));
        assert_eq!(e.buffer_users(2), Some(0));
        assert!(e.is_idle());
        assert!(
            e.peer_counters(PEER).unwrap().failed.is_none(),
            "the pairing stays up"
        );
    }
}

#[test]
fn a_landing_that_fails_answers_failed_and_delivers_nothing() {
    let mut e = receiver();
    e.on_message(
        PEER,
        inline_msg(vec![range(2, 2, 0, 10)], 10, b"n"),
        Instant::now(),
    );
    actions(&mut e);
    e.on_inline_landed(PEER, 9, 10, Err("the copy failed".into()));
    let a = actions(&mut e);
    assert!(
        matches!(&a[..], [Action::Control { msg: PeerMsg::Failed { offer_id: 9, code: Code::Internal, message }, .. }] if message == "the copy failed"),
        "{a:?}"
    );
    assert_eq!(e.buffer_users(2), Some(0));
    assert!(e.is_idle());
}

/// A sender whose peer takes 4096 bytes inline and receives by rendezvous; buffer 1 (8192).
fn sender() -> Engine {
    let mut e = Engine::new(EngineConfig {
        inline_max_bytes: 4096,
        ..small_chunks()
    });
    assert_eq!(e.add_peer("receiver", 1, 1), PEER);
    e.add_buffer(1, 8192, key(1)).unwrap();
    e.on_message(PEER, PeerMsg::InlineLimit { max_bytes: 1 << 30 }, Instant::now());
    rendezvous_peer(&mut e, PEER);
    e
}

fn write_spec(len: u64) -> WriteSpec {
    WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: PEER,
        remote: range(2, 2, 0, len),
    }
}

#[test]
fn a_source_that_cannot_be_read_fails_the_write_and_frees_the_window() {
    let mut e = sender();
    let now = Instant::now();
    let t = e
        .start_write(
            vec![write_spec(4096)],
            Vec::new(),
            now + Duration::from_secs(9),
            now,
        )
        .unwrap();
    let a = actions(&mut e);
    let Some(Action::SendInline { offer, sources, .. }) =
        a.iter().find(|a| matches!(a, Action::SendInline { .. }))
    else {
        panic!("{a:?}")
    };
    assert_eq!(sources, &vec![(1, 0, 4096)]);
    assert_eq!(e.inline_outstanding(PEER), 4096);
    e.on_inline_unsent(offer.offer_id, "the client's memory is gone");
    let a = actions(&mut e);
    assert!(
        a.iter().any(|a| matches!(a, Action::Finished { transfer, outcome } if *transfer == t && outcome.code == Code::FailedPrecondition && outcome.message.contains("memory is gone"))),
        "{a:?}"
    );
    assert_eq!(e.inline_outstanding(PEER), 0);
    assert_eq!(e.buffer_users(1), Some(0));
    assert!(e.is_idle());
}

#[test]
fn a_peer_limit_above_this_node_is_taken_as_the_smaller() {
    let mut e = sender();
    let now = Instant::now();
    // 4097 > this node's 4096 (the peer said 1 GiB): by the lanes, an offer.
    e.start_write(
        vec![write_spec(4097)],
        Vec::new(),
        now + Duration::from_secs(9),
        now,
    )
    .unwrap();
    let a = actions(&mut e);
    assert!(
        a.iter().any(|a| matches!(
            a,
            Action::Control {
                msg: PeerMsg::Offer(_),
                ..
            }
        )),
        "{a:?}"
    );
    assert!(!a.iter().any(|a| matches!(a, Action::SendInline { .. })), "{a:?}");
    assert_eq!(e.inline_outstanding(PEER), 0);
}

#[test]
fn block_writes_and_reads_go_inline_as_their_wire_stream() {
    use crate::blocks::{IndexArray, Layout};
    let mut s = Sim::new(1, inline_cfg(8192, 1 << 20), 12);
    s.buffer(0, 1, 1 << 16, 3);
    s.buffer(1, 2, 1 << 16, 0);
    let strided = |first| Layout::Strided {
        first,
        stride: 1024,
        len: 1000,
        count: 16,
    };
    let a = s.nodes[0].eng.register_blocks(1, strided(0)).unwrap();
    let b = s.nodes[1].eng.register_blocks(2, strided(7)).unwrap();
    let remote = |s: &Sim, indices: &[u32]| RemoteBlocks {
        list_id: b,
        access_key: s.nodes[1].eng.buffer_key(2).unwrap(),
        blocks: 0,
        block_len: 0,
        indices: IndexArray::compact(indices),
    };
    let deadline = s.now + Duration::from_secs(60);
    // Blocks 3, 0, 9 of a into 5, 15, 1 of b (3000 bytes), then 8 of them back (8000).
    let w = BlockSpec {
        local_list: a,
        local_indices: IndexArray::compact(&[3, 0, 9]),
        peer: P,
        remote: remote(&s, &[5, 15, 1]),
    };
    let tw = s.nodes[0]
        .eng
        .start_write_blocks(w, b"blocks".to_vec(), deadline, s.now)
        .unwrap();
    s.run();
    assert_eq!(s.outcome(0, tw).code, Code::Ok);
    for (x, y) in [(3u64, 5u64), (0, 15), (9, 1)] {
        assert!(
            s.same((0, 1, x * 1024), (1, 2, 7 + y * 1024), 1000),
            "block {x} -> {y}"
        );
    }
    assert_eq!(s.nodes[1].notes.len(), 1);
    let back: Vec<u32> = (8..16).collect();
    let r = BlockSpec {
        local_list: a,
        local_indices: IndexArray::compact(&back),
        peer: P,
        remote: remote(&s, &[0, 1, 2, 3, 4, 5, 6, 7]),
    };
    let tr = s.nodes[0].eng.start_read_blocks(r, deadline, s.now).unwrap();
    s.run();
    assert_eq!(s.outcome(0, tr).code, Code::Ok);
    for k in 0..8u64 {
        assert!(
            s.same((1, 2, 7 + k * 1024), (0, 1, (8 + k) * 1024), 1000),
            "block {k}"
        );
    }
    assert_eq!(lane_traffic(&s), 0, "no lane carried anything");
    assert_eq!(sent_inline(&s, 0), (1, 1));
    assert_eq!(sent_inline(&s, 1), (1, 1));
    s.assert_idle();
}

/// Peers with GPUs (their topologies say so) that announce no GPU buffers: a WRITE cannot know
/// its destination is host memory, so it takes the lanes; a READ's reader says its destinations
/// are host memory (`ReadRequest::host_dests`), so the holder answers inline — plain and block.
#[test]
fn towards_a_peer_with_gpus_only_reads_that_say_host_destinations_go_inline() {
    use crate::blocks::{IndexArray, Layout};
    let mut s = Sim::new(1, inline_cfg(8192, 1 << 20), 13);
    for n in &mut s.nodes {
        n.eng.set_peer_topology(P, super::routes::node(2, 1));
    }
    s.buffer(0, 1, 1 << 16, 3);
    s.buffer(1, 2, 1 << 16, 4);
    let w = s.write(0, 1, 0, 2, 0, 4096);
    let r = s.read(0, 2, 8192, 1, 8192, 4096);
    s.run();
    assert_eq!(s.outcome(0, w).code, Code::Ok);
    assert_eq!(s.outcome(0, r).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 4096));
    assert!(s.same((1, 2, 8192), (0, 1, 8192), 4096));
    assert_eq!(
        sent_inline(&s, 0),
        (0, 1),
        "the WRITE by the lanes, the READ's answer inline"
    );
    assert_eq!(sent_inline(&s, 1), (1, 0));
    // A block READ too; and with its destination in GPU memory, by the lanes.
    let strided = |first| Layout::Strided {
        first,
        stride: 1024,
        len: 1000,
        count: 8,
    };
    let a = s.nodes[0].eng.register_blocks(1, strided(20_000)).unwrap();
    let b = s.nodes[1].eng.register_blocks(2, strided(30_000)).unwrap();
    for gpu in [false, true] {
        if gpu {
            s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(0));
        }
        let spec = BlockSpec {
            local_list: a,
            local_indices: IndexArray::compact(&[1, 2, 3]),
            peer: P,
            remote: RemoteBlocks {
                list_id: b,
                access_key: s.nodes[1].eng.buffer_key(2).unwrap(),
                blocks: 0,
                block_len: 0,
                indices: IndexArray::compact(&[7, 0, 4]),
            },
        };
        let deadline = s.now + Duration::from_secs(60);
        let t = s.nodes[0].eng.start_read_blocks(spec, deadline, s.now).unwrap();
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        for (x, y) in [(1u64, 7u64), (2, 0), (3, 4)] {
            assert!(
                s.same((1, 2, 30_000 + y * 1024), (0, 1, 20_000 + x * 1024), 1000),
                "gpu {gpu}"
            );
        }
        assert_eq!(sent_inline(&s, 1).0, 2, "gpu {gpu}: only the host one inline");
    }
    s.assert_idle();
}
