//! Framed sessions served on a thread of their own (`runtime.session_thread`, session 30:
//! src/poller/session_thread.rs): requests read, checked and started fast from the
//! `tcpxd-sessions` thread, their answers and events written there; a client that goes away
//! mid-burst, a shutdown mid-burst, and the refusals the same as with the option off. Checked
//! through what the client gets (bytes compared, statuses, every tag answered once) and what
//! the daemon counts and runs (`SessionWatch::handled`, `fast_started`, its threads).

use std::collections::HashSet;
use std::time::Duration;

use crate::common::daemons::*;
use crate::common::framed::*;
use prost::Message;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tokio::io::AsyncReadExt;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Two daemons paired: a with its sessions on the sessions thread (`on`) or on its poller
/// (`off`), b with no sessions thread (so this process's `tcpxd-sessions` threads are a's).
async fn pair_with(name: &str, session_thread: &str) -> (TestDaemon, TestDaemon) {
    tcpxd::logging::init("warn");
    let mut a = start(&format!("{name}-a"), |args| {
        args.poller_sessions = Some("on".to_string());
        args.session_thread = Some(session_thread.to_string());
    })
    .await;
    let b = start(&format!("{name}-b"), |args| {
        args.session_thread = Some("off".to_string())
    })
    .await;
    connect(&mut a, &b).await;
    (a, b)
}

/// Threads of this process named `name` (nextest runs each test in a process of its own).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim_end() == name)
        .count()
}

/// (handled on the serving thread, off it, sockets watched), fast starts of daemon `d`.
fn counts(d: &TestDaemon) -> ((u64, u64, usize), u64) {
    let w = d.daemon.state().poller.sessions().expect("sessions watched");
    (w.handled(), w.fast_started())
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

/// Waits until daemon `d` watches no session socket (bounded).
async fn until_unwatched(d: &TestDaemon) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while counts(d).0.2 != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "a session's socket is still watched"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_is_served_on_the_sessions_thread_with_its_bytes_events_and_ids() {
    let (mut a, mut b) = pair_with("st-burst", "on").await;
    assert!(a.daemon.state().poller.session_thread());
    assert!(!b.daemon.state().poller.session_thread());
    assert_eq!(
        threads_named("tcpxd-sessions"),
        1,
        "a's sessions thread, b has none"
    );
    let src = host_buffer(&mut a.client, 4 * MIB, "").await;
    let back = host_buffer(&mut a.client, 4 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 4 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 4 * MIB, 30).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let ((on0, off0, _), fast0) = counts(&a);
    // 16 WRITEs of 64 KiB in one write (all in flight together), then 16 READs back.
    let n = 16u64;
    let writes: Vec<(u64, Op)> = (0..n)
        .map(|i| {
            (
                i + 1,
                write_op(write_entry(&src, i * 64 * KIB, &dst, i * 64 * KIB, 64 * KIB)),
            )
        })
        .collect();
    let reads: Vec<(u64, Op)> = (0..n)
        .map(|i| {
            (
                100 + i,
                read_op(read_entry(&dst, i * 64 * KIB, &back, i * 64 * KIB, 64 * KIB)),
            )
        })
        .collect();
    let mut ids = Vec::new();
    for reqs in [writes, reads] {
        s.send_raw(&frames(&reqs)).await;
        let mut tags = HashSet::new();
        for _ in 0..reqs.len() {
            let ev = s.next().await;
            let t = finished(&ev);
            assert_eq!(t.status_code, 0, "tag {}: {}", ev.tag, t.status_message);
            assert_eq!(t.bytes_done, 64 * KIB);
            assert!(tags.insert(ev.tag), "tag {} answered twice", ev.tag);
            ids.push(t.transfer_id);
        }
        let want: HashSet<u64> = reqs.iter().map(|(t, _)| *t).collect();
        assert_eq!(tags, want);
    }
    let len = n * 64 * KIB;
    let want = crc(&mut a.client, src.id, 0, len).await;
    assert_eq!(crc(&mut b.client, dst.id, 0, len).await, want);
    assert_eq!(crc(&mut a.client, back.id, 0, len).await, want);
    // Every request handled on the sessions thread, once, and started fast. (In session 31 a
    // burst was handled on a runtime worker twice, none fast: the session's first poll runs on
    // the worker that accepted the connection, and a burst sent right after the preface's answer
    // could be there by then. Since session 32 a first read that finds a burst, or nothing,
    // goes to the serving thread: `a_burst_sent_with_the_preface_…` below makes it certain.)
    let ((on, off, watched), fast) = counts(&a);
    assert_eq!((on - on0, off - off0, watched), (2 * n, 0, 1));
    assert_eq!(fast - fast0, 2 * n);
    // Each id known to WaitTransfer once its event came (the answer applied before the end).
    for id in ids {
        let t = a
            .client
            .wait_transfer(pb::WaitTransferRequest { transfer_id: id })
            .await
            .expect("a transfer started fast is known")
            .into_inner();
        assert_eq!(t.status_code, 0);
    }
    // A finished tag cancelled: "already finished", as off the thread.
    s.send(7, Op::CancelTag(1)).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (7, tonic::Code::FailedPrecondition as i32), "{msg}");
    assert_eq!(
        msg,
        "cancel_tag: tag 1 already finished (OK); nothing was cancelled"
    );
    half_close(&mut s).await;
    s.assert_eof().await;
    until_unwatched(&a).await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}

