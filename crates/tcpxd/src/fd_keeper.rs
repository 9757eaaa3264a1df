//! `tcpxd fd-keeper`: a small process that holds file descriptors for the daemon across its
//! restarts where no systemd keeps them (a GKE DaemonSet's sidecar container, a plain run): the
//! fds of daemon-allocated CUDA memory (src/cuda_kept.rs), so that memory outlives the daemon as
//! long as the keeper lives (docs/OPERATIONS.md, "Restarts").
//!
//! The daemon connects to the keeper's unix socket (SOCK_SEQPACKET, mode 0600) for each request
//! and speaks systemd's words: `FDSTORE=1\nFDNAME=<name>\n` with one descriptor (SCM_RIGHTS)
//! stores it (replacing one of that name), `FDSTOREREMOVE=1\nFDNAME=<name>\n` closes it; each is
//! answered `OK\n` or `ERR <why>\n`. `LISTEN=1\n` is answered with one message
//! `FDNAME=<name>\n` per kept descriptor, carrying a duplicate of it, then `END=1\n`. The keeper
//! closes every descriptor when it exits, which frees the memory.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

/// Descriptors a keeper keeps at most (its default `--max`).
pub const KEEPER_MAX: usize = 4096;
/// The longest message either side sends.
const MAX_MESSAGE: usize = 4096;
/// How long one side waits for the other's next message.
const PATIENCE: Duration = Duration::from_secs(10);

#[derive(clap::Args, Debug)]
pub struct FdKeeperArgs {
    /// The unix socket to serve (created mode 0600; a stale one is replaced), e.g.
    /// /run/tcpxd/state/fd-keeper.sock: the daemon's runtime.fd_keeper.
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Descriptors kept at most; more are refused (raise `ulimit -n` with it). Default: 4096.
    #[arg(long, default_value_t = KEEPER_MAX)]
    pub max: usize,
}

fn seqpacket() -> std::io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

fn send(sock: BorrowedFd<'_>, text: &str, fd: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    rustix::net::sendmsg(
        sock,
        &[IoSlice::new(text.as_bytes())],
        &mut control,
        SendFlags::empty(),
    )?;
    Ok(())
}

/// One message and the descriptors that came with it; `None` when the peer closed.
fn recv(sock: BorrowedFd<'_>) -> std::io::Result<Option<(String, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let fds: Vec<OwnedFd> = control
        .drain()
        .flat_map(|m| match m {
            RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
            _ => Vec::new(),
        })
        .collect();
    if got.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((
        String::from_utf8_lossy(&buf[..got.bytes]).into_owned(),
        fds,
    )))
}

fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

fn connect(path: &Path) -> std::io::Result<OwnedFd> {
    let sock = seqpacket()?;
    rustix::net::connect(&sock, &SocketAddrUnix::new(path)?)?;
    rustix::net::sockopt::set_socket_timeout(&sock, rustix::net::sockopt::Timeout::Recv, Some(PATIENCE))?;
    Ok(sock)
}

/// Sends one store or remove request to the keeper at `path` and waits for its answer.
pub fn request(path: &Path, text: &str, fd: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
    let sock = connect(path)?;
    send(sock.as_fd(), text, fd)?;
    match recv(sock.as_fd())? {
        Some((answer, _)) if answer.starts_with("OK") => Ok(()),
        Some((answer, _)) => Err(std::io::Error::other(format!(
            "the fd keeper refused: {}",
            answer.trim().trim_start_matches("ERR ")
        ))),
        None => Err(std::io::Error::other(
            "the fd keeper closed the connection unanswered",
        )),
    }
}

/// Every descriptor the keeper at `path` holds, by name (duplicates: the keeper keeps its own).
pub fn list(path: &Path) -> std::io::Result<HashMap<String, OwnedFd>> {
    let sock = connect(path)?;
    send(sock.as_fd(), "LISTEN=1\n", None)?;
    let mut out = HashMap::new();
    loop {
        let Some((text, mut fds)) = recv(sock.as_fd())? else {
            return Err(std::io::Error::other(
                "the fd keeper closed the connection mid-list",
            ));
        };
        if field(&text, "END").is_some() {
            return Ok(out);
        }
        if let (Some(name), Some(fd)) = (field(&text, "FDNAME"), fds.pop()) {
            out.insert(name.to_string(), fd);
        }
    }
}

