//! `runtime.lane_thread`'s receive side (session 31): a receive lane's comm, once accepted, is
//! driven by the lane thread of its GPU — posts, tests, unpacks and consumes. Each test turns
//! the key on for the receiving daemon only, so a `tcpxd-lanes` thread there can only be the
//! receive side's (until that daemon sends), and checks bytes, ends and the lanes' counts back
//! at zero.

use std::time::{Duration, Instant};

use super::{set_env, threads_named};
use crate::common::blocks::{list, permutation, strided, u32s, write_request};
use crate::common::daemons::{self, *};
use crate::common::gpus::{cuda_buffer, with_config};
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Small transfers stay on the lanes (not inline on the control connection).
const NO_INLINE: &str = "[transfer]\ninline_max_bytes = 0\n";

fn on(tag: &str) -> impl FnOnce(&mut tcpxd::config::DaemonArgs) + use<> {
    let cfg = with_config(tag, NO_INLINE);
    move |a| {
        cfg(a);
        a.lane_thread = Some("on".into());
    }
}

fn off(tag: &str) -> impl FnOnce(&mut tcpxd::config::DaemonArgs) + use<> {
    let cfg = with_config(tag, NO_INLINE);
    move |a| {
        cfg(a);
        a.lane_thread = Some("off".into());
    }
}

/// Waits until transfer `id` has moved bytes (or finished).
async fn until_moving(c: &mut Client, id: u64) {
    let mut events = c
        .watch(pb::WatchRequest { transfer_id: id })
        .await
        .expect("watch")
        .into_inner();
    while let Some(e) = events.message().await.expect("watch stream") {
        if e.state == pb::TransferState::Finished as i32 || e.bytes_done > 0 {
            return;
        }
    }
}

/// `n` WRITEs of `size` from `src` into `dst` (same offsets), all in flight, then each waited.
async fn writes(c: &mut Client, src: &pb::Buffer, dst: &pb::Buffer, n: u64, size: u64) {
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(
            write(c, write_entry(src, i * size, dst, i * size, size), b"")
                .await
                .unwrap(),
        );
    }
    for id in ids {
        wait_ok(c, id).await;
    }
}

/// `n` READs of `size` from `remote` into `local` (same offsets), all in flight, then waited.
async fn reads(c: &mut Client, remote: &pb::Buffer, local: &pb::Buffer, n: u64, size: u64) {
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(
            read(c, read_entry(remote, i * size, local, i * size, size))
                .await
                .unwrap(),
        );
    }
    for id in ids {
        wait_ok(c, id).await;
    }
}

