//! Hostile input, table-driven, over the peer service (a raw tonic client pretending to be a
//! peer: handshakes, control-stream openings and every control message) and the client API:
//! sizes at and past every limit, overflowing offsets, unknown ids, truncated and oversized
//! messages. Every case gets the right status (or, for messages about unknown ids, is ignored
//! without harm), no daemon crashes, and no byte of any buffer changes.

mod common;

use std::time::Duration;

use common::daemons::{self, *};
use tcpxd::api::proto::peer as ppb;
use tcpxd::api::proto::peer::tcpxd_peer_client::TcpxdPeerClient;
use tcpxd::api::proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 4 * MIB;

/// Sends raw bytes as a request message and reads the reply as raw bytes: truncated and
/// malformed protobuf, which no generated client can produce.
#[derive(Clone, Default)]
struct RawCodec;
struct RawCoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCoder;
    type Decoder = RawCoder;
    fn encoder(&mut self) -> RawCoder {
        RawCoder
    }
    fn decoder(&mut self) -> RawCoder {
        RawCoder
    }
}

impl tonic::codec::Encoder for RawCoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes_buf::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes_buf::Buf;
        let mut v = vec![0; src.remaining()];
        src.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

mod bytes_buf {
    pub use prost::bytes::{Buf, BufMut};
}

/// A unary call with raw request bytes.
async fn raw_unary(channel: Channel, path: &str, body: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::try_from(path.to_string()).unwrap(),
        RawCodec,
    )
    .await
    .map(|r| r.into_inner())
}

/// The hostile daemon's settings: generous peer timeouts, since the fake peer never connects
/// its data lanes and speaks slowly.
fn patient_config(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("tcpxd-hostile-{tag}-{}.toml", std::process::id()));
    std::fs::write(
        &p,
        "[peer]\nconnect_timeout_s = 600\nheartbeat_interval_ms = 500\nheartbeat_timeout_ms = 600000\n",
    )
    .unwrap();
    p
}

/// Checksums of every buffer of the daemons.
async fn snapshot(cs: &mut [&mut Client]) -> Vec<u32> {
    let mut out = Vec::new();
    for c in cs.iter_mut() {
        let list = c
            .list_buffers(pb::ListBuffersRequest {})
            .await
            .unwrap()
            .into_inner();
        for b in list.buffers {
            out.push(crc(c, b.id, 0, 0).await);
        }
    }
    out
}

fn check<T>(n: &mut usize, name: &str, r: Result<T, tonic::Status>, code: Code, words: &str) {
    *n += 1;
    match r {
        Ok(_) => panic!("{name}: expected {code:?}, got success"),
        Err(s) => {
            assert_eq!(s.code(), code, "{name}: {}", s.message());
            assert!(
                s.message().contains(words),
                "{name}: {:?} should mention {words:?}",
                s.message()
            );
        }
    }
}

fn range(buffer_id: u64, key: &[u8], offset: u64, length: u64) -> ppb::RemoteRange {
    ppb::RemoteRange {
        buffer_id,
        access_key: key.to_vec(),
        offset,
        length,
    }
}

fn key_of(b: &pb::Buffer) -> Vec<u8> {
    hex::decode(
        b.descriptor
            .split('@')
            .next()
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap(),
    )
    .unwrap()
}

fn msg(body: ppb::peer_message::Body) -> ppb::PeerMessage {
    ppb::PeerMessage { body: Some(body) }
}

/// A fake peer with an open control stream to a daemon.
struct FakePeer {
    tx: mpsc::Sender<ppb::PeerMessage>,
    rx: tonic::Streaming<ppb::PeerMessage>,
    _listen: tcpxd::net::ListenComm,
}

async fn fake_peer(addr: &str, node: &str) -> FakePeer {
    let plugin = daemons::plugin();
    let listen = plugin.listen(0).unwrap();
    let mut raw = TcpxdPeerClient::connect(format!("http://{addr}")).await.unwrap();
    let resp = raw
        .handshake(ppb::HandshakeRequest {
            protocol_version: tcpxd::peers::PROTOCOL_VERSION,
            node_id: node.into(),
            lanes: vec![ppb::LaneHandle {
                lane: 0,
                device: 0,
                handle: listen.handle().0.to_vec(),
            }],
            ..Default::default()
        })
        .await
        .expect("handshake")
        .into_inner();
    let (tx, rx) = mpsc::channel(64);
    tx.send(msg(ppb::peer_message::Body::Hello(ppb::Hello {
        session_id: resp.session_id,
        node_id: node.into(),
        proof: Vec::new(),
    })))
    .await
    .unwrap();
    // It receives by rendezvous (it never posts a receive anyway).
    tx.send(msg(ppb::peer_message::Body::ReceiveMode(ppb::ReceiveMode {
        credits: 0,
        chunk_bytes: 0,
        ..Default::default()
    })))
    .await
    .unwrap();
    let rx = raw
        .control(ReceiverStream::new(rx))
        .await
        .expect("control")
        .into_inner();
    FakePeer {
        tx,
        rx,
        _listen: listen,
    }
}

