//! Bad input: every case gets the exact status code, a message naming the field, and changes no
//! byte of any buffer on either node.

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;
use tonic::Code;

const MIB: u64 = 1 << 20;

fn expect_err<T: std::fmt::Debug>(what: &str, r: Result<T, tonic::Status>, code: Code, words: &str) {
    match r {
        Ok(v) => panic!("{what}: expected {code:?}, got success {v:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{what}: {}", s.message());
            assert!(
                s.message().contains(words),
                "{what}: {:?} should mention {words:?}",
                s.message()
            );
        }
    }
}

/// Checksums of every buffer on both nodes.
async fn snapshot(a: &mut Client, b: &mut Client) -> Vec<u32> {
    let mut out = Vec::new();
    for c in [a, b] {
        let list = c
            .list_buffers(pb::ListBuffersRequest {})
            .await
            .unwrap()
            .into_inner();
        for buf in list.buffers {
            out.push(crc(c, buf.id, 0, 0).await);
        }
    }
    out
}

/// A transfer the local daemon accepted must end with `code` (the remote refused it).
async fn expect_refused(
    what: &str,
    c: &mut Client,
    started: Result<u64, tonic::Status>,
    code: Code,
    words: &str,
) {
    let id = started.unwrap_or_else(|s| panic!("{what}: refused locally: {s}"));
    let e = wait(c, id).await;
    assert_eq!(e.status_code, code as i32, "{what}: {}", e.status_message);
    assert!(
        e.status_message.contains(words),
        "{what}: {:?} should mention {words:?}",
        e.status_message
    );
    assert_eq!(e.entries.len(), 1);
    assert_eq!(e.entries[0].code, code as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_precisely_and_changes_nothing() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("bad-a", |_| {}).await;
    let mut b = daemons::start("bad-b", |_| {}).await;
    let mut c = daemons::start("bad-c", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, 4 * MIB, "src").await;
    let dst = host_buffer(&mut b.client, 4 * MIB, "dst").await;
    let far = host_buffer(&mut c.client, 4 * MIB, "far").await;
    fill_seed(&mut a.client, src.id, 0, 0, 1).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 2).await;
    let before = snapshot(&mut a.client, &mut b.client).await;
    let a_addr = a.peer_addr();
    let ac = &mut a.client;
    let good = |len| write_entry(&src, 0, &dst, 0, len);

    // ---- WRITE, refused locally ----------------------------------------------------------
    let mut e = good(10);
    e.local_buffer_id = 999;
    expect_err(
        "unknown local buffer",
        write(ac, e, b"").await,
        Code::NotFound,
        "entries[0].local_buffer_id: buffer 999 does not exist",
    );
    let mut e = good(10);
    e.local_offset = 4 * MIB - 5;
    expect_err(
        "local range past the end",
        write(ac, e, b"").await,
        Code::InvalidArgument,
        "entries[0].local_offset: 10 bytes from offset 4194299",
    );
    expect_err(
        "zero length",
        write(ac, good(0), b"").await,
        Code::InvalidArgument,
        "entries[0].length",
    );
    let mut e = good(10);
    e.local_offset = u64::MAX - 3;
    expect_err(
        "local offset overflow",
        write(ac, e, b"").await,
        Code::InvalidArgument,
        "overflows 64 bits",
    );
    let mut e = good(10);
    e.remote_offset = u64::MAX - 3;
    expect_err(
        "remote offset overflow",
        write(ac, e, b"").await,
        Code::InvalidArgument,
        "entries[0].remote_offset",
    );
    let mut e = good(10);
    e.remote_offset = 4 * MIB - 5;
    expect_err(
        "remote range past the end",
        write(ac, e, b"").await,
        Code::InvalidArgument,
        "entries[0].remote_offset: 10 bytes from offset 4194299 end at 4194309, past the end of the remote buffer (4194304 bytes; 5 fit there)",
    );
    // The field at fault: the length when it alone is more than the buffer holds, else the offset.
    expect_err(
        "remote length past the end",
        write(ac, good(4 * MIB + 1), b"").await,
        Code::InvalidArgument,
        "entries[0].length: 4194305 bytes is more than the remote buffer holds (4194304 bytes)",
    );
    let mut e = good(10);
    e.remote_offset = 4 * MIB;
    expect_err(
        "remote offset past the end",
        write(ac, e, b"").await,
        Code::InvalidArgument,
        "entries[0].remote_offset: 4194304 is past the end of the remote buffer",
    );
    let mut e = good(10);
    e.remote_descriptor = "tcpxd1:bad-b:1:4096:nothex".into();
    expect_err(
        "malformed descriptor",
        write(ac, e, b"").await,
        Code::InvalidArgument,
        "malformed descriptor",
    );
    let mut e = good(10);
    e.remote_descriptor = "hello".into();
    expect_err(
        "garbage descriptor",
        write(ac, e, b"").await,
        Code::InvalidArgument,
        "entries[0].remote_descriptor",
    );
    let mut e = good(10);
    // Without its peer addresses (an older daemon's descriptor): nothing to connect to.
    e.remote_descriptor = far.descriptor.split('@').next().unwrap().to_string();
    expect_err(
        "descriptor of an unconnected node",
        write(ac, e, b"").await,
        Code::NotFound,
        "not a connected peer",
    );
    // A descriptor of this node is a same-node copy (daemon_same_node), not an error.
    expect_err(
        "notification over 1 MiB",
        write(ac, good(10), &vec![0u8; (MIB + 1) as usize]).await,
        Code::InvalidArgument,
        "notification",
    );
    expect_err(
        "Write without an entry",
        ac.write(pb::WriteRequest::default()).await,
        Code::InvalidArgument,
        "entry",
    );
    expect_err(
        "empty batch",
        ac.write_batch(pb::WriteBatchRequest::default()).await,
        Code::InvalidArgument,
        "entries",
    );
    expect_err(
        "batch over the entry limit",
        ac.write_batch(pb::WriteBatchRequest {
            entries: vec![good(1); 65_537],
            notification: vec![],
            timeout_ms: 0,
            ready_event_ipc_handle: Vec::new(),
            wait: false,
            ranges: None,
        })
        .await,
        Code::InvalidArgument,
        "65537 entries",
    );

    // ---- Packed ranges of one buffer pair (BatchRanges), refused locally --------------------
    let le = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let ranges = |lo: &[u64], ro: &[u64], len: u64| pb::BatchRanges {
        local_buffer_id: src.id,
        remote_descriptor: dst.descriptor.clone(),
        local_offsets: le(lo),
        remote_offsets: le(ro),
        lengths: Vec::new(),
        uniform_length: len,
    };
    let packed = |r: pb::BatchRanges| pb::WriteBatchRequest {
        ranges: Some(r),
        ..Default::default()
    };
    let cases: Vec<(&str, pb::WriteBatchRequest, Code, &str)> = vec![
        (
            "entries and ranges",
            pb::WriteBatchRequest {
                entries: vec![good(1)],
                ..packed(ranges(&[0], &[0], 1))
            },
            Code::InvalidArgument,
            "ranges: give entries or ranges, not both",
        ),
        (
            "ranges of no entry",
            packed(ranges(&[], &[], 1)),
            Code::InvalidArgument,
            "ranges.local_offsets: at least one entry",
        ),
        (
            "offsets not whole",
            packed(pb::BatchRanges {
                local_offsets: vec![0; 12],
                ..ranges(&[0], &[0], 1)
            }),
            Code::InvalidArgument,
            "ranges.local_offsets: 12 bytes",
        ),
        (
            "offset counts differ",
            packed(ranges(&[0, 8], &[0], 4)),
            Code::InvalidArgument,
            "ranges.remote_offsets: 1 offsets, but local_offsets has 2",
        ),
        (
            "no length",
            packed(ranges(&[0], &[0], 0)),
            Code::InvalidArgument,
            "ranges.uniform_length",
        ),
        (
            "ranges over the entry limit",
            packed(ranges(&vec![0; 65_537], &vec![0; 65_537], 1)),
            Code::InvalidArgument,
            "ranges.local_offsets: 65537 entries exceed the limit of 65536",
        ),
        (
            "ranges of an unknown local buffer",
            packed(pb::BatchRanges {
                local_buffer_id: 999,
                ..ranges(&[0], &[0], 1)
            }),
            Code::NotFound,
            "ranges.local_buffer_id: buffer 999",
        ),
        (
            "ranges of a garbage descriptor",
            packed(pb::BatchRanges {
                remote_descriptor: "nope".into(),
                ..ranges(&[0], &[0], 1)
            }),
            Code::InvalidArgument,
            "ranges.remote_descriptor",
        ),
        (
            "ranges past the remote buffer",
            packed(ranges(&[0, 4096], &[0, 4 * MIB - 100], 4096)),
            Code::InvalidArgument,
            "ranges.remote_offsets[1]",
        ),
        (
            "ranges past the local buffer",
            packed(ranges(&[0, 4 * MIB], &[0, 4096], 4096)),
            Code::InvalidArgument,
            "ranges.local_offsets[1]: 4194304 is past the end of the local buffer",
        ),
        (
            "ranges of a zero length",
            packed(pb::BatchRanges {
                lengths: le(&[4, 0]),
                ..ranges(&[0, 8], &[0, 8], 0)
            }),
            Code::InvalidArgument,
            "ranges.lengths[1]: must be at least 1 byte",
        ),
    ];
    for (what, req, code, words) in cases {
        expect_err(what, ac.write_batch(req).await, code, words);
    }
    expect_err(
        "read ranges past the remote buffer",
        ac.read_batch(pb::ReadBatchRequest {
            ranges: Some(ranges(&[0], &[4 * MIB], 1)),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "ranges.remote_offsets[0]",
    );

    // ---- WRITE, refused by the remote (the offer is rejected, nothing posted) --------------
    let forged_key = {
        let bare = dst.descriptor.split('@').next().unwrap();
        let mut parts: Vec<String> = bare.split(':').map(String::from).collect();
        parts[4] = "00".repeat(16);
        parts.join(":")
    };
    let mut e = good(4096);
    e.remote_descriptor = forged_key.clone();
    let r = write(ac, e, b"x").await;
    expect_refused(
        "forged access key",
        ac,
        r,
        Code::PermissionDenied,
        "wrong access key",
    )
    .await;
    let forged_id = dst
        .descriptor
        .replacen(&format!(":{}:", dst.id), &format!(":{}:", dst.id + 100), 1);
    let mut e = good(4096);
    e.remote_descriptor = forged_id;
    let r = write(ac, e, b"").await;
    expect_refused("forged buffer id", ac, r, Code::NotFound, "does not exist").await;
    let forged_size = dst
        .descriptor
        .replacen(&format!(":{}:", 4 * MIB), &format!(":{}:", 64 * MIB), 1);
    let mut e = good(4096);
    e.remote_descriptor = forged_size;
    e.remote_offset = 8 * MIB;
    let r = write(ac, e, b"").await;
    expect_refused("forged size", ac, r, Code::InvalidArgument, "past the end").await;

    // ---- READ ----------------------------------------------------------------------------
    let mut e = read_entry(&dst, 0, &src, 0, 10);
    e.local_buffer_id = 999;
    expect_err(
        "read into an unknown buffer",
        read(ac, e).await,
        Code::NotFound,
        "entries[0].local_buffer_id: buffer 999 does not exist",
    );
    expect_err(
        "read of zero bytes",
        read(ac, read_entry(&dst, 0, &src, 0, 0)).await,
        Code::InvalidArgument,
        "length",
    );
    let mut e = read_entry(&dst, 0, &src, 0, 4096);
    e.remote_descriptor = forged_key.clone();
    let r = read(ac, e).await;
    expect_refused(
        "read with a forged key",
        ac,
        r,
        Code::PermissionDenied,
        "wrong access key",
    )
    .await;

    // ---- buffers ----------------------------------------------------------------------------
    let host = |size| pb::RegisterBufferRequest {
        reattach_id: Default::default(),
        reattach_key: Default::default(),
        source: Some(pb::register_buffer_request::Source::Host(pb::HostAllocation {
            size,
        })),
        label: String::new(),
    };
    expect_err(
        "zero-size buffer",
        ac.register_buffer(host(0)).await,
        Code::InvalidArgument,
        "host.size",
    );
    expect_err(
        "huge buffer",
        ac.register_buffer(host(1 << 50)).await,
        Code::InvalidArgument,
        "max_buffer_bytes",
    );
    expect_err(
        "no source",
        ac.register_buffer(pb::RegisterBufferRequest::default()).await,
        Code::InvalidArgument,
        "source",
    );
    if !tcpxd::gpu::driver_available() {
        expect_err(
            "CUDA on a machine without a GPU",
            ac.register_buffer(pb::RegisterBufferRequest {
                reattach_id: Default::default(),
                reattach_key: Default::default(),
                source: Some(pb::register_buffer_request::Source::Cuda(pb::CudaAllocation {
                    device: 0,
                    size: 4096,
                })),
                label: String::new(),
            })
            .await,
            Code::FailedPrecondition,
            "no CUDA driver",
        );
    }
    expect_err(
        "IPC handle of the wrong length",
        ac.register_buffer(pb::RegisterBufferRequest {
            reattach_id: Default::default(),
            reattach_key: Default::default(),
            source: Some(pb::register_buffer_request::Source::CudaIpc(pb::CudaIpcImport {
                device: 0,
                ipc_handle: vec![0; 10],
                offset: 0,
                size: 4096,
            })),
            label: String::new(),
        })
        .await,
        Code::InvalidArgument,
        "cuda_ipc.ipc_handle",
    );
    expect_err(
        "duplicate registration of a label",
        ac.register_buffer(pb::RegisterBufferRequest {
            reattach_id: Default::default(),
            reattach_key: Default::default(),
            source: Some(pb::register_buffer_request::Source::Host(pb::HostAllocation {
                size: 4096,
            })),
            label: "src".into(),
        })
        .await,
        Code::AlreadyExists,
        "label",
    );
    expect_err(
        "release an unknown buffer",
        ac.release_buffer(pb::ReleaseBufferRequest { buffer_id: 999 })
            .await,
        Code::NotFound,
        "buffer_id",
    );
    let fill = |id, offset, length, pattern| pb::FillBufferRequest {
        buffer_id: id,
        offset,
        length,
        pattern,
    };
    use pb::fill_buffer_request::Pattern;
    expect_err(
        "fill unknown",
        ac.fill_buffer(fill(999, 0, 1, Some(Pattern::Byte(1)))).await,
        Code::NotFound,
        "buffer_id",
    );
    expect_err(
        "fill past the end",
        ac.fill_buffer(fill(src.id, 4 * MIB, 1, Some(Pattern::Byte(1))))
            .await,
        Code::InvalidArgument,
        "past the end",
    );
    expect_err(
        "fill offset overflow",
        ac.fill_buffer(fill(src.id, u64::MAX, 2, Some(Pattern::Byte(1))))
            .await,
        Code::InvalidArgument,
        "overflows",
    );
    expect_err(
        "fill byte 256",
        ac.fill_buffer(fill(src.id, 0, 1, Some(Pattern::Byte(256)))).await,
        Code::InvalidArgument,
        "byte",
    );
    expect_err(
        "fill empty repeat",
        ac.fill_buffer(fill(src.id, 0, 1, Some(Pattern::Repeat(vec![]))))
            .await,
        Code::InvalidArgument,
        "repeat",
    );
    expect_err(
        "fill without pattern",
        ac.fill_buffer(fill(src.id, 0, 1, None)).await,
        Code::InvalidArgument,
        "pattern",
    );
    let rb = |offset, length| pb::ReadBufferRequest {
        buffer_id: src.id,
        offset,
        length,
    };
    expect_err(
        "read 0 bytes",
        ac.read_buffer(rb(0, 0)).await,
        Code::InvalidArgument,
        "length",
    );
    expect_err(
        "read over 1 MiB",
        ac.read_buffer(rb(0, MIB + 1)).await,
        Code::InvalidArgument,
        "length",
    );
    expect_err(
        "read past the end",
        ac.read_buffer(rb(4 * MIB - 1, 2)).await,
        Code::InvalidArgument,
        "past the end",
    );
    expect_err(
        "checksum past the end",
        ac.checksum_buffer(pb::ChecksumBufferRequest {
            buffer_id: src.id,
            offset: 4 * MIB + 1,
            length: 0,
        })
        .await,
        Code::InvalidArgument,
        "offset",
    );

    // ---- transfers and peers ------------------------------------------------------------------
    expect_err(
        "watch unknown",
        ac.watch(pb::WatchRequest { transfer_id: 999_999 }).await,
        Code::NotFound,
        "transfer_id",
    );
    expect_err(
        "wait unknown",
        ac.wait_transfer(pb::WaitTransferRequest { transfer_id: 999_999 })
            .await,
        Code::NotFound,
        "transfer_id",
    );
    expect_err(
        "cancel unknown",
        ac.cancel(pb::CancelRequest { transfer_id: 999_999 }).await,
        Code::NotFound,
        "transfer_id",
    );
    expect_err(
        "connect without address",
        ac.connect_peer(pb::ConnectPeerRequest { address: " ".into() })
            .await,
        Code::InvalidArgument,
        "address",
    );
    expect_err(
        "connect to nothing",
        ac.connect_peer(pb::ConnectPeerRequest {
            address: "127.0.0.1:1".into(),
        })
        .await,
        Code::Unavailable,
        "127.0.0.1:1",
    );
    expect_err(
        "connect to itself",
        ac.connect_peer(pb::ConnectPeerRequest { address: a_addr }).await,
        Code::InvalidArgument,
        "itself",
    );

    // ---- a released buffer's descriptor stops working -------------------------------------------
    let gone = host_buffer(&mut b.client, 4096, "").await;
    b.client
        .release_buffer(pb::ReleaseBufferRequest { buffer_id: gone.id })
        .await
        .unwrap();
    let ac = &mut a.client;
    let r = write(ac, write_entry(&src, 0, &gone, 0, 4096), b"").await;
    expect_refused(
        "descriptor of a released buffer",
        ac,
        r,
        Code::NotFound,
        "does not exist",
    )
    .await;

    assert_eq!(
        snapshot(&mut a.client, &mut b.client).await,
        before,
        "a refused request changed bytes"
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    // And the pair still works.
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    a.stop().await;
    b.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_buffer_past_the_nodes_memory_is_refused_not_left_to_the_oom_killer() {
    // A reserve larger than any machine's memory: every host registration would cut into it.
    tcpxd::logging::init("warn");
    let conf = std::env::temp_dir().join(format!("tcpxd-headroom-{}.toml", std::process::id()));
    std::fs::write(
        &conf,
        "[transfer]\nhost_memory_reserve_bytes = 1125899906842624\n",
    )
    .unwrap();
    let conf2 = conf.clone();
    let mut d = daemons::start("headroom", move |a| a.config = Some(conf2)).await;
    // Twice: the first refusal left nothing pending and took no label.
    for (what, words) in [
        ("1 MiB host buffer", "host.size: faulting in 1048576 bytes"),
        ("again", "transfer.host_memory_reserve_bytes"),
    ] {
        let req = pb::RegisterBufferRequest {
            reattach_id: Default::default(),
            reattach_key: Default::default(),
            source: Some(pb::register_buffer_request::Source::Host(pb::HostAllocation {
                size: MIB,
            })),
            label: "kv".into(),
        };
        expect_err(
            what,
            d.client.register_buffer(req).await,
            Code::ResourceExhausted,
            words,
        );
    }
    // Nothing was registered, and the label is still free.
    let list = d
        .client
        .list_buffers(pb::ListBuffersRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(list.buffers.is_empty(), "{list:?}");
    std::fs::remove_file(&conf).unwrap();
    d.stop().await;
}
