//! A peer's ordered control stream: the outbound stream tonic polls (messages and heartbeats)
//! and the task that forwards inbound messages to the poller. The messages' conversions to and
//! from `tcpxd.peer.v1` are `control.rs`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Sleep;
use tokio_stream::Stream;
use tonic::{Status, Streaming};

use super::control::{Malformed, msg_from_pb, msg_to_pb};
use crate::api::proto::peer as pb;
use crate::engine::PeerIdx;
use crate::poller::{Command, ControlOut};

/// How many messages [`Outbound`] hands over in a row before it lets its task yield (twice: once
/// for tonic's encoder to pass on what it buffered, once for the task itself). hyper drains a
/// ready body into HTTP/2's send buffer before the connection task writes a byte, so a burst —
/// a NIXL pull's 32 read requests or block offers of ~8 KiB each — left whole only once the last
/// was encoded (~260 µs after the first, hop traces on two H200s). The yields go through
/// tokio's `yield_now`, which wakes the task only after the others that are ready (the
/// connection task among them) had their turn.
const BURST: u32 = 4;

/// A peer's outbound control stream: the messages the poller sends this peer, plus a heartbeat
/// whenever it has been quiet for `interval`; it ends when the poller drops the peer's channel.
/// tonic polls it directly as the request (caller) or response (callee) body, so a message the
/// poller sends goes onto the wire with no task in between.
///
/// # Order
/// Messages leave in the order the poller sent them: the stream only ever returns the channel's
/// next message, a heartbeat while it is empty, or `Pending` (after [`BURST`] in a row, with its
/// task's wake already arranged by `yield_now`, so no wake-up is lost).
pub(super) struct Outbound {
    first: Option<pb::PeerMessage>,
    control: mpsc::UnboundedReceiver<ControlOut>,
    interval: Duration,
    quiet: Pin<Box<Sleep>>,
    seq: u64,
    /// Messages handed over since the task last yielded.
    burst: u32,
    /// `Pending`s still to return before the next message (see [`BURST`]).
    yields: u8,
}

impl Outbound {
    pub(super) fn new(
        first: Option<pb::PeerMessage>,
        control: mpsc::UnboundedReceiver<ControlOut>,
        interval: Duration,
    ) -> Outbound {
        Outbound {
            first,
            control,
            interval,
            quiet: Box::pin(tokio::time::sleep(interval)),
            seq: 0,
            burst: 0,
            yields: 0,
        }
    }

    fn sent(&mut self, m: pb::PeerMessage) -> Poll<Option<pb::PeerMessage>> {
        let next = tokio::time::Instant::now() + self.interval;
        self.quiet.as_mut().reset(next);
        Poll::Ready(Some(m))
    }
}

impl Stream for Outbound {
    type Item = pb::PeerMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<pb::PeerMessage>> {
        if let Some(m) = self.first.take() {
            return self.sent(m);
        }
        if self.yields > 0 {
            self.yields -= 1;
            // Polled once, `yield_now` arranges the wake and answers `Pending`.
            let _ = std::pin::pin!(tokio::task::yield_now()).poll(cx);
            return Poll::Pending;
        }
        match self.control.poll_recv(cx) {
            Poll::Ready(Some(ControlOut::DirectSwitch)) => {
                return self.sent(pb::PeerMessage {
                    body: Some(pb::peer_message::Body::DirectSwitch(pb::DirectSwitch {})),
                });
            }
            Poll::Ready(Some(ControlOut::Msg(m))) => {
                let (kind, id) = m.label();
                tracing::trace!(target: "tcpxd::hop", hop = "wire.out", kind, id);
                self.burst += 1;
                if self.burst == BURST {
                    self.burst = 0;
                    self.yields = 2;
                }
                return self.sent(msg_to_pb(&m));
            }
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => self.burst = 0,
        }
        match self.quiet.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.seq += 1;
                let seq = self.seq;
                self.sent(pb::PeerMessage {
                    body: Some(pb::peer_message::Body::Heartbeat(pb::Heartbeat { seq })),
                })
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// `Outbound` as a server response body (whose items are results; it never yields an error).
pub struct OutboundResponse(pub(super) Outbound);

impl Stream for OutboundResponse {
    type Item = Result<pb::PeerMessage, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.0).poll_next(cx).map(|m| m.map(Ok))
    }
}

