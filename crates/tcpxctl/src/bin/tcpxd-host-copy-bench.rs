//! `tcpxd-host-copy-bench`: how fast the daemon's host copies of block chunks go, without the
//! plugin (issue 38 point 3: on a 16-core host, host blocks moved at 0.32–0.40× contiguous bytes
//! whatever `transfer.host_copy_threads` said). A receiver's work per chunk is modelled: a
//! chunk of `--chunk-kib` landed in one of `--slots` landing slots, scattered in pieces of
//! `--block-kib` to blocks permuted over a `--dest-mib` destination, then its slot zeroed (a
//! direct receive's). Three ways, as the daemon can run them:
//!
//! - `poller`: one thread copies and zeroes each chunk in turn (0 helpers);
//! - `fork-join T`: each chunk's copies cut across T helpers and the caller, which waits for
//!   them (`HostCopies::copy_all`, session 18), then zeroes;
//! - `queued T`: each chunk handed whole to one of T helpers (`HostCopies::queue`, session 19),
//!   up to `--in-flight` chunks under way (a receive lane's window), the caller taking tickets
//!   back in order as the poller consumes receives.
//!
//! Each row prints GB/s of chunk bytes and its ratio to `poller`; a memcpy of the same bytes
//! contiguous on one thread is the first row. `--routines` repeats the rows for each copy
//! routine (`transfer.host_copy_routine`: plain, prefetch, stream; session 23), `--spinners`
//! says how many helpers may spin (`transfer.host_copy_spinners`). Reports only: nothing here
//! asserts a speed.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use clap::Parser;
use tcpxd::net::copy_routines::CopyRoutine;
use tcpxd::net::host_copies::{CopyJob, HelperPolicy, HelperSpin, HostCopies, HostCopy};

#[derive(Parser, Debug)]
#[command(
    name = "tcpxd-host-copy-bench",
    about = "Time host block-chunk copies on helper threads"
)]
struct Args {
    /// Chunk size in KiB (the daemon's default `chunk_bytes`: 512 KiB).
    #[arg(long, default_value_t = 512)]
    chunk_kib: usize,
    /// Block (piece) size in KiB.
    #[arg(long, default_value_t = 16)]
    block_kib: usize,
    /// Destination size in MiB (larger than the last-level cache).
    #[arg(long, default_value_t = 512)]
    dest_mib: usize,
    /// Landing slots (two lanes of 16 receives).
    #[arg(long, default_value_t = 32)]
    slots: usize,
    /// Chunks under way at once in the queued rows.
    #[arg(long, default_value_t = 32)]
    in_flight: usize,
    /// Helper counts, comma-separated.
    #[arg(long, default_value = "1,2,4,8", value_delimiter = ',')]
    threads: Vec<usize>,
    /// Seconds per row.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// The most an idle helper spins for its next chunk, µs (the daemon's
    /// `transfer.host_copy_spin_us`; 200 is its `auto` where it spins).
    #[arg(long, default_value_t = 200)]
    spin_us: u64,
    /// Helpers that may spin (the daemon's `transfer.host_copy_spinners`).
    #[arg(long, default_value_t = 64)]
    spinners: usize,
    /// Copy routines, comma-separated: plain, prefetch, stream (each runs every row).
    #[arg(long, default_value = "plain", value_delimiter = ',')]
    routines: Vec<String>,
    /// Skip the fork-and-join rows.
    #[arg(long)]
    no_fork_join: bool,
}

struct Setup {
    slots: Vec<u8>,
    dest: Vec<u8>,
    /// Destination block of each chunk's k-th piece, chunk after chunk (wrapping).
    order: Vec<usize>,
    chunk: usize,
    block: usize,
}

impl Setup {
    /// Chunk `n`'s copies out of its slot, and the slot.
    fn job(&mut self, n: usize) -> CopyJob {
        let per = self.chunk / self.block;
        let slot = (n % (self.slots.len() / self.chunk)) * self.chunk;
        let mut copies = Vec::with_capacity(per);
        for k in 0..per {
            let b = self.order[(n * per + k) % self.order.len()];
            copies.push(HostCopy {
                from: self.slots[slot + k * self.block..].as_ptr(),
                to: self.dest[b * self.block..].as_mut_ptr(),
                n: self.block,
            });
        }
        CopyJob {
            copies,
            zero: Some((self.slots[slot..].as_mut_ptr(), self.chunk)),
            cold_targets: true,
            keep: Vec::new(),
        }
    }
}

fn row(name: &str, bytes: u64, took: Duration, base: Option<f64>) -> f64 {
    let gbps = bytes as f64 / took.as_secs_f64() / 1e9;
    match base {
        Some(b) => println!("{name:<16} {gbps:>8.2} GB/s  {:>5.2}x poller", gbps / b),
        None => println!("{name:<16} {gbps:>8.2} GB/s"),
    }
    gbps
}

