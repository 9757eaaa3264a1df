//! Cancellation, deadlines and shutdown draining with transfers still in flight: the peer runs
//! as its own process and is held stopped (SIGSTOP) once the transfer moved its first bytes
//! (`common::hold`), which works on any plugin, with the emulation's hold gate closed before the
//! post so that the transfer cannot end before the peer is stopped, however loaded the machine;
//! the test acts, then lets it go on. Every test
//! checks that the lanes drain back to zero and that the next transfer is byte-exact (the
//! zero-length chunks that keep both sides in step did their job).

use std::time::Duration;

use crate::common::daemons::{self, *};
use crate::common::hold::{self, Frozen, freeze_once_moving};
use crate::common::procs::ProcDaemon;
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

/// The peer `b` as its own process (to be held stopped), paired with `a`, and its client.
async fn peer_process(a: &mut TestDaemon, name: &str) -> (ProcDaemon, Client) {
    tcpxd::logging::init("warn");
    hold::peer_process(a, name, &[]).await
}

async fn next_transfer_is_exact(a: &mut TestDaemon, src: &pb::Buffer, dst: &pb::Buffer) {
    // (One MiB: a held transfer's slots are all back, and new bytes land where they should.)
    let id = write(&mut a.client, write_entry(src, 0, dst, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_write_mid_flight_frees_every_slot() {
    hold::gate_on();
    let mut a = daemons::start("cancel-a", |_| {}).await;
    let (b, mut bc) = peer_process(&mut a, "cancel-b").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 3).await;
    hold::close_gate();
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"never")
        .await
        .unwrap();
    let (frozen, _) = freeze_once_moving(&mut a.client, id, &b).await;
    let r = a
        .client
        .cancel(pb::CancelRequest { transfer_id: id })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    frozen.thaw();
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
    assert_lanes_drain(&mut bc).await;
    next_transfer_is_exact(&mut a, &src, &dst).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, MIB).await,
        crc(&mut bc, dst.id, 0, MIB).await
    );
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_read_and_missing_a_deadline_drain_too() {
    hold::gate_on();
    let mut a = daemons::start("dl-a", |_| {}).await;
    let (b, mut bc) = peer_process(&mut a, "dl-b").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    fill_seed(&mut bc, dst.id, 0, 0, 11).await;
    // READ cancelled mid-flight.
    hold::close_gate();
    let id = read(&mut a.client, read_entry(&dst, 0, &src, 0, 128 * MIB))
        .await
        .unwrap();
    let (frozen, _) = freeze_once_moving(&mut a.client, id, &b).await;
    assert!(
        a.client
            .cancel(pb::CancelRequest { transfer_id: id })
            .await
            .unwrap()
            .into_inner()
            .cancelled
    );
    frozen.thaw();
    assert_eq!(
        wait(&mut a.client, id).await.status_code,
        tonic::Code::Cancelled as i32
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    // A transfer's deadline counts the opening of its lanes, which open on first use: on a
    // routed pairing (the real plugin's run, with GPUs) a → b's lanes took longer to open than
    // the deadlines below, so the writes ended before they could be held. An untimed write of
    // the same memory pair first opens every lane the timed ones take (they stay open: idle
    // lanes close after peer.lane_idle_close_ms, 120 s).
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    // WRITE whose deadline (from timeout_ms) passes while b is held. b is stopped before the
    // post: stopped once bytes moved, the write could finish first (its rest fitting in the
    // lanes' socket buffers) or its deadline pass before the first event was seen.
    let frozen = Frozen::now(&b);
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
    frozen.thaw();
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
    let frozen = Frozen::now(&b);
    let id = a.client.write(req).await.unwrap().into_inner().transfer_id;
    let e = wait(&mut a.client, id).await;
    frozen.thaw();
    assert_eq!(
        e.status_code,
        tonic::Code::DeadlineExceeded as i32,
        "{}",
        e.status_message
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    fill_seed(&mut a.client, src.id, 0, MIB, 12).await;
    next_transfer_is_exact(&mut a, &src, &dst).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, MIB).await,
        crc(&mut bc, dst.id, 0, MIB).await
    );
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_within_grace_and_fails_the_rest() {
    hold::gate_on();
    // Grace long enough: the transfer in flight finishes.
    let mut a = daemons::start("grace-a", |args| args.shutdown_grace_s = Some(20)).await;
    let (b, mut bc) = peer_process(&mut a, "grace-b").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 21).await;
    hold::close_gate();
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let mut watcher = a.client.clone();
    let waiter = tokio::spawn(async move { wait(&mut watcher, id).await });
    let (frozen, _) = freeze_once_moving(&mut a.client, id, &b).await;
    // The drain begins while the transfer is held (the health service says NOT_SERVING just
    // before the drain command goes to the poller), then b goes on and the transfer finishes.
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        tonic::transport::Endpoint::from_static("http://[::]:50051")
            .connect_with_connector(tower::service_fn({
                let path = a.daemon.api_socket.clone();
                move |_| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            tokio::net::UnixStream::connect(path).await?,
                        ))
                    }
                }
            }))
            .await
            .unwrap(),
    );
    let shutdown = tokio::spawn(a.daemon.shutdown());
    loop {
        let serving = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "tcpxd.v1.Tcpxd".into(),
            })
            .await
            .map(|r| r.into_inner().status);
        let serving_now = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
        if serving.ok() != Some(serving_now) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    frozen.thaw();
    let report = shutdown.await.unwrap();
    assert_eq!(report.finished_in_grace, 1);
    assert_eq!(report.failed_at_deadline, 0);
    assert_eq!(waiter.await.unwrap().status_code, 0);
    assert_eq!(crc(&mut bc, dst.id, 0, 128 * MIB).await, {
        // The source daemon is gone; recompute the seeded pattern's checksum locally.
        crc32c::crc32c(&tcpxd_pattern::seeded_vec(21, (128 * MIB) as usize))
    });
    drop(b);

    // Grace too short: the transfer fails with UNAVAILABLE, and says why.
    let mut a = daemons::start("grace2-a", |args| args.shutdown_grace_s = Some(0)).await;
    let (b, mut bc) = peer_process(&mut a, "grace2-b").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    hold::close_gate();
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let mut watcher = a.client.clone();
    let waiter = tokio::spawn(async move { wait(&mut watcher, id).await });
    let (frozen, _) = freeze_once_moving(&mut a.client, id, &b).await;
    let report = a.daemon.shutdown().await;
    frozen.thaw();
    assert_eq!(report.failed_at_deadline, 1);
    let e = waiter.await.unwrap();
    assert_eq!(e.status_code, tonic::Code::Unavailable as i32);
    assert!(e.status_message.contains("shutting down"), "{}", e.status_message);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_buffer_waits_for_the_transfers_that_use_it() {
    hold::gate_on();
    let mut a = daemons::start("release-a", |_| {}).await;
    let (b, mut bc) = peer_process(&mut a, "release-b").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 9).await;
    // Held in flight while a releases its buffer: the release waits for the transfer. The
    // receiver is stopped before the write is posted (stopped once bytes moved, the sender
    // could finish anyway, the rest fitting in the lanes' socket buffers).
    let frozen = Frozen::now(&b);
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let mut releaser = a.client.clone();
    let release = tokio::spawn(async move {
        releaser
            .release_buffer(pb::ReleaseBufferRequest { buffer_id: src.id })
            .await
    });
    // Not answered while the transfer is held (a release that did not wait would answer now).
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !release.is_finished(),
        "the sender's release waits for the transfer"
    );
    frozen.thaw();
    release
        .await
        .unwrap()
        .expect("the sender's release waits instead of refusing");
    // The transfer ended before the buffer went away: it completed.
    let e = wait(&mut a.client, id).await;
    assert_eq!(e.status_code, 0, "{}", e.status_message);
    assert_eq!(e.bytes_done, 128 * MIB);
    // The receiver's release waits the same way: b writes into a's buffer and is held (the
    // sender stopped this time), while a releases the destination.
    let back = host_buffer(&mut a.client, 128 * MIB, "back").await;
    hold::close_gate();
    let id = write(&mut bc, write_entry(&dst, 0, &back, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let (frozen, _) = freeze_once_moving(&mut bc, id, &b).await;
    let mut releaser = a.client.clone();
    let release = tokio::spawn(async move {
        releaser
            .release_buffer(pb::ReleaseBufferRequest { buffer_id: back.id })
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !release.is_finished(),
        "the receiver's release waits for the transfer"
    );
    frozen.thaw();
    release
        .await
        .unwrap()
        .expect("the receiver's release waits instead of refusing");
    wait_ok(&mut bc, id).await;
    // Gone now: a second release names the buffer.
    let err = a
        .client
        .release_buffer(pb::ReleaseBufferRequest { buffer_id: back.id })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(err.message().contains("buffer_id"), "{}", err.message());

    // A deadline shorter than the transfer, held: FAILED_PRECONDITION, and the buffer stays
    // usable. The peer is stopped before the transfer is posted: stopped once bytes moved, a
    // 64 MiB write could finish anyway, its rest fitting in the lanes' socket buffers.
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut bc, 64 * MIB, "").await;
    let frozen = Frozen::now(&b);
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 64 * MIB), b"")
        .await
        .unwrap();
    let mut req = tonic::Request::new(pb::ReleaseBufferRequest { buffer_id: src.id });
    req.metadata_mut().insert("grpc-timeout", "100m".parse().unwrap());
    // Sent by a client that does not give up at the deadline itself: the daemon answers up to
    // 50 ms before it, which a loaded machine can delay past it (tonic's client then answered
    // CANCELLED "Timeout expired" in its place).
    let mut untimed = crate::common::untimed::client(&a.daemon.api_socket).await;
    let err = untimed.release_buffer(req).await.unwrap_err();
    frozen.thaw();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("in use"), "{}", err.message());
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, 0).await,
        crc(&mut bc, dst.id, 0, 0).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_ends_within_its_grace_period_though_the_plugin_cannot_close_a_comm() {
    hold::gate_on();
    // Google's plugin closes a comm only once every request on it has moved its bytes, or its
    // peer closed its end (tcpxClose joins helper threads that look at their stop flag only when
    // idle): a daemon stopping at the same moment as its peer, each with a request under way,
    // once spun in its close for over ten minutes. The emulation closes as the plugin does with
    // TCPXEMU_CLOSE=plugin; the peer, held stopped, never closes its end.
    // SAFETY: each test runs in its own process (nextest) and sets the variable before the
    // emulation is initialised and before any other thread reads the environment.
    unsafe { std::env::set_var("TCPXEMU_CLOSE", "plugin") };
    tcpxd::logging::init("warn");
    let mut a = daemons::start("stuckclose-a", |args| args.shutdown_grace_s = Some(1)).await;
    let (b, mut bc) = hold::peer_process(&mut a, "stuckclose-b", &[("TCPXEMU_CLOSE", "plugin")]).await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    hold::close_gate();
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let mut watcher = a.client.clone();
    let waiter = tokio::spawn(async move { wait(&mut watcher, id).await });
    let (frozen, _) = freeze_once_moving(&mut a.client, id, &b).await;
    // The drain fails the transfer when its second is over, then the send comm cannot close
    // (its send has bytes left, the peer takes none). Before, the shutdown waited for ever; now
    // it gives the close the rest of the grace period (at least CLOSE_AT_LEAST) and stops.
    let report = tokio::time::timeout(Duration::from_secs(60), a.daemon.shutdown())
        .await
        .expect("the shutdown ended though a comm could not be closed");
    frozen.thaw();
    assert_eq!(report.failed_at_deadline, 1);
    let e = waiter.await.unwrap();
    assert_eq!(e.status_code, tonic::Code::Unavailable as i32);
    assert!(
        e.status_message.contains("grace period over"),
        "{}",
        e.status_message
    );
    // The peer goes on: its own buffers are there and it answers.
    let s = bc.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(s.active_transfers, 0);
}

