//! Registered buffers as the engine knows them: size, key, users, and who waits for them.

use super::*;

impl Engine {
    /// Makes a buffer known (the driver owns its memory).
    pub fn add_buffer(&mut self, id: u64, size: u64, key: [u8; 16]) -> EngineResult<()> {
        if self.buffers.contains_key(&id) {
            return Err(EngineError::new(
                Code::AlreadyExists,
                format!("buffer {id} is already registered"),
            ));
        }
        self.buffers.insert(
            id,
            BufferMeta {
                size,
                key,
                users: 0,
                watched: false,
                memory: topology::Memory::Host,
            },
        );
        Ok(())
    }

    /// Replaces a buffer's access key. Offers and reads already accepted keep going; every
    /// later one must carry the new key.
    pub fn rekey_buffer(&mut self, id: u64, key: [u8; 16]) -> EngineResult<()> {
        let b = self
            .buffers
            .get_mut(&id)
            .ok_or_else(|| EngineError::not_found(format!("buffer_id: buffer {id} does not exist")))?;
        b.key = key;
        Ok(())
    }

    /// Forgets a buffer; refused while transfers use it.
    pub fn remove_buffer(&mut self, id: u64) -> EngineResult<()> {
        let b = self
            .buffers
            .get(&id)
            .ok_or_else(|| EngineError::not_found(format!("buffer_id: buffer {id} does not exist")))?;
        if b.users > 0 {
            return Err(EngineError::new(
                Code::FailedPrecondition,
                format!(
                    "buffer {id} is in use by {} chunk ranges of active transfers",
                    b.users
                ),
            ));
        }
        self.buffers.remove(&id);
        // Its block lists go with it (transfers under way keep their plans).
        self.lists.release_buffer(id);
        Ok(())
    }

    /// Ranges of active transfers using a buffer.
    pub fn buffer_users(&self, id: u64) -> Option<u32> {
        self.buffers.get(&id).map(|b| b.users)
    }

    /// Asks for `Action::BufferIdle` once the buffer's last user ends. `true` (and no action)
    /// when nothing uses it now, or it is unknown: the caller need not wait.
    pub fn watch_buffer(&mut self, id: u64) -> bool {
        match self.buffers.get_mut(&id) {
            Some(b) if b.users > 0 => {
                b.watched = true;
                false
            }
            _ => true,
        }
    }

    pub(super) fn use_buffer(&mut self, id: u64) {
        if let Some(b) = self.buffers.get_mut(&id) {
            b.users += 1;
        }
    }

    pub(super) fn unuse_buffer(&mut self, id: u64) {
        if let Some(b) = self.buffers.get_mut(&id) {
            b.users = b.users.saturating_sub(1);
            if b.users == 0 && std::mem::take(&mut b.watched) {
                self.actions.push_back(Action::BufferIdle { buffer: id });
            }
        }
    }

    /// Entry `i`'s local range: `entries[i].local_buffer_id`, `.local_offset` and `.length`.
    /// `last`: the buffer the previous entry named and its size, kept between calls (a batch
    /// of one buffer pair names one local buffer 65,536 times: looked up once).
    pub(super) fn check_local(
        &self,
        i: usize,
        buffer: u64,
        offset: u64,
        len: u64,
        last: &mut Option<(u64, u64)>,
    ) -> EngineResult<()> {
        let size = match *last {
            Some((id, size)) if id == buffer => size,
            _ => {
                let b = self.buffers.get(&buffer).ok_or_else(|| {
                    EngineError::not_found(format!(
                        "entries[{i}].local_buffer_id: buffer {buffer} does not exist"
                    ))
                })?;
                *last = Some((buffer, b.size));
                b.size
            }
        };
        // The field names are formatted only for an error (a batch checks 65,536 entries).
        if range_end(offset, len).is_some_and(|end| end <= size) {
            return Ok(());
        }
        check_bounds(
            &format!("entries[{i}].local_offset"),
            &format!("entries[{i}].length"),
            &format!("buffer {buffer}"),
            size,
            offset,
            len,
        )
    }
}
