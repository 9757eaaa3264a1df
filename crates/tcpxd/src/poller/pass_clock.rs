//! Where a busy pass's time goes: the pass split at its phases' boundaries
//! (`tcpxd_poller_busy_phase_seconds_total{phase}`, [`crate::metrics::POLLER_PHASES`]).
//!
//! The pass series (`tcpxd_poller_pass_seconds_total`) says how much of the poller's thread its
//! busy passes take; at 16 transfers in flight on two H200s the receiving poller's were 0.87–0.92
//! of its busiest half second at ~120 µs a pass (docs/BENCHMARKS.md, session 26), which makes it
//! the ceiling of those rows. This clock says which part of a pass that is, on the host where it
//! runs (the device host has no profiler). A lap is one `Instant::now()` (a vDSO read, tens of
//! ns): nine a pass.

use std::time::{Duration, Instant};

use crate::metrics::{POLLER_ACTION_SLOTS, POLLER_PHASES};

/// A pass's phases, in [`POLLER_PHASES`]' order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PassPhase {
    Intake = 0,
    Commands = 1,
    Setup = 2,
    Actions = 3,
    TestLanes = 4,
    Tick = 5,
    Consume = 6,
    Flush = 7,
}

/// One pass's time by phase: each [`lap`](PassClock::lap) gives the time since the previous one
/// (or the pass's start) to the phase named.
pub(super) struct PassClock {
    last: Instant,
    spent: [Duration; POLLER_PHASES.len()],
}

impl PassClock {
    pub(super) fn start(at: Instant) -> PassClock {
        PassClock {
            last: at,
            spent: [Duration::ZERO; POLLER_PHASES.len()],
        }
    }

    /// The time since the last lap goes to `phase`.
    pub(super) fn lap(&mut self, phase: PassPhase) {
        let now = Instant::now();
        self.spent[phase as usize] += now - self.last;
        self.last = now;
    }

    /// The last lap's instant: the pass's end once its last phase is lapped.
    pub(super) fn now(&self) -> Instant {
        self.last
    }

    pub(super) fn spent(&self) -> &[Duration; POLLER_PHASES.len()] {
        &self.spent
    }
}

/// The `actions` phase split by what ran: each engine action's kind
/// ([`crate::engine::ACTION_KINDS`]), then the direct connections' batched writes, the progress
/// flush and the GPU gathers' launch (`tcpxd_poller_action_seconds_total{kind}`), summed over a
/// busy pass and published with it.
pub(super) struct ActionClock {
    spent: [Duration; POLLER_ACTION_SLOTS],
}

/// [`ActionClock`]'s slots after the action kinds.
pub(super) const SEND_DIRECT: usize = crate::engine::ACTION_KINDS.len();
pub(super) const PROGRESS_FLUSH: usize = SEND_DIRECT + 1;
pub(super) const LANE_ORDERS: usize = SEND_DIRECT + 2;
pub(super) const SUBMIT_GATHERS: usize = SEND_DIRECT + 3;
/// The `finished` action's slot: the framed sessions' events its transfers' ends pushed are
/// written when the actions' batch closes (`crate::api::local::outbox::Batch`), counted there.
pub(super) const FINISHED: usize = kind_slot("finished");

/// The slot of the engine action kind `name` (a build error if there is none).
const fn kind_slot(name: &str) -> usize {
    let kinds = crate::engine::ACTION_KINDS;
    let mut i = 0;
    while i < kinds.len() {
        let (k, n) = (kinds[i].as_bytes(), name.as_bytes());
        if k.len() == n.len() {
            let mut j = 0;
            while j < k.len() && k[j] == n[j] {
                j += 1;
            }
            if j == k.len() {
                return i;
            }
        }
        i += 1;
    }
    panic!("no such action kind")
}

impl ActionClock {
    pub(super) fn new() -> ActionClock {
        ActionClock {
            spent: [Duration::ZERO; POLLER_ACTION_SLOTS],
        }
    }

    /// `since`'s time to now goes to `slot`; returns now (the next slot's start).
    pub(super) fn add(&mut self, slot: usize, since: Instant) -> Instant {
        let now = Instant::now();
        self.spent[slot] += now - since;
        now
    }

    /// The pass's sums, the clock back to zero.
    pub(super) fn take(&mut self) -> [Duration; POLLER_ACTION_SLOTS] {
        std::mem::replace(&mut self.spent, [Duration::ZERO; POLLER_ACTION_SLOTS])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_to_the_pass_and_go_to_their_phases() {
        let start = Instant::now();
        let mut c = PassClock::start(start);
        std::thread::sleep(Duration::from_millis(2));
        c.lap(PassPhase::Intake);
        c.lap(PassPhase::Commands);
        std::thread::sleep(Duration::from_millis(3));
        c.lap(PassPhase::Actions);
        c.lap(PassPhase::TestLanes);
        std::thread::sleep(Duration::from_millis(1));
        c.lap(PassPhase::Actions);
        c.lap(PassPhase::Consume);
        c.lap(PassPhase::Flush);
        let s = c.spent();
        assert!(s[PassPhase::Intake as usize] >= Duration::from_millis(2));
        assert!(
            s[PassPhase::Actions as usize] >= Duration::from_millis(4),
            "both laps: {s:?}"
        );
        assert_eq!(
            s.iter().sum::<Duration>(),
            c.now() - start,
            "nothing lost between laps"
        );
        assert_eq!(POLLER_PHASES[PassPhase::TestLanes as usize], "test_lanes");
        assert_eq!(POLLER_PHASES[PassPhase::Flush as usize], "flush");
    }

    #[test]
    fn the_action_clock_sums_by_slot_and_starts_again_after_take() {
        let mut c = ActionClock::new();
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        let t = c.add(3, t);
        c.add(SUBMIT_GATHERS, t);
        let spent = c.take();
        assert!(spent[3] >= Duration::from_millis(2));
        assert_eq!(
            crate::metrics::POLLER_ACTION_KINDS[SUBMIT_GATHERS],
            "submit_gathers"
        );
        assert_eq!(crate::metrics::POLLER_ACTION_KINDS[3], "land");
        assert_eq!(crate::metrics::POLLER_ACTION_KINDS[FINISHED], "finished");
        assert_eq!(c.take(), [Duration::ZERO; POLLER_ACTION_SLOTS]);
    }
}
