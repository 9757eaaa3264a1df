//! A framed session's transfer whose start runs inline (src/api/session/starting.rs): the session's
//! task hands the command to the poller and reads on; the poller's answer, the wait for the end
//! and the event are run by the thread that answers. What the session must still do while a start
//! is on its way, tested by sending the next request in the same write as the transfer's: a
//! cancel of its tag (it waits for the id), the client going away (the transfer is cancelled on
//! both sides once its id comes), a start that first pairs with the remote node (its rest polled
//! by a runtime worker after the dial), and a refusal of a start (the tag free again). Bytes,
//! statuses and both daemons' lanes and transfer slots checked, as in daemon_local.rs.

use std::collections::HashMap;
use std::time::Duration;

use crate::common::daemons::{self, *};
use crate::common::framed::*;
use crate::common::hold;
use prost::Message;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The frames of `reqs`, joined: written in one write, read by the daemon together.
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

async fn ended(c: &mut Client, status: &str) -> u64 {
    let stats = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    stats
        .transfer_totals
        .iter()
        .filter(|t| t.status == status)
        .map(|t| t.transfers)
        .sum()
}

async fn until_cancelled(c: &mut Client, want: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while ended(c, "cancelled").await < want {
        assert!(
            std::time::Instant::now() < deadline,
            "{want} transfers not cancelled within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_written_with_its_transfer_waits_for_the_start_and_cancels_it() {
    hold::gate_on();
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("start-cancel").await;
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * MIB, "").await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    hold::close_gate();
    s.send_raw(&frames(&[
        (1, write_op(write_entry(&src, 0, &dst, 0, 60 * MIB))),
        (2, Op::CancelTag(1)),
        (3, read_op(read_entry(&dst, 0, &src, 0, 60 * MIB))),
        (4, Op::CancelTag(3)),
    ]))
    .await;
    let mut got = HashMap::new();
    for _ in 0..4 {
        let ev = s.next().await;
        got.insert(ev.tag, ev.event.expect("an event"));
    }
    for (cancel, transfer) in [(2, 1), (4, 3)] {
        assert!(
            matches!(
                got[&cancel],
                Event::Cancelled(pb::CancelResponse { cancelled: true })
            ),
            "{got:?}"
        );
        match &got[&transfer] {
            Event::Finished(t) => assert_eq!(
                t.status_code,
                tonic::Code::Cancelled as i32,
                "{}",
                t.status_message
            ),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(ended(&mut a.client, "cancelled").await, 2);
    hold::open_gate();
    // The session goes on: a transfer after them lands whole.
    fill_seed(&mut a.client, src.id, 0, 0, 5).await;
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 64 * KIB))).await;
    let t = finished(&s.next().await).clone();
    assert_eq!(
        (t.status_code, t.bytes_done),
        (0, 64 * KIB),
        "{}",
        t.status_message
    );
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 64 * KIB).await,
        crc(&mut a.client, src.id, 0, 64 * KIB).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_right_after_its_requests_has_them_cancelled_on_both_sides() {
    hold::gate_on();
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("start-gone").await;
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * MIB, "").await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    hold::close_gate();
    s.send_raw(&frames(&[
        (1, write_op(write_entry(&src, 0, &dst, 0, 60 * MIB))),
        (2, read_op(read_entry(&dst, 0, &src, 0, 60 * MIB))),
    ]))
    .await;
    // Gone without reading anything: the session may end while the starts are on their way.
    drop(s);
    until_cancelled(&mut a.client, 2).await;
    hold::open_gate();
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    assert_eq!(ended(&mut a.client, "cancelled").await, 2);
    assert_eq!(ended(&mut a.client, "ok").await, 0);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_pairs_first_and_a_refused_start_both_answer() {
    tcpxd::logging::init("warn");
    // Not paired: the first transfer dials b (descriptors carry its address), its rest polled
    // by whichever thread the dial wakes.
    let mut a = daemons::start("start-dial-a", |_| {}).await;
    let mut b = daemons::start("start-dial-b", |_| {}).await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 9).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let mut bad = write_entry(&src, 0, &dst, 0, 4 * KIB);
    bad.remote_offset = 2 * MIB; // past the end of b's buffer
    s.send_raw(&frames(&[
        (1, write_op(write_entry(&src, 0, &dst, 0, MIB))),
        (2, Op::CancelTag(1)),
        (3, write_op(bad)),
    ]))
    .await;
    let mut got = HashMap::new();
    for _ in 0..3 {
        let ev = s.next().await;
        got.insert(ev.tag, ev);
    }
    // The cancel waited for the start (the dial, then the poller's answer): it found the
    // transfer running or finished.
    let w = finished(&got[&1]).clone();
    match &got[&2].event {
        Some(Event::Cancelled(pb::CancelResponse { cancelled: true })) => {
            assert_eq!(
                w.status_code,
                tonic::Code::Cancelled as i32,
                "{}",
                w.status_message
            )
        }
        Some(Event::Refused(r)) => {
            assert_eq!(r.code, tonic::Code::FailedPrecondition as i32, "{}", r.message);
            assert_eq!((w.status_code, w.bytes_done), (0, MIB), "{}", w.status_message);
        }
        other => panic!("{other:?}"),
    }
    // Refused by its start (the descriptor says b's buffer's size), as before it ran inline.
    let (_, code, msg) = refused(got.remove(&3).expect("tag 3's event"));
    assert_eq!(code, tonic::Code::InvalidArgument as i32, "{msg}");
    assert!(
        msg.starts_with("entries[0].remote_offset: 2097152 is past the end"),
        "{msg}"
    );
    // Its tag and the cancelled one are free again; a WRITE under each lands whole.
    for tag in [1, 3] {
        s.send(tag, write_op(write_entry(&src, 0, &dst, 0, MIB))).await;
        let ev = s.next().await;
        assert_eq!(ev.tag, tag);
        let t = finished(&ev);
        assert_eq!((t.status_code, t.bytes_done), (0, MIB), "{}", t.status_message);
    }
    assert_eq!(
        crc(&mut b.client, dst.id, 0, MIB).await,
        crc(&mut a.client, src.id, 0, MIB).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
