//! Small transfers inline on the control connection (engine `inline.rs`, peer protocol 11):
//! between two daemons a WRITE or READ of at most `transfer.inline_max_bytes` carries its bytes
//! in its header, no lane touched; one byte more takes the lanes. Bytes compared, the peers'
//! `sent_inline` / `received_inline` counted, a notification delivered after its bytes, a bad
//! key refused with nothing written.

use crate::common::daemons::*;
use crate::common::peer_stats::{lane_bytes_total, only_peer};
use tcpxd::api::proto::v1 as pb;
use tonic::Code;

const KIB: u64 = 1 << 10;
/// The limit both daemons run with here (the default is 64 KiB).
const LIMIT: u64 = 8 * KIB;

async fn inline_pair(name: &str) -> (TestDaemon, TestDaemon) {
    let limit = |a: &mut tcpxd::config::DaemonArgs| a.inline.inline_max_bytes = Some(LIMIT);
    let mut a = start(&format!("{name}-a"), limit).await;
    let b = start(&format!("{name}-b"), limit).await;
    connect(&mut a, &b).await;
    (a, b)
}

/// A descriptor for `b` with its access key's first byte flipped.
fn wrong_key(b: &pb::Buffer) -> pb::Buffer {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_up_to_the_limit_go_inline_and_one_byte_more_takes_the_lanes() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = inline_pair("inline").await;
    let src = host_buffer(&mut a.client, 64 * KIB, "src").await;
    let back = host_buffer(&mut a.client, 64 * KIB, "back").await;
    let dst = host_buffer(&mut b.client, 64 * KIB, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 31).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 32).await;
    let d = describe_features(&mut a.client).await;
    assert!(d.contains(&"inline_small_transfers".to_string()), "{d:?}");

    let mut inline = 0;
    for (len, goes_inline) in [(1, true), (4 * KIB, true), (LIMIT, true), (LIMIT + 1, false)] {
        let before = (only_peer(&mut a.client).await, only_peer(&mut b.client).await);
        let id = write(&mut a.client, write_entry(&src, 7, &dst, 100, len), b"")
            .await
            .unwrap();
        let e = wait_ok(&mut a.client, id).await;
        assert_eq!((e.bytes_done, e.total_bytes), (len, len));
        assert_eq!(
            bytes(&mut b.client, dst.id, 100, len).await,
            bytes(&mut a.client, src.id, 7, len).await,
            "WRITE of {len}"
        );
        let id = read(&mut a.client, read_entry(&dst, 300, &back, 9, len))
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            bytes(&mut a.client, back.id, 9, len).await,
            bytes(&mut b.client, dst.id, 300, len).await,
            "READ of {len}"
        );
        let after = (only_peer(&mut a.client).await, only_peer(&mut b.client).await);
        let n = u64::from(goes_inline);
        assert_eq!(
            after.0.sent_inline - before.0.sent_inline,
            n,
            "{len}: {:?}",
            after.0
        );
        assert_eq!(after.1.received_inline - before.1.received_inline, n, "{len}");
        assert_eq!(
            after.1.sent_inline - before.1.sent_inline,
            n,
            "{len}: the READ's answer"
        );
        assert_eq!(after.0.received_inline - before.0.received_inline, n, "{len}");
        let lanes = lane_bytes_total(&after.0) - lane_bytes_total(&before.0);
        if goes_inline {
            inline += 2;
            assert_eq!(lanes, 0, "{len}: no lane carried a byte");
        } else {
            assert!(lanes >= 2 * len, "{len}: {lanes} bytes on the lanes");
        }
    }
    let s = only_peer(&mut a.client).await;
    assert_eq!(s.sent_inline + s.received_inline, inline);
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

