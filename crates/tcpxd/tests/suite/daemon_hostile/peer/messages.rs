//! Hostile control messages: offers and read requests with every field at and past its limit
//! (chunk sizes, lanes, range counts, notifications, unknown buffers, wrong keys, overflowing and
//! out-of-bounds ranges), and messages about ids nobody knows. Each case is answered by the
//! stated Reject or ReadReject, or ignored without harm (`Ctl`).

use super::*;

/// What the control-message cases name: the hostile daemon's buffers and block lists.
pub(super) struct Names {
    /// `SIZE` bytes, the offers' destination and the reads' source.
    pub(super) dst: pb::Buffer,
    pub(super) key: Vec<u8>,
    pub(super) other: pb::Buffer,
    /// The block lists' buffer's key.
    pub(super) blk_key: Vec<u8>,
    /// 16 blocks of 4 KiB.
    pub(super) uniform: u64,
    /// Three blocks of 4096, 1000 and 4096 bytes.
    pub(super) mixed: u64,
}

impl Names {
    pub(super) fn ok_range(&self) -> ppb::RemoteRange {
        range(self.dst.id, &self.key, 0, 4096)
    }
}

/// Fresh offer and read ids, and the lane an offer names: a rendezvous lane of the pairing (the
/// layout's first, or on a routed pairing (the daemon on the CUDA stand-in) the first of the
/// (host, host) group's).
pub(super) struct Ids {
    next_offer: u64,
    next_read: u64,
    offer_lane: u32,
}

impl Ids {
    pub(super) fn new(offer_lane: u32) -> Ids {
        Ids {
            next_offer: 1000,
            next_read: 5000,
            offer_lane,
        }
    }

    pub(super) fn offer(&mut self, ranges: Vec<ppb::RemoteRange>) -> ppb::Offer {
        self.next_offer += 1;
        ppb::Offer {
            offer_id: self.next_offer,
            read_id: 0,
            chunk_bytes: 512 * 1024,
            first_lane: self.offer_lane,
            ranges,
            notification: Vec::new(),
            deadline_ms: 10_000,
            coalesced: false,
            blocks: None,
            transfer_id: 0,
            ..Default::default()
        }
    }

    pub(super) fn read(&mut self, pairs: Vec<ppb::ReadPair>) -> ppb::ReadRequest {
        self.next_read += 1;
        ppb::ReadRequest {
            read_id: self.next_read,
            pairs,
            deadline_ms: 10_000,
            blocks: None,
            ..Default::default()
        }
    }
}

pub(super) fn pair(s: ppb::RemoteRange, d: ppb::RemoteRange) -> ppb::ReadPair {
    ppb::ReadPair {
        source: Some(s),
        dest: Some(d),
    }
}

/// A read's destination: 4 KiB of buffer 1 on the fake peer's side, under a key of nines.
pub(super) fn far() -> ppb::RemoteRange {
    range(1, &[9; 16], 0, 4096)
}

