"""The ledger's restarts as the policy reads them (vkvagent/service/restarting.py): which count, and
each placed once on the monotonic clock. The restart the daemon carries out is tested with the
daemon (test_daemon.py, test_fleet.py, test_daemon_systemd.py)."""

from __future__ import annotations

import io
import time
from pathlib import Path

from vkvagent.adapters.exporter import AgentMetrics
from vkvagent.adapters.ledger import Ledger
from vkvagent.knowledge.events import Events
from vkvagent.service.restarting import RestartBook


def book() -> RestartBook:
    return RestartBook({}, Events(stream=io.StringIO()).emit, AgentMetrics())


def test_the_ledger_gives_the_policy_restarts_and_aborted_attempts(tmp_path: Path) -> None:
    now = time.time()
    with Ledger(tmp_path / "state") as ledger:
        for kind, reason, outcome, hours_ago in (
            ("restart", "uptime_decline: restart: in window", "done", 30),
            ("apply", "manual", "rolled-back", 20),
            ("restart", "stall: restart: emergency", "aborted", 0.2),
            ("restart", "long ago: restart", "done", 9 * 24),  # past the 8 days looked at
        ):
            action = ledger.begin(kind, reason, now - hours_ago * 3600, {})
            ledger.end(action, outcome, now - hours_ago * 3600 + 10)
        found = [(r.cause, r.aborted) for r in book().records(ledger, now, 1000.0)]
    assert found == [("uptime_decline", False), ("manual", False), ("stall", True)]


def test_restarts_are_placed_on_the_monotonic_clock_once_whatever_the_wall_clock_does(
    tmp_path: Path,
) -> None:
    """One restart taken on this boot's clock (the ledger kept its monotonic time and the
    boot's id), one from another boot (only its wall time means anything): stepping the wall
    clock a day either way changes neither's age."""
    wall = time.time()
    with Ledger(tmp_path / "state", boot="this-boot") as ledger:
        here = ledger.begin("restart", "stall: restart", wall - 600, {}, mono=5000.0)
        ledger.end(here, "done", wall - 590)
    with Ledger(tmp_path / "state", boot="an-earlier-boot") as ledger:
        before = ledger.begin("restart", "kv_pressure: restart", wall - 7200, {}, mono=1e6)
        ledger.end(before, "done", wall - 7190)
    restarts = book()
    with Ledger(tmp_path / "state", boot="this-boot") as ledger:
        ages = []
        for step, mono in ((0.0, 5600.0), (86400.0, 5660.0), (-86400.0, 5720.0)):
            records = restarts.records(ledger, wall + (mono - 5600.0) + step, mono)
            ages.append([round(r.age(wall + step, mono)) for r in records])
    # This boot's from its own monotonic time; the earlier boot's aged by the wall clock when
    # first read, then 60 s a step like the other.
    assert ages == [[600, 7200], [660, 7260], [720, 7320]]
