//! The state a daemon keeps across restarts (`runtime.state_dir`, docs/OPERATIONS.md,
//! "Restarts"): the node's identity, how far each id space has been handed out (so no id is
//! ever reused for something else), and one small file per live registration with what a client
//! must present to take it back after a restart (its kind, size and access key; a list's buffer).
//!
//! Layout of the directory (mode 0700):
//! - `node`: the node id the state belongs to (another node id: the state is set aside),
//! - `format`: the journal's format ([`FORMAT`]); a daemon refuses to start on a directory of a
//!   newer format than it reads (its registrations would not all come back), and writes its own,
//! - `floors`: three numbers, the ids reserved so far for buffers, block lists, prepared lists
//!   (reserved [`RESERVE`] ahead, written before an id past them is handed out),
//! - `regs/b<id>`, `regs/l<id>`, `regs/p<id>`: a live registration (JSON); the block lists
//!   registered with a buffer in one step (a `register_batch` entry's granule lists) are named in
//!   the buffer's record instead of a file each (one write a region), and come back pending
//!   with it all the same; at a clean stop each of them gets its own `l<id>` record too
//!   ([`Journal::write_list_records`]), the form daemons before session 20 read, so that one of
//!   them started on the directory (a downgrade) finds them,
//! - `host/<id>`: the memory of a daemon-allocated host buffer (on tmpfs: the bytes survive the
//!   process, not the machine).
//!
//! Daemon-allocated CUDA memory is not a file here: its fd is in the service manager's
//! descriptor store (src/fd_store.rs), named `tcpxd-cuda-b<id>`; its record carries its device.
//!
//! At start-up the previous instance's registrations become *pending*: a client re-attaches one
//! by presenting its id (and a buffer's key); what nobody re-attached within the grace period
//! is forgotten (a client whose process died meanwhile). Daemon-allocated host buffers are not
//! a client's: the daemon restores them itself, bytes included.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::engine::{Code, EngineError};

/// Ids reserved ahead of the last handed out, per write of `floors`.
pub const RESERVE: u64 = 4096;

/// The journal's format, in the `format` file. 1 (no file): sessions up to 20 (20's buffer
/// records may name lists, which older daemons ignore). 2: since session 21, the file itself, and
/// lists named in buffer records written as their own records too at a clean stop. A daemon
/// refuses a directory whose format is newer than this.
pub const FORMAT: u32 = 2;

/// The three id spaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Space {
    Buffer,
    List,
    Prepared,
}

impl Space {
    const ALL: [Space; 3] = [Space::Buffer, Space::List, Space::Prepared];

    fn index(self) -> usize {
        self as usize
    }

    fn prefix(self) -> char {
        match self {
            Space::Buffer => 'b',
            Space::List => 'l',
            Space::Prepared => 'p',
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Space::Buffer => "buffer",
            Space::List => "block list",
            Space::Prepared => "prepared list",
        }
    }
}

/// What the journal keeps of one registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum Record {
    Buffer {
        /// `host`, `host_shared`, `cuda`, `cuda_ipc`.
        kind: String,
        size: u64,
        /// The current access key (hex): a rotated key stays rotated.
        key: String,
        label: String,
        /// Memory registered by address: whose (only that process re-attaches it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<Owner>,
        /// Daemon-allocated CUDA memory kept in the descriptor store: its device.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<u32>,
        /// Block lists registered with the buffer in one step, recorded here rather than in a
        /// file each (`Journal::record_many`): each comes back pending as a list of this buffer.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        lists: Vec<u64>,
    },
    List {
        buffer: u64,
    },
    Prepared,
}

