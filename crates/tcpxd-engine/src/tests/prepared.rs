//! Prepared lists: preparing (each entry checked once, the error naming the first bad one, the
//! limits), transfers by entry index (grouping by list pair, consecutive entries merged into
//! ranges, a group past the transfer limit split, every check before anything starts), the kept
//! notification (sent once after the last part, never on failure or cancel, a READ's to the
//! holder), and prepared WRITEs and READs of many groups through the simulator, bytes compared.

use super::*;
use crate::blocks::{IndexArray, Layout, MAX_TRANSFER_BLOCKS};

const BUF: usize = 1 << 17;

fn entries(v: &[(u32, u32, u32)]) -> Vec<PreparedEntry> {
    v.iter()
        .map(|&(list, first, count)| PreparedEntry { list, first, count })
        .collect()
}

fn remote_list(s: &Sim, node: usize, list: u64) -> RemoteList {
    let l = s.nodes[node].eng.block_list(list).unwrap();
    RemoteList {
        list_id: list,
        access_key: s.nodes[node].eng.buffer_key(l.buffer()).unwrap(),
        blocks: l.len(),
        block_len: l.uniform_len().unwrap_or(0),
    }
}

/// Two lists a node: 64 blocks of 1000 bytes each, strided in one buffer and scattered (uniform,
/// reversed) in another; node 0's buffers 1 and 2 hold a pattern, node 1's 3 and 4 zeros.
struct Setup {
    s: Sim,
    /// Node 0's lists, node 1's lists.
    lists: [[u64; 2]; 2],
    /// On node 0: a local prepared list over its lists, a remote one over node 1's; 16 entries of
    /// 4 blocks per list (entry e: list e / 16, blocks (e % 16) * 4 ..).
    local: u64,
    remote: u64,
}

fn setup(seed: u64) -> Setup {
    let mut s = Sim::new(2, small_chunks(), seed);
    s.buffer(0, 1, BUF, 5);
    s.buffer(0, 2, BUF, 9);
    s.buffer(1, 3, BUF, 0);
    s.buffer(1, 4, BUF, 0);
    let strided = || Layout::Strided {
        first: 100,
        stride: 1024,
        len: 1000,
        count: 64,
    };
    let scattered = || Layout::Uniform {
        offsets: (0..64u64).rev().map(|i| 7 + i * 1500).collect(),
        len: 1000,
    };
    let mut lists = [[0; 2]; 2];
    for (n, bufs) in [(0usize, [1u64, 2]), (1, [3, 4])] {
        lists[n][0] = s.nodes[n].eng.register_blocks(bufs[0], strided()).unwrap();
        lists[n][1] = s.nodes[n].eng.register_blocks(bufs[1], scattered()).unwrap();
    }
    let shape: Vec<(u32, u32, u32)> = (0..32).map(|e| (e / 16, (e % 16) * 4, 4)).collect();
    let local = s.nodes[0]
        .eng
        .prepare_local(lists[0].to_vec(), entries(&shape))
        .unwrap();
    assert_eq!((local.entries, local.blocks), (32, 128));
    let rl = vec![remote_list(&s, 1, lists[1][0]), remote_list(&s, 1, lists[1][1])];
    let remote = s.nodes[0].eng.prepare_remote(P, rl, entries(&shape)).unwrap();
    Setup {
        s,
        lists,
        local: local.id,
        remote: remote.id,
    }
}

/// Block `j` of entry `e` of the setup's prepared lists on `node`: (buffer, offset, length).
fn block_of(st: &Setup, node: usize, e: u32, j: u32) -> (u64, u64, u32) {
    let list = st.lists[node][(e / 16) as usize];
    let l = st.s.nodes[node].eng.block_list(list).unwrap();
    let (off, len) = l.block((e % 16) * 4 + j).unwrap();
    (l.buffer(), off, len)
}

/// What the destination node's buffers must hold after each pair's blocks were copied whole.
fn expected(st: &Setup, read: bool, local: &[u32], remote: &[u32]) -> HashMap<u64, Vec<u8>> {
    let (src, dst) = if read { (1, 0) } else { (0, 1) };
    let mut want = st.s.nodes[dst].bufs.clone();
    for (&l, &r) in local.iter().zip(remote) {
        let (se, de) = if read { (r, l) } else { (l, r) };
        for j in 0..4 {
            let (sb, so, sn) = block_of(st, src, se, j);
            let (db, d_off, dn) = block_of(st, dst, de, j);
            assert_eq!(sn, dn);
            let data = st.s.nodes[src].bufs[&sb][so as usize..][..sn as usize].to_vec();
            want.get_mut(&db).unwrap()[d_off as usize..][..dn as usize].copy_from_slice(&data);
        }
    }
    want
}

