//! tcpxctl: the command-line companion of tcpxd.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use tcpxctl::cli::args::{ClientCommand, GlobalOpts};
use tcpxctl::conformance;
use tcpxd::net::Plugin;

#[derive(Parser)]
#[command(name = "tcpxctl", version, about = "Command-line companion of tcpxd")]
struct Cli {
    #[command(flatten)]
    global: GlobalOpts,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check that a net plugin behaves as GPUDirect-TCPX does (run it on an A3 node before tcpxd).
    Conformance(ConformanceArgs),
    #[command(flatten)]
    Client(ClientCommand),
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
    /// Use buffers in the memory of this CUDA device (NCCL_PTR_CUDA registrations; received
    /// bytes gathered from the plugin's GPU bounce buffer by the daemon's unpacker,
    /// UCCL_TCPX_UNPACK_IMPL: the kernel by default) instead of host memory.
    #[arg(long, value_name = "DEVICE")]
    cuda: Option<usize>,
    /// Which NICs serve each GPU, as the daemon's `topology.map` (pci, a3vm or GPU=NIC;…): with
    /// --cuda, the per-device cases run only on the devices that serve that GPU (a device named
    /// with --device that does not fails `gpu_binding`: on A3 its comms would end the process).
    #[arg(long, value_name = "MAP", env = "TCPXD_TOPOLOGY", default_value = "pci")]
    topology: String,
    /// Print JSON lines (one per case) instead of the table.
    #[arg(long)]
    json: bool,
}

/// The subcommands that talk to no running daemon: `--endpoint` (global) is hidden from their help.
const NO_ENDPOINT: &[&[&str]] = &[&["demo"], &["conformance"], &["bench", "raw"]];

/// tcpxctl's command line, `--endpoint` hidden where it means nothing (still accepted there).
fn command() -> clap::Command {
    let mut cmd = Cli::command();
    let hidden = cmd
        .get_arguments()
        .find(|a| a.get_id() == "endpoint")
        .expect("the global --endpoint")
        .clone()
        .hide(true);
    // A subcommand that has an argument of a global's id keeps its own: clap propagates the
    // global (and its help line) only to the others.
    for path in NO_ENDPOINT {
        cmd = with_arg(cmd, path, &hidden);
    }
    cmd
}

fn with_arg(cmd: clap::Command, path: &[&str], arg: &clap::Arg) -> clap::Command {
    match path {
        [] => cmd.arg(arg.clone()),
        [first, rest @ ..] => cmd.mut_subcommand(*first, |sub| with_arg(sub, rest, arg)),
    }
}

fn main() -> ExitCode {
    tcpxd::logging::init("warn");
    let cli = Cli::from_arg_matches(&command().get_matches()).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Conformance(mut args) => {
            // `tcpxctl --json conformance` means the same as `tcpxctl conformance --json`.
            args.json |= cli.global.json;
            run_conformance(args)
        }
        Command::Client(command) => run_client(&cli.global, command),
    }
}

