"""Faults other than ``kill -9``: each class is a function returning a ``Row``.

Against a real systemd (tests/sandbox.py), with ``vkvagent run`` as vkvagent.service next to
the simulator as vllm.service, in enforce mode with every window open and no interval or
cooldown, so that any wrong restart would happen at once:

- ``crash_loop``: vLLM's engine dies every few seconds and ``Restart=always`` starts it
  again. vkvagent sees ``engine_down`` and adds no restart of its own: systemd's journal counts
  exactly 1 + NRestarts starts, and the ledger has no restart.
- ``dbus``: D-Bus unavailable (the agent's bus address names no socket), then access denied
  (the agent runs as an unprivileged user), while vLLM stalls and a restart is wanted. Every
  attempt is refused with a one-line ``restart.failed``, vLLM is never restarted, the ledger
  has only aborted actions, the agent keeps running (its watchdog fed). Once the bus is back,
  the next attempt restarts vLLM, once.
- ``state_full``: a small tmpfs mounted over the state directory, filled while the agent runs:
  ``state.write_failed``, ``vkvagent status`` still answers, the agent keeps ticking; space
  freed: ``state.write_recovered``, a fresh status, and every sample committed before the fill
  still there. Then the agent is started on a full disk: it comes back by itself once space
  returns.

In this process:

- ``clock_jumps``: the daemon (``Daemon`` with an injected ``Clock``) against the simulator,
  in enforce mode; the wall clock jumps forwards and back by an hour to a year while the
  monotonic clock runs on. No restart is decided, no restart-fixable cause is diagnosed.
- ``metrics_endpoint``: ``/metrics`` that never answers, stalls mid-body, trickles its headers
  or body forever, is huge (declared, streamed or a gzip bomb), with random timeouts and
  limits: every scrape fails in one line within connect_timeout + read_timeout, and memory
  stays bounded. Then ``daemon.tick()`` against a trickling vLLM: bounded the same way.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import socket
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from reliability.report import Row, need_sandbox
from tests.httpserver import RawServer, read_request
from tests.sandbox import PROJECT, Sandbox, exec_line, reach_python, sim_unit
from tests.simproc import SimProcess, get
from tests.test_actuator import actions, restarts_requested
from vkvagent.adapters.history import History
from vkvagent.adapters.vllm import ScrapeError, VllmClient
from vkvagent.engine.diagnosis import FIXABLE
from vkvagent.service.daemon import Clock, Daemon
from vkvagent.tools.demo import scaled_clock

VLLM = "vllm.service"
AGENT = "vkvagent.service"
# Not /etc/vkvagent and /var/lib/vkvagent: see reliability/kill.py.
CONFIG_DIR = "/etc/vkvagent-reliability"
STATE_DIR = "/var/lib/vkvagent-reliability"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NO_BUS = "unix:path=/run/no-such-bus/system_bus_socket"

EAGER = """\
[policy]
mode = "enforce"
windows = ["daily 00:00-24:00"]
min_interval = 0
cooldown = 0
max_per_day = 1000
"""


def agent_config(policy: str = EAGER) -> str:
    return f"""\
[agent]
state_dir = "{STATE_DIR}"
sample_interval = 1.0
[vllm]
url = "http://127.0.0.1:8000"
connect_timeout = 1.0
read_timeout = 3.0
[gpu]
enabled = false
[metrics]
listen = ""
[restart]
ready_timeout = 30
job_timeout = 30
drain_timeout = 2
drain_max_in_flight = 100000
graceful_shutdown = false
[diagnosis]
stall_after = 10
{policy}"""


def agent_unit(*, user: str = "", environment: Mapping[str, str] | None = None) -> str:
    """vkvagent.service as tests/test_daemon_systemd.py has it, with this module's paths."""
    run = exec_line([sys.executable, "-m", "vkvagent", "run", "--config", CONFIG_DIR])
    lines = [
        "[Unit]", "Description=vkvagent (reliability)", "After=vllm.service",
        "[Service]", "Type=notify", "NotifyAccess=main", "WatchdogSec=15", "TimeoutAbortSec=3",
        "Restart=on-failure", "RestartSec=2", f"ExecStart={run}",
        f"Environment=PYTHONDONTWRITEBYTECODE=1 PYTHONPATH={PROJECT}",
    ]  # fmt: skip
    lines += [f"Environment={key}={value}" for key, value in (environment or {}).items()]
    if user:
        lines.append(f"User={user}")
    return "\n".join([*lines, "[Install]", "WantedBy=multi-user.target", ""])


