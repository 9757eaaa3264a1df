//! How a thread that polls waits when a pass made no progress — the one backoff of the daemon and
//! its tools, [`Backoff`], paced by a [`Pace`]:
//!
//! - [`Pace::POLL`], while requests carrying bytes are in flight (the daemon's poller, the raw
//!   bench): it spins a little, then yields the CPU at every pass (so the plugin's own threads
//!   run), and naps only once nothing has progressed for [`STALL_BEFORE_NAP`] — a stalled peer,
//!   not a transfer in flight. [`Pace::POLL_SHARED`], the daemon's poller with `runtime.spin`
//!   off (few CPUs): the same without the spins.
//! - [`Pace::CONNECT`], between non-blocking connect/accept calls (`net::comm`'s blocking
//!   helpers): a connection takes milliseconds to seconds, so it naps from the start, 200 µs
//!   doubling to 20 ms.
//!
//! The daemon's poller naps in `park_timeout` (a command ends the nap at once; a direct control
//! socket's data waits for its end) and parks in `epoll_wait` on its command channel's eventfd and
//! its direct control sockets when nothing is in flight (`poller/park.rs`) — with `runtime.spin` on ([`Spin`]),
//! only once nothing has been in flight for [`LINGER`]: while traffic flows it keeps polling
//! between transfers, so the next command, control message or eager receive finds it awake, and
//! [`Warmth`] keeps an async worker awake as long.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Passes that spin before the thread starts yielding.
pub const SPINS_BEFORE_YIELD: u32 = 64;
/// How long passes without progress yield before the thread naps.
pub const STALL_BEFORE_NAP: Duration = Duration::from_millis(2);
/// How long a poller keeps polling after its last progress with nothing in flight before it parks.
/// Back-to-back transfers come well within it (a 4 KiB transfer takes 0.1–0.5 ms end to end), so
/// their commands and control messages never have to wake a parked thread; an idle daemon parks
/// 1 ms after its last transfer and costs nothing.
pub const LINGER: Duration = Duration::from_millis(1);
/// One nap, once stalled.
pub const NAP: Duration = Duration::from_micros(50);

/// What one idle step did, or asks the caller to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Spun (a CPU hint); poll again.
    Spun,
    /// Yielded the CPU; poll again.
    Yielded,
    /// Stalled: sleep this long (or until woken), then poll again.
    Nap(Duration),
}

/// How a [`Backoff`] waits: passes that spin, then how long passes yield, then naps that double
/// from `nap_min` up to `nap_max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// Passes without progress that spin (a CPU hint) before the thread yields.
    pub spins: u32,
    /// How long passes without progress yield, once spinning is over, before the loop naps.
    pub yield_for: Duration,
    /// The first nap.
    pub nap_min: Duration,
    /// The longest nap: each nap after the first is twice the one before, up to this.
    pub nap_max: Duration,
}

impl Pace {
    /// A loop with requests in flight: [`SPINS_BEFORE_YIELD`] spins, yields for
    /// [`STALL_BEFORE_NAP`], then naps of [`NAP`].
    pub const POLL: Pace = Pace {
        spins: SPINS_BEFORE_YIELD,
        yield_for: STALL_BEFORE_NAP,
        nap_min: NAP,
        nap_max: NAP,
    };

    /// [`Pace::POLL`] on a machine whose CPUs are scarce (the daemon's poller with
    /// `runtime.spin` off): yields from the first pass without progress, spinning none — the
    /// plugin's threads, the peer's poller and the client need the CPU a spinning pass holds,
    /// and on two CPUs a spin phase delays the very completion it waits for.
    pub const POLL_SHARED: Pace = Pace {
        spins: 0,
        ..Pace::POLL
    };

    /// Waiting for a connect or accept to complete: naps at once, 200 µs doubling to 20 ms.
    pub const CONNECT: Pace = Pace {
        spins: 0,
        yield_for: Duration::ZERO,
        nap_min: Duration::from_micros(200),
        nap_max: Duration::from_millis(20),
    };
}

/// The idle state of a polling loop between two passes that made progress.
#[derive(Debug)]
pub struct Backoff {
    pace: Pace,
    spins: u32,
    /// When the current stretch without progress began (taken once spinning is over).
    since: Option<Instant>,
    /// The next nap.
    nap: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff::new()
    }
}

impl Backoff {
    /// A backoff at [`Pace::POLL`].
    pub fn new() -> Backoff {
        Backoff::with(Pace::POLL)
    }

    pub fn with(pace: Pace) -> Backoff {
        Backoff {
            pace,
            spins: 0,
            since: None,
            nap: pace.nap_min,
        }
    }

    /// A pass made progress (or the loop was woken with work): start over.
    pub fn reset(&mut self) {
        self.spins = 0;
        self.since = None;
        self.nap = self.pace.nap_min;
    }