/// 16 in flight both ways into the daemon whose receive lanes are on its lane thread: 64 KiB
/// (eager credits, `Land` orders), 256 KiB (rendezvous receives into the buffer), then block
/// lists scattered from its landing ring — every byte where it belongs, every lane drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receives_on_the_lane_thread_move_16_in_flight_exactly_plain_and_scattered() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("lanerecv-a", off("lanerecv-a")).await;
    let mut b = daemons::start("lanerecv-b", on("lanerecv-b")).await;
    connect(&mut a, &b).await;
    let n = 16u64;
    for (round, size) in [64 * KIB, 256 * KIB, 64 * KIB].into_iter().enumerate() {
        let src = host_buffer(&mut a.client, n * size, "").await;
        let dst = host_buffer(&mut b.client, n * size, "").await;
        let back = host_buffer(&mut b.client, n * size, "").await;
        fill_seed(&mut a.client, src.id, 0, 0, 40 + round as u64).await;
        let want = crc(&mut a.client, src.id, 0, n * size).await;
        // a → b: b receives.
        writes(&mut a.client, &src, &dst, n, size).await;
        assert_eq!(
            crc(&mut b.client, dst.id, 0, n * size).await,
            want,
            "WRITE {size}"
        );
        if round == 0 {
            // b has sent nothing on a lane yet: its lane thread is the receive side's.
            assert!(
                !threads_named("tcpxd-lanes").is_empty(),
                "the receiver's lane thread started with its first receive lane"
            );
        }
        // b reads a's bytes: b receives again (a's send lanes, on its poller, carry them).
        reads(&mut b.client, &src, &back, n, size).await;
        assert_eq!(
            crc(&mut b.client, back.id, 0, n * size).await,
            want,
            "READ {size}"
        );
    }
    // Block lists: 200 blocks of 4 KiB, permuted on both sides, written a → b and read by b.
    const N: u32 = 200;
    const BS: u64 = 4096;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 9).await;
    let sl = list(&mut a.client, src.id, strided(0, BS + 512, BS as u32, N)).await;
    let dl = list(&mut b.client, dst.id, strided(7, BS + 64, BS as u32, N)).await;
    let (li, ri) = (permutation(N, 5), permutation(N, 9));
    let fin = a
        .client
        .write_blocks(write_request(&sl, u32s(&li), &dl, u32s(&ri), true))
        .await
        .expect("write_blocks")
        .into_inner()
        .r#final
        .expect("final");
    assert_eq!(fin.status_code, 0, "{}", fin.status_message);
    let s = bytes(&mut a.client, src.id, 0, MIB).await;
    let d = bytes(&mut b.client, dst.id, 0, MIB).await;
    for k in 0..N as usize {
        let so = (u64::from(li[k]) * (BS + 512)) as usize;
        let d_o = (7 + u64::from(ri[k]) * (BS + 64)) as usize;
        assert_eq!(
            &s[so..so + BS as usize],
            &d[d_o..d_o + BS as usize],
            "block pair {k}"
        );
    }
    // And read back by b into a third layout.
    let back = host_buffer(&mut b.client, MIB, "").await;
    let bl = list(&mut b.client, back.id, strided(0, BS, BS as u32, N)).await;
    let fin = b
        .client
        .read_blocks(crate::common::blocks::read_request(
            &sl,
            u32s(&li),
            &bl,
            u32s(&(0..N).collect::<Vec<_>>()),
            true,
        ))
        .await
        .expect("read_blocks")
        .into_inner()
        .r#final
        .expect("final");
    assert_eq!(fin.status_code, 0, "{}", fin.status_message);
    let r = bytes(&mut b.client, back.id, 0, MIB).await;
    for (k, &l) in li.iter().enumerate() {
        let so = (u64::from(l) * (BS + 512)) as usize;
        let bo = k * BS as usize;
        assert_eq!(
            &s[so..so + BS as usize],
            &r[bo..bo + BS as usize],
            "read block {k}"
        );
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

/// Transfers into the lane thread's receive lanes cancelled or past their deadline mid-flight
/// (paced sends: they are still moving) end as they should, and every slot and credit comes
/// back to zero on both sides; the next transfers are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_deadline_mid_flight_give_every_receive_slot_and_credit_back() {
    tcpxd::logging::init("error");
    set_env("TCPXEMU_RATE_GBPS", "2");
    let mut a = daemons::start("lanerecv-cancel-a", off("lanerecv-cancel-a")).await;
    let mut b = daemons::start("lanerecv-cancel-b", on("lanerecv-cancel-b")).await;
    connect(&mut a, &b).await;
    let size = 4 * MIB;
    let n = 16u64;
    let src = host_buffer(&mut a.client, n * size, "").await;
    let dst = host_buffer(&mut b.client, n * size, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 5).await;
    // Half WRITEs (b receives) with a deadline too short for them, half READs by b.
    let mut cancelled = Vec::new();
    let mut timed = Vec::new();
    for i in 0..n / 2 {
        let id = a
            .client
            .write(pb::WriteRequest {
                entry: Some(write_entry(&src, i * size, &dst, i * size, size)),
                timeout_ms: 40,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .transfer_id;
        timed.push(id);
    }
    for i in n / 2..n {
        let e = read_entry(&src, i * size, &dst, i * size, size);
        cancelled.push(read(&mut b.client, e).await.unwrap());
    }
    // Once b's READs move, cancel them.
    until_moving(&mut b.client, cancelled[0]).await;
    for &id in &cancelled {
        b.client
            .cancel(pb::CancelRequest { transfer_id: id })
            .await
            .unwrap();
    }
    for id in cancelled {
        let e = wait(&mut b.client, id).await;
        assert!(
            e.status_code == 0 || e.status_code == tonic::Code::Cancelled as i32,
            "READ {id}: {} {}",
            e.status_code,
            e.status_message
        );
    }
    let mut late = 0;
    for id in timed {
        let e = wait(&mut a.client, id).await;
        if e.status_code != 0 {
            late += 1;
            assert_eq!(
                e.status_code,
                tonic::Code::DeadlineExceeded as i32,
                "WRITE {id}: {}",
                e.status_message
            );
        }
    }
    assert!(late > 0, "a 40 ms deadline passes on 4 MiB paced at 2 Gbit/s");
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    // The next transfers are exact.
    fill_seed(&mut a.client, src.id, 0, 0, 6).await;
    writes(&mut a.client, &src, &dst, 4, MIB).await;
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 4 * MIB).await,
        crc(&mut a.client, src.id, 0, 4 * MIB).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

/// The peer killed while the lane thread holds its receives (READs in flight, paced): they fail
/// UNAVAILABLE at once, not at their deadline; the lanes drain; a new peer process on the same
/// address pairs again and the next READs are exact on a new lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_killed_while_the_lane_thread_holds_receives_fails_them_and_pairs_again() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("lanerecv-loss-a", on("lanerecv-loss-a")).await;
    let port = procs::free_port();
    let size = 4 * MIB;
    let n = 16u64;
    for round in 0..2 {
        let mut c = procs::spawn("lanerecv-loss-c", port, NO_INLINE, &[("TCPXEMU_RATE_GBPS", "1")]).await;
        let mut cc = c.client().await;
        a.client
            .connect_peer(pb::ConnectPeerRequest {
                address: c.peer_addr.clone(),
            })
            .await
            .expect("a pairs with c");
        let src = host_buffer(&mut cc, n * size, "").await;
        let dst = host_buffer(&mut a.client, n * size, "").await;
        fill_seed(&mut cc, src.id, 0, 0, 30 + round).await;
        if round == 1 {
            // The last round is not killed: its READs are exact.
            reads(&mut a.client, &src, &dst, n, MIB).await;
            assert_eq!(
                crc(&mut a.client, dst.id, 0, n * MIB).await,
                crc(&mut cc, src.id, 0, n * MIB).await
            );
            break;
        }
        let mut ids = Vec::new();
        for i in 0..n {
            let e = read_entry(&src, i * size, &dst, i * size, size);
            ids.push(read(&mut a.client, e).await.unwrap());
        }
        until_moving(&mut a.client, ids[0]).await;
        c.kill();
        let killed = Instant::now();
        let mut failed = 0;
        for id in ids {
            let e = wait(&mut a.client, id).await;
            if e.status_code == 0 {
                continue;
            }
            failed += 1;
            assert_eq!(
                e.status_code,
                tonic::Code::Unavailable as i32,
                "READ {id}: {}",
                e.status_message
            );
        }
        assert!(failed > 0, "the kill failed the READs in flight");
        // (Their deadline is two minutes away.)
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "failed {:?} after the kill",
            killed.elapsed()
        );
        assert_lanes_drain(&mut a.client).await;
    }
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
}

