"""`vkvagent status`'s verdicts, exit codes and staleness, on status documents as the daemon
writes them (the daemon's own writing is tested in test_daemon.py)."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from vkvagent.knowledge import status, status_text
from vkvagent.knowledge.status import (
    FlagChange,
    FlagsStatus,
    FleetStatus,
    GpuStatus,
    LastProbe,
    LastRestart,
    LoadNow,
    PolicyStatus,
    ProbeStatus,
    RecentEvent,
    SloObjective,
    SloStatus,
    SlotHolder,
    SourceFailure,
    StatusCode,
    StatusError,
    StatusReport,
    TrendPoint,
    UnitStatus,
    Verdict,
    VllmStatus,
    add_trend,
    exit_code,
    is_stale,
    verdict_state,
)
from vkvagent.knowledge.status_check import Range, checked, headline
from vkvagent.knowledge.status_text import costs_line, render, sparkline

NOW = 1_800_000_000.0
GONE = 2**22 + 7  # above Linux's largest PID: a writer that no longer runs


def document(state: str, **extra: Any) -> dict[str, Any]:
    """A status document with only the keys the first version wrote that status reads."""
    return {
        "version": 1, "updated": NOW, "pid": os.getpid(),
        "pid_namespace": status.pid_namespace(), "agent_version": "0.1.0",
        "interval": 10.0, "unit_name": "vllm.service", "unit": None, "unit_error": None,
        "vllm": {"version": "0.11.0", "flavor": "v1-latest", "uptime_s": 7200.0},
        "now": {"tokens_per_s": 5000.0},
        "verdict": {"state": state, "action": "none", "cause": None, "reason": "healthy: ...",
                    "ratio": 0.98, "evidence": {"itl": 0.02}},
        "policy": {"mode": "observe", "window_open": False, "next_window": None,
                   "budget_left": 3},
        **extra,
    }  # fmt: skip


def report(state: str, **extra: Any) -> StatusReport:
    return StatusReport.from_json(document(state, **extra))


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


def test_a_stale_status_headlines_unknown_with_the_last_verdict_beneath() -> None:
    """The headline says what the exit code (3) says; the old verdict is history."""
    silent = report("healthy")  # written by a process that still runs (this one)
    assert exit_code(silent, NOW + 3600) == StatusCode.UNKNOWN
    head, beneath = render(silent, NOW + 3600).splitlines()[:2]
    assert (
        head == "vkvagent 0.1.0: UNKNOWN (stale: last update 60 min ago, daemon running but silent)"
    )
    assert beneath == f"  last state  HEALTHY at {_iso(NOW)}"
    assert render(silent, NOW + 5).splitlines()[0].startswith("vkvagent 0.1.0: HEALTHY | ")


def test_a_status_whose_daemon_is_gone_is_unknown_at_once() -> None:
    """Stopped or crashed: no need to wait out the staleness bound (a minute) to say so."""
    stopped = report("healthy", pid=GONE)
    assert is_stale(stopped, NOW + 5)
    assert exit_code(stopped, NOW + 5) == StatusCode.UNKNOWN
    head = render(stopped, NOW + 5).splitlines()[0]
    assert head == "vkvagent 0.1.0: UNKNOWN (stale: last update 5 s ago, daemon not running)"
    # Without a PID, or read from another PID namespace (a monitoring container), where that
    # PID means another process, it can only be judged by its age.
    for unseen in (report("healthy", pid=None), report("healthy", pid=GONE, pid_namespace=1)):
        assert exit_code(unseen, NOW + 5) == StatusCode.HEALTHY
        assert exit_code(unseen, NOW + 61) == StatusCode.UNKNOWN
        assert "daemon not visible from here" in render(unseen, NOW + 61).splitlines()[0]


def test_status_json_always_has_every_key() -> None:
    written = report("degraded")
    full = status.shown_json(written, NOW + 5, "vllm.service")
    assert (full["exit_code"], full["stale"]) == (1, False)
    assert status.shown_json(written, NOW + 3600, "vllm.service")["stale"] is True
    blank = status.shown_json(None, NOW, "vllm-7b.service")
    assert blank.keys() == full.keys()  # the whole schema, not just {"exit_code": 3}
    for part in ("verdict", "policy", "vllm", "now"):
        assert blank[part].keys() == full[part].keys(), part
    assert blank["exit_code"] == StatusCode.UNKNOWN and blank["stale"] is False
    assert blank["verdict"]["state"] == "unknown"
    assert blank["verdict"]["reason"].startswith("no status yet: the daemon has not run")
    assert blank["unit_name"] == "vllm-7b.service"
    assert blank["updated"] is None and blank["policy"]["mode"] is None
    assert blank["now"]["tokens_per_s"] is None and blank["last_restart"] is None


def test_a_stale_status_json_says_unknown_and_keeps_the_last_state_apart() -> None:
    """`jq .verdict.state` must not say healthy for a dead daemon."""
    stopped = status.shown_json(report("healthy", pid=GONE), NOW + 5, "vllm.service")
    assert (stopped["stale"], stopped["exit_code"]) == (True, 3)
    assert stopped["verdict"]["state"] == "unknown"
    assert stopped["last_state"] == "healthy"
    assert stopped["verdict"]["reason"] == (
        "stale: last update 5 s ago, daemon not running; last verdict: healthy: ..."
    )
    current = status.shown_json(report("degraded"), NOW + 5, "vllm.service")
    assert current["verdict"]["state"] == current["last_state"] == "degraded"
    assert status.shown_json(None, NOW, "vllm.service")["last_state"] is None


def failing(source: str, for_seconds: float) -> dict[str, Any]:
    return {"source": source, "error": "bus unavailable", "since": NOW - for_seconds}


@pytest.mark.parametrize(
    ("failed", "action", "cause", "reason", "state"),
    [
        ("systemd", "none", None, "healthy: speed 1.00", "impaired"),
        ("gpu", "hold", "uptime_decline", "outside window", "impaired"),
        ("systemd", "restart", "stall", "restart: emergency", "impaired"),  # it would fail
        ("systemd", "none", "engine_down", "/metrics unreachable", "critical"),  # worse wins
        ("gpu", "hold", "kv_pressure", "escalated: the last 2 restarts", "escalated"),
        # vLLM's /metrics failing is the engine's own finding once it names a cause for it.
        ("vllm", "none", None, "learning: warm-up", "impaired"),
        ("vllm", "restart", "unresponsive", "restart: emergency", "acting"),
        ("vllm", "none", "engine_down", "/metrics unreachable", "critical"),
    ],
)
def test_an_agent_that_cannot_act_is_impaired_unless_worse_or_diagnosed(
    failed: str, action: str, cause: str | None, reason: str, state: str
) -> None:
    word = verdict_state(action=action, cause=cause, reason=reason, has_data=True, failed=(failed,))
    assert word == state


def test_a_source_failing_for_three_intervals_is_named_and_exits_1() -> None:
    # A blip (two 10 s intervals) is not yet a failure the agent cannot act through.
    blip = report("healthy", failing=[failing("systemd", 20.0)])
    assert status.failed_sources(blip.failing, NOW, blip.interval) == []
    held = report("impaired", failing=[failing("systemd", 30.0), failing("gpu", 5.0)])
    assert [f.source for f in status.failed_sources(held.failing, NOW, 10.0)] == ["systemd"]
    assert exit_code(held, NOW + 5) == StatusCode.DEGRADED
    # The wall clock stepped back an hour (NTP) while it failed: its monotonic duration holds.
    stepped = SourceFailure("systemd", "bus unavailable", since=NOW + 3600, seconds=30.0)
    assert status.failed_sources([stepped], NOW, 10.0) == [stepped]
    shown = render(held, NOW + 5).splitlines()
    assert shown[0].startswith("vkvagent 0.1.0: IMPAIRED (systemd failing) | ")
    assert "  failing     systemd for 30 s: bus unavailable (no restart can happen)" in shown
    assert "  failing     gpu for 5 s: bus unavailable (no GPU-fault veto)" in shown


def test_render_ends_with_the_last_events_and_their_time() -> None:
    events = [
        {"time": NOW - 90, "event": "source.failed", "message": "systemd: bus unavailable"},
        {"time": NOW - 30, "event": "decision.changed", "message": "none: healthy"},
    ]
    shown = render(report("healthy", events=events), NOW).splitlines()
    assert shown[-3:] == [
        "",
        f"{_iso(NOW - 90)} source.failed: systemd: bus unavailable",
        f"{_iso(NOW - 30)} decision.changed: none: healthy",
    ]


# -- the monitoring-plugin check ---------------------------------------------------------------

# The plugin guidelines' performance data: 'label'=value[UOM];[warn];[crit];[min];[max], with
# U for a value not known, ranges as [@]start:end, trailing empty fields left out.
NUMBER = r"-?[0-9]+(?:\.[0-9]+)?"
RANGE = rf"@?(?:~|{NUMBER})?:?(?:{NUMBER})?"
PERF = rf"(?:'[^'=]+'|[^ '=]+)=(?:{NUMBER}(?:%|s|ms|us|B|KB|MB|TB|c)?|U)(?:;(?:{RANGE})?){{0,4}}"
FIRST_LINE = re.compile(rf"^[^|\n]+ \| {PERF}(?: {PERF})*$")


def test_the_first_line_carries_performance_data_in_the_guidelines_grammar() -> None:
    current = report("healthy", now={"tokens_per_s": 5000.0, "kv_usage": 0.423})
    warning, critical = Range.parse("0.8:"), Range.parse("0.6:")
    head = render(current, NOW + 5, warning=warning, critical=critical).splitlines()[0]
    assert FIRST_LINE.match(head), head
    assert head.split(" | ")[1] == (
        "speed_ratio=0.980;0.8:;0.6:;0 kv_usage=42.3%;;;0;100 throughput=5000.0;;;0 "
        "restarts_left=3;;;0"
    )
    unknown = report("healthy", verdict={**document("healthy")["verdict"], "ratio": None})
    head = render(unknown, NOW + 5).splitlines()[0]
    assert FIRST_LINE.match(head) and "speed_ratio=U;;;0 kv_usage=U;" in head
    # No figures for a stale status, or none: they would be graphed as current.
    assert "|" not in render(current, NOW + 3600).splitlines()[0]
    assert render(None, NOW) == (
        "vkvagent 0.1.0: UNKNOWN - no status yet: the daemon has not run (or cannot write its "
        "state)\n"
    )


@pytest.mark.parametrize(
    ("text", "alerts", "passes"),
    [
        ("0.8:", [0.79, 0.0], [0.8, 1.2]),  # below 0.8
        ("~:0.5", [0.51], [0.5, -1.0]),  # above 0.5
        ("0.5:1.5", [0.4, 1.6], [0.5, 1.0, 1.5]),  # outside
        ("@0.5:0.7", [0.5, 0.6, 0.7], [0.49, 0.71]),  # inside
        (":0.9", [0.95, -0.1], [0.0, 0.9]),  # an empty start is 0
    ],
)
def test_thresholds_read_the_plugin_guidelines_ranges(
    text: str, alerts: list[float], passes: list[float]
) -> None:
    limit = Range.parse(text)
    assert [limit.alerts(v) for v in alerts] == [True] * len(alerts)
    assert [limit.alerts(v) for v in passes] == [False] * len(passes)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0.8", "a bare number is the range 0..0.8 (an alert above it); for an alert below it"),
        ("fast:", "expected [@]start:end"),
        ("abc", "threshold 'abc': expected [@]start:end"),
        ("0.9:0.1", "its start is above its end"),
    ],
)
def test_a_threshold_that_cannot_mean_a_speed_limit_is_refused(text: str, problem: str) -> None:
    with pytest.raises(StatusError, match=re.escape(problem)):
        Range.parse(text)


def test_thresholds_on_the_speed_ratio_raise_the_exit_code_never_lower_it() -> None:
    w, c = Range.parse("0.8:"), Range.parse("0.6:")
    slow = report("healthy", verdict={**document("healthy")["verdict"], "ratio": 0.7})
    assert checked(slow, NOW + 5) == (StatusCode.HEALTHY, "")
    assert checked(slow, NOW + 5, w, c) == (
        StatusCode.DEGRADED, "speed ratio 0.70 outside the warning range 0.8:",
    )  # fmt: skip
    head = render(slow, NOW + 5, warning=w, critical=c).splitlines()[0]
    assert head.startswith(
        "vkvagent 0.1.0: WARNING - speed ratio 0.70 outside the warning range 0.8: (verdict "
        "HEALTHY) | speed_ratio=0.700;0.8:;0.6:;0 "
    )
    assert checked(slow, NOW + 5, w, Range.parse("0.75:"))[0] == 2
    # A worse verdict stays; a stale one stays unknown, its old ratio judged by nobody.
    critical = report("critical", verdict={**document("critical")["verdict"], "ratio": 0.99})
    assert checked(critical, NOW + 5, w, c) == (StatusCode.CRITICAL, "")
    assert checked(slow, NOW + 3600, w, c) == (StatusCode.UNKNOWN, "")


def test_render_shows_a_suggestion_as_flags_and_where_to_review_it() -> None:
    verdict = {**document("degraded")["verdict"], "cause": "kv_pressure"}
    verdict["suggestion"] = {"enable-prefix-caching": True, "max-num-seqs": 32}
    line = next(
        x for x in render(report("degraded", verdict=verdict), NOW).splitlines()
        if x.startswith("  suggestion")
    )  # fmt: skip
    assert line == (
        "  suggestion  --enable-prefix-caching --max-num-seqs 32 "
        "(review it as a change: vkvagent plan --suggested)"
    )


def test_render_shows_the_band_beside_the_speed_ratio() -> None:
    verdict = {**document("healthy")["verdict"], "ratio": 0.8}
    banded = report("healthy", verdict={**verdict, "enter_ratio": 0.75, "leave_ratio": 0.85})
    assert "speed vs fresh baseline 0.80 (slow below 0.75, back above 0.85)\n" in render(
        banded, NOW + 5
    )
    # A status written before the band reads without it, and shows the ratio alone.
    older = report("healthy", verdict=verdict)
    assert (older.verdict.enter_ratio, older.verdict.leave_ratio) == (None, None)
    assert "speed vs fresh baseline 0.80\n" in render(older, NOW + 5)


def unit_document(restart_policy: str | None, wanted: bool | None) -> dict[str, Any]:
    """The unit as status.json writes it; a key that is None is left out, as an older
    vkvagent wrote it."""
    unit: dict[str, Any] = {"active_state": "active", "sub_state": "running", "main_pid": 77,
                            "n_restarts": 0}  # fmt: skip
    if restart_policy is not None:
        unit["restart_policy"] = restart_policy
    if wanted is not None:
        unit["wanted"] = wanted
    return unit


def with_unit(restart_policy: str | None, wanted: bool | None, mode: str = "enforce") -> str:
    """The warning line of `vkvagent status` ("" when none) for a unit and a policy mode."""
    policy = {**document("healthy")["policy"], "mode": mode}
    shown = report("healthy", unit=unit_document(restart_policy, wanted), policy=policy)
    lines = [x for x in render(shown, NOW + 5).splitlines() if x.startswith("  warning")]
    assert len(lines) <= 1
    return lines[0][len("  warning     ") :] if lines else ""


LEFT_DOWN = (
    "vllm.service has Restart=on-failure: vLLM exits 0 when its engine dies (vLLM 0.32 does), "
    "and systemd then leaves it down"
)


def test_render_warns_of_a_unit_vllms_exit_0_leaves_down_saying_who_starts_it() -> None:
    assert with_unit("on-failure", True) == (
        f"{LEFT_DOWN}; vkvagent starts it again within a sample interval (enforce mode, "
        "max_per_day allowing), but set Restart=always to have systemd do it at once"
    )
    assert with_unit("on-failure", True, "observe") == (
        f"{LEFT_DOWN}, and vkvagent in observe mode does not start it: set Restart=always"
    )
    assert with_unit("on-failure", None, "") == f"{LEFT_DOWN}: set Restart=always"
    for policy in ("no", "on-abnormal", "on-abort", "on-watchdog"):
        assert with_unit(policy, True).startswith(f"vllm.service has Restart={policy}: ")
    assert with_unit("always", True) == with_unit("on-success", True) == ""
    # Written by a vkvagent that did not read them: nothing known, nothing said.
    assert with_unit(None, None) == ""


def test_render_warns_of_a_unit_nothing_wants() -> None:
    assert with_unit("always", False) == (
        "vllm.service is not enabled, or masked, and no unit wants it: it does not start at "
        "boot, and vkvagent does not start it when it is down; systemctl enable vllm.service "
        "(unmask it first if masked)"
    )
    assert with_unit("on-failure", False) == (
        "vllm.service is not enabled, or masked, and no unit wants it, and it has "
        "Restart=on-failure: vLLM exits 0 when its engine dies (vLLM 0.32 does), and then "
        "neither systemd nor vkvagent starts it again; set Restart=always, and systemctl "
        "enable vllm.service (unmask it first if masked)"
    )


def test_the_units_warning_changes_neither_the_exit_code_nor_the_first_line() -> None:
    """A unit's settings are the operator's to fix, not a state of vLLM to page for: the check
    stays what the verdict and thresholds make it, and status.json carries the facts."""
    w, c = Range.parse("0.8:"), Range.parse("0.6:")
    for state in ("healthy", "degraded", "critical"):
        fine = report(state, unit=unit_document("always", True))
        left = report(state, unit=unit_document("on-failure", False))
        assert checked(left, NOW + 5, w, c) == checked(fine, NOW + 5, w, c)
        assert headline(left, NOW + 5, w, c) == headline(fine, NOW + 5, w, c)
        assert "\n  warning     " in render(left, NOW + 5)
        assert "\n  warning" not in render(fine, NOW + 5)
    unit = json.loads(json.dumps(left.to_json()))["unit"]
    assert (unit["restart_policy"], unit["wanted"]) == ("on-failure", False)
    assert StatusReport.from_json(left.to_json()) == left
    older = report("healthy", unit=unit_document(None, None)).unit
    assert older is not None and (older.restart_policy, older.wanted) == ("", None)


def test_render_explains_and_draws_the_trend() -> None:
    trend: tuple[TrendPoint, ...] = ()
    for minute in range(0, 120, 5):
        trend = add_trend(trend, NOW + minute * 60, 5000.0 - minute * 10, None)
    trend = add_trend(trend, NOW + 116 * 60, 1.0, None)  # 1 min after the last: not kept
    assert len(trend) == 24 and trend[-1].tokens_per_s == 5000.0 - 115 * 10
    shown = render(report("healthy", trend=[p.to_json() for p in trend]), NOW, explain=True)
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


# -- the document: one schema, written and read back ------------------------------------------


# [slo] of availability 99.9 % and TTFT within 2 s for 95 %, as the daemon writes it (the
# engine's ``Objective.to_json()``): availability overspent, TTFT burning fast.
SLO: dict[str, Any] = {
    "period_days": 28.0,
    "objectives": [
        {"objective": "availability", "words": "99.9 % of requests served", "target": 0.999,
         "attainment": {"1h": 0.99995, "1d": 0.9991, "period": 0.99855},
         "budget_remaining": -0.45, "burn_rates": {"5m": 0.0, "30m": 0.2, "1h": 0.05, "6h": 1.1},
         "burning": None},
        {"objective": "ttft", "words": "95 % of requests' first token within 2 s",
         "target": 0.95, "attainment": {"1h": 0.2, "1d": 0.9641, "period": 0.96},
         "budget_remaining": 0.2, "burn_rates": {"5m": 17.0, "30m": 16.0, "1h": 16.0, "6h": 3.0},
         "burning": "fast"},
    ],
}  # fmt: skip


def full_report() -> StatusReport:
    """A report with every part set, as the daemon builds it while restarting."""
    last_probe = LastProbe(time=NOW - 30, outcome="timeout", latency_s=30.0, detail="no data")
    holder = SlotHolder(0, "gpu-a", 123, "stall", "stall: emergency", NOW - 60, lease="7587")
    return StatusReport(
        updated=NOW,
        agent_version="0.1.0",
        interval=10.0,
        unit_name="vllm.service",
        verdict=Verdict(
            state="acting",
            action="restart",
            reason="restart: in window",
            cause="uptime_decline",
            ratio=0.7,
            evidence={"itl": 0.02, "why": None},
            suggestion={"max-num-seqs": 128},
        ),
        policy=PolicyStatus(
            mode="enforce",
            window_open=False,
            budget_left=2,
            next_window="2027-01-15T02:00:00+00:00",
            paused_until="2027-01-15T03:00:00+00:00",
        ),
        pid=4242,
        unit=UnitStatus("active", "running", main_pid=77, n_restarts=1, memory_bytes=2**33),
        unit_error=None,
        vllm=VllmStatus(
            version="0.11.0", flavor="v1-latest", recognised=True, uptime_s=7200.0, error=None
        ),
        now=LoadNow(
            tokens_per_s=5000.0,
            requests_per_s=2.5,
            kv_usage=0.4,
            preemptions_per_s=0.0,
            prefix_hit_ratio=0.3,
            ttft_p50_s=0.12,
            itl_p50_s=0.02,
            running=12.0,
            waiting=1.0,
        ),
        gpus=(GpuStatus(0, 71.0, 1410.0, 1980.0, ("sw_power_cap",), ("sw_power_cap",)),),
        last_restart=LastRestart(
            kind="restart",
            reason="uptime_decline: restart",
            started=NOW - 3600,
            id=4,
            ended=NOW - 3540,
            outcome="done",
            recovered=True,
            costs={"drain_mode": "vllm", "in_flight": 3.0},
            hooks=({"name": "post_ready", "problem": None},),
        ),
        probe=ProbeStatus(
            enabled=True, wanted=True, in_flight_s=12.0, last=last_probe, failing="timeout: no data"
        ),
        flags=FlagsStatus(
            apply="next-window",
            desired={"gpu-memory-utilization": 0.85, "max-num-seqs": 4},
            running={"gpu-memory-utilization": 0.9, "max-num-seqs": 4},
            pending={"gpu-memory-utilization": 0.85},
            due="apply --gpu-memory-utilization 0.85",
            waiting_for="outside window (next 2026-12-03T02:00:00Z)",
            last_change=FlagChange(
                action=3,
                flags={"max-num-seqs": 4},
                verdict="worse",
                ratio=0.61,
                speed_before=20.5,
                speed_after=12.5,
                loads=("16-23 generated tokens/s",),
                rollback="done (action 4)",
            ),
        ),
        trend=(TrendPoint(NOW - 300, 5100.0, 0.75), TrendPoint(NOW, 5000.0, None)),
        fleet=FleetStatus(
            group="default",
            host="gpu-b",
            max_concurrent=1,
            state="waiting",
            on_unreachable="hold",
            lease_ttl=30.0,
            error=None,
            holders=(holder,),
            listed=NOW - 5,
        ),
        slo=SloStatus.from_json(SLO),
        failing=(SourceFailure("gpu", "NVML: driver not loaded", NOW - 60),),
        events=(RecentEvent(NOW - 60, "source.failed", "gpu: NVML: driver not loaded"),),
        stale_after=900.0,
        progress="draining: 3 requests in flight",
    )


def test_a_full_report_survives_its_own_document() -> None:
    written = full_report()
    document = json.loads(json.dumps(written.to_json()))
    assert list(document) == [
        "version", "updated", "agent_version", "interval", "unit_name", "verdict", "policy",
        "pid", "pid_namespace", "unit", "unit_error", "vllm", "now", "gpus", "last_restart",
        "probe", "flags", "trend", "fleet", "slo", "failing", "events", "stale_after",
        "progress",
    ]  # fmt: skip
    assert document["trend"] == [[NOW - 300, 5100.0, 0.75], [NOW, 5000.0, None]]
    assert document["fleet"]["holders"][0]["lease"] == "7587"
    assert StatusReport.from_json(document) == written
    assert StatusReport.from_json(document).to_json() == written.to_json()
    # Not restarting: neither key is written, as before.
    idle = StatusReport.from_json(dict(document, stale_after=None, progress=None))
    assert "stale_after" not in idle.to_json() and "progress" not in idle.to_json()
    # A document of an older version, with pending flags as they were written, still reads.
    older = dict(document, pending_flags="unknown: no unit", flags=None)
    assert StatusReport.from_json(older).flags is None
    shown = render(written, NOW)
    assert "  fleet       group default, 1 of 1 slots held: gpu-a (slot 0" in shown
    assert (
        "  flags       due: apply --gpu-memory-utilization 0.85 (running "
        "--gpu-memory-utilization 0.9 --max-num-seqs 4); waiting for outside window (next "
        "2026-12-03T02:00:00Z)"
    ) in shown
    assert (
        "  last change action 3 --max-num-seqs 4: worse: 0.61 of the previous fresh speed "
        "(20.5 -> 12.5 tokens/s per request at 16-23 generated tokens/s); rolled back: done "
        "(action 4)"
    ) in shown


def test_an_old_document_reads_with_what_it_lacked_as_unknown() -> None:
    """The first version's keys only: no probe, fleet, costs, restart in progress."""
    old = StatusReport.from_json(document("healthy"))
    assert old.probe is None and old.fleet is None and old.last_restart is None
    assert old.vllm.recognised is None and old.now.running is None and old.gpus == ()
    assert old.verdict.suggestion == {} and old.policy.paused_until is None
    assert old.trend == () and old.stale_after is None and old.flags is None
    assert old.slo is None  # written before [slo], or without one
    rewritten = old.to_json()
    assert rewritten["now"]["tokens_per_s"] == 5000.0 and rewritten["probe"] is None
    assert StatusReport.from_json(rewritten) == old


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"updated": "yesterday"}, "updated: expected a number, got text"),
        ({"verdict": None}, "verdict: expected an object, got nothing"),
        ({"verdict": {"state": 3}}, "verdict.state: expected text, got an integer"),
        ({"policy": {"mode": "observe", "window_open": "no", "budget_left": 3}},
         "policy.window_open: expected true or false, got text"),
        ({"gpus": [{"index": 0}, {"index": True}]}, "gpus[1].index: expected an integer"),
        ({"trend": [[NOW, 1.0]]}, "trend[0]: expected [at, tokens_per_s, ratio], got a list"),
        ({"fleet": {"group": "g"}}, "fleet.host: expected text, got nothing"),
        ({"flags": {"apply": "manual", "desired": {}, "last_change": {"action": 1}}},
         "flags.last_change.flags: expected an object, got nothing"),
        ({"version": 2}, "version: expected 1, got 2"),
        ({"slo": {"period_days": 28, "objectives": [{**SLO["objectives"][0], "burning": 1}]}},
         "slo.objectives[0].burning: expected text, got an integer"),
        ({"slo": {"period_days": 28, "objectives": [
            {**SLO["objectives"][0], "attainment": {"1h": "high"}}]}},
         "slo.objectives[0].attainment.1h: expected a number, got text"),
        ({"slo": {"period_days": 28, "objectives": [
            {**SLO["objectives"][0], "attainment": {"1h": float("nan")}}]}},
         "slo.objectives[0].attainment.1h: expected a finite number, got nan"),
        ({"last_restart": {"kind": "restart", "reason": "r", "started": NOW,
                           "costs": {"drain_seconds": "2 s"}}},
         "last_restart.costs.drain_seconds: expected a number, got text"),
    ],
)  # fmt: skip
def test_garbage_is_one_status_error_naming_its_place(change: dict[str, Any], problem: str) -> None:
    with pytest.raises(StatusError) as raised:
        StatusReport.from_json(dict(document("healthy"), **change))
    assert str(raised.value).startswith(problem) and "\n" not in str(raised.value)
    with pytest.raises(StatusError, match=r"^status: expected an object, got a list$"):
        StatusReport.from_json([])


