//! The callee side of pairing: the `Handshake` handler (authentication, then one pairing per node
//! under the node's lock) and the `Control` handler that binds a control stream to its handshake.

use std::net::SocketAddr;

use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use super::control_stream::{Outbound, OutboundResponse, spawn_inbound};
use super::settle::{Dialled, Slot};
use super::{
    PROTOCOL_VERSION, PeerInfo, Peers, PendingSession, ask, lane_to_pb, lanes_from_pb, topology_from_pb,
};
use crate::api::proto::peer as pb;
use crate::auth::{ClusterSecret, NONCE_BYTES, ProofOf, accept_fields, handshake_fields, hello_fields};
use crate::poller::{Command, PeerChannels, PeerLink};

impl Peers {
    /// Callee side of `Handshake`.
    pub async fn handshake(
        &self,
        req: pb::HandshakeRequest,
        from: String,
    ) -> Result<pb::HandshakeResponse, Status> {
        if req.protocol_version != PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "protocol_version: {} is not supported (this daemon speaks {PROTOCOL_VERSION})",
                req.protocol_version
            )));
        }
        // Authentication before anything else: an unauthenticated caller learns and opens nothing.
        let nonces = match &self.secret {
            Some(secret) => Some(self.authenticate(secret, &req, &from)?),
            None => None,
        };
        let answer_proof = |resp: &mut pb::HandshakeResponse| {
            if let (Some(secret), Some((server, client_nonce))) = (&self.secret, &nonces) {
                resp.proof = secret.prove(ProofOf::Accept, &accept_fields(server, client_nonce, resp));
            }
        };
        crate::config::check_node_id(&req.node_id).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if req.node_id == self.node_id {
            return Err(Status::invalid_argument(
                "node_id: a daemon cannot peer with itself",
            ));
        }
        let remote = lanes_from_pb(&req.lanes).map_err(Status::invalid_argument)?;
        let topology = topology_from_pb(req.topology.as_ref(), &remote).map_err(Status::invalid_argument)?;
        let dial = match (from.parse::<SocketAddr>(), u16::try_from(req.listen_port)) {
            (Ok(a), Ok(port)) if port != 0 => Some(SocketAddr::new(a.ip(), port).to_string()),
            _ => None,
        };
        // Under the node's lock: a second handshake from the node (through another of this
        // daemon's addresses, or crossing one this daemon sent) sees the first one's pairing.
        let slot = Slot::take(&self.pairing, &req.node_id);
        let settled = slot.lock.lock().await;
        // A pairing this daemon is closing counts as gone: the node dials only once its side
        // closed it (its answer is on the way on the old stream).
        let closing = |p: &PeerInfo| matches!(*p.link.borrow(), PeerLink::Closing);
        if self
            .by_node(&req.node_id)
            .is_some_and(|p| Self::usable(&p) && !closing(&p))
        {
            // Already paired (the caller reached us by another address, or both sides called):
            // keep the working pairing; session 0 and no lanes tell the caller to use it.
            let mut resp = pb::HandshakeResponse {
                protocol_version: PROTOCOL_VERSION,
                node_id: self.node_id.clone(),
                lanes: Vec::new(),
                session_id: 0,
                proof: Vec::new(),
                topology: self.topology.clone(),
                direct_token: Vec::new(),
            };
            answer_proof(&mut resp);
            return Ok(resp);
        }
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let (link_tx, link_rx) = watch::channel(PeerLink::Connecting);
        let (idx, mine) = ask(&self.poller, |reply| Command::AcceptPeer {
            node_id: req.node_id.clone(),
            remote: remote.clone(),
            topology,
            channels: PeerChannels {
                control: control_tx,
                link: link_tx,
            },
            reply,
        })
        .await?
        .map_err(|e| Status::unavailable(format!("setting up lanes: {e}")))?;
        let session_id: u64 = rand::random::<u64>().max(1);
        self.sessions.lock().unwrap_or_else(|e| e.into_inner()).insert(
            session_id,
            PendingSession {
                idx,
                node_id: req.node_id.clone(),
                outbound: control_rx,
                nonces,
            },
        );
        let previous = self.by_node.lock().unwrap_or_else(|e| e.into_inner()).insert(
            req.node_id.clone(),
            PeerInfo {
                node_id: req.node_id.clone(),
                address: from,
                idx,
                lanes: remote.len() as u32,
                link: link_rx,
                dial,
                dialled: Dialled::There,
            },
        );
        drop(settled);
        // A node reconnecting replaces its old pairing (failed: a usable one is kept above),
        // which fails whatever still used it. One closed when idle, or closing, is no failure:
        // the new pairing takes over its totals once it is closed (engine `pair_life.rs`).
        if let Some(old) =
            previous.filter(|p| !matches!(*p.link.borrow(), PeerLink::Idle | PeerLink::Closing))
        {
            let _ = self.poller.send(Command::PeerDown {
                peer: old.idx,
                reason: "the peer connected again".into(),
            });
        }
        // The caller must open its control stream before the lanes' timeout.
        let (poller, sessions, timeout) = (self.poller.clone(), self.sessions.clone(), self.connect_timeout);
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            let expired = sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&session_id)
                .is_some();
            if expired {
                let _ = poller.send(Command::PeerDown {
                    peer: idx,
                    reason: "the peer never opened its control stream".into(),
                });
            }
        });
        // A direct control connection's token (`direct.rs`), usable as long as the session.
        let direct_token = match self.direct_control {
            true => {
                let secret = self.secret.as_ref();
                let proof = |token: &[u8]| match (secret, &nonces) {
                    (Some(secret), Some((server, client_nonce))) => Some(secret.prove(
                        ProofOf::Direct,
                        &crate::auth::direct_fields(server, client_nonce, token),
                    )),
                    _ => None,
                };
                self.direct
                    .issue(idx, &req.node_id, proof, self.connect_timeout)
                    .to_vec()
            }
            false => Vec::new(),
        };
        let mut resp = pb::HandshakeResponse {
            protocol_version: PROTOCOL_VERSION,
            node_id: self.node_id.clone(),
            lanes: mine.iter().map(lane_to_pb).collect(),
            session_id,
            proof: Vec::new(),
            topology: self.topology.clone(),
            direct_token,
        };
        answer_proof(&mut resp);
        Ok(resp)
    }

    /// Checks a handshake's proof of the cluster secret; returns its (server, client) nonces.
    fn authenticate(
        &self,
        secret: &ClusterSecret,
        req: &pb::HandshakeRequest,
        from: &str,
    ) -> Result<([u8; NONCE_BYTES], [u8; NONCE_BYTES]), Status> {
        let refuse = |why: &str| {
            // The claimed node id is unchecked input: bounded and escaped in the log.
            let node: String = req.node_id.chars().take(128).collect();
            tracing::warn!(from = %from, node = %node.escape_debug(), "refused a handshake: {why}");
            Status::unauthenticated(format!("handshake refused: {why}"))
        };
        if req.server_nonce.is_empty() && req.proof.is_empty() {
            return Err(refuse(
                "this daemon requires peers to prove the cluster secret (peer.secret_file)",
            ));
        }
        if !self.challenges.take(&req.server_nonce) {
            return Err(refuse(
                "server_nonce: not a challenge this daemon issued, or one already used or expired (a replayed handshake?)",
            ));
        }
        let server: [u8; NONCE_BYTES] = req
            .server_nonce
            .as_slice()
            .try_into()
            .expect("taken: right length");
        let client_nonce: [u8; NONCE_BYTES] = req.client_nonce.as_slice().try_into().map_err(|_| {
            refuse(&format!(
                "client_nonce: {} bytes, expected {NONCE_BYTES}",
                req.client_nonce.len()
            ))
        })?;
        if !secret.check(
            ProofOf::Handshake,
            &handshake_fields(&server, &client_nonce, req),
            &req.proof,
        ) {
            return Err(refuse("proof: does not prove the cluster secret"));
        }
        Ok((server, client_nonce))
    }

    /// Callee side of `Control`: binds the stream to its handshake by the Hello's session id.
    pub async fn control(
        &self,
        req: Request<Streaming<pb::PeerMessage>>,
    ) -> Result<Response<OutboundResponse>, Status> {
        let mut inbound = req.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("control stream ended before its Hello"))?;
        let Some(pb::peer_message::Body::Hello(hello)) = first.body else {
            return Err(Status::invalid_argument(
                "the first control message must be a Hello",
            ));
        };
        let session = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&hello.session_id)
            .ok_or_else(|| Status::permission_denied("unknown or used session id"))?;
        if let (Some(secret), Some((server, client_nonce))) = (&self.secret, &session.nonces)
            && !secret.check(
                ProofOf::Hello,
                &hello_fields(server, client_nonce, hello.session_id, &hello.node_id),
                &hello.proof,
            )
        {
            tracing::warn!(peer = %session.node_id, "refused a control stream: its Hello does not prove the cluster secret");
            let _ = self.poller.send(Command::PeerDown {
                peer: session.idx,
                reason: "the control stream's Hello did not prove the cluster secret".into(),
            });
            return Err(Status::unauthenticated(
                "proof: the Hello does not prove the cluster secret",
            ));
        }
        if session.node_id != hello.node_id {
            let _ = self.poller.send(Command::PeerDown {
                peer: session.idx,
                reason: "control stream Hello named another node".into(),
            });
            return Err(Status::permission_denied(
                "the Hello names another node than the handshake",
            ));
        }
        spawn_inbound(
            self.poller.clone(),
            session.idx,
            session.node_id.clone(),
            inbound,
            self.heartbeat.timeout,
        );
        Ok(Response::new(OutboundResponse(Outbound::new(
            None,
            session.outbound,
            self.heartbeat.interval,
        ))))
    }
}
