//! The peer service (`tcpxd.peer.v1.TcpxdPeer`): the callee side of handshakes and control
//! streams; all logic lives in [`crate::peers`].

use std::sync::Arc;

use tonic::{Request, Response, Status, Streaming};

use super::proto::peer as pb;
use super::state::DaemonState;

pub struct PeerService {
    pub state: Arc<DaemonState>,
}

#[tonic::async_trait]
impl pb::tcpxd_peer_server::TcpxdPeer for PeerService {
    async fn challenge(
        &self,
        _: Request<pb::ChallengeRequest>,
    ) -> Result<Response<pb::ChallengeResponse>, Status> {
        self.state.peers.challenge().map(Response::new)
    }

    async fn handshake(
        &self,
        req: Request<pb::HandshakeRequest>,
    ) -> Result<Response<pb::HandshakeResponse>, Status> {
        let from = req.remote_addr().map(|a| a.to_string()).unwrap_or_default();
        let resp = self.state.peers.handshake(req.into_inner(), from).await?;
        Ok(Response::new(resp))
    }

    type ControlStream = crate::peers::OutboundResponse;

    async fn control(
        &self,
        req: Request<Streaming<pb::PeerMessage>>,
    ) -> Result<Response<Self::ControlStream>, Status> {
        self.state.peers.control(req).await
    }
}
