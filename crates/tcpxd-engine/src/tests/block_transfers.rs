//! Block WRITEs and READs through the simulator: lists on both sides, random indices, every
//! receive protocol, the destination compared byte for byte with a per-block copy; the refusals
//! at the sender (from the token), at the receiver and at a READ's holder, each naming the field,
//! nothing landing and the pairing going on; planning a million blocks.

use super::*;
use crate::blocks::{IndexArray, Layout};

const SRC: usize = 1 << 20;
const DST: usize = 1 << 20;

/// `count` non-overlapping blocks of `lens` (one length each, cycled) at random places in a
/// buffer of `size` bytes, in random order: an explicit or uniform list.
fn scattered(s: &mut Sim, count: usize, lens: &[u64], size: usize) -> Layout {
    // Slots of the largest length, shuffled: blocks never overlap.
    let slot = *lens.iter().max().unwrap() as usize + s.rand(3);
    let slots = size / slot;
    assert!(slots >= count);
    let mut order: Vec<usize> = (0..slots).collect();
    for i in (1..order.len()).rev() {
        let j = s.rand(i + 1);
        order.swap(i, j);
    }
    let offsets: Vec<u64> = order[..count].iter().map(|&k| (k * slot) as u64).collect();
    let lens: Vec<u64> = (0..count).map(|i| lens[i % lens.len()]).collect();
    let lens = if lens.iter().all(|&l| l == lens[0]) {
        vec![lens[0]]
    } else {
        lens
    };
    Layout::compact(offsets, &lens).unwrap()
}

fn remote(s: &Sim, node: usize, list: u64, indices: IndexArray, token_blocks: bool) -> RemoteBlocks {
    let l = s.nodes[node].eng.block_list(list).unwrap();
    RemoteBlocks {
        list_id: list,
        access_key: s.nodes[node].eng.buffer_key(l.buffer()).unwrap(),
        blocks: if token_blocks { l.len() } else { 0 },
        block_len: if token_blocks {
            l.uniform_len().unwrap_or(0)
        } else {
            0
        },
        indices,
    }
}

/// What the destination buffer must hold after copying each pair whole.
fn expected(s: &Sim, src: (usize, u64), dst: (usize, u64), pairs: &[(u32, u32)]) -> Vec<u8> {
    let (sl, dl) = (
        s.nodes[src.0].eng.block_list(src.1).unwrap(),
        s.nodes[dst.0].eng.block_list(dst.1).unwrap(),
    );
    let sbuf = &s.nodes[src.0].bufs[&sl.buffer()];
    let mut want = s.nodes[dst.0].bufs[&dl.buffer()].clone();
    for &(a, b) in pairs {
        let ((so, sn), (d_off, dn)) = (sl.block(a).unwrap(), dl.block(b).unwrap());
        assert_eq!(sn, dn);
        want[d_off as usize..][..dn as usize].copy_from_slice(&sbuf[so as usize..][..sn as usize]);
    }
    want
}

/// Random pairs: sources may repeat, destinations never do.
fn random_pairs(s: &mut Sim, n: usize, src_len: u32, dst_len: u32) -> Vec<(u32, u32)> {
    let mut dst: Vec<u32> = (0..dst_len).collect();
    for i in (1..dst.len()).rev() {
        let j = s.rand(i + 1);
        dst.swap(i, j);
    }
    // Runs of consecutive destinations now and then (ranges encoding, merged runs).
    if s.rand(2) == 0 {
        dst[..n].sort_unstable();
    }
    (0..n)
        .map(|k| (s.rand(src_len as usize) as u32, dst[k]))
        .collect()
}

fn pack(idx: impl Iterator<Item = u32>) -> IndexArray {
    IndexArray::compact(&idx.collect::<Vec<u32>>())
}

#[test]
fn random_block_writes_and_reads_land_byte_exact() {
    every_mode(random_block_writes_and_reads_land_byte_exact_in_mode);
}