/// `n` shuffled 4 KiB slots (the same permutation on every call with one seed).
fn shuffled_slots(n: u64, seed: u64) -> Vec<u64> {
    let mut rng = tcpxd_testkit::Rng::new(seed);
    let mut v: Vec<u64> = (0..n).collect();
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    v
}

/// Host block chunks gathered and scattered by the poller with 3 helper threads on both sides
/// (`transfer.host_copy_threads`, issue 38 point 3): a packed batch of 32,768 scattered 4 KiB
/// entries of one buffer pair, cancelled once it moves (its peer held stopped), ends CANCELLED
/// and returns every slot and credit on both daemons; the next scattered batch lands exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_host_block_batch_with_copy_helpers_frees_every_slot() {
    cancel_host_block_batch("cancel-copies", &[]).await;
}

/// The same with direct receives at the receiver (`TCPXEMU_HOST_RECV=direct`, as the real
/// plugin receives host memory): its receives, posted `scatter_ahead` beyond the window, give
/// their plugin slots back while their scatters run (`lanes::Wait::Slot`); cancelled midway,
/// every one is still consumed and every slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_host_block_batch_received_in_place_frees_every_slot() {
    cancel_host_block_batch("cancel-inplace", &[("TCPXEMU_HOST_RECV", "direct")]).await;
}

