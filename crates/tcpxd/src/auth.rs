//! Authentication: the cluster secret peers prove to each other by challenge-response in the
//! handshake, and the bearer token the client API's TCP listener requires.
//!
//! Neither the secret nor the token is ever logged or put in an error message: their types
//! print as `<redacted>`.
//!
//! The peer handshake with a secret (HMAC-SHA256 over length-prefixed fields):
//! 1. the caller asks the callee for a challenge: a fresh 32-byte `server_nonce`, single use,
//!    valid for the connect timeout;
//! 2. the caller's `Handshake` carries the server nonce, its own fresh `client_nonce` and
//!    `proof = HMAC(secret, "handshake" | server_nonce | client_nonce | node_id | listen_port |
//!    lanes)`. The callee consumes the nonce and checks the proof before doing anything else: a
//!    replayed handshake names a used nonce and is refused; an unauthenticated caller gets no
//!    lane handle and opens nothing;
//! 3. the callee's answer carries `HMAC(secret, "accept" | client_nonce | server_nonce |
//!    session_id | node_id | lanes)`, which the caller checks before connecting any lane (an
//!    impostor callee, or a replayed answer, fails: the client nonce is fresh);
//! 4. the caller's `Hello` carries `HMAC(secret, "hello" | server_nonce | client_nonce |
//!    session_id | node_id)`, binding the control stream to the authenticated handshake.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use tonic::Status;

use crate::api::proto::peer as pb;

type HmacSha256 = Hmac<Sha256>;

/// Length of every nonce in the handshake.
pub const NONCE_BYTES: usize = 32;
/// Shortest secret or token accepted.
pub const MIN_SECRET_BYTES: usize = 16;
/// Most challenges outstanding at once; past that, issuing one drops the oldest.
pub const MAX_CHALLENGES: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path}: {len} bytes after trimming whitespace; at least {MIN_SECRET_BYTES} required")]
    TooShort {
        what: &'static str,
        path: PathBuf,
        len: usize,
    },
}

/// Reads a secret file: its content less surrounding whitespace, at least 16 bytes.
fn read_secret(what: &'static str, path: &Path) -> Result<Vec<u8>, AuthError> {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            file = %path.display(),
            "{what} is readable by other users (mode {:o}); chmod 0600 it",
            meta.permissions().mode() & 0o777
        );
    }
    let raw = std::fs::read(path).map_err(|source| AuthError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    let text = raw.trim_ascii().to_vec();
    if text.len() < MIN_SECRET_BYTES {
        return Err(AuthError::TooShort {
            what,
            path: path.to_path_buf(),
            len: text.len(),
        });
    }
    Ok(text)
}

/// Equality of two byte strings whose time depends on neither content (both are hashed first,
/// so not even the length leaks through an early exit).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let (x, y) = (Sha256::digest(a), Sha256::digest(b));
    let diff = x.iter().zip(y.iter()).fold(0u8, |acc, (p, q)| acc | (p ^ q));
    std::hint::black_box(diff) == 0
}

/// The shared cluster secret.
#[derive(Clone)]
pub struct ClusterSecret(Vec<u8>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// What a proof is about: each label gives a different MAC for the same fields.
#[derive(Debug, Clone, Copy)]
pub enum ProofOf {
    Handshake,
    Accept,
    Hello,
    /// A direct control connection's opening (`peers/direct.rs`).
    Direct,
}

impl ProofOf {
    fn label(self) -> &'static [u8] {
        match self {
            ProofOf::Handshake => b"tcpxd.peer.v1 handshake",
            ProofOf::Accept => b"tcpxd.peer.v1 accept",
            ProofOf::Hello => b"tcpxd.peer.v1 hello",
            ProofOf::Direct => b"tcpxd.peer.v1 direct",
        }
    }
}

/// The lane handles as proof input.
pub fn lanes_bytes(lanes: &[pb::LaneHandle]) -> Vec<u8> {
    let mut out = Vec::with_capacity(lanes.len() * 140);
    for l in lanes {
        out.extend_from_slice(&l.lane.to_le_bytes());
        out.extend_from_slice(&l.device.to_le_bytes());
        out.extend_from_slice(&(l.handle.len() as u64).to_le_bytes());
        out.extend_from_slice(&l.handle);
    }
    out
}

/// The lanes and the topology a handshake announces, as proof input.
fn lanes_and_topology(lanes: &[pb::LaneHandle], topology: Option<&pb::PeerTopology>) -> Vec<u8> {
    let mut out = lanes_bytes(lanes);
    if let Some(t) = topology {
        out.extend_from_slice(b"topology");
        out.extend_from_slice(&prost::Message::encode_to_vec(t));
    }
    out
}

