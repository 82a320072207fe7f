"""Fleets against a real etcd (Debian's etcd-server, 3.4) on loopback, started by these tests:
agents as separate processes contending for a group's slots, a holder killed with SIGKILL,
etcd stopped and started again under a daemon. Skipped without the etcd binary, except under
CI=true, where that fails."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from tests.certificates import make_certificates
from tests.etcd import Etcd, require_etcd
from tests.httpserver import RawServer, free_port, read_request
from tests.test_daemon import events_of, write_config
from vkvagent.actuation.outcome import Outcome
from vkvagent.adapters.fleet import RETRY_AFTER, EtcdClient, Fleet, FleetError, Gate
from vkvagent.engine import Decision, EngineState
from vkvagent.knowledge import config, status, status_text
from vkvagent.knowledge.config import FleetConfig
from vkvagent.knowledge.events import CATALOGUE
from vkvagent.service.daemon import Clock, Daemon
from vkvagent.tools.cli import main

pytestmark = pytest.mark.fleet

PROJECT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", name="etcd")
def etcd_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd")).start()
    try:
        yield server
    finally:
        server.stop()


def fleet_of(url: str, group: str, **keys: Any) -> Fleet:
    cfg = FleetConfig(endpoints=(url,), group=group, **keys)
    return Fleet.from_config(cfg)


class Recorded:
    """An ``emit`` that keeps the events."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __call__(self, name: str, message: str, **fields: Any) -> None:
        assert name in CATALOGUE
        self.events.append((name, message, fields))

    def names(self) -> list[str]:
        return [name for name, _message, _fields in self.events]


# -- the protocol ------------------------------------------------------------------------------


def test_slots_leases_and_holders(etcd: Etcd) -> None:
    a = fleet_of(etcd.url, "proto", max_concurrent=2, lease_ttl=5, name="gpu-a")
    b = fleet_of(etcd.url, "proto", max_concurrent=2, lease_ttl=5, name="gpu-b")
    c = fleet_of(etcd.url, "proto", max_concurrent=2, lease_ttl=5, name="gpu-c")
    slot_a, seen = a.acquire("uptime_decline", "uptime_decline: restart: in window")
    assert slot_a is not None and slot_a.index == 0 and [h.host for h in seen] == ["gpu-a"]
    slot_b, _seen = b.acquire("stall", "stall: restart: emergency")
    assert slot_b is not None and slot_b.index == 1
    slot_c, seen = c.acquire("stall", "stall")
    assert slot_c is None and [h.host for h in seen] == ["gpu-a", "gpu-b"]
    holders = c.holders()
    assert [(h.slot, h.host, h.pid, h.cause) for h in holders] == [
        (0, "gpu-a", os.getpid(), "uptime_decline"),
        (1, "gpu-b", os.getpid(), "stall"),
    ]
    assert holders[0].reason == "uptime_decline: restart: in window"
    assert holders[0].since is not None and abs(holders[0].since - time.time()) < 5
    assert slot_a.release() is None  # revoked: the key is gone at once, not after the TTL
    slot_c, _seen = c.acquire("stall", "stall")
    assert slot_c is not None and slot_c.index == 0
    for slot in (slot_b, slot_c):
        assert slot.release() is None
    assert c.holders() == []
    assert slot_a.release() is None  # a second release: the lease is already gone


def test_a_slot_is_given_back_when_the_action_raises(etcd: Etcd) -> None:
    events = Recorded()
    gate = Gate(FleetConfig(endpoints=(etcd.url,), group="raises", name="gpu-a"), events)
    with (
        pytest.raises(RuntimeError, match="broke"),
        gate.slot(cause="stall", reason="stall: test", emergency=False) as turn,
    ):
        assert turn.allowed and turn.admission.slot is not None
        raise RuntimeError("the action broke")
    assert events.names() == ["fleet.slot_acquired", "fleet.slot_released"]
    assert events.events[1][2]["result"] == "error"
    assert fleet_of(etcd.url, "raises").holders() == []
    assert gate.state == "idle"


