//! Holding a transfer in flight on any plugin (issue #40 point 7). Tests that stop a transfer
//! midway (cancel, deadlines, drains, a client going away) once held it only by pacing the
//! emulation (`TCPXEMU_RATE_GBPS`), which Google's plugin ignores: there a 128 MiB transfer ends
//! in ~60 ms, before the test acts. Here the peer daemon runs as its own process, and the test
//! stops it (SIGSTOP) as soon as the transfer has moved its first bytes: the receiver takes no
//! more data and the sender's sockets fill, whatever the plugin. The test does what it needs
//! mid-flight, then lets the peer go on (SIGCONT) well within the peer heartbeat timeout (3 s).
//!
//! Stopping the peer once bytes moved races the transfer's end: on a loaded machine the test may
//! see its first event late, and stop the peer after the last byte (or with the rest already in
//! the lanes' socket buffers, tens of MiB on loopback). On the emulation the race is gone: a
//! test calls [`gate_on`] before any daemon starts and [`close_gate`] before posting the
//! transfer, and the emulation's hold gate (`TCPXEMU_HOLD_FILE`, docs/EMULATION.md) lets the
//! senders of this process and of the peers it spawns write 16 MiB more and then wait until the
//! peer is thawed: the transfer moves its first bytes and cannot end before. (On another plugin,
//! `TCPXD_TEST_PLUGIN`, the gate is ignored and the race is back, as before it.)

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::daemons::Client;
use super::procs::ProcDaemon;
use tcpxd::api::proto::v1 as pb;

static GATE: OnceLock<PathBuf> = OnceLock::new();

/// Turns the emulation's hold gate on for this test's process and the peer daemons it spawns
/// afterwards (they inherit the environment). Call it first, before any daemon starts: the
/// emulation reads its environment once.
pub fn gate_on() {
    GATE.get_or_init(|| {
        let file = std::env::temp_dir().join(format!("tcpxd-hold-{}", std::process::id()));
        std::fs::remove_file(&file).ok();
        // SAFETY: each test runs in its own process (nextest); this runs before any daemon (and
        // so the emulation, which reads the variable) starts.
        unsafe { std::env::set_var("TCPXEMU_HOLD_FILE", &file) };
        file
    });
}

/// [`gate_on`] with a budget of `bytes` (`TCPXEMU_HOLD_AFTER_BYTES`; 16 MiB by default): for a
/// test whose transfers are smaller than the default budget, so that they too are held.
pub fn gate_on_with_budget(bytes: u64) {
    // SAFETY: as in `gate_on`, which this runs first of all.
    unsafe { std::env::set_var("TCPXEMU_HOLD_AFTER_BYTES", bytes.to_string()) };
    gate_on();
}

/// Closes the hold gate (see the module's comment) until the next thaw: call it before posting
/// a transfer to be held with [`freeze_once_moving`] or [`freeze_once_lanes_move`].
pub fn close_gate() {
    static GENERATION: AtomicU64 = AtomicU64::new(0);
    let file = GATE
        .get()
        .expect("hold::gate_on() first, before any daemon starts");
    // New contents each time: the emulation grants a fresh budget per contents.
    let g = GENERATION.fetch_add(1, Ordering::Relaxed);
    std::fs::write(file, format!("{g}\n")).expect("the hold gate's file");
}

/// Opens the hold gate (a thaw does too): for a test that keeps the peer stopped but needs this
/// process's other transfers to move.
pub fn open_gate() {
    if let Some(file) = GATE.get() {
        std::fs::remove_file(file).ok();
    }
}

/// Waits until every thread of `pid` is stopped: kill(2) returns before a SIGSTOP has taken
/// effect on threads running on other CPUs.
fn wait_stopped(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stopped = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("the peer's threads")
            .filter_map(Result::ok)
            .all(|t| {
                std::fs::read_to_string(t.path().join("stat")).is_ok_and(|s| {
                    // `pid (comm) S ...`: the state follows the last ')'.
                    s.rfind(')')
                        .and_then(|i| s[i + 1..].split_whitespace().next())
                        .is_some_and(|st| st == "T" || st == "t")
                })
            });
        if stopped {
            return;
        }
        assert!(Instant::now() < deadline, "pid {pid} not stopped within 30 s");
        std::thread::yield_now();
    }
}

