//! A pairing's direct control connection (docs/ARCHITECTURE.md, "The direct control
//! connection"): a plain TCP connection between the two daemons' peer ports on which each
//! poller writes its engine messages itself and reads the peer's itself, the socket in its epoll
//! set (`poller/direct.rs`, `poller/park.rs`) — no async worker, no reader task and no HTTP/2
//! between the poller and the wire. This module sets connections up and supplies the frames
//! ([`frame_msg`], [`decoder`]).
//!
//! Set up after the pairing's authentication: the callee's `Handshake` answer carries a
//! one-time random token (`HandshakeResponse.direct_token`); once its `Control` stream is open
//! the caller dials the callee's peer address — the port the gRPC server listens on, whose
//! accept path tells the two apart by the first 8 bytes (`incoming.rs`) — and sends
//! [`PREFACE`], the token and, with a cluster secret, its proof over the handshake's nonces and
//! the token (`auth::ProofOf::Direct`). The callee hands the connection to its poller first,
//! then answers [`ACK`]; the caller hands its end to its poller on the answer. Never under mutual
//! TLS (`peer.tls_*`): the callee issues no token and the pairing stays on the stream.
//!
//! On the wire: frames of a little-endian `u32` length and a `tcpxd.peer.v1.PeerMessage`, at
//! most [`MAX_CONTROL_MESSAGE`] bytes. A frame longer, one that does not decode, a `Hello` or a
//! `DirectSwitch` on it, the connection's end or error: the pairing fails with the reason
//! (logged by the poller as the peer's failure), like a lost peer. A connection with a wrong
//! token, or a wrong proof, is closed with a warning and changes nothing.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::MAX_CONTROL_MESSAGE;
use super::control::{Malformed, msg_from_pb, msg_to_pb};
use crate::api::proto::peer as pb;
use crate::engine::{PeerIdx, PeerMsg};
use crate::poller::{Command, Decode, DirectConn, PollerTx};

/// A direct control connection's first 8 bytes (an HTTP/2 client's are `PRI * HT`).
pub const PREFACE: &[u8; 8] = b"TCPXDC/1";
/// The one-time token's length.
pub const TOKEN_BYTES: usize = 16;
/// A proof's length (HMAC-SHA256).
const PROOF_BYTES: usize = 32;
/// The callee's answer: the connection is bound to its pairing.
pub const ACK: u8 = 0x01;
/// How long an opening connection has to send its token (and proof).
const OPENING_WAIT: Duration = Duration::from_secs(10);

