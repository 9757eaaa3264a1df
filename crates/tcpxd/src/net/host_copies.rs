//! Host copies of block chunks on helper threads (issue 38 point 3): a chunk's gather (its pieces
//! of a host buffer into a staging slot, `blocks::gather_region`) and scatter (the landed bytes
//! into a host buffer's pieces, `RecvComm::scatter_landed`). On a host whose lanes move 13–15
//! GB/s of contiguous bytes, the poller copying one chunk after another bounds block transfers
//! (~4 GB/s, issue 38).
//!
//! Two ways in:
//! - [`HostCopies::queue`]: the chunk's copies (and, for a direct receive, the zeroing of its
//!   landing slot afterwards) join the helpers' one queue, and the poller goes on at once with a
//!   [`CopyTicket`]; the send is posted, or the receive consumed, only once the ticket is done
//!   (as a GPU gather or scatter waits for its batch). Several chunks of each lane are copied at
//!   once on as many helpers, overlapping the poller's tests and posts: what a fork-and-join
//!   copy (below) could not do, the poller waiting for its helpers on every chunk. With no
//!   helpers, or a chunk under [`MIN_QUEUE_BYTES`], the copy runs at once on the caller and no
//!   ticket is returned.
//!
//! **One queue, oldest first** (session 27, issue 38 point 3): every helper takes the oldest
//! job of one shared queue, so jobs start in the order they were queued — a lane's chunks in
//! ring order, the order its sends must be posted in — on whichever helper is free first. Until
//! session 26 each helper had its own channel and a job went to the one with the fewest jobs
//! under way: a chunk could wait behind another on a helper that was slow to wake (or had lost
//! its CPU) while other helpers sat idle, and the lane's next send waited for it with its
//! younger chunks already copied (session 24's trace: gathers waited 0.4–1 ms p50 for a helper
//! to start them, 2–4 ms p90, for a 43 µs copy). An idle helper spins on the queue as its
//! [`SpinGauge`] allows, then sleeps on the queue's condition variable; a job wakes one sleeper
//! only when no idle helper is spinning to take it.
//!
//! **Each lane's next send first** (session 28): a job is queued at a [`Place`] and taken by
//! place, then oldest first. `Next`: the gather of a lane's next send (nothing of its lane
//! before it, room in the plugin), and fork-and-join parts; `Due`: scatters, and gathers whose
//! send the plugin would take at once (fewer than `send_window` of its lane's sends before
//! it); `Behind`: gathers ahead of their lane's window (`transfer.host_gather_ahead`), moved up
//! ([`HostCopies::hurry`]) as the window reaches them or they become the lane's next. A lane's
//! gathers keep its ring order. Until then a transfer's second lane waited for its first gather
//! behind the first lane's `send_window + host_gather_ahead` (24) gathers, queued a few µs
//! earlier (the 2-core VM's trace: its first send 2–3 ms after the first lane's), and a lane
//! whose window had room waited behind other lanes' gathers ahead.
//! - [`HostCopies::copy_all`]: fork and join: a chunk's copies cut into parts of about equal bytes
//!   (a piece may be cut), all but the first handed to helpers, the first copied by the caller,
//!   returning once every part is done (eager landings, tests).
//!
//! Whatever a queued job reads or writes stays valid until its ticket is done: the regions it
//! names are held by the job ([`CopyJob::keep`]); the plugin's bounce pages are not consumed
//! before the ticket is done, and every comm, ring or buffer is dropped only after
//! [`HostCopies::quiesce`] (the poller's close and removal paths), as GPU block kernels are
//! quiesced there.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use super::copy_clock::JobTimes;
use super::copy_clock::{Clock, JobClock, clock_finish, clock_start};
use super::copy_routines::{CopyRoutine, copy_list};
use super::memory::Region;

