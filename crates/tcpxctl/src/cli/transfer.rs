//! Following a transfer to its end: `Watch` with a progress bar, `WaitTransfer` as the fallback.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tonic::{Code, Status};

use crate::client::ApiClient;
use tcpxd::api::proto::v1::{TransferEvent, TransferState, WaitTransferRequest, WatchRequest};

/// How to follow a transfer.
#[derive(Debug, Clone, Default)]
pub struct FollowOptions {
    /// Draw a progress bar on stderr (only drawn when stderr is a terminal).
    pub progress: bool,
    /// Shown left of the bar (`write`, `read`, ...).
    pub label: String,
    /// Give up after this long with DEADLINE_EXCEEDED (the daemon enforces the transfer's own
    /// deadline; this only keeps the client from waiting forever on a daemon that went quiet).
    pub client_deadline: Option<Duration>,
}

/// A finished transfer as the client saw it.
#[derive(Debug, Clone)]
pub struct Followed {
    /// The final event (state FINISHED).
    pub event: TransferEvent,
    /// Wall time from the start of following to the final event.
    pub observed: Duration,
}

/// A progress bar for `total` bytes, hidden unless asked for and stderr is a terminal.
pub fn progress_bar(total: u64, label: &str, enabled: bool) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{msg:>8} [{elapsed_precise}] {wide_bar:.cyan/blue} {binary_bytes}/{binary_total_bytes} \
         {decimal_bytes_per_sec} ETA {eta}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(label.to_string());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Follows a transfer until it finishes. Returns the final event whatever its status; an `Err`
/// means the daemon could not be asked (or the transfer is unknown).
pub async fn follow_transfer(
    client: &mut ApiClient,
    transfer_id: u64,
    total_bytes: u64,
    opts: &FollowOptions,
) -> Result<Followed, Status> {
    let start = Instant::now();
    let bar = progress_bar(total_bytes, &opts.label, opts.progress);
    let follow = watch_until_finished(client, transfer_id, &bar);
    let result = match opts.client_deadline {
        Some(limit) => match tokio::time::timeout(limit, follow).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(format!(
                "transfer {transfer_id} did not finish within {:.1} s (client-side limit)",
                limit.as_secs_f64()
            ))),
        },
        None => follow.await,
    };
    match &result {
        Ok(ev) if ev.status_code == 0 => bar.finish(),
        _ => bar.abandon(),
    }
    result.map(|event| Followed {
        event,
        observed: start.elapsed(),
    })
}

async fn watch_until_finished(
    client: &mut ApiClient,
    transfer_id: u64,
    bar: &ProgressBar,
) -> Result<TransferEvent, Status> {
    match client.watch(WatchRequest { transfer_id }).await {
        Ok(response) => {
            let mut stream = response.into_inner();
            while let Some(ev) = stream.message().await? {
                if ev.total_bytes > 0 {
                    bar.set_length(ev.total_bytes);
                }
                bar.set_position(ev.bytes_done);
                if ev.state == TransferState::Finished as i32 {
                    return Ok(ev);
                }
            }
            // The stream ended without a final event: ask for it directly.
        }
        // A daemon without Watch still answers WaitTransfer.
        Err(status) if status.code() == Code::Unimplemented => {}
        Err(status) => return Err(status),
    }
    let ev = client
        .wait_transfer(WaitTransferRequest { transfer_id })
        .await?
        .into_inner();
    bar.set_position(ev.bytes_done);
    Ok(ev)
}
