//! A peer's ordered control stream: the outbound stream tonic polls (messages and heartbeats),
//! the task that forwards inbound messages to the poller, and the conversions between the
//! engine's control messages and `tcpxd.peer.v1`.

use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc as std_mpsc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Sleep;
use tokio_stream::Stream;
use tonic::{Status, Streaming};

use crate::api::proto::peer as pb;
use crate::engine::{self, Code, Offer, PeerIdx, PeerMsg, ReadPair, RemoteRange};
use crate::poller::Command;

/// A peer's outbound control stream: the messages the poller sends this peer, plus a heartbeat
/// whenever it has been quiet for `interval`; it ends when the poller drops the peer's channel.
/// tonic polls it directly as the request (caller) or response (callee) body, so a message the
/// poller sends goes onto the wire with no task in between.
pub(super) struct Outbound {
    first: Option<pb::PeerMessage>,
    control: mpsc::UnboundedReceiver<PeerMsg>,
    interval: Duration,
    quiet: Pin<Box<Sleep>>,
    seq: u64,
}

impl Outbound {
    pub(super) fn new(
        first: Option<pb::PeerMessage>,
        control: mpsc::UnboundedReceiver<PeerMsg>,
        interval: Duration,
    ) -> Outbound {
        Outbound {
            first,
            control,
            interval,
            quiet: Box::pin(tokio::time::sleep(interval)),
            seq: 0,
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
        match self.control.poll_recv(cx) {
            Poll::Ready(Some(m)) => {
                let (kind, id) = m.label();
                tracing::trace!(target: "tcpxd::hop", hop = "wire.out", kind, id);
                return self.sent(msg_to_pb(&m));
            }
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => {}
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

/// [`Outbound`] as a server response body (whose items are results; it never yields an error).
pub struct OutboundResponse(pub(super) Outbound);

impl Stream for OutboundResponse {
    type Item = Result<pb::PeerMessage, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.0).poll_next(cx).map(|m| m.map(Ok))
    }
}

/// Forwards a peer's inbound control messages to the poller, in order; a broken stream or a
/// malformed message fails the peer. A malformed offer or read request goes to the engine,
/// which refuses it.
pub(super) fn spawn_inbound(
    poller: std_mpsc::Sender<Command>,
    idx: PeerIdx,
    node: String,
    mut inbound: Streaming<pb::PeerMessage>,
    silence: Duration,
) {
    tokio::spawn(async move {
        let reason = loop {
            let Ok(next) = tokio::time::timeout(silence, inbound.message()).await else {
                break format!("no control message or heartbeat for {silence:?}");
            };
            match next {
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
                    Err(Malformed::Fatal(why)) => break format!("malformed control message: {why}"),
                },
                Ok(None) => break "control stream closed by the peer".to_string(),
                Err(s) => break format!("control stream failed: {}", s.message()),
            }
        };
        tracing::warn!(peer = %node, "{reason}");
        let _ = poller.send(Command::PeerDown { peer: idx, reason });
    });
}

fn range_to_pb(r: &RemoteRange) -> pb::RemoteRange {
    pb::RemoteRange {
        buffer_id: r.buffer_id,
        access_key: r.access_key.to_vec(),
        offset: r.offset,
        length: r.length,
    }
}

fn range_from_pb(field: &str, r: Option<&pb::RemoteRange>) -> Result<RemoteRange, String> {
    let r = r.ok_or_else(|| format!("{field}: missing"))?;
    let access_key: [u8; 16] = r
        .access_key
        .as_slice()
        .try_into()
        .map_err(|_| format!("{field}.access_key: {} bytes, expected 16", r.access_key.len()))?;
    Ok(RemoteRange {
        buffer_id: r.buffer_id,
        access_key,
        offset: r.offset,
        length: r.length,
    })
}

/// Engine message → wire.
pub fn msg_to_pb(m: &PeerMsg) -> pb::PeerMessage {
    use pb::peer_message::Body;
    let offer = |o: &Offer| pb::Offer {
        offer_id: o.offer_id,
        read_id: o.read_id,
        chunk_bytes: o.chunk_bytes,
        first_lane: o.first_lane,
        ranges: o.ranges.iter().map(range_to_pb).collect(),
        notification: o.notification.clone(),
        deadline_ms: o.deadline_ms,
        coalesced: o.coalesced,
    };
    let body = match m {
        PeerMsg::ReceiveMode {
            credits,
            chunk_bytes,
            eager_first_lane,
            eager_max_bytes,
        } => Body::ReceiveMode(pb::ReceiveMode {
            credits: *credits,
            chunk_bytes: *chunk_bytes,
            eager_first_lane: *eager_first_lane,
            eager_max_bytes: *eager_max_bytes,
        }),
        PeerMsg::Credits { returned } => Body::Credits(pb::Credits {
            returned: returned.clone(),
        }),
        PeerMsg::Header(o) => Body::Header(offer(o)),
        PeerMsg::Offer(o) => Body::Offer(offer(o)),
        PeerMsg::Accept { offer_id } => Body::Accept(pb::Accept { offer_id: *offer_id }),
        PeerMsg::Reject {
            offer_id,
            code,
            message,
            range_index,
        } => Body::Reject(pb::Reject {
            offer_id: *offer_id,
            code: *code as i32,
            message: message.clone(),
            range_index: *range_index,
        }),
        PeerMsg::Done { offer_id } => Body::Done(pb::Done { offer_id: *offer_id }),
        PeerMsg::Failed {
            offer_id,
            code,
            message,
        } => Body::Failed(pb::Failed {
            offer_id: *offer_id,
            code: *code as i32,
            message: message.clone(),
        }),
        PeerMsg::CancelOffer {
            offer_id,
            code,
            message,
        } => Body::CancelOffer(pb::CancelOffer {
            offer_id: *offer_id,
            code: *code as i32,
            message: message.clone(),
        }),
        PeerMsg::ReadRequest {
            read_id,
            pairs,
            deadline_ms,
            blocks: _,
        } => Body::ReadRequest(pb::ReadRequest {
            read_id: *read_id,
            pairs: pairs
                .iter()
                .map(|p| pb::ReadPair {
                    source: Some(range_to_pb(&p.source)),
                    dest: Some(range_to_pb(&p.dest)),
                })
                .collect(),
            deadline_ms: *deadline_ms,
        }),
        PeerMsg::ReadReject {
            read_id,
            code,
            message,
            range_index,
        } => Body::ReadReject(pb::ReadReject {
            read_id: *read_id,
            code: *code as i32,
            message: message.clone(),
            range_index: *range_index,
        }),
        PeerMsg::CancelRead { read_id } => Body::CancelRead(pb::CancelRead { read_id: *read_id }),
        PeerMsg::Goodbye { reason } => Body::Goodbye(pb::Goodbye {
            reason: reason.clone(),
        }),
    };
    pb::PeerMessage { body: Some(body) }
}

/// Why an inbound message could not be handed to the engine.
#[derive(Debug)]
pub enum Malformed {
    /// An offer or read request with a bad field: the engine refuses it.
    Refuse(engine::Malformed),
    /// The peer broke the protocol.
    Fatal(String),
}

/// Wire → engine message. `Ok(None)`: nothing for the engine (a heartbeat).
pub fn msg_from_pb(m: pb::PeerMessage) -> Result<Option<PeerMsg>, Malformed> {
    use pb::peer_message::Body;
    let body = m
        .body
        .ok_or_else(|| Malformed::Fatal("message without a body".into()))?;
    Ok(Some(match body {
        Body::Hello(_) => return Err(Malformed::Fatal("a second Hello".into())),
        Body::Heartbeat(_) => return Ok(None),
        Body::ReceiveMode(m) => PeerMsg::ReceiveMode {
            credits: m.credits,
            chunk_bytes: m.chunk_bytes,
            eager_first_lane: m.eager_first_lane,
            eager_max_bytes: m.eager_max_bytes,
        },
        Body::Credits(c) => PeerMsg::Credits { returned: c.returned },
        Body::Header(o) => {
            // Its data may be on its way already: a header the engine cannot read breaks the
            // order of every lane, so it fails the pairing instead of a refusal.
            let ranges: Result<Vec<RemoteRange>, String> = o
                .ranges
                .iter()
                .enumerate()
                .map(|(i, r)| range_from_pb(&format!("header.ranges[{i}]"), Some(r)))
                .collect();
            PeerMsg::Header(Offer {
                offer_id: o.offer_id,
                read_id: o.read_id,
                chunk_bytes: o.chunk_bytes,
                first_lane: o.first_lane,
                ranges: ranges.map_err(Malformed::Fatal)?,
                notification: o.notification,
                deadline_ms: o.deadline_ms,
                blocks: None,
                coalesced: o.coalesced,
            })
        }
        Body::Offer(o) => {
            let ranges: Result<Vec<RemoteRange>, String> = o
                .ranges
                .iter()
                .enumerate()
                .map(|(i, r)| range_from_pb(&format!("ranges[{i}]"), Some(r)))
                .collect();
            match ranges {
                Ok(ranges) => PeerMsg::Offer(Offer {
                    offer_id: o.offer_id,
                    read_id: o.read_id,
                    chunk_bytes: o.chunk_bytes,
                    first_lane: o.first_lane,
                    ranges,
                    notification: o.notification,
                    deadline_ms: o.deadline_ms,
                    blocks: None,
                    coalesced: o.coalesced,
                }),
                Err(why) => {
                    return Err(Malformed::Refuse(engine::Malformed::Offer {
                        offer_id: o.offer_id,
                        why,
                    }));
                }
            }
        }
        Body::Accept(a) => PeerMsg::Accept { offer_id: a.offer_id },
        Body::Reject(r) => PeerMsg::Reject {
            offer_id: r.offer_id,
            code: Code::from_i32(r.code),
            message: r.message,
            range_index: r.range_index,
        },
        Body::Done(d) => PeerMsg::Done { offer_id: d.offer_id },
        Body::Failed(f) => PeerMsg::Failed {
            offer_id: f.offer_id,
            code: Code::from_i32(f.code),
            message: f.message,
        },
        Body::CancelOffer(c) => PeerMsg::CancelOffer {
            offer_id: c.offer_id,
            code: Code::from_i32(c.code),
            message: c.message,
        },
        Body::ReadRequest(r) => {
            let pairs: Result<Vec<ReadPair>, String> = r
                .pairs
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    Ok(ReadPair {
                        source: range_from_pb(&format!("pairs[{i}].source"), p.source.as_ref())?,
                        dest: range_from_pb(&format!("pairs[{i}].dest"), p.dest.as_ref())?,
                    })
                })
                .collect();
            match pairs {
                Ok(pairs) => PeerMsg::ReadRequest {
                    read_id: r.read_id,
                    pairs,
                    deadline_ms: r.deadline_ms,
                    blocks: None,
                },
                Err(why) => {
                    return Err(Malformed::Refuse(engine::Malformed::ReadRequest {
                        read_id: r.read_id,
                        why,
                    }));
                }
            }
        }
        Body::ReadReject(r) => PeerMsg::ReadReject {
            read_id: r.read_id,
            code: Code::from_i32(r.code),
            message: r.message,
            range_index: r.range_index,
        },
        Body::CancelRead(c) => PeerMsg::CancelRead { read_id: c.read_id },
        Body::Goodbye(g) => PeerMsg::Goodbye {
            reason: g.reason.chars().take(4096).collect(),
        },
    }))
}