/// Random pairs: sources may repeat, destinations never do; runs of consecutive entries now
/// and then.
fn random_pairs(s: &mut Sim, n: usize, read: bool) -> (Vec<u32>, Vec<u32>) {
    let mut dst: Vec<u32> = (0..32).collect();
    for i in (1..dst.len()).rev() {
        let j = s.rand(i + 1);
        dst.swap(i, j);
    }
    if s.rand(2) == 0 {
        dst[..n].sort_unstable();
    }
    let src: Vec<u32> = (0..n)
        .map(|k| if k % 3 == 0 { k as u32 } else { s.rand(32) as u32 })
        .collect();
    let dst = dst[..n].to_vec();
    if read { (dst, src) } else { (src, dst) }
}

#[test]
fn prepared_writes_and_reads_of_many_groups_land_byte_exact_with_one_notification() {
    every_mode(prepared_writes_and_reads_in_mode);
}

fn prepared_writes_and_reads_in_mode() {
    for seed in 0..6u64 {
        let read = seed % 2 == 1;
        let mut st = setup(900 + seed);
        let n = 12 + st.s.rand(20);
        let (local, remote) = random_pairs(&mut st.s, n, read);
        let want = expected(&st, read, &local, &remote);
        let (now, dl) = (st.s.now, st.s.now + Duration::from_secs(60));
        let eng = &mut st.s.nodes[0].eng;
        let t = if read {
            eng.start_read_prepared(st.local, &local, st.remote, &remote, b"pulled".to_vec(), dl, now)
        } else {
            eng.start_write_prepared(st.local, &local, st.remote, &remote, b"pushed".to_vec(), dl, now)
        }
        .unwrap();
        // Step until the notification is delivered: by then every byte is in place.
        let dst = if read { 0 } else { 1 };
        let mut steps = 0;
        while st.s.nodes[1].notes.is_empty() && st.s.step() {
            steps += 1;
            assert!(steps < 1_000_000);
        }
        assert_eq!(
            st.s.nodes[1].notes,
            vec![(
                t.0,
                if read {
                    b"pulled".to_vec()
                } else {
                    b"pushed".to_vec()
                }
            )],
            "seed {seed}: one notification, under the transfer's id"
        );
        for (b, data) in &want {
            assert!(
                st.s.nodes[dst].bufs[b] == *data,
                "seed {seed}: buffer {b} differs"
            );
        }
        st.s.run();
        let o = st.s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "seed {seed}: {}", o.message);
        assert_eq!(o.landed, n as u64 * 4000);
        assert_eq!(st.s.nodes[1].notes.len(), 1, "seed {seed}: delivered once");
        assert!(st.s.nodes[0].notes.is_empty());
        st.s.assert_idle();
    }
}

/// The offers (or headers) a node sent, still queued towards the other.
fn offers_sent(s: &mut Sim, from: usize) -> Vec<Offer> {
    s.drain();
    s.ctrl[1 - from]
        .iter()
        .filter_map(|m| match m {
            PeerMsg::Offer(o) | PeerMsg::Header(o) => Some(o.clone()),
            _ => None,
        })
        .collect()
}

fn ranges_of(a: &IndexArray) -> Vec<u32> {
    a.iter().collect()
}

