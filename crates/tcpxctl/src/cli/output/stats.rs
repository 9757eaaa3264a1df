//! `tcpxctl stats`: the daemon's counters per peer and lane, as text and as JSON.

use super::*;

fn lane_json(l: &LaneStats) -> Value {
    json!({
        "lane": l.lane,
        "device": l.device,
        "bytes_sent": l.bytes_sent,
        "bytes_received": l.bytes_received,
        "chunks_sent": l.chunks_sent,
        "chunks_received": l.chunks_received,
        "sends_in_flight": l.sends_in_flight,
        "recvs_in_flight": l.recvs_in_flight,
        "sends_queued": l.sends_queued,
        "recvs_queued": l.recvs_queued,
        "send_window_full": l.send_window_full,
        "recv_window_full": l.recv_window_full,
        "kind": lane_kind(l),
        "send_kind": l.send_kind,
        "recv_kind": l.recv_kind,
        "send_memory": l.send_memory,
        "recv_memory": l.recv_memory,
        "send_credits": l.send_credits,
        "send_credit_limit": l.send_credit_limit,
        "recv_credits": l.recv_credits,
        "recv_credit_limit": l.recv_credit_limit,
        "send_gpu": l.send_gpu,
        "recv_gpu": l.recv_gpu,
        "send_device": l.send_device,
        "recv_device": l.recv_device,
        "send_state": l.send_state,
        "recv_state": l.recv_state,
    })
}

