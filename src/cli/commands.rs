//! Running tcpxctl's client subcommands.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::json;
use tonic::Status;

use crate::api::proto::v1::register_buffer_request::Source;
use crate::api::proto::v1::{
    CancelRequest, ChecksumBufferRequest, ConnectPeerRequest, CudaAllocation, DescribeBufferRequest,
    FillBufferRequest, GetStatsRequest, HostAllocation, ListBuffersRequest, ListPeersRequest,
    ReadBufferRequest, ReadEntry, ReadRequest, RegisterBufferRequest, ReleaseBufferRequest, SubscribeRequest,
    TransferEvent, TransferStarted, WaitTransferRequest, WriteEntry, WriteRequest, fill_buffer_request,
};
use crate::cli::args::{
    BufferCommand, BufferReadArgs, ChecksumArgs, ClientCommand, DemoArgs, FillArgs, GlobalOpts, PeerCommand,
    ReadArgs, RegisterArgs, StatsArgs, SubscribeArgs, WaitOpts, WriteArgs,
};
use crate::cli::demo::{DemoError, DemoOptions, run_demo};
use crate::cli::output::{
    buffer_json, buffer_text, buffers_table, event_json, event_summary, hexdump, notification_json,
    notification_text, peer_json, peers_table, stats_json, stats_text, transfer_elapsed,
};
use crate::cli::transfer::{FollowOptions, follow_transfer};
use crate::client::ApiClient;
use crate::client::{
    ClientError, Endpoint, code_and_message, code_number_name, connect, format_bytes, status_line,
};

/// The most ReadBuffer returns per call.
const READ_BUFFER_MAX: u64 = 1 << 20;
/// Exit status after an interrupt (128 + SIGINT), as shells report it.
const EXIT_INTERRUPTED: u8 = 130;
/// How much longer than `--timeout` the client waits before giving up on its own.
const CLIENT_DEADLINE_SLACK: Duration = Duration::from_secs(10);

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

macro_rules! outln {
    () => {
        emit("\n")?
    };
    ($($arg:tt)*) => {
        emit(&format!("{}\n", format_args!($($arg)*)))?
    };
}

macro_rules! out {
    ($($arg:tt)*) => {
        emit(&format!($($arg)*))?
    };
}

