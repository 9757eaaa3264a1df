//! Rejections: fragment lists that break the bounds, jobs whose lengths do not add up, unknown
//! tickets; only the bad receives fail, and nothing is written outside a destination.

use super::*;

/// Writes `frags` into slot `slot` of the fixture's ring (as the plugin does) and returns the
/// list with its device view, as the poller hands it over.
fn ring_list<'a>(ring: &'a PinnedRegion, slot_off: usize, frags: &[loadMeta]) -> FragmentList<'a> {
    let raw: Vec<u8> = frags
        .iter()
        .flat_map(|f| {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&f.src_off.to_le_bytes());
            b[4..8].copy_from_slice(&f.len.to_le_bytes());
            b[8..].copy_from_slice(&f.dst_off.to_le_bytes());
            b
        })
        .collect();
    ring.write(slot_off, &raw).unwrap();
    FragmentList::from_pinned(ring, slot_off, frags.len()).unwrap()
}

/// Polls a batch to its end: Ok, or the error `is_done` reported.
fn outcome(u: &mut dyn Unpacker, t: Ticket) -> Result<(), UnpackError> {
    let start = Instant::now();
    loop {
        if u.is_done(&t)? {
            return Ok(());
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{}: batch never finished",
            u.name()
        );
        std::hint::spin_loop();
    }
}

/// An exact job whose fragments do not add up to its destination is refused by every
/// implementation: at `push` where the host reads the list, at `is_done` where the kernel reads
/// the ring in place (and adds the lengths up itself).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_exact_jobs_must_add_up() {
    let fx = Fixture::new(10, 4 << 20);
    let short = [lm(0, 4096, 4096), lm(8192, 4000, 0)];
    let dst = fx.gpu.alloc(8192).unwrap();
    for_each_impl(|u| {
        let job = UnpackJob {
            frags: ring_list(&fx.ring, 0, &short),
            bounce: fx.bounce.span(),
            dst: dst.span(),
            exact: true,
        };
        match u.push(&job) {
            Err(e) => {
                assert_ne!(u.name(), "kernel-mapped");
                assert!(
                    matches!(
                        e,
                        UnpackError::Short {
                            landed: 8096,
                            expected: 8192
                        }
                    ),
                    "{}: {e}",
                    u.name()
                );
                assert!(
                    u.submit().unwrap().is_none(),
                    "{}: a refused job queued work",
                    u.name()
                );
            }
            Ok(()) => {
                assert_eq!(u.name(), "kernel-mapped", "accepted a short exact job");
                let t = u.submit().unwrap().unwrap();
                let e = outcome(u, t).unwrap_err();
                assert!(
                    matches!(
                        e,
                        UnpackError::DeviceShort {
                            task: 0,
                            landed: 8096,
                            expected: 8192
                        }
                    ),
                    "{e}"
                );
                assert!(e.is_data());
                // What names it on the host (the poller's `check_list`).
                assert!(matches!(validate(&job), Err(UnpackError::Short { .. })));
            }
        }
        // The same list, not exact: accepted, and the gap left alone.
        u.push(&UnpackJob { exact: false, ..job }).unwrap();
        if let Some(t) = u.submit().unwrap() {
            outcome(u, t).unwrap();
        }
    });
}