@contextlib.contextmanager
def agent_box(vllm: str, config: str, agent: str = "", *, ready: bool = True) -> Iterator[Sandbox]:
    """A container running ``vllm`` as vllm.service, with vkvagent.service installed (not
    started) and its config written."""
    need_sandbox()
    with Sandbox(units={VLLM: vllm, AGENT: agent or agent_unit()}, enable=[VLLM]) as box:
        directory = box.root / CONFIG_DIR.lstrip("/")
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        directory.chmod(0o755)
        (directory / "config.toml").write_text(config)
        (directory / "config.toml").chmod(0o644)
        if ready:
            box.wait_http(timeout=30)
        yield box


def events(box: Sandbox, name: str) -> list[dict[str, Any]]:
    done = box.run("journalctl", "-o", "json", "--no-pager", f"VKV_EVENT={name}")
    return [json.loads(line) for line in done.stdout.split("\n") if line.strip()]


def wait_for(check: Callable[[], bool], timeout: float, every: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every)
    return check()


def prop(box: Sandbox, unit: str, name: str) -> str:
    return box.run("systemctl", "show", "-p", name, "--value", unit).stdout.strip()


def starts(box: Sandbox, unit: str = VLLM) -> int:
    done = box.run("journalctl", "-u", unit, "-o", "json", "--no-pager")
    messages = [
        str(json.loads(line).get("MESSAGE", "")) for line in done.stdout.split("\n") if line
    ]
    return sum(1 for m in messages if m.startswith(f"Started {unit}"))


def inside(box: Sandbox, code: str, *args: str) -> str:
    """Python run inside the container (its view of the files: SQLite cannot open them through
    /proc/PID/root); its stdout."""
    done = box.run(sys.executable, "-c", code, *args, check=False, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"inside the container: {done.stderr.strip()[-400:]}")
    return done.stdout


COUNT_SAMPLES = """
import sys
from vkvagent.adapters.history import History
with History(sys.argv[1], readonly=True) as history:
    print(len(history.samples(until=float(sys.argv[2]))))
"""
INTEGRITY = """
import sqlite3, sys
for name in sys.argv[2:]:
    db = sqlite3.connect(f"file:{sys.argv[1]}/{name}?mode=ro", uri=True)
    print(name, db.execute("PRAGMA integrity_check").fetchone()[0])
"""


def samples_until(box: Sandbox, until: float) -> int:
    return int(inside(box, COUNT_SAMPLES, STATE_DIR, repr(until)).strip())


def integrity(box: Sandbox, *names: str) -> list[str]:
    """The files whose SQLite integrity check is not "ok"."""
    out = inside(box, INTEGRITY, STATE_DIR, *names)
    return [line for line in out.splitlines() if not line.endswith(" ok")]


def status_answers(box: Sandbox, row: Row, when: str) -> None:
    """``vkvagent status`` (and --json) answers with a Nagios code and no traceback."""
    for extra in ((), ("--json",)):
        done = box.run(
            sys.executable,
            "-m",
            "vkvagent",
            "status",
            *extra,
            "--config",
            CONFIG_DIR,
            check=False,
            timeout=60,
        )
        row.check(
            done.returncode in (0, 1, 2, 3)
            and done.stdout.strip() != ""
            and "Traceback" not in done.stderr,
            f"{when}: `vkvagent status {' '.join(extra)}` exited {done.returncode}: "
            f"{done.stderr.strip()[-200:]}",
        )
        if extra and done.returncode in (0, 1, 2, 3):
            try:
                json.loads(done.stdout)
            except ValueError:
                row.fail(f"{when}: `vkvagent status --json` printed no JSON")