/// Frames an engine message: a little-endian `u32` length, then its `tcpxd.peer.v1` encoding.
pub fn frame_msg(m: &PeerMsg, out: &mut Vec<u8>) {
    if let PeerMsg::Inline { offer, payload } = m
        && !payload.is_empty()
    {
        return frame_inline(offer, payload, out);
    }
    let pbm = msg_to_pb(m);
    let len = pbm.encoded_len();
    out.reserve(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    pbm.encode(out).expect("a Vec grows as needed");
}

/// An inline transfer's frame, the same bytes as [`frame_msg`]'s way would make, its payload
/// copied once, straight into `out`: `msg_to_pb` clones it into the message first (up to
/// `transfer.inline_max_bytes`, 64 KiB by default, a fresh allocation each: session 29 found
/// that clone, with the page faults of its allocation, at ~6% of a sending poller's samples with
/// 64 KiB GPU WRITEs 16 in flight on the CUDA stand-in).
fn frame_inline(offer: &crate::engine::Offer, payload: &[u8], out: &mut Vec<u8>) {
    use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
    // The header as `msg_to_pb` encodes it, with no payload.
    let header = match msg_to_pb(&PeerMsg::Inline {
        offer: offer.clone(),
        payload: Vec::new(),
    })
    .body
    {
        Some(pb::peer_message::Body::InlineTransfer(t)) => t,
        _ => unreachable!("an inline message is an InlineTransfer"),
    };
    const BODY_TAG: u32 = 141;
    const PAYLOAD_TAG: u32 = 2;
    let field = key_len(PAYLOAD_TAG) + encoded_len_varint(payload.len() as u64) + payload.len();
    let inner = header.encoded_len() + field;
    let len = key_len(BODY_TAG) + encoded_len_varint(inner as u64) + inner;
    out.reserve(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    encode_key(BODY_TAG, WireType::LengthDelimited, out);
    encode_varint(inner as u64, out);
    header.encode(out).expect("a Vec grows as needed");
    encode_key(PAYLOAD_TAG, WireType::LengthDelimited, out);
    encode_varint(payload.len() as u64, out);
    out.extend_from_slice(payload);
}

/// Why the bytes of a direct connection could not be read as frames.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("a frame of {len} bytes (at most {limit} may come)")]
    Oversized { len: u64, limit: usize },
    #[error("a frame that is not a tcpxd.peer.v1 PeerMessage ({0})")]
    Garbage(#[from] prost::DecodeError),
}

/// The frames in the bytes read so far.
pub struct Frames {
    buf: Vec<u8>,
    start: usize,
    limit: usize,
}

impl Frames {
    pub fn new(limit: usize) -> Frames {
        Frames {
            buf: Vec::new(),
            start: 0,
            limit,
        }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > (1 << 20) && self.start > self.buf.len() / 2 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// No partial frame is kept: the next bytes may be decoded where they were read
    /// ([`Frames::first`]), only a partial frame at their end copied in ([`Frames::push`]).
    pub fn is_empty(&self) -> bool {
        self.start == self.buf.len()
    }

    /// The next whole frame, decoded; `None` until one is complete. An oversized length is
    /// refused as soon as its 4 bytes are in.
    pub fn next_msg(&mut self) -> Result<Option<pb::PeerMessage>, FrameError> {
        let Some((m, used)) = Frames::first(&self.buf[self.start..], self.limit)? else {
            return Ok(None);
        };
        self.start += used;
        Ok(Some(m))
    }

    /// The first whole frame of `bytes`, decoded, and how many bytes it took; `None` when they
    /// hold no whole frame. An oversized length is refused as soon as its 4 bytes are in.
    pub fn first(bytes: &[u8], limit: usize) -> Result<Option<(pb::PeerMessage, usize)>, FrameError> {
        let Some(head) = bytes.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(head.try_into().expect("4 bytes")) as usize;
        if len > limit {
            return Err(FrameError::Oversized {
                len: len as u64,
                limit,
            });
        }
        let Some(body) = bytes.get(4..4 + len) else {
            return Ok(None);
        };
        Ok(Some((pb::PeerMessage::decode(body)?, 4 + len)))
    }
}

/// A token issued in a handshake's answer, not used yet.
struct Pending {
    idx: PeerIdx,
    node: String,
    /// With a cluster secret: the proof the connection must bring.
    proof: Option<Vec<u8>>,
    expires: Instant,
}

/// The callee's side: the tokens issued, and what a connection presenting one is handed to.
pub struct DirectAcceptor {
    tokens: Mutex<HashMap<[u8; TOKEN_BYTES], Pending>>,
    /// The poller's channel: set-up connections go to it.
    poller: PollerTx,
}

impl DirectAcceptor {
    pub fn new(poller: PollerTx) -> DirectAcceptor {
        DirectAcceptor {
            tokens: Mutex::new(HashMap::new()),
            poller,
        }
    }

    /// A token for pairing `idx`, usable once within `ttl`.
    /// `proof`: with a cluster secret, the proof a connection presenting the token must bring.
    pub(super) fn issue(
        &self,
        idx: PeerIdx,
        node: &str,
        proof: impl FnOnce(&[u8]) -> Option<Vec<u8>>,
        ttl: Duration,
    ) -> [u8; TOKEN_BYTES] {
        let token: [u8; TOKEN_BYTES] = rand::random();
        let proof = proof(&token);
        let now = Instant::now();
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        tokens.retain(|_, p| p.expires > now);
        tokens.insert(
            token,
            Pending {
                idx,
                node: node.to_string(),
                proof,
                expires: now + ttl,
            },
        );
        token
    }

    /// A connection whose first 8 bytes were [`PREFACE`]: its token (and proof) binds it to its
    /// pairing, which the poller gets before the answer goes out. Anything wrong closes it with
    /// a warning and changes nothing.
    pub async fn accept(&self, mut stream: tokio::net::TcpStream, from: SocketAddr) {
        let mut token = [0u8; TOKEN_BYTES];
        if !matches!(
            tokio::time::timeout(OPENING_WAIT, stream.read_exact(&mut token)).await,
            Ok(Ok(_))
        ) {
            tracing::warn!(%from, "refused a direct control connection: no token within {OPENING_WAIT:?}");
            return;
        }
        let pending = {
            let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
            tokens.remove(&token).filter(|p| p.expires > Instant::now())
        };
        let Some(pending) = pending else {
            tracing::warn!(%from, "refused a direct control connection: unknown, used or expired token");
            return;
        };
        if let Some(want) = &pending.proof {
            let mut proof = [0u8; PROOF_BYTES];
            let read = tokio::time::timeout(OPENING_WAIT, stream.read_exact(&mut proof)).await;
            if !matches!(read, Ok(Ok(_))) || !same(&proof, want) {
                tracing::warn!(%from, peer = %pending.node, "refused a direct control connection: its proof does not prove the cluster secret (the pairing stays on its control stream)");
                return;
            }
        }
        let conn = match start(stream, pending.idx, false) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(%from, peer = %pending.node, "direct control connection: {e}");
                return;
            }
        };
        let stream = conn.stream.clone();
        if self
            .poller
            .send(Command::DirectControl {
                peer: pending.idx,
                conn,
            })
            .is_err()
        {
            return;
        }
        // After the poller has it: the caller switches on this answer.
        let _ = stream.set_write_timeout(Some(OPENING_WAIT));
        if let Err(e) = (&*stream).write_all(&[ACK]) {
            tracing::warn!(%from, peer = %pending.node, "direct control connection: answering: {e}");
        }
    }

    /// Caller side: dials the callee's peer address, presents the token (and proof), waits for
    /// the answer and hands the connection to the poller (which switches to it at once).
    pub(super) async fn dial(
        &self,
        address: &str,
        idx: PeerIdx,
        token: &[u8],
        proof: Option<Vec<u8>>,
        within: Duration,
    ) -> Result<(), String> {
        let hostport = address
            .split_once("://")
            .map_or(address, |(_, rest)| rest)
            .trim_end_matches('/');
        let open = async {
            let mut s = tokio::net::TcpStream::connect(hostport)
                .await
                .map_err(|e| format!("connecting to {hostport}: {e}"))?;
            let mut opening = PREFACE.to_vec();
            opening.extend_from_slice(token);
            opening.extend_from_slice(proof.as_deref().unwrap_or_default());
            s.write_all(&opening)
                .await
                .map_err(|e| format!("sending the token: {e}"))?;
            let mut ack = [0u8; 1];
            match s.read_exact(&mut ack).await {
                Ok(_) if ack[0] == ACK => Ok(s),
                Ok(_) => Err(format!("answered {:#04x}, not {ACK:#04x}", ack[0])),
                Err(e) => Err(format!("no answer ({e}): the peer refused the token")),
            }
        };
        let s = tokio::time::timeout(within, open)
            .await
            .map_err(|_| format!("not set up within {within:?}"))??;
        let conn = start(s, idx, true).map_err(|e| e.to_string())?;
        self.poller
            .send(Command::DirectControl { peer: idx, conn })
            .map_err(|_| "the daemon is shutting down".to_string())
    }
}

/// Equal, in time independent of where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What the poller needs of a set-up connection: the socket, non-blocking (the poller reads it
/// when its epoll says so and sends with `MSG_DONTWAIT`), and the frames both ways.
fn start(stream: tokio::net::TcpStream, idx: PeerIdx, caller: bool) -> std::io::Result<DirectConn> {
    stream.set_nodelay(true)?;
    let stream = stream.into_std()?;
    stream.set_nonblocking(true)?;
    Ok(DirectConn {
        stream: Arc::new(stream),
        frame: frame_msg,
        decode: decoder(idx),
        caller,
    })
}

/// The poller's decoder of pairing `idx`'s direct connection: whole frames become the peer's
/// messages (a heartbeat none, a refusable bad offer `Command::Malformed`); an oversized frame,
/// one that is no `PeerMessage`, a `Hello` or a `DirectSwitch` on it end the pairing.
pub fn decoder(idx: PeerIdx) -> Decode {
    let mut frames = Frames::new(MAX_CONTROL_MESSAGE);
    Box::new(move |mut bytes: &[u8], out: &mut VecDeque<Command>| {
        loop {
            // The frames a read holds whole are decoded where they were read (a pass's batch
            // of messages, `poller/direct.rs`, comes in one read); only a frame cut by the
            // read's end is copied, and the next read's bytes join it.
            let next = if frames.is_empty() {
                match Frames::first(bytes, MAX_CONTROL_MESSAGE).map_err(|e| e.to_string())? {
                    Some((m, used)) => {
                        bytes = &bytes[used..];
                        Some(m)
                    }
                    None => {
                        frames.push(bytes);
                        bytes = &[];
                        None
                    }
                }
            } else {
                frames.push(bytes);
                bytes = &[];
                frames.next_msg().map_err(|e| e.to_string())?
            };
            let Some(m) = next else {
                return Ok(());
            };
            match msg_from_pb(m) {
                Ok(Some(msg)) => {
                    let (kind, id) = msg.label();
                    tracing::trace!(target: "tcpxd::hop", hop = "wire.in", kind, id);
                    out.push_back(Command::Message { peer: idx, msg });
                }
                Ok(None) => {}
                Err(Malformed::Refuse(request)) => out.push_back(Command::Malformed { peer: idx, request }),
                Err(Malformed::Fatal(why)) => {
                    return Err(format!("malformed control message: {why}"));
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_come_whole_in_order_however_the_bytes_are_cut() {
        let msgs: Vec<PeerMsg> = (0..5u64)
            .map(|id| PeerMsg::Done {
                offer_id: id,
                returned: crate::engine::ReturnedCredits::from_wire(vec![id as u32, 1]),
            })
            .collect();
        let mut wire = Vec::new();
        for m in &msgs {
            frame_msg(m, &mut wire);
        }
        for cut in [1usize, 3, 7, wire.len()] {
            let mut f = Frames::new(1 << 20);
            let mut got = Vec::new();
            for piece in wire.chunks(cut) {
                f.push(piece);
                while let Some(m) = f.next_msg().unwrap() {
                    got.push(msg_from_pb(m).unwrap().unwrap());
                }
            }
            assert_eq!(got, msgs, "cut every {cut} bytes");
        }
    }

    #[test]
    fn an_inline_transfer_is_framed_as_its_message_encodes() {
        let offer = crate::engine::Offer {
            offer_id: 77,
            read_id: 0,
            chunk_bytes: 65536,
            first_lane: 0,
            ranges: vec![crate::engine::RemoteRange {
                buffer_id: 5,
                access_key: [3; 16],
                offset: 4096,
                length: 3000,
            }]
            .into(),
            notification: b"note".to_vec(),
            deadline_ms: 0,
            blocks: None,
            coalesced: false,
            transfer_id: 12,
            announced: None,
        };
        for len in [0usize, 1, 127, 128, 3000, 70_000] {
            let m = PeerMsg::Inline {
                offer: offer.clone(),
                payload: (0..len).map(|i| i as u8).collect(),
            };
            let pbm = msg_to_pb(&m);
            let mut want = (pbm.encoded_len() as u32).to_le_bytes().to_vec();
            pbm.encode(&mut want).unwrap();
            let mut got = vec![9u8];
            frame_msg(&m, &mut got);
            assert_eq!(&got[1..], &want[..], "payload of {len} bytes");
            let mut f = Frames::new(1 << 20);
            f.push(&got[1..]);
            assert_eq!(msg_from_pb(f.next_msg().unwrap().unwrap()).unwrap().unwrap(), m);
        }
    }

    #[test]
    fn the_decoder_takes_whole_frames_in_place_and_joins_a_cut_one_however_reads_cut_them() {
        let msgs: Vec<PeerMsg> = (0..6u64)
            .map(|id| PeerMsg::Done {
                offer_id: id,
                returned: crate::engine::ReturnedCredits::from_wire(vec![id as u32, 2]),
            })
            .collect();
        let mut wire = Vec::new();
        for m in &msgs {
            frame_msg(m, &mut wire);
        }
        // Reads of every size, and two reads cut at every byte.
        let mut cuts: Vec<Vec<usize>> = (1..=wire.len())
            .map(|n| (n..wire.len()).step_by(n).collect())
            .collect();
        cuts.extend((1..wire.len()).map(|at| vec![at]));
        for cut in cuts {
            let mut decode = decoder(PeerIdx(2));
            let mut out = VecDeque::new();
            let mut from = 0;
            for &to in cut.iter().chain([wire.len()].iter()) {
                decode(&wire[from..to], &mut out).unwrap();
                from = to;
            }
            let got: Vec<PeerMsg> = out
                .into_iter()
                .map(|c| match c {
                    Command::Message { msg, .. } => msg,
                    _ => panic!("a message"),
                })
                .collect();
            assert_eq!(got, msgs, "reads cut at {cut:?}");
        }
    }

    #[test]
    fn an_oversized_or_garbled_frame_is_refused_naming_why() {
        let mut f = Frames::new(1024);
        f.push(&u32::MAX.to_le_bytes());
        let e = f.next_msg().unwrap_err();
        assert_eq!(
            e.to_string(),
            "a frame of 4294967295 bytes (at most 1024 may come)"
        );
        let mut f = Frames::new(1024);
        f.push(&3u32.to_le_bytes());
        f.push(&[0xff, 0xff, 0xff]);
        let e = f.next_msg().unwrap_err();
        assert!(
            e.to_string()
                .starts_with("a frame that is not a tcpxd.peer.v1 PeerMessage"),
            "{e}"
        );
    }

    #[test]
    fn the_decoder_hands_whole_messages_over_as_commands_and_names_a_broken_frame() {
        let mut wire = Vec::new();
        let done = PeerMsg::Done {
            offer_id: 4,
            returned: crate::engine::ReturnedCredits::from_wire(vec![1, 3]),
        };
        frame_msg(&done, &mut wire);
        frame_msg(
            &PeerMsg::Credits {
                returned: crate::engine::ReturnedCredits::from_wire(vec![1, 2]),
            },
            &mut wire,
        );
        let mut decode = decoder(PeerIdx(3));
        let mut out = VecDeque::new();
        let (first, rest) = wire.split_at(5);
        decode(first, &mut out).unwrap();
        assert!(out.is_empty(), "half a frame is kept, not handed over");
        decode(rest, &mut out).unwrap();
        let got: Vec<_> = out
            .drain(..)
            .map(|c| match c {
                Command::Message { peer, msg } => (peer, msg),
                _ => panic!("a message"),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (PeerIdx(3), done),
                (
                    PeerIdx(3),
                    PeerMsg::Credits {
                        returned: crate::engine::ReturnedCredits::from_wire(vec![1, 2])
                    }
                )
            ]
        );
        let marker = pb::PeerMessage {
            body: Some(pb::peer_message::Body::DirectSwitch(Default::default())),
        };
        let mut bad = (marker.encoded_len() as u32).to_le_bytes().to_vec();
        marker.encode(&mut bad).unwrap();
        let e = decode(&bad, &mut out).unwrap_err();
        assert!(e.contains("DirectSwitch on the direct control connection"), "{e}");
    }
}
