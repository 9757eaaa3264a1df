//! tracing-subscriber set-up shared by the binaries: `RUST_LOG` filters, `UCCL_TCPX_DEBUG=1` raises
//! tcpxd's own targets (and the plugin's lines) to debug. Colours only on a terminal (never with
//! `NO_COLOR` set), so a log redirected to a file or journald is plain text.

use std::io::IsTerminal as _;

use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// Whether log lines get ANSI colours: stderr is a terminal and `NO_COLOR` is unset or empty.
pub fn colours(stderr_is_terminal: bool, no_color: Option<&str>) -> bool {
    stderr_is_terminal && no_color.is_none_or(str::is_empty)
}

/// Installs a stderr subscriber. `default` is the filter used when `RUST_LOG` is unset.
pub fn init(default: &str) {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    if std::env::var("UCCL_TCPX_DEBUG").is_ok_and(|v| v == "1") {
        for directive in ["tcpxd=debug", "tcpxctl=debug"] {
            if let Ok(d) = directive.parse() {
                filter = filter.add_directive(d);
            }
        }
    }
    let no_color = std::env::var("NO_COLOR").ok();
    let ansi = colours(std::io::stderr().is_terminal(), no_color.as_deref());
    // `TCPXD_HOP_RECORD`: the hop trace kept in memory, beside the log (crate::hop_record).
    let Some(record) = crate::hop_record::layer() else {
        // Without the recorder, one global filter. Per-layer filters lose the event that follows
        // a `tracing::enabled!` check they answer "no" on the same thread (tokio-rs/tracing#2519,
        // open): net::logger asks before each plugin TRACE line, so the lanes' `lane.*` hops after
        // a plugin call went missing from the log.
        let _ = tracing_subscriber::fmt()
            .with_ansi(ansi)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
        if let Some(why) = crate::hop_record::take_problem() {
            tracing::warn!("{why}");
        }
        return;
    };
    // With the recorder the log and the record filter apart (the record wants every hop whatever
    // RUST_LOG says), so the upstream bug above applies: a hop right after a plugin TRACE check on
    // the same thread can be missing from both (docs/OPERATIONS.md, `TCPXD_HOP_RECORD`).
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let _ = tracing_subscriber::registry().with(fmt).with(record).try_init();
    if let Some(why) = crate::hop_record::take_problem() {
        tracing::warn!("{why}");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn colours_only_on_a_terminal_without_no_color() {
        assert!(super::colours(true, None));
        assert!(super::colours(true, Some("")));
        assert!(!super::colours(true, Some("1")));
        assert!(!super::colours(false, None));
    }
}