def agent_alive(box: Sandbox, row: Row, when: str) -> None:
    state, restarts = prop(box, AGENT, "ActiveState"), prop(box, AGENT, "NRestarts")
    row.check(
        (state, restarts) == ("active", "0"),
        f"{when}: vkvagent.service {state}, NRestarts={restarts} (expected active, never "
        "restarted)",
    )


# -- vLLM crash-looping ------------------------------------------------------------------------


def crash_loop(row: Row, seconds: float = 25.0) -> None:
    """The engine dies 2 s (60 simulated s) after each start; systemd starts it again."""
    vllm = sim_unit(
        "--scenario",
        "engine-dead",
        "--scenario-onset",
        "60",
        service="Restart=always\nRestartSec=1",
        unit="StartLimitIntervalSec=0",
    )
    with agent_box(vllm, agent_config(), ready=False) as box:
        box.run("systemctl", "start", AGENT)
        wait_for(lambda: int(prop(box, VLLM, "NRestarts") or 0) >= 5, seconds)
        time.sleep(2)  # a last round of decisions after a crash
        alive = prop(box, AGENT, "ActiveState"), prop(box, AGENT, "NRestarts")
        box.run("systemctl", "stop", AGENT)
        crashes = int(prop(box, VLLM, "NRestarts") or 0)
        made = starts(box)
        row.trials += 1
        row.faults = (row.faults or 0) + crashes
        row.check(crashes >= 3, f"crash loop: vLLM crashed only {crashes} times")
        row.check(
            made == 1 + crashes,
            f"crash loop: vllm.service started {made} times, systemd's Restart= accounts for "
            f"1 + {crashes}: vkvagent added restarts",
        )
        found = actions(box, STATE_DIR)
        requested = sum(restarts_requested(a) for a in found)
        row.check(requested == 0, f"crash loop: vkvagent requested {requested} restarts")
        row.check(not events(box, "restart.started"), "crash loop: a restart.started event")
        causes = {e.get("VKV_CAUSE") for e in events(box, "decision.changed")}
        row.check("engine_down" in causes, f"crash loop: engine_down never seen ({causes})")
        row.check(alive == ("active", "0"), f"crash loop: vkvagent.service {alive}")
        row.notes.append(
            f"crash loop: vLLM crashed {crashes} times in {seconds:.0f} s, systemd started it "
            f"{made} times, vkvagent requested {requested} restarts"
        )


# -- D-Bus unavailable, access denied ----------------------------------------------------------

STALLED = ("--scenario", "stall", "--scenario-onset", "150", "--rate", "4")
WATCH = 10.0  # seconds of refused attempts watched after the first


def _refused(box: Sandbox, row: Row, what: str, expect: str, wait: float = 60.0) -> int:
    """Start the agent, let it be refused, then watch it back off (the next try a minute
    later, not at the next tick); the checks. Returns how many attempts it made."""
    box.run("systemctl", "start", AGENT)
    wait_for(lambda: bool(events(box, "restart.failed")), wait)
    time.sleep(WATCH)  # ten ticks: none may try again
    failed = events(box, "restart.failed")
    row.trials += 1
    row.faults = (row.faults or 0) + len(failed)
    row.check(len(failed) == 1, f"{what}: {len(failed)} refused attempts in {WATCH:g} s, not 1")
    report = json.loads((box.root / STATE_DIR.lstrip("/") / "status.json").read_text())
    shown = report["verdict"]["reason"]
    row.check(shown.startswith("retry back-off: 1 "), f"{what}: the decision says {shown!r}")
    for event in failed:
        message = str(event.get("MESSAGE", ""))
        if not row.check(
            expect in message and "\n" not in message, f"{what}: restart.failed says {message!r}"
        ):
            break
    row.check(starts(box) == 1, f"{what}: vllm.service was restarted")
    found = actions(box, STATE_DIR)
    outcomes = sorted({str(a.outcome) for a in found})
    row.check(outcomes in ([], ["aborted"]), f"{what}: ledger outcomes {outcomes}")
    agent_alive(box, row, what)
    row.notes.append(
        f"{what}: refused in one line, vLLM untouched; {len(failed)} attempt(s) within "
        f"{WATCH:g} s of the first at sample_interval 1 s, then a retry back-off "
        f"({len(found)} aborted action(s) in the ledger)"
    )
    return len(failed)


