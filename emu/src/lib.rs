//! tcpxemu: an emulation of the GPUDirect-TCPX NCCL net plugin over plain TCP.
//!
//! The cdylib (`libnccl_net_tcpxemu.so`) exports exactly one symbol, [`ncclNetPlugin_v7`], an
//! `ncclNet_v7_t` that behaves like Google's `nccl-plugin-gpudirecttcpx`, traps included (see
//! `reference/TCPX_PLUGIN_ABI.md` §1–§3 and §7, and `docs/EMULATION.md`). The rlib lets a Rust
//! program (the daemon's built-in emulation, the tests) reach the same table in-process through
//! [`plugin_table`].
//!
//! Layout:
//! - [`abi`]: the shared `#[repr(C)]` mirror of the v7 ABI (one text with the daemon).
//! - `config`: the environment, read once at the first `init`.
//! - `log`: the NCCL logger (C variadic, called with `"%s"`) and an optional Rust hook.
//! - `memory`: the unpack ring, the bounce-page pool, the device-handle storage and the pinned
//!   staging of the CUDA mode.
//! - `cuda`: the CUDA driver API (loaded at run time; probed before first use), contexts.
//! - `wire`: the listen handle, the socket hellos and the control header.
//! - `sockio`, `sync`, `rng`: socket calls (`MSG_NOSIGNAL`), comm health and queues, a PRNG.
//! - `listen`, `connect`, `send`, `recv`: the comms and their helper threads (`recv::readers`: the
//!   receive comm's socket threads).
//! - `topology`: each NIC's `pciPath` and the GPUs it serves (RxDM's binding on A3).
//! - `hold`: the hold gate, a test knob that keeps sends from finishing while a file exists.
//! - `nccl`: the PAT guard (keeps NCCL 2.24+ off an algorithm that ignores device unpack).
//! - `ffi`: the 19 table entries, each behind `catch_unwind` (`ffi::requests`: memory registration
//!   and the request entries).

pub use tcpxd_abi as abi;

#[macro_use]
mod log;

mod config;
mod connect;
mod cuda;
mod ffi;
mod hold;
mod listen;
mod memory;
mod misbound;
mod nccl;
mod recv;
mod rng;
mod send;
mod sockio;
mod sync;
mod topology;
mod wire;

pub use log::{LogGate, LogHook, set_log_gate, set_log_hook};

/// The name this plugin reports in its table (`ncclNet_v7_t::name`).
pub const PLUGIN_NAME: &std::ffi::CStr = c"tcpxemu_v7";

/// The plugin table, exported for `dlopen`/`dlsym` as NCCL loads net plugins.
#[unsafe(no_mangle)]
pub static ncclNetPlugin_v7: abi::ncclNet_v7_t = ffi::TABLE;

/// The memory registrations of this process not yet deregistered, of `size` bytes (tests: that
/// no registration of a buffer outlives its removal; a size no other registration has picks it).
pub fn live_registrations(size: usize) -> usize {
    LIVE_MRS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&size)
        .copied()
        .unwrap_or(0)
}

/// Live registrations by size (`regMr` adds one, `deregMr` takes it back).
static LIVE_MRS: std::sync::Mutex<std::collections::BTreeMap<usize, usize>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn live_mrs(size: usize, by: isize) {
    let mut m = LIVE_MRS.lock().unwrap_or_else(|e| e.into_inner());
    let n = m.entry(size).or_insert(0);
    *n = n.saturating_add_signed(by);
    if *n == 0 {
        m.remove(&size);
    }
}

/// The same table for in-process use (the daemon's built-in emulation, tests).
pub fn plugin_table() -> &'static abi::ncclNet_v7_t {
    &ncclNetPlugin_v7
}
