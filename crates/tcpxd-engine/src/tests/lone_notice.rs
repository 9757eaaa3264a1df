//! A notification alone (`notice.rs`): a WRITE of one zero-byte entry travels as its header
//! and the answer, delivered after the receiver's key check, with no lane touched.

use super::*;
use crate::topology::Memory;

/// Starts a notification alone from node `from` to buffer `remote` at `offset` under `access`.
fn notice(s: &mut Sim, from: usize, remote: u64, offset: u64, access: [u8; 16], note: &[u8]) -> TransferId {
    let spec = WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: remote,
            access_key: access,
            offset,
            length: 0,
        },
    };
    let deadline = s.now + Duration::from_secs(60);
    s.nodes[from]
        .eng
        .start_write(vec![spec], note.to_vec(), deadline, s.now)
        .unwrap()
}

/// No chunk went either way on any lane of either node.
fn assert_no_lane_traffic(s: &Sim) {
    for n in &s.nodes {
        let c = n.eng.peer_counters(P).unwrap();
        for l in c.send.iter().chain(&c.recv) {
            assert_eq!((l.bytes, l.chunks), (0, 0), "a lane carried something: {c:?}");
        }
    }
}

#[test]
fn a_notification_alone_is_delivered_with_control_messages_only() {
    every_mode(delivered_in_mode);
}

fn delivered_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 5);
    s.buffer(0, 1, 4096, 1);
    s.buffer(1, 2, 4096, 0);
    let t = notice(&mut s, 0, 2, 4096, key(2), b"hello");
    s.run();
    let o = s.outcome(0, t);
    assert_eq!((o.code, o.landed), (Code::Ok, 0), "{o:?}");
    assert_eq!(o.entries, vec![(Code::Ok, String::new())]);
    assert_eq!(s.nodes[1].notes, vec![(t.0, b"hello".to_vec())]);
    assert_eq!(
        s.nodes[1].noted_buffers,
        vec![vec![2]],
        "the notification names the buffer"
    );
    assert!(s.nodes[1].bufs[&2].iter().all(|&b| b == 0), "no byte changed");
    assert_no_lane_traffic(&s);
    let (a, b) = (
        s.nodes[0].eng.peer_counters(P).unwrap(),
        s.nodes[1].eng.peer_counters(P).unwrap(),
    );
    assert_eq!((a.sent_notices, b.received_notices), (1, 1));
    assert_eq!((a.sent_eager, a.sent_rendezvous, b.received_eager), (0, 0, 0));
    assert_eq!((a.transfers_started, a.transfers_ok), (1, 1));
    s.assert_idle();
}

#[test]
fn notifications_alone_arrive_in_the_order_sent_between_writes() {
    every_mode(ordered_in_mode);
}

fn ordered_in_mode() {
    let mut s = Sim::new(1, small_chunks(), 9);
    s.buffer(0, 1, 65536, 1);
    s.buffer(1, 2, 65536, 0);
    let mut ids = Vec::new();
    for k in 0..6u8 {
        ids.push(notice(&mut s, 0, 2, 0, key(2), &[k]));
    }
    let w = s.write(0, 1, 0, 2, 0, 20_000);
    s.run();
    assert_eq!(s.outcome(0, w).code, Code::Ok);
    let got: Vec<Vec<u8>> = s.nodes[1].notes.iter().map(|(_, p)| p.clone()).collect();
    assert_eq!(
        got,
        vec![
            vec![0],
            vec![1],
            vec![2],
            vec![3],
            vec![4],
            vec![5],
            b"note".to_vec()
        ]
    );
    for t in ids {
        assert_eq!(s.outcome(0, t).code, Code::Ok);
    }
    assert!(s.same((0, 1, 0), (1, 2, 0), 20_000));
    s.assert_idle();
}

#[test]
fn a_notification_alone_with_a_wrong_key_is_refused_and_not_delivered() {
    every_mode(wrong_key_in_mode);
}

fn wrong_key_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 6);
    s.buffer(0, 1, 4096, 1);
    s.buffer(1, 2, 4096, 0);
    let t = notice(&mut s, 0, 2, 0, key(7), b"sneaky");
    let missing = notice(&mut s, 0, 3, 0, key(3), b"nowhere");
    let past = notice(&mut s, 0, 2, 4097, key(2), b"past");
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::PermissionDenied, "{o:?}");
    assert!(
        o.message.contains("wrong access key for buffer 2"),
        "{}",
        o.message
    );
    assert_eq!(s.outcome(0, missing).code, Code::NotFound);
    let o = s.outcome(0, past);
    assert_eq!(o.code, Code::InvalidArgument, "{o:?}");
    assert!(o.message.contains("ranges[0].offset"), "{}", o.message);
    assert!(
        s.nodes[1].notes.is_empty(),
        "a refused notification was delivered"
    );
    assert_no_lane_traffic(&s);
    assert_eq!(s.nodes[0].eng.peer_counters(P).unwrap().transfers_failed, 3);
    s.assert_idle();
}