/// Serves `args.socket` until the process is ended.
pub fn serve(args: &FdKeeperArgs) -> std::io::Result<()> {
    if let Some(dir) = args.socket.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(dir)?;
    }
    let _ = std::fs::remove_file(&args.socket);
    let listener = seqpacket()?;
    rustix::net::bind(&listener, &SocketAddrUnix::new(&args.socket)?)?;
    std::fs::set_permissions(&args.socket, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    rustix::net::listen(&listener, 64)?;
    tracing::info!(socket = %args.socket.display(), max = args.max, "fd keeper serving");
    let mut kept: HashMap<String, OwnedFd> = HashMap::new();
    loop {
        let conn = match rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("fd keeper: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let _ = rustix::net::sockopt::set_socket_timeout(
            &conn,
            rustix::net::sockopt::Timeout::Recv,
            Some(PATIENCE),
        );
        if let Err(e) = answer(conn.as_fd(), &mut kept, args.max) {
            tracing::warn!("fd keeper: a request failed: {e}");
        }
    }
}

/// Answers the requests of one connection until it closes.
fn answer(conn: BorrowedFd<'_>, kept: &mut HashMap<String, OwnedFd>, max: usize) -> std::io::Result<()> {
    while let Some((text, mut fds)) = recv(conn)? {
        let name = field(&text, "FDNAME").filter(|n| !n.is_empty() && n.len() <= 255 && !n.contains(':'));
        if field(&text, "LISTEN") == Some("1") {
            for (name, fd) in kept.iter() {
                send(conn, &format!("FDNAME={name}\n"), Some(fd.as_fd()))?;
            }
            send(conn, "END=1\n", None)?;
        } else if field(&text, "FDSTORE") == Some("1") {
            let reply = match (name, fds.pop()) {
                (None, _) => "ERR FDNAME: missing, empty, over 255 bytes or with a ':'\n".to_string(),
                (_, None) => "ERR FDSTORE=1 came without a descriptor\n".to_string(),
                (Some(n), Some(_)) if !kept.contains_key(n) && kept.len() >= max => {
                    format!("ERR the keeper holds {max} descriptors already (--max)\n")
                }
                (Some(n), Some(fd)) => {
                    kept.insert(n.to_string(), fd);
                    tracing::info!(name = n, kept = kept.len(), "fd keeper: stored");
                    "OK\n".to_string()
                }
            };
            send(conn, &reply, None)?;
        } else if field(&text, "FDSTOREREMOVE") == Some("1") {
            if let Some(n) = name
                && kept.remove(n).is_some()
            {
                tracing::info!(name = n, kept = kept.len(), "fd keeper: removed");
            }
            send(conn, "OK\n", None)?;
        } else {
            send(conn, "ERR say FDSTORE=1, FDSTOREREMOVE=1 or LISTEN=1\n", None)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keeper_stores_lists_and_removes_descriptors() {
        let dir = std::env::temp_dir().join(format!("tcpxd-fdkeeper-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let args = FdKeeperArgs {
            socket: dir.join("keeper.sock"),
            max: 1,
        };
        let path = args.socket.clone();
        std::thread::spawn(move || serve(&args));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while list(&path).is_err() {
            assert!(std::time::Instant::now() < deadline, "the keeper serves");
            std::thread::sleep(Duration::from_millis(10));
        }
        let file = std::fs::File::create(dir.join("kept")).unwrap();
        request(&path, "FDSTORE=1\nFDNAME=a\n", Some(file.as_fd())).unwrap();
        let e = request(&path, "FDSTORE=1\nFDNAME=b\n", Some(file.as_fd())).unwrap_err();
        assert!(e.to_string().contains("holds 1 descriptors already"), "{e}");
        let e = request(&path, "FDSTORE=1\nFDNAME=c\n", None).unwrap_err();
        assert!(e.to_string().contains("without a descriptor"), "{e}");
        let got = list(&path).unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), ["a"]);
        assert_eq!(
            rustix::fs::fstat(&got["a"]).unwrap().st_ino,
            rustix::fs::fstat(&file).unwrap().st_ino
        );
        request(&path, "FDSTOREREMOVE=1\nFDNAME=a\n", None).unwrap();
        assert!(list(&path).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
