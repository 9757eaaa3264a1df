//! Hostile block offers and block reads (docs/BLOCKS.md): headers malformed on their own and
//! against real lists, refused naming the field, nothing posted.

use super::messages::{Ids, Names, far, pair};
use super::*;

/// Little-endian u32s, as block indices and lengths travel.
pub(super) fn le(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()
}

impl Names {
    /// A header of 4 KiB blocks `indices` of list `list_id`, with `dst`'s key.
    pub(super) fn header(&self, list_id: u64, indices: Vec<u8>) -> ppb::BlockHeader {
        ppb::BlockHeader {
            list_id,
            access_key: self.key.clone(),
            encoding: ppb::IndexEncoding::U32Le as i32,
            indices,
            uniform_length: 4096,
            lengths: Vec::new(),
            total: 4096,
        }
    }

    pub(super) fn good_header(&self) -> ppb::BlockHeader {
        self.header(1, le(&[0]))
    }

    /// A header on one of the real lists, with their buffer's key.
    pub(super) fn on_list(
        &self,
        list: u64,
        idx: &[u32],
        uniform_length: u32,
        total: u64,
    ) -> ppb::BlockHeader {
        ppb::BlockHeader {
            list_id: list,
            access_key: self.blk_key.clone(),
            encoding: ppb::IndexEncoding::U32Le as i32,
            indices: le(idx),
            uniform_length,
            lengths: Vec::new(),
            total,
        }
    }

    /// A block read of `source_list`'s blocks `source_indices` with `dst`'s key.
    pub(super) fn read_blocks(&self, source_list: u64, source_indices: Vec<u8>) -> ppb::ReadBlocks {
        ppb::ReadBlocks {
            source_list,
            source_key: self.key.clone(),
            source_encoding: ppb::IndexEncoding::U32Le as i32,
            source_indices,
            dest: Some(ppb::BlockHeader {
                access_key: vec![9; 16],
                ..self.good_header()
            }),
        }
    }
}