fn random_block_writes_and_reads_land_byte_exact_in_mode() {
    for seed in 0..8u64 {
        let read = seed % 2 == 1;
        let mut s = Sim::new(2, small_chunks(), 700 + seed);
        s.buffer(0, 1, SRC, 0);
        s.buffer(1, 2, DST, 0);
        // Node 0's list is the source of a WRITE, the destination of a READ.
        let (src_node, dst_node) = if read { (1, 0) } else { (0, 1) };
        let fill: Vec<u8> = (0..SRC).map(|i| (i * 7 + seed as usize) as u8).collect();
        let sb = if read { 2 } else { 1 };
        s.nodes[src_node].bufs.insert(sb, fill);
        // Uniform lengths (strided or scattered), or explicit lists of the same lengths.
        let lens: Vec<u64> = match seed % 4 {
            0 | 1 => vec![1 + s.rand(3000) as u64],
            _ => vec![100, 2500, 4096, 7, 9000],
        };
        let (n0, n1) = (60 + s.rand(60), 60 + s.rand(60));
        let l0 = if seed % 4 == 0 {
            Layout::Strided {
                first: 3,
                stride: lens[0] + 5,
                len: lens[0] as u32,
                count: n0 as u32,
            }
        } else {
            scattered(&mut s, n0, &lens, SRC)
        };
        let l1 = scattered(&mut s, n1, &lens, DST);
        let list0 = s.nodes[0].eng.register_blocks(1, l0).unwrap();
        let list1 = s.nodes[1].eng.register_blocks(2, l1).unwrap();
        let (src_list, dst_list) = if read { (list1, list0) } else { (list0, list1) };
        let (sl, dl) = (
            s.nodes[src_node].eng.block_list(src_list).unwrap().len(),
            s.nodes[dst_node].eng.block_list(dst_list).unwrap().len(),
        );
        // Pairs of equal length: with several lengths, keep the pairs whose lengths agree.
        let mut pairs = random_pairs(&mut s, (sl.min(dl) as usize) / 2 + 1, sl, dl);
        pairs.retain(|&(a, b)| {
            s.nodes[src_node]
                .eng
                .block_list(src_list)
                .unwrap()
                .block(a)
                .unwrap()
                .1
                == s.nodes[dst_node]
                    .eng
                    .block_list(dst_list)
                    .unwrap()
                    .block(b)
                    .unwrap()
                    .1
        });
        assert!(!pairs.is_empty());
        let want = expected(&s, (src_node, src_list), (dst_node, dst_list), &pairs);
        let srcs = pack(pairs.iter().map(|p| p.0));
        let dsts = pack(pairs.iter().map(|p| p.1));
        let token = seed % 3 != 0;
        let now = s.now;
        let dl_at = now + Duration::from_secs(60);
        let t = if read {
            let spec = BlockSpec {
                local_list: dst_list,
                local_indices: dsts,
                peer: P,
                remote: remote(&s, 1, src_list, srcs, token),
            };
            s.nodes[0].eng.start_read_blocks(spec, dl_at, now).unwrap()
        } else {
            let spec = BlockSpec {
                local_list: src_list,
                local_indices: srcs,
                peer: P,
                remote: remote(&s, 1, dst_list, dsts, token),
            };
            s.nodes[0]
                .eng
                .start_write_blocks(spec, b"blocks".to_vec(), dl_at, now)
                .unwrap()
        };
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "seed {seed}: {}", o.message);
        let dbuf = if read { 1 } else { 2 };
        assert!(
            s.nodes[dst_node].bufs[&dbuf] == want,
            "seed {seed}: the destination differs"
        );
        if !read {
            assert_eq!(s.nodes[1].notes.len(), 1);
        }
        s.assert_idle();
    }
}

/// Two nodes with a uniform list each: 16 blocks of 1000 bytes at a stride of 1024.
fn two_lists(seed: u64) -> (Sim, u64, u64) {
    let mut s = Sim::new(1, small_chunks(), seed);
    s.buffer(0, 1, 1 << 16, 3);
    s.buffer(1, 2, 1 << 16, 0);
    let strided = || Layout::Strided {
        first: 0,
        stride: 1024,
        len: 1000,
        count: 16,
    };
    let a = s.nodes[0].eng.register_blocks(1, strided()).unwrap();
    let b = s.nodes[1].eng.register_blocks(2, strided()).unwrap();
    (s, a, b)
}

fn write_spec(s: &Sim, a: u64, b: u64, local: &[u32], remote_idx: &[u32], token: bool) -> BlockSpec {
    BlockSpec {
        local_list: a,
        local_indices: IndexArray::from_indices(local),
        peer: P,
        remote: remote(s, 1, b, IndexArray::from_indices(remote_idx), token),
    }
}

