//! Prepared lists over another client's block lists of this node (their tokens name this node):
//! prepared as a remote list would be, with the tokens' keys checked at once; a transfer between
//! a local prepared list and such a list is planned here into byte ranges that the daemon copies
//! (`SameNodePlan`), with the checks a peer would make (entries, block counts and lengths, a
//! destination block named once, the keys still current).

use std::collections::HashSet;

use super::plan::check_index_pairs;
use super::*;
use crate::same_node::{SameNodePlan, SamePiece};

impl Engine {
    /// Prepares a list over lists of this node named by their tokens (`lists`).
    pub fn prepare_same_node(
        &mut self,
        lists: Vec<RemoteList>,
        entries: Vec<PreparedEntry>,
    ) -> EngineResult<PreparedInfo> {
        self.check_prepared_room()?;
        check_list_count(lists.len(), "remote_tokens")?;
        let mut lens = Vec::with_capacity(lists.len());
        let mut seen: HashMap<u64, usize> = HashMap::with_capacity(lists.len());
        for (i, l) in lists.iter().enumerate() {
            if let Some(j) = seen.insert(l.list_id, i) {
                return Err(EngineError::invalid(format!(
                    "remote_tokens[{i}]: list {} is named already at remote_tokens[{j}]",
                    l.list_id
                )));
            }
            lens.push(self.same_node_list(l, &format!("remote_tokens[{i}]"))?.len());
        }
        let blocks = check_prepared_entries(&entries, &lens, |p| lists[p].list_id)?;
        Ok(self.insert_prepared(None, Lists::SameNode(lists), entries, blocks))
    }

    /// A list of this node a token names, its key checked against its buffer's current key.
    fn same_node_list(&self, l: &RemoteList, field: &str) -> EngineResult<&blocks::BlockList> {
        let list = self.lists.get(l.list_id).ok_or_else(|| {
            EngineError::not_found(format!("{field}: list {} does not exist on this node", l.list_id))
        })?;
        let buffer = list.buffer();
        if !self
            .buffers
            .get(&buffer)
            .is_some_and(|b| keys_equal(&b.key, &l.access_key))
        {
            return Err(EngineError::new(
                Code::PermissionDenied,
                format!(
                    "{field}: wrong access key for list {} (the key of buffer {buffer} now)",
                    l.list_id
                ),
            ));
        }
        Ok(list)
    }

    /// Whether prepared list `id` names another client's lists of this node (`prepare_same_node`).
    pub fn is_same_node_prepared(&self, id: u64) -> bool {
        self.prepared
            .lists
            .get(&id)
            .is_some_and(|p| matches!(p.lists, Lists::SameNode(_)))
    }

