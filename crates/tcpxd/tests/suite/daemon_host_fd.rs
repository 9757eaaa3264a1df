//! Client host memory without copies (#24): a local client hands its own memory (a memfd) to the
//! daemon as a file descriptor on the framed local session; the daemon maps it and registers it as
//! a buffer. Bytes the client writes into its file are what transfers send, with no FillBuffer;
//! bytes a transfer lands are in the client's file; the file is sealed against shrinking; bad
//! descriptors and ranges are refused by name; the session's buffers (and their mappings) go when
//! it ends, counted back to zero.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::common::daemons::*;
use crate::common::framed::*;
use rustix::fs::{MemfdFlags, SealFlags};
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_request::Op;
use tcpxd_pattern::seeded_vec as pattern;

const MIB: u64 = 1 << 20;

/// A sealable memfd of `size` bytes named `name` (its mappings show as `/memfd:<name>`).
fn memfd(name: &str, size: u64) -> OwnedFd {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, size).unwrap();
    fd
}

/// The client's side of the file, written and read with pwrite/pread: this test process maps it
/// only through the daemons it runs, so the mappings counted are theirs.
fn file(fd: &OwnedFd) -> File {
    File::from(fd.try_clone().unwrap())
}

/// Mappings of `/memfd:<name>` in this process (both in-process daemons).
fn mappings(name: &str) -> usize {
    let needle = format!("/memfd:{name} ");
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| format!("{l} ").contains(&needle))
        .count()
}

fn register(offset: u64, size: u64, label: &str) -> Op {
    Op::RegisterHostFd(pb::RegisterHostFdRequest {
        reattach_id: Default::default(),
        reattach_key: Default::default(),
        offset,
        size,
        label: label.to_string(),
        block_lists: Vec::new(),
    })
}