fn main() {
    let a = Args::parse();
    let (chunk, block) = (a.chunk_kib * 1024, a.block_kib * 1024);
    if block == 0 || chunk % block != 0 || a.slots == 0 || a.in_flight == 0 {
        eprintln!(
            "tcpxd-host-copy-bench: --chunk-kib must be a multiple of --block-kib (> 0); --slots, --in-flight > 0"
        );
        std::process::exit(2);
    }
    let blocks = a.dest_mib * 1024 * 1024 / block;
    let mut order: Vec<usize> = (0..blocks).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let mut s = Setup {
        slots: vec![1u8; a.slots * chunk],
        dest: vec![0u8; blocks * block],
        order,
        chunk,
        block,
    };
    let run_for = Duration::from_secs_f64(a.seconds);
    println!(
        "{} CPUs; chunks of {} KiB in {} KiB pieces over {} MiB, slot zeroed after; {} in flight when queued",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        a.chunk_kib,
        a.block_kib,
        a.dest_mib,
        a.in_flight
    );

    // A contiguous memcpy of chunks on one thread: the ceiling of one core.
    let (src, mut dst) = (vec![3u8; chunk], vec![0u8; chunk]);
    let (t0, mut bytes) = (Instant::now(), 0u64);
    while t0.elapsed() < run_for {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        bytes += chunk as u64;
    }
    row("memcpy 1 thread", bytes, t0.elapsed(), None);

    let spin = HelperSpin {
        max: Duration::from_micros(a.spin_us),
    };
    for word in &a.routines {
        let routine = match CopyRoutine::parse("--routines", word) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("tcpxd-host-copy-bench: {e}");
                std::process::exit(2);
            }
        };
        let policy = HelperPolicy {
            spinners: a.spinners,
            routine,
            ..HelperPolicy::with_spin(spin)
        };
        println!("-- routine {}, {} helpers may spin", routine.name(), a.spinners);
        rows(&a, &mut s, policy, run_for);
    }
    std::hint::black_box(&s.dest);
}

/// The poller row, then fork-and-join and queued rows per helper count, copying as `policy` says.
fn rows(a: &Args, s: &mut Setup, policy: HelperPolicy, run_for: Duration) {
    // The poller alone.
    let none = HostCopies::with_policy(0, policy);
    let (t0, mut n) = (Instant::now(), 0usize);
    while t0.elapsed() < run_for {
        let job = s.job(n);
        // SAFETY: `s`'s vectors outlive the call; targets are distinct blocks of `dest` (a
        // permutation) and the zeroed slot is this chunk's alone.
        let t = unsafe { none.queue(job) };
        assert!(t.is_none());
        n += 1;
    }
    let base = row("poller", (n * s.chunk) as u64, t0.elapsed(), None);

    for &threads in &a.threads {
        let pool = HostCopies::with_policy(threads, policy);
        let (t0, mut n) = (Instant::now(), 0usize);
        while !a.no_fork_join && t0.elapsed() < run_for {
            let job = s.job(n);
            // SAFETY: as above; `copy_all` returns once every part is copied.
            unsafe { pool.copy_all(&job.copies) };
            let (at, len) = job.zero.expect("a slot");
            // SAFETY: the slot, no copy of it under way.
            unsafe { std::ptr::write_bytes(at, 0, len) };
            n += 1;
        }
        if !a.no_fork_join {
            row(
                &format!("fork-join {threads}"),
                (n * s.chunk) as u64,
                t0.elapsed(),
                Some(base),
            );
        }

        let (t0, mut n) = (Instant::now(), 0usize);
        let mut under_way = VecDeque::new();
        // At most `slots` chunks under way, so a slot is never written by two jobs.
        let window = a.in_flight.min(a.slots);
        while t0.elapsed() < run_for || !under_way.is_empty() {
            while let Some(t) = under_way.front() {
                if !tcpxd::net::host_copies::CopyTicket::is_done(t) {
                    break;
                }
                under_way.pop_front();
            }
            if under_way.len() < window && t0.elapsed() < run_for {
                let job = s.job(n);
                // SAFETY: as above; a slot is reused only after its earlier job's ticket is done
                // (at most `slots` under way), and `quiesce` below ends every job before `s` goes.
                if let Some(t) = unsafe { pool.queue(job) } {
                    under_way.push_back(t);
                }
                n += 1;
            } else {
                // As the poller's backoff: a helper may need this core.
                std::thread::yield_now();
            }
        }
        pool.quiesce();
        row(
            &format!("queued {threads}"),
            (n * s.chunk) as u64,
            t0.elapsed(),
            Some(base),
        );
    }
}
