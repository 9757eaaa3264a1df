//! The framing of the local session: after the 8-byte preface, each message is a 4-byte
//! big-endian length and that many bytes of protobuf (`SessionRequest` in, `SessionEvent` out).

use bytes::{Buf, BufMut, BytesMut};
use prost::Message;
use tokio_util::codec::Decoder;
use tonic::Status;

use crate::api::proto::v1 as pb;

/// What a client sends first to get the framed session, and what the daemon answers.
pub const PREFACE: &[u8; 8] = b"TCPXD/1\n";

/// The preface's name, as `DescribeNode` reports it (`NodeDescription.local_session`).
pub const PROTOCOL: &str = "TCPXD/1";

/// The largest frame either side may send (its length field not counted).
pub const MAX_FRAME: usize = 64 << 20;

/// Bytes of the length field.
const HEADER: usize = 4;

/// Why the request side of a framed session stopped.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame: {0} bytes is over the {MAX_FRAME}-byte limit")]
    TooLong(u32),
    #[error("frame: not a SessionRequest: {0}")]
    NotARequest(#[from] prost::DecodeError),
    #[error("frame: the connection ended {0} bytes into a frame")]
    Truncated(usize),
    /// The connection itself failed (reset): the client is gone, nothing to answer.
    #[error("reading the connection: {0}")]
    Io(#[from] std::io::Error),
}

impl FrameError {
    /// The refusal the client gets before the daemon closes; `None` when it cannot be told.
    pub fn status(&self) -> Option<Status> {
        match self {
            FrameError::TooLong(_) => Some(Status::resource_exhausted(self.to_string())),
            FrameError::NotARequest(_) | FrameError::Truncated(_) => {
                Some(Status::invalid_argument(self.to_string()))
            }
            FrameError::Io(_) => None,
        }
    }
}

/// Splits the byte stream from a client into `SessionRequest`s.
#[derive(Debug, Default)]
pub struct RequestDecoder;

impl Decoder for RequestDecoder {
    type Item = pb::SessionRequest;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<pb::SessionRequest>, FrameError> {
        let Some(head) = src.first_chunk::<HEADER>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*head);
        if len as usize > MAX_FRAME {
            return Err(FrameError::TooLong(len));
        }
        let want = HEADER + len as usize;
        if src.len() < want {
            // The rest of this frame, read in as few calls as the socket allows.
            src.reserve(want - src.len());
            return Ok(None);
        }
        src.advance(HEADER);
        let body = src.split_to(len as usize).freeze();
        Ok(Some(pb::SessionRequest::decode(body)?))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<pb::SessionRequest>, FrameError> {
        match self.decode(src)? {
            Some(req) => Ok(Some(req)),
            None if src.is_empty() => Ok(None),
            None => Err(FrameError::Truncated(src.len())),
        }
    }
}

/// Appends one event as a frame (length, then the message) to `out`. (A `BytesMut` grows as
/// needed: encoding into it does not run out of room.)
pub fn put_event(out: &mut BytesMut, event: &pb::SessionEvent) -> Result<(), prost::EncodeError> {
    out.reserve(HEADER + event.encoded_len());
    put_frame(out, event)
}

/// Appends one message as a frame (its length, then the message) to `out`: the one encoding of
/// the framing, for events here and for requests on the client side (`tcpxctl bench --via
/// local`, the suite's framed client). A growable buffer (`Vec`, `BytesMut`) never runs out of room.
pub fn put_frame(out: &mut impl BufMut, msg: &impl Message) -> Result<(), prost::EncodeError> {
    out.put_u32(msg.encoded_len() as u32);
    msg.encode(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::proto::v1::session_request::Op;

    fn frame(req: &pb::SessionRequest) -> Vec<u8> {
        let body = req.encode_to_vec();
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend(body);
        v
    }

    #[test]
    fn frames_split_anywhere_decode_in_order() {
        let reqs: Vec<_> = (1..=3)
            .map(|tag| pb::SessionRequest {
                tag,
                op: Some(Op::CancelTag(tag * 10)),
            })
            .collect();
        let wire: Vec<u8> = reqs.iter().flat_map(frame).collect();
        for cut in 0..wire.len() {
            let mut buf = BytesMut::new();
            let mut got = Vec::new();
            for part in [&wire[..cut], &wire[cut..]] {
                buf.extend_from_slice(part);
                while let Some(r) = RequestDecoder.decode(&mut buf).unwrap() {
                    got.push(r);
                }
            }
            assert_eq!(got, reqs, "cut at {cut}");
            assert!(RequestDecoder.decode_eof(&mut buf).unwrap().is_none());
        }
    }

    #[test]
    fn an_empty_frame_is_an_empty_request() {
        let mut buf = BytesMut::from(&[0u8, 0, 0, 0][..]);
        let r = RequestDecoder.decode(&mut buf).unwrap().unwrap();
        assert_eq!(r, pb::SessionRequest::default());
    }

    #[test]
    fn limits_name_the_size_and_the_limit() {
        let mut buf = BytesMut::from(&(MAX_FRAME as u32 + 1).to_be_bytes()[..]);
        let e = RequestDecoder.decode(&mut buf).unwrap_err();
        let st = e.status().unwrap();
        assert_eq!(st.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            st.message(),
            "frame: 67108865 bytes is over the 67108864-byte limit"
        );
        // Exactly the limit is fine (it waits for the body).
        let mut buf = BytesMut::from(&(MAX_FRAME as u32).to_be_bytes()[..]);
        assert!(RequestDecoder.decode(&mut buf).unwrap().is_none());

        let mut buf = BytesMut::from(&[0u8, 0, 0, 2, 0xff, 0xff][..]);
        let st = RequestDecoder.decode(&mut buf).unwrap_err().status().unwrap();
        assert_eq!(st.code(), tonic::Code::InvalidArgument);
        assert!(
            st.message().starts_with("frame: not a SessionRequest: "),
            "{}",
            st.message()
        );

        let mut buf = BytesMut::from(&[0u8, 0, 0, 9, 1][..]);
        assert!(RequestDecoder.decode(&mut buf).unwrap().is_none());
        let st = RequestDecoder.decode_eof(&mut buf).unwrap_err().status().unwrap();
        assert_eq!(st.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn events_are_length_prefixed() {
        let ev = pb::SessionEvent {
            tag: 7,
            event: Some(pb::session_event::Event::Cancelled(pb::CancelResponse {
                cancelled: true,
            })),
        };
        let mut out = BytesMut::new();
        put_event(&mut out, &ev).unwrap();
        let len = u32::from_be_bytes(out[..4].try_into().unwrap()) as usize;
        assert_eq!(len, out.len() - 4);
        assert_eq!(pb::SessionEvent::decode(&out[4..]).unwrap(), ev);
    }
}