/// The ring read in place (`kernel-mapped`): the host reads nothing before the launch, so the
/// kernel's guard is what keeps a bad list out of bounds, and the kernel's sums of lengths are
/// what catch a short one. Only the bad receives are affected: the others in the same batch are
/// unpacked whole, the host check of each list names what was wrong (the out-of-bounds
/// fragment, the short list), and the next batch is fine.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_in_place_rejections_touch_only_the_bad_receives() {
    let fx = Fixture::new(11, 4 << 20);
    let mut u = UnpackImpl::Kernel(FragSource::Mapped).build(&fx.gpu).unwrap();
    let mut rng = Rng::new(23);
    let dst_len = 8 * 4096u64;
    let stride = dst_len + 4096;
    let good0 = shuffled_pages(&mut rng, 4 << 20, 8).frags;
    let mut past = shuffled_pages(&mut rng, 4 << 20, 8).frags;
    let bad_index = past.iter().position(|f| f.dst_off == 7 * 4096).unwrap();
    past[bad_index].dst_off = 7 * 4096 + 100; // its last 100 bytes past the destination
    let mut short = shuffled_pages(&mut rng, 4 << 20, 8).frags;
    let dropped = short.pop().unwrap();
    let good3 = shuffled_pages(&mut rng, 4 << 20, 8).frags;
    let lists = [&good0, &past, &short, &good3];
    let dst = fx.gpu.alloc(4 * stride as usize).unwrap();
    let mut expect = vec![POISON; dst.len()];
    dst.write(0, &expect).unwrap();
    for (j, frags) in lists.iter().enumerate() {
        u.push(&UnpackJob {
            frags: ring_list(&fx.ring, j * RING_SLOT_BYTES, frags),
            bounce: fx.bounce.span(),
            dst: dst.subspan(j as u64 * stride, dst_len).unwrap(),
            exact: true,
        })
        .unwrap();
        // What the kernel must have copied: everything but the out-of-bounds fragment.
        let copied: Vec<loadMeta> = frags
            .iter()
            .filter(|f| f.dst_off + u64::from(f.len) <= dst_len)
            .copied()
            .collect();
        gather(&mut expect, j as u64 * stride, &fx.bounce_host, 0, &copied);
    }
    let t = u.submit().unwrap().unwrap();
    let e = outcome(u.as_mut(), t).unwrap_err();
    assert!(
        matches!(
            e,
            UnpackError::DeviceRejected { task: 1, fragment } if fragment as usize == bad_index
        ),
        "{e}"
    );
    assert!(e.is_data());
    let mut got = vec![0u8; dst.len()];
    dst.read_into(&fx.stream, 0, &mut got).unwrap();
    compare("in place, batch with bad receives", &got, &expect);
    // The host check names each receive's fault (the poller's `check_list`).
    let bounce_len = fx.bounce.len() as u64;
    assert_eq!(validate_list(&good0, bounce_len, dst_len, true).unwrap(), dst_len);
    assert!(matches!(
        validate_list(&past, bounce_len, dst_len, true),
        Err(UnpackError::Fragment { index, .. }) if index == bad_index
    ));
    assert!(matches!(
        validate_list(&short, bounce_len, dst_len, true),
        Err(UnpackError::Short { landed, expected }) if landed == dst_len - u64::from(dropped.len) && expected == dst_len
    ));
    assert_eq!(validate_list(&good3, bounce_len, dst_len, true).unwrap(), dst_len);
    // The short list alone in a batch, after a good one: found by the kernel's sums.
    for (j, frags) in [&good0, &short].iter().enumerate() {
        u.push(&UnpackJob {
            frags: ring_list(&fx.ring, j * RING_SLOT_BYTES, frags),
            bounce: fx.bounce.span(),
            dst: dst.subspan(j as u64 * stride, dst_len).unwrap(),
            exact: true,
        })
        .unwrap();
    }
    let t = u.submit().unwrap().unwrap();
    let e = outcome(u.as_mut(), t).unwrap_err();
    assert!(
        matches!(e, UnpackError::DeviceShort { task: 1, landed, expected }
            if landed == dst_len - u64::from(dropped.len) && expected == dst_len),
        "{e}"
    );
    // Nothing sticks: the next batch is fine.
    dst.write(0, &vec![POISON; dst.len()]).unwrap();
    let mut expect = vec![POISON; dst.len()];
    u.push(&UnpackJob {
        frags: ring_list(&fx.ring, 0, &good3),
        bounce: fx.bounce.span(),
        dst: dst.subspan(0, dst_len).unwrap(),
        exact: true,
    })
    .unwrap();
    gather(&mut expect, 0, &fx.bounce_host, 0, &good3);
    let t = u.submit().unwrap().unwrap();
    outcome(u.as_mut(), t).unwrap();
    dst.read_into(&fx.stream, 0, &mut got).unwrap();
    compare("in place, the batch after", &got, &expect);
}