/// The process whose memory a registration by address is, and where in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub pid: i32,
    /// Its start time (`/proc/<pid>/stat` field 22, clock ticks since boot): a pid reused by
    /// another process does not match.
    pub start: u64,
    pub address: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("state directory {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "state directory {dir}: written by a newer tcpxd (journal format {found} in its `format` \
         file; this tcpxd reads formats up to {known}), whose registrations would not all come back \
         here: start the newer tcpxd, or move the directory aside (its registrations are then not \
         restored) and start this one"
    )]
    Newer {
        dir: PathBuf,
        /// The `format` file's text (a number, or what could not be read as one).
        found: String,
        known: u32,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A daemon-allocated host buffer of the previous instance, to restore.
#[derive(Debug, Clone)]
pub struct KeptHost {
    pub id: u64,
    pub size: u64,
    pub key: [u8; 16],
    pub label: String,
    pub file: PathBuf,
}

#[derive(Debug, Default)]
struct Inner {
    /// The first id not reserved yet, per space.
    reserved: [u64; 3],
    /// The next id to hand out, per space.
    next: [u64; 3],
    /// The previous instance's registrations nobody re-attached yet.
    pending: HashMap<(Space, u64), Record>,
    /// This instance's block lists and their buffers (forgotten with the buffer).
    lists: HashMap<u64, u64>,
    /// The records of buffers that name lists (`Record::Buffer::lists`), as written: rewritten
    /// when one of those lists goes, kept when the buffer's record is written again.
    carried: HashMap<u64, Record>,
}

/// A daemon-allocated CUDA buffer of the previous instance, to restore from its kept fd.
#[derive(Debug, Clone)]
pub struct KeptCuda {
    pub id: u64,
    pub size: u64,
    pub key: [u8; 16],
    pub label: String,
    pub device: u32,
}

/// The state directory of a running daemon.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    inner: Mutex<Inner>,
}

