//! Cross-memory attach: the daemon reading and writing a local client's own pages
//! (`process_vm_readv` / `process_vm_writev`), for host memory a client registered that the
//! daemon cannot map (anonymous memory: a plain numpy array, a CPU tensor). The client's pid is
//! the unix socket's peer credential (SO_PEERCRED), never a number from a message.
//!
//! The kernel allows it when the daemon may ptrace the client: CAP_SYS_PTRACE over the client's
//! user namespace, or the same user where Yama's `kernel.yama.ptrace_scope` is 0 (at 1, only a
//! process's ancestors may: the daemon is not the client's). [`AttachError::Denied`] says which
//! setting grants it.

use std::io;

use super::{HostRegion, Region};

/// A client's memory, by its process and address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientPages {
    pub pid: i32,
    pub addr: u64,
}

/// Why the kernel refused to copy a client's pages.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(
        "the kernel refused the daemon access to process {pid}'s memory ({errno}): the daemon needs \
         ptrace access to its clients, CAP_SYS_PTRACE (systemd: AmbientCapabilities=CAP_SYS_PTRACE in \
         tcpxd.service; Kubernetes: securityContext.capabilities.add [\"SYS_PTRACE\"] on the tcpxd \
         DaemonSet's container, with hostPID: true so client pids are the daemon's), or running as the \
         client's user with kernel.yama.ptrace_scope = 0 ({scope}); or register memory the daemon can map \
         (a memfd or /dev/shm file: tcpxd.nixl.host_array, torch's share_memory_())"
    )]
    Denied {
        pid: i32,
        errno: io::Error,
        scope: String,
    },
    #[error("process {pid} is gone")]
    Gone { pid: i32 },
    #[error("process {pid} has no memory at {addr:#x}..{end:#x} (unmapped or not readable and writable)", end = addr + len)]
    Fault { pid: i32, addr: u64, len: u64 },
    #[error(
        "process {pid}'s memory at {addr:#x} is not writable (a read-only mapping): transfers into it would fail; register read-write memory"
    )]
    ReadOnly { pid: i32, addr: u64 },
    #[error("copying process {pid}'s memory: {0}", pid = .1)]
    Other(io::Error, i32),
}

impl AttachError {
    fn of(e: io::Error, pid: i32, addr: u64, len: u64) -> AttachError {
        match e.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => AttachError::Denied {
                pid,
                errno: e,
                scope: ptrace_scope(),
            },
            Some(libc::ESRCH) => AttachError::Gone { pid },
            Some(libc::EFAULT) => AttachError::Fault { pid, addr, len },
            _ => AttachError::Other(e, pid),
        }
    }
}

/// Yama's ptrace scope as the message names it.
fn ptrace_scope() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Ok(s) => format!("it is {} here", s.trim()),
        Err(_) => "Yama is not active here".to_string(),
    }
}

/// Which way a copy goes.
#[derive(Clone, Copy)]
enum Way {
    FromClient,
    ToClient,
}

