//! Hostile handshakes (every field at and past its limit, an oversized one, a challenge without
//! a secret), truncated and malformed protobuf on both services, and control streams opened
//! without a valid Hello.

use super::*;

/// The handshake, malformed-request and control-stream-opening cases against `b`, counted in `n`.
pub(super) async fn handshake_and_openings(b: &mut TestDaemon, n: &mut usize) {
    // ---- Handshake --------------------------------------------------------------------------
    let lane = |l: u32, h: Vec<u8>| ppb::LaneHandle {
        lane: l,
        device: 0,
        handle: h,
    };
    // Peer protocol 6: a lane's handle comes on the control stream at its first use.
    let good_handle = Vec::new();
    let good = ppb::HandshakeRequest {
        protocol_version: tcpxd::peers::PROTOCOL_VERSION,
        node_id: "host-x".into(),
        lanes: vec![lane(0, good_handle.clone())],
        ..Default::default()
    };
    let mut cases: Vec<(String, ppb::HandshakeRequest, Code, &str)> = Vec::new();
    // Every version but this daemon's (a protocol-4 daemon predates `Notify`).
    for v in [0, 1, 2, 3, 4, 5, 6, 7, u32::MAX]
        .into_iter()
        .filter(|&v| v != tcpxd::peers::PROTOCOL_VERSION)
    {
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
    for len in [1usize, 64, 128, 129, 4096] {
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
        check(n, &name, raw.handshake(req).await, code, words);
    }
    // Oversized: past the peer service's 8 MiB message limit.
    let huge = ppb::HandshakeRequest {
        node_id: "x".repeat(9 << 20),
        ..good.clone()
    };
    *n += 1;
    let e = raw.handshake(huge).await.expect_err("an oversized handshake");
    assert!(
        matches!(
            e.code(),
            Code::OutOfRange | Code::ResourceExhausted | Code::Internal
        ),
        "oversized handshake: {e:?}"
    );
    // The oversized stream may take its connection down with it (the server resets what the
    // client had not finished sending): the next case starts on a fresh one.
    let mut raw = TcpxdPeerClient::connect(format!("http://{}", b.peer_addr()))
        .await
        .unwrap();
    check(
        n,
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
            *n += 1;
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
            *n += 1;
            let api = daemons::unix_channel(b.daemon.api_socket.clone()).await;
            let e = raw_unary(api, path, body.clone()).await.expect_err(what);
            assert_eq!(e.code(), Code::Internal, "{path} with {what}: {}", e.message());
        }
    }
    // HandshakeRequest's field 2 is the node id: a string must be UTF-8.
    *n += 1;
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
        3,
        "a malformed request registered nothing (dst, other, blk)"
    );

    // ---- Control stream openings -----------------------------------------------------------
    let opener = raw.clone();
    let open = |first: Vec<ppb::PeerMessage>| {
        let mut raw: TcpxdPeerClient<Channel> = opener.clone();
        async move { raw.control(tokio_stream::iter(first)).await.map(|_| ()) }
    };
    check(
        n,
        "empty control stream",
        open(vec![]).await,
        Code::InvalidArgument,
        "Hello",
    );
    check(
        n,
        "control opened with an offer",
        open(vec![msg(ppb::peer_message::Body::Accept(ppb::Accept {
            offer_id: 1,
            first_lane: None,
        }))])
        .await,
        Code::InvalidArgument,
        "Hello",
    );
    check(
        n,
        "control opened without a body",
        open(vec![ppb::PeerMessage { body: None }]).await,
        Code::InvalidArgument,
        "Hello",
    );
    for session in [0u64, 1, 12345, u64::MAX] {
        check(
            n,
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
        n,
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
}