async fn buffer(client: &mut ApiClient, json: bool, cmd: BufferCommand) -> Result<(), CliError> {
    match cmd {
        BufferCommand::Register(args) => register(client, json, args).await,
        BufferCommand::List => {
            let buffers = client
                .list_buffers(ListBuffersRequest {})
                .await
                .map_err(rpc("listing buffers"))?
                .into_inner()
                .buffers;
            if json {
                print_json(&json!(buffers.iter().map(buffer_json).collect::<Vec<_>>()))?;
            } else if buffers.is_empty() {
                outln!("no buffers");
            } else {
                out!("{}", buffers_table(&buffers));
            }
            Ok(())
        }
        BufferCommand::Describe(args) => {
            let b = client
                .describe_buffer(DescribeBufferRequest { buffer_id: args.id })
                .await
                .map_err(rpc(format!("describing buffer {}", args.id)))?
                .into_inner();
            if json {
                print_json(&buffer_json(&b))?;
            } else {
                out!("{}", buffer_text(&b));
            }
            Ok(())
        }
        BufferCommand::Rekey(args) => {
            let b = client
                .rekey_buffer(crate::api::proto::v1::RekeyBufferRequest { buffer_id: args.id })
                .await
                .map_err(rpc(format!("re-keying buffer {}", args.id)))?
                .into_inner();
            if json {
                print_json(&buffer_json(&b))?;
            } else {
                out!("{}", buffer_text(&b));
            }
            Ok(())
        }
        BufferCommand::Release(args) => {
            client
                .release_buffer(ReleaseBufferRequest { buffer_id: args.id })
                .await
                .map_err(rpc(format!("releasing buffer {}", args.id)))?;
            if json {
                print_json(&json!({"released": args.id}))?;
            } else {
                outln!("buffer {} released", args.id);
            }
            Ok(())
        }
        BufferCommand::Fill(args) => fill(client, json, args).await,
        BufferCommand::Read(args) => read_buffer(client, json, args).await,
        BufferCommand::Checksum(args) => checksum(client, json, args).await,
    }
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
        return demo(global, args).await;
    }
    if let ClientCommand::Health = command {
        return health(global).await;
    }
    if let ClientCommand::Bench(cmd) = command {
        return crate::cli::bench::run(global, cmd).await;
    }
    let mut client = connect(&global.endpoint)
        .await
        .map_err(|source| CliError::Connect { source })?;
    let json = global.json;
    match command {
        ClientCommand::Buffer(cmd) => buffer(&mut client, json, cmd).await,
        ClientCommand::Peer(PeerCommand::Connect(args)) => {
            let peer = client
                .connect_peer(ConnectPeerRequest {
                    address: args.address.clone(),
                })
                .await
                .map_err(rpc(format!("connecting to peer {}", args.address)))?
                .into_inner();
            if json {
                print_json(&peer_json(&peer))?;
            } else {
                out!("{}", peers_table(std::slice::from_ref(&peer)));
            }
            Ok(())
        }
        ClientCommand::Peer(PeerCommand::List) => {
            let peers = client
                .list_peers(ListPeersRequest {})
                .await
                .map_err(rpc("listing peers"))?
                .into_inner()
                .peers;
            if json {
                print_json(&json!(peers.iter().map(peer_json).collect::<Vec<_>>()))?;
            } else if peers.is_empty() {
                outln!("no peers");
            } else {
                out!("{}", peers_table(&peers));
            }
            Ok(())
        }
        ClientCommand::Describe => crate::cli::node::describe(&mut client, json).await,
        ClientCommand::Write(args) => write(&mut client, json, args).await,
        ClientCommand::Read(args) => read(&mut client, json, args).await,
        ClientCommand::Watch(args) => {
            let total = 0; // Learned from the first event.
            follow(&mut client, json, "transfer", args.transfer_id, total, None).await
        }
        ClientCommand::Wait(args) => {
            let start = Instant::now();
            let wait = client.wait_transfer(WaitTransferRequest {
                transfer_id: args.transfer_id,
            });
            let ev = tokio::select! {
                r = wait => r.map_err(rpc(format!("waiting for transfer {}", args.transfer_id)))?.into_inner(),
                _ = tokio::signal::ctrl_c() => return Err(CliError::Interrupted),
            };
            report_finished("transfer", json, &ev, start.elapsed())
        }
        ClientCommand::Cancel(args) => {
            let r = client
                .cancel(CancelRequest {
                    transfer_id: args.transfer_id,
                })
                .await
                .map_err(rpc(format!("cancelling transfer {}", args.transfer_id)))?
                .into_inner();
            if json {
                print_json(&json!({"transfer_id": args.transfer_id, "cancelled": r.cancelled}))?;
            } else if r.cancelled {
                outln!("transfer {} cancelled", args.transfer_id);
            } else {
                outln!(
                    "transfer {} had already ended; its final status stands",
                    args.transfer_id
                );
            }
            Ok(())
        }
        ClientCommand::Subscribe(args) => subscribe(&mut client, json, args).await,
        ClientCommand::Stats(args) => stats(&mut client, json, args).await,
        ClientCommand::Demo(_) | ClientCommand::Health | ClientCommand::Bench(_) => {
            unreachable!("handled above")
        }
    }
}

async fn register(client: &mut ApiClient, json: bool, args: RegisterArgs) -> Result<(), CliError> {
    let cuda = args.cuda().map_err(CliError::Usage)?;
    let source = match (args.host, cuda) {
        (Some(size), _) => Source::Host(HostAllocation { size }),
        (None, Some((device, size))) => Source::Cuda(CudaAllocation { device, size }),
        (None, None) => return Err(CliError::Usage("give --host SIZE or --cuda DEVICE SIZE".into())),
    };
    let b = client
        .register_buffer(RegisterBufferRequest {
            source: Some(source),
            label: args.label,
        })
        .await
        .map_err(rpc("registering a buffer"))?
        .into_inner();
    if json {
        print_json(&buffer_json(&b))?;
    } else {
        out!("{}", buffer_text(&b));
    }
    Ok(())
}

async fn fill(client: &mut ApiClient, json: bool, args: FillArgs) -> Result<(), CliError> {
    let (pattern, text) = match (args.pattern.byte, args.pattern.seed, args.pattern.repeat) {
        (Some(b), _, _) => (
            fill_buffer_request::Pattern::Byte(u32::from(b)),
            format!("byte 0x{b:02x}"),
        ),
        (_, Some(s), _) => (fill_buffer_request::Pattern::Seed(s), format!("seed {s}")),
        (_, _, Some(r)) => {
            let text = format!("pattern 0x{} ({} bytes)", hex::encode(&r.0), r.0.len());
            (fill_buffer_request::Pattern::Repeat(r.0), text)
        }
        _ => return Err(CliError::Usage("give --byte, --seed or --repeat".into())),
    };
    client
        .fill_buffer(FillBufferRequest {
            buffer_id: args.id,
            offset: args.offset,
            length: args.length,
            pattern: Some(pattern),
        })
        .await
        .map_err(rpc(format!("filling buffer {}", args.id)))?;
    let range = if args.length == 0 {
        format!("from {} to the end", args.offset)
    } else {
        format!("{}..{}", args.offset, args.offset.saturating_add(args.length))
    };
    if json {
        print_json(&json!({"buffer_id": args.id, "offset": args.offset, "length": args.length}))?;
    } else {
        outln!("buffer {} {range} filled with {text}", args.id);
    }
    Ok(())
}

