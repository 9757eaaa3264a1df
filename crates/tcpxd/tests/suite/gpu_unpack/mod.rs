//! GPU tests of src/gpu and src/unpack. They need a CUDA GPU, so they are ignored by default:
//! `cargo test --release -p tcpxd --test suite -- --ignored gpu_unpack::`.
//!
//! Every unpacker runs against a host reference; destinations are poisoned first and every byte
//! is compared.

mod rejections;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tcpxd::gpu::{DeviceRegion, FragmentList, Gpu, GpuError, PersistConfig, PinnedRegion, Stream};
use tcpxd::net::Region;
use tcpxd::net::abi::loadMeta;
use tcpxd::unpack::{
    FragSource, Ticket, UnpackError, UnpackImpl, UnpackJob, Unpacker, validate, validate_list,
};
use tcpxd_pattern::seeded_bytes as pattern;
use tcpxd_testkit::Rng; // the daemon's seeded fill, by position

const POISON: u8 = 0xA5;
const RING_SLOT_BYTES: usize = 2048 * 16;
const PERSISTENT: PersistConfig = PersistConfig {
    blocks: 0,
    linger: Duration::from_micros(200),
};
const IMPLS: [UnpackImpl; 8] = [
    UnpackImpl::Persistent(PERSISTENT),
    UnpackImpl::Kernel(FragSource::Mapped),
    UnpackImpl::Kernel(FragSource::DeviceCopy),
    UnpackImpl::Kernel(FragSource::Params),
    UnpackImpl::Kernel(FragSource::PackedMapped),
    UnpackImpl::Kernel(FragSource::PackedDevice),
    UnpackImpl::D2d,
    UnpackImpl::Host,
];

fn gpu() -> Arc<Gpu> {
    Gpu::open(0).expect("these tests need a CUDA GPU")
}

fn lm(src_off: u64, len: u64, dst_off: u64) -> loadMeta {
    loadMeta {
        src_off: src_off as u32,
        len: len as u32,
        dst_off,
    }
}

struct Fixture {
    gpu: Arc<Gpu>,
    stream: Stream,
    bounce: DeviceRegion,
    bounce_host: Vec<u8>,
    ring: PinnedRegion,
}

impl Fixture {
    fn new(seed: u64, bounce_len: usize) -> Fixture {
        let gpu = gpu();
        let bounce_host = Rng::new(seed).bytes(bounce_len);
        let bounce = gpu.alloc(bounce_len).unwrap();
        bounce.write(0, &bounce_host).unwrap();
        Fixture {
            stream: Stream::new(&gpu).unwrap(),
            ring: gpu.alloc_pinned(16 * RING_SLOT_BYTES).unwrap(),
            gpu,
            bounce,
            bounce_host,
        }
    }
}

/// One receive of a test: its fragments, destination size, and whether the unpacker sees the
/// list through the (host-mapped) ring or as a host slice only.
#[derive(Clone)]
struct Spec {
    frags: Vec<loadMeta>,
    dst_len: u64,
    mapped: bool,
}

/// Aligned 4 KiB fragments from shuffled bounce pages, `pages` of them.
fn shuffled_pages(rng: &mut Rng, bounce_len: u64, pages: u64) -> Spec {
    let total_pages = bounce_len / 4096;
    let mut src: Vec<u64> = (0..total_pages).collect();
    rng.shuffle(&mut src);
    let mut frags: Vec<loadMeta> = (0..pages)
        .map(|i| lm(src[i as usize] * 4096, 4096, i * 4096))
        .collect();
    rng.shuffle(&mut frags);
    Spec {
        frags,
        dst_len: pages * 4096,
        mapped: true,
    }
}

/// `dst_len` bytes cut into pieces of 1..=max_piece bytes at random source offsets, in random
/// order (plus some slack at the end of the destination that no fragment covers).
fn random_pieces(rng: &mut Rng, bounce_len: u64, dst_len: u64, max_piece: u64) -> Spec {
    let mut frags = Vec::new();
    let mut pos = 0;
    let covered = dst_len - dst_len / 16;
    while pos < covered {
        let len = (1 + rng.below(max_piece)).min(covered - pos);
        frags.push(lm(rng.below(bounce_len - len), len, pos));
        pos += len;
    }
    rng.shuffle(&mut frags);
    Spec {
        frags,
        dst_len,
        mapped: true,
    }
}

