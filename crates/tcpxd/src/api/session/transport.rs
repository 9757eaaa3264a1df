//! A session's two sides as a transport supplies them: the request side ([`Requests`], yielding
//! [`Incoming`]) and the event side ([`Events`]), and the gRPC stream's own (the framed local
//! session's are in `crate::api::local`).

use std::future::Future;
use std::sync::Arc;

use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use crate::api::host_memory::{self, Attached};
use crate::api::local::inline::OffPollerHold;
use crate::api::local::outbox::Outbox;
use crate::api::proto::v1 as pb;

/// What a session's request side yields next.
pub enum Incoming {
    /// Boxed: a request is far larger than the other variants.
    Request(Box<pb::SessionRequest>),
    /// The client half-closed: no more requests; the open ones finish, then the session ends.
    HalfClosed,
    /// The client went away: the open transfers are cancelled.
    Gone,
    /// The client broke the transport's rules (a frame over the limit, one that does not
    /// decode): answered with one refusal under tag 0, then the session ends as for `Gone`.
    Broken(Status),
}

/// A session's request side.
pub trait Requests: Send {
    /// The next request, or why there is none.
    fn next(&mut self) -> impl Future<Output = Incoming> + Send;

    /// The file descriptor that came with the request `next` returned last (`register_host_fd`);
    /// a transport that cannot carry descriptors says so.
    fn attached(&mut self) -> Result<Attached, Status> {
        Err(host_memory::no_descriptors())
    }

    /// The `n` file descriptors that came with the request `next` returned last
    /// (`register_batch`), in order; a transport that cannot carry descriptors says so.
    fn attached_n(&mut self, _n: usize) -> Result<Vec<Attached>, Status> {
        Err(host_memory::no_descriptors())
    }

    /// Served on the poller's thread (`crate::poller::SessionWatch`): a hold that keeps the
    /// session's polls off that thread while it lives (a registration, a large request). `None`:
    /// the session runs on the runtime anyway.
    fn off_poller(&self) -> Option<OffPollerHold> {
        None
    }

    /// The poller's watch of this session's socket, when served there.
    fn watch(&self) -> Option<&Arc<crate::poller::SessionWatch>> {
        None
    }

    /// The bytes of the request `next` returned last, where the transport knows (else 0).
    fn last_len(&self) -> u64 {
        0
    }

    /// Attaches a request ring (`attach_request_ring`: src/api/local/ring.rs): `next` takes
    /// from it too, in the client's order. A transport without one says so.
    fn attach_ring(&mut self, _ring: crate::api::local::ring::Ring) -> Result<(), Status> {
        Err(Status::failed_precondition(
            "attach_request_ring: only on the framed local session (the gRPC stream cannot carry its memfd)",
        ))
    }

    /// The client's process, from the connection's peer credentials (`register_client_memory`);
    /// a transport without them says so.
    fn peer_pid(&self) -> Result<i32, Status> {
        Err(host_memory::no_peer_process())
    }
}

/// A session's event side.
pub trait Events: Send {
    /// Hands one event to the client; `Err` when the client is gone.
    fn send(&mut self, event: pb::SessionEvent) -> impl Future<Output = Result<(), Gone>> + Send;

    /// Resolves when the client is known to be gone though nothing is being sent. `reading`:
    /// whether the request side is still open (a transport that learns of the client's going
    /// from its request side only needs to watch once that side has ended).
    fn gone(&mut self, reading: bool) -> impl Future<Output = ()> + Send;

    /// Where other threads may push this session's events straight to the client (the framed
    /// session: src/api/local/outbox.rs): the session's transfers then end and its
    /// notifications arrive without its task (src/api/local/inline.rs). `None`: every event
    /// goes through `send`.
    fn outbox(&self) -> Option<Arc<Outbox>> {
        None
    }

    /// What the session's task waits on besides its own work: `Ok` once it has written events
    /// that others pushed and the socket did not take at once (the session looks again at its
    /// backlog), `Err` when the client is gone. Without an outbox: `gone`.
    fn attend(&mut self, reading: bool) -> impl Future<Output = Result<(), Gone>> + Send {
        async move {
            self.gone(reading).await;
            Err(Gone)
        }
    }
}

/// The session ended early: the client went away.
#[derive(Debug)]
pub struct Gone;

impl Requests for Streaming<pb::SessionRequest> {
    async fn next(&mut self) -> Incoming {
        match self.message().await {
            Ok(Some(req)) => Incoming::Request(Box::new(req)),
            Ok(None) => Incoming::HalfClosed,
            Err(status) => {
                tracing::debug!("session: the client went away: {status}");
                Incoming::Gone
            }
        }
    }
}

impl Events for mpsc::Sender<Result<pb::SessionEvent, Status>> {
    async fn send(&mut self, event: pb::SessionEvent) -> Result<(), Gone> {
        mpsc::Sender::send(self, Ok(event)).await.map_err(|_| Gone)
    }

    async fn gone(&mut self, _reading: bool) {
        self.closed().await
    }
}