/// What a Handshake's proof covers.
pub fn handshake_fields(server: &[u8], client_nonce: &[u8], req: &pb::HandshakeRequest) -> [Vec<u8>; 5] {
    [
        server.to_vec(),
        client_nonce.to_vec(),
        req.node_id.as_bytes().to_vec(),
        req.listen_port.to_le_bytes().to_vec(),
        lanes_and_topology(&req.lanes, req.topology.as_ref()),
    ]
}

/// What a HandshakeResponse's proof covers.
pub fn accept_fields(server: &[u8], client_nonce: &[u8], resp: &pb::HandshakeResponse) -> [Vec<u8>; 5] {
    [
        client_nonce.to_vec(),
        server.to_vec(),
        resp.session_id.to_le_bytes().to_vec(),
        resp.node_id.as_bytes().to_vec(),
        lanes_and_topology(&resp.lanes, resp.topology.as_ref()),
    ]
}

/// What a direct control connection's proof covers: the handshake's nonces and the token the
/// callee issued in its answer.
pub fn direct_fields(server: &[u8], client_nonce: &[u8], token: &[u8]) -> [Vec<u8>; 3] {
    [server.to_vec(), client_nonce.to_vec(), token.to_vec()]
}

/// What a Hello's proof covers.
pub fn hello_fields(server: &[u8], client_nonce: &[u8], session_id: u64, node_id: &str) -> [Vec<u8>; 4] {
    [
        server.to_vec(),
        client_nonce.to_vec(),
        session_id.to_le_bytes().to_vec(),
        node_id.as_bytes().to_vec(),
    ]
}

impl ClusterSecret {
    pub fn load(path: &Path) -> Result<ClusterSecret, AuthError> {
        read_secret("peer.secret_file", path).map(ClusterSecret)
    }

    #[doc(hidden)]
    pub fn from_bytes(b: &[u8]) -> ClusterSecret {
        ClusterSecret(b.to_vec())
    }

    fn mac(&self, of: ProofOf, fields: &[impl AsRef<[u8]>]) -> HmacSha256 {
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(of.label());
        for f in fields {
            let f = f.as_ref();
            m.update(&(f.len() as u64).to_le_bytes());
            m.update(f);
        }
        m
    }

    /// The proof over `fields`.
    pub fn prove(&self, of: ProofOf, fields: &[impl AsRef<[u8]>]) -> Vec<u8> {
        self.mac(of, fields).finalize().into_bytes().to_vec()
    }

    /// Checks a proof in constant time.
    pub fn check(&self, of: ProofOf, fields: &[impl AsRef<[u8]>], proof: &[u8]) -> bool {
        self.mac(of, fields).verify_slice(proof).is_ok()
    }
}

/// A fresh random nonce.
pub fn nonce() -> [u8; NONCE_BYTES] {
    rand::random()
}

/// The challenges this daemon issued and not yet saw used: single use, expiring.
pub struct Challenges {
    issued: Mutex<HashMap<[u8; NONCE_BYTES], Instant>>,
    ttl: Duration,
}

impl Challenges {
    pub fn new(ttl: Duration) -> Challenges {
        Challenges {
            issued: Mutex::new(HashMap::new()),
            ttl,
        }
    }

    /// A new challenge. Past `MAX_CHALLENGES` outstanding, the oldest is dropped: a flood of
    /// challenge requests costs bounded memory and cannot lock real peers out (their handshake
    /// follows their challenge within milliseconds).
    pub fn issue(&self) -> [u8; NONCE_BYTES] {
        let now = Instant::now();
        let mut issued = self.issued.lock().unwrap_or_else(|e| e.into_inner());
        issued.retain(|_, expires| *expires > now);
        while issued.len() >= MAX_CHALLENGES {
            let oldest = issued.iter().min_by_key(|(_, e)| **e).map(|(n, _)| *n);
            match oldest {
                Some(n) => issued.remove(&n),
                None => break,
            };
        }
        let n = nonce();
        issued.insert(n, now + self.ttl);
        n
    }

    /// Uses up a challenge: true when this daemon issued it, unused and unexpired.
    pub fn take(&self, n: &[u8]) -> bool {
        let Ok(n) = <[u8; NONCE_BYTES]>::try_from(n) else {
            return false;
        };
        let mut issued = self.issued.lock().unwrap_or_else(|e| e.into_inner());
        issued.remove(&n).is_some_and(|expires| expires > Instant::now())
    }
}

/// Mutual TLS on the peer service: this node's certificate and key, and the cluster CA that
/// signed every node's certificate. Both directions require a certificate from that CA.
#[derive(Clone)]
pub struct PeerTls {
    pub server: tonic::transport::ServerTlsConfig,
    pub client: tonic::transport::ClientTlsConfig,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerTls(<redacted>)")
    }
}