/// A chunk's copies of fewer bytes than this run on the calling thread alone: handing parts out
/// costs a few µs a helper, a 128 KiB memcpy ~10–30 µs.
pub const MIN_SPLIT_BYTES: usize = 128 * 1024;
/// No part is smaller than this (fewer parts than helpers for a small chunk).
pub const MIN_PART_BYTES: usize = 64 * 1024;
/// A queued chunk of fewer bytes than this is copied by the caller at once (handing it over costs
/// more than copying it).
pub const MIN_QUEUE_BYTES: usize = 32 * 1024;
/// A queued chunk is cut across idle helpers in parts of at least this many bytes (a 512 KiB
/// chunk over up to 4): its copies then take a quarter of the time when helpers are free — at a
/// transfer's start and end, where one chunk's gather or scatter is all that runs.
pub const MIN_QUEUED_PART_BYTES: usize = 128 * 1024;
/// `transfer.host_copy_spin_us` `auto` on a host that spins (`runtime.spin`): the most an idle
/// helper looks for its next job before it sleeps.
pub const AUTO_SPIN: Duration = Duration::from_micros(200);
/// `transfer.host_copy_spin_us` at most.
pub const MAX_SPIN_US: u64 = 100_000;
/// `transfer.host_copy_spinners` `auto`: how many helpers (the first ones, which jobs go to
/// first) may spin for their next job; the others sleep on their channels between jobs. On the
/// 16-core host 8 helpers all spinning moved scattered blocks at 0.59–0.60× contiguous bytes and
/// 8 that never spin at 0.79–0.83× (session 22): helpers spinning there take the CPUs the
/// pollers and the plugin's threads want, while one kept awake still takes a job at once.
pub const AUTO_SPINNERS: usize = 1;

/// How the helpers work, besides how many there are: how long and how many of them spin, how
/// they copy, whether a chunk is cut across idle ones (`transfer.host_copy_*`, docs/CONFIG.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelperPolicy {
    pub spin: HelperSpin,
    /// Helpers that may spin (the first ones); the rest never do.
    pub spinners: usize,
    pub routine: CopyRoutine,
    /// Whether a queued chunk of at least 2 × [`MIN_QUEUED_PART_BYTES`] is cut across the
    /// helpers with nothing under way (`transfer.host_copy_split`).
    pub split: bool,
}

impl HelperPolicy {
    /// Every helper spinning as `spin` allows, plain copies, chunks cut across idle helpers
    /// (session 22's helpers).
    pub fn with_spin(spin: HelperSpin) -> HelperPolicy {
        HelperPolicy {
            spin,
            spinners: MAX_HOST_COPY_THREADS,
            routine: CopyRoutine::Plain,
            split: true,
        }
    }

    /// Helper `i`'s spin: the policy's for the first `spinners`, none for the others.
    pub fn spin_of(&self, i: usize) -> HelperSpin {
        if i < self.spinners {
            self.spin
        } else {
            HelperSpin { max: Duration::ZERO }
        }
    }
}

/// How long an idle helper may spin for its next job before it sleeps on its channel
/// (`transfer.host_copy_spin_us`): at most `max`, and only as long as its recent jobs say the
/// next one is likely to come ([`SpinGauge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelperSpin {
    pub max: Duration,
}

impl HelperSpin {
    /// `auto`: [`AUTO_SPIN`] where the daemon spins (`runtime.spin`: 8 CPUs or more, cores to
    /// spare), none elsewhere (a helper spinning on a small host takes the CPU from the poller
    /// and the plugin's threads).
    pub fn auto(spin: bool) -> HelperSpin {
        HelperSpin {
            max: if spin { AUTO_SPIN } else { Duration::ZERO },
        }
    }
}

/// A helper's measure of how soon its next job comes: an average of its recent idle gaps (job
/// done → next job taken), each counted at most `2 × max` (an idle daemon's hours weigh as
/// little as a pause between transfers). An idle helper spins only while the average gap fits
/// in `max`, and then for at most 1.5× it: a helper fed every few tens of µs stays awake, one
/// whose jobs come further apart than `max` sleeps at once (spinning would end in the same sleep,
/// its CPU time spent for nothing).
#[derive(Debug, Clone, Copy)]
pub struct SpinGauge {
    max_ns: u64,
    avg_ns: u64,
}

impl SpinGauge {
    pub fn new(spin: HelperSpin) -> SpinGauge {
        let max_ns = spin.max.as_nanos().min(u128::from(u64::MAX / 4)) as u64;
        // Starts as if jobs came `max` apart: a fresh helper spins its first gap out.
        SpinGauge {
            max_ns,
            avg_ns: max_ns,
        }
    }

    /// How long to spin for the next job now.
    pub fn budget(&self) -> Duration {
        if self.max_ns == 0 || self.avg_ns > self.max_ns {
            return Duration::ZERO;
        }
        Duration::from_nanos((self.avg_ns + self.avg_ns / 2).clamp(1_000, self.max_ns))
    }

