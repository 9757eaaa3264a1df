//! Tests of `net::host_copies`: copies landing exactly on 0 to 5 helpers, queued jobs and their
//! tickets, chunks cut across idle helpers, and how long idle helpers spin.

use super::*;
use crate::net::copy_routines::CopyRoutine;
use tcpxd_testkit::Rng;

/// Random scattered copies (pieces cut across parts, tiny and large ones) land exactly as a
/// copy one by one, with 0 to 5 helpers; nothing outside the targets is touched.
#[test]
fn split_copies_land_exactly_as_one_by_one() {
    let mut rng = Rng::new(38);
    let src: Vec<u8> = (0..4 << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
    for helpers in 0..6 {
        let pool = HostCopies::new(helpers, HelperSpin::auto(true));
        assert_eq!(pool.threads(), helpers);
        for round in 0..20 {
            // Targets: distinct slots of 32 KiB in shuffled order, lengths 1..=32 KiB.
            let slots = 128usize;
            let mut order: Vec<usize> = (0..slots).collect();
            for i in (1..slots).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let count = 1 + rng.below(slots as u64) as usize;
            let mut dst = vec![0xEEu8; slots * 32768];
            let mut want = dst.clone();
            let mut copies = Vec::new();
            for &s in order.iter().take(count) {
                let n = 1 + rng.below(if round % 2 == 0 { 32768 } else { 64 }) as usize;
                let from = rng.below((src.len() - n) as u64) as usize;
                let to = s * 32768 + rng.below((32768 - n + 1) as u64) as usize;
                want[to..to + n].copy_from_slice(&src[from..from + n]);
                copies.push(HostCopy {
                    from: src[from..].as_ptr(),
                    to: dst[to..].as_mut_ptr(),
                    n,
                });
            }
            // SAFETY: sources in `src`, distinct targets in `dst`, both alive across the call.
            unsafe { pool.copy_all(&copies) };
            assert!(dst == want, "{helpers} helpers, round {round}");
        }
    }
}

/// Queued jobs (many chunks at once, each with scattered copies and a zeroed source slot)
/// land exactly as copies one by one, on 0 to 4 helpers; a ticket is done only after its
/// job, `quiesce` waits for every one, and fork-and-join copies still work between them.
#[test]
fn queued_jobs_land_exactly_and_tickets_say_when() {
    let mut rng = Rng::new(83);
    for helpers in 0..5 {
        let pool = HostCopies::new(helpers, HelperSpin::auto(true));
        let chunk = 256 * 1024;
        let jobs = 24;
        // Sources: one slot per job (zeroed by its job once copied out); targets: 16 KiB
        // blocks of `dst` in shuffled order.
        let mut slots: Vec<u8> = (0..jobs * chunk).map(|i| (i * 13 + i / 977) as u8).collect();
        let src = slots.clone();
        let blocks = jobs * chunk / 16384;
        let mut order: Vec<usize> = (0..blocks).collect();
        for i in (1..blocks).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut dst = vec![0xEEu8; jobs * chunk];
        let mut want = dst.clone();
        let mut tickets = Vec::new();
        for j in 0..jobs {
            let mut copies = Vec::new();
            for b in 0..chunk / 16384 {
                let from = j * chunk + b * 16384;
                let to = order[from / 16384] * 16384;
                want[to..to + 16384].copy_from_slice(&src[from..from + 16384]);
                copies.push(HostCopy {
                    from: slots[from..].as_ptr(),
                    to: dst[to..].as_mut_ptr(),
                    n: 16384,
                });
            }
            let job = CopyJob {
                copies,
                zero: Some((slots[j * chunk..].as_mut_ptr(), chunk)),
                cold_targets: true,
                keep: Vec::new(),
            };
            // SAFETY: `slots` and `dst` outlive every job (`quiesce` below); targets are
            // distinct blocks of `dst`, each job zeroes only its own slot after copying it.
            match unsafe { pool.queue(job) } {
                Some(t) => tickets.push(t),
                None => assert_eq!(helpers, 0, "with helpers a 256 KiB job is queued"),
            }
        }
        // A fork-and-join copy between the queued jobs (into a vector of its own).
        let extra: Vec<u8> = (0..1 << 20).map(|i| (i % 241) as u8).collect();
        let mut extra_dst = vec![0u8; 1 << 20];
        let c = HostCopy {
            from: extra.as_ptr(),
            to: extra_dst.as_mut_ptr(),
            n: extra.len(),
        };
        // SAFETY: two live, distinct vectors.
        unsafe { pool.copy_all(&[c]) };
        assert!(extra_dst == extra);
        pool.quiesce();
        assert_eq!(pool.in_flight(), 0);
        assert!(tickets.iter().all(CopyTicket::is_done));
        assert_eq!(tickets.len(), if helpers == 0 { 0 } else { jobs });
        assert!(dst == want, "{helpers} helpers");
        assert!(slots.iter().all(|&b| b == 0), "every slot zeroed");
    }
}

/// A helper spins only while its jobs come within the most it may spin, and then about
/// 1.5× their recent gap: jobs every 20 µs keep it spinning ~30 µs, jobs a millisecond
/// apart (or an idle daemon) make it sleep at once, and it spins again once jobs come close.
#[test]
fn helpers_spin_only_as_long_as_their_jobs_need() {
    let us = Duration::from_micros;
    let mut g = SpinGauge::new(HelperSpin { max: us(200) });
    assert_eq!(g.budget(), us(200), "a fresh helper spins its first gap out");
    for _ in 0..20 {
        g.saw(us(20));
    }
    assert!(g.budget() >= us(25) && g.budget() <= us(40), "{:?}", g.budget());
    for _ in 0..3 {
        g.saw(Duration::from_millis(1));
    }
    assert_eq!(g.budget(), Duration::ZERO, "jobs far apart: sleep at once");
    let before = g.avg_ns;
    g.saw(Duration::from_secs(3600));
    assert_eq!(
        g.avg_ns,
        (3 * before + 400_000) / 4,
        "a long idle counts as 2 × max"
    );
    for _ in 0..10 {
        g.saw(us(20));
    }
    assert!(
        g.budget() > Duration::ZERO && g.budget() <= us(200),
        "{:?}",
        g.budget()
    );
    // Off: never spins.
    let mut off = SpinGauge::new(HelperSpin::auto(false));
    off.saw(us(1));
    assert_eq!(off.budget(), Duration::ZERO);
    assert_eq!(HelperSpin::auto(true).max, AUTO_SPIN);
    // Only the first `spinners` helpers spin.
    let one = HelperPolicy {
        spinners: 1,
        ..HelperPolicy::with_spin(HelperSpin::auto(true))
    };
    assert_eq!(one.spin_of(0).max, AUTO_SPIN);
    assert_eq!(one.spin_of(1).max, Duration::ZERO);
    assert_eq!(one.spin_of(7).max, Duration::ZERO);
    // A pool under that policy: helper 0 spins, the others never do, and they copy alike.
    let pool = HostCopies::with_policy(3, one);
    let spins: Vec<Duration> = pool.helpers.iter().map(|h| h.spin.max).collect();
    assert_eq!(spins, [AUTO_SPIN, Duration::ZERO, Duration::ZERO]);
    let src = vec![9u8; 3 * 64 * 1024];
    let mut dst = vec![0u8; 3 * 64 * 1024];
    let mut tickets = Vec::new();
    for k in 0..3 {
        let job = CopyJob {
            copies: vec![HostCopy {
                from: src[k * 65536..].as_ptr(),
                to: dst[k * 65536..].as_mut_ptr(),
                n: 65536,
            }],
            zero: None,
            cold_targets: true,
            keep: Vec::new(),
        };
        // SAFETY: two live vectors, distinct 64 KiB targets; `quiesce` ends the jobs first.
        tickets.push(unsafe { pool.queue(job) }.expect("64 KiB is queued"));
    }
    pool.quiesce();
    assert!(tickets.iter().all(CopyTicket::is_done));
    assert!(dst == src);
    // A pool that never spins still copies every job and sleeps between them.
    let pool = HostCopies::new(2, HelperSpin::auto(false));
    let src = vec![5u8; 64 * 1024];
    let mut dst = vec![0u8; 64 * 1024];
    for round in 0..4 {
        dst.fill(0);
        let job = CopyJob {
            copies: vec![HostCopy {
                from: src.as_ptr(),
                to: dst.as_mut_ptr(),
                n: src.len(),
            }],
            zero: None,
            cold_targets: false,
            keep: Vec::new(),
        };
        // SAFETY: two live, distinct vectors; `quiesce` ends the job before they are read.
        let t = unsafe { pool.queue(job) }.expect("64 KiB is queued");
        pool.quiesce();
        assert!(t.is_done());
        assert!(dst == src, "round {round}");
    }
}

/// The policies the queued-chunk test runs under: session 22's (all spin, plain, split), and
/// one spinner or none, each copy routine, split off.
fn policies() -> Vec<HelperPolicy> {
    let base = HelperPolicy::with_spin(HelperSpin::auto(true));
    let mut all = vec![base];
    for (spinners, routine, split) in [
        (1, CopyRoutine::Prefetch, true),
        (0, CopyRoutine::Stream, true),
        (1, CopyRoutine::Stream, false),
        (1, CopyRoutine::Plain, false),
    ] {
        all.push(HelperPolicy {
            spinners,
            routine,
            split,
            ..base
        });
    }
    all
}

/// A queued chunk is cut across idle helpers (each part zeroing the landed bytes it copied
/// out when the job zeroes its sources), lands exactly, and leaves its slot all zeros; a job
/// whose sources do not tile its zeroed range goes whole and is zeroed after; gathers (no
/// zeroing) are cut too and leave their sources alone. With `split` off every job goes whole;
/// every copy routine and spinner count lands the same bytes.
#[test]
fn queued_chunks_are_cut_across_idle_helpers_and_land_exactly() {
    let mut rng = Rng::new(21);
    let chunk = 512 * 1024;
    let piece = 16 * 1024;
    let src: Vec<u8> = (0..chunk).map(|i| (i * 31 + i / 1013) as u8).collect();
    for (helpers, policy) in [1usize, 2, 4]
        .into_iter()
        .flat_map(|h| policies().into_iter().map(move |p| (h, p)))
    {
        let pool = HostCopies::with_policy(helpers, policy);
        for round in 0..6 {
            let mut order: Vec<usize> = (0..chunk / piece).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let mut slot = src.clone();
            let mut dst = vec![0xEEu8; chunk];
            let mut want = dst.clone();
            // Rounds 0-1: a scatter out of a landing slot (sources in wire order, zeroed);
            // 2-3: the same with its pieces out of order (sources do not tile); 4-5: a
            // gather (no zeroing).
            let mut copies: Vec<HostCopy> = (0..chunk / piece)
                .map(|k| {
                    let to = order[k] * piece;
                    want[to..to + piece].copy_from_slice(&src[k * piece..(k + 1) * piece]);
                    HostCopy {
                        from: slot[k * piece..].as_ptr(),
                        to: dst[to..].as_mut_ptr(),
                        n: piece,
                    }
                })
                .collect();
            if round / 2 == 1 {
                copies.swap(0, 5);
            }
            let zero = (round < 4).then_some((slot.as_mut_ptr(), chunk));
            let job = CopyJob {
                copies,
                zero,
                cold_targets: round < 4,
                keep: Vec::new(),
            };
            let tiles = job.sources_tile_zero();
            assert_eq!(tiles, round < 2, "round {round}");
            // SAFETY: `slot` and `dst` outlive the job (`quiesce` below); targets distinct.
            let ticket = unsafe { pool.queue(job) }.expect("512 KiB is queued");
            pool.quiesce();
            assert!(ticket.is_done());
            let cut = policy.split && !(2..4).contains(&round);
            assert_eq!(
                ticket.parts(),
                if cut { helpers } else { 1 },
                "{helpers} helpers, round {round}, {policy:?}"
            );
            assert!(dst == want, "{helpers} helpers, round {round}, {policy:?}");
            if round < 4 {
                assert!(slot.iter().all(|&b| b == 0), "slot zeroed, round {round}");
            } else {
                assert!(slot == src, "a gather's source untouched");
            }
        }
    }
}

/// A job under `MIN_QUEUE_BYTES` is copied at once, helpers or not.
#[test]
fn a_small_job_is_copied_at_once() {
    let pool = HostCopies::new(2, HelperSpin::auto(true));
    let src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    let job = CopyJob {
        copies: vec![HostCopy {
            from: src.as_ptr(),
            to: dst.as_mut_ptr(),
            n: 4096,
        }],
        zero: None,
        cold_targets: false,
        keep: Vec::new(),
    };
    // SAFETY: two live, distinct vectors; the copy is over when `queue` returns None.
    assert!(unsafe { pool.queue(job) }.is_none());
    assert!(dst == src);
}

/// One large piece is cut into parts of about equal bytes, one per thread.
#[test]
fn one_large_piece_is_cut_across_every_thread() {
    let src: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; 1 << 20];
    let pool = HostCopies::new(3, HelperSpin::auto(true));
    let c = HostCopy {
        from: src.as_ptr(),
        to: dst.as_mut_ptr(),
        n: src.len(),
    };
    // SAFETY: two live, distinct 1 MiB vectors.
    unsafe { pool.copy_all(&[c]) };
    assert!(dst == src);
    assert_eq!(default_threads(2), 0);
    assert_eq!(default_threads(3), 0);
    assert_eq!(default_threads(4), 2);
    assert_eq!(default_threads(16), 8);
    assert_eq!(default_threads(128), MAX_DEFAULT_THREADS);
}

