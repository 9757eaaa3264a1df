//! A framed session's transfer requests started straight on the engine in the poller's pass
//! (session 29, leanstart: src/api/session/fast.rs, src/poller/fast_starts.rs) and the requests
//! that go the usual way beside them: a same-node copy, a node to pair with first, a failed
//! peer, refusals by the checks (the same words as the unary calls'), a deadline that passes, a
//! cancel, a peer lost mid-transfer. Checked through what the client gets (bytes compared,
//! statuses, every tag answered) and what the daemon counts (`SessionWatch::fast_started`,
//! `handled`).

use std::time::Duration;

use crate::common::daemons::*;
use crate::common::framed::*;
use crate::common::procs;
use prost::Message;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tonic::Code;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Two daemons paired, a serving its framed sessions on its poller.
async fn pair_on(name: &str) -> (TestDaemon, TestDaemon) {
    tcpxd::logging::init("warn");
    let mut a = start(&format!("{name}-a"), |args| {
        args.poller_sessions = Some("on".to_string())
    })
    .await;
    let b = start(&format!("{name}-b"), |_| {}).await;
    connect(&mut a, &b).await;
    (a, b)
}

/// Transfers daemon `d`'s sessions started straight on the engine.
fn fast(d: &TestDaemon) -> u64 {
    d.daemon.state().poller.sessions().expect("on").fast_started()
}

/// Requests handled on the poller's thread by daemon `d`'s sessions.
fn on_poller(d: &TestDaemon) -> u64 {
    d.daemon.state().poller.sessions().expect("on").handled().0
}

/// Round trips of `op` on `s` (tags from `tag` up) until one was started fast (at most 100:
/// the runtime holds a session only until its poll ends); the next tag.
async fn until_fast(s: &mut Framed, d: &TestDaemon, mut tag: u64, op: &Op) -> u64 {
    for _ in 0..100 {
        let before = fast(d);
        s.send(tag, op.clone()).await;
        let ev = s.next().await;
        assert_eq!(finished(&ev).status_code, 0, "{}", finished(&ev).status_message);
        tag += 1;
        if fast(d) > before {
            return tag;
        }
    }
    panic!("no request of 100 was started fast");
}