/// Receives read in place, more than one launch holds (64): launches of 64, 64 and 2, each
/// reporting the batches before it, and every byte right, round after round; a short receive in
/// the second launch is named by its place in the batch.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_in_place_across_launches() {
    let fx = Fixture::new(12, 16 << 20);
    let mut u = UnpackImpl::Kernel(FragSource::Mapped).build(&fx.gpu).unwrap();
    let receives = 130usize;
    let pages = 16u64;
    let dst_len = pages * 4096;
    let lists_mem = fx.gpu.alloc_pinned(receives * pages as usize * 16).unwrap();
    let dst = fx.gpu.alloc(receives * dst_len as usize).unwrap();
    for round in 0..3u64 {
        let short_at = (round == 1).then_some(100usize);
        let mut rng = Rng::new(29 + round);
        let mut expect = vec![POISON; dst.len()];
        dst.write(0, &expect).unwrap();
        for j in 0..receives {
            let mut frags = shuffled_pages(&mut rng, 16 << 20, pages).frags;
            if Some(j) == short_at {
                frags.pop();
            }
            let off = j * pages as usize * 16;
            u.push(&UnpackJob {
                frags: ring_list(&lists_mem, off, &frags),
                bounce: fx.bounce.span(),
                dst: dst.subspan(j as u64 * dst_len, dst_len).unwrap(),
                exact: true,
            })
            .unwrap();
            gather(&mut expect, j as u64 * dst_len, &fx.bounce_host, 0, &frags);
        }
        let t = u.submit().unwrap().unwrap();
        assert_eq!(t.seq(), round + 1);
        match short_at {
            None => outcome(u.as_mut(), t).unwrap(),
            Some(j) => {
                let e = outcome(u.as_mut(), t).unwrap_err();
                assert!(
                    matches!(e, UnpackError::DeviceShort { task, .. } if task as usize == j),
                    "{e}"
                );
            }
        }
        let mut got = vec![0u8; dst.len()];
        dst.read_into(&fx.stream, 0, &mut got).unwrap();
        compare(&format!("130 receives, round {round}"), &got, &expect);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release -- --ignored"]
fn gpu_unpack_unknown_ticket_is_an_error() {
    let fx = Fixture::new(8, 1 << 20);
    let gpu = fx.gpu.clone();
    let mut a = UnpackImpl::D2d.build(&gpu).unwrap();
    let mut b = UnpackImpl::D2d.build(&gpu).unwrap();
    let dst = gpu.alloc(4096).unwrap();
    let frags = [lm(0, 4096, 0)];
    a.push(&UnpackJob {
        frags: FragmentList::host(&frags),
        bounce: fx.bounce.span(),
        dst: dst.span(),
        exact: false,
    })
    .unwrap();
    let t = a.submit().unwrap().unwrap();
    assert!(matches!(b.is_done(&t), Err(UnpackError::UnknownTicket(_))));
    a.wait(&t).unwrap();
    assert!(a.is_done(&t).unwrap());
    // The same for the kernel unpacker (its tickets come from its completion word).
    let mut k = UnpackImpl::default().build(&gpu).unwrap();
    k.push(&UnpackJob {
        frags: FragmentList::host(&frags),
        bounce: fx.bounce.span(),
        dst: dst.span(),
        exact: false,
    })
    .unwrap();
    let kt = k.submit().unwrap().unwrap();
    assert!(matches!(k.is_done(&t), Err(UnpackError::UnknownTicket(_))));
    assert!(matches!(a.is_done(&kt), Err(UnpackError::UnknownTicket(_))));
    k.wait(&kt).unwrap();
    assert!(k.is_done(&kt).unwrap());
}