/// Runs the specs as one batch and checks every byte of every destination.
fn run_batch(fx: &Fixture, u: &mut dyn Unpacker, specs: &[Spec], bounce_off: u64, dst_misalign: u64) {
    assert!(specs.len() <= 16);
    let offsets: Vec<u64> = specs
        .iter()
        .scan(dst_misalign, |acc, s| {
            let o = *acc;
            *acc += s.dst_len + 4096 + 7;
            Some(o)
        })
        .collect();
    let total = offsets.last().unwrap() + specs.last().unwrap().dst_len + 4096;
    let dst = fx.gpu.alloc(total as usize).unwrap();
    let mut expect = vec![POISON; total as usize];
    dst.write(0, &expect).unwrap();
    let bounce = fx
        .bounce
        .subspan(bounce_off, fx.bounce.len() as u64 - bounce_off)
        .unwrap();
    for (j, s) in specs.iter().enumerate() {
        let slot_off = j * RING_SLOT_BYTES;
        let raw: Vec<u8> = s
            .frags
            .iter()
            .flat_map(|f| {
                let mut b = [0u8; 16];
                b[..4].copy_from_slice(&f.src_off.to_le_bytes());
                b[4..8].copy_from_slice(&f.len.to_le_bytes());
                b[8..].copy_from_slice(&f.dst_off.to_le_bytes());
                b
            })
            .collect();
        fx.ring.write(slot_off, &raw).unwrap();
        let frags = if s.mapped {
            FragmentList::from_pinned(&fx.ring, slot_off, s.frags.len()).unwrap()
        } else {
            FragmentList::host(&s.frags)
        };
        u.push(&UnpackJob {
            frags,
            bounce,
            dst: dst.subspan(offsets[j], s.dst_len).unwrap(),
            exact: false,
        })
        .unwrap();
        gather(&mut expect, offsets[j], &fx.bounce_host, bounce_off, &s.frags);
    }
    let t = u.submit().unwrap();
    finish(u, t);
    let mut got = vec![0u8; total as usize];
    dst.read_into(&fx.stream, 0, &mut got).unwrap();
    compare(u.name(), &got, &expect);
}

fn finish(u: &mut dyn Unpacker, t: Option<Ticket>) {
    let Some(t) = t else { return };
    let start = Instant::now();
    while !u.is_done(&t).unwrap() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{}: batch never finished",
            u.name()
        );
        std::hint::spin_loop();
    }
}

fn compare(name: &str, got: &[u8], expect: &[u8]) {
    if let Some(i) = got.iter().zip(expect).position(|(a, b)| a != b) {
        let bad = got.iter().zip(expect).filter(|(a, b)| a != b).count();
        panic!(
            "{name}: {bad} bytes differ, the first at {i} (got {:#04x}, expected {:#04x})",
            got[i], expect[i]
        );
    }
}

/// The host reference: `frags` gathered from `src` (at `src_base`) into `expect` (at `dst_base`).
fn gather(expect: &mut [u8], dst_base: u64, src: &[u8], src_base: u64, frags: &[loadMeta]) {
    for f in frags {
        let s = (src_base + u64::from(f.src_off)) as usize;
        let d = (dst_base + f.dst_off) as usize;
        expect[d..d + f.len as usize].copy_from_slice(&src[s..s + f.len as usize]);
    }
}

