//! The eager protocol between real daemons (issue #13 points 1, 2): data leaves before the
//! receiver answers, a transfer refused after its data left changes no destination byte, cancel
//! and deadlines give every credit and slot back on both sides, a receiver killed mid-write fails
//! the write on the sender within the heartbeat bound, mixed pairings (eager one way, rendezvous
//! the other) work both ways, and both emulation receive modes (bounce pages, direct receives
//! into the landing slots) land byte-exact. The whole suite also runs eager with
//! `TCPXD_TRANSFER_PROTOCOL=eager`.

use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use crate::common::hold;
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

/// The eager lanes themselves are under test here: small transfers are not carried inline
/// (daemon_inline.rs tests that path).
fn eager(a: &mut tcpxd::config::DaemonArgs) {
    a.transfer_protocol = Some("eager".into());
    a.inline.inline_max_bytes = Some(0);
}

fn rendezvous(a: &mut tcpxd::config::DaemonArgs) {
    a.transfer_protocol = Some("rendezvous".into());
    a.inline.inline_max_bytes = Some(0);
}

async fn lanes(c: &mut Client) -> Vec<pb::LaneStats> {
    let peers = c
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers;
    peers.iter().for_each(assert_routed_as_expected);
    peers.into_iter().flat_map(|p| p.lanes).collect()
}

