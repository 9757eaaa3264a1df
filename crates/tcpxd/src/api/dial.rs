//! Making the nodes a transfer's descriptors name reachable before its entries are checked: a
//! failed peer is paired again (`Peers::revive`), a node this daemon never met is connected at the
//! peer addresses its descriptor carries. Both go through `Peers::connect`, so they authenticate
//! as `ConnectPeer` does (cluster secret, mutual TLS) and concurrent first uses make one pairing.
//! A pairing still connecting is waited for, so a transfer starts on the pairing that comes up.
//! A pairing closed when idle is paired anew like a failed one, and a transfer the engine refused
//! because its pairing closed (or was closing) meanwhile is started again (`after_idle_close`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tonic::{Code, Status};

use super::state::{DaemonState, status};
use crate::block_token::BlockToken;
use crate::buffers::Descriptor;
use crate::engine::EngineError;
use crate::poller::{PeerLink, Refused};

/// How many times a transfer is started again after its pairing closed when idle: each needs a
/// close, which needs the pairing idle for `peer.pairing_idle_close_ms`, so a second is already
/// rare.
const IDLE_CLOSE_RETRIES: u32 = 4;

/// A pairing that failed or closed when idle: the next use pairs anew.
fn gone(link: &PeerLink) -> bool {
    matches!(link, PeerLink::Failed(_) | PeerLink::Idle)
}

/// The longest a first use waits for an address to accept a TCP connection before it asks
/// `Peers::connect` to dial it.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// A node named by a transfer's descriptors (or a token): which field named it first and its
/// addresses. The field's name is formatted only for an error.
struct Named<'a> {
    by: NamedBy<'a>,
    addresses: Vec<&'a str>,
}

/// The field that named a node first.
enum NamedBy<'a> {
    /// `entries[i].remote_descriptor`.
    Entry(usize),
    /// A field named as it is (a block-list token's).
    Field(&'a str),
}

impl Named<'_> {
    fn field(&self) -> String {
        match self.by {
            NamedBy::Entry(i) => format!("entries[{i}].remote_descriptor"),
            NamedBy::Field(f) => f.to_string(),
        }
    }
}

impl DaemonState {
    /// Re-pairs the failed peers and connects the never-met nodes the descriptors name: the
    /// batch's descriptors, each parsed once by the entry checks, with the index of the first
    /// entry naming it (descriptors of this node are skipped). A node that cannot be reached
    /// fails the call, naming the entry and every address tried.
    pub(crate) async fn reach_peers<'a>(
        &self,
        descriptors: impl Iterator<Item = (usize, &'a Descriptor)> + Clone,
        deadline: Instant,
    ) -> Result<(), Status> {
        // The usual case: every node named is this one or paired and up. Nothing to build, dial
        // or wait for (`reach` would do nothing either).
        if self.all_up(descriptors.clone().map(|(_, d)| d)) {
            return Ok(());
        }
        let mut nodes: BTreeMap<&str, Named<'_>> = BTreeMap::new();
        for (i, d) in descriptors {
            if d.node_id == self.node_id {
                continue;
            }
            let named = nodes.entry(d.node_id.as_str()).or_insert_with(|| Named {
                by: NamedBy::Entry(i),
                addresses: Vec::new(),
            });
            for a in &d.addresses {
                if !named.addresses.contains(&a.as_str()) {
                    named.addresses.push(a);
                }
            }
        }
        // Boxed: the dialling's state (a TCP probe, a pairing's handshake) is large, and a
        // transfer's start future holds this one; only this rare path allocates it.
        Box::pin(self.reach(nodes, deadline)).await
    }

