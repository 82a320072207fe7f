"""The soak: a week of ``vkvagent run`` against the simulator serving the ServeGen week, on a
fast clock, in this process (as bench/daemon.py runs it), then the same week replayed.

The simulator (``vkvagent sim serve --workload servegen --rate PEAK --time-scale SCALE``) runs
as its own process, set to render a fresh page for every scrape (its 50 ms render cache would
otherwise hold a page for minutes of simulated time at this speed). The daemon (``Daemon``,
observe mode, no systemd) ticks at a fixed rate on ``demo.scaled_clock``, with everything else
``vkvagent run`` does: the scrape, the GPU recording, the SQLite history (with a short
``[history] retention_days``, so pruning runs all week), the engine, engine.json, status.json,
the textfile and the /metrics endpoint, which this process scrapes now and then.

Measured every few simulated hours: VmRSS, open file descriptors (/proc/self/fd), threads
(``threading.active_count()``), the history's files and rows. Flat means: after the first
simulated day, RSS grows by at most 2 MiB (bench/README.md's target for the daemon), the
descriptors and threads come back to the same count, and the history stays within its
retention (rows and bytes stop growing once pruning has begun).

Nothing lost: every tick's sample reached the history. The samples are copied out to an
archive (another ``History``) after every tick, before retention could prune them, and
each tick's decision is written to a file. At the end ``replay.replay`` runs the engine over
the archived samples; its decision at every timestamp (action, cause, the reason's head, the
vLLM run, the speed ratio) must equal the daemon's: the daemon's decisions are a deterministic
function of what it recorded, and ``vkvagent replay`` reproduces them.
"""

from __future__ import annotations

import io
import json
import math
import os
import socket
import sqlite3
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from reliability.report import Row
from vkvagent.adapters.history import FILE_NAME as HISTORY_FILE
from vkvagent.adapters.history import History
from vkvagent.engine.diagnosis import FIXABLE
from vkvagent.engine.samples import Sample
from vkvagent.knowledge import config
from vkvagent.service.daemon import Daemon
from vkvagent.tools import replay, timeline
from vkvagent.tools.demo import scaled_clock, simulator

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DAY = 86400.0
RSS_GROWTH_MIB = 2.0
SCRAPE_EVERY = 3600.0  # simulated seconds between scrapes of the daemon's own /metrics


@dataclass
class Point:
    tick: int
    day: float  # simulated days since the first tick
    rss_kib: int
    fds: int
    threads: int
    history_bytes: int
    rows: int


@dataclass
class Soak:
    days: float
    interval: float
    scale: float
    retention_days: float
    peak: float
    ticks: int = 0
    late: int = 0  # ticks that began later than their slot
    points: list[Point] = field(default_factory=list)
    archived: int = 0
    scrapes: int = 0
    events: dict[str, int] = field(default_factory=dict)
    elapsed: float = 0.0
    simulated: float = 0.0
    mismatches: list[str] = field(default_factory=list)
    compared: int = 0
    changes: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)  # "action/cause" -> ticks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_text(work: Path, soak: Soak, sim_port: int, metrics_port: int, recording: Path) -> str:
    return f"""\
[agent]
state_dir = "{work / "state"}"
sample_interval = {soak.interval}

[vllm]
url = "http://127.0.0.1:{sim_port}"

[gpu]
recording = "{recording}"

[history]
retention_days = {soak.retention_days}

[metrics]
listen = "127.0.0.1:{metrics_port}"
textfile = "{work / "vkvagent.prom"}"
"""


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def history_size(state: Path) -> tuple[int, int]:
    """Bytes of the history's files (database, WAL, shared memory) and its rows."""
    size = sum(f.stat().st_size for f in state.glob(HISTORY_FILE + "*") if f.is_file())
    db = sqlite3.connect(f"file:{state / HISTORY_FILE}?mode=ro", uri=True)
    try:
        rows = int(db.execute("SELECT count(*) FROM samples").fetchone()[0])
    finally:
        db.close()
    return size, rows


def measure(soak: Soak, state: Path, first: float, now: float) -> None:
    size, rows = history_size(state)
    fds = len(os.listdir("/proc/self/fd"))
    point = Point(
        soak.ticks, (now - first) / DAY, rss_kib(), fds, threading.active_count(), size, rows
    )
    soak.points.append(point)


def archive(daemon: Daemon, into: History, last: float) -> tuple[float, int]:
    """Copy the samples the daemon stored after ``last`` into ``into``."""
    copied = 0
    for sample in daemon.parts.history.samples(since=last):
        if sample.time > last:
            into.append(sample)
            last = sample.time
            copied += 1
    return last, copied


