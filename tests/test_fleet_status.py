"""`vkvagent fleet status`: what each host publishes of itself, checked as it is read back,
and against a real etcd (tests/test_fleet.py's), daemons publishing, a host gone silent
counted unknown and then gone, a garbage entry refused by name, etcd down."""

from __future__ import annotations

import dataclasses
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.etcd import Etcd
from tests.test_daemon import write_config
from tests.test_fleet import (
    Recorded,
    daemon_with_fleet,
    etcd_fixture,  # noqa: F401 - the `etcd` fixture
    fleet_of,
)
from tests.test_status import NOW, report
from vkvagent.adapters.fleet import ENTRIES_PAGE, ENTRY_LEASE, Gate
from vkvagent.knowledge.config import FleetConfig
from vkvagent.knowledge.fleet_view import FleetView, HostEntry
from vkvagent.knowledge.status import SlotHolder, StatusCode, StatusError
from vkvagent.tools.cli import main

SECRET = "sk-do-not-publish"
DEGRADED = report(
    "degraded",
    verdict={"state": "degraded", "action": "hold", "cause": "uptime_decline",
             "reason": "outside window (next 2026-12-07T02:00:00Z)", "ratio": 0.71,
             "evidence": {"argv": f"vllm serve --api-key {SECRET}"}},
    last_restart={"kind": "restart", "reason": "uptime_decline: speed 0.70", "started": NOW - 7200,
                  "ended": NOW - 7100, "outcome": "done", "recovered": True,
                  "hooks": [{"name": "pre_stop", "output": SECRET}]},
)  # fmt: skip


def entry_text(entry: HostEntry, **changed: Any) -> str:
    return json.dumps({**entry.to_json(), **changed})


def test_an_entry_says_the_verdict_and_nothing_secret() -> None:
    entry = HostEntry.of(DEGRADED, "gpu-a", NOW + 5, every=300.0)
    published = entry.to_json()
    assert SECRET not in json.dumps(published)
    assert published["schema"] == 1 and (entry.state, entry.code) == ("degraded", 1)
    assert (entry.cause, entry.ratio, entry.vllm_version) == ("uptime_decline", 0.71, "0.11.0")
    assert entry.last_restart is not None and entry.last_restart.recovered is True
    assert entry.stale_after == 330.0  # the next publish, and three samples (10 s) more
    assert HostEntry.parse("gpu-a", entry_text(entry)) == entry
    acting = report("acting", stale_after=600.0)
    assert HostEntry.of(acting, "gpu-a", NOW, every=30.0).stale_after == 600.0  # a restart's length


@pytest.mark.parametrize(
    ("host", "changed", "refusal"),
    [
        ("gpu-a", {"schema": 2}, r"schema 2: newer than this vkvagent reads \(1\)"),
        ("gpu-a", {"schema": None}, "schema None: expected 1"),
        ("gpu-b", {}, "it names another host, 'gpu-a'"),
        ("gpu-a", {"ratio": "fast"}, "ratio: expected a number, got text"),
        ("gpu-a", {"state": "fine"}, "state 'fine', code 1: not vkvagent's"),
        ("gpu-a", {"code": 7}, "state 'degraded', code 7: not vkvagent's"),
        ("gpu-a", {"reason": "x" * 5000}, "bytes, over the 4096 it may have"),
    ],
)
def test_an_entry_that_is_not_one_of_vkvagents_is_refused_saying_why(
    host: str, changed: dict[str, Any], refusal: str
) -> None:
    entry = HostEntry.of(DEGRADED, "gpu-a", NOW, every=30.0)
    with pytest.raises(StatusError, match=refusal):
        HostEntry.parse(host, entry_text(entry, **changed))
    with pytest.raises(StatusError, match="not JSON"):
        HostEntry.parse("gpu-a", "{")


def test_the_group_exits_as_its_worst_host_and_a_silent_one_is_unknown() -> None:
    def at(state: str, host: str, published: float) -> tuple[str, str]:
        return host, entry_text(HostEntry.of(report(state), host, published, every=30.0))

    healthy, degraded = at("healthy", "gpu-a", NOW - 10), at("degraded", "gpu-b", NOW - 20)
    silent = at("healthy", "gpu-c", NOW - 91)  # three publishes missed, and one second
    critical = at("critical", "gpu-d", NOW)
    holder = SlotHolder(slot=0, host="gpu-b", cause="uptime_decline")

    def view(*entries: tuple[str, str]) -> FleetView:
        return FleetView.of("g", 1, NOW, entries, [holder])

    assert view(healthy).code == StatusCode.HEALTHY
    assert view(healthy, degraded).code == StatusCode.DEGRADED
    assert view(healthy, degraded, silent).code == StatusCode.UNKNOWN
    assert view(healthy, degraded, silent, critical).code == StatusCode.CRITICAL
    assert view().code == StatusCode.UNKNOWN
    assert view(healthy, ("gpu-x", "garbage")).code == StatusCode.UNKNOWN

    shown = view(degraded, silent, healthy, ("gpu-x", "garbage")).render(NOW)
    lines = shown.splitlines()
    assert lines[0] == "fleet group g: 3 hosts, 1 of 1 restart slots held by gpu-b (slot 0)"
    assert lines[1].split() == ["HOST", "STATE", "CAUSE", "VLLM", "UPTIME", "SPEED", "LAST",
                                "ACTION", "SLOT", "ENTRY"]  # fmt: skip
    assert lines[2].split()[:2] == ["gpu-a", "healthy"]
    assert lines[3].split()[:3] == ["gpu-b", "degraded", "-"] and " 0  " in lines[3]
    assert lines[4].split()[:2] == ["gpu-c", "unknown"]
    assert lines[4].endswith("2 min ago, stale (was healthy)")
    assert lines[5] == "refused gpu-x: not JSON"


