//! Safe owners of the plugin's comms, memory handles and requests.
//!
//! The owners enforce the plugin's rules before calling it: at most 16 outstanding requests per
//! comm, `test` only on the oldest in-flight request, `irecvConsumed` only for the oldest completed
//! receive. The `*_unchecked` variants skip exactly that check (and nothing that memory safety
//! depends on) so the conformance suite can watch the plugin enforce its own rules.
//!
//! Every request keeps its memory region alive until the plugin is done with it (a send until
//! `test` reports done, a receive until it is consumed); a comm keeps the plugin loaded.
//!
//! - `comm_core`: the shared comm pointer (closed when its last owner goes), `MemHandle`, `test`.
//! - `connect`: `ListenComm`, `Connector` and `loopback_pair`, which open comms.
//! - `send`: `SendComm`, its window and test order.
//! - `recv`: `RecvComm`, its window, test and consume order, the unpack ring and host landing.

use std::ffi::c_int;

use super::abi;
use super::error::{NetError, NetResult};

mod comm_core;
mod connect;
mod recv;
mod send;

pub use comm_core::MemHandle;
pub use connect::{Connector, ListenComm, loopback_pair};
pub use recv::{RecvComm, RecvCompletion};
pub use send::SendComm;

/// A value `test` must leave alone in TCPX (it never writes `*sizes`).
pub const SIZE_SENTINEL: c_int = -0x5A5A_5A5B;

/// The listen handle a receiver hands to its sender (`NCCL_NET_HANDLE_MAXSIZE` bytes).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ConnectHandle(pub [u8; abi::NCCL_NET_HANDLE_MAXSIZE]);

impl std::fmt::Debug for ConnectHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConnectHandle(")?;
        for b in &self.0[..16] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl ConnectHandle {
    pub fn from_bytes(bytes: &[u8]) -> NetResult<ConnectHandle> {
        let arr: [u8; abi::NCCL_NET_HANDLE_MAXSIZE] = bytes.try_into().map_err(|_| {
            NetError::InvalidArgument(format!(
                "a connect handle is {} bytes, got {}",
                abi::NCCL_NET_HANDLE_MAXSIZE,
                bytes.len()
            ))
        })?;
        Ok(ConnectHandle(arr))
    }
}

/// Identifies a request on its comm. Ids grow by one per post; they are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}