def test_a_lease_lost_while_held_is_noticed_and_reported_once(etcd: Etcd) -> None:
    events = Recorded()
    cfg = FleetConfig(endpoints=(etcd.url,), group="lost", lease_ttl=2, name="gpu-a")
    gate = Gate(cfg, events)
    with gate.slot(cause="stall", reason="stall: test", emergency=False) as turn:
        assert turn.allowed and turn.admission.slot is not None
        slot = turn.admission.slot
        time.sleep(1.0)  # renewed at least once: the lease outlives its first TTL
        assert gate.check(slot)
        EtcdClient([etcd.url]).revoke(slot.lease)  # what etcd does when renewals stop arriving
        assert slot.lost.wait(3.0), "the keepalive thread did not notice"
        assert not gate.check(slot) and not gate.check(slot)
        turn.result = "done"
    assert events.names() == [
        "fleet.slot_acquired", "fleet.slot_lost", "fleet.slot_released"
    ]  # fmt: skip
    assert "etcd let the lease expire" in events.events[1][1]


def run_agents(
    etcd: Etcd, tmp_path: Path, group: str, *, n: int, agents: int, hold: float, ttl: int = 10
) -> list[tuple[str, str, float]]:
    """``agents`` processes of one group wanting to restart at the same moment; the log."""
    log = tmp_path / f"{group}.log"
    start_at = time.monotonic() + 1.5  # after every interpreter has started
    procs = []
    for i in range(agents):
        argv = [
            sys.executable, "-m", "tests.fleet_agent", "--endpoint", etcd.url,
            "--name", f"gpu{i}", "--group", group, "--max", str(n), "--ttl", str(ttl),
            "--log", str(log), "--hold", str(hold), "--start-at", f"{start_at:.6f}",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(argv, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    for proc in procs:
        out, err = proc.communicate(timeout=45)
        assert proc.returncode == 0, err.decode()[-2000:]
        for line in out.decode().splitlines():
            assert json.loads(line)["event"] in CATALOGUE
    entries = []
    for line in log.read_text().splitlines():
        what, name, at = line.split()
        entries.append((what, name, float(at)))
    return entries


def most_at_once(entries: list[tuple[str, str, float]]) -> int:
    running, most = 0, 0
    # An end and a start at the same instant: the end first (its slot was given back after).
    for what, _name, _at in sorted(entries, key=lambda e: (e[2], e[0] == "start")):
        running += 1 if what == "start" else -1
        most = max(most, running)
    return most


@pytest.mark.parametrize("n", [1, 2])
def test_five_agents_never_more_than_n_at_once_and_all_restart(
    etcd: Etcd, tmp_path: Path, n: int
) -> None:
    entries = run_agents(etcd, tmp_path, f"five-{n}", n=n, agents=5, hold=0.6)
    starts = sorted(name for what, name, _at in entries if what == "start")
    assert starts == [f"gpu{i}" for i in range(5)]  # every one restarted, once
    assert sorted(name for what, name, _at in entries if what == "end") == starts
    assert most_at_once(entries) == n  # never more than n, and the n slots were used
    assert fleet_of(etcd.url, f"five-{n}").holders() == []  # every slot given back


def test_a_killed_holder_loses_its_slot_when_its_lease_expires(etcd: Etcd, tmp_path: Path) -> None:
    ttl = 3
    log = tmp_path / "kill.log"
    holder = subprocess.Popen(
        [
            sys.executable, "-m", "tests.fleet_agent", "--endpoint", etcd.url, "--name", "doomed",
            "--group", "kill", "--ttl", str(ttl), "--log", str(log), "--hold", "600",
        ],
        cwd=PROJECT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    watcher = fleet_of(etcd.url, "kill", lease_ttl=ttl, name="next")
    try:
        deadline = time.monotonic() + 15
        while not (log.exists() and "start doomed" in log.read_text()):
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(ttl * 1.5)  # renewed: it holds past its first TTL
        assert [h.host for h in watcher.holders()] == ["doomed"]
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        killed = time.monotonic()
        slot, holders = watcher.acquire("stall", "stall")
        assert slot is None and [h.host for h in holders] == ["doomed"]  # not freed by the death
        while watcher.holders():
            assert time.monotonic() - killed < ttl + 2, "the dead holder's slot was never freed"
            time.sleep(0.05)
        freed = time.monotonic() - killed
        slot, _holders = watcher.acquire("stall", "stall")
        assert slot is not None
        assert slot.release() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            holder.kill()
        holder.wait()
    # The lease was renewed every TTL/3 until the kill: it ends between 2/3 TTL and the TTL
    # after it (etcd checks expiries every 0.5 s).
    assert ttl / 3 < freed < ttl + 1.0, freed


# -- the daemon --------------------------------------------------------------------------------


class FakeActuator:
    """Stands in for the actuator (which needs systemd): counts restarts, can run ``during``."""

    unit = "vllm.service"

    def __init__(self, during: Any = None) -> None:
        self.reasons: list[str] = []
        self.during = during

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield

    def restart(
        self,
        reason: str,
        *,
        drain: bool = True,
        cause: str = "manual",
        plan: object = None,
        down: bool = False,
    ) -> Outcome:
        self.reasons.append(reason)
        if self.during is not None:
            self.during()
        return Outcome(action_id=1, result="done", message="ok", seconds=0.1, service_seconds=0.1)


def restart_decision(cause: str = "uptime_decline") -> Decision:
    return Decision(
        time=datetime.now(timezone.utc), action="restart", cause=cause,
        reason="restart: in window", evidence={}, ratio=0.6, window_open=True, next_window=None,
        uptime=3600.0, state=EngineState(), drain_max_in_flight=0,
    )  # fmt: skip


def daemon_with_fleet(
    tmp_path: Path, endpoint: str, clock: Clock | None = None, **fleet: object
) -> tuple[Daemon, io.StringIO]:
    keys: dict[str, object] = {"endpoints": [endpoint], "timeout": 0.5, "name": "gpu-here"}
    keys.update(fleet)
    path = write_config(tmp_path, "http://127.0.0.1:9", fleet=keys)
    stream = io.StringIO()
    return Daemon.offline(path, stream, clock or Clock()), stream


def fleet_events(stream: io.StringIO) -> list[dict[str, Any]]:
    return [e for e in events_of(stream) if str(e["event"]).startswith(("fleet.", "restart."))]


def test_daemon_takes_and_gives_back_a_slot_around_the_restart(etcd: Etcd, tmp_path: Path) -> None:
    watcher = fleet_of(etcd.url, "daemon")
    seen: list[list[str]] = []
    actuator = FakeActuator(during=lambda: seen.append([h.host for h in watcher.holders()]))
    daemon, stream = daemon_with_fleet(tmp_path, etcd.url, group="daemon")
    try:
        outcome = daemon.restarter.restart(daemon.parts, actuator, restart_decision())  # type: ignore[arg-type]
        assert outcome is not None and outcome.result == "done"
        assert seen == [["gpu-here"]]  # held during the restart
        assert watcher.holders() == []  # given back after it
        daemon.tick()
    finally:
        daemon.close()
    names = [e["event"] for e in fleet_events(stream)]
    assert names == [
        "fleet.slot_acquired", "restart.started", "restart.completed", "fleet.slot_released"
    ]  # fmt: skip
    report = status.read(tmp_path / "state")
    assert report is not None and report.fleet is not None and report.fleet.state == "idle"
    assert report.fleet.holders == () and report.fleet.group == "daemon"
    exposed = generate_latest(daemon.metrics.registry).decode()
    assert 'vkvagent_fleet_state{group="daemon",state="idle"} 1.0' in exposed
    assert 'vkvagent_fleet_state{group="daemon",state="unreachable"} 0.0' in exposed
    assert 'vkvagent_fleet_slots_held{group="daemon"} 0.0' in exposed
    assert 'vkvagent_fleet_max_concurrent{group="daemon"} 1.0' in exposed
    line = status_text.render(report, time.time())
    assert "  fleet       group daemon, 0 of 1 slots held; this host (gpu-here) idle" in line


def test_an_operators_restart_takes_a_slot_too_unless_told_not_to(
    etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = {"endpoints": [etcd.url], "group": "manual", "name": "gpu-here", "timeout": 0.5}
    path = write_config(tmp_path, "http://127.0.0.1:9", fleet=keys)
    # No system bus here: once admitted, the restart fails at D-Bus, after the slot is taken.
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/run/no-such-bus/system_bus_socket")
    other = fleet_of(etcd.url, "manual", name="gpu-other")
    held, _holders = other.acquire("stall", "stall: restart: emergency")
    assert held is not None

    def said(*argv: str) -> list[str]:
        """What the command printed to stderr (its progress, then its error), exit 1."""
        err = io.StringIO()
        assert main([*argv, "--config", str(path)], io.StringIO(), err) == 1
        return (capsys.readouterr().err + err.getvalue()).splitlines()

    refused = "all 1 slots of group manual are held: by gpu-other (slot 0)"
    assert said("restart")[-1] == f"vkvagent: {refused}; --ignore-fleet restarts anyway"
    lines = said("restart", "--ignore-fleet")
    assert not any("slot" in line for line in lines) and "bus" in lines[-1]  # on to systemd
    # Nothing to do asks no slot of the fleet.
    assert said("rollback") == [
        "vkvagent: nothing to roll back: vkvagent has not changed this unit"
    ]
    assert held.release() is None
    took, gave_back, failed = said("restart")
    assert took == "vkvagent: took slot 0 of 1 in group manual (lease 60 s) to restart"
    assert gave_back.startswith("vkvagent: gave back slot 0 of group manual after ")
    assert gave_back.endswith(" s (aborted)") and "bus" in failed  # the outcome, as it was
    assert other.holders() == []


def test_daemon_waits_for_a_slot_and_says_so_once(etcd: Etcd, tmp_path: Path) -> None:
    other = fleet_of(etcd.url, "busy", name="gpu-other")
    slot, _holders = other.acquire("stall", "stall: restart")
    assert slot is not None
    actuator = FakeActuator()
    daemon, stream = daemon_with_fleet(tmp_path, etcd.url, group="busy")
    try:
        for _tick in range(3):
            assert daemon.restarter.restart(daemon.parts, actuator, restart_decision()) is None  # type: ignore[arg-type]
        daemon.tick()
        assert slot.release() is None
        assert daemon.restarter.restart(daemon.parts, actuator, restart_decision()) is not None  # type: ignore[arg-type]
    finally:
        daemon.close()
    events = fleet_events(stream)
    assert [e["event"] for e in events][:2] == ["fleet.slot_waited", "fleet.slot_acquired"]
    assert "all 1 slots of group busy are held: by gpu-other (slot 0)" in events[0]["message"]
    assert actuator.reasons == ["uptime_decline: restart: in window"]
    report = status.read(tmp_path / "state")
    assert report is not None and report.fleet is not None
    assert report.fleet.state == "idle"  # the tick wanted no restart: not waiting now


def test_etcd_unreachable_holds_the_restart_with_a_clear_reason(tmp_path: Path) -> None:
    require_etcd()  # the marker's contract: run where the others run
    closed = f"http://127.0.0.1:{free_port()}"
    actuator = FakeActuator()
    daemon, stream = daemon_with_fleet(tmp_path, closed)
    try:
        for _tick in range(2):
            assert daemon.restarter.restart(daemon.parts, actuator, restart_decision()) is None  # type: ignore[arg-type]
        assert daemon.restarter.restart(daemon.parts, actuator, restart_decision("stall")) is None  # type: ignore[arg-type]
        daemon.tick()
        daemon.tick()
    finally:
        daemon.close()
    assert actuator.reasons == []  # fail closed: nothing restarted
    events = fleet_events(stream)
    assert [e["event"] for e in events] == ["fleet.unreachable"]  # once, not once per tick
    assert events[0]["level"] == "warning" and events[0]["effect"] == "held"
    assert events[0]["message"].startswith(
        "etcd unreachable: restart held (on_unreachable = hold): etcd unreachable: "
        f"{closed}: connection refused"
    )
    report = status.read(tmp_path / "state")
    assert report is not None and report.fleet is not None
    assert report.fleet.state == "unreachable"
    assert "connection refused" in (report.fleet.error or "")
    assert "  fleet       group default: etcd unreachable, restarts held (" in status_text.render(
        report, time.time()
    )


def test_emergency_only_lets_emergencies_restart_without_etcd(tmp_path: Path) -> None:
    require_etcd()
    closed = f"http://127.0.0.1:{free_port()}"
    actuator = FakeActuator()
    daemon, stream = daemon_with_fleet(tmp_path, closed, on_unreachable="emergency-only")
    try:
        assert daemon.restarter.restart(daemon.parts, actuator, restart_decision()) is None  # type: ignore[arg-type]
        outcome = daemon.restarter.restart(daemon.parts, actuator, restart_decision("stall"))  # type: ignore[arg-type]
        assert outcome is not None and outcome.result == "done"
    finally:
        daemon.close()
    assert actuator.reasons == ["stall: restart: in window"]
    events = fleet_events(stream)
    assert [(e["event"], e.get("effect")) for e in events] == [
        ("fleet.unreachable", "held"),
        ("fleet.unreachable", "emergency"),
        ("restart.started", None),
        ("restart.completed", None),
    ]
    assert "restarting without a slot: stall is an emergency cause" in events[1]["message"]


def test_etcd_down_then_back_holds_then_resumes(tmp_path: Path) -> None:
    (tmp_path / "etcd").mkdir()
    server = Etcd(tmp_path / "etcd").start()
    actuator = FakeActuator()
    later = [0.0]  # seconds the daemon's monotonic clock is ahead of the real one
    clock = Clock(mono=lambda: time.monotonic() + later[0])
    daemon, stream = daemon_with_fleet(tmp_path, server.url, clock, group="outage")
    try:
        assert daemon.restarter.restart(daemon.parts, actuator, restart_decision()) is not None  # type: ignore[arg-type]
        server.stop()
        assert daemon.restarter.restart(daemon.parts, actuator, restart_decision()) is None  # type: ignore[arg-type]
        daemon.tick()
        report = status.read(tmp_path / "state")
        assert report is not None and report.fleet is not None
        assert report.fleet.state == "unreachable"
        exposed = generate_latest(daemon.metrics.registry).decode()
        assert 'vkvagent_fleet_state{group="outage",state="unreachable"} 1.0' in exposed
        server.start()
        daemon.tick()
        assert status.read(tmp_path / "state").fleet.state == "unreachable"  # type: ignore[union-attr]
        later[0] += RETRY_AFTER
        daemon.tick()  # the status listing asks again, and notices etcd is back
        report = status.read(tmp_path / "state")
        assert report is not None and report.fleet is not None
        assert report.fleet.state == "idle"
        assert daemon.restarter.restart(daemon.parts, actuator, restart_decision()) is not None  # type: ignore[arg-type]
        assert fleet_of(server.url, "outage").holders() == []
    finally:
        daemon.close()
        server.stop()
    assert len(actuator.reasons) == 2
    names = [e["event"] for e in fleet_events(stream) if not e["event"].startswith("restart.")]
    assert names == [
        "fleet.slot_acquired", "fleet.slot_released",
        "fleet.unreachable",
        "fleet.reachable",
        "fleet.slot_acquired", "fleet.slot_released",
    ]  # fmt: skip


# -- configuration -----------------------------------------------------------------------------


def test_fleet_config_is_off_by_default_and_checked(tmp_path: Path) -> None:
    assert config.Config().fleet.endpoints == ()
    path = tmp_path / "config.toml"
    path.write_text(
        '[fleet]\nendpoints = ["https://etcd1:2379", "etcd2:2379"]\nusername = "vkv"\n'
        'on_unreachable = "restart"\n'
    )
    with pytest.raises(config.ConfigError) as caught:
        config.load(path, as_root=False)
    problems = "\n".join(caught.value.problems)
    assert 'config.toml:2: fleet.endpoints: list item string "etcd2:2379"' in problems
    assert 'fleet.on_unreachable: "restart" is not allowed (allowed: hold, emergency-only)' in (
        problems.replace("string ", "")
    )
    path.write_text('[fleet]\nendpoints = ["http://127.0.0.1:2379"]\nusername = "vkv"\n')
    with pytest.raises(config.ConfigError, match=r"fleet\.username: username and password_file"):
        config.load(path, as_root=False)


def test_the_password_comes_from_its_file_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    client = EtcdClient(["http://127.0.0.1:9"], username="vkv", password_file=str(tmp_path / "x"))
    with pytest.raises(FleetError) as caught:
        client.range_prefix("/vkvagent/")
    assert "cannot read password_file" in str(caught.value) and "\n" not in str(caught.value)


# -- TLS and authentication --------------------------------------------------------------------


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    files = make_certificates(tmp_path)
    tls = {"ca_file": str(files["ca"]), "cert_file": str(files["client"]),
           "key_file": str(files["client-key"])}  # fmt: skip
    server = Etcd(
        tmp_path, "--cert-file", str(files["server"]), "--key-file", str(files["server-key"]),
        "--client-cert-auth", "--trusted-ca-file", str(files["ca"]), scheme="https", **tls,
    )  # fmt: skip
    server.start()
    try:
        fleet = fleet_of(server.url, "tls", name="gpu-tls", **tls)
        slot, holders = fleet.acquire("stall", "stall")
        assert slot is not None and [h.host for h in holders] == ["gpu-tls"]
        assert slot.release() is None
        without = fleet_of(server.url, "tls", ca_file=str(files["ca"]))  # no client certificate
        with pytest.raises(FleetError) as caught:
            without.holders()
        assert str(caught.value).startswith(f"etcd unreachable: {server.url}: ")
        untrusted = fleet_of(server.url, "tls")  # the system's CAs do not know this one
        with pytest.raises(FleetError, match="certificate verify failed"):
            untrusted.holders()
    finally:
        server.stop()


def test_user_and_password_file_with_token_renewal(tmp_path: Path) -> None:
    server = Etcd(tmp_path, "--auth-token", "simple", "--auth-token-ttl", "1").start()
    admin = EtcdClient([server.url])
    prefix = "/vkvagent/fleet/"
    end = chr(ord(prefix[-1]) + 1)
    for path, body in [
        ("auth/user/add", {"name": "root", "password": "rootpw"}),
        ("auth/user/grant", {"user": "root", "role": "root"}),
        ("auth/user/add", {"name": "agent", "password": "s3cret"}),
        ("auth/role/add", {"name": "fleet"}),
        ("auth/role/grant", {"name": "fleet", "perm": {
            "permType": "READWRITE", "key": _b64(prefix), "range_end": _b64(prefix[:-1] + end),
        }}),
        ("auth/user/grant", {"user": "agent", "role": "fleet"}),
        ("auth/enable", {}),
    ]:  # fmt: skip
        admin.call(path, body)
    try:
        password = tmp_path / "password"
        password.write_text("s3cret\n")
        fleet = fleet_of(server.url, "auth", username="agent", password_file=str(password))
        slot, _holders = fleet.acquire("stall", "stall")
        assert slot is not None
        token = fleet.client._token
        time.sleep(2.5)  # etcd forgets the simple token after a second of disuse
        assert [h.host for h in fleet.holders()] == [fleet.host]  # authenticated again
        assert fleet.client._token not in (None, token)
        assert slot.release() is None
        anonymous = fleet_of(server.url, "auth")
        with pytest.raises(FleetError, match="user name is empty"):
            anonymous.holders()
        password.write_text("wrong\n")
        wrong = fleet_of(server.url, "auth", username="agent", password_file=str(password))
        with pytest.raises(FleetError, match=r"authentication as agent: .*invalid user ID or"):
            wrong.holders()
    finally:
        server.stop()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# -- the client's bounds -----------------------------------------------------------------------


def test_a_silent_or_wrong_peer_is_one_line_within_the_timeout_and_the_next_endpoint_answers(
    etcd: Etcd,
) -> None:
    def silent(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        stop.wait(5)  # accepts, reads, never answers

    def html(conn: socket.socket, _stop: threading.Event) -> None:
        read_request(conn)
        body = b"<html>not etcd</html>"
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip

    with RawServer(silent) as hung, RawServer(html) as wrong:
        client = EtcdClient([hung.url, wrong.url], timeout=0.3)
        began = time.monotonic()
        with pytest.raises(FleetError) as caught:
            client.range_prefix("/vkvagent/")
        assert time.monotonic() - began < 1.5
        assert str(caught.value) == (
            f"etcd unreachable: {hung.url}: no answer within 0.3 s; "
            f"{wrong.url}: HTTP 200: not a JSON answer (is this etcd?)"
        )
        closed = f"http://127.0.0.1:{free_port()}"
        fleet = Fleet(EtcdClient([closed, hung.url, etcd.url], timeout=0.3), group="failover")
        assert fleet.holders() == []  # the third endpoint answers
        began = time.monotonic()
        assert fleet.holders() == []  # and is asked first from then on
        assert time.monotonic() - began < 0.25


def test_a_hung_etcd_costs_the_tick_its_timeout_once_a_minute_not_at_every_tick() -> None:
    """The status's listing of the holders, and a slot for a restart: while etcd does not
    answer, asked again RETRY_AFTER later; the unreachable state and its events stand."""

    def silent(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        stop.wait(5)

    clock, said = [1000.0], Recorded()
    with RawServer(silent) as hung:
        cfg = FleetConfig(endpoints=(hung.url,), group="hung", timeout=0.3)
        gate = Gate(cfg, said, mono=lambda: clock[0])

        def report() -> float:
            began = time.monotonic()
            assert gate.report(wanting=False).state == "unreachable"
            return time.monotonic() - began

        assert report() >= 0.3  # asked, and no answer within the timeout
        began = time.monotonic()
        with gate.slot(cause="kv_pressure", reason="a restart", emergency=False) as turn:
            assert not turn.allowed and "etcd unreachable: restart held" in turn.admission.why
        assert time.monotonic() - began < 0.1  # not asked either
        for _tick in range(5):
            clock[0] += RETRY_AFTER / 6
            assert report() < 0.1  # not asked
        clock[0] += RETRY_AFTER / 6
        assert report() >= 0.3
    assert said.names() == ["fleet.unreachable", "fleet.unreachable"]  # idle, then held


def test_the_status_schema_names_every_state_a_gate_can_be_in() -> None:
    """status.FLEET_STATES is what the exporter and `status` list; the gate sets them."""
    import ast

    from vkvagent.adapters import fleet
    from vkvagent.knowledge.status import FLEET_STATES

    source = ast.parse(Path(fleet.__file__).read_text())
    set_to = {
        node.value.value
        for node in ast.walk(source)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and any(ast.unparse(target) == "self.state" for target in node.targets)
    }
    assert set_to == set(FLEET_STATES)
