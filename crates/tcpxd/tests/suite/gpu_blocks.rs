//! GPU tests of the block-transfer kernels (crates/tcpxd/kernels/blocks.cu, src/gpu/blocks.rs). They need a
//! CUDA GPU, so they are ignored by default:
//! `cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 gpu_blocks::`.
//!
//! Each test plans a block transfer with the engine's planner, gathers every chunk on the GPU
//! into a staging slot (checked against the host gather), cuts each chunk into fragments as TCPX
//! leaves them (at most 4 KiB, shuffled over a bounce buffer), scatters them on the GPU, and
//! compares every byte of the destination with a per-block copy. Destinations are poisoned first.

use std::sync::Arc;

use tcpxd::engine::blocks::{BlockList, IndexArray, Layout, Segment, SidePlan};
use tcpxd::gpu::blocks::{BLOCK_TASKS, BlockSignal, GatherTask, INLINE_CAPS, ScatterTask};
use tcpxd::gpu::{DeviceRegion, Gpu, Kernels, PinnedRegion, Stream};
use tcpxd::net::abi::loadMeta;
use tcpxd::net::blocks::gather_host;
use tcpxd_testkit::Rng;

const POISON: u8 = 0xA5;
const GIB: u64 = 1 << 30;

fn gpu() -> Arc<Gpu> {
    Gpu::open(0).expect("these tests need a CUDA GPU")
}

fn seg_bytes(segs: &[Segment]) -> Vec<u8> {
    segs.iter()
        .flat_map(|s| {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&s.offset.to_le_bytes());
            b[8..12].copy_from_slice(&s.wire.to_le_bytes());
            b[12..].copy_from_slice(&s.len.to_le_bytes());
            b
        })
        .collect()
}

fn meta_bytes(frags: &[loadMeta]) -> Vec<u8> {
    frags
        .iter()
        .flat_map(|f| {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&f.src_off.to_le_bytes());
            b[4..8].copy_from_slice(&f.len.to_le_bytes());
            b[8..].copy_from_slice(&f.dst_off.to_le_bytes());
            b
        })
        .collect()
}

/// One side: a device buffer, and the window of it the test's blocks lie in (its host shadow).
struct Side {
    region: DeviceRegion,
    window: u64,
    shadow: Vec<u8>,
}

/// A transfer of `si` of `src` into `di` of `dst` in chunks of `chunk_bytes`, through both kernels.
struct Case<'a> {
    src: &'a BlockList,
    si: &'a [u32],
    dst: &'a BlockList,
    di: &'a [u32],
    chunk_bytes: u32,
}

