//! Hostile clients: every client API call at and past its limits.

use super::*;

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
    for count in [65_537usize, 70_000] {
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
    // Oversized request: past the API's 64 MiB limit.
    n += 1;
    let e = ac
        .write(pb::WriteRequest {
            entry: Some(good()),
            notification: vec![0; 65 << 20],
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
        reattach_id: Default::default(),
        reattach_key: Default::default(),
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
                reattach_id: Default::default(),
                reattach_key: Default::default(),
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
