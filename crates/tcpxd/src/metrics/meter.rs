//! The poller's side of the event series: when each transfer it tracks started.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::Metrics;
use super::labels::Op;
use crate::engine::{Outcome, TransferId};

/// The poller's side: when each transfer it tracks started, and its op and size.
#[derive(Debug)]
pub struct Meter {
    pub metrics: Arc<Metrics>,
    started: HashMap<TransferId, (Op, u64, Instant)>,
}

impl Meter {
    pub fn new(metrics: Arc<Metrics>) -> Meter {
        Meter {
            metrics,
            started: HashMap::new(),
        }
    }

    pub fn started(&mut self, id: TransferId, op: Op, total: u64) {
        self.started.insert(id, (op, total, Instant::now()));
    }

    pub fn finished(&mut self, id: TransferId, outcome: &Outcome, bytes_done: u64) {
        if let Some((op, total, at)) = self.started.remove(&id) {
            self.metrics
                .transfer_finished(op, outcome.code, bytes_done, total, at.elapsed());
        }
    }
}