/// Notifications alone mixed with WRITEs in one burst, on the sessions thread and on the poller
/// (session 33, rt3: the fast starts' way for notices, which any change to the notice's hops
/// must keep): every tag answered once, OK;
/// the notices delivered to b's subscriber in the order sent, each naming its transfer; the
/// WRITEs' bytes landed; every request started fast; the lanes drained after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notices_mixed_with_writes_in_a_burst_arrive_in_order_with_the_bytes() {
    for (session_thread, name) in [("on", "st-notes"), ("off", "st-notes-poller")] {
        let (mut a, mut b) = pair_with(name, session_thread).await;
        let src = host_buffer(&mut a.client, MIB, "").await;
        let dst = host_buffer(&mut b.client, MIB, "").await;
        fill_seed(&mut a.client, src.id, 0, MIB, 33).await;
        let mut sub = b
            .client
            .subscribe(pb::SubscribeRequest::default())
            .await
            .unwrap()
            .into_inner();
        let mut s = Framed::open(&a.daemon.api_socket).await;
        let (_, fast0) = counts(&a);
        let n = 16u64;
        let mut reqs = Vec::new();
        for i in 0..n {
            let at = i * 64 * KIB;
            reqs.push((2 * i + 1, write_op(write_entry(&src, at, &dst, at, 64 * KIB))));
            reqs.push((
                2 * i + 2,
                Op::Write(pb::WriteRequest {
                    entry: Some(write_entry(&src, 0, &dst, at, 0)),
                    notification: format!("note {i}").into_bytes(),
                    timeout_ms: 60_000,
                    ..Default::default()
                }),
            ));
        }
        // (in bursts of PASS_BUDGET requests: a longer one's rest goes to the runtime)
        let mut ids = std::collections::HashMap::new();
        for burst in reqs.chunks(tcpxd::poller::PASS_BUDGET as usize) {
            s.send_raw(&frames(burst)).await;
            for _ in 0..burst.len() {
                let ev = s.next().await;
                let t = finished(&ev);
                assert_eq!(t.status_code, 0, "{name}: tag {}: {}", ev.tag, t.status_message);
                let want = if ev.tag % 2 == 1 { 64 * KIB } else { 0 };
                assert_eq!(t.bytes_done, want, "{name}: tag {}", ev.tag);
                assert!(
                    ids.insert(ev.tag, t.transfer_id).is_none(),
                    "tag {} answered twice",
                    ev.tag
                );
            }
        }
        assert_eq!(ids.len(), reqs.len());
        for i in 0..n {
            let note = sub.message().await.unwrap().expect("a notification");
            assert_eq!(
                String::from_utf8_lossy(&note.payload),
                format!("note {i}"),
                "{name}"
            );
            assert_eq!(
                note.transfer_id,
                ids[&(2 * i + 2)],
                "{name}: notice {i}'s transfer"
            );
            assert_eq!(note.buffer_ids, vec![dst.id]);
        }
        assert_eq!(
            crc(&mut a.client, src.id, 0, n * 64 * KIB).await,
            crc(&mut b.client, dst.id, 0, n * 64 * KIB).await,
            "{name}: the WRITEs' bytes"
        );
        assert_eq!(counts(&a).1 - fast0, 2 * n, "{name}: every request started fast");
        let p = crate::common::peer_stats::only_peer(&mut a.client).await;
        assert_eq!(p.sent_notices, n, "{name}");
        half_close(&mut s).await;
        s.assert_eof().await;
        until_unwatched(&a).await;
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
    }
}

