//! Draining, the daemon's orderly stop, decided here: from [`Engine::begin_drain`] on no
//! transfer starts; those running get until the drain's deadline, when [`Engine::on_tick`] fails
//! what is left; [`Engine::is_drained`] says when the driver may stop, and what the drain did;
//! [`Engine::close_by`] until when the driver waits for its comms to close (a plugin's close
//! may block for ever: Google's joins helper threads that never look up while a request they
//! carry has bytes left, and a peer stopping at the same moment never sends them).

use std::time::{Duration, Instant};

use crate::{Code, Engine, EngineError, EngineResult};

/// What a drain did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// Transfers that finished well after the drain began.
    pub finished_in_grace: usize,
    /// Transfers failed when the grace period ended.
    pub failed_at_deadline: usize,
}

/// The least time the driver gets to close its comms once drained: the drain's deadline, or
/// this long after the moment it was drained when the transfers took the whole grace period.
pub const CLOSE_AT_LEAST: Duration = Duration::from_secs(1);

/// A drain under way.
#[derive(Debug)]
pub(crate) struct Drain {
    deadline: Instant,
    report: DrainReport,
}

impl Engine {
    /// Command: stop taking transfers; those running may finish until `deadline`.
    pub fn begin_drain(&mut self, deadline: Instant) {
        let report = self.drain.as_ref().map_or(
            DrainReport {
                finished_in_grace: 0,
                failed_at_deadline: 0,
            },
            |d| d.report,
        );
        self.drain = Some(Drain { deadline, report });
    }

    /// Whether a drain began.
    pub fn is_draining(&self) -> bool {
        self.drain.is_some()
    }

    /// Query: once draining, whether the driver may stop — no transfer left, and nothing in
    /// flight or the grace period over — and what the drain did. `None` before.
    pub fn is_drained(&self, now: Instant) -> Option<DrainReport> {
        let d = self.drain.as_ref()?;
        (self.transfers.is_empty() && (self.is_idle() || now > d.deadline)).then_some(d.report)
    }

    /// Refuses a new transfer while draining.
    pub(crate) fn refuse_while_draining(&self) -> EngineResult<()> {
        match self.drain {
            Some(_) => Err(EngineError::new(
                Code::Unavailable,
                "the daemon is shutting down; no new transfers",
            )),
            None => Ok(()),
        }
    }

    /// A transfer finished well: counted if a drain is under way.
    pub(crate) fn note_finished_ok(&mut self) {
        if let Some(d) = &mut self.drain {
            d.report.finished_in_grace += 1;
        }
    }

    /// Time: once the grace period is over, fails every transfer left.
    pub(crate) fn tick_drain(&mut self, now: Instant) {
        let Some(d) = &self.drain else { return };
        if now <= d.deadline || self.transfers.is_empty() {
            return;
        }
        let ids = self.active_transfer_ids();
        for id in &ids {
            self.fail_transfer(
                *id,
                Code::Unavailable,
                "the daemon is shutting down (grace period over)",
                None,
            );
        }
        if let Some(d) = &mut self.drain {
            d.report.failed_at_deadline += ids.len();
        }
    }

    /// Query: until when the driver waits for its comms to close, once drained at `now` (or
    /// stopping without a drain): the drain's deadline, never less than [`CLOSE_AT_LEAST`]
    /// after `now`. Comms not closed by then are left to the process's exit.
    pub fn close_by(&self, now: Instant) -> Instant {
        let floor = now + CLOSE_AT_LEAST;
        self.drain.as_ref().map_or(floor, |d| d.deadline.max(floor))
    }

    /// The drain's deadline, while one is under way and transfers remain.
    pub(crate) fn drain_deadline(&self) -> Option<Instant> {
        self.drain
            .as_ref()
            .filter(|_| !self.transfers.is_empty())
            .map(|d| d.deadline)
    }
}
