//! The poller's side of the event series: when each transfer it tracks started.

use std::sync::Arc;
use std::time::Instant;

use super::Metrics;
use super::labels::Op;
use crate::engine::{Outcome, TransferId};

/// The poller's side: when each transfer it tracks started, and its op and size.
#[derive(Debug)]
pub struct Meter {
    pub metrics: Arc<Metrics>,
    started: crate::engine::idhash::IdMap<TransferId, (Op, u64, Instant)>,
}

impl Meter {
    pub fn new(metrics: Arc<Metrics>) -> Meter {
        Meter {
            metrics,
            started: Default::default(),
        }
    }

    pub fn started(&mut self, id: TransferId, op: Op, total: u64) {
        self.started_at(id, op, total, Instant::now());
    }

    /// [`Meter::started`] at `at` (the caller's clock read, shared with the transfer's status).
    pub fn started_at(&mut self, id: TransferId, op: Op, total: u64, at: Instant) {
        self.started.insert(id, (op, total, at));
    }

    pub fn finished(&mut self, id: TransferId, outcome: &Outcome, bytes_done: u64) {
        self.finished_at(id, outcome, bytes_done, Instant::now());
    }

    /// [`Meter::finished`] at `now` (the caller's clock read).
    pub fn finished_at(&mut self, id: TransferId, outcome: &Outcome, bytes_done: u64, now: Instant) {
        if let Some((op, total, at)) = self.started.remove(&id) {
            self.metrics.transfer_finished(
                op,
                outcome.code,
                bytes_done,
                total,
                now.saturating_duration_since(at),
            );
        }
    }
}
