"""`vkvagent status`'s verdicts, exit codes and staleness, on status documents as the daemon
writes them (the daemon's own writing is tested in test_daemon.py)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from vkvagent.status import (
    StatusCode,
    add_trend,
    costs_line,
    exit_code,
    is_stale,
    render,
    sparkline,
    verdict_state,
)

NOW = 1_800_000_000.0


def report(state: str, **extra: Any) -> dict[str, Any]:
    return {
        "version": 1, "updated": NOW, "pid": 2**22 + 7, "agent_version": "0.1.0",
        "interval": 10.0, "unit_name": "vllm.service", "unit": None, "unit_error": None,
        "vllm": {"version": "0.11.0", "flavor": "v1-latest", "uptime_s": 7200.0},
        "now": {"tokens_per_s": 5000.0},
        "verdict": {"state": state, "action": "none", "cause": None, "reason": "healthy: ...",
                    "ratio": 0.98, "evidence": {"itl": 0.02}},
        "policy": {"mode": "observe", "window_open": False, "next_window": None,
                   "budget_left": 3},
        **extra,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("action", "cause", "reason", "has_data", "state"),
    [
        ("none", None, "healthy: speed 1.00", True, "healthy"),
        ("none", None, "learning: warm-up", True, "healthy"),
        ("hold", "uptime_decline", "outside window", True, "degraded"),
        ("hold", "gpu_throttle", "vetoed: gpu_throttle", True, "degraded"),
        ("restart", "stall", "restart: emergency", True, "acting"),
        ("hold", "kv_pressure", "escalated: the last 2 restarts", True, "escalated"),
        ("none", "engine_down", "/metrics unreachable", True, "critical"),
        ("none", "gpu_fault", "vetoed: gpu_fault", True, "critical"),
        ("none", None, "no sample", False, "unknown"),
    ],
)
def test_verdict_states(
    action: str, cause: str | None, reason: str, has_data: bool, state: str
) -> None:
    assert verdict_state(action=action, cause=cause, reason=reason, has_data=has_data) == state


@pytest.mark.parametrize(
    ("state", "code"),
    [
        ("healthy", StatusCode.HEALTHY),
        ("degraded", StatusCode.DEGRADED),
        ("acting", StatusCode.DEGRADED),
        ("escalated", StatusCode.CRITICAL),
        ("critical", StatusCode.CRITICAL),
        ("unknown", StatusCode.UNKNOWN),
    ],
)
def test_exit_codes(state: str, code: StatusCode) -> None:
    assert exit_code(report(state), NOW + 5) == code


def test_a_silent_daemon_is_unknown_but_a_restart_in_progress_is_not() -> None:
    assert exit_code(None, NOW) == StatusCode.UNKNOWN
    assert not is_stale(report("healthy"), NOW + 60)
    assert is_stale(report("healthy"), NOW + 61)  # three 10 s intervals, at least a minute
    acting = report("acting", stale_after=900.0)
    assert exit_code(acting, NOW + 600) == StatusCode.DEGRADED
    assert exit_code(acting, NOW + 901) == StatusCode.UNKNOWN
    shown = render(report("healthy"), NOW + 3600)
    assert "last update 60 min ago; daemon not running" in shown.splitlines()[0]


def test_render_explains_and_draws_the_trend() -> None:
    trend: list[list[Any]] = []
    for minute in range(0, 120, 5):
        trend = add_trend(trend, NOW + minute * 60, 5000.0 - minute * 10, None)
    trend = add_trend(trend, NOW + 116 * 60, 1.0, None)  # 1 min after the last: not kept
    assert len(trend) == 24 and trend[-1][1] == 5000.0 - 115 * 10
    shown = render(report("healthy", trend=trend), NOW, explain=True)
    line = next(x for x in shown.splitlines() if x.startswith("  trend"))
    spark = line.split()[1]
    assert len(spark) == 24 and spark[0] == "█" and spark[-1] == "▁"  # falling
    assert "last 1.9 h" in line
    assert "evidence" in shown and "itl" in shown
    assert sparkline([None, 1.0, 2.0]) == " ▁█"


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def test_render_shows_the_probe() -> None:
    def line(probe: dict[str, Any]) -> str:
        shown = render(report("healthy", probe=probe), NOW)
        return next(x for x in shown.splitlines() if x.startswith("  probe"))

    assert line({"enabled": False}) == "  probe       off"
    last = {"time": NOW - 30, "outcome": "timeout", "latency_s": 30.0,
            "detail": "no data for 30 s (read timeout)"}  # fmt: skip
    assert line({"enabled": True, "in_flight_s": 12.0, "last": last}) == (
        "  probe       in flight for 12 s; last timeout in 30.00 s at "
        f"{_iso(NOW - 30)} (no data for 30 s (read timeout))"
    )
    ok = {"time": NOW, "outcome": "ok", "latency_s": 0.042, "detail": ""}
    assert line({"enabled": True, "last": ok}).endswith("last ok in 0.04 s at " + _iso(NOW))
    unsent = {"enabled": True, "failing": "unusable: vLLM names several models or none"}
    assert "cannot be sent: unusable: vLLM names several" in line(unsent)
    assert "none sent yet" in line({"enabled": True})
    assert "probe" not in render(report("healthy"), NOW)  # a status from before the probe


def test_render_shows_the_restart_in_progress_and_what_the_last_one_cost() -> None:
    last = {
        "id": 4, "kind": "apply", "reason": "manual: test", "started": NOW - 60,
        "ended": NOW - 10, "outcome": "done", "recovered": None,
        "costs": {"drain_mode": "vllm", "in_flight": 3.0, "aborted": 0.0, "drain_seconds": 0.885,
                  "down_seconds": 55.173, "missed": 19.1},
        "hooks": [{"name": "post_ready", "problem": "exited with status 1"}],
    }  # fmt: skip
    progress = "stopping: vLLM finishing 2 requests in flight (3 s of at most 120 s)"
    lines = render(report("acting", last_restart=last, progress=progress), NOW).splitlines()
    assert f"  restarting  {progress}" in lines
    at = lines.index(next(x for x in lines if x.startswith("  last action apply")))
    assert lines[at + 1 : at + 3] == [
        "              drained by vLLM in 0.9 s, 0 of 3 in flight cut off, down 55.2 s (about "
        "19 requests turned away)",
        "              post_ready failed: exited with status 1",
    ]
    cut = {"drain_mode": "none", "in_flight": 4.0, "aborted": 4.0, "drain_seconds": None,
           "down_seconds": 37.4, "missed": None}  # fmt: skip
    assert costs_line(cut) == "not drained, 4 of 4 in flight cut off, down 37.4 s"
    busy = {"drain_mode": "busy", "in_flight": 9.0, "aborted": 9.0, "drain_seconds": 120.0,
            "down_seconds": None, "missed": None}  # fmt: skip
    assert costs_line(busy) == "no quiet moment came in 120.0 s, 9 of 9 in flight cut off"
