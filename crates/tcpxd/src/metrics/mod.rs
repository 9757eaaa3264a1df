//! Prometheus metrics: one registry per daemon (tests run several in one process).
//!
//! Two kinds of series:
//! - events the poller records as they happen ([`Metrics`] and the poller-side [`Meter`]):
//!   transfers and bytes by op and status, latency per size class, unpack time, time from a
//!   receive's completion to its consumption, plugin errors by code;
//! - state read from the poller's stats snapshot at each scrape ([`Metrics::render`]): per-lane
//!   bytes, chunks, requests in flight, queued chunks and window-full events, and peer states.
//!
//! The `GetStats` RPC reads the same objects ([`Metrics::summary`]), so `tcpxctl stats` and a
//! scrape agree. docs/OPERATIONS.md lists every series.
//!
//! Files: `labels.rs` (label values, buckets), `events.rs` (the event series, their rendering
//! and summary), `meter.rs` (the poller's side), `snapshot.rs` (the snapshot's series),
//! `endpoint.rs` (`GET /metrics`).

mod endpoint;
mod events;
mod labels;
mod meter;
mod snapshot;
#[cfg(test)]
mod tests;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

pub use endpoint::{bind, serve};
pub use events::{
    Hist, Metrics, POLLER_ACTION_KINDS, POLLER_ACTION_SLOTS, POLLER_PHASES, PassCounters, Summary,
};
pub use labels::{Op, size_class, status_label};
pub use meter::Meter;
pub use snapshot::{NodeGauges, link_name};

/// A counter family registered in `r`.
fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("registered once");
    c
}

/// A histogram family with `buckets` registered in `r`.
fn histogram_vec(r: &Registry, name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels)
        .expect("valid metric");
    r.register(Box::new(h.clone())).expect("registered once");
    h
}
