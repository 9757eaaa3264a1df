//! Block receives posted a window ahead (`transfer.scatter_ahead`, docs/BLOCKS.md "Receiving
//! into host memory") between two daemons on loopback over the built-in emulation in its direct
//! receive mode (host receives land where they were posted, as on the real plugin), the
//! scatters on copy helpers: with `recv_window = 2` and `scatter_ahead = 3`, a block WRITE and a
//! block READ of ~120 chunks of scattered blocks keep up to 5 receives posted per lane (at most 2
//! in the plugin: one more would fail the lane), never more, land byte-exact, and every lane
//! drains to zero.
//!
//! The receives are caught posted ahead by the emulation's hold gate (`common::hold`), not by
//! pacing the NICs: closed before each transfer is posted, it lets the senders write 64 KiB and
//! then holds their sends, so the receiver's lanes sit with their receives posted (the engine
//! posts them as it plans, whatever has landed) however loaded the machine; the test opens it
//! once a lane holds more than its receive window, and samples the lanes until the transfer ends.

use crate::common::blocks::{self, permutation, read_request, strided, u32s, write_request};
use crate::common::daemons::{self, *};
use crate::common::hold;
use crate::common::windows::{self, Posted};
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;
/// Blocks of 4000 bytes in 64 KiB chunks (copied on a helper: 32 KiB or more), 16-17 pieces each.
const N: u32 = 2000;
const BS: u64 = 4000;
const SIZE: u64 = 16 * MIB;

async fn list(c: &mut Client, buffer: u64, first: u64, stride: u64) -> pb::BlockList {
    blocks::list(c, buffer, strided(first, stride, BS as u32, N)).await
}

/// With the hold gate closed before transfer `id` of `c` was posted: waits until one of the
/// receiver's lanes (`on`) holds more receives than its window (posted ahead), opens the gate,
/// and waits for the transfer, sampling those lanes meanwhile. The most posted on one lane.
async fn wait_sampling(c: &Client, id: u64, on: &mut Client) -> u32 {
    let bound = "recv_window 2 + scatter_ahead 3";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let held = loop {
        let n = windows::most_posted(on, Posted::Recvs).await;
        assert!(n <= 5, "{n} receives posted on a lane: {bound} at most");
        if n > 2 {
            break n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no receive posted ahead within 30 s with the senders held (most {n})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    };
    hold::open_gate();
    held.max(windows::wait_sampling(c, id, on, Posted::Recvs, 5, bound).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_receives_post_a_window_ahead_and_land_byte_exact() {
    hold::gate_on_with_budget(64 << 10);
    tcpxd::logging::init("warn");
    // SAFETY: each test runs in its own process (nextest) and sets the variable before the
    // emulation is initialised and before any other thread reads the environment.
    unsafe { std::env::set_var("TCPXEMU_HOST_RECV", "direct") };
    let config = std::env::temp_dir().join(format!("tcpxd-scatter-ahead-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        "[transfer]\nrecv_window = 2\nscatter_ahead = 3\nhost_copy_threads = 2\n",
    )
    .unwrap();
    let args = |args: &mut tcpxd::config::DaemonArgs| {
        args.transfer_protocol = Some("rendezvous".into());
        args.config = Some(config.clone());
        args.chunk_bytes = Some(65536);
    };
    let mut a = daemons::start("scatter-ahead-a", args).await;
    let mut b = daemons::start("scatter-ahead-b", args).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, SIZE, "").await;
    let dst = host_buffer(&mut b.client, SIZE, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 31).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 32).await;
    // Gaps between the blocks on both sides; pairs permuted.
    let sl = list(&mut a.client, src.id, 5, BS + 24).await;
    let dl = list(&mut b.client, dst.id, 17, BS + 100).await;
    let (li, ri) = (permutation(N, 5), permutation(N, 9));
    hold::close_gate();
    let started = a
        .client
        .write_blocks(write_request(&sl, u32s(&li), &dl, u32s(&ri), false))
        .await
        .expect("write_blocks")
        .into_inner();
    let b_client = &mut b.client.clone();
    let most = wait_sampling(&a.client, started.transfer_id, b_client).await;
    assert!(
        most > 2,
        "the WRITE never had a receive posted ahead (most {most})"
    );
    let s = bytes(&mut a.client, src.id, 0, SIZE).await;
    let d = bytes(b_client, dst.id, 0, SIZE).await;
    for k in 0..N as usize {
        let so = (5 + u64::from(li[k]) * (BS + 24)) as usize;
        let d_o = (17 + u64::from(ri[k]) * (BS + 100)) as usize;
        assert!(
            s[so..][..BS as usize] == d[d_o..][..BS as usize],
            "WRITE pair {k} differs"
        );
    }

    // READ them back from b (b gathers, a scatters): into a second list at a, with gaps, the
    // pairs permuted.
    let back = host_buffer(&mut a.client, SIZE, "").await;
    let bl = list(&mut a.client, back.id, 3, BS + 50).await;
    let all: Vec<u32> = (0..N).collect();
    let into = permutation(N, 13);
    hold::close_gate();
    let started = a
        .client
        .read_blocks(read_request(&dl, u32s(&all), &bl, u32s(&into), false))
        .await
        .expect("read_blocks")
        .into_inner();
    let most = wait_sampling(&a.client, started.transfer_id, &mut a.client.clone()).await;
    assert!(
        most > 2,
        "the READ never had a receive posted ahead (most {most})"
    );
    let r = bytes(&mut a.client, back.id, 0, SIZE).await;
    for (k, &to) in into.iter().enumerate() {
        let d_o = (17 + k as u64 * (BS + 100)) as usize;
        let r_o = (3 + u64::from(to) * (BS + 50)) as usize;
        assert!(
            r[r_o..][..BS as usize] == d[d_o..][..BS as usize],
            "READ block {k} differs"
        );
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(b_client).await;
    a.stop().await;
    b.stop().await;
    let _ = std::fs::remove_file(config);
}