/// Every lane that sent chunks between two `eager` nodes is an eager lane with `credits`
/// credits, and at least one did.
fn assert_eager_sends(l: &[pb::LaneStats], credits: u32) {
    let used: Vec<&pb::LaneStats> = l.iter().filter(|l| l.chunks_sent > 0).collect();
    assert!(!used.is_empty(), "{l:?}");
    for l in used {
        assert_eq!(
            (l.send_kind.as_str(), l.send_credit_limit),
            ("eager", credits),
            "{l:?}"
        );
    }
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_refused_after_its_data_left_changes_no_destination_byte() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("eager-ref-a", eager).await;
    let mut b = daemons::start("eager-ref-b", eager).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 8 * MIB, "src").await;
    let dst = host_buffer(&mut b.client, 8 * MIB, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 5).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 6).await;
    let before = crc(&mut b.client, dst.id, 0, 0).await;
    let sent_before: u64 = lanes(&mut a.client).await.iter().map(|l| l.chunks_sent).sum();

    for len in [1, 4096, 8 * MIB] {
        let id = write(
            &mut a.client,
            write_entry(&src, 0, &wrong_key(&dst), 0, len),
            b"no",
        )
        .await
        .unwrap();
        let e = wait(&mut a.client, id).await;
        assert_eq!(
            e.status_code,
            tonic::Code::PermissionDenied as i32,
            "{}",
            e.status_message
        );
        assert!(
            e.status_message.contains("wrong access key"),
            "{}",
            e.status_message
        );
    }
    // The data did leave before the refusal: the sends went out with no round trip.
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    let l = lanes(&mut a.client).await;
    let sent: u64 = l.iter().map(|l| l.chunks_sent).sum();
    assert!(sent - sent_before >= 18, "{} chunks sent", sent - sent_before);
    // They went on eager lanes, 16 credits each (every lane of an eager node; on a routed
    // pairing, a node with GPUs, the eager lanes of host memory to host memory).
    assert_eager_sends(&l, 16);
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 0).await,
        before,
        "a refused transfer changed bytes"
    );

    // The lanes are still in step: the right key lands byte-exact.
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 8 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, 0).await,
        crc(&mut b.client, dst.id, 0, 0).await
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_pairings_follow_each_receivers_mode_both_ways() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("mixed-a", eager).await;
    let mut b = daemons::start("mixed-b", rendezvous).await;
    connect(&mut a, &b).await;
    let la = host_buffer(&mut a.client, 4 * MIB, "a").await;
    let lb = host_buffer(&mut b.client, 4 * MIB, "b").await;
    let back = host_buffer(&mut a.client, 4 * MIB, "back").await;
    fill_seed(&mut a.client, la.id, 0, 0, 1).await;
    // a → b: rendezvous (b's mode); b → a: eager (a's mode); reads both ways.
    let id = write(&mut a.client, write_entry(&la, 0, &lb, 0, 4 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let id = write(&mut b.client, write_entry(&lb, 0, &back, 0, 4 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut b.client, id).await;
    assert_eq!(
        crc(&mut a.client, la.id, 0, 0).await,
        crc(&mut a.client, back.id, 0, 0).await
    );
    fill_seed(&mut b.client, lb.id, 0, 0, 2).await;
    let id = read(&mut a.client, read_entry(&lb, 0, &back, 0, 4 * MIB))
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let id = read(&mut b.client, read_entry(&back, 0, &lb, 0, 4 * MIB))
        .await
        .unwrap();
    wait_ok(&mut b.client, id).await;
    assert_eq!(
        crc(&mut a.client, back.id, 0, 0).await,
        crc(&mut b.client, lb.id, 0, 0).await
    );
    // Each way's lanes in use follow the receiver's mode: a → b rendezvous lanes without
    // credits, b → a eager lanes with 16.
    for (c, send, recv) in [
        (&mut a.client, "rendezvous", "eager"),
        (&mut b.client, "eager", "rendezvous"),
    ] {
        let l = lanes(c).await;
        for (kind, dir) in [(send, "send"), (recv, "recv")] {
            let used: Vec<(&String, u32)> = l
                .iter()
                .map(|l| match dir {
                    "send" => (&l.send_kind, l.send_credit_limit),
                    _ => (&l.recv_kind, l.recv_credit_limit),
                })
                .filter(|(k, _)| !k.is_empty())
                .collect();
            assert!(!used.is_empty(), "no {dir} lane in use: {l:?}");
            let limit = if kind == "eager" { 16 } else { 0 };
            assert!(used.iter().all(|&(k, n)| k == kind && n == limit), "{dir}: {l:?}");
        }
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_deadlines_give_every_credit_and_slot_back_on_both_sides() {
    // The peer as its own process, held stopped (SIGSTOP) to keep each transfer in flight on any
    // plugin, and the emulation's hold gate closed before each post so that none can end before
    // the peer is stopped (`common::hold`).
    hold::gate_on();
    tcpxd::logging::init("error");
    let mut a = daemons::start("eager-cancel-a", eager).await;
    let (b, mut bc) =
        hold::peer_process(&mut a, "eager-cancel-b", &[("TCPXD_TRANSFER_PROTOCOL", "eager")]).await;
    let src = host_buffer(&mut a.client, 128 * MIB, "src").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 3).await;
    fill_seed(&mut bc, dst.id, 0, 0, 4).await;
    // A write cancelled mid-flight.
    hold::close_gate();
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let (frozen, _) = hold::freeze_once_moving(&mut a.client, id, &b).await;
    assert!(
        a.client
            .cancel(pb::CancelRequest { transfer_id: id })
            .await
            .unwrap()
            .into_inner()
            .cancelled
    );
    frozen.thaw();
    let e = wait(&mut a.client, id).await;
    assert_eq!(
        e.status_code,
        tonic::Code::Cancelled as i32,
        "{}",
        e.status_message
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    // A write whose deadline passes mid-flight. (The gate keeps it from ending; the deadline
    // leaves the test a generous second to see its first bytes move and stop the peer, which
    // stays stopped well within the heartbeat timeout.)
    hold::close_gate();
    let mut caller = a.client.clone();
    let (s2, d2) = (src.clone(), dst.clone());
    let call = tokio::spawn(async move {
        caller
            .write(pb::WriteRequest {
                entry: Some(write_entry(&s2, 0, &d2, 0, 128 * MIB)),
                notification: Vec::new(),
                timeout_ms: 1000,
                ready_event_ipc_handle: Vec::new(),
                wait: true,
            })
            .await
    });
    let frozen = hold::freeze_once_lanes_move(&mut a.client, &b, 1).await;
    let e = call.await.unwrap();
    frozen.thaw();
    match e {
        Ok(r) => {
            let ev = r.into_inner().r#final.expect("the final event");
            assert_eq!(
                ev.status_code,
                tonic::Code::DeadlineExceeded as i32,
                "{}",
                ev.status_message
            )
        }
        Err(s) => assert_eq!(s.code(), tonic::Code::DeadlineExceeded, "{}", s.message()),
    }
    // A read (the holder's eager write back) cancelled mid-flight by the reader.
    hold::close_gate();
    let id = read(&mut a.client, read_entry(&dst, 0, &src, 0, 128 * MIB))
        .await
        .unwrap();
    let (frozen, _) = hold::freeze_once_moving(&mut a.client, id, &b).await;
    a.client
        .cancel(pb::CancelRequest { transfer_id: id })
        .await
        .unwrap();
    frozen.thaw();
    let e = wait(&mut a.client, id).await;
    assert_eq!(
        e.status_code,
        tonic::Code::Cancelled as i32,
        "{}",
        e.status_message
    );
    // Every credit back with its sender, every credit receive posted again, no slot held.
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    // Each lane in use either way, eager with 16 credits (an eager node's every lane, or a
    // routed pairing's eager lanes of host memory to host memory), has them all back.
    let l = lanes(&mut bc).await;
    assert_eager_sends(&l, 16);
    for l in &l {
        if !l.send_kind.is_empty() {
            assert_eq!((l.send_credits, l.send_credit_limit), (16, 16), "{l:?}");
        }
        if !l.recv_kind.is_empty() {
            assert_eq!(l.recv_kind, "eager", "{l:?}");
            assert_eq!((l.recv_credits, l.recv_credit_limit), (16, 16), "{l:?}");
        }
    }
    assert!(
        l.iter().any(|l| !l.recv_kind.is_empty()) && l.iter().any(|l| !l.send_kind.is_empty()),
        "lanes in use both ways: {l:?}"
    );
    // And the lanes are in step: the next transfers are byte-exact.
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, 4 * MIB).await,
        crc(&mut bc, dst.id, 0, 4 * MIB).await
    );
    let id = read(&mut a.client, read_entry(&dst, 4 * MIB, &src, 4 * MIB, 4 * MIB))
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, src.id, 4 * MIB, 4 * MIB).await,
        crc(&mut bc, dst.id, 4 * MIB, 4 * MIB).await
    );
    a.stop().await;
}

