//! Spread plans (`EngineConfig::spread_min_chunk`, `plan::spread_chunk_bytes`, issue #38): a plain
//! transfer of fewer than two chunks per lane of its protocol is cut into smaller chunks, the size
//! carried in its header or offer, so the receiver plans the same chunks with nothing new.

use super::*;
use crate::plan::spread_chunk_bytes;

const KIB: u32 = 1024;

#[test]
fn the_spread_chunk_halves_until_two_chunks_a_lane_or_the_floor() {
    let c = 512 * KIB;
    let floor = 128 * KIB;
    assert_eq!(
        spread_chunk_bytes(&[1 << 20], c, 2, floor, 2),
        256 * KIB,
        "1 MiB, 2 lanes: 4 chunks"
    );
    assert_eq!(
        spread_chunk_bytes(&[1 << 20], c, 4, floor, 2),
        128 * KIB,
        "4 lanes: 8 chunks"
    );
    assert_eq!(spread_chunk_bytes(&[512 << 10], c, 2, floor, 2), 128 * KIB);
    assert_eq!(
        spread_chunk_bytes(&[200_000], c, 2, floor, 2),
        128 * KIB,
        "as far as the floor goes"
    );
    assert_eq!(
        spread_chunk_bytes(&[64 << 10], c, 2, floor, 2),
        c,
        "too small to halve: as given"
    );
    assert_eq!(
        spread_chunk_bytes(&[16 << 20], c, 2, floor, 2),
        c,
        "enough chunks already"
    );
    assert_eq!(
        spread_chunk_bytes(&[2 << 20], c, 2, floor, 2),
        c,
        "two a lane already"
    );
    assert_eq!(spread_chunk_bytes(&[1 << 20], c, 2, 0, 2), c, "off");
    assert_eq!(
        spread_chunk_bytes(&[256 << 10, 256 << 10], c, 2, floor, 2),
        128 * KIB,
        "ranges count together"
    );
    assert_eq!(spread_chunk_bytes(&[0], c, 2, 4096, 2), c, "nothing to move");
    // A chunk size that is no multiple of 4 KiB halves to one.
    assert_eq!(spread_chunk_bytes(&[100_000], 100_000, 2, 4096, 2), 24 * KIB);
    // Never below the smallest chunk, whatever the floor says.
    assert_eq!(spread_chunk_bytes(&[8192], 8192, 16, 1, 2), 4096);
}

#[test]
fn more_chunks_a_lane_halve_further_down_to_the_floor() {
    let c = 512 * KIB;
    let floor = 128 * KIB;
    assert_eq!(
        spread_chunk_bytes(&[1 << 20], c, 2, floor, 4),
        128 * KIB,
        "1 MiB, 2 lanes, 4 a lane: 8 chunks"
    );
    assert_eq!(
        spread_chunk_bytes(&[1 << 20], c, 2, 64 * KIB, 8),
        64 * KIB,
        "8 a lane: 16 chunks"
    );
    assert_eq!(
        spread_chunk_bytes(&[1 << 20], c, 2, floor, 8),
        128 * KIB,
        "the floor still holds"
    );
    assert_eq!(
        spread_chunk_bytes(&[2 << 20], c, 2, floor, 4),
        256 * KIB,
        "2 MiB: two a lane at 512 KiB, four at 256 KiB"
    );
    assert_eq!(
        spread_chunk_bytes(&[4 << 20], c, 2, floor, 4),
        c,
        "four a lane already"
    );
    assert_eq!(
        spread_chunk_bytes(&[1 << 20], c, 2, floor, 1),
        c,
        "one a lane: two chunks of 512 KiB are enough"
    );
    assert_eq!(spread_chunk_bytes(&[1 << 20], c, 2, floor, 0), c, "0 counts as 1");
}

/// Auto, 2 rendezvous lanes and 2 GPU credit lanes per peer, 16 KiB chunks spread down to 4 KiB.
pub(super) fn spread_cfg(min: u32) -> EngineConfig {
    EngineConfig {
        protocol: Protocol::Auto,
        eager_lanes: 2,
        eager_max_bytes: 16 * 1024,
        gpu_credits: true,
        chunk_bytes: 16 * KIB,
        spread_min_chunk: min,
        ..EngineConfig::default()
    }
}

/// The chunk size of the first header or offer queued towards node 1.
fn announced_chunk(s: &Sim) -> u32 {
    s.ctrl[1]
        .iter()
        .find_map(|m| match m {
            PeerMsg::Header(h) | PeerMsg::Offer(h) => Some(h.chunk_bytes),
            _ => None,
        })
        .expect("a header or an offer")
}

