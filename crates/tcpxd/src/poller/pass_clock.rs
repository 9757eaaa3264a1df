//! Where a busy pass's time goes: the pass split at its phases' boundaries
//! (`tcpxd_poller_busy_phase_seconds_total{phase}`, [`crate::metrics::POLLER_PHASES`]).
//!
//! The pass series (`tcpxd_poller_pass_seconds_total`) says how much of the poller's thread its
//! busy passes take; at 16 transfers in flight on two H200s the receiving poller's were 0.87–0.92
//! of its busiest half second at ~120 µs a pass (docs/BENCHMARKS.md, session 26), which makes it
//! the ceiling of those rows. This clock says which part of a pass that is, on the host where it
//! runs (the device host has no profiler). A lap is one `Instant::now()` (a vDSO read, tens of
//! ns): nine a pass, and the actions' split ([`ActionClock`]) one an action and four a batch.
//!
//! # Sampled (session 33, pollcpu)
//! Those reads were ~6% of a busy READ initiator's poller on one H200 (`__vdso_clock_gettime`,
//! 1.5 µs a transfer at 16 in flight, `perf record`; docs/BENCHMARKS.md). So one pass in
//! [`TIMED_ONE_IN`], picked at random ([`Sampler`]), is timed phase by phase and action by
//! action, and a timed busy pass's split counts [`TIMED_ONE_IN`] times: the phase and action
//! series are estimates (unbiased: whether a pass is timed does not depend on what it does), the
//! pass series (`tcpxd_poller_pass_seconds_total`, `_passes_total`) stay exact. An untimed pass
//! reads the clock only where the poller needs the time (its start and end, the commands'
//! slice, the engine's tick).

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

/// One pass in this many is timed phase by phase and action by action (module docs).
pub(super) const TIMED_ONE_IN: u32 = 8;

/// Picks the passes to time: each with a chance of one in [`TIMED_ONE_IN`], independently of
/// the others (a counter would alias with a pattern of passes, busy and idle taking turns).
pub(super) struct Sampler(u64);

impl Sampler {
    pub(super) fn new() -> Sampler {
        // Any odd seed; the pass pattern cannot know it.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as u64);
        Sampler(seed | 1)
    }

    /// Whether the next pass is timed (xorshift64*).
    pub(super) fn next(&mut self) -> bool {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % u64::from(TIMED_ONE_IN) == 0
    }
}

/// One pass's time by phase: each [`lap`](PassClock::lap) gives the time since the previous one
/// (or the pass's start) to the phase named; an untimed pass's laps read no clock.
pub(super) struct PassClock {
    last: Instant,
    timed: bool,
    spent: [Duration; POLLER_PHASES.len()],
}

impl PassClock {
    pub(super) fn start(at: Instant, timed: bool) -> PassClock {
        PassClock {
            last: at,
            timed,
            spent: [Duration::ZERO; POLLER_PHASES.len()],
        }
    }

    /// This pass is timed by phase.
    pub(super) fn timed(&self) -> bool {
        self.timed
    }

    /// The time since the last lap goes to `phase` (a timed pass).
    pub(super) fn lap(&mut self, phase: PassPhase) {
        if !self.timed {
            return;
        }
        let now = Instant::now();
        self.spent[phase as usize] += now - self.last;
        self.last = now;
    }

    /// Now: a timed pass's last lap (the pass's end once its last phase is lapped), or the clock.
    pub(super) fn now(&self) -> Instant {
        if self.timed { self.last } else { Instant::now() }
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
    /// The pass is timed ([`PassClock`]): off, [`ActionClock::add`] reads no clock.
    on: bool,
    /// What an untimed pass's marks are (never read).
    zero: Instant,
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
            on: true,
            zero: Instant::now(),
        }
    }

    /// Whether this pass's actions are timed.
    pub(super) fn set_on(&mut self, on: bool) {
        self.on = on;
    }

    /// A batch's start mark: now, when timed.
    pub(super) fn mark(&self) -> Instant {
        if self.on { Instant::now() } else { self.zero }
    }

    /// `since`'s time to now goes to `slot`; returns now (the next slot's start). Untimed:
    /// nothing, `since` back.
    pub(super) fn add(&mut self, slot: usize, since: Instant) -> Instant {
        if !self.on {
            return since;
        }
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
        let mut c = PassClock::start(start, true);
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
    fn an_untimed_pass_laps_nothing_and_still_tells_the_time() {
        let start = Instant::now();
        let mut c = PassClock::start(start, false);
        std::thread::sleep(Duration::from_millis(2));
        c.lap(PassPhase::Intake);
        assert!(!c.timed());
        assert_eq!(c.spent(), &[Duration::ZERO; POLLER_PHASES.len()]);
        assert!(
            c.now() - start >= Duration::from_millis(2),
            "now() reads the clock"
        );
        let mut a = ActionClock::new();
        a.set_on(false);
        let t = a.mark();
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(a.add(3, t), t, "no clock read");
        assert_eq!(a.take(), [Duration::ZERO; POLLER_ACTION_SLOTS]);
    }

    #[test]
    fn about_one_pass_in_timed_one_in_is_timed_and_not_in_a_pattern() {
        let mut s = Sampler::new();
        let n = 80_000;
        let picks: Vec<bool> = (0..n).map(|_| s.next()).collect();
        let timed = picks.iter().filter(|&&p| p).count();
        let want = n / TIMED_ONE_IN as usize;
        assert!(
            timed.abs_diff(want) < want / 10,
            "{timed} timed of {n}, ~{want} wanted"
        );
        // Passes busy and idle by turns: the even and the odd ones are timed alike.
        let even = picks.iter().step_by(2).filter(|&&p| p).count();
        assert!(even.abs_diff(timed - even) < want / 10, "{even} even of {timed}");
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
