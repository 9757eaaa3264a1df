//! Peers: the handshake (both sides), the ordered control stream of each peer, and conversions
//! between the engine's control messages and `tcpxd.peer.v1`.
//!
//! The daemon a client asks to `ConnectPeer` (the caller) opens listening comms for the lanes the
//! callee will send on, calls `Handshake` with their handles, gets the callee's handles back and
//! connects to them, then opens the `Control` stream (first message: `Hello` with the session id).
//! The callee does the mirror image inside its `Handshake` handler (`callee.rs`). A peer is up
//! once every lane in both directions is connected.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tonic::Status;

use crate::api::proto::peer as pb;
use crate::api::proto::peer::tcpxd_peer_client::TcpxdPeerClient;
use crate::auth::{
    self, Challenges, ClusterSecret, NONCE_BYTES, ProofOf, accept_fields, handshake_fields, hello_fields,
};
use crate::engine::{PeerIdx, PeerMsg};
use crate::net::ConnectHandle;
use crate::poller::{Command, LaneHandleInfo, PeerChannels, PeerLink};

mod callee;
mod control;

pub use control::{Malformed, OutboundResponse, msg_from_pb, msg_to_pb};
use control::{Outbound, spawn_inbound};

/// 3: `ReceiveMode` may split the lanes (auto: eager lanes and rendezvous lanes on one pairing),
/// which a protocol-2 sender would misread (it would plan eager chunks over every lane), so the
/// two refuse to pair.
pub const PROTOCOL_VERSION: u32 = 3;
/// The most lanes one direction of a pairing may have (a handshake with more is refused).
pub const MAX_LANES: usize = 64;
/// Largest control message (a 4096-range offer with a 1 MiB notification fits easily).
pub const MAX_CONTROL_MESSAGE: usize = 8 << 20;

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
}

/// A callee-side peer waiting for its control stream.
struct PendingSession {
    idx: PeerIdx,
    node_id: String,
    outbound: mpsc::UnboundedReceiver<PeerMsg>,
    answer: mpsc::WeakUnboundedSender<PeerMsg>,
    /// With a cluster secret: the handshake's (server, client) nonces, for the Hello's proof.
    nonces: Option<([u8; NONCE_BYTES], [u8; NONCE_BYTES])>,
}

/// All peers of this daemon.
pub struct Peers {
    node_id: String,
    poller: std_mpsc::Sender<Command>,
    connect_timeout: Duration,
    heartbeat: Heartbeat,
    by_node: Mutex<HashMap<String, PeerInfo>>,
    sessions: Arc<Mutex<HashMap<u64, PendingSession>>>,
    /// One lock per address being connected: two calls for one address make one peer, and a
    /// handshake that hangs on one address holds up no other (an entry lives while a call holds
    /// or waits for it).
    connecting: DialMap,
    /// The port of this daemon's peer service, announced in handshakes (0 until bound).
    listen_port: AtomicU16,
    /// The cluster secret peers must prove; `None`: peers are not authenticated.
    secret: Option<ClusterSecret>,
    challenges: Challenges,
    /// Mutual TLS to peers (their service requires it too).
    tls: Option<tonic::transport::ClientTlsConfig>,
}

fn unavailable_poller() -> Status {
    Status::unavailable("the daemon is shutting down")
}

async fn ask<T>(
    poller: &std_mpsc::Sender<Command>,
    make: impl FnOnce(oneshot::Sender<T>) -> Command,
) -> Result<T, Status> {
    let (tx, rx) = oneshot::channel();
    poller.send(make(tx)).map_err(|_| unavailable_poller())?;
    rx.await.map_err(|_| unavailable_poller())
}

