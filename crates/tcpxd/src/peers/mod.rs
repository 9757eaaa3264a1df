//! Peers: the handshake (both sides), the ordered control stream of each peer
//! (`control_stream.rs`), and conversions between the engine's control messages and
//! `tcpxd.peer.v1` (`control.rs`).
//!
//! The daemon a client asks to `ConnectPeer` (the caller) opens listening comms for the lanes the
//! callee will send on, calls `Handshake` with their handles, gets the callee's handles back and
//! connects to them, then opens the `Control` stream (first message: `Hello` with the session id).
//! The callee does the mirror image inside its `Handshake` handler (`callee.rs`). A peer is up
//! once every lane in both directions is connected. A node has one pairing however many of its
//! addresses are dialled, at once or not, and when two nodes dial each other at once
//! (`settle.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tonic::Status;

use crate::api::proto::peer as pb;
use crate::api::proto::peer::tcpxd_peer_client::TcpxdPeerClient;
use crate::auth::{
    self, Challenges, ClusterSecret, NONCE_BYTES, ProofOf, accept_fields, handshake_fields, hello_fields,
};
use crate::engine::PeerIdx;
use crate::poller::{Command, LaneInfo, PeerChannels, PeerLink};

mod callee;
mod control;
mod control_stream;
pub mod direct;
pub mod incoming;
mod packed_pb;
mod settle;
mod topology_pb;

pub use control::{Malformed, msg_from_pb, msg_to_pb};
pub use control_stream::OutboundResponse;
use control_stream::{Outbound, spawn_inbound};
pub use settle::Dialled;
use settle::{Dialing, LockMap, Settle, Slot};
use topology_pb::{topology_from_pb, topology_to_pb};

/// 3: `ReceiveMode` may split the lanes (auto: eager lanes and rendezvous lanes on one pairing),
/// which a protocol-2 sender would misread (it would plan eager chunks over every lane), so the
/// two refuse to pair.
/// 4: offers may be coalesced (cut as one stream of their ranges' total) or carry block lists; a
/// protocol-3 receiver would ignore `coalesced` and plan one chunk sequence per range, so every
/// lane would fall out of step: the two refuse to pair.
/// 5: `Notify`, a prepared transfer's notification sent after its last part; a protocol-4 daemon
/// would not understand it (the notification would be lost): the two refuse to pair.
/// 6 (session 18; gpu-credits' part): `GpuCredits` and streamed headers (`MoreChunks`): a
/// protocol-5 receiver would take a streamed header's first chunks for all of them and every
/// lane would fall out of step.
/// 6: lanes open on first use and close when idle (`LaneOpen`, `LaneListening`, `LaneClose`,
/// `LaneCloseAnswer` on the control stream; the handshake's lanes carry no handle): a protocol-5
/// daemon would wait for handles that never come: the two refuse to pair. Also 6 (gpu-routes):
/// the handshake's `topology` and `Accept.first_lane` route rendezvous lanes by memory pair
/// (engine `routes.rs`); a daemon without them would plan other lanes.
/// 6 (wire-ranges): `PackedRanges` in offers, headers and read requests (one buffer id and key,
/// packed offsets and lengths); a protocol-5 daemon would see an offer with no ranges.
/// 6 (routed-credits): a routed pairing's lane catalogue has an eager lane per route in every
/// memory pair, and `GpuCredits.buffer_gpus`; eager headers name those lanes (engine `routes.rs`).
/// 7 (routed-lanes): a routed pairing's lanes are its catalogue's only, numbered from 0 (the
/// layout's, never used there, no longer come first): a protocol-6 daemon would take every lane
/// number for another route.
/// 7 (session 19; numpy-zeros' part, same version): `CancelSeen`, the receiver's answer to `CancelOffer`, which
/// the sender waits for before it sends the offer's remaining chunks empty: a protocol-6 receiver
/// never answers, and the sender would hold them (and the lanes behind them) for ever.
/// 7 (session 19, idle-pairings): pairings close by agreement once idle (`PairingClose`,
/// `PairingCloseAnswer`, engine `pair_life.rs`); a protocol-6 daemon would take the message for
/// a broken stream and fail the pairing. (Other branches' protocol-7 changes are listed with
/// theirs.)
/// 8 (session 20, mixed-routes): a plain WRITE whose ranges lie in several memories goes as one
/// offer per memory pair (engine `route_parts.rs`), its notification sent after every part landed
/// as `Notify` with `buffer_ids`, the receiver's buffers it wrote: a protocol-7 daemon would
/// deliver it naming no buffer.
/// 9 (session 21, host-blocks): packed ranges on a uniform length's grid carry their offsets as
/// `u32` slots (`PackedRanges.offset_slots`, half the bytes of a 65,536-entry batch's request and
/// offer): a protocol-8 daemon would read no offsets.
/// 9 (session 21, poll-epoll): `Done.returned` carries the credits the receiver's last consume
/// returned (one message where a `Done` and a `Credits` went): a protocol-8 sender would drop
/// them and run out of credits.
/// 10 (session 22, notify-ctl): a header of one zero-byte range carrying a notification is a
/// notification alone (engine `notice.rs`): the receiver checks the key and offset, delivers it and
/// answers `Done`, with no chunk on any lane. A protocol-9 receiver would refuse its length, or,
/// receiving by rendezvous, take the header for a broken pairing.
/// 11 (session 23, inline): `InlineLimit` and `InlineTransfer` (engine `inline.rs`): small
/// transfers carried whole on the control connection; a protocol-10 daemon knows neither.
/// 12 (session 28, sendlanes): returned credits (`Credits.returned`, `Done.returned`) are sparse
/// (lane, count) pairs in new fields (engine `wire::ReturnedCredits`), not one count per lane; a
/// protocol-11 daemon would read none returned and its sender would stall.
pub const PROTOCOL_VERSION: u32 = 12;
/// The most lanes one direction of a pairing may have (a handshake with more is refused).
pub const MAX_LANES: usize = 64;
/// Largest control message: a block offer's header carries the receiver's indices and the
/// sender's lengths (up to 4,194,304 blocks: 32 MiB), a 4096-range offer a 1 MiB notification.
pub const MAX_CONTROL_MESSAGE: usize = 64 << 20;

