"""Benchmark: the daemon's loop against the simulator, 10,000 ticks on a fast clock.

The simulator (``vkvagent sim serve``, healthy scenario, 4 requests/s) runs as its own process
SCALE times faster than real time. The daemon runs in this process on a clock just as fast,
with everything ``vkvagent run`` does but systemd: the HTTP scrape, the GPU recording, the
SQLite append, the engine, the state and status files (fsynced), the textfile, and the
/metrics endpoint on loopback, which a separate process scrapes every 15 simulated seconds.
``daemon.tick()`` is called at a fixed rate of one per ``sample_interval / SCALE`` real
seconds, so each tick sees ``sample_interval`` of simulated time, as in production.

Measured: the CPU time of ``tick()`` on its thread (``time.thread_time_ns``), and of the whole
process from one tick to the next (``time.process_time_ns``: adds the exporter's thread serving
the scrapes); VmRSS every WARMUP ticks (the first is the steady one); the history database's
size at the end. Run with ``make bench``; ``--ticks`` for a shorter run.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from vkvagent.adapters.history import FILE_NAME as HISTORY_FILE
from vkvagent.processes import stop_process
from vkvagent.service.daemon import Daemon
from vkvagent.tools.demo import scaled_clock, simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SCALE = 1000.0
INTERVAL = 10.0  # simulated seconds between ticks: 10 ms real at SCALE
TICKS = 10_000
WARMUP = 1_000  # RSS after these many ticks is the steady one
SCRAPE_EVERY = 15.0  # simulated seconds between two scrapes of vkvagent's /metrics
TARGET_RSS_MB = 40.0
TARGET_GROWTH_MB = 2.0
TARGET_TICK_MS = 5.0

SCRAPER = """
import signal, sys, time, urllib.request
url, period = sys.argv[1], float(sys.argv[2])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
count = 0
try:
    while True:
        with urllib.request.urlopen(url, timeout=5) as response:
            response.read()
        count += 1
        time.sleep(period)
