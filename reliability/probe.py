"""The active probe against servers that misbehave, in this process, on loopback: one row each
for a hung server (accepts and never reads; reads and never answers; answers the headers and
never the body), a slow one (answers inside the probe's timeout, or past it) and a dead one
(nothing listens; hangs up; answers 500). Every probe must end within its own timeout with
the outcome the server earns, leave no thread behind, and never hold up the daemon's tick.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from reliability.report import Row
from tests.conftest import read_page
from tests.httpserver import RawServer, free_port, read_request
from vkvagent.adapters.probe import Prober
from vkvagent.adapters.vllm import VllmClient
from vkvagent.service.daemon import Clock, Daemon

COMPLETION = json.dumps({"choices": [{"index": 0, "text": " the"}]}).encode()
SLACK = 0.5  # seconds a probe may end past its timeout (thread scheduling on a busy host)
Handler = Callable[[socket.socket, threading.Event], None]


def _reply(conn: socket.socket, status: str, body: bytes) -> None:
    conn.sendall(
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: "
        f"{len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


def _hung(variant: str) -> Handler:
    def handle(conn: socket.socket, stop: threading.Event) -> None:
        if variant != "never-reads":
            read_request(conn)
        if variant == "headers-only":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        stop.wait(30)

    return handle


def _slow(delay: float) -> Handler:
    def handle(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        if not stop.wait(delay):
            _reply(conn, "200 OK", COMPLETION)

    return handle


def _dead(variant: str) -> Handler:
    def handle(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        if variant == "server-error":
            _reply(conn, "500 Internal Server Error", b'{"error": "EngineDeadError"}')
        # "hangs-up": the handler returns and the connection closes unanswered

    return handle


def _probe(row: Row, url: str, timeout: float, expect: str, at_least: float = 0.0) -> float:
    """One probe; checks its outcome and that it ended in time. Its latency."""
    prober = Prober(VllmClient(url, connect_timeout=min(0.5, timeout / 2), read_timeout=timeout))
    row.check(prober.send("m"), "the first probe was not sent")
    if expect == "timeout":  # surely still in flight: no second one may go
        row.check(not prober.send("m"), "a second probe went while one was in flight")
    prober.wait(timeout + 5)
    results = prober.collect()
    row.trials += 1
    row.faults = (row.faults or 0) + 1
    if not row.check(len(results) == 1, f"{len(results)} results for one probe"):
        return 0.0
    (result,) = results
    bound = timeout + min(0.5, timeout / 2) + SLACK
    row.check(result.outcome == expect, f"{expect} expected, got {result.outcome}: {result.detail}")
    row.check(
        at_least <= result.latency <= bound,
        f"{expect}: took {result.latency:.2f} s, allowed {at_least:.2f} to {bound:.2f}",
    )
    facts = prober.facts()
    row.check(prober.in_flight is None, "a finished probe still in flight")
    if expect in ("timeout", "error"):
        row.check(facts.unanswered == result.sent, f"{expect}: not counted as unanswered")
    else:
        row.check(facts.unanswered is None, f"{expect}: counted as unanswered")
    return result.latency


def _no_probe_threads(row: Row) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name == "vkvagent-probe" and t.is_alive()]:
            return
        time.sleep(0.05)
    row.fail("probe threads left running")


def hung(row: Row, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    variants = ("never-reads", "never-answers", "headers-only")
    worst = 0.0
    for number in range(trials):
        variant, timeout = variants[number % len(variants)], rng.uniform(0.2, 0.8)
        with RawServer(_hung(variant)) as server:
            took = _probe(row, server.url, timeout, "timeout", at_least=timeout * 0.9)
            server.stop.set()
        worst = max(worst, took - timeout)
    _no_probe_threads(row)
    slowest = _daemon_while_probe_hangs(row)
    row.notes.append(
        f"hung: {trials} probes ({', '.join(variants)}), each a timeout, at most "
        f"{worst * 1000:.0f} ms past its timeout; daemon ticks while one hung: at most "
        f"{slowest * 1000:.0f} ms; the stall found once it gave up"
    )


def slow(row: Row, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    answered = late = 0
    for number in range(trials):
        timeout = rng.uniform(0.3, 0.8)
        within = number % 2 == 0
        delay = timeout * (rng.uniform(0.1, 0.7) if within else rng.uniform(1.3, 2.0))
        with RawServer(_slow(delay)) as server:
            expect = "ok" if within else "timeout"
            _probe(row, server.url, timeout, expect, at_least=min(delay, timeout) * 0.9)
            server.stop.set()
        answered, late = answered + within, late + (not within)
    _no_probe_threads(row)
    row.notes.append(
        f"slow: {answered} answered inside the timeout (ok, latency >= the delay), {late} past "
        "it (timeout, ended at the timeout)"
    )


def dead(row: Row, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    for number in range(trials):
        variant, timeout = (
            ("refused", "hangs-up", "server-error")[number % 3],
            rng.uniform(0.2, 0.8),
        )
        expect = "refused" if variant == "refused" else "error"
        if variant == "refused":
            _probe(row, f"http://127.0.0.1:{free_port()}", timeout, expect)
        else:
            with RawServer(_dead(variant)) as server:
                _probe(row, server.url, timeout, expect)
                server.stop.set()
        seen[variant] = seen.get(variant, 0) + 1
    _no_probe_threads(row)
    row.notes.append(
        f"dead: {seen}; refused is not an unanswered probe (vLLM down or loading: /metrics "
        "says so), a hang-up or a 500 is"
    )


# -- the daemon, while its probe hangs ------------------------------------------------------------


class _Clock:
    """The daemon's clocks, moved by hand: 10 s a tick, so the probe is due at once."""

    def __init__(self) -> None:
        self.wall, self.mono = time.time(), 1000.0

    def clock(self) -> Clock:
        return Clock(wall=lambda: self.wall, mono=lambda: self.mono)

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def _frozen_vllm(page: bytes) -> Handler:
    """/metrics answers at once (the same page: counters still, gauges frozen at 0 pending),
    /version 404s, completions hang: vLLM 0.32 with its engine stopped."""

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        head = read_request(conn)
        if head.startswith(b"GET /metrics"):
            _reply(conn, "200 OK", page)
        elif head.startswith(b"GET "):
            _reply(conn, "404 Not Found", b"{}")
        else:
            stop.wait(30)

    return handle


