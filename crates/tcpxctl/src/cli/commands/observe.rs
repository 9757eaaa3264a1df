//! Watching the daemon rather than moving data: `subscribe` (notifications), `stats` (once or
//! refreshed) and `health` (the gRPC health service).

use std::time::Instant;

use serde_json::json;

use crate::cli::args::{GlobalOpts, StatsArgs, SubscribeArgs};
use crate::cli::error::{CliError, print_json, rpc};
use crate::cli::output::{notification_json, notification_text, stats_json, stats_text};
use crate::client::ApiClient;
use tcpxd::api::proto::v1::{GetStatsRequest, SubscribeRequest};

pub(super) async fn subscribe(
    client: &mut ApiClient,
    json: bool,
    args: SubscribeArgs,
) -> Result<(), CliError> {
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
pub(super) async fn health(global: &GlobalOpts) -> Result<(), CliError> {
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
