//! Mapping host memory that lives in a file: a local client's own, handed to the daemon as a file
//! descriptor (SCM_RIGHTS on the framed local session, src/api/local; registered as a buffer by
//! src/host_fd.rs), or the daemon's own allocations under its state directory (src/buffers/allocate.rs):
//! both processes map the same pages, so nothing is copied on either side.
//!
//! What the daemon checks before it maps the file (each refusal names the field and what to do):
//! - a regular file (a memfd, a file on /dev/shm or hugetlbfs, a file on disk), not a socket,
//!   pipe or device;
//! - open for reading and writing (the mapping is `PROT_READ | PROT_WRITE`, `MAP_SHARED`), and not
//!   sealed against writing;
//! - `offset + size` within the file's size, once it can no longer shrink.
//!
//! Truncation. A shared mapping of a file that is truncated under it raises SIGBUS on the next
//! touch of a page past the new end: in the daemon's own copies or in the plugin's threads, which
//! would take the whole daemon down. So the daemon seals the file against shrinking
//! (`F_SEAL_SHRINK`) before it checks the size, which a memfd created with `MFD_ALLOW_SEALING`
//! takes (the Python package's own allocations always are); the seal stays on the file for good
//! (growing it is still allowed). A file that cannot take the seal (a memfd without
//! `MFD_ALLOW_SEALING`, a torch `share_memory_()` file, a file on disk) is taken only from a
//! client whose credentials (`SO_PEERCRED`) are the daemon's own user or root: such a client can
//! signal or trace the daemon anyway, so truncating its memory gives it no power it lacked; any
//! other client gets PERMISSION_DENIED and is told to hand over a sealable memfd.

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{FileType, OFlags, SealFlags};

use crate::engine::{Code, EngineError};
use crate::headroom::Headroom;
use crate::net::HostRegion;

/// Whether a client may hand over a file that cannot be sealed against shrinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsealed {
    /// The client runs as the daemon's user or as root: it could stop the daemon anyway.
    Allowed,
    /// Any other client (or one whose credentials are unknown).
    Refused,
}

impl Unsealed {
    /// The policy for a client of user `peer_uid` (None: unknown) and a daemon of user `daemon_uid`.
    pub fn for_peer(peer_uid: Option<u32>, daemon_uid: u32) -> Unsealed {
        match peer_uid {
            Some(uid) if uid == daemon_uid || uid == 0 => Unsealed::Allowed,
            _ => Unsealed::Refused,
        }
    }
}

/// How the file was made safe from truncation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shrink {
    /// `F_SEAL_SHRINK` is on the file (it was already, or the daemon put it on).
    Sealed,
    /// The file cannot be sealed; the client is trusted not to shrink it ([`Unsealed::Allowed`]).
    Trusted,
}

/// Checks the client's file and maps `[offset, offset + size)` of it, faulting its pages in
/// where `headroom` has room for those not in memory yet (a fresh memfd's are holes: faulting
/// them in allocates them, charged to the daemon).
pub fn map_client_file(
    fd: &OwnedFd,
    offset: u64,
    size: u64,
    unsealed: Unsealed,
    headroom: &Headroom,
) -> Result<(HostRegion, Shrink), EngineError> {
    let invalid = |why: String| EngineError::invalid(format!("host_fd: {why}"));
    let st = rustix::fs::fstat(fd).map_err(|e| invalid(format!("fstat: {e}")))?;
    let ty = FileType::from_raw_mode(st.st_mode);
    if ty != FileType::RegularFile {
        return Err(invalid(format!(
            "the descriptor is {}, not a regular file: hand over a memfd or a file on /dev/shm",
            type_name(ty)
        )));
    }
    let flags = rustix::fs::fcntl_getfl(fd).map_err(|e| invalid(format!("F_GETFL: {e}")))?;
    if flags & OFlags::RWMODE != OFlags::RDWR {
        return Err(invalid(
            "the file is not open for reading and writing (open it O_RDWR): transfers write into it".into(),
        ));
    }
    let shrink = seal_against_shrinking(fd, unsealed)?;
    // Sealed: the size read now holds for good. Trusted: the client keeps it.
    let st = rustix::fs::fstat(fd).map_err(|e| invalid(format!("fstat: {e}")))?;
    let file_size = u64::try_from(st.st_size).unwrap_or(0);
    match offset.checked_add(size) {
        Some(end) if end <= file_size => {}
        Some(end) => {
            return Err(EngineError::invalid(format!(
                "register_host_fd.offset + size: range {offset}..{end} is past the end of the file ({file_size} bytes)"
            )));
        }
        None => {
            return Err(EngineError::invalid(format!(
                "register_host_fd.offset + size: {offset} + {size} overflows 64 bits"
            )));
        }
    }
    let len = usize::try_from(size)
        .map_err(|_| EngineError::invalid("register_host_fd.size: too large for this machine"))?;
    // What the checks above leave to fail here (hugetlbfs alignment, a file system without
    // shared mappings, the address space) is the file's or the machine's, not a bad request.
    let failed =
        |e: crate::net::NetError| EngineError::new(Code::FailedPrecondition, format!("host_fd: {e}"));
    let region = HostRegion::map_file_lazily(fd.as_fd(), offset, len).map_err(failed)?;
    // What faulting the range in would allocate: no more than its pages not in memory
    // (`mincore`), nor than the file's bytes without storage (size less `st_blocks`). Both
    // count: pages the client allocated with `fallocate` (the package does) but never touched
    // are not in memory yet, and a file whose storage is complete may not be resident. A
    // hugetlbfs file's pages come from the huge page pool, reserved when the file was sized or
    // mapped, not from the memory `MemAvailable` counts: nothing to admit.
    // A file whose storage is complete (what the client wrote, or allocated with `fallocate`)
    // needs no `mincore`: nothing to allocate, whatever is resident (a pass over every page,
    // ~13 % of the daemon's time registering written 1 MiB memfds).
    let stored = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
    let missing = if stored >= file_size || on_hugetlbfs(fd) {
        0
    } else {
        let (resident, pages) = region.resident_pages().map_err(failed)?;
        let absent = (pages - resident) as u64 * rustix::param::page_size() as u64;
        absent.min(file_size - stored)
    };
    let _admitted = headroom.admit("register_host_fd.size", missing)?;
    region.fault_in_file().map_err(failed)?;
    Ok((region, shrink))
}

