#!/usr/bin/env python3
"""Where a many-in-flight run's CPU goes, thread by thread: runs one `tcpxctl bench transfer` (its
two local daemons) and samples every thread's on-CPU time (`/proc/PID/task/TID/schedstat`) of
tcpxctl and the daemons it starts, every 10 ms, until they exit. Prints each thread kind's CPU
time in all and per transfer (µs), beside the bench's own rows.

With N transfers in flight and a core for each busy thread, the slowest thread bounds the rate:
a thread at X µs of CPU per transfer caps it at 1/X transfers a second, however deep the queue.
So the thread whose CPU per transfer is nearest the measured wall time per transfer is the one
that serializes (on a host with cores to spare; on a loaded 2-core VM read the per-transfer CPU,
not the wall time).

    python3 benches/inflight_threads.py --tcpxctl target/release/tcpxctl -- \\
        --sizes 64K --iters 2000 --warmup 50 --concurrency 8 [--cuda 0]

Everything after `--` goes to `tcpxctl bench transfer` (use one size: the transfer count is
`--iters + --warmup` of it). Setup (start, pairing, fill, checksum) is counted too; with a few
thousand transfers it is a small part. A poller's CPU includes its polling while transfers are
in flight (yields on a small host; with `runtime.spin`, on by default from 8 CPUs, it never
sleeps while traffic flows): set `TCPXD_SPIN=off` for the work alone, and split a thread's time
with `perf record -t TID` (the daemons' release builds keep their symbols).

A poller that never sleeps while transfers are in flight (it yields, and on a host with CPUs to
spare a yield returns at once) shows about as much CPU as the run is long, whatever its work: so
the script also reads each daemon's `tcpxd_poller_pass_seconds_total` (its `/metrics`, every
100 ms): the time in passes that made progress (`busy`) and in passes that found nothing
(`idle`), apart from the waits between passes. `busy µs/transfer` is the poller's work per
transfer; `peak busy` the largest share of any 0.5 s of the run its busy passes took (near 1.0:
the poller is the ceiling; well below: something else is).

Every figure above counts the whole run, its one-off work too: the pairing, each lane's first
accept (which in the emulation's CUDA mode builds the comm's bounce memory on the poller's
thread: the receiver's `setup` phase, ~275 ms a run on the H200 host, session 27) and the
buffers' registration (`commands`). `peak busy` can be that one-off work. The last table,
`Steady window`, is the same figures over the middle of the run only (20% to 80% of daemon a's
finished transfers, between two scrapes 0.1 s apart): read the poller's cost per transfer and
its busy share there. Give it a run of a few seconds (on the H200 host, 64 KiB at 16 in flight:
`--iters 100000` or more).

`--syscalls` (root, `perf`): over the same steady window, counts each daemon poller's system
calls with `perf stat` on its thread (tracepoints, a few % of overhead) and prints them per
transfer: `send direct` is the direct control connection's writes (`sendto` with
`MSG_DONTWAIT|MSG_NOSIGNAL`, the only ones with those flags: the emulation's lanes send with
`MSG_NOSIGNAL` alone, the framed sessions' answers are `write`s), `recvfrom` the direct
sockets' reads (std's `read` on a TCP stream is a `recv`), `epoll_wait` the pass's looks and
parks, `sched_yield` / `futex` the backoff and wake-ups.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict


def threads_of(pid):
    """{tid: (name, on-CPU ns)} of one process; {} once it is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue
        out[int(tid)] = (name, ns)
    return out


def children(pid):
    """The pids of `pid`'s children (every thread's)."""
    kids = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids.update(int(k) for k in f.read().split())
            except OSError:
                pass
    except OSError:
        pass
    return kids


def arg_value(args, name, default):
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def kind(name):
    """Threads grouped by what they are: numbered threads of one kind together."""
    return re.sub(r"[-_ ]?\d+$", "", name) or name


def daemon_role(pid):
    """A daemon's role by its node id (`bench-a` issues the transfers, `bench-b` is the peer);
    None until the child runs tcpxd (a child not yet past its exec shows tcpxctl's arguments)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        args = []
    for node, role in ((b"bench-a", "daemon1"), (b"bench-b", "daemon2")):
        if node in args:
            return role
    return None


def ready_file(pid):
    """A daemon's `--ready-file` (tcpxctl's local daemons are started with one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    for i, a in enumerate(args):
        if a == "--ready-file" and i + 1 < len(args):
            return args[i + 1]
    return None