#[test]
fn a_transfer_of_few_chunks_goes_in_smaller_ones_and_lands_whole() {
    // (floor, chunks a lane, the GPU WRITE's chunk, the host WRITE's); four a lane: 32 KiB as
    // eight chunks of 4 KiB, 48 KiB as twelve.
    for (min, per_lane, gpu_chunk, host_chunk) in [
        (0, 2, 16 * KIB, 16 * KIB),
        (4096, 2, 8 * KIB, 8 * KIB),
        (4096, 4, 4 * KIB, 4 * KIB),
    ] {
        let cfg = EngineConfig {
            spread_chunks_per_lane: per_lane,
            ..spread_cfg(min)
        };
        let mut s = Sim::new(2, cfg, 71);
        s.gpu_buffer(1, 2, 1 << 20, 0, 0);
        s.buffer(1, 3, 1 << 20, 0);
        s.buffer(0, 1, 1 << 20, 5);
        s.run();
        // Into GPU memory by credits: 32 KiB over the 2 credit lanes, 4 chunks of 8 KiB spread.
        let t = s.write(0, 1, 0, 2, 0, 32 * 1024);
        s.drain();
        assert_eq!(
            announced_chunk(&s),
            gpu_chunk,
            "min {min}: the header's chunk size"
        );
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        assert!(s.same((0, 1, 0), (1, 2, 0), 32 * 1024), "min {min}: byte-exact");
        // Into host memory above eager_max: an offer over the 2 rendezvous lanes, 48 KiB (3
        // chunks of 16 KiB, 6 of 8 KiB spread).
        let t = s.write(0, 1, 4096, 3, 100, 48 * 1024);
        s.drain();
        assert_eq!(
            announced_chunk(&s),
            host_chunk,
            "min {min}: the offer's chunk size"
        );
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        assert!(
            s.same((0, 1, 4096), (1, 3, 100), 48 * 1024),
            "min {min}: byte-exact"
        );
        // A READ into the reader's GPU memory: the holder spreads its sends the same way.
        let t = s.read(1, 1, 0, 2, 64 * 1024, 20 * 1024);
        s.run();
        assert_eq!(s.outcome(1, t).code, Code::Ok);
        assert!(s.same((0, 1, 0), (1, 2, 64 * 1024), 20 * 1024));
        s.assert_idle();
    }
}

/// The chunk sizes of the headers and offers queued towards node 1, in order.
fn announced_chunks(s: &Sim) -> Vec<u32> {
    s.ctrl[1]
        .iter()
        .filter_map(|m| match m {
            PeerMsg::Header(h) | PeerMsg::Offer(h) => Some(h.chunk_bytes),
            _ => None,
        })
        .collect()
}

#[test]
fn only_a_transfer_alone_on_the_lanes_is_spread() {
    let mut s = Sim::new(2, spread_cfg(4096), 73);
    s.gpu_buffer(1, 2, 1 << 20, 0, 0);
    s.buffer(0, 1, 1 << 20, 5);
    s.run();
    // Two WRITEs of 32 KiB started together: the first is alone when it is planned (4 chunks of
    // 8 KiB over the 2 credit lanes), the second finds it on the lanes and keeps 16 KiB chunks.
    let a = s.write(0, 1, 0, 2, 0, 32 * 1024);
    let b = s.write(0, 1, 32 * 1024, 2, 32 * 1024, 32 * 1024);
    s.drain();
    assert_eq!(announced_chunks(&s), [8 * KIB, 16 * KIB]);
    s.run();
    for t in [a, b] {
        assert_eq!(s.outcome(0, t).code, Code::Ok);
    }
    assert!(s.same((0, 1, 0), (1, 2, 0), 64 * 1024), "byte-exact");
    // Alone again once both ended: spread.
    let c = s.write(0, 1, 0, 2, 128 * 1024, 32 * 1024);
    s.drain();
    assert_eq!(announced_chunks(&s), [8 * KIB]);
    s.run();
    assert_eq!(s.outcome(0, c).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 128 * 1024), 32 * 1024));
    // A READ served beside a WRITE of the holder's own: the holder plans the READ's sends with
    // the WRITE on the lanes, so they keep the chunk size.
    let w = s.write(0, 1, 0, 2, 256 * 1024, 32 * 1024);
    let r = s.read(1, 1, 0, 2, 512 * 1024, 20 * 1024);
    s.run();
    assert_eq!(s.outcome(0, w).code, Code::Ok);
    assert_eq!(s.outcome(1, r).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 512 * 1024), 20 * 1024));
    s.assert_idle();
}