def dbus(row: Row, *, unavailable: bool = True, denied: bool = True) -> None:
    if unavailable:
        dbus_unavailable(row)
    if denied:
        access_denied(row)


def dbus_unavailable(row: Row) -> None:
    unavailable = agent_unit(environment={"DBUS_SYSTEM_BUS_ADDRESS": NO_BUS})
    with agent_box(sim_unit(*STALLED), agent_config(), unavailable) as box:
        _refused(box, row, "D-Bus unavailable", "bus unavailable")
        # The bus comes back (the agent's environment fixed, as an operator would): the next
        # attempt restarts vLLM, once.
        box.run("systemctl", "stop", AGENT)
        box.write_unit(AGENT, agent_unit())
        box.run("systemctl", "daemon-reload")
        box.run("systemctl", "start", AGENT)
        # The back-off lets the next attempt come a minute after the refused one.
        wait_for(lambda: bool(events(box, "restart.completed")), 90)
        time.sleep(2)
        done = [a for a in actions(box, STATE_DIR) if a.outcome == "done"]
        row.check(len(done) == 1, f"D-Bus back: {len(done)} completed restarts, expected 1")
        row.check(starts(box) == 2, f"D-Bus back: vllm.service started {starts(box)} times")
        agent_alive(box, row, "D-Bus back")


def access_denied(row: Row) -> None:
    """The agent as an unprivileged user: systemd (or polkit) refuses its restarts. The
    refused attempts must not count as starts against the unit's start limit either."""
    nobody = agent_unit(user="nobody")
    with agent_box(sim_unit(*STALLED), agent_config(), nobody) as box:
        reach_python(box)
        box.run("mkdir", "-p", STATE_DIR)
        box.run("chown", "nobody:nogroup", STATE_DIR)
        _refused(box, row, "access denied", "access denied")
        limit = [e for e in events(box, "restart.failed") if "StartLimitBurst" in str(e)]
        row.check(not limit, f"access denied: refused jobs counted as starts: {limit[:1]}")


# -- the state directory full ------------------------------------------------------------------

FILL = """
import sys
try:
    open(sys.argv[1], "wb").write(bytes(64 << 20))
except OSError:  # the disk is full: what was wanted
    pass
"""
OBSERVE = '[policy]\nmode = "observe"\n'


def _fill(box: Sandbox) -> None:
    box.run(sys.executable, "-c", FILL, f"{STATE_DIR}/filler")


def _free(box: Sandbox) -> None:
    box.run("rm", "-f", f"{STATE_DIR}/filler")