/// Copies `len` bytes between `local` (this process) and the client's `remote`, whole: a partial
/// transfer (a page boundary the kernel stopped at) goes on from where it stopped.
///
/// # Safety
/// `local .. local + len` must be memory of this process valid for the copy's direction (readable
/// for `ToClient`, writable for `FromClient`) and not accessed otherwise meanwhile.
unsafe fn copy(
    way: Way,
    pages: ClientPages,
    remote: u64,
    local: *mut u8,
    len: usize,
) -> Result<(), AttachError> {
    let mut done = 0usize;
    while done < len {
        let l = libc::iovec {
            // SAFETY: within `local .. local + len` (the caller's range).
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let r = libc::iovec {
            iov_base: (remote + done as u64) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: one local and one remote iovec as built above; the kernel checks the remote
        // range against the client's mappings and reports a fault instead of touching it.
        let n = unsafe {
            match way {
                Way::FromClient => libc::process_vm_readv(pages.pid, &l, 1, &r, 1, 0),
                Way::ToClient => libc::process_vm_writev(pages.pid, &l, 1, &r, 1, 0),
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(AttachError::of(
                e,
                pages.pid,
                remote + done as u64,
                (len - done) as u64,
            ));
        }
        if n == 0 {
            return Err(AttachError::Fault {
                pid: pages.pid,
                addr: remote + done as u64,
                len: (len - done) as u64,
            });
        }
        done += n as usize;
    }
    Ok(())
}

/// The most iovecs one `process_vm_*` call takes (Linux's `UIO_MAXIOV`).
const MAX_IOV: usize = 1024;

/// Copies many pieces between this process and a client's pages at once: each `(local, client
/// offset, len)` is queued, adjacent pieces (contiguous on both sides) merged, and up to
/// [`MAX_IOV`] copied per `process_vm_readv` / `process_vm_writev` — a chunk landed in 4 KiB
/// bounce pages, or gathered from many small blocks, is a few calls, not one per piece.
pub(super) struct ClientCopies {
    pages: ClientPages,
    way: Way,
    queued: Vec<(*mut u8, u64, usize)>,
}

impl ClientCopies {
    /// Copies into the client's pages.
    pub(super) fn into_client(pages: ClientPages) -> ClientCopies {
        ClientCopies {
            pages,
            way: Way::ToClient,
            queued: Vec::new(),
        }
    }

    /// Copies out of the client's pages.
    pub(super) fn from_client(pages: ClientPages) -> ClientCopies {
        ClientCopies {
            pages,
            way: Way::FromClient,
            queued: Vec::new(),
        }
    }

    /// Queues `len` bytes at `local` to or from the client's offset `client_off`; copies the
    /// queue when it is full.
    ///
    /// # Safety
    /// `local .. local + len` must stay valid for the copy's direction (readable into the client,
    /// writable out of it) and otherwise untouched until [`ClientCopies::flush`] returns.
    pub(super) unsafe fn push(
        &mut self,
        local: *mut u8,
        client_off: u64,
        len: usize,
    ) -> Result<(), AttachError> {
        if let Some(last) = self.queued.last_mut()
            && last.0.wrapping_add(last.2) == local
            && last.1 + last.2 as u64 == client_off
        {
            last.2 += len;
            return Ok(());
        }
        if self.queued.len() == MAX_IOV {
            self.flush()?;
        }
        self.queued.push((local, client_off, len));
        Ok(())
    }

    /// Copies what is queued.
    pub(super) fn flush(&mut self) -> Result<(), AttachError> {
        let queued = std::mem::take(&mut self.queued);
        if queued.is_empty() {
            return Ok(());
        }
        let local: Vec<libc::iovec> = queued
            .iter()
            .map(|&(p, _, n)| libc::iovec {
                iov_base: p.cast(),
                iov_len: n,
            })
            .collect();
        let remote: Vec<libc::iovec> = queued
            .iter()
            .map(|&(_, off, n)| libc::iovec {
                iov_base: (self.pages.addr + off) as *mut libc::c_void,
                iov_len: n,
            })
            .collect();
        let total: usize = queued.iter().map(|q| q.2).sum();
        let (l, r, nl, nr) = (
            local.as_ptr(),
            remote.as_ptr(),
            local.len() as libc::c_ulong,
            remote.len() as libc::c_ulong,
        );
        // SAFETY: every local range was promised valid for this direction by `push`'s caller;
        // the kernel checks the remote ranges against the client's mappings.
        let n = unsafe {
            match self.way {
                Way::FromClient => libc::process_vm_readv(self.pages.pid, l, nl, r, nr, 0),
                Way::ToClient => libc::process_vm_writev(self.pages.pid, l, nl, r, nr, 0),
            }
        };
        let done = if n < 0 { 0 } else { n as usize };
        if done == total {
            return Ok(());
        }
        // Stopped part way (or refused): the rest piece by piece, which goes on after a partial
        // copy and names the error.
        let mut skip = done;
        for (p, off, len) in queued {
            if skip >= len {
                skip -= len;
                continue;
            }
            // SAFETY: as above, the rest of one queued piece.
            unsafe {
                copy(
                    self.way,
                    self.pages,
                    self.pages.addr + off + skip as u64,
                    p.add(skip),
                    len - skip,
                )
            }?;
            skip = 0;
        }
        Ok(())
    }
}

/// Copies pieces `(from's offset, to's offset, len)` from one client's pages to another's through
/// `bounce`: every piece read in a few `process_vm_readv` calls (up to 1024 pieces a call), then
/// written out in a few `process_vm_writev` — many small pieces (a batch of 16 KiB blocks) are a
/// handful of calls instead of two each.
pub fn copy_between_clients(
    from: ClientPages,
    to: ClientPages,
    pieces: &[(u64, u64, usize)],
    bounce: &mut Vec<u8>,
) -> Result<(), AttachError> {
    let total: usize = pieces.iter().map(|p| p.2).sum();
    bounce.resize(total, 0);
    let base = bounce.as_mut_ptr();
    let mut read = ClientCopies::from_client(from);
    let mut at = 0;
    for &(s, _, n) in pieces {
        // SAFETY: `base + at .. + n` is inside `bounce` (its `total` bytes), which nothing else
        // touches until the flush below returns.
        unsafe { read.push(base.add(at), s, n) }?;
        at += n;
    }
    read.flush()?;
    let mut write = ClientCopies::into_client(to);
    at = 0;
    for &(_, d, n) in pieces {
        // SAFETY: as above, read by the kernel until the flush below returns.
        unsafe { write.push(base.add(at), d, n) }?;
        at += n;
    }
    write.flush()
}

impl ClientPages {
    /// Copies `dst.len()` bytes at `offset` of the client's memory into `dst`.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), AttachError> {
        // SAFETY: `dst` is an exclusive Rust slice of this process.
        unsafe {
            copy(
                Way::FromClient,
                *self,
                self.addr + offset,
                dst.as_mut_ptr(),
                dst.len(),
            )
        }
    }

    /// Copies `src` into the client's memory at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), AttachError> {
        // SAFETY: `src` is a live Rust slice; the kernel only reads it for `ToClient`.
        unsafe {
            copy(
                Way::ToClient,
                *self,
                self.addr + offset,
                src.as_ptr().cast_mut(),
                src.len(),
            )
        }
    }

    /// Checks now that the daemon may read and write the client's range `[0, len)`: its first
    /// and last bytes are read (the kernel checks each page's permission on the copy), and its
    /// mappings must all be writable (`client_maps`: read from the kernel, never by writing a
    /// byte back, which would lose a client thread's write to it in between).
    pub fn probe(&self, len: u64) -> Result<(), AttachError> {
        for at in [0, len.saturating_sub(1)] {
            let mut b = [0u8; 1];
            self.read(at, &mut b)?;
        }
        self.writable(&mut self.maps()?, len)
    }

    /// This client's mappings, opened (refusals named as the copies' are).
    fn maps(&self) -> Result<super::client_maps::ClientMaps, AttachError> {
        super::client_maps::ClientMaps::open(self.pid).map_err(|e| AttachError::of(e, self.pid, self.addr, 0))
    }

    /// `[0, len)` lies in writable mappings of the client.
    fn writable(&self, maps: &mut super::client_maps::ClientMaps, len: u64) -> Result<(), AttachError> {
        match maps.unwritable(self.addr, len) {
            Ok(None) => Ok(()),
            Ok(Some((addr, super::client_maps::Unwritable::ReadOnly))) => {
                Err(AttachError::ReadOnly { pid: self.pid, addr })
            }
            Ok(Some((addr, super::client_maps::Unwritable::Unmapped))) => Err(AttachError::Fault {
                pid: self.pid,
                addr,
                len: 1,
            }),
            Err(e) => Err(AttachError::of(e, self.pid, self.addr, len)),
        }
    }
}

/// [`ClientPages::probe`] of many ranges (`(pages, len)` each), in one `process_vm_readv` for up
/// to `MAX_IOV` / 2 of one process and one opening of its mappings rather than calls for
/// each: per range, in order, the same answer. A range the kernel stops at (the calls
/// go a byte an iovec, in order, and say how many they copied) is probed alone, for its own
/// error, and the rest go on together after it.
pub fn probe_many(ranges: &[(ClientPages, u64)]) -> Vec<Result<(), AttachError>> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut bytes = vec![0u8; 2 * ranges.len().min(MAX_IOV / 2)];
    while out.len() < ranges.len() {
        let start = out.len();
        let pid = ranges[start].0.pid;
        let same = ranges[start..]
            .iter()
            .take(MAX_IOV / 2)
            .take_while(|(p, _)| p.pid == pid)
            .count();
        let batch = &ranges[start..start + same];
        let remote: Vec<libc::iovec> = batch
            .iter()
            .flat_map(|&(p, len)| [p.addr, p.addr + len.saturating_sub(1)])
            .map(|at| libc::iovec {
                iov_base: at as *mut libc::c_void,
                iov_len: 1,
            })
            .collect();
        let local = libc::iovec {
            iov_base: bytes.as_mut_ptr().cast(),
            iov_len: remote.len(),
        };
        // SAFETY: one local iovec over `bytes` (at least `remote.len()` long, exclusively ours)
        // and 1-byte remote iovecs; the kernel checks each remote byte against the client's
        // mappings and stops at the first it cannot copy instead of touching it.
        let read = unsafe { libc::process_vm_readv(pid, &local, 1, remote.as_ptr(), remote.len() as _, 0) };
        let readable = if read < 0 { 0 } else { read as usize / 2 };
        // Writable: from the client's mappings (one query a range), never by writing back.
        let mut good = 0;
        if readable > 0 {
            match batch[0].0.maps() {
                Ok(mut maps) => {
                    while good < readable && batch[good].0.writable(&mut maps, batch[good].1).is_ok() {
                        good += 1;
                    }
                }
                Err(_) => good = 0,
            }
        }
        out.extend((0..good).map(|_| Ok(())));
        if good < batch.len() {
            // The range the kernel stopped at (or a call refused whole): alone, for its error.
            let (pages, len) = batch[good];
            out.push(pages.probe(len));
        }
    }
    out
}

