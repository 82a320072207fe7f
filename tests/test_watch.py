"""What the daemon notices in the samples (vkvagent/service/watch.py): vLLM's process ending without
vkvagent asking, and why it is down, from the journal. The sources' and the probe's events
are tested with the daemon (test_daemon_sources.py, test_probe.py)."""

from __future__ import annotations

import io
import json
import time
from dataclasses import replace

import pytest

from tests.conftest import metrics
from vkvagent.adapters import unitlog
from vkvagent.engine.samples import Sample, UnitFacts
from vkvagent.knowledge.events import Events
from vkvagent.service.watch import JOURNAL_LAG, UnitWatch


def events_of(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_vllm_ending_without_vkvagent_asking_is_reported() -> None:
    """Told once per exit: brought back by Restart= (NRestarts counts up), or left stopped
    (vLLM 0.32 exits 0 when its engine dies: Restart=on-failure does nothing). vkvagent's own
    restart (a requested start sets NRestarts back to 0) is no such exit."""
    stream = io.StringIO()
    watch = UnitWatch(Events(stream=stream).emit)

    def seen(state: str, sub: str, restarts: int, invocation: str = "a", stopped: str = "") -> None:
        unit = UnitFacts(
            state, sub, invocation, 100, None, restarts, restart_policy="on-failure",
            last_exit="exited with status 0" if state == "inactive" else "",
        )  # fmt: skip
        sample = Sample(time=time.time(), mono=time.monotonic(), vllm=None, unit=unit)
        line = "RuntimeError: Engine core died" if state == "inactive" else ""
        watch.note(sample, {"stopped": stopped, "exit_line": line}, "vllm.service")

    for state, sub, restarts, invocation in (
        ("active", "running", 0, "a"),
        ("activating", "auto-restart", 1, "a"),  # the engine died; Restart= acts
        ("active", "running", 1, "b"),
        ("active", "running", 0, "c"),  # vkvagent's restart
        ("activating", "auto-restart", 1, "c"),  # a crash after it: 1 again, but new
        ("active", "running", 1, "d"),
        ("active", "running", 0, "e"),  # an operator's restart
        ("inactive", "dead", 0, "c"),  # exited 0 under Restart=on-failure
        ("inactive", "dead", 0, "c"),
        ("active", "running", 0, "f"),
    ):
        seen(state, sub, restarts, invocation)
    seen("inactive", "dead", 0, "f", stopped="systemd: Stopping vllm.service...")
    # A stop the tick caught half-way: vLLM's graceful shutdown takes seconds.
    seen("active", "running", 0, "g")
    seen("deactivating", "stop-sigterm", 0, "g")
    seen("inactive", "dead", 0, "g", stopped="systemd: Stopping vllm.service...")
    # A start that failed, a tick catching it half-way: no run of vLLM ended.
    seen("activating", "start", 0, "h")
    seen("deactivating", "stop-sigterm", 0, "h")
    seen("failed", "failed", 0, "h")
    exits = [e for e in events_of(stream) if e["event"] == "unit.exited"]
    assert [(e["restarted_by_systemd"], e["n_restarts"]) for e in exits] == [
        (True, 1),
        (True, 1),
        (False, 0),
        (False, 0),
        (False, 0),
    ]
    assert "Restart= started it again" in str(exits[0]["message"])
    assert exits[2]["message"] == (
        "vllm.service is inactive: vLLM exited with status 0 (RuntimeError: Engine core died), "
        "and systemd will not start it again (Restart=on-failure); nobody stopped it"
    )
    assert (exits[2]["exit"], exits[2]["error"]) == (
        "exited with status 0",
        "RuntimeError: Engine core died",
    )
    for stop in exits[3:]:
        assert stop["stopped_by"] == "systemd: Stopping vllm.service..."
        assert "stopped on purpose" in str(stop["message"])


def test_a_missing_error_line_is_looked_for_again_only_while_journald_may_lag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """journald can hold a dead process's last lines for a moment after systemd reports the
    unit down, so the journal is read again while no line was found, for JOURNAL_LAG seconds:
    a clean stop has none, and is not read every tick for as long as vLLM stays down."""
    reads: list[float] = []
    lines: list[str] = []
    monkeypatch.setattr(
        unitlog,
        "why_it_failed",
        lambda _unit, since: reads.append(since) or (lines[-1] if lines else None),
    )
    monkeypatch.setattr(unitlog, "stopped_on_purpose", lambda _unit, _since: "")
    watch = UnitWatch(Events(stream=io.StringIO()).emit)
    down = UnitFacts("inactive", "dead", "a", 0, None, 0, active_since=100.0)

    def tick(mono: float, unit: UnitFacts = down) -> dict[str, str]:
        sample = Sample(time=1e9 + mono, mono=mono, vllm=None, unit=unit)
        return watch.why_down(sample, "vllm.service")

    said = [tick(float(mono)) for mono in range(0, 121, 2)]
    assert len(reads) == JOURNAL_LAG / 2 and said[-1]["exit_line"] == ""
    failed = replace(down, active_state="failed", sub_state="failed")
    lines.append("RuntimeError: Engine core died")  # another state: read again, found
    assert tick(200.0, failed)["exit_line"] == "RuntimeError: Engine core died"
    assert tick(202.0, failed)["exit_line"] == "RuntimeError: Engine core died"
    assert len(reads) == JOURNAL_LAG / 2 + 1
    # A hang while active, vLLM answering again, then another hang in the same state: the
    # second is read afresh, not given the first one's answer.
    hung = replace(down, active_state="active", sub_state="running")
    lines.append("")
    assert tick(300.0, hung)["exit_line"] == ""
    answered = Sample(time=1e9 + 302, mono=302.0, vllm=metrics(), unit=hung)
    assert watch.why_down(answered, "vllm.service") == {}
    lines.append("torch.OutOfMemoryError: CUDA out of memory")
    assert tick(400.0, hung)["exit_line"] == "torch.OutOfMemoryError: CUDA out of memory"