/// HTTP/2 flow-control windows of the peer channel (both directions, set on the peer server and
/// on every peer endpoint). h2's defaults (64 KiB a stream and a connection) let a burst of
/// control messages out one window at a time, each waiting for the reader's WINDOW_UPDATE: a
/// NIXL pull's 32 read requests (~8 KiB each, their index ranges) and the holder's 32 block
/// offers took 0.3–0.8 ms a direction to cross on one host (hop traces, 2 × H200), all before
/// the first byte of data moved. The inbound side reads each message at once
/// (`control_stream::spawn_inbound`), so the window bounds nothing the daemon holds for long.
pub const CONTROL_STREAM_WINDOW: u32 = 8 << 20;
/// See [`CONTROL_STREAM_WINDOW`]: the connection's window, over its one control stream and the
/// handshakes.
pub const CONTROL_CONNECTION_WINDOW: u32 = 16 << 20;

/// Liveness on the control stream: each side sends a heartbeat whenever its stream has been
/// quiet for `interval`; a stream silent for `timeout` fails its peer.
#[derive(Debug, Clone, Copy)]
pub struct Heartbeat {
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat {
            interval: Duration::from_millis(crate::config::DEFAULT_HEARTBEAT_INTERVAL_MS),
            timeout: Duration::from_millis(crate::config::DEFAULT_HEARTBEAT_TIMEOUT_MS),
        }
    }
}

#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub node_id: String,
    pub address: String,
    pub idx: PeerIdx,
    pub lanes: u32,
    pub link: watch::Receiver<PeerLink>,
    /// Where this daemon can reach the peer's service again (the caller side knows the address
    /// it dialled; the callee side the caller's address with the port its handshake announced).
    pub dial: Option<String>,
    /// Who dialled this pairing: this daemon or the peer.
    pub dialled: Dialled,
}