pub fn stats_json(s: &Stats) -> Value {
    json!({
        "node_id": s.node_id,
        "active_transfers": s.active_transfers,
        "buffers": s.buffers,
        "buffer_bytes": s.buffer_bytes,
        "peers": s.peers.iter().map(|p| json!({
            "node_id": p.node_id,
            "state": peer_state_name(p.state),
            "error": p.error,
            "transfers_started": p.transfers_started,
            "transfers_ok": p.transfers_ok,
            "transfers_failed": p.transfers_failed,
            "idle_closes": p.idle_closes,
            "send_lanes": p.send_lanes,
            "recv_lanes": p.recv_lanes,
            "routed": p.routed,
            "bytes_sent": p.bytes_sent,
            "bytes_received": p.bytes_received,
            "sent_eager": p.sent_eager,
            "sent_rendezvous": p.sent_rendezvous,
            "sent_notices": p.sent_notices,
            "received_eager": p.received_eager,
            "received_rendezvous": p.received_rendezvous,
            "received_notices": p.received_notices,
            "lanes": p.lanes.iter().map(lane_json).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "transfer_totals": s.transfer_totals.iter().map(|t| json!({
            "op": t.op, "status": t.status, "transfers": t.transfers, "bytes": t.bytes,
        })).collect::<Vec<_>>(),
        "latency": s.latency.iter().map(|l| json!({
            "op": l.op, "size_class": l.size_class, "histogram": hist_json(l.histogram.as_ref()),
        })).collect::<Vec<_>>(),
        "unpack": s.unpack.iter().map(|u| json!({
            "kind": u.kind, "histogram": hist_json(u.histogram.as_ref()),
        })).collect::<Vec<_>>(),
        "recv_to_consume": hist_json(s.recv_to_consume.as_ref()),
        "plugin_errors": s.plugin_errors.iter().map(|e| json!({"code": e.code, "count": e.count}))
            .collect::<Vec<_>>(),
    })
}

fn hist_json(h: Option<&Histogram>) -> Value {
    let Some(h) = h else { return Value::Null };
    json!({
        "count": h.count,
        "sum_seconds": h.sum_seconds,
        "p50_le_seconds": quantile_bound(h, 0.5),
        "p99_le_seconds": quantile_bound(h, 0.99),
        "buckets": h.upper_bounds.iter().zip(&h.cumulative_counts)
            .map(|(le, n)| json!({"le": le, "count": n})).collect::<Vec<_>>(),
    })
}

/// The upper bound of the bucket holding quantile `q` (`None` when empty or above every bound).
pub fn quantile_bound(h: &Histogram, q: f64) -> Option<f64> {
    if h.count == 0 {
        return None;
    }
    let rank = (q * h.count as f64).ceil().max(1.0) as u64;
    h.upper_bounds
        .iter()
        .zip(&h.cumulative_counts)
        .find(|(_, n)| **n >= rank)
        .map(|(le, _)| *le)
}

fn format_seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// One histogram as "n, mean m, p50 ≤ a, p99 ≤ b".
fn hist_text(h: &Histogram) -> String {
    if h.count == 0 {
        return "none".into();
    }
    let bound = |q| {
        quantile_bound(h, q).map_or("> last bucket".to_string(), |b| {
            format!("≤ {}", format_seconds(b))
        })
    };
    format!(
        "{} × mean {}, p50 {}, p99 {}",
        h.count,
        format_seconds(h.sum_seconds / h.count as f64),
        bound(0.5),
        bound(0.99)
    )
}

/// The event series (what this node's transfers did) as text lines.
fn events_text(s: &Stats) -> String {
    let mut out = String::new();
    if !s.transfer_totals.is_empty() {
        let _ = writeln!(
            out,
            "
transfers started here:"
        );
        for t in &s.transfer_totals {
            let _ = writeln!(
                out,
                "  {:<5} {:<18} {:>8} transfer(s) {:>12}",
                t.op,
                t.status,
                t.transfers,
                format_bytes(t.bytes)
            );
        }
    }
    if !s.latency.is_empty() {
        let _ = writeln!(out, "latency (successful transfers):");
        for l in &s.latency {
            if let Some(h) = &l.histogram {
                let _ = writeln!(out, "  {:<5} {:<9} {}", l.op, l.size_class, hist_text(h));
            }
        }
    }
    for u in &s.unpack {
        if let Some(h) = &u.histogram {
            let _ = writeln!(out, "unpack ({}): {}", u.kind, hist_text(h));
        }
    }
    if let Some(h) = s.recv_to_consume.as_ref().filter(|h| h.count > 0) {
        let _ = writeln!(out, "receive done -> consumed: {}", hist_text(h));
    }
    if !s.plugin_errors.is_empty() {
        let list: Vec<String> = s
            .plugin_errors
            .iter()
            .map(|e| format!("{} {}", e.code, e.count))
            .collect();
        let _ = writeln!(out, "plugin errors: {}", list.join(", "));
    }
    out
}

/// The GPU a lane's comm was opened under on this node ("-": none, a node without GPUs).
fn gpu_text(gpu: i32) -> String {
    if gpu < 0 { "-".to_string() } else { gpu.to_string() }
}

/// A lane state as `stats` shows it ("-": a daemon before peer protocol 6 did not say).
fn or_dash(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}

/// How [`stats_text`] shows rates.
#[derive(Clone, Copy)]
pub enum Rates<'a> {
    /// One snapshot: no rate columns.
    Off,
    /// A `--watch` frame: every frame has the same columns, the rates against the last snapshot
    /// and the time since it ("-" in the first frame and for a failed pairing).
    Watch(Option<(&'a Stats, Duration)>),
}

/// What a lane carries each way: `eager` when the receiving side keeps credits on it (its
/// `transfer.protocol` is `eager`, or `auto` and this is one of its eager lanes, or a routed
/// group's eager lane), else `rendezvous`; one word when both ways agree. A daemon before
/// session 19 says no kind: then the credit limits tell.
pub fn lane_kind(l: &LaneStats) -> String {
    let by_limit = |limit: u32| if limit > 0 { "eager" } else { "rendezvous" };
    let said = |kind: &str| (!kind.is_empty()).then(|| kind.to_string());
    let both = said(&l.send_kind).is_some() || said(&l.recv_kind).is_some();
    let (send, recv) = if both {
        (said(&l.send_kind), said(&l.recv_kind))
    } else {
        (
            Some(by_limit(l.send_credit_limit).to_string()),
            Some(by_limit(l.recv_credit_limit).to_string()),
        )
    };
    match (send, recv) {
        (Some(s), Some(r)) if s == r => s,
        (Some(s), Some(r)) => format!("{s}/{r}"),
        (Some(s), None) => format!("{s}/-"),
        (None, Some(r)) => format!("-/{r}"),
        (None, None) => "-".into(),
    }
}

/// A routed lane's memory pair each way ("gpu1>gpu4"), "-" for a layout lane.
fn lane_memory(l: &LaneStats) -> String {
    match (l.send_memory.as_str(), l.recv_memory.as_str()) {
        ("", "") => "-".into(),
        (s, r) if s == r => s.into(),
        (s, r) => format!("{}/{}", or_dash(s), or_dash(r)),
    }
}

/// How the pairing's transfers went, each way: by eager header, by rendezvous offer, or as a
/// notice (a notification alone: control messages only); `None` while all are 0.
fn protocols_text(p: &PeerStats) -> Option<String> {
    let sent = [p.sent_eager, p.sent_rendezvous, p.sent_notices];
    let received = [p.received_eager, p.received_rendezvous, p.received_notices];
    if sent.iter().chain(&received).all(|&n| n == 0) {
        return None;
    }
    let side = |[eager, rendezvous, notices]: [u64; 3]| {
        format!("{eager} eager, {rendezvous} rendezvous, {notices} notices")
    };
    Some(format!(
        "transfers by protocol: sent {}; received {}",
        side(sent),
        side(received)
    ))
}

/// Stats as text: a node line, then per peer a line and a lane table (with `Rates::Watch`,
/// send/receive rates per lane).
pub fn stats_text(s: &Stats, rates: Rates<'_>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "node {}: {} active transfer(s), {} buffer(s) holding {}",
        s.node_id,
        s.active_transfers,
        s.buffers,
        format_bytes(s.buffer_bytes)
    );
    if s.peers.is_empty() {
        let _ = writeln!(out, "no peers");
    }
    for p in &s.peers {
        let _ = writeln!(
            out,
            "\npeer {} {}: {} started, {} ok, {} failed{}",
            p.node_id,
            peer_state_name(p.state),
            p.transfers_started,
            p.transfers_ok,
            p.transfers_failed,
            match p.idle_closes {
                0 => String::new(),
                n => format!(", closed when idle {n} times"),
            }
        );
        if !p.error.is_empty() {
            let _ = writeln!(out, "  error: {}", p.error);
        }
        // Totals since the pairing (lanes not listed moved nothing), then how many of its
        // lanes are in use: GetStats lists only those (a routed pairing has hundreds, opened on
        // first use).
        let (sent, received) = if p.send_lanes + p.recv_lanes > 0 {
            (p.bytes_sent, p.bytes_received)
        } else {
            (
                p.lanes.iter().map(|l| l.bytes_sent).sum(),
                p.lanes.iter().map(|l| l.bytes_received).sum(),
            )
        };
        let _ = write!(
            out,
            "  sent {}, received {}",
            format_bytes(sent),
            format_bytes(received)
        );
        if p.send_lanes + p.recv_lanes > 0 {
            let _ = write!(
                out,
                "; {} lane(s) in use of {} out, {} in{}",
                p.lanes.len(),
                p.send_lanes,
                p.recv_lanes,
                if p.routed { " (routed by memory pair)" } else { "" }
            );
        }
        let _ = writeln!(out);
        if let Some(line) = protocols_text(p) {
            let _ = writeln!(out, "  {line}");
        }
        // Rates only for a pairing that can carry traffic, against the same node's pairing that
        // could in the last snapshot: GetStats also lists a node's newest failed pairing, whose
        // counters must not be taken for the live one's.
        let failed = |q: &PeerStats| q.state == PeerState::Failed as i32;
        let watch = matches!(rates, Rates::Watch(_));
        let prev_peer = match rates {
            Rates::Watch(Some((prev, dt))) if !failed(p) => prev
                .peers
                .iter()
                .find(|q| q.node_id == p.node_id && !failed(q))
                .map(|q| (q, dt)),
            _ => None,
        };
        let mut header = vec![
            "LANE",
            "NIC S/R",
            "KIND",
            "MEMORY",
            "GPU S/R",
            "STATE S/R",
            "SENT",
            "RECEIVED",
            "CHUNKS S/R",
            "IN FLIGHT S/R",
            "QUEUED S/R",
            "WINDOW FULL S/R",
        ];
        if watch {
            header.extend(["SEND RATE", "RECV RATE"]);
        }
        let mut t = Table::new(header).indent(2);
        // A daemon before session 19 listed every lane of a routed pairing, most never opened:
        // those are counted, not shown (the JSON has them all).
        let lists_all = p.send_lanes + p.recv_lanes == 0;
        let unused = |l: &&LaneStats| {
            lists_all
                && l.send_state == "closed"
                && l.recv_state == "closed"
                && l.chunks_sent == 0
                && l.chunks_received == 0
                && l.send_credit_limit == 0
                && l.recv_credit_limit == 0
        };
        let never_used = p.lanes.iter().filter(unused).count();
        for l in p.lanes.iter().filter(|l| !unused(l)) {
            let mut row = vec![
                l.lane.to_string(),
                format!("{}/{}", l.send_device, l.recv_device),
                lane_kind(l),
                lane_memory(l),
                format!("{}/{}", gpu_text(l.send_gpu), gpu_text(l.recv_gpu)),
                format!("{}/{}", or_dash(&l.send_state), or_dash(&l.recv_state)),
                format_bytes(l.bytes_sent),
                format_bytes(l.bytes_received),
                format!("{}/{}", l.chunks_sent, l.chunks_received),
                format!("{}/{}", l.sends_in_flight, l.recvs_in_flight),
                format!("{}/{}", l.sends_queued, l.recvs_queued),
                format!("{}/{}", l.send_window_full, l.recv_window_full),
            ];
            if let Some((prev, dt)) = prev_peer {
                let before = prev.lanes.iter().find(|q| q.lane == l.lane);
                let sent = l.bytes_sent - before.map_or(0, |q| q.bytes_sent.min(l.bytes_sent));
                let recv = l.bytes_received - before.map_or(0, |q| q.bytes_received.min(l.bytes_received));
                row.push(format_rate(sent, dt));
                row.push(format_rate(recv, dt));
            } else if watch {
                row.extend(["-".to_string(), "-".to_string()]);
            }
            t.row(row);
        }
        if t.is_empty() {
            let _ = writeln!(out, "  no lanes in use");
        } else {
            let _ = write!(out, "{t}");
        }
        if never_used > 0 {
            let _ = writeln!(out, "  {never_used} more lanes never used (closed both ways)");
        }
    }
    out.push_str(&events_text(s));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tcpxd::api::proto::v1::PeerStats;
    #[test]
    fn stats_render() {
        let lane = LaneStats {
            lane: 0,
            device: 1,
            bytes_sent: 2 << 30,
            ..Default::default()
        };
        let s = Stats {
            node_id: "a".into(),
            peers: vec![PeerStats {
                node_id: "b".into(),
                state: PeerState::Up as i32,
                lanes: vec![lane],
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut prev = s.clone();
        prev.peers[0].lanes[0].bytes_sent = 1 << 30;
        let text = stats_text(&s, Rates::Watch(Some((&prev, Duration::from_secs(1)))));
        assert!(text.contains("peer b UP"), "{text}");
        assert!(text.contains("1.07 GB/s"), "{text}");
        assert_eq!(stats_json(&s)["peers"][0]["lanes"][0]["bytes_sent"], 2u64 << 30);
        assert!(text.contains("WINDOW FULL S/R"), "{text}");
        assert!(!text.contains("error:"), "{text}");

        // A node listed with its live pairing and its newest failed one: the live one's rate
        // comes from the live one's last sample, the failed one gets none.
        let mut both = s.clone();
        both.peers.insert(
            0,
            PeerStats {
                node_id: "b".into(),
                state: PeerState::Failed as i32,
                error: "peer restarted".into(),
                lanes: vec![LaneStats {
                    bytes_sent: 5 << 30,
                    ..s.peers[0].lanes[0].clone()
                }],
                ..Default::default()
            },
        );
        let mut before = both.clone();
        before.peers[1].lanes[0].bytes_sent = 1 << 30;
        let text = stats_text(&both, Rates::Watch(Some((&before, Duration::from_secs(1)))));
        let (failed_part, live_part) = text.split_at(text.find("peer b UP").expect("live pairing listed"));
        assert!(
            failed_part.contains("SEND RATE") && !failed_part.contains("B/s"),
            "{text}"
        );
        assert!(
            live_part.contains("SEND RATE") && live_part.contains("1.07 GB/s"),
            "{text}"
        );

        // A failed pairing says why.
        let mut failed = s.clone();
        failed.peers[0].state = PeerState::Failed as i32;
        failed.peers[0].error = "control stream closed by the peer".into();
        let text = stats_text(&failed, Rates::Off);
        assert!(
            text.contains("peer b FAILED") && text.contains("  error: control stream closed by the peer"),
            "{text}"
        );
        assert_eq!(
            stats_json(&failed)["peers"][0]["error"],
            "control stream closed by the peer"
        );
    }

    #[test]
    fn watch_frames_have_the_same_columns_and_lanes_say_their_kind() {
        let lanes = vec![
            LaneStats {
                lane: 0,
                ..Default::default()
            },
            LaneStats {
                lane: 1,
                send_credit_limit: 16,
                recv_credit_limit: 16,
                ..Default::default()
            },
            LaneStats {
                lane: 2,
                recv_credit_limit: 16,
                ..Default::default()
            },
        ];
        let s = Stats {
            node_id: "a".into(),
            peers: vec![PeerStats {
                node_id: "b".into(),
                state: PeerState::Up as i32,
                lanes,
                ..Default::default()
            }],
            ..Default::default()
        };
        let header = |text: &str| {
            text.lines()
                .find(|l| l.trim_start().starts_with("LANE"))
                .map(str::to_string)
        };
        let first = stats_text(&s, Rates::Watch(None));
        let second = stats_text(&s, Rates::Watch(Some((&s, Duration::from_secs(1)))));
        assert_eq!(header(&first), header(&second), "{first}\n{second}");
        assert!(header(&first).is_some_and(|h| h.contains("KIND") && h.ends_with("RECV RATE")));
        let rows: Vec<&str> = first
            .lines()
            .filter(|l| l.trim_start().starts_with(char::is_numeric))
            .collect();
        let tail: Vec<&str> = rows[0].split_whitespace().rev().take(2).collect();
        assert!(rows[0].contains(" rendezvous ") && tail == ["-", "-"], "{first}");
        assert!(rows[1].contains(" eager "), "{first}");
        assert!(rows[2].contains(" rendezvous/eager "), "{first}");
        assert!(second.contains("0.00 B/s"), "{second}");
        assert!(!stats_text(&s, Rates::Off).contains("RATE"));
    }

    #[test]
    fn stats_events_render() {
        use tcpxd::api::proto::v1::{LatencyStats, TransferTotals};
        let h = Histogram {
            count: 4,
            sum_seconds: 0.004,
            upper_bounds: vec![0.0005, 0.001, 0.0025],
            cumulative_counts: vec![1, 3, 4],
        };
        assert_eq!(quantile_bound(&h, 0.5), Some(0.001));
        assert_eq!(quantile_bound(&h, 0.99), Some(0.0025));
        let s = Stats {
            node_id: "a".into(),
            transfer_totals: vec![TransferTotals {
                op: "write".into(),
                status: "ok".into(),
                transfers: 4,
                bytes: 4 << 20,
            }],
            latency: vec![LatencyStats {
                op: "write".into(),
                size_class: "1m_16m".into(),
                histogram: Some(h.clone()),
            }],
            recv_to_consume: Some(h),
            ..Default::default()
        };
        let text = stats_text(&s, Rates::Off);
        assert!(text.contains("write ok"), "{text}");
        assert!(
            text.contains("4 × mean 1.0 ms, p50 ≤ 1.0 ms, p99 ≤ 2.5 ms"),
            "{text}"
        );
        let j = stats_json(&s);
        assert_eq!(j["transfer_totals"][0]["bytes"], 4u64 << 20);
        assert_eq!(j["latency"][0]["histogram"]["p50_le_seconds"], 0.001);
    }

    /// A routed pairing's never-used lanes are counted, not listed; each listed lane shows its
    /// NIC each way.
    #[test]
    fn stats_count_never_used_lanes_and_show_each_directions_nic() {
        let lane = |lane: u32, state: &str, chunks: u64| LaneStats {
            lane,
            send_device: 1,
            recv_device: 3,
            send_state: state.into(),
            recv_state: "closed".into(),
            chunks_sent: chunks,
            ..Default::default()
        };
        let s = Stats {
            node_id: "a".into(),
            peers: vec![PeerStats {
                node_id: "b".into(),
                lanes: vec![lane(0, "closed", 0), lane(7, "open", 4), lane(9, "closed", 0)],
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = stats_text(&s, Rates::Off);
        assert!(text.contains("NIC S/R"), "{text}");
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_start().starts_with(char::is_numeric))
            .collect();
        assert_eq!(rows.len(), 2, "{text}");
        assert!(
            rows[0].trim_start().starts_with('7') && rows[0].contains("1/3"),
            "{text}"
        );
        assert!(rows[1].contains("2 more lanes never used"), "{text}");
        assert_eq!(stats_json(&s)["peers"][0]["lanes"].as_array().unwrap().len(), 3);
    }

    /// Since session 19 GetStats lists only the lanes in use: the peer line says how many of the
    /// pairing's lanes that is and its totals, each lane its kind and memory pair each way.
    #[test]
    fn stats_say_lanes_in_use_of_the_pairings_with_kind_and_memory() {
        let s = Stats {
            node_id: "a".into(),
            peers: vec![PeerStats {
                node_id: "b".into(),
                state: PeerState::Up as i32,
                send_lanes: 528,
                recv_lanes: 528,
                routed: true,
                bytes_sent: 3 << 20,
                bytes_received: 0,
                lanes: vec![
                    LaneStats {
                        lane: 40,
                        bytes_sent: 3 << 20,
                        send_kind: "rendezvous".into(),
                        send_memory: "gpu1>gpu4".into(),
                        send_state: "closed".into(),
                        recv_state: "closed".into(),
                        ..Default::default()
                    },
                    LaneStats {
                        lane: 44,
                        send_kind: "eager".into(),
                        recv_kind: "eager".into(),
                        send_memory: "host>host".into(),
                        recv_memory: "host>host".into(),
                        send_state: "open".into(),
                        recv_state: "opening".into(),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = stats_text(&s, Rates::Off);
        assert!(
            text.contains(
                "sent 3.00 MiB, received 0 B; 2 lane(s) in use of 528 out, 528 in (routed by memory pair)"
            ),
            "{text}"
        );
        assert!(text.contains("MEMORY"), "{text}");
        let rows: Vec<&str> = text.lines().filter(|l| l.trim_start().starts_with("4")).collect();
        assert_eq!(rows.len(), 2, "{text}");
        assert!(
            rows[0].contains("rendezvous/-") && rows[0].contains("gpu1>gpu4/-"),
            "{text}"
        );
        assert!(
            rows[1].contains(" eager ") && rows[1].contains(" host>host "),
            "{text}"
        );
        let j = stats_json(&s);
        assert_eq!(j["peers"][0]["send_lanes"], 528);
        assert_eq!(j["peers"][0]["routed"], true);
        assert_eq!(j["peers"][0]["lanes"][1]["recv_memory"], "host>host");
    }

    /// The pairing's transfers by protocol, notices (notifications alone) among them: a line
    /// under the peer's totals once any moved, and the JSON's fields.
    #[test]
    fn stats_show_transfers_by_protocol_with_notices() {
        let peer = PeerStats {
            node_id: "b".into(),
            state: PeerState::Up as i32,
            ..Default::default()
        };
        let quiet = Stats {
            node_id: "a".into(),
            peers: vec![peer.clone()],
            ..Default::default()
        };
        assert!(!stats_text(&quiet, Rates::Off).contains("by protocol"));
        let s = Stats {
            peers: vec![PeerStats {
                sent_eager: 2,
                sent_rendezvous: 1,
                sent_notices: 3,
                received_notices: 4,
                ..peer
            }],
            ..quiet
        };
        let text = stats_text(&s, Rates::Off);
        assert!(
            text.contains(
                "  transfers by protocol: sent 2 eager, 1 rendezvous, 3 notices; received 0 eager, \
                 0 rendezvous, 4 notices"
            ),
            "{text}"
        );
        let j = &stats_json(&s)["peers"][0];
        assert_eq!(
            [&j["sent_eager"], &j["sent_rendezvous"], &j["sent_notices"]],
            [2, 1, 3]
        );
        assert_eq!(
            [
                &j["received_eager"],
                &j["received_rendezvous"],
                &j["received_notices"]
            ],
            [0, 0, 4]
        );
    }

    /// Each lane's GPU at this end and its state each way (lanes open on first use, close when
    /// idle): the table's columns and the JSON's fields.
    #[test]
    fn stats_show_each_lanes_gpu_and_state() {
        let lane = |lane: u32, gpu: i32, send: &str, recv: &str| LaneStats {
            lane,
            device: lane as i32,
            send_gpu: gpu,
            recv_gpu: gpu,
            send_state: send.into(),
            recv_state: recv.into(),
            ..Default::default()
        };
        let s = Stats {
            node_id: "a".into(),
            peers: vec![PeerStats {
                node_id: "b".into(),
                lanes: vec![lane(0, 2, "open", "closed"), lane(1, -1, "", "")],
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = stats_text(&s, Rates::Off);
        assert!(text.contains("GPU S/R") && text.contains("STATE S/R"), "{text}");
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_start().starts_with(['0', '1']))
            .collect();
        assert!(
            rows[0].contains("2/2") && rows[0].contains("open/closed"),
            "{text}"
        );
        assert!(rows[1].contains("-/-"), "{text}");
        let j = stats_json(&s);
        assert_eq!(j["peers"][0]["lanes"][0]["send_state"], "open");
        assert_eq!(j["peers"][0]["lanes"][0]["recv_gpu"], 2);
    }
}