def state_full(row: Row) -> None:
    with agent_box(sim_unit(), agent_config(OBSERVE)) as box:
        box.run("mkdir", "-p", STATE_DIR)
        box.run("mount", "-t", "tmpfs", "-o", "size=4m,mode=0750", "tmpfs", STATE_DIR)
        box.run("systemctl", "start", AGENT)
        status_file = box.root / STATE_DIR.lstrip("/") / "status.json"
        wait_for(status_file.exists, 20)
        time.sleep(5)
        filled_at = time.time()
        committed = samples_until(box, filled_at)
        _fill(box)
        row.trials += 1
        row.faults = (row.faults or 0) + 1
        failed = wait_for(lambda: bool(events(box, "state.write_failed")), 20)
        row.check(failed, "disk full: no state.write_failed event")
        whats = sorted({str(e.get("VKV_WHAT")) for e in events(box, "state.write_failed")})
        status_answers(box, row, "disk full")
        time.sleep(4)  # some ticks on a full disk
        agent_alive(box, row, "disk full")
        _free(box)
        freed_at = time.time()
        recovered = wait_for(
            lambda: (
                {str(e.get("VKV_WHAT")) for e in events(box, "state.write_recovered")} >= set(whats)
            ),
            20,
        )
        row.check(recovered, f"space back: no state.write_recovered for each of {whats}")
        fresh = wait_for(lambda: _updated(status_file) > freed_at, 10)
        row.check(fresh, "space back: status.json not written again")
        status_answers(box, row, "space back")
        kept = samples_until(box, filled_at)
        if kept < committed:
            row.lost += committed - kept
            row.fail(f"disk full: {committed - kept} of {committed} committed samples lost")
        bad = integrity(box, "history.sqlite3", "ledger.sqlite3")
        row.check(not bad, f"disk full: integrity check: {bad}")
        row.lost += len(bad)
        agent_alive(box, row, "space back")
        row.notes.append(
            f"full while running: write failures reported for {', '.join(whats)}, all "
            f"recovered; {kept} samples committed before the fill kept"
        )

        # Full when the agent starts: it may not start, but it must come back by itself.
        box.run("systemctl", "stop", AGENT)
        _fill(box)
        row.trials += 1
        row.faults += 1
        box.run("systemctl", "start", "--no-block", AGENT)
        time.sleep(6)
        on_full = prop(box, AGENT, "ActiveState"), prop(box, AGENT, "SubState")
        said = [m for m in box.messages(AGENT) if m.startswith("vkvagent: ")][-1:]
        status_answers(box, row, "agent started on a full disk")
        _free(box)
        freed_at = time.time()
        back = wait_for(
            lambda: (
                prop(box, AGENT, "ActiveState") == "active" and _updated(status_file) > freed_at
            ),
            30,
        )
        row.check(back, f"started on a full disk ({on_full}): not back once space returned")
        row.notes.append(
            f"started on a full disk: {on_full[0]} ({on_full[1]}; it said {said}), "
            + ("back by itself once space returned" if back else "did not come back")
        )


def _updated(path: Path) -> float:
    try:
        return float(json.loads(path.read_text())["updated"])
    except (OSError, ValueError, KeyError):
        return 0.0


# -- clock jumps -------------------------------------------------------------------------------

JUMPS = (3600.0, 6 * 3600.0, 86400.0, 30 * 86400.0, 365 * 86400.0)
SCALE = 1000.0


class JumpClock:
    """A fast clock whose wall time can be stepped (NTP, an RTC gone wrong); monotonic time
    is never stepped."""

    def __init__(self, base: Clock) -> None:
        self.base, self.offset = base, 0.0

    def clock(self) -> Clock:
        return Clock(
            wall=lambda: self.base.wall() + self.offset, mono=self.base.mono, scale=self.base.scale
        )


def _process_start(sim: SimProcess) -> float:
    page = get(sim.url + "/metrics")[1].decode()
    line = next(x for x in page.splitlines() if x.startswith("process_start_time_seconds"))
    return float(line.split()[-1])


