//! `tcpxctl demo`: runs [`crate::cli::demo::run_demo`] and prints its report.

use crate::cli::args::{DemoArgs, GlobalOpts};
use crate::cli::demo::{DemoOptions, run_demo};
use crate::cli::error::{CliError, print_json};

pub(super) async fn demo(global: &GlobalOpts, args: DemoArgs) -> Result<(), CliError> {
    let opts = DemoOptions {
        size: args.size,
        chunk_bytes: args.chunk_bytes,
        keep_dir: args.keep_dir,
        daemon: args.daemon,
        dir: None,
        ready_timeout: args.ready_timeout,
        progress: !global.json,
        handle_signals: true,
        ..DemoOptions::default()
    };
    let report = run_demo(&opts).await.map_err(CliError::Demo)?;
    if global.json {
        print_json(&report.to_json())?;
    } else {
        outln!("{report}");
    }
    for exit in report.daemon_exits.iter().filter(|e| !e.clean()) {
        eprintln!("tcpxctl: warning: {} {}", exit.node, exit.describe());
    }
    Ok(())
}