/// Offers refused for a field: each answered by a Reject naming it.
pub(super) fn offer_cases(t: &Names, ids: &mut Ids, lanes: &FakeLanes, ctl: &mut Vec<(String, Ctl)>) {
    let (dst, key, other) = (&t.dst, t.key.clone(), &t.other);
    let ok_range = || t.ok_range();
    let mut offer = |ranges| ids.offer(ranges);
    for cb in [0u32, 1, 4095, 4_194_305, 8 << 20, u32::MAX] {
        let mut o = offer(vec![ok_range()]);
        o.chunk_bytes = cb;
        ctl.push((
            format!("chunk_bytes {cb}"),
            Ctl::Offer(o, Code::InvalidArgument, "chunk size", 0),
        ));
    }
    // Past the daemon's lanes (2 layout lanes: from 2 on), and on a routed pairing also eager
    // lanes: no rendezvous lane of a group.
    for fl in lanes.bad_offer_lanes() {
        let mut o = offer(vec![ok_range()]);
        o.first_lane = fl;
        ctl.push((
            format!("first_lane {fl}"),
            Ctl::Offer(o, Code::InvalidArgument, "first_lane", 0),
        ));
    }
    ctl.push((
        "no ranges".into(),
        Ctl::Offer(offer(vec![]), Code::InvalidArgument, "0 ranges", 0),
    ));
    ctl.push((
        "65537 ranges".into(),
        Ctl::Offer(
            offer(vec![ok_range(); 65_537]),
            Code::InvalidArgument,
            "65537 ranges",
            0,
        ),
    ));
    for extra in [1usize, 4096] {
        let mut o = offer(vec![ok_range()]);
        o.notification = vec![0; (1 << 20) + extra];
        ctl.push((
            format!("notification 1 MiB + {extra}"),
            Ctl::Offer(o, Code::InvalidArgument, "notification", 0),
        ));
    }
    for id in [0u64, other.id + 1000, u64::MAX, u64::MAX - 1] {
        ctl.push((
            format!("offer to unknown buffer {id}"),
            Ctl::Offer(
                offer(vec![range(id, &key, 0, 4096)]),
                Code::NotFound,
                "does not exist",
                0,
            ),
        ));
    }
    ctl.push((
        "offer with the other buffer's key".into(),
        Ctl::Offer(
            offer(vec![range(other.id, &key, 0, 4096)]),
            Code::PermissionDenied,
            "wrong access key",
            0,
        ),
    ));
    ctl.push((
        "offer with an all-zero key".into(),
        Ctl::Offer(
            offer(vec![range(dst.id, &[0; 16], 0, 4096)]),
            Code::PermissionDenied,
            "wrong access key",
            0,
        ),
    ));
    for byte in 0..16 {
        let mut k = key.clone();
        k[byte] ^= 0x80;
        ctl.push((
            format!("key with byte {byte} flipped"),
            Ctl::Offer(
                offer(vec![range(dst.id, &k, 0, 4096)]),
                Code::PermissionDenied,
                "wrong access key",
                0,
            ),
        ));
    }
    for len in [0usize, 1, 15, 17, 32, 1024] {
        ctl.push((
            format!("key of {len} bytes"),
            Ctl::Offer(
                offer(vec![range(dst.id, &vec![1; len], 0, 4096)]),
                Code::InvalidArgument,
                "access_key",
                0,
            ),
        ));
    }
    ctl.push((
        "zero-length range".into(),
        Ctl::Offer(
            offer(vec![range(dst.id, &key, 0, 0)]),
            Code::InvalidArgument,
            "length",
            0,
        ),
    ));
    for (off, len) in [
        (u64::MAX, 1),
        (u64::MAX - 1, 2),
        (1, u64::MAX),
        (u64::MAX, u64::MAX),
        (1 << 63, 1 << 63),
    ] {
        ctl.push((
            format!("overflowing range {off}+{len}"),
            Ctl::Offer(
                offer(vec![range(dst.id, &key, off, len)]),
                Code::InvalidArgument,
                "overflows",
                0,
            ),
        ));
    }
    for (off, len) in [
        (SIZE, 1),
        (SIZE - 1, 2),
        (0, SIZE + 1),
        (SIZE - 4095, 4096),
        (1 << 40, 4096),
        (0, 1 << 40),
    ] {
        ctl.push((
            format!("range {off}+{len} past the end"),
            Ctl::Offer(
                offer(vec![range(dst.id, &key, off, len)]),
                Code::InvalidArgument,
                "past the end",
                0,
            ),
        ));
    }
    for at in [1usize, 7, 100, 4095] {
        let mut ranges = vec![ok_range(); at + 1];
        ranges[at] = range(dst.id, &key, SIZE, 1);
        ctl.push((
            format!("bad range at index {at}"),
            Ctl::Offer(offer(ranges), Code::InvalidArgument, "past the end", at as u32),
        ));
    }
    for rid in [1u64, 77, u64::MAX] {
        let mut o = offer(vec![ok_range()]);
        o.read_id = rid;
        ctl.push((
            format!("offer for unknown read {rid}"),
            Ctl::Offer(o, Code::NotFound, "read", 0),
        ));
    }
}