/// A callee-side peer waiting for its control stream.
struct PendingSession {
    idx: PeerIdx,
    node_id: String,
    outbound: mpsc::UnboundedReceiver<crate::poller::ControlOut>,
    /// With a cluster secret: the handshake's (server, client) nonces, for the Hello's proof.
    nonces: Option<([u8; NONCE_BYTES], [u8; NONCE_BYTES])>,
}

/// All peers of this daemon.
pub struct Peers {
    node_id: String,
    poller: crate::poller::PollerTx,
    connect_timeout: Duration,
    heartbeat: Heartbeat,
    by_node: Mutex<HashMap<String, PeerInfo>>,
    sessions: Arc<Mutex<HashMap<u64, PendingSession>>>,
    /// One lock per address being connected: two calls for one address make one peer, and a
    /// handshake that hangs on one address holds up no other (an entry lives while a call holds
    /// or waits for it).
    connecting: LockMap,
    /// One lock per node id: every change to a node's pairing (the callee's accept, the
    /// caller's settling once the answer names the node) happens under it (`settle.rs`).
    pairing: LockMap,
    /// Dials between their handshake and the moment they settled.
    dialing: watch::Sender<usize>,
    /// The port of this daemon's peer service, announced in handshakes (0 until bound).
    listen_port: AtomicU16,
    /// The cluster secret peers must prove; `None`: peers are not authenticated.
    secret: Option<ClusterSecret>,
    challenges: Challenges,
    /// Mutual TLS to peers (their service requires it too).
    tls: Option<tonic::transport::ClientTlsConfig>,
    /// This node's topology as its handshakes announce it.
    topology: Option<pb::PeerTopology>,
    /// Direct control connections (`direct.rs`): the tokens this daemon issued as a callee, and
    /// the poller's channel the connections' readers use.
    direct: Arc<direct::DirectAcceptor>,
    /// `peer.direct_control`, and no mutual TLS: pairings use direct control connections.
    direct_control: bool,
}

fn unavailable_poller() -> Status {
    Status::unavailable("the daemon is shutting down")
}

async fn ask<T>(
    poller: &crate::poller::PollerTx,
    make: impl FnOnce(oneshot::Sender<T>) -> Command,
) -> Result<T, Status> {
    let (tx, rx) = oneshot::channel();
    poller.send(make(tx)).map_err(|_| unavailable_poller())?;
    rx.await.map_err(|_| unavailable_poller())
}

impl Peers {
    pub fn new(
        node_id: &str,
        poller: crate::poller::PollerTx,
        connect_timeout: Duration,
        heartbeat: Heartbeat,
    ) -> Peers {
        Peers {
            node_id: node_id.to_string(),
            direct: Arc::new(direct::DirectAcceptor::new(poller.clone())),
            poller,
            connect_timeout,
            heartbeat,
            by_node: Mutex::new(HashMap::new()),
            sessions: Arc::new(Mutex::new(HashMap::new())),
            connecting: Arc::new(Mutex::new(HashMap::new())),
            pairing: Arc::new(Mutex::new(HashMap::new())),
            dialing: watch::channel(0).0,
            listen_port: AtomicU16::new(0),
            secret: None,
            challenges: Challenges::new(connect_timeout),
            tls: None,
            topology: None,
            direct_control: false,
        }
    }

    /// Offers and uses direct control connections (`peer.direct_control`; the daemon never
    /// turns it on under mutual TLS: the connection is plain TCP).
    pub fn with_direct_control(mut self, on: bool) -> Peers {
        self.direct_control = on;
        self
    }

    /// Where the peer port's accept path hands direct control connections (`incoming.rs`).
    pub fn direct_acceptor(&self) -> Arc<direct::DirectAcceptor> {
        self.direct.clone()
    }

    /// Announces this topology in every handshake (without: none, as a node without GPUs).
    pub fn with_topology(
        mut self,
        topology: &crate::engine::topology::Topology,
        lanes_per_route: u32,
    ) -> Peers {
        self.topology = Some(topology_to_pb(topology, lanes_per_route));
        self
    }