#[test]
fn the_sender_refuses_what_the_token_shows_wrong_naming_the_field_and_changing_nothing() {
    let (mut s, a, b) = two_lists(800);
    let now = s.now;
    let dl = now + Duration::from_secs(5);
    let mut cases: Vec<(BlockSpec, Code, &str)> = vec![
        (
            write_spec(&s, 99, b, &[0], &[0], true),
            Code::NotFound,
            "local_list: list 99 does not exist",
        ),
        (
            write_spec(&s, a, b, &[0, 1], &[0], true),
            Code::InvalidArgument,
            "remote_indices: 1 blocks, but local_indices names 2",
        ),
        (
            write_spec(&s, a, b, &[0, 16], &[0, 1], true),
            Code::InvalidArgument,
            "local_indices[1]: block 16 is past the list's 16 blocks",
        ),
        (
            write_spec(&s, a, b, &[0, 1], &[3, 16], true),
            Code::InvalidArgument,
            "remote_indices[1]: block 16 is past the list's 16 blocks",
        ),
        (
            write_spec(&s, a, b, &[0, 1, 2], &[3, 4, 3], true),
            Code::InvalidArgument,
            "remote_indices[2]: block 3 is already named at 0",
        ),
    ];
    let mut wrong_len = write_spec(&s, a, b, &[0, 1], &[0, 1], true);
    wrong_len.remote.block_len = 999;
    cases.push((
        wrong_len,
        Code::InvalidArgument,
        "remote_indices[0]: block 0 is 999 bytes, but its partner is 1000 bytes",
    ));
    for (spec, code, words) in cases {
        let e = s.nodes[0]
            .eng
            .start_write_blocks(spec, Vec::new(), dl, now)
            .unwrap_err();
        assert_eq!(
            (e.code, e.message.contains(words)),
            (code, true),
            "{e} should say {words}"
        );
        assert!(
            s.nodes[0].eng.poll_action().is_none(),
            "a refused request emits nothing"
        );
        assert!(s.nodes[0].eng.is_idle());
    }
    // A destination named twice in a READ's local indices.
    let spec = BlockSpec {
        local_list: a,
        local_indices: IndexArray::from_indices(&[5, 5]),
        peer: P,
        remote: remote(&s, 1, b, IndexArray::from_indices(&[0, 1]), true),
    };
    let e = s.nodes[0].eng.start_read_blocks(spec, dl, now).unwrap_err();
    assert!(
        e.message
            .contains("local_indices[1]: block 5 is already named at 0"),
        "{e}"
    );
    assert_eq!(s.nodes[0].eng.buffer_users(1), Some(0));
}

/// Starts a block WRITE the receiver must refuse; it fails with `code` naming `words`, nothing
/// lands, every slot comes back, and a good transfer on the same pairing then succeeds.
fn refused_write(s: &mut Sim, spec: BlockSpec, code: Code, words: &str) {
    let now = s.now;
    let t = s.nodes[0]
        .eng
        .start_write_blocks(spec, b"x".to_vec(), now + Duration::from_secs(5), now)
        .unwrap();
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, code, "{}", o.message);
    assert!(o.message.contains(words), "{} should say {words}", o.message);
    assert!(s.nodes[1].bufs[&2].iter().all(|&b| b == 0), "nothing landed");
    assert!(s.nodes[1].notes.is_empty());
    s.assert_idle();
}

#[test]
fn the_receiver_refuses_a_bad_block_write_before_anything_lands() {
    every_mode(the_receiver_refuses_a_bad_block_write_before_anything_lands_in_mode);
}

