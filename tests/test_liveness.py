"""Whether vLLM is up (vkvagent/engine/liveness.py) and what the policy lets vkvagent do about
a vLLM that serves nothing: exits counted from the unit's facts, starts measured, the start
timeout learned, and a crash loop's starts backed off and escalated."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

import pytest

from tests.conftest import metrics
from vkvagent.engine import EngineState, Observation, Settings, decide
from vkvagent.engine.liveness import (
    Found,
    LivenessSettings,
    LivenessState,
    judge,
    observe,
)
from vkvagent.engine.policy import Controls, PolicySettings, RestartRecord, Verdict, evaluate
from vkvagent.engine.samples import Sample, UnitFacts

T0 = 1_741_000_000.0
SETTINGS = LivenessSettings()
ACTIVE = UnitFacts(
    "active", "running", "a" * 32, 7, None, 0, active_since=T0, restart_policy="on-failure",
    wanted=True,
)  # fmt: skip
DOWN = replace(
    ACTIVE, active_state="failed", sub_state="failed", main_pid=0, last_exit="exited with status 0"
)
METRICS = metrics()


def sample(at: float, unit: UnitFacts | None, answered: bool = True) -> Sample:
    return Sample(T0 + at, 1000.0 + at, METRICS if answered else None, None, unit=unit)


def watched(*samples: Sample, stopped: str = "") -> LivenessState:
    state = LivenessState()
    for s in samples:
        state = observe(SETTINGS, state, [s], stopped=stopped)
    return state


def test_exits_are_counted_from_restarts_and_from_a_unit_left_down() -> None:
    state = watched(
        sample(10, ACTIVE),
        sample(20, replace(ACTIVE, n_restarts=2)),  # two exits that systemd restarted
        sample(30, DOWN),  # and one it left down
    )
    assert state.exits == (1020.0, 1020.0, 1030.0)
    # A requested start sets NRestarts back to 0: that is no exit.
    assert watched(sample(10, replace(ACTIVE, n_restarts=3)), sample(20, ACTIVE)).exits == ()


def test_a_stop_someone_asked_for_is_no_exit() -> None:
    assert (
        watched(sample(10, ACTIVE), sample(20, DOWN), stopped="Stopping vllm.service").exits == ()
    )


def test_exits_age_out_of_the_window_and_a_reboot_forgets_them() -> None:
    state = watched(sample(10, ACTIVE), sample(20, DOWN))
    assert state.exits == (1020.0,)
    later = observe(SETTINGS, state, [sample(20 + 3600, DOWN)], stopped="")
    assert later.exits == ()
    assert state.forget_monotonic().exits == ()


def test_a_start_watched_from_its_beginning_is_measured_and_sets_the_timeout() -> None:
    assert LivenessState().timeout(SETTINGS) == 600.0  # none measured: the default
    state = watched(sample(5, ACTIVE, answered=False), sample(65, ACTIVE, answered=False))
    assert state.loading == T0 and state.starts == ()
    state = observe(SETTINGS, state, [sample(95, ACTIVE)], stopped="")
    assert state.starts == (95.0,) and state.loading is None
    assert state.timeout(SETTINGS) == 285.0  # three times the longest start
    assert replace(state, starts=(10.0,)).timeout(SETTINGS) == 120.0  # the floor
    assert state.timeout(replace(SETTINGS, start_timeout=50.0)) == 50.0  # the operator's word
    # A daemon that arrives at a vLLM already serving (or long loading) measures nothing.
    assert watched(sample(600, ACTIVE, answered=False), sample(700, ACTIVE)).starts == ()


def judged(
    unit: UnitFacts,
    state: LivenessState | None = None,
    *,
    stopped: str = "",
    exit_line: str = "",
    answered_at: float | None = None,
) -> tuple[Found | None, str]:
    return judge(
        SETTINGS, state or LivenessState(), sample(1000, unit, answered=False), stopped=stopped,
        exit_line=exit_line, answered_at=answered_at, mono=2000.0,
    )  # fmt: skip


def test_a_wanted_unit_that_exited_and_stays_down_is_dead() -> None:
    found, _ = judged(DOWN, exit_line="RuntimeError: Engine core died")
    assert found is not None and found.cause == "dead" and not found.reported
    assert found.summary == (
        "vLLM exited with status 0 and nobody stopped it; Restart=on-failure leaves it down: "
        "RuntimeError: Engine core died"
    )
    assert found.evidence["error"] == "RuntimeError: Engine core died"


@pytest.mark.parametrize(
    ("unit", "stopped", "note"),
    [
        (DOWN, "Stopping vllm.service", "stopped on purpose (Stopping vllm.service)"),
        (replace(DOWN, wanted=False), "", "the unit is not enabled"),
        (replace(DOWN, sub_state="auto-restart"), "", "systemd's Restart= is starting it"),
        (replace(ACTIVE, active_since=T0 + 900), "", "still loading (100 s of at most 600 s)"),
    ],
)
def test_a_unit_down_for_a_reason_of_its_own_is_only_reported(
    unit: UnitFacts, stopped: str, note: str
) -> None:
    found, said = judged(unit, stopped=stopped)
    assert found is None and said.startswith(note)


def test_a_start_past_its_timeout_is_hung_unless_it_answered_in_this_activation() -> None:
    found, _ = judged(ACTIVE)  # active from T0, 1000 s ago, never answered
    assert found is not None and found.cause == "start_hung"
    assert found.evidence["start_timeout_s"] == 600.0
    found, note = judged(ACTIVE, answered_at=T0 + 30)
    assert found is None and note == ""


def test_exits_past_the_threshold_are_a_crash_loop_acted_on_only_when_left_down() -> None:
    looping = LivenessState(exits=(1990.0, 1995.0, 1999.0))
    found, _ = judged(DOWN, looping)
    assert found is not None and found.cause == "crash_loop" and not found.reported
    assert found.summary.startswith("3 exits in the last 60 min (crash loop from 3); down now")
    found, _ = judged(replace(DOWN, sub_state="auto-restart"), looping)
    assert found is not None and found.cause == "crash_loop" and found.reported


NOW = datetime.fromtimestamp(T0 + 10 * 3600, timezone.utc)  # 10:06 UTC, outside the window
POLICY = PolicySettings(mode="enforce", windows=("daily 02:00-05:00",))


def verdict(cause: str, *ages: tuple[str, float]) -> Verdict:
    history = [RestartRecord(NOW.timestamp() - age, c) for c, age in ages]
    return evaluate(
        POLICY, cause=cause, wanted=True, uptime=None, request_rate=None, history=history,
        controls=Controls(), now=NOW,
    )  # fmt: skip


def test_a_dead_vllm_is_started_at_any_hour_within_the_budget_not_the_interval() -> None:
    v = verdict("dead", ("stall", 600.0))  # a restart 10 min ago: min_interval is 1 h
    assert (v.action, v.drain_max_in_flight) == ("restart", None)
    assert v.reason == "restart: vLLM serves nothing, any time"
    v = verdict("dead", *[("stall", 3600.0 * h) for h in (1, 2, 3, 4)])
    assert (v.action, v.reason) == ("hold", "budget: 4 restarts in the last 24 h (at most 4)")


def test_a_crash_loops_starts_back_off_then_escalate() -> None:
    v = verdict("crash_loop", ("dead", 50.0))
    assert v.action == "hold" and v.reason.startswith("crash loop back-off: 1 start(s)")
    assert verdict("crash_loop", ("crash_loop", 70.0)).action == "restart"
    escalating = replace(POLICY, escalate_after=3)
    history = [RestartRecord(NOW.timestamp() - age, "dead") for age in (100.0, 1000.0)]
    held = evaluate(
        escalating, cause="crash_loop", wanted=True, uptime=None, request_rate=None,
        history=history, controls=Controls(), now=NOW,
    )  # fmt: skip
    assert held.reason.startswith("crash loop back-off: 2 start(s) for it, the last 2 min ago")
    v = verdict("crash_loop", ("crash_loop", 1000.0), ("dead", 2000.0))
    assert v.action == "hold" and v.reason.startswith("escalated: vLLM still exits after 2 starts")
    # Older than the window, they no longer count.
    assert verdict("crash_loop", ("crash_loop", 4000.0), ("crash_loop", 5000.0)).action == (
        "restart"
    )


def test_exits_are_kept_across_vllm_runs_a_crash_loop_is_many_runs() -> None:
    """Each exit starts a new vLLM run (and a new baseline); the count of exits goes on."""
    always = replace(ACTIVE, restart_policy="always")
    seen: list[Sample] = []
    state, decision = EngineState(), None
    for i, (active, sub, restarts, answered) in enumerate(
        [
            ("active", "running", 0, True),
            ("active", "running", 1, True),  # a new process (a new run) after one exit
            ("active", "running", 2, True),
            ("activating", "auto-restart", 3, False),
        ]
    ):
        unit = replace(
            always, active_state=active, sub_state=sub, n_restarts=restarts, active_since=T0 + i
        )
        page = metrics(process_start_time=T0 + i) if answered else None
        seen.append(Sample(T0 + i, 1000.0 + i, page, None if answered else "refused", unit=unit))
        observed = Observation(samples=tuple(seen), unit_active=active == "active")
        decision = decide(Settings(), state, observed, datetime.fromtimestamp(T0 + i, timezone.utc))
        state = decision.state
    assert decision is not None and state.liveness.exits == (1001.0, 1002.0, 1003.0)
    assert (decision.cause, decision.action) == ("crash_loop", "none")
    assert decision.reason.startswith("reported: crash_loop: 3 exits")
