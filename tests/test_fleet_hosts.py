"""Three daemons as three hosts of one fleet group, against the real etcd, each with the
simulator as its vLLM (``vkvagent sim serve``, the uptime-decline scenario: its speed falls
10 % an hour from an hour of uptime) SCALE times faster than real time, and each daemon on a
clock as fast (``demo.scaled_clock``), in observe mode: what a new host learns from the two
that ran before it, what ``fleet status`` sees of the three, a peer's garbage, a host that
goes silent and etcd stopped."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from tests.etcd import Etcd
from tests.httpserver import free_port
from tests.test_daemon import events_of
from tests.test_fleet import etcd_fixture, fleet_of  # noqa: F401 - the `etcd` fixture
from tests.test_prevention import cured, declining
from vkvagent.knowledge.fleet_view import FleetView
from vkvagent.service.daemon import Clock, Daemon
from vkvagent.tools.demo import scaled_clock, simulator

pytestmark = pytest.mark.fleet

SCALE = 600.0  # a simulated hour in 6 s
INTERVAL = 20.0  # the daemons' sample interval (simulated seconds)
GROUP = "hosts"
HOUR = 3600.0


@dataclass
class Host:
    """One host: its daemon ticking on its own thread, its clock and its events."""

    name: str
    daemon: Daemon
    clock: Clock
    started: float  # the simulator's start (Unix seconds): uptime 0
    stream: io.StringIO
    stop: threading.Event = field(default_factory=threading.Event)
    failure: list[BaseException] = field(default_factory=list)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in events_of(self.stream) if e["event"] == name]

    def uptime(self) -> float:
        return self.clock.wall() - self.started


def config(tmp: Path, name: str, port: int, recording: Path, etcd: str) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(
        f'[agent]\nstate_dir = "{tmp / name}"\nsample_interval = {INTERVAL}\n'
        f'[vllm]\nurl = "http://127.0.0.1:{port}"\n'
        f'[gpu]\nrecording = "{recording}"\n'
        '[metrics]\nlisten = ""\n'
        # Restarts as often as hourly: prevention's floor (the cooldown, a day over
        # max_per_day) below the plan this decline makes.
        '[policy]\nmode = "observe"\nwindows = ["daily 00:00-24:00"]\n'
        "cooldown = 3600\nmax_per_day = 24\n"
        f'[fleet]\nendpoints = ["{etcd}"]\ngroup = "{GROUP}"\nname = "{name}"\ntimeout = 0.5\n'
    )
    return path


@contextlib.contextmanager
def host(tmp: Path, name: str, etcd: str) -> Iterator[Host]:
    """A simulator and a daemon ticking every INTERVAL of the fast clock (``Daemon.run``
    wants the main thread: its signals)."""
    port, recording = free_port(), tmp / f"{name}-gpu.json"
    options = ("--scenario", "uptime-decline", "--time-scale", str(SCALE), "--rate", "4")
    with simulator(port, recording, *options) as started:
        clock = scaled_clock(started, SCALE)
        stream = io.StringIO()
        daemon = Daemon.offline(config(tmp, name, port, recording, etcd), stream, clock)
        running = Host(name, daemon, clock, started, stream)

        def ticks() -> None:
            try:
                while not running.stop.wait(INTERVAL / SCALE):
                    daemon.tick()
            except BaseException as exc:  # the test names it
                running.failure.append(exc)

        thread = threading.Thread(target=ticks, name=name, daemon=True)
        thread.start()
        try:
            yield running
        finally:
            running.stop.set()
            thread.join(timeout=30)
            daemon.close()
    assert not running.failure, f"{name}'s tick raised {running.failure[0]!r}"


def wait_for(check: Callable[[], object], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def server_of(running: Host) -> str:
    baseline = running.daemon.state.baseline
    return baseline.server if baseline is not None else ""


def test_three_hosts_learn_from_each_other_see_each_other_and_go_on_without_etcd(
    etcd: Etcd, tmp_path: Path
) -> None:
    raw = fleet_of(etcd.url, GROUP).client
    with host(tmp_path, "gpu-a", etcd.url) as a, host(tmp_path, "gpu-b", etcd.url) as b:
        # The two older hosts: each has two cured runs of this server behind it, declining
        # from 1 h of uptime by 10 % an hour, as the simulator's does.
        server = wait_for(
            lambda: server_of(a) if server_of(a) == server_of(b) else "", 30, "a server"
        )
        for number, peer in enumerate((a, b)):
            ended = peer.clock.wall() - HOUR
            past = tuple(
                cured(replace(declining(f"{peer.name}-{i}", onset_h=1.0, per_h=0.1, hours=6.0,
                                        seed=2 * number + i), server=server), ended_at=ended)
                for i in (1, 2)
            )  # fmt: skip
            with peer.daemon.lock:
                peer.daemon.state = replace(peer.daemon.state, past=past)
        runs = f"/vkvagent/fleet/{GROUP}/runs/{server}/"
        wait_for(lambda: len(raw.range_prefix(runs)) == 2, 30, "the two hosts' runs in etcd")
        raw.put(runs + "gpu-x", '{"schema": 1, "host": "gpu-x"', "0")

        with host(tmp_path, "gpu-c", etcd.url) as c:
            # The new host plans its first restart from its peers' four runs (gpu-x refused)
            # and decides it before its own run has slowed enough to be diagnosed.
            def first_restart() -> dict[str, Any] | None:
                said = [e for e in c.events("decision.changed")
                        if "would restart" in str(e["reason"])]  # fmt: skip
                return said[0] if said else None

            decided = wait_for(first_restart, 120, "gpu-c's first restart")
            assert decided["cause"] == "prevention", decided["reason"]
            assert "(4 of them other hosts')" in decided["reason"]
            (refused,) = c.events("fleet.peer_refused")
            assert refused["peer"] == "gpu-x" and refused["error"] == "not JSON"
            assert c.daemon.state.plan is not None and c.daemon.state.plan.peers == 4
            # ... and has its peers' fresh baselines of the server, to be judged by at the
            # loads it has not learned.
            assert c.daemon.parts.fleet_runs is not None
            baselines = c.daemon.parts.fleet_runs.learned(server).baselines
            assert sorted(b.run.rpartition("@")[2] for b in baselines) == ["gpu-a", "gpu-b"]

            # fleet status sees the three; a host gone silent is unknown once its entry is
            # older than it says it may be.
            reader = fleet_of(etcd.url, GROUP)

            def stale() -> dict[str, bool]:
                view = FleetView.of(GROUP, 1, c.clock.wall(), reader.entries(), [])
                return {peer.entry.host: peer.stale for peer in view.hosts}

            assert stale() == {"gpu-a": False, "gpu-b": False, "gpu-c": False}
            b.stop.set()
            wait_for(lambda: stale()["gpu-b"], 30, "gpu-b stale")
            assert not stale()["gpu-a"] and not stale()["gpu-c"]

            # etcd stopped: each host goes on alone, says so once, and again once it is back.
            ticked = {h.name: h.daemon.last for h in (a, c)}
            etcd.stop()
            try:
                for h in (a, c):
                    wait_for(lambda h=h: h.events("fleet.unreachable"), 30, f"{h.name} alone")
                time.sleep(1.0)  # 10 simulated minutes
                for h in (a, c):
                    last = h.daemon.last
                    assert last is not None and last is not ticked[h.name]
                    assert last.time > ticked[h.name].time  # type: ignore[union-attr]
                    assert len(h.events("fleet.unreachable")) == 1
            finally:
                etcd.start()
            for h in (a, c):
                wait_for(lambda h=h: h.events("fleet.reachable"), 60, f"{h.name} back")
