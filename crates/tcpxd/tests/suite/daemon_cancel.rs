//! Cancellation, deadlines and shutdown draining, over an emulated NIC slowed to 1 Gbit/s so
//! transfers are still in flight when they are stopped. Every test checks that the lanes drain
//! back to zero and that the next transfer is byte-exact (the zero-length chunks that keep both
//! sides in step did their job).

use std::time::Duration;

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

async fn next_transfer_is_exact(a: &mut TestDaemon, src: &pb::Buffer, dst: &pb::Buffer) {
    let id = write(&mut a.client, write_entry(src, 0, dst, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_write_mid_flight_frees_every_slot() {
    slow_nic();
    let mut a = daemons::start("cancel-a", |_| {}).await;
    let mut b = daemons::start("cancel-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 3).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"never")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = a
        .client
        .cancel(pb::CancelRequest { transfer_id: id })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    let e = wait(&mut a.client, id).await;
    assert_eq!(
        e.status_code,
        tonic::Code::Cancelled as i32,
        "{}",
        e.status_message
    );
    assert!(e.bytes_done < 128 * MIB);
    // A second cancel reports the transfer already ended.
    let r = a
        .client
        .cancel(pb::CancelRequest { transfer_id: id })
        .await
        .unwrap()
        .into_inner();
    assert!(!r.cancelled);
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    next_transfer_is_exact(&mut a, &src, &dst).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, MIB).await,
        crc(&mut b.client, dst.id, 0, MIB).await
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_read_and_missing_a_deadline_drain_too() {
    slow_nic();
    let mut a = daemons::start("dl-a", |_| {}).await;
    let mut b = daemons::start("dl-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 128 * MIB, "").await;
    fill_seed(&mut b.client, dst.id, 0, 0, 11).await;
    // READ cancelled mid-flight.
    let id = read(&mut a.client, read_entry(&dst, 0, &src, 0, 128 * MIB))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        a.client
            .cancel(pb::CancelRequest { transfer_id: id })
            .await
            .unwrap()
            .into_inner()
            .cancelled
    );
    assert_eq!(
        wait(&mut a.client, id).await.status_code,
        tonic::Code::Cancelled as i32
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    // WRITE whose deadline (from timeout_ms) passes mid-flight.
    let id = a
        .client
        .write(pb::WriteRequest {
            entry: Some(write_entry(&src, 0, &dst, 0, 128 * MIB)),
            notification: vec![],
            timeout_ms: 200,
            ready_event_ipc_handle: Vec::new(),
            wait: false,
        })
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    let e = wait(&mut a.client, id).await;
    assert_eq!(
        e.status_code,
        tonic::Code::DeadlineExceeded as i32,
        "{}",
        e.status_message
    );
    // The gRPC deadline of the call bounds the transfer just the same.
    let mut req = tonic::Request::new(pb::WriteRequest {
        entry: Some(write_entry(&src, 0, &dst, 0, 128 * MIB)),
        notification: vec![],
        timeout_ms: 0,
        ready_event_ipc_handle: Vec::new(),
        wait: false,
    });
    req.set_timeout(Duration::from_millis(300));
    let id = a.client.write(req).await.unwrap().into_inner().transfer_id;
    let e = wait(&mut a.client, id).await;
    assert_eq!(
        e.status_code,
        tonic::Code::DeadlineExceeded as i32,
        "{}",
        e.status_message
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    fill_seed(&mut a.client, src.id, 0, MIB, 12).await;
    next_transfer_is_exact(&mut a, &src, &dst).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, MIB).await,
        crc(&mut b.client, dst.id, 0, MIB).await
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_within_grace_and_fails_the_rest() {
    slow_nic();
    // Grace long enough: the transfer in flight finishes.
    let mut a = daemons::start("grace-a", |args| args.shutdown_grace_s = Some(20)).await;
    let mut b = daemons::start("grace-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 32 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 32 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 21).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 32 * MIB), b"")
        .await
        .unwrap();
    let mut watcher = a.client.clone();
    let waiter = tokio::spawn(async move { wait(&mut watcher, id).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let report = a.daemon.shutdown().await;
    assert_eq!(report.finished_in_grace, 1);
    assert_eq!(report.failed_at_deadline, 0);
    assert_eq!(waiter.await.unwrap().status_code, 0);
    assert_eq!(crc(&mut b.client, dst.id, 0, 32 * MIB).await, {
        // The source daemon is gone; recompute the seeded pattern's checksum locally.
        crc32c::crc32c(&tcpxd_pattern::seeded_vec(21, (32 * MIB) as usize))
    });
    b.stop().await;

    // Grace too short: the transfer fails with UNAVAILABLE, and says why.
    let mut a = daemons::start("grace2-a", |args| args.shutdown_grace_s = Some(0)).await;
    let mut b = daemons::start("grace2-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 128 * MIB, "").await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let mut watcher = a.client.clone();
    let waiter = tokio::spawn(async move { wait(&mut watcher, id).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let report = a.daemon.shutdown().await;
    assert_eq!(report.failed_at_deadline, 1);
    let e = waiter.await.unwrap();
    assert_eq!(e.status_code, tonic::Code::Unavailable as i32);
    assert!(e.status_message.contains("shutting down"), "{}", e.status_message);
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_buffer_waits_for_the_transfers_that_use_it() {
    slow_nic();
    let mut a = daemons::start("release-a", |_| {}).await;
    let mut b = daemons::start("release-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 32 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 32 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 9).await;
    // 32 MiB at 1 Gbit/s: about 270 ms in flight when both sides release their buffers.
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 32 * MIB), b"")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t0 = std::time::Instant::now();
    b.client
        .release_buffer(pb::ReleaseBufferRequest { buffer_id: dst.id })
        .await
        .expect("the receiver's release waits for the transfer instead of refusing");
    a.client
        .release_buffer(pb::ReleaseBufferRequest { buffer_id: src.id })
        .await
        .expect("the sender's release waits too");
    assert!(t0.elapsed() > Duration::from_millis(20), "{:?}", t0.elapsed());
    // The transfer ended before either buffer went away: it completed.
    let e = wait(&mut a.client, id).await;
    assert_eq!(e.status_code, 0, "{}", e.status_message);
    assert_eq!(e.bytes_done, 32 * MIB);
    // Gone now: a second release names the buffer.
    let err = b
        .client
        .release_buffer(pb::ReleaseBufferRequest { buffer_id: dst.id })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(err.message().contains("buffer_id"), "{}", err.message());

    // A deadline shorter than the transfer: FAILED_PRECONDITION, and the buffer stays usable.
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * MIB, "").await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 64 * MIB), b"")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut req = tonic::Request::new(pb::ReleaseBufferRequest { buffer_id: dst.id });
    req.metadata_mut().insert("grpc-timeout", "100m".parse().unwrap());
    let err = b.client.release_buffer(req).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("in use"), "{}", err.message());
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, 0).await,
        crc(&mut b.client, dst.id, 0, 0).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}