def fleet_status(path: Path, *options: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["fleet", "status", "--config", str(path), *options], out)
    return code, out.getvalue()


def line_of(shown: str, host: str) -> str:
    (line,) = [line for line in shown.splitlines() if line.startswith(f"{host} ")]
    return line


@pytest.mark.fleet
def test_fleet_status_over_etcd_ages_out_a_silent_host_and_refuses_garbage(
    etcd: Etcd, tmp_path: Path
) -> None:
    daemons = []
    for name in ("gpu-a", "gpu-b"):
        (tmp_path / name).mkdir()
        daemon, _stream = daemon_with_fleet(tmp_path / name, etcd.url, group="view", name=name)
        daemons.append(daemon)
    try:
        for daemon in daemons:
            daemon.tick()  # vLLM does not answer: each publishes that
        path = tmp_path / "gpu-a" / "config.toml"
        code, said = fleet_status(path, "--json")
        view = json.loads(said)
        hosts = {h["host"]: h for h in view["hosts"]}
        assert sorted(hosts) == ["gpu-a", "gpu-b"] and view["refused"] == []
        for host in hosts.values():
            assert (host["stale"], host["slot"]) == (False, None)
            assert host["stale_after"] == 360.0  # a publish every 5 min, and 3 samples of 20 s
            assert (host["state"], host["exit_code"]) == ("critical", 2)
        assert code == view["code"] == StatusCode.CRITICAL

        # A host whose daemon stops publishing: unknown once its entry is stale, then gone
        # when its lease ends (ENTRY_LEASE publishes).
        gate = Gate(FleetConfig(endpoints=(etcd.url,), group="view", name="gpu-c"), Recorded(),
                    publish_every=0.5)  # fmt: skip
        gate.publish(report("healthy", updated=time.time(), interval=0.1))  # stale after 0.8 s
        assert line_of(fleet_status(path)[1], "gpu-c").split()[1] == "healthy"
        time.sleep(1.6)
        code, said = fleet_status(path)
        assert code == StatusCode.CRITICAL  # the others' vLLM is down: critical outranks unknown
        line = line_of(said, "gpu-c")
        assert line.split()[1] == "unknown" and line.endswith("stale (was healthy)")
        deadline = time.monotonic() + ENTRY_LEASE * 0.5 + 10
        while "gpu-c" in fleet_status(path)[1] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "gpu-c" not in fleet_status(path)[1]

        # Garbage under the hosts' prefix is refused by name; the others still show.
        fleet_of(etcd.url, "view").client.put("/vkvagent/fleet/view/hosts/gpu-x", "{oops", "0")
        said = fleet_status(path)[1]
        assert "refused gpu-x: not JSON" in said
        assert line_of(said, "gpu-a") and line_of(said, "gpu-b")
    finally:
        for daemon in daemons:
            daemon.close()

    # etcd down: unknown, in one line, as `vkvagent status` says it.
    etcd.stop()
    try:
        code, said = fleet_status(path)
        assert code == StatusCode.UNKNOWN
        assert said.startswith("fleet status unknown: group view: etcd unreachable")
    finally:
        etcd.start()


@pytest.mark.fleet
def test_a_host_publishes_on_its_cadence_and_at_once_when_its_verdict_changes(etcd: Etcd) -> None:
    cfg = FleetConfig(endpoints=(etcd.url,), group="cadence", name="gpu-a")
    gate, reader = Gate(cfg, Recorded(), publish_every=3600.0), fleet_of(etcd.url, "cadence")

    def published() -> HostEntry:
        ((host, raw),) = reader.entries()
        return HostEntry.parse(host, raw)

    gate.publish(report("healthy", updated=time.time()))
    first = published()
    # Only the speed and the reason changed, and the next publish is an hour away: no put,
    # no revision for etcd to keep.
    again = report("healthy", updated=time.time())
    gate.publish(dataclasses.replace(again, verdict=dataclasses.replace(
        again.verdict, ratio=0.91, reason="healthy: speed 0.91")))  # fmt: skip
    assert published() == first
    gate.publish(report("degraded", updated=time.time()))
    assert (published().state, published().code) == ("degraded", 1)


@pytest.mark.fleet
def test_a_group_of_more_hosts_than_a_page_is_read_whole(etcd: Etcd) -> None:
    fleet = fleet_of(etcd.url, "many")
    names = [f"gpu-{i:03}" for i in range(2 * ENTRIES_PAGE + 5)]
    for name in names:
        fleet.client.put(f"{fleet.hosts_prefix}{name}", name, "0")
    assert fleet.entries() == [(name, name) for name in names]


def test_without_a_fleet_it_is_unknown_in_one_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, "http://127.0.0.1:9")
    code, said = fleet_status(path)
    assert code == StatusCode.UNKNOWN
    assert (
        said
        == "fleet status unknown: no [fleet] endpoints in the config: this host is in no group\n"
    )
    code, said = fleet_status(path, "--json")
    assert (code, json.loads(said)["code"]) == (StatusCode.UNKNOWN, 3)
