//! The framed session's request ring (src/api/local/ring.rs): a sealed memfd the client attaches
//! and writes its requests in, which the daemon's poller reads. Real transfers between two
//! daemons, bytes compared: requests on the ring and the socket in one order (a cancel always
//! finds the transfer sent before it, whichever way each went), with the poller parked (the
//! doorbell) and spinning, served on the poller's thread or the runtime's; a ring full in a
//! burst (the rest on the socket, in order); hostile clients (a length past the slot, an entry
//! after socket frames that never came, garbage, a descriptor's request on the ring) refused
//! with their own session only; bad files and the switch off refused with the session going on.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{Ordering, fence};

use prost::Message;

use crate::common::daemons::*;
use crate::common::framed::*;
use crate::common::hold;
use rustix::fs::{MemfdFlags, SealFlags};
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tcpxd::net::shared_words::SharedWords;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn memfd(bytes: u64, seals: SealFlags) -> OwnedFd {
    let fd = rustix::fs::memfd_create("ring-suite", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, bytes).unwrap();
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

/// A ring as a client writes it (the Python package's tcpxd._ring does the same).
struct ClientRing {
    fd: OwnedFd,
    words: SharedWords,
    slots: u64,
    slot_words: usize,
    written: u64,
    /// Socket frames sent since the attach frame (doorbells not counted).
    socket_sent: u64,
    /// Entries put on the ring, and doorbells rung.
    ringed: u64,
    doorbells: u64,
}

impl ClientRing {
    fn new(slots: u32, slot_bytes: u32) -> ClientRing {
        let bytes = 64 + u64::from(slots) * u64::from(slot_bytes);
        let fd = memfd(bytes, SealFlags::SHRINK | SealFlags::GROW);
        let words = SharedWords::map(fd.as_fd(), bytes as usize / 8).unwrap();
        ClientRing {
            fd,
            words,
            slots: u64::from(slots),
            slot_words: slot_bytes as usize / 8,
            written: 0,
            socket_sent: 0,
            ringed: 0,
            doorbells: 0,
        }
    }

    fn at(&self, k: u64) -> usize {
        8 + ((k - 1) % self.slots) as usize * self.slot_words
    }

    fn taken(&self) -> u64 {
        self.words.load(0, Ordering::Acquire)
    }

    /// Writes `bytes` as entry `k` saying `before` socket frames came first (no checks: a
    /// hostile client's too).
    fn write(&self, k: u64, bytes: &[u8], len: u64, before: u64) {
        let at = self.at(k);
        self.words.store(at + 1, len, Ordering::Relaxed);
        self.words.store(at + 2, before, Ordering::Relaxed);
        for (i, c) in bytes.chunks(8).enumerate() {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            self.words
                .store(at + 4 + i, u64::from_le_bytes(b), Ordering::Relaxed);
        }
        self.words.store(at, k, Ordering::Release);
    }

    /// Sends `req` on the ring when it fits and there is room (ringing the doorbell when the
    /// daemon's poller may be parked), else on the socket; whether it went on the ring.
    async fn send(&mut self, s: &mut Framed, req: pb::SessionRequest) -> bool {
        let bytes = req.encode_to_vec();
        let k = self.written + 1;
        if bytes.len() > self.slot_words * 8 - 32 || k - self.taken() > self.slots {
            s.send_request(req).await;
            self.socket_sent += 1;
            return false;
        }
        self.write(k, &bytes, bytes.len() as u64, self.socket_sent);
        self.written = k;
        self.ringed += 1;
        fence(Ordering::SeqCst);
        if self.words.load(1, Ordering::Relaxed) == 0 {
            self.doorbells += 1;
            s.send(0, Op::RingDoorbell(true)).await;
        }
        true
    }

    async fn socket(&mut self, s: &mut Framed, req: pb::SessionRequest) {
        s.send_request(req).await;
        self.socket_sent += 1;
    }
}

/// Attaches `ring` under `tag`: the answer (slots, slot bytes) or the refusal's (code, message).
async fn attach(
    s: &mut Framed,
    tag: u64,
    fd: impl AsFd,
    slots: u32,
    slot_bytes: u32,
) -> Result<(u32, u32), (i32, String)> {
    let req = pb::AttachRequestRingRequest { slots, slot_bytes };
    s.send_with_fd(tag, Op::AttachRequestRing(req), fd).await;
    let ev = s.next().await;
    assert_eq!(ev.tag, tag);
    match ev.event {
        Some(Event::RequestRingAttached(r)) => Ok((r.slots, r.slot_bytes)),
        Some(Event::Refused(st)) => Err((st.code, st.message)),
        other => panic!("expected attach_request_ring's answer, got {other:?}"),
    }
}

fn request(tag: u64, op: Op) -> pb::SessionRequest {
    pb::SessionRequest { tag, op: Some(op) }
}

/// WRITEs and their cancels, each pair split across the ring and the socket both ways: every
/// cancel finds its transfer (cancelled, or refused as finished already: never "no request of
/// this session has tag"); then 4 KiB WRITEs on the ring alone, bytes compared.
async fn one_order(name: &str, setup: impl Fn(&mut tcpxd::config::DaemonArgs) + Copy) {
    let mut a = start(&format!("{name}-a"), setup).await;
    let mut b = start(&format!("{name}-b"), setup).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 31).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let mut ring = ClientRing::new(16, 512);
    assert_eq!(attach(&mut s, 1, &ring.fd, 16, 512).await, Ok((16, 512)));
    let mut tag = 1;
    for round in 0..12u64 {
        let on_ring_first = round % 2 == 0;
        tag += 2;
        let (t, c) = (tag, tag + 1);
        let len = 16 * MIB;
        let off = (round % 3) * len;
        let write = request(t, write_op(write_entry(&src, off, &dst, off, len)));
        let cancel = request(c, Op::CancelTag(t));
        if on_ring_first {
            assert!(ring.send(&mut s, write).await, "a WRITE fits a slot");
            ring.socket(&mut s, cancel).await;
        } else {
            ring.socket(&mut s, write).await;
            assert!(ring.send(&mut s, cancel).await);
        }
        let mut seen = 0;
        while seen < 2 {
            let ev = s.next().await;
            seen += 1;
            match (ev.tag, ev.event) {
                (x, Some(Event::Finished(_))) if x == t => {}
                (x, Some(Event::Cancelled(r))) if x == c => assert!(r.cancelled),
                (x, Some(Event::Refused(st))) if x == c => {
                    assert_eq!(
                        st.code,
                        tonic::Code::FailedPrecondition as i32,
                        "round {round}: {}",
                        st.message
                    );
                    assert!(
                        st.message.contains("already finished"),
                        "round {round}: {}",
                        st.message
                    );
                }
                other => panic!("round {round}: {other:?}"),
            }
        }
    }
    // 4 KiB WRITEs on the ring, one at a time, then 40 in a burst (the ring holds 16: the rest go
    // on the socket, in order): every one OK, the bytes there.
    let mut ends = 0;
    for i in 0..8u64 {
        tag += 1;
        let off = 60 * MIB + i * 4 * KIB;
        assert!(
            ring.send(
                &mut s,
                request(tag, write_op(write_entry(&src, off, &dst, off, 4 * KIB)))
            )
            .await
        );
        assert_eq!(finished(&s.next().await).status_code, 0);
        ends += 1;
    }
    let before = ring.socket_sent;
    for i in 0..40u64 {
        tag += 1;
        let off = 61 * MIB + i * 4 * KIB;
        ring.send(
            &mut s,
            request(tag, write_op(write_entry(&src, off, &dst, off, 4 * KIB))),
        )
        .await;
    }
    for _ in 0..40 {
        let ev = s.next().await;
        let t = finished(&ev);
        assert_eq!(t.status_code, 0, "{}", t.status_message);
        ends += 1;
    }
    assert_eq!(ends, 48);
    for (at, len) in [(60 * MIB, 32 * KIB), (61 * MIB, 160 * KIB)] {
        assert_eq!(
            crc(&mut a.client, src.id, at, len).await,
            crc(&mut b.client, dst.id, at, len).await,
            "the bytes at {at}"
        );
    }
    assert_eq!(ring.taken(), ring.ringed, "every entry taken");
    eprintln!(
        "{name}: {} requests on the ring, {} on the socket ({} in the burst), {} doorbells",
        ring.ringed,
        ring.socket_sent,
        ring.socket_sent - before,
        ring.doorbells
    );
    half_close(&mut s).await;
    s.assert_eof().await;
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_and_socket_requests_keep_the_clients_order_parked_or_spinning() {
    hold::gate_on();
    tcpxd::logging::init("warn");
    // The poller parks between requests and serves the sessions (the 2-core default): doorbells.
    one_order("ring-parked", |args| {
        args.spin = Some("off".into());
        args.poller_sessions = Some("on".into());
    })
    .await;
    // It spins and the runtime serves the sessions (the 16-core host's default).
    one_order("ring-spin", |args| {
        args.spin = Some("on".into());
        args.poller_sessions = Some("off".into());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_rings_fail_only_their_own_session_and_bad_attaches_are_refused() {
    hold::gate_on();
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("ring-hostile").await;
    let src = host_buffer(&mut a.client, 4 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 4 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 5).await;
    // A well-behaved session on the same daemon throughout.
    let mut good = Framed::open(&a.daemon.api_socket).await;
    let mut good_ring = ClientRing::new(16, 256);
    assert_eq!(attach(&mut good, 1, &good_ring.fd, 16, 256).await, Ok((16, 256)));
    let mut good_tag = 1;
    let mut check_good = async |good: &mut Framed, ring: &mut ClientRing| {
        good_tag += 1;
        let e = write_entry(&src, 0, &dst, 0, 4 * KIB);
        assert!(ring.send(good, request(good_tag, write_op(e))).await);
        let ev = good.next().await;
        assert_eq!(ev.tag, good_tag);
        assert_eq!(finished(&ev).status_code, 0);
    };
    check_good(&mut good, &mut good_ring).await;

    // Bad attaches: refused naming the field, the session goes on; a second ring refused.
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let (code, msg) = attach(&mut s, 1, ClientRing::new(16, 128).fd, 8, 128)
        .await
        .unwrap_err();
    assert_eq!(code, tonic::Code::InvalidArgument as i32);
    assert_eq!(msg, "attach_request_ring.slots: 8 (a power of two, 16 to 4096)");
    let small = memfd(64, SealFlags::SHRINK);
    let (_, msg) = attach(&mut s, 2, &small, 16, 128).await.unwrap_err();
    assert!(msg.contains("needs 2112"), "{msg}");
    let ring = ClientRing::new(16, 128);
    assert_eq!(attach(&mut s, 3, &ring.fd, 16, 128).await, Ok((16, 128)));
    let (_, msg) = attach(&mut s, 4, ClientRing::new(16, 128).fd, 16, 128)
        .await
        .unwrap_err();
    assert_eq!(
        msg,
        "attach_request_ring: this session has a request ring already"
    );
    // A request that needs a descriptor, on the ring: refused, the session goes on.
    let mut ring = ring;
    ring.socket_sent = 1; // the second attach's frame came after the ring's own
    let reg = request(
        5,
        Op::RegisterHostFd(pb::RegisterHostFdRequest {
            size: 4096,
            ..Default::default()
        }),
    );
    assert!(ring.send(&mut s, reg).await);
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (5, tonic::Code::InvalidArgument as i32));
    assert!(
        msg.contains("came on the request ring, which carries no file descriptor"),
        "{msg}"
    );
    // A length past the slot: refused under tag 0, the session ends.
    ring.write(ring.written + 1, b"", 4096, ring.socket_sent);
    s.send(0, Op::RingDoorbell(true)).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (0, tonic::Code::InvalidArgument as i32));
    assert_eq!(
        msg,
        "request ring: entry 2 says it is 4096 bytes; a slot holds at most 96"
    );
    s.assert_eof().await;
    check_good(&mut good, &mut good_ring).await;

    // 10,000 doorbells at once: nothing answered, nothing counted; the session goes on in order.
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let mut ring = ClientRing::new(16, 128);
    assert_eq!(attach(&mut s, 1, &ring.fd, 16, 128).await, Ok((16, 128)));
    let mut bells = Vec::new();
    for _ in 0..10_000 {
        tcpxd::api::local::frame::put_frame(&mut bells, &request(0, Op::RingDoorbell(true))).unwrap();
    }
    s.send_raw(&bells).await;
    assert!(ring.send(&mut s, request(2, Op::CancelTag(9))).await);
    let (tag, code, _) = refused(s.next().await);
    assert_eq!(
        (tag, code),
        (2, tonic::Code::NotFound as i32),
        "the ring's request, answered next"
    );
    check_good(&mut good, &mut good_ring).await;
    drop(s);

    // Garbage that does not decode: refused naming the entry.
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let ring = ClientRing::new(16, 128);
    assert_eq!(attach(&mut s, 1, &ring.fd, 16, 128).await, Ok((16, 128)));
    ring.write(1, &[0xff; 40], 40, 0);
    s.send(0, Op::RingDoorbell(true)).await;
    let (tag, _, msg) = refused(s.next().await);
    assert_eq!(tag, 0);
    assert!(
        msg.starts_with("request ring: entry 1 is not a SessionRequest: "),
        "{msg}"
    );
    s.assert_eof().await;

    // An entry that says socket frames came before it which never did: the session waits for
    // them, and ends refused when the client half-closes.
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let ring = ClientRing::new(16, 128);
    assert_eq!(attach(&mut s, 1, &ring.fd, 16, 128).await, Ok((16, 128)));
    let bytes = request(2, Op::CancelTag(9)).encode_to_vec();
    ring.write(1, &bytes, bytes.len() as u64, 3);
    s.send(0, Op::RingDoorbell(true)).await;
    check_good(&mut good, &mut good_ring).await;
    half_close(&mut s).await;
    let (tag, _, msg) = refused(s.next().await);
    assert_eq!(tag, 0);
    assert_eq!(
        msg,
        "request ring: entry 1 says 3 socket requests came before it, but the socket ended after 0"
    );
    s.assert_eof().await;

    // Every word scribbled while a session runs: only that session is refused or ends.
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let ring = ClientRing::new(16, 128);
    assert_eq!(attach(&mut s, 1, &ring.fd, 16, 128).await, Ok((16, 128)));
    for i in 0..ring.words.len() {
        ring.words.store(
            i,
            0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 3),
            Ordering::Relaxed,
        );
    }
    ring.words.store(ring.at(1), 1, Ordering::Release);
    s.send(0, Op::RingDoorbell(true)).await;
    drop(s);
    check_good(&mut good, &mut good_ring).await;
    assert!(
        good_ring.ringed == 5,
        "the good session's requests went on its ring"
    );

    // The switch off: refused, the session goes on the socket; DescribeNode lists the feature.
    let mut off = start("ring-off", |args| args.request_ring = Some("off".into())).await;
    let mut s = Framed::open(&off.daemon.api_socket).await;
    let (code, msg) = attach(&mut s, 1, ClientRing::new(16, 128).fd, 16, 128)
        .await
        .unwrap_err();
    assert_eq!(code, tonic::Code::FailedPrecondition as i32);
    assert!(msg.contains("runtime.request_ring off"), "{msg}");
    s.send(2, Op::CancelTag(77)).await;
    let (tag, code, _) = refused(s.next().await);
    assert_eq!((tag, code), (2, tonic::Code::NotFound as i32));
    let node = off
        .client
        .describe_node(pb::DescribeNodeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(node.features.iter().any(|f| f == "request_ring"));
    drop(s);
    off.stop().await;

    half_close(&mut good).await;
    good.assert_eof().await;
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
    b.stop().await;
}
