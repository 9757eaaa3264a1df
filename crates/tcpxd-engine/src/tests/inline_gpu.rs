//! The GPU inline bound (`inline_gpu_in_flight`, `inline.rs`): transfers touching GPU memory go
//! inline only while fewer than the bound are unanswered on the pairing, the rest take the lanes
//! at once; host transfers are not counted; a READ's holder bounds its own answers; cancel,
//! deadline and peer loss bring the count back to zero.

use super::*;
use crate::topology::Memory;

/// Both nodes take 4096 bytes inline (window 1 MiB), GPU inline on, `in_flight` GPU transfers.
fn gpu_cfg(in_flight: u64) -> EngineConfig {
    EngineConfig {
        inline_max_bytes: 4096,
        inline_window_bytes: 1 << 20,
        inline_gpu: true,
        inline_gpu_in_flight: in_flight,
        ..small_chunks()
    }
}

/// Sent inline, sent on lanes (eager or rendezvous) by `node`.
fn inline_and_lanes(s: &Sim, node: usize) -> (u64, u64) {
    let c = s.nodes[node].eng.peer_counters(P).unwrap();
    (c.sent_inline, c.sent_eager + c.sent_rendezvous)
}

#[test]
fn gpu_writes_past_the_bound_take_the_lanes_and_host_ones_stay_inline() {
    for in_flight in [0u64, 1, 2] {
        let mut s = Sim::new(1, gpu_cfg(in_flight), 21);
        s.buffer(0, 1, 1 << 16, 1);
        s.buffer(0, 3, 1 << 16, 5);
        s.buffer(1, 2, 1 << 16, 0);
        s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(0));
        let gpu: Vec<TransferId> = (0..4u64)
            .map(|k| s.write(0, 1, k * 4096, 2, k * 4096, 4096))
            .collect();
        let host = s.write(0, 3, 0, 2, 32768, 4096);
        s.drain();
        let inline_gpu = in_flight.min(4);
        assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), inline_gpu, "{in_flight}");
        assert_eq!(
            inline_and_lanes(&s, 0),
            (inline_gpu + 1, 4 - inline_gpu),
            "bound {in_flight}: the host WRITE inline whatever the GPU count"
        );
        s.run();
        for t in gpu.into_iter().chain([host]) {
            assert_eq!(s.outcome(0, t).code, Code::Ok, "{in_flight}");
        }
        assert!(s.same((0, 1, 0), (1, 2, 0), 16384));
        assert!(s.same((0, 3, 0), (1, 2, 32768), 4096));
        assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), 0, "{in_flight}");
        assert_eq!(s.nodes[0].eng.inline_outstanding(P), 0, "{in_flight}");
        // Answered, the bound is free again: the next GPU WRITE goes inline (if any may).
        let t = s.write(0, 1, 0, 2, 0, 4096);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        let again = u64::from(in_flight > 0);
        assert_eq!(inline_and_lanes(&s, 0).0, inline_gpu + 1 + again, "{in_flight}");
        s.assert_idle();
    }
}

#[test]
fn a_holder_bounds_its_gpu_answers_to_reads() {
    let mut s = Sim::new(1, gpu_cfg(1), 22);
    s.buffer(0, 3, 1 << 16, 0);
    s.buffer(1, 4, 1 << 16, 9);
    s.nodes[1].eng.set_buffer_memory(4, Memory::Gpu(0));
    let reads: Vec<TransferId> = (0..3u64)
        .map(|k| s.read(0, 4, k * 4096, 3, k * 4096, 4096))
        .collect();
    // Every request reaches the holder before any answer comes back.
    s.drain();
    while let Some(m) = s.ctrl[1].pop_front() {
        s.nodes[1].eng.on_message(P, m, s.now);
    }
    s.drain();
    assert_eq!(s.nodes[1].eng.inline_gpu_in_flight(P), 1);
    assert_eq!(
        inline_and_lanes(&s, 1),
        (1, 2),
        "one answer inline, two by the lanes"
    );
    s.run();
    for t in reads {
        assert_eq!(s.outcome(0, t).code, Code::Ok);
    }
    assert!(s.same((1, 4, 0), (0, 3, 0), 12288));
    assert_eq!(s.nodes[1].eng.inline_gpu_in_flight(P), 0);
    s.assert_idle();
}