async fn cancel_host_block_batch(name: &str, peer_env: &[(&str, &str)]) {
    hold::gate_on();
    use crate::common::batches::ranges;
    tcpxd::logging::init("warn");
    let mut a = daemons::start(&format!("{name}-a"), |d| d.host_copy_threads = Some(3)).await;
    let mut env = vec![("TCPXD_HOST_COPY_THREADS", "3")];
    env.extend_from_slice(peer_env);
    let (b, mut bc) = hold::peer_process(&mut a, &format!("{name}-b"), &env).await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 5).await;
    let (blocks, bs) = (32_768u64, 4096u64);
    let (from, to) = (shuffled_slots(blocks, 1), shuffled_slots(blocks, 2));
    let list: Vec<(u64, u64, u64)> = from
        .iter()
        .zip(&to)
        .map(|(&f, &t)| (f * bs, t * bs, bs))
        .collect();
    let batch = |list: &[(u64, u64, u64)]| pb::WriteBatchRequest {
        ranges: Some(ranges(&src, &dst, list)),
        timeout_ms: 120_000,
        ..Default::default()
    };
    hold::close_gate();
    let id = a
        .client
        .write_batch(batch(&list))
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    let (frozen, _) = freeze_once_moving(&mut a.client, id, &b).await;
    let r = a
        .client
        .cancel(pb::CancelRequest { transfer_id: id })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    frozen.thaw();
    let e = wait(&mut a.client, id).await;
    assert_eq!(
        e.status_code,
        tonic::Code::Cancelled as i32,
        "{}",
        e.status_message
    );
    assert!(e.bytes_done < blocks * bs);
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    // The next batch (the first 2,048 pairs, sources moved by 1 byte) lands exactly.
    let next: Vec<(u64, u64, u64)> = list[..2048].iter().map(|&(f, t, l)| (f + 1, t, l - 1)).collect();
    let id = a
        .client
        .write_batch(batch(&next))
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    wait_ok(&mut a.client, id).await;
    for &(f, t, l) in next.iter().step_by(97) {
        assert_eq!(
            crc(&mut a.client, src.id, f, l).await,
            crc(&mut bc, dst.id, t, l).await,
            "pair at {t}"
        );
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    a.stop().await;
}
