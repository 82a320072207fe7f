"""A source the agent needs to act, failing for good, as the daemon reports it: status.json,
`vkvagent status`, the metric the alert rule reads, and the events the status shows. In-process
ticks on a clock this test moves, against a real loopback vLLM page and a real D-Bus client
pointed at a bus that is not there."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tests.conftest import read_page
from tests.httpserver import HttpServer
from tests.test_daemon import write_config
from vkvagent.adapters.systemd import Systemd
from vkvagent.knowledge import status
from vkvagent.knowledge.events import Events
from vkvagent.service.daemon import Clock, Daemon
from vkvagent.tools.cli import main

PAGE = read_page("v1-0.10.prom").encode()
INTERVAL = 20.0  # test_daemon.write_config's sample interval


class Moved:
    """A wall and monotonic clock that move only when told: five ticks end 20 s ago."""

    def __init__(self) -> None:
        self.start = self.at = time.time() - 5 * INTERVAL

    def clock(self) -> Clock:
        return Clock(wall=lambda: self.at, mono=lambda: self.at - self.start)


@pytest.fixture
def vllm() -> Iterator[HttpServer]:
    routes = {"/metrics": lambda h: h.reply(200, PAGE), "/version": lambda h: h.reply(404, b"")}
    with HttpServer(routes) as server:
        yield server


def test_systemd_unreachable_for_three_intervals_is_impaired_never_healthy(
    tmp_path: Path, vllm: HttpServer
) -> None:
    path = write_config(tmp_path, vllm.url, probe={"enabled": False})
    moved, stream = Moved(), io.StringIO()
    daemon = Daemon(
        path, clock=moved.clock(), events=Events(stream=stream, now=lambda: moved.at),
        notify=lambda _message: None, use_systemd=False,
    )  # fmt: skip
    bus = Systemd("unix:path=" + str(tmp_path / "no-bus"), timeout=2.0)
    daemon.parts.sampler.unit = lambda: bus.unit("vllm.service")  # the agent's own reader
    states = []
    try:
        for _tick in range(5):
            daemon.tick()
            report = status.read(tmp_path / "state")
            assert report is not None
            states.append(report.verdict.state)
            moved.at += INTERVAL
        page = generate_latest(daemon.metrics.registry).decode()
    finally:
        daemon.close()
        bus.close()
    # vLLM answers (learning: healthy) but the unit cannot be read: briefly, a blip; for three
    # intervals, the agent cannot restart anything, whatever the engine concludes.
    assert states == ["healthy", "healthy", "healthy", "impaired", "impaired"]
    assert report.verdict.reason.startswith("learning")  # the engine's words are kept
    [failure] = report.failing
    assert failure.source == "systemd" and "bus" in failure.error
    assert failure.since == moved.start and failure.seconds == 4 * INTERVAL
    assert 'vkvagent_source_failed{source="systemd"} 1.0' in page
    assert 'vkvagent_source_failed{source="vllm"} 0.0' in page
    assert 'vkvagent_verdict{state="impaired"} 1.0' in page
    # The status shows the events behind it, as `systemctl status` shows journal lines.
    assert "source.failed" in [e.event for e in report.events]

    out = io.StringIO()
    assert main(["status", "--config", str(path)], out, io.StringIO()) == 1
    shown = out.getvalue()
    head = shown.splitlines()[0]
    assert head.startswith("vkvagent 0.1.0: IMPAIRED (systemd failing) | speed_ratio=U;;;0 ")
    assert "  failing     systemd for 80 s: " in shown and "(no restart can happen)" in shown
    assert any(line.endswith(f"source.failed: systemd: {failure.error}")
               for line in shown.splitlines())  # fmt: skip
