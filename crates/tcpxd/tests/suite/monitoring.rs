//! deploy/grafana's dashboard and deploy/prometheus's alert rules use the series the daemon
//! really exports (issue #40 point 6): every metric name in every expression is on the /metrics
//! page of two live daemons that moved data both ways, saw a plugin error and failed a transfer;
//! the dashboard is well-formed Grafana JSON (unique panel ids, a 24-column grid without
//! overlaps, every query on the datasource variable); and where `promtool` is installed (CI's
//! `.ci/run` installs Debian's `prometheus` for it), `promtool check rules` and `promtool test
//! rules` pass.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::common::daemons::*;
use crate::common::procs;
use crate::common::scrape::http_get;
use tonic::Code;

const MIB: u64 = 1 << 20;

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
}

fn dashboard() -> Value {
    let path = repo("deploy/grafana/tcpxd-dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("the dashboard is JSON")
}

/// Every PromQL expression of the alert rules: (alert name, expression).
fn rule_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo("deploy/prometheus/tcpxd-alerts.yaml")).unwrap();
    let v = Value::deserialize(serde_yaml_ng::Deserializer::from_str(&text)).expect("the rules are YAML");
    let mut out = Vec::new();
    for g in v["groups"].as_array().expect("groups") {
        for r in g["rules"].as_array().expect("rules") {
            let name = r["alert"].as_str().or(r["record"].as_str()).expect("named rule");
            out.push((name.to_string(), r["expr"].as_str().expect("expr").to_string()));
        }
    }
    out
}

/// Every PromQL expression of the dashboard: (panel title, expression), annotations and template
/// variables' queries included.
fn dashboard_exprs(d: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                p["title"].as_str().unwrap().to_string(),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    for a in d["annotations"]["list"].as_array().into_iter().flatten() {
        out.push(("annotation".into(), a["expr"].as_str().unwrap().to_string()));
    }
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(q) = v["definition"].as_str() {
            // label_values(METRIC{...}, label): the metric is what must exist.
            let inner = q.strip_prefix("label_values(").expect("label_values query");
            out.push(("variable".into(), inner.split(',').next().unwrap().to_string()));
        }
    }
    out
}

/// The metric names an expression reads: identifiers that are neither functions (followed by
/// `(`), keywords, label names (inside `{}` or a `by (...)` list), durations (inside `[]`), string
/// contents nor Grafana variables.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &[
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "inf",
        "nan",
        // Aggregation operators, which may be followed by `by (...)` rather than `(`.
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    const GROUPING: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let (mut i, mut depth_brace, mut depth_bracket) = (0, 0, 0);
    let mut skip_group = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
                continue;
            }
            '{' => depth_brace += 1,
            '}' => depth_brace -= 1,
            '[' => depth_bracket += 1,
            ']' => depth_bracket -= 1,
            ')' if skip_group => skip_group = false,
            '$' => {
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                continue;
            }
            _ if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let call = j < chars.len() && chars[j] == '(';
                if GROUPING.contains(&word.as_str()) && call {
                    skip_group = true;
                } else if !(call
                    || skip_group
                    || depth_brace > 0
                    || depth_bracket > 0
                    || KEYWORDS.contains(&word.to_lowercase().as_str()))
                {
                    names.insert(word);
                }
                continue;
            }
            _ if c.is_ascii_digit() => {
                // A number or a duration (5m, 1e9): its letters are not a name.
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    names
}

#[test]
fn metric_names_are_read_out_of_promql() {
    let got = metric_names(
        r#"sum by (instance, peer) (rate(tcpxd_lane_bytes_total{peer=~"$peer", direction="send"}[$__rate_interval]))
           / on (instance) group_left sum(tcpxd_x) > 1e9 and up{job="x"} offset 5m"#,
    );
    let want: BTreeSet<String> = ["tcpxd_lane_bytes_total", "tcpxd_x", "up"]
        .map(String::from)
        .into();
    assert_eq!(got, want);
    assert_eq!(
        metric_names("histogram_quantile(0.99, sum by (le) (rate(a_bucket[5m])))"),
        ["a_bucket".to_string()].into()
    );
}

