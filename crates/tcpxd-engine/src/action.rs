//! [`Action`]: what the engine asks of its driver, taken with [`Engine::poll_action`] and
//! carried out in order (the crate doc's "Driving it").

#[cfg(doc)]
use crate::Engine;
use crate::wire::PeerMsg;
use crate::{Outcome, PairLife, PeerIdx, TransferId};

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send a control message to a peer.
    Control { peer: PeerIdx, msg: PeerMsg },
    /// Put the control messages framed so far for `peer` on the wire now, not at the end of
    /// the batch of actions: the one before it is what a client waits for (a received WRITE's
    /// `Done`, whose sender answers its client on it), and the actions after it (the consumed
    /// chunks' credit receives posted again, notifications) are not. A driver that writes each
    /// control message at once may ignore it.
    SendNow { peer: PeerIdx },
    /// Post one send on a lane (the window has room).
    PostSend {
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offset: u64,
        len: u32,
    },
    /// Post one credit receive on a lane: `len` bytes into the lane's landing slots (eager
    /// mode; where the bytes go is decided by a later `Land`).
    PostCredit { peer: PeerIdx, lane: u32, len: u32 },
    /// The oldest completed credit receive of a lane that has no destination yet belongs to
    /// this chunk: unpack its `len` bytes into `buffer` at `offset`, or (`buffer: None`, a
    /// rejected or cancelled transfer) consume it without unpacking. Then report
    /// `on_recv_consumed`.
    Land {
        peer: PeerIdx,
        lane: u32,
        buffer: Option<u64>,
        offset: u64,
        len: u32,
    },
    /// Post one send on a lane whose bytes lie in pieces of `buffer`: copy the pieces
    /// ([`Engine::send_pieces`]`(offer, wire, len)`, in wire order) into a staging slot of the
    /// lane and send `len` bytes from there. At most `send_window + gather_ahead` of a lane's
    /// sends are posted and unfinished, so a ring of that many slots per lane is never overrun;
    /// the driver hands the plugin at most `send_window` of them ("Windows" in the crate doc).
    PostGatherSend {
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offer: u64,
        wire: u64,
        len: u32,
    },
    /// Post one receive on a lane whose bytes go to pieces of `buffer`
    /// ([`Engine::recv_pieces`]`(peer, offer, wire, len)`): posted into a landing place of the
    /// lane, and once it completed, scattered into the pieces (only while
    /// [`Engine::recv_lands`]`(peer, offer)`, as for `PostRecv`) before `on_recv_consumed` is
    /// reported. At most `recv_window + scatter_ahead` receives of a lane are posted (until
    /// consumed), the driver handing the plugin at most `recv_window` of them.
    PostScatterRecv {
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offer: u64,
        wire: u64,
        len: u32,
    },
    /// Eager: as [`Action::Land`], but the chunk's bytes go to pieces of `buffer`
    /// ([`Engine::recv_pieces`]`(peer, offer, wire, len)`).
    LandScatter {
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offer: u64,
        wire: u64,
        len: u32,
    },
    /// Post one receive on a lane (the window has room), into `buffer` at `offset`, for the
    /// chunk of offer `offer` (from `peer`). Once it completed, unpack it only while
    /// [`Engine::recv_lands`]`(peer, offer)` says so (a transfer that failed or was cancelled
    /// since: consume it without unpacking, so no byte of the destination changes after the
    /// transfer ended); then report `on_recv_consumed`.
    PostRecv {
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offset: u64,
        len: u32,
        offer: u64,
    },
    /// Post one receive of `len` bytes on a lane into a landing place of the lane's own, not
    /// into any buffer: its chunk belongs to a transfer that failed or was cancelled on this
    /// node (the chunks already agreed on still come, data or empty). Consume it without
    /// unpacking, then report `on_recv_consumed`. (Posted into the destination, a plugin that
    /// receives in place would write it there after the transfer ended.)
    PostDropRecv { peer: PeerIdx, lane: u32, len: u32 },
    /// A transfer's end-to-end bytes advanced.
    Progress {
        transfer: TransferId,
        bytes_done: u64,
        total: u64,
        running: bool,
    },
    /// A transfer ended.
    Finished { transfer: TransferId, outcome: Outcome },
    /// Data from a peer landed; deliver its notification to local subscribers. `transfer_id`:
    /// the peer's transfer that carried it (`Offer::notify_id`, or a prepared transfer's id).
    Notify {
        peer: PeerIdx,
        transfer_id: u64,
        payload: Vec<u8>,
        buffers: Vec<u64>,
    },
    /// The peer asked to send on receive lane `lane` (`lane_life.rs`): listen for it on the
    /// lane's NIC with the lane's GPU current, send the peer `PeerMsg::LaneListening` with the
    /// handle (on the control stream, before any later action's message), accept, and report
    /// `on_lane_ready(peer, lane, false)`.
    ListenLane { peer: PeerIdx, lane: u32 },
    /// The peer listens for send lane `lane`: connect to `handle` with the lane's GPU current
    /// and report `on_lane_ready(peer, lane, true)` (a handle that cannot be read or a connect
    /// that fails: `on_peer_failed`).
    ConnectLane {
        peer: PeerIdx,
        lane: u32,
        handle: Vec<u8>,
    },
    /// Both sides agreed the lane is idle: close its comm (and what was registered on it). Its
    /// requests are all done (a receive lane's idle credit receives go with the comm).
    CloseLane { peer: PeerIdx, lane: u32, send: bool },
    /// The peer failed: close its comms (the engine already dropped its queues).
    ClosePeer { peer: PeerIdx, reason: String },
    /// A pairing's life changed (`pair_life.rs`). `Closing`: this side asked the peer to close
    /// it (a transfer naming it is refused with `EngineError::closed_pairing` until it is `Live`
    /// again or `Closed`); `Live`: the peer kept it; `Closed`: both sides agreed it is idle —
    /// close every comm it has, end its control stream once the messages already sent to it
    /// are out, and report it idle, not failed. Nothing names it again but `ReleasePeer`.
    Pairing { peer: PeerIdx, life: PairLife },
    /// A failed pairing the engine forgot (`release.rs`), or one closed when idle that a new
    /// pairing with its node took over (`pair_life.rs`): drop whatever the driver still keeps
    /// for it. No action names it again.
    ReleasePeer { peer: PeerIdx },
    /// Send an inline transfer (`inline.rs`): read the bytes of `sources` (buffer, offset,
    /// length), in order, into one payload and send `PeerMsg::Inline { offer, payload }` on the
    /// control stream, before any later action's message. A source that cannot be read: send
    /// nothing and report [`Engine::on_inline_unsent`].
    SendInline {
        peer: PeerIdx,
        offer: crate::Offer,
        sources: Vec<(u64, u64, u64)>,
        /// Some source is GPU memory: the driver may copy the payload out asynchronously and
        /// send the message once the copy ended; either way it reports
        /// [`Engine::on_inline_gathered`] first and sends only if that says so.
        gather: bool,
    },
    /// Land an inline transfer from `peer` (its ranges checked): only while
    /// [`Engine::recv_lands`]`(peer, offer)`, copy `payload` into `dests` (buffer, offset,
    /// length), in order; then, whatever came of it, report [`Engine::on_inline_landed`]
    /// before carrying out the next action (its `Done` and notification follow from that).
    /// Into GPU memory the copy may run asynchronously: then report it once the copy ended
    /// (the engine keeps the destination buffers in use until then, whatever else happens).
    LandInline {
        peer: PeerIdx,
        offer: u64,
        dests: Vec<(u64, u64, u64)>,
        payload: Vec<u8>,
        /// Some destination is GPU memory (the copy may run asynchronously).
        gpu: bool,
    },
    /// The last user of a buffer someone waits for ([`Engine::watch_buffer`]) ended: it can be
    /// released now.
    BufferIdle { buffer: u64 },
}