    /// Plans a WRITE (`write`) or READ between local prepared list `local_id` and same-node list
    /// `remote_id`: pair k copies the blocks of local entry `local_idx[k]` to or from those of
    /// remote entry `remote_idx[k]`.
    pub fn plan_same_node_prepared(
        &self,
        (local_id, local_idx): (u64, &[u32]),
        (remote_id, remote_idx): (u64, &[u32]),
        write: bool,
    ) -> EngineResult<SameNodePlan> {
        let local = self.prepared.lists.get(&local_id).ok_or_else(|| {
            EngineError::not_found(format!(
                "local_prepared_id: prepared list {local_id} does not exist"
            ))
        })?;
        let Lists::Local(local_lists) = &local.lists else {
            return Err(EngineError::invalid(format!(
                "local_prepared_id: prepared list {local_id} names lists of other clients (it was prepared from remote_tokens)"
            )));
        };
        let remote = self.prepared.lists.get(&remote_id).ok_or_else(|| {
            EngineError::not_found(format!(
                "remote_prepared_id: prepared list {remote_id} does not exist"
            ))
        })?;
        let Lists::SameNode(remote_lists) = &remote.lists else {
            return Err(EngineError::invalid(format!(
                "remote_prepared_id: prepared list {remote_id} does not name lists of this node by their tokens"
            )));
        };
        check_index_pairs(
            (local_id, local_idx, local.entries.len()),
            (remote_id, remote_idx, remote.entries.len()),
        )?;
        // Each remote list once: it still exists and its token's key is still current.
        let mut checked: HashMap<u32, &blocks::BlockList> = HashMap::new();
        let mut dest: HashSet<(u32, u32)> = HashSet::new();
        let (mut lh, mut rh) = (0usize, 0usize);
        let mut plan = SameNodePlan::default();
        for (k, (&li, &ri)) in local_idx.iter().zip(remote_idx).enumerate() {
            let le = local.entries.get_near(li, &mut lh).expect("checked");
            let re = remote.entries.get_near(ri, &mut rh).expect("checked");
            if le.count != re.count {
                return Err(EngineError::invalid(format!(
                    "remote_indices[{k}]: entry {ri} covers {} blocks, but local entry {li} covers {}",
                    re.count, le.count
                )));
            }
            let ll = self.lists.get(local_lists[le.list as usize]).ok_or_else(|| {
                EngineError::not_found(format!(
                    "local_indices[{k}]: entry {li}'s list {} was released",
                    local_lists[le.list as usize]
                ))
            })?;
            let rl = match checked.get(&re.list) {
                Some(l) => *l,
                None => {
                    let l = self
                        .same_node_list(&remote_lists[re.list as usize], &format!("remote_indices[{k}]"))?;
                    checked.insert(re.list, l);
                    l
                }
            };
            for j in 0..le.count {
                let (lo, llen) = ll.block(le.first + j).expect("checked when prepared");
                let (ro, rlen) = rl.block(re.first + j).expect("checked when prepared");
                if llen != rlen {
                    return Err(EngineError::invalid(format!(
                        "remote_indices[{k}]: block {} of entry {ri} is {rlen} bytes, but its partner is {llen} bytes (pairs must be equal in length)",
                        re.first + j
                    )));
                }
                let d = if write {
                    (re.list, re.first + j)
                } else {
                    (u32::MAX - le.list, le.first + j)
                };
                if !dest.insert(d) {
                    let field = if write { "remote_indices" } else { "local_indices" };
                    return Err(EngineError::invalid(format!(
                        "{field}[{k}]: names a destination block that another pair names already"
                    )));
                }
                plan.push(SamePiece {
                    local_buffer: ll.buffer(),
                    local_offset: lo,
                    remote_buffer: rl.buffer(),
                    remote_offset: ro,
                    len: u64::from(llen),
                });
            }
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::Layout;

    fn strided(count: u32, len: u32) -> Layout {
        Layout::Strided {
            first: 0,
            stride: u64::from(len),
            len,
            count,
        }
    }

    fn entry(list: u32, first: u32, count: u32) -> PreparedEntry {
        PreparedEntry { list, first, count }
    }

    #[test]
    fn same_node_prepared_lists_plan_byte_ranges_and_refuse_bad_pairs() {
        let mut e = Engine::new(EngineConfig::default());
        e.add_buffer(1, 1 << 20, [1; 16]).unwrap();
        e.add_buffer(2, 1 << 20, [2; 16]).unwrap();
        let la = e.register_blocks(1, strided(64, 4096)).unwrap();
        let lb = e.register_blocks(2, strided(64, 4096)).unwrap();
        let token = |key| RemoteList {
            list_id: lb,
            access_key: key,
            blocks: 64,
            block_len: 4096,
        };
        let local = e
            .prepare_local(vec![la], (0..16).map(|i| entry(0, i * 2, 2)).collect())
            .unwrap();
        let wrong = e
            .prepare_same_node(vec![token([9; 16])], vec![entry(0, 0, 1)])
            .unwrap_err();
        assert_eq!(wrong.code, Code::PermissionDenied, "{}", wrong.message);
        let remote = e
            .prepare_same_node(
                vec![token([2; 16])],
                (0..16).map(|i| entry(0, i * 2, 2)).collect(),
            )
            .unwrap();
        assert!(e.is_same_node_prepared(remote.id) && !e.is_same_node_prepared(local.id));
        let p = e
            .plan_same_node_prepared((local.id, &[0, 1, 5]), (remote.id, &[3, 4, 0]), true)
            .unwrap();
        assert_eq!(p.total, 6 * 4096);
        assert_eq!(
            p.pieces,
            vec![
                SamePiece {
                    local_buffer: 1,
                    local_offset: 0,
                    remote_buffer: 2,
                    remote_offset: 6 * 4096,
                    len: 4 * 4096
                },
                SamePiece {
                    local_buffer: 1,
                    local_offset: 10 * 4096,
                    remote_buffer: 2,
                    remote_offset: 0,
                    len: 2 * 4096
                },
            ]
        );
        let twice = e
            .plan_same_node_prepared((local.id, &[0, 1]), (remote.id, &[3, 3]), true)
            .unwrap_err();
        assert!(
            twice
                .message
                .starts_with("remote_indices[1]: names a destination block"),
            "{}",
            twice.message
        );
        // A READ's destination is the local side: a source named twice is fine.
        assert!(
            e.plan_same_node_prepared((local.id, &[0, 1]), (remote.id, &[3, 3]), false)
                .is_ok()
        );
        let past = e
            .plan_same_node_prepared((local.id, &[16]), (remote.id, &[0]), true)
            .unwrap_err();
        assert!(past.message.starts_with("local_indices"), "{}", past.message);
        // The wrong way round, and a rekey since: refused.
        assert!(
            e.plan_same_node_prepared((remote.id, &[0]), (local.id, &[0]), true)
                .is_err()
        );
        e.rekey_buffer(2, [3; 16]).unwrap();
        let stale = e
            .plan_same_node_prepared((local.id, &[0]), (remote.id, &[0]), true)
            .unwrap_err();
        assert_eq!(stale.code, Code::PermissionDenied, "{}", stale.message);
    }
}