async fn describe_features(c: &mut Client) -> Vec<String> {
    c.describe_node(pb::DescribeNodeRequest {})
        .await
        .expect("describe")
        .into_inner()
        .features
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_ranges_goes_inline_and_its_notification_comes_after_its_bytes() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = inline_pair("inline-batch").await;
    let src = host_buffer(&mut a.client, 64 * KIB, "src").await;
    let dst = host_buffer(&mut b.client, 64 * KIB, "dst").await;
    let other = host_buffer(&mut b.client, 16 * KIB, "other").await;
    fill_seed(&mut a.client, src.id, 0, 0, 41).await;
    let mut sub = b
        .client
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    // Scattered on both sides, two destination buffers: 3 KiB + 10 + 2 KiB + 500 = within 8 KiB.
    let entries = vec![
        write_entry(&src, 0, &dst, 40 * KIB, 3 * KIB),
        write_entry(&src, 9000, &dst, 17, 10),
        write_entry(&src, 20 * KIB, &other, 5, 2 * KIB),
        write_entry(&src, 33, &dst, 60 * KIB, 500),
    ];
    let id = a
        .client
        .write_batch(pb::WriteBatchRequest {
            entries: entries.clone(),
            notification: b"batch landed".to_vec(),
            timeout_ms: 60_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    // Delivered once the bytes are there: every range already holds its bytes when it comes.
    let n = sub.message().await.unwrap().expect("a notification");
    assert_eq!((n.transfer_id, &n.payload[..]), (id, &b"batch landed"[..]));
    for e in &entries {
        let buffer = if e.remote_descriptor == other.descriptor {
            other.id
        } else {
            dst.id
        };
        assert_eq!(
            bytes(&mut b.client, buffer, e.remote_offset, e.length).await,
            bytes(&mut a.client, src.id, e.local_offset, e.length).await,
            "{e:?}"
        );
    }
    wait_ok(&mut a.client, id).await;
    let s = only_peer(&mut a.client).await;
    // One inline message, or one per memory pair where the peer's topology puts the two host
    // buffers on different routes (the A3-shaped real-plugin pair, tools/realplugin): never a lane.
    assert!(
        (1..=2).contains(&s.sent_inline) && s.sent_eager + s.sent_rendezvous == 0,
        "{s:?}"
    );
    assert_eq!(lane_bytes_total(&s), 0);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_is_refused_and_writes_nothing() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = inline_pair("inline-bad").await;
    let src = host_buffer(&mut a.client, 16 * KIB, "src").await;
    let dst = host_buffer(&mut b.client, 16 * KIB, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 51).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 52).await;
    let before = crc(&mut b.client, dst.id, 0, 0).await;
    let id = write(
        &mut a.client,
        write_entry(&src, 0, &wrong_key(&dst), 0, 4 * KIB),
        b"no",
    )
    .await
    .unwrap();
    let e = wait(&mut a.client, id).await;
    assert_eq!(e.status_code, Code::PermissionDenied as i32, "{e:?}");
    assert!(
        e.status_message.contains("wrong access key"),
        "{}",
        e.status_message
    );
    let id = read(&mut a.client, read_entry(&wrong_key(&dst), 0, &src, 0, 4 * KIB))
        .await
        .unwrap();
    let e = wait(&mut a.client, id).await;
    assert_eq!(e.status_code, Code::PermissionDenied as i32, "{e:?}");
    assert_eq!(crc(&mut b.client, dst.id, 0, 0).await, before, "no byte written");
    let (sa, sb) = (only_peer(&mut a.client).await, only_peer(&mut b.client).await);
    assert_eq!(
        (sa.sent_inline, sb.received_inline),
        (1, 1),
        "the WRITE went inline"
    );
    assert_eq!((sa.transfers_failed, sb.transfers_failed), (2, 0));
    // The pairing still carries the next one.
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4 * KIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 4 * KIB).await,
        crc(&mut a.client, src.id, 0, 4 * KIB).await
    );
    a.stop().await;
    b.stop().await;
}

