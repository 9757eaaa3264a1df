//! RxDM's GPU receive memory, as the plugin imports it at every accept (`src/gpu/rx_pool.cu`,
//! `GpumemImport`): `get_gpu_fd_<pci>` answers a file descriptor (one dummy byte with
//! `SCM_RIGHTS`), `get_gpu_metadata_<pci>` a framed `raw_bytes` holding `{int fd; size_t size;
//! size_t align}`. Here each GPU's memory is a file, `<prefix>/gpumem-<pci>`, which the CUDA
//! stand-in maps (`cuMemImportFromShareableHandle` / `cuMemMap`) and the devmem shim
//! (tools/realplugin/devmem-shim) opens by its name and maps too, to put each steered flow's bytes
//! in its GPU's pages; without it the plugin's accept fails on every GPU whose import it does not
//! skip (`NCCL_TCPX_RXMEM_IMPORT_SKIP_ODDS=1` skips the odd ones).

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Payload, UnixSocketProto, frame, read_frame};

/// Bytes of "GPU receive memory" per GPU (a memfd; pages are only used if written).
pub const GPU_MEM_BYTES: usize = 64 << 20;
/// The alignment the metadata reports (RxDM reports its allocation granularity).
pub const GPU_MEM_ALIGN: usize = 2 << 20;

/// Serves `get_gpu_fd_<pci>` and `get_gpu_metadata_<pci>` for each GPU.
pub struct GpuMemServer {
    paths: Vec<PathBuf>,
    stopping: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

/// The 24 bytes of RxDM's `IpcGpuMemFdMetadata {int fd; size_t size; size_t align}`.
pub fn metadata_bytes(size: usize, align: usize) -> Vec<u8> {
    let mut b = vec![0u8; 24];
    b[0..4].copy_from_slice(&(-1i32).to_ne_bytes());
    b[8..16].copy_from_slice(&(size as u64).to_ne_bytes());
    b[16..24].copy_from_slice(&(align as u64).to_ne_bytes());
    b
}

/// GPU `gpu`'s receive memory under `prefix` (the devmem shim opens it by this name).
pub fn pool_path(prefix: &Path, gpu: &str) -> PathBuf {
    prefix.join(format!("gpumem-{gpu}"))
}

/// A fresh file of `len` zero bytes (sparse: pages only where written).
fn pool_file(path: &Path, len: usize) -> std::io::Result<OwnedFd> {
    let _ = std::fs::remove_file(path);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)?;
    f.set_len(len as u64)?;
    Ok(OwnedFd::from(f))
}

/// Sends `fd` with one dummy byte, as RxDM's `UnixSocketConnection::SendFd`.
fn send_fd(conn: &UnixStream, fd: &OwnedFd) -> std::io::Result<()> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE of one int; a u64 array keeps the buffer aligned for cmsghdr.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: zeroed msghdr, pointed at the stack iovec and the control buffer, both alive for
    // the call; the cmsg is written inside the control buffer (CMSG_FIRSTHDR of a big enough one).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
        if libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

impl GpuMemServer {
    /// Listens under `prefix` for every GPU in `gpus` (PCI bus ids).
    pub fn start(prefix: &Path, gpus: &[String]) -> std::io::Result<GpuMemServer> {
        let stopping = Arc::new(AtomicBool::new(false));
        let mut paths = Vec::new();
        let mut threads = Vec::new();
        for gpu in gpus {
            let pool = pool_path(prefix, gpu);
            let fd = Arc::new(pool_file(&pool, GPU_MEM_BYTES)?);
            paths.push(pool);
            for (kind, is_fd) in [("get_gpu_fd_", true), ("get_gpu_metadata_", false)] {
                let path = prefix.join(format!("{kind}{gpu}"));
                let _ = std::fs::remove_file(&path);
                let listener = UnixListener::bind(&path)?;
                paths.push(path);
                let (fd, stopping) = (fd.clone(), stopping.clone());
                threads.push(std::thread::spawn(move || {
                    for conn in listener.incoming() {
                        if stopping.load(Ordering::Acquire) {
                            return;
                        }
                        let Ok(mut conn) = conn else { continue };
                        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                        // One request (the GPU's bus id as raw_bytes), one answer.
                        if !matches!(read_frame(&mut conn), Ok(Some(_))) {
                            continue;
                        }
                        let _ = if is_fd {
                            send_fd(&conn, &fd)
                        } else {
                            conn.write_all(&frame(&UnixSocketProto {
                                payload: Some(Payload::RawBytes(metadata_bytes(
                                    GPU_MEM_BYTES,
                                    GPU_MEM_ALIGN,
                                ))),
                            }))
                        };
                    }
                }));
            }
        }
        Ok(GpuMemServer {
            paths,
            stopping,
            threads,
        })
    }

    /// Stops listening and removes the sockets.
    pub fn stop(&mut self) {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        for p in &self.paths {
            let _ = UnixStream::connect(p);
            let _ = std::fs::remove_file(p);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for GpuMemServer {
    fn drop(&mut self) {
        self.stop();
    }
}