#[test]
fn pairs_group_by_list_pair_in_order_with_consecutive_entries_merged() {
    let mut st = setup(1);
    let (now, dl) = (st.s.now, st.s.now + Duration::from_secs(60));
    // Entries 0, 1, 2 are list 0's blocks 0..12; 16 is list 1's blocks 0..4.
    let local = [0, 1, 16, 2];
    let remote = [0, 1, 2, 16];
    let t = st.s.nodes[0]
        .eng
        .start_write_prepared(st.local, &local, st.remote, &remote, b"n".to_vec(), dl, now)
        .unwrap();
    let offers = offers_sent(&mut st.s, 0);
    assert_eq!(offers.len(), 3, "one part per (local list, remote list)");
    let [c, d] = st.lists[1];
    let want: [(u64, Vec<u32>); 3] = [
        (c, (0..8).collect()),  // (list 0, list C): pairs 0 and 1, merged
        (c, (8..12).collect()), // (list 1, list C): pair 2
        (d, (0..4).collect()),  // (list 0, list D): pair 3
    ];
    for (o, (list, idx)) in offers.iter().zip(want) {
        let h = o.blocks.as_ref().unwrap();
        assert_eq!(h.list_id, list);
        assert_eq!(ranges_of(&h.indices), idx);
        assert_eq!(h.indices.encoding(), crate::blocks::IndexEncoding::Ranges);
        assert!(
            o.notification.is_empty(),
            "a WRITE of several parts keeps its notification"
        );
    }
    assert_eq!(
        offers[0].blocks.as_ref().unwrap().indices.bytes().len(),
        8,
        "pairs 0 and 1 are one range"
    );
    assert_eq!(st.s.nodes[0].progress[&t], 0);
    st.s.run();
    assert_eq!(st.s.outcome(0, t).code, Code::Ok);
    assert_eq!(st.s.nodes[1].notes, vec![(t.0, b"n".to_vec())]);
    st.s.assert_idle();

    // A WRITE of one part carries the notification on its offer, as any block WRITE.
    let t = st.s.nodes[0]
        .eng
        .start_write_prepared(st.local, &[3, 4], st.remote, &[5, 6], b"one".to_vec(), dl, now)
        .unwrap();
    let offers = offers_sent(&mut st.s, 0);
    assert_eq!(offers.len(), 1);
    assert_eq!(offers[0].notification, b"one".to_vec());
    st.s.run();
    assert_eq!(st.s.outcome(0, t).code, Code::Ok);
    // The notification names the sender's transfer, not its offer (the two differ here).
    assert_ne!(t.0, offers[0].offer_id);
    assert_eq!(st.s.nodes[1].notes[1], (t.0, b"one".to_vec()));
    assert_eq!(st.s.nodes[1].notes.len(), 2);
    st.s.assert_idle();
}

#[test]
fn a_group_past_the_transfer_limit_is_split_and_lands() {
    let mut s = Sim::new(1, small_chunks(), 3);
    let n: u32 = MAX_TRANSFER_BLOCKS as u32 + 5000;
    s.buffer(0, 1, n as usize, 3);
    s.buffer(1, 2, n as usize, 0);
    let one_byte = Layout::Strided {
        first: 0,
        stride: 1,
        len: 1,
        count: n,
    };
    let a = s.nodes[0].eng.register_blocks(1, one_byte.clone()).unwrap();
    let b = s.nodes[1].eng.register_blocks(2, one_byte).unwrap();
    let local = s.nodes[0]
        .eng
        .prepare_local(vec![a], entries(&[(0, 0, n)]))
        .unwrap();
    let rl = vec![remote_list(&s, 1, b)];
    let remote = s.nodes[0]
        .eng
        .prepare_remote(P, rl, entries(&[(0, 0, n)]))
        .unwrap();
    let (now, dl) = (s.now, s.now + Duration::from_secs(600));
    let t = s.nodes[0]
        .eng
        .start_write_prepared(local.id, &[0], remote.id, &[0], b"big".to_vec(), dl, now)
        .unwrap();
    let offers = offers_sent(&mut s, 0);
    let counts: Vec<u64> = offers
        .iter()
        .map(|o| o.blocks.as_ref().unwrap().indices.count())
        .collect();
    assert_eq!(counts, vec![MAX_TRANSFER_BLOCKS, 5000]);
    assert_eq!(
        ranges_of(&offers[1].blocks.as_ref().unwrap().indices)[0],
        MAX_TRANSFER_BLOCKS as u32
    );
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), u64::from(n)));
    assert_eq!(s.nodes[1].notes, vec![(t.0, b"big".to_vec())]);
    s.assert_idle();
}

