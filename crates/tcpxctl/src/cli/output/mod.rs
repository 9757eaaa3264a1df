//! How tcpxctl prints things: tables, hexdumps, and the API's messages as text and as JSON.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{Value, json};

use crate::client::{code_number_name, format_bytes, format_duration, format_rate};
use tcpxd::api::proto::v1::{
    Buffer, BufferKind, Histogram, LaneStats, Notification, Peer, PeerState, PeerStats, Stats, TransferEvent,
    TransferState,
};

/// A plain text table: a header row and left-aligned columns separated by two spaces.
#[derive(Debug, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
    indent: usize,
}

impl Table {
    pub fn new<I, S>(header: I) -> Table
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Table {
            rows: vec![header.into_iter().map(Into::into).collect()],
            indent: 0,
        }
    }

    /// Indents every line by `n` spaces.
    pub fn indent(mut self, n: usize) -> Table {
        self.indent = n;
        self
    }

    pub fn row<I, S>(&mut self, cells: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// Whether only the header is there.
    pub fn is_empty(&self) -> bool {
        self.rows.len() <= 1
    }
}

impl std::fmt::Display for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut widths = vec![0usize; columns];
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        for row in &self.rows {
            let mut line = " ".repeat(self.indent);
            for (i, cell) in row.iter().enumerate() {
                if i + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    let pad = widths[i] - cell.chars().count();
                    line.push_str(cell);
                    line.push_str(&" ".repeat(pad + 2));
                }
            }
            writeln!(f, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

/// A hexdump as `xxd` prints it: `00000010: 0001 0203 ...  ................`, with offsets
/// starting at `base` (the range's offset in the buffer).
pub fn hexdump(data: &[u8], base: u64) -> String {
    let mut out = String::with_capacity(data.len() * 4 + 16);
    for (i, line) in data.chunks(16).enumerate() {
        let _ = write!(out, "{:08x}: ", base + (i as u64) * 16);
        let mut hex = String::with_capacity(40);
        for (j, b) in line.iter().enumerate() {
            let _ = write!(hex, "{b:02x}");
            if j % 2 == 1 {
                hex.push(' ');
            }
        }
        // 16 bytes take 32 digits and 8 spaces; pad short lines so the text column lines up.
        let _ = write!(out, "{hex:<40} ");
        out.extend(line.iter().map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        }));
        out.push('\n');
    }
    out
}

/// A notification payload as text when it is printable UTF-8, else `None`.
pub fn printable_text(payload: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(payload).ok()?;
    s.chars()
        .all(|c| !c.is_control() || c == '\n' || c == '\t')
        .then_some(s)
}

pub fn kind_name(kind: i32) -> &'static str {
    match BufferKind::try_from(kind) {
        Ok(BufferKind::Host) => "host",
        Ok(BufferKind::Cuda) => "cuda",
        Ok(BufferKind::CudaIpc) => "cuda-ipc",
        Ok(BufferKind::HostShared) => "host-shared",
        Ok(BufferKind::HostAttached) => "host-attached",
        _ => "unspecified",
    }
}

pub fn peer_state_name(state: i32) -> &'static str {
    match PeerState::try_from(state) {
        Ok(PeerState::Connecting) => "CONNECTING",
        Ok(PeerState::Up) => "UP",
        Ok(PeerState::Failed) => "FAILED",
        // Closed when idle by both daemons; the next transfer pairs again.
        Ok(PeerState::Idle) => "IDLE",
        _ => "UNSPECIFIED",
    }
}

pub fn transfer_state_name(state: i32) -> &'static str {
    match TransferState::try_from(state) {
        Ok(TransferState::Offered) => "OFFERED",
        Ok(TransferState::Running) => "RUNNING",
        Ok(TransferState::Finished) => "FINISHED",
        _ => "UNSPECIFIED",
    }
}

/// `4096 (4.00 KiB)`.
pub fn size_with_units(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} B")
    } else {
        format!("{bytes} ({})", format_bytes(bytes))
    }
}

pub fn buffer_json(b: &Buffer) -> Value {
    let mut v = json!({
        "id": b.id,
        "kind": kind_name(b.kind),
        "size": b.size,
        "label": b.label,
        "descriptor": b.descriptor,
        "active_transfers": b.active_transfers,
    });
    if matches!(
        BufferKind::try_from(b.kind),
        Ok(BufferKind::Cuda | BufferKind::CudaIpc)
    ) {
        v["device"] = json!(b.device);
        v["cuda_ipc_handle"] = json!(hex::encode(&b.cuda_ipc_handle));
    }
    v
}

