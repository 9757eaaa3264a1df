//! Block transfers whose two lists are both of this node (two clients of one daemon): no peer,
//! no lanes. The engine checks them as it checks a peer's offer (the lists exist, the token's key
//! is its buffer's current key, the indices are inside the lists, pairs are equal in length, a
//! destination block is named once) and turns them into the byte ranges the daemon copies.

use crate::blocks::{BlockError, IndexArray};
use crate::{Code, Engine, EngineError, EngineResult, RemoteBlocks, keys_equal};

/// One range a same-node transfer copies: `len` bytes at `local_offset` of `local_buffer` and
/// at `remote_offset` of `remote_buffer` (which way is the transfer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamePiece {
    pub local_buffer: u64,
    pub local_offset: u64,
    pub remote_buffer: u64,
    pub remote_offset: u64,
    pub len: u64,
}

/// A transfer between two sides of this node, as byte ranges (adjacent pairs merged).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SameNodePlan {
    pub pieces: Vec<SamePiece>,
    pub total: u64,
}

impl SameNodePlan {
    /// Appends a pair of ranges, merged into the last piece when both sides continue it.
    pub(crate) fn push(&mut self, p: SamePiece) {
        self.total += p.len;
        match self.pieces.last_mut() {
            Some(l)
                if l.local_buffer == p.local_buffer
                    && l.remote_buffer == p.remote_buffer
                    && l.local_offset + l.len == p.local_offset
                    && l.remote_offset + l.len == p.remote_offset =>
            {
                l.len += p.len
            }
            _ => self.pieces.push(p),
        }
    }
}