    /// Whether every node the descriptors name is this one or paired and up (`reach_peers` has
    /// nothing to do then); looked at in place, not copied.
    pub(crate) fn all_up<'a>(&self, mut descriptors: impl Iterator<Item = &'a Descriptor>) -> bool {
        descriptors.all(|d| {
            d.node_id == self.node_id
                || self
                    .peers
                    .with_node(&d.node_id, |p| matches!(*p.link.borrow(), PeerLink::Up))
                    .unwrap_or(false)
        })
    }

    /// As `reach_peers`, for the node a block-list token names (`field`: the token's field).
    pub(crate) async fn reach_token(
        &self,
        field: &str,
        token: &BlockToken,
        deadline: Instant,
    ) -> Result<(), Status> {
        if token.node_id == self.node_id {
            return Ok(());
        }
        let nodes = BTreeMap::from([(
            token.node_id.as_str(),
            Named {
                by: NamedBy::Field(field),
                addresses: token.addresses.iter().map(String::as_str).collect(),
            },
        )]);
        self.reach(nodes, deadline).await
    }

    async fn reach(&self, nodes: BTreeMap<&str, Named<'_>>, deadline: Instant) -> Result<(), Status> {
        let mut failed = Vec::new();
        for (&node, named) in &nodes {
            match self.peers.by_node(node) {
                // Failed, closed when idle, or closing (`revive` waits for the answer first).
                Some(p)
                    if matches!(
                        *p.link.borrow(),
                        PeerLink::Failed(_) | PeerLink::Idle | PeerLink::Closing
                    ) && p.dial.is_some() =>
                {
                    failed.push(node);
                }
                Some(p) if matches!(*p.link.borrow(), PeerLink::Connecting) => {
                    // Still setting up, perhaps a pairing about to be replaced by the one the
                    // two nodes settle on (`peers/settle.rs`): start on the one that comes up.
                    // A failure is left to the entry checks, which name the peer and why.
                    let budget = deadline.saturating_duration_since(Instant::now());
                    let _ = tokio::time::timeout(budget, self.peers.until_up(node)).await;
                    if self
                        .peers
                        .by_node(node)
                        .is_some_and(|p| gone(&p.link.borrow()) && p.dial.is_some())
                    {
                        failed.push(node);
                    }
                }
                Some(p) if !gone(&p.link.borrow()) => {}
                // Never met, or failed (or closed when idle) with no address of its own: the
                // descriptor's addresses.
                _ if !named.addresses.is_empty() => self.dial(node, named, deadline).await?,
                _ => {}
            }
        }
        self.peers.revive(&failed, deadline).await
    }

    /// Connects to `node` at the first of its descriptor's addresses that answers as that node.
    async fn dial(&self, node: &str, named: &Named<'_>, deadline: Instant) -> Result<(), Status> {
        let mut tried = Vec::new();
        for a in &named.addresses {
            let budget = deadline.saturating_duration_since(Instant::now());
            // An address that does not take a TCP connection fails here, costing only this
            // call, not a pairing's connect timeout (30 s by default).
            match tokio::time::timeout(budget.min(PROBE_TIMEOUT), tokio::net::TcpStream::connect(*a)).await {
                Ok(Ok(_probe)) => {}
                Ok(Err(e)) => {
                    tried.push(format!("{a}: cannot reach a tcpxd peer service there: {e}"));
                    continue;
                }
                Err(_) => {
                    tried.push(format!(
                        "{a}: no TCP connection within {:?}",
                        budget.min(PROBE_TIMEOUT)
                    ));
                    continue;
                }
            }
            tracing::info!(peer = %node, address = %a, "connecting to a node named by a descriptor");
            match tokio::time::timeout(budget, self.peers.connect(a)).await {
                Ok(Ok(info)) if info.node_id == node => return Ok(()),
                Ok(Ok(info)) => tried.push(format!("{a} answers as node {}", info.node_id)),
                // Refusals that another address would not change (authentication, protocol):
                // reported as they are.
                Ok(Err(s)) if !matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded) => {
                    return Err(Status::new(
                        s.code(),
                        format!(
                            "{}: connecting to node {node} at {a}: {}",
                            named.field(),
                            s.message()
                        ),
                    ));
                }
                Ok(Err(s)) => tried.push(format!("{a}: {}", s.message())),
                Err(_) => tried.push(format!("{a}: no answer before the transfer's deadline")),
            }
            // Paired meanwhile by another call (through another of its addresses)?
            if self.peers.by_node(node).is_some_and(|p| !gone(&p.link.borrow())) {
                return Ok(());
            }
        }
        Err(Status::unavailable(format!(
            "{}: node {node} is not paired with this daemon and none of the descriptor's peer addresses answers as it: {}",
            named.field(),
            tried.join("; ")
        )))
    }

    /// After the engine refused a transfer: when only because a pairing it named closed when
    /// idle or is closing (`EngineError::closed_pairing`, engine `pair_life.rs`), waits for that
    /// close to settle and answers `Ok`, for the caller to start the transfer again from its
    /// `reach_*` (which pairs anew); otherwise, after `IDLE_CLOSE_RETRIES` such retries or past
    /// the deadline, the refusal as a status. A transfer never fails because its pairing had
    /// been closed.
    pub(crate) async fn after_idle_close(
        &self,
        e: EngineError,
        retries: &mut u32,
        deadline: Instant,
    ) -> Result<(), Status> {
        let Some(node) = e.closed_pairing.as_deref() else {
            return Err(status(e));
        };
        if *retries >= IDLE_CLOSE_RETRIES || Instant::now() >= deadline {
            return Err(status(e));
        }
        *retries += 1;
        tracing::debug!(peer = %node, "the transfer's pairing closed when idle: pairing again");
        self.peers.settle_close(node, deadline).await;
        Ok(())
    }

    /// As `after_idle_close`, for a start the poller refused with its request handed back: the
    /// request, to be started again once its node is reached anew.
    pub(crate) async fn start_again<T>(
        &self,
        refused: Refused<T>,
        retries: &mut u32,
        deadline: Instant,
    ) -> Result<T, Status> {
        match refused.again {
            Some(request) => {
                self.after_idle_close(refused.error, retries, deadline).await?;
                Ok(request)
            }
            None => Err(status(refused.error)),
        }
    }
}
