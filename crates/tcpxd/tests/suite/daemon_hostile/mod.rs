//! Hostile input, table-driven, over the peer service (a raw tonic client pretending to be a
//! peer: handshakes, control-stream openings and every control message) and the client API:
//! sizes at and past every limit, overflowing offsets, unknown ids, truncated and oversized
//! messages. Every case gets the right status (or, for messages about unknown ids, is ignored
//! without harm), no daemon crashes, and no byte of any buffer changes.

mod client;
mod direct;
mod inline;
mod packed;
mod peer;
mod routed;

use std::time::Duration;

use crate::common::daemons::{self, *};
use crate::common::fake_lanes::{FakeLanes, gpu_topology};
use tcpxd::api::proto::peer as ppb;
use tcpxd::api::proto::peer::tcpxd_peer_client::TcpxdPeerClient;
use tcpxd::api::proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 4 * MIB;

/// Sends raw bytes as a request message and reads the reply as raw bytes: truncated and
/// malformed protobuf, which no generated client can produce.
#[derive(Clone, Default)]
struct RawCodec;
struct RawCoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCoder;
    type Decoder = RawCoder;
    fn encoder(&mut self) -> RawCoder {
        RawCoder
    }
    fn decoder(&mut self) -> RawCoder {
        RawCoder
    }
}

impl tonic::codec::Encoder for RawCoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes_buf::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes_buf::Buf;
        let mut v = vec![0; src.remaining()];
        src.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

mod bytes_buf {
    pub use prost::bytes::{Buf, BufMut};
}

/// A unary call with raw request bytes.
async fn raw_unary(channel: Channel, path: &str, body: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::try_from(path.to_string()).unwrap(),
        RawCodec,
    )
    .await
    .map(|r| r.into_inner())
}

/// The hostile daemon's settings: generous peer timeouts, since the fake peer never connects
/// its data lanes and speaks slowly.
fn patient_config(tag: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("tcpxd-hostile-{tag}-{}.toml", std::process::id()));
    std::fs::write(
        &p,
        "[peer]\nconnect_timeout_s = 600\nheartbeat_interval_ms = 500\nheartbeat_timeout_ms = 600000\n",
    )
    .unwrap();
    p
}

/// Checksums of every buffer of the daemons.
async fn snapshot(cs: &mut [&mut Client]) -> Vec<u32> {
    let mut out = Vec::new();
    for c in cs.iter_mut() {
        let list = c
            .list_buffers(pb::ListBuffersRequest {})
            .await
            .unwrap()
            .into_inner();
        for b in list.buffers {
            out.push(crc(c, b.id, 0, 0).await);
        }
    }
    out
}

fn check<T>(n: &mut usize, name: &str, r: Result<T, tonic::Status>, code: Code, words: &str) {
    *n += 1;
    match r {
        Ok(_) => panic!("{name}: expected {code:?}, got success"),
        Err(s) => {
            assert_eq!(s.code(), code, "{name}: {}", s.message());
            assert!(
                s.message().contains(words),
                "{name}: {:?} should mention {words:?}",
                s.message()
            );
        }
    }
}

fn range(buffer_id: u64, key: &[u8], offset: u64, length: u64) -> ppb::RemoteRange {
    ppb::RemoteRange {
        buffer_id,
        access_key: key.to_vec(),
        offset,
        length,
    }
}

fn key_of(b: &pb::Buffer) -> Vec<u8> {
    hex::decode(
        b.descriptor
            .split('@')
            .next()
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap(),
    )
    .unwrap()
}

fn msg(body: ppb::peer_message::Body) -> ppb::PeerMessage {
    ppb::PeerMessage { body: Some(body) }
}

/// A fake peer with an open control stream to a daemon.
struct FakePeer {
    tx: mpsc::Sender<ppb::PeerMessage>,
    rx: tonic::Streaming<ppb::PeerMessage>,
    /// The lanes its messages must name (the layout's, or on a routed pairing its memory
    /// pair's: `common::fake_lanes`).
    lanes: FakeLanes,
}

async fn fake_peer(addr: &str, node: &str) -> FakePeer {
    fake_peer_with(addr, node, None).await
}

/// A fake peer announcing `topology` (`None`: none, a node without GPUs). One with GPUs makes
/// the pairing routed even with a daemon without any.
async fn fake_peer_with(addr: &str, node: &str, topology: Option<ppb::PeerTopology>) -> FakePeer {
    let mut raw = TcpxdPeerClient::connect(format!("http://{addr}")).await.unwrap();
    let req = ppb::HandshakeRequest {
        protocol_version: tcpxd::peers::PROTOCOL_VERSION,
        node_id: node.into(),
        lanes: vec![ppb::LaneHandle {
            lane: 0,
            device: 0,
            // Peer protocol 6: no handle (the lane is never used here).
            handle: Vec::new(),
        }],
        topology,
        ..Default::default()
    };
    let resp = raw.handshake(req.clone()).await.expect("handshake").into_inner();
    let lanes = FakeLanes::of(&req, &resp);
    let (tx, rx) = mpsc::channel(64);
    tx.send(msg(ppb::peer_message::Body::Hello(ppb::Hello {
        session_id: resp.session_id,
        node_id: node.into(),
        proof: Vec::new(),
    })))
    .await
    .unwrap();
    // It receives by rendezvous (it never posts a receive anyway).
    tx.send(msg(ppb::peer_message::Body::ReceiveMode(ppb::ReceiveMode {
        credits: 0,
        chunk_bytes: 0,
        ..Default::default()
    })))
    .await
    .unwrap();
    let rx = raw
        .control(ReceiverStream::new(rx))
        .await
        .expect("control")
        .into_inner();
    FakePeer { tx, rx, lanes }
}

impl FakePeer {
    /// The next message that is not a heartbeat.
    async fn next(&mut self) -> ppb::peer_message::Body {
        loop {
            let m = tokio::time::timeout(Duration::from_secs(20), self.rx.message())
                .await
                .expect("an answer within 20 s")
                .expect("stream intact")
                .expect("stream open");
            match m.body {
                Some(
                    ppb::peer_message::Body::Heartbeat(_)
                    | ppb::peer_message::Body::ReceiveMode(_)
                    | ppb::peer_message::Body::InlineLimit(_)
                    | ppb::peer_message::Body::GpuCredits(_)
                    | ppb::peer_message::Body::Credits(_),
                ) => continue,
                Some(b) => return b,
                None => panic!("a message without a body"),
            }
        }
    }
}

enum Ctl {
    /// Must be answered by a Reject of this offer with the code, words and range index.
    Offer(ppb::Offer, Code, &'static str, u32),
    /// Must be answered by a ReadReject.
    Read(ppb::ReadRequest, Code, &'static str, u32),
    /// About an unknown id: ignored, no answer, the peer stays up.
    Ignored(ppb::peer_message::Body),
}