/// GPU memory on the CUDA stand-in (two daemon processes, `daemon_stub_gpus`): with
/// `transfer.inline_gpu` on, GPU → GPU WRITEs and READs up to the limit go inline (their copies
/// out of and into device memory through each poller's pinned staging, `inline_copies.rs`),
/// byte-exact; off, they take the lanes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_goes_inline_only_with_inline_gpu_on_the_cuda_stand_in() {
    use crate::common::gpus::{Compare, Trip, cuda_buffer, write_and_read_back};
    use crate::daemon_stub_gpus::start_with;
    for on in [true, false] {
        let dir = tcpxd_testkit::ScratchDir::fresh("tcpxd-inline-gpu", if on { "on" } else { "off" });
        std::fs::create_dir_all(&*dir).unwrap();
        let env = [("TCPXD_INLINE_GPU", if on { "on" } else { "off" })];
        let mut a = start_with(&dir, "inline-gpu-a", "d2d", 1, true, &env).await;
        let mut b = start_with(&dir, "inline-gpu-b", "d2d", 1, true, &env).await;
        let size = 64 * KIB;
        let src = cuda_buffer(&mut a.client, 3, size).await;
        let dst = cuda_buffer(&mut b.client, 5, size).await;
        let back = cuda_buffer(&mut a.client, 0, size).await;
        fill_seed(&mut a.client, src.id, 0, 0, 61).await;
        let trip = Trip {
            src: &src,
            dst: &dst,
            back: &back,
        };
        for (k, len) in [1u64, 4 * KIB, 16 * KIB].into_iter().enumerate() {
            let at = [k as u64 * 5, 100 + k as u64, 7];
            let what = format!("inline_gpu {on}");
            write_and_read_back(&mut a.client, &mut b.client, trip, at, len, Compare::Bytes, &what).await;
        }
        let s = only_peer(&mut a.client).await;
        let n = if on { 3 } else { 0 };
        assert_eq!(
            (s.sent_inline, s.received_inline),
            (n, n),
            "inline_gpu {on}: {s:?}"
        );
    }
}

/// Several GPU → GPU WRITEs in flight on the CUDA stand-in with `transfer.inline_gpu` on and
/// `transfer.inline_gpu_in_flight` at its default (1): one at a time goes inline, the others take
/// the lanes at once; all byte-exact, and GetStats counts both. Rounds of eight started before
/// any is waited for. Which way a WRITE goes depends on when the inline one before it was
/// answered (on a loaded 2-core machine each may be answered before the next starts, so every
/// one goes inline), so this checks what holds either way — every WRITE counted once, the
/// receiver's count equal to the sender's, the lanes used exactly when some did not go inline —
/// and the engine's `tests/inline_gpu.rs` checks the bound itself deterministically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_writes_in_flight_go_inline_one_at_a_time_and_the_rest_by_the_lanes() {
    use crate::common::gpus::{assert_same, cuda_buffer};
    use crate::daemon_stub_gpus::start_with;
    let dir = tcpxd_testkit::ScratchDir::fresh("tcpxd-inline-gpu", "in-flight");
    std::fs::create_dir_all(&*dir).unwrap();
    let env = [("TCPXD_INLINE_GPU", "on")];
    let mut a = start_with(&dir, "gpu-window-a", "d2d", 1, true, &env).await;
    let mut b = start_with(&dir, "gpu-window-b", "d2d", 1, true, &env).await;
    let len = 16 * KIB;
    let src = cuda_buffer(&mut a.client, 2, 8 * 2 * len).await;
    let dst = cuda_buffer(&mut b.client, 4, 8 * 2 * len + 64).await;
    let mut sent = 0;
    for round in 0..8u64 {
        fill_seed(&mut a.client, src.id, 0, 0, 70 + round).await;
        let mut ids = Vec::new();
        for k in 0..8u64 {
            let at = k * 2 * len + round % 7;
            let id = write(&mut a.client, write_entry(&src, at, &dst, at + 3, len), b"")
                .await
                .unwrap();
            ids.push((id, at));
        }
        for (id, at) in ids {
            wait_ok(&mut a.client, id).await;
            let what = format!("round {round}: {len} bytes at {at}, 8 in flight");
            assert_same(
                &mut a.client,
                (src.id, at),
                &mut b.client,
                (dst.id, at + 3),
                len,
                &what,
            )
            .await;
        }
        sent += 8;
        let s = only_peer(&mut a.client).await;
        assert_eq!(s.sent_inline + s.sent_eager + s.sent_rendezvous, sent, "{s:?}");
        // The test's first WRITE finds nothing in flight: it goes inline.
        assert!(s.sent_inline > 0, "{s:?}");
        let r = only_peer(&mut b.client).await;
        assert_eq!(r.received_inline, s.sent_inline, "{r:?}");
        assert_eq!(
            lane_bytes_total(&s) > 0,
            s.sent_inline < sent,
            "the lanes carry exactly the WRITEs that did not go inline: {s:?}"
        );
        if s.sent_inline < sent {
            return;
        }
    }
}
