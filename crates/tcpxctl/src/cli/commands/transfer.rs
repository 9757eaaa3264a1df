//! The transfer subcommands (write, read, watch, wait, cancel): starting a transfer, then
//! waiting for it in the same call or following it (with [`crate::cli::transfer`]), and
//! reporting how it finished.

use std::time::{Duration, Instant};

use serde_json::json;
use tonic::Status;

use crate::cli::args::{ReadArgs, TransferIdArgs, WaitOpts, WriteArgs};
use crate::cli::error::{CliError, print_json, rpc};
use crate::cli::output::{event_json, event_summary, transfer_elapsed};
use crate::cli::transfer::{FollowOptions, follow_transfer};
use crate::client::{ApiClient, format_bytes, status_line};
use tcpxd::api::proto::v1::{
    CancelRequest, ReadEntry, ReadRequest, TransferEvent, TransferStarted, WaitTransferRequest, WriteEntry,
    WriteRequest,
};

/// How much longer than `--timeout` the client waits before giving up on its own.
const CLIENT_DEADLINE_SLACK: Duration = Duration::from_secs(10);

/// `--timeout` as the request's gRPC deadline, and the client-side limit for following.
pub(super) fn apply_timeout<T>(request: &mut tonic::Request<T>, wait: &WaitOpts) -> Option<Duration> {
    wait.timeout.map(|t| {
        request.set_timeout(t);
        t + CLIENT_DEADLINE_SLACK
    })
}

pub(super) fn timeout_ms(wait: &WaitOpts) -> u64 {
    wait.timeout
        .map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1))
}

pub(super) async fn write(client: &mut ApiClient, json: bool, args: WriteArgs) -> Result<(), CliError> {
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

pub(super) async fn read(client: &mut ApiClient, json: bool, args: ReadArgs) -> Result<(), CliError> {
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

/// `tcpxctl watch`: follows a transfer started elsewhere.
pub(super) async fn watch(client: &mut ApiClient, json: bool, args: TransferIdArgs) -> Result<(), CliError> {
    let total = 0; // Learned from the first event.
    follow(client, json, "transfer", args.transfer_id, total, None).await
}

/// `tcpxctl wait`: waits for a transfer to finish, without progress.
pub(super) async fn wait(client: &mut ApiClient, json: bool, args: TransferIdArgs) -> Result<(), CliError> {
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

/// `tcpxctl cancel`: cancels a transfer, or says it had already ended.
pub(super) async fn cancel(client: &mut ApiClient, json: bool, args: TransferIdArgs) -> Result<(), CliError> {
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

/// Whether to start and wait in one call (`wait`): whenever the caller waits and no progress bar
/// is drawn (the bar needs Watch's progress events).
pub(super) fn one_call(json: bool, wait: &WaitOpts) -> bool {
    use std::io::IsTerminal as _;
    !wait.no_wait && (json || !std::io::stderr().is_terminal())
}

/// Runs a transfer call made with `wait`: one round trip, the final event in the answer. Ctrl-C
/// drops the call, which makes the daemon cancel the transfer.
pub(super) async fn waited(
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

pub(super) async fn after_start(
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
