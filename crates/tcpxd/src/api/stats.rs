//! The metrics' side of the client API: the event series in `GetStats`, and the page the
//! Prometheus endpoint serves (both read the same counters).

use tonic::Status;

use super::proto::v1 as pb;
use super::state::DaemonState;
use crate::metrics::{Hist, Summary};

fn hist_pb(h: &Hist) -> pb::Histogram {
    pb::Histogram {
        count: h.count,
        sum_seconds: h.sum_seconds,
        upper_bounds: h.buckets.iter().map(|b| b.0).collect(),
        cumulative_counts: h.buckets.iter().map(|b| b.1).collect(),
    }
}

/// The event series as `Stats` fields (the rest left default).
pub fn event_stats(s: &Summary) -> pb::Stats {
    pb::Stats {
        transfer_totals: s
            .transfers
            .iter()
            .map(|((op, status), (n, bytes))| pb::TransferTotals {
                op: op.clone(),
                status: status.clone(),
                transfers: *n,
                bytes: *bytes,
            })
            .collect(),
        latency: s
            .latency
            .iter()
            .map(|((op, class), h)| pb::LatencyStats {
                op: op.clone(),
                size_class: class.clone(),
                histogram: Some(hist_pb(h)),
            })
            .collect(),
        unpack: s
            .unpack
            .iter()
            .map(|(kind, h)| pb::UnpackStats {
                kind: kind.clone(),
                histogram: Some(hist_pb(h)),
            })
            .collect(),
        recv_to_consume: Some(hist_pb(&s.recv_to_consume)),
        plugin_errors: s
            .plugin_errors
            .iter()
            .map(|(code, n)| pb::PluginErrorCount {
                code: code.clone(),
                count: *n,
            })
            .collect(),
        ..Default::default()
    }
}

impl DaemonState {
    /// The Prometheus page: the event series and a fresh stats snapshot from the poller.
    pub async fn render_metrics(&self) -> Result<String, Status> {
        let snap = self.stats_snapshot().await?;
        let buffers = self.buffers.list();
        if let Some(j) = &self.journal {
            self.metrics.set_reattach_pending(j.pending());
        }
        let (memory_available, memory_reserve) = self.buffers.memory_reading();
        Ok(self.metrics.render(
            &snap,
            &crate::metrics::NodeGauges {
                buffers: buffers.len(),
                buffer_bytes: buffers.iter().map(|b| b.size).sum(),
                memory_available,
                memory_reserve,
            },
        ))
    }
}