/// A buffer as `key: value` lines.
pub fn buffer_text(b: &Buffer) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "id:          {}", b.id);
    let _ = writeln!(out, "kind:        {}", kind_name(b.kind));
    let _ = writeln!(out, "size:        {}", size_with_units(b.size));
    if !b.label.is_empty() {
        let _ = writeln!(out, "label:       {}", b.label);
    }
    if matches!(
        BufferKind::try_from(b.kind),
        Ok(BufferKind::Cuda | BufferKind::CudaIpc)
    ) {
        let _ = writeln!(out, "device:      {}", b.device);
        if !b.cuda_ipc_handle.is_empty() {
            let _ = writeln!(out, "ipc handle:  {}", hex::encode(&b.cuda_ipc_handle));
        }
    }
    let _ = writeln!(out, "transfers:   {} active", b.active_transfers);
    let _ = writeln!(out, "descriptor:  {}", b.descriptor);
    out
}

pub fn buffers_table(buffers: &[Buffer]) -> Table {
    let mut t = Table::new(["ID", "KIND", "SIZE", "BYTES", "ACTIVE TRANSFERS", "LABEL"]);
    for b in buffers {
        t.row([
            b.id.to_string(),
            kind_name(b.kind).to_string(),
            format_bytes(b.size),
            b.size.to_string(),
            b.active_transfers.to_string(),
            b.label.clone(),
        ]);
    }
    t
}

pub fn peer_json(p: &Peer) -> Value {
    json!({
        "node_id": p.node_id,
        "address": p.address,
        "state": peer_state_name(p.state),
        "error": p.error,
        "lanes": p.lanes,
    })
}

pub fn peers_table(peers: &[Peer]) -> Table {
    let mut t = Table::new(["NODE", "ADDRESS", "STATE", "LANES", "ERROR"]);
    for p in peers {
        t.row([
            p.node_id.clone(),
            p.address.clone(),
            peer_state_name(p.state).to_string(),
            p.lanes.to_string(),
            p.error.clone(),
        ]);
    }
    t
}

/// The time a finished transfer took: the daemon's `elapsed_us`, else what the client saw.
pub fn transfer_elapsed(ev: &TransferEvent, observed: Duration) -> Duration {
    if ev.elapsed_us > 0 {
        Duration::from_micros(ev.elapsed_us)
    } else {
        observed
    }
}

pub fn event_json(ev: &TransferEvent, elapsed: Duration) -> Value {
    let mut v = json!({
        "transfer_id": ev.transfer_id,
        "state": transfer_state_name(ev.state),
        "bytes_done": ev.bytes_done,
        "total_bytes": ev.total_bytes,
        "elapsed_us": ev.elapsed_us,
    });
    if ev.state == TransferState::Finished as i32 {
        v["status_code"] = json!(ev.status_code);
        v["status"] = json!(code_number_name(ev.status_code));
        v["status_message"] = json!(ev.status_message);
        v["entries"] = ev
            .entries
            .iter()
            .map(|e| {
                json!({
                    "code": e.code,
                    "status": code_number_name(e.code),
                    "message": e.message,
                })
            })
            .collect();
        let secs = elapsed.as_secs_f64();
        if ev.status_code == 0 && secs > 0.0 {
            v["seconds"] = json!(secs);
            v["bytes_per_second"] = json!(ev.total_bytes as f64 / secs);
        }
    }
    v
}

/// One line for a finished transfer: `transfer 7: OK, 1.00 GiB in 0.512 s (2.10 GB/s)`.
pub fn event_summary(ev: &TransferEvent, elapsed: Duration) -> String {
    if ev.status_code == 0 {
        format!(
            "transfer {}: OK, {} in {} ({})",
            ev.transfer_id,
            format_bytes(ev.total_bytes),
            format_duration(elapsed),
            format_rate(ev.total_bytes, elapsed)
        )
    } else {
        // A finished transfer's bytes_done is what landed (not what was sent).
        format!(
            "transfer {}: {} after {}; {} of {} landed",
            ev.transfer_id,
            code_number_name(ev.status_code),
            format_duration(elapsed),
            format_bytes(ev.bytes_done),
            format_bytes(ev.total_bytes),
        )
    }
}

pub fn notification_json(n: &Notification) -> Value {
    let mut v = json!({
        "from_node": n.from_node,
        "transfer_id": n.transfer_id,
        "buffer_ids": n.buffer_ids,
        "payload_hex": hex::encode(&n.payload),
    });
    if let Some(text) = printable_text(&n.payload) {
        v["payload_text"] = json!(text);
    }
    v
}

/// `from demo-a transfer 7 (buffers 3): hello`.
pub fn notification_text(n: &Notification) -> String {
    let buffers: Vec<String> = n.buffer_ids.iter().map(u64::to_string).collect();
    let payload = match printable_text(&n.payload) {
        Some(text) => text.to_string(),
        None => format!("0x{}", hex::encode(&n.payload)),
    };
    format!(
        "from {} transfer {} (buffers {}): {}",
        n.from_node,
        n.transfer_id,
        if buffers.is_empty() {
            "-".to_string()
        } else {
            buffers.join(",")
        },
        payload
    )
}

