//! An idle daemon costs (almost) nothing: two `tcpxd` processes paired on the emulation, lanes
//! up and used once, then left alone. Each one's CPU time (utime + stime from /proc/<pid>/stat)
//! over a few seconds stays far below a core, and its RSS stays flat. The figures are printed;
//! the assertion is generous (3% of a core, 4 MiB) so a loaded CI machine does not trip it —
//! the target (≤ 1%) is what the printed figure shows.

use std::time::{Duration, Instant};

use crate::common::daemons::{fill_seed, host_buffer, wait_ok, write, write_entry};
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

/// CPU seconds (user + system) the process has used so far, and its RSS in bytes.
fn usage(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat");
    // The command name (field 2) may hold spaces: count fields after its closing parenthesis.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the command name.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).expect("statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    (ticks as f64 / hz, pages * 4096)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_paired_daemon_costs_under_a_few_percent_of_a_core_and_keeps_its_rss() {
    idle_cost(&[("TCPXD_SPIN", "off")]).await;
}

/// With `runtime.spin` on the poller and one async worker keep polling while traffic flows, and
/// eager credits stay posted on every lane: once the traffic stops, both park all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_daemon_with_posted_credits_parks_when_idle() {
    idle_cost(&[("TCPXD_SPIN", "on"), ("TCPXD_TRANSFER_PROTOCOL", "eager")]).await;
}

async fn idle_cost(env: &[(&str, &str)]) {
    tcpxd::logging::init("warn");
    let a = procs::spawn("idle-a", 0, "", env).await;
    let b = procs::spawn("idle-b", 0, "", env).await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    ac.connect_peer(pb::ConnectPeerRequest {
        address: b.peer_addr.clone(),
    })
    .await
    .expect("connect");
    // Use the lanes once in each direction, so everything a transfer sets up exists.
    let src = host_buffer(&mut ac, 8 << 20, "").await;
    let dst = host_buffer(&mut bc, 8 << 20, "").await;
    fill_seed(&mut ac, src.id, 0, 0, 1).await;
    for _ in 0..4 {
        let id = write(&mut ac, write_entry(&src, 0, &dst, 0, 8 << 20), b"")
            .await
            .unwrap();
        wait_ok(&mut ac, id).await;
        let id = crate::common::daemons::read(
            &mut ac,
            crate::common::daemons::read_entry(&dst, 0, &src, 0, 4096),
        )
        .await
        .unwrap();
        wait_ok(&mut ac, id).await;
    }
    // Let the last transfer's wake-ups pass, then measure both processes over the same window.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pids = [a.child.id(), b.child.id()];
    let before: Vec<_> = pids.iter().map(|&p| usage(p)).collect();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let wall = t0.elapsed().as_secs_f64();
    for (i, &pid) in pids.iter().enumerate() {
        let (cpu1, rss1) = usage(pid);
        let (cpu0, rss0) = before[i];
        let share = (cpu1 - cpu0) / wall * 100.0;
        let grew = rss1 as i64 - rss0 as i64;
        println!(
            "idle daemon {} ({env:?}): {share:.2}% of a core over {wall:.1} s; RSS {} KiB -> {} KiB ({grew:+} bytes)",
            ["a", "b"][i],
            rss0 >> 10,
            rss1 >> 10
        );
        assert!(share <= 3.0, "an idle daemon used {share:.2}% of a core");
        assert!(grew < 4 << 20, "RSS grew by {grew} bytes while idle");
    }
}
