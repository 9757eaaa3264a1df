//! The hop trace kept in memory (`TCPXD_HOP_RECORD=PATH`, session 31, tail): every
//! `tcpxd::hop` event appended to a buffer as one short line — the wall clock's nanoseconds, the
//! thread, the event's fields — and written to `PATH` by a thread of its own every
//! [`FLUSH_EVERY`] and at the daemon's end. The `RUST_LOG=tcpxd::hop=trace` log formats each
//! event and `write`s it to stderr on the thread that made it (~1.2 µs an event on the H200, a
//! system call on the poller's path: a tail of its own); here an event costs a lock, a clock
//! read and a few formatted fields, no system call (on the 16-CPU H200 host two daemons'
//! recorded 4 KiB READ took ~20 µs more at p50 for its ~20 events, ~1 µs an event, about the
//! log's; one daemon's, ~4 events, none), so the slowest 1% of small transfers can be split leg
//! by leg without a `write` of the trace's making them. `benches/hops.py` reads both forms.
//!
//! A line: `<unix ns> HOP <thread> hop="api.in" id=7 ...` (the thread's name, `-` when it has
//! none). Nothing is recorded unless the variable is set; the file is created at start and
//! appended to.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::Context;

/// How often the writer thread empties the buffer into the file.
pub const FLUSH_EVERY: Duration = Duration::from_millis(50);

/// Each of the two buffers' room (swapped at each flush), its pages touched once at the start:
/// a tight loop of small transfers makes ~1 M events a second (~100 MB/s), so a flush's worth
/// fits without the buffer growing — a reallocation, or a page's first touch, on the thread
/// that made the event would be a tail of the recorder's own.
const ROOM: usize = 32 << 20;

fn buffer() -> String {
    let mut b = String::with_capacity(ROOM);
    b.extend(std::iter::repeat_n(' ', ROOM));
    b.clear();
    b
}

/// The environment variable naming the file.
pub const ENV: &str = "TCPXD_HOP_RECORD";

struct Shared {
    buf: Mutex<String>,
    file: Mutex<std::fs::File>,
}

impl Shared {
    /// Moves what was recorded into the file (the buffer swapped out under its lock, written
    /// after it).
    fn flush(&self, spare: &mut String) {
        {
            let mut buf = self.buf.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::swap(&mut *buf, spare);
        }
        if !spare.is_empty() {
            let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
            let _ = f.write_all(spare.as_bytes());
            let _ = f.flush();
            spare.clear();
        }
    }
}

static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();

/// What went wrong setting the recorder up, said once the logger is up (`logging::init`).
static PROBLEM: Mutex<Option<String>> = Mutex::new(None);

/// The recorder's setup problem, if any (taken: said once).
pub fn take_problem() -> Option<String> {
    PROBLEM.lock().unwrap_or_else(|e| e.into_inner()).take()
}

fn problem(why: String) {
    *PROBLEM.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
}

/// The recorder's layer, filtered to the hop target; `None` when [`ENV`] is unset or its file
/// cannot be opened ([`take_problem`] says why).
pub fn layer<S>() -> Option<tracing_subscriber::filter::Filtered<HopLayer, Targets, S>>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let path = std::env::var_os(ENV).filter(|p| !p.is_empty())?;
    let file = match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
        Ok(f) => f,
        Err(e) => {
            let shown = path.to_string_lossy();
            problem(format!(
                "{ENV}: cannot open {shown}: {e}; the hop trace is not recorded"
            ));
            return None;
        }
    };
    let shared = Arc::new(Shared {
        buf: Mutex::new(buffer()),
        file: Mutex::new(file),
    });
    if SHARED.set(shared.clone()).is_err() {
        return None;
    }
    let writer = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("tcpxd-hoprec".into())
        .spawn(move || {
            let mut spare = buffer();
            loop {
                std::thread::sleep(FLUSH_EVERY);
                writer.flush(&mut spare);
            }
        });
    if let Err(e) = spawned {
        problem(format!(
            "{ENV}: no writer thread ({e}); recorded only at the daemon's end"
        ));
    }
    let targets = Targets::new().with_target("tcpxd::hop", tracing::Level::TRACE);
    Some(HopLayer { shared }.with_filter(targets))
}

/// Writes what is recorded now (the daemon's end: the writer thread's last turn may not come).
pub fn flush() {
    if let Some(s) = SHARED.get() {
        s.flush(&mut String::new());
    }
}

/// Appends each hop event to the shared buffer.
pub struct HopLayer {
    shared: Arc<Shared>,
}

thread_local! {
    static THREAD: String = std::thread::current().name().unwrap_or("-").replace(' ', "_");
}

/// The event's fields as `name=value`, strings quoted (as the log's fmt layer writes them).
struct Fields<'a>(&'a mut String);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}=\"{}\"", field.name(), value);
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        let _ = write!(self.0, " {}={}", field.name(), value);
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        let _ = write!(self.0, " {}={}", field.name(), value);
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        let _ = write!(self.0, " {}={}", field.name(), value);
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl<S: tracing::Subscriber> Layer<S> for HopLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        // (`Targets` matches by prefix: `tcpxd::hop_record`'s own would pass it)
        if event.metadata().target() != "tcpxd::hop" {
            return;
        }
        let ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut buf = self.shared.buf.lock().unwrap_or_else(|e| e.into_inner());
        THREAD.with(|t| {
            let _ = write!(buf, "{ns} HOP {t}");
        });
        event.record(&mut Fields(&mut buf));
        buf.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt as _;

    #[test]
    fn a_hop_event_is_one_line_with_its_fields_and_other_targets_none() {
        let shared = Arc::new(Shared {
            buf: Mutex::new(String::new()),
            file: Mutex::new(tempfile_in_target()),
        });
        let layer = HopLayer {
            shared: shared.clone(),
        }
        .with_filter(Targets::new().with_target("tcpxd::hop", tracing::Level::TRACE));
        let sub = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(sub, || {
            tracing::trace!(target: "tcpxd::hop", hop = "api.in", id = 7u64, kind = "read");
            tracing::info!("not a hop");
            tracing::trace!(target: "tcpxd::other", hop = "x");
        });
        let got = shared.buf.lock().unwrap().clone();
        let lines: Vec<&str> = got.lines().collect();
        assert_eq!(lines.len(), 1, "{got}");
        let mut parts = lines[0].splitn(4, ' ');
        let ns: u128 = parts.next().unwrap().parse().unwrap();
        assert!(ns > 1_600_000_000_000_000_000, "{ns}");
        assert_eq!(parts.next(), Some("HOP"));
        assert!(parts.next().is_some());
        assert_eq!(parts.next(), Some("hop=\"api.in\" id=7 kind=\"read\""));
        let mut spare = String::new();
        shared.flush(&mut spare);
        assert!(shared.buf.lock().unwrap().is_empty());
    }

    fn tempfile_in_target() -> std::fs::File {
        let p = std::env::temp_dir().join(format!("tcpxd-hoprec-test-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .unwrap();
        let _ = std::fs::remove_file(&p);
        f
    }
}
