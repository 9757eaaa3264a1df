//! What goes over the wire and into the listen handle. All integers are little-endian.
//!
//! Listen handle (128 bytes; `listen` zeroes all of it):
//! ```text
//!   0  u32  magic "TXEM"            24  [16] address (IPv4: first 4 bytes)
//!   4  u16  version (1)             40  u64  listen nonce
//!   6  u8   family (4 or 6)         48..88   zero
//!   8  u32  listener's device       88  u8   connect stage: 0 idle, 1 connecting
//!  12  u16  port                    96  u64  connect stage: pointer to the in-progress connect
//!  14  u16  nsocks per thread      104..128  zero
//!  16  u16  nthreads
//! ```
//! Hello (32 bytes, first thing on every socket a connector opens):
//! `magic "TXHL" u32 | version u16 | role u16 (0 = ctrl, 1+i = data socket i) | connection id u64 |
//!  listen nonce u64 | data sockets u16 | zero [6]`.
//! The acceptor answers the ctrl socket with one ack byte (0x06) when `accept` takes the group.
//!
//! Control header (24 bytes, one per request, on the ctrl socket):
//! `magic "TXRQ" u32 | chunk size u32 | request seq u64 | size u32 | zero u32`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub(crate) const HANDLE_MAGIC: u32 = u32::from_le_bytes(*b"TXEM");
pub(crate) const HANDLE_VERSION: u16 = 1;
pub(crate) const HANDLE_DESC_LEN: usize = 88;
pub(crate) const STAGE_STATE_OFF: usize = 88;
pub(crate) const STAGE_PTR_OFF: usize = 96;
pub(crate) const STAGE_IDLE: u8 = 0;
pub(crate) const STAGE_CONNECTING: u8 = 1;

pub(crate) const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"TXHL");
pub(crate) const HELLO_VERSION: u16 = 1;
pub(crate) const HELLO_LEN: usize = 32;
pub(crate) const ROLE_CTRL: u16 = 0;
pub(crate) const ACK: u8 = 0x06;

pub(crate) const HEADER_MAGIC: u32 = u32::from_le_bytes(*b"TXRQ");
pub(crate) const HEADER_LEN: usize = 24;

fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn get_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}
pub(crate) fn get_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// The descriptive part of a listen handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HandleDesc {
    pub(crate) device: u32,
    pub(crate) addr: IpAddr,
    pub(crate) port: u16,
    pub(crate) nsocks: u16,
    pub(crate) nthreads: u16,
    pub(crate) nonce: u64,
}

impl HandleDesc {
    /// Data sockets per comm, as the listener asked.
    pub(crate) fn sockets(&self) -> usize {
        (usize::from(self.nsocks) * usize::from(self.nthreads)).clamp(1, crate::config::MAX_SOCKETS as usize)
    }

    pub(crate) fn encode(&self, out: &mut [u8; 128]) {
        out.fill(0);
        put_u32(out, 0, HANDLE_MAGIC);
        put_u16(out, 4, HANDLE_VERSION);
        match self.addr {
            IpAddr::V4(a) => {
                out[6] = 4;
                out[24..28].copy_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                out[6] = 6;
                out[24..40].copy_from_slice(&a.octets());
            }
        }
        put_u32(out, 8, self.device);
        put_u16(out, 12, self.port);
        put_u16(out, 14, self.nsocks);
        put_u16(out, 16, self.nthreads);
        put_u64(out, 40, self.nonce);
    }