impl Engine {
    /// Plans a block WRITE (`write`) or READ between `local_list` and the list `remote` names,
    /// both of this node. Nothing is started: the caller copies.
    pub fn plan_same_node_blocks(
        &self,
        local_list: u64,
        local_indices: &IndexArray,
        remote: &RemoteBlocks,
        write: bool,
    ) -> EngineResult<SameNodePlan> {
        let local = self.lists.get(local_list).ok_or_else(|| {
            EngineError::not_found(format!("local_list_id: list {local_list} does not exist"))
        })?;
        let theirs = self.lists.get(remote.list_id).ok_or_else(|| {
            EngineError::not_found(format!(
                "remote_token: list {} does not exist on this node (released?)",
                remote.list_id
            ))
        })?;
        let buffer = theirs.buffer();
        if !self
            .buffers
            .get(&buffer)
            .is_some_and(|b| keys_equal(&b.key, &remote.access_key))
        {
            return Err(EngineError::new(
                Code::PermissionDenied,
                format!(
                    "remote_token: wrong access key for list {} (the key of buffer {buffer} now)",
                    remote.list_id
                ),
            ));
        }
        local_indices.check(local.len(), "local_indices")?;
        remote.indices.check(theirs.len(), "remote_indices")?;
        let (n, m) = (local_indices.count(), remote.indices.count());
        if n == 0 {
            return Err(BlockError::Empty {
                field: "local_indices".into(),
            }
            .into());
        }
        if n != m {
            return Err(BlockError::CountMismatch {
                field: "remote_indices".into(),
                got: m,
                other: "local_indices".into(),
                want: n,
            }
            .into());
        }
        let limit = crate::blocks::MAX_TRANSFER_BLOCKS;
        if n > limit {
            return Err(BlockError::TooMany {
                field: "local_indices".into(),
                count: n,
                limit,
            }
            .into());
        }
        // The destination: every block named once (two pairs would write the same bytes).
        if write {
            remote.indices.check_distinct(theirs.len(), "remote_indices")?;
        } else {
            local_indices.check_distinct(local.len(), "local_indices")?;
        }
        let mut plan = SameNodePlan::default();
        for (at, (li, ri)) in local_indices.iter().zip(remote.indices.iter()).enumerate() {
            let (lo, ll) = local.block(li).expect("checked against the list");
            let (ro, rl) = theirs.block(ri).expect("checked against the list");
            if ll != rl {
                return Err(BlockError::LengthMismatch {
                    field: "remote_indices".into(),
                    at: at as u64,
                    index: ri,
                    len: rl,
                    partner: ll,
                }
                .into());
            }
            plan.push(SamePiece {
                local_buffer: local.buffer(),
                local_offset: lo,
                remote_buffer: buffer,
                remote_offset: ro,
                len: u64::from(ll),
            });
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineConfig;
    use crate::blocks::Layout;

    /// An engine holding buffers `(id, size)`, each with its own key (returned in order).
    fn engine_with_buffers(buffers: &[(u64, u64)]) -> (Engine, Vec<[u8; 16]>) {
        let mut e = Engine::new(EngineConfig::default());
        let keys: Vec<[u8; 16]> = buffers.iter().map(|&(id, _)| [id as u8; 16]).collect();
        for (&(id, size), key) in buffers.iter().zip(&keys) {
            e.add_buffer(id, size, *key).unwrap();
        }
        (e, keys)
    }

    fn remote(list: u64, key: [u8; 16], indices: &[u32]) -> RemoteBlocks {
        RemoteBlocks {
            list_id: list,
            access_key: key,
            blocks: 0,
            block_len: 0,
            indices: IndexArray::from_indices(indices),
        }
    }

    fn strided(count: u32) -> Layout {
        Layout::Strided {
            first: 0,
            stride: 4096,
            len: 4096,
            count,
        }
    }

    #[test]
    fn pairs_become_merged_ranges_and_bad_input_is_refused() {
        let (mut e, keys) = engine_with_buffers(&[(1, 1 << 20), (2, 1 << 20)]);
        let a = e.register_blocks(1, strided(16)).unwrap();
        let b = e.register_blocks(2, strided(16)).unwrap();
        let c = e
            .register_blocks(
                2,
                Layout::Strided {
                    first: 0,
                    stride: 8192,
                    len: 8192,
                    count: 4,
                },
            )
            .unwrap();
        let p = e
            .plan_same_node_blocks(
                a,
                &IndexArray::from_indices(&[0, 1, 2, 7]),
                &remote(b, keys[1], &[3, 4, 5, 0]),
                true,
            )
            .unwrap();
        let piece = |lo, ro, len| SamePiece {
            local_buffer: 1,
            local_offset: lo,
            remote_buffer: 2,
            remote_offset: ro,
            len,
        };
        assert_eq!(p.total, 4 * 4096);
        assert_eq!(
            p.pieces,
            vec![piece(0, 3 * 4096, 3 * 4096), piece(7 * 4096, 0, 4096)]
        );

        let bad = |r: RemoteBlocks, li: &[u32], write| {
            e.plan_same_node_blocks(a, &IndexArray::from_indices(li), &r, write)
                .unwrap_err()
        };
        let wrong_key = bad(remote(b, [9; 16], &[0]), &[0], true);
        assert_eq!(wrong_key.code, Code::PermissionDenied);
        assert!(wrong_key.message.starts_with("remote_token: wrong access key"));
        assert_eq!(bad(remote(99, keys[1], &[0]), &[0], true).code, Code::NotFound);
        let past = bad(remote(b, keys[1], &[16]), &[0], true);
        assert!(
            past.message.starts_with("remote_indices[0]: block 16 is past"),
            "{}",
            past.message
        );
        let count = bad(remote(b, keys[1], &[0, 1]), &[0], true);
        assert!(
            count.message.starts_with("remote_indices: 2 blocks"),
            "{}",
            count.message
        );
        let twice = bad(remote(b, keys[1], &[1, 1]), &[0, 2], true);
        assert!(
            twice
                .message
                .starts_with("remote_indices[1]: block 1 is already named"),
            "{}",
            twice.message
        );
        // A READ's destination is the local list: a source named twice is fine.
        assert!(
            e.plan_same_node_blocks(
                a,
                &IndexArray::from_indices(&[0, 2]),
                &remote(b, keys[1], &[1, 1]),
                false
            )
            .is_ok()
        );
        let len = bad(remote(c, keys[1], &[0]), &[0], true);
        assert!(
            len.message.contains("pairs must be equal in length"),
            "{}",
            len.message
        );
    }
}
