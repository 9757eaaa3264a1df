//! The lane pass, one mechanism for the poller and for `tcpxctl bench raw`: what a pass does
//! with a lane's comm, without the engine.
//!
//! - Receive lanes ([`RecvQueue`]): post receives as the window allows, test the head of the
//!   comm, start the unpack of what completed ([`start_unpack`]: nothing when the plugin received
//!   in place, a host gather for host memory, a push into the GPU's [`GpuStage`] for CUDA
//!   memory, one batch per GPU per pass), and consume (`irecvConsumed`) in ring order once
//!   unpacked. A receive dropped without unpacking is [`discard`]ed (its host landing slot
//!   zeroed).
//! - Send lanes ([`post_send`], [`test_sends`]): post within the window, test the head.
//!
//! Each user keeps what is its own: the poller its engine events (what to post comes from the
//! engine's actions, completions go back as events), the raw bench its transfer accounting.

mod recv;
mod send;
pub mod stage;
mod unpack;

pub use recv::{Landed, Posted, RecvQueue};
pub use send::{post_send, test_sends};
pub use stage::{BatchEnd, GpuStage, stage_for};
pub use unpack::{Dest, Target, Wait, check_list, discard, start_unpack};

/// A lane's request tags: TCPX ignores them (the k-th send meets the k-th receive), so they only
/// number a lane's requests for the plugin's logs, wrapping within `i32`'s positive range.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tag(i32);

impl Tag {
    /// The next tag (the first is 1).
    pub fn advance(&mut self) -> i32 {
        self.0 = self.0.wrapping_add(1) & 0x7fff_ffff;
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_count_from_one_and_stay_positive() {
        let mut t = Tag::default();
        assert_eq!((t.advance(), t.advance()), (1, 2));
        let mut t = Tag(i32::MAX - 1);
        assert_eq!(t.advance(), i32::MAX);
        assert_eq!(t.advance(), 0);
        assert_eq!(t.advance(), 1);
    }
}