#[test]
fn zero_bytes_are_refused_without_a_notification_or_beside_other_entries() {
    let mut s = Sim::new(1, small_chunks(), 7);
    s.buffer(0, 1, 4096, 1);
    s.buffer(1, 2, 4096, 0);
    let spec = |length| WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length,
        },
    };
    let deadline = s.now + Duration::from_secs(5);
    let eng = &mut s.nodes[0].eng;
    let e = eng
        .start_write(vec![spec(0)], Vec::new(), deadline, s.now)
        .unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument);
    assert!(
        e.message
            .starts_with("entries[0].length: must be at least 1 byte"),
        "{}",
        e.message
    );
    let e = eng
        .start_write(vec![spec(10), spec(0)], b"n".to_vec(), deadline, s.now)
        .unwrap_err();
    assert!(e.message.starts_with("entries[1].length"), "{}", e.message);
    let read = ReadSpec {
        peer: P,
        remote: spec(0).remote,
        local_buffer: 1,
        local_offset: 0,
    };
    let e = eng.start_read(vec![read], deadline, s.now).unwrap_err();
    assert!(e.message.starts_with("entries[0].length"), "{}", e.message);
    assert!(eng.poll_action().is_none(), "a refused request changed nothing");
    s.assert_idle();
}

#[test]
fn a_notification_alone_fails_with_its_peer() {
    let mut s = Sim::new(1, small_chunks(), 8);
    s.buffer(0, 1, 4096, 1);
    s.buffer(1, 2, 4096, 0);
    let t = notice(&mut s, 0, 2, 0, key(2), b"lost");
    s.drain();
    s.nodes[0].eng.on_peer_failed(P, "the stream broke");
    s.drain();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::Unavailable, "{o:?}");
    assert!(o.message.contains("the stream broke"), "{}", o.message);
    assert!(s.nodes[0].eng.is_idle());
    assert_eq!(s.nodes[0].eng.buffer_users(1), Some(0));
    // A later one is refused at its start, naming the entry's field (formatted only then).
    let spec = WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length: 0,
        },
    };
    let deadline = s.now + Duration::from_secs(5);
    let e = s.nodes[0]
        .eng
        .start_write(vec![spec], b"again".to_vec(), deadline, s.now)
        .unwrap_err();
    assert_eq!(e.code, Code::Unavailable);
    assert!(
        e.message.starts_with("entries[0].remote_descriptor: peer ")
            && e.message.contains("failed: the stream broke"),
        "{}",
        e.message
    );
    assert!(s.nodes[0].eng.is_idle());
}

#[test]
fn a_notification_alone_past_its_deadline_or_cancelled_ends_and_drains() {
    every_mode(deadline_in_mode);
}

fn deadline_in_mode() {
    let mut s = Sim::new(1, small_chunks(), 10);
    s.buffer(0, 1, 4096, 1);
    s.buffer(1, 2, 4096, 0);
    let spec = WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length: 0,
        },
    };
    let late = s.now + Duration::from_millis(10);
    let t = s.nodes[0]
        .eng
        .start_write(vec![spec], b"late".to_vec(), late, s.now)
        .unwrap();
    let c = notice(&mut s, 0, 2, 0, key(2), b"cancelled");
    s.drain();
    // Before the receiver reads either header: one passes its deadline, one is cancelled.
    s.nodes[0].eng.on_tick(late + Duration::from_millis(1));
    assert!(s.nodes[0].eng.cancel(c, Code::Cancelled, "the client cancelled"));
    s.drain();
    assert_eq!(s.outcome(0, t).code, Code::DeadlineExceeded);
    assert_eq!(s.outcome(0, c).code, Code::Cancelled);
    // The headers were on their way: delivered there (as a WRITE whose cancel crossed its
    // `Done`), and the answers end the sender's held offers.
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::DeadlineExceeded, "finished once");
    assert_eq!(s.nodes[1].notes.len(), 2);
    s.assert_idle();
}

#[test]
fn a_notification_alone_between_gpus_on_a_routed_pairing_opens_no_lane() {
    for protocol in [Protocol::Rendezvous, Protocol::Eager, Protocol::Auto] {
        let c = EngineConfig {
            protocol,
            devices: 4,
            lanes_per_device: 2,
            eager_max_bytes: SIM_EAGER_MAX,
            ..small_chunks()
        };
        let topo = || super::routes::node(8, 4);
        let mut s = Sim::pair_routed(8, [c.clone(), c], 12, [topo(), topo()]);
        s.buffer(0, 1, 4096, 1);
        s.buffer(1, 2, 4096, 0);
        s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(7));
        s.nodes[1].eng.set_buffer_memory(2, Memory::Gpu(3));
        let t = notice(&mut s, 0, 2, 0, key(2), b"gpu");
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{protocol:?}");
        assert_eq!(s.nodes[1].notes, vec![(t.0, b"gpu".to_vec())], "{protocol:?}");
        assert_no_lane_traffic(&s);
        for n in &s.nodes {
            assert_eq!(n.eng.lanes_open(), (0, 0), "{protocol:?}: a lane opened for it");
        }
        s.assert_idle();
    }
}
