//! A send lane's pass: post a send, test the head of the comm (the poller: after each post).

use super::tag::Tag;
use crate::net::{MemHandle, NetResult, SendComm};

/// Posts one send of `len` bytes at `at` in `mh` with the lane's next tag; `false` when the
/// plugin has no slot free (nothing changed).
///
/// A posted send does not move yet: the plugin's `isend` only records the request, and each
/// `test` call on the comm activates at most one more posted request and hands the oldest
/// active one's chunks to the data sockets (Google's TCPX plugin: `tcpxIsend_v5` queues it
/// with `tcpxGetRequest`, `tcpxTest` runs `tcpxCommProgress`; the emulation alike since session
/// 33, `emu/src/send.rs`). The poller's send lanes, the lane threads and `tcpxctl bench raw`
/// therefore [`test_sends`] right after each post, so a transfer's first chunk is on its way
/// while the others are posted (session 32, sendtest), and a window of posts is not left
/// waiting for one test per send.
pub fn post_send(comm: &mut SendComm, tag: &mut Tag, mh: &MemHandle, at: usize, len: u32) -> NetResult<bool> {
    let posted = comm.isend(mh, at, len as usize, tag.advance())?.is_some();
    if posted {
        tracing::trace!(target: "tcpxd::hop", hop = "lane.isend", len, comm = comm.trace_id());
    }
    Ok(posted)
}

/// Tests the oldest send while the plugin reports them done, calling `done` for each. Returns
/// how many completed; on a plugin error the send stays in flight.
pub fn test_sends(comm: &mut SendComm, mut done: impl FnMut()) -> NetResult<usize> {
    let mut n = 0;
    while let Some(id) = comm.oldest() {
        if !comm.test(id)? {
            break;
        }
        tracing::trace!(target: "tcpxd::hop", hop = "lane.sent", comm = comm.trace_id());
        done();
        n += 1;
    }
    Ok(n)
}