async fn buffers(c: &mut Client) -> Vec<pb::Buffer> {
    c.list_buffers(pb::ListBuffersRequest {})
        .await
        .unwrap()
        .into_inner()
        .buffers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_memory_is_sent_and_landed_with_no_copy() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("hostfd-rt").await;
    let len = 4 * MIB;
    let src_fd = memfd("hostfd-rt-src", len + 4096);
    let back_fd = memfd("hostfd-rt-back", len);
    let (src_file, back_file) = (file(&src_fd), file(&back_fd));
    let one = pattern(2424, len as usize);
    src_file.write_all_at(&one, 4096).unwrap();
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send_with_fd(1, register(4096, len, "client-src"), &src_fd)
        .await;
    let src = s.registered(1).await.expect("registered");
    assert_eq!(src.kind, pb::BufferKind::HostShared as i32);
    assert_eq!((src.size, src.label.as_str()), (len, "client-src"));
    s.send_with_fd(2, register(0, len, ""), &back_fd).await;
    let back = s.registered(2).await.expect("registered");
    drop((src_fd, back_fd)); // the daemon's mappings hold the files
    // Sealed: the client can no longer shrink them under the daemon.
    let seals = rustix::fs::fcntl_get_seals(&src_file).unwrap();
    assert!(seals.contains(SealFlags::SHRINK), "{seals:?}");
    assert!(
        src_file.set_len(4096).is_err(),
        "shrinking a registered memfd fails"
    );
    let dst = host_buffer(&mut b.client, len, "").await;
    // The daemon reads what the client wrote into its file (no FillBuffer).
    assert_eq!(crc(&mut a.client, src.id, 0, 0).await, crc32c::crc32c(&one));
    s.send(3, write_op(write_entry(&src, 0, &dst, 0, len))).await;
    let ev = s.next().await;
    assert_eq!(finished(&ev).status_code, 0, "{ev:?}");
    assert_eq!(crc(&mut b.client, dst.id, 0, 0).await, crc32c::crc32c(&one));
    // The client writes into its memory again; the next WRITE sends the new bytes.
    let two = pattern(2525, len as usize);
    src_file.write_all_at(&two, 4096).unwrap();
    s.send(4, write_op(write_entry(&src, 0, &dst, 0, len))).await;
    assert_eq!(finished(&s.next().await).status_code, 0);
    assert_eq!(crc(&mut b.client, dst.id, 0, 0).await, crc32c::crc32c(&two));
    // A READ lands in the client's other file: the client reads it there.
    s.send(5, read_op(read_entry(&dst, 0, &back, 0, len))).await;
    assert_eq!(finished(&s.next().await).status_code, 0);
    let mut got = vec![0u8; len as usize];
    back_file.read_exact_at(&mut got, 0).unwrap();
    assert!(
        got == two,
        "the READ landed the remote bytes in the client's memory"
    );
    half_close(&mut s).await;
    s.assert_eof().await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_buffers_and_mappings_go_when_it_ends() {
    tcpxd::logging::init("warn");
    let mut a = start("hostfd-life", |_| {}).await;
    let fds: Vec<OwnedFd> = (0..3).map(|_| memfd("hostfd-life", MIB)).collect();
    let mut s = Framed::open(&a.daemon.api_socket).await;
    for (i, fd) in fds.iter().enumerate() {
        s.send_with_fd(i as u64 + 1, register(0, MIB, ""), fd).await;
        s.registered(i as u64 + 1).await.expect("registered");
    }
    drop(fds);
    let listed = buffers(&mut a.client).await;
    assert_eq!(listed.len(), 3);
    assert!(listed.iter().all(|b| b.kind == pb::BufferKind::HostShared as i32));
    assert_eq!(mappings("hostfd-life"), 3);
    // One released by the client (gRPC, any connection): unmapped at once.
    a.client
        .release_buffer(pb::ReleaseBufferRequest {
            buffer_id: listed[0].id,
        })
        .await
        .unwrap();
    assert_eq!(mappings("hostfd-life"), 2);
    // A daemon-allocated buffer is nobody's session's: it stays.
    let keep = host_buffer(&mut a.client, MIB, "").await;
    // The client goes away: the other two go with its session.
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = buffers(&mut a.client).await;
        if left.len() == 1 {
            assert_eq!(left[0].id, keep.id);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the session's buffers were not released: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        mappings("hostfd-life"),
        0,
        "every mapping of the client's files is gone"
    );
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_in_use_is_released_only_after_its_transfer() {
    // The WRITE is held in flight by the emulation's hold gate (16 MiB moved, then its senders
    // wait) until the release was refused and the session ended, whatever the machine's load.
    crate::common::hold::gate_on();
    let (mut a, mut b) = pair("hostfd-busy").await;
    let len = 64 * MIB;
    let fd = memfd("hostfd-busy", len);
    let f = file(&fd);
    let data = pattern(77, len as usize);
    f.write_all_at(&data, 0).unwrap();
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send_with_fd(1, register(0, len, ""), &fd).await;
    let src = s.registered(1).await.expect("registered");
    drop(fd);
    let dst = host_buffer(&mut b.client, len, "").await;
    // Started on another connection, and held by the gate once it moved bytes.
    crate::common::hold::close_gate();
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, len), b"")
        .await
        .unwrap();
    crate::common::hold::once_moving(&mut a.client, id).await;
    // A release_batch does not wait for the transfer: answered FAILED_PRECONDITION, it stays.
    s.send(
        2,
        Op::ReleaseBatch(pb::ReleaseBatchRequest {
            buffer_ids: vec![src.id],
        }),
    )
    .await;
    let ev = s.next().await;
    let Some(tcpxd::api::proto::v1::session_event::Event::ReleasedBatch(rel)) = ev.event else {
        panic!("expected a released_batch, got {ev:?}")
    };
    assert_eq!(
        rel.statuses[0].code,
        tonic::Code::FailedPrecondition as i32,
        "{rel:?}"
    );
    assert_eq!(buffers(&mut a.client).await.len(), 1);
    drop(s); // the registering session ends mid-transfer
    crate::common::hold::open_gate();
    // The transfer finishes with the buffer's bytes; only then does the buffer go.
    let ev = wait(&mut a.client, id).await;
    assert_eq!(ev.status_code, 0, "{ev:?}");
    assert_eq!(crc(&mut b.client, dst.id, 0, 0).await, crc32c::crc32c(&data));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !buffers(&mut a.client).await.is_empty() {
        assert!(Instant::now() < deadline, "never released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(mappings("hostfd-busy"), 0);
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_descriptors_and_ranges_are_refused_by_name() {
    tcpxd::logging::init("warn");
    let mut a = start("hostfd-bad", |_| {}).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let fd = memfd("hostfd-bad", 8192);
    // No descriptor with the frame.
    s.send(1, register(0, 8192, "")).await;
    let (code, msg) = s.registered(1).await.unwrap_err();
    assert_eq!(code, tonic::Code::InvalidArgument as i32);
    assert!(msg.contains("no file descriptor came with this request"), "{msg}");
    // Past the file's end.
    s.send_with_fd(2, register(4096, 8192, ""), &fd).await;
    let (code, msg) = s.registered(2).await.unwrap_err();
    assert_eq!(code, tonic::Code::InvalidArgument as i32);
    assert_eq!(
        msg,
        "register_host_fd.offset + size: range 4096..12288 is past the end of the file (8192 bytes)"
    );
    // Not a regular file.
    let (x, _y) = std::os::unix::net::UnixStream::pair().unwrap();
    s.send_with_fd(3, register(0, 1, ""), &x).await;
    let (code, msg) = s.registered(3).await.unwrap_err();
    assert_eq!(code, tonic::Code::InvalidArgument as i32);
    assert!(msg.starts_with("host_fd: the descriptor is a socket"), "{msg}");
    // Read-only.
    let ro = File::open("/etc/hostname")
        .or_else(|_| File::open("/etc/passwd"))
        .unwrap();
    s.send_with_fd(4, register(0, 1, ""), &ro).await;
    let (_, msg) = s.registered(4).await.unwrap_err();
    assert!(msg.contains("O_RDWR"), "{msg}");
    // Zero bytes; a label taken.
    s.send_with_fd(5, register(0, 0, ""), &fd).await;
    let (_, msg) = s.registered(5).await.unwrap_err();
    assert!(msg.starts_with("register_host_fd.size: 0 bytes"), "{msg}");
    host_buffer(&mut a.client, 4096, "taken").await;
    s.send_with_fd(6, register(0, 4096, "taken"), &fd).await;
    let (code, _) = s.registered(6).await.unwrap_err();
    assert_eq!(code, tonic::Code::AlreadyExists as i32);
    // Nothing of these stayed: the daemon's buffer only, and no mapping of the file.
    assert_eq!(buffers(&mut a.client).await.len(), 1);
    assert_eq!(mappings("hostfd-bad"), 0);
    // The session goes on: a good one is taken.
    s.send_with_fd(7, register(0, 8192, ""), &fd).await;
    s.registered(7).await.expect("registered");
    // gRPC cannot carry descriptors: its Session stream says where to go instead.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(pb::SessionRequest {
        tag: 1,
        op: Some(register(0, 8192, "")),
    })
    .await
    .unwrap();
    let mut events = a
        .client
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let ev = events.message().await.unwrap().unwrap();
    let (_, code, msg) = refused(ev);
    assert_eq!(code, tonic::Code::FailedPrecondition as i32);
    assert!(msg.contains("only over the framed local session"), "{msg}");
    drop(tx);
}

fn strided(stride: u64, count: u32) -> pb::StridedBlocks {
    pb::StridedBlocks {
        first: 0,
        stride,
        length: stride as u32,
        count,
    }
}

/// A registration that asks for block lists gets them made on the new buffer in the same step
/// (what tcpxd.nixl's granule lists were two RegisterBlocks calls for); a list the daemon refuses
/// leaves the buffer registered without it, named; too many lists change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_makes_the_block_lists_it_asks_for() {
    tcpxd::logging::init("warn");
    let mut a = start("hostfd-lists", |_| {}).await;
    let fd = memfd("hostfd-lists", MIB);
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let Op::RegisterHostFd(mut req) = register(0, MIB, "lists") else {
        unreachable!()
    };
    // 4 KiB and 512-byte tilings of the buffer, and one running past its end.
    req.block_lists = vec![strided(4096, 256), strided(512, 2048), strided(4096, 257)];
    s.send_with_fd(1, Op::RegisterHostFd(req.clone()), &fd).await;
    let buf = s.registered(1).await.expect("registered");
    assert_eq!((buf.block_lists.len(), buf.block_list_status.len()), (3, 3));
    for (i, count) in [(0, 256), (1, 2048)] {
        let (list, st) = (&buf.block_lists[i], &buf.block_list_status[i]);
        assert_eq!(st.code, 0, "{st:?}");
        assert_eq!((list.buffer_id, list.count), (buf.id, count));
        let described = a
            .client
            .describe_blocks(pb::DescribeBlocksRequest { list_id: list.id })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(&described, list);
    }
    let (bad, st) = (&buf.block_lists[2], &buf.block_list_status[2]);
    assert_eq!(
        (bad.id, st.code),
        (0, tonic::Code::InvalidArgument as i32),
        "{st:?}"
    );
    assert!(st.message.starts_with("block_lists[2]: "), "{}", st.message);
    // Too many lists: refused by name and limit, nothing registered.
    req.block_lists = vec![strided(4096, 1); 9];
    s.send_with_fd(2, Op::RegisterHostFd(req), &fd).await;
    let (code, msg) = s.registered(2).await.unwrap_err();
    assert_eq!(code, tonic::Code::InvalidArgument as i32);
    assert_eq!(msg, "block_lists: 9 lists is over the limit of 8 a registration");
    assert_eq!(buffers(&mut a.client).await.len(), 1);
    // The lists go with the buffer when the session ends.
    half_close(&mut s).await;
    s.assert_eof().await;
    let gone = Instant::now() + Duration::from_secs(10);
    while !buffers(&mut a.client).await.is_empty() {
        assert!(Instant::now() < gone, "the session's buffer was not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let err = a
        .client
        .describe_blocks(pb::DescribeBlocksRequest {
            list_id: buf.block_lists[0].id,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
}

fn batch_fd(offset: u64, size: u64, lists: Vec<pb::StridedBlocks>) -> pb::RegisterBatchEntry {
    let Op::RegisterHostFd(mut r) = register(offset, size, "") else {
        unreachable!()
    };
    r.block_lists = lists;
    pb::RegisterBatchEntry {
        memory: Some(pb::register_batch_entry::Memory::HostFd(r)),
    }
}

/// Registrations in one `register_batch` frame, their descriptors with it in order: each entry
/// registered or refused alone, answered together in order; a frame whose descriptors are not one
/// per host_fd entry, or with too many entries, refused whole with nothing registered; a
/// `release_batch` releases the session's own buffers by position; the rest go with the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_registrations_is_answered_entry_by_entry() {
    use std::os::fd::AsFd;
    use tcpxd::api::proto::v1::session_event::Event;
    tcpxd::logging::init("warn");
    let mut a = start("hostfd-batch", |_| {}).await;
    let fds: Vec<OwnedFd> = (0..4).map(|_| memfd("hostfd-batch", MIB)).collect();
    file(&fds[3]).write_all_at(b"fourth", 0).unwrap();
    let mut s = Framed::open(&a.daemon.api_socket).await;
    let entries = vec![
        batch_fd(0, MIB, vec![strided(4096, 256)]),
        batch_fd(4096, MIB, Vec::new()), // runs past the end of its file
        pb::RegisterBatchEntry { memory: None },
        batch_fd(0, MIB, vec![strided(4096, 1); 9]), // too many lists
        batch_fd(0, MIB, Vec::new()),
    ];
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let op = Op::RegisterBatch(pb::RegisterBatchRequest {
        entries,
        ..Default::default()
    });
    s.send_with_fds(1, op, &borrowed).await;
    let ev = s.next().await;
    assert_eq!(ev.tag, 1);
    let Some(Event::RegisteredBatch(got)) = ev.event else {
        panic!("expected a registered_batch, got {ev:?}")
    };
    assert_eq!((got.buffers.len(), got.statuses.len()), (5, 5));
    let codes: Vec<i32> = got.statuses.iter().map(|st| st.code).collect();
    let bad = tonic::Code::InvalidArgument as i32;
    assert_eq!(codes, vec![0, bad, bad, bad, 0], "{:?}", got.statuses);
    assert!(
        got.statuses[1].message.contains("past the end of the file"),
        "{:?}",
        got.statuses[1]
    );
    assert_eq!(
        got.statuses[2].message,
        "register_batch.entries[2]: set one of host_fd, client_memory"
    );
    assert_eq!(
        got.statuses[3].message,
        "register_batch.entries[3].block_lists: 9 lists is over the limit of 8 a registration"
    );
    for refused in [1, 2, 3] {
        assert_eq!(got.buffers[refused].id, 0);
    }
    let (first, fifth) = (&got.buffers[0], &got.buffers[4]);
    assert_eq!((first.block_lists.len(), first.block_lists[0].count), (1, 256));
    assert_eq!(first.block_list_status[0].code, 0);
    // Each good entry got its own descriptor, in order: the fifth entry's buffer is the 4th file.
    assert_eq!(
        crc(&mut a.client, fifth.id, 0, 6).await,
        crc32c::crc32c(b"fourth")
    );
    drop(fds);
    assert_eq!(buffers(&mut a.client).await.len(), 2);
    assert_eq!(mappings("hostfd-batch"), 2);
    // Descriptors not one per host_fd entry: the frame refused, nothing registered.
    let fd = memfd("hostfd-batch", MIB);
    let op = Op::RegisterBatch(pb::RegisterBatchRequest {
        entries: vec![batch_fd(0, MIB, Vec::new()), batch_fd(0, MIB, Vec::new())],
        ..Default::default()
    });
    s.send_with_fds(2, op, &[fd.as_fd()]).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (2, bad));
    assert!(
        msg.starts_with("register_batch: 1 file descriptors came with this request for 2 host_fd entries"),
        "{msg}"
    );
    // Over the limit of entries: refused by name and limit.
    let entry = pb::RegisterBatchEntry {
        memory: Some(pb::register_batch_entry::Memory::ClientMemory(
            pb::RegisterClientMemoryRequest {
                address: 4096,
                size: 4096,
                ..Default::default()
            },
        )),
    };
    s.send(
        3,
        Op::RegisterBatch(pb::RegisterBatchRequest {
            entries: vec![entry; 65],
            ..Default::default()
        }),
    )
    .await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (3, bad));
    assert_eq!(
        msg,
        "register_batch.entries: 65 entries is over the limit of 64 a batch"
    );
    drop(fd);
    assert_eq!(buffers(&mut a.client).await.len(), 2);
    assert_eq!(mappings("hostfd-batch"), 2);
    // Released in a batch: this session's buffer at once (unmapped right after the answer), an
    // id it never registered and one released already answered NOT_FOUND by position.
    let ids = vec![first.id, 12_345, first.id];
    s.send(4, Op::ReleaseBatch(pb::ReleaseBatchRequest { buffer_ids: ids }))
        .await;
    let ev = s.next().await;
    assert_eq!(ev.tag, 4);
    let Some(Event::ReleasedBatch(rel)) = ev.event else {
        panic!("expected a released_batch, got {ev:?}")
    };
    let codes: Vec<i32> = rel.statuses.iter().map(|st| st.code).collect();
    let missing = tonic::Code::NotFound as i32;
    assert_eq!(codes, vec![0, missing, missing], "{:?}", rel.statuses);
    assert!(
        rel.statuses[1]
            .message
            .starts_with("release_batch.buffer_ids[1]: buffer 12345 was not registered on this session"),
        "{:?}",
        rel.statuses[1]
    );
    assert_eq!(buffers(&mut a.client).await.len(), 1);
    // Its mapping goes right after the answer, before the session reads its next request: by
    // the next answer on this session it is gone.
    s.send(
        5,
        Op::ReleaseBatch(pb::ReleaseBatchRequest {
            buffer_ids: vec![fifth.id; 65],
        }),
    )
    .await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (5, bad));
    assert_eq!(
        msg,
        "release_batch.buffer_ids: 65 ids is over the limit of 64 a batch"
    );
    assert_eq!(mappings("hostfd-batch"), 1);
    assert_eq!(buffers(&mut a.client).await.len(), 1);
    // The batch's buffers go with the session, mappings and all.
    half_close(&mut s).await;
    s.assert_eof().await;
    let gone = Instant::now() + Duration::from_secs(10);
    while !buffers(&mut a.client).await.is_empty() || mappings("hostfd-batch") != 0 {
        assert!(Instant::now() < gone, "the session's buffers were not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn by_address(address: u64, size: u64) -> pb::RegisterBatchEntry {
    pb::RegisterBatchEntry {
        memory: Some(pb::register_batch_entry::Memory::ClientMemory(
            pb::RegisterClientMemoryRequest {
                address,
                size,
                ..Default::default()
            },
        )),
    }
}

/// A batch of memory by address (this process's own: the daemons run in it) is probed together
/// (two system calls for the batch): a range the kernel stops at — unmapped from its first byte,
/// or only at its last — refused by name alone, the ranges after it registered all the same, their
/// bytes the client's; released together, an id twice and one not this session's answered
/// NOT_FOUND by position, the others gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_by_address_is_probed_and_released_together() {
    use tcpxd::api::proto::v1::session_event::Event;
    tcpxd::logging::init("warn");
    let mut a = start("by-address-batch", |_| {}).await;
    let page = 4096u64;
    // Two pages mapped, the second unmapped: a range over both has its last byte unmapped.
    // SAFETY: a fresh anonymous mapping of this test's own; its second page unmapped at once and
    // the first unmapped at the end, nothing else holding either.
    let two = unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            2 * page as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        assert_eq!(
            libc::munmap(p.cast::<u8>().add(page as usize).cast(), page as usize),
            0
        );
        p as u64
    };
    let mut mem: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 64 << 10]).collect();
    mem[2][..5].copy_from_slice(b"third");
    let at = |v: &Vec<u8>| v.as_ptr() as u64;
    let entries = vec![
        by_address(at(&mem[0]), 64 << 10),
        by_address(page, page), // nothing mapped there
        by_address(at(&mem[1]), 64 << 10),
        by_address(two, 2 * page), // its last byte unmapped
        by_address(at(&mem[2]), 64 << 10),
    ];
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send(
        1,
        Op::RegisterBatch(pb::RegisterBatchRequest {
            entries,
            ..Default::default()
        }),
    )
    .await;
    let ev = s.next().await;
    let Some(Event::RegisteredBatch(got)) = ev.event else {
        panic!("expected a registered_batch, got {ev:?}")
    };
    let codes: Vec<i32> = got.statuses.iter().map(|st| st.code).collect();
    let bad = tonic::Code::InvalidArgument as i32;
    assert_eq!(codes, vec![0, bad, 0, bad, 0], "{:?}", got.statuses);
    for (i, addr) in [(1, page), (3, two + 2 * page - 1)] {
        assert!(
            got.statuses[i].message.contains("has no memory at"),
            "{:?}",
            got.statuses[i]
        );
        assert!(
            got.statuses[i].message.contains(&format!("{addr:#x}")),
            "{:?}",
            got.statuses[i]
        );
        assert_eq!(got.buffers[i].id, 0);
    }
    let ids: Vec<u64> = [0, 2, 4].iter().map(|&i| got.buffers[i].id).collect();
    assert_eq!(crc(&mut a.client, ids[2], 0, 5).await, crc32c::crc32c(b"third"));
    assert_eq!(buffers(&mut a.client).await.len(), 3);
    let asked = vec![ids[0], ids[0], 12_345, ids[1], ids[2]];
    s.send(2, Op::ReleaseBatch(pb::ReleaseBatchRequest { buffer_ids: asked }))
        .await;
    let ev = s.next().await;
    let Some(Event::ReleasedBatch(rel)) = ev.event else {
        panic!("expected a released_batch, got {ev:?}")
    };
    let codes: Vec<i32> = rel.statuses.iter().map(|st| st.code).collect();
    let missing = tonic::Code::NotFound as i32;
    assert_eq!(codes, vec![0, missing, missing, 0, 0], "{:?}", rel.statuses);
    assert!(buffers(&mut a.client).await.is_empty());
    // SAFETY: the first page of the mapping made above, no buffer naming it any more.
    assert_eq!(
        unsafe { libc::munmap(two as *mut libc::c_void, page as usize) },
        0
    );
    drop(mem);
}
