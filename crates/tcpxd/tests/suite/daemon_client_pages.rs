//! Host memory a client registers by address (anonymous memory, no file to hand over): the
//! daemon reads and writes the client's pages by cross-memory attach, the client's process taken
//! from the socket's peer credentials. The daemons run in this test process, so the client is
//! this process: its Vecs are registered and checked byte for byte. Such a buffer moves both
//! ways within one node and across nodes (staged through the lanes' slots); its memory gone
//! fails the transfer naming the buffer, and the daemons go on.

use crate::common::blocks::{list, read_request, u32s, write_request};
use crate::common::daemons::{self, *};
use crate::common::framed::Framed;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_request::Op;
use tonic::Code;

const MIB: u64 = 1 << 20;

fn register(addr: u64, size: u64) -> Op {
    Op::RegisterClientMemory(pb::RegisterClientMemoryRequest {
        address: addr,
        size,
        label: String::new(),
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_memory_moves_both_ways_within_the_node_and_to_another() {
    let (mut a, mut b) = pair("pages").await;
    // This process's own anonymous memory, registered by address on a's framed session.
    let mut mine: Vec<u8> = (0..(3 * MIB) as usize).map(|i| (i * 7 + 3) as u8).collect();
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send(1, register(mine.as_mut_ptr() as u64, 3 * MIB)).await;
    let pages = s.registered(1).await.expect("registered");
    assert_eq!(pages.kind, pb::BufferKind::HostAttached as i32);
    // The daemon's own view (ChecksumBuffer, ReadBuffer) reads the client's pages.
    assert_eq!(
        crc(&mut a.client, pages.id, 0, 3 * MIB).await,
        crc32c::crc32c(&mine)
    );

    // WRITE out of the client's pages into another client's buffer of the same daemon, then
    // READ a range back into the client's pages: byte-exact both ways.
    let other = host_buffer(&mut a.client, 3 * MIB, "").await;
    let id = write(&mut a.client, write_entry(&pages, 0, &other, 0, 3 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, other.id, 0, 3 * MIB).await,
        crc32c::crc32c(&mine)
    );
    fill_seed(&mut a.client, other.id, 0, 0, 99).await;
    let id = read(&mut a.client, read_entry(&other, 4096, &pages, MIB + 5, MIB))
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let want = crc(&mut a.client, other.id, 4096, MIB).await;
    assert_eq!(
        crc32c::crc32c(&mine[(MIB + 5) as usize..(2 * MIB + 5) as usize]),
        want
    );
    // And the other way round: the other client names the pages by descriptor.
    let id = write(&mut a.client, write_entry(&other, 0, &pages, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc32c::crc32c(&mine[..4096]),
        crc(&mut a.client, other.id, 0, 4096).await
    );

    // Across nodes: staged through the lanes' staging and landing slots, byte-exact
    // (daemon_client_pages::across_nodes has more).
    let far = host_buffer(&mut b.client, MIB, "").await;
    let id = write(&mut a.client, write_entry(&pages, 0, &far, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut b.client, far.id, 0, 4096).await,
        crc32c::crc32c(&mine[..4096])
    );

    // Bad input: address 0, a range the process does not have.
    s.send(2, register(0, 4096)).await;
    let (code, msg) = s.registered(2).await.unwrap_err();
    assert_eq!(
        (code, msg.as_str()),
        (Code::InvalidArgument as i32, "address: must not be 0")
    );
    s.send(3, register(4096, 4096)).await;
    let (code, msg) = s.registered(3).await.unwrap_err();
    assert_eq!(code, Code::InvalidArgument as i32, "{msg}");
    assert!(msg.contains("has no memory at 0x1000"), "{msg}");
    // A read-only page: refused from its mapping's permissions (never by writing to it).
    let ro = anonymous(8192);
    // SAFETY: the second page of this test's own mapping, made read-only.
    assert_eq!(
        unsafe { libc::mprotect(ro.add(4096).cast(), 4096, libc::PROT_READ) },
        0
    );
    s.send(4, register(ro as u64, 8192)).await;
    let (code, msg) = s.registered(4).await.unwrap_err();
    assert_eq!(code, Code::InvalidArgument as i32, "{msg}");
    assert!(
        msg.contains(&format!("memory at {:#x} is not writable", ro as u64 + 4096)),
        "{msg}"
    );
    s.send(5, register(ro as u64, 4096)).await;
    s.registered(5).await.expect("its writable first page registers");
    drop(s); // the session's buffers go with it
    let _keep = &mut mine;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_by_address_needs_the_framed_session() {
    let mut d = daemons::start("pages-grpc", |_| {}).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::SessionRequest {
        tag: 1,
        op: Some(register(4096, 4096)),
    })
    .await
    .unwrap();
    drop(tx);
    let mut events = d
        .client
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let ev = events.message().await.unwrap().expect("an answer");
    let Some(pb::session_event::Event::Refused(st)) = ev.event else {
        panic!("{ev:?}")
    };
    assert_eq!(st.code, Code::FailedPrecondition as i32);
    assert!(st.message.contains("framed local session"), "{}", st.message);
    d.stop().await;
}

/// Memory by address maps nothing in the daemon: not even address space of its size (until
/// session 21 each such buffer reserved it, an mmap at registration and a munmap at release). The
/// daemon runs in this process, so its mappings are this process's: registering 4 GiB of
/// untouched client memory must not add gigabytes to them, and the buffers still serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_by_address_maps_nothing_in_the_daemon() {
    const GIB: usize = 1 << 30;
    let mut d = daemons::start("pages-nomap", |_| {}).await;
    let regions: Vec<*mut u8> = (0..4).map(|_| anonymous(GIB)).collect();
    let before = vm_size();
    let mut s = Framed::open(&d.daemon.api_socket).await;
    let mut ids = Vec::new();
    for (i, p) in regions.iter().enumerate() {
        s.send(i as u64 + 1, register(*p as u64, GIB as u64)).await;
        ids.push(s.registered(i as u64 + 1).await.expect("registered").id);
    }
    let grew = vm_size().saturating_sub(before);
    assert!(
        grew < GIB as u64 / 2,
        "4 GiB registered by address grew the daemon's address space by {grew} bytes"
    );
    // They serve: the daemon's own reads see the client's bytes.
    bytes(regions[3], 4096)[..5].copy_from_slice(b"hello");
    assert_eq!(
        crc(&mut d.client, ids[3], 0, 4096).await,
        crc32c::crc32c(&bytes(regions[3], 4096)[..])
    );
    d.stop().await;
}

/// A `register_batch` asking `packed_answer` is answered by arrays rather than a Buffer message
/// an entry: ids, list ids and counts, descriptors and tokens back to back, and the refusals
/// (an entry, a list) with their statuses; what they say is what the unary calls say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packed_answer_carries_ids_lists_descriptors_and_refusals() {
    use tcpxd::api::proto::v1::register_batch_entry::Memory;
    use tcpxd::api::proto::v1::session_event::Event;
    let mut d = daemons::start("pages-packed", |_| {}).await;
    let (a, b) = (anonymous(2 * MIB as usize), anonymous(MIB as usize));
    let strided = |g: u32, count: u32| pb::StridedBlocks {
        first: 0,
        stride: u64::from(g),
        length: g,
        count,
    };
    let entry = |address: u64, size: u64, block_lists: Vec<pb::StridedBlocks>| pb::RegisterBatchEntry {
        memory: Some(Memory::ClientMemory(pb::RegisterClientMemoryRequest {
            address,
            size,
            block_lists,
            ..Default::default()
        })),
    };
    let entries = vec![
        entry(a as u64, 2 * MIB, vec![strided(4096, 512), strided(512, 4096)]),
        entry(0, 4096, vec![strided(4096, 1)]), // refused: address 0
        entry(b as u64, MIB, vec![strided(4096, 512)]), // its list runs past the end: not made
    ];
    let mut s = Framed::open(&d.daemon.api_socket).await;
    s.send(
        1,
        Op::RegisterBatch(pb::RegisterBatchRequest {
            entries,
            packed_answer: true,
        }),
    )
    .await;
    let ev = s.next().await;
    let Some(Event::RegisteredBatch(got)) = ev.event else {
        panic!("{ev:?}")
    };
    assert!(got.buffers.is_empty() && got.statuses.is_empty());
    let p = got.packed.expect("packed");
    let u64s = |b: &[u8]| -> Vec<u64> {
        b.chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let ids = u64s(&p.buffer_ids);
    assert_eq!(ids.len(), 3);
    assert!(ids[0] != 0 && ids[1] == 0 && ids[2] != 0, "{ids:?}");
    assert_eq!(p.refused_entries, vec![1]);
    assert_eq!(p.refused[0].code, Code::InvalidArgument as i32);
    assert!(
        p.refused[0].message.contains("address"),
        "{}",
        p.refused[0].message
    );
    let lists = u64s(&p.list_ids);
    assert_eq!(u64s(&p.list_counts), vec![512, 4096, 0]);
    assert_eq!(p.entry_lists, vec![2, 0, 1]);
    assert!(lists[0] != 0 && lists[1] != 0 && lists[2] == 0, "{lists:?}");
    assert_eq!(p.refused_lists, vec![2]);
    assert!(
        p.lists_refused[0].message.starts_with("block_lists[0]: "),
        "{}",
        p.lists_refused[0].message
    );
    // Descriptors and tokens: per entry its descriptor, then a token per list slot.
    let ends: Vec<usize> = p
        .text_ends
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()) as usize)
        .collect();
    let text = String::from_utf8(p.text.clone()).unwrap();
    let mut at = 0;
    let strs: Vec<&str> = ends
        .iter()
        .map(|&e| {
            let s = &text[at..e];
            at = e;
            s
        })
        .collect();
    assert_eq!(strs.len(), 3 + 3);
    assert!(strs[3].is_empty() && strs[5].is_empty());
    let listed = d
        .client
        .list_buffers(pb::ListBuffersRequest {})
        .await
        .unwrap()
        .into_inner()
        .buffers;
    let desc = |id: u64| listed.iter().find(|b| b.id == id).unwrap().descriptor.clone();
    assert_eq!((strs[0], strs[4]), (desc(ids[0]).as_str(), desc(ids[2]).as_str()));
    for (slot, k) in [(1usize, 0usize), (2, 1)] {
        let bl = d
            .client
            .describe_blocks(pb::DescribeBlocksRequest { list_id: lists[k] })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((bl.buffer_id, bl.token.as_str()), (ids[0], strs[slot]));
    }
    d.stop().await;
}

/// This process's address space in bytes (`VmSize` of /proc/self/status).
fn vm_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// This process's anonymous memory of `len` bytes (its own mapping, so that a test can take it
/// away under the daemon).
fn anonymous(len: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}

fn bytes(p: *mut u8, len: usize) -> &'static mut [u8] {
    // SAFETY: `p` is a live mapping of `len` bytes from `anonymous`, used by one test only; the
    // daemons write it only while the test waits for their transfers.
    unsafe { std::slice::from_raw_parts_mut(p, len) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_nodes_both_ways_by_address_on_one_side_or_both() {
    let (mut a, mut b) = pair("pages-x").await;
    let size = 5 * MIB + 777; // several chunks and an odd tail
    let len = size as usize;
    let (pa, pb_) = (anonymous(len), anonymous(len));
    let (ma, mb) = (bytes(pa, len), bytes(pb_, len));
    for (i, x) in ma.iter_mut().enumerate() {
        *x = (i * 13 + 1) as u8;
    }
    let mut sa = Framed::open(&a.daemon.api_socket).await;
    sa.send(1, register(pa as u64, size)).await;
    let on_a = sa.registered(1).await.expect("registered on a");
    let mut sb = Framed::open(&b.daemon.api_socket).await;
    sb.send(1, register(pb_ as u64, size)).await;
    let on_b = sb.registered(1).await.expect("registered on b");
    let plain_b = host_buffer(&mut b.client, size, "").await;
    let plain_a = host_buffer(&mut a.client, size, "").await;

    // By address -> plain, WRITE started on a (a gathers from the client's pages).
    let id = write(&mut a.client, write_entry(&on_a, 0, &plain_b, 0, size), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(crc(&mut b.client, plain_b.id, 0, size).await, crc32c::crc32c(ma));
    // Plain -> by address, READ started on a (a scatters into the client's pages).
    fill_seed(&mut b.client, plain_b.id, 0, 0, 7).await;
    let id = read(&mut a.client, read_entry(&plain_b, 3, &on_a, 11, size - 20))
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc32c::crc32c(&ma[11..len - 9]),
        crc(&mut b.client, plain_b.id, 3, size - 20).await
    );
    // Started by the peer: b READs a's pages, b WRITEs a small chunk into them (eager-sized).
    let id = read(&mut b.client, read_entry(&on_a, 0, &plain_b, 0, size))
        .await
        .unwrap();
    wait_ok(&mut b.client, id).await;
    assert_eq!(crc(&mut b.client, plain_b.id, 0, size).await, crc32c::crc32c(ma));
    fill_seed(&mut b.client, plain_b.id, 0, 0, 8).await;
    let id = write(&mut b.client, write_entry(&plain_b, 100, &on_a, 4000, 300), b"")
        .await
        .unwrap();
    wait_ok(&mut b.client, id).await;
    assert_eq!(
        crc32c::crc32c(&ma[4000..4300]),
        crc(&mut b.client, plain_b.id, 100, 300).await
    );
    // By address on both sides, both ways.
    let id = write(&mut a.client, write_entry(&on_a, 0, &on_b, 0, size), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(&ma[..], &mb[..]);
    for x in mb.iter_mut() {
        *x = x.wrapping_mul(3).wrapping_add(5);
    }
    let id = read(&mut a.client, read_entry(&on_b, 0, &on_a, 0, size))
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(&ma[..], &mb[..]);
    // A plain buffer of a into b's pages.
    fill_seed(&mut a.client, plain_a.id, 0, 0, 9).await;
    let id = write(&mut a.client, write_entry(&plain_a, 0, &on_b, 0, size), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(crc(&mut a.client, plain_a.id, 0, size).await, crc32c::crc32c(mb));

    // The client's memory gone (unmapped under the daemon, as when its process exits): the
    // transfer fails naming the buffer, both ways, and the daemons go on.
    // SAFETY: `pa` is the mapping made above; `ma` is not used after this.
    assert_eq!(unsafe { libc::munmap(pa.cast(), len) }, 0);
    let id = write(&mut a.client, write_entry(&on_a, 0, &plain_b, 0, size), b"")
        .await
        .unwrap();
    let f = wait(&mut a.client, id).await;
    assert_ne!(f.status_code, Code::Ok as i32);
    assert!(
        f.status_message.contains(&format!("buffer {}", on_a.id))
            && f.status_message.contains("has no memory"),
        "{}",
        f.status_message
    );
    let id = write(&mut b.client, write_entry(&plain_b, 0, &on_a, 0, size), b"")
        .await
        .unwrap();
    let f = wait(&mut b.client, id).await;
    assert_ne!(f.status_code, Code::Ok as i32, "{}", f.status_message);
    assert!(
        f.status_message.contains(&format!("buffer {}", on_a.id))
            && f.status_message.contains("into the client's pages"),
        "{}",
        f.status_message
    );
    // Both daemons still move bytes between them.
    fill_seed(&mut a.client, plain_a.id, 0, 0, 10).await;
    let id = write(&mut a.client, write_entry(&plain_a, 0, &on_b, 0, size), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(crc(&mut a.client, plain_a.id, 0, size).await, crc32c::crc32c(mb));
    drop((sa, sb));
    // SAFETY: the mapping made above; the sessions (and so the buffers) are gone.
    assert_eq!(unsafe { libc::munmap(pb_.cast(), len) }, 0);
    a.stop().await;
    b.stop().await;
}

fn blocks_at(offsets: &[u64], length: u32) -> pb::register_blocks_request::Layout {
    pb::register_blocks_request::Layout::Uniform(pb::UniformBlocks {
        offsets: offsets.iter().flat_map(|x| x.to_le_bytes()).collect(),
        length,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_lists_over_client_pages_move_across_nodes() {
    let (mut a, mut b) = pair("pages-blk").await;
    const N: usize = 64;
    const BS: u32 = 5000; // odd sizes: pieces straddle chunks
    let size = MIB as usize;
    let p = anonymous(size);
    let mine = bytes(p, size);
    for (i, x) in mine.iter_mut().enumerate() {
        *x = (i * 31 + 7) as u8;
    }
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send(1, register(p as u64, MIB)).await;
    let pages = s.registered(1).await.expect("registered");
    let far = host_buffer(&mut b.client, MIB, "").await;
    let src_offs: Vec<u64> = (0..N as u64).map(|k| 3 + k * 9001 % (MIB - 6000)).collect();
    let dst_offs: Vec<u64> = (0..N as u64).map(|k| 11 + (N as u64 - 1 - k) * 6000).collect();
    let sl = list(&mut a.client, pages.id, blocks_at(&src_offs, BS)).await;
    let dl = list(&mut b.client, far.id, blocks_at(&dst_offs, BS)).await;
    let all: Vec<u32> = (0..N as u32).collect();
    // WRITE: gathered from the client's pages.
    let fin = a
        .client
        .write_blocks(write_request(&sl, u32s(&all), &dl, u32s(&all), true))
        .await
        .expect("write_blocks")
        .into_inner()
        .r#final
        .expect("final");
    assert_eq!(fin.status_code, 0, "{}", fin.status_message);
    for k in 0..N {
        let (so, d) = (src_offs[k] as usize, dst_offs[k]);
        assert_eq!(
            crc(&mut b.client, far.id, d, u64::from(BS)).await,
            crc32c::crc32c(&mine[so..so + BS as usize]),
            "block {k}"
        );
    }
    // READ: scattered into the client's pages, blocks swapped round.
    fill_seed(&mut b.client, far.id, 0, 0, 21).await;
    let rev: Vec<u32> = all.iter().rev().copied().collect();
    let fin = a
        .client
        .read_blocks(read_request(&dl, u32s(&rev), &sl, u32s(&all), true))
        .await
        .expect("read_blocks")
        .into_inner()
        .r#final
        .expect("final");
    assert_eq!(fin.status_code, 0, "{}", fin.status_message);
    for k in 0..N {
        let (so, d) = (src_offs[k] as usize, dst_offs[N - 1 - k]);
        assert_eq!(
            crc32c::crc32c(&mine[so..so + BS as usize]),
            crc(&mut b.client, far.id, d, u64::from(BS)).await,
            "block {k}"
        );
    }
    drop(s);
    // SAFETY: the mapping made above; the session (and so the buffer) is gone.
    assert_eq!(unsafe { libc::munmap(p.cast(), size) }, 0);
    a.stop().await;
    b.stop().await;
}