fn run(gpu: &Arc<Gpu>, k: &Kernels, rng: &mut Rng, c: &Case<'_>, s: &Side, d: &mut Side) {
    let stream = Stream::new(gpu).unwrap();
    let send = SidePlan::build(c.src, &IndexArray::compact(c.si), "local_indices").unwrap();
    let recv = SidePlan::build(c.dst, &IndexArray::compact(c.di), "remote_indices").unwrap();
    assert_eq!(send.total(), recv.total());
    // The expected destination: a per-block copy on the shadows.
    let mut want = d.shadow.clone();
    for (&a, &b) in c.si.iter().zip(c.di) {
        let (so, l) = c.src.block(a).unwrap();
        let (doff, dl) = c.dst.block(b).unwrap();
        assert_eq!(l, dl);
        let (so, doff, l) = ((so - s.window) as usize, (doff - d.window) as usize, l as usize);
        want[doff..doff + l].copy_from_slice(&s.shadow[so..so + l]);
    }
    let chunk = c.chunk_bytes as usize;
    let staging = gpu.alloc(BLOCK_TASKS * chunk).unwrap();
    let bounce = gpu.alloc(BLOCK_TASKS * (chunk + 64 * 1024)).unwrap();
    let bounce_slot = chunk + 64 * 1024;
    let err = gpu.alloc_pinned(8).unwrap();
    // Every launch reports itself done through one counter and word: the word must hold each
    // launch's number after it, so the counter went back to zero every time.
    let (counter, word) = (gpu.alloc(4).unwrap(), gpu.alloc_pinned(8).unwrap());
    let mut launches = 0u64;
    let signal = |launches: &mut u64| {
        *launches += 1;
        BlockSignal::new(&counter, &word, 0, *launches).unwrap()
    };
    let chunks = send.chunk_count(c.chunk_bytes);
    let (mut gt, mut st) = (Vec::new(), Vec::new());
    let mut first = 0u64;
    while first < chunks {
        let n = (chunks - first).min(BLOCK_TASKS as u64) as usize;
        // Gather tables, segment tables and fragment lists of this launch, in pinned memory.
        let mut tables: Vec<(Vec<Segment>, Vec<Segment>)> = Vec::new();
        for j in 0..n {
            send.chunk_into(c.chunk_bytes, first + j as u64, &mut gt);
            recv.chunk_into(c.chunk_bytes, first + j as u64, &mut st);
            tables.push((gt.clone(), st.clone()));
        }
        let table_bytes: usize = tables.iter().map(|(g, s)| 16 * (g.len() + s.len())).sum();
        let pinned = gpu.alloc_pinned(table_bytes.max(16)).unwrap();
        let mut at = 0usize;
        let mut gather = Vec::new();
        let mut spans = Vec::new();
        for (j, (g, s_)) in tables.iter().enumerate() {
            let bytes: u32 = g.iter().map(|p| p.len).sum();
            pinned.write(at, &seg_bytes(g)).unwrap();
            let gspan = pinned.span().sub(at as u64, 16 * g.len() as u64).unwrap();
            at += 16 * g.len();
            pinned.write(at, &seg_bytes(s_)).unwrap();
            spans.push((
                pinned.span().sub(at as u64, 16 * s_.len() as u64).unwrap(),
                s_.len() as u32,
                bytes,
            ));
            at += 16 * s_.len();
            gather.push(
                GatherTask::new(
                    gspan,
                    g.len() as u32,
                    s.region.span(),
                    staging.subspan((j * chunk) as u64, chunk as u64).unwrap(),
                    bytes,
                )
                .unwrap(),
            );
        }
        gpu.launch_gather_blocks(k, &stream, &gather, 4, &err, 0, signal(&mut launches))
            .unwrap();
        stream.synchronize().unwrap();
        assert_eq!(err.as_slice()[..4], [0; 4], "the gather reported a bad piece");
        assert_eq!(
            word.load_u64(0).unwrap(),
            launches,
            "the gather launch signalled itself done"
        );
        let mut staged = vec![0u8; n * chunk];
        staging.read_into(&stream, 0, &mut staged).unwrap();
        // Check each gathered chunk against the host gather, then cut it into fragments.
        let mut ring = Vec::new();
        let mut lists = Vec::new();
        for (j, (g, _)) in tables.iter().enumerate() {
            let shifted: Vec<Segment> = g
                .iter()
                .map(|p| Segment {
                    offset: p.offset - s.window,
                    ..*p
                })
                .collect();
            let mut expect = vec![0u8; chunk];
            let bytes = gather_host(&s.shadow, &shifted, &mut expect).unwrap() as usize;
            let got = &staged[j * chunk..j * chunk + bytes];
            assert!(
                got == &expect[..bytes],
                "chunk {}: gathered bytes differ",
                first + j as u64
            );
            // Fragments: pieces of at most 4 KiB at random places of this chunk's bounce slot.
            let mut cuts = Vec::new();
            let mut w = 0usize;
            while w < bytes {
                let l = (1 + rng.below(4096) as usize).min(bytes - w);
                cuts.push((w, l));
                w += l;
            }
            rng.shuffle(&mut cuts);
            let mut slot = rng.bytes(bounce_slot);
            let mut frags = Vec::new();
            let mut pos = rng.below(64) as usize;
            for (w, l) in cuts {
                slot[pos..pos + l].copy_from_slice(&got[w..w + l]);
                frags.push(loadMeta {
                    src_off: pos as u32,
                    len: l as u32,
                    dst_off: w as u64,
                });
                pos += l + rng.below(16) as usize;
            }
            bounce.write((j * bounce_slot) as u64, &slot).unwrap();
            lists.push((ring.len(), frags.len()));
            ring.extend(meta_bytes(&frags));
        }
        let ring_pinned = gpu.alloc_pinned(ring.len().max(16)).unwrap();
        ring_pinned.write(0, &ring).unwrap();
        let scatter: Vec<ScatterTask> = lists
            .iter()
            .enumerate()
            .map(|(j, &(off, count))| {
                let (segs, nsegs, bytes) = spans[j];
                ScatterTask::new(
                    ring_pinned.span().sub(off as u64, 16 * count as u64).unwrap(),
                    count as u32,
                    bounce
                        .subspan((j * bounce_slot) as u64, bounce_slot as u64)
                        .unwrap(),
                    segs,
                    nsegs,
                    bytes,
                    d.region.span(),
                )
                .unwrap()
            })
            .collect();
        gpu.launch_scatter_blocks(k, &stream, &scatter, 4, &err, 0, signal(&mut launches))
            .unwrap();
        stream.synchronize().unwrap();
        assert_eq!(err.as_slice()[..4], [0; 4], "the scatter reported a bad fragment");
        assert_eq!(
            word.load_u64(0).unwrap(),
            launches,
            "the scatter launch signalled itself done"
        );
        first += n as u64;
    }
    let mut got = vec![0u8; d.shadow.len()];
    d.region.read_into(&stream, d.window, &mut got).unwrap();
    let bad = got.iter().zip(&want).position(|(a, b)| a != b);
    assert!(bad.is_none(), "destination differs first at window byte {bad:?}");
    d.shadow = got;
}

