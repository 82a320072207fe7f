"""``vkvagent demo``: the simulator and the real agent loop, on a fast clock, in one terminal.

The simulator (``vkvagent sim serve``, a subprocess) runs the uptime-decline scenario ``scale``
times faster than real time; the daemon (in this process, observe mode, no systemd) runs on a
clock anchored at the simulator's start and just as fast, so both agree on the uptime. A restart
window opens a few simulated hours in. The view prints a line whenever the verdict changes and
ends by itself once the agent has diagnosed the decline and decided to restart (or after
``limit`` real seconds), with a short summary. No root, GPU or systemd needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TextIO

from vkvagent.engine import Decision
from vkvagent.errors import VkvagentError
from vkvagent.knowledge import status
from vkvagent.processes import stop_process
from vkvagent.service.daemon import Clock, Daemon

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class DemoError(VkvagentError):
    """The demo could not run (the simulator did not start); one line."""


@dataclass
class Seen:
    """What the view noticed, for the summary."""

    lines: list[str] = field(default_factory=list)
    healthy_at: float | None = None  # simulated uptime of the first healthy verdict
    degraded_at: float | None = None
    cause: str | None = None
    decided_at: float | None = None
    decision: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def simulator(port: int, recording: Path, *options: str) -> Iterator[float]:
    """Run ``vkvagent sim serve`` on 127.0.0.1:``port`` with simulator ``options`` (scenario,
    time scale, workload...), GPU readings kept in ``recording``; yields its process start
    time (Unix seconds) once it answers. Shared by the demo, the daemon benchmark and the
    soak, whose clocks all start there."""
    argv = [
        sys.executable, "-m", "vkvagent", "sim", "serve", MODEL, "--port", str(port),
        "--host", "127.0.0.1", "--cold-start", "0", "--seed", "7",
        "--gpu-recording", str(recording), *options,
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield _wait_started(process, f"http://127.0.0.1:{port}", recording)
    finally:
        stop_process(process)


def _wait_started(process: subprocess.Popen[str], url: str, recording: Path) -> float:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = process.stderr.read().strip() if process.stderr else ""
            raise DemoError(f"the simulator exited {process.returncode}: {error}")
        started = _process_start(url) if recording.exists() else None
        if started is not None:
            return started
        time.sleep(0.1)
    raise DemoError("the simulator did not answer within 20 s")


def _process_start(url: str) -> float | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=1) as response:
            page = response.read().decode()
    except (OSError, ValueError):
        return None
    for line in page.splitlines():
        if line.startswith("process_start_time_seconds"):
            return float(line.split()[-1])
    return None


def scaled_clock(anchor: float, scale: float) -> Clock:
    """Wall and monotonic clocks that run ``scale`` times fast from ``anchor`` (Unix time)."""
    real_wall, real_mono = time.time(), time.monotonic()
    virtual_now = anchor + (real_wall - anchor) * scale

    def wall() -> float:
        return virtual_now + (time.monotonic() - real_mono) * scale

    def mono() -> float:
        return (time.monotonic() - real_mono) * scale

    return Clock(wall=wall, mono=mono, scale=scale)


def config_text(state_dir: Path, port: int, recording: Path, window_start: datetime) -> str:
    start = window_start.strftime("%H:%M")
    end = (window_start + timedelta(hours=4)).strftime("%H:%M")
    return f"""\
[agent]
state_dir = "{state_dir}"
sample_interval = 20.0

[vllm]
url = "http://127.0.0.1:{port}"

[gpu]
recording = "{recording}"

[metrics]
listen = ""