    /// One pass made no progress.
    pub fn step(&mut self) -> Step {
        if self.spins < self.pace.spins {
            self.spins += 1;
            std::hint::spin_loop();
            return Step::Spun;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() < self.pace.yield_for {
            std::thread::yield_now();
            return Step::Yielded;
        }
        let nap = self.nap;
        self.nap = (nap * 2).min(self.pace.nap_max);
        Step::Nap(nap)
    }

    /// [`Backoff::step`] for loops with nothing to wake them: naps with a plain sleep.
    pub fn step_or_sleep(&mut self) {
        if let Step::Nap(d) = self.step() {
            std::thread::sleep(d);
        }
    }
}

/// Whether a daemon keeps polling between transfers (`runtime.spin`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spin {
    /// On with [`SPIN_AUTO_CPUS`] CPUs or more: a machine with cores to spare.
    Auto,
    On,
    Off,
}

/// `Spin::Auto` turns spinning on from this many CPUs up: below it (a 2-core VM running both
/// daemons of a test, say) the spinning threads would take the CPU from the work they wait for.
pub const SPIN_AUTO_CPUS: usize = 8;

impl Spin {
    /// Parses a setting; the error names `field`.
    pub fn parse(field: &str, v: &str) -> Result<Spin, String> {
        match v {
            "auto" => Ok(Spin::Auto),
            "on" | "true" | "1" => Ok(Spin::On),
            "off" | "false" | "0" => Ok(Spin::Off),
            other => Err(format!("{field}: {other:?} is not auto, on or off")),
        }
    }

    /// On or off for a machine with `cpus` CPUs.
    pub fn resolve(self, cpus: usize) -> bool {
        match self {
            Spin::Auto => cpus >= SPIN_AUTO_CPUS,
            Spin::On => true,
            Spin::Off => false,
        }
    }
}

/// The CPUs this process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Keeps one async worker awake while the poller has traffic, so a peer's control message or a
/// client's next call is read by a running thread instead of waking a parked one (on a VM each
/// such wake-up is an interrupt to the hypervisor, tens of µs). The poller calls
/// [`Warmth::touch`] on every pass that made progress, and holds the worker awake
/// ([`Warmth::hold`]) while it carries out a command: a long one (a NIXL pull's 32,768 pairs
/// checked and planned, ~1.2 ms) would otherwise outlast the linger, and the worker would park
/// just before the command's messages came for it to send. [`Warmth::keep_warm`], a task on the
/// runtime, yields in a loop while held or until [`LINGER`] has passed without a touch, then
/// sleeps until the next one. A yielding task makes its worker poll the I/O driver without
/// blocking, so socket events are picked up at once; the runtime has a second worker when
/// spinning (`config::SPIN_ASYNC_WORKERS`) for what arrives while the first is busy (a message
/// the poller hands over waited 120–280 µs for one busy worker). Costs one core while traffic
/// flows, nothing when idle.
#[derive(Debug)]
pub struct Warmth {
    epoch: Instant,
    last_ns: AtomicU64,
    /// Holds in force ([`Warmth::hold`]).
    held: AtomicU64,
    asleep: AtomicBool,
    wake: tokio::sync::Notify,
}

impl Warmth {
    pub fn new() -> Arc<Warmth> {
        Arc::new(Warmth {
            epoch: Instant::now(),
            last_ns: AtomicU64::new(0),
            held: AtomicU64::new(0),
            asleep: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
        })
    }

    /// Traffic now: keeps (or gets) the worker awake for [`LINGER`].
    pub fn touch(&self) {
        self.touch_at(Instant::now());
    }

    /// [`Warmth::touch`] with the caller's clock read (the poller's pass end).
    pub fn touch_at(&self, now: Instant) {
        self.last_ns.store(
            now.saturating_duration_since(self.epoch).as_nanos() as u64,
            Ordering::SeqCst,
        );
        if self.asleep.load(Ordering::SeqCst) && self.asleep.swap(false, Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }

    /// Keeps the worker awake until the guard is dropped (a touch then, so it lingers after).
    pub fn hold(&self) -> WarmHold<'_> {
        self.held.fetch_add(1, Ordering::SeqCst);
        self.touch();
        WarmHold(self)
    }

    fn recent(&self) -> bool {
        if self.held.load(Ordering::SeqCst) > 0 {
            return true;
        }
        let now = self.epoch.elapsed().as_nanos() as u64;
        now.saturating_sub(self.last_ns.load(Ordering::SeqCst)) < LINGER.as_nanos() as u64
    }