/// Two `tcpxd` processes, both eager, with the emulation's host receive mode `host_recv`.
async fn eager_pair(
    tag: &str,
    host_recv: &str,
    a_env: &[(&str, &str)],
) -> (procs::ProcDaemon, procs::ProcDaemon) {
    let mut env = vec![
        ("TCPXD_TRANSFER_PROTOCOL", "eager"),
        ("TCPXEMU_HOST_RECV", host_recv),
    ];
    let a = procs::spawn(&format!("{tag}-a"), 0, "", &[&env[..], a_env].concat()).await;
    env.truncate(2);
    let b = procs::spawn(&format!("{tag}-b"), 0, "", &env).await;
    let mut ac = a.client().await;
    ac.connect_peer(pb::ConnectPeerRequest {
        address: b.peer_addr.clone(),
    })
    .await
    .expect("a pairs with b");
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_emulation_receive_modes_land_byte_exact() {
    tcpxd::logging::init("error");
    for mode in ["bounce", "direct"] {
        let (a, b) = eager_pair(&format!("eager-{mode}"), mode, &[]).await;
        let (mut ac, mut bc) = (a.client().await, b.client().await);
        let src = host_buffer(&mut ac, 32 * MIB, "src").await;
        let dst = host_buffer(&mut bc, 32 * MIB, "dst").await;
        let back = host_buffer(&mut ac, 32 * MIB, "back").await;
        fill_seed(&mut ac, src.id, 0, 0, 9).await;
        fill_seed(&mut bc, dst.id, 0, 0, 10).await;
        // Uneven sizes and offsets: short last chunks, chunks of every lane.
        for (off, len) in [
            (0, 1),
            (7, 4095),
            (4096, 4096),
            (12345, 3 * MIB + 17),
            (0, 32 * MIB),
        ] {
            let id = write(&mut ac, write_entry(&src, off, &dst, off, len), b"")
                .await
                .unwrap();
            wait_ok(&mut ac, id).await;
            assert_eq!(
                crc(&mut ac, src.id, off, len).await,
                crc(&mut bc, dst.id, off, len).await,
                "{mode}: write {off}+{len}"
            );
        }
        fill_seed(&mut bc, dst.id, 0, 0, 11).await;
        let id = read(&mut ac, read_entry(&dst, 0, &back, 0, 32 * MIB))
            .await
            .unwrap();
        wait_ok(&mut ac, id).await;
        assert_eq!(
            crc(&mut ac, back.id, 0, 0).await,
            crc(&mut bc, dst.id, 0, 0).await,
            "{mode}: read"
        );
        // A refused write changes nothing, in either mode.
        let before = crc(&mut bc, dst.id, 0, 0).await;
        let id = write(&mut ac, write_entry(&src, 0, &wrong_key(&dst), 0, 4 * MIB), b"")
            .await
            .unwrap();
        let refused = wait(&mut ac, id).await;
        assert_eq!(refused.status_code, tonic::Code::PermissionDenied as i32);
        // Its data went out with the header, yet the final event counts what landed: nothing.
        assert_eq!(
            refused.bytes_done, 0,
            "{mode}: a refused write reports bytes landed"
        );
        assert_lanes_drain(&mut ac).await;
        assert_lanes_drain(&mut bc).await;
        assert_eq!(
            crc(&mut bc, dst.id, 0, 0).await,
            before,
            "{mode}: a refused write landed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_killed_during_an_eager_write_fails_it_within_the_bound() {
    tcpxd::logging::init("error");
    let bound = Duration::from_millis(tcpxd::config::DEFAULT_HEARTBEAT_TIMEOUT_MS);
    // The sender paces its sends (4 Gbit/s) so the kill lands in the middle of the write.
    let (a, mut b) = eager_pair("eager-kill", "bounce", &[("TCPXEMU_RATE_GBPS", "4")]).await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    let src = host_buffer(&mut ac, 256 * MIB, "src").await;
    let dst = host_buffer(&mut bc, 256 * MIB, "dst").await;
    let id = write(&mut ac, write_entry(&src, 0, &dst, 0, 256 * MIB), b"")
        .await
        .unwrap();
    let mut events = ac
        .watch(pb::WatchRequest { transfer_id: id })
        .await
        .unwrap()
        .into_inner();
    while let Some(e) = events.message().await.unwrap() {
        assert_ne!(
            e.state,
            pb::TransferState::Finished as i32,
            "ended before the kill: {e:?}"
        );
        if e.bytes_done >= 8 * MIB {
            break;
        }
    }
    b.kill();
    let killed = Instant::now();
    let end = wait(&mut ac, id).await;
    let took = killed.elapsed();
    assert_eq!(
        end.status_code,
        tonic::Code::Unavailable as i32,
        "{}",
        end.status_message
    );
    assert!(
        end.status_message.contains("eager-kill-b"),
        "{}",
        end.status_message
    );
    // Within 3 s (issue #13): a killed process's sockets close at once, so this does not even
    // wait for the heartbeat bound.
    assert!(
        took < Duration::from_secs(3).min(bound),
        "failed {took:?} after the kill"
    );
    assert_lanes_drain(&mut ac).await;
}

mod hostile {
    //! Hostile headers over the real wire: a raw peer-service client pretending to be a peer.

    use super::*;
    use crate::common::fake_lanes::{FakeLanes, gpu_topology};
    use ppb::peer_message::Body;
    use tcpxd::api::proto::peer as ppb;
    use tcpxd::api::proto::peer::tcpxd_peer_client::TcpxdPeerClient;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;

    struct FakePeer {
        tx: mpsc::Sender<ppb::PeerMessage>,
        rx: tonic::Streaming<ppb::PeerMessage>,
        /// The lanes its headers name (`common::fake_lanes`).
        lanes: FakeLanes,
    }

    fn msg(body: Body) -> ppb::PeerMessage {
        ppb::PeerMessage { body: Some(body) }
    }

    /// A fake peer announcing `gpus` GPUs (0: no topology, a node without GPUs): with GPUs
    /// the pairing is routed, its headers name the (host, host) group's eager lanes.
    async fn fake_peer(addr: &str, node: &str, gpus: u32) -> FakePeer {
        let mut raw = TcpxdPeerClient::connect(format!("http://{addr}")).await.unwrap();
        let req = ppb::HandshakeRequest {
            protocol_version: tcpxd::peers::PROTOCOL_VERSION,
            node_id: node.into(),
            lanes: vec![ppb::LaneHandle {
                lane: 0,
                device: 0,
                handle: Vec::new(),
            }],
            topology: (gpus > 0).then(|| gpu_topology(gpus)),
            ..Default::default()
        };
        let resp = raw.handshake(req.clone()).await.expect("handshake").into_inner();
        let lanes = FakeLanes::of(&req, &resp);
        let (tx, rx) = mpsc::channel(64);
        for body in [
            Body::Hello(ppb::Hello {
                session_id: resp.session_id,
                node_id: node.into(),
                proof: Vec::new(),
            }),
            Body::ReceiveMode(ppb::ReceiveMode {
                credits: 0,
                chunk_bytes: 0,
                ..Default::default()
            }),
        ] {
            tx.send(msg(body)).await.unwrap();
        }
        let rx = raw
            .control(ReceiverStream::new(rx))
            .await
            .expect("control")
            .into_inner();
        FakePeer { tx, rx, lanes }
    }

    impl FakePeer {
        /// The next message that is not a heartbeat or the daemon's ReceiveMode.
        async fn next(&mut self) -> Option<Body> {
            loop {
                let m = tokio::time::timeout(Duration::from_secs(20), self.rx.message())
                    .await
                    .expect("an answer within 20 s")
                    .ok()??;
                match m.body {
                    Some(Body::Heartbeat(_) | Body::ReceiveMode(_)) => continue,
                    b => return b,
                }
            }
        }
    }

    /// A header on `lanes`' first eager lane into host memory (an `eager` daemon's eager lanes
    /// start at 0 on its layout).
    fn header(
        lanes: &FakeLanes,
        id: u64,
        buffer_id: u64,
        key: &[u8],
        offset: u64,
        length: u64,
    ) -> ppb::Offer {
        ppb::Offer {
            offer_id: id,
            read_id: 0,
            chunk_bytes: 512 * 1024,
            first_lane: lanes.header_lane(0),
            ranges: vec![ppb::RemoteRange {
                buffer_id,
                access_key: key.to_vec(),
                offset,
                length,
            }],
            notification: Vec::new(),
            deadline_ms: 10_000,
            coalesced: false,
            blocks: None,
            transfer_id: 0,
            ..Default::default()
        }
    }

    async fn failed_with(c: &mut Client, node: &str, words: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let peers = c
                .list_peers(pb::ListPeersRequest {})
                .await
                .unwrap()
                .into_inner()
                .peers;
            let p = peers.iter().find(|p| p.node_id == node).expect("listed");
            if p.state == pb::PeerState::Failed as i32 {
                assert!(p.error.contains(words), "{node}: {}", p.error);
                return;
            }
            assert!(Instant::now() < deadline, "{node} never failed: {p:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_headers_are_refused_and_change_nothing() {
        tcpxd::logging::init("error");
        let mut b = daemons::start("eager-hostile-b", eager).await;
        let dst = host_buffer(&mut b.client, 4 * MIB, "dst").await;
        fill_seed(&mut b.client, dst.id, 0, 0, 1).await;
        let before = crc(&mut b.client, dst.id, 0, 0).await;
        let key = hex::decode(
            dst.descriptor
                .split('@')
                .next()
                .unwrap()
                .rsplit(':')
                .next()
                .unwrap(),
        )
        .unwrap();
        let mut bad_key = key.clone();
        bad_key[15] ^= 1;

        // Once with a fake without GPUs (not routed in CI: the layout's eager lanes), once
        // with one announcing two (routed: the (host, host) group's eager lanes); on a daemon
        // with GPUs (the CUDA stand-in) both pairings are routed.
        for gpus in [0u32, 2] {
            let node = |n: &str| format!("eager-{n}-{gpus}");
            let mut fake = fake_peer(&b.peer_addr(), &node("p"), gpus).await;
            // Refused one by one (their chunks would be consumed without unpacking); the pairing stays.
            let h = |id, buffer_id, key: &[u8], offset, length| {
                header(&fake.lanes, id, buffer_id, key, offset, length)
            };
            let mut unknown_read = h(5, dst.id, &key, 0, 4096);
            unknown_read.read_id = 77;
            let cases = [
                (
                    h(1, dst.id, &bad_key, 0, 4096),
                    tonic::Code::PermissionDenied,
                    "wrong access key",
                ),
                (
                    h(2, dst.id, &key, 4 * MIB - 10, 4096),
                    tonic::Code::InvalidArgument,
                    "past the end",
                ),
                (
                    h(3, dst.id, &key, u64::MAX, 2),
                    tonic::Code::InvalidArgument,
                    "overflows",
                ),
                (
                    h(4, dst.id + 99, &key, 0, 4096),
                    tonic::Code::NotFound,
                    "does not exist",
                ),
                (unknown_read, tonic::Code::NotFound, "read 77 is unknown"),
            ];
            for (hd, code, words) in cases {
                let id = hd.offer_id;
                fake.tx.send(msg(Body::Header(hd))).await.unwrap();
                match fake.next().await {
                    Some(Body::Reject(r)) => {
                        assert_eq!((r.offer_id, r.code), (id, code as i32), "{words}: {}", r.message);
                        assert!(r.message.contains(words), "{:?} lacks {words:?}", r.message);
                    }
                    other => panic!("{words}: expected a Reject, got {other:?}"),
                }
            }
            // Messages about transfers nobody knows are ignored; an offer gets a refusal (nothing
            // was posted for it), and the stream still answers in order.
            for body in [
                Body::Done(ppb::Done {
                    offer_id: 999,
                    ..Default::default()
                }),
                Body::CancelOffer(ppb::CancelOffer {
                    offer_id: 999,
                    code: 1,
                    message: String::new(),
                }),
                Body::Failed(ppb::Failed {
                    offer_id: 999,
                    code: 13,
                    message: String::new(),
                }),
            ] {
                fake.tx.send(msg(body)).await.unwrap();
            }
            fake.tx
                .send(msg(Body::Offer(header(&fake.lanes, 6, dst.id, &key, 0, 4096))))
                .await
                .unwrap();
            match fake.next().await {
                Some(Body::Reject(r)) => {
                    assert_eq!(r.code, tonic::Code::FailedPrecondition as i32);
                    assert!(r.message.contains("receives eagerly"), "{}", r.message);
                }
                other => panic!("expected a Reject, got {other:?}"),
            }
            // A header whose chunks are larger than the credit receives: the pairing fails.
            let mut big = header(&fake.lanes, 7, dst.id, &key, 0, 8 * 4096);
            big.chunk_bytes = 1 << 20;
            fake.tx.send(msg(Body::Header(big))).await.unwrap();
            failed_with(
                &mut b.client,
                &node("p"),
                "exceeds the 524288-byte credit receives",
            )
            .await;

            // Credits from a peer the daemon never granted any to, a header with a 3-byte key and
            // more chunks than one header may carry: each fails its pairing.
            let lanes = fake.lanes.clone();
            let mut bad_range = header(&lanes, 1, dst.id, &key, 0, 4096);
            bad_range.ranges[0].access_key = vec![1, 2, 3];
            let mut huge = header(&lanes, 1, dst.id, &bad_key, 0, u64::MAX);
            huge.chunk_bytes = 4096;
            let cases = [
                (
                    node("q"),
                    Body::Credits(ppb::Credits { returned: vec![0, 1] }),
                    "receives by rendezvous",
                ),
                (node("r"), Body::Header(bad_range), "access_key"),
                (node("s"), Body::Header(huge), "more than"),
            ];
            for (node, body, words) in cases {
                let f = fake_peer(&b.peer_addr(), &node, gpus).await;
                f.tx.send(msg(body)).await.unwrap();
                failed_with(&mut b.client, &node, words).await;
            }
        }
        assert_eq!(
            crc(&mut b.client, dst.id, 0, 0).await,
            before,
            "a hostile header changed bytes"
        );
        assert_lanes_drain(&mut b.client).await;
        b.stop().await;
    }
}
