//! Faults from the emulation's knobs and from signals, on `tcpxd` processes: a connection cut
//! after N bytes, a stalled (SIGSTOPped) peer, a slow peer, and cancels and deadlines while a
//! transfer is offered or queued. Each ends with an error or a slow completion, never a hang; the
//! lanes drain; the next transfer is byte-exact.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;
use tonic::Code;

const MIB: u64 = 1 << 20;
const BOUND: Duration = Duration::from_millis(tcpxd::config::DEFAULT_HEARTBEAT_TIMEOUT_MS);

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill(1)")
        .success();
    assert!(ok, "kill {sig} {pid}");
}

async fn first_event(c: &mut Client, id: u64) -> pb::TransferEvent {
    c.watch(pb::WatchRequest { transfer_id: id })
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .expect("an event")
}

async fn until_bytes(c: &mut Client, id: u64, min: u64) {
    let mut events = c
        .watch(pb::WatchRequest { transfer_id: id })
        .await
        .unwrap()
        .into_inner();
    while let Some(e) = events.message().await.unwrap() {
        assert_ne!(
            e.state,
            pb::TransferState::Finished as i32,
            "ended too early: {e:?}"
        );
        if e.bytes_done >= min {
            return;
        }
    }
}

async fn exact_write(c: &mut Client, rc: &mut Client, src: &pb::Buffer, dst: &pb::Buffer, len: u64) {
    let id = write(c, write_entry(src, 0, dst, 0, len), b"")
        .await
        .expect("write starts");
    wait_ok(c, id).await;
    assert_eq!(crc(rc, dst.id, 0, len).await, crc(c, src.id, 0, len).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_fails_with_the_plugins_words_and_the_callee_redials() {
    tcpxd::logging::init("error");
    // x's sends shut their sockets after 4 MiB per comm.
    let x = procs::spawn("cut-x", 0, "", &[("TCPXEMU_FAIL_AFTER_BYTES", "4194304")]).await;
    let mut xc = x.client().await;
    let mut y = daemons::start("cut-y", |_| {}).await;
    xc.connect_peer(pb::ConnectPeerRequest {
        address: y.peer_addr(),
    })
    .await
    .unwrap();
    let src = host_buffer(&mut xc, 64 * MIB, "src").await;
    fill_seed(&mut xc, src.id, 0, 0, 11).await;
    let dst = host_buffer(&mut y.client, 64 * MIB, "dst").await;
    let id = write(&mut xc, write_entry(&src, 0, &dst, 0, 64 * MIB), b"")
        .await
        .unwrap();
    let e = wait(&mut xc, id).await;
    assert_eq!(e.status_code, Code::Unavailable as i32, "{}", e.status_message);
    assert!(e.status_message.contains("cut-y"), "{}", e.status_message);
    assert_lanes_drain(&mut xc).await;
    // y sees its peer fail too; its next write to x dials x again (x's handshake announced its
    // port) and, y's sends being clean, lands byte-exact.
    let deadline = Instant::now() + BOUND + Duration::from_secs(5);
    let y_saw = loop {
        let p = y
            .client
            .list_peers(pb::ListPeersRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        if p[0].state == pb::PeerState::Failed as i32 {
            break p[0].error.clone();
        }
        assert!(Instant::now() < deadline, "y never noticed: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Whichever side's plugin noticed first, its words reach x's status: x's own ("injected
    // connection failure"), or y's (its receive saw the connection close), sent in y's Goodbye.
    assert!(
        e.status_message.contains("injected connection failure")
            || (e.status_message.contains("the peer ended the pairing")
                && e.status_message.contains("Connection closed by remote peer")),
        "the plugin's own words: x: {}; y: {y_saw}",
        e.status_message
    );
    assert!(y_saw.contains("tcpxemu: "), "y: {y_saw}");
    let back = host_buffer(&mut y.client, 16 * MIB, "back").await;
    fill_seed(&mut y.client, back.id, 0, 0, 12).await;
    let land = host_buffer(&mut xc, 16 * MIB, "land").await;
    exact_write(&mut y.client, &mut xc, &back, &land, 16 * MIB).await;
    assert_lanes_drain(&mut y.client).await;
    y.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_peer_fails_within_the_bound_and_offered_transfers_cancel_or_expire() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("stall-a", |_| {}).await;
    let b = procs::spawn("stall-b", 0, "", &[]).await;
    let mut bc = b.client().await;
    a.client
        .connect_peer(pb::ConnectPeerRequest {
            address: b.peer_addr.clone(),
        })
        .await
        .unwrap();
    let src = host_buffer(&mut a.client, 256 * MIB, "src").await;
    fill_seed(&mut a.client, src.id, 0, 0, 21).await;
    let dst = host_buffer(&mut bc, 256 * MIB, "dst").await;

    // The peer stops answering in the middle of a 256 MiB write.
    let big = write(&mut a.client, write_entry(&src, 0, &dst, 0, 256 * MIB), b"")
        .await
        .unwrap();
    until_bytes(&mut a.client, big, MIB).await;
    signal(b.child.id(), "-STOP");
    let stopped = Instant::now();
    // A new write to it stays unfinished (offered under rendezvous; running under eager, its
    // data waiting for credits); cancel it there.
    let offered = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4 * MIB), b"")
        .await
        .unwrap();
    let ev = first_event(&mut a.client, offered).await;
    assert_ne!(ev.state, pb::TransferState::Finished as i32, "{ev:?}");
    let r = a
        .client
        .cancel(pb::CancelRequest { transfer_id: offered })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    let e = wait(&mut a.client, offered).await;
    assert_eq!(e.status_code, Code::Cancelled as i32, "{}", e.status_message);
    // Another one's deadline passes while it is offered.
    let expiring = a
        .client
        .write(pb::WriteRequest {
            entry: Some(write_entry(&src, 0, &dst, 0, 4 * MIB)),
            timeout_ms: 300,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    let e = wait(&mut a.client, expiring).await;
    assert_eq!(
        e.status_code,
        Code::DeadlineExceeded as i32,
        "{}",
        e.status_message
    );
    // The big write fails, naming the peer and the silence, within the heartbeat bound.
    let e = wait(&mut a.client, big).await;
    let took = stopped.elapsed();
    assert_eq!(e.status_code, Code::Unavailable as i32, "{}", e.status_message);
    assert!(e.status_message.contains("stall-b"), "{}", e.status_message);
    assert!(e.status_message.contains("heartbeat"), "{}", e.status_message);
    assert!(
        took < BOUND + Duration::from_secs(2),
        "failed {took:?} after the stall"
    );
    assert_lanes_drain(&mut a.client).await;

    // The peer wakes up: the next write pairs again and lands byte-exact.
    signal(b.child.id(), "-CONT");
    let dst2 = host_buffer(&mut bc, 16 * MIB, "dst2").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // The woken peer may still hold the old pairing for a moment: UNAVAILABLE, retry.
        match write(&mut a.client, write_entry(&src, 0, &dst2, 0, 16 * MIB), b"").await {
            Ok(id) => {
                wait_ok(&mut a.client, id).await;
                break;
            }
            Err(s) => {
                assert_eq!(s.code(), Code::Unavailable, "{}", s.message());
                assert!(Instant::now() < deadline, "never reconnected: {}", s.message());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert_eq!(
        crc(&mut bc, dst2.id, 0, 0).await,
        crc(&mut a.client, src.id, 0, 16 * MIB).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_peer_completes_slowly_but_exactly_and_queued_transfers_cancel() {
    tcpxd::logging::init("error");
    // s sends at 0.5 Gbit/s with 2 ms before each send.
    let s = procs::spawn(
        "slow-s",
        0,
        "",
        &[("TCPXEMU_RATE_GBPS", "0.5"), ("TCPXEMU_DELAY_US", "2000")],
    )
    .await;
    let mut sc = s.client().await;
    let mut f = daemons::start("slow-f", |_| {}).await;
    sc.connect_peer(pb::ConnectPeerRequest {
        address: f.peer_addr(),
    })
    .await
    .unwrap();
    let src = host_buffer(&mut sc, 32 * MIB, "src").await;
    fill_seed(&mut sc, src.id, 0, 0, 31).await;
    let dst = host_buffer(&mut f.client, 32 * MIB, "dst").await;
    exact_write(&mut sc, &mut f.client, &src, &dst, 32 * MIB).await;
    // A read served by the slow side, too.
    let into = host_buffer(&mut f.client, 8 * MIB, "into").await;
    let id = read(&mut f.client, read_entry(&src, 0, &into, 0, 8 * MIB))
        .await
        .unwrap();
    wait_ok(&mut f.client, id).await;
    assert_eq!(
        crc(&mut f.client, into.id, 0, 0).await,
        crc(&mut sc, src.id, 0, 8 * MIB).await
    );

    // A transfer queued behind a long one on the slow lanes is cancelled; the long one finishes.
    let long = write(&mut sc, write_entry(&src, 0, &dst, 0, 32 * MIB), b"")
        .await
        .unwrap();
    let queued = write(&mut sc, write_entry(&src, 0, &dst, 0, 4 * MIB), b"")
        .await
        .unwrap();
    let r = sc
        .cancel(pb::CancelRequest { transfer_id: queued })
        .await
        .unwrap()
        .into_inner();
    assert!(r.cancelled);
    let e = wait(&mut sc, queued).await;
    assert_eq!(e.status_code, Code::Cancelled as i32, "{}", e.status_message);
    // Another one's deadline passes while it waits behind the long one.
    let expiring = sc
        .write(pb::WriteRequest {
            entry: Some(write_entry(&src, 0, &dst, 0, 4 * MIB)),
            timeout_ms: 100,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .transfer_id;
    let e = wait(&mut sc, expiring).await;
    assert_eq!(
        e.status_code,
        Code::DeadlineExceeded as i32,
        "{}",
        e.status_message
    );
    wait_ok(&mut sc, long).await;
    assert_eq!(
        crc(&mut f.client, dst.id, 0, 0).await,
        crc(&mut sc, src.id, 0, 0).await
    );
    assert_lanes_drain(&mut sc).await;
    assert_lanes_drain(&mut f.client).await;
    f.stop().await;
}