    /// One idle gap seen: `gap` from a job's end to the next job's start.
    pub fn saw(&mut self, gap: Duration) {
        let g = (gap.as_nanos().min(u128::from(u64::MAX)) as u64).min(2 * self.max_ns);
        // An average over the last few gaps (weight 1/4 each).
        self.avg_ns = (3 * self.avg_ns + g) / 4;
    }
}
/// `transfer.host_copy_threads` at most.
pub const MAX_HOST_COPY_THREADS: usize = 64;

/// `transfer.host_copy_threads`' default for a host of `cores` cores: none below 4 cores (2
/// cores: the poller copies alone), else half of them, at most [`MAX_DEFAULT_THREADS`] (16
/// cores: 8 helpers besides the poller, one of them spinning, [`AUTO_SPINNERS`]). Session 22 on
/// the 16-core host: 4 helpers all spinning 0.62–0.73× contiguous, 8 that never spin 0.79–0.83×
/// (the best rows; session 21's default was a quarter of the cores, at most 4).
pub fn default_threads(cores: usize) -> usize {
    if cores < 4 {
        0
    } else {
        (cores / 2).min(MAX_DEFAULT_THREADS)
    }
}

/// The most helpers [`default_threads`] gives.
pub const MAX_DEFAULT_THREADS: usize = 8;

/// One copy: `n` bytes from `from` to `to`.
#[derive(Debug, Clone, Copy)]
pub struct HostCopy {
    pub from: *const u8,
    pub to: *mut u8,
    pub n: usize,
}

/// A part of a chunk's copies handed to a helper, and the count it lowers when done.
struct Part {
    copies: Vec<HostCopy>,
    left: Arc<AtomicUsize>,
}

/// A chunk's copies queued whole ([`HostCopies::queue`]): the copies, then `zero` (`n` bytes at
/// a pointer: a direct receive's landing slot, zeroed once copied out), with the regions they
/// lie in held until done.
pub struct CopyJob {
    pub copies: Vec<HostCopy>,
    pub zero: Option<(*mut u8, usize)>,
    /// Whether the targets are read by nobody soon (a scatter into a buffer, not a staging slot
    /// the plugin sends from next): [`CopyRoutine::Stream`] writes them non-temporally.
    pub cold_targets: bool,
    /// Kept alive until the job is done (the source and target regions it copies between).
    pub keep: Vec<Arc<dyn Region>>,
}

impl CopyJob {
    /// The job's bytes: copied and zeroed.
    pub fn bytes(&self) -> usize {
        self.copies.iter().map(|c| c.n).sum::<usize>() + self.zero.map_or(0, |z| z.1)
    }

    /// Whether the copies read `zero`'s range exactly, in order, each byte once (a direct
    /// receive's scatter: its landed bytes in wire order): each source can then be zeroed as
    /// soon as it is copied, and the job cut into parts that zero their own sources.
    fn sources_tile_zero(&self) -> bool {
        let Some((at, n)) = self.zero else {
            return false;
        };
        let mut next = at.cast_const();
        for c in &self.copies {
            if c.from != next {
                return false;
            }
            next = next.wrapping_add(c.n);
        }
        next == at.cast_const().wrapping_add(n)
    }

    /// Copies with `routine`, then zeroes, on this thread.
    ///
    /// # Safety
    /// As [`HostCopies::queue`].
    unsafe fn run(&self, routine: CopyRoutine) {
        if self.sources_tile_zero() {
            // SAFETY: every source lies in `zero`'s range (checked just above), writable by
            // this job alone (the caller's contract), and is read by this copy only.
            unsafe { copy_list(&self.copies, routine, true, self.cold_targets) };
            return;
        }
        // SAFETY: the caller's contract (sources readable, targets this job's alone).
        unsafe { copy_list(&self.copies, routine, false, self.cold_targets) };
        if let Some((at, n)) = self.zero {
            // SAFETY: the caller's contract: `n` writable bytes nothing else touches.
            unsafe { super::copy_routines::zero(at, n, routine) };
        }
    }
}

/// A part of a job whose sources tile its zeroed range ([`CopyJob::sources_tile_zero`]): each
/// copy made, then its source zeroed while it is still in the cache; and whether its targets
/// are cold ([`CopyJob::cold_targets`]).
struct SourcesZeroed(Vec<HostCopy>, bool);

