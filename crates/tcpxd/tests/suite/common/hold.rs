//! Holding a transfer in flight on any plugin (issue #40 point 7). Tests that stop a transfer
//! midway (cancel, deadlines, drains, a client going away) once held it only by pacing the
//! emulation (`TCPXEMU_RATE_GBPS`), which Google's plugin ignores: there a 128 MiB transfer ends
//! in ~60 ms, before the test acts. Here the peer daemon runs as its own process, and the test
//! stops it (SIGSTOP) as soon as the transfer has moved its first bytes: the receiver takes no
//! more data and the sender's sockets fill, whatever the plugin. The test does what it needs
//! mid-flight, then lets the peer go on (SIGCONT) well within the peer heartbeat timeout (3 s).

use std::time::Duration;

use super::daemons::Client;
use super::procs::ProcDaemon;
use tcpxd::api::proto::v1 as pb;

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
    /// Stops `peer` now.
    pub fn now(peer: &ProcDaemon) -> Frozen {
        let pid = peer.child.id() as i32;
        signal(pid, libc::SIGSTOP);
        Frozen { pid, thawed: false }
    }

    /// Lets the peer go on.
    pub fn thaw(mut self) {
        signal(self.pid, libc::SIGCONT);
        self.thawed = true;
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if !self.thawed {
            // SAFETY: as in `signal`; a failed test must not leave a stopped process behind.
            unsafe { libc::kill(self.pid, libc::SIGCONT) };
        }
    }
}

/// Follows transfer `id` on `c` (its initiator's daemon) until it has moved bytes, then stops
/// `peer`. Returns the event that showed the bytes. Panics if the transfer finished first (make
/// it larger). A stopped *sender* holds the transfer until thawed; a stopped *receiver* does so
/// only while the rest is larger than the lanes' socket buffers can take (tens of MiB on
/// loopback): to hold a write for sure, stop its receiver before posting it.
pub async fn freeze_once_moving(c: &mut Client, id: u64, peer: &ProcDaemon) -> (Frozen, pb::TransferEvent) {
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
            return (Frozen::now(peer), e);
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