#[test]
fn a_restarted_node_takes_back_prepared_ids_and_hands_out_new_ones_above_its_floor() {
    let mut s = Sim::new(1, small_chunks(), 5);
    let n = 8;
    s.buffer(0, 1, n as usize, 3);
    let layout = Layout::Strided {
        first: 0,
        stride: 1,
        len: 1,
        count: n,
    };
    let eng = &mut s.nodes[0].eng;
    eng.start_ids_at(100, 200);
    let a = eng.register_blocks(1, layout.clone()).unwrap();
    assert_eq!(a, 100);
    assert_eq!(eng.register_blocks_as(Some(3), 1, layout).unwrap(), 3);
    let fresh = eng.prepare_local(vec![a], entries(&[(0, 0, n)])).unwrap();
    assert_eq!(fresh.id, 200);
    let back = eng
        .prepare_local_as(Some(7), vec![3], entries(&[(0, 0, n)]))
        .unwrap();
    assert_eq!(back.id, 7);
    for id in [7, 200, 0] {
        let e = eng
            .prepare_local_as(Some(id), vec![3], entries(&[(0, 0, 1)]))
            .unwrap_err();
        assert_eq!(e.code, Code::AlreadyExists, "{e}");
        assert!(e.message.starts_with("reattach_id: "), "{e}");
    }
    assert_eq!(eng.prepared_lists(), 2, "the refusals changed nothing");
    assert_eq!(eng.prepare_local(vec![3], entries(&[(0, 0, 1)])).unwrap().id, 201);
}

/// Nothing changed: no transfer, no action.
fn unchanged(s: &mut Sim, node: usize) {
    assert_eq!(s.nodes[node].eng.active_transfers(), 0);
    assert!(s.nodes[node].eng.poll_action().is_none(), "an action was emitted");
}

#[test]
fn bad_transfers_name_the_first_bad_input_and_change_nothing() {
    let mut st = setup(2);
    let (now, dl) = (st.s.now, st.s.now + Duration::from_secs(60));
    let (l, r) = (st.local, st.remote);
    // Entry counts that differ: a local list with an entry of 3 blocks.
    let odd = st.s.nodes[0]
        .eng
        .prepare_local(vec![st.lists[0][0]], entries(&[(0, 0, 4), (0, 4, 3)]))
        .unwrap()
        .id;
    type Case = (u64, Vec<u32>, u64, Vec<u32>, Code, String);
    let cases: Vec<Case> = vec![
        (
            l,
            vec![0, 99],
            r,
            vec![0, 1],
            Code::InvalidArgument,
            format!("local_indices[1]: entry 99 past the 32 entries of prepared list {l}"),
        ),
        (
            l,
            vec![0, 1],
            r,
            vec![0, 32],
            Code::InvalidArgument,
            format!("remote_indices[1]: entry 32 past the 32 entries of prepared list {r}"),
        ),
        (
            l,
            vec![0, 1],
            r,
            vec![0],
            Code::InvalidArgument,
            "remote_indices: 1 entries, but local_indices names 2".into(),
        ),
        (
            l,
            vec![],
            r,
            vec![],
            Code::InvalidArgument,
            "local_indices: at least one entry is required".into(),
        ),
        (
            odd,
            vec![0, 1],
            r,
            vec![0, 1],
            Code::InvalidArgument,
            format!(
                "remote_indices[1]: entry 1 of prepared list {r} covers 4 blocks, but its partner, entry 1 of prepared list {odd}, covers 3"
            ),
        ),
        (
            l,
            vec![0, 1],
            l,
            vec![0, 1],
            Code::InvalidArgument,
            format!("remote_prepared_id: prepared list {l} names lists of this node"),
        ),
        (
            r,
            vec![0, 1],
            r,
            vec![0, 1],
            Code::InvalidArgument,
            format!("local_prepared_id: prepared list {r} names another node's lists"),
        ),
        (
            77,
            vec![0],
            r,
            vec![0],
            Code::NotFound,
            "local_prepared_id: prepared list 77 does not exist".into(),
        ),
        (
            l,
            vec![0],
            78,
            vec![0],
            Code::NotFound,
            "remote_prepared_id: prepared list 78 does not exist".into(),
        ),
        (
            l,
            vec![0, 1, 2],
            r,
            vec![5, 7, 5],
            Code::InvalidArgument,
            "remote_indices[2]: entry 5 names blocks that remote_indices[0] (entry 5) names already".into(),
        ),
    ];
    for (li, lx, ri, rx, code, want) in cases {
        let e = st.s.nodes[0]
            .eng
            .start_write_prepared(li, &lx, ri, &rx, b"x".to_vec(), dl, now)
            .unwrap_err();
        assert_eq!(e.code, code, "{}", e.message);
        assert!(e.message.starts_with(&want), "{} (want {want})", e.message);
        unchanged(&mut st.s, 0);
    }
    // A READ's destination is local: a local entry named twice (overlapping ranges) is refused.
    let e = st.s.nodes[0]
        .eng
        .start_read_prepared(l, &[3, 3], r, &[0, 1], Vec::new(), dl, now)
        .unwrap_err();
    assert!(
        e.message
            .starts_with("local_indices[1]: entry 3 names blocks that local_indices[0]"),
        "{}",
        e.message
    );
    unchanged(&mut st.s, 0);
    // A block list released under a prepared list: NOT_FOUND at transfer time, nothing started
    // (the first group is fine; the second's list is gone).
    st.s.nodes[0].eng.release_blocks(st.lists[0][1]).unwrap();
    let e = st.s.nodes[0]
        .eng
        .start_write_prepared(l, &[0, 16], r, &[0, 1], Vec::new(), dl, now)
        .unwrap_err();
    assert_eq!(e.code, Code::NotFound);
    assert!(
        e.message.starts_with(&format!(
            "local_prepared_id: list {} of prepared list {l} does not exist",
            st.lists[0][1]
        )),
        "{}",
        e.message
    );
    unchanged(&mut st.s, 0);
    // A released prepared list.
    st.s.nodes[0].eng.release_prepared(r).unwrap();
    let e = st.s.nodes[0]
        .eng
        .start_write_prepared(l, &[0], r, &[0], Vec::new(), dl, now)
        .unwrap_err();
    assert_eq!(e.code, Code::NotFound);
    let e = st.s.nodes[0].eng.release_prepared(r).unwrap_err();
    assert_eq!(
        e.message,
        format!("prepared_id: prepared list {r} does not exist")
    );
    unchanged(&mut st.s, 0);
}