@contextlib.contextmanager
def _daemon(url: str, clock: Clock) -> Iterator[Daemon]:
    with tempfile.TemporaryDirectory(prefix="vkv-reliability.") as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(
            f'[agent]\nstate_dir = "{tmp}/state"\nsample_interval = 10\n[vllm]\nurl = "{url}"\n'
            '[gpu]\nenabled = false\n[metrics]\nlisten = ""\n[probe]\nafter = 20\ntimeout = 2\n'
            '[diagnosis]\nstall_after = 60\n[policy]\nmode = "enforce"\nwindows = []\n'
        )
        daemon = Daemon.offline(config, io.StringIO(), clock)
        try:
            yield daemon
        finally:
            daemon.close()


def _daemon_while_probe_hangs(row: Row) -> float:
    """Ticks go on at their own pace while the probe waits out its timeout (2 s), and the
    stall is found once it has given up. The slowest tick, in seconds.

    A tick that sent a probe must return with it still in flight: one that waited for it
    would return after its timeout, with the probe over. (A bound on the tick's own seconds
    failed on a loaded 2-core host, at 0.88 s, where ticks take 10 ms.)"""
    page = read_page("v1-0.32-cpu.prom").encode()
    hand = _Clock()
    slowest, found, probes = 0.0, False, 0
    with RawServer(_frozen_vllm(page)) as server, _daemon(server.url, hand.clock()) as daemon:
        for _ in range(12):
            began = time.monotonic()
            decision = daemon.tick()
            slowest = max(slowest, time.monotonic() - began)
            row.trials += 1
            found = found or decision.cause == "stall"
            if decision.probe_wanted:
                probes += 1
                row.check(
                    daemon.parts.prober.in_flight is not None,
                    f"a tick waited for the probe it sent ({slowest:.2f} s)",
                )
            if daemon.parts.prober.in_flight is not None:
                daemon.parts.prober.wait(3)  # let the hung probe give up before the next tick
            hand.advance(10)
        server.stop.set()
    row.check(probes > 0, "no probe was sent to the hung engine")
    row.check(found, "the hung engine was never named a stall")
    return slowest
