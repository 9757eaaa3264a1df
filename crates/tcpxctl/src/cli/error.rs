//! How a tcpxctl subcommand ends: its error (printed as `tcpxctl: <error>`) and exit status, and
//! writing to stdout, where a closed pipe ends the command quietly.

use std::io::Write as _;
use std::process::ExitCode;

use tonic::Status;

use crate::cli::demo::DemoError;
use crate::client::{ClientError, Endpoint, code_and_message, code_number_name, status_line};

/// Exit status after an interrupt (128 + SIGINT), as shells report it.
const EXIT_INTERRUPTED: u8 = 130;

pub(crate) fn print_json(v: &serde_json::Value) -> Result<(), CliError> {
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
    pub(crate) fn exit_code(&self) -> ExitCode {
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

pub(crate) fn rpc(what: impl Into<String>) -> impl FnOnce(Status) -> CliError {
    let what = what.into();
    move |status| CliError::Rpc { what, status }
}
