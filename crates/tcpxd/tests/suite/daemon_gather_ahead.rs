//! Block sends gathered a window ahead (`transfer.gather_ahead`, and `transfer.host_gather_ahead`
//! for these host buffers; docs/BLOCKS.md "The driver")
//! between two daemons on loopback over the built-in emulation: with `send_window = 2` and
//! `gather_ahead = 3`, a block WRITE and a block READ of thousands of small chunks keep up to 5
//! sends posted per lane (2 in the plugin, 3 gathered and held), never more, land byte-exact
//! under both protocols, and every lane drains to zero.
//!
//! The lanes are kept full by the emulation's hold gate (`common::hold`), not by pacing: closed
//! before each transfer is posted, it lets the senders write 64 KiB and then holds their sends
//! in the plugin, so the driver gathers ahead whatever the machine's load; the test opens it
//! once a lane holds more than its send window, and samples the lanes until the transfer ends.

use crate::common::blocks::{self, permutation, read_request, strided, u32s, write_request};
use crate::common::daemons::{self, *};
use crate::common::hold;
use crate::common::windows::{self, Posted};
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;
/// Blocks of 1000 bytes in 4 KiB chunks: each chunk is gathered from 4-5 pieces.
const N: u32 = 4000;
const BS: u64 = 1000;
const SIZE: u64 = 8 * MIB;

/// A strided list of `N` blocks of `BS` bytes at `first`, `stride` apart.
async fn list(c: &mut Client, buffer: u64, first: u64, stride: u64) -> pb::BlockList {
    blocks::list(c, buffer, strided(first, stride, BS as u32, N)).await
}

/// With the hold gate closed before transfer `id` of `c` was posted: waits until one of the
/// sender's lanes (`on`) holds more sends than its window (gathered ahead), opens the gate, and
/// waits for the transfer, sampling those lanes meanwhile. The most posted on one lane.
async fn wait_sampling(c: &Client, id: u64, on: &mut Client) -> u32 {
    let bound = "send_window 2 + gather_ahead 3";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let held = loop {
        let n = windows::most_posted(on, Posted::Sends).await;
        assert!(n <= 5, "{n} sends posted on a lane: {bound} at most");
        if n > 2 {
            break n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no send gathered ahead within 30 s with the senders held (most {n})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    };
    hold::open_gate();
    held.max(windows::wait_sampling(c, id, on, Posted::Sends, 5, bound).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_sends_gather_a_window_ahead_and_land_byte_exact() {
    hold::gate_on_with_budget(64 << 10);
    tcpxd::logging::init("warn");
    let config = std::env::temp_dir().join(format!("tcpxd-gather-ahead-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        "[transfer]\nsend_window = 2\ngather_ahead = 3\nhost_gather_ahead = 3\n",
    )
    .unwrap();
    for protocol in ["rendezvous", "eager"] {
        let args = |args: &mut tcpxd::config::DaemonArgs| {
            args.transfer_protocol = Some(protocol.into());
            args.config = Some(config.clone());
            args.chunk_bytes = Some(4096);
        };
        let mut a = daemons::start("ahead-a", args).await;
        let mut b = daemons::start("ahead-b", args).await;
        connect(&mut a, &b).await;
        let src = host_buffer(&mut a.client, SIZE, "").await;
        let dst = host_buffer(&mut b.client, SIZE, "").await;
        fill_seed(&mut a.client, src.id, 0, 0, 21).await;
        // Gaps between the blocks on both sides; pairs permuted.
        let sl = list(&mut a.client, src.id, 5, BS + 24).await;
        let dl = list(&mut b.client, dst.id, 17, BS + 100).await;
        let (li, ri) = (permutation(N, 3), permutation(N, 7));
        hold::close_gate();
        let started = a
            .client
            .write_blocks(write_request(&sl, u32s(&li), &dl, u32s(&ri), false))
            .await
            .expect("write_blocks")
            .into_inner();
        assert_eq!(started.total_bytes, u64::from(N) * BS);
        let b_client = &mut b.client.clone();
        let most = wait_sampling(&a.client, started.transfer_id, &mut a.client.clone()).await;
        assert!(
            most > 2,
            "{protocol}: the WRITE never had a send gathered ahead (most {most})"
        );
        let s = bytes(&mut a.client, src.id, 0, SIZE).await;
        let d = bytes(b_client, dst.id, 0, SIZE).await;
        for k in 0..N as usize {
            let so = (5 + u64::from(li[k]) * (BS + 24)) as usize;
            let d_o = (17 + u64::from(ri[k]) * (BS + 100)) as usize;
            assert!(
                s[so..][..BS as usize] == d[d_o..][..BS as usize],
                "{protocol}: WRITE pair {k} differs"
            );
        }

        // READ them back from b (b gathers): into a second list at a, in order.
        let back = host_buffer(&mut a.client, SIZE, "").await;
        let bl = list(&mut a.client, back.id, 0, BS).await;
        let all: Vec<u32> = (0..N).collect();
        hold::close_gate();
        let started = a
            .client
            .read_blocks(read_request(&dl, u32s(&all), &bl, u32s(&all), false))
            .await
            .expect("read_blocks")
            .into_inner();
        let most = wait_sampling(&a.client, started.transfer_id, b_client).await;
        assert!(
            most > 2,
            "{protocol}: the READ never had a send gathered ahead (most {most})"
        );
        let r = bytes(&mut a.client, back.id, 0, SIZE).await;
        for k in 0..N as usize {
            let d_o = (17 + k as u64 * (BS + 100)) as usize;
            assert!(
                r[k * BS as usize..][..BS as usize] == d[d_o..][..BS as usize],
                "{protocol}: READ block {k} differs"
            );
        }
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(b_client).await;
        a.stop().await;
        b.stop().await;
    }
    let _ = std::fs::remove_file(config);
}