/// Block offers and block reads refused for a field: each answered by a Reject or ReadReject
/// naming it.
pub(super) fn block_cases(t: &Names, ids: &mut Ids, ctl: &mut Vec<(String, Ctl)>) {
    let (key, other, blk_key) = (t.key.clone(), t.other.clone(), t.blk_key.clone());
    let (uniform, mixed) = (t.uniform, t.mixed);
    let ok_range = || t.ok_range();
    let header = |list_id, indices| t.header(list_id, indices);
    let good_header = || t.good_header();
    let on_list = |list, idx: &[u32], uniform_length, total| t.on_list(list, idx, uniform_length, total);
    let read_blocks = |source_list, source_indices| t.read_blocks(source_list, source_indices);
    let mut block_cases: Vec<(String, ppb::BlockHeader, Code, &'static str)> = vec![
        (
            "block offer to an unknown list".into(),
            header(424_242, le(&[0])),
            Code::NotFound,
            "blocks.list_id: list 424242 does not exist",
        ),
        (
            "block offer with a 3-byte key".into(),
            ppb::BlockHeader {
                access_key: vec![1; 3],
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.access_key: 3 bytes, expected 16",
        ),
        (
            "block offer with 5 index bytes".into(),
            header(1, vec![0; 5]),
            Code::InvalidArgument,
            "blocks.indices: 5 bytes are not a whole number of 4-byte indices",
        ),
        (
            "block offer with no indices".into(),
            header(1, Vec::new()),
            Code::InvalidArgument,
            "blocks.indices: at least one block is required",
        ),
        (
            "block offer with index encoding 7".into(),
            ppb::BlockHeader {
                encoding: 7,
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.indices: unknown index encoding 7",
        ),
        (
            "block offer with an empty index range".into(),
            ppb::BlockHeader {
                encoding: ppb::IndexEncoding::Ranges as i32,
                indices: le(&[3, 0]),
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.indices: range 0 (3, 0) is empty",
        ),
        (
            "block offer of more than MAX_TRANSFER_BLOCKS".into(),
            ppb::BlockHeader {
                encoding: ppb::IndexEncoding::Ranges as i32,
                indices: le(&[0, 4_194_305]),
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.indices: 4194305 blocks exceed the limit of 4194304",
        ),
        (
            "block offer with neither lengths".into(),
            ppb::BlockHeader {
                uniform_length: 0,
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.uniform_length: 0 and no lengths",
        ),
        (
            "block offer with both lengths".into(),
            ppb::BlockHeader {
                lengths: le(&[4096]),
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.lengths: given with uniform_length 4096",
        ),
        (
            "block offer with 6 bytes of lengths".into(),
            ppb::BlockHeader {
                uniform_length: 0,
                lengths: vec![0; 6],
                ..good_header()
            },
            Code::InvalidArgument,
            "blocks.lengths: 6 bytes are not a whole number of u32 lengths",
        ),
    ];
    // Against real lists.
    block_cases.extend([
        (
            "block offer past the list".to_string(),
            on_list(uniform, &[3, 16], 4096, 8192),
            Code::InvalidArgument,
            "blocks.indices[1]: block 16 is past the list's 16 blocks",
        ),
        (
            "block offer naming a block twice".into(),
            on_list(uniform, &[5, 7, 5], 4096, 3 * 4096),
            Code::InvalidArgument,
            "blocks.indices[2]: block 5 is already named at 0",
        ),
        (
            "block offer whose lengths disagree with the list".into(),
            on_list(mixed, &[0, 1, 2], 4096, 3 * 4096),
            Code::InvalidArgument,
            "blocks.indices[1]: block 1 is 1000 bytes, but its partner is 4096 bytes",
        ),
        (
            "block offer with more lengths than indices".into(),
            ppb::BlockHeader {
                uniform_length: 0,
                lengths: le(&[4096, 4096]),
                ..on_list(uniform, &[1], 0, 4096)
            },
            Code::InvalidArgument,
            "blocks.indices: 1 blocks, but lengths names 2",
        ),
        (
            "block offer whose total disagrees".into(),
            on_list(uniform, &[1, 2], 4096, 8193),
            Code::InvalidArgument,
            "blocks.total: the header says 8193 bytes, but its 2 blocks hold 8192",
        ),
        (
            "block offer with another buffer's key".into(),
            ppb::BlockHeader {
                access_key: key.clone(),
                ..on_list(uniform, &[1], 4096, 4096)
            },
            Code::PermissionDenied,
            "blocks.access_key: wrong access key for list",
        ),
    ]);
    for (name, h, code, words) in block_cases.drain(..) {
        let mut o = ids.offer(Vec::new());
        o.blocks = Some(h);
        ctl.push((name, Ctl::Offer(o, code, words, 0)));
    }
    {
        let mut o = ids.offer(vec![ok_range()]);
        o.blocks = Some(good_header());
        ctl.push((
            "block offer with ranges too".into(),
            Ctl::Offer(
                o,
                Code::InvalidArgument,
                "ranges: a block offer carries its destinations in `blocks`",
                0,
            ),
        ));
        let mut o = ids.offer(vec![
            ok_range(),
            ok_range(),
            range(other.id, &key_of(&other), 0, 4096),
        ]);
        o.coalesced = true;
        ctl.push((
            "coalesced offer naming two buffers".into(),
            Ctl::Offer(
                o,
                Code::InvalidArgument,
                "ranges[2].buffer_id: a coalesced offer's ranges must lie in one buffer",
                2,
            ),
        ));
    }
    let read_cases: Vec<(String, ppb::ReadBlocks, Code, &'static str)> = vec![
        (
            "block read of an unknown list".into(),
            read_blocks(424_242, le(&[0])),
            Code::NotFound,
            "blocks.source_list: list 424242 does not exist",
        ),
        (
            "block read with a 17-byte key".into(),
            ppb::ReadBlocks {
                source_key: vec![1; 17],
                ..read_blocks(1, le(&[0]))
            },
            Code::InvalidArgument,
            "blocks.source_key: 17 bytes, expected 16",
        ),
        (
            "block read of more than MAX_TRANSFER_BLOCKS".into(),
            ppb::ReadBlocks {
                source_encoding: ppb::IndexEncoding::Ranges as i32,
                ..read_blocks(1, le(&[0, 4_194_305]))
            },
            Code::InvalidArgument,
            "blocks.source_indices: 4194305 blocks exceed the limit of 4194304",
        ),
        (
            "block read without a destination".into(),
            ppb::ReadBlocks {
                dest: None,
                ..read_blocks(1, le(&[0]))
            },
            Code::InvalidArgument,
            "blocks.dest: missing",
        ),
        (
            "block read with a destination of 2 index bytes".into(),
            ppb::ReadBlocks {
                dest: Some(header(1, vec![0; 2])),
                ..read_blocks(1, le(&[0]))
            },
            Code::InvalidArgument,
            "blocks.dest.indices: 2 bytes are not a whole number",
        ),
    ];
    let mut read_cases = read_cases;
    read_cases.extend([
        (
            "block read past the holder's list".to_string(),
            ppb::ReadBlocks {
                source_key: blk_key.clone(),
                ..read_blocks(uniform, le(&[16]))
            },
            Code::InvalidArgument,
            "blocks.source_indices[0]: block 16 is past the list's 16 blocks",
        ),
        (
            "block read whose lengths disagree with the holder's list".into(),
            ppb::ReadBlocks {
                source_key: blk_key.clone(),
                ..read_blocks(mixed, le(&[1]))
            },
            Code::InvalidArgument,
            "blocks.source_indices[0]: block 1 is 1000 bytes, but its partner is 4096 bytes",
        ),
        (
            "block read with another buffer's key".into(),
            read_blocks(uniform, le(&[0])),
            Code::PermissionDenied,
            "blocks.source_key: wrong access key for list",
        ),
    ]);
    for (name, rb, code, words) in read_cases {
        let mut r = ids.read(Vec::new());
        r.blocks = Some(rb);
        ctl.push((name, Ctl::Read(r, code, words, 0)));
    }
    {
        let mut r = ids.read(vec![pair(ok_range(), far())]);
        r.blocks = Some(read_blocks(1, le(&[0])));
        ctl.push((
            "block read with pairs too".into(),
            Ctl::Read(
                r,
                Code::InvalidArgument,
                "pairs: a block read request carries its ranges in `blocks`",
                0,
            ),
        ));
    }
}