    /// Requires peers to prove this cluster secret (both directions).
    pub fn with_secret(mut self, secret: Option<ClusterSecret>) -> Peers {
        self.secret = secret;
        self
    }

    /// Dials peers over mutual TLS.
    pub fn with_tls(mut self, tls: Option<tonic::transport::ClientTlsConfig>) -> Peers {
        self.tls = tls;
        self
    }

    /// Callee side of `Challenge`.
    pub fn challenge(&self) -> Result<pb::ChallengeResponse, Status> {
        if self.secret.is_none() {
            return Err(Status::failed_precondition(
                "challenge: this daemon runs without a cluster secret (peer.secret_file); the two daemons' settings differ",
            ));
        }
        Ok(pb::ChallengeResponse {
            server_nonce: self.challenges.issue().to_vec(),
        })
    }

    /// Records the port the peer service listens on, for handshakes to announce.
    pub fn set_listen_port(&self, port: u16) {
        self.listen_port.store(port, Ordering::Relaxed);
    }

    /// Reconnects, before a transfer uses them, the named peers that failed or whose pairing
    /// closed when idle (waiting first for a close under way to settle), when they can be
    /// dialled again: the next use of a peer pairs anew, transparently. A peer that cannot be
    /// reached fails the call with UNAVAILABLE naming it.
    pub async fn revive(
        self: &Arc<Self>,
        nodes: &[&str],
        deadline: std::time::Instant,
    ) -> Result<(), Status> {
        for &node in nodes {
            self.settle_close(node, deadline).await;
            let Some(p) = self.by_node(node) else { continue };
            let why = match &*p.link.borrow() {
                PeerLink::Failed(why) => why.clone(),
                PeerLink::Idle => "its pairing closed when idle".to_string(),
                _ => continue,
            };
            let Some(addr) = p.dial.clone() else { continue };
            let budget = deadline.saturating_duration_since(std::time::Instant::now());
            if matches!(*p.link.borrow(), PeerLink::Idle) {
                tracing::debug!(peer = %node, address = %addr, "pairing again with a peer whose pairing closed when idle");
            } else {
                tracing::info!(peer = %node, address = %addr, "reconnecting to a failed peer");
            }
            let again = tokio::time::timeout(budget, self.connect(&addr)).await;
            let got = match again {
                Ok(Ok(info)) => info,
                Ok(Err(s)) => {
                    return Err(Status::unavailable(format!(
                        "peer {node} is down ({why}); reconnecting to {addr} failed: {}",
                        s.message()
                    )));
                }
                Err(_) => {
                    return Err(Status::unavailable(format!(
                        "peer {node} is down ({why}); reconnecting to {addr} did not finish before the deadline"
                    )));
                }
            };
            if got.node_id != node {
                return Err(Status::unavailable(format!(
                    "peer {node} is down ({why}); {addr} now answers as node {}",
                    got.node_id
                )));
            }
        }
        Ok(())
    }

    pub fn list(&self) -> Vec<PeerInfo> {
        let mut v: Vec<PeerInfo> = self
            .by_node
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        v
    }

    /// `f` of the peer for a node id, if connected (in any state), without a copy of it (the
    /// transfers' checks: no allocation a request). `f` runs under the peers' lock.
    pub fn with_node<R>(&self, node: &str, f: impl FnOnce(&PeerInfo) -> R) -> Option<R> {
        self.by_node
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .map(f)
    }

    /// The peer for a node id, if connected (in any state).
    pub fn by_node(&self, node: &str) -> Option<PeerInfo> {
        self.by_node
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .cloned()
    }

    /// Waits until the pairing with `node` is up, following it to the pairing that replaced it
    /// when two handshakes settled (`settle.rs`). Nothing to wait for without a pairing.
    pub async fn until_up(&self, node: &str) -> Result<(), Status> {
        match self.by_node(node) {
            Some(p) => self.wait_up(p).await.map(|_| ()),
            None => Ok(()),
        }
    }

