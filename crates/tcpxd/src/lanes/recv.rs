//! A receive lane's queues: the receives posted (in ring order) and the completed ones being
//! unpacked (in ring order), with the pass over them — post, test the head, start the unpack,
//! consume from the front once unpacked.

use std::collections::VecDeque;

use super::stage::BatchEnd;
use super::tag::Tag;
use super::unpack::Wait;
use crate::net::{MemHandle, NetResult, RecvComm, RequestId};

/// A posted receive: its request, its length and what its driver keeps with it.
#[derive(Debug, Clone, Copy)]
pub struct Posted<P> {
    pub id: RequestId,
    pub len: u32,
    pub meta: P,
}

/// A completed receive waiting for its unpack before `irecvConsumed`, or (`released`) after it:
/// a receive whose bytes are in its own posted range gives its plugin slot back at once
/// ([`Wait::releases_early`]) and waits here for its copies only.
#[derive(Debug)]
pub struct Landed<L> {
    pub id: RequestId,
    pub wait: Wait,
    pub meta: L,
    /// `irecvConsumed` was called already.
    pub released: bool,
}

/// One receive lane's queues, in ring order (the plugin's order): `posted` until `test` reports
/// a receive done, then `landing` until it is consumed. Only the head of each is ever tested or
/// consumed, as the plugin's rules require.
#[derive(Debug)]
pub struct RecvQueue<P, L> {
    posted: VecDeque<Posted<P>>,
    landing: VecDeque<Landed<L>>,
    tag: Tag,
}

impl<P, L> Default for RecvQueue<P, L> {
    fn default() -> Self {
        RecvQueue {
            posted: VecDeque::new(),
            landing: VecDeque::new(),
            tag: Tag::default(),
        }
    }
}

impl<P: Copy, L> RecvQueue<P, L> {
    /// Posts one receive of `len` bytes at `at` in `mh`; `false` when the plugin has no slot
    /// free (nothing changed).
    pub fn post(
        &mut self,
        comm: &mut RecvComm,
        mh: &MemHandle,
        at: usize,
        len: u32,
        meta: P,
    ) -> NetResult<bool> {
        match comm.irecv(mh, at, len as usize, self.tag.advance())? {
            Some(id) => {
                tracing::trace!(target: "tcpxd::hop", hop = "lane.irecv", len, comm = comm.trace_id());
                self.posted.push_back(Posted { id, len, meta });
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Tests the oldest posted receive while the plugin reports them done; each completed one
    /// is handed to `start` (which starts its unpack) and moves to the landing queue. Returns how
    /// many completed; on a plugin error the receive stays posted.
    pub fn test_heads(
        &mut self,
        comm: &mut RecvComm,
        mut start: impl FnMut(&RecvComm, &Posted<P>) -> (Wait, L),
    ) -> NetResult<usize> {
        let mut n = 0;
        while let Some(&posted) = self.posted.front() {
            if comm.test(posted.id)?.is_none() {
                break;
            }
            tracing::trace!(target: "tcpxd::hop", hop = "lane.recvd", len = posted.len, comm = comm.trace_id());
            let (wait, meta) = start(comm, &posted);
            self.posted.pop_front();
            self.landing.push_back(Landed {
                id: posted.id,
                wait,
                meta,
                released: false,
            });
            n += 1;
        }
        Ok(n)
    }

    /// Consumes completed receives from the front while their unpack is over (`outcome` tells
    /// how a GPU's batch ended, `None` while it runs), handing each to `done` with its outcome.
    /// Then gives the plugin back the slots of the completed receives behind them, in ring
    /// order, whose wait [releases early](Wait::releases_early) (their copies run on): the
    /// plugin's oldest completed request is always the first not yet released. Last, the
    /// released receives whose copies are over are handed to `done` too, wherever they are in
    /// the queue: the plugin has them back already, and only the caller's own bookkeeping (the
    /// engine's window, the landing slot) waits for them, which needs no order — a copy helper
    /// that was slow to start one chunk no longer holds the lane's window while the chunks
    /// behind it are done (issue 38 point 3). Returns how many were consumed; on a plugin error
    /// the front stays.
    pub fn consume_ready(
        &mut self,
        comm: &mut RecvComm,
        mut outcome: impl FnMut(usize, u64) -> Option<BatchEnd>,
        mut done: impl FnMut(Landed<L>, Result<(), String>),
    ) -> NetResult<usize> {
        let mut n = 0;
        while let Some(front) = self.landing.front() {
            let Some(result) = front.wait.outcome(comm, front.id, &mut outcome) else {
                break;
            };
            if !front.released {
                comm.consume(front.id)?;
            }
            let landed = self.landing.pop_front().expect("the front");
            done(landed, result);
            n += 1;
        }
        for l in self.landing.iter_mut().filter(|l| !l.released) {
            if !l.wait.releases_early() {
                break;
            }
            comm.consume(l.id)?;
            l.released = true;
        }
        let mut i = 0;
        while i < self.landing.len() {
            let l = &self.landing[i];
            let ready = if l.released {
                l.wait.outcome(comm, l.id, &mut outcome)
            } else {
                None
            };
            match ready {
                Some(result) => {
                    let landed = self.landing.remove(i).expect("in the queue");
                    done(landed, result);
                    n += 1;
                }
                None => i += 1,
            }
        }
        Ok(n)
    }

    /// The oldest completed receive still waiting for its destination ([`Wait::Header`]).
    pub fn awaiting_header(&mut self) -> Option<&mut Landed<L>> {
        self.landing.iter_mut().find(|l| matches!(l.wait, Wait::Header))
    }

    /// Receives posted and not completed yet.
    pub fn posted(&self) -> usize {
        self.posted.len()
    }

    /// Completed receives not consumed yet.
    pub fn landed(&self) -> usize {
        self.landing.len()
    }

    /// Forgets every receive (the lane's comm is closed).
    pub fn clear(&mut self) {
        self.posted.clear();
        self.landing.clear();
    }
}