def run_soak(soak: Soak, work: Path) -> None:
    sim_port, metrics_port, recording = free_port(), free_port(), work / "gpu.json"
    (work / "archive").mkdir()
    # A new page for every scrape: at this speed the 50 ms render cache would serve one page
    # for two simulated minutes, long enough to look like a stalled engine.
    options = (
        "--time-scale", str(soak.scale), "--workload", "servegen", "--rate", str(soak.peak),
        "--render-interval", "0",
    )  # fmt: skip
    with simulator(sim_port, recording, *options) as started:
        clock = scaled_clock(started, soak.scale)
        cfg = work / "config.toml"
        cfg.write_text(config_text(work, soak, sim_port, metrics_port, recording))
        cfg.chmod(0o644)
        events_path, decisions_path = work / "events.jsonl", work / "decisions.jsonl"
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with (
            events_path.open("w") as log,
            decisions_path.open("w") as decisions,
            History(work / "archive") as kept,
        ):
            daemon = Daemon.offline(cfg, log, clock)
            try:
                loop(soak, daemon, kept, decisions, url, work / "state")
            finally:
                daemon.close()
        for line in events_path.read_text().splitlines():
            name = str(json.loads(line)["event"])
            soak.events[name] = soak.events.get(name, 0) + 1
    compare(soak, work, cfg, decisions_path)


def loop(
    soak: Soak, daemon: Daemon, kept: History, decisions: io.TextIOBase, url: str, state: Path
) -> None:
    period = soak.interval / soak.scale
    every = max(1, round(6 * 3600 / soak.interval))
    began = next_at = time.monotonic()
    first = last_archived = -math.inf
    end = scrape_at = math.inf
    while True:
        decision = daemon.tick()
        at = decision.time.timestamp()
        if soak.ticks == 0:
            first, end = at, at + soak.days * DAY
            scrape_at = at + SCRAPE_EVERY
        soak.ticks += 1
        action, cause, head, run = decision.key()
        decisions.write(json.dumps([at, action, cause, head, run, decision.ratio]) + "\n")
        # Every tick, so the daemon's pruning never reaches a sample not yet copied: on a busy
        # host one late tick can span more simulated time than the retention (2 s of real time
        # here is 1.3 simulated hours), and copies made every so many ticks, or every hour,
        # then lost samples.
        last_archived, copied = archive(daemon, kept, last_archived)
        soak.archived += copied
        if at >= scrape_at:
            scrape_at = at + SCRAPE_EVERY
            with urllib.request.urlopen(url, timeout=5) as answer:  # the endpoint, scraped
                answer.read()
            soak.scrapes += 1
        if soak.ticks % every == 1:
            measure(soak, state, first, at)
        if at >= end:
            break
        next_at += period
        now = time.monotonic()
        if next_at > now:
            time.sleep(next_at - now)
        else:
            soak.late += 1
            next_at = now
    measure(soak, state, first, at)
    soak.elapsed = time.monotonic() - began
    soak.simulated = at - first


class Recorded:
    """The archived samples as ``replay.replay`` reads a timeline: (sample, unit memory),
    oldest first, read in chunks (a week of samples does not fit in memory as objects)."""

    def __init__(self, history: History, step: float) -> None:
        self.history, self.step = history, step

    def samples(self) -> Iterator[tuple[Sample, float | None]]:
        last = -math.inf
        while True:
            chunk = [s for s in self.history.samples(since=last, limit=2000) if s.time > last]
            if not chunk:
                return
            for sample in chunk:
                yield sample, (sample.unit.memory_bytes if sample.unit else None)
            last = chunk[-1].time


