//! The event series and a snapshot rendered and summarised.

use std::sync::Arc;
use std::time::Duration;

use super::labels::CHUNK_BUCKETS;
use super::*;
use crate::engine::{Code, Outcome, TransferId};
use crate::engine::{LaneCounters, PeerCounters};
use crate::net::NetError;
use crate::peer_stats::PeerStats;
use crate::peer_stats::{PeerLink, StatsSnapshot};

#[test]
fn size_classes() {
    assert_eq!(size_class(0), "lt_64k");
    assert_eq!(size_class(64 << 10), "64k_1m");
    assert_eq!(size_class(4 << 20), "1m_16m");
    assert_eq!(size_class(16 << 20), "16m_256m");
    assert_eq!(size_class(1 << 30), "ge_256m");
}

#[test]
fn events_render_and_summarise_alike() {
    let m = Metrics::new();
    let ok = Outcome {
        code: Code::Ok,
        message: String::new(),
        entries: vec![],
        landed: 1 << 20,
    };
    let mut meter = Meter::new(Arc::new(m));
    meter.started(TransferId(1), Op::Write, 1 << 20);
    meter.finished(TransferId(1), &ok, 1 << 20);
    meter.started(TransferId(2), Op::Read, 100);
    let cancelled = Outcome {
        code: Code::Cancelled,
        ..ok.clone()
    };
    meter.finished(TransferId(2), &cancelled, 0);
    // Unknown ids are ignored.
    meter.finished(TransferId(3), &ok, 5);
    let m = meter.metrics.clone();
    m.recv_consumed("host", Duration::from_micros(3), Duration::from_micros(7));
    m.plugin_error(&NetError::Plugin {
        call: "test",
        code: crate::net::abi::NCCL_SYSTEM_ERROR,
        lines: vec![],
    });
    let snap = StatsSnapshot {
        peers: vec![PeerStats {
            counters: PeerCounters {
                node_id: "b".into(),
                failed: None,
                transfers_started: 2,
                transfers_ok: 1,
                transfers_failed: 1,
                sent_eager: 6,
                sent_rendezvous: 7,
                received_eager: 8,
                received_rendezvous: 9,
                idle_closes: 3,
                send: vec![LaneCounters {
                    bytes: 1 << 20,
                    chunks: 2,
                    posted: 1,
                    queued: 3,
                    window_full: 4,
                    credits: 5,
                    credit_limit: 16,
                    credit_bytes_out: 0,
                    state: "open",
                    ..LaneCounters::default()
                }],
                // A lane in use receiving only: listed with its number.
                recv: vec![LaneCounters {
                    lane: 5,
                    bytes: 4096,
                    chunks: 1,
                    state: "closed",
                    ..LaneCounters::default()
                }],
                ..PeerCounters::default()
            },
            link: PeerLink::Up,
            send_devices: vec![0],
            recv_devices: vec![0],
            send_gpus: vec![None],
            recv_gpus: vec![None],
            direct_control: true,
            direct_messages_sent: 0,
        }],
        // Released pairings of b: their totals add to b's counters, not to its gauges.
        retired: vec![PeerCounters {
            node_id: "b".into(),
            transfers_ok: 3,
            sent_eager: 1,
            send: vec![LaneCounters {
                bytes: 1 << 20,
                window_full: 1,
                ..LaneCounters::default()
            }],
            ..PeerCounters::default()
        }],
        active_transfers: 1,
    };
    let node = NodeGauges {
        buffers: 2,
        buffer_bytes: 4096,
        memory_available: Some(3 << 30),
        memory_reserve: 1 << 30,
    };
    let text = m.render(&snap, &node);
    for line in [
        "tcpxd_transfers_total{op=\"write\",status=\"ok\"} 1",
        "tcpxd_transfers_total{op=\"read\",status=\"cancelled\"} 1",
        "tcpxd_transfer_bytes_total{op=\"write\",status=\"ok\"} 1048576",
        "tcpxd_transfer_duration_seconds_count{op=\"write\",size_class=\"1m_16m\"} 1",
        "tcpxd_unpack_seconds_count{kind=\"host\"} 1",
        "tcpxd_recv_to_consume_seconds_count 1",
        "tcpxd_plugin_errors_total{code=\"ncclSystemError\"} 1",
        "tcpxd_lane_bytes_total{direction=\"send\",lane=\"0\",peer=\"b\"} 2097152",
        "tcpxd_lane_bytes_total{direction=\"recv\",lane=\"5\",peer=\"b\"} 4096",
        "tcpxd_lane_window_full_total{direction=\"send\",lane=\"0\",peer=\"b\"} 5",
        "tcpxd_lane_in_flight{direction=\"send\",lane=\"0\",peer=\"b\"} 1",
        "tcpxd_lane_queued{direction=\"send\",lane=\"0\",peer=\"b\"} 3",
        "tcpxd_lane_credits{direction=\"send\",lane=\"0\",peer=\"b\"} 5",
        "tcpxd_lane_credit_limit{direction=\"send\",lane=\"0\",peer=\"b\"} 16",
        "tcpxd_peer_state{peer=\"b\",state=\"up\"} 1",
        "tcpxd_peer_protocol_total{direction=\"sent\",peer=\"b\",protocol=\"eager\"} 7",
        "tcpxd_peer_protocol_total{direction=\"received\",peer=\"b\",protocol=\"rendezvous\"} 9",
        "tcpxd_peer_state{peer=\"b\",state=\"failed\"} 0",
        "tcpxd_peer_state{peer=\"b\",state=\"idle\"} 0",
        "tcpxd_peer_idle_closes_total{peer=\"b\"} 3",
        "tcpxd_peer_transfers_total{peer=\"b\",result=\"ok\"} 4",
        "tcpxd_active_transfers 1",
        "tcpxd_buffers 2",
        "tcpxd_buffer_bytes 4096",
        "tcpxd_host_memory_available_bytes 3221225472",
        "tcpxd_host_memory_reserve_bytes 1073741824",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    let start: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("tcpxd_start_time_seconds "))
        .expect("the start time is exported")
        .parse()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(start > now - 600.0 && start <= now, "{start} against {now}");
    // Unreadable memory figures leave the series out, not at a made-up 0.
    let text = m.render(&snap, &NodeGauges::default());
    assert!(!text.contains("tcpxd_host_memory_available_bytes"), "{text}");
    let s = m.summary();
    assert_eq!(s.transfers[&("write".into(), "ok".into())], (1, 1 << 20));
    assert_eq!(s.transfers[&("read".into(), "cancelled".into())], (1, 0));
    assert_eq!(s.latency[&("write".into(), "1m_16m".into())].count, 1);
    assert!(!s.latency.contains_key(&("read".into(), "lt_64k".into())));
    assert_eq!(s.unpack["host"].count, 1);
    assert_eq!(s.recv_to_consume.count, 1);
    assert_eq!(s.recv_to_consume.buckets.len(), CHUNK_BUCKETS.len());
    assert_eq!(s.plugin_errors["ncclSystemError"], 1);
    assert_eq!(s.ok_and_failed(), (1, 1), "the stop line's totals");
    assert_eq!(s.transfers.len(), 2, "no zero entries: {:?}", s.transfers);
    assert_eq!(s.plugin_errors.len(), 1, "no zero entries: {:?}", s.plugin_errors);
    assert!(
        text.contains("tcpxd_plugin_errors_total{code=\"ncclRemoteError\"} 0"),
        "every code exported from 0: {text}"
    );
    assert!(
        text.contains("tcpxd_transfers_total{op=\"read\",status=\"deadline_exceeded\"} 0"),
        "every status exported from 0: {text}"
    );
}