def test_read_tells_a_damaged_file_from_a_document_that_does_not_fit(tmp_path: Path) -> None:
    assert status.read(tmp_path) is None  # none yet
    status.path(tmp_path).write_text("{half a docu")
    with pytest.raises(StatusError, match=r"status\.json: damaged, not JSON \(the daemon rewr"):
        status.read(tmp_path)
    status.path(tmp_path).write_text(json.dumps(document("healthy", version=2)))
    with pytest.raises(StatusError, match=r"status version 2, this one reads 1\): restart the"):
        status.read(tmp_path)
    status.path(tmp_path).write_text(json.dumps(full_report().to_json()))
    assert status.read(tmp_path) == full_report()
    status.path(tmp_path).write_text(json.dumps(document("healthy", unit_name=None)))
    with pytest.raises(StatusError, match=r"status\.json: unit_name: expected text, got nothing$"):
        status.read(tmp_path)


# -- the operator's objectives ([slo]) ---------------------------------------------------------


def with_slo(state: str, burning: str | None = "fast", **extra: Any) -> StatusReport:
    """A current status with SLO's objectives, TTFT's burn alert set to ``burning``."""
    ttft = {**SLO["objectives"][1], "burning": burning}
    return report(state, slo={**SLO, "objectives": [SLO["objectives"][0], ttft]}, **extra)