async fn read_buffer(client: &mut ApiClient, json: bool, args: BufferReadArgs) -> Result<(), CliError> {
    if args.length == 0 {
        return Err(CliError::Usage("--length must be at least 1 byte".into()));
    }
    let end = args
        .offset
        .checked_add(args.length)
        .ok_or_else(|| CliError::Usage("--offset + --length overflows".into()))?;
    if args.length > READ_BUFFER_MAX {
        // Several requests: check the whole range first, so a bad one prints nothing.
        let b = client
            .describe_buffer(DescribeBufferRequest { buffer_id: args.id })
            .await
            .map_err(rpc(format!("describing buffer {}", args.id)))?
            .into_inner();
        if end > b.size {
            return Err(CliError::Usage(format!(
                "range {}..{end} is past the end of buffer {} ({} bytes)",
                args.offset, args.id, b.size
            )));
        }
    }
    let mut file = match &args.out {
        Some(path) => Some(std::fs::File::create(path).map_err(|source| CliError::Io {
            what: format!("creating {}", path.display()),
            source,
        })?),
        None => None,
    };
    let mut all_hex = String::new();
    let mut pos = args.offset;
    while pos < end {
        let length = (end - pos).min(READ_BUFFER_MAX);
        let data = client
            .read_buffer(ReadBufferRequest {
                buffer_id: args.id,
                offset: pos,
                length,
            })
            .await
            .map_err(rpc(format!("reading buffer {} at {pos}", args.id)))?
            .into_inner()
            .data;
        if data.is_empty() {
            return Err(CliError::Usage(format!(
                "buffer {} returned no data at offset {pos}",
                args.id
            )));
        }
        let io = |source| CliError::Io {
            what: "writing the output".to_string(),
            source,
        };
        match (&mut file, json) {
            (Some(f), _) => f.write_all(&data).map_err(io)?,
            (None, true) => all_hex.push_str(&hex::encode(&data)),
            (None, false) => emit(&hexdump(&data, pos))?,
        }
        pos += data.len() as u64;
    }
    if let (Some(path), true) = (&args.out, json) {
        print_json(
            &json!({"buffer_id": args.id, "offset": args.offset, "length": args.length, "out": path.display().to_string()}),
        )?;
    } else if json {
        print_json(
            &json!({"buffer_id": args.id, "offset": args.offset, "length": args.length, "data_hex": all_hex}),
        )?;
    } else if let Some(path) = &args.out {
        eprintln!("wrote {} to {}", format_bytes(args.length), path.display());
    }
    Ok(())
}

async fn checksum(client: &mut ApiClient, json: bool, args: ChecksumArgs) -> Result<(), CliError> {
    let r = client
        .checksum_buffer(ChecksumBufferRequest {
            buffer_id: args.id,
            offset: args.offset,
            length: args.length,
        })
        .await
        .map_err(rpc(format!("checksum of buffer {}", args.id)))?
        .into_inner();
    if json {
        print_json(&json!({
            "buffer_id": args.id,
            "offset": args.offset,
            "length": r.length,
            "crc32c": format!("{:08x}", r.crc32c),
        }))?;
    } else {
        outln!(
            "crc32c {:08x}  length {} ({})",
            r.crc32c,
            r.length,
            format_bytes(r.length)
        );
    }
    Ok(())
}

/// `--timeout` as the request's gRPC deadline, and the client-side limit for following.
fn apply_timeout<T>(request: &mut tonic::Request<T>, wait: &WaitOpts) -> Option<Duration> {
    wait.timeout.map(|t| {
        request.set_timeout(t);
        t + CLIENT_DEADLINE_SLACK
    })
}

fn timeout_ms(wait: &WaitOpts) -> u64 {
    wait.timeout
        .map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1))
}