fn the_receiver_refuses_a_bad_block_write_before_anything_lands_in_mode() {
    let (mut s, a, b) = two_lists(810);
    // Tokens without counts: the sender cannot check, the receiver does.
    let spec = write_spec(&s, a, b, &[0, 1], &[2, 16], false);
    refused_write(
        &mut s,
        spec,
        Code::InvalidArgument,
        "blocks.indices[1]: block 16 is past",
    );
    let mut spec = write_spec(&s, a, b, &[0], &[0], false);
    spec.remote.list_id = 777;
    refused_write(
        &mut s,
        spec,
        Code::NotFound,
        "blocks.list_id: list 777 does not exist",
    );
    let spec = write_spec(&s, a, b, &[0, 1], &[4, 4], false);
    refused_write(
        &mut s,
        spec,
        Code::InvalidArgument,
        "blocks.indices[1]: block 4 is already named",
    );
    // A stale token: the receiver's buffer was rekeyed after it was handed out.
    let spec = write_spec(&s, a, b, &[0], &[0], true);
    s.nodes[1].eng.rekey_buffer(2, [0xEE; 16]).unwrap();
    refused_write(
        &mut s,
        spec,
        Code::PermissionDenied,
        "blocks.access_key: wrong access key for list",
    );
    // Lengths that disagree with the receiver's list (its list of other lengths, token silent).
    let other = s.nodes[1]
        .eng
        .register_blocks(
            2,
            Layout::Explicit {
                offsets: vec![0, 2000, 4000],
                lens: vec![1000, 900, 1000],
            },
        )
        .unwrap();
    let spec = BlockSpec {
        local_list: a,
        local_indices: IndexArray::from_indices(&[0, 1, 2]),
        peer: P,
        remote: remote(&s, 1, other, IndexArray::from_indices(&[0, 1, 2]), false),
    };
    refused_write(
        &mut s,
        spec,
        Code::InvalidArgument,
        "blocks.indices[1]: block 1 is 900 bytes, but its partner is 1000 bytes",
    );
    // The pairing goes on: a good block write lands.
    let spec = BlockSpec {
        local_list: a,
        local_indices: IndexArray::from_indices(&[0, 2]),
        peer: P,
        remote: remote(&s, 1, other, IndexArray::from_indices(&[2, 0]), true),
    };
    let now = s.now;
    let t = s.nodes[0]
        .eng
        .start_write_blocks(spec, Vec::new(), now + Duration::from_secs(5), now)
        .unwrap();
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 4000), 1000) && s.same((0, 1, 2048), (1, 2, 0), 1000));
    s.assert_idle();
}

#[test]
fn the_holder_refuses_a_bad_block_read_naming_the_field() {
    every_mode(the_holder_refuses_a_bad_block_read_naming_the_field_in_mode);
}

fn the_holder_refuses_a_bad_block_read_naming_the_field_in_mode() {
    // Node 0 reads node 1's list into its own: node 1 holds the source.
    let (mut s, a, b) = two_lists(820);
    let pattern: Vec<u8> = (0..1 << 16).map(|i: usize| (i % 253) as u8 + 1).collect();
    s.nodes[1].bufs.insert(2, pattern);
    let before = s.nodes[0].bufs[&1].clone();
    let read = |s: &mut Sim, spec: BlockSpec| {
        let now = s.now;
        let t = s.nodes[0]
            .eng
            .start_read_blocks(spec, now + Duration::from_secs(5), now)
            .unwrap();
        s.run();
        t
    };
    let spec = |s: &Sim, src: &[u32], token: bool| BlockSpec {
        local_list: a,
        local_indices: IndexArray::from_indices(&[0, 1]),
        peer: P,
        remote: remote(s, 1, b, IndexArray::from_indices(src), token),
    };
    let mut cases: Vec<(BlockSpec, Code, &str)> = Vec::new();
    cases.push((
        spec(&s, &[0, 20], false),
        Code::InvalidArgument,
        "blocks.source_indices[1]: block 20 is past the list's 16 blocks",
    ));
    let mut unknown = spec(&s, &[0, 1], false);
    unknown.remote.list_id = 4242;
    cases.push((
        unknown,
        Code::NotFound,
        "blocks.source_list: list 4242 does not exist",
    ));
    let mut stale = spec(&s, &[0, 1], true);
    stale.remote.access_key = [0xAB; 16];
    cases.push((
        stale,
        Code::PermissionDenied,
        "blocks.source_key: wrong access key",
    ));
    for (spec, code, words) in cases {
        let t = read(&mut s, spec);
        let o = s.outcome(0, t);
        assert_eq!(o.code, code, "{}", o.message);
        assert!(o.message.contains(words), "{} should say {words}", o.message);
        assert!(s.nodes[0].bufs[&1] == before, "nothing landed");
        s.assert_idle();
    }
    // Lengths that disagree at the holder: its list of other lengths.
    let other = s.nodes[1]
        .eng
        .register_blocks(
            2,
            Layout::Explicit {
                offsets: vec![0, 2000],
                lens: vec![1000, 999],
            },
        )
        .unwrap();
    let mut bad_len = spec(&s, &[0, 1], false);
    bad_len.remote = remote(&s, 1, other, IndexArray::from_indices(&[0, 1]), false);
    let t = read(&mut s, bad_len);
    let o = s.outcome(0, t);
    assert!(
        o.message
            .contains("blocks.source_indices[1]: block 1 is 999 bytes, but its partner is 1000 bytes"),
        "{}",
        o.message
    );
    // The pairing goes on.
    let good = spec(&s, &[7, 3], true);
    let t = read(&mut s, good);
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 7 * 1024), 1000) && s.same((0, 1, 1024), (1, 2, 3 * 1024), 1000));
    s.assert_idle();
}