/// Work no helper can take (the pool closing) runs on the calling thread (`run_work`, as a
/// helper runs it): a scatter out of a landing slot cut in parts (sources zeroed), one whose pieces do not
/// tile the slot (whole, zeroed after), a gather; bytes exact, no ticket, nothing in flight.
#[test]
fn work_no_helper_can_take_runs_on_the_calling_thread() {
    let chunk = 512 * 1024;
    let piece = 16 * 1024;
    let src: Vec<u8> = (0..chunk).map(|i| (i * 29 + i / 811) as u8).collect();
    for (helpers, policy) in [1usize, 3]
        .into_iter()
        .flat_map(|h| policies().into_iter().map(move |p| (h, p)))
    {
        let pool = HostCopies::with_policy(helpers, policy);
        pool.close(); // the helpers end: none takes work from now on
        for round in 0..3 {
            let mut slot = src.clone();
            let mut dst = vec![0xEEu8; chunk];
            let mut copies: Vec<HostCopy> = (0..chunk / piece)
                .map(|k| {
                    let to = (chunk / piece - 1 - k) * piece;
                    HostCopy {
                        from: slot[k * piece..].as_ptr(),
                        to: dst[to..].as_mut_ptr(),
                        n: piece,
                    }
                })
                .collect();
            if round == 1 {
                copies.swap(0, 3);
            }
            let zero = (round < 2).then_some((slot.as_mut_ptr(), chunk));
            let job = CopyJob {
                copies,
                zero,
                cold_targets: false,
                keep: Vec::new(),
            };
            assert_eq!(job.sources_tile_zero(), round == 0);
            // SAFETY: `slot` and `dst` outlive the call, which copies them before it returns.
            let ticket = unsafe { pool.queue(job) };
            assert!(ticket.is_none(), "{helpers} helpers, round {round}: run here");
            assert_eq!(pool.in_flight(), 0);
            for k in 0..chunk / piece {
                let to = (chunk / piece - 1 - k) * piece;
                assert!(
                    dst[to..to + piece] == src[k * piece..(k + 1) * piece],
                    "{helpers} helpers, round {round}, {policy:?}: piece {k}"
                );
            }
            if round < 2 {
                assert!(slot.iter().all(|&b| b == 0), "slot zeroed, round {round}");
            } else {
                assert!(slot == src, "a gather's source untouched");
            }
        }
    }
}

