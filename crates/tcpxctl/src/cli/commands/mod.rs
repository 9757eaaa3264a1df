//! Running tcpxctl's client subcommands: dispatch (the error type, its exit codes and writing to
//! stdout are in `crate::cli::error`). The subcommands themselves live by concern in the
//! submodules: buffers, peers, transfers (starting and following them), observation (subscribe,
//! stats, health) and the demo.

use std::process::ExitCode;

use crate::cli::args::{ClientCommand, GlobalOpts};
use crate::cli::demo::{DemoError, DemoOptions};
use crate::cli::error::CliError;
use crate::client::connect;

// The submodules print with these two; they are declared below them so that they see them.
macro_rules! outln {
    () => {
        $crate::cli::error::emit("\n")?
    };
    ($($arg:tt)*) => {
        $crate::cli::error::emit(&format!("{}\n", format_args!($($arg)*)))?
    };
}

macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::error::emit(&format!($($arg)*))?
    };
}

pub mod blocks;
mod buffer;
mod demo;
mod observe;
mod peer;
mod transfer;

/// Runs one client subcommand and prints its error, if any, as `tcpxctl: ...`.
pub async fn run(global: &GlobalOpts, command: ClientCommand) -> ExitCode {
    match execute(global, command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::BrokenPipe) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tcpxctl: {e}");
            if let CliError::Demo(d) = &e {
                if !matches!(
                    d,
                    DemoError::BadOption(_) | DemoError::DaemonMissing { .. } | DemoError::Interrupted(_)
                ) {
                    eprintln!(
                        "tcpxctl: the daemons' logs are kept in {}",
                        DemoOptions::default().work_dir().display()
                    );
                }
            }
            e.exit_code()
        }
    }
}

async fn execute(global: &GlobalOpts, command: ClientCommand) -> Result<(), CliError> {
    if let ClientCommand::Demo(args) = command {
        return demo::demo(global, args).await;
    }
    if let ClientCommand::Health(args) = command {
        return observe::health(global, args).await;
    }
    if let ClientCommand::Bench(cmd) = command {
        return crate::cli::bench::run(global, cmd).await;
    }
    let mut client = connect(&global.endpoint)
        .await
        .map_err(|source| CliError::Connect { source })?;
    let json = global.json;
    match command {
        ClientCommand::Buffer(cmd) => buffer::buffer(&mut client, json, cmd).await,
        ClientCommand::Peer(cmd) => peer::peer(&mut client, json, cmd).await,
        ClientCommand::Describe => crate::cli::node::describe(&mut client, json).await,
        ClientCommand::Blocks(cmd) => blocks::blocks(&mut client, json, cmd).await,
        ClientCommand::WriteBlocks(args) => blocks::write_blocks(&mut client, json, args).await,
        ClientCommand::ReadBlocks(args) => blocks::read_blocks(&mut client, json, args).await,
        ClientCommand::Write(args) => transfer::write(&mut client, json, args).await,
        ClientCommand::Read(args) => transfer::read(&mut client, json, args).await,
        ClientCommand::Watch(args) => transfer::watch(&mut client, json, args).await,
        ClientCommand::Wait(args) => transfer::wait(&mut client, json, args).await,
        ClientCommand::Cancel(args) => transfer::cancel(&mut client, json, args).await,
        ClientCommand::Subscribe(args) => observe::subscribe(&mut client, json, args).await,
        ClientCommand::Stats(args) => observe::stats(&mut client, json, args).await,
        ClientCommand::Demo(_) | ClientCommand::Health(_) | ClientCommand::Bench(_) => {
            unreachable!("handled above")
        }
    }
}