#[test]
fn an_offer_whose_header_differs_from_the_read_is_refused() {
    let (mut s, a, b) = two_lists(830);
    let now = s.now;
    let spec = BlockSpec {
        local_list: a,
        local_indices: IndexArray::from_indices(&[0, 1]),
        peer: P,
        remote: remote(&s, 1, b, IndexArray::from_indices(&[2, 3]), true),
    };
    let t = s.nodes[0]
        .eng
        .start_read_blocks(spec, now + Duration::from_secs(5), now)
        .unwrap();
    s.drain();
    // The holder answers, but a tampered echo (other destination indices) comes back.
    let req = s.ctrl[1].pop_front().unwrap();
    s.nodes[1].eng.on_message(P, req, now);
    s.drain();
    let tamper = |o: &mut Offer| o.blocks.as_mut().unwrap().indices = IndexArray::from_indices(&[1, 0]);
    let msg = loop {
        match s.ctrl[0].pop_front().expect("the holder's offer") {
            PeerMsg::Offer(mut o) if o.read_id != 0 => {
                tamper(&mut o);
                break PeerMsg::Offer(o);
            }
            PeerMsg::Header(mut o) if o.read_id != 0 => {
                tamper(&mut o);
                break PeerMsg::Header(o);
            }
            m => s.nodes[0].eng.on_message(P, m, now),
        }
    };
    let before = s.nodes[0].bufs[&1].clone();
    s.nodes[0].eng.on_message(P, msg, now);
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::InvalidArgument);
    assert!(o.message.contains("does not match read"), "{}", o.message);
    assert!(s.nodes[0].bufs[&1] == before, "nothing landed");
    s.assert_idle();
}

#[test]
fn removing_a_buffer_releases_its_lists() {
    let (mut s, a, _) = two_lists(840);
    assert!(s.nodes[0].eng.block_list(a).is_some());
    s.nodes[0].eng.remove_buffer(1).unwrap();
    assert!(s.nodes[0].eng.block_list(a).is_none());
    let e = s.nodes[0].eng.release_blocks(a).unwrap_err();
    assert_eq!(e.code, Code::NotFound);
}

#[test]
fn a_million_blocks_plan_on_both_sides() {
    // No timing asserted (debug builds are slow): planning is per transfer, one pass per side.
    const N: u32 = 1 << 20;
    let strided = Layout::Strided {
        first: 0,
        stride: 4096,
        len: 4096,
        count: N,
    };
    let size = u64::from(N) * 4096;
    let mk = |node: &str| {
        let mut e = Engine::new(EngineConfig::default());
        e.add_buffer(1, size, key(1)).unwrap();
        let l = e.register_blocks(1, strided.clone()).unwrap();
        let p = e.add_peer(node, 1, 1);
        e.on_lane_ready(p, 0, true);
        e.on_lane_ready(p, 0, false);
        rendezvous_peer(&mut e, p);
        (e, l, p)
    };
    let (mut snd, ls, p) = mk("b");
    let (mut rcv, lr, q) = mk("a");
    // Scattered on both sides: a stride-3 walk at the source, reversed at the destination.
    let src: Vec<u32> = (0..N).map(|i| (i * 3) % N).collect();
    let dst: Vec<u32> = (0..N).rev().collect();
    let spec = BlockSpec {
        local_list: ls,
        local_indices: IndexArray::compact(&src),
        peer: p,
        remote: RemoteBlocks {
            list_id: lr,
            access_key: key(1),
            blocks: N,
            block_len: 4096,
            indices: IndexArray::compact(&dst),
        },
    };
    let now = Instant::now();
    snd.start_write_blocks(spec, Vec::new(), now + Duration::from_secs(60), now)
        .unwrap();
    let offer = std::iter::from_fn(|| snd.poll_action())
        .find_map(|a| match a {
            Action::Control {
                msg: PeerMsg::Offer(o),
                ..
            } => Some(o),
            _ => None,
        })
        .expect("the offer");
    assert_eq!(offer.blocks.as_ref().unwrap().total, size);
    rcv.on_message(q, PeerMsg::Offer(offer), now);
    let actions: Vec<Action> = std::iter::from_fn(|| rcv.poll_action()).collect();
    assert!(
        actions.iter().any(|a| matches!(
            a,
            Action::Control {
                msg: PeerMsg::Accept { .. },
                ..
            }
        )),
        "accepted"
    );
    // 1M blocks of 4 KiB in chunks of 512 KiB: each chunk is 128 pieces on both sides.
    let scatters = actions
        .iter()
        .filter(|a| matches!(a, Action::PostScatterRecv { .. }))
        .count();
    assert_eq!(scatters, 16, "the receive window's worth posted");
    let Action::PostScatterRecv { offer, wire, len, .. } = actions
        .iter()
        .find(|a| matches!(a, Action::PostScatterRecv { .. }))
        .unwrap()
    else {
        unreachable!()
    };
    assert_eq!(rcv.recv_pieces(q, *offer, *wire, *len).unwrap().count(), 128);
}

