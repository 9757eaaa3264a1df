"""The picture of deploy/grafana/tcpxd-dashboard.json in docs/OPERATIONS.md, from real data.

Grafana is not packaged in Debian and not reachable from the machine this was made on, so this
renders the dashboard's own panels itself: `collect` runs two daemons on the emulation with a
client workload (writes and reads of 4 KiB to 64 MiB both ways, transfers with too short a
deadline, b killed with SIGKILL and started again on the same addresses, its buffers registered
again), has Debian's `prometheus` scrape both every 2 s, and saves what the dashboard's queries
return over the run (Prometheus's query_range API, `$__rate_interval` = 10 s, every instance and
peer); `plot` draws each panel from that file with matplotlib.

    python3 tools/dashboard/demo_picture.py collect OUT.json   # the venv with tcpxd; prometheus on PATH
    python3 tools/dashboard/demo_picture.py plot OUT.json docs/dashboard-demo.png   # matplotlib
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/tcpxd-dashboard.json"
SCRAPE_S = 2
RATE_WINDOW = "10s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def queries() -> list:
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        targets = []
        for t in p["targets"]:
            expr = (t["expr"].replace("$__rate_interval", RATE_WINDOW)
                    .replace("$instance", ".*").replace("$peer", ".*"))
            targets.append({"expr": expr, "legend": t.get("legendFormat", ""), "ref": t["refId"]})
        overrides = {o["matcher"]["options"]: {pr["id"]: pr["value"] for pr in o["properties"]}
                     for o in p["fieldConfig"].get("overrides", [])}
        out.append({"title": p["title"], "unit": p["fieldConfig"]["defaults"].get("unit", "short"),
                    "overrides": overrides, "targets": targets})
    return out


class Daemon:
    def __init__(self, tcpxd: str, tmp: Path, name: str, peer_port: int, metrics_port: int) -> None:
        self.args = [tcpxd, "--node-id", name, "--builtin-emulation", "--api-socket", str(tmp / f"{name}.sock"),
                     "--peer-listen", f"127.0.0.1:{peer_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}"]
        self.endpoint = f"unix:{tmp / (name + '.sock')}"
        self.log = tmp / f"{name}.log"
        self.proc: subprocess.Popen = self.start()

    def start(self) -> subprocess.Popen:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"),
                                     env={**os.environ, "RUST_LOG": "warn"})
        subprocess.run([str(Path(self.args[0]).parent / "tcpxctl"), "--endpoint", self.endpoint,
                        "health", "--wait", "30"], check=True, stdout=subprocess.DEVNULL)
        return self.proc


def collect(out: Path) -> None:
    import tcpxd

    tcpxd_bin = os.environ.get("TCPXD_BIN") or str(max(
        (p for p in (ROOT / "target/debug/tcpxd", ROOT / "target/release/tcpxd") if p.exists()),
        key=lambda p: p.stat().st_mtime))
    tmp = Path(tempfile.mkdtemp(prefix="tcpxd-dash-"))
    ports = {n: (free_port(), free_port()) for n in "ab"}
    prom_port = free_port()
    (tmp / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {SCRAPE_S}s, evaluation_interval: {SCRAPE_S}s}}\n"
        "scrape_configs:\n  - job_name: tcpxd\n    static_configs:\n"
        + "".join(f"      - targets: ['127.0.0.1:{ports[n][1]}']\n        labels: {{instance: {n}}}\n" for n in "ab"))
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "wb"))
    daemons = {n: Daemon(tcpxd_bin, tmp, n, *ports[n]) for n in "ab"}
    start = time.time()
    events = []
    try:
        ca = tcpxd.Client(daemons["a"].endpoint)
        cb = tcpxd.Client(daemons["b"].endpoint)
        src = ca.register_host(64 << 20, label="src", shared=False)
        back = ca.register_host(64 << 20, label="back", shared=False)
        src.fill(seed=1)

        def b_buffers(cb):
            dst = cb.register_host(64 << 20, label="dst", shared=False)
            bsrc = cb.register_host(16 << 20, label="bsrc", shared=False)
            bsrc.fill(seed=2)
            return dst, bsrc

        dst, bsrc = b_buffers(cb)
        sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
        i = 0
        killed = restarted = deadlines = False
        while time.time() - start < 170:
            t = time.time() - start
            if t > 45 and not deadlines:
                deadlines = True
                events.append((t, "5 writes of 64 MiB with a 1 ms deadline"))
                for _ in range(5):
                    try:
                        ca.write(src, dst.descriptor, 64 << 20, timeout=0.001)
                    except tcpxd.TcpxdError:
                        pass
            if t > 80 and not killed:
                killed = True
                events.append((t, "b killed (SIGKILL)"))
                daemons["b"].proc.kill()
                daemons["b"].proc.wait()
            if t > 95 and not restarted:
                restarted = True
                daemons["b"].start()
                events.append((time.time() - start, "b started again; its buffers registered again"))
                cb.close()
                cb = tcpxd.Client(daemons["b"].endpoint)
                dst, bsrc = b_buffers(cb)
            n = sizes[i % len(sizes)]
            i += 1
            try:
                ca.write(src, dst.descriptor, n, timeout=30)
                if i % 3 == 0:
                    ca.read(dst.descriptor, back, min(n, 16 << 20), timeout=30)
                if i % 4 == 0 and restarted == killed:
                    cb.write(bsrc, back.descriptor, 1 << 20, timeout=30)
            except tcpxd.TcpxdError:
                time.sleep(0.2)  # b is down: a's writes fail until it is back
            time.sleep(0.05 if t < 120 else 0.3)  # a quieter last phase
        end = time.time()
        time.sleep(2 * SCRAPE_S)
        base = f"http://127.0.0.1:{prom_port}/api/v1/query_range"
        panels = []
        for q in queries():
            for tgt in q["targets"]:
                url = base + "?" + urllib.parse.urlencode(
                    {"query": tgt["expr"], "start": start, "end": end, "step": SCRAPE_S})
                with urllib.request.urlopen(url, timeout=30) as r:
                    body = json.load(r)
                assert body["status"] == "success", body
                tgt["result"] = body["data"]["result"]
            panels.append(q)
        out.write_text(json.dumps({"start": start, "end": end, "events": events, "panels": panels,
                                   "tcpxd": tcpxd_bin, "scrape_s": SCRAPE_S, "rate_window": RATE_WINDOW}))
        print(f"{len(panels)} panels, {i} rounds, events {events}")
    finally:
        for d in daemons.values():
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                d.proc.wait(30)
        prom.send_signal(signal.SIGTERM)
        prom.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


UNITS = {"Bps": (1e6, "MB/s"), "s": (1e-3, "ms"), "bytes": (2 ** 30, "GiB"), "ops": (1, "per s"), "short": (1, "")}


def legend(fmt: str, metric: dict) -> str:
    out = fmt
    for k, v in metric.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def plot(data_path: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(data_path.read_text())
    panels = data["panels"]
    cols = 4
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows))
    t0 = data["start"]
    for ax, p in zip(axes.flat, panels):
        right = None
        for tgt in p["targets"]:
            override = p["overrides"].get(tgt["ref"], {})
            unit = override.get("unit", p["unit"])
            scale, label = UNITS.get(unit, (1, unit))
            on = ax
            if override.get("custom.axisPlacement") == "right":  # as Grafana: its own axis
                right = right or ax.twinx()
                on = right
                right.tick_params(labelsize=7)
            for series in tgt["result"]:
                xs = [float(v[0]) - t0 for v in series["values"]]
                ys = [float(v[1]) / scale for v in series["values"]]
                if not any(ys):
                    continue  # zero throughout (e.g. the statuses no transfer ended with): left out
                name = f"{legend(tgt['legend'], series['metric'])} [{label}]".replace(" []", "")
                on.plot(xs, ys, linewidth=1.2, linestyle="--" if on is right else "-",
                        label=name + (" (right axis)" if on is right else ""))
        for t, _ in data["events"]:
            ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=7)
        handles, labels = ax.get_legend_handles_labels()
        if right is not None:
            h2, l2 = right.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        if handles:
            ax.legend(handles, labels, fontsize=6, loc="upper left", ncol=2 if len(handles) > 6 else 1)
        else:
            ax.text(0.5, 0.5, "no data (or only zeros) in this run", ha="center", va="center", transform=ax.transAxes, fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    events = "; ".join(f"{t:.0f} s: {e}" for t, e in data["events"])
    fig.suptitle("deploy/grafana/tcpxd-dashboard.json's panels over a demo run: two tcpxd daemons (debug build, "
                 "built-in emulation) on a 2-core VM, scraped by Prometheus every "
                 f"{data['scrape_s']} s, rates over {data['rate_window']}, plotted with matplotlib (not Grafana)\n"
                 f"dotted lines: {events}; series at zero throughout are left out", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(png, dpi=72)
    print(f"wrote {png} ({png.stat().st_size} bytes)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "collect":
        collect(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "plot":
        plot(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(__doc__)
