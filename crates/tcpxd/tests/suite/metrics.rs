//! The Prometheus endpoint: a transfer between two daemons moves the counters the scrape shows,
//! and GetStats (what `tcpxctl stats` prints) reports the same numbers.

use crate::common::daemons::{self, Client, TestDaemon};
use crate::common::scrape::{http_get, samples, sum};
use tcpxd::api::proto::v1 as pb;

async fn start(node: &str) -> TestDaemon {
    daemons::start(node, |a| a.metrics_listen = Some("127.0.0.1:0".parse().unwrap())).await
}

async fn stats(c: &mut Client) -> pb::Stats {
    c.get_stats(pb::GetStatsRequest {})
        .await
        .expect("stats")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_moves_the_scraped_counters_and_stats_agree() {
    let mut a = start("ma").await;
    let mut b = start("mb").await;
    let a_metrics = a.daemon.metrics_addr.expect("metrics enabled");
    let b_metrics = b.daemon.metrics_addr.expect("metrics enabled");

    // Before any transfer: served, and no transfer counted.
    let (status, body) = http_get(a_metrics, "/metrics").await;
    assert!(status.contains("200"), "{status}");
    assert_eq!(sum(&samples(&body), "tcpxd_transfers_total", &[]), 0.0);
    assert_eq!(samples(&body)["tcpxd_active_transfers"], 0.0);
    let (status, _) = http_get(a_metrics, "/nope").await;
    assert!(status.contains("404"), "{status}");

    const SIZE: u64 = 3 << 20;
    let src = daemons::host_buffer(&mut a.client, SIZE, "src").await;
    let dst = daemons::host_buffer(&mut b.client, SIZE, "dst").await;
    daemons::fill_seed(&mut a.client, src.id, 0, SIZE, 7).await;
    daemons::connect(&mut a, &b).await;
    let id = daemons::write(&mut a.client, daemons::write_entry(&src, 0, &dst, 0, SIZE), b"")
        .await
        .expect("write starts");
    daemons::wait_ok(&mut a.client, id).await;
    assert_eq!(
        daemons::crc(&mut a.client, src.id, 0, SIZE).await,
        daemons::crc(&mut b.client, dst.id, 0, SIZE).await
    );
    daemons::assert_lanes_drain(&mut a.client).await;
    daemons::assert_lanes_drain(&mut b.client).await;

    let page = http_get(a_metrics, "/metrics").await.1;
    let page_b = http_get(b_metrics, "/metrics").await.1;
    // docs/OPERATIONS.md lists every series the endpoints serve.
    let ops =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/OPERATIONS.md")).unwrap();
    let mut families: Vec<&str> = page
        .lines()
        .chain(page_b.lines())
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    families.sort();
    families.dedup();
    assert!(families.len() >= 15, "{families:?}");
    for f in &families {
        assert!(
            ops.contains(&format!("`{f}`")),
            "docs/OPERATIONS.md does not list {f}"
        );
    }
    let sa = samples(&page);
    let sb = samples(&page_b);
    let ok_write = ["op=\"write\"", "status=\"ok\""];
    assert_eq!(sum(&sa, "tcpxd_transfers_total", &ok_write), 1.0);
    assert_eq!(sum(&sa, "tcpxd_transfer_bytes_total", &ok_write), SIZE as f64);
    assert_eq!(
        sum(
            &sa,
            "tcpxd_transfer_duration_seconds_count",
            &["op=\"write\"", "size_class=\"1m_16m\""]
        ),
        1.0
    );
    // Every byte left a's send lanes and entered b's receive lanes.
    assert_eq!(
        sum(
            &sa,
            "tcpxd_lane_bytes_total",
            &["peer=\"mb\"", "direction=\"send\""]
        ),
        SIZE as f64
    );
    assert_eq!(
        sum(
            &sb,
            "tcpxd_lane_bytes_total",
            &["peer=\"ma\"", "direction=\"recv\""]
        ),
        SIZE as f64
    );
    // The receiver unpacked and consumed every chunk; nothing is left in flight.
    let chunks = sum(&sb, "tcpxd_lane_chunks_total", &["direction=\"recv\""]);
    assert!(chunks >= 1.0);
    assert_eq!(sum(&sb, "tcpxd_recv_to_consume_seconds_count", &[]), chunks);
    assert_eq!(sum(&sb, "tcpxd_unpack_seconds_count", &[]), chunks);
    assert_eq!(sum(&sa, "tcpxd_lane_in_flight", &[]), 0.0);
    assert_eq!(sum(&sb, "tcpxd_lane_in_flight", &[]), 0.0);
    assert_eq!(sa["tcpxd_peer_state{peer=\"mb\",state=\"up\"}"], 1.0);
    assert_eq!(sum(&sa, "tcpxd_plugin_errors_total", &[]), 0.0);
    // b started nothing.
    assert_eq!(sum(&sb, "tcpxd_transfers_total", &[]), 0.0);

    // GetStats reports the same numbers.
    let st = stats(&mut a.client).await;
    let t = st
        .transfer_totals
        .iter()
        .find(|t| t.op == "write" && t.status == "ok")
        .expect("write/ok totals");
    assert_eq!((t.transfers, t.bytes), (1, SIZE));
    let lat = st
        .latency
        .iter()
        .find(|l| l.op == "write")
        .expect("write latency");
    assert_eq!(lat.size_class, "1m_16m");
    assert_eq!(lat.histogram.as_ref().unwrap().count, 1);
    let sent: u64 = st.peers.iter().flat_map(|p| &p.lanes).map(|l| l.bytes_sent).sum();
    assert_eq!(sent, SIZE);
    let window_full: u64 = st
        .peers
        .iter()
        .flat_map(|p| &p.lanes)
        .map(|l| l.send_window_full)
        .sum();
    assert_eq!(
        window_full as f64,
        sum(&sa, "tcpxd_lane_window_full_total", &["direction=\"send\""])
    );
    let stb = stats(&mut b.client).await;
    assert_eq!(stb.recv_to_consume.as_ref().unwrap().count as f64, chunks);

    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_with_a_tiny_deadline_is_counted_by_its_status() {
    let mut a = start("ca").await;
    let mut b = start("cb").await;
    let addr = a.daemon.metrics_addr.unwrap();
    let src = daemons::host_buffer(&mut a.client, 1 << 20, "src").await;
    let dst = daemons::host_buffer(&mut b.client, 1 << 20, "dst").await;
    daemons::connect(&mut a, &b).await;
    // A deadline that has passed by the time the poller sees it.
    let id = a
        .client
        .write(pb::WriteRequest {
            entry: Some(daemons::write_entry(&src, 0, &dst, 0, 1 << 20)),
            notification: Vec::new(),
            timeout_ms: 1,
            ready_event_ipc_handle: Vec::new(),
            wait: false,
        })
        .await
        .map(|r| r.into_inner().transfer_id);
    if let Ok(id) = id {
        let ev = daemons::wait(&mut a.client, id).await;
        let s = samples(&http_get(addr, "/metrics").await.1);
        let status = tcpxd::metrics::status_label(tcpxd::engine::Code::from_i32(ev.status_code));
        assert_eq!(
            sum(
                &s,
                "tcpxd_transfers_total",
                &["op=\"write\"", &format!("status=\"{status}\"")]
            ),
            1.0,
            "{ev:?}"
        );
        assert_eq!(sum(&s, "tcpxd_transfers_total", &[]), 1.0);
    }
    a.stop().await;
    b.stop().await;
}