def clock_jumps(row: Row, seed: int, jumps: int = 8) -> None:
    rng = random.Random(seed)
    with SimProcess(MODEL, "--time-scale", str(SCALE), "--rate", "4", "--seed", "3") as sim:
        jump = JumpClock(scaled_clock(_process_start(sim), SCALE))
        with contextlib.ExitStack() as stack:
            work = Path(stack.enter_context(_tempdir()))
            config = work / "config.toml"
            config.write_text(f"""\
[agent]
state_dir = "{work / "state"}"
sample_interval = 10.0
[vllm]
url = "{sim.url}"
[gpu]
enabled = false
[metrics]
listen = ""
{EAGER}""")
            stream = io.StringIO()
            clock = jump.clock()
            daemon = Daemon.offline(config, stream, clock)
            stack.callback(daemon.close)
            decisions: list[tuple[float, str, str | None]] = []

            def ticks(count: int) -> None:
                for _ in range(count):
                    decision = daemon.tick()
                    decisions.append((jump.offset, decision.action, decision.cause))
                    time.sleep(10.0 / SCALE)

            deadline = time.monotonic() + 90
            ticks(40)
            while time.monotonic() < deadline and not (daemon.last and daemon.last.ratio):
                ticks(10)
            row.check(
                daemon.last is not None and daemon.last.ratio is not None,
                "clock jumps: no baseline learned before the jumps",
            )
            for number in range(jumps):
                size = rng.choice(JUMPS) * rng.uniform(0.5, 1.5)
                jump.offset += size if jump.offset <= 0 else -size
                row.trials += 1
                row.faults = (row.faults or 0) + 1
                try:
                    ticks(30)
                except Exception as exc:
                    row.fail(f"clock jump {number} ({jump.offset:+.0f} s): tick raised {exc!r}")
            wrong = [d for d in decisions if d[1] == "restart" or d[2] in FIXABLE]
            row.check(not wrong, f"clock jumps: spurious decisions {wrong[:5]}")
            with History(work / "state", readonly=True) as history:
                kept = len(history.samples())
            row.notes.append(
                f"clock jumps: {jumps} wall-clock steps (offsets up to "
                f"{max(abs(d[0]) for d in decisions) / 86400:.0f} days), {len(decisions)} ticks; "
                f"causes seen: {sorted({str(d[2]) for d in decisions})}; actions: "
                f"{sorted({d[1] for d in decisions})}; history keeps {kept} of "
                f"{len(decisions)} samples (retention follows the wall clock: a step forward "
                "past retention_days expires what came before it)"
            )


@contextlib.contextmanager
def _tempdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="vkv-reliability.") as tmp:
        yield tmp


# -- /metrics that hangs, trickles or is huge ---------------------------------------------------

HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
    b"Connection: close\r\n"
)
BLOCK = b"# filler\n" * 7000  # about 64 KiB


def _hang_until_gone(conn: socket.socket, stop: threading.Event) -> None:
    conn.settimeout(0.2)
    while not stop.is_set():
        try:
            if conn.recv(1) == b"":
                return
        except socket.timeout:
            continue


def _behaviour(kind: str, rng: random.Random, limit: int) -> Callable[..., None]:
    interval = rng.uniform(0.005, 0.1)
    size = rng.randrange(limit + 1, 40 * limit)
    bomb = _gzip_zeros(size) if kind == "gzip-bomb" else b""  # made before the client waits

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        if kind == "silent":
            _hang_until_gone(conn, stop)
        elif kind == "stall-mid-body":
            conn.sendall(HEAD + b"Content-Length: 100000\r\n\r\n" + BLOCK[:1000])
            _hang_until_gone(conn, stop)
        elif kind == "trickle-headers":
            conn.sendall(HEAD + b"X-Slow: ")
            while not stop.wait(interval):
                conn.sendall(b"a")
        elif kind == "trickle-body":
            conn.sendall(HEAD + b"\r\n")
            while not stop.wait(interval):
                conn.sendall(b"#")
        elif kind == "huge-declared":
            conn.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % size)
            _hang_until_gone(conn, stop)
        elif kind == "huge-streamed":
            conn.sendall(HEAD + b"\r\n")
            sent = 0
            while sent < size and not stop.is_set():
                conn.sendall(BLOCK)
                sent += len(BLOCK)
        elif kind == "gzip-bomb":
            conn.sendall(
                HEAD + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(bomb), bomb)
            )

    return handle


KINDS = ("silent", "stall-mid-body", "trickle-headers", "trickle-body", "huge-declared",
         "huge-streamed", "gzip-bomb")  # fmt: skip