impl Peers {
    pub fn new(
        node_id: &str,
        poller: std_mpsc::Sender<Command>,
        connect_timeout: Duration,
        heartbeat: Heartbeat,
    ) -> Peers {
        Peers {
            node_id: node_id.to_string(),
            poller,
            connect_timeout,
            heartbeat,
            by_node: Mutex::new(HashMap::new()),
            sessions: Arc::new(Mutex::new(HashMap::new())),
            connecting: Arc::new(Mutex::new(HashMap::new())),
            listen_port: AtomicU16::new(0),
            secret: None,
            challenges: Challenges::new(connect_timeout),
            tls: None,
        }
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

    /// Reconnects, before a transfer uses them, the named peers that failed and can be dialled
    /// again: the next use of a peer after it went down pairs anew, transparently. A peer that
    /// cannot be reached fails the call with UNAVAILABLE naming it.
    pub async fn revive(&self, nodes: &[&str], deadline: std::time::Instant) -> Result<(), Status> {
        for &node in nodes {
            let Some(p) = self.by_node(node) else { continue };
            let why = match &*p.link.borrow() {
                PeerLink::Failed(why) => why.clone(),
                _ => continue,
            };
            let Some(addr) = p.dial.clone() else { continue };
            let budget = deadline.saturating_duration_since(std::time::Instant::now());
            tracing::info!(peer = %node, address = %addr, "reconnecting to a failed peer");
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

    /// The peer for a node id, if connected (in any state).
    pub fn by_node(&self, node: &str) -> Option<PeerInfo> {
        self.by_node
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(node)
            .cloned()
    }

    fn usable(info: &PeerInfo) -> bool {
        !matches!(*info.link.borrow(), PeerLink::Failed(_))
    }

    /// Caller side of `ConnectPeer`.
    pub async fn connect(&self, address: &str) -> Result<PeerInfo, Status> {
        let slot = DialSlot::take(&self.connecting, address);
        let _guard = slot.lock.lock().await;
        self.connect_locked(address).await
    }

    /// A peer call's answer within the connect timeout: a peer that takes the connection and
    /// never answers fails the pairing instead of holding it forever.
    async fn bounded<T>(&self, what: &str, call: impl std::future::Future<Output = T>) -> Result<T, Status> {
        tokio::time::timeout(self.connect_timeout, call)
            .await
            .map_err(|_| Status::unavailable(format!("{what}: no answer within {:?}", self.connect_timeout)))
    }

    async fn connect_locked(&self, address: &str) -> Result<PeerInfo, Status> {
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
            .connect_timeout(self.connect_timeout);
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
            ..Default::default()
        };
        if let Some((secret, server, client_nonce)) = &auth {
            req.proof = secret.prove(ProofOf::Handshake, &handshake_fields(server, client_nonce, &req));
            req.server_nonce = server.to_vec();
            req.client_nonce = client_nonce.to_vec();
        }
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
        if resp.session_id == 0 || self.by_node(&resp.node_id).is_some_and(|p| Self::usable(&p)) {
            // Already paired with that node: use the existing pairing.
            return match self.by_node(&resp.node_id).filter(Self::usable) {
                Some(p) => self.wait_up(p).await,
                None => Err(Status::unavailable(format!(
                    "{address} (node {}) reports an existing pairing this daemon does not have; retry",
                    resp.node_id
                ))),
            };
        }
        let remote = lanes_from_pb(&resp.lanes).map_err(Status::failed_precondition)?;
        guard.defuse();
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let answer = control_tx.downgrade();
        let (link_tx, link_rx) = watch::channel(PeerLink::Connecting);
        let idx = ask(&self.poller, |reply| Command::CompletePeer {
            prepared,
            node_id: resp.node_id.clone(),
            remote: remote.clone(),
            channels: PeerChannels {
                control: control_tx,
                link: link_tx,
            },
            reply,
        })
        .await?
        .map_err(|e| Status::unavailable(format!("connecting lanes to {}: {e}", resp.node_id)))?;
        let info = PeerInfo {
            node_id: resp.node_id.clone(),
            address: address.to_string(),
            idx,
            lanes: remote.len() as u32,
            link: link_rx,
            dial: Some(address.to_string()),
        };
        self.by_node
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(info.node_id.clone(), info.clone());

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
            answer,
            idx,
            info.node_id.clone(),
            inbound,
            self.heartbeat.timeout,
        );
        self.wait_up(info).await
    }

    async fn wait_up(&self, info: PeerInfo) -> Result<PeerInfo, Status> {
        let mut link = info.link.clone();
        let wait = async {
            loop {
                match &*link.borrow_and_update() {
                    PeerLink::Up => return Ok(()),
                    PeerLink::Failed(why) => {
                        return Err(Status::unavailable(format!("peer {}: {why}", info.node_id)));
                    }
                    PeerLink::Connecting => {}
                }
                if link.changed().await.is_err() {
                    return Err(unavailable_poller());
                }
            }
        };
        match tokio::time::timeout(self.connect_timeout + Duration::from_secs(1), wait).await {
            Ok(r) => r.map(|_| info),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "peer {}: lanes not connected within {:?}",
                info.node_id, self.connect_timeout
            ))),
        }
    }
}

/// Addresses being dialled, each with the lock its calls take in turn.
type DialMap = Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>;

/// One address's place in `Peers::connecting`: its lock, and the entry removed when the last call
/// holding or waiting for it goes (cancelled calls included).
struct DialSlot {
    map: DialMap,
    address: String,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl DialSlot {
    fn take(map: &DialMap, address: &str) -> DialSlot {
        let lock = map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(address.to_string())
            .or_default()
            .clone();
        DialSlot {
            map: map.clone(),
            address: address.to_string(),
            lock,
        }
    }
}

impl Drop for DialSlot {
    fn drop(&mut self) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        // The map's reference and this one: nobody else holds or waits for this address.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.address);
        }
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
    poller: std_mpsc::Sender<Command>,
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

fn lane_to_pb(l: &LaneHandleInfo) -> pb::LaneHandle {
    pb::LaneHandle {
        lane: l.lane,
        device: l.device,
        handle: l.handle.0.to_vec(),
    }
}

fn lanes_from_pb(lanes: &[pb::LaneHandle]) -> Result<Vec<LaneHandleInfo>, String> {
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
            let handle =
                ConnectHandle::from_bytes(&l.handle).map_err(|e| format!("lanes[{i}].handle: {e}"))?;
            Ok(LaneHandleInfo {
                lane: l.lane,
                device: l.device,
                handle,
            })
        })
        .collect()
}