/// A wall-clock time as `YYYY-MM-DD HH:MM:SS UTC` (what `stats --watch` stamps its frames with).
pub fn utc_text(t: std::time::SystemTime) -> String {
    let secs = t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's days_from_civil, inverted).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

mod stats;
pub use stats::{Rates, lane_kind, quantile_bound, stats_json, stats_text};

#[cfg(test)]
mod tests {
    use super::*;
    use tcpxd::api::proto::v1::EntryStatus;

    #[test]
    fn hexdump_like_xxd() {
        let data: Vec<u8> = (0u8..20).chain(*b"AB c").collect();
        let dump = hexdump(&data, 0x100);
        let lines: Vec<&str> = dump.lines().collect();
        assert_eq!(
            lines[0],
            "00000100: 0001 0203 0405 0607 0809 0a0b 0c0d 0e0f  ................"
        );
        assert_eq!(
            lines[1],
            "00000110: 1011 1213 4142 2063                      ....AB c"
        );
        assert_eq!(lines.len(), 2);
        assert_eq!(hexdump(&[], 0), "");
        assert_eq!(
            hexdump(&[0x41], 0),
            "00000000: 41                                       A\n"
        );
    }

    #[test]
    fn table_aligns() {
        let mut t = Table::new(["A", "LONGER", "C"]);
        t.row(["1234", "x", ""]);
        t.row(["5", "yy", "z"]);
        assert_eq!(t.to_string(), "A     LONGER  C\n1234  x\n5     yy      z\n");
        assert!(!t.is_empty());
        assert!(Table::new(["X"]).is_empty());
    }

    #[test]
    fn payloads() {
        assert_eq!(printable_text(b"hello world\n"), Some("hello world\n"));
        assert_eq!(printable_text(b"\x00\x01"), None);
        assert_eq!(printable_text(&[0xff, 0xfe]), None);
        let n = Notification {
            from_node: "a".into(),
            transfer_id: 7,
            payload: vec![0, 1],
            buffer_ids: vec![3, 4],
        };
        assert_eq!(notification_text(&n), "from a transfer 7 (buffers 3,4): 0x0001");
        assert_eq!(notification_json(&n)["payload_hex"], "0001");
        assert!(notification_json(&n).get("payload_text").is_none());
    }

    #[test]
    fn buffer_listing_says_what_its_transfer_count_is() {
        let b = Buffer {
            id: 3,
            kind: BufferKind::Host as i32,
            size: 4096,
            label: "kv".into(),
            descriptor: "tcpxd1:a:3:4096:00@h:1".into(),
            active_transfers: 0,
            ..Default::default()
        };
        let table = buffers_table(std::slice::from_ref(&b)).to_string();
        assert!(
            table.starts_with("ID  KIND  SIZE      BYTES  ACTIVE TRANSFERS  LABEL\n"),
            "{table}"
        );
        assert!(buffer_text(&b).contains("transfers:   0 active\n"));
    }

    #[test]
    fn events() {
        let ev = TransferEvent {
            transfer_id: 7,
            state: TransferState::Finished as i32,
            bytes_done: 1 << 30,
            total_bytes: 1 << 30,
            status_code: 0,
            status_message: String::new(),
            entries: vec![EntryStatus {
                code: 0,
                message: String::new(),
            }],
            elapsed_us: 500_000,
        };
        let el = transfer_elapsed(&ev, Duration::from_secs(9));
        assert_eq!(el, Duration::from_millis(500));
        assert_eq!(
            event_summary(&ev, el),
            "transfer 7: OK, 1.00 GiB in 0.500 s (2.15 GB/s)"
        );
        let j = event_json(&ev, el);
        assert_eq!(j["status"], "OK");
        assert_eq!(j["state"], "FINISHED");
        let failed = TransferEvent {
            status_code: 4,
            bytes_done: 0,
            ..ev
        };
        assert_eq!(
            event_summary(&failed, el),
            "transfer 7: DEADLINE_EXCEEDED after 0.500 s; 0 B of 1.00 GiB landed"
        );
    }

    #[test]
    fn utc_times() {
        use std::time::{Duration as D, UNIX_EPOCH};
        assert_eq!(utc_text(UNIX_EPOCH), "1970-01-01 00:00:00 UTC");
        assert_eq!(
            utc_text(UNIX_EPOCH + D::from_secs(951_782_400)),
            "2000-02-29 00:00:00 UTC"
        );
        assert_eq!(
            utc_text(UNIX_EPOCH + D::from_secs(1_795_926_601)),
            "2026-11-29 04:30:01 UTC"
        );
    }
}