/// A side of `len` bytes whose window `window..window + wlen` holds random bytes (source) or the
/// poison (destination).
fn side(gpu: &Arc<Gpu>, rng: &mut Rng, len: u64, window: u64, wlen: u64, source: bool) -> Side {
    let region = gpu.alloc(len as usize).unwrap();
    let shadow = if source {
        rng.bytes(wlen as usize)
    } else {
        vec![POISON; wlen as usize]
    };
    region.write(window, &shadow).unwrap();
    Side {
        region,
        window,
        shadow,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn odd_offsets_and_lengths_scattered_both_sides() {
    let gpu = gpu();
    let k = gpu.kernels().unwrap();
    let mut rng = Rng::new(0x5EED_0001);
    for (round, (len, n, chunk)) in [
        (4096u32, 700u32, 524_288u32),
        (16_384, 300, 524_288),
        (65_536, 80, 524_288),
        (1, 3000, 4096),
        (4097, 500, 65_536),
        (1234, 900, 7777 * 8),
        (300_001, 9, 524_288),
    ]
    .into_iter()
    .enumerate()
    {
        // Odd base offsets and gaps so no two sides agree on alignment.
        let gap = [0u64, 1, 3, 16, 61][round % 5];
        let stride = u64::from(len) + gap;
        let (sfirst, dfirst) = (7 + round as u64, 13 + 2 * round as u64);
        let wlen_s = sfirst + stride * u64::from(n) + 9;
        let wlen_d = dfirst + stride * u64::from(n) + 9;
        let src = BlockList::new(
            1,
            1,
            wlen_s,
            Layout::Strided {
                first: sfirst,
                stride,
                len,
                count: n,
            },
        )
        .unwrap();
        let dst = BlockList::new(
            2,
            2,
            wlen_d,
            Layout::Strided {
                first: dfirst,
                stride,
                len,
                count: n,
            },
        )
        .unwrap();
        let mut si: Vec<u32> = (0..n).collect();
        let mut di: Vec<u32> = (0..n).collect();
        rng.shuffle(&mut si);
        if round % 2 == 0 {
            rng.shuffle(&mut di);
        }
        let s = side(&gpu, &mut rng, wlen_s, 0, wlen_s, true);
        let mut d = side(&gpu, &mut rng, wlen_d, 0, wlen_d, false);
        let case = Case {
            src: &src,
            si: &si,
            dst: &dst,
            di: &di,
            chunk_bytes: chunk,
        };
        run(&gpu, &k, &mut rng, &case, &s, &mut d);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn blocks_at_the_end_of_a_4_gib_buffer() {
    // Both buffers 4 GiB + 4099 bytes; the blocks lie in the last 8 MiB, the last one ending on
    // the buffer's last byte, several straddling the 4 GiB line (offsets past 32 bits).
    let gpu = gpu();
    let k = gpu.kernels().unwrap();
    let mut rng = Rng::new(0x5EED_0002);
    let len = 4 * GIB + 4099;
    let wlen = 8u64 << 20;
    let window = len - wlen;
    let (block, n) = (16_411u32, 400u32);
    let first = len - u64::from(block) * u64::from(n);
    let list = |id| {
        BlockList::new(
            id,
            id,
            len,
            Layout::Strided {
                first,
                stride: u64::from(block),
                len: block,
                count: n,
            },
        )
        .unwrap()
    };
    let (src, dst) = (list(1), list(2));
    assert_eq!(src.block(n - 1).map(|(o, l)| o + u64::from(l)), Some(len));
    let mut si: Vec<u32> = (0..n).collect();
    let mut di: Vec<u32> = (0..n).collect();
    rng.shuffle(&mut si);
    rng.shuffle(&mut di);
    let s = side(&gpu, &mut rng, len, window, wlen, true);
    let mut d = side(&gpu, &mut rng, len, window, wlen, false);
    let case = Case {
        src: &src,
        si: &si,
        dst: &dst,
        di: &di,
        chunk_bytes: 524_288,
    };
    run(&gpu, &k, &mut rng, &case, &s, &mut d);
    // In order on both sides: every chunk is one piece per side (merged runs).
    let ordered: Vec<u32> = (0..n).collect();
    let case = Case {
        src: &src,
        si: &ordered,
        dst: &dst,
        di: &ordered,
        chunk_bytes: 4 << 20,
    };
    run(&gpu, &k, &mut rng, &case, &s, &mut d);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pieces_and_fragments_out_of_bounds_are_skipped_and_reported() {
    let gpu = gpu();
    let k = gpu.kernels().unwrap();
    let stream = Stream::new(&gpu).unwrap();
    let src = gpu.alloc(8192).unwrap();
    src.write(0, &[1u8; 8192]).unwrap();
    let staging = gpu.alloc(8192).unwrap();
    staging.write(0, &[0u8; 8192]).unwrap();
    let table: PinnedRegion = gpu.alloc_pinned(64).unwrap();
    let err = gpu.alloc_pinned(8).unwrap();
    // The second piece reaches past the 8 KiB source.
    let segs = [
        Segment {
            offset: 0,
            wire: 0,
            len: 100,
        },
        Segment {
            offset: 8000,
            wire: 100,
            len: 500,
        },
    ];
    table.write(0, &seg_bytes(&segs)).unwrap();
    let t = GatherTask::new(table.span(), 2, src.span(), staging.span(), 600).unwrap();
    gpu.launch_gather_blocks(&k, &stream, &[t], 1, &err, 0, BlockSignal::NONE)
        .unwrap();
    stream.synchronize().unwrap();
    assert_ne!(err.as_slice()[..4], [0; 4], "the bad piece was reported");
    let mut got = vec![0u8; 8192];
    staging.read_into(&stream, 0, &mut got).unwrap();
    assert!(
        got[100..].iter().all(|&b| b == 0),
        "nothing copied from past the source"
    );

    // A fragment past the chunk: reported, the destination untouched.
    let err2 = gpu.alloc_pinned(8).unwrap();
    let ring = gpu.alloc_pinned(16).unwrap();
    ring.write(
        0,
        &meta_bytes(&[loadMeta {
            src_off: 0,
            len: 200,
            dst_off: 500,
        }]),
    )
    .unwrap();
    let dst = gpu.alloc(8192).unwrap();
    dst.write(0, &[POISON; 8192]).unwrap();
    table
        .write(
            0,
            &seg_bytes(&[Segment {
                offset: 0,
                wire: 0,
                len: 600,
            }]),
        )
        .unwrap();
    let t = ScatterTask::new(ring.span(), 1, src.span(), table.span(), 1, 600, dst.span()).unwrap();
    gpu.launch_scatter_blocks(&k, &stream, &[t], 1, &err2, 0, BlockSignal::NONE)
        .unwrap();
    stream.synchronize().unwrap();
    assert_ne!(err2.as_slice()[..4], [0; 4]);
    dst.read_into(&stream, 0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == POISON));
}

/// The poller's batches (`unpack::block_batch::BlockBatcher`), at three chunk sizes (tables through
/// the device arena, and inline in both sizes): 40+ chunks gathered in one batch (launches of at
/// most 16), scattered in one batch, compared with the host twins; then a
/// batch with a fragment past its chunk fails when it is done, naming the chunk, and the next
/// batch on the same batcher is clean again.
#[test]
#[ignore = "needs a CUDA GPU"]
fn batches_of_many_chunks_and_their_reports() {
    use tcpxd::net::blocks::scatter_host;
    use tcpxd::unpack::UnpackError;
    use tcpxd::unpack::block_batch::{BlockBatcher, BlockOp};

    let gpu = gpu();
    let mut rng = Rng::new(0x5EED_0003);
    // 50,000-byte chunks: ~51 pieces each, tables through the device arena; 16,000 and 4,000:
    // tables inline in the launch (the two sizes of INLINE_CAPS).
    for chunk in [50_000u32, 16_000, 4_000] {
        let (n, len) = (2000u32, 1000u32);
        let stride = u64::from(len) + 5;
        let list = |id, first| {
            BlockList::new(
                id,
                id,
                first + stride * u64::from(n),
                Layout::Strided {
                    first,
                    stride,
                    len,
                    count: n,
                },
            )
            .unwrap()
        };
        let (src, dst) = (list(1, 3), list(2, 11));
        let mut si: Vec<u32> = (0..n).collect();
        let mut di: Vec<u32> = (0..n).collect();
        rng.shuffle(&mut si);
        rng.shuffle(&mut di);
        let send = SidePlan::build(&src, &IndexArray::compact(&si), "s").unwrap();
        let recv = SidePlan::build(&dst, &IndexArray::compact(&di), "d").unwrap();
        let chunks = send.chunk_count(chunk) as usize;
        assert!(chunks > 2 * BLOCK_TASKS, "{chunks} chunks");
        // The most pieces one launch of 16 chunks carries on either side: over the largest inline
        // table for the first chunk size (the device arena), within it for the others.
        let launch_pieces = |plan: &SidePlan| {
            let mut v = Vec::new();
            (0..chunks)
                .map(|k| {
                    plan.chunk_into(chunk, k as u64, &mut v);
                    v.len()
                })
                .collect::<Vec<_>>()
                .chunks(BLOCK_TASKS)
                .map(|c| c.iter().sum::<usize>())
                .max()
                .unwrap()
        };
        let most = launch_pieces(&send).max(launch_pieces(&recv));
        assert_eq!(
            most > *INLINE_CAPS.last().unwrap(),
            chunk == 50_000,
            "{most} pieces a launch"
        );
        let sbytes = rng.bytes(src.buffer_len() as usize);
        let s = gpu.alloc(sbytes.len()).unwrap();
        s.write(0, &sbytes).unwrap();
        let d = gpu.alloc(dst.buffer_len() as usize).unwrap();
        d.write(0, &vec![POISON; dst.buffer_len() as usize]).unwrap();
        let staging = gpu.alloc(chunks * chunk as usize).unwrap();
        let mut gathers = BlockBatcher::new(&gpu, BlockOp::Gather).unwrap();
        let mut scatters = BlockBatcher::new(&gpu, BlockOp::Scatter).unwrap();
        let (mut gt, mut st) = (Vec::new(), Vec::new());
        let (mut gtabs, mut stabs, mut metas) = (Vec::new(), Vec::new(), Vec::new());
        let mut want = vec![POISON; dst.buffer_len() as usize];
        let mut slot = vec![0u8; chunk as usize];
        for k in 0..chunks {
            send.chunk_into(chunk, k as u64, &mut gt);
            recv.chunk_into(chunk, k as u64, &mut st);
            let bytes = gather_host(&sbytes, &gt, &mut slot).unwrap();
            // The staging slot is the receiver's bounce buffer here: one fragment per 4 KiB.
            let frags: Vec<loadMeta> = (0..bytes.div_ceil(4096))
                .map(|i| loadMeta {
                    src_off: i * 4096,
                    len: (bytes - i * 4096).min(4096),
                    dst_off: u64::from(i * 4096),
                })
                .collect();
            scatter_host(&frags, &slot[..bytes as usize], &st, bytes, &mut want).unwrap();
            let gtab = gpu.alloc_pinned(16 * gt.len()).unwrap();
            gtab.write(0, &seg_bytes(&gt)).unwrap();
            let stab = gpu.alloc_pinned(16 * st.len()).unwrap();
            stab.write(0, &seg_bytes(&st)).unwrap();
            let meta = gpu.alloc_pinned(16 * frags.len()).unwrap();
            meta.write(0, &meta_bytes(&frags)).unwrap();
            let dst_slot = staging
                .subspan(k as u64 * u64::from(chunk), u64::from(chunk))
                .unwrap();
            gathers
                .push_gather(
                    GatherTask::new(gtab.span(), gt.len() as u32, s.span(), dst_slot, bytes).unwrap(),
                    bytes,
                    &gt,
                )
                .unwrap();
            scatters
                .push_scatter(
                    ScatterTask::new(
                        meta.span(),
                        frags.len() as u32,
                        dst_slot,
                        stab.span(),
                        st.len() as u32,
                        bytes,
                        d.span(),
                    )
                    .unwrap(),
                    frags.len() as u32,
                    &st,
                )
                .unwrap();
            gtabs.push(gtab);
            stabs.push(stab);
            metas.push(meta);
        }
        // The gathers first (the scatters read what they wrote: same order as the poller's).
        let t = gathers.submit().unwrap().expect("a gather batch");
        gathers.wait(&t).unwrap();
        assert!(gathers.submit().unwrap().is_none(), "nothing left queued");
        let t = scatters.submit().unwrap().expect("a scatter batch");
        scatters.wait(&t).unwrap();
        let stream = Stream::new(&gpu).unwrap();
        let mut got = vec![0u8; want.len()];
        d.read_into(&stream, 0, &mut got).unwrap();
        let bad = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(bad.is_none(), "destination differs first at byte {bad:?}");

        // A fragment past its 100-byte chunk in the third task: reported once the batch is done.
        let one = [Segment {
            offset: 0,
            wire: 0,
            len: 100,
        }];
        let stab = gpu.alloc_pinned(16).unwrap();
        stab.write(0, &seg_bytes(&one)).unwrap();
        let good = gpu.alloc_pinned(16).unwrap();
        good.write(
            0,
            &meta_bytes(&[loadMeta {
                src_off: 0,
                len: 100,
                dst_off: 0,
            }]),
        )
        .unwrap();
        let past = gpu.alloc_pinned(16).unwrap();
        past.write(
            0,
            &meta_bytes(&[loadMeta {
                src_off: 0,
                len: 100,
                dst_off: 50,
            }]),
        )
        .unwrap();
        let bounce = staging.subspan(0, 4096).unwrap();
        for meta in [&good, &good, &past] {
            let task = ScatterTask::new(meta.span(), 1, bounce, stab.span(), 1, 100, d.span()).unwrap();
            scatters.push_scatter(task, 1, &one).unwrap();
        }
        let t = scatters.submit().unwrap().unwrap();
        match scatters.wait(&t) {
            Err(UnpackError::DeviceRejected { task: 2, fragment: 0 }) => {}
            other => panic!("expected task 2's fragment 0 rejected, got {other:?}"),
        }
        let task = ScatterTask::new(good.span(), 1, bounce, stab.span(), 1, 100, d.span()).unwrap();
        scatters.push_scatter(task, 1, &one).unwrap();
        let t = scatters.submit().unwrap().unwrap();
        scatters.wait(&t).unwrap();
        // A task whose table does not come with it is refused at once.
        let task = ScatterTask::new(good.span(), 1, bounce, stab.span(), 1, 100, d.span()).unwrap();
        assert!(scatters.push_scatter(task, 1, &[]).is_err());
    }
}