/// The panic hook fires on the lane thread that holds the receiver's receives (its 40th post:
/// credit receives and receives together): the transfers it carried end at once, not at their
/// deadline, every slot and credit comes back on both sides, and a new lane thread receives the
/// next transfers byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_thread_that_panics_holding_receives_fails_them_at_once_and_the_next_work_moves() {
    tcpxd::logging::init("error");
    set_env("TCPXD_TEST_LANE_THREAD_PANIC_AT", "40");
    set_env("TCPXEMU_RATE_GBPS", "4");
    let mut a = daemons::start("lanerecv-panic-a", off("lanerecv-panic-a")).await;
    let mut b = daemons::start("lanerecv-panic-b", on("lanerecv-panic-b")).await;
    connect(&mut a, &b).await;
    let n = 8u64;
    let chunk = 16 * MIB;
    let src = host_buffer(&mut a.client, n * chunk, "").await;
    let dst = host_buffer(&mut b.client, n * chunk, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 3).await;
    // b READs (its thread posts the receives).
    let mut ids = Vec::new();
    for i in 0..n {
        let e = read_entry(&src, i * chunk, &dst, i * chunk, chunk);
        ids.push(read(&mut b.client, e).await.unwrap());
    }
    let started = Instant::now();
    let mut failed = 0;
    for id in ids {
        let e = wait(&mut b.client, id).await;
        if e.status_code == 0 {
            continue;
        }
        failed += 1;
        assert_eq!(
            e.status_code,
            tonic::Code::Unavailable as i32,
            "READ {id}: {}",
            e.status_message
        );
        assert!(
            e.status_message.contains("lane thread tcpxd-lanes")
                && e.status_message
                    .contains(" panicked: TCPXD_TEST_LANE_THREAD_PANIC_AT"),
            "READ {id}: {}",
            e.status_message
        );
    }
    assert!(failed > 0, "the panic failed the READs in flight");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "failed at once, not at the deadline"
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    for round in 0..2 {
        fill_seed(&mut a.client, src.id, 0, 0, 20 + round).await;
        reads(&mut b.client, &src, &dst, n, chunk).await;
        writes(&mut a.client, &src, &dst, n, MIB).await;
        assert_eq!(
            crc(&mut b.client, dst.id, 0, n * chunk).await,
            crc(&mut a.client, src.id, 0, n * chunk).await,
            "round {round}"
        );
    }
    assert!(!threads_named("tcpxd-lanes").is_empty(), "a new lane thread");
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