/// The names of [`Action`]'s kinds, in [`Action::kind`]'s order (a driver's per-kind clocks:
/// the daemon's `tcpxd_poller_action_seconds_total{kind}`).
pub const ACTION_KINDS: [&str; 22] = [
    "control",
    "post_send",
    "post_credit",
    "land",
    "post_gather_send",
    "post_scatter_recv",
    "land_scatter",
    "post_recv",
    "post_drop_recv",
    "progress",
    "finished",
    "notify",
    "listen_lane",
    "connect_lane",
    "close_lane",
    "close_peer",
    "pairing",
    "release_peer",
    "send_inline",
    "land_inline",
    "buffer_idle",
    "send_now",
];

impl Action {
    /// This action's kind: its index in [`ACTION_KINDS`].
    pub fn kind(&self) -> usize {
        match self {
            Action::Control { .. } => 0,
            Action::PostSend { .. } => 1,
            Action::PostCredit { .. } => 2,
            Action::Land { .. } => 3,
            Action::PostGatherSend { .. } => 4,
            Action::PostScatterRecv { .. } => 5,
            Action::LandScatter { .. } => 6,
            Action::PostRecv { .. } => 7,
            Action::PostDropRecv { .. } => 8,
            Action::Progress { .. } => 9,
            Action::Finished { .. } => 10,
            Action::Notify { .. } => 11,
            Action::ListenLane { .. } => 12,
            Action::ConnectLane { .. } => 13,
            Action::CloseLane { .. } => 14,
            Action::ClosePeer { .. } => 15,
            Action::Pairing { .. } => 16,
            Action::ReleasePeer { .. } => 17,
            Action::SendInline { .. } => 18,
            Action::LandInline { .. } => 19,
            Action::BufferIdle { .. } => 20,
            Action::SendNow { .. } => 21,
        }
    }
}

#[cfg(test)]
mod kind_tests {
    use super::*;

    #[test]
    fn every_kind_names_itself_as_its_variant_does() {
        let samples = [
            Action::PostCredit {
                peer: PeerIdx(0),
                lane: 1,
                len: 4096,
            },
            Action::PostDropRecv {
                peer: PeerIdx(0),
                lane: 1,
                len: 4096,
            },
            Action::ListenLane {
                peer: PeerIdx(0),
                lane: 2,
            },
            Action::CloseLane {
                peer: PeerIdx(0),
                lane: 2,
                send: true,
            },
            Action::ReleasePeer { peer: PeerIdx(3) },
            Action::BufferIdle { buffer: 7 },
            Action::SendNow { peer: PeerIdx(3) },
        ];
        for a in &samples {
            let debug = format!("{a:?}");
            let variant = debug.split([' ', '{', '(']).next().unwrap();
            let snake: String = variant
                .chars()
                .enumerate()
                .flat_map(|(i, c)| {
                    let lower = c.to_ascii_lowercase();
                    if c.is_ascii_uppercase() && i > 0 {
                        vec!['_', lower]
                    } else {
                        vec![lower]
                    }
                })
                .collect();
            assert_eq!(ACTION_KINDS[a.kind()], snake, "{debug}");
        }
    }
}