fn for_each_impl(f: impl Fn(&mut dyn Unpacker)) {
    let gpu = gpu();
    for imp in IMPLS {
        let mut u = imp.build(&gpu).unwrap();
        f(u.as_mut());
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_open_reports_the_device() {
    let n = Gpu::device_count().unwrap();
    assert!(n >= 1);
    let g = gpu();
    assert!(g.sm_count() > 0);
    eprintln!(
        "{} (cc {:?}, {} SMs)",
        g.name(),
        g.compute_capability(),
        g.sm_count()
    );
    eprintln!("kernels: {:?}", g.kernels().unwrap().source());
    assert!(matches!(Gpu::open(n), Err(GpuError::NoDevice { .. })));
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_aligned_shuffled_pages() {
    let fx = Fixture::new(1, 64 << 20);
    let mut rng = Rng::new(11);
    let specs = [shuffled_pages(&mut rng, 64 << 20, 128)];
    for_each_impl(|u| run_batch(&fx, u, &specs, 0, 0));
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_unaligned_offsets_and_lengths() {
    let fx = Fixture::new(2, 16 << 20);
    let mut rng = Rng::new(12);
    for (bounce_off, misalign) in [(0, 0), (1, 3), (8, 4), (5, 16), (2, 2)] {
        let specs = [random_pieces(&mut rng, (16 << 20) - bounce_off, 300_001, 4096)];
        for_each_impl(|u| run_batch(&fx, u, &specs, bounce_off, misalign));
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_one_byte_fragments() {
    let fx = Fixture::new(3, 1 << 20);
    let mut rng = Rng::new(13);
    let specs = [random_pieces(&mut rng, 1 << 20, 2048, 1)];
    for_each_impl(|u| run_batch(&fx, u, &specs, 0, 1));
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_2048_fragments_in_one_chunk() {
    let fx = Fixture::new(4, 64 << 20);
    let mut rng = Rng::new(14);
    let mut full = shuffled_pages(&mut rng, 64 << 20, 2048);
    assert_eq!(full.frags.len(), 2048);
    let mut pieces = random_pieces(&mut rng, 64 << 20, 4 << 20, 4096);
    pieces.frags.truncate(2048);
    full.mapped = false;
    for_each_impl(|u| {
        run_batch(&fx, u, std::slice::from_ref(&full), 0, 0);
        run_batch(&fx, u, std::slice::from_ref(&pieces), 0, 0);
    });
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_several_chunks_in_one_batch() {
    let fx = Fixture::new(5, 128 << 20);
    let mut rng = Rng::new(15);
    // 16 receives: full 2048-fragment ones (7 of them: more than one staging slot of the
    // kernel unpacker holds, so the batch is split), unaligned pieces, 1-byte fragments, an empty one; mapped and host-only lists.
    let mut specs = Vec::new();
    for j in 0..16u64 {
        let mut s = match j % 5 {
            0 => shuffled_pages(&mut rng, 128 << 20, 2048),
            1 => shuffled_pages(&mut rng, 128 << 20, 2048),
            2 => random_pieces(&mut rng, 128 << 20, 700_000, 4096),
            3 => random_pieces(&mut rng, 128 << 20, 1500, 1),
            _ => Spec {
                frags: Vec::new(),
                dst_len: 4096,
                mapped: true,
            },
        };
        s.mapped = j % 2 == 0;
        specs.push(s);
    }
    for_each_impl(|u| run_batch(&fx, u, &specs, 0, 0));
}

/// Many batches through the 16 ring slots (and the unpackers' 16 event slots), several batches
/// in flight as the poller would have them, a slot reused only once its batch is done.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_ring_wrap_around() {
    let fx = Fixture::new(6, 64 << 20);
    let gpu = fx.gpu.clone();
    for imp in IMPLS {
        let mut u = imp.build(&gpu).unwrap();
        let mut rng = Rng::new(16);
        let batches = 40;
        let per_batch = 3;
        let dst_len = 64 * 4096u64;
        let dst = gpu
            .alloc((batches * per_batch) as usize * dst_len as usize)
            .unwrap();
        let mut expect = vec![POISON; dst.len()];
        dst.write(0, &expect).unwrap();
        // Ticket of the batch holding each ring slot.
        let mut holder: [Option<Ticket>; 16] = [None; 16];
        let mut job = 0usize;
        for _ in 0..batches {
            let mut slots = Vec::new();
            for _ in 0..per_batch {
                let slot = job % 16;
                if let Some(t) = holder[slot].take() {
                    finish(u.as_mut(), Some(t));
                }
                let spec = if job % 2 == 0 {
                    shuffled_pages(&mut rng, 64 << 20, 64)
                } else {
                    random_pieces(&mut rng, 64 << 20, dst_len, 4096)
                };
                let slot_off = slot * RING_SLOT_BYTES;
                for (i, f) in spec.frags.iter().enumerate() {
                    let mut b = [0u8; 16];
                    b[..4].copy_from_slice(&f.src_off.to_le_bytes());
                    b[4..8].copy_from_slice(&f.len.to_le_bytes());
                    b[8..].copy_from_slice(&f.dst_off.to_le_bytes());
                    fx.ring.write(slot_off + i * 16, &b).unwrap();
                }
                let base = job as u64 * dst_len;
                u.push(&UnpackJob {
                    frags: FragmentList::from_pinned(&fx.ring, slot_off, spec.frags.len()).unwrap(),
                    bounce: fx.bounce.span(),
                    dst: dst.subspan(base, dst_len).unwrap(),
                    exact: false,
                })
                .unwrap();
                gather(&mut expect, base, &fx.bounce_host, 0, &spec.frags);
                slots.push(slot);
                job += 1;
            }
            let t = u.submit().unwrap().expect("work was queued");
            for s in slots {
                holder[s] = Some(t);
            }
        }
        for t in holder.into_iter().flatten() {
            finish(u.as_mut(), Some(t));
        }
        let mut got = vec![0u8; dst.len()];
        dst.read_into(&fx.stream, 0, &mut got).unwrap();
        compare(u.name(), &got, &expect);
    }
}

/// More batches in flight than an unpacker has completion slots (16), nothing waited for until
/// the last is submitted, and batches of more receives than one launch carries (64): every byte
/// lands, every ticket reads done once the last does, and the slots are reused only after their
/// batch finished (the kernel unpacker's signal word and back-pressure).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_more_batches_in_flight_than_slots() {
    let fx = Fixture::new(9, 64 << 20);
    let gpu = fx.gpu.clone();
    for imp in IMPLS {
        let mut u = imp.build(&gpu).unwrap();
        let mut rng = Rng::new(19);
        // 40 batches of 2 receives, then one of 70 and one of 130 small receives.
        let sizes: Vec<usize> = std::iter::repeat_n(2, 40).chain([70, 130]).collect();
        let dst_len = 16 * 4096u64;
        let receives: usize = sizes.iter().sum();
        let dst = gpu.alloc(receives * dst_len as usize).unwrap();
        let mut expect = vec![POISON; dst.len()];
        dst.write(0, &expect).unwrap();
        let mut lists = Vec::new();
        let mut tickets = Vec::new();
        let mut job = 0u64;
        for &n in &sizes {
            for _ in 0..n {
                let spec = if job % 3 == 0 {
                    random_pieces(&mut rng, 64 << 20, dst_len, 4096)
                } else {
                    shuffled_pages(&mut rng, 64 << 20, 16)
                };
                let base = job * dst_len;
                gather(&mut expect, base, &fx.bounce_host, 0, &spec.frags);
                lists.push(spec.frags);
                u.push(&UnpackJob {
                    frags: FragmentList::host(lists.last().unwrap()),
                    bounce: fx.bounce.span(),
                    dst: dst.subspan(base, dst_len).unwrap(),
                    exact: false,
                })
                .unwrap();
                job += 1;
            }
            tickets.push(u.submit().unwrap().expect("work was queued"));
        }
        let last = *tickets.last().unwrap();
        u.wait(&last).unwrap();
        for t in &tickets {
            assert!(
                u.is_done(t).unwrap(),
                "{}: batch {} not done after the last",
                u.name(),
                t.seq()
            );
        }
        assert!(tickets.windows(2).all(|w| w[0].seq() < w[1].seq()));
        let mut got = vec![0u8; dst.len()];
        dst.read_into(&fx.stream, 0, &mut got).unwrap();
        compare(u.name(), &got, &expect);
    }
}

/// The persistent grid leaves after its linger and a new one is launched for the next batch;
/// with a linger of 1 µs grids leave between (and while) batches are posted, so batches and
/// departing grids cross, and every batch must still be taken exactly once.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_persistent_grid_leaves_and_comes_back() {
    let fx = Fixture::new(10, 64 << 20);
    let gpu = fx.gpu.clone();
    for (linger_us, blocks, batches) in [(200u64, 0u32, 6usize), (1, 0, 200), (1, 3, 100), (50_000, 0, 50)] {
        let mut u = tcpxd::unpack::KernelUnpacker::persistent(
            &gpu,
            PersistConfig {
                blocks,
                linger: Duration::from_micros(linger_us),
            },
        )
        .unwrap();
        let mut rng = Rng::new(20 + linger_us);
        let dst_len = 32 * 4096u64;
        let dst = gpu.alloc(batches * dst_len as usize).unwrap();
        let mut expect = vec![POISON; dst.len()];
        dst.write(0, &expect).unwrap();
        let mut lists = Vec::new();
        let mut last = None;
        for b in 0..batches {
            let spec = if b % 2 == 0 {
                shuffled_pages(&mut rng, 64 << 20, 32)
            } else {
                random_pieces(&mut rng, 64 << 20, dst_len, 4096)
            };
            let base = b as u64 * dst_len;
            gather(&mut expect, base, &fx.bounce_host, 0, &spec.frags);
            lists.push(spec.frags);
            u.push(&UnpackJob {
                frags: FragmentList::host(lists.last().unwrap()),
                bounce: fx.bounce.span(),
                dst: dst.subspan(base, dst_len).unwrap(),
                exact: false,
            })
            .unwrap();
            let t = u.submit().unwrap().unwrap();
            last = Some(t);
            // Long linger: wait for each batch, then idle past the 200 µs linger (a new grid
            // each time); short ones: keep several in flight.
            if linger_us == 200 {
                finish(&mut u, Some(t));
                std::thread::sleep(Duration::from_millis(5));
            } else if b % 7 == 6 {
                finish(&mut u, Some(t));
            }
        }
        finish(&mut u, last);
        let launches = u.grid_launches().unwrap();
        // Dropping asks the (possibly still resident) grid to leave and waits for it.
        drop(u);
        let mut got = vec![0u8; dst.len()];
        dst.read_into(&fx.stream, 0, &mut got).unwrap();
        compare("kernel-persistent", &got, &expect);
        eprintln!("linger {linger_us} µs, {batches} batches: {launches} grid launches");
        match linger_us {
            200 => assert_eq!(launches, batches as u64, "one grid per isolated batch"),
            50_000 => assert_eq!(launches, 1, "one grid for a burst within its linger"),
            _ => assert!(launches >= 1),
        }
    }
}

/// A resident grid must not read bounce pages from a cache that outlived the batch: the same
/// pages are rewritten between batches (as the NIC does) and each batch must see the new bytes.
/// The copies go through preallocated pinned buffers on a stream of their own: freeing memory
/// synchronizes the whole device, which would wait for the grid to linger out and make every
/// round start a fresh grid (with fresh caches), proving nothing.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_persistent_grid_sees_rewritten_bounce_pages() {
    let fx = Fixture::new(11, 1 << 20);
    let gpu = fx.gpu.clone();
    let mut u = tcpxd::unpack::KernelUnpacker::persistent(
        &gpu,
        PersistConfig {
            blocks: 0,
            linger: Duration::from_millis(500),
        },
    )
    .unwrap();
    let pages = 64u64;
    let bytes = (pages * 4096) as usize;
    let frags: Vec<loadMeta> = (0..pages)
        .map(|i| lm(i * 4096, 4096, (pages - 1 - i) * 4096))
        .collect();
    let dst = gpu.alloc(bytes).unwrap();
    let up = gpu.alloc_pinned(bytes).unwrap();
    let down = gpu.alloc_pinned(bytes).unwrap();
    let copies = Stream::new(&gpu).unwrap();
    let mut rng = Rng::new(33);
    for round in 0..20 {
        let content = rng.bytes(bytes);
        up.write(0, &content).unwrap();
        copies.copy_h2d(&fx.bounce, 0, &up, 0, bytes as u64).unwrap();
        copies.synchronize().unwrap();
        u.push(&UnpackJob {
            frags: FragmentList::host(&frags),
            bounce: fx.bounce.span(),
            dst: dst.span(),
            exact: false,
        })
        .unwrap();
        let t = u.submit().unwrap();
        finish(&mut u, t);
        copies.copy_d2h(&down, 0, &dst, 0, bytes as u64).unwrap();
        copies.synchronize().unwrap();
        let mut got = vec![0u8; bytes];
        down.read(0, &mut got).unwrap();
        let mut expect = vec![0u8; bytes];
        gather(&mut expect, 0, &content, 0, &frags);
        compare(&format!("round {round}"), &got, &expect);
    }
    assert_eq!(
        u.grid_launches(),
        Some(1),
        "the grid stayed resident across the rounds"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_rejects_a_fragment_past_dst_len() {
    let fx = Fixture::new(7, 4 << 20);
    let frags = [lm(0, 4096, 0), lm(8192, 4096, 4096), lm(4096, 4097, 8192)];
    let dst = fx.gpu.alloc(3 * 4096 + 4096).unwrap();
    let poison = vec![POISON; dst.len()];
    for_each_impl(|u| {
        dst.write(0, &poison).unwrap();
        let err = u
            .push(&UnpackJob {
                frags: FragmentList::host(&frags),
                bounce: fx.bounce.span(),
                dst: dst.subspan(0, 3 * 4096).unwrap(),
                exact: false,
            })
            .unwrap_err();
        assert!(
            matches!(err, UnpackError::Fragment { index: 2, .. }),
            "{}: {err}",
            u.name()
        );
        assert!(err.to_string().contains("fragment 2 of 3"), "{err}");
        assert!(
            u.submit().unwrap().is_none(),
            "{}: a refused job queued work",
            u.name()
        );
        let mut got = vec![0u8; dst.len()];
        dst.read_into(&fx.stream, 0, &mut got).unwrap();
        compare(u.name(), &got, &poison);
    });
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_device_region_alloc_copies_and_region_trait() {
    let gpu = gpu();
    let stream = Stream::new(&gpu).unwrap();
    let r = gpu.alloc(10_000_001).unwrap();
    assert_eq!(r.as_ptr() as usize % 4096, 0);
    assert_eq!(r.len(), 10_000_001);
    assert_eq!(r.mem_type(), tcpxd::net::MemType::Cuda);
    let mut zero = vec![1u8; 10_000_001];
    r.read_into(&stream, 0, &mut zero).unwrap();
    assert!(zero.iter().all(|&b| b == 0), "fresh device memory is zeroed");
    let data = Rng::new(9).bytes(10_000_001);
    r.write(0, &data).unwrap();
    let r2 = gpu.alloc(10_000_001).unwrap();
    stream.copy_d2d(&r2, 0, &r, 0, 10_000_001).unwrap();
    let pinned = gpu.alloc_pinned(10_000_001).unwrap();
    stream.copy_d2h(&pinned, 0, &r2, 0, 10_000_001).unwrap();
    stream.synchronize().unwrap();
    compare("d2d+d2h", pinned.as_slice(), &data);
    assert!(r.write(10_000_000, &[0, 0]).is_err());
    assert!(stream.copy_d2d(&r2, 1, &r, 0, 10_000_001).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_pinned_region_device_pointer() {
    let gpu = gpu();
    let stream = Stream::new(&gpu).unwrap();
    let mut p = gpu.alloc_pinned(1 << 20).unwrap();
    assert_eq!(p.mem_type(), tcpxd::net::MemType::Host);
    assert_ne!(p.device_ptr(), 0);
    let data = Rng::new(10).bytes(1 << 20);
    p.as_mut_slice().copy_from_slice(&data);
    // The device view works as a copy source and destination.
    let d = gpu.alloc(1 << 20).unwrap();
    stream.copy_span_d2d(d.span(), p.span(), 1 << 20).unwrap();
    stream.synchronize().unwrap();
    let mut back = vec![0u8; 1 << 20];
    d.read(0, &mut back).unwrap();
    compare("pinned→device", &back, &data);
    p.as_mut_slice().fill(0);
    stream.copy_span_d2d(p.span(), d.span(), 1 << 20).unwrap();
    stream.synchronize().unwrap();
    compare("device→pinned", p.as_slice(), &data);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_fill_read_and_crc32c() {
    let gpu = gpu();
    let stream = Stream::new(&gpu).unwrap();
    let len = (64 << 20) + 77;
    let r = gpu.alloc(len).unwrap();
    r.fill_with(&stream, 0, len as u64, |pos, chunk| pattern(42, pos, chunk))
        .unwrap();
    let mut expect = vec![0u8; len];
    pattern(42, 0, &mut expect);
    let mut got = vec![0u8; len];
    r.read_into(&stream, 0, &mut got).unwrap();
    compare("fill/read", &got, &expect);
    for (off, n) in [
        (0usize, len),
        (0, 4096),
        (0, 1),
        (5, 10 << 20 | 3),
        (4096, 12_345),
        (16, 8 << 20),
    ] {
        let want = crc32c::crc32c(&expect[off..off + n]);
        assert_eq!(
            r.crc32c(&stream, off as u64, n as u64).unwrap(),
            want,
            "kernel crc at {off}+{n}"
        );
        assert_eq!(
            r.crc32c_via_host(&stream, off as u64, n as u64).unwrap(),
            want,
            "host crc at {off}+{n}"
        );
    }
    assert_eq!(r.crc32c(&stream, 0, 0).unwrap(), 0);
    assert!(r.crc32c(&stream, 1, len as u64).is_err());
}

const IPC_ENV: &str = "TCPXD_TEST_IPC_IMPORT";

/// IPC across processes: this process exports, a child (this test binary, running
/// `gpu_ipc_child`) imports, checks the bytes and writes new ones, which this process then sees.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_ipc_export_import_in_a_child_process() {
    let gpu = gpu();
    let stream = Stream::new(&gpu).unwrap();
    let len = (3 << 20) + 123;
    let r = gpu.alloc(len).unwrap();
    r.fill_with(&stream, 0, len as u64, |pos, c| pattern(7, pos, c))
        .unwrap();
    let e = r.export_ipc().unwrap();
    assert_eq!(e.len, len as u64);
    let arg = format!("{}:{}:{}", hex::encode(e.handle), e.offset, e.len);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &crate::common::test_name(module_path!(), "gpu_ipc_child"),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IPC_ENV, arg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
    let mut got = vec![0u8; 65536];
    r.read(0, &mut got).unwrap();
    let mut want = vec![0u8; 65536];
    pattern(8, 0, &mut want);
    compare("written by the child", &got, &want);
    let mut rest = vec![0u8; 4096];
    r.read(65536, &mut rest).unwrap();
    let mut want = vec![0u8; 4096];
    pattern(7, 65536, &mut want);
    compare("untouched by the child", &rest, &want);
}

/// The importer side of `gpu_ipc_export_import_in_a_child_process` (does nothing on its own).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_ipc_child() {
    let Ok(arg) = std::env::var(IPC_ENV) else {
        return;
    };
    let parts: Vec<&str> = arg.split(':').collect();
    let handle: [u8; 64] = hex::decode(parts[0]).unwrap().try_into().unwrap();
    let offset: u64 = parts[1].parse().unwrap();
    let len: usize = parts[2].parse().unwrap();
    let gpu = gpu();
    let stream = Stream::new(&gpu).unwrap();
    let r = gpu.import_ipc(&handle, offset, len).unwrap();
    assert!(r.is_imported());
    assert!(r.export_ipc().is_err());
    let mut got = vec![0u8; len];
    r.read_into(&stream, 0, &mut got).unwrap();
    let mut want = vec![0u8; len];
    pattern(7, 0, &mut want);
    compare("imported", &got, &want);
    r.fill_with(&stream, 0, 65536, |pos, c| pattern(8, pos, c))
        .unwrap();
    assert!(gpu.import_ipc(&handle, offset, len + (1 << 30)).is_err());
}