def compare(soak: Soak, work: Path, cfg: Path, decisions_path: Path) -> None:
    """Replay the archive and compare with the daemon's decisions, timestamp by timestamp."""
    settings = config.load(cfg).engine_settings()
    with History(work / "archive", readonly=True) as kept:
        line = cast(timeline.Timeline, Recorded(kept, soak.interval))  # step and samples() only
        result = replay.replay(settings, line, trace=True)
    trace = result.trace
    assert trace is not None
    ours: list[tuple[Any, ...]] = []
    previous: tuple[Any, ...] | None = None
    with decisions_path.open() as lines:
        for index, text in enumerate(lines):
            at, action, cause, head, run, ratio = json.loads(text)
            soak.compared += 1
            verdict = f"{action}/{cause or '-'}: {head}"
            soak.verdicts[verdict] = soak.verdicts.get(verdict, 0) + 1
            if index >= len(trace.times):
                soak.mismatches.append(f"tick {index}: the replay has no evaluation")
                break
            theirs = (trace.times[index], trace.causes[index], _number(trace.ratio[index]))
            if (at, cause, ratio) != theirs:
                mine = (at, cause, ratio)
                soak.mismatches.append(f"tick {index}: daemon {mine}, replay {theirs}")
            key = (action, cause, head, run)
            if key != previous or action == "restart":
                ours.append((at, *key))
            previous = key
    if len(trace.times) != soak.compared:
        soak.mismatches.append(f"{soak.compared} ticks, {len(trace.times)} replayed samples")
    replayed = [(d.time.timestamp(), *d.key()) for d in result.decisions]
    if replayed and ours and replayed[-1][0] != ours[-1][0]:
        replayed = replayed[:-1]  # replay adds the last evaluation when it is not a change
    soak.changes = len(ours)
    for index, (mine, theirs) in enumerate(zip(ours, replayed)):
        if mine != theirs:
            soak.mismatches.append(f"change {index}: daemon {mine}, replay {theirs}")
            break
    if len(ours) != len(replayed):
        soak.mismatches.append(f"{len(ours)} decision changes, replay has {len(replayed)}")


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def judge(soak: Soak, row: Row) -> None:
    """The checks, into ``row``."""
    expected = int(soak.days * DAY / soak.interval)
    row.check(
        soak.simulated >= soak.days * DAY * 0.999, f"only {soak.simulated / DAY:.2f} simulated days"
    )
    row.lost += max(0, soak.ticks - soak.archived)
    row.check(soak.archived == soak.ticks, f"{soak.ticks} ticks, {soak.archived} samples stored")
    failed = soak.events.get("state.write_failed", 0)
    row.check(failed == 0, f"{failed} state.write_failed events")
    steady = [p for p in soak.points if p.day >= 1.0] or soak.points[-1:]
    base = steady[0]
    growth = (max(p.rss_kib for p in steady) - base.rss_kib) / 1024
    row.check(growth <= RSS_GROWTH_MIB, f"RSS grew {growth:.2f} MiB after the first day")
    fds = [p.fds for p in steady]
    threads = [p.threads for p in steady]
    row.check(max(fds) - min(fds) <= 2 and fds[-1] <= fds[0] + 1, f"file descriptors {fds}")
    row.check(max(threads) == min(threads), f"threads {threads}")
    keep = soak.retention_days * DAY / soak.interval
    slack = 3600 / soak.interval + 2  # pruned once an hour
    row.check(
        max(p.rows for p in soak.points) <= keep + slack,
        f"history rows up to {max(p.rows for p in soak.points)}, retention keeps "
        f"{keep:.0f} (+{slack:.0f})",
    )
    pruned = [p for p in soak.points if p.day >= soak.retention_days + 1.0]
    if pruned:
        top = max(p.history_bytes for p in pruned)
        first = pruned[0].history_bytes
        row.check(top <= 1.25 * first + (1 << 20), f"history grew from {first} to {top} bytes")
    wrong = {v: n for v, n in soak.verdicts.items() if v.split(":")[0].split("/")[1] in FIXABLE}
    row.check(not wrong, f"a restart-fixable cause on a healthy server: {wrong}")
    if soak.mismatches:
        row.fail(f"replay differs from the daemon: {soak.mismatches[0]}")
        row.failures.extend(soak.mismatches[1:3])
    row.trials = 1
    row.faults = 0
    row.notes.append(
        f"{soak.simulated / DAY:.2f} simulated days in {soak.elapsed:.0f} s ({soak.scale:g}x), "
        f"{soak.ticks} ticks every {soak.interval:g} s (expected {expected}; {soak.late} late), "
        f"ServeGen week at peak {soak.peak:g} req/s, retention {soak.retention_days:g} d"
    )
    row.notes.append(
        f"RSS {base.rss_kib / 1024:.1f} MiB after day 1, {steady[-1].rss_kib / 1024:.1f} MiB at "
        f"the end (max growth {growth:+.2f} MiB); fds {min(fds)}-{max(fds)}; threads "
        f"{min(threads)}-{max(threads)}; history {soak.points[-1].rows} rows, "
        f"{max(p.history_bytes for p in soak.points) / 2**20:.1f} MiB at most"
    )
    row.notes.append(
        "RSS (MiB) every 6 simulated hours: "
        + " ".join(f"{p.rss_kib / 1024:.1f}" for p in soak.points)
    )
    row.notes.append(
        f"determinism: {soak.compared} ticks and {soak.changes} decision changes compared with "
        f"replay.replay over the archived samples: {len(soak.mismatches)} differences; events: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(soak.events.items()))
    )
    row.notes.append(
        "ticks by action/cause: reason: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(soak.verdicts.items(), key=lambda kv: -kv[1]))
    )


def run(days: float, interval: float, scale: float, retention_days: float, peak: float) -> Row:
    row = Row(f"soak: {days:g} simulated days, ServeGen week")
    started = time.monotonic()
    soak = Soak(days, interval, scale, retention_days, peak)
    try:
        with tempfile.TemporaryDirectory(prefix="vkv-soak.") as tmp:
            run_soak(soak, Path(tmp))
        judge(soak, row)
    except Exception as exc:
        row.fail(f"{type(exc).__name__}: {exc}")
    row.seconds = time.monotonic() - started
    return row
