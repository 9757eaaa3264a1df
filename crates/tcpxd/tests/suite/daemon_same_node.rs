//! Transfers between two clients of one daemon (two NIXL agents on one node): the daemon copies
//! the bytes itself, with a remote transfer's semantics — WRITE and READ, batches, block lists,
//! notifications to the receiving client's subscribers, cancel, deadlines, the transfer metrics
//! and bad input refused naming the field. Host memory here; the GPU variants are in
//! `daemon_gpu` (gated).

use crate::common::blocks::{list, read_request, strided, u32s, write_request};
use crate::common::daemons::{self, *};
use crate::common::gpus::cuda_buffer;
use tcpxd::api::proto::v1 as pb;
use tonic::Code;

const MIB: u64 = 1 << 20;

/// The daemon and a second client of it (the first is `d.client`).
async fn one_daemon(name: &str) -> (TestDaemon, Client) {
    let d = daemons::start(name, |_| {}).await;
    let other = unix_client(d.daemon.api_socket.clone()).await;
    (d, other)
}

async fn totals(c: &mut Client, op: &str, status: &str) -> (u64, u64) {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    s.transfer_totals
        .iter()
        .find(|t| t.op == op && t.status == status)
        .map_or((0, 0), |t| (t.transfers, t.bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_write_and_read_byte_exact_with_notifications() {
    let (mut d, mut b) = one_daemon("same-rw").await;
    let a = &mut d.client;
    // 24 MiB: past the inline size and several chunks, so the blocking pool carries it.
    let src = host_buffer(a, 24 * MIB, "a").await;
    let dst = host_buffer(&mut b, 24 * MIB, "b").await;
    fill_seed(a, src.id, 0, 0, 7).await;
    let mut sub = b
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();

    // A WRITE of the whole buffer, with a notification for B's subscribers.
    let id = write(a, write_entry(&src, 0, &dst, 0, 24 * MIB), b"landed")
        .await
        .unwrap();
    let e = wait_ok(a, id).await;
    assert_eq!((e.bytes_done, e.total_bytes), (24 * MIB, 24 * MIB));
    assert_eq!(
        crc(a, src.id, 0, 24 * MIB).await,
        crc(&mut b, dst.id, 0, 24 * MIB).await
    );
    let n = sub.message().await.unwrap().expect("a notification");
    assert_eq!(n.from_node, "same-rw");
    assert_eq!(n.transfer_id, id);
    assert_eq!(n.payload, b"landed");
    assert_eq!(n.buffer_ids, vec![dst.id]);

    // A small batch (inline), at offsets, READ by B from A's buffer.
    fill_seed(a, src.id, 0, 0, 8).await;
    let r = b
        .read_batch(pb::ReadBatchRequest {
            entries: vec![
                read_entry(&src, 4096, &dst, 0, 4096),
                read_entry(&src, MIB + 1, &dst, 8192, 1000),
            ],
            timeout_ms: 10_000,
            wait: true,
            ranges: None,
        })
        .await
        .unwrap()
        .into_inner();
    let f = r.r#final.expect("waited");
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    assert_eq!(f.entries.len(), 2);
    assert_eq!(
        crc(a, src.id, 4096, 4096).await,
        crc(&mut b, dst.id, 0, 4096).await
    );
    assert_eq!(
        crc(a, src.id, MIB + 1, 1000).await,
        crc(&mut b, dst.id, 8192, 1000).await
    );
    // The bytes around are the first WRITE's.
    fill_seed(a, src.id, 0, 0, 7).await;
    assert_eq!(
        crc(a, src.id, 4096, 4096).await,
        crc(&mut b, dst.id, 4096, 4096).await
    );

    // A READ has no notification; both transfers are counted as the node's own.
    assert_eq!(totals(a, "write", "ok").await, (1, 24 * MIB));
    assert_eq!(totals(a, "read", "ok").await, (1, 4096 + 1000));
    // The id is known to Watch/WaitTransfer after the end, and a cancel finds it ended.
    assert!(
        !a.cancel(pb::CancelRequest { transfer_id: id })
            .await
            .unwrap()
            .into_inner()
            .cancelled
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_lists_of_two_clients_move_block_for_block() {
    let (mut d, mut b) = one_daemon("same-blocks").await;
    let a = &mut d.client;
    let src = host_buffer(a, 4 * MIB, "").await;
    let dst = host_buffer(&mut b, 4 * MIB, "").await;
    fill_seed(a, src.id, 0, 0, 21).await;
    let la = list(a, src.id, strided(0, 16384, 16384, 256)).await;
    let lb = list(&mut b, dst.id, strided(0, 16384, 16384, 256)).await;
    let mut sub = b
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    let (li, ri): (Vec<u32>, Vec<u32>) = (0..64).map(|k| (k * 3, 255 - k)).unzip();
    let w = a
        .write_blocks(pb::WriteBlocksRequest {
            notification: b"blocks".to_vec(),
            timeout_ms: 10_000,
            ..write_request(&la, u32s(&li), &lb, u32s(&ri), true)
        })
        .await
        .unwrap()
        .into_inner();
    let f = w.r#final.expect("waited");
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    assert_eq!(w.total_bytes, 64 * 16384);
    for (&l, &r) in li.iter().zip(&ri) {
        assert_eq!(
            crc(a, src.id, u64::from(l) * 16384, 16384).await,
            crc(&mut b, dst.id, u64::from(r) * 16384, 16384).await,
            "block {l} -> {r}"
        );
    }
    let n = sub.message().await.unwrap().expect("a notification");
    assert_eq!(
        (n.payload.as_slice(), n.buffer_ids.as_slice()),
        (&b"blocks"[..], &[dst.id][..])
    );

    // READ back by B into other blocks of its own list, by ranges of A's.
    let r = b
        .read_blocks(pb::ReadBlocksRequest {
            timeout_ms: 10_000,
            ..read_request(
                &la,
                pb::BlockIndices {
                    encoding: pb::IndexEncoding::Ranges as i32,
                    data: [100u32, 4].iter().flat_map(|x| x.to_le_bytes()).collect(),
                },
                &lb,
                u32s(&[0, 1, 2, 3]),
                true,
            )
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.r#final.expect("waited").status_code, 0);
    assert_eq!(
        crc(a, src.id, 100 * 16384, 4 * 16384).await,
        crc(&mut b, dst.id, 0, 4 * 16384).await
    );

    // Bad pairs are refused as for a peer's list, naming the field.
    let bad = a
        .write_blocks(pb::WriteBlocksRequest {
            timeout_ms: 10_000,
            ..write_request(&la, u32s(&[0, 1]), &lb, u32s(&[5, 5]), false)
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(
        bad.message()
            .starts_with("remote_indices[1]: block 5 is already named"),
        "{}",
        bad.message()
    );
    let past = a
        .write_blocks(pb::WriteBlocksRequest {
            timeout_ms: 10_000,
            ..write_request(&la, u32s(&[256]), &lb, u32s(&[0]), false)
        })
        .await
        .unwrap_err();
    assert!(
        past.message().starts_with("local_indices[0]: block 256 is past"),
        "{}",
        past.message()
    );
    // A rekeyed buffer makes its list's old token stale.
    b.rekey_buffer(pb::RekeyBufferRequest { buffer_id: dst.id })
        .await
        .unwrap();
    let stale = a
        .write_blocks(pb::WriteBlocksRequest {
            timeout_ms: 10_000,
            ..write_request(&la, u32s(&[0]), &lb, u32s(&[0]), false)
        })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::PermissionDenied, "{}", stale.message());
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_deadline_stop_a_copy_between_chunks() {
    let (mut d, mut b) = one_daemon("same-stop").await;
    let a = &mut d.client;
    let size = 128 * MIB;
    let src = host_buffer(a, size, "").await;
    let dst = host_buffer(&mut b, size, "").await;
    // A deadline of 1 ms: 32 chunks of 4 MiB take longer than that on any machine.
    let r = a
        .write_batch(pb::WriteBatchRequest {
            entries: vec![write_entry(&src, 0, &dst, 0, size)],
            timeout_ms: 1,
            wait: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let f = r.r#final.expect("waited");
    assert_eq!(
        f.status_code,
        Code::DeadlineExceeded as i32,
        "{}",
        f.status_message
    );
    assert!(f.bytes_done < size);
    assert_eq!(f.entries[0].code, Code::DeadlineExceeded as i32);

    // Cancel: the copy takes tens of milliseconds, the cancel a round trip. On a machine so
    // loaded that the copy ends first, the cancel reports it ended and the transfer is OK.
    let mut landed = 0;
    for _ in 0..5 {
        let id = write(a, write_entry(&src, 0, &dst, 0, size), b"never")
            .await
            .unwrap();
        let c = a
            .cancel(pb::CancelRequest { transfer_id: id })
            .await
            .unwrap()
            .into_inner();
        let e = wait(a, id).await;
        if c.cancelled {
            assert_eq!(e.status_code, Code::Cancelled as i32, "{}", e.status_message);
            assert!(e.bytes_done < size);
            landed += 1;
            break;
        }
        assert_eq!(e.status_code, 0, "{}", e.status_message);
    }
    assert_eq!(landed, 1, "no cancel reached a copy in flight in 5 tries");
    assert_eq!(totals(a, "write", "cancelled").await.0, 1);
    assert_eq!(totals(a, "write", "deadline_exceeded").await.0, 1);
    // The next transfer is whole.
    fill_seed(a, src.id, 0, MIB, 4).await;
    let id = write(a, write_entry(&src, 0, &dst, 0, MIB), b"").await.unwrap();
    wait_ok(a, id).await;
    assert_eq!(crc(a, src.id, 0, MIB).await, crc(&mut b, dst.id, 0, MIB).await);
    // ReleaseBuffer waits for the copies using the buffer: once it answers, the copy ended
    // (a cancel finds nothing to stop) and it ended well.
    let id = write(a, write_entry(&src, 0, &dst, 0, size), b"").await.unwrap();
    b.release_buffer(pb::ReleaseBufferRequest { buffer_id: dst.id })
        .await
        .unwrap();
    assert!(
        !a.cancel(pb::CancelRequest { transfer_id: id })
            .await
            .unwrap()
            .into_inner()
            .cancelled
    );
    wait_ok(a, id).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_same_node_entries_are_refused_naming_the_field() {
    let (mut d, mut b) = one_daemon("same-bad").await;
    let other = daemons::start("same-bad-far", |_| {}).await;
    let a = &mut d.client;
    let src = host_buffer(a, MIB, "").await;
    let dst = host_buffer(&mut b, MIB, "").await;
    let mut far_client = other.client.clone();
    let far = host_buffer(&mut far_client, MIB, "").await;
    let expect = |r: Result<u64, tonic::Status>, code: Code, starts: &str| {
        let s = r.expect_err(starts);
        assert_eq!(s.code(), code, "{}", s.message());
        assert!(
            s.message().starts_with(starts),
            "{} (wanted {starts})",
            s.message()
        );
    };
    expect(
        write(a, write_entry(&src, 0, &dst, MIB - 10, 11), b"").await,
        Code::InvalidArgument,
        "entries[0].remote_offset",
    );
    expect(
        write(a, write_entry(&src, MIB, &dst, 0, 1), b"").await,
        Code::InvalidArgument,
        "entries[0].local_offset",
    );
    let mut wrong = dst.clone();
    let key_at = wrong.descriptor.find('@').unwrap_or(wrong.descriptor.len()) - 1;
    let flip = if wrong.descriptor.as_bytes()[key_at] == b'0' {
        "1"
    } else {
        "0"
    };
    wrong.descriptor.replace_range(key_at..=key_at, flip);
    expect(
        write(a, write_entry(&src, 0, &wrong, 0, 1), b"").await,
        Code::PermissionDenied,
        "entries[0].remote_descriptor: wrong access key",
    );
    // A buffer copied onto itself: overlapping ranges are refused, disjoint ones copied.
    expect(
        write(a, write_entry(&src, 0, &src, 100, 200), b"").await,
        Code::InvalidArgument,
        "entries[0].remote_offset: the range overlaps",
    );
    let id = write(a, write_entry(&src, 0, &src, 4096, 4096), b"")
        .await
        .unwrap();
    wait_ok(a, id).await;
    assert_eq!(crc(a, src.id, 0, 4096).await, crc(a, src.id, 4096, 4096).await);
    // One batch cannot go both within this node and to another.
    let mixed = a
        .write_batch(pb::WriteBatchRequest {
            entries: vec![write_entry(&src, 0, &dst, 0, 1), write_entry(&src, 0, &far, 0, 1)],
            timeout_ms: 10_000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(mixed.code(), Code::InvalidArgument);
    assert!(
        mixed
            .message()
            .starts_with("entries[1].remote_descriptor: names node same-bad-far"),
        "{}",
        mixed.message()
    );
    // A released buffer's descriptor names nothing.
    b.release_buffer(pb::ReleaseBufferRequest { buffer_id: dst.id })
        .await
        .unwrap();
    expect(
        read(a, read_entry(&dst, 0, &src, 0, 1)).await,
        Code::NotFound,
        "entries[0].remote_descriptor: buffer",
    );
    // Nothing was started but the one good copy.
    let s = a.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(s.transfer_totals.len(), 1, "{:?}", s.transfer_totals);
    assert_eq!(s.transfer_totals[0].transfers, 1, "{:?}", s.transfer_totals);
    other.stop().await;
    d.stop().await;
}

fn prepared_entries(e: &[(u32, u32, u32)]) -> Vec<u8> {
    e.iter()
        .flat_map(|&(l, f, c)| [l, f, c])
        .flat_map(u32::to_le_bytes)
        .collect()
}

fn le32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_lists_over_another_clients_lists_copy_and_notify() {
    let (mut d, mut b) = one_daemon("same-prep").await;
    let a = &mut d.client;
    let src = host_buffer(a, 2 * MIB, "").await;
    let dst = host_buffer(&mut b, 2 * MIB, "").await;
    fill_seed(a, src.id, 0, 0, 31).await;
    fill_seed(&mut b, dst.id, 0, 0, 32).await;
    let la = list(a, src.id, strided(0, 4096, 4096, 512)).await;
    let lb = list(&mut b, dst.id, strided(0, 4096, 4096, 512)).await;
    // Entries of 2 blocks each over both lists; A prepares its own and B's (by token).
    let shape = prepared_entries(&(0..64).map(|i| (0, i * 4, 2)).collect::<Vec<_>>());
    let local = a
        .prepare_blocks(pb::PrepareBlocksRequest {
            local_list_ids: vec![la.id],
            entries: shape.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let remote = a
        .prepare_blocks(pb::PrepareBlocksRequest {
            remote_tokens: vec![lb.token.clone()],
            entries: shape.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut sub = b
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    let (li, ri) = ([0u32, 1, 2, 40], [63u32, 10, 11, 0]);
    let w = a
        .write_prepared(pb::WritePreparedRequest {
            local_prepared_id: local.prepared_id,
            local_indices: le32(&li),
            remote_prepared_id: remote.prepared_id,
            remote_indices: le32(&ri),
            notification: b"prepared".to_vec(),
            timeout_ms: 10_000,
            wait: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let f = w.r#final.expect("waited");
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    assert_eq!(w.total_bytes, 4 * 2 * 4096);
    for (&l, &r) in li.iter().zip(&ri) {
        let (lo, ro) = (u64::from(l) * 4 * 4096, u64::from(r) * 4 * 4096);
        assert_eq!(
            crc(a, src.id, lo, 8192).await,
            crc(&mut b, dst.id, ro, 8192).await,
            "{l} -> {r}"
        );
    }
    let n = sub.message().await.unwrap().expect("a notification");
    assert_eq!(
        (n.payload.as_slice(), n.buffer_ids.as_slice()),
        (&b"prepared"[..], &[dst.id][..])
    );

    // READ back into entry 5 here from B's entry 30.
    let r = a
        .read_prepared(pb::ReadPreparedRequest {
            local_prepared_id: local.prepared_id,
            local_indices: le32(&[5]),
            remote_prepared_id: remote.prepared_id,
            remote_indices: le32(&[30]),
            notification: b"read".to_vec(),
            timeout_ms: 10_000,
            wait: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.r#final.expect("waited").status_code, 0);
    assert_eq!(
        crc(a, src.id, 20 * 4096, 8192).await,
        crc(&mut b, dst.id, 120 * 4096, 8192).await
    );
    // A prepared READ's notification goes to the holder of the source, as a peer's would.
    let n = sub.message().await.unwrap().expect("a notification");
    assert_eq!(
        (n.payload.as_slice(), n.buffer_ids.as_slice()),
        (&b"read"[..], &[dst.id][..])
    );

    // A destination entry named twice is refused; a released list is unknown.
    let twice = a
        .write_prepared(pb::WritePreparedRequest {
            local_prepared_id: local.prepared_id,
            local_indices: le32(&[0, 1]),
            remote_prepared_id: remote.prepared_id,
            remote_indices: le32(&[3, 3]),
            timeout_ms: 10_000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(twice.code(), Code::InvalidArgument);
    assert!(
        twice.message().starts_with("remote_indices[1]"),
        "{}",
        twice.message()
    );
    a.release_prepared(pb::ReleasePreparedRequest {
        prepared_id: remote.prepared_id,
    })
    .await
    .unwrap();
    let gone = a
        .write_prepared(pb::WritePreparedRequest {
            local_prepared_id: local.prepared_id,
            local_indices: le32(&[0]),
            remote_prepared_id: remote.prepared_id,
            remote_indices: le32(&[0]),
            timeout_ms: 10_000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound, "{}", gone.message());
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcpxctl_writes_and_reads_between_buffers_of_one_daemon() {
    let (mut d, mut b) = one_daemon("same-ctl").await;
    let a = &mut d.client;
    let src = host_buffer(a, 4 * MIB, "").await;
    let dst = host_buffer(&mut b, 4 * MIB, "").await;
    fill_seed(a, src.id, 0, 0, 41).await;
    let endpoint = format!("unix:{}", d.daemon.api_socket.display());
    let run = |args: Vec<String>| {
        let endpoint = endpoint.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(tcpxd_testkit::workspace_bin("tcpxctl"))
                .arg("--endpoint")
                .arg(endpoint)
                .args(args)
                .output()
                .expect("tcpxctl runs")
        })
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let out = run(s(&[
        "write",
        "--local",
        &format!("{}:1M", src.id),
        "--remote",
        &dst.descriptor,
        "--length",
        "2M",
    ]))
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        crc(a, src.id, MIB, 2 * MIB).await,
        crc(&mut b, dst.id, 0, 2 * MIB).await
    );
    let out = run(s(&[
        "read",
        "--remote",
        &dst.descriptor,
        "--local",
        &format!("{}:3M", src.id),
        "--length",
        "4K",
    ]))
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        crc(a, src.id, 3 * MIB, 4096).await,
        crc(&mut b, dst.id, 0, 4096).await
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored daemon_same_node::"]
async fn gpu_to_gpu_and_mixed_both_ways_on_one_daemon() {
    let (mut d, mut b) = one_daemon("same-gpu").await;
    let a = &mut d.client;
    let size = 24 * MIB + 4096;
    let g1 = cuda_buffer(a, 0, size).await;
    let g2 = cuda_buffer(&mut b, 0, size).await;
    let h1 = host_buffer(a, size, "").await;
    let h2 = host_buffer(&mut b, size, "").await;
    fill_seed(a, g1.id, 0, 0, 51).await;
    fill_seed(a, h1.id, 0, 0, 52).await;
    // GPU -> GPU (device copy), GPU -> host, host -> GPU, each large (chunked on the blocking
    // pool) and small (inline), at odd offsets.
    for (src, dst, seed_src) in [(&g1, &g2, g1.id), (&g1, &h2, g1.id), (&h1, &g2, h1.id)] {
        for (len, so, dof) in [(24 * MIB, 0, 4096), (5000, 17, 3)] {
            let id = write(a, write_entry(src, so, dst, dof, len), b"").await.unwrap();
            wait_ok(a, id).await;
            assert_eq!(
                crc(a, seed_src, so, len).await,
                crc(&mut b, dst.id, dof, len).await,
                "{:?} -> {:?}, {len} bytes",
                src.kind,
                dst.kind
            );
        }
    }
    // READ: B pulls A's GPU buffer into its host buffer.
    let id = read(&mut b, read_entry(&g1, 100, &h2, 0, MIB)).await.unwrap();
    wait_ok(&mut b, id).await;
    assert_eq!(crc(a, g1.id, 100, MIB).await, crc(&mut b, h2.id, 0, MIB).await);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_in_flight_count_as_active_transfers_and_a_drain_waits_for_them() {
    let (mut d, mut b) = one_daemon("same-drain").await;
    let a = &mut d.client;
    let size = 128 * MIB;
    let src = host_buffer(a, size, "").await;
    let dst = host_buffer(&mut b, size, "").await;
    // GetStats counts a copy while it runs (a few tens of milliseconds; on a machine so loaded
    // that the copy ends before the stats are read, the next try).
    let mut seen = false;
    for _ in 0..5 {
        let id = write(a, write_entry(&src, 0, &dst, 0, size), b"").await.unwrap();
        let s = a.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
        wait_ok(a, id).await;
        if s.active_transfers == 1 {
            seen = true;
            break;
        }
        assert_eq!(s.active_transfers, 0);
    }
    assert!(seen, "no GetStats saw a copy of 128 MiB running in 5 tries");
    let s = a.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(s.active_transfers, 0, "ended copies are not counted");
    // A drain waits for the copy running when it began (grace: the default 30 s), and its
    // report counts it.
    let id = write(a, write_entry(&src, 0, &dst, 0, size), b"").await.unwrap();
    let mut watcher = a.clone();
    let waiter = tokio::spawn(async move { wait(&mut watcher, id).await });
    let report = d.daemon.shutdown().await;
    let e = waiter.await.unwrap();
    assert_eq!(e.status_code, 0, "{}", e.status_message);
    assert_eq!(report.failed_at_deadline, 0);
    assert!(report.finished_in_grace <= 1);
    assert_eq!(e.bytes_done, size, "the copy is whole");

    // A grace period of zero: the copy running at the drain is stopped between two chunks,
    // UNAVAILABLE and why (unless it ended first), and the report says so.
    let mut d = daemons::start("same-drain0", |args| args.shutdown_grace_s = Some(0)).await;
    let mut b = unix_client(d.daemon.api_socket.clone()).await;
    let a = &mut d.client;
    let src = host_buffer(a, size, "").await;
    let dst = host_buffer(&mut b, size, "").await;
    let id = write(a, write_entry(&src, 0, &dst, 0, size), b"").await.unwrap();
    let mut watcher = a.clone();
    let waiter = tokio::spawn(async move { wait(&mut watcher, id).await });
    let report = d.daemon.shutdown().await;
    let e = waiter.await.unwrap();
    if e.status_code == 0 {
        assert_eq!(report.failed_at_deadline, 0, "ended before the drain");
    } else {
        assert_eq!(e.status_code, Code::Unavailable as i32, "{}", e.status_message);
        assert!(
            e.status_message.contains("grace period over"),
            "{}",
            e.status_message
        );
        assert!(e.bytes_done < size);
        assert_eq!(report.failed_at_deadline, 1);
    }
}
