//! The file descriptors a service manager passed to this process at its start (`LISTEN_FDS`,
//! `LISTEN_FDNAMES`, `LISTEN_PID`: `sd_listen_fds(3)`): systemd's descriptor store handing back
//! what the previous instance stored (src/fd_store.rs).

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Mutex;

/// The first descriptor `LISTEN_FDS` counts (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: i32 = 3;

static INHERITED: Mutex<Option<HashMap<String, OwnedFd>>> = Mutex::new(None);

/// Takes the descriptors the manager passed to this process (`LISTEN_FDS` for this pid), by name,
/// once (later calls find none). Made close-on-exec. Unnamed ones are `unknown`, as
/// `sd_listen_fds_with_names(3)` names them.
pub fn take() -> HashMap<String, OwnedFd> {
    static TAKEN: std::sync::Once = std::sync::Once::new();
    TAKEN.call_once(|| {
        let mine = std::env::var("LISTEN_PID")
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
            == Some(std::process::id());
        let count = std::env::var("LISTEN_FDS")
            .ok()
            .and_then(|n| n.trim().parse::<i32>().ok())
            .filter(|_| mine)
            .unwrap_or(0)
            .clamp(0, 1 << 16);
        let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
        let mut names = names.split(':');
        let mut fds = HashMap::new();
        for raw in LISTEN_FDS_START..LISTEN_FDS_START + count {
            let name = names.next().filter(|n| !n.is_empty()).unwrap_or("unknown");
            // SAFETY: the manager passed descriptors 3..3+LISTEN_FDS to this very process
            // (LISTEN_PID); nothing else in it owns them, and this runs once.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            if rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC).is_err() {
                // Not open after all (a manager that lied): not ours to close.
                std::mem::forget(fd);
                continue;
            }
            fds.insert(name.to_string(), fd);
        }
        *INHERITED.lock().unwrap_or_else(|e| e.into_inner()) = Some(fds);
    });
    INHERITED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .unwrap_or_default()
}
