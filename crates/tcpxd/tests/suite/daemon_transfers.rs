//! WRITE and READ between daemons on loopback over the built-in emulation (host-bounce mode:
//! received bytes land in scattered bounce pages and are gathered by the host unpacker).

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_from_one_byte_to_256_mib_land_byte_exact() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("sizes-a", |_| {}).await;
    let mut b = daemons::start("sizes-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 256 * MIB + 8192, "src").await;
    let dst = host_buffer(&mut b.client, 256 * MIB + 8192, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 7).await;
    let zero_crc = crc(&mut b.client, dst.id, 0, 4096).await;
    for (k, len) in [1u64, 4095, 4096, 4097, MIB + 3, 16 * MIB, 256 * MIB]
        .into_iter()
        .enumerate()
    {
        let (soff, doff) = (k as u64 * 13, 4096 + k as u64);
        let id = write(&mut a.client, write_entry(&src, soff, &dst, doff, len), b"")
            .await
            .unwrap();
        let done = wait_ok(&mut a.client, id).await;
        assert_eq!(done.bytes_done, len);
        assert_eq!(
            crc(&mut a.client, src.id, soff, len).await,
            crc(&mut b.client, dst.id, doff, len).await,
            "{len} bytes differ"
        );
    }
    // The first page of the destination was never a target: still zero.
    assert_eq!(crc(&mut b.client, dst.id, 0, 4096).await, zero_crc);
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

/// `runtime.spin` on (the poller lingers, an async worker is kept awake) whatever the machine:
/// writes and reads of every shape land byte-exact and every lane drains, under both protocols;
/// and with `runtime.warm_worker` off (session 32: no worker kept awake, the poller still
/// lingers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spinning_daemons_move_bytes_exactly_under_both_protocols() {
    tcpxd::logging::init("warn");
    for (protocol, warm) in [("rendezvous", "auto"), ("eager", "auto"), ("eager", "off")] {
        let spin = |args: &mut tcpxd::config::DaemonArgs| {
            args.spin = Some("on".into());
            args.warm_worker = Some(warm.into());
            args.transfer_protocol = Some(protocol.into());
        };
        let mut a = daemons::start("spin-a", spin).await;
        let mut b = daemons::start("spin-b", spin).await;
        connect(&mut a, &b).await;
        let x = host_buffer(&mut a.client, 16 * MIB, "").await;
        let y = host_buffer(&mut b.client, 8 * MIB, "").await;
        fill_seed(&mut a.client, x.id, 0, 0, 5).await;
        for (k, len) in [1u64, 4096, 65536 + 7, 3 * MIB].into_iter().enumerate() {
            let off = k as u64 * 4099;
            let id = write(&mut a.client, write_entry(&x, off, &y, off + 1, len), b"")
                .await
                .unwrap();
            assert_eq!(wait_ok(&mut a.client, id).await.bytes_done, len);
            assert_eq!(
                crc(&mut a.client, x.id, off, len).await,
                crc(&mut b.client, y.id, off + 1, len).await,
                "{protocol} (warm worker {warm}): {len} bytes written differ"
            );
            let id = read(&mut a.client, read_entry(&y, off + 1, &x, 8 * MIB, len))
                .await
                .unwrap();
            wait_ok(&mut a.client, id).await;
            assert_eq!(
                crc(&mut a.client, x.id, 8 * MIB, len).await,
                crc(&mut a.client, x.id, off, len).await,
                "{protocol} (warm worker {warm}): {len} bytes read back differ"
            );
        }
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
        a.stop().await;
        b.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_pulls_remote_bytes_and_batches_report_per_entry() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("read-a", |_| {}).await;
    let mut b = daemons::start("read-b", |_| {}).await;
    connect(&mut a, &b).await;
    let remote = host_buffer(&mut b.client, 8 * MIB, "").await;
    let local = host_buffer(&mut a.client, 8 * MIB, "").await;
    fill_seed(&mut b.client, remote.id, 0, 0, 99).await;
    let id = read(&mut a.client, read_entry(&remote, 1000, &local, 5, 3 * MIB))
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut b.client, remote.id, 1000, 3 * MIB).await,
        crc(&mut a.client, local.id, 5, 3 * MIB).await
    );
    // A READ batch of three ranges and a WRITE batch back.
    let entries = (0..3u64)
        .map(|k| read_entry(&remote, k * 2 * MIB, &local, 4 * MIB + k * 1000, 900))
        .collect();
    let id = a
        .client
        .read_batch(pb::ReadBatchRequest {
            entries,
            timeout_ms: 60_000,
            wait: false,
            ranges: None,
        })
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    let done = wait_ok(&mut a.client, id).await;
    assert_eq!(done.entries.len(), 3);
    assert!(done.entries.iter().all(|e| e.code == 0));
    for k in 0..3u64 {
        assert_eq!(
            crc(&mut b.client, remote.id, k * 2 * MIB, 900).await,
            crc(&mut a.client, local.id, 4 * MIB + k * 1000, 900).await
        );
    }
    let entries = (0..3u64)
        .map(|k| write_entry(&local, k * MIB, &remote, 7 * MIB + k * 4096, 4096))
        .collect();
    let id = a
        .client
        .write_batch(pb::WriteBatchRequest {
            entries,
            notification: vec![],
            timeout_ms: 60_000,
            ready_event_ipc_handle: Vec::new(),
            wait: false,
            ranges: None,
        })
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    let done = wait_ok(&mut a.client, id).await;
    assert_eq!(done.entries.len(), 3);
    for k in 0..3u64 {
        assert_eq!(
            crc(&mut a.client, local.id, k * MIB, 4096).await,
            crc(&mut b.client, remote.id, 7 * MIB + k * 4096, 4096).await
        );
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_transfers_in_both_directions_across_three_daemons() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("many-a", |_| {}).await;
    let mut b = daemons::start("many-b", |_| {}).await;
    let mut c = daemons::start("many-c", |_| {}).await;
    connect(&mut a, &b).await;
    connect(&mut b, &c).await;
    connect(&mut c, &a).await;
    let n = 12u64;
    let slot = 256 * 1024;
    let mut bufs = Vec::new();
    for (i, d) in [&mut a, &mut b, &mut c].into_iter().enumerate() {
        let src = host_buffer(&mut d.client, 9 * n * slot, "").await;
        let dst = host_buffer(&mut d.client, 9 * n * slot, "").await;
        fill_seed(&mut d.client, src.id, 0, 0, 1000 + i as u64).await;
        bufs.push((d.client.clone(), src, dst));
    }
    // Every node writes to and reads from both others at once, each transfer into its own slot.
    let mut tasks = Vec::new();
    for from in 0..3usize {
        for to in 0..3usize {
            if from == to {
                continue;
            }
            for k in 0..n {
                let (mut cl, src, _) = bufs[from].clone();
                let (_, rsrc, rdst) = bufs[to].clone();
                let (_, _, ldst) = bufs[from].clone();
                let len = 1 + (k * 104_729 + from as u64 * 7 + to as u64) % slot;
                // Slot (from, to, k) is used by this transfer alone, in every buffer.
                let write_slot = (from * 3 + to) as u64 * n + k;
                tasks.push(tokio::spawn(async move {
                    if k % 2 == 0 {
                        let off = write_slot * slot;
                        let id = write(&mut cl, write_entry(&src, off, &rdst, off, len), b"")
                            .await
                            .unwrap();
                        wait_ok(&mut cl, id).await;
                        (from, src.id, off, to, rdst.id, off, len)
                    } else {
                        let off = write_slot * slot;
                        let id = read(&mut cl, read_entry(&rsrc, off, &ldst, off, len))
                            .await
                            .unwrap();
                        wait_ok(&mut cl, id).await;
                        (to, rsrc.id, off, from, ldst.id, off, len)
                    }
                }));
            }
        }
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let mut clients: Vec<Client> = bufs.iter().map(|(c, _, _)| c.clone()).collect();
    for (sn, sid, soff, dn, did, doff, len) in results {
        let s = crc(&mut clients[sn], sid, soff, len).await;
        let d = crc(&mut clients[dn], did, doff, len).await;
        assert_eq!(s, d, "{len} bytes from node {sn} to node {dn} differ");
    }
    for cl in &mut clients {
        assert_lanes_drain(cl).await;
    }
    a.stop().await;
    b.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_arrive_after_their_data_in_order() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("note-a", |_| {}).await;
    let mut b = daemons::start("note-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 16 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 16 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 5).await;
    // A READ first: on `a` it takes a transfer id but makes no offer, so the WRITEs' transfer
    // ids differ from their offer ids and the notifications must name the transfers.
    let id = read(&mut a.client, read_entry(&dst, 0, &src, 15 * MIB, 4096))
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let mut sub = b
        .client
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    let mut expected = Vec::new();
    for k in 0..6u64 {
        let note = format!("chunk {k}");
        let id = write(
            &mut a.client,
            write_entry(&src, k * 2 * MIB, &dst, k * 2 * MIB, 2 * MIB),
            note.as_bytes(),
        )
        .await
        .unwrap();
        expected.push((
            id,
            note,
            crc(&mut a.client, src.id, k * 2 * MIB, 2 * MIB).await,
            k,
        ));
    }
    for (id, note, src_crc, k) in &expected {
        let n = sub.message().await.unwrap().expect("a notification");
        assert_eq!(n.from_node, "note-a");
        assert_eq!(n.transfer_id, *id, "the writer's transfer id");
        assert_eq!(
            String::from_utf8_lossy(&n.payload),
            *note,
            "notifications in completion order"
        );
        assert_eq!(n.buffer_ids, vec![dst.id]);
        // The data is already there when the notification arrives.
        assert_eq!(crc(&mut b.client, dst.id, k * 2 * MIB, 2 * MIB).await, *src_crc);
    }
    for (id, ..) in expected {
        wait_ok(&mut a.client, id).await;
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_progress_and_ends_with_the_final_status() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("watch-a", |_| {}).await;
    let mut b = daemons::start("watch-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * MIB, "").await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 64 * MIB), b"")
        .await
        .unwrap();
    let mut stream = a
        .client
        .watch(pb::WatchRequest { transfer_id: id })
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        events.push(e);
    }
    let last = events.last().expect("at least one event");
    assert_eq!(last.state, pb::TransferState::Finished as i32);
    assert_eq!(last.status_code, 0);
    assert_eq!(last.bytes_done, 64 * MIB);
    assert!(
        events.windows(2).all(|w| w[0].bytes_done <= w[1].bytes_done),
        "progress is monotonic"
    );
    // Watching a finished transfer yields its final event at once.
    let again: Vec<_> = {
        let mut s = a
            .client
            .watch(pb::WatchRequest { transfer_id: id })
            .await
            .unwrap()
            .into_inner();
        let mut v = Vec::new();
        while let Some(e) = s.message().await.unwrap() {
            v.push(e);
        }
        v
    };
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].state, pb::TransferState::Finished as i32);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_again_or_from_the_other_side_reuses_the_pairing() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("pair-a", |_| {}).await;
    let mut b = daemons::start("pair-b", |_| {}).await;
    let first = connect(&mut a, &b).await;
    assert_eq!(first.state, pb::PeerState::Up as i32);
    // The same address again, and the other daemon calling back: one pairing.
    let again = connect(&mut a, &b).await;
    assert_eq!(again.node_id, "pair-b");
    let back = connect(&mut b, &a).await;
    assert_eq!(back.node_id, "pair-a");
    assert_eq!(back.state, pb::PeerState::Up as i32);
    for c in [&mut a.client, &mut b.client] {
        let peers = c
            .list_peers(pb::ListPeersRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        assert_eq!(peers.len(), 1, "{peers:?}");
        assert_eq!(peers[0].state, pb::PeerState::Up as i32);
    }
    // Both directions still move data.
    let x = host_buffer(&mut a.client, MIB, "").await;
    let y = host_buffer(&mut b.client, MIB, "").await;
    fill_seed(&mut b.client, y.id, 0, 0, 8).await;
    let id = write(&mut b.client, write_entry(&y, 0, &x, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut b.client, id).await;
    assert_eq!(
        crc(&mut a.client, x.id, 0, 0).await,
        crc(&mut b.client, y.id, 0, 0).await
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffers_over_2_gib_work_across_registration_windows() {
    // regMr takes an int size, so the poller registers big buffers in overlapping windows. The
    // daemons fault every page in at registration (6 GiB of RAM here), a step at a time, so the
    // heartbeats go on meanwhile (net/memory.rs, `populate`).
    tcpxd::logging::init("warn");
    let mut a = daemons::start("big-a", |_| {}).await;
    let mut b = daemons::start("big-b", |_| {}).await;
    connect(&mut a, &b).await;
    let gib = 1u64 << 30;
    let src = host_buffer(&mut a.client, 3 * gib, "").await;
    let dst = host_buffer(&mut b.client, 3 * gib, "").await;
    for (soff, doff, len) in [
        (2 * gib - 3 * MIB - 5, 2 * gib + MIB + 7, 16 * MIB), // source straddles 2 GiB
        (gib - MIB, 3 * gib - 8 * MIB, 8 * MIB), // source straddles 1 GiB, destination at the end
        (3 * gib - 4096, gib - 2048, 4096),      // the last page, across a boundary
    ] {
        fill_seed(&mut a.client, src.id, soff, len, soff).await;
        let id = write(&mut a.client, write_entry(&src, soff, &dst, doff, len), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            crc(&mut a.client, src.id, soff, len).await,
            crc(&mut b.client, dst.id, doff, len).await
        );
        let back = host_buffer(&mut a.client, len, "").await;
        let id = read(&mut a.client, read_entry(&dst, doff, &back, 0, len))
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            crc(&mut a.client, back.id, 0, len).await,
            crc(&mut a.client, src.id, soff, len).await
        );
    }
    let peers = a
        .client
        .list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers;
    assert_eq!(peers[0].state, pb::PeerState::Up as i32);
    a.stop().await;
    b.stop().await;
}
