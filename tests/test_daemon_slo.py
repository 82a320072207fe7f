"""The operator's objectives ([slo]) as the daemon reports them: a line and a part of
status.json, the `vkvagent_slo_*` gauges, and one `slo.burning` or `slo.recovered` event per
crossing of a burn alert. In-process ticks on a clock this test moves, against a real loopback
vLLM page that does not change (so the engine counts nothing more), with the engine's tallies
set to burn as the test needs; and a restart's cut-off requests handed from the ledger to the
engine."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import read_page
from tests.httpserver import HttpServer
from tests.test_daemon import events_of, write_config
from tests.test_daemon_sources import INTERVAL, Moved
from vkvagent.adapters.ledger import Ledger
from vkvagent.engine.slo import Counts, SloSettings, SloState
from vkvagent.knowledge import status
from vkvagent.knowledge.events import Events
from vkvagent.service.daemon import Daemon
from vkvagent.tools.cli import main

PAGE = read_page("v1-0.10.prom").encode()
SLO = SloSettings(availability=0.999, ttft_seconds=2.0)
BURST = Counts(answered=900.0, failed=100.0, ttft_good=900.0, ttft_all=900.0)  # 10 % refused


@pytest.fixture
def vllm() -> Iterator[HttpServer]:
    routes = {"/metrics": lambda h: h.reply(200, PAGE), "/version": lambda h: h.reply(404, b"")}
    with HttpServer(routes) as server:
        yield server


def daemon_for(path: Path, moved: Moved, stream: io.StringIO) -> Daemon:
    return Daemon(
        path, clock=moved.clock(), events=Events(stream=stream, now=lambda: moved.at),
        notify=lambda _message: None, use_systemd=False,
    )  # fmt: skip


def burst(daemon: Daemon, at: float) -> None:
    """A tenth of the requests refused at ``at``: a burn rate of 100 in every window it is in."""
    daemon.state = replace(daemon.state, slo=daemon.state.slo.add(SLO, at, BURST))


def test_each_burn_alert_crossing_is_one_event_and_the_status_says_it(
    tmp_path: Path, vllm: HttpServer
) -> None:
    path = write_config(
        tmp_path,
        vllm.url,
        probe={"enabled": False},
        slo={"availability": 0.999, "ttft_seconds": 2.0},
    )
    moved, stream = Moved(), io.StringIO()
    daemon = daemon_for(path, moved, stream)
    assert daemon.parts.settings.slo == SLO  # [slo] as the engine reads it
    t0 = time.time() - 2 * INTERVAL  # `vkvagent status` reads the fast tick's status as current
    said: list[tuple[str, object]] = []

    def tick(to: float) -> status.StatusReport:
        moved.at = to
        daemon.tick()
        found = [e for e in events_of(stream) if str(e["event"]).startswith("slo.")]
        said.extend((str(e["event"]), e["alert"]) for e in found[len(said) :])
        report = status.read(tmp_path / "state")
        assert report is not None and report.slo is not None
        return report

    try:
        burst(daemon, t0 - 1200)  # in the 30 min window, not the 5 min one: a slow burn
        report = tick(t0)
        assert said == [("slo.burning", "slow")]
        tick(t0 + INTERVAL)  # still burning: nothing new
        assert said == [("slo.burning", "slow")]
        burst(daemon, t0 + 30)  # burning faster: the 1 h and 5 min windows too
        fast = tick(t0 + 2 * INTERVAL)
        assert said[1:] == [("slo.burning", "fast")]
        page = generate_latest(daemon.metrics.registry).decode()
        out = io.StringIO()
        code = main(["status", "--config", str(path)], out, io.StringIO())
        tick(t0 + 2 * INTERVAL + 600)  # the 5 min window is clear: back to slow, no event
        assert len(said) == 2
        recovered = tick(t0 + 3 * 3600)  # the 30 min window clear too: none
    finally:
        daemon.close()
    assert said == [("slo.burning", "slow"), ("slo.burning", "fast"), ("slo.recovered", "slow")]

    [availability, ttft] = report.slo.objectives if report.slo else ()
    assert (availability.objective, availability.burning) == ("availability", "slow")
    assert availability.words == "99.9 % of requests served" and availability.target == 0.999
    assert availability.attainment["1h"] == pytest.approx(0.9)
    assert availability.burn_rates["5m"] is None and availability.burn_rates["30m"] > 6
    # TTFT: every request within 2 s, so no budget spent and nothing burning.
    assert (ttft.objective, ttft.burning, ttft.budget_remaining) == ("ttft", None, 1.0)
    assert fast.slo is not None and fast.slo.fast() == ["availability"]
    assert recovered.slo is not None and recovered.slo.objectives[0].burning is None

    # The events carry the objective in words, its burn rates and the budget left.
    first = next(e for e in events_of(stream) if e["event"] == "slo.burning")
    assert first["objective"] == "availability" and first["words"] == availability.words
    assert set(first["burn_rates"]) == {"5m", "30m", "1h", "6h"}  # type: ignore[arg-type]
    assert first["budget_remaining"] == availability.budget_remaining
    assert str(first["message"]).startswith(
        "availability error budget burning slow (99.9 % of requests served): burn rate 5m -, "
    )
    # The gauges, and the check: a fast burn makes a healthy verdict a warning.
    gauges = {
        (f.name, s.labels["objective"], s.labels.get("window")): s.value
        for f in text_string_to_metric_families(page)
        for s in f.samples
        if f.name.startswith("vkvagent_slo_")
    }
    assert gauges[("vkvagent_slo_burn_rate", "availability", "5m")] == pytest.approx(100.0)
    assert gauges[("vkvagent_slo_attainment", "ttft", "1h")] == 1.0
    assert len(gauges) == 2 + 2 * 3 + 2 + 2 * 4  # targets, attainments, budgets, burn rates
    assert code == 1, out.getvalue()
    head, *lines = out.getvalue().splitlines()
    assert " WARNING - availability error budget burning fast (verdict " in head
    assert " slo_availability=" in head and " slo_ttft_budget=100.0%;;;;100" in head
    assert any(x.startswith("  slo         99.9 % of requests served: ") for x in lines)


def test_without_slo_nothing_is_reported(tmp_path: Path, vllm: HttpServer) -> None:
    path = write_config(tmp_path, vllm.url, probe={"enabled": False})
    moved, stream = Moved(), io.StringIO()
    daemon = daemon_for(path, moved, stream)
    try:
        # Tallies from a time [slo] was declared: kept, but nothing reported.
        daemon.state = replace(daemon.state, slo=SloState().add(SLO, moved.at - 60, BURST))
        daemon.tick()
        page = generate_latest(daemon.metrics.registry).decode()
    finally:
        daemon.close()
    report = status.read(tmp_path / "state")
    assert report is not None and report.slo is None
    assert json.loads(status.path(tmp_path / "state").read_text())["slo"] is None
    assert "vkvagent_slo_" not in page
    assert not [e for e in events_of(stream) if str(e["event"]).startswith("slo.")]


def test_a_restarts_cut_off_requests_go_from_the_ledger_to_the_engine(tmp_path: Path) -> None:
    """The actuator's costs, as the ledger keeps them, are each restart record's cut_off and
    refused: the daemon's own restart leaves no sample of its outage, so the actuator's
    estimate of the requests that arrived meanwhile is what the budget is charged."""
    path = write_config(tmp_path, "http://127.0.0.1:9")
    now = time.time()
    with Ledger(tmp_path / "state") as ledger:
        for reason, costs, minutes_ago in (
            (
                "stall: restart: emergency",
                {"drain_mode": "none", "aborted": 4.0, "missed": 90.0},
                30,
            ),
            (
                "uptime_decline: restart: in window",
                {"drain_mode": "vllm", "aborted": 0.0, "missed": float("nan")},
                20,
            ),
            ("kv_pressure: restart", None, 10),  # aborted before vLLM was stopped: no costs
        ):
            action = ledger.begin("restart", reason, now - minutes_ago * 60, {})
            notes = {} if costs is None else {"costs": costs}
            ledger.end(action, "done", now - minutes_ago * 60 + 5, notes=notes)
    daemon = Daemon.offline(path, io.StringIO())
    try:
        found = [
            (r.cause, r.cut_off, r.refused, r.ended)
            for r in daemon.restarts.records(daemon.parts.ledger, now, 1000.0)
        ]
    finally:
        daemon.close()
    assert found == [  # ended: the span the refused requests were counted over
        ("stall", 4.0, 90.0, now - 30 * 60 + 5),
        ("uptime_decline", 0.0, None, now - 20 * 60 + 5),
        ("kv_pressure", None, None, now - 10 * 60 + 5),
    ]
