//! The engine's settings ([`EngineConfig`]) and their defaults.

use std::time::Duration;

use crate::lane_life::DEFAULT_LANE_OPEN_TIMEOUT;
use crate::plan::DEFAULT_CHUNK_BYTES;

/// How this node receives (`transfer.protocol`), announced to each peer at pairing; senders
/// follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Offer, accept, then receives posted into the destination, on every lane.
    Rendezvous,
    /// Credit receives of `chunk_bytes` kept posted on every lane; every transfer is eager.
    Eager,
    /// The last `eager_lanes` receive lanes of each peer keep credits; transfers of at most
    /// `eager_max_bytes` go eager over those, larger ones by rendezvous over the others.
    Auto,
}

/// Limits and sizes.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Chunk size for the offers this node makes.
    pub chunk_bytes: u32,
    /// Plain transfers cut into fewer than two chunks per lane of their protocol take a smaller
    /// chunk, halved down to no less than this ([`crate::plan::spread_chunk_bytes`]); 0: off.
    /// The chunk size travels in each header and offer, so the receiver needs nothing.
    pub spread_min_chunk: u32,
    /// Chunks per lane a spread plan aims at ([`crate::plan::spread_chunk_bytes`]; 1..=16,
    /// [`crate::plan::SPREAD_CHUNKS_PER_LANE`] by default): 1 MiB over two lanes is four chunks
    /// of 256 KiB at 2, eight of 128 KiB at 4 (with `spread_min_chunk` ≤ 128 KiB).
    pub spread_chunks_per_lane: u32,
    /// Sends posted per lane at most (the sends the driver hands the plugin).
    pub send_window: usize,
    /// Sends in pieces (`PostGatherSend`) posted per lane beyond `send_window`: gathered ahead,
    /// they wait in the driver until the plugin's window has room (see "Windows" above).
    pub gather_ahead: usize,
    /// As `gather_ahead`, for sends in pieces from host memory (the buffer's memory as
    /// [`crate::Engine::set_buffer_memory`] said; host memory unless it said otherwise): their
    /// gathers run on the host's copy helpers, whose latency would otherwise hold the lane's
    /// window ([`DEFAULT_HOST_GATHER_AHEAD`]; `gather_ahead` stays for GPU memory, whose staging
    /// slots are GPU memory).
    pub host_gather_ahead: usize,
    /// Receives posted (until consumed) per lane at most; the plugin allows 16.
    pub recv_window: usize,
    /// Receives in pieces (`PostScatterRecv`) posted per lane beyond `recv_window`: they wait in
    /// the driver until the plugin has a slot of the lane free (see "Windows" above).
    pub scatter_ahead: usize,
    /// Entries per transfer (and ranges per offer or read request).
    pub max_entries: usize,
    /// Notification bytes per transfer.
    pub max_notification: usize,
    /// How this node receives: eager (credit receives of `chunk_bytes` kept posted on a lane,
    /// destinations decided when the header arrives), rendezvous (offer, accept, then receives
    /// posted into the destination), or auto (both, on separate lanes, chosen per transfer by
    /// size). Announced to each peer at pairing; the sender follows the receiver's mode.
    pub protocol: Protocol,
    /// Credit receives per eager lane (1..=recv_window).
    pub credits: u32,
    /// Devices this node's lanes use (the lane layout: [`crate::LaneLayout`]).
    pub devices: u32,
    /// Lanes per device towards each peer, besides the eager ones.
    pub lanes_per_device: u32,
    /// Auto: eager lanes per device, opened after the others (so each peer's last receive
    /// lanes, `devices × eager_lanes` of them, keep credits); the others carry rendezvous
    /// transfers. With no lane left for rendezvous every lane is eager.
    pub eager_lanes: u32,
    /// Auto: the largest transfer (its total bytes towards this node) senders send eagerly.
    pub eager_max_bytes: u64,
    /// How long data may wait in its bounce pages for its header before the peer is failed
    /// (an honest sender writes the header before it posts the sends).
    pub header_timeout: Duration,
    /// Auto: this node's credit receives land in GPU memory (the driver posts them into a
    /// landing registration on the lane's GPU; the unpack alone decides where bytes go), so
    /// they are `chunk_bytes` each and transfers into its GPU buffers take them at any size
    /// (`crate::streams`). Announced to each peer (`PeerMsg::GpuCredits`).
    pub gpu_credits: bool,
    /// With `gpu_credits`: bytes of un-consumed chunks a sender may have on each credit lane
    /// (bounce memory the receiver holds for data not yet unpacked); 0: `credits × chunk_bytes`.
    pub credit_budget_bytes: u64,
    /// A send lane with nothing queued, posted or lent (credits) for this long is closed on both
    /// sides and opened again on its next chunk (`lane_life.rs`); `None`: kept open.
    pub lane_idle_close: Option<Duration>,
    /// How long a send lane may wait for the peer's listening handle once it asked for it
    /// before the pairing fails.
    pub lane_open_timeout: Duration,
    /// A pairing with nothing on it for this long is closed by agreement of both sides and
    /// paired anew by its next use (`pair_life.rs`); `None`: kept while the peer lives.
    pub pairing_idle_close: Option<Duration>,
    /// Transfers of at most this many bytes in total go inline on the control connection
    /// (`inline.rs`): the payload in the header, no lane, credit or landing slot. Announced to
    /// each peer (`PeerMsg::InlineLimit`); a sender inlines up to the smaller of both limits.
    /// 0: off (the engine's default; the daemon's is `transfer.inline_max_bytes`).
    pub inline_max_bytes: u64,
    /// Inline bytes sent to a peer and not yet answered (`Done`, `Reject`) at most: a transfer
    /// that would pass it takes its lanes at once (it never waits).
    pub inline_window_bytes: u64,
    /// Inline transfers may read GPU sources (a synchronous copy in the driver) and write into
    /// destinations the peer announced as GPU memory; off: only host memory to host memory.
    pub inline_gpu: bool,
    /// Inline transfers touching GPU memory (a synchronous device copy on a poller) sent to a
    /// peer and not yet answered, at most: a GPU transfer past it takes its lanes at once (it
    /// never waits). 0: none inline even with `inline_gpu`.
    pub inline_gpu_in_flight: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            spread_min_chunk: 0,
            spread_chunks_per_lane: crate::plan::SPREAD_CHUNKS_PER_LANE,
            send_window: 12,
            gather_ahead: DEFAULT_GATHER_AHEAD,
            host_gather_ahead: DEFAULT_GATHER_AHEAD,
            recv_window: 16,
            scatter_ahead: 0,
            max_entries: DEFAULT_MAX_ENTRIES,
            max_notification: 1 << 20,
            protocol: Protocol::Rendezvous,
            credits: 16,
            devices: 1,
            lanes_per_device: 1,
            eager_lanes: 1,
            eager_max_bytes: DEFAULT_EAGER_MAX_BYTES,
            header_timeout: Duration::from_secs(5),
            gpu_credits: false,
            credit_budget_bytes: DEFAULT_CREDIT_BUDGET_BYTES,
            lane_idle_close: None,
            lane_open_timeout: DEFAULT_LANE_OPEN_TIMEOUT,
            pairing_idle_close: None,
            inline_max_bytes: 0,
            inline_window_bytes: DEFAULT_INLINE_WINDOW_BYTES,
            inline_gpu: false,
            inline_gpu_in_flight: DEFAULT_INLINE_GPU_IN_FLIGHT,
        }
    }
}