/// Read requests refused for a field: each answered by a ReadReject naming it.
pub(super) fn read_cases(t: &Names, ids: &mut Ids, ctl: &mut Vec<(String, Ctl)>) {
    let (dst, key, other) = (&t.dst, t.key.clone(), &t.other);
    let ok_range = || t.ok_range();
    let mut read = |pairs| ids.read(pairs);
    ctl.push((
        "read of no pairs".into(),
        Ctl::Read(read(vec![]), Code::InvalidArgument, "0 ranges", 0),
    ));
    ctl.push((
        "read of 65537 pairs".into(),
        Ctl::Read(
            read(vec![pair(ok_range(), far()); 65_537]),
            Code::InvalidArgument,
            "65537",
            0,
        ),
    ));
    for id in [0u64, other.id + 1000, u64::MAX] {
        ctl.push((
            format!("read of unknown buffer {id}"),
            Ctl::Read(
                read(vec![pair(range(id, &key, 0, 4096), far())]),
                Code::NotFound,
                "does not exist",
                0,
            ),
        ));
    }
    for byte in [0usize, 5, 15] {
        let mut k = key.clone();
        k[byte] ^= 1;
        ctl.push((
            format!("read with key byte {byte} flipped"),
            Ctl::Read(
                read(vec![pair(range(dst.id, &k, 0, 4096), far())]),
                Code::PermissionDenied,
                "wrong access key",
                0,
            ),
        ));
    }
    for (off, len, words) in [
        (u64::MAX, 1, "overflows"),
        (1, u64::MAX, "overflows"),
        (SIZE, 1, "past the end"),
        (0, SIZE + 1, "past the end"),
        (0, 0, "length"),
    ] {
        let mut d = far();
        d.length = len;
        ctl.push((
            format!("read of source {off}+{len}"),
            Ctl::Read(
                read(vec![pair(range(dst.id, &key, off, len), d)]),
                Code::InvalidArgument,
                words,
                0,
            ),
        ));
    }
    for dlen in [1u64, 4095, 4097, u64::MAX] {
        let mut d = far();
        d.length = dlen;
        ctl.push((
            format!("read with destination length {dlen}"),
            Ctl::Read(
                read(vec![pair(ok_range(), d)]),
                Code::InvalidArgument,
                "lengths differ",
                0,
            ),
        ));
    }
    for (s, d, words) in [
        (None, Some(far()), "source: missing"),
        (Some(ok_range()), None, "dest: missing"),
        (
            Some(range(dst.id, &[1; 3], 0, 4096)),
            Some(far()),
            "source.access_key",
        ),
        (
            Some(ok_range()),
            Some(range(1, &[1; 20], 0, 4096)),
            "dest.access_key",
        ),
    ] {
        ctl.push((
            format!("read pair with {words}"),
            Ctl::Read(
                read(vec![ppb::ReadPair { source: s, dest: d }]),
                Code::InvalidArgument,
                words,
                0,
            ),
        ));
    }
    {
        let mut pairs = vec![pair(ok_range(), far()); 10];
        pairs[9] = pair(range(dst.id, &key, SIZE, 4096), far());
        ctl.push((
            "read with a bad pair at index 9".into(),
            Ctl::Read(read(pairs), Code::InvalidArgument, "past the end", 9),
        ));
    }
}

/// Messages about ids nobody knows: ignored, no answer, the peer stays up.
pub(super) fn ignored_cases(ctl: &mut Vec<(String, Ctl)>) {
    use ppb::peer_message::Body;
    for id in [0u64, 1, 999_999, u64::MAX] {
        for (what, body) in [
            (
                "accept",
                Body::Accept(ppb::Accept {
                    offer_id: id,
                    first_lane: None,
                }),
            ),
            (
                "reject",
                Body::Reject(ppb::Reject {
                    offer_id: id,
                    code: 3,
                    message: "x".repeat(1000),
                    range_index: u32::MAX,
                }),
            ),
            (
                "done",
                Body::Done(ppb::Done {
                    offer_id: id,
                    ..Default::default()
                }),
            ),
            (
                "failed",
                Body::Failed(ppb::Failed {
                    offer_id: id,
                    code: i32::MIN,
                    message: String::new(),
                }),
            ),
            (
                "cancel offer",
                Body::CancelOffer(ppb::CancelOffer {
                    offer_id: id,
                    code: 9999,
                    message: "gone".into(),
                }),
            ),
            (
                "read reject",
                Body::ReadReject(ppb::ReadReject {
                    read_id: id,
                    code: -1,
                    message: String::new(),
                    range_index: 7,
                }),
            ),
            ("cancel read", Body::CancelRead(ppb::CancelRead { read_id: id })),
            ("heartbeat", Body::Heartbeat(ppb::Heartbeat { seq: id })),
        ] {
            ctl.push((format!("{what} of unknown id {id}"), Ctl::Ignored(body)));
        }
    }
}