#[test]
fn preparing_checks_every_entry_once_and_the_limits() {
    let mut st = setup(4);
    let [a, b] = st.lists[0];
    let eng = &mut st.s.nodes[0].eng;
    type Case = (Vec<u64>, Vec<(u32, u32, u32)>, Code, String);
    let bad: Vec<Case> = vec![
        (
            vec![a, b],
            vec![(0, 0, 4), (1, 60, 4), (1, 62, 4)],
            Code::InvalidArgument,
            format!("entries[2]: blocks 62..66 past the 64 blocks of list {b}"),
        ),
        (
            vec![a],
            vec![(1, 0, 1)],
            Code::InvalidArgument,
            "entries[0]: list position 1 is past the 1 lists named".into(),
        ),
        (
            vec![a],
            vec![(0, 3, 0)],
            Code::InvalidArgument,
            "entries[0]: count must be at least 1 block".into(),
        ),
        (
            vec![a],
            vec![],
            Code::InvalidArgument,
            "entries: at least one entry is required".into(),
        ),
        (
            vec![],
            vec![(0, 0, 1)],
            Code::InvalidArgument,
            "local_list_ids: at least one list is required".into(),
        ),
        (
            vec![a, 999],
            vec![(0, 0, 1)],
            Code::NotFound,
            "local_list_ids[1]: list 999 does not exist".into(),
        ),
        (
            vec![a, b, a],
            vec![(0, 0, 1)],
            Code::InvalidArgument,
            format!("local_list_ids[2]: list {a} is named already at local_list_ids[0]"),
        ),
    ];
    let before = eng.prepared_lists();
    for (lists, e, code, want) in bad {
        let err = eng.prepare_local(lists, entries(&e)).unwrap_err();
        assert_eq!(err.code, code, "{}", err.message);
        assert_eq!(err.message, want);
    }
    let too_many = vec![
        PreparedEntry {
            list: 0,
            first: 0,
            count: 1
        };
        MAX_PREPARED_ENTRIES + 1
    ];
    let err = eng.prepare_local(vec![a], too_many).unwrap_err();
    assert_eq!(
        err.message,
        format!(
            "entries: {} entries exceed the limit of 4194304",
            MAX_PREPARED_ENTRIES + 1
        )
    );
    // A remote list's entries are checked against its token's count.
    let rl = remote_list(&st.s, 1, st.lists[1][0]);
    let eng = &mut st.s.nodes[0].eng;
    let err = eng
        .prepare_remote(P, vec![rl.clone()], entries(&[(0, 63, 2)]))
        .unwrap_err();
    assert_eq!(
        err.message,
        format!(
            "entries[0]: blocks 63..65 past the 64 blocks of list {}",
            rl.list_id
        )
    );
    assert_eq!(eng.prepared_lists(), before, "nothing was kept");
    // Ids are never reused; the count of prepared lists is bounded.
    let first = eng.prepare_local(vec![a], entries(&[(0, 0, 1)])).unwrap().id;
    eng.release_prepared(first).unwrap();
    let next = eng.prepare_local(vec![a], entries(&[(0, 0, 1)])).unwrap().id;
    assert_eq!(next, first + 1);
    while eng.prepared_lists() < MAX_PREPARED {
        eng.prepare_local(vec![a], entries(&[(0, 0, 1)])).unwrap();
    }
    let err = eng.prepare_local(vec![a], entries(&[(0, 0, 1)])).unwrap_err();
    assert_eq!(err.code, Code::ResourceExhausted);
    assert!(
        err.message
            .starts_with("prepared: 65536 prepared lists exist already"),
        "{}",
        err.message
    );
}