/// Whether the file lies on hugetlbfs (a memfd made with `MFD_HUGETLB`, a file under a hugetlbfs
/// mount).
fn on_hugetlbfs(fd: &OwnedFd) -> bool {
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    // `f_type`'s width differs between targets (i64 here, u32 on some).
    #[allow(clippy::unnecessary_cast)]
    rustix::fs::fstatfs(fd).is_ok_and(|s| s.f_type as i64 == HUGETLBFS_MAGIC)
}

/// Puts `F_SEAL_SHRINK` on the file, or decides whether an unsealable one may be used.
fn seal_against_shrinking(fd: &OwnedFd, unsealed: Unsealed) -> Result<Shrink, EngineError> {
    // EINVAL: the file system has no seals at all (a file on disk).
    let seals = rustix::fs::fcntl_get_seals(fd).unwrap_or(SealFlags::SEAL);
    if seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE) {
        return Err(EngineError::invalid(
            "host_fd: the file is sealed against writing (F_SEAL_WRITE): transfers into it could not land",
        ));
    }
    if seals.contains(SealFlags::SHRINK) {
        return Ok(Shrink::Sealed);
    }
    if !seals.contains(SealFlags::SEAL) && rustix::fs::fcntl_add_seals(fd, SealFlags::SHRINK).is_ok() {
        return Ok(Shrink::Sealed);
    }
    match unsealed {
        Unsealed::Allowed => Ok(Shrink::Trusted),
        Unsealed::Refused => Err(EngineError::new(
            Code::PermissionDenied,
            "host_fd: the file cannot be sealed against shrinking (F_SEAL_SHRINK), and only a client \
             running as the daemon's own user (or root) may hand over such a file: truncating it would \
             crash the daemon. Hand over a memfd created with MFD_ALLOW_SEALING (the Python package's \
             register_host(size) makes one)",
        )),
    }
}

fn type_name(ty: FileType) -> &'static str {
    match ty {
        FileType::Directory => "a directory",
        FileType::Socket => "a socket",
        FileType::Fifo => "a pipe",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Symlink => "a symbolic link",
        _ => "not a regular file",
    }
}

#[cfg(test)]
mod tests {
    use rustix::fs::MemfdFlags;

    use super::*;

    #[test]
    fn the_policy_trusts_only_the_daemons_user_and_root() {
        assert_eq!(Unsealed::for_peer(Some(1000), 1000), Unsealed::Allowed);
        assert_eq!(Unsealed::for_peer(Some(0), 1000), Unsealed::Allowed);
        assert_eq!(Unsealed::for_peer(Some(1001), 1000), Unsealed::Refused);
        assert_eq!(Unsealed::for_peer(None, 0), Unsealed::Refused);
    }

    #[test]
    fn hugetlbfs_files_are_told_apart() {
        assert!(!on_hugetlbfs(&memfd()));
        // Where the kernel has hugetlbfs (the pool may be empty: nothing is allocated here).
        if let Ok(huge) = rustix::fs::memfd_create("tcpxd-huge", MemfdFlags::CLOEXEC | MemfdFlags::HUGETLB) {
            assert!(on_hugetlbfs(&huge));
        }
    }

    fn memfd() -> OwnedFd {
        let fd =
            rustix::fs::memfd_create("tcpxd-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        fd
    }
}
