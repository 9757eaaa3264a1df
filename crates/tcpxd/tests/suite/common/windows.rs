//! How many requests a daemon's lanes hold posted while a transfer runs, sampled through
//! GetStats: the window tests (`daemon_gather_ahead`, `daemon_scatter_ahead`) check that a lane
//! never holds more than its window plus what may be posted ahead.

use crate::common::daemons::{self, Client};
use tcpxd::api::proto::v1 as pb;

/// Which of a lane's posted requests are counted.
#[derive(Debug, Clone, Copy)]
pub enum Posted {
    Sends,
    Recvs,
}

impl Posted {
    fn noun(self) -> &'static str {
        match self {
            Posted::Sends => "sends",
            Posted::Recvs => "receives",
        }
    }
}

/// The most `kind` requests posted on one lane of `c`'s peers right now.
pub async fn most_posted(c: &mut Client, kind: Posted) -> u32 {
    let s = c
        .get_stats(pb::GetStatsRequest {})
        .await
        .expect("stats")
        .into_inner();
    s.peers
        .iter()
        .flat_map(|p| &p.lanes)
        .map(|l| match kind {
            Posted::Sends => l.sends_in_flight,
            Posted::Recvs => l.recvs_in_flight,
        })
        .max()
        .unwrap_or(0)
}

/// Waits for transfer `id` of `c`, sampling `on`'s lanes meanwhile: the most `kind` requests
/// seen posted on one lane, each sample at most `limit` (`bound` says which window and how far
/// ahead, in the failure).
pub async fn wait_sampling(
    c: &Client,
    id: u64,
    on: &mut Client,
    kind: Posted,
    limit: u32,
    bound: &str,
) -> u32 {
    let mut c = c.clone();
    let waiting = tokio::spawn(async move { daemons::wait(&mut c, id).await });
    let mut most = 0;
    while !waiting.is_finished() {
        let n = most_posted(on, kind).await;
        assert!(
            n <= limit,
            "{n} {} posted on a lane: {bound} at most",
            kind.noun()
        );
        most = most.max(n);
        tokio::time::sleep(std::time::Duration::from_micros(200)).await;
    }
    let ev = waiting.await.expect("the wait");
    assert_eq!(ev.status_code, 0, "transfer {id}: {}", ev.status_message);
    most
}
