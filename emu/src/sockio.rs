//! Socket calls. Writes use `send(MSG_NOSIGNAL)`: the library lives inside C programs, where a
//! write to a closed socket must never raise SIGPIPE.

use std::io;
use std::os::fd::RawFd;

/// Write all `len` bytes at `buf`.
pub(crate) fn send_all(fd: RawFd, mut buf: *const u8, mut len: usize) -> io::Result<()> {
    while len > 0 {
        // SAFETY: the caller guarantees `buf..buf+len` is readable for the duration of the call.
        let n = unsafe { libc::send(fd, buf.cast(), len, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        let n = n as usize;
        // SAFETY: n ≤ len, so the pointer stays within (or one past) the caller's range.
        buf = unsafe { buf.add(n) };
        len -= n;
    }
    Ok(())
}

/// Read exactly `len` bytes into `buf`; EOF before that is `UnexpectedEof`.
pub(crate) fn recv_exact(fd: RawFd, mut buf: *mut u8, mut len: usize) -> io::Result<()> {
    while len > 0 {
        // SAFETY: the caller guarantees `buf..buf+len` is writable for the duration of the call.
        // MSG_WAITALL: one call for the whole range unless a signal or an error interrupts it.
        let n = unsafe { libc::recv(fd, buf.cast(), len, libc::MSG_WAITALL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        let n = n as usize;
        // SAFETY: n ≤ len.
        buf = unsafe { buf.add(n) };
        len -= n;
    }
    Ok(())
}

/// Fill every iovec completely: one `recvmsg(MSG_WAITALL)` per batch (the kernel copies as
/// bytes arrive and returns once all are in), more after a partial return (signal, error). The
/// iovecs are consumed (advanced) on the way.
pub(crate) fn readv_all(fd: RawFd, iov: &mut [libc::iovec]) -> io::Result<()> {
    let mut first = 0;
    while first < iov.len() {
        if iov[first].iov_len == 0 {
            first += 1;
            continue;
        }
        let rest = &mut iov[first..];
        // SAFETY: an all-zero msghdr is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = rest.as_mut_ptr();
        msg.msg_iovlen = rest.len() as _;
        // SAFETY: every iovec in `rest` describes writable memory the caller owns (bounce pages
        // or the destination), and `rest.len()` ≤ IOV_MAX (callers pass at most 256).
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_WAITALL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        let mut n = n as usize;
        while n > 0 {
            let v = &mut iov[first];
            let take = n.min(v.iov_len);
            // SAFETY: take ≤ iov_len, so the base stays within the iovec's buffer.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(take) }.cast();
            v.iov_len -= take;
            n -= take;
            if v.iov_len == 0 {
                first += 1;
            }
        }
    }
    Ok(())
}

/// Wait until `fd` is readable (or hung up); `Ok(false)` on timeout.
pub(crate) fn wait_readable(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, count 1.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(r > 0)
}

/// Did the peer go away (as opposed to a local or other failure)?
pub(crate) fn is_peer_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::WriteZero
    )
}