#[test]
fn the_notification_is_not_sent_when_a_part_fails_or_the_transfer_is_cancelled() {
    every_mode(notification_not_sent_on_failure_in_mode);
}

fn notification_not_sent_on_failure_in_mode() {
    // A part refused at the receiver: its list is gone there (the token still names it).
    let mut st = setup(5);
    let (now, dl) = (st.s.now, st.s.now + Duration::from_secs(60));
    st.s.nodes[1].eng.release_blocks(st.lists[1][1]).unwrap();
    let t = st.s.nodes[0]
        .eng
        .start_write_prepared(st.local, &[0, 1], st.remote, &[0, 16], b"never".to_vec(), dl, now)
        .unwrap();
    st.s.run();
    let o = st.s.outcome(0, t);
    assert_eq!(o.code, Code::NotFound, "{}", o.message);
    assert!(
        st.s.nodes[1].notes.is_empty(),
        "no notification for a failed transfer"
    );
    st.s.assert_idle();
    // Cancelled before its parts finished.
    let mut st = setup(6);
    let t = st.s.nodes[0]
        .eng
        .start_read_prepared(
            st.local,
            &[0, 16],
            st.remote,
            &[0, 16],
            b"never".to_vec(),
            dl,
            now,
        )
        .unwrap();
    st.s.step();
    assert!(st.s.nodes[0].eng.cancel(t, Code::Cancelled, "by the test"));
    st.s.run();
    assert_eq!(st.s.outcome(0, t).code, Code::Cancelled);
    assert!(
        st.s.nodes[1].notes.is_empty(),
        "no notification for a cancelled transfer"
    );
    st.s.assert_idle();
}

#[test]
fn a_notify_names_the_buffers_of_the_lists_still_there() {
    let mut st = setup(7);
    let [c, d] = st.lists[1];
    st.s.nodes[1].eng.release_blocks(d).unwrap();
    st.s.nodes[1].eng.on_message(
        P,
        PeerMsg::Notify {
            transfer_id: 42,
            payload: b"hi".to_vec(),
            lists: vec![c, d, c],
            buffers: vec![],
        },
        st.s.now,
    );
    let mut got = Vec::new();
    while let Some(a) = st.s.nodes[1].eng.poll_action() {
        if let Action::Notify {
            transfer_id,
            payload,
            buffers,
            ..
        } = a
        {
            got.push((transfer_id, payload, buffers));
        }
    }
    assert_eq!(got, vec![(42, b"hi".to_vec(), vec![3])]);
}