finally:
    print(count, flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, then what it printed (one line, at exit: the pipe cannot fill before)."""
    stop_process(process)
    out, _ = process.communicate()
    return out or ""


def config_text(work: Path, sim_port: int, metrics_port: int, recording: Path) -> str:
    return f"""\
[agent]
state_dir = "{work / "state"}"
sample_interval = {INTERVAL}

[vllm]
url = "http://127.0.0.1:{sim_port}"

[gpu]
recording = "{recording}"

[metrics]
listen = "127.0.0.1:{metrics_port}"
textfile = "{work / "vkvagent.prom"}"

[policy]
mode = "observe"
"""


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def row(name: str, samples_ns: list[int]) -> str:
    ms = [s / 1e6 for s in samples_ns]
    q = statistics.quantiles(ms, n=10)
    return f"| {name} | {statistics.median(ms):.2f} | {q[0]:.2f} | {q[-1]:.2f} |"


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


@dataclass
class Run:
    ticks: int
    tick_ns: list[int] = field(default_factory=list)  # tick() on its own thread
    interval_ns: list[int] = field(default_factory=list)  # tick to tick, every thread
    rss: list[float] = field(default_factory=list)  # MiB, every WARMUP ticks
    elapsed: float = 0.0  # real seconds
    simulated: float = 0.0  # simulated seconds from the first tick to the last
    last: str = ""  # the last decision
    scrapes: str = ""
    history: int = 0  # bytes
    events: dict[str, int] = field(default_factory=dict)


def measure(ticks: int) -> Run:
    run = Run(ticks)
    with tempfile.TemporaryDirectory(prefix="vkvagent-bench-") as tmp:
        work = Path(tmp)
        sim_port, metrics_port, recording = free_port(), free_port(), work / "gpu.json"
        options = ("--time-scale", str(SCALE), "--rate", "4")
        with simulator(sim_port, recording, *options) as started:
            clock = scaled_clock(started, SCALE)
            config_path = work / "config.toml"
            config_path.write_text(config_text(work, sim_port, metrics_port, recording))
            events_path = work / "events.jsonl"
            with events_path.open("w") as log:
                daemon = Daemon.offline(config_path, log, clock)
                url = f"http://127.0.0.1:{metrics_port}/metrics"
                argv = [sys.executable, "-c", SCRAPER, url, str(SCRAPE_EVERY / SCALE)]
                scraper = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
                try:
                    loop(daemon, run)
                finally:
                    run.scrapes = stop(scraper).strip()
                    daemon.close()
            run.history = sum(
                f.stat().st_size for f in (work / "state").glob(HISTORY_FILE + "*") if f.is_file()
            )
            for line in events_path.read_text().splitlines():
                name = str(json.loads(line)["event"])
                run.events[name] = run.events.get(name, 0) + 1
    return run


def loop(daemon: Daemon, run: Run) -> None:
    """``run.ticks`` ticks at a fixed rate, as the scheduler runs them: one every
    ``INTERVAL / SCALE`` real seconds; a late tick is not made up for."""
    period = INTERVAL / SCALE
    began = next_at = time.monotonic()
    previous = time.process_time_ns()
    first = 0.0
    for i in range(run.ticks):
        start, thread = time.process_time_ns(), time.thread_time_ns()
        decision = daemon.tick()
        run.tick_ns.append(time.thread_time_ns() - thread)
        if i:
            run.interval_ns.append(start - previous)
        previous = start
        if i == 0:
            first = decision.time.timestamp()
        if (i + 1) % WARMUP == 0:
            run.rss.append(rss_mib())
        next_at = max(next_at + period, time.monotonic())
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    run.elapsed = time.monotonic() - began
    run.simulated = decision.time.timestamp() - first
    run.last = f"{decision.action}: {decision.reason}"


def report(run: Run) -> None:
    ticks, mb = run.ticks, 1e6 / 2**20  # MiB per MB
    steady, final = run.rss[0], run.rss[-1]
    growth = final - steady
    median_tick = statistics.median(run.tick_ns[WARMUP:]) / 1e6
    print(
        f"{ticks} ticks, sample_interval {INTERVAL:g} s at {SCALE:g}x: {run.elapsed:.0f} s real, "
        f"{run.simulated / 3600:.1f} h simulated ({run.simulated / (ticks - 1):.1f} s per "
        f"tick); Python {sys.version.split()[0]}; last decision: {run.last}"
    )
    print(
        f"/metrics scraped {run.scrapes} times; events: "
        + ", ".join(f"{k} x{n}" for k, n in sorted(run.events.items()))
    )
    print(f"RSS every {WARMUP} ticks (MiB): " + " ".join(f"{r:.1f}" for r in run.rss))
    blocks = [run.tick_ns[i : i + WARMUP] for i in range(0, ticks, WARMUP)]
    print(
        f"tick() CPU median per {WARMUP} ticks (ms): "
        + " ".join(f"{statistics.median(b) / 1e6:.2f}" for b in blocks)
    )
    print()
    print("| CPU time (ms) | median | p10 | p90 |")
    print("|---|---|---|---|")
    print(row(f"tick(), ticks 1-{WARMUP}", run.tick_ns[:WARMUP]))
    print(row(f"tick(), ticks {WARMUP + 1}-{ticks}", run.tick_ns[WARMUP:]))
    print(row(f"per interval, all threads, ticks {WARMUP + 1}-{ticks}", run.interval_ns[WARMUP:]))
    print()
    print("| figure | value | target | |")
    print("|---|---|---|---|")
    print(
        f"| tick() CPU, median after {WARMUP} ticks | {median_tick:.2f} ms "
        f"| <= {TARGET_TICK_MS:g} ms | {verdict(median_tick <= TARGET_TICK_MS)} |"
    )
    print(
        f"| RSS after {WARMUP} ticks (steady) | {steady:.1f} MiB ({steady / mb:.1f} MB) "
        f"| <= {TARGET_RSS_MB:g} MB | {verdict(steady <= TARGET_RSS_MB * mb)} |"
    )
    print(
        f"| RSS after {ticks} ticks | {final:.1f} MiB ({final / mb:.1f} MB) "
        f"| <= {TARGET_RSS_MB:g} MB | {verdict(final <= TARGET_RSS_MB * mb)} |"
    )
    print(
        f"| RSS growth | {growth:+.2f} MiB ({growth / mb:+.2f} MB) | <= {TARGET_GROWTH_MB:g} MB "
        f"| {verdict(growth <= TARGET_GROWTH_MB * mb)} |"
    )
    print(
        f"| history database at the end | {run.history / 2**20:.2f} MiB "
        f"({run.history / ticks:.0f} bytes/sample) | | |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ticks", type=int, default=TICKS, help=f"default {TICKS}")
    ticks = parser.parse_args().ticks
    if ticks < 2 * WARMUP:
        parser.error(f"--ticks must be at least {2 * WARMUP}")
    report(measure(ticks))


if __name__ == "__main__":
    main()