    /// Up, connecting or closing (a close may still be answered "kept"): not failed, not
    /// closed when idle.
    fn usable(info: &PeerInfo) -> bool {
        !matches!(*info.link.borrow(), PeerLink::Failed(_) | PeerLink::Idle)
    }

    /// Waits (bounded by `deadline`) while this daemon asks `node` to close their pairing when
    /// idle (`PeerLink::Closing`): the answer makes it `Up` again or `Idle`.
    pub async fn settle_close(&self, node: &str, deadline: std::time::Instant) {
        let Some(p) = self.by_node(node) else { return };
        let mut link = p.link.clone();
        let budget = deadline.saturating_duration_since(std::time::Instant::now());
        let _ = tokio::time::timeout(budget, link.wait_for(|l| !matches!(l, PeerLink::Closing))).await;
    }

    /// Caller side of `ConnectPeer`. The dial runs as a task of its own, which the caller
    /// awaits: a caller that goes away meanwhile (a client cancelling its ConnectPeer, as a
    /// Python agent's pairing ahead is when its remote agent is loaded again; a caller's budget
    /// running out) does not cut it short. Cut between the poller's making the pairing and the
    /// control stream's opening, it left the pairing connecting for good here while the callee
    /// failed its side, and every transfer to that node waited on it (python
    /// test_nixl_single.py under CPU load: the first READ still "PROC" after 30 s).
    pub async fn connect(self: &Arc<Self>, address: &str) -> Result<PeerInfo, Status> {
        let (peers, address) = (self.clone(), address.to_string());
        tokio::spawn(async move {
            let slot = Slot::take(&peers.connecting, &address);
            let _guard = slot.lock.lock().await;
            peers.connect_locked(&address).await
        })
        .await
        .unwrap_or_else(|e| Err(Status::internal(format!("connecting to a peer: {e}"))))
    }

    /// A peer call's answer within the connect timeout: a peer that takes the connection and
    /// never answers fails the pairing instead of holding it forever.
    async fn bounded<T>(&self, what: &str, call: impl std::future::Future<Output = T>) -> Result<T, Status> {
        tokio::time::timeout(self.connect_timeout, call)
            .await
            .map_err(|_| Status::unavailable(format!("{what}: no answer within {:?}", self.connect_timeout)))
    }

