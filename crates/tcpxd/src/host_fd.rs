//! Host memory of a local client's own, handed to the daemon as a file descriptor (SCM_RIGHTS on
//! the framed local session, src/api/local) and registered as a buffer like any other: both
//! processes map the same pages, so nothing is copied on either side.
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
use std::sync::Arc;

use rustix::fs::{FileType, OFlags, SealFlags};

use crate::buffers::{BufferEntry, BufferKind, BufferMemory, BufferRegistry};
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
    let missing = if on_hugetlbfs(fd) {
        0
    } else {
        let (resident, pages) = region.resident_pages().map_err(failed)?;
        let absent = (pages - resident) as u64 * rustix::param::page_size() as u64;
        let stored = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
        absent.min(file_size.saturating_sub(stored))
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

impl BufferRegistry {
    /// Registers `[offset, offset + size)` of a client's file (not yet visible:
    /// [`BufferRegistry::publish`] makes it so once the poller knows it).
    pub fn register_host_file(
        &self,
        fd: &OwnedFd,
        offset: u64,
        size: u64,
        label: &str,
        unsealed: Unsealed,
    ) -> Result<(Arc<BufferEntry>, Shrink), EngineError> {
        self.register_host_file_as(fd, offset, size, label, unsealed, None)
    }

    /// As [`BufferRegistry::register_host_file`], taking back a re-attached id and key.
    pub fn register_host_file_as(
        &self,
        fd: &OwnedFd,
        offset: u64,
        size: u64,
        label: &str,
        unsealed: Unsealed,
        ident: Option<crate::buffers::Ident>,
    ) -> Result<(Arc<BufferEntry>, Shrink), EngineError> {
        self.check_new("register_host_fd.size", size, label)?;
        let (region, shrink) = map_client_file(fd, offset, size, unsealed, &self.headroom)?;
        let entry = self.entry_as(
            BufferKind::HostShared,
            size,
            label,
            BufferMemory::Host(Arc::new(region)),
            ident,
        );
        Ok((entry, shrink))
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    use rustix::fs::MemfdFlags;

    use super::*;
    use crate::buffers::{Pattern, fill, read};

    fn memfd(size: u64, sealing: bool) -> OwnedFd {
        let mut flags = MemfdFlags::CLOEXEC;
        if sealing {
            flags |= MemfdFlags::ALLOW_SEALING;
        }
        let fd = rustix::fs::memfd_create("tcpxd-test", flags).unwrap();
        rustix::fs::ftruncate(&fd, size).unwrap();
        fd
    }

    fn file(fd: &OwnedFd) -> File {
        File::from(fd.try_clone().unwrap())
    }

    #[test]
    fn the_policy_trusts_only_the_daemons_user_and_root() {
        assert_eq!(Unsealed::for_peer(Some(1000), 1000), Unsealed::Allowed);
        assert_eq!(Unsealed::for_peer(Some(0), 1000), Unsealed::Allowed);
        assert_eq!(Unsealed::for_peer(Some(1001), 1000), Unsealed::Refused);
        assert_eq!(Unsealed::for_peer(None, 0), Unsealed::Refused);
    }

    #[test]
    fn a_memfd_is_shared_both_ways_and_sealed_against_shrinking() {
        let reg = BufferRegistry::new("n", 1 << 30);
        let fd = memfd(3 << 20, true);
        let f = file(&fd);
        f.write_all_at(b"client bytes", 4096 + 5).unwrap();
        // An unaligned offset: the buffer starts 5 bytes into the file's second page.
        let (b, shrink) = reg
            .register_host_file(&fd, 4096 + 5, 2 << 20, "", Unsealed::Refused)
            .unwrap();
        assert_eq!(shrink, Shrink::Sealed);
        assert_eq!(b.kind, BufferKind::HostShared);
        assert_eq!(
            read(&b, 0, 12).unwrap(),
            b"client bytes",
            "the client's write, seen"
        );
        fill(&b, 100, 3, &Pattern::Byte(0xEE)).unwrap();
        let mut got = [0u8; 3];
        f.read_exact_at(&mut got, 4096 + 5 + 100).unwrap();
        assert_eq!(got, [0xEE; 3], "the daemon's write, seen by the client");
        let seals = rustix::fs::fcntl_get_seals(&fd).unwrap();
        assert!(seals.contains(SealFlags::SHRINK), "{seals:?}");
        // The client can no longer truncate the file under the daemon; growing is still fine.
        assert!(rustix::fs::ftruncate(&fd, 4096).is_err());
        rustix::fs::ftruncate(&fd, 4 << 20).unwrap();
        assert_eq!(read(&b, 0, 12).unwrap(), b"client bytes");
    }

    #[test]
    fn only_the_pages_of_a_file_not_yet_in_memory_count_against_the_headroom() {
        // 4 MiB of room: an 8 MiB fresh memfd (all holes) does not fit; once the client wrote
        // every page, faulting it in takes nothing new and it does.
        let probe = Box::new(|| Some(4 << 20));
        let reg = BufferRegistry::new("n", 1 << 30).with_headroom(Headroom::with_probe(0, probe));
        let fd = memfd(8 << 20, true);
        let e = reg
            .register_host_file(&fd, 0, 8 << 20, "", Unsealed::Refused)
            .unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert!(
            e.message
                .starts_with("register_host_fd.size: faulting in 8388608 bytes"),
            "{e}"
        );
        file(&fd).write_all_at(&vec![1u8; 8 << 20], 0).unwrap();
        let (b, _) = reg
            .register_host_file(&fd, 0, 8 << 20, "", Unsealed::Refused)
            .unwrap();
        assert_eq!(read(&b, (8 << 20) - 2, 2).unwrap(), [1, 1]);
        // Half written: the other half counts (4 MiB, which fits).
        let half = memfd(8 << 20, true);
        file(&half).write_all_at(&vec![2u8; 4 << 20], 0).unwrap();
        reg.register_host_file(&half, 0, 8 << 20, "", Unsealed::Refused)
            .unwrap();
        // Allocated by the client (`fallocate`, as the Python package does) but never touched:
        // not in memory, yet faulting it in allocates nothing new.
        let allocated = memfd(8 << 20, true);
        rustix::fs::fallocate(&allocated, rustix::fs::FallocateFlags::empty(), 0, 8 << 20).unwrap();
        let (b, _) = reg
            .register_host_file(&allocated, 0, 8 << 20, "", Unsealed::Refused)
            .unwrap();
        assert_eq!(read(&b, 0, 2).unwrap(), [0, 0]);
    }

    #[test]
    fn hugetlbfs_files_are_told_apart() {
        assert!(!on_hugetlbfs(&memfd(4096, true)));
        // Where the kernel has hugetlbfs (the pool may be empty: nothing is allocated here).
        if let Ok(huge) = rustix::fs::memfd_create("tcpxd-huge", MemfdFlags::CLOEXEC | MemfdFlags::HUGETLB) {
            assert!(on_hugetlbfs(&huge));
        }
    }

    #[test]
    fn bounds_are_checked_against_the_files_size() {
        let reg = BufferRegistry::new("n", 1 << 30);
        let fd = memfd(8192, true);
        let e = reg
            .register_host_file(&fd, 4096, 4097, "", Unsealed::Refused)
            .unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert_eq!(
            e.message,
            "register_host_fd.offset + size: range 4096..8193 is past the end of the file (8192 bytes)"
        );
        let e = reg
            .register_host_file(&fd, u64::MAX, 2, "", Unsealed::Refused)
            .unwrap_err();
        assert!(e.message.contains("overflows 64 bits"), "{e}");
        let e = reg
            .register_host_file(&fd, 0, 0, "", Unsealed::Refused)
            .unwrap_err();
        assert!(e.message.starts_with("register_host_fd.size: 0 bytes"), "{e}");
        let small = BufferRegistry::new("n", 4096);
        let e = small
            .register_host_file(&fd, 0, 8192, "", Unsealed::Refused)
            .unwrap_err();
        assert!(e.message.contains("max_buffer_bytes"), "{e}");
        // Exactly the file: fine.
        reg.register_host_file(&fd, 0, 8192, "", Unsealed::Refused)
            .unwrap();
    }

    #[test]
    fn unsealable_files_are_taken_only_from_trusted_clients() {
        let reg = BufferRegistry::new("n", 1 << 30);
        let fd = memfd(8192, false);
        let e = reg
            .register_host_file(&fd, 0, 8192, "", Unsealed::Refused)
            .unwrap_err();
        assert_eq!(e.code, Code::PermissionDenied);
        assert!(e.message.contains("MFD_ALLOW_SEALING"), "{e}");
        let (_, shrink) = reg
            .register_host_file(&fd, 0, 8192, "", Unsealed::Allowed)
            .unwrap();
        assert_eq!(shrink, Shrink::Trusted);
        // A file on disk cannot be sealed either.
        let dir = std::env::temp_dir().join(format!("tcpxd-hostfd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(8192).unwrap();
        let fd = OwnedFd::from(f);
        let e = reg
            .register_host_file(&fd, 0, 8192, "", Unsealed::Refused)
            .unwrap_err();
        assert_eq!(e.code, Code::PermissionDenied);
        reg.register_host_file(&fd, 0, 8192, "", Unsealed::Allowed)
            .unwrap();
        // Read-only: refused whoever asks.
        let ro = OwnedFd::from(File::open(&path).unwrap());
        let e = reg
            .register_host_file(&ro, 0, 8192, "", Unsealed::Allowed)
            .unwrap_err();
        assert!(e.message.contains("O_RDWR"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn what_is_not_a_regular_file_or_is_write_sealed_is_refused() {
        let reg = BufferRegistry::new("n", 1 << 30);
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let e = reg
            .register_host_file(&OwnedFd::from(a), 0, 1, "", Unsealed::Allowed)
            .unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("a socket, not a regular file"), "{e}");
        let dev = OwnedFd::from(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
                .unwrap(),
        );
        let e = reg
            .register_host_file(&dev, 0, 1, "", Unsealed::Allowed)
            .unwrap_err();
        assert!(e.message.contains("a character device"), "{e}");
        let fd = memfd(8192, true);
        rustix::fs::fcntl_add_seals(&fd, SealFlags::WRITE).unwrap();
        let e = reg
            .register_host_file(&fd, 0, 8192, "", Unsealed::Allowed)
            .unwrap_err();
        assert!(e.message.contains("sealed against writing"), "{e}");
    }

    #[test]
    fn the_mapping_goes_with_the_last_reference() {
        let maps = || {
            std::fs::read_to_string("/proc/self/maps")
                .unwrap()
                .lines()
                .filter(|l| l.contains("memfd:tcpxd-last-ref"))
                .count()
        };
        let reg = BufferRegistry::new("n", 1 << 30);
        let fd = rustix::fs::memfd_create("tcpxd-last-ref", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .unwrap();
        rustix::fs::ftruncate(&fd, 1 << 20).unwrap();
        let (b, _) = reg
            .register_host_file(&fd, 0, 1 << 20, "", Unsealed::Refused)
            .unwrap();
        drop(fd);
        assert_eq!(
            maps(),
            1,
            "mapped once; the descriptor itself is not needed after"
        );
        let region = b.host_region().unwrap().clone();
        let (resident, pages) = region.resident_pages().unwrap();
        assert_eq!(resident, pages, "populated at registration");
        drop(b);
        // A transfer's reference keeps the mapping.
        assert_eq!(maps(), 1);
        assert_eq!(region.to_vec(0, 4).unwrap(), vec![0u8; 4]);
        drop(region);
        assert_eq!(maps(), 0, "unmapped with the last reference");
    }
}
