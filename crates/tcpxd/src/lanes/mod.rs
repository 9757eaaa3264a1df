//! The lane pass, one mechanism for the poller and for `tcpxctl bench raw`: what a pass does
//! with a lane's comm, without the engine.
//!
//! - Receive lanes ([`RecvQueue`]): post receives as the window allows, test the head of the
//!   comm, start the unpack of what completed ([`start_unpack`]: nothing when the plugin received
//!   in place, a host gather for host memory, a push into the GPU's [`GpuStage`] for CUDA
//!   memory, one batch per GPU per [`GpuStage::advance`]), and consume (`irecvConsumed`) in ring
//!   order once unpacked. A receive dropped without unpacking is [`discard`]ed (its host landing slot
//!   zeroed).
//! - Send lanes ([`post_send`], [`test_sends`]): post within the window, test the head.
//!
//! Each user keeps what is its own: the poller its engine events (what to post comes from the
//! engine's actions, completions go back as events), the raw bench its transfer accounting.

mod recv;
mod send;
pub mod stage;
mod tag;
mod unpack;

pub use recv::{Landed, Posted, RecvQueue};
pub use send::{post_send, test_sends};
pub use stage::{BatchEnd, GpuStage, stage_for};
pub use tag::Tag;
pub use unpack::{Dest, Target, Wait, check_list, discard, start_unpack};

use std::cell::Cell;

thread_local! {
    static PASS: Cell<u64> = const { Cell::new(0) };
}

/// Starts the next pass of this thread's lane loop (the poller's): the hop trace's `pass` field
/// numbers the passes, so a trace tells in which pass each step of a chunk ran (a landing, its
/// unpack's launch, its consume, the message that ends its transfer), whatever the timings.
pub fn next_pass() {
    PASS.with(|p| p.set(p.get().wrapping_add(1)));
}

/// The number of this thread's current pass (0 on a thread that runs no lane loop).
pub fn pass() -> u64 {
    PASS.with(Cell::get)
}