/// The frames of `reqs`, joined: one write, read by the daemon together.
fn frames(reqs: &[(u64, Op)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (tag, op) in reqs {
        let body = pb::SessionRequest {
            tag: *tag,
            op: Some(op.clone()),
        }
        .encode_to_vec();
        out.extend((body.len() as u32).to_be_bytes());
        out.extend(body);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_in_flight_go_straight_to_the_engine_with_their_bytes_and_events() {
    let (mut a, mut b) = pair_on("fs-many").await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, MIB, 31).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let small = write_op(write_entry(&src, 0, &dst, 0, 4 * KIB));
    until_fast(&mut s, &a, 1000, &small).await;
    for write in [true, false] {
        if !write {
            // READ back into a cleared source.
            fill_seed(&mut a.client, src.id, 0, MIB, 0).await;
        }
        let (f0, on0) = (fast(&a), on_poller(&a));
        // 15 transfers of 64 KiB in one write (under the pass's budget): read in one poll.
        let n = u64::from(tcpxd::poller::PASS_BUDGET) - 1;
        let reqs: Vec<(u64, Op)> = (0..n)
            .map(|i| {
                let at = i * 64 * KIB;
                let op = match write {
                    true => write_op(write_entry(&src, at, &dst, at, 64 * KIB)),
                    false => read_op(read_entry(&dst, at, &src, at, 64 * KIB)),
                };
                (i + 1, op)
            })
            .collect();
        s.send_raw(&frames(&reqs)).await;
        let mut ids = Vec::new();
        let mut tags = std::collections::BTreeSet::new();
        for _ in 0..n {
            let ev = s.next().await;
            let t = finished(&ev);
            assert_eq!(t.status_code, 0, "tag {}: {}", ev.tag, t.status_message);
            assert_eq!((t.bytes_done, t.total_bytes), (64 * KIB, 64 * KIB));
            assert_eq!(t.state, pb::TransferState::Finished as i32);
            assert!(tags.insert(ev.tag), "one event a tag");
            ids.push(t.transfer_id);
        }
        let len = n * 64 * KIB;
        assert_eq!(
            crc(&mut a.client, src.id, 0, len).await,
            crc(&mut b.client, dst.id, 0, len).await,
            "write {write}"
        );
        // Every request read on the poller's thread went straight to the engine.
        let (on, started) = (on_poller(&a) - on0, fast(&a) - f0);
        assert_eq!(started, on, "write {write}");
        assert!(started >= 1, "write {write}: none on the poller's thread");
        // The transfers are known to WaitTransfer as a usual start's.
        for id in ids {
            assert_eq!(wait(&mut a.client, id).await.status_code, 0);
        }
    }
    // Packed batches (one buffer pair, BatchRanges: what the Python client sends for a batch)
    // go straight to the engine too: 16 ranges of 16 KiB written, then read back elsewhere.
    let le = |v: Vec<u64>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let offsets = || (0..16u64).map(|i| i * 32 * KIB).collect::<Vec<u64>>();
    fill_seed(&mut a.client, src.id, 0, MIB, 33).await;
    let f0 = fast(&a);
    let wb = Op::WriteBatch(pb::WriteBatchRequest {
        ranges: Some(pb::BatchRanges {
            local_buffer_id: src.id,
            remote_descriptor: dst.descriptor.clone(),
            local_offsets: le(offsets()),
            remote_offsets: le(offsets()),
            lengths: Vec::new(),
            uniform_length: 16 * KIB,
        }),
        ..Default::default()
    });
    let back = host_buffer(&mut a.client, MIB, "").await;
    let rb = Op::ReadBatch(pb::ReadBatchRequest {
        ranges: Some(pb::BatchRanges {
            local_buffer_id: back.id,
            remote_descriptor: dst.descriptor.clone(),
            local_offsets: le(offsets()),
            remote_offsets: le(offsets()),
            lengths: Vec::new(),
            uniform_length: 16 * KIB,
        }),
        ..Default::default()
    });
    for (tag, op) in [(200, wb), (201, rb)] {
        s.send(tag, op).await;
        let ev = s.next().await;
        assert_eq!(ev.tag, tag);
        let t = finished(&ev);
        assert_eq!(t.status_code, 0, "{}", t.status_message);
        assert_eq!(t.bytes_done, 16 * 16 * KIB);
    }
    for at in offsets() {
        let want = bytes(&mut a.client, src.id, at, 16 * KIB).await;
        assert_eq!(bytes(&mut b.client, dst.id, at, 16 * KIB).await, want);
        assert_eq!(bytes(&mut a.client, back.id, at, 16 * KIB).await, want);
    }
    assert!(fast(&a) > f0, "a packed batch went the fast way");
    half_close(&mut s).await;
    s.assert_eof().await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_off_the_fast_path_go_the_usual_way_with_the_same_answers() {
    let (mut a, mut b) = pair_on("fs-usual").await;
    // c: a node a has never met (its descriptor carries its peer address: first use pairs).
    let mut c = start("fs-usual-c", |_| {}).await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let near = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    let far = host_buffer(&mut c.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, MIB, 41).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let small = write_op(write_entry(&src, 0, &dst, 0, 4 * KIB));
    let mut tag = until_fast(&mut s, &a, 1000, &small).await;
    let f0 = fast(&a);
    let want = bytes(&mut a.client, src.id, 0, 256 * KIB).await;
    let (mut ac, mut cc) = (a.client.clone(), c.client.clone());
    // Within this node, and to a node to pair with first: done, bytes right, not fast.
    for (to, client) in [(&near, &mut ac), (&far, &mut cc)] {
        s.send(tag, write_op(write_entry(&src, 0, to, 0, 256 * KIB)))
            .await;
        let ev = s.next().await;
        assert_eq!(ev.tag, tag);
        assert_eq!(finished(&ev).status_code, 0, "{}", finished(&ev).status_message);
        assert_eq!(bytes(client, to.id, 0, 256 * KIB).await, want);
        tag += 1;
    }
    // Refused by the checks, as the unary call refuses the same entry: an unregistered local
    // buffer, a remote range past its end, an entry of no bytes. Nothing starts.
    let mut unknown = write_entry(&src, 0, &dst, 0, 4 * KIB);
    unknown.local_buffer_id = 987_654;
    let past = write_entry(&src, 0, &dst, MIB - KIB, 4 * KIB);
    let empty = write_entry(&src, 0, &dst, 0, 0);
    for e in [unknown, past, empty] {
        let unary = write(&mut a.client, e.clone(), b"").await.expect_err("refused");
        s.send(tag, write_op(e)).await;
        let (got_tag, code, message) = refused(s.next().await);
        assert_eq!(got_tag, tag);
        assert_eq!((code, message.as_str()), (unary.code() as i32, unary.message()));
        assert!(message.contains("entries[0]."), "names the field: {message}");
        tag += 1;
    }
    // A READ refused alike (its local buffer unknown).
    let mut r = read_entry(&dst, 0, &src, 0, 4 * KIB);
    r.local_buffer_id = 987_655;
    let unary = read(&mut a.client, r.clone()).await.expect_err("refused");
    s.send(tag, read_op(r)).await;
    let (_, code, message) = refused(s.next().await);
    assert_eq!((code, message.as_str()), (unary.code() as i32, unary.message()));
    tag += 1;
    assert_eq!(fast(&a), f0, "none of these went the fast way");
    // The next plain WRITE goes straight to the engine again.
    until_fast(&mut s, &a, tag, &small).await;
    half_close(&mut s).await;
    s.assert_eof().await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    assert_lanes_drain(&mut c.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_start_ends_by_its_deadline_or_its_cancel_and_the_session_goes_on() {
    let (mut a, mut b) = pair_on("fs-end").await;
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 64 * MIB, 51).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let small = write_op(write_entry(&src, 0, &dst, 0, 4 * KIB));
    let tag = until_fast(&mut s, &a, 1000, &small).await;
    // 64 MiB within 1 ms: its deadline passes (refused at its start, or ended by the engine).
    let f0 = fast(&a);
    let late = Op::Write(pb::WriteRequest {
        entry: Some(write_entry(&src, 0, &dst, 0, 64 * MIB)),
        timeout_ms: 1,
        ..Default::default()
    });
    s.send(tag, late).await;
    let ev = s.next().await;
    assert_eq!(ev.tag, tag);
    let code = match &ev.event {
        Some(Event::Finished(t)) => {
            assert!(t.bytes_done < 64 * MIB);
            t.status_code
        }
        Some(Event::Refused(st)) => st.code,
        other => panic!("{other:?}"),
    };
    assert_eq!(code, Code::DeadlineExceeded as i32, "{ev:?}");
    // 64 MiB and its cancel in one write: the cancel waits for the start, which it cancels.
    let big = write_op(write_entry(&src, 0, &dst, 0, 64 * MIB));
    s.send_raw(&frames(&[(tag + 1, big), (tag + 2, Op::CancelTag(tag + 1))]))
        .await;
    let (mut cancelled, mut ended) = (None, None);
    for _ in 0..2 {
        let ev = s.next().await;
        match ev.event {
            Some(Event::Cancelled(c)) => cancelled = Some((ev.tag, c.cancelled)),
            Some(Event::Finished(t)) => ended = Some((ev.tag, t.status_code)),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(cancelled, Some((tag + 2, true)));
    assert_eq!(ended, Some((tag + 1, Code::Cancelled as i32)));
    assert!(fast(&a) > f0, "the late or the cancelled one went the fast way");
    // The tag is free again, and the next transfer is byte-exact.
    s.send(tag + 1, write_op(write_entry(&src, 0, &dst, 0, MIB)))
        .await;
    assert_eq!(finished(&s.next().await).status_code, 0);
    assert_eq!(
        crc(&mut a.client, src.id, 0, MIB).await,
        crc(&mut b.client, dst.id, 0, MIB).await
    );
    half_close(&mut s).await;
    s.assert_eof().await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}

/// x (a process whose sends cut their sockets after 4 MiB a comm) WRITEs 64 MiB to y through
/// its framed session: the pairing fails mid-transfer and the event says so; the next WRITE
/// names a failed peer (not the fast way: it pairs again) and lands byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_lost_mid_transfer_fails_it_and_the_next_request_pairs_again() {
    tcpxd::logging::init("error");
    let x = procs::spawn("fs-loss-x", 0, "", &[("TCPXEMU_FAIL_AFTER_BYTES", "4194304")]).await;
    let mut xc = x.client().await;
    let mut y = start("fs-loss-y", |_| {}).await;
    xc.connect_peer(pb::ConnectPeerRequest {
        address: y.peer_addr(),
    })
    .await
    .unwrap();
    let src = host_buffer(&mut xc, 64 * MIB, "").await;
    fill_seed(&mut xc, src.id, 0, 64 * MIB, 61).await;
    let dst = host_buffer(&mut y.client, 64 * MIB, "").await;
    let mut s = Framed::open(&x.api_socket).await;
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 64 * MIB))).await;
    let ev = s.next().await;
    let t = finished(&ev);
    assert_eq!(t.status_code, Code::Unavailable as i32, "{}", t.status_message);
    assert!(t.bytes_done < 64 * MIB);
    // Until x knows its peer failed (it does with the event above), then the next request
    // pairs again (x's cut is per comm: the new comms carry 4 MiB each).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut tag = 2;
    loop {
        s.send(tag, write_op(write_entry(&src, 0, &dst, 0, MIB))).await;
        // (refused UNAVAILABLE while y has not yet noticed the loss: "retry")
        let ev = s.next().await;
        assert_eq!(ev.tag, tag);
        let (code, message) = match ev.event {
            Some(Event::Finished(t)) => (t.status_code, t.status_message),
            Some(Event::Refused(st)) => (st.code, st.message),
            other => panic!("{other:?}"),
        };
        if code == 0 {
            break;
        }
        assert_eq!(code, Code::Unavailable as i32, "{message}");
        assert!(
            std::time::Instant::now() < deadline,
            "never paired again: {message}"
        );
        tag += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        crc(&mut xc, src.id, 0, MIB).await,
        crc(&mut y.client, dst.id, 0, MIB).await
    );
    half_close(&mut s).await;
    s.assert_eof().await;
    y.stop().await;
}

/// A framed session's transfers around its pairing's idle close (`daemon_pairing_life`'s race,
/// through the session): a transfer meets the pairing live (the fast way), closing, or closed
/// (the usual way, which pairs again; one the engine refused because the pairing closed
/// meanwhile starts again the usual way). Every one lands byte-exact and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_racing_the_pairing_close_all_land_through_the_session() {
    tcpxd::logging::init("warn");
    const TRANSFERS: u64 = 15;
    let set = |args: &mut tcpxd::config::DaemonArgs| {
        args.lane_idle_close_ms = Some(40);
        args.pairing_idle_close_ms = Some(100);
        args.poller_sessions = Some("on".to_string());
    };
    let mut a = start("fs-race-a", set).await;
    let mut b = start("fs-race-b", set).await;
    connect(&mut a, &b).await;
    let a_buf = host_buffer(&mut a.client, 2 * MIB, "a").await;
    let b_buf = host_buffer(&mut b.client, 2 * MIB, "b").await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let f0 = fast(&a);
    for i in 0..TRANSFERS {
        let len = 64 * KIB + i * 60_000;
        let op = if i % 2 == 0 {
            fill_seed(&mut a.client, a_buf.id, 0, len, 700 + i).await;
            write_op(write_entry(&a_buf, 0, &b_buf, 0, len))
        } else {
            fill_seed(&mut b.client, b_buf.id, 0, len, 700 + i).await;
            read_op(read_entry(&b_buf, 0, &a_buf, 0, len))
        };
        s.send(i + 1, op).await;
        let ev = s.next().await;
        assert_eq!(ev.tag, i + 1);
        let t = finished(&ev);
        assert_eq!(t.status_code, 0, "transfer {i}: {}", t.status_message);
        assert_eq!(
            crc(&mut a.client, a_buf.id, 0, len).await,
            crc(&mut b.client, b_buf.id, 0, len).await,
            "transfer {i}"
        );
        // From under the idle time to over it (as daemon_pairing_life's race).
        tokio::time::sleep(Duration::from_millis(80 + (i % 7) * 60)).await;
    }
    let closes = a
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers
        .iter()
        .map(|p| p.idle_closes)
        .max()
        .unwrap_or(0);
    assert!(closes > 0, "the pairing never closed");
    println!(
        "{TRANSFERS} transfers: {} fast, {closes} idle closes",
        fast(&a) - f0
    );
    half_close(&mut s).await;
    s.assert_eof().await;
    a.stop().await;
    b.stop().await;
}