/// Timing, not a check (run with `--ignored --nocapture`): starting vLLM's pull as `tcpxd.nixl`
/// prepares it. 32 layers, each a list of 32,768 4 KiB granules (one byte each here: planning
/// does not touch the bytes), each layer's K and V regions 4,096 descriptors of 4 granules; one
/// READ of 512 random distinct descriptors per region (32,768 pairs, 131,072 granules a side).
#[test]
#[ignore = "timing: prints how long starting a vLLM-sized prepared READ takes"]
fn timing_of_a_vllm_sized_prepared_read() {
    let (layers, per_region, pick) = (32u32, 4096u32, 512usize);
    let granules = 2 * per_region * 4;
    let mut s = Sim::new(2, small_chunks(), 7);
    let mut lists = [Vec::new(), Vec::new()];
    for (n, list) in lists.iter_mut().enumerate() {
        for l in 0..layers {
            let id = 100 + u64::from(l);
            s.buffer(n, id, granules as usize, 0);
            let layout = Layout::Strided {
                first: 0,
                stride: 1,
                len: 1,
                count: granules,
            };
            list.push(s.nodes[n].eng.register_blocks(id, layout).unwrap());
        }
    }
    let shape: Vec<(u32, u32, u32)> = (0..layers)
        .flat_map(|l| (0..2 * per_region).map(move |d| (l, d * 4, 4)))
        .collect();
    let local = s.nodes[0]
        .eng
        .prepare_local(lists[0].clone(), entries(&shape))
        .unwrap();
    let rl: Vec<RemoteList> = lists[1].iter().map(|&l| remote_list(&s, 1, l)).collect();
    let remote = s.nodes[0].eng.prepare_remote(P, rl, entries(&shape)).unwrap();
    // Per region, `pick` random distinct descriptors on each side (vLLM's block ids).
    let ids = |s: &mut Sim| -> Vec<u32> {
        let mut out = Vec::new();
        for region in 0..2 * layers {
            let mut b: Vec<u32> = (0..per_region).collect();
            for i in (1..b.len()).rev() {
                let j = s.rand(i + 1);
                b.swap(i, j);
            }
            out.extend(b[..pick].iter().map(|&x| region * per_region + x));
        }
        out
    };
    // The build machine is shared: the least of 20 rounds, and their median.
    let mut took = Vec::new();
    for _ in 0..20 {
        let (li, ri) = (ids(&mut s), ids(&mut s));
        let (now, dl) = (s.now, s.now + Duration::from_secs(60));
        let t0 = std::time::Instant::now();
        let t = s.nodes[0]
            .eng
            .start_read_prepared(local.id, &li, remote.id, &ri, Vec::new(), dl, now)
            .unwrap();
        took.push(t0.elapsed());
        assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "timing only"));
    }
    took.sort();
    println!(
        "start_read_prepared of {} pairs: least {:?}, median {:?} (20 rounds)",
        layers as usize * 2 * pick,
        took[0],
        took[took.len() / 2]
    );
}

/// Many pairs (the bitmap check, not the sort): distinct destinations start; a destination named
/// twice is refused naming both pairs, nothing started; the same through a list given as runs.
#[test]
fn many_pairs_with_a_destination_named_twice_are_refused_naming_both() {
    let mut s = Sim::new(2, small_chunks(), 11);
    let n = 4096u32;
    let mut lists = [0u64; 2];
    for (node, list) in lists.iter_mut().enumerate() {
        s.buffer(node, 7, n as usize, 0);
        let layout = Layout::Strided {
            first: 0,
            stride: 1,
            len: 1,
            count: n,
        };
        *list = s.nodes[node].eng.register_blocks(7, layout).unwrap();
    }
    // Runs (one entry per block, in order) on this side, flat (reversed pairs of blocks) there.
    let runs: Vec<(u32, u32, u32)> = (0..n).map(|b| (0, b, 1)).collect();
    let flat: Vec<(u32, u32, u32)> = (0..n).map(|b| (0, b ^ 1, 1)).collect();
    for shape in [&runs, &flat] {
        let local = s.nodes[0]
            .eng
            .prepare_local(vec![lists[0]], entries(shape))
            .unwrap();
        let rl = vec![remote_list(&s, 1, lists[1])];
        let remote = s.nodes[0].eng.prepare_remote(P, rl, entries(shape)).unwrap();
        let (now, dl) = (s.now, s.now + Duration::from_secs(60));
        let mut li: Vec<u32> = (0..2000).map(|k| (k * 2 + 1) % n).collect();
        let ri: Vec<u32> = (0..2000).collect();
        let t = s.nodes[0]
            .eng
            .start_read_prepared(local.id, &li, remote.id, &ri, Vec::new(), dl, now)
            .unwrap();
        assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "checked only"));
        li[1500] = li[10];
        let before = s.nodes[0].eng.active_transfers();
        let e = s.nodes[0]
            .eng
            .start_read_prepared(local.id, &li, remote.id, &ri, Vec::new(), dl, now)
            .unwrap_err();
        assert!(
            e.message.contains("local_indices[1500]") && e.message.contains("local_indices[10]"),
            "{}",
            e.message
        );
        assert_eq!(s.nodes[0].eng.active_transfers(), before, "nothing started");
    }
}