/// The queue's order (session 28): by place (`Next`, `Due`, `Behind`), then oldest first;
/// `hurry` moves a job up to an earlier place keeping its age (once: a job already there, taken
/// or done is not moved). Checked on a pool whose one helper never runs, the test taking the
/// jobs in the queue's order and running them; bytes exact, tickets done.
#[test]
fn jobs_go_by_place_then_age_and_hurry_moves_a_waiting_one_up() {
    let mut pool = HostCopies::new(0, HelperSpin::auto(false));
    pool.helpers.push(Helper {
        stats: Arc::default(),
        spin: HelperSpin { max: Duration::ZERO },
        thread: None,
    });
    let chunk = 64 * 1024;
    let places = [
        Place::Behind,
        Place::Behind,
        Place::Due,
        Place::Next,
        Place::Behind,
        Place::Due,
        Place::Next,
    ];
    let src: Vec<u8> = (0..places.len() * chunk)
        .map(|i| (i * 31 + i / 4099) as u8)
        .collect();
    let mut dst = vec![0u8; src.len()];
    let mut tickets = Vec::new();
    for (j, &place) in places.iter().enumerate() {
        let job = CopyJob {
            copies: vec![HostCopy {
                from: src[j * chunk..].as_ptr(),
                to: dst[j * chunk..].as_mut_ptr(),
                n: chunk,
            }],
            zero: None,
            cold_targets: false,
            keep: Vec::new(),
        };
        // SAFETY: distinct targets in `dst`, sources in `src`, both alive until every job ran
        // (below, before the pool is dropped).
        tickets.push(unsafe { pool.queue_at(job, place) }.expect("64 KiB is queued"));
    }
    assert!(tickets.iter().all(|t| t.parts() == 1 && !t.is_done()));
    assert_eq!(
        pool.hurry(&tickets[4], Place::Next),
        1,
        "job 4 was behind: now next, by its age"
    );
    assert_eq!(
        pool.hurry(&tickets[4], Place::Due),
        0,
        "a later place moves nothing"
    );
    assert_eq!(pool.hurry(&tickets[3], Place::Next), 0, "next from the start");
    let mut order = Vec::new();
    while let Some(work) = pool.queue.try_pop() {
        let flag = work.done_flag().expect("a queued job").clone();
        let j = tickets
            .iter()
            .position(|t| Arc::ptr_eq(&t.parts[0], &flag))
            .expect("one of the test's jobs");
        order.push(j);
        // SAFETY: as queued above.
        unsafe { run_work(work, pool.routine) };
        flag.store(1, Ordering::Release);
        pool.queue.unfinished.fetch_sub(1, Ordering::Release);
        assert!(tickets[j].is_done());
        if j == 2 {
            assert_eq!(
                pool.hurry(&tickets[1], Place::Due),
                1,
                "job 1 goes before job 5 (older), and before job 0"
            );
        }
    }
    assert_eq!(order, [3, 4, 6, 2, 1, 5, 0]);
    assert_eq!(pool.hurry(&tickets[0], Place::Next), 0, "taken and done");
    assert!(dst == src, "every byte copied once");
    assert_eq!(pool.in_flight(), 0);
}