/// The threads of process `pid` whose names start with `name`.
fn threads_of(pid: u32, name: &str) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the daemon's threads")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim_end().to_string())
        .filter(|c| c.starts_with(name))
        .collect()
}

/// On the CUDA stand-in (two `tcpxd` processes, credits on GPU lanes, the `d2d` unpacker on
/// the lane threads' own GPU stages): 16 WRITEs and 16 READs of 64 KiB and of 256 KiB in flight
/// between GPU buffers, byte-exact, and the lanes drained; the receiver has its GPU's lane
/// thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_receives_on_the_lane_thread_move_16_in_flight_exactly_on_the_cuda_stand_in() {
    use crate::common::gpus::{Compare, assert_equal};
    use crate::daemon_stub_gpus::start_with;
    let dir = tcpxd_testkit::ScratchDir::fresh("tcpxd-lanerecv-gpus", "d2d");
    std::fs::create_dir_all(&*dir).unwrap();
    let env = [("TCPXD_LANE_THREAD", "on"), ("TCPXD_INLINE_MAX_BYTES", "0")];
    let mut a = start_with(&dir, "lanerecv-gpu-a", "d2d", 1, true, &env).await;
    let mut b = start_with(&dir, "lanerecv-gpu-b", "d2d", 1, true, &env).await;
    let n = 16u64;
    for (round, size) in [64 * KIB, 256 * KIB].into_iter().enumerate() {
        let src = cuda_buffer(&mut a.client, 0, n * size).await;
        let dst = cuda_buffer(&mut b.client, 1, n * size).await;
        let back = cuda_buffer(&mut a.client, 2, n * size).await;
        fill_seed(&mut a.client, src.id, 0, 0, 60 + round as u64).await;
        writes(&mut a.client, &src, &dst, n, size).await;
        let what = format!("{n} WRITEs of {size} bytes GPU 0 -> GPU 1");
        assert_equal(
            Compare::Bytes,
            &mut a.client,
            (src.id, 0),
            &mut b.client,
            (dst.id, 0),
            n * size,
            &what,
        )
        .await;
        if round == 0 {
            let names = threads_of(b.pid(), "tcpxd-lanes-");
            assert!(!names.is_empty(), "the receiver's GPU lane thread: {names:?}");
        }
        reads(&mut a.client, &dst, &back, n, size).await;
        let what = format!("{n} READs of {size} bytes GPU 1 -> GPU 2");
        assert_equal(
            Compare::Bytes,
            &mut b.client,
            (dst.id, 0),
            &mut a.client,
            (back.id, 0),
            n * size,
            &what,
        )
        .await;
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}