impl HostRegion {
    /// Copies `len` bytes of the client's memory at `client_off` into this region at `offset`.
    pub fn read_from_client(
        &self,
        offset: usize,
        pages: ClientPages,
        client_off: u64,
        len: usize,
    ) -> Result<(), AttachError> {
        self.check(offset, len)
            .map_err(|e| AttachError::Other(io::Error::other(e.to_string()), pages.pid))?;
        // SAFETY: the range is inside the region (checked); the region's bytes are accessed only
        // through copies, never through references.
        unsafe {
            copy(
                Way::FromClient,
                pages,
                pages.addr + client_off,
                self.as_ptr().add(offset),
                len,
            )
        }
    }

    /// Copies `len` bytes of this region at `offset` into the client's memory at `client_off`.
    pub fn write_to_client(
        &self,
        offset: usize,
        pages: ClientPages,
        client_off: u64,
        len: usize,
    ) -> Result<(), AttachError> {
        self.check(offset, len)
            .map_err(|e| AttachError::Other(io::Error::other(e.to_string()), pages.pid))?;
        // SAFETY: as above; the kernel only reads the local range for `ToClient`.
        unsafe {
            copy(
                Way::ToClient,
                pages,
                pages.addr + client_off,
                self.as_ptr().add(offset),
                len,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_pages_copy_both_ways_and_faults_name_the_range() {
        let mut mine = vec![7u8; 8192];
        let pages = ClientPages {
            pid: std::process::id() as i32,
            addr: mine.as_mut_ptr() as u64,
        };
        pages.probe(8192).unwrap();
        pages.write(100, b"hello").unwrap();
        let mut back = [0u8; 5];
        pages.read(100, &mut back).unwrap();
        assert_eq!(&back, b"hello");
        let region = HostRegion::new(8192).unwrap();
        region.read_from_client(4096, pages, 98, 9).unwrap();
        assert_eq!(region.to_vec(4096, 9).unwrap(), b"\x07\x07hello\x07\x07");
        region.write(0, b"world").unwrap();
        region.write_to_client(0, pages, 8000, 5).unwrap();
        drop(region);
        assert_eq!(&mine[8000..8005], b"world");
        let nowhere = ClientPages {
            pid: pages.pid,
            addr: 8,
        };
        let e = nowhere.read(0, &mut back).unwrap_err();
        assert!(matches!(e, AttachError::Fault { addr: 8, .. }), "{e}");
    }

    #[test]
    fn the_writer_merges_and_batches_pieces_and_names_a_fault() {
        let mut mine = vec![0u8; 3 * MAX_IOV * 2];
        let pages = ClientPages {
            pid: std::process::id() as i32,
            addr: mine.as_mut_ptr() as u64,
        };
        let src: Vec<u8> = (0..mine.len()).map(|i| (i % 251) as u8).collect();
        let mut w = ClientCopies::into_client(pages);
        // Every other 2-byte piece, backwards (no merging: more than MAX_IOV of them), then the
        // gaps forwards (merged where contiguous).
        for k in (0..src.len() / 4).rev() {
            // SAFETY: `src` outlives the writer's flush below.
            unsafe { w.push(src.as_ptr().add(4 * k).cast_mut(), 4 * k as u64, 2) }.unwrap();
        }
        for k in 0..src.len() / 4 {
            // SAFETY: as above.
            unsafe { w.push(src.as_ptr().add(4 * k + 2).cast_mut(), 4 * k as u64 + 2, 2) }.unwrap();
        }
        w.flush().unwrap();
        assert_eq!(mine, src);
        let mut w = ClientCopies::into_client(ClientPages {
            pid: pages.pid,
            addr: 8,
        });
        // SAFETY: as above.
        unsafe { w.push(src.as_ptr().cast_mut(), 0, 4) }.unwrap();
        assert!(matches!(w.flush(), Err(AttachError::Fault { addr: 8, .. })));
    }

    #[test]
    fn a_refusal_names_the_permission_and_the_settings_that_grant_it() {
        let e = AttachError::of(io::Error::from_raw_os_error(libc::EPERM), 4242, 0, 1);
        let m = e.to_string();
        for part in [
            "process 4242",
            "CAP_SYS_PTRACE",
            "AmbientCapabilities=CAP_SYS_PTRACE",
            "SYS_PTRACE",
            "hostPID: true",
            "kernel.yama.ptrace_scope = 0",
            "host_array",
        ] {
            assert!(m.contains(part), "{part} missing from: {m}");
        }
        assert!(matches!(
            AttachError::of(io::Error::from_raw_os_error(libc::ESRCH), 1, 0, 1),
            AttachError::Gone { pid: 1 }
        ));
    }
}
