//! The metrics' side of the client API: the event series in `GetStats`, and the page the
//! Prometheus endpoint serves (both read the same counters).

use tonic::Status;

use super::proto::v1 as pb;
use super::state::DaemonState;
use crate::engine::LaneCounters;
use crate::engine::topology::Memory;
use crate::metrics::{Hist, Summary};
use crate::peer_stats::PeerStats;

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

/// The lanes in use of a pairing, each direction's by lane number (`Engine::listed_counters`:
/// lane `i` may be in use one way only; the other way then reads as idle).
pub(super) fn lane_stats(p: &PeerStats) -> Vec<pb::LaneStats> {
    let c = &p.counters;
    let mut numbers: Vec<u32> = c.send.iter().chain(&c.recv).map(|l| l.lane).collect();
    numbers.sort_unstable();
    numbers.dedup();
    let find = |lanes: &[LaneCounters], n: u32| {
        lanes
            .binary_search_by_key(&n, |l| l.lane)
            .ok()
            .map(|at| lanes[at].clone())
    };
    numbers
        .into_iter()
        .map(|n| {
            let i = n as usize;
            let (s, r) = (find(&c.send, n), find(&c.recv, n));
            // A direction not listed: idle, closed if the pairing has the lane that way.
            let idle = |has: bool| LaneCounters {
                state: if has { "closed" } else { "" },
                ..LaneCounters::default()
            };
            let kind = |l: &Option<LaneCounters>| match l {
                Some(l) if l.eager => "eager",
                Some(_) => "rendezvous",
                None => "",
            };
            let memory = |l: &Option<LaneCounters>| {
                l.as_ref()
                    .and_then(|l| l.memory)
                    .map_or(String::new(), |(src, dst)| {
                        format!("{}>{}", memory_text(src), memory_text(dst))
                    })
            };
            let (send_kind, recv_kind) = (kind(&s).to_string(), kind(&r).to_string());
            let (send_memory, recv_memory) = (memory(&s), memory(&r));
            let s = s.unwrap_or_else(|| idle(n < c.send_lanes));
            let r = r.unwrap_or_else(|| idle(n < c.recv_lanes));
            pb::LaneStats {
                lane: n,
                device: p
                    .send_devices
                    .get(i)
                    .or(p.recv_devices.get(i))
                    .copied()
                    .unwrap_or(-1),
                bytes_sent: s.bytes,
                bytes_received: r.bytes,
                chunks_sent: s.chunks,
                chunks_received: r.chunks,
                sends_in_flight: s.posted as u32,
                recvs_in_flight: r.posted as u32,
                sends_queued: s.queued as u32,
                recvs_queued: r.queued as u32,
                send_window_full: s.window_full,
                recv_window_full: r.window_full,
                send_credits: s.credits,
                send_credit_limit: s.credit_limit,
                recv_credits: r.credits,
                recv_credit_limit: r.credit_limit,
                send_credit_bytes_out: s.credit_bytes_out,
                send_device: p.send_devices.get(i).copied().unwrap_or(-1),
                recv_device: p.recv_devices.get(i).copied().unwrap_or(-1),
                send_gpu: gpu_pb(p.send_gpus.get(i)),
                recv_gpu: gpu_pb(p.recv_gpus.get(i)),
                send_state: s.state.to_string(),
                recv_state: r.state.to_string(),
                send_kind,
                recv_kind,
                send_memory,
                recv_memory,
            }
        })
        .collect()
}

/// A memory as `LaneStats` names it: "host", "gpu3".
fn memory_text(m: Memory) -> String {
    match m {
        Memory::Host => "host".into(),
        Memory::Gpu(g) => format!("gpu{g}"),
    }
}

/// A lane's GPU for `LaneStats`: -1 for none.
fn gpu_pb(g: Option<&Option<u32>>) -> i32 {
    g.copied().flatten().map_or(-1, |g| g as i32)
}
