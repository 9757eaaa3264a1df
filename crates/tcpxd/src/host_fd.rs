//! Host memory of a local client's own, handed to the daemon as a file descriptor (SCM_RIGHTS on
//! the framed local session, src/api/local) and registered as a buffer like any other. What the
//! daemon checks before it maps the file, and how it keeps the file from shrinking under the
//! mapping, is src/host_file.rs.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::buffers::{BufferEntry, BufferKind, BufferMemory, BufferRegistry};
use crate::engine::EngineError;
use crate::host_file::{Shrink, Unsealed, map_client_file};

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

    use rustix::fs::{MemfdFlags, SealFlags};

    use super::*;
    use crate::buffers::{Pattern, fill, read};
    use crate::engine::Code;
    use crate::headroom::Headroom;

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