def pass_seconds(addr):
    """{("s"|"n", "yes"|"no"): value} from a daemon's `tcpxd_poller_pass_seconds_total` and
    `tcpxd_poller_passes_total`; None if unreadable."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=0.5) as r:
            text = r.read().decode()
    except Exception:
        return None
    out = {}
    for line in text.splitlines():
        m = re.match(r'tcpxd_poller_pass(es|_seconds)_total\{progress="(yes|no)"\} (\S+)', line)
        if m:
            out[("n" if m.group(1) == "es" else "s", m.group(2))] = float(m.group(3))
        m = re.match(r'tcpxd_poller_busy_phase_seconds_total\{phase="(\w+)"\} (\S+)', line)
        if m:
            out[("p", m.group(1))] = float(m.group(2))
        m = re.match(r'tcpxd_poller_action_seconds_total\{kind="(\w+)"\} (\S+)', line)
        if m:
            out[("a", m.group(1))] = float(m.group(2))
        m = re.match(r'tcpxd_transfers_total\{op="\w+",status="ok"\} (\S+)', line)
        if m:
            out[("t", "ok")] = out.get(("t", "ok"), 0.0) + float(m.group(1))
    return out or None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tcpxctl", default="tcpxctl")
    ap.add_argument("--raw", action="store_true", help="run `tcpxctl bench raw` (the plugin alone, one process) instead")
    ap.add_argument("--syscalls", action="store_true", help="count each poller's system calls over the steady window (perf stat)")
    ap.add_argument("--perf-record", metavar="DIR", help="perf record each busy daemon thread over the steady window into DIR, then report")
    ap.add_argument("--perf-freq", type=int, default=2000, help="--perf-record's sampling frequency (Hz)")
    ap.add_argument("--perf-secs", type=float, default=2.5, help="--perf-record's longest window (s)")
    ap.add_argument("--perf-callgraph", default="dwarf,8192", help="--perf-record's --call-graph (fp, dwarf[,size], lbr)")
    ap.add_argument("--perf-top", type=int, default=30, help="--perf-record's symbols a thread in the report")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `tcpxctl bench transfer`'s arguments")
    a = ap.parse_args()
    bench = [x for x in a.bench if x != "--"] if a.bench[:1] == ["--"] else a.bench
    transfers = int(arg_value(bench, "--iters", "100")) + int(arg_value(bench, "--warmup", "10"))
    proc = subprocess.Popen([a.tcpxctl, "bench", "raw" if a.raw else "transfer", *bench], stdout=subprocess.PIPE, text=True)
    # (role, tid) -> (name, last ns seen)
    seen = {}
    roles = {proc.pid: "tcpxctl"}
    # role -> metrics address; role -> [(t, busy s, idle s)]
    metrics, passes, phases, actions = {}, defaultdict(list), {}, {}
    # role -> [(t, every scraped value)]: the steady window's figures (`steady`)
    series = defaultdict(list)
    last_scrape = 0.0
    # --syscalls: role -> (perf stat process, output file); (t0, done0), (t1, done1) of daemon a
    counting, count_span = {}, []
    # --perf-record: [(role, tid, name, perf process, file, cpu ns at start)], (t, done) at both ends
    recording, rec_span = [], []
    t_start = time.monotonic()
    while proc.poll() is None:
        for kid in children(proc.pid):
            role = roles.get(kid) or daemon_role(kid)
            if role:
                roles[kid] = role
        for pid, role in roles.items():
            for tid, (name, ns) in threads_of(pid).items():
                seen[(role, tid)] = (name, ns)
        now = time.monotonic()
        if now - last_scrape >= 0.1:
            last_scrape = now
            for pid, role in roles.items():
                if role == "tcpxctl":
                    continue
                if role not in metrics:
                    try:
                        with open(ready_file(pid) or "/nonexistent") as f:
                            metrics[role] = json.load(f).get("metrics")
                    except (OSError, ValueError):
                        continue
                p = metrics[role] and pass_seconds(metrics[role])
                if p:
                    # Each thread kind's CPU so far (ns), for the steady window's per-thread rows.
                    for (r, _), (name, ns) in seen.items():
                        if r == role:
                            p[("c", kind(name))] = p.get(("c", kind(name)), 0.0) + ns
                    series[role].append((time.monotonic(), p))
                    if a.syscalls and role == "daemon1":
                        syscall_window(roles, counting, count_span, p.get(("t", "ok"), 0.0), transfers)
                    if a.perf_record and role == "daemon1":
                        record_window(a, roles, seen, recording, rec_span, p.get(("t", "ok"), 0.0), transfers, t_start)
                    phases[role] = {k[1]: v for k, v in p.items() if k[0] == "p"}
                    actions[role] = {k[1]: v for k, v in p.items() if k[0] == "a"}
                    passes[role].append(
                        (
                            time.monotonic(),
                            p.get(("s", "yes"), 0.0),
                            p.get(("s", "no"), 0.0),
                            p.get(("n", "yes"), 0.0),
                            p.get(("n", "no"), 0.0),
                        )
                    )
        time.sleep(0.01)
    out = proc.stdout.read()
    print(out, end="")
    per = defaultdict(lambda: [0, 0])
    for (role, _), (name, ns) in seen.items():
        k = (role.replace("daemon1", "daemon a").replace("daemon2", "daemon b"), kind(name))
        per[k][0] += ns
        per[k][1] += 1
    print(f"\nCPU per thread kind ({transfers} transfers; µs per transfer = CPU ÷ transfers):")
    print(f"{'process':<10} {'threads':<28} {'n':>3} {'CPU ms':>9} {'µs/transfer':>12}")
    for (role, k), (ns, n) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        if ns < 1e6:
            continue
        print(f"{role:<10} {k:<28} {n:>3} {ns / 1e6:>9.1f} {ns / 1e3 / transfers:>12.1f}")
    if passes:
        print("\nPoller passes (tcpxd_poller_pass_seconds_total; the waits between passes not counted):")
        print(
            f"{'process':<10} {'busy ms':>9} {'idle ms':>9} {'busy µs/transfer':>17} {'idle µs/transfer':>17}"
            f" {'busy passes/tr':>15} {'µs/busy pass':>13} {'µs/idle pass':>13} {'peak busy':>10}"
        )
        for role in sorted(passes):
            ss = passes[role]
            busy, idle, nbusy, nidle = ss[-1][1:]
            peak = 0.0
            j = 0
            for i in range(len(ss)):
                while ss[i][0] - ss[j][0] > 0.5:
                    j += 1
                # the window ending at sample i, at least 0.3 s long
                k = max((x for x in range(j + 1) if ss[i][0] - ss[x][0] >= 0.3), default=None)
                if k is not None:
                    peak = max(peak, (ss[i][1] - ss[k][1]) / (ss[i][0] - ss[k][0]))
            name = role.replace("daemon1", "daemon a").replace("daemon2", "daemon b")
            print(
                f"{name:<10} {busy * 1e3:>9.1f} {idle * 1e3:>9.1f} {busy * 1e6 / transfers:>17.1f}"
                f" {idle * 1e6 / transfers:>17.1f} {nbusy / transfers:>15.2f}"
                f" {busy * 1e6 / max(nbusy, 1):>13.1f} {idle * 1e6 / max(nidle, 1):>13.2f} {peak:>10.2f}"
            )
        if any(phases.values()):
            names = ["intake", "commands", "setup", "actions", "test_lanes", "tick", "consume", "flush"]
            print("\nBusy passes by phase (tcpxd_poller_busy_phase_seconds_total; µs per transfer):")
            print(f"{'process':<10} " + " ".join(f"{n:>11}" for n in names))
            for role in sorted(phases):
                name = role.replace("daemon1", "daemon a").replace("daemon2", "daemon b")
                vals = " ".join(f"{phases[role].get(n, 0.0) * 1e6 / transfers:>11.1f}" for n in names)
                print(f"{name:<10} {vals}")
        if any(actions.values()):
            print("\nBusy passes' engine actions by kind (tcpxd_poller_action_seconds_total; µs per transfer, ≥ 0.1):")
            for role in sorted(actions):
                name = role.replace("daemon1", "daemon a").replace("daemon2", "daemon b")
                rows = sorted(actions[role].items(), key=lambda kv: -kv[1])
                cells = [f"{k} {v * 1e6 / transfers:.1f}" for k, v in rows if v * 1e6 / transfers >= 0.1]
                print(f"{name:<10} " + ", ".join(cells))
    steady(series)
    if a.syscalls:
        syscall_report(counting, count_span)
    if a.perf_record:
        record_report(a, recording, rec_span, seen)
    return proc.returncode


def busy_threads(roles, seen, since):
    """[(role, tid, name, ns)] of the daemons' threads worth recording: the named busy ones and any
    other that used a fifth of a CPU or more since `since` (monotonic s)."""
    out = []
    span = max(time.monotonic() - since, 1e-3)
    for pid, role in roles.items():
        if role == "tcpxctl":
            continue
        for tid, (name, ns) in threads_of(pid).items():
            named = name.startswith(("tcpxd-poller", "tcpxd-sessions", "tcpxd-lanes"))
            if named or ns / 1e9 / span >= 0.2:
                out.append((role, tid, name, ns))
    return out


def record_window(a, roles, seen, recording, span, done, transfers, since, lo=0.2, hi=0.8):
    """Starts `perf record` on each busy daemon thread once daemon a finished `lo` of the run's
    transfers; stops them at `hi` or after --perf-secs; `span` gets (time, finished) at both ends."""

    if not span and done >= lo * transfers:
        os.makedirs(a.perf_record, exist_ok=True)
        # Each daemon's mappings: a stripped build's call chains show run-time addresses.
        for pid, role in roles.items():
            try:
                with open(f"/proc/{pid}/maps") as src, open(os.path.join(a.perf_record, f"{role}.maps"), "w") as dst:
                    dst.write(src.read())
            except OSError:
                pass
        for role, tid, name, ns in busy_threads(roles, seen, since):
            out = os.path.join(a.perf_record, f"{role}-{name}-{tid}.data")
            cmd = ["perf", "record", "-q", "-F", str(a.perf_freq), "--call-graph", a.perf_callgraph, "-t", str(tid), "-o", out]
            try:
                p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            except OSError as e:
                print(f"--perf-record: perf record: {e}", file=sys.stderr)
                return
            recording.append((role, tid, name, p, out, ns))
        span.append((time.monotonic(), done))
    elif len(span) == 1 and (done >= hi * transfers or time.monotonic() - span[0][0] >= a.perf_secs):
        stop_recording(recording, span, done)


def stop_recording(recording, span, done):
    import signal

    cpu = {}
    for role, tid, name, p, out, ns in recording:
        try:
            with open(f"/proc/{tid}/schedstat") as f:
                cpu[tid] = int(f.read().split()[0])
        except OSError:
            pass
        p.send_signal(signal.SIGINT)
    for *_, p, _, _ in recording:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    span.append((time.monotonic(), done, cpu))


def record_report(a, recording, span, seen):
    if len(span) == 1:
        # the run ended inside the window
        done = span[0][1]
        stop_recording(recording, span, done)
    if not recording or len(span) < 2 or span[1][1] <= span[0][1]:
        print("\nperf record: the steady window was not caught (a longer run: more --iters)")
        for *_, p, _, _ in recording:
            err = p.stderr.read() if p.stderr else ""
            if err.strip():
                print(f"perf record said: {err.strip()[:500]}")
        return
    transfers = span[1][1] - span[0][1]
    secs = span[1][0] - span[0][0]
    cpu_end = span[1][2]
    print(
        f"\nperf record -F {a.perf_freq} --call-graph {a.perf_callgraph}, {transfers:.0f} transfers of daemon a"
        f" in {secs:.2f} s ({transfers / secs:.0f}/s, slowed by the sampling); per thread: CPU µs a transfer in"
        " that window, then `perf report --no-children` (self) with each share as µs a transfer:"
    )
    for role, tid, name, p, out, ns0 in sorted(recording, key=lambda r: (r[0], r[2])):
        who = role.replace("daemon1", "daemon a").replace("daemon2", "daemon b")
        cpu_us = (cpu_end.get(tid, ns0) - ns0) / 1e3 / transfers
        print(f"\n### {who} {name} (tid {tid}): {cpu_us:.2f} µs CPU a transfer, {cpu_us * transfers / secs / 1e6:.2f} of a CPU")
        if not os.path.exists(out):
            err = p.stderr.read() if p.stderr else ""
            print(f"(no perf data: {err.strip()[:300]})")
            continue
        base = ["perf", "report", "-i", out, "--stdio", "--no-header", "--no-inline"]
        self_rep = run_report(base + ["--no-children", "-g", "none", "--sort", "dso,sym", "--percent-limit", "0"])
        # Kept beside the data (which is deleted): every sampled symbol, or with a stripped binary
        # every sampled address (file offsets: resolve them against the unstripped build with the
        # same build id, `perf buildid-list`), self and inclusive, to read or resolve later.
        keep = out[: -len(".data")]
        with open(keep + ".self.txt", "w") as f:
            f.write(self_rep)
        with open(keep + ".children.txt", "w") as f:
            f.write(run_report(base + ["--children", "-g", "none", "--sort", "dso,sym", "--percent-limit", "0.05"]))
        with open(keep + ".buildids.txt", "w") as f:
            f.write(run_report(["perf", "buildid-list", "-i", out]))
        n = 0
        for line in self_rep.splitlines():
            m = re.match(r"\s*([\d.]+)%\s+(.*)", line)
            if not m:
                continue
            n += 1
            if n > a.perf_top:
                break
            pct = float(m.group(1))
            print(f"  {pct:6.2f}% {pct / 100 * cpu_us:6.2f} µs  {m.group(2).strip()[:150]}")
        incl = run_report(base + ["--children", "-g", "none", "--sort", "sym", "--percent-limit", "2"])
        rows = [l for l in incl.splitlines() if re.match(r"\s*[\d.]+%", l)]
        if rows:
            print("  inclusive (children, self, symbol; ≥ 2%):")
            for l in rows[: a.perf_top + 10]:
                print("   " + " ".join(l.split())[:170])
        if name.startswith("tcpxd-poller") or name.startswith("tcpxd-sessions"):
            callers = run_report(
                base + ["--no-children", "-g", "folded,0.5,callee", "--sort", "sym", "--percent-limit", "2"]
            )
            lines = [l.rstrip() for l in callers.splitlines() if l.strip() and not l.startswith("#")]
            print("  top self symbols' callers (≥ 2% symbols; chains ≥ 0.5%, innermost caller first):")
            for l in lines[:120]:
                print("   " + l[:240])
        try:
            os.remove(out)
        except OSError:
            pass


def run_report(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(perf report failed: {e})"


# (label, perf event, tracepoint filter)
SYSCALLS = [
    ("send direct", "syscalls:sys_enter_sendto", "flags == 0x4040"),
    ("sendto all", "syscalls:sys_enter_sendto", None),
    ("read", "syscalls:sys_enter_read", None),
    ("recvfrom", "syscalls:sys_enter_recvfrom", None),
    ("write", "syscalls:sys_enter_write", None),
    ("epoll_wait", "syscalls:sys_enter_epoll_wait", None),
    ("sched_yield", "syscalls:sys_enter_sched_yield", None),
    ("futex", "syscalls:sys_enter_futex", None),
    ("all", "raw_syscalls:sys_enter", None),
]


def syscall_window(roles, counting, span, done, transfers, lo=0.2, hi=0.8):
    """Starts `perf stat` on both daemons' poller threads once daemon a finished `lo` of the
    run's transfers, stops it at `hi`; `span` gets (time, finished) at both ends."""
    import signal

    if not span and done >= lo * transfers:
        for pid, role in roles.items():
            if role == "tcpxctl":
                continue
            tids = [tid for tid, (name, _) in threads_of(pid).items() if name == "tcpxd-poller"]
            if not tids:
                continue
            out = f"/tmp/inflight_syscalls_{role}_{os.getpid()}.csv"
            cmd = ["perf", "stat", "-x,", "-o", out, "-t", str(tids[0])]
            for _, ev, flt in SYSCALLS:
                cmd += ["-e", ev] + (["--filter", flt] if flt else [])
            try:
                counting[role] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
            except OSError as e:
                print(f"--syscalls: perf stat: {e}", file=sys.stderr)
        span.append((time.monotonic(), done))
    elif len(span) == 1 and done >= hi * transfers:
        for proc, _ in counting.values():
            proc.send_signal(signal.SIGINT)
        for proc, _ in counting.values():
            proc.wait()
        span.append((time.monotonic(), done))


