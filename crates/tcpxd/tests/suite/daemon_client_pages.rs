//! Host memory a client registers by address (anonymous memory, no file to hand over): the
//! daemon reads and writes the client's pages by cross-memory attach, the client's process taken
//! from the socket's peer credentials. The daemons run in this test process, so the client is
//! this process: its Vecs are registered and checked byte for byte. Within one node such a
//! buffer moves both ways; a transfer with another node naming it is refused saying why.

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
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_memory_moves_both_ways_within_the_node_and_is_refused_across() {
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

    // Across nodes: refused, started here or by the peer, naming why.
    connect(&mut a, &b).await;
    let far = host_buffer(&mut b.client, MIB, "").await;
    let e = write(&mut a.client, write_entry(&pages, 0, &far, 0, 4096), b"")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    assert!(
        e.message().contains("cross-memory attach") && e.message().contains("host_array"),
        "{}",
        e.message()
    );
    let id = read(&mut b.client, read_entry(&pages, 0, &far, 0, 4096))
        .await
        .unwrap();
    let f = wait(&mut b.client, id).await;
    assert_eq!(
        f.status_code,
        Code::FailedPrecondition as i32,
        "{}",
        f.status_message
    );
    assert!(
        f.status_message.contains("moves only within this node"),
        "{}",
        f.status_message
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