/// Cuts `copies` into `parts` runs of about equal bytes, in order (a piece may be cut in two).
fn cut(copies: &[HostCopy], parts: usize) -> Vec<Vec<HostCopy>> {
    let total: usize = copies.iter().map(|c| c.n).sum();
    let per = total.div_ceil(parts.max(1));
    let mut split: Vec<Vec<HostCopy>> = vec![Vec::new(); parts.max(1)];
    let (mut k, mut room) = (0usize, per);
    for c in copies {
        let mut c = *c;
        while c.n > 0 {
            if room == 0 && k + 1 < split.len() {
                k += 1;
                room = per;
            }
            let n = if k + 1 == split.len() { c.n } else { c.n.min(room) };
            split[k].push(HostCopy { n, ..c });
            c = HostCopy {
                from: c.from.wrapping_add(n),
                to: c.to.wrapping_add(n),
                n: c.n - n,
            };
            room = room.saturating_sub(n);
        }
    }
    split
}

/// What a helper is handed. A queued job (or job part) carries the flag its ticket reads,
/// raised once it is done.
enum Work {
    Part(Part),
    Job(CopyJob, Clock, Arc<AtomicU64>),
    /// A queued job's part, and what it keeps alive.
    JobPart(SourcesZeroed, Vec<Arc<dyn Region>>, Clock, Arc<AtomicU64>),
}

impl Work {
    /// The flag a queued job's ticket reads (none for a `copy_all` part).
    fn done_flag(&self) -> Option<&Arc<AtomicU64>> {
        match self {
            Work::Part(_) => None,
            Work::Job(_, _, done) | Work::JobPart(_, _, _, done) => Some(done),
        }
    }
}

/// Where a queued job goes in the helpers' queue ([`HostCopies::queue_at`]): jobs are taken by
/// place (`Next`, then `Due`, then `Behind`), then oldest first. A lane's gathers keep its ring
/// order: only its next send's gather is `Next`, and a gather is `Due` only when every gather of
/// its lane before it is (`post_sends` hurries the older ones, by age, as the window opens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    /// Its lane's next send (nothing of the lane waits before it, the plugin has room), or a
    /// fork-and-join part its caller waits for: before every other job.
    Next,
    /// Wanted as soon as it is done: a scatter, or a gather whose send the plugin would take at
    /// once (fewer than `send_window` of its lane's sends before it).
    Due,
    /// A gather ahead of its lane's send window: taken only when no job `Next` or `Due` waits,
    /// until [`HostCopies::hurry`] moves it up.
    Behind,
}

/// The queue's jobs, ordered by (place, age).
#[derive(Default)]
struct Jobs {
    queued: VecDeque<((Place, u64), Work)>,
    /// The next job's age stamp.
    next: u64,
}

impl Jobs {
    fn len(&self) -> usize {
        self.queued.len()
    }

    fn pop(&mut self) -> Option<Work> {
        self.queued.pop_front().map(|(_, w)| w)
    }

    fn insert(&mut self, key: (Place, u64), work: Work) {
        let at = self.queued.partition_point(|(k, _)| *k <= key);
        self.queued.insert(at, (key, work));
    }

    fn push(&mut self, work: Work, place: Place) {
        let age = self.next;
        self.next += 1;
        self.insert((place, age), work);
    }
}

