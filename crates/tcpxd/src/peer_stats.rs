//! What the poller reports of its pairings: each peer's link state, counters and devices, and the
//! snapshot that GetStats and the metrics' scrape read. Below both the poller, which fills it, and
//! the metrics, which read it.

use crate::engine::PeerCounters;

/// A peer's link state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerLink {
    Connecting,
    Up,
    /// Up, and this side asked the peer to close it when idle (engine `pair_life.rs`): a
    /// transfer naming it waits for the answer (then `Up` again, or `Idle`).
    Closing,
    /// Closed by agreement of both sides when idle: no control stream, no comm; the next use
    /// pairs anew. Not a failure.
    Idle,
    Failed(String),
}

/// Counters for GetStats.
#[derive(Debug, Clone)]
pub struct PeerStats {
    /// The lanes in use only (`Engine::listed_counters`), each with its lane number.
    pub counters: PeerCounters,
    pub link: PeerLink,
    /// By lane number, every lane of the pairing: its device (NIC).
    pub send_devices: Vec<i32>,
    pub recv_devices: Vec<i32>,
    /// By lane number: the GPU made current when each lane's comm was opened (`None`: none).
    pub send_gpus: Vec<Option<u32>>,
    pub recv_gpus: Vec<Option<u32>>,
    /// This side sends its engine messages on the pairing's direct control connection.
    pub direct_control: bool,
    /// Messages sent on it since the pairing.
    pub direct_messages_sent: u64,
}

#[derive(Debug, Clone)]
pub struct StatsSnapshot {
    /// The pairings kept: live ones, and per node at most its newest failed one once the
    /// transfers that used older ones ended (the engine releases those).
    pub peers: Vec<PeerStats>,
    /// Per node, the added-up totals of its released pairings (the metrics' counters include
    /// them; GetStats does not list them).
    pub retired: Vec<PeerCounters>,
    pub active_transfers: usize,
}