/// A block WRITE or READ of 200 scattered 1500-byte blocks stopped after `steps` events by a
/// cancel (0), its deadline (1) or the peer failing (2): true when the stop ended it. Every slot,
/// credit and buffer user comes back either way.
fn stop_blocks_midway(read: bool, how: u8, seed: u64) -> bool {
    let mut s = Sim::new(2, small_chunks(), seed);
    s.buffer(0, 1, SRC, 4);
    s.buffer(1, 2, DST, 0);
    let l0 = scattered(&mut s, 200, &[1500], SRC);
    let l1 = scattered(&mut s, 200, &[1500], DST);
    let a = s.nodes[0].eng.register_blocks(1, l0).unwrap();
    let b = s.nodes[1].eng.register_blocks(2, l1).unwrap();
    let pairs = random_pairs(&mut s, 200, 200, 200);
    let spec = BlockSpec {
        local_list: a,
        local_indices: pack(pairs.iter().map(|p| if read { p.1 } else { p.0 })),
        peer: P,
        remote: remote(
            &s,
            1,
            b,
            pack(pairs.iter().map(|p| if read { p.0 } else { p.1 })),
            true,
        ),
    };
    let now = s.now;
    let deadline = now + Duration::from_millis(50);
    let t = if read {
        s.nodes[0].eng.start_read_blocks(spec, deadline, now).unwrap()
    } else {
        s.nodes[0]
            .eng
            .start_write_blocks(spec, Vec::new(), deadline, now)
            .unwrap()
    };
    let steps = 5 + s.rand(50);
    for _ in 0..steps {
        s.step();
    }
    match how {
        0 => {
            s.nodes[0].eng.cancel(t, Code::Cancelled, "stop");
        }
        1 => s.nodes[0].eng.on_tick(deadline),
        _ => {
            for i in 0..2 {
                s.nodes[i].eng.on_peer_failed(P, "lane 1: connection reset");
            }
            s.drain();
            assert_eq!(s.outcome(0, t).code, Code::Unavailable);
            for (i, buf) in [(0, 1), (1, 2)] {
                let e = &mut s.nodes[i].eng;
                assert!(e.is_idle() && e.lanes_idle() && e.posted() == (0, 0));
                assert_eq!(e.buffer_users(buf), Some(0));
                e.remove_buffer(buf).expect("no user is left");
            }
            return true;
        }
    }
    s.run();
    let o = s.outcome(0, t);
    let want = [Code::Cancelled, Code::DeadlineExceeded][how as usize];
    assert!(
        o.code == want || o.code == Code::Ok,
        "{:?}: {}",
        o.code,
        o.message
    );
    s.assert_idle();
    o.code == want
}

#[test]
fn block_transfers_stopped_midway_return_every_slot_and_credit() {
    every_mode(block_transfers_stopped_midway_in_mode);
}

fn block_transfers_stopped_midway_in_mode() {
    let mut stopped = [0; 3];
    for seed in 0..3 {
        for read in [false, true] {
            for how in 0..3u8 {
                stopped[how as usize] +=
                    u32::from(stop_blocks_midway(read, how, 900 + seed * 10 + u64::from(how)));
            }
        }
    }
    assert!(
        stopped.iter().all(|&n| n >= 3),
        "most stops land midway: {stopped:?}"
    );
}
