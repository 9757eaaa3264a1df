//! Whether a local client's addresses are writable, read from its mappings' permissions rather
//! than by writing to them. Registration by address (`cross_memory`) once checked writes by
//! reading a byte and writing it back: a client thread that wrote that byte in between lost its
//! write. Here the kernel answers from the process's VMAs: `PROCMAP_QUERY` on `/proc/PID/maps`
//! (Linux 6.11 and later, one `ioctl` a mapping), else the file's text, read once.
//!
//! Reading `/proc/PID/maps` needs less than `process_vm_writev` does (ptrace read access, where the
//! copy needs attach access), so a daemon that may copy a client's pages may read its maps.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;

/// The kernel's `struct procmap_query` (include/uapi/linux/fs.h, Linux 6.11).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong =
    (3 << 30) | ((std::mem::size_of::<ProcmapQuery>() as libc::c_ulong) << 16) | (0x66 << 8) | 17;
/// `PROCMAP_QUERY_VMA_WRITABLE`.
const VMA_WRITABLE: u64 = 0x02;

/// One mapping: `[start, end)` and whether it may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Vma {
    start: u64,
    end: u64,
    writable: bool,
}

/// What keeps an address from being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unwritable {
    /// A mapping without write permission.
    ReadOnly,
    /// No mapping.
    Unmapped,
}

/// A client's mappings, opened once for a registration (or a batch of them).
pub struct ClientMaps {
    file: File,
    /// The mappings as text, once `PROCMAP_QUERY` was found missing (or `text_only`).
    text: Option<Vec<Vma>>,
}

impl ClientMaps {
    /// Opens process `pid`'s mappings.
    pub fn open(pid: i32) -> io::Result<ClientMaps> {
        Ok(ClientMaps {
            file: File::open(format!("/proc/{pid}/maps"))?,
            text: None,
        })
    }

    /// As [`ClientMaps::open`], reading the text only (tests of the older kernels' way).
    #[cfg(test)]
    fn open_text_only(pid: i32) -> io::Result<ClientMaps> {
        let mut m = ClientMaps::open(pid)?;
        m.text = Some(m.read_text()?);
        Ok(m)
    }

    /// The first address of `[addr, addr + len)` that no writable mapping covers, if any, and
    /// what is there.
    pub fn unwritable(&mut self, addr: u64, len: u64) -> io::Result<Option<(u64, Unwritable)>> {
        let end = addr.saturating_add(len.max(1));
        let mut at = addr;
        while at < end {
            match self.covering(at)? {
                Some(v) if v.writable && v.start <= at && at < v.end => at = v.end,
                Some(_) => return Ok(Some((at, Unwritable::ReadOnly))),
                None => return Ok(Some((at, Unwritable::Unmapped))),
            }
        }
        Ok(None)
    }

    /// The mapping that covers `at`, if any.
    fn covering(&mut self, at: u64) -> io::Result<Option<Vma>> {
        if self.text.is_none() {
            let mut q = ProcmapQuery {
                size: std::mem::size_of::<ProcmapQuery>() as u64,
                query_addr: at,
                ..ProcmapQuery::default()
            };
            // SAFETY: `q` is a live, correctly sized `struct procmap_query` whose name and
            // build-id buffers are absent (sizes 0); the kernel writes only into `q`.
            let r = unsafe {
                libc::ioctl(
                    self.file.as_raw_fd(),
                    PROCMAP_QUERY as _,
                    &mut q as *mut ProcmapQuery,
                )
            };
            if r == 0 {
                return Ok(Some(Vma {
                    start: q.vma_start,
                    end: q.vma_end,
                    writable: q.vma_flags & VMA_WRITABLE != 0,
                }));
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENOENT) => return Ok(None),
                // Before Linux 6.11 the ioctl does not exist: read the text instead.
                Some(libc::ENOTTY) | Some(libc::EINVAL) => self.text = Some(self.read_text()?),
                _ => return Err(e),
            }
        }
        let vmas = self.text.as_deref().unwrap_or_default();
        let i = vmas.partition_point(|v| v.end <= at);
        Ok(vmas.get(i).filter(|v| v.start <= at).copied())
    }

    /// Every mapping from the file's text, in address order.
    fn read_text(&mut self) -> io::Result<Vec<Vma>> {
        let mut s = String::new();
        (&self.file).read_to_string(&mut s)?;
        Ok(parse(&s))
    }
}

/// `start-end perms …` lines into mappings (lines that do not parse are skipped).
fn parse(text: &str) -> Vec<Vma> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_ascii_whitespace();
            let (start, end) = f.next()?.split_once('-')?;
            let perms = f.next()?;
            Some(Vma {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                writable: perms.as_bytes().get(1) == Some(&b'w'),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapping of this test's own of `pages` pages with `prot` (unmapped when dropped).
    struct Map(*mut libc::c_void, usize);
    impl Map {
        fn new(pages: usize, prot: i32) -> Map {
            let len = pages * 4096;
            // SAFETY: a fresh private anonymous mapping of this test's own.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Map(p, len)
        }
        fn at(&self, page: usize) -> u64 {
            self.0 as u64 + (page * 4096) as u64
        }
        fn protect(&self, page: usize, prot: i32) {
            // SAFETY: one page inside this test's own mapping.
            assert_eq!(
                unsafe { libc::mprotect(self.at(page) as *mut libc::c_void, 4096, prot) },
                0
            );
        }
    }
    impl Drop for Map {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`, unmapped once.
            unsafe { libc::munmap(self.0, self.1) };
        }
    }

    #[test]
    fn writable_read_only_and_unmapped_ranges_by_either_way() {
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let m = Map::new(4, rw);
        m.protect(2, libc::PROT_READ);
        let pid = std::process::id() as i32;
        for text in [false, true] {
            let mut maps = if text {
                ClientMaps::open_text_only(pid).unwrap()
            } else {
                ClientMaps::open(pid).unwrap()
            };
            assert_eq!(maps.unwritable(m.at(0), 2 * 4096).unwrap(), None, "text {text}");
            assert_eq!(maps.unwritable(m.at(1) + 100, 1).unwrap(), None);
            // Over the read-only page: its first address.
            assert_eq!(
                maps.unwritable(m.at(0), 3 * 4096).unwrap(),
                Some((m.at(2), Unwritable::ReadOnly))
            );
            assert_eq!(maps.unwritable(m.at(3), 4096).unwrap(), None);
            // Nothing mapped at page 1 of the address space.
            assert_eq!(
                maps.unwritable(4096, 4096).unwrap(),
                Some((4096, Unwritable::Unmapped))
            );
        }
    }

    #[test]
    fn maps_text_parses() {
        let v = parse(
            "55d0c0000000-55d0c0001000 r--p 00000000 08:01 1 /bin/x\n\
             7f0000000000-7f0000002000 rw-p 00000000 00:00 0 \n",
        );
        assert_eq!(
            v,
            vec![
                Vma {
                    start: 0x55d0c0000000,
                    end: 0x55d0c0001000,
                    writable: false
                },
                Vma {
                    start: 0x7f0000000000,
                    end: 0x7f0000002000,
                    writable: true
                },
            ]
        );
    }
}