    pub(crate) fn decode(b: &[u8; 128]) -> Result<HandleDesc, String> {
        let magic = get_u32(b, 0);
        if magic != HANDLE_MAGIC {
            return Err(format!("bad handle magic {magic:#010x}"));
        }
        let version = get_u16(b, 4);
        if version != HANDLE_VERSION {
            return Err(format!("unsupported handle version {version}"));
        }
        let addr = match b[6] {
            4 => IpAddr::V4(Ipv4Addr::new(b[24], b[25], b[26], b[27])),
            6 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(&b[24..40]);
                IpAddr::V6(Ipv6Addr::from(a))
            }
            f => return Err(format!("bad address family {f}")),
        };
        let d = HandleDesc {
            device: get_u32(b, 8),
            addr,
            port: get_u16(b, 12),
            nsocks: get_u16(b, 14),
            nthreads: get_u16(b, 16),
            nonce: get_u64(b, 40),
        };
        if d.port == 0 || d.nsocks == 0 || d.nthreads == 0 {
            return Err("handle has port 0 or no sockets".into());
        }
        Ok(d)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) role: u16,
    pub(crate) conn_id: u64,
    pub(crate) nonce: u64,
    pub(crate) nsockets: u16,
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        put_u32(&mut b, 0, HELLO_MAGIC);
        put_u16(&mut b, 4, HELLO_VERSION);
        put_u16(&mut b, 6, self.role);
        put_u64(&mut b, 8, self.conn_id);
        put_u64(&mut b, 16, self.nonce);
        put_u16(&mut b, 24, self.nsockets);
        b
    }

    pub(crate) fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, String> {
        if get_u32(b, 0) != HELLO_MAGIC || get_u16(b, 4) != HELLO_VERSION {
            return Err("not a tcpxemu hello".into());
        }
        Ok(Hello {
            role: get_u16(b, 6),
            conn_id: get_u64(b, 8),
            nonce: get_u64(b, 16),
            nsockets: get_u16(b, 24),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) chunk: u32,
    pub(crate) seq: u64,
    pub(crate) size: u32,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        put_u32(&mut b, 0, HEADER_MAGIC);
        put_u32(&mut b, 4, self.chunk);
        put_u64(&mut b, 8, self.seq);
        put_u32(&mut b, 16, self.size);
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        if get_u32(b, 0) != HEADER_MAGIC {
            return Err("bad control header magic".into());
        }
        let h = Header {
            chunk: get_u32(b, 4),
            seq: get_u64(b, 8),
            size: get_u32(b, 16),
        };
        if h.size > 0 && h.chunk == 0 {
            return Err("control header with chunk size 0".into());
        }
        Ok(h)
    }
}

/// Chunks of a request of `size` bytes cut at `chunk` bytes.
pub(crate) fn nchunks(size: u32, chunk: u32) -> u64 {
    if size == 0 {
        0
    } else {
        u64::from(size).div_ceil(u64::from(chunk))
    }
}

/// The first chunk index (within a request whose first chunk has running number `start`) that
/// socket `me` of `nsocks` carries: chunk k goes to socket `(start + k) % nsocks`.
pub(crate) fn first_chunk_for(start: u64, me: usize, nsocks: usize) -> u64 {
    let n = nsocks as u64;
    (me as u64 + n - start % n) % n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_roundtrip() {
        let d = HandleDesc {
            device: 3,
            addr: "::1".parse().unwrap(),
            port: 4242,
            nsocks: 2,
            nthreads: 3,
            nonce: 0xdead_beef_1234,
        };
        let mut b = [0xffu8; 128];
        d.encode(&mut b);
        assert!(b[HANDLE_DESC_LEN..].iter().all(|&x| x == 0));
        assert_eq!(HandleDesc::decode(&b).unwrap(), d);
        assert_eq!(d.sockets(), 6);
        b[0] ^= 1;
        assert!(HandleDesc::decode(&b).is_err());
    }

    #[test]
    fn chunk_mapping_covers_every_chunk_once() {
        for nsocks in 1..6 {
            for start in 0..10u64 {
                let total = 13u64;
                let mut seen = vec![0; total as usize];
                for me in 0..nsocks {
                    let mut k = first_chunk_for(start, me, nsocks);
                    while k < total {
                        assert_eq!((start + k) % nsocks as u64, me as u64);
                        seen[k as usize] += 1;
                        k += nsocks as u64;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1));
            }
        }
    }

    #[test]
    fn header_roundtrip() {
        let h = Header {
            chunk: 524288,
            seq: 7,
            size: 1 << 20,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        assert_eq!(nchunks(0, 0), 0);
        assert_eq!(nchunks(1, 4096), 1);
        assert_eq!(nchunks(8193, 4096), 3);
    }
}
