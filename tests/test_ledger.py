"""The action ledger (SQLite): what it keeps, and what it refuses to open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from vkvagent.adapters.ledger import FILE_NAME, SCHEMA_VERSION, Ledger, LedgerError


def test_an_action_its_steps_and_its_outcome_are_kept_across_opens(tmp_path: Path) -> None:
    with Ledger(tmp_path) as ledger:
        action = ledger.begin("restart", "stall: restart: emergency", 100.0, {"drain": False})
        ledger.step(action, "preflight", "begin", 100.5)
        ledger.step(action, "preflight", "done", 101.0)
        assert ledger.open_action() is not None
    with Ledger(tmp_path) as ledger:
        found = ledger.open_action()
        assert found is not None and found.id == action and found.finished("preflight")
        ledger.end(action, "aborted", 102.0)
        assert ledger.open_action() is None
        [kept] = ledger.since(50.0)
        assert (kept.kind, kept.outcome, kept.detail) == ("restart", "aborted", {"drain": False})


def test_what_an_action_cost_joins_its_detail_when_it_ends(tmp_path: Path) -> None:
    with Ledger(tmp_path) as ledger:
        action = ledger.begin("restart", "manual: test", 100.0, {"previous_dropin": None})
        costs = {"drain": "vllm", "in_flight": 3.0, "aborted": 0.0}
        ledger.end(action, "done", 140.0, {"costs": costs})
        ledger.end(action, "failed", 150.0, {"costs": {}})  # an ended action stays as it ended
        kept = ledger.action(action)
        assert (kept.outcome, kept.ended) == ("done", 140.0)
        assert kept.detail == {"previous_dropin": None, "costs": costs}


def test_a_ledger_from_a_newer_vkvagent_is_refused_and_left_alone(tmp_path: Path) -> None:
    with Ledger(tmp_path) as ledger:
        ledger.begin("restart", "uptime_decline: restart: in window", 100.0, {})
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    before = (tmp_path / FILE_NAME).read_bytes()
    with pytest.raises(LedgerError) as caught:
        Ledger(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path / FILE_NAME}: ledger schema {SCHEMA_VERSION + 1} is newer than this "
        f"vkvagent supports ({SCHEMA_VERSION})"
    )
    assert (tmp_path / FILE_NAME).read_bytes() == before