async fn write(client: &mut ApiClient, json: bool, args: WriteArgs) -> Result<(), CliError> {
    let mut request = tonic::Request::new(WriteRequest {
        entry: Some(WriteEntry {
            local_buffer_id: args.local.buffer_id,
            local_offset: args.local.offset,
            remote_descriptor: args.remote.clone(),
            remote_offset: args.remote_offset,
            length: args.length,
        }),
        notification: args.notify.clone().map(String::into_bytes).unwrap_or_default(),
        timeout_ms: timeout_ms(&args.wait),
        ready_event_ipc_handle: Vec::new(),
        wait: one_call(json, &args.wait),
    });
    let deadline = apply_timeout(&mut request, &args.wait);
    if request.get_ref().wait {
        let mut caller = client.clone();
        return waited(client, caller.write(request), json, "write", deadline).await;
    }
    let started = client.write(request).await.map_err(rpc("write"))?.into_inner();
    after_start(client, json, "write", started, &args.wait, deadline).await
}

async fn read(client: &mut ApiClient, json: bool, args: ReadArgs) -> Result<(), CliError> {
    let mut request = tonic::Request::new(ReadRequest {
        entry: Some(ReadEntry {
            remote_descriptor: args.remote.clone(),
            remote_offset: args.remote_offset,
            local_buffer_id: args.local.buffer_id,
            local_offset: args.local.offset,
            length: args.length,
        }),
        timeout_ms: timeout_ms(&args.wait),
        wait: one_call(json, &args.wait),
    });
    let deadline = apply_timeout(&mut request, &args.wait);
    if request.get_ref().wait {
        let mut caller = client.clone();
        return waited(client, caller.read(request), json, "read", deadline).await;
    }
    let started = client.read(request).await.map_err(rpc("read"))?.into_inner();
    after_start(client, json, "read", started, &args.wait, deadline).await
}

/// Whether to start and wait in one call (`wait`): whenever the caller waits and no progress bar
/// is drawn (the bar needs Watch's progress events).
fn one_call(json: bool, wait: &WaitOpts) -> bool {
    use std::io::IsTerminal as _;
    !wait.no_wait && (json || !std::io::stderr().is_terminal())
}

/// Runs a transfer call made with `wait`: one round trip, the final event in the answer. Ctrl-C
/// drops the call, which makes the daemon cancel the transfer.
async fn waited(
    client: &mut ApiClient,
    call: impl std::future::Future<Output = Result<tonic::Response<TransferStarted>, Status>>,
    json: bool,
    what: &str,
    client_deadline: Option<Duration>,
) -> Result<(), CliError> {
    let start = Instant::now();
    let call = async {
        match client_deadline {
            Some(limit) => tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
                Err(Status::deadline_exceeded(format!(
                    "the {what} did not finish within {:.1} s (client-side limit)",
                    limit.as_secs_f64()
                )))
            }),
            None => call.await,
        }
    };
    let started = tokio::select! {
        r = call => r.map_err(rpc(what))?.into_inner(),
        _ = tokio::signal::ctrl_c() => {
            eprintln!("tcpxctl: interrupted; the daemon cancels the {what}");
            return Err(CliError::Interrupted);
        }
    };
    match started.r#final {
        Some(ev) => report_finished(what, json, &ev, start.elapsed()),
        // A daemon that predates `wait` answered at once: follow the transfer instead.
        None => {
            follow(
                client,
                json,
                what,
                started.transfer_id,
                started.total_bytes,
                client_deadline,
            )
            .await
        }
    }
}

async fn after_start(
    client: &mut ApiClient,
    json: bool,
    what: &str,
    started: TransferStarted,
    wait: &WaitOpts,
    deadline: Option<Duration>,
) -> Result<(), CliError> {
    if wait.no_wait {
        if json {
            print_json(&json!({"transfer_id": started.transfer_id, "total_bytes": started.total_bytes}))?;
        } else {
            outln!(
                "transfer {} started: {}",
                started.transfer_id,
                format_bytes(started.total_bytes)
            );
        }
        return Ok(());
    }
    follow(
        client,
        json,
        what,
        started.transfer_id,
        started.total_bytes,
        deadline,
    )
    .await
}