    async fn connect_locked(&self, address: &str) -> Result<PeerInfo, Status> {
        // A close under way settles first: kept, it is used; closed, the node is dialled anew.
        if let Some(p) = self.list().into_iter().find(|p| p.address == address) {
            let deadline = std::time::Instant::now() + self.connect_timeout;
            self.settle_close(&p.node_id, deadline).await;
        }
        if let Some(p) = self
            .list()
            .into_iter()
            .find(|p| p.address == address && Self::usable(p))
        {
            return self.wait_up(p).await;
        }
        let uri = match (address.split_once("://"), &self.tls) {
            (Some(_), _) => address.to_string(),
            (None, Some(_)) => format!("https://{address}"),
            (None, None) => format!("http://{address}"),
        };
        let mut endpoint = tonic::transport::Endpoint::from_shared(uri)
            .map_err(|e| {
                Status::invalid_argument(format!("address: {address:?} is not a valid host:port ({e})"))
            })?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .initial_stream_window_size(CONTROL_STREAM_WINDOW)
            .initial_connection_window_size(CONTROL_CONNECTION_WINDOW);
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| Status::invalid_argument(format!("address: {address:?}: TLS: {e}")))?;
        }
        let channel = endpoint.connect().await.map_err(|e| {
            Status::unavailable(format!(
                "address: cannot reach a tcpxd peer service at {address}: {e}"
            ))
        })?;
        let mut client = TcpxdPeerClient::new(channel)
            .max_decoding_message_size(MAX_CONTROL_MESSAGE)
            .max_encoding_message_size(MAX_CONTROL_MESSAGE);

        // With a secret: the callee's challenge first, so the handshake can prove the secret.
        let auth = match &self.secret {
            Some(secret) => {
                let ch = self
                    .bounded(
                        &format!("challenge from {address}"),
                        client.challenge(pb::ChallengeRequest {
                            node_id: self.node_id.clone(),
                        }),
                    )
                    .await?
                    .map_err(|s| remote_error(s, &format!("challenge from {address}")))?
                    .into_inner();
                let server: [u8; NONCE_BYTES] = ch.server_nonce.as_slice().try_into().map_err(|_| {
                    Status::unauthenticated(format!(
                        "{address} sent a {}-byte challenge, expected {NONCE_BYTES}",
                        ch.server_nonce.len()
                    ))
                })?;
                Some((secret, server, auth::nonce()))
            }
            None => None,
        };
        let (prepared, lanes) = ask(&self.poller, |reply| Command::PrepareLanes { reply })
            .await?
            .map_err(|e| Status::internal(format!("opening lanes: {e}")))?;
        // Until CompletePeer takes them, the prepared listens are closed on any early return.
        let guard = PreparedGuard {
            poller: self.poller.clone(),
            prepared: Some(prepared),
        };
        let mut req = pb::HandshakeRequest {
            protocol_version: PROTOCOL_VERSION,
            node_id: self.node_id.clone(),
            lanes: lanes.iter().map(lane_to_pb).collect(),
            listen_port: self.listen_port.load(Ordering::Relaxed) as u32,
            topology: self.topology.clone(),
            ..Default::default()
        };
        if let Some((secret, server, client_nonce)) = &auth {
            req.proof = secret.prove(ProofOf::Handshake, &handshake_fields(server, client_nonce, &req));
            req.server_nonce = server.to_vec();
            req.client_nonce = client_nonce.to_vec();
        }
        // Counted from here until this dial recorded, joined or gave up a pairing: a dial told
        // "already paired" that finds no pairing yet waits for the others (`Settle::WaitForOthers`).
        let mut dialing = Dialing::start(&self.dialing);
        let resp = self
            .bounded(&format!("handshake with {address}"), client.handshake(req))
            .await?
            .map_err(|s| remote_error(s, &format!("handshake with {address}")))?
            .into_inner();
        if let Some((secret, server, client_nonce)) = &auth
            && !secret.check(
                ProofOf::Accept,
                &accept_fields(server, client_nonce, &resp),
                &resp.proof,
            )
        {
            tracing::warn!(address = %address, "refused a peer: its answer does not prove the cluster secret");
            return Err(Status::unauthenticated(format!(
                "handshake with {address}: the answer does not prove the cluster secret"
            )));
        }
        if resp.protocol_version != PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "{address} speaks peer protocol {}, this daemon {PROTOCOL_VERSION}",
                resp.protocol_version
            )));
        }
        crate::config::check_node_id(&resp.node_id)
            .map_err(|e| Status::failed_precondition(format!("{address} sent a bad node id: {e}")))?;
        if resp.node_id == self.node_id {
            return Err(Status::invalid_argument(format!(
                "address: {address} is this daemon itself (node {})",
                self.node_id
            )));
        }
        // The answer names the node: settle against this daemon's pairing with it, under the
        // node's lock (`settle.rs`).
        let node = resp.node_id.clone();
        let slot = Slot::take(&self.pairing, &node);
        let settling = slot.lock.lock().await;
        let existing = self.by_node(&node).filter(Self::usable);
        let step = settle::after_handshake(
            &self.node_id,
            &node,
            resp.session_id,
            existing.as_ref().map(|p| p.dialled),
        );
        let existing = match (step, existing) {
            (Settle::Join, Some(p)) => {
                drop(settling);
                dialing.settle();
                return self.wait_up(p).await;
            }
            (Settle::WaitForOthers, _) => {
                drop(settling);
                dialing.settle();
                return match self.after_other_dials(&node).await {
                    Some(p) => self.wait_up(p).await,
                    None => Err(Status::unavailable(format!(
                        "{address} (node {node}) reports an existing pairing this daemon does not have; retry"
                    ))),
                };
            }
            (_, existing) => existing,
        };
        let remote = lanes_from_pb(&resp.lanes).map_err(Status::failed_precondition)?;
        let topology = topology_from_pb(resp.topology.as_ref(), &remote)
            .map_err(|e| Status::failed_precondition(format!("{address} (node {node}) sent a bad {e}")))?;
        guard.defuse();
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let (link_tx, link_rx) = watch::channel(PeerLink::Connecting);
        let idx = ask(&self.poller, |reply| Command::CompletePeer {
            prepared,
            node_id: node.clone(),
            remote: remote.clone(),
            topology,
            channels: PeerChannels {
                control: control_tx,
                link: link_tx,
            },
            reply,
        })
        .await?
        .map_err(|e| Status::unavailable(format!("connecting lanes to {node}: {e}")))?;
        let info = PeerInfo {
            node_id: node.clone(),
            address: address.to_string(),
            idx,
            lanes: remote.len() as u32,
            link: link_rx,
            dial: Some(address.to_string()),
            dialled: Dialled::Here,
        };
        self.by_node
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(node.clone(), info.clone());
        if let Some(old) = existing {
            let why = match old.dialled {
                Dialled::Here => format!(
                    "replaced by a new pairing ({node} answered a new session: it no longer has this one)"
                ),
                Dialled::There => format!(
                    "superseded: {} and {node} dialled each other at once; the pairing {} dialled stays",
                    self.node_id, self.node_id
                ),
            };
            tracing::info!(peer = %node, "{why}");
            self.retire(&old, why);
        }
        drop(settling);
        dialing.settle();

        // The control stream: Hello, then whatever the poller sends this peer.
        let hello = pb::PeerMessage {
            body: Some(pb::peer_message::Body::Hello(pb::Hello {
                session_id: resp.session_id,
                node_id: self.node_id.clone(),
                proof: match &auth {
                    Some((secret, server, client_nonce)) => secret.prove(
                        ProofOf::Hello,
                        &hello_fields(server, client_nonce, resp.session_id, &self.node_id),
                    ),
                    None => Vec::new(),
                },
            })),
        };
        // The caller's request stream carries bare messages: the pump never yields an error.
        let outbound = Outbound::new(Some(hello), control_rx, self.heartbeat.interval);
        let opened = self
            .bounded(
                &format!("control stream to {}", info.node_id),
                client.control(outbound),
            )
            .await
            .and_then(|r| r);
        let inbound = match opened {
            Ok(r) => r.into_inner(),
            Err(s) => {
                let why = format!("control stream to {}: {}", info.node_id, s.message());
                let _ = self.poller.send(Command::PeerDown {
                    peer: idx,
                    reason: why.clone(),
                });
                return Err(Status::unavailable(why));
            }
        };
        spawn_inbound(
            self.poller.clone(),
            idx,
            info.node_id.clone(),
            inbound,
            self.heartbeat.timeout,
        );
        // The direct control connection, when the callee offers one: set up before the pairing
        // is handed out, so its first transfer uses it. One that cannot be set up leaves the
        // pairing on its control stream (the callee switches only once this side did).
        if self.direct_control && !resp.direct_token.is_empty() {
            let proof = auth.as_ref().map(|(secret, server, client_nonce)| {
                secret.prove(
                    ProofOf::Direct,
                    &auth::direct_fields(server, client_nonce, &resp.direct_token),
                )
            });
            if let Err(why) = self
                .direct
                .dial(address, idx, &resp.direct_token, proof, self.connect_timeout)
                .await
            {
                tracing::warn!(peer = %info.node_id, %address, "direct control connection not set up ({why}): the pairing's control messages stay on its HTTP/2 stream");
            }
        }
        self.wait_up(info).await
    }

    /// Waits until the pairing is up. A pairing that fails because another replaced it (two
    /// handshakes settled, `settle.rs`) hands the wait on to the one that replaced it.
    async fn wait_up(&self, info: PeerInfo) -> Result<PeerInfo, Status> {
        let node = info.node_id.clone();
        let wait = async {
            let mut info = info;
            let mut link = info.link.clone();
            loop {
                let failed = match &*link.borrow_and_update() {
                    PeerLink::Up | PeerLink::Closing => return Ok(info),
                    PeerLink::Failed(why) => Some(why.clone()),
                    PeerLink::Idle => Some("its pairing closed when idle".to_string()),
                    PeerLink::Connecting => None,
                };
                if let Some(why) = failed {
                    match self.by_node(&node).filter(Self::usable) {
                        Some(next) if next.idx != info.idx => {
                            link = next.link.clone();
                            info = next;
                            continue;
                        }
                        _ => return Err(Status::unavailable(format!("peer {node}: {why}"))),
                    }
                }
                if link.changed().await.is_err() {
                    return Err(unavailable_poller());
                }
            }
        };
        match tokio::time::timeout(self.connect_timeout + Duration::from_secs(1), wait).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(format!(
                "peer {node}: lanes not connected within {:?}",
                self.connect_timeout
            ))),
        }
    }

    /// After this daemon's other dials (any node) have settled: its usable pairing with `node`.
    async fn after_other_dials(&self, node: &str) -> Option<PeerInfo> {
        let mut count = self.dialing.subscribe();
        // Bounded: each of those dials gives up within its own connect timeout.
        let _ = tokio::time::timeout(self.connect_timeout, count.wait_for(|n| *n == 0)).await;
        self.by_node(node).filter(Self::usable)
    }

    /// Fails a pairing another replaced, and forgets its control stream if it never opened. A
    /// superseded one never came up (the peer dropped its side of that handshake), and transfers
    /// wait for a connecting pairing (`until_up`); one the peer answered a new session for is
    /// gone there already, so what still used it fails with it, as it would have anyway.
    fn retire(&self, old: &PeerInfo, reason: String) {
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, s| s.idx != old.idx);
        let _ = self.poller.send(Command::PeerDown {
            peer: old.idx,
            reason,
        });
    }
}