impl PeerTls {
    /// Reads the PEM files (their content is checked when the listener and connections start).
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<PeerTls, AuthError> {
        let read = |what: &'static str, p: &Path| {
            std::fs::read(p).map_err(|source| AuthError::Read {
                what,
                path: p.to_path_buf(),
                source,
            })
        };
        let identity = tonic::transport::Identity::from_pem(
            read("peer.tls_cert_file", cert)?,
            read("peer.tls_key_file", key)?,
        );
        let ca = tonic::transport::Certificate::from_pem(read("peer.tls_ca_file", ca)?);
        Ok(PeerTls {
            server: tonic::transport::ServerTlsConfig::new()
                .identity(identity.clone())
                .client_ca_root(ca.clone()),
            client: tonic::transport::ClientTlsConfig::new()
                .identity(identity)
                .ca_certificate(ca),
        })
    }
}

/// The client API's bearer token (TCP listener only).
#[derive(Clone)]
pub struct ApiToken(Vec<u8>);

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

impl ApiToken {
    pub fn load(path: &Path) -> Result<ApiToken, AuthError> {
        read_secret("api.token_file", path).map(ApiToken)
    }

    /// The value of an `authorization` header carrying this token.
    pub fn header_value(&self) -> Result<tonic::metadata::MetadataValue<tonic::metadata::Ascii>, String> {
        let text = std::str::from_utf8(&self.0).map_err(|_| "the API token is not UTF-8".to_string())?;
        format!("Bearer {text}")
            .parse()
            .map_err(|_| "the API token has characters a header cannot carry".to_string())
    }

    /// Checks a request's `authorization: Bearer <token>` header in constant time.
    pub fn check<T>(&self, req: &tonic::Request<T>) -> Result<(), Status> {
        let Some(value) = req.metadata().get("authorization") else {
            return Err(Status::unauthenticated(
                "authorization: the API's TCP listener requires a bearer token (authorization: Bearer <token>)",
            ));
        };
        let presented = value.as_bytes().strip_prefix(b"Bearer ").unwrap_or(b"");
        if constant_time_eq(presented, &self.0) {
            Ok(())
        } else {
            Err(Status::unauthenticated(
                "authorization: the bearer token is wrong",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_every_field_and_the_label() {
        let s = ClusterSecret::from_bytes(b"0123456789abcdef-secret");
        let f: [&[u8]; 3] = [b"n1", b"n2", b"node"];
        let p = s.prove(ProofOf::Handshake, &f);
        assert!(s.check(ProofOf::Handshake, &f, &p));
        assert!(!s.check(ProofOf::Accept, &f, &p));
        let g: [&[u8]; 3] = [b"n1", b"n2", b"nodf"];
        assert!(!s.check(ProofOf::Handshake, &g, &p));
        // Length prefixes: moving a byte between fields changes the proof.
        let h: [&[u8]; 3] = [b"n1n", b"2", b"node"];
        assert!(!s.check(ProofOf::Handshake, &h, &p));
        let other = ClusterSecret::from_bytes(b"0123456789abcdef-secreT");
        assert!(!other.check(ProofOf::Handshake, &f, &p));
        assert!(!s.check(ProofOf::Handshake, &f, &p[..31]));
        assert_eq!(format!("{s:?}"), "ClusterSecret(<redacted>)");
    }

    #[test]
    fn challenges_are_single_use() {
        let c = Challenges::new(Duration::from_secs(30));
        let n = c.issue();
        assert!(c.take(&n));
        assert!(!c.take(&n), "a used challenge is refused");
        assert!(!c.take(&nonce()), "an unknown challenge is refused");
        assert!(!c.take(&n[..16]));
        let expired = Challenges::new(Duration::ZERO);
        let n = expired.issue();
        assert!(!expired.take(&n), "an expired challenge is refused");
        // A flood keeps memory bounded and the newest challenges usable.
        let first = c.issue();
        let mut last = first;
        for _ in 0..MAX_CHALLENGES {
            last = c.issue();
        }
        assert!(c.issued.lock().unwrap().len() <= MAX_CHALLENGES);
        assert!(!c.take(&first), "the oldest was dropped");
        assert!(c.take(&last));
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        let t = ApiToken(b"tok-0123456789abcdef".to_vec());
        let mut req = tonic::Request::new(());
        assert_eq!(t.check(&req).unwrap_err().code(), tonic::Code::Unauthenticated);
        req.metadata_mut()
            .insert("authorization", "Bearer tok-0123456789abcdeX".parse().unwrap());
        assert_eq!(t.check(&req).unwrap_err().code(), tonic::Code::Unauthenticated);
        req.metadata_mut()
            .insert("authorization", t.header_value().unwrap());
        assert!(t.check(&req).is_ok());
        assert_eq!(format!("{t:?}"), "ApiToken(<redacted>)");
    }
}