/// Why a control stream's inbound side ended.
enum Ended {
    /// The stream ended or broke.
    Stream(String),
    /// Silence or bad input: the pairing fails.
    Failed(String),
}

/// Forwards a peer's inbound control messages to the poller, in order; a broken stream or a
/// malformed message fails the peer. A malformed offer or read request goes to the engine,
/// which refuses it.
pub(super) fn spawn_inbound(
    poller: crate::poller::PollerTx,
    idx: PeerIdx,
    node: String,
    mut inbound: Streaming<pb::PeerMessage>,
    silence: Duration,
) {
    tokio::spawn(async move {
        let reason = loop {
            let Ok(next) = tokio::time::timeout(silence, inbound.message()).await else {
                break Ended::Failed(format!("no control message or heartbeat for {silence:?}"));
            };
            match next {
                // The last engine message on this stream: the rest come on the direct connection.
                Ok(Some(pb::PeerMessage {
                    body: Some(pb::peer_message::Body::DirectSwitch(_)),
                })) => {
                    if poller.send(Command::DirectSwitch { peer: idx }).is_err() {
                        return;
                    }
                }
                Ok(Some(m)) => match msg_from_pb(m) {
                    Ok(Some(msg)) => {
                        let (kind, id) = msg.label();
                        tracing::trace!(target: "tcpxd::hop", hop = "wire.in", kind, id);
                        if poller.send(Command::Message { peer: idx, msg }).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(Malformed::Refuse(request)) => {
                        if poller.send(Command::Malformed { peer: idx, request }).is_err() {
                            return;
                        }
                    }
                    Err(Malformed::Fatal(why)) => {
                        break Ended::Failed(format!("malformed control message: {why}"));
                    }
                },
                Ok(None) => break Ended::Stream("control stream closed by the peer".to_string()),
                Err(s) => break Ended::Stream(format!("control stream failed: {}", s.message())),
            }
        };
        // The poller logs it as a failure unless the pairing had closed when idle (its stream
        // ends then too). The stream's end (not its silence) waits for the direct connection's,
        // when the pairing has switched to one: the peer's last messages (a pairing close's
        // answer, a Goodbye) come there and may arrive after it.
        let cmd = match reason {
            Ended::Stream(reason) => {
                tracing::debug!(peer = %node, "{reason}");
                Command::ControlStreamEnded { peer: idx, reason }
            }
            Ended::Failed(reason) => {
                tracing::debug!(peer = %node, "{reason}");
                Command::PeerDown { peer: idx, reason }
            }
        };
        let _ = poller.send(cmd);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::PeerMsg;

    /// A burst leaves whole and in order, with two `Pending`s after every [`BURST`] messages
    /// (the task yields so the connection can write); each `Pending` arranged its own wake: an
    /// awaited `next` never stalls on one.
    #[tokio::test]
    async fn a_burst_leaves_in_order_yielding_every_few_messages_without_losing_a_wake() {
        let (tx, rx) = mpsc::unbounded_channel();
        let done = |id| PeerMsg::Done {
            offer_id: id,
            returned: Default::default(),
        };
        for id in 0..10u64 {
            tx.send(ControlOut::Msg(done(id))).unwrap();
        }
        let mut out = Outbound::new(None, rx, Duration::from_secs(60));
        let (mut got, mut pendings) = (Vec::new(), Vec::new());
        while got.len() < 10 {
            match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut out).poll_next(cx))).await {
                Poll::Ready(Some(m)) => got.push(m),
                Poll::Ready(None) => panic!("the stream ended with messages left"),
                Poll::Pending => {
                    pendings.push(got.len());
                    tokio::task::yield_now().await;
                }
            }
        }
        let want: Vec<_> = (0..10u64).map(|id| msg_to_pb(&done(id))).collect();
        assert_eq!(got, want);
        assert_eq!(pendings, vec![4, 4, 8, 8]);
        // Awaited: every Pending wakes the task again, so the next burst comes through whole.
        for id in 10..30u64 {
            tx.send(ControlOut::Msg(done(id))).unwrap();
        }
        drop(tx);
        let rest = tokio::time::timeout(Duration::from_secs(5), async {
            let mut v = Vec::new();
            while let Some(m) = tokio_stream::StreamExt::next(&mut out).await {
                v.push(m);
            }
            v
        })
        .await
        .expect("no wake-up lost");
        let want: Vec<_> = (10..30u64).map(|id| msg_to_pb(&done(id))).collect();
        assert_eq!(rest, want);
    }
}