    /// The task that keeps a worker awake; ends when `stop` turns true (the daemon stopping).
    pub async fn keep_warm(self: Arc<Warmth>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            while self.recent() {
                tokio::task::yield_now().await;
            }
            self.asleep.store(true, Ordering::SeqCst);
            // A touch between the check and the flag: it saw no sleeper, so look again.
            if self.recent() {
                self.asleep.store(false, Ordering::SeqCst);
                continue;
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

/// A hold on a [`Warmth`] ([`Warmth::hold`]): the worker stays awake while it lives.
#[derive(Debug)]
pub struct WarmHold<'a>(&'a Warmth);

impl Drop for WarmHold<'_> {
    fn drop(&mut self) {
        self.0.touch();
        self.0.held.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits (bounded) until `f` holds.
    async fn until(f: impl Fn() -> bool) -> bool {
        let end = Instant::now() + Duration::from_secs(5);
        while !f() {
            if Instant::now() > end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        true
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_warm_worker_sleeps_when_untouched_wakes_on_a_touch_and_ends_with_the_daemon() {
        let w = Warmth::new();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(w.clone().keep_warm(stopped));
        // Never touched: it goes to sleep.
        assert!(until(|| w.asleep.load(Ordering::SeqCst)).await);
        // A touch wakes it; with no more touches it sleeps again after the linger.
        w.touch();
        assert!(!w.asleep.load(Ordering::SeqCst));
        assert!(until(|| w.asleep.load(Ordering::SeqCst)).await);
        // Held, it stays awake past the linger; released, it lingers, then sleeps.
        {
            let _held = w.hold();
            assert!(!w.asleep.load(Ordering::SeqCst));
            tokio::time::sleep(LINGER * 5).await;
            assert!(!w.asleep.load(Ordering::SeqCst), "held past the linger");
        }
        assert!(until(|| w.asleep.load(Ordering::SeqCst)).await);
        // The daemon stopping ends the task.
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("keep_warm ended")
            .unwrap();
    }

    #[test]
    fn spin_settings_parse_and_auto_follows_the_cpus() {
        assert_eq!(Spin::parse("f", "auto").unwrap(), Spin::Auto);
        assert_eq!(Spin::parse("f", "on").unwrap(), Spin::On);
        assert_eq!(Spin::parse("f", "off").unwrap(), Spin::Off);
        assert!(
            Spin::parse("runtime.spin", "maybe")
                .unwrap_err()
                .contains("runtime.spin")
        );
        assert!(!Spin::Auto.resolve(2));
        assert!(Spin::Auto.resolve(SPIN_AUTO_CPUS));
        assert!(Spin::On.resolve(1));
        assert!(!Spin::Off.resolve(64));
    }

    #[test]
    fn spins_then_yields_then_naps_only_after_a_stall() {
        let mut b = Backoff::new();
        for _ in 0..SPINS_BEFORE_YIELD {
            assert_eq!(b.step(), Step::Spun);
        }
        // Within the stall allowance: yields, never naps.
        assert_eq!(b.step(), Step::Yielded);
        std::thread::sleep(STALL_BEFORE_NAP + Duration::from_millis(1));
        assert_eq!(b.step(), Step::Nap(NAP));
        assert_eq!(b.step(), Step::Nap(NAP), "the poll pace's naps stay short");
        // Progress starts over.
        b.reset();
        assert_eq!(b.step(), Step::Spun);
    }

    #[test]
    fn the_shared_poll_pace_yields_at_once_and_naps_as_the_poll_pace_does() {
        let mut b = Backoff::with(Pace::POLL_SHARED);
        assert_eq!(b.step(), Step::Yielded, "no spin on scarce CPUs");
        std::thread::sleep(STALL_BEFORE_NAP + Duration::from_millis(1));
        assert_eq!(b.step(), Step::Nap(NAP));
        b.reset();
        assert_eq!(b.step(), Step::Yielded);
    }

    #[test]
    fn the_connect_pace_naps_at_once_doubling_up_to_its_longest() {
        let mut b = Backoff::with(Pace::CONNECT);
        let naps: Vec<Duration> = (0..10)
            .map(|_| match b.step() {
                Step::Nap(d) => d,
                other => panic!("{other:?}: the connect pace neither spins nor yields"),
            })
            .collect();
        let us = |n| Duration::from_micros(n);
        assert_eq!(
            naps,
            [
                us(200),
                us(400),
                us(800),
                us(1600),
                us(3200),
                us(6400),
                us(12800),
                us(20000),
                us(20000),
                us(20000)
            ]
        );
        // Progress (a call that got further) starts over at the shortest nap.
        b.reset();
        assert_eq!(b.step(), Step::Nap(us(200)));
    }

    #[test]
    fn a_pace_goes_through_its_phases_in_order() {
        let pace = Pace {
            spins: 2,
            yield_for: Duration::from_millis(1),
            nap_min: Duration::from_micros(10),
            nap_max: Duration::from_micros(25),
        };
        let mut b = Backoff::with(pace);
        assert_eq!(b.step(), Step::Spun);
        assert_eq!(b.step(), Step::Spun);
        assert_eq!(b.step(), Step::Yielded);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(b.step(), Step::Nap(Duration::from_micros(10)));
        assert_eq!(b.step(), Step::Nap(Duration::from_micros(20)));
        assert_eq!(b.step(), Step::Nap(Duration::from_micros(25)));
        assert_eq!(b.step(), Step::Nap(Duration::from_micros(25)));
    }
}
