//! The lists a node registered, by id and by buffer.

use std::collections::HashMap;

use super::{BlockError, BlockList, Layout};

/// The most lists one node keeps registered at once.
pub const MAX_LISTS: usize = 65_536;

/// A node's registered block lists. Ids are never reused, so a token naming a released list
/// names no other. Lists go with their buffer ([`BlockRegistry::release_buffer`]); a token also
/// carries its buffer's key, so a rekey of the buffer makes every token of its lists stale
/// without touching the lists (the key is checked where the buffer's key is known).
#[derive(Debug, Default)]
pub struct BlockRegistry {
    lists: HashMap<u64, BlockList>,
    by_buffer: HashMap<u64, Vec<u64>>,
    next_id: u64,
}

impl BlockRegistry {
    /// Registers `layout` inside `buffer` (`buffer_len` bytes): checked once here (see
    /// [`BlockList::new`]). Returns the new list's id (from 1).
    pub fn register(&mut self, buffer: u64, buffer_len: u64, layout: Layout) -> Result<u64, BlockError> {
        self.register_as(None, buffer, buffer_len, layout)
    }

    /// As [`BlockRegistry::register`], under id `id` when given (a list re-attached after a
    /// restart: an id an earlier instance handed out, never one live here).
    pub fn register_as(
        &mut self,
        id: Option<u64>,
        buffer: u64,
        buffer_len: u64,
        layout: Layout,
    ) -> Result<u64, BlockError> {
        if self.lists.len() >= MAX_LISTS {
            return Err(BlockError::TooManyLists { limit: MAX_LISTS });
        }
        if let Some(id) = id
            && (id == 0 || self.lists.contains_key(&id))
        {
            return Err(BlockError::IdTaken { id });
        }
        let id = id.unwrap_or(self.next_id + 1);
        let list = BlockList::new(id, buffer, buffer_len, layout)?;
        self.next_id = self.next_id.max(id);
        self.lists.insert(id, list);
        self.by_buffer.entry(buffer).or_default().push(id);
        Ok(id)
    }

    /// New ids start at `first` at the lowest (above those of earlier instances).
    pub fn start_ids_at(&mut self, first: u64) {
        self.next_id = self.next_id.max(first.saturating_sub(1));
    }

    pub fn get(&self, id: u64) -> Option<&BlockList> {
        self.lists.get(&id)
    }

    /// Releases one list; false if there was none of that id.
    pub fn release(&mut self, id: u64) -> bool {
        let Some(list) = self.lists.remove(&id) else {
            return false;
        };
        if let Some(ids) = self.by_buffer.get_mut(&list.buffer()) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                self.by_buffer.remove(&list.buffer());
            }
        }
        true
    }

    /// Releases every list of `buffer` (the buffer is going); returns how many.
    pub fn release_buffer(&mut self, buffer: u64) -> usize {
        let ids = self.by_buffer.remove(&buffer).unwrap_or_default();
        for id in &ids {
            self.lists.remove(id);
        }
        ids.len()
    }

    /// The ids of `buffer`'s lists, oldest first.
    pub fn lists_of(&self, buffer: u64) -> &[u64] {
        self.by_buffer.get(&buffer).map_or(&[], Vec::as_slice)
    }

    pub fn len(&self) -> usize {
        self.lists.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lists.is_empty()
    }

    /// Bytes the registered lists' storage takes.
    pub fn storage_bytes(&self) -> usize {
        self.lists.values().map(BlockList::storage_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strided(count: u32) -> Layout {
        Layout::Strided {
            first: 0,
            stride: 4096,
            len: 4096,
            count,
        }
    }

    #[test]
    fn lists_go_with_their_buffer_and_ids_are_never_reused() {
        let mut r = BlockRegistry::default();
        let a = r.register(7, 1 << 20, strided(256)).unwrap();
        let b = r
            .register(7, 1 << 20, Layout::compact(vec![0, 8192, 4096], &[100]).unwrap())
            .unwrap();
        let c = r.register(8, 1 << 20, strided(1)).unwrap();
        assert_eq!((a, b, c), (1, 2, 3));
        assert_eq!(r.lists_of(7), &[1, 2]);
        assert_eq!(r.get(b).unwrap().len(), 3);
        assert_eq!(
            r.storage_bytes(),
            24,
            "strided lists take nothing, uniform 8 bytes a block"
        );
        // A bad list changes nothing (and uses no id).
        let e = r.register(8, 4096, strided(2)).unwrap_err();
        assert!(e.to_string().contains("exceeds the buffer's 4096 bytes"), "{e}");
        assert_eq!(r.len(), 3);
        assert_eq!(r.release_buffer(7), 2);
        assert!(r.get(a).is_none() && r.get(b).is_none());
        assert!(r.lists_of(7).is_empty());
        assert!(r.release(c));
        assert!(!r.release(c));
        assert!(r.is_empty());
        assert_eq!(r.register(8, 1 << 20, strided(1)).unwrap(), 4);
    }

    #[test]
    fn a_restarted_node_starts_above_its_floor_and_takes_back_old_ids() {
        let mut r = BlockRegistry::default();
        r.start_ids_at(4097);
        assert_eq!(r.register(7, 1 << 20, strided(1)).unwrap(), 4097);
        // A list of the previous instance comes back under its id, below the floor.
        assert_eq!(r.register_as(Some(12), 7, 1 << 20, strided(256)).unwrap(), 12);
        assert_eq!(r.get(12).unwrap().len(), 256);
        assert_eq!(r.lists_of(7), &[4097, 12]);
        // Never twice, never 0, and a bad one changes nothing.
        for id in [12, 4097, 0] {
            let e = r.register_as(Some(id), 7, 1 << 20, strided(1)).unwrap_err();
            assert!(matches!(e, BlockError::IdTaken { id: i } if i == id), "{e}");
        }
        assert!(r.register_as(Some(13), 7, 4096, strided(2)).is_err());
        assert!(r.get(13).is_none());
        // New ids go on above everything seen.
        assert_eq!(r.register(7, 1 << 20, strided(1)).unwrap(), 4098);
        assert_eq!(r.register_as(Some(9000), 7, 1 << 20, strided(1)).unwrap(), 9000);
        assert_eq!(r.register(7, 1 << 20, strided(1)).unwrap(), 9001);
    }

    #[test]
    fn the_number_of_lists_is_bounded() {
        let mut r = BlockRegistry::default();
        for _ in 0..MAX_LISTS {
            r.register(1, 4096, strided(1)).unwrap();
        }
        let e = r.register(1, 4096, strided(1)).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("lists: {MAX_LISTS} lists are registered already (the limit); release one first")
        );
    }
}