/// `gather_ahead`'s default: off. Gathering a window ahead (12) was measured on two H200s over
/// the emulation and moved block transfers no faster (the receiver bounds them there, not the
/// sender's gathers: docs/BENCHMARKS.md, session 9) for twice the staging memory; it stays a
/// setting for links where the sender is the bound.
pub const DEFAULT_GATHER_AHEAD: usize = 0;

/// The daemon's `transfer.host_gather_ahead` default where there are copy helpers (without,
/// 0; the engine's own default keeps `gather_ahead`'s 0): a send window ahead. Session 24 (host-blocks4, the 2-core VM's chunk
/// trace, `benches/chunks.py`): with none, a host block chunk's gather holds one of the lane's
/// `send_window` places while it waits for a helper and copies, so the plugin held 6.1–7.0 of a
/// lane's sends against 10.0 for contiguous bytes, under 4 (its sockets per comm) 38–40% of the
/// data phase against 20–22%; 12 ahead: 8.8–9.4, under 4 25–30%. The ratio there is the 2 CPUs'
/// (unchanged within its noise); the 16-core host's verdict is `tools/host-blocks-sweep.sh`'s
/// `ga0` row against `default` (docs/BENCHMARKS.md, session 24).
pub const DEFAULT_HOST_GATHER_AHEAD: usize = 12;

/// `max_entries`' default: a batch of this many small entries of one buffer pair is coalesced
/// into wire chunks (docs/BLOCKS.md), so it costs chunks, not entries.
pub const DEFAULT_MAX_ENTRIES: usize = 65_536;

/// `transfer.credit_budget_bytes`' default: 32 MiB of un-consumed chunks per credit lane (8
/// chunks of 4 MiB; the count, 16, binds first at 512 KiB chunks). The emulation's bounce pool is
/// 64 MiB per receive comm; RxDM's is 4 GiB per GPU, shared by its comms.
pub const DEFAULT_CREDIT_BUDGET_BYTES: u64 = 32 << 20;

/// `transfer.eager_max_bytes`' default: transfers up to 64 KiB go eager under `auto` (measured:
/// eager wins for small transfers, rendezvous from 1-4 MiB up; docs/BENCHMARKS.md).
pub const DEFAULT_EAGER_MAX_BYTES: u64 = 64 * 1024;

/// `transfer.inline_window_bytes`' default: 256 KiB of inline payloads per pairing awaiting their
/// answer (64 transfers of 4 KiB), so the control connection never queues unbounded data.
pub const DEFAULT_INLINE_WINDOW_BYTES: u64 = 256 * 1024;

/// `transfer.inline_gpu_in_flight`' default: one GPU transfer inline per pairing at a time, set
/// when the device copies were synchronous on the poller (two H200s, session 23: one at a time GPU
/// inline won, 4 KiB WRITE p50 65-74 us against 177-210; eight in flight, all inline, lost, 64 KiB
/// 1.0 GB/s against 1.9: docs/BENCHMARKS.md). Session 24 made them asynchronous
/// (poller/inline_copies.rs): `benches/inline_gpu_async.sh` measures 8 against this.
pub const DEFAULT_INLINE_GPU_IN_FLIGHT: u64 = 1;

/// The largest `inline_max_bytes` a node takes (a control message carries the payload whole).
pub const MAX_INLINE_BYTES: u64 = 1 << 20;