impl FakePeer {
    /// The next message that is not a heartbeat.
    async fn next(&mut self) -> ppb::peer_message::Body {
        loop {
            let m = tokio::time::timeout(Duration::from_secs(20), self.rx.message())
                .await
                .expect("an answer within 20 s")
                .expect("stream intact")
                .expect("stream open");
            match m.body {
                Some(
                    ppb::peer_message::Body::Heartbeat(_)
                    | ppb::peer_message::Body::ReceiveMode(_)
                    | ppb::peer_message::Body::Credits(_),
                ) => continue,
                Some(b) => return b,
                None => panic!("a message without a body"),
            }
        }
    }
}

enum Ctl {
    /// Must be answered by a Reject of this offer with the code, words and range index.
    Offer(ppb::Offer, Code, &'static str, u32),
    /// Must be answered by a ReadReject.
    Read(ppb::ReadRequest, Code, &'static str, u32),
    /// About an unknown id: ignored, no answer, the peer stays up.
    Ignored(ppb::peer_message::Body),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peer_messages_are_refused_and_change_nothing() {
    tcpxd::logging::init("error");
    let cfg = patient_config("b");
    // Offers are the rendezvous protocol's (an eager daemon refuses them all alike); eager
    // headers have their own test below.
    let mut b = daemons::start("host-b", |a| {
        a.config = Some(cfg.clone());
        a.transfer_protocol = Some("rendezvous".into());
    })
    .await;
    let dst = host_buffer(&mut b.client, SIZE, "dst").await;
    let other = host_buffer(&mut b.client, MIB, "other").await;
    fill_seed(&mut b.client, dst.id, 0, 0, 1).await;
    fill_seed(&mut b.client, other.id, 0, 0, 2).await;
    let before = snapshot(&mut [&mut b.client]).await;
    let key = key_of(&dst);
    let mut n = 0usize;

    // ---- Handshake --------------------------------------------------------------------------
    let plugin = daemons::plugin();
    let listen = plugin.listen(0).unwrap();
    let lane = |l: u32, h: Vec<u8>| ppb::LaneHandle {
        lane: l,
        device: 0,
        handle: h,
    };
    let good_handle = listen.handle().0.to_vec();
    let good = ppb::HandshakeRequest {
        protocol_version: tcpxd::peers::PROTOCOL_VERSION,
        node_id: "host-x".into(),
        lanes: vec![lane(0, good_handle.clone())],
        ..Default::default()
    };
    let mut cases: Vec<(String, ppb::HandshakeRequest, Code, &str)> = Vec::new();
    for v in [0, 1, 2, 4, 7, u32::MAX] {
        cases.push((
            format!("protocol {v}"),
            ppb::HandshakeRequest {
                protocol_version: v,
                ..good.clone()
            },
            Code::FailedPrecondition,
            "protocol_version",
        ));
    }
    for id in ["", "a:b", "a b", "é", "x/y", &"n".repeat(129), "host-b"] {
        let words = if id == "host-b" { "itself" } else { "node_id" };
        cases.push((
            format!("node id {id:?}"),
            ppb::HandshakeRequest {
                node_id: id.into(),
                ..good.clone()
            },
            Code::InvalidArgument,
            words,
        ));
    }
    for count in [0usize, 65, 100] {
        cases.push((
            format!("{count} lanes"),
            ppb::HandshakeRequest {
                lanes: (0..count as u32).map(|l| lane(l, good_handle.clone())).collect(),
                ..good.clone()
            },
            Code::InvalidArgument,
            "lanes",
        ));
    }
    for idx in [1, 5, u32::MAX] {
        cases.push((
            format!("lane index {idx}"),
            ppb::HandshakeRequest {
                lanes: vec![lane(idx, good_handle.clone())],
                ..good.clone()
            },
            Code::InvalidArgument,
            "lanes[0].lane",
        ));
    }
    for len in [0usize, 1, 64, 127, 129, 4096] {
        cases.push((
            format!("handle of {len} bytes"),
            ppb::HandshakeRequest {
                lanes: vec![lane(0, vec![7; len])],
                ..good.clone()
            },
            Code::InvalidArgument,
            "lanes[0].handle",
        ));
    }
    let mut raw = TcpxdPeerClient::connect(format!("http://{}", b.peer_addr()))
        .await
        .unwrap();
    for (name, req, code, words) in cases {
        check(&mut n, &name, raw.handshake(req).await, code, words);
    }
    // Oversized: past the peer service's 8 MiB message limit.
    let huge = ppb::HandshakeRequest {
        node_id: "x".repeat(9 << 20),
        ..good.clone()
    };
    n += 1;
    let e = raw.handshake(huge).await.expect_err("an oversized handshake");
    assert!(
        matches!(
            e.code(),
            Code::OutOfRange | Code::ResourceExhausted | Code::Internal
        ),
        "oversized handshake: {e:?}"
    );
    check(
        &mut n,
        "challenge without a secret",
        raw.challenge(ppb::ChallengeRequest::default()).await,
        Code::FailedPrecondition,
        "without a cluster secret",
    );

    // Truncated and malformed protobuf on both services: refused, nothing registered or paired.
    let malformed: [(&str, Vec<u8>); 5] = [
        ("a truncated varint", vec![0x08, 0xff]),
        ("a length past the end", vec![0x12, 0x40, b'a']),
        ("a truncated nested message", vec![0x1a, 0x10, 0x08]),
        ("an invalid wire type", vec![0x0f]),
        ("field number 0", vec![0x00, 0x01]),
    ];
    let peer_channel = Channel::from_shared(format!("http://{}", b.peer_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    for (what, body) in &malformed {
        for path in [
            "/tcpxd.peer.v1.TcpxdPeer/Handshake",
            "/tcpxd.peer.v1.TcpxdPeer/Challenge",
        ] {
            n += 1;
            let e = raw_unary(peer_channel.clone(), path, body.clone())
                .await
                .expect_err(what);
            assert_eq!(e.code(), Code::Internal, "{path} with {what}: {}", e.message());
            assert!(
                e.message().contains("decode"),
                "{path} with {what}: {}",
                e.message()
            );
        }
        for path in [
            "/tcpxd.v1.Tcpxd/Write",
            "/tcpxd.v1.Tcpxd/RegisterBuffer",
            "/tcpxd.v1.Tcpxd/ConnectPeer",
        ] {
            n += 1;
            let api = daemons::unix_channel(b.daemon.api_socket.clone()).await;
            let e = raw_unary(api, path, body.clone()).await.expect_err(what);
            assert_eq!(e.code(), Code::Internal, "{path} with {what}: {}", e.message());
        }
    }
    // HandshakeRequest's field 2 is the node id: a string must be UTF-8.
    n += 1;
    let e = raw_unary(
        peer_channel.clone(),
        "/tcpxd.peer.v1.TcpxdPeer/Handshake",
        vec![0x12, 0x02, 0xff, 0xfe],
    )
    .await
    .expect_err("a node id that is not UTF-8");
    assert_eq!(e.code(), Code::Internal, "{}", e.message());
    assert_eq!(
        b.client
            .list_buffers(pb::ListBuffersRequest {})
            .await
            .unwrap()
            .into_inner()
            .buffers
            .len(),
        2,
        "a malformed request registered nothing"
    );

    // ---- Control stream openings -----------------------------------------------------------
    let opener = raw.clone();
    let open = |first: Vec<ppb::PeerMessage>| {
        let mut raw: TcpxdPeerClient<Channel> = opener.clone();
        async move { raw.control(tokio_stream::iter(first)).await.map(|_| ()) }
    };
    check(
        &mut n,
        "empty control stream",
        open(vec![]).await,
        Code::InvalidArgument,
        "Hello",
    );
    check(
        &mut n,
        "control opened with an offer",
        open(vec![msg(ppb::peer_message::Body::Accept(ppb::Accept {
            offer_id: 1,
        }))])
        .await,
        Code::InvalidArgument,
        "Hello",
    );
    check(
        &mut n,
        "control opened without a body",
        open(vec![ppb::PeerMessage { body: None }]).await,
        Code::InvalidArgument,
        "Hello",
    );
    for session in [0u64, 1, 12345, u64::MAX] {
        check(
            &mut n,
            &format!("Hello with unknown session {session}"),
            open(vec![msg(ppb::peer_message::Body::Hello(ppb::Hello {
                session_id: session,
                node_id: "host-x".into(),
                proof: Vec::new(),
            }))])
            .await,
            Code::PermissionDenied,
            "session",
        );
    }
    // A real session, but the Hello names another node.
    let resp = raw
        .handshake(ppb::HandshakeRequest {
            node_id: "host-y".into(),
            ..good.clone()
        })
        .await
        .unwrap()
        .into_inner();
    check(
        &mut n,
        "Hello naming another node",
        open(vec![msg(ppb::peer_message::Body::Hello(ppb::Hello {
            session_id: resp.session_id,
            node_id: "host-z".into(),
            proof: Vec::new(),
        }))])
        .await,
        Code::PermissionDenied,
        "another node",
    );
    drop(listen);

    // ---- Control messages --------------------------------------------------------------------
    let mut fake = fake_peer(&b.peer_addr(), "host-p").await;
    let mut next_id = 1000u64;
    let mut offer = |ranges: Vec<ppb::RemoteRange>| {
        next_id += 1;
        ppb::Offer {
            offer_id: next_id,
            read_id: 0,
            chunk_bytes: 512 * 1024,
            first_lane: 0,
            ranges,
            notification: Vec::new(),
            deadline_ms: 10_000,
        }
    };
    let ok_range = || range(dst.id, &key, 0, 4096);
    let mut ctl: Vec<(String, Ctl)> = Vec::new();
    for cb in [0u32, 1, 4095, 4_194_305, 8 << 20, u32::MAX] {
        let mut o = offer(vec![ok_range()]);
        o.chunk_bytes = cb;
        ctl.push((
            format!("chunk_bytes {cb}"),
            Ctl::Offer(o, Code::InvalidArgument, "chunk size", 0),
        ));
    }
    for fl in [2u32, 3, 64, 1000, u32::MAX] {
        let mut o = offer(vec![ok_range()]);
        o.first_lane = fl;
        ctl.push((
            format!("first_lane {fl}"),
            Ctl::Offer(o, Code::InvalidArgument, "first_lane", 0),
        ));
    }
    ctl.push((
        "no ranges".into(),
        Ctl::Offer(offer(vec![]), Code::InvalidArgument, "0 ranges", 0),
    ));
    ctl.push((
        "4097 ranges".into(),
        Ctl::Offer(
            offer(vec![ok_range(); 4097]),
            Code::InvalidArgument,
            "4097 ranges",
            0,
        ),
    ));
    for extra in [1usize, 4096] {
        let mut o = offer(vec![ok_range()]);
        o.notification = vec![0; (1 << 20) + extra];
        ctl.push((
            format!("notification 1 MiB + {extra}"),
            Ctl::Offer(o, Code::InvalidArgument, "notification", 0),
        ));
    }
    for id in [0u64, other.id + 1000, u64::MAX, u64::MAX - 1] {
        ctl.push((
            format!("offer to unknown buffer {id}"),
            Ctl::Offer(
                offer(vec![range(id, &key, 0, 4096)]),
                Code::NotFound,
                "does not exist",
                0,
            ),
        ));
    }
    ctl.push((
        "offer with the other buffer's key".into(),
        Ctl::Offer(
            offer(vec![range(other.id, &key, 0, 4096)]),
            Code::PermissionDenied,
            "wrong access key",
            0,
        ),
    ));
    ctl.push((
        "offer with an all-zero key".into(),
        Ctl::Offer(
            offer(vec![range(dst.id, &[0; 16], 0, 4096)]),
            Code::PermissionDenied,
            "wrong access key",
            0,
        ),
    ));
    for byte in 0..16 {
        let mut k = key.clone();
        k[byte] ^= 0x80;
        ctl.push((
            format!("key with byte {byte} flipped"),
            Ctl::Offer(
                offer(vec![range(dst.id, &k, 0, 4096)]),
                Code::PermissionDenied,
                "wrong access key",
                0,
            ),
        ));
    }
    for len in [0usize, 1, 15, 17, 32, 1024] {
        ctl.push((
            format!("key of {len} bytes"),
            Ctl::Offer(
                offer(vec![range(dst.id, &vec![1; len], 0, 4096)]),
                Code::InvalidArgument,
                "access_key",
                0,
            ),
        ));
    }
    ctl.push((
        "zero-length range".into(),
        Ctl::Offer(
            offer(vec![range(dst.id, &key, 0, 0)]),
            Code::InvalidArgument,
            "length",
            0,
        ),
    ));
    for (off, len) in [
        (u64::MAX, 1),
        (u64::MAX - 1, 2),
        (1, u64::MAX),
        (u64::MAX, u64::MAX),
        (1 << 63, 1 << 63),
    ] {
        ctl.push((
            format!("overflowing range {off}+{len}"),
            Ctl::Offer(
                offer(vec![range(dst.id, &key, off, len)]),
                Code::InvalidArgument,
                "overflows",
                0,
            ),
        ));
    }
    for (off, len) in [
        (SIZE, 1),
        (SIZE - 1, 2),
        (0, SIZE + 1),
        (SIZE - 4095, 4096),
        (1 << 40, 4096),
        (0, 1 << 40),
    ] {
        ctl.push((
            format!("range {off}+{len} past the end"),
            Ctl::Offer(
                offer(vec![range(dst.id, &key, off, len)]),
                Code::InvalidArgument,
                "past the end",
                0,
            ),
        ));
    }
    for at in [1usize, 7, 100, 4095] {
        let mut ranges = vec![ok_range(); at + 1];
        ranges[at] = range(dst.id, &key, SIZE, 1);
        ctl.push((
            format!("bad range at index {at}"),
            Ctl::Offer(offer(ranges), Code::InvalidArgument, "past the end", at as u32),
        ));
    }
    for rid in [1u64, 77, u64::MAX] {
        let mut o = offer(vec![ok_range()]);
        o.read_id = rid;
        ctl.push((
            format!("offer for unknown read {rid}"),
            Ctl::Offer(o, Code::NotFound, "read", 0),
        ));
    }
    // Read requests.
    let pair = |s: ppb::RemoteRange, d: ppb::RemoteRange| ppb::ReadPair {
        source: Some(s),
        dest: Some(d),
    };
    let mut read_id = 5000u64;
    let mut read = |pairs: Vec<ppb::ReadPair>| {
        read_id += 1;
        ppb::ReadRequest {
            read_id,
            pairs,
            deadline_ms: 10_000,
        }
    };
    let far = || range(1, &[9; 16], 0, 4096);
    ctl.push((
        "read of no pairs".into(),
        Ctl::Read(read(vec![]), Code::InvalidArgument, "0 ranges", 0),
    ));
    ctl.push((
        "read of 4097 pairs".into(),
        Ctl::Read(
            read(vec![pair(ok_range(), far()); 4097]),
            Code::InvalidArgument,
            "4097",
            0,
        ),
    ));
    for id in [0u64, other.id + 1000, u64::MAX] {
        ctl.push((
            format!("read of unknown buffer {id}"),
            Ctl::Read(
                read(vec![pair(range(id, &key, 0, 4096), far())]),
                Code::NotFound,
                "does not exist",
                0,
            ),
        ));
    }
    for byte in [0usize, 5, 15] {
        let mut k = key.clone();
        k[byte] ^= 1;
        ctl.push((
            format!("read with key byte {byte} flipped"),
            Ctl::Read(
                read(vec![pair(range(dst.id, &k, 0, 4096), far())]),
                Code::PermissionDenied,
                "wrong access key",
                0,
            ),
        ));
    }
    for (off, len, words) in [
        (u64::MAX, 1, "overflows"),
        (1, u64::MAX, "overflows"),
        (SIZE, 1, "past the end"),
        (0, SIZE + 1, "past the end"),
        (0, 0, "length"),
    ] {
        let mut d = far();
        d.length = len;
        ctl.push((
            format!("read of source {off}+{len}"),
            Ctl::Read(
                read(vec![pair(range(dst.id, &key, off, len), d)]),
                Code::InvalidArgument,
                words,
                0,
            ),
        ));
    }
    for dlen in [1u64, 4095, 4097, u64::MAX] {
        let mut d = far();
        d.length = dlen;
        ctl.push((
            format!("read with destination length {dlen}"),
            Ctl::Read(
                read(vec![pair(ok_range(), d)]),
                Code::InvalidArgument,
                "lengths differ",
                0,
            ),
        ));
    }
    for (s, d, words) in [
        (None, Some(far()), "source: missing"),
        (Some(ok_range()), None, "dest: missing"),
        (
            Some(range(dst.id, &[1; 3], 0, 4096)),
            Some(far()),
            "source.access_key",
        ),
        (
            Some(ok_range()),
            Some(range(1, &[1; 20], 0, 4096)),
            "dest.access_key",
        ),
    ] {
        ctl.push((
            format!("read pair with {words}"),
            Ctl::Read(
                read(vec![ppb::ReadPair { source: s, dest: d }]),
                Code::InvalidArgument,
                words,
                0,
            ),
        ));
    }
    {
        let mut pairs = vec![pair(ok_range(), far()); 10];
        pairs[9] = pair(range(dst.id, &key, SIZE, 4096), far());
        ctl.push((
            "read with a bad pair at index 9".into(),
            Ctl::Read(read(pairs), Code::InvalidArgument, "past the end", 9),
        ));
    }
    // Messages about ids nobody knows.
    use ppb::peer_message::Body;
    for id in [0u64, 1, 999_999, u64::MAX] {
        for (what, body) in [
            ("accept", Body::Accept(ppb::Accept { offer_id: id })),
            (
                "reject",
                Body::Reject(ppb::Reject {
                    offer_id: id,
                    code: 3,
                    message: "x".repeat(1000),
                    range_index: u32::MAX,
                }),
            ),
            ("done", Body::Done(ppb::Done { offer_id: id })),
            (
                "failed",
                Body::Failed(ppb::Failed {
                    offer_id: id,
                    code: i32::MIN,
                    message: String::new(),
                }),
            ),
            (
                "cancel offer",
                Body::CancelOffer(ppb::CancelOffer {
                    offer_id: id,
                    code: 9999,
                    message: "gone".into(),
                }),
            ),
            (
                "read reject",
                Body::ReadReject(ppb::ReadReject {
                    read_id: id,
                    code: -1,
                    message: String::new(),
                    range_index: 7,
                }),
            ),
            ("cancel read", Body::CancelRead(ppb::CancelRead { read_id: id })),
            ("heartbeat", Body::Heartbeat(ppb::Heartbeat { seq: id })),
        ] {
            ctl.push((format!("{what} of unknown id {id}"), Ctl::Ignored(body)));
        }
    }

    for (name, case) in ctl {
        n += 1;
        match case {
            Ctl::Offer(o, code, words, idx) => {
                let id = o.offer_id;
                fake.tx.send(msg(Body::Offer(o))).await.unwrap();
                match fake.next().await {
                    Body::Reject(r) => {
                        assert_eq!(r.offer_id, id, "{name}");
                        assert_eq!(r.code, code as i32, "{name}: {}", r.message);
                        assert!(
                            r.message.contains(words),
                            "{name}: {:?} lacks {words:?}",
                            r.message
                        );
                        assert_eq!(r.range_index, idx, "{name}");
                    }
                    other => panic!("{name}: expected a Reject, got {other:?}"),
                }
            }
            Ctl::Read(r, code, words, idx) => {
                let id = r.read_id;
                fake.tx.send(msg(Body::ReadRequest(r))).await.unwrap();
                match fake.next().await {
                    Body::ReadReject(r) => {
                        assert_eq!(r.read_id, id, "{name}");
                        assert_eq!(r.code, code as i32, "{name}: {}", r.message);
                        assert!(
                            r.message.contains(words),
                            "{name}: {:?} lacks {words:?}",
                            r.message
                        );
                        assert_eq!(r.range_index, idx, "{name}");
                    }
                    other => panic!("{name}: expected a ReadReject, got {other:?}"),
                }
            }
            Ctl::Ignored(body) => fake.tx.send(msg(body)).await.unwrap(),
        }
    }
    // The ignored messages did no harm: the stream answers in order and the peer is not failed.
    let probe = offer(vec![range(dst.id, &key, SIZE, 1)]);
    let probe_id = probe.offer_id;
    fake.tx.send(msg(Body::Offer(probe))).await.unwrap();
    match fake.next().await {
        Body::Reject(r) => assert_eq!(r.offer_id, probe_id),
        other => panic!("after the ignored messages: {other:?}"),
    }
    let peers = b
        .client
        .list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers;
    let p = peers
        .iter()
        .find(|p| p.node_id == "host-p")
        .expect("the fake peer");
    assert_ne!(p.state, pb::PeerState::Failed as i32, "{p:?}");

    // Protocol violations end the pairing (and nothing else).
    n += 1;
    fake.tx.send(ppb::PeerMessage { body: None }).await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match fake.rx.message().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .expect("the daemon closes the stream");
    let _ = end;
    let second = fake_peer(&b.peer_addr(), "host-q").await;
    n += 1;
    second
        .tx
        .send(msg(Body::Hello(ppb::Hello {
            session_id: 1,
            node_id: "host-q".into(),
            proof: Vec::new(),
        })))
        .await
        .unwrap();
    for (node, why) in [("host-p", "without a body"), ("host-q", "second Hello")] {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let peers = b
                .client
                .list_peers(pb::ListPeersRequest {})
                .await
                .unwrap()
                .into_inner()
                .peers;
            let p = peers.iter().find(|p| p.node_id == node).expect("listed");
            if p.state == pb::PeerState::Failed as i32 {
                assert!(p.error.contains(why), "{node}: {}", p.error);
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{node} never failed: {p:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    eprintln!("{n} peer-service cases");
    assert!(n >= 150, "{n} peer-service cases");
    assert_eq!(
        snapshot(&mut [&mut b.client]).await,
        before,
        "a hostile message changed bytes"
    );
    assert_lanes_drain(&mut b.client).await;
    b.stop().await;
    std::fs::remove_file(cfg).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_client_requests_are_refused_and_change_nothing() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("hc-a", |_| {}).await;
    let mut b = daemons::start("hc-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, SIZE, "src").await;
    let dst = host_buffer(&mut b.client, SIZE, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 1).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 2).await;
    let before = snapshot(&mut [&mut a.client, &mut b.client]).await;
    let ac = &mut a.client;
    let mut n = 0usize;

    // Write and read entries: every field at and past its limit.
    let good = || write_entry(&src, 0, &dst, 0, 4096);
    let mut w: Vec<(String, pb::WriteEntry, Code, &str)> = Vec::new();
    for (off, len, words) in [
        (SIZE, 1, "past the end"),
        (SIZE - 1, 2, "past the end"),
        (0, SIZE + 1, "past the end"),
        (u64::MAX, 1, "overflows"),
        (1, u64::MAX, "overflows"),
        (u64::MAX, u64::MAX, "overflows"),
        (1 << 63, 1 << 63, "overflows"),
        (0, 0, "length"),
    ] {
        let mut e = good();
        e.local_offset = off;
        e.length = len;
        // A length past the buffer size trips the remote range check as well, which may come first.
        let local_words = if len > SIZE { "entries[0]" } else { words };
        w.push((
            format!("local {off}+{len}"),
            e,
            Code::InvalidArgument,
            local_words,
        ));
        let mut e = good();
        e.remote_offset = off;
        e.length = len;
        let words = if len == 0 { "length" } else { "remote" };
        w.push((format!("remote {off}+{len}"), e, Code::InvalidArgument, words));
    }
    for id in [0u64, 999, u64::MAX] {
        let mut e = good();
        e.local_buffer_id = id;
        w.push((format!("local buffer {id}"), e, Code::NotFound, "local_buffer_id"));
    }
    // The descriptor's fixed fields (its peer addresses, after '@', are checked elsewhere).
    let desc = dst.descriptor.split('@').next().unwrap().to_string();
    let parts: Vec<&str> = desc.split(':').collect();
    for (name, d) in [
        ("empty", String::new()),
        ("prefix only", "tcpxd1".to_string()),
        ("other prefix", desc.replacen("tcpxd1", "tcpxd2", 1)),
        ("four fields", parts[..4].join(":")),
        ("six fields", format!("{desc}:x")),
        (
            "key too short",
            format!("{}:{}", parts[..4].join(":"), &parts[4][..31]),
        ),
        ("key too long", format!("{desc}0")),
        (
            "key not hex",
            format!("{}:{}", parts[..4].join(":"), "g".repeat(32)),
        ),
        (
            "id not a number",
            format!("tcpxd1:{}:x:{}:{}", parts[1], parts[3], parts[4]),
        ),
        (
            "id past u64",
            format!(
                "tcpxd1:{}:99999999999999999999:{}:{}",
                parts[1], parts[3], parts[4]
            ),
        ),
        (
            "size not a number",
            format!("tcpxd1:{}:{}:-1:{}", parts[1], parts[2], parts[4]),
        ),
        (
            "node id bad",
            format!("tcpxd1:a b:{}:{}:{}", parts[2], parts[3], parts[4]),
        ),
        ("oversized", "x".repeat(100_000)),
    ] {
        let mut e = good();
        e.remote_descriptor = d;
        w.push((
            format!("descriptor {name}"),
            e,
            Code::InvalidArgument,
            "remote_descriptor",
        ));
    }
    for node in ["hc-nobody", "zz"] {
        let mut e = good();
        e.remote_descriptor = format!("tcpxd1:{node}:1:{SIZE}:{}", parts[4]);
        w.push((
            format!("descriptor of unknown node {node}"),
            e,
            Code::NotFound,
            "not a connected peer",
        ));
    }
    for (name, e, code, words) in w {
        check(
            &mut n,
            &format!("write {name}"),
            write(ac, e.clone(), b"").await,
            code,
            words,
        );
        // The same entry as a read (remote and local swapped in meaning).
        let r = pb::ReadEntry {
            remote_descriptor: e.remote_descriptor,
            remote_offset: e.remote_offset,
            local_buffer_id: e.local_buffer_id,
            local_offset: e.local_offset,
            length: e.length,
        };
        n += 1;
        let got = read(ac, r).await;
        let s = got.expect_err(&format!("read {name}"));
        assert_eq!(s.code(), code, "read {name}: {}", s.message());
    }
    // Batches: a bad entry anywhere is named by its index.
    for at in [0usize, 1, 99, 4095] {
        let mut entries = vec![good(); at + 1];
        entries[at].length = 0;
        check(
            &mut n,
            &format!("batch with a bad entry {at}"),
            ac.write_batch(pb::WriteBatchRequest {
                entries,
                ..Default::default()
            })
            .await,
            Code::InvalidArgument,
            &format!("entries[{at}]"),
        );
    }
    for count in [4097usize, 5000] {
        check(
            &mut n,
            &format!("batch of {count}"),
            ac.write_batch(pb::WriteBatchRequest {
                entries: vec![good(); count],
                ..Default::default()
            })
            .await,
            Code::InvalidArgument,
            "entries",
        );
        check(
            &mut n,
            &format!("read batch of {count}"),
            ac.read_batch(pb::ReadBatchRequest {
                entries: vec![read_entry(&dst, 0, &src, 0, 4096); count],
                ..Default::default()
            })
            .await,
            Code::InvalidArgument,
            "entries",
        );
    }
    for extra in [1usize, 1000] {
        check(
            &mut n,
            &format!("notification 1 MiB + {extra}"),
            write(ac, good(), &vec![0; (1 << 20) + extra]).await,
            Code::InvalidArgument,
            "notification",
        );
    }
    for len in [1usize, 63, 65] {
        check(
            &mut n,
            &format!("ready event handle of {len} bytes"),
            ac.write(pb::WriteRequest {
                entry: Some(good()),
                ready_event_ipc_handle: vec![0; len],
                ..Default::default()
            })
            .await,
            Code::InvalidArgument,
            "ready_event_ipc_handle",
        );
    }
    // Oversized request: past the API's 16 MiB limit.
    n += 1;
    let e = ac
        .write(pb::WriteRequest {
            entry: Some(good()),
            notification: vec![0; 17 << 20],
            ..Default::default()
        })
        .await
        .expect_err("oversized");
    assert!(
        matches!(
            e.code(),
            Code::OutOfRange | Code::ResourceExhausted | Code::Internal
        ),
        "{e:?}"
    );

    // Buffers.
    let host = |size| pb::RegisterBufferRequest {
        source: Some(pb::register_buffer_request::Source::Host(pb::HostAllocation {
            size,
        })),
        label: String::new(),
    };
    for size in [0u64] {
        check(
            &mut n,
            "register 0",
            ac.register_buffer(host(size)).await,
            Code::InvalidArgument,
            "size",
        );
    }
    for size in [(64 << 30) + 1, 1 << 50, 1 << 63, u64::MAX] {
        check(
            &mut n,
            &format!("register {size}"),
            ac.register_buffer(host(size)).await,
            Code::InvalidArgument,
            "max_buffer_bytes",
        );
    }
    for len in [0usize, 63, 65, 1000] {
        check(
            &mut n,
            &format!("IPC handle of {len} bytes"),
            ac.register_buffer(pb::RegisterBufferRequest {
                source: Some(pb::register_buffer_request::Source::CudaIpc(pb::CudaIpcImport {
                    device: 0,
                    ipc_handle: vec![0; len],
                    offset: 0,
                    size: 4096,
                })),
                label: String::new(),
            })
            .await,
            Code::InvalidArgument,
            "ipc_handle",
        );
    }
    for id in [0u64, 999, u64::MAX] {
        check(
            &mut n,
            &format!("release {id}"),
            ac.release_buffer(pb::ReleaseBufferRequest { buffer_id: id })
                .await,
            Code::NotFound,
            "buffer_id",
        );
        check(
            &mut n,
            &format!("rekey {id}"),
            ac.rekey_buffer(pb::RekeyBufferRequest { buffer_id: id }).await,
            Code::NotFound,
            "buffer_id",
        );
        check(
            &mut n,
            &format!("describe {id}"),
            ac.describe_buffer(pb::DescribeBufferRequest { buffer_id: id })
                .await,
            Code::NotFound,
            "buffer_id",
        );
        check(
            &mut n,
            &format!("checksum {id}"),
            ac.checksum_buffer(pb::ChecksumBufferRequest {
                buffer_id: id,
                offset: 0,
                length: 1,
            })
            .await,
            Code::NotFound,
            "buffer_id",
        );
        check(
            &mut n,
            &format!("read buffer {id}"),
            ac.read_buffer(pb::ReadBufferRequest {
                buffer_id: id,
                offset: 0,
                length: 1,
            })
            .await,
            Code::NotFound,
            "buffer_id",
        );
    }
    use pb::fill_buffer_request::Pattern;
    for (off, len, words) in [
        (SIZE, 1, "past the end"),
        (SIZE - 1, 2, "past the end"),
        (u64::MAX, 2, "overflows"),
        (1, u64::MAX, "overflows"),
    ] {
        check(
            &mut n,
            &format!("fill {off}+{len}"),
            ac.fill_buffer(pb::FillBufferRequest {
                buffer_id: src.id,
                offset: off,
                length: len,
                pattern: Some(Pattern::Byte(1)),
            })
            .await,
            Code::InvalidArgument,
            words,
        );
        check(
            &mut n,
            &format!("read buffer {off}+{len}"),
            ac.read_buffer(pb::ReadBufferRequest {
                buffer_id: src.id,
                offset: off,
                length: len,
            })
            .await,
            Code::InvalidArgument,
            "",
        );
    }
    for byte in [256u32, 1000, u32::MAX] {
        check(
            &mut n,
            &format!("fill byte {byte}"),
            ac.fill_buffer(pb::FillBufferRequest {
                buffer_id: src.id,
                offset: 0,
                length: 1,
                pattern: Some(Pattern::Byte(byte)),
            })
            .await,
            Code::InvalidArgument,
            "byte",
        );
    }
    for len in [MIB + 1, 2 * MIB, u64::MAX] {
        check(
            &mut n,
            &format!("read buffer of {len} bytes"),
            ac.read_buffer(pb::ReadBufferRequest {
                buffer_id: src.id,
                offset: 0,
                length: len,
            })
            .await,
            Code::InvalidArgument,
            "length",
        );
    }
    for off in [SIZE + 1, u64::MAX] {
        check(
            &mut n,
            &format!("checksum from {off}"),
            ac.checksum_buffer(pb::ChecksumBufferRequest {
                buffer_id: src.id,
                offset: off,
                length: 0,
            })
            .await,
            Code::InvalidArgument,
            "offset",
        );
    }
    // Transfers and peers.
    for id in [0u64, 1 << 40, u64::MAX] {
        check(
            &mut n,
            &format!("watch {id}"),
            ac.watch(pb::WatchRequest { transfer_id: id }).await,
            Code::NotFound,
            "transfer_id",
        );
        check(
            &mut n,
            &format!("wait {id}"),
            ac.wait_transfer(pb::WaitTransferRequest { transfer_id: id })
                .await,
            Code::NotFound,
            "transfer_id",
        );
        check(
            &mut n,
            &format!("cancel {id}"),
            ac.cancel(pb::CancelRequest { transfer_id: id }).await,
            Code::NotFound,
            "transfer_id",
        );
    }
    for addr in ["", " ", "\t\n"] {
        check(
            &mut n,
            &format!("connect {addr:?}"),
            ac.connect_peer(pb::ConnectPeerRequest { address: addr.into() })
                .await,
            Code::InvalidArgument,
            "address",
        );
    }
    for addr in ["127.0.0.1:1", "127.0.0.1:9"] {
        check(
            &mut n,
            &format!("connect {addr}"),
            ac.connect_peer(pb::ConnectPeerRequest { address: addr.into() })
                .await,
            Code::Unavailable,
            addr,
        );
    }
    for addr in ["a b:1", "http://[::1", "127.0.0.1:99999"] {
        n += 1;
        let e = ac
            .connect_peer(pb::ConnectPeerRequest { address: addr.into() })
            .await
            .expect_err(addr);
        assert!(
            matches!(e.code(), Code::InvalidArgument | Code::Unavailable),
            "connect {addr}: {e:?}"
        );
        assert!(e.message().contains("address"), "connect {addr}: {}", e.message());
    }

    eprintln!("{n} client cases");
    assert!(n >= 130, "{n} client cases");
    assert_eq!(
        snapshot(&mut [&mut a.client, &mut b.client]).await,
        before,
        "a refused request changed bytes"
    );
    assert_lanes_drain(&mut a.client).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    a.stop().await;
    b.stop().await;
}