/// The helpers' one queue (due jobs first, then oldest first), and who waits on it.
struct Queue {
    jobs: Mutex<Jobs>,
    ready: Condvar,
    /// Jobs in `jobs` (read without the lock by spinning helpers).
    len: AtomicUsize,
    /// Idle helpers spinning for the next job, and helpers asleep on `ready`.
    spinning: AtomicUsize,
    sleeping: AtomicUsize,
    /// Queued jobs (and job parts) not finished yet: the caller adds, the helpers take away.
    unfinished: AtomicU64,
    /// The pool is going: helpers end once the queue is empty.
    closed: AtomicBool,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Jobs> {
        // A helper never panics holding the lock (it only pops); a poisoned lock is still
        // a valid queue.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `work` at its `place`; wakes a sleeping helper unless an idle one is spinning for it.
    fn push(&self, work: Work, place: Place) {
        let queued = {
            let mut q = self.lock();
            q.push(work, place);
            self.len.store(q.len(), Ordering::SeqCst);
            q.len()
        };
        if self.sleeping.load(Ordering::SeqCst) > 0 && queued > self.spinning.load(Ordering::SeqCst) {
            self.ready.notify_one();
        }
    }

    /// The next job (the first due one, else the oldest behind), if any.
    fn try_pop(&self) -> Option<Work> {
        if self.len.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let mut q = self.lock();
        let w = q.pop();
        self.len.store(q.len(), Ordering::SeqCst);
        w
    }

    /// The next job, sleeping until there is one; `None` once the pool is closed and empty.
    fn pop_or_sleep(&self, stats: &HelperStats) -> Option<Work> {
        let mut q = self.lock();
        loop {
            if let Some(w) = q.pop() {
                self.len.store(q.len(), Ordering::SeqCst);
                return Some(w);
            }
            if self.closed.load(Ordering::SeqCst) {
                return None;
            }
            stats.sleeps.fetch_add(1, Ordering::Relaxed);
            self.sleeping.fetch_add(1, Ordering::SeqCst);
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            self.sleeping.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

// SAFETY: a `Part` carries raw pointers into memory that `HostCopies::copy_all`'s caller
// guarantees readable (`from`) and writable by this copy alone (`to`) until `copy_all` returns,
// and `copy_all` returns only after every part it handed out was copied (`left` reached 0). A
// `Job`'s pointers are valid until its ticket is done (`HostCopies::queue`'s contract), which
// is after the helper ran it; a `JobPart` is a part of such a job (its sources, which it zeroes,
// lie in the job's zeroed range and are read by this part alone).
unsafe impl Send for Work {}

/// A queued job's ticket: done once each of its parts (one, or several for a job cut across
/// idle helpers) raised its flag (nonzero).
#[derive(Debug, Clone)]
pub struct CopyTicket {
    parts: Vec<Arc<AtomicU64>>,
    clock: Clock,
}

impl CopyTicket {
    /// Whether the job's copies (and zeroing) are over: its memory may be reused.
    pub fn is_done(&self) -> bool {
        self.parts.iter().all(|done| done.load(Ordering::Acquire) != 0)
    }

    /// How many helpers the job went to.
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    /// When the job waited and ran, while the hop trace is on (`copy_clock::JobClock`).
    pub fn times(&self) -> Option<JobTimes> {
        self.clock.as_ref().and_then(|c| c.times())
    }

    /// A ticket done once `gate` holds 1 or more, for tests of what waits on tickets (a copy
    /// that finishes when the test says).
    #[doc(hidden)]
    pub fn gated(gate: Arc<AtomicU64>) -> CopyTicket {
        CopyTicket {
            parts: vec![gate],
            clock: None,
        }
    }
}

/// A helper thread: what it did, how long it may spin.
struct Helper {
    stats: Arc<HelperStats>,
    /// How long it may spin when idle (none past the policy's `spinners`).
    spin: HelperSpin,
    thread: Option<JoinHandle<()>>,
}

/// What a helper did with queued jobs: jobs, bytes copied and zeroed, time spent on them.
#[derive(Default)]
struct HelperStats {
    jobs: AtomicU64,
    bytes: AtomicU64,
    busy_ns: AtomicU64,
    /// Time spent spinning for a next job, and how often it slept instead.
    spun_ns: AtomicU64,
    sleeps: AtomicU64,
}

/// A helper's loop: the queue's oldest job run and counted, one after another; an idle helper
/// spins on the queue as long as its [`SpinGauge`] allows before it sleeps.
fn helper_loop(queue: Arc<Queue>, stats: Arc<HelperStats>, spin: HelperSpin, routine: CopyRoutine) {
    let mut gauge = SpinGauge::new(spin);
    // When the last job ended (None: none yet, or the gap was already counted).
    let mut idle_since: Option<Instant> = None;
    loop {
        let work = match queue.try_pop() {
            Some(w) => w,
            None => {
                let budget = gauge.budget();
                let mut got = None;
                if !budget.is_zero() {
                    let since = Instant::now();
                    queue.spinning.fetch_add(1, Ordering::SeqCst);
                    while since.elapsed() < budget {
                        for _ in 0..64 {
                            std::hint::spin_loop();
                        }
                        if let Some(w) = queue.try_pop() {
                            got = Some(w);
                            break;
                        }
                        if queue.closed.load(Ordering::SeqCst) {
                            break;
                        }
                    }
                    queue.spinning.fetch_sub(1, Ordering::SeqCst);
                    stats
                        .spun_ns
                        .fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                match got {
                    Some(w) => w,
                    None => match queue.pop_or_sleep(&stats) {
                        Some(w) => w,
                        None => return,
                    },
                }
            }
        };
        if let Some(t) = idle_since.take() {
            gauge.saw(t.elapsed());
        }
        let done = work.done_flag().cloned();
        // SAFETY: `HostCopies::copy_all`'s contract for a part (valid until it returns, which
        // waits for `left`), `HostCopies::queue`'s for a job or a job's part (valid until the
        // ticket is done, which the flag below makes it).
        if let Some(Ran { bytes, busy }) = unsafe { run_work(work, routine) } {
            stats.busy_ns.fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
            stats.bytes.fetch_add(bytes, Ordering::Relaxed);
            stats.jobs.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(done) = done {
            done.store(1, Ordering::Release);
            queue.unfinished.fetch_sub(1, Ordering::Release);
        }
        idle_since = Some(Instant::now());
    }
}

/// The poller's host copies and their helper threads (see the module's documentation).
pub struct HostCopies {
    helpers: Vec<Helper>,
    queue: Arc<Queue>,
    routine: CopyRoutine,
    split: bool,
}

impl std::fmt::Debug for HostCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostCopies({} helpers)", self.helpers.len())
    }
}

/// A queued job's (or job part's) run: bytes copied and zeroed, and how long it took.
struct Ran {
    bytes: u64,
    busy: std::time::Duration,
}

/// Runs `work` on this thread: a helper's, or the caller's for work a gone helper could not
/// take. A `copy_all` part is counted down on its `left`; a queued job or job part runs between
/// its clock's start and finish, then drops what it kept alive, and says what it did (a helper
/// counts it: [`HelperStats`], its ticket's `finished`).
///
/// # Safety
/// As for the helper that would have run it: [`HostCopies::copy_all`]'s contract for a part,
/// [`HostCopies::queue`]'s for a job or a job's part.
unsafe fn run_work(work: Work, routine: CopyRoutine) -> Option<Ran> {
    match work {
        Work::Part(part) => {
            copy_part(&part.copies);
            part.left.fetch_sub(1, Ordering::Release);
            None
        }
        Work::JobPart(SourcesZeroed(copies, cold), keep, clock, _) => {
            clock_start(&clock);
            let since = Instant::now();
            let bytes = 2 * copies.iter().map(|c| c.n as u64).sum::<u64>();
            // SAFETY: the caller's contract, and the job's sources tiled its zeroed range
            // (checked before it was cut): this part's sources are its own.
            unsafe { copy_list(&copies, routine, true, cold) };
            drop((copies, keep));
            clock_finish(&clock);
            let busy = since.elapsed();
            Some(Ran { bytes, busy })
        }
        Work::Job(job, clock, _) => {
            clock_start(&clock);
            let (since, bytes) = (Instant::now(), job.bytes() as u64);
            // SAFETY: the caller's contract.
            unsafe { job.run(routine) };
            drop(job);
            clock_finish(&clock);
            let busy = since.elapsed();
            Some(Ran { bytes, busy })
        }
    }
}

fn copy_part(copies: &[HostCopy]) {
    for c in copies {
        // SAFETY: see `Part` and `HostCopies::copy_all`'s contract: both ranges are valid for
        // `n` bytes and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(c.from, c.to, c.n) };
    }
}

impl HostCopies {
    /// `threads` helper threads besides the caller (0: every copy on the calling thread), idle
    /// ones spinning as `spin` allows, all of them. A helper that cannot be started leaves fewer
    /// (logged).
    pub fn new(threads: usize, spin: HelperSpin) -> HostCopies {
        HostCopies::with_policy(threads, HelperPolicy::with_spin(spin))
    }

    /// `threads` helper threads working as `policy` says.
    pub fn with_policy(threads: usize, policy: HelperPolicy) -> HostCopies {
        let queue = Arc::new(Queue {
            jobs: Mutex::new(Jobs::default()),
            ready: Condvar::new(),
            len: AtomicUsize::new(0),
            spinning: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            unfinished: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        });
        let mut helpers = Vec::new();
        for i in 0..threads.min(MAX_HOST_COPY_THREADS) {
            let stats = Arc::new(HelperStats::default());
            let (their_queue, their_stats) = (queue.clone(), stats.clone());
            let (spin, routine) = (policy.spin_of(i), policy.routine);
            let spawned = std::thread::Builder::new()
                .name(format!("tcpxd-copy-{i}"))
                .spawn(move || helper_loop(their_queue, their_stats, spin, routine));
            match spawned {
                Ok(thread) => helpers.push(Helper {
                    stats,
                    spin,
                    thread: Some(thread),
                }),
                Err(e) => {
                    tracing::warn!("host copy helper {i} could not start: {e}");
                    break;
                }
            }
        }
        HostCopies {
            helpers,
            queue,
            routine: policy.routine,
            split: policy.split,
        }
    }

    /// Whether queued work reaches a helper: there are helpers and the pool is not closing.
    fn open(&self) -> bool {
        !self.helpers.is_empty() && !self.queue.closed.load(Ordering::SeqCst)
    }

    /// Closes the queue: the helpers end once it is empty, and work queued from now on runs on
    /// the calling thread (as with no helpers).
    fn close(&self) {
        let _q = self.queue.lock();
        self.queue.closed.store(true, Ordering::SeqCst);
        self.queue.ready.notify_all();
    }

    /// Helper threads besides the caller.
    pub fn threads(&self) -> usize {
        self.helpers.len()
    }

    /// Copies every `copies[i]`, split across the helpers and this thread when they total at
    /// least [`MIN_SPLIT_BYTES`]; returns once every byte is copied.
    ///
    /// # Safety
    /// Every copy's `from` must be readable and its `to` writable for `n` bytes until this call
    /// returns, no two copies' targets may overlap each other or any source, and nothing else may
    /// write the targets meanwhile.
    pub unsafe fn copy_all(&self, copies: &[HostCopy]) {
        let total: usize = copies.iter().map(|c| c.n).sum();
        let parts = (total / MIN_PART_BYTES).min(self.helpers.len() + 1);
        if total < MIN_SPLIT_BYTES || parts < 2 {
            copy_part(copies);
            return;
        }
        if !self.open() {
            copy_part(copies);
            return;
        }
        let mut split = cut(copies, parts);
        let first = std::mem::take(&mut split[0]);
        let left = Arc::new(AtomicUsize::new(0));
        for part in split.into_iter().skip(1) {
            left.fetch_add(1, Ordering::Relaxed);
            self.queue.push(
                Work::Part(Part {
                    copies: part,
                    left: left.clone(),
                }),
                Place::Next,
            );
        }
        copy_part(&first);
        while left.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
            std::thread::yield_now();
        }
    }

    /// Puts `job` on the helpers' queue as due now (`Place::Due`: behind every job `Next` and
    /// every due job queued before it) and returns its ticket; with no helper, or a job under [`MIN_QUEUE_BYTES`],
    /// runs it here and returns `None` (done).
    ///
    /// # Safety
    /// Every copy's `from` must be readable and its `to` writable for `n` bytes, and `zero`'s
    /// range writable, until the ticket is done (outside the regions in `job.keep`, the caller
    /// keeps the memory alive that long, and [`HostCopies::quiesce`] before freeing it); no two
    /// targets may overlap each other or any source, and nothing else may write the targets (or
    /// the sources) meanwhile.
    pub unsafe fn queue(&self, job: CopyJob) -> Option<CopyTicket> {
        // SAFETY: the caller's contract.
        unsafe { self.queue_at(job, Place::Due) }
    }

    /// As [`HostCopies::queue`], at `place` in the queue (session 28: every lane's next send's
    /// gather first, then the gathers the send windows would send at once, then those ahead).
    ///
    /// # Safety
    /// As [`HostCopies::queue`].
    pub unsafe fn queue_at(&self, job: CopyJob, place: Place) -> Option<CopyTicket> {
        if !self.open() || job.bytes() < MIN_QUEUE_BYTES {
            // SAFETY: the caller's contract, for this call's length.
            unsafe { job.run(self.routine) };
            return None;
        }
        // Helpers with nothing to do take a part each (a transfer's first and last chunks, or
        // a lull); under load the job goes whole to the queue.
        let copied: usize = job.copies.iter().map(|c| c.n).sum();
        let tiles = job.sources_tile_zero();
        let idle = self.helpers.len().saturating_sub(self.in_flight() as usize);
        let clock: Clock =
            tracing::enabled!(target: "tcpxd::hop", tracing::Level::TRACE).then(|| Arc::new(JobClock::new()));
        let parts = idle.min(copied / MIN_QUEUED_PART_BYTES);
        let works: Vec<Work> = if self.split && parts >= 2 && (job.zero.is_none() || tiles) {
            cut(&job.copies, parts)
                .into_iter()
                .map(|copies| {
                    let done = Arc::new(AtomicU64::new(0));
                    if tiles {
                        Work::JobPart(
                            SourcesZeroed(copies, job.cold_targets),
                            job.keep.clone(),
                            clock.clone(),
                            done,
                        )
                    } else {
                        Work::Job(
                            CopyJob {
                                copies,
                                zero: None,
                                cold_targets: job.cold_targets,
                                keep: job.keep.clone(),
                            },
                            clock.clone(),
                            done,
                        )
                    }
                })
                .collect()
        } else {
            vec![Work::Job(job, clock.clone(), Arc::new(AtomicU64::new(0)))]
        };
        let mut ticket = Vec::with_capacity(works.len());
        for w in works {
            ticket.push(w.done_flag().expect("a queued job's flag").clone());
            self.queue.unfinished.fetch_add(1, Ordering::AcqRel);
            self.queue.push(w, place);
        }
        Some(CopyTicket { parts: ticket, clock })
    }

    /// Moves the parts of `ticket` still queued at a later place than `place` up to it,
    /// keeping their age (a gather queued ahead of its lane's window that the window reached,
    /// or its lane's next send now). Returns how many parts moved (none: they were there
    /// already, taken by a helper, or done).
    pub fn hurry(&self, ticket: &CopyTicket, place: Place) -> usize {
        let mut q = self.queue.lock();
        let mut moved = Vec::new();
        let mut i = 0;
        while i < q.queued.len() {
            let ((at, _), ref work) = q.queued[i];
            let mine = at > place
                && work
                    .done_flag()
                    .is_some_and(|f| ticket.parts.iter().any(|p| Arc::ptr_eq(p, f)));
            if mine {
                moved.push(q.queued.remove(i).expect("in the queue"));
            } else {
                i += 1;
            }
        }
        let n = moved.len();
        for ((_, age), work) in moved {
            q.insert((place, age), work);
        }
        n
    }

    /// Returns once every queued job is done (before a comm, ring or buffer a job may touch is
    /// dropped).
    pub fn quiesce(&self) {
        while self.queue.unfinished.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
            std::thread::yield_now();
        }
    }

    /// Jobs (and job parts) queued and not done yet.
    pub fn in_flight(&self) -> u64 {
        self.queue.unfinished.load(Ordering::Acquire)
    }
}

impl Drop for HostCopies {
    fn drop(&mut self) {
        self.quiesce();
        if !self.helpers.is_empty() {
            // Where a host block path's time went (docs/BENCHMARKS.md, session 19): each
            // helper's share of the queued bytes and how long it copied them.
            let per: Vec<String> = self
                .helpers
                .iter()
                .map(|h| {
                    let (b, ns) = (
                        h.stats.bytes.load(Ordering::Relaxed),
                        h.stats.busy_ns.load(Ordering::Relaxed),
                    );
                    let gbps = if ns == 0 { 0.0 } else { b as f64 / ns as f64 };
                    format!(
                        "{} jobs, {:.1} MB in {:.1} ms ({gbps:.1} GB/s), spun {:.1} ms (at most {} µs a gap), slept {} times",
                        h.stats.jobs.load(Ordering::Relaxed),
                        b as f64 / 1e6,
                        ns as f64 / 1e6,
                        h.stats.spun_ns.load(Ordering::Relaxed) as f64 / 1e6,
                        h.spin.max.as_micros(),
                        h.stats.sleeps.load(Ordering::Relaxed),
                    )
                })
                .collect();
            tracing::info!(helpers = per.len(), "host copy helpers: {}", per.join("; "));
        }
        let threads: Vec<JoinHandle<()>> = self.helpers.iter_mut().filter_map(|h| h.thread.take()).collect();
        self.close(); // the helpers end: the queue is empty
        self.helpers.clear();
        for t in threads {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
#[path = "host_copies_tests.rs"]
mod tests;