[policy]
mode = "observe"
windows = ["daily {start}-{end}"]
"""


def run(out: TextIO, *, scale: float = 400.0, limit: float = 150.0) -> int:
    """The demo; returns 0 once a restart was decided, 1 if ``limit`` passed first."""
    with tempfile.TemporaryDirectory(prefix="vkvagent-demo-") as tmp:
        work = Path(tmp)
        port, recording = _free_port(), work / "gpu.json"
        out.write(
            f"vkvagent demo: a simulated vLLM ({MODEL}) whose decode speed falls 10 % per hour "
            f"after its first hour of uptime, {scale:g}x faster than real time; the agent in "
            "observe mode (it decides, never acts).\n"
        )
        out.flush()
        options = ("--scenario", "uptime-decline", "--time-scale", str(scale), "--rate", "4")
        with simulator(port, recording, *options) as started:
            clock = scaled_clock(started, scale)
            window = datetime.fromtimestamp(started, timezone.utc) + timedelta(hours=2)
            window = window.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
            config_path = work / "config.toml"
            config_path.write_text(config_text(work / "state", port, recording, window))
            events = work / "events.jsonl"
            with events.open("w") as log:
                daemon = Daemon.offline(config_path, log, clock)
                seen = Seen()
                viewer = threading.Thread(
                    target=_view, args=(daemon, seen, out, started, limit), daemon=True
                )
                viewer.start()
                daemon.run()
                viewer.join(timeout=5)
            _summary(seen, out, work, events)
            return 0 if seen.decided_at is not None else 1


def _view(daemon: Daemon, seen: Seen, out: TextIO, started: float, limit: float) -> None:
    """Print a line at each change of verdict; stop the daemon once a restart is decided."""
    deadline = time.monotonic() + limit
    shown: tuple[str, str | None] | None = None
    decided_ticks = 0
    while time.monotonic() < deadline and not daemon.stopping.is_set():
        time.sleep(0.25)
        decision: Decision | None = daemon.last
        report = status.read(daemon.parts.state_dir)
        if decision is None or report is None:
            continue
        uptime = decision.time.timestamp() - started
        state = report.verdict.state
        key = (state, decision.reason.split(":", 1)[0])
        if key != shown:
            shown = key
            ratio = "-" if decision.ratio is None else f"{decision.ratio:.2f}"
            tokens = report.now.tokens_per_s
            line = (
                f"  uptime {uptime / 3600:4.1f} h  {state:9} speed/baseline {ratio:>5}  "
                f"{'-' if tokens is None else f'{tokens:,.0f}'} tokens/s  {decision.action}: "
                f"{decision.reason}"
            )
            out.write(_fit(line) + "\n")
            out.flush()
            seen.lines.append(line)
        if state == "healthy" and decision.ratio is not None and seen.healthy_at is None:
            seen.healthy_at = uptime
        if decision.cause and decision.cause != "engine_down" and seen.degraded_at is None:
            seen.degraded_at, seen.cause = uptime, decision.cause
        if "would restart" in decision.reason or decision.action == "restart":
            if seen.decided_at is None:
                seen.decided_at, seen.decision = uptime, decision.reason
            decided_ticks += 1
            if decided_ticks >= 3:
                break
    daemon.stop()


def _fit(line: str) -> str:
    width = os.get_terminal_size().columns if sys.stdout.isatty() else 160
    return line if len(line) <= width else line[: width - 1] + "…"


def _summary(seen: Seen, out: TextIO, work: Path, events: Path) -> None:
    def at(uptime: float | None) -> str:
        return "never" if uptime is None else f"at {uptime / 3600:.1f} h of uptime"

    kinds: dict[str, int] = {}
    for line in events.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            name = json.loads(line)["event"]
            kinds[name] = kinds.get(name, 0) + 1
    out.write(
        "summary:\n"
        f"  baseline learned and healthy {at(seen.healthy_at)}\n"
        f"  degradation diagnosed {at(seen.degraded_at)}: {seen.cause or '-'}\n"
        f"  restart decided {at(seen.decided_at)}: {seen.decision or '-'}\n"
        f"  journal events: {', '.join(f'{k} x{n}' for k, n in sorted(kinds.items()))}\n"
        '  In production, vkvagent.service runs this loop with mode = "enforce" and restarts '
        "vllm.service through systemd.\n"
    )
    del work