def _gzip_zeros(size: int) -> bytes:
    """``size`` zero bytes (rounded up to MiB), gzip-compressed: about 1/1000 of that."""
    packer = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    return b"".join(packer.compress(zeros) for _ in range(size // len(zeros) + 1)) + packer.flush()


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def metrics_endpoint(row: Row, seed: int, trials: int) -> None:
    rng = random.Random(seed)
    worst = 0.0
    grown = 0
    for number in range(trials):
        kind = KINDS[number % len(KINDS)]
        connect, read = rng.uniform(0.05, 0.5), rng.uniform(0.1, 0.8)
        limit = rng.choice([64 * 1024, 256 * 1024, 1 << 20, 8 << 20])
        before = _rss_kib()
        with RawServer(_behaviour(kind, rng, limit)) as server:
            client = VllmClient(
                server.url, connect_timeout=connect, read_timeout=read, max_page_bytes=limit
            )
            began = time.monotonic()
            try:
                client.scrape()
            except ScrapeError as exc:
                message = str(exc)
                row.check("\n" not in message, f"{kind}: message {message!r}")
                if kind.startswith(("huge", "gzip")):
                    row.check("limit" in message, f"{kind}: {message!r} does not name the limit")
            except Exception as exc:
                row.fail(f"{kind}: {type(exc).__name__}: {exc}")
            else:
                row.fail(f"{kind}: the scrape succeeded")
            took = time.monotonic() - began
            server.stop.set()
        row.trials += 1
        row.faults = (row.faults or 0) + 1
        row.inputs = (row.inputs or 0) + 1
        over = took - (connect + read)
        worst = max(worst, over)
        row.check(over < 0.5, f"{kind}: took {took:.2f} s, deadline {connect + read:.2f} s")
        grown = max(grown, _rss_kib() - before)
        row.check(
            _rss_kib() - before < 4 * limit // 1024 + 16 * 1024,
            f"{kind}: RSS grew {(_rss_kib() - before) // 1024} MiB (limit {limit // 1024} KiB)",
        )
    row.notes.append(
        f"/metrics: {trials} scrapes of {len(KINDS)} kinds, each failed in one line; at most "
        f"{worst * 1000:.0f} ms past connect_timeout + read_timeout; RSS grew at most "
        f"{grown // 1024} MiB"
    )
    _daemon_on_trickle(row)


def _daemon_on_trickle(row: Row) -> None:
    """A whole tick against a trickling vLLM is bounded the same way, and the decision is
    engine_down (systemd's business), never a restart."""
    rng = random.Random(1)
    with RawServer(_behaviour("trickle-body", rng, 1 << 20)) as server, _tempdir() as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(
            f'[agent]\nstate_dir = "{tmp}/state"\n[vllm]\nurl = "{server.url}"\n'
            "connect_timeout = 0.2\nread_timeout = 0.5\n[gpu]\nenabled = false\n"
            f'[metrics]\nlisten = ""\n{EAGER}'
        )
        daemon = Daemon.offline(config, io.StringIO())
        slowest = 0.0
        try:
            for _ in range(3):
                began = time.monotonic()
                decision = daemon.tick()
                took = time.monotonic() - began
                row.trials += 1
                row.faults = (row.faults or 0) + 1
                # One bounded exchange: /version is asked only once /metrics has answered.
                row.check(took < 0.7 + 0.5, f"a tick on a trickling vLLM took {took:.2f} s")
                slowest = max(slowest, took)
                row.check(
                    (decision.action, decision.cause) != ("restart", None)
                    and decision.cause == "engine_down",
                    f"daemon tick on a trickling vLLM: {decision.action} {decision.cause}",
                )
        finally:
            daemon.close()
            server.stop.set()
    row.notes.append(
        f"daemon tick against a trickling /metrics (connect 0.2 s + read 0.5 s): at most "
        f"{slowest:.2f} s, engine_down; a tick makes one bounded request (/metrics)"
    )
