//! Hostile peers: handshakes, control-stream openings and every control message from a fake peer.

use super::*;

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
    // Block lists for the block offers and reads below: 16 blocks of 4 KiB, and three of 4096,
    // 1000 and 4096 bytes.
    let blk = host_buffer(&mut b.client, MIB, "blk").await;
    fill_seed(&mut b.client, blk.id, 0, 0, 3).await;
    let mut register = async |layout| {
        b.client
            .register_blocks(pb::RegisterBlocksRequest {
                reattach_id: Default::default(),
                buffer_id: blk.id,
                layout: Some(layout),
            })
            .await
            .unwrap()
            .into_inner()
            .id
    };
    use pb::register_blocks_request::Layout as L;
    let uniform = register(L::Strided(pb::StridedBlocks {
        first: 0,
        stride: 8192,
        length: 4096,
        count: 16,
    }))
    .await;
    let mixed = register(L::Explicit(pb::ExplicitBlocks {
        offsets: [0u64, 100_000, 200_000]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        lengths: [4096u32, 1000, 4096]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
    }))
    .await;
    let blk_key = key_of(&blk);
    let before = snapshot(&mut [&mut b.client]).await;
    let key = key_of(&dst);
    let mut n = 0usize;

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
    // The oversized stream may take its connection down with it (the server resets what the
    // client had not finished sending): the next case starts on a fresh one.
    let mut raw = TcpxdPeerClient::connect(format!("http://{}", b.peer_addr()))
        .await
        .unwrap();
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
            first_lane: None,
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

    // ---- Control messages --------------------------------------------------------------------
    let mut fake = fake_peer(&b.peer_addr(), "host-p").await;
    // Offers name a rendezvous lane of the pairing: the layout's first, or on a routed pairing
    // (the daemon on the CUDA stand-in) the first of the (host, host) group's.
    let lanes = fake.lanes.clone();
    let mut next_id = 1000u64;
    let mut offer = |ranges: Vec<ppb::RemoteRange>| {
        next_id += 1;
        ppb::Offer {
            offer_id: next_id,
            read_id: 0,
            chunk_bytes: 512 * 1024,
            first_lane: lanes.offer_lane,
            ranges,
            notification: Vec::new(),
            deadline_ms: 10_000,
            coalesced: false,
            blocks: None,
            transfer_id: 0,
            ..Default::default()
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
    // Past the daemon's lanes (2 layout lanes: from 2 on), and on a routed pairing also eager
    // lanes: no rendezvous lane of a group.
    for fl in lanes.bad_offer_lanes() {
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
        "65537 ranges".into(),
        Ctl::Offer(
            offer(vec![ok_range(); 65_537]),
            Code::InvalidArgument,
            "65537 ranges",
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
            blocks: None,
            ..Default::default()
        }
    };
    let far = || range(1, &[9; 16], 0, 4096);
    ctl.push((
        "read of no pairs".into(),
        Ctl::Read(read(vec![]), Code::InvalidArgument, "0 ranges", 0),
    ));
    ctl.push((
        "read of 65537 pairs".into(),
        Ctl::Read(
            read(vec![pair(ok_range(), far()); 65_537]),
            Code::InvalidArgument,
            "65537",
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
    // Block offers and block reads (docs/BLOCKS.md): refused naming the field, nothing posted.
    let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let header = |list_id: u64, indices: Vec<u8>| ppb::BlockHeader {
        list_id,
        access_key: key.clone(),
        encoding: ppb::IndexEncoding::U32Le as i32,
        indices,
        uniform_length: 4096,
        lengths: Vec::new(),
        total: 4096,
    };
    let good_header = || header(1, le(&[0]));
    let mut block_cases: Vec<(String, ppb::BlockHeader, Code, &'static str)> = vec![
        (
            "block offer to an unknown list".into(),
            header(424_242, le(&[0])),
            Code::NotFound,
            "blocks.list_id: list 424242 does not exist",
        ),
        (
            "block offer with a 3-byte key".into(),
            ppb::BlockHeader {
                access_key: vec![1; 3],
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.access_key: 3 bytes, expected 16",
        ),
        (
            "block offer with 5 index bytes".into(),
            header(1, vec![0; 5]),
            Code::InvalidArgument,
            "blocks.indices: 5 bytes are not a whole number of 4-byte indices",
        ),
        (
            "block offer with no indices".into(),
            header(1, Vec::new()),
            Code::InvalidArgument,
            "blocks.indices: at least one block is required",
        ),
        (
            "block offer with index encoding 7".into(),
            ppb::BlockHeader {
                encoding: 7,
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.indices: unknown index encoding 7",
        ),
        (
            "block offer with an empty index range".into(),
            ppb::BlockHeader {
                encoding: ppb::IndexEncoding::Ranges as i32,
                indices: le(&[3, 0]),
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.indices: range 0 (3, 0) is empty",
        ),
        (
            "block offer of more than MAX_TRANSFER_BLOCKS".into(),
            ppb::BlockHeader {
                encoding: ppb::IndexEncoding::Ranges as i32,
                indices: le(&[0, 4_194_305]),
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.indices: 4194305 blocks exceed the limit of 4194304",
        ),
        (
            "block offer with neither lengths".into(),
            ppb::BlockHeader {
                uniform_length: 0,
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.uniform_length: 0 and no lengths",
        ),
        (
            "block offer with both lengths".into(),
            ppb::BlockHeader {
                lengths: le(&[4096]),
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.lengths: given with uniform_length 4096",
        ),
        (
            "block offer with 6 bytes of lengths".into(),
            ppb::BlockHeader {
                uniform_length: 0,
                lengths: vec![0; 6],
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.lengths: 6 bytes are not a whole number of u32 lengths",
        ),
    ];
    // Against real lists.
    let on_list = |list: u64, idx: &[u32], uniform_length: u32, total: u64| ppb::BlockHeader {
        list_id: list,
        access_key: blk_key.clone(),
        encoding: ppb::IndexEncoding::U32Le as i32,
        indices: le(idx),
        uniform_length,
        lengths: Vec::new(),
        total,
    };
    block_cases.extend([
        (
            "block offer past the list".to_string(),
            on_list(uniform, &[3, 16], 4096, 8192),
            Code::InvalidArgument,
            "blocks.indices[1]: block 16 is past the list's 16 blocks",
        ),
        (
            "block offer naming a block twice".into(),
            on_list(uniform, &[5, 7, 5], 4096, 3 * 4096),
            Code::InvalidArgument,
            "blocks.indices[2]: block 5 is already named at 0",
        ),
        (
            "block offer whose lengths disagree with the list".into(),
            on_list(mixed, &[0, 1, 2], 4096, 3 * 4096),
            Code::InvalidArgument,
            "blocks.indices[1]: block 1 is 1000 bytes, but its partner is 4096 bytes",
        ),
        (
            "block offer with more lengths than indices".into(),
            ppb::BlockHeader {
                uniform_length: 0,
                lengths: le(&[4096, 4096]),
                ..on_list(uniform, &[1], 0, 4096)
            },
            Code::InvalidArgument,
            "blocks.indices: 1 blocks, but lengths names 2",
        ),
        (
            "block offer whose total disagrees".into(),
            on_list(uniform, &[1, 2], 4096, 8193),
            Code::InvalidArgument,
            "blocks.total: the header says 8193 bytes, but its 2 blocks hold 8192",
        ),
        (
            "block offer with another buffer's key".into(),
            ppb::BlockHeader {
                access_key: key.clone(),
                ..on_list(uniform, &[1], 4096, 4096)
            },
            Code::PermissionDenied,
            "blocks.access_key: wrong access key for list",
        ),
    ]);
    for (name, h, code, words) in block_cases.drain(..) {
        let mut o = offer(Vec::new());
        o.blocks = Some(h);
        ctl.push((name, Ctl::Offer(o, code, words, 0)));
    }
    {
        let mut o = offer(vec![ok_range()]);
        o.blocks = Some(good_header());
        ctl.push((
            "block offer with ranges too".into(),
            Ctl::Offer(
                o,
                Code::InvalidArgument,
                "ranges: a block offer carries its destinations in `blocks`",
                0,
            ),
        ));
        let mut o = offer(vec![
            ok_range(),
            ok_range(),
            range(other.id, &key_of(&other), 0, 4096),
        ]);
        o.coalesced = true;
        ctl.push((
            "coalesced offer naming two buffers".into(),
            Ctl::Offer(
                o,
                Code::InvalidArgument,
                "ranges[2].buffer_id: a coalesced offer's ranges must lie in one buffer",
                2,
            ),
        ));
    }
    let read_blocks = |source_list: u64, source_indices: Vec<u8>| ppb::ReadBlocks {
        source_list,
        source_key: key.clone(),
        source_encoding: ppb::IndexEncoding::U32Le as i32,
        source_indices,
        dest: Some(ppb::BlockHeader {
            access_key: vec![9; 16],
            ..good_header()
        }),
    };
    let read_cases: Vec<(String, ppb::ReadBlocks, Code, &'static str)> = vec![
        (
            "block read of an unknown list".into(),
            read_blocks(424_242, le(&[0])),
            Code::NotFound,
            "blocks.source_list: list 424242 does not exist",
        ),
        (
            "block read with a 17-byte key".into(),
            ppb::ReadBlocks {
                source_key: vec![1; 17],
                ..read_blocks(1, le(&[0]))
            },
            Code::InvalidArgument,
            "blocks.source_key: 17 bytes, expected 16",
        ),
        (
            "block read of more than MAX_TRANSFER_BLOCKS".into(),
            ppb::ReadBlocks {
                source_encoding: ppb::IndexEncoding::Ranges as i32,
                ..read_blocks(1, le(&[0, 4_194_305]))
            },
            Code::InvalidArgument,
            "blocks.source_indices: 4194305 blocks exceed the limit of 4194304",
        ),
        (
            "block read without a destination".into(),
            ppb::ReadBlocks {
                dest: None,
                ..read_blocks(1, le(&[0]))
            },
            Code::InvalidArgument,
            "blocks.dest: missing",
        ),
        (
            "block read with a destination of 2 index bytes".into(),
            ppb::ReadBlocks {
                dest: Some(header(1, vec![0; 2])),
                ..read_blocks(1, le(&[0]))
            },
            Code::InvalidArgument,
            "blocks.dest.indices: 2 bytes are not a whole number",
        ),
    ];
    let mut read_cases = read_cases;
    read_cases.extend([
        (
            "block read past the holder's list".to_string(),
            ppb::ReadBlocks {
                source_key: blk_key.clone(),
                ..read_blocks(uniform, le(&[16]))
            },
            Code::InvalidArgument,
            "blocks.source_indices[0]: block 16 is past the list's 16 blocks",
        ),
        (
            "block read whose lengths disagree with the holder's list".into(),
            ppb::ReadBlocks {
                source_key: blk_key.clone(),
                ..read_blocks(mixed, le(&[1]))
            },
            Code::InvalidArgument,
            "blocks.source_indices[0]: block 1 is 1000 bytes, but its partner is 4096 bytes",
        ),
        (
            "block read with another buffer's key".into(),
            read_blocks(uniform, le(&[0])),
            Code::PermissionDenied,
            "blocks.source_key: wrong access key for list",
        ),
    ]);
    for (name, rb, code, words) in read_cases {
        let mut r = read(Vec::new());
        r.blocks = Some(rb);
        ctl.push((name, Ctl::Read(r, code, words, 0)));
    }
    {
        let mut r = read(vec![pair(ok_range(), far())]);
        r.blocks = Some(read_blocks(1, le(&[0])));
        ctl.push((
            "block read with pairs too".into(),
            Ctl::Read(
                r,
                Code::InvalidArgument,
                "pairs: a block read request carries its ranges in `blocks`",
                0,
            ),
        ));
    }
    // Messages about ids nobody knows.
    use ppb::peer_message::Body;
    for id in [0u64, 1, 999_999, u64::MAX] {
        for (what, body) in [
            (
                "accept",
                Body::Accept(ppb::Accept {
                    offer_id: id,
                    first_lane: None,
                }),
            ),
            (
                "reject",
                Body::Reject(ppb::Reject {
                    offer_id: id,
                    code: 3,
                    message: "x".repeat(1000),
                    range_index: u32::MAX,
                }),
            ),
            (
                "done",
                Body::Done(ppb::Done {
                    offer_id: id,
                    ..Default::default()
                }),
            ),
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
    // A rekey makes the list's tokens stale: the old key is refused for block offers and reads.
    b.client
        .rekey_buffer(pb::RekeyBufferRequest { buffer_id: blk.id })
        .await
        .unwrap();
    n += 1;
    let mut o = offer(Vec::new());
    o.blocks = Some(on_list(uniform, &[1], 4096, 4096));
    let id = o.offer_id;
    fake.tx.send(msg(Body::Offer(o))).await.unwrap();
    match fake.next().await {
        Body::Reject(r) => {
            assert_eq!(
                (r.offer_id, r.code),
                (id, Code::PermissionDenied as i32),
                "{}",
                r.message
            );
            assert!(
                r.message.starts_with("blocks.access_key: wrong access key"),
                "{}",
                r.message
            );
        }
        other => panic!("stale block offer: {other:?}"),
    }
    n += 1;
    let mut r = read(Vec::new());
    r.blocks = Some(ppb::ReadBlocks {
        source_key: blk_key.clone(),
        ..read_blocks(uniform, le(&[0]))
    });
    let id = r.read_id;
    fake.tx.send(msg(Body::ReadRequest(r))).await.unwrap();
    match fake.next().await {
        Body::ReadReject(r) => {
            assert_eq!(
                (r.read_id, r.code),
                (id, Code::PermissionDenied as i32),
                "{}",
                r.message
            );
            assert!(
                r.message.starts_with("blocks.source_key: wrong access key"),
                "{}",
                r.message
            );
        }
        other => panic!("stale block read: {other:?}"),
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