#[test]
fn cancel_deadline_and_peer_loss_return_the_gpu_count() {
    for how in ["cancel", "deadline", "peer loss", "reject"] {
        let mut s = Sim::new(1, gpu_cfg(1), 23);
        s.buffer(0, 1, 8192, 1);
        s.buffer(1, 2, 8192, 0);
        s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(0));
        let t = if how == "reject" {
            // A wrong key: the receiver refuses the inline message.
            let spec = WriteSpec {
                local_buffer: 1,
                local_offset: 0,
                peer: P,
                remote: RemoteRange {
                    buffer_id: 2,
                    access_key: key(99),
                    offset: 0,
                    length: 4096,
                },
            };
            let deadline = s.now + Duration::from_secs(60);
            s.nodes[0]
                .eng
                .start_write(vec![spec], Vec::new(), deadline, s.now)
                .unwrap()
        } else {
            s.write(0, 1, 0, 2, 0, 4096)
        };
        s.drain();
        assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), 1, "{how}");
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
            "reject" => Code::PermissionDenied,
            _ => {
                s.nodes[0].eng.on_peer_failed(P, "the test broke it");
                s.ctrl[1].clear();
                Code::Unavailable
            }
        };
        s.run();
        assert_eq!(s.outcome(0, t).code, code, "{how}");
        assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), 0, "{how}");
        assert_eq!(s.nodes[0].eng.inline_outstanding(P), 0, "{how}");
        assert!(s.nodes[0].eng.is_idle(), "{how}");
        if how != "peer loss" {
            // The count free, the next GPU WRITE goes inline again.
            let before = inline_and_lanes(&s, 0).0;
            let t = s.write(0, 1, 0, 2, 0, 4096);
            s.run();
            assert_eq!(s.outcome(0, t).code, Code::Ok, "{how}");
            assert_eq!(inline_and_lanes(&s, 0).0, before + 1, "{how}");
            assert!(s.same((0, 1, 0), (1, 2, 0), 4096));
            s.assert_idle();
        }
    }
}

#[test]
fn a_gpu_transfer_takes_the_lanes_while_the_pairing_has_offers_on_them() {
    let mut s = Sim::new(1, gpu_cfg(8), 23);
    s.buffer(0, 1, 1 << 20, 1);
    s.buffer(0, 3, 1 << 16, 5);
    s.buffer(1, 2, 1 << 20, 0);
    s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(0));
    // Alone, a small GPU WRITE goes inline; with a large one on the lanes, the next small GPU
    // WRITE takes the lanes too, while a host WRITE still goes inline.
    let first = s.write(0, 1, 0, 2, 0, 4096);
    s.drain();
    assert_eq!(inline_and_lanes(&s, 0), (1, 0));
    let big = s.write(0, 1, 65536, 2, 65536, 65536);
    let small = s.write(0, 1, 4096, 2, 4096, 4096);
    let host = s.write(0, 3, 0, 2, 8192, 4096);
    s.drain();
    assert_eq!(
        inline_and_lanes(&s, 0),
        (2, 2),
        "the big WRITE and the small GPU one on the lanes, the host one inline"
    );
    s.run();
    for t in [first, big, small, host] {
        assert_eq!(s.outcome(0, t).code, Code::Ok);
    }
    assert!(s.same((0, 1, 0), (1, 2, 0), 8192));
    assert!(s.same((0, 1, 65536), (1, 2, 65536), 65536));
    assert!(s.same((0, 3, 0), (1, 2, 8192), 4096));
    // Everything answered: a small GPU WRITE goes inline again.
    let again = s.write(0, 1, 0, 2, 0, 4096);
    s.run();
    assert_eq!(s.outcome(0, again).code, Code::Ok);
    assert_eq!(inline_and_lanes(&s, 0).0, 3);
    assert_eq!(s.nodes[0].eng.inline_gpu_in_flight(P), 0);
    s.assert_idle();
}
