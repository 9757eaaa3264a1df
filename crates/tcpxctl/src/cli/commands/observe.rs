//! Watching the daemon rather than moving data: `subscribe` (notifications), `stats` (once or
//! refreshed) and `health` (the gRPC health service).

use std::time::{Duration, Instant};

use serde_json::json;

use crate::cli::args::{GlobalOpts, HealthArgs, StatsArgs, SubscribeArgs};
use crate::cli::error::{CliError, print_json, rpc};
use crate::cli::output::{Rates, notification_json, notification_text, stats_json, stats_text, utc_text};
use crate::client::ApiClient;
use tcpxd::api::proto::v1::{GetStatsRequest, SubscribeRequest};

/// How often a long-running command asks a daemon that stopped answering (it may be restarting:
/// docs/OPERATIONS.md, "Restarts").
const RETRY: Duration = Duration::from_millis(500);

/// Whether a failed call may succeed once the daemon is back (it stopped or restarts).
fn transient(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

pub(super) async fn subscribe(
    client: &mut ApiClient,
    json: bool,
    args: SubscribeArgs,
) -> Result<(), CliError> {
    let mut stream = Some(
        client
            .subscribe(SubscribeRequest::default())
            .await
            .map_err(rpc("subscribe"))?
            .into_inner(),
    );
    let mut seen = 0u64;
    if args.count == Some(0) {
        return Ok(());
    }
    // The daemon delivers a notification to the subscribers it has when the data lands: say
    // when this one counts (scripts wait for this line before starting the transfer).
    match args.count {
        Some(n) => eprintln!("tcpxctl: subscribed; waiting for {n} notification(s)"),
        None => eprintln!("tcpxctl: subscribed; waiting for notifications (Ctrl-C to stop)"),
    }
    loop {
        let Some(live) = stream.as_mut() else {
            // The daemon stopped or restarts: subscribe again once it answers. Notifications of
            // transfers that finished meanwhile are not seen.
            tokio::select! {
                _ = tokio::time::sleep(RETRY) => {}
                _ = tokio::signal::ctrl_c() => return Ok(()),
            }
            match client.subscribe(SubscribeRequest::default()).await {
                Ok(s) => {
                    stream = Some(s.into_inner());
                    eprintln!("tcpxctl: subscribed again");
                }
                Err(e) if transient(&e) => {}
                Err(e) => return Err(rpc("subscribe")(e)),
            }
            continue;
        };
        let next = tokio::select! {
            m = live.message() => m,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let n = match next {
            Ok(Some(n)) => n,
            Ok(None) => {
                eprintln!(
                    "tcpxctl: the daemon ended the subscription (it stops or restarts); subscribing again when it answers (Ctrl-C to stop)"
                );
                stream = None;
                continue;
            }
            Err(e) if transient(&e) => {
                eprintln!(
                    "tcpxctl: the subscription failed ({}); subscribing again when the daemon answers (Ctrl-C to stop)",
                    e.message()
                );
                stream = None;
                continue;
            }
            Err(e) => return Err(rpc("subscription")(e)),
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

pub(super) async fn stats(client: &mut ApiClient, json: bool, args: StatsArgs) -> Result<(), CliError> {
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
            out!("{}", stats_text(&s, Rates::Off));
        }
        return Ok(());
    };
    let clear = !json && std::io::stdout().is_terminal();
    let mut previous = None;
    let mut shown = 0u64;
    let mut down = false;
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
        let s = match client.get_stats(GetStatsRequest {}).await {
            Ok(s) => {
                if std::mem::take(&mut down) {
                    eprintln!("tcpxctl: the daemon answers again");
                    previous = None; // a restarted daemon counts from zero: no rates across it
                }
                s.into_inner()
            }
            Err(e) if transient(&e) => {
                if !down {
                    eprintln!(
                        "tcpxctl: no answer from the daemon ({}); asking again every {every:?} (it may be restarting)",
                        e.message()
                    );
                    down = true;
                }
                continue;
            }
            Err(e) => return Err(rpc("stats")(e)),
        };
        let now = Instant::now();
        let wall = std::time::SystemTime::now();
        if json {
            // Each frame says when it was taken (the text frames' first line).
            let mut j = stats_json(&s);
            j["time_unix_ms"] = json!(
                wall.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64)
            );
            print_json(&j)?;
        } else {
            let rates = Rates::Watch(previous.as_ref().map(|(p, t): &(_, Instant)| (p, now - *t)));
            let text = stats_text(&s, rates);
            if clear {
                out!("\x1b[2J\x1b[H");
            } else if previous.is_some() {
                outln!();
            }
            outln!(
                "{} (every {}s; frame {})",
                utc_text(wall),
                every.as_secs_f64(),
                shown + 1
            );
            out!("{text}");
        }
        previous = Some((s, now));
        shown += 1;
        if args.count.is_some_and(|n| shown >= n) {
            return Ok(());
        }
    }
}

const SERVICE: &str = "tcpxd.v1.Tcpxd";

/// `tcpxctl health`: the gRPC health status of the client API service; with `--wait`, asked
/// again every 100 ms until it is SERVING or the time is up.
pub(super) async fn health(global: &GlobalOpts, args: HealthArgs) -> Result<(), CliError> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let deadline = args.wait.map(|w| Instant::now() + w);
    let status = loop {
        let answer = check_health(global).await;
        let serving = matches!(answer, Ok(ServingStatus::Serving));
        match deadline {
            Some(d) if !serving && Instant::now() < d => {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    _ = tokio::signal::ctrl_c() => return Err(CliError::Interrupted),
                }
            }
            _ => break answer?,
        }
    };
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

async fn check_health(
    global: &GlobalOpts,
) -> Result<tonic_health::pb::health_check_response::ServingStatus, CliError> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
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
    Ok(ServingStatus::try_from(r.status).unwrap_or(ServingStatus::Unknown))
}