def syscall_report(counting, span):
    import signal

    # A run that ended inside the window: its counters stop here.
    for proc, _ in counting.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait()
    if len(span) < 2 or span[1][1] <= span[0][1]:
        print("\nSystem calls: the steady window was not caught (a longer run: more --iters)")
        return
    transfers = span[1][1] - span[0][1]
    print(f"\nPollers' system calls per transfer (perf stat on the thread, {transfers:.0f} transfers in the steady window):")
    print(f"{'process':<10} " + " ".join(f"{label:>12}" for label, _, _ in SYSCALLS))
    for role in sorted(counting):
        _, out = counting[role]
        try:
            rows = [line.split(",") for line in open(out) if line.strip() and not line.startswith("#")]
        except OSError:
            continue
        vals = [float(r[0]) if r[0].replace(".", "").isdigit() else float("nan") for r in rows]
        name = role.replace("daemon1", "daemon a").replace("daemon2", "daemon b")
        print(f"{name:<10} " + " ".join(f"{v / transfers:>12.2f}" for v in vals[: len(SYSCALLS)]))


def steady(series, lo=0.2, hi=0.8):
    """The same figures over the run's middle only: from the first scrape at which the issuing
    daemon (a) had finished `lo` of its transfers to the last at which it had finished at most
    `hi` of them. Per transfer there means per transfer finished in that window, so the run's
    one-off work (pairing, lanes' connects and accepts with their bounce memory, the buffers'
    registration) is left out: what a transfer costs once traffic flows."""
    a = series.get("daemon1")
    if not a:
        return
    done = [(t, p.get(("t", "ok"), 0.0)) for t, p in a]
    total = done[-1][1]
    if total <= 0:
        return
    inside = [t for t, n in done if lo * total <= n <= hi * total]
    if len(inside) < 2:
        print("\nSteady window: too few scrapes inside the run's middle (a longer run: more --iters)")
        return
    t0, t1 = inside[0], inside[-1]
    n0 = next(n for t, n in done if t == t0)
    n1 = next(n for t, n in done if t == t1)
    transfers = n1 - n0
    if transfers <= 0:
        return
    span = t1 - t0
    print(
        f"\nSteady window ({transfers:.0f} transfers in {span:.2f} s between {lo:.0%} and {hi:.0%} of daemon a's"
        f" finished transfers, {transfers / span:.0f} transfers/s; µs per transfer in the window):"
    )
    names = ["intake", "commands", "setup", "actions", "test_lanes", "tick", "consume", "flush"]
    print(f"{'process':<10} {'busy':>7} {'busy share':>10} " + " ".join(f"{n:>11}" for n in names))
    rows = {}
    for role in sorted(series):
        ss = series[role]
        # each role's scrapes nearest the window's ends
        s0 = min(ss, key=lambda x: abs(x[0] - t0))
        s1 = min(ss, key=lambda x: abs(x[0] - t1))
        if s1[0] <= s0[0]:
            continue
        d = {k: s1[1].get(k, 0.0) - s0[1].get(k, 0.0) for k in s1[1]}
        rows[role] = d
        busy = d.get(("s", "yes"), 0.0)
        name = role.replace("daemon1", "daemon a").replace("daemon2", "daemon b")
        vals = " ".join(f"{d.get(('p', n), 0.0) * 1e6 / transfers:>11.2f}" for n in names)
        print(f"{name:<10} {busy * 1e6 / transfers:>7.1f} {busy / (s1[0] - s0[0]):>10.2f} {vals}")
    print("CPU per thread kind in the window (µs per transfer, ≥ 0.5; /proc schedstat):")
    for role, d in rows.items():
        name = role.replace("daemon1", "daemon a").replace("daemon2", "daemon b")
        cpu = sorted(((k[1], v) for k, v in d.items() if k[0] == "c"), key=lambda kv: -kv[1])
        cells = [f"{k} {v / 1e3 / transfers:.1f}" for k, v in cpu if v / 1e3 / transfers >= 0.5]
        print(f"{name:<10} cpu: " + ", ".join(cells))
    for role, d in rows.items():
        name = role.replace("daemon1", "daemon a").replace("daemon2", "daemon b")
        acts = sorted(((k[1], v) for k, v in d.items() if k[0] == "a"), key=lambda kv: -kv[1])
        cells = [f"{k} {v * 1e6 / transfers:.2f}" for k, v in acts if v * 1e6 / transfers >= 0.05]
        if cells:
            print(f"{name:<10} actions: " + ", ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
