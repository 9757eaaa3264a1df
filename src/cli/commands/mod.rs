//! Running tcpxctl's client subcommands: dispatch, the error type and its exit codes, and
//! writing to stdout. The subcommands themselves live by concern in the submodules: buffers,
//! peers, transfers (starting and following them), observation (subscribe, stats, health) and
//! the demo.

use std::io::Write as _;
use std::process::ExitCode;

use tonic::Status;

use crate::cli::args::{ClientCommand, GlobalOpts};
use crate::cli::demo::{DemoError, DemoOptions};
use crate::client::{ClientError, Endpoint, code_and_message, code_number_name, connect, status_line};

/// Exit status after an interrupt (128 + SIGINT), as shells report it.
const EXIT_INTERRUPTED: u8 = 130;

fn print_json(v: &serde_json::Value) -> Result<(), CliError> {
    emit(&format!("{v}\n"))
}

/// Writes to stdout; a closed pipe (`tcpxctl ... | head`) ends the command quietly.
pub(crate) fn emit(text: &str) -> Result<(), CliError> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|source| {
            if source.kind() == std::io::ErrorKind::BrokenPipe {
                CliError::BrokenPipe
            } else {
                CliError::Io {
                    what: "writing to stdout".to_string(),
                    source,
                }
            }
        })
}

// The submodules print with these two; they are declared below them so that they see them.
macro_rules! outln {
    () => {
        $crate::cli::commands::emit("\n")?
    };
    ($($arg:tt)*) => {
        $crate::cli::commands::emit(&format!("{}\n", format_args!($($arg)*)))?
    };
}

macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::commands::emit(&format!($($arg)*))?
    };
}

mod buffer;
mod demo;
mod observe;
mod peer;
mod transfer;

/// Why a subcommand failed; printed as `tcpxctl: <error>`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{source}{}", connect_hint(source))]
    Connect { source: ClientError },
    /// An RPC failed: `write failed: INVALID_ARGUMENT: entries[0].length: ...`.
    #[error("{what} failed: {}", status_line(status))]
    Rpc { what: String, status: Status },
    /// A transfer finished with a non-OK status.
    #[error("{what} failed: {}{}", code_and_message(&code_number_name(*code), message), entries_text(entries))]
    Transfer {
        what: String,
        code: i32,
        message: String,
        /// Failed entries of a batch, as (index, code, message).
        entries: Vec<(usize, i32, String)>,
    },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{0}")]
    Usage(String),
    /// The health service answered, but not SERVING.
    #[error("{0}")]
    NotServing(String),
    #[error("demo failed: {0}")]
    Demo(DemoError),
    #[error("bench failed: {0}")]
    Bench(String),
    #[error("interrupted")]
    Interrupted,
    /// stdout was closed (`| head`): not an error worth a message.
    #[error("stdout closed")]
    BrokenPipe,
}

impl CliError {
    fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Interrupted | CliError::Demo(DemoError::Interrupted(_)) => {
                ExitCode::from(EXIT_INTERRUPTED)
            }
            CliError::Usage(_) => ExitCode::from(2),
            _ => ExitCode::FAILURE,
        }
    }
}

fn connect_hint(e: &ClientError) -> &'static str {
    match e {
        ClientError::Connect { endpoint, .. } => match Endpoint::parse(endpoint) {
            Ok(Endpoint::Unix(_)) => {
                " (is tcpxd running? point --endpoint or TCPXD_ENDPOINT at its api socket)"
            }
            _ => " (is tcpxd running and serving there? see --endpoint / TCPXD_ENDPOINT)",
        },
        ClientError::InvalidEndpoint { .. } | ClientError::Token { .. } => "",
    }
}

fn entries_text(entries: &[(usize, i32, String)]) -> String {
    entries
        .iter()
        .map(|(i, code, msg)| {
            format!(
                "\n  entries[{i}]: {}",
                code_and_message(&code_number_name(*code), msg)
            )
        })
        .collect()
}

fn rpc(what: impl Into<String>) -> impl FnOnce(Status) -> CliError {
    let what = what.into();
    move |status| CliError::Rpc { what, status }
}

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