def test_render_gives_a_line_per_objective_with_its_windows_and_budget() -> None:
    shown = render(with_slo("healthy"), NOW + 5).splitlines()
    assert [line for line in shown if line.startswith("  slo")] == [
        # Digits enough to tell a miss from the target: two decimals for 99.9 %.
        "  slo         99.9 % of requests served: 99.99 % (1 h), 99.91 % (1 d), 99.85 % "
        "(28 d); budget left -45 % (overspent)",
        "  slo         95 % of requests' first token within 2 s: 20.0 % (1 h), 96.4 % (1 d), "
        "96.0 % (28 d); budget left 20 %; burning fast",
    ]
    explained = render(with_slo("healthy"), NOW + 5, explain=True).splitlines()
    at = explained.index(shown[next(i for i, x in enumerate(shown) if "first token" in x)])
    assert explained[at + 1] == (
        "              burn rate 5m 17.0, 30m 16.0, 1h 16.0, 6h 3.0 (1: the budget lasts "
        "exactly 28 d)"
    )
    # Declared, nothing counted yet (a fresh agent, an idle server).
    fresh = {
        "objective": "itl", "words": "95 % of output tokens within 100 ms", "target": 0.95,
        "attainment": {"1h": None, "1d": None, "period": None}, "burn_rates": {"5m": None},
    }  # fmt: skip
    line = status_text.slo_line(SloObjective.from_json(fresh), 28.0)
    assert line == "95 % of output tokens within 100 ms: nothing counted yet"
    assert "  slo" not in render(report("healthy"), NOW + 5)  # no [slo]