/// The metric names a /metrics page serves (a histogram's `_bucket`, `_sum` and `_count`).
fn served_names(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

fn metrics_addr(p: &procs::ProcDaemon) -> std::net::SocketAddr {
    let ready: Value =
        serde_json::from_str(&std::fs::read_to_string(p.dir().join("ready.json")).unwrap()).unwrap();
    ready["metrics"]
        .as_str()
        .expect("metrics listen in the ready file")
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_alerts_read_series_the_daemon_exports() {
    tcpxd::logging::init("error");
    let config = "[metrics]\nlisten = \"127.0.0.1:0\"\n";
    // x's sends shut their sockets after 16 MiB per comm: its third transfer fails in the plugin.
    let x = procs::spawn("mon-x", 0, config, &[("TCPXEMU_FAIL_AFTER_BYTES", "16777216")]).await;
    let y = procs::spawn("mon-y", 0, config, &[]).await;
    let (mut xc, mut yc) = (x.client().await, y.client().await);
    let src = host_buffer(&mut xc, 64 * MIB, "src").await;
    let back = host_buffer(&mut xc, MIB, "back").await;
    let dst = host_buffer(&mut yc, 64 * MIB, "dst").await;
    fill_seed(&mut xc, src.id, 0, 0, 3).await;
    fill_seed(&mut yc, dst.id, 0, 0, 4).await;
    // Both ways (receives on x too: unpack and consume times), small and large.
    let id = write(&mut xc, write_entry(&src, 0, &dst, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut xc, id).await;
    let id = write(&mut yc, write_entry(&dst, 0, &back, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut yc, id).await;
    let id = write(&mut xc, write_entry(&src, 0, &dst, 0, 4 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut xc, id).await;
    // Then past the cut: the plugin fails x's send, the transfer fails, the peer fails.
    let id = write(&mut xc, write_entry(&src, 0, &dst, 0, 64 * MIB), b"")
        .await
        .unwrap();
    let e = wait(&mut xc, id).await;
    assert_eq!(e.status_code, Code::Unavailable as i32, "{}", e.status_message);

    let mut served = BTreeSet::new();
    for p in [&x, &y] {
        let (status, page) = http_get(metrics_addr(p), "/metrics").await;
        assert!(status.contains("200"), "{status}");
        served.extend(served_names(&page));
    }
    // The event-driven series this run was meant to produce are there (the plugin error is
    // counted by whichever side's plugin noticed the cut first, or by neither when the other
    // side's goodbye came first: the family is exported from 0 anyway).
    for name in [
        "tcpxd_plugin_errors_total",
        "tcpxd_transfers_total",
        "tcpxd_unpack_seconds_bucket",
        "tcpxd_lane_credits",
        "tcpxd_start_time_seconds",
        "tcpxd_host_memory_available_bytes",
    ] {
        assert!(served.contains(name), "{name} not served: {served:?}");
    }
    let d = dashboard();
    let mut missing = Vec::new();
    for (place, expr) in dashboard_exprs(&d).into_iter().chain(rule_exprs()) {
        let names = metric_names(&expr);
        assert!(!names.is_empty(), "{place}: no metric in {expr}");
        for n in names {
            // `up` is Prometheus's own, per scrape target.
            if n != "up" && !served.contains(&n) {
                missing.push(format!("{place}: {n}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "series the daemon does not export: {missing:#?}"
    );
}

#[test]
fn the_dashboard_is_well_formed() {
    let d = dashboard();
    assert_eq!(d["uid"], "tcpxd-overview");
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vars, ["datasource", "instance", "peer"]);
    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap();
        assert!(ids.insert(p["id"].as_u64().unwrap()), "{title}: duplicate id");
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap(),
            g["y"].as_u64().unwrap(),
            g["w"].as_u64().unwrap(),
            g["h"].as_u64().unwrap(),
        );
        assert!(x + w <= 24 && w > 0 && h > 0, "{title}: off the 24-column grid");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(
                    cells.insert((cx, cy)),
                    "{title}: overlaps another panel at {cx},{cy}"
                );
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert!(
            !p["description"].as_str().unwrap_or("").is_empty(),
            "{title}: no description"
        );
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            assert!(t["expr"].as_str().is_some_and(|e| !e.is_empty()), "{title}");
        }
    }
    // What issue #40 asked the dashboard to show.
    let text = d.to_string();
    for series in [
        "tcpxd_lane_bytes_total",
        "tcpxd_transfer_duration_seconds_bucket",
        "tcpxd_transfers_total",
        "tcpxd_plugin_errors_total",
        "tcpxd_lane_credits",
        "tcpxd_lane_window_full_total",
        "tcpxd_plugin_log_lines_total",
        "tcpxd_start_time_seconds",
        "tcpxd_buffers",
        "tcpxd_host_memory_available_bytes",
    ] {
        assert!(text.contains(series), "the dashboard shows no {series}");
    }
}

/// `promtool check rules` and the rules' unit tests, where promtool exists (CI installs it).
#[test]
fn promtool_checks_the_rules_and_their_tests() {
    let dir = repo("deploy/prometheus");
    let run = |args: &[&str]| {
        std::process::Command::new("promtool")
            .args(args)
            .current_dir(&dir)
            .output()
    };
    let Ok(version) = run(&["--version"]) else {
        eprintln!("promtool not installed: skipping (`apt-get install prometheus` has it; CI installs it)");
        return;
    };
    assert!(version.status.success());
    for args in [
        &["check", "rules", "tcpxd-alerts.yaml"][..],
        &["test", "rules", "tcpxd-alerts.test.yaml"][..],
    ] {
        let out = run(args).unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
