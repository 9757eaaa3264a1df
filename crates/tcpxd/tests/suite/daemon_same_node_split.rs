//! Same-node copies split over several threads (`transfer.host_copy_threads` workers, each
//! taking 4 MiB chunks in turn with its own bounce buffer): byte-exact between two buffers of
//! client pages (two copies a chunk), between client pages and the daemon's host memory (one),
//! and between host buffers, in 4 MiB chunks or many small pieces; a cancel or a deadline stops every worker, the transfer reports
//! as with one thread, and what it reports landed does not grow afterwards.

use crate::common::daemons::{self, *};
use crate::common::framed::Framed;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_request::Op;
use tonic::Code;

const MIB: u64 = 1 << 20;

async fn split_daemon(name: &str) -> (TestDaemon, Client) {
    let d = daemons::start(name, |a| a.host_copy_threads = Some(4)).await;
    let other = unix_client(d.daemon.api_socket.clone()).await;
    (d, other)
}

fn register(addr: u64, size: u64) -> Op {
    Op::RegisterClientMemory(pb::RegisterClientMemoryRequest {
        address: addr,
        size,
        label: String::new(),
        ..Default::default()
    })
}

async fn batch(c: &mut Client, entries: Vec<pb::WriteEntry>, timeout_ms: u64) -> pb::TransferEvent {
    c.write_batch(pb::WriteBatchRequest {
        entries,
        timeout_ms,
        wait: true,
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .r#final
    .expect("waited")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_copy_split_over_threads_is_byte_exact() {
    let (mut d, mut b) = split_daemon("split-exact").await;
    let size = 40 * MIB + 12_345;
    let mut src: Vec<u8> = (0..size as usize).map(|i| (i * 13 + i / 4093) as u8).collect();
    let mut dst = vec![0u8; size as usize];
    let mut s = Framed::open(&d.daemon.api_socket).await;
    s.send(1, register(src.as_mut_ptr() as u64, size)).await;
    let from = s.registered(1).await.expect("registered");
    s.send(2, register(dst.as_mut_ptr() as u64, size)).await;
    let to = s.registered(2).await.expect("registered");

    // Client pages to client pages, three entries of odd sizes and offsets (17 chunks).
    let parts = [
        (0, 5, 17 * MIB + 3),
        (17 * MIB + 3, 20 * MIB, 9 * MIB),
        (30 * MIB, 31 * MIB, 9 * MIB + 1),
    ];
    let entries = parts
        .iter()
        .map(|&(s, d, n)| write_entry(&from, s, &to, d, n))
        .collect();
    let f = batch(&mut d.client, entries, 120_000).await;
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    assert_eq!(f.bytes_done, 35 * MIB + 4);
    for &(s, t, n) in &parts {
        let (s, t, n) = (s as usize, t as usize, n as usize);
        assert!(dst[t..t + n] == src[s..s + n], "entry at {s} → {t}");
    }
    assert!(dst[..5].iter().all(|&x| x == 0), "nothing before the first entry");

    // Many small pieces between client pages (runs of them a few calls each): 700 entries of
    // 16 KiB plus odd sizes, scattered and out of order, byte-exact, nothing else touched.
    dst.fill(0);
    let small: Vec<(u64, u64, u64)> = (0..700u64)
        .map(|i| {
            let n = (16 << 10) + (i % 7) * 5;
            (((i * 37) % 700) * (32 << 10) + 1, ((i * 40) << 10) + 3, n)
        })
        .collect();
    let entries = small
        .iter()
        .map(|&(s, d, n)| write_entry(&from, s, &to, d, n))
        .collect();
    let f = batch(&mut d.client, entries, 120_000).await;
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    let mut want = vec![0u8; size as usize];
    for &(s, t, n) in &small {
        let (s, t, n) = (s as usize, t as usize, n as usize);
        want[t..t + n].copy_from_slice(&src[s..s + n]);
    }
    assert!(dst == want, "700 small pieces");

    // Client pages to the daemon's host memory and back (one copy a chunk), whole.
    let host = host_buffer(&mut b, size, "").await;
    let f = batch(
        &mut d.client,
        vec![write_entry(&from, 0, &host, 0, size)],
        120_000,
    )
    .await;
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    assert_eq!(crc(&mut b, host.id, 0, size).await, crc32c::crc32c(&src));
    dst.fill(0);
    let id = read(&mut d.client, read_entry(&host, 0, &to, 0, size))
        .await
        .unwrap();
    wait_ok(&mut d.client, id).await;
    assert!(dst == src, "READ from host memory into client pages");

    // Host buffer to host buffer.
    let other = host_buffer(&mut d.client, size, "").await;
    let f = batch(&mut b, vec![write_entry(&host, 0, &other, 0, size)], 120_000).await;
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    assert_eq!(crc(&mut d.client, other.id, 0, size).await, crc32c::crc32c(&src));
    drop(s);
    let _keep = (&mut src, &mut dst);
    d.stop().await;
}

/// What a stopped split copy reports: its code on the transfer, OK on exactly the entries whose
/// bytes all landed and the code on the others, landed bytes below the total and covering the
/// OK entries, the same figure when asked again later.
async fn check_stopped(c: &mut Client, f: &pb::TransferEvent, code: Code, lens: &[u64]) {
    assert_eq!(f.status_code, code as i32, "{}", f.status_message);
    let total: u64 = lens.iter().sum();
    assert!(f.bytes_done < total, "{} of {total}", f.bytes_done);
    assert_eq!(f.bytes_done % (4 * MIB), 0, "whole chunks landed");
    let mut ok = 0;
    for (e, n) in f.entries.iter().zip(lens) {
        if e.code == 0 {
            ok += n;
        } else {
            assert_eq!(e.code, code as i32, "{}", e.message);
            assert_eq!(e.message, f.status_message);
        }
    }
    assert!(ok <= f.bytes_done && ok < total);
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let again = wait(c, f.transfer_id).await;
    assert_eq!(again.bytes_done, f.bytes_done, "nothing lands after the stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_deadline_stop_every_worker_of_a_split_copy() {
    let (mut d, mut b) = split_daemon("split-stop").await;
    let a = &mut d.client;
    let size = 256 * MIB;
    let src = host_buffer(a, size, "").await;
    let dst = host_buffer(&mut b, size, "").await;
    let lens = [64 * MIB; 4];
    let entries = || {
        (0..4)
            .map(|i| write_entry(&src, i * 64 * MIB, &dst, i * 64 * MIB, 64 * MIB))
            .collect::<Vec<_>>()
    };
    // A deadline of 1 ms: 64 chunks over four threads take longer than that on any machine.
    let f = batch(a, entries(), 1).await;
    check_stopped(a, &f, Code::DeadlineExceeded, &lens).await;

    // Cancel: the copy takes tens of milliseconds, the cancel a round trip (a machine so
    // loaded that the copy ends first sees it ended, OK; five tries).
    let mut cancelled = 0;
    for _ in 0..5 {
        let id = a
            .write_batch(pb::WriteBatchRequest {
                entries: entries(),
                timeout_ms: 120_000,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .transfer_id;
        let c = a
            .cancel(pb::CancelRequest { transfer_id: id })
            .await
            .unwrap()
            .into_inner();
        let e = wait(a, id).await;
        if c.cancelled {
            check_stopped(a, &e, Code::Cancelled, &lens).await;
            cancelled += 1;
            break;
        }
        assert_eq!(e.status_code, 0, "{}", e.status_message);
    }
    assert_eq!(cancelled, 1, "no cancel reached a copy in flight in 5 tries");
    // The next transfer is whole.
    fill_seed(a, src.id, 0, 0, 7).await;
    let f = batch(a, entries(), 120_000).await;
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    assert_eq!(crc(a, src.id, 0, size).await, crc(&mut b, dst.id, 0, size).await);
    d.stop().await;
}