fn run_client(global: &GlobalOpts, command: ClientCommand) -> ExitCode {
    // The benchmarks time single RPCs: one thread keeps the response's wake-up on the thread
    // that waits for it (no hand-over between workers inside the measured latency).
    let runtime = if matches!(command, ClientCommand::Bench(_)) {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tcpxctl: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(tcpxctl::cli::commands::run(global, command))
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
    let topology = match tcpxd::engine::topology::MapSpec::parse(&args.topology) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("tcpxctl: --topology: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = conformance::Options {
        topology,
        devices: (!args.devices.is_empty()).then_some(args.devices),
        connect_timeout: Duration::from_secs(args.connect_timeout_secs),
        case_timeout: Duration::from_secs(args.case_timeout_secs),
        wraparound_requests: args.wraparound_requests,
        filter: args.filter,
        memory: match args.cuda {
            Some(device) => conformance::TestMemory::Cuda(device),
            None => conformance::TestMemory::Host,
        },
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("tcpxctl").chain(args.iter().copied()))
    }

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
        command().debug_assert();
    }

    /// What `tcpxctl PATH... --help` prints.
    fn help(path: &[&str]) -> String {
        let args = std::iter::once("tcpxctl")
            .chain(path.iter().copied())
            .chain(["--help"]);
        let e = command().try_get_matches_from(args).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp);
        e.to_string()
    }

    #[test]
    fn endpoint_is_shown_only_where_it_means_something() {
        for path in NO_ENDPOINT {
            assert!(!help(path).contains("--endpoint"), "{path:?}: {}", help(path));
        }
        for path in [
            &["write"][..],
            &["buffer", "register"],
            &["bench", "transfer"],
            &["stats"],
        ] {
            assert!(help(path).contains("--endpoint"), "{path:?}");
        }
        // Still accepted (before or after the subcommand), as every global option is.
        let cli = Cli::from_arg_matches(
            &command()
                .try_get_matches_from(["tcpxctl", "demo", "--endpoint", "unix:/x"])
                .unwrap(),
        )
        .unwrap();
        assert!(matches!(cli.command, Command::Client(ClientCommand::Demo(_))));
    }

    #[test]
    fn conformance_keeps_its_flags() {
        let cli = parse(&["conformance", "--builtin-emulation", "--json", "--device", "1"]).unwrap();
        let Command::Conformance(args) = cli.command else {
            panic!("not conformance");
        };
        assert!(args.json && args.builtin_emulation);
        assert_eq!(args.devices, vec![1]);
        let cli = parse(&["--json", "conformance", "--plugin", "/x.so"]).unwrap();
        assert!(cli.global.json);
        assert!(parse(&["conformance"]).is_err());
    }

    #[test]
    fn global_options_anywhere() {
        let cli = parse(&["--endpoint", "unix:/a.sock", "buffer", "list", "--json"]).unwrap();
        assert_eq!(cli.global.endpoint, "unix:/a.sock");
        assert!(cli.global.json);
        let cli = parse(&["buffer", "list", "--endpoint", "h:1"]).unwrap();
        assert_eq!(cli.global.endpoint, "h:1");
    }

    #[test]
    fn write_arguments() {
        let cli = parse(&[
            "write",
            "--local",
            "3:4K",
            "--remote",
            "tcpxd1:node-b:7:00ff",
            "--remote-offset",
            "1M",
            "--length",
            "1GiB",
            "--notify",
            "hi",
            "--timeout",
            "2.5",
            "--no-wait",
        ])
        .unwrap();
        let Command::Client(ClientCommand::Write(w)) = cli.command else {
            panic!("not write");
        };
        assert_eq!((w.local.buffer_id, w.local.offset), (3, 4096));
        assert_eq!(w.remote, "tcpxd1:node-b:7:00ff");
        assert_eq!(w.remote_offset, 1 << 20);
        assert_eq!(w.length, 1 << 30);
        assert_eq!(w.notify.as_deref(), Some("hi"));
        assert_eq!(w.wait.timeout, Some(Duration::from_millis(2500)));
        assert!(w.wait.no_wait);
        assert!(
            parse(&["write", "--local", "3", "--remote", "d"]).is_err(),
            "--length needed"
        );
        assert!(parse(&["write", "--local", "d:x", "--remote", "d", "--length", "1"]).is_err());
    }

    #[test]
    fn buffer_arguments() {
        let cli = parse(&["buffer", "register", "--host", "1G", "--label", "kv"]).unwrap();
        let Command::Client(ClientCommand::Buffer(tcpxctl::cli::args::BufferCommand::Register(r))) =
            cli.command
        else {
            panic!("not register");
        };
        assert_eq!(r.host, Some(1 << 30));
        assert_eq!(r.label, "kv");
        assert!(parse(&["buffer", "register", "--cuda", "0", "1M"]).is_ok());
        assert!(parse(&["buffer", "register"]).is_err());
        assert!(parse(&["buffer", "register", "--host", "1M", "--cuda", "0", "1M"]).is_err());
        assert!(parse(&["buffer", "fill", "1", "--seed", "42"]).is_ok());
        assert!(parse(&["buffer", "fill", "1", "--repeat", "0xdeadbeef", "--offset", "4K"]).is_ok());
        assert!(parse(&["buffer", "fill", "1"]).is_err(), "a pattern is required");
        assert!(parse(&["buffer", "fill", "1", "--byte", "1", "--seed", "2"]).is_err());
        assert!(parse(&["buffer", "fill", "1", "--byte", "256"]).is_err());
        assert!(parse(&["buffer", "read", "1", "--length", "64"]).is_ok());
        assert!(parse(&["buffer", "read", "1"]).is_err(), "--length needed");
        assert!(parse(&["buffer", "checksum", "1"]).is_ok());
    }

    #[test]
    fn block_subcommands() {
        for args in [
            &["blocks", "register", "--buffer", "1", "--block-size", "16K"][..],
            &[
                "blocks",
                "register",
                "--buffer",
                "1",
                "--block-size",
                "4K",
                "--count",
                "8",
                "--stride",
                "8K",
                "-q",
            ],
            &[
                "blocks",
                "register",
                "--buffer",
                "1",
                "--block-size",
                "4K",
                "--offsets",
                "0,8K,4K",
            ],
            &[
                "blocks",
                "register",
                "--buffer",
                "1",
                "--offsets",
                "@o.txt",
                "--lengths",
                "@l.txt",
            ],
            &["blocks", "describe", "3"],
            &["blocks", "release", "3"],
            &[
                "write-blocks",
                "--list",
                "1",
                "--indices",
                "0-99,200",
                "--remote",
                "t",
                "--remote-indices",
                "@f",
            ],
            &[
                "read-blocks",
                "--remote",
                "t",
                "--remote-indices",
                "0-9",
                "--list",
                "2",
                "--indices",
                "5-14",
                "--no-wait",
            ],
            &[
                "bench",
                "transfer",
                "--blocks",
                "1000",
                "--block-size",
                "16K",
                "--seed",
                "3",
                "--op",
                "read",
            ],
            &["bench", "transfer", "--sizes", "4K"],
        ] {
            parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        }
        for bad in [
            &["blocks", "register", "--buffer", "1"][..],
            &[
                "blocks",
                "register",
                "--buffer",
                "1",
                "--block-size",
                "4K",
                "--count",
                "2",
                "--offsets",
                "0",
            ],
            &[
                "blocks",
                "register",
                "--buffer",
                "1",
                "--block-size",
                "4K",
                "--lengths",
                "1",
            ],
            &["write-blocks", "--list", "1", "--indices", "0", "--remote", "t"],
            &["bench", "transfer", "--blocks", "1000"],
            &["bench", "transfer", "--block-size", "4K"],
            &["bench", "transfer", "--seed", "4"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
        let cli = parse(&["bench", "transfer", "--blocks", "10", "--block-size", "4K"]).unwrap();
        let Command::Client(ClientCommand::Bench(tcpxctl::cli::args::BenchCommand::Transfer(t))) =
            cli.command
        else {
            panic!("not bench transfer");
        };
        assert_eq!((t.blocks, t.block_size, t.seed), (Some(10), Some(4096), 1));
    }

    #[test]
    fn other_subcommands() {
        for args in [
            &["peer", "connect", "10.0.0.2:50052"][..],
            &["peer", "list"],
            &["read", "--remote", "d", "--local", "2:0", "--length", "4K"],
            &["watch", "7"],
            &["wait", "7"],
            &["cancel", "7"],
            &["subscribe", "--count", "1"],
            &["stats", "--watch", "1"],
            &["stats", "--watch", "0.5", "--count", "3"],
            &["health"],
            &["health", "--wait", "30"],
            &["buffer", "register", "--host", "1M", "--quiet"],
            &["buffer", "describe", "1", "-q"],
            &["buffer", "rekey", "1", "--quiet"],
            &["demo"],
            &["demo", "--size", "64M", "--chunk-bytes", "512K", "--keep-dir"],
            &["bench", "transfer"],
            &[
                "bench",
                "transfer",
                "--peer-endpoint",
                "h:1",
                "--peer-address",
                "h:2",
                "--op",
                "read",
            ],
            &[
                "bench", "transfer", "--raw", "--cuda", "0", "--min", "1M", "--max", "1G", "--step", "2",
            ],
            &[
                "bench", "raw", "--sizes", "4K,1M", "--batch", "4", "--iters", "5", "--out", "x.jsonl",
            ],
            &[
                "bench", "raw", "--plugin", "/x.so", "--device", "0", "--device", "1",
            ],
        ] {
            parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        }
        assert!(
            parse(&["stats", "--count", "3"]).is_err(),
            "--count needs --watch"
        );
        assert!(parse(&["stats", "--watch", "1", "--count", "0"]).is_err());
        assert!(parse(&["health", "--wait", "0"]).is_err());
        assert!(parse(&["bench", "raw", "--sizes", "4K", "--min", "8K"]).is_err());
        assert!(parse(&["bench", "transfer", "--peer-address", "h:2"]).is_err());
        assert!(parse(&["bench", "raw", "--op", "copy"]).is_err());
        let cli = parse(&["demo"]).unwrap();
        let Command::Client(ClientCommand::Demo(d)) = cli.command else {
            panic!("not demo");
        };
        assert_eq!(d.size, 1 << 30);
        assert_eq!(d.ready_timeout, Duration::from_secs(30));
    }
}