/// A peer daemon stopped with SIGSTOP; continued by [`Frozen::thaw`], or when dropped.
pub struct Frozen {
    pid: i32,
    thawed: bool,
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

impl Frozen {
    /// Stops `peer` now (every thread of it, on return).
    pub fn now(peer: &ProcDaemon) -> Frozen {
        let pid = peer.child.id() as i32;
        signal(pid, libc::SIGSTOP);
        wait_stopped(pid);
        Frozen { pid, thawed: false }
    }

    /// Lets the peer go on, and opens the hold gate.
    pub fn thaw(mut self) {
        open_gate();
        signal(self.pid, libc::SIGCONT);
        self.thawed = true;
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if !self.thawed {
            open_gate();
            // SAFETY: as in `signal`; a failed test must not leave a stopped process behind.
            unsafe { libc::kill(self.pid, libc::SIGCONT) };
        }
    }
}

/// Follows transfer `id` on `c` (its initiator's daemon) until it has moved bytes, then stops
/// `peer`. Returns the event that showed the bytes. Panics if the transfer finished first.
/// With the hold gate closed before the post ([`close_gate`]) it cannot have: the transfer's
/// senders wait at the gate until the thaw. Without it (another plugin), a stopped *sender*
/// holds the transfer only if it is stopped before the rest is in the lanes' socket buffers,
/// a stopped *receiver* only if it is stopped before it took the last byte.
pub async fn freeze_once_moving(c: &mut Client, id: u64, peer: &ProcDaemon) -> (Frozen, pb::TransferEvent) {
    let e = once_moving(c, id).await;
    (Frozen::now(peer), e)
}

/// Follows transfer `id` on `c` (its initiator's daemon) until it has moved bytes, and returns
/// the event that showed them. Panics if the transfer finished first (with the hold gate closed
/// before the post, [`close_gate`], it cannot have until [`open_gate`]).
pub async fn once_moving(c: &mut Client, id: u64) -> pb::TransferEvent {
    let mut events = c
        .watch(pb::WatchRequest { transfer_id: id })
        .await
        .expect("watch")
        .into_inner();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), events.message())
            .await
            .expect("an event within 30 s")
            .expect("watch stream")
            .expect("the transfer's events");
        assert_ne!(
            e.state,
            pb::TransferState::Finished as i32,
            "transfer {id} finished before it could be held: {e:?}"
        );
        if e.bytes_done > 0 {
            return e;
        }
    }
}

/// Bytes moved on every lane of every pairing, both ways, and the transfers not yet finished.
async fn moved(c: &mut Client) -> (u64, u64) {
    let s = c
        .get_stats(pb::GetStatsRequest {})
        .await
        .expect("stats")
        .into_inner();
    let bytes = s
        .peers
        .iter()
        .flat_map(|p| &p.lanes)
        .map(|l| l.bytes_sent + l.bytes_received)
        .sum();
    (bytes, u64::from(s.active_transfers))
}

/// For transfers a test cannot watch by id (a session's, a waiting call's): asks `c` (the
/// initiator's daemon) until at least `active` transfers are unfinished and its lanes moved bytes
/// since the call, then stops `peer`. Panics if fewer than `active` are still unfinished once it
/// is stopped (they finished first: make them larger).
pub async fn freeze_once_lanes_move(c: &mut Client, peer: &ProcDaemon, active: u64) -> Frozen {
    let (before, _) = moved(c).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (bytes, now_active) = moved(c).await;
        if bytes > before && now_active >= active {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no bytes moved within 30 s");
        tokio::task::yield_now().await;
    }
    let frozen = Frozen::now(peer);
    let (_, still) = moved(c).await;
    assert!(
        still >= active,
        "{still} of {active} transfers unfinished when held: make them larger"
    );
    frozen
}

/// The peer `b` of an in-process daemon `a`, as its own process (so that it can be held
/// stopped), `env` in its environment, paired with `a`; and its client.
pub async fn peer_process(
    a: &mut super::daemons::TestDaemon,
    name: &str,
    env: &[(&str, &str)],
) -> (ProcDaemon, Client) {
    let b = super::procs::spawn(name, 0, "", env).await;
    let bc = b.client().await;
    a.client
        .connect_peer(pb::ConnectPeerRequest {
            address: b.peer_addr.clone(),
        })
        .await
        .expect("connect peer");
    (b, bc)
}
