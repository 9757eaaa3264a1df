//! A notification alone (issue #39 point 5): a WRITE of exactly one zero-byte entry carrying a
//! notification. Between daemons it travels as control messages only (the header and `Done`, peer
//! protocol 10): the receiver checks the descriptor's key and offset and delivers it to its
//! subscribers; no lane carries a byte. Within one daemon it is a copy of nothing. Zero bytes
//! anywhere else are refused naming the field.

use crate::common::daemons::*;
use crate::common::peer_stats::only_peer;
use crate::common::scrape::{http_get, samples, sum};
use tcpxd::api::proto::v1 as pb;
use tonic::Code;

const KIB: u64 = 1 << 10;

/// A descriptor for `b` with its access key's first byte flipped.
fn wrong_key(b: &pb::Buffer) -> pb::Buffer {
    // `tcpxd1:<node>:<id>:<size>:<key hex>[@<peer addresses>]`
    let (desc, at) = b
        .descriptor
        .split_once('@')
        .map_or((&b.descriptor[..], None), |(d, a)| (d, Some(a)));
    let (head, key) = desc.rsplit_once(':').unwrap();
    let mut k = hex::decode(key).unwrap();
    k[0] ^= 0xff;
    let tail = at.map(|a| format!("@{a}")).unwrap_or_default();
    pb::Buffer {
        descriptor: format!("{head}:{}{tail}", hex::encode(k)),
        ..b.clone()
    }
}

/// Bytes each listed lane carried, by lane, each way.
fn lane_bytes(p: &pb::PeerStats) -> Vec<(u32, u64, u64)> {
    p.lanes
        .iter()
        .map(|l| (l.lane, l.bytes_sent, l.bytes_received))
        .collect()
}

/// `tcpxctl stats` of daemon `d`: its text and its `--json`.
async fn tcpxctl_stats(d: &TestDaemon) -> (String, serde_json::Value) {
    let endpoint = format!("unix:{}", d.daemon.api_socket.display());
    let run = |json: bool| {
        let endpoint = endpoint.clone();
        tokio::task::spawn_blocking(move || {
            let mut cmd = std::process::Command::new(tcpxd_testkit::workspace_bin("tcpxctl"));
            cmd.arg("--endpoint").arg(endpoint);
            if json {
                cmd.arg("--json");
            }
            let out = cmd.arg("stats").output().expect("tcpxctl runs");
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            out.stdout
        })
    };
    let text = String::from_utf8(run(false).await.unwrap()).unwrap();
    let json = serde_json::from_slice(&run(true).await.unwrap()).unwrap();
    (text, json)
}

