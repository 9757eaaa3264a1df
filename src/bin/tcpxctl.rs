//! tcpxctl: the command-line companion of tcpxd.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tcpxd::conformance;
use tcpxd::net::Plugin;

#[derive(Parser)]
#[command(name = "tcpxctl", version, about = "Command-line companion of tcpxd")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check that a net plugin behaves as GPUDirect-TCPX does (run it on an A3 node before tcpxd).
    Conformance(ConformanceArgs),
}

#[derive(Args)]
struct ConformanceArgs {
    /// The plugin to test, e.g. /usr/local/tcpx/lib64/libnccl-net.so.
    #[arg(
        long,
        value_name = "PATH",
        required_unless_present = "builtin_emulation",
        conflicts_with = "builtin_emulation"
    )]
    plugin: Option<PathBuf>,
    /// Test the emulation plugin linked into tcpxctl instead of a file.
    #[arg(long)]
    builtin_emulation: bool,
    /// Devices to test (repeatable); all of the plugin's by default.
    #[arg(long = "device", value_name = "N")]
    devices: Vec<i32>,
    /// Only cases whose name contains this text.
    #[arg(long)]
    filter: Option<String>,
    /// Seconds allowed for one connect/accept (the real plugin waits up to 5 s after accept).
    #[arg(long, default_value_t = 30)]
    connect_timeout_secs: u64,
    /// Seconds after which a case counts as hung.
    #[arg(long, default_value_t = 120)]
    case_timeout_secs: u64,
    /// Requests streamed through one comm pair in the ring wrap-around case.
    #[arg(long, default_value_t = 3000)]
    wraparound_requests: usize,
    /// Print JSON lines (one per case) instead of the table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    tcpxd::logging::init("warn");
    let cli = Cli::parse();
    match cli.command {
        Command::Conformance(args) => run_conformance(args),
    }
}

fn run_conformance(args: ConformanceArgs) -> ExitCode {
    let plugin = match (&args.plugin, args.builtin_emulation) {
        (Some(path), _) => Plugin::load(path),
        (None, _) => Plugin::builtin_emulation(),
    };
    let plugin = match plugin {
        Ok(p) => p,
        Err(e) => {
            eprintln!("tcpxctl: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = conformance::Options {
        devices: (!args.devices.is_empty()).then_some(args.devices),
        connect_timeout: Duration::from_secs(args.connect_timeout_secs),
        case_timeout: Duration::from_secs(args.case_timeout_secs),
        wraparound_requests: args.wraparound_requests,
        filter: args.filter,
    };
    let report = conformance::run(&plugin, &opts);
    if args.json {
        print!("{}", conformance::report_json_lines(&report));
    } else {
        println!("{report}");
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