#[test]
fn poller_passes_count_busy_and_idle_apart() {
    let m = Metrics::new();
    let passes = m.pass_counters();
    passes.pass(true, Duration::from_micros(30));
    passes.pass(true, Duration::from_micros(20));
    passes.pass(false, Duration::from_micros(2));
    let mut spent = [Duration::ZERO; POLLER_PHASES.len()];
    spent[4] = Duration::from_micros(40);
    spent[6] = Duration::from_micros(10);
    passes.busy_phases(&spent);
    let mut actions = [Duration::ZERO; POLLER_ACTION_SLOTS];
    actions[3] = Duration::from_micros(7);
    actions[POLLER_ACTION_SLOTS - 1] = Duration::from_micros(2);
    passes.busy_actions(&actions);
    let snap = StatsSnapshot {
        peers: Vec::new(),
        retired: Vec::new(),
        active_transfers: 0,
    };
    let text = m.render(&snap, &NodeGauges::default());
    for line in [
        "tcpxd_poller_passes_total{progress=\"yes\"} 2",
        "tcpxd_poller_passes_total{progress=\"no\"} 1",
        "tcpxd_poller_pass_seconds_total{progress=\"yes\"} 0.00005",
        "tcpxd_poller_pass_seconds_total{progress=\"no\"} 0.000002",
        "tcpxd_poller_busy_phase_seconds_total{phase=\"test_lanes\"} 0.00004",
        "tcpxd_poller_busy_phase_seconds_total{phase=\"consume\"} 0.00001",
        "tcpxd_poller_busy_phase_seconds_total{phase=\"intake\"} 0",
        "tcpxd_poller_action_seconds_total{kind=\"land\"} 0.000007",
        "tcpxd_poller_action_seconds_total{kind=\"submit_gathers\"} 0.000002",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

#[test]
fn successful_transfers_count_in_their_series_at_every_size_class() {
    // Session 32: the successful ones' series are looked up once and kept; each size class and
    // op still lands in its own, a failure in its status's.
    let m = Metrics::new();
    let sizes = [1u64, 64 << 10, 1 << 20, 16 << 20, 256 << 20];
    for (i, &size) in sizes.iter().enumerate() {
        for _ in 0..=i {
            m.transfer_finished(Op::Read, Code::Ok, size, size, Duration::from_micros(5));
        }
        m.transfer_finished(Op::Write, Code::Ok, size, size, Duration::from_micros(5));
    }
    m.transfer_finished(Op::Read, Code::Unavailable, 3, 64 << 10, Duration::from_micros(5));
    let s = m.summary();
    let read_bytes: u64 = sizes.iter().enumerate().map(|(i, &b)| b * (i as u64 + 1)).sum();
    assert_eq!(s.transfers[&("read".into(), "ok".into())], (15, read_bytes));
    assert_eq!(
        s.transfers[&("write".into(), "ok".into())],
        (5, sizes.iter().sum::<u64>())
    );
    assert_eq!(s.transfers[&("read".into(), "unavailable".into())], (1, 3));
    for (i, &size) in sizes.iter().enumerate() {
        let class = size_class(size);
        assert_eq!(
            s.latency[&("read".into(), class.into())].count,
            i as u64 + 1,
            "{class}"
        );
        assert_eq!(s.latency[&("write".into(), class.into())].count, 1, "{class}");
    }
}