/// A peer call's error, prefixed: the peer's own refusals keep their code; a connection that
/// broke underneath (a TLS or protocol mismatch shows as CANCELLED or UNKNOWN) is UNAVAILABLE.
fn remote_error(s: Status, what: &str) -> Status {
    let code = match s.code() {
        tonic::Code::Cancelled | tonic::Code::Unknown => tonic::Code::Unavailable,
        c => c,
    };
    Status::new(code, format!("{what}: {}", s.message()))
}

/// Closes prepared listening comms unless the handshake got far enough to use them.
struct PreparedGuard {
    poller: crate::poller::PollerTx,
    prepared: Option<u64>,
}

impl PreparedGuard {
    fn defuse(mut self) {
        self.prepared = None;
    }
}

impl Drop for PreparedGuard {
    fn drop(&mut self) {
        if let Some(prepared) = self.prepared.take() {
            let _ = self.poller.send(Command::DropPrepared { prepared });
        }
    }
}

fn lane_to_pb(l: &LaneInfo) -> pb::LaneHandle {
    pb::LaneHandle {
        lane: l.lane,
        device: l.device,
        // Protocol 6: the handle comes on the control stream when the lane is first used.
        handle: Vec::new(),
    }
}

fn lanes_from_pb(lanes: &[pb::LaneHandle]) -> Result<Vec<LaneInfo>, String> {
    if lanes.is_empty() || lanes.len() > MAX_LANES {
        return Err(format!("lanes: {} lanes (1 to {MAX_LANES} allowed)", lanes.len()));
    }
    lanes
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if l.lane as usize != i {
                return Err(format!("lanes[{i}].lane: expected {i}, got {}", l.lane));
            }
            if !l.handle.is_empty() {
                return Err(format!(
                    "lanes[{i}].handle: {} bytes, but since peer protocol 6 a lane's handle comes on the control stream at its first use (LaneListening): the handshake carries none",
                    l.handle.len()
                ));
            }
            Ok(LaneInfo {
                lane: l.lane,
                device: l.device,
            })
        })
        .collect()
}