/// Follows a transfer with a progress bar; Ctrl-C cancels it.
async fn follow(
    client: &mut ApiClient,
    json: bool,
    what: &str,
    transfer_id: u64,
    total_bytes: u64,
    client_deadline: Option<Duration>,
) -> Result<(), CliError> {
    let opts = FollowOptions {
        progress: !json,
        label: what.to_string(),
        client_deadline,
    };
    let mut canceller = client.clone();
    let done = tokio::select! {
        r = follow_transfer(client, transfer_id, total_bytes, &opts) => {
            r.map_err(rpc(format!("following transfer {transfer_id}")))?
        }
        _ = tokio::signal::ctrl_c() => {
            let cancelled = canceller.cancel(CancelRequest { transfer_id }).await;
            match cancelled {
                Ok(r) if r.get_ref().cancelled => eprintln!("tcpxctl: transfer {transfer_id} cancelled"),
                Ok(_) => eprintln!("tcpxctl: transfer {transfer_id} had already ended"),
                Err(s) => eprintln!("tcpxctl: cancelling transfer {transfer_id} failed: {}", status_line(&s)),
            }
            return Err(CliError::Interrupted);
        }
    };
    report_finished(what, json, &done.event, done.observed)
}

fn report_finished(what: &str, json: bool, ev: &TransferEvent, observed: Duration) -> Result<(), CliError> {
    let elapsed = transfer_elapsed(ev, observed);
    if json {
        print_json(&event_json(ev, elapsed))?;
    } else {
        outln!("{}", event_summary(ev, elapsed));
    }
    if ev.status_code == 0 {
        return Ok(());
    }
    let entries = if ev.entries.len() > 1 {
        ev.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.code != 0)
            .map(|(i, e)| (i, e.code, e.message.clone()))
            .collect()
    } else {
        Vec::new()
    };
    Err(CliError::Transfer {
        what: if what == "transfer" {
            format!("transfer {}", ev.transfer_id)
        } else {
            format!("{what} (transfer {})", ev.transfer_id)
        },
        code: ev.status_code,
        message: ev.status_message.clone(),
        entries,
    })
}

async fn subscribe(client: &mut ApiClient, json: bool, args: SubscribeArgs) -> Result<(), CliError> {
    let mut stream = client
        .subscribe(SubscribeRequest {})
        .await
        .map_err(rpc("subscribe"))?
        .into_inner();
    let mut seen = 0u64;
    if args.count == Some(0) {
        return Ok(());
    }
    loop {
        let next = tokio::select! {
            m = stream.message() => m.map_err(rpc("subscription"))?,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let Some(n) = next else {
            eprintln!("tcpxctl: the daemon ended the subscription");
            return Ok(());
        };
        if json {
            print_json(&notification_json(&n))?;
        } else {
            outln!("{}", notification_text(&n));
        }
        seen += 1;
        if args.count.is_some_and(|c| seen >= c) {
            return Ok(());
        }
    }
}

async fn stats(client: &mut ApiClient, json: bool, args: StatsArgs) -> Result<(), CliError> {
    use std::io::IsTerminal as _;
    let Some(every) = args.watch else {
        let s = client
            .get_stats(GetStatsRequest {})
            .await
            .map_err(rpc("stats"))?
            .into_inner();
        if json {
            print_json(&stats_json(&s))?;
        } else {
            out!("{}", stats_text(&s, None));
        }
        return Ok(());
    };
    let clear = !json && std::io::stdout().is_terminal();
    let mut previous = None;
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
        let s = client
            .get_stats(GetStatsRequest {})
            .await
            .map_err(rpc("stats"))?
            .into_inner();
        let now = Instant::now();
        if json {
            print_json(&stats_json(&s))?;
        } else {
            let text = stats_text(&s, previous.as_ref().map(|(p, t): &(_, Instant)| (p, now - *t)));
            if clear {
                out!("\x1b[2J\x1b[H");
            } else if previous.is_some() {
                outln!();
            }
            out!("{text}");
        }
        previous = Some((s, now));
    }
}

/// `tcpxctl health`: the gRPC health status of the client API service.
async fn health(global: &GlobalOpts) -> Result<(), CliError> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    const SERVICE: &str = "tcpxd.v1.Tcpxd";
    let (channel, token) = crate::client::connect_channel(&global.endpoint)
        .await
        .map_err(|source| CliError::Connect { source })?;
    let r = HealthClient::with_interceptor(channel, token)
        .check(HealthCheckRequest {
            service: SERVICE.into(),
        })
        .await
        .map_err(rpc("health check"))?
        .into_inner();
    let status = ServingStatus::try_from(r.status).unwrap_or(ServingStatus::Unknown);
    if global.json {
        print_json(&json!({"service": SERVICE, "status": status.as_str_name()}))?;
    } else {
        outln!("{SERVICE}: {}", status.as_str_name());
    }
    if status == ServingStatus::Serving {
        Ok(())
    } else {
        Err(CliError::NotServing(format!(
            "{SERVICE} is {}",
            status.as_str_name()
        )))
    }
}

async fn demo(global: &GlobalOpts, args: DemoArgs) -> Result<(), CliError> {
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
