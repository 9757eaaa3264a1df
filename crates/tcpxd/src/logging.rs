//! tracing-subscriber set-up shared by the binaries: `RUST_LOG` filters, `UCCL_TCPX_DEBUG=1` raises
//! tcpxd's own targets (and the plugin's lines) to debug.

use tracing_subscriber::EnvFilter;

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
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
