//! File descriptors kept across a restart by the service manager: systemd's file-descriptor store
//! (`sd_notify(3)` `FDSTORE=1` with `FDNAME=`, the descriptor passed by SCM_RIGHTS; the unit's
//! `FileDescriptorStoreMax=`), handed back to the next process as `LISTEN_FDS` /
//! `LISTEN_FDNAMES` (`sd_listen_fds(3)`). The daemon keeps there the fds of its CUDA memory
//! (gpu/vmm.rs), so that memory and its bytes outlive the process (docs/OPERATIONS.md,
//! "Restarts").
//!
//! The store is used when the manager says it keeps one: `NOTIFY_SOCKET` is set and `FDSTORE`
//! (set by systemd 254 and later to `FileDescriptorStoreMax=`; set it in the unit with
//! `Environment=FDSTORE=` for older systemd) is above 0. Where there is no systemd (GKE, a plain
//! run), `runtime.fd_keeper` names the socket of a `tcpxd fd-keeper` (src/fd_keeper.rs) that
//! keeps them instead: the same messages over a SOCK_SEQPACKET connection, each answered, and
//! `LISTEN=1` to get them back at start.

use std::collections::{HashMap, HashSet};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

use crate::fd_keeper::KEEPER_MAX;

#[derive(Debug)]
enum Via {
    /// systemd's notification socket (`NOTIFY_SOCKET`; `@` starts an abstract name).
    Systemd(String),
    /// A `tcpxd fd-keeper`'s socket.
    Keeper(PathBuf),
}

/// The service manager's descriptor store, or an fd keeper's.
#[derive(Debug)]
pub struct FdStore {
    via: Via,
    /// How many descriptors the store keeps (`FDSTORE`, or the keeper's).
    pub max: usize,
}

impl FdStore {
    /// The store the environment names, if any.
    pub fn from_env() -> Option<FdStore> {
        let socket = std::env::var("NOTIFY_SOCKET").ok().filter(|s| !s.is_empty())?;
        let max = std::env::var("FDSTORE").ok()?.trim().parse::<usize>().ok()?;
        (max > 0).then_some(FdStore {
            via: Via::Systemd(socket),
            max,
        })
    }

    /// The store of the `tcpxd fd-keeper` serving `socket`.
    pub fn keeper(socket: &Path) -> FdStore {
        FdStore {
            via: Via::Keeper(socket.to_path_buf()),
            max: KEEPER_MAX,
        }
    }

    /// What the store is, for logs.
    pub fn describe(&self) -> String {
        match &self.via {
            Via::Systemd(_) => "systemd's file-descriptor store".into(),
            Via::Keeper(p) => format!("the fd keeper at {}", p.display()),
        }
    }

    /// The descriptors the store kept for this service, by name (once per process for systemd's).
    pub fn take_stored(&self) -> std::io::Result<HashMap<String, OwnedFd>> {
        match &self.via {
            Via::Systemd(_) => Ok(take_inherited()),
            Via::Keeper(path) => crate::fd_keeper::list(path),
        }
    }

    fn send(&self, text: &str, fd: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
        let socket = match &self.via {
            Via::Systemd(s) => s,
            Via::Keeper(path) => return crate::fd_keeper::request(path, text, fd),
        };
        let sock = UnixDatagram::unbound()?;
        match socket.strip_prefix('@') {
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                sock.connect_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?
            }
            None => sock.connect(socket)?,
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Some(fd) = fd {
            fds = [fd];
            control.push(SendAncillaryMessage::ScmRights(&fds));
        }
        let sent = rustix::net::sendmsg(
            &sock,
            &[IoSlice::new(text.as_bytes())],
            &mut control,
            SendFlags::empty(),
        )?;
        if sent != text.len() {
            return Err(std::io::Error::other("the notification was cut short"));
        }
        Ok(())
    }

    /// Hands a duplicate of `fd` to the store under `name` (the store keeps it until removed or
    /// the service stops). `FDPOLL=0`: systemd drops a stored fd on which it sees POLLHUP or
    /// POLLERR, and a driver's fd says nothing dependable there.
    pub fn store(&self, name: &str, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        self.send(&format!("FDSTORE=1\nFDNAME={name}\nFDPOLL=0\n"), Some(fd))
    }

    /// Closes the store's descriptors named `name`.
    pub fn remove(&self, name: &str) -> std::io::Result<()> {
        self.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}\n"), None)
    }
}

/// The name daemon-allocated CUDA buffer `id`'s fd has in the store (src/cuda_kept.rs).
pub fn fd_name(id: u64) -> String {
    format!("tcpxd-cuda-b{id}")
}

/// The store, and which buffers have their fd there.
#[derive(Debug)]
pub struct CudaStore {
    pub(crate) store: FdStore,
    kept: Mutex<HashSet<u64>>,
}

impl CudaStore {
    pub fn new(store: FdStore) -> CudaStore {
        CudaStore {
            store,
            kept: Mutex::new(HashSet::new()),
        }
    }

    /// The buffers whose fd is in the store.
    pub(crate) fn kept(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The descriptors the store kept for the previous instance, by name; none (logged) when
    /// it cannot be asked.
    pub fn take_stored(&self) -> HashMap<String, OwnedFd> {
        self.store.take_stored().unwrap_or_else(|e| {
            tracing::warn!(
                "asking {} for the kept CUDA descriptors: {e}; daemon-allocated CUDA memory is not restored",
                self.store.describe()
            );
            HashMap::new()
        })
    }

    /// Drops a descriptor of the store that no buffer claims (a previous instance's leftover).
    pub fn remove_unclaimed(&self, name: &str) {
        if let Err(e) = self.store.remove(name) {
            tracing::warn!(name, "removing a descriptor nobody claims from the store: {e}");
        }
    }
}

/// Takes the descriptors the manager passed to this process (`LISTEN_FDS`), by name, once.
pub fn take_inherited() -> HashMap<String, OwnedFd> {
    crate::net::inherited_fds::take()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_stored_descriptor_reaches_the_manager_with_its_name() {
        let dir = std::env::temp_dir().join(format!("tcpxd-fdstore-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let manager = UnixDatagram::bind(&path).unwrap();
        let store = FdStore {
            via: Via::Systemd(path.to_string_lossy().into_owned()),
            max: 4,
        };
        let file = std::fs::File::create(dir.join("kept")).unwrap();
        store.store("tcpxd-cuda-b7", file.as_fd()).unwrap();
        let mut buf = [0u8; 256];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            &manager,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut control,
            rustix::net::RecvFlags::empty(),
        )
        .unwrap();
        assert_eq!(&buf[..got.bytes], b"FDSTORE=1\nFDNAME=tcpxd-cuda-b7\nFDPOLL=0\n");
        let fds: Vec<OwnedFd> = control
            .drain()
            .flat_map(|m| match m {
                rustix::net::RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(fds.len(), 1);
        assert_eq!(
            rustix::fs::fstat(&fds[0]).unwrap().st_ino,
            rustix::fs::fstat(&file).unwrap().st_ino,
            "the same file"
        );
        store.remove("tcpxd-cuda-b7").unwrap();
        let got = manager.recv(&mut buf).unwrap();
        assert_eq!(&buf[..got], b"FDSTOREREMOVE=1\nFDNAME=tcpxd-cuda-b7\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