/// A burst the client writes with the preface, so there before the session's first poll (which
/// runs on the runtime worker that accepted the connection): read on the thread that serves the
/// sessions all the same, every request handled there and started fast — the sessions thread,
/// and the poller's with that option off. (Before session 32 the first poll read it on the
/// worker, none fast: the burst test above, whose client writes right after the preface's
/// answer, met that twice in session 31.) One request written so is read on the worker, as
/// before: handing it over would wake a parked thread for one request (BENCHMARKS, session 32).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_sent_with_the_preface_is_read_on_the_serving_thread_and_started_fast() {
    for (session_thread, name) in [("on", "st-first"), ("off", "st-first-poller")] {
        let (mut a, mut b) = pair_with(name, session_thread).await;
        let src = host_buffer(&mut a.client, MIB, "").await;
        let dst = host_buffer(&mut b.client, MIB, "").await;
        fill_seed(&mut a.client, src.id, 0, MIB, 12).await;
        let ((on0, off0, _), fast0) = counts(&a);
        let n = 16u64;
        let reqs: Vec<(u64, Op)> = (0..n)
            .map(|i| {
                let at = i * 64 * KIB;
                (i + 1, write_op(write_entry(&src, at, &dst, at, 64 * KIB)))
            })
            .collect();
        let mut s = Framed::open_with(&a.daemon.api_socket, &frames(&reqs)).await;
        let mut tags = HashSet::new();
        for _ in 0..n {
            let ev = s.next().await;
            let t = finished(&ev);
            assert_eq!(t.status_code, 0, "tag {}: {}", ev.tag, t.status_message);
            assert!(tags.insert(ev.tag), "tag {} answered twice", ev.tag);
        }
        assert_eq!(tags, (1..=n).collect::<HashSet<u64>>());
        assert_eq!(
            crc(&mut a.client, src.id, 0, n * 64 * KIB).await,
            crc(&mut b.client, dst.id, 0, n * 64 * KIB).await
        );
        let ((on, off, _), fast) = counts(&a);
        assert_eq!(
            (on - on0, off - off0, fast - fast0),
            (n, 0, n),
            "session_thread {session_thread}: (handled on the serving thread, off it, started fast)"
        );
        let one = [(100, write_op(write_entry(&src, 0, &dst, 0, 64 * KIB)))];
        let mut single = Framed::open_with(&a.daemon.api_socket, &frames(&one)).await;
        let ev = single.next().await;
        assert_eq!((ev.tag, finished(&ev).status_code), (100, 0));
        let ((on1, off1, _), fast1) = counts(&a);
        assert_eq!(
            (on1 - on, off1 - off, fast1 - fast),
            (0, 1, 0),
            "session_thread {session_thread}: one request with the preface"
        );
        half_close(&mut single).await;
        single.assert_eof().await;
        half_close(&mut s).await;
        s.assert_eof().await;
        until_unwatched(&a).await;
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_burst_leaves_nothing_behind_and_the_next_session_is_served() {
    let (mut a, mut b) = pair_with("st-gone", "on").await;
    let src = host_buffer(&mut a.client, 4 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 4 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 4 * MIB, 31).await;
    for round in 0..3u64 {
        let mut s = Framed::open(&a.daemon.api_socket).await;
        // 48 WRITEs of 64 KiB in one write; the client reads a few events (or none) and goes.
        let reqs: Vec<(u64, Op)> = (0..48u64)
            .map(|i| {
                (
                    i + 1,
                    write_op(write_entry(&src, i * 64 * KIB, &dst, i * 64 * KIB, 64 * KIB)),
                )
            })
            .collect();
        s.send_raw(&frames(&reqs)).await;
        for _ in 0..round {
            let ev = s.next().await;
            assert_eq!(finished(&ev).status_code, 0);
        }
        drop(s);
        until_unwatched(&a).await;
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
    }
    // The thread serves the next session as before.
    fill_seed(&mut b.client, dst.id, 0, MIB, 0).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, MIB))).await;
    assert_eq!(finished(&s.next().await).status_code, 0);
    assert_eq!(
        crc(&mut b.client, dst.id, 0, MIB).await,
        crc(&mut a.client, src.id, 0, MIB).await
    );
    half_close(&mut s).await;
    s.assert_eof().await;
    assert_eq!(threads_named("tcpxd-sessions"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_mid_burst_answers_each_tag_at_most_once_and_ends_the_thread() {
    let (mut a, mut b) = pair_with("st-stop", "on").await;
    let src = host_buffer(&mut a.client, 8 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 8 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 8 * MIB, 32).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let reqs: Vec<(u64, Op)> = (0..128u64)
        .map(|i| {
            (
                i + 1,
                write_op(write_entry(&src, i * 64 * KIB, &dst, i * 64 * KIB, 64 * KIB)),
            )
        })
        .collect();
    s.send_raw(&frames(&reqs)).await;
    assert_eq!(threads_named("tcpxd-sessions"), 1);
    let stopping = tokio::spawn(a.stop());
    // Events until the connection ends (EOF, or reset once the daemon is gone): each tag at
    // most once, each finished OK or refused / failed as the daemon stops (UNAVAILABLE).
    let mut seen = HashSet::new();
    let read = async {
        loop {
            let mut head = [0u8; 4];
            if s.io.read_exact(&mut head).await.is_err() {
                return;
            }
            let mut body = vec![0u8; u32::from_be_bytes(head) as usize];
            if s.io.read_exact(&mut body).await.is_err() {
                return;
            }
            let ev = pb::SessionEvent::decode(&body[..]).expect("a SessionEvent");
            assert!((1..=128).contains(&ev.tag), "tag {}", ev.tag);
            assert!(seen.insert(ev.tag), "tag {} answered twice", ev.tag);
            let (code, msg) = match ev.event {
                Some(Event::Finished(t)) => (t.status_code, t.status_message),
                Some(Event::Refused(st)) => (st.code, st.message),
                other => panic!("tag {}: {other:?}", ev.tag),
            };
            assert!(
                code == 0 || code == tonic::Code::Unavailable as i32,
                "tag {}: {code} {msg}",
                ev.tag
            );
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("the session ends with the daemon");
    tokio::time::timeout(Duration::from_secs(60), stopping)
        .await
        .expect("the daemon stops")
        .unwrap();
    assert_eq!(
        threads_named("tcpxd-sessions"),
        0,
        "the sessions thread ended with the poller"
    );
    assert_lanes_drain(&mut b.client).await;
}

/// The fast path's refusals are the same words with the sessions on their own thread as on the
/// poller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_the_same_on_and_off_the_sessions_thread() {
    let mut got = Vec::new();
    for mode in ["on", "off"] {
        let (mut a, mut b) = pair_with(&format!("st-refuse-{mode}"), mode).await;
        let src = host_buffer(&mut a.client, MIB, "").await;
        let dst = host_buffer(&mut b.client, MIB, "").await;
        let mut s = Framed::open(&a.daemon.api_socket).await;
        let mut unknown = src.clone();
        unknown.id += 1000;
        let cases = [
            write_op(write_entry(&unknown, 0, &dst, 0, 4 * KIB)),
            write_op(write_entry(&src, MIB - KIB, &dst, 0, 4 * KIB)),
            write_op(write_entry(&src, 0, &dst, MIB - KIB, 4 * KIB)),
            write_op(write_entry(&src, 0, &dst, 0, 0)),
            read_op(read_entry(&dst, 0, &unknown, 0, 4 * KIB)),
        ];
        let mut answers = Vec::new();
        for (tag, op) in cases.into_iter().enumerate() {
            s.send(tag as u64 + 1, op).await;
            let ev = s.next().await;
            answers.push(match ev.event {
                Some(Event::Refused(st)) => (ev.tag, st.code, st.message),
                Some(Event::Finished(t)) => (ev.tag, t.status_code, t.status_message),
                other => panic!("{other:?}"),
            });
        }
        assert!(answers.iter().all(|(_, code, _)| *code != 0), "{answers:?}");
        half_close(&mut s).await;
        s.assert_eof().await;
        got.push(answers);
    }
    // (the buffers' ids and descriptors are each daemon's own: compare with them masked)
    let mask = |v: &Vec<(u64, i32, String)>| -> Vec<(u64, i32, String)> {
        v.iter()
            .map(|(t, c, m)| (*t, *c, m.chars().filter(|c| !c.is_ascii_digit()).collect()))
            .collect()
    };
    assert_eq!(mask(&got[0]), mask(&got[1]));
}