def test_perfdata_has_each_objectives_period_attainment_and_budget() -> None:
    head = render(with_slo("healthy", burning=None), NOW + 5).splitlines()[0]
    assert FIRST_LINE.match(head), head
    assert head.endswith(
        "restarts_left=3;;;0 slo_availability=99.855%;;;0;100 slo_availability_budget=-45.0%;;;;100"
        " slo_ttft=96.000%;;;0;100 slo_ttft_budget=20.0%;;;;100"
    )
    unknown = {**SLO["objectives"][0], "attainment": {}, "budget_remaining": None}
    head = render(report("healthy", slo={**SLO, "objectives": [unknown]}), NOW + 5).splitlines()[0]
    assert FIRST_LINE.match(head) and head.endswith(
        " slo_availability=U;;;0;100 slo_availability_budget=U;;;;100"
    )


def test_a_fast_burn_raises_a_healthy_check_to_warning_and_a_slow_one_does_not() -> None:
    """Fast: 2 % of a month's budget in an hour, the workbook's page; the verdict's own
    critical states stay vLLM down, a GPU fault and escalation."""
    assert checked(with_slo("healthy"), NOW + 5) == (
        StatusCode.DEGRADED, "ttft error budget burning fast",
    )  # fmt: skip
    head = render(with_slo("healthy"), NOW + 5).splitlines()[0]
    assert head.startswith(
        "vkvagent 0.1.0: WARNING - ttft error budget burning fast (verdict HEALTHY) | "
    )
    assert checked(with_slo("healthy", burning="slow"), NOW + 5) == (
        StatusCode.HEALTHY,
        "",
    )
    assert checked(with_slo("degraded"), NOW + 5) == (StatusCode.DEGRADED, "")
    assert checked(with_slo("critical"), NOW + 5) == (StatusCode.CRITICAL, "")
    assert checked(with_slo("healthy"), NOW + 3600) == (
        StatusCode.UNKNOWN,
        "",
    )  # stale
    # A speed threshold crossed says so, and may go further than the burn does.
    slow = {**document("healthy")["verdict"], "ratio": 0.5}
    limited = checked(with_slo("healthy", verdict=slow), NOW + 5, None, Range.parse("0.6:"))
    assert limited == (StatusCode.CRITICAL, "speed ratio 0.50 outside the critical range 0.6:")
    # `status --json` carries the raised code, as the command exits with it.
    code, _why = checked(with_slo("healthy"), NOW + 5)
    shown = status.shown_json(with_slo("healthy"), NOW + 5, "vllm.service", code=code)
    assert shown["exit_code"] == 1 and shown["slo"]["objectives"][1]["burning"] == "fast"