impl Journal {
    /// Opens (creating) the state directory of node `node_id`: reads the previous instance's
    /// floors and registrations, and reserves the first ids of this one.
    pub fn open(dir: &Path, node_id: &str) -> Result<Journal, JournalError> {
        for d in [dir.to_path_buf(), dir.join("regs"), dir.join("host")] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&d)
                .map_err(io(&d))?;
        }
        if !on_tmpfs(dir) {
            tracing::warn!(
                dir = %dir.display(),
                "runtime.state_dir is not on tmpfs: daemon-allocated host memory kept there is written back to disk; use a directory under /run"
            );
        }
        let node_file = dir.join("node");
        match std::fs::read_to_string(&node_file) {
            Ok(n) if n.trim() == node_id => {}
            Ok(other) => {
                // Another node's state (a reused directory): set aside, never mixed in.
                let aside = dir.join(format!("previous-node-{}", other.trim()));
                tracing::warn!(
                    dir = %dir.display(),
                    previous = other.trim(),
                    now = node_id,
                    "the state directory belongs to another node id: its registrations are not restored"
                );
                let _ = std::fs::remove_dir_all(&aside);
                std::fs::create_dir(&aside).map_err(io(&aside))?;
                for sub in ["regs", "host", "floors", "format"] {
                    let from = dir.join(sub);
                    if from.exists() {
                        std::fs::rename(&from, aside.join(sub)).map_err(io(&from))?;
                    }
                }
                for d in [dir.join("regs"), dir.join("host")] {
                    std::fs::DirBuilder::new()
                        .mode(0o700)
                        .create(&d)
                        .map_err(io(&d))?;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&node_file)(e)),
        }
        let format_file = dir.join("format");
        match std::fs::read_to_string(&format_file) {
            Ok(text) => {
                // Unreadable counts as newer: never guess at a format.
                if !text.trim().parse::<u32>().is_ok_and(|f| f <= FORMAT) {
                    return Err(JournalError::Newer {
                        dir: dir.to_path_buf(),
                        found: text.trim().chars().take(32).collect(),
                        known: FORMAT,
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&format_file)(e)),
        }
        write_atomic(&format_file, format!("{FORMAT}\n").as_bytes())?;
        write_atomic(&node_file, node_id.as_bytes())?;
        let mut inner = Inner {
            reserved: [1; 3],
            next: [1; 3],
            pending: HashMap::new(),
            lists: HashMap::new(),
            carried: HashMap::new(),
        };
        if let Ok(text) = std::fs::read_to_string(dir.join("floors")) {
            for (i, n) in text.split_whitespace().take(3).enumerate() {
                if let Ok(n) = n.parse::<u64>() {
                    inner.next[i] = n.max(1);
                }
            }
        }
        let regs = dir.join("regs");
        for e in std::fs::read_dir(&regs).map_err(io(&regs))? {
            let e = e.map_err(io(&regs))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let parsed = Space::ALL.iter().find_map(|&s| {
                name.strip_prefix(s.prefix())
                    .and_then(|n| n.parse::<u64>().ok())
                    .map(|id| (s, id))
            });
            let record = std::fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<Record>(&b).ok());
            match (parsed, record) {
                (Some((space, id)), Some(record)) => {
                    let i = space.index();
                    inner.next[i] = inner.next[i].max(id + 1);
                    if let Record::Buffer { lists, .. } = &record
                        && !lists.is_empty()
                    {
                        let l = Space::List.index();
                        for &list in lists {
                            inner.next[l] = inner.next[l].max(list + 1);
                            inner
                                .pending
                                .insert((Space::List, list), Record::List { buffer: id });
                        }
                        inner.carried.insert(id, record.clone());
                    }
                    inner.pending.insert((space, id), record);
                }
                _ => {
                    tracing::warn!(file = %e.path().display(), "state directory: an unreadable registration, removed");
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        inner.reserved = inner.next;
        let journal = Journal {
            dir: dir.to_path_buf(),
            inner: Mutex::new(inner),
        };
        {
            let mut inner = journal.lock();
            for s in Space::ALL {
                journal.reserve(&mut inner, s, 0)?;
            }
        }
        Ok(journal)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first id of `space` this instance may hand out (above every id of earlier instances).
    pub fn first_id(&self, space: Space) -> u64 {
        self.lock().next[space.index()]
    }

    /// Makes sure ids up to `id` are reserved in `floors` before anyone sees them.
    fn reserve(&self, inner: &mut Inner, space: Space, id: u64) -> Result<(), JournalError> {
        let i = space.index();
        inner.next[i] = inner.next[i].max(id + 1);
        if id != 0 && inner.next[i] < inner.reserved[i] {
            return Ok(());
        }
        inner.reserved[i] = inner.next[i] + RESERVE;
        let text = format!(
            "{} {} {}\n",
            inner.reserved[0], inner.reserved[1], inner.reserved[2]
        );
        write_atomic(&self.dir.join("floors"), text.as_bytes())
    }

    fn reg_path(&self, space: Space, id: u64) -> PathBuf {
        self.dir.join("regs").join(format!("{}{id}", space.prefix()))
    }

    /// Records a live registration (new, re-attached or re-keyed) before its id is answered.
    pub fn record(&self, space: Space, id: u64, record: &Record) -> Result<(), EngineError> {
        let mut inner = self.lock();
        self.reserve(&mut inner, space, id).map_err(internal)?;
        self.write(&mut inner, space, id, record)
    }

    /// Writes one record, the lock held (ids reserved already): a list's buffer noted; a
    /// buffer's lists (`Record::Buffer::lists`) noted, or, when it names none, those its record
    /// named before kept while they live or wait to be re-attached.
    fn write(&self, inner: &mut Inner, space: Space, id: u64, record: &Record) -> Result<(), EngineError> {
        let mut record = std::borrow::Cow::Borrowed(record);
        match record.as_ref() {
            Record::List { buffer } => {
                inner.lists.insert(id, *buffer);
            }
            Record::Buffer { lists, .. } if space == Space::Buffer => {
                let lists = if lists.is_empty() {
                    let before = match inner.carried.get(&id) {
                        Some(Record::Buffer { lists, .. }) => lists.clone(),
                        _ => Vec::new(),
                    };
                    before
                        .into_iter()
                        .filter(|l| {
                            inner.lists.get(l) == Some(&id) || inner.pending.contains_key(&(Space::List, *l))
                        })
                        .collect()
                } else {
                    for &l in lists {
                        inner.lists.insert(l, id);
                    }
                    lists.clone()
                };
                if let Record::Buffer { lists: named, .. } = record.to_mut() {
                    *named = lists;
                }
                match record.as_ref() {
                    Record::Buffer { lists, .. } if !lists.is_empty() => {
                        inner.carried.insert(id, record.as_ref().clone());
                    }
                    _ => {
                        inner.carried.remove(&id);
                    }
                }
            }
            _ => {}
        }
        let bytes = serde_json::to_vec(record.as_ref())
            .map_err(|e| EngineError::new(Code::Internal, e.to_string()))?;
        write_atomic(&self.reg_path(space, id), &bytes).map_err(internal)
    }

    /// Records several live registrations at once (a batch of registrations answered together),
    /// each before its id is answered: per record, whether it was written. The id floors are
    /// written at most once for the lot.
    pub fn record_many(&self, records: &[(Space, u64, Record)]) -> Vec<Result<(), EngineError>> {
        let mut inner = self.lock();
        for space in Space::ALL {
            let carried = records.iter().flat_map(|(_, _, r)| match r {
                Record::Buffer { lists, .. } if space == Space::List => lists.as_slice(),
                _ => &[],
            });
            let top = records
                .iter()
                .filter(|r| r.0 == space)
                .map(|r| r.1)
                .chain(carried.copied())
                .max();
            if let Some(id) = top
                && let Err(e) = self.reserve(&mut inner, space, id)
            {
                let e = internal(e);
                return records.iter().map(|_| Err(e.clone())).collect();
            }
        }
        records
            .iter()
            .map(|(space, id, record)| self.write(&mut inner, *space, *id, record))
            .collect()
    }

    /// Forgets a registration that was released.
    pub fn forget(&self, space: Space, id: u64) {
        let _ = std::fs::remove_file(self.reg_path(space, id));
        match space {
            Space::Buffer => {
                let _ = std::fs::remove_file(self.host_file(id));
                // Its lists went with it.
                let lists: Vec<u64> = {
                    let mut inner = self.lock();
                    inner.carried.remove(&id);
                    let ids: Vec<u64> = inner
                        .lists
                        .iter()
                        .filter(|&(_, &b)| b == id)
                        .map(|(&l, _)| l)
                        .collect();
                    for l in &ids {
                        inner.lists.remove(l);
                    }
                    ids
                };
                for l in lists {
                    let _ = std::fs::remove_file(self.reg_path(Space::List, l));
                }
            }
            Space::List => self.forget_list(id, None),
            Space::Prepared => {}
        }
    }

    /// Forgets list `id` (of buffer `of`, where known: a pending list's record): a list named in
    /// its buffer's record has that record written again without it.
    fn forget_list(&self, id: u64, of: Option<u64>) {
        {
            {
                let mut inner = self.lock();
                let buffer =
                    inner
                        .lists
                        .remove(&id)
                        .or(of)
                        .or_else(|| match inner.pending.get(&(Space::List, id)) {
                            Some(Record::List { buffer }) => Some(*buffer),
                            _ => None,
                        });
                // A list named in its buffer's record: the record written again without it.
                let rewrite = buffer.and_then(|b| match inner.carried.get(&b) {
                    Some(r @ Record::Buffer { lists, .. }) if lists.contains(&id) => {
                        let mut r = r.clone();
                        if let Record::Buffer { lists, .. } = &mut r {
                            lists.retain(|&l| l != id);
                        }
                        Some((b, r))
                    }
                    _ => None,
                });
                if let Some((b, r)) = rewrite {
                    inner.pending.remove(&(Space::List, id));
                    if let Err(e) = self.write(&mut inner, Space::Buffer, b, &r) {
                        tracing::warn!(
                            buffer = b,
                            list = id,
                            "state directory: rewriting a buffer's record without a list gone: {e}"
                        );
                    }
                }
            }
        }
    }

    /// Takes back pending registration `id` of `space` if `matches` accepts its record; the
    /// error says why not (FAILED_PRECONDITION), naming `field`.
    pub fn claim(
        &self,
        field: &str,
        space: Space,
        id: u64,
        matches: impl FnOnce(&Record) -> Result<(), String>,
    ) -> Result<Record, EngineError> {
        let mut inner = self.lock();
        let Some(record) = inner.pending.get(&(space, id)) else {
            return Err(EngineError::new(
                Code::FailedPrecondition,
                format!(
                    "{field}: {} {id} is not waiting to be re-attached (never registered before this \
                     daemon's restart, re-attached already, or forgotten after runtime.reattach_grace_s)",
                    space.noun()
                ),
            ));
        };
        matches(record).map_err(|why| {
            EngineError::new(
                Code::FailedPrecondition,
                format!("{field}: {} {id} cannot be re-attached: {why}", space.noun()),
            )
        })?;
        Ok(inner.pending.remove(&(space, id)).expect("checked above"))
    }

    /// Puts back a registration taken by [`Journal::claim`] whose re-attach then failed: it waits
    /// for its client again.
    pub fn unclaim(&self, space: Space, id: u64, record: Record) {
        self.lock().pending.insert((space, id), record);
    }

    /// Takes the previous instance's daemon-allocated host buffers whose memory file is there
    /// (the daemon restores them itself); the others are forgotten.
    pub fn take_kept_host(&self) -> Vec<KeptHost> {
        let mut inner = self.lock();
        let ids: Vec<u64> = inner
            .pending
            .iter()
            .filter(|&(&(s, _), r)| {
                s == Space::Buffer && matches!(r, Record::Buffer { kind, .. } if kind == "host")
            })
            .map(|(&(_, id), _)| id)
            .collect();
        let mut kept = Vec::new();
        for id in ids {
            let Some(Record::Buffer { size, key, label, .. }) = inner.pending.remove(&(Space::Buffer, id))
            else {
                continue;
            };
            let file = self.host_file(id);
            let key = hex::decode(&key).ok().and_then(|k| <[u8; 16]>::try_from(k).ok());
            match key {
                Some(key) if file.exists() => kept.push(KeptHost {
                    id,
                    size,
                    key,
                    label,
                    file,
                }),
                _ => {
                    tracing::warn!(
                        buffer = id,
                        "a daemon-allocated host buffer's memory is gone: not restored"
                    );
                    self.forget(Space::Buffer, id);
                }
            }
        }
        kept.sort_by_key(|k| k.id);
        kept
    }

    /// Takes the previous instance's daemon-allocated CUDA buffers that were kept in the
    /// descriptor store (a device recorded); the others (allocated without a store) are forgotten.
    pub fn take_kept_cuda(&self) -> Vec<KeptCuda> {
        let mut inner = self.lock();
        let ids: Vec<u64> = inner
            .pending
            .iter()
            .filter(|&(&(s, _), r)| {
                s == Space::Buffer && matches!(r, Record::Buffer { kind, .. } if kind == "cuda")
            })
            .map(|(&(_, id), _)| id)
            .collect();
        let mut kept = Vec::new();
        let mut gone = Vec::new();
        for id in ids {
            let Some(Record::Buffer {
                size,
                key,
                label,
                device,
                ..
            }) = inner.pending.remove(&(Space::Buffer, id))
            else {
                continue;
            };
            let key = hex::decode(&key).ok().and_then(|k| <[u8; 16]>::try_from(k).ok());
            match (key, device) {
                (Some(key), Some(device)) => kept.push(KeptCuda {
                    id,
                    size,
                    key,
                    label,
                    device,
                }),
                _ => gone.push(id),
            }
        }
        drop(inner);
        for id in gone {
            tracing::warn!(
                buffer = id,
                "a daemon-allocated CUDA buffer was not kept in a descriptor store: not restored"
            );
            self.forget(Space::Buffer, id);
        }
        kept.sort_by_key(|k| k.id);
        kept
    }

    /// Where daemon-allocated host buffer `id` keeps its memory.
    pub fn host_file(&self, id: u64) -> PathBuf {
        self.dir.join("host").join(id.to_string())
    }

    /// How many of the previous instance's registrations wait to be re-attached.
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    /// Writes each block list named in a buffer's record (live, or waiting to be re-attached) as
    /// its own `l<id>` record too, as daemons before session 20 wrote every list: called at a
    /// clean stop, so that such a daemon started on the directory next (a downgrade) finds them
    /// (it ignores the buffer records' `lists`). Returns how many were written.
    pub fn write_list_records(&self) -> usize {
        let inner = self.lock();
        let mut written = 0;
        for (&buffer, record) in &inner.carried {
            let Record::Buffer { lists, .. } = record else {
                continue;
            };
            for &list in lists {
                let path = self.reg_path(Space::List, list);
                let bytes = serde_json::to_vec(&Record::List { buffer }).expect("a list record serialises");
                match write_atomic(&path, &bytes) {
                    Ok(()) => written += 1,
                    Err(e) => tracing::warn!("state directory: a list's own record for older daemons: {e}"),
                }
            }
        }
        written
    }

    /// Forgets every registration nobody re-attached (the grace period is over); returns how many.
    pub fn expire(&self) -> usize {
        let gone: Vec<((Space, u64), Record)> = self.lock().pending.drain().collect();
        for ((s, id), record) in &gone {
            match record {
                Record::List { buffer } => {
                    let _ = std::fs::remove_file(self.reg_path(Space::List, *id));
                    self.forget_list(*id, Some(*buffer));
                }
                _ => self.forget(*s, *id),
            }
        }
        gone.len()
    }
}

/// Whether `dir` lies on tmpfs (or ramfs): memory, not disk, behind its files.
fn on_tmpfs(dir: &Path) -> bool {
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    const RAMFS_MAGIC: u64 = 0x8584_58f6;
    rustix::fs::statfs(dir).is_ok_and(|s| matches!(s.f_type as u64, TMPFS_MAGIC | RAMFS_MAGIC))
}

fn internal(e: JournalError) -> EngineError {
    EngineError::new(Code::Internal, e.to_string())
}

/// Writes `path` whole or not at all (a temporary file renamed over it).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), JournalError> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))
}

#[cfg(test)]
#[path = "journal_tests.rs"]
mod tests;