/// The `tcpxd_peer_protocol_total` sample of `peer`, `direction` and `protocol` on `d`'s scrape.
async fn protocol_total(d: &TestDaemon, peer: &str, direction: &str, protocol: &str) -> f64 {
    let (status, body) = http_get(d.daemon.metrics_addr.expect("metrics enabled"), "/metrics").await;
    assert!(status.contains("200"), "{status}");
    sum(
        &samples(&body),
        "tcpxd_peer_protocol_total",
        &[
            &format!("peer=\"{peer}\""),
            &format!("direction=\"{direction}\""),
            &format!("protocol=\"{protocol}\""),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_alone_is_delivered_with_no_lane_traffic_and_a_wrong_key_is_refused() {
    tcpxd::logging::init("warn");
    let metrics = |a: &mut tcpxd::config::DaemonArgs| a.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let mut a = start("notice-a", metrics).await;
    let mut b = start("notice-b", metrics).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 64 * KIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * KIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 22).await;
    // A WRITE first (4 KiB: carried inline on the control connection since session 23, as the
    // notices are; the lanes' counts below must not move either way).
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4 * KIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let before = (only_peer(&mut a.client).await, only_peer(&mut b.client).await);
    let dst_crc = crc(&mut b.client, dst.id, 0, 0).await;
    let mut sub = b
        .client
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();

    // Refused by the receiver: the wrong key, nothing delivered.
    let bad = write(
        &mut a.client,
        write_entry(&src, 0, &wrong_key(&dst), 0, 0),
        b"sneaky",
    )
    .await
    .unwrap();
    let e = wait(&mut a.client, bad).await;
    assert_eq!(e.status_code, Code::PermissionDenied as i32, "{e:?}");
    assert!(
        e.status_message.contains("wrong access key"),
        "{}",
        e.status_message
    );

    // Delivered: at the buffer's end too (offset = size, zero bytes).
    let mut ids = Vec::new();
    for (k, off) in [(0u64, 100u64), (1, 64 * KIB)] {
        let note = format!("alone {k}");
        let id = write(&mut a.client, write_entry(&src, 0, &dst, off, 0), note.as_bytes())
            .await
            .unwrap();
        ids.push((id, note));
    }
    for (id, note) in &ids {
        // In the order sent, the refused one never: the first delivered is the first good one.
        let n = sub.message().await.unwrap().expect("a notification");
        assert_eq!(n.from_node, "notice-a");
        assert_eq!(n.transfer_id, *id);
        assert_eq!(String::from_utf8_lossy(&n.payload), *note);
        assert_eq!(n.buffer_ids, vec![dst.id]);
        let e = wait_ok(&mut a.client, *id).await;
        assert_eq!((e.bytes_done, e.total_bytes), (0, 0), "{e:?}");
    }
    assert_eq!(crc(&mut b.client, dst.id, 0, 0).await, dst_crc, "no byte changed");

    // Control messages only: no lane carried a byte more; counted as notices.
    let after = (only_peer(&mut a.client).await, only_peer(&mut b.client).await);
    assert_eq!(
        lane_bytes(&after.0),
        lane_bytes(&before.0),
        "a's lanes: {:?}",
        after.0
    );
    assert_eq!(
        lane_bytes(&after.1),
        lane_bytes(&before.1),
        "b's lanes: {:?}",
        after.1
    );
    assert_eq!((after.0.sent_notices, after.1.received_notices), (3, 3));
    // `tcpxctl stats` shows them, as text and JSON, and so does the scrape (the refused one is
    // counted too: it went as a notice and the receiver answered).
    for (d, peer, direction, field, data) in [
        (
            &a,
            "notice-b",
            "sent",
            "sent_notices",
            (after.0.sent_eager, after.0.sent_rendezvous, after.0.sent_inline),
        ),
        (
            &b,
            "notice-a",
            "received",
            "received_notices",
            (
                after.1.received_eager,
                after.1.received_rendezvous,
                after.1.received_inline,
            ),
        ),
    ] {
        let (text, json) = tcpxctl_stats(d).await;
        let line = format!(
            "{direction} {} eager, {} rendezvous, 3 notices, {} inline",
            data.0, data.1, data.2
        );
        assert!(text.contains(&line), "{line:?} not in:\n{text}");
        assert_eq!(data.0 + data.1 + data.2, 1, "the WRITE before went as data");
        assert_eq!(json["peers"][0]["node_id"], peer, "{json}");
        assert_eq!(json["peers"][0][field], 3, "{json}");
        assert_eq!(protocol_total(d, peer, direction, "notice").await, 3.0);
    }
    assert_eq!(
        (after.0.sent_eager + after.0.sent_rendezvous),
        (before.0.sent_eager + before.0.sent_rendezvous),
        "no transfer went as data"
    );
    assert_eq!(
        (after.0.transfers_ok, after.0.transfers_failed),
        (before.0.transfers_ok + 2, before.0.transfers_failed + 1)
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_bytes_are_refused_without_a_notification_or_beside_other_entries() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("notice-bad").await;
    let src = host_buffer(&mut a.client, 64 * KIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * KIB, "").await;
    let refused = |r: Result<u64, tonic::Status>, field: &str| {
        let e = r.expect_err("zero bytes accepted");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(
            e.message()
                .starts_with(&format!("{field}: must be at least 1 byte")),
            "{}",
            e.message()
        );
    };
    refused(
        write(&mut a.client, write_entry(&src, 0, &dst, 0, 0), b"").await,
        "entries[0].length",
    );
    refused(
        read(&mut a.client, read_entry(&dst, 0, &src, 0, 0)).await,
        "entries[0].length",
    );
    let batch = a
        .client
        .write_batch(pb::WriteBatchRequest {
            entries: vec![
                write_entry(&src, 0, &dst, 0, 10),
                write_entry(&src, 0, &dst, 0, 0),
            ],
            notification: b"n".to_vec(),
            timeout_ms: 10_000,
            ready_event_ipc_handle: Vec::new(),
            wait: false,
            ranges: None,
        })
        .await
        .map(|r| r.into_inner().transfer_id);
    refused(batch, "entries[1].length");
    // Past the remote buffer's end: refused as a WRITE's offset is, before anything is sent.
    let e = write(&mut a.client, write_entry(&src, 0, &dst, 64 * KIB + 1, 0), b"n")
        .await
        .expect_err("past the end accepted");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("entries[0].remote_offset"),
        "{}",
        e.message()
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_alone_within_one_daemon_is_delivered() {
    tcpxd::logging::init("warn");
    let mut d = start("notice-one", |_| {}).await;
    let mut other = unix_client(d.daemon.api_socket.clone()).await;
    let src = host_buffer(&mut d.client, 4 * KIB, "a").await;
    let dst = host_buffer(&mut other, 4 * KIB, "b").await;
    let mut sub = other
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    let bad = write(&mut d.client, write_entry(&src, 0, &wrong_key(&dst), 0, 0), b"x").await;
    assert_eq!(
        bad.expect_err("a wrong key accepted").code(),
        Code::PermissionDenied
    );
    let id = write(&mut d.client, write_entry(&src, 0, &dst, 4 * KIB, 0), b"here")
        .await
        .unwrap();
    let e = wait_ok(&mut d.client, id).await;
    assert_eq!((e.bytes_done, e.total_bytes), (0, 0));
    let n = sub.message().await.unwrap().expect("a notification");
    assert_eq!(
        (n.transfer_id, &n.payload[..], &n.buffer_ids[..]),
        (id, &b"here"[..], &[dst.id][..])
    );
    d.stop().await;
}
