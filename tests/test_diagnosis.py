"""Diagnosis names the cause with its numbers, holds symptoms with hysteresis, and vetoes
restarts that cannot help."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from tests.conftest import FIXTURES, metrics
from tests.conftest import window_stats as window
from vkvagent.adapters.gpu import GpuReader, RecordedBackend
from vkvagent.engine.baseline import Capacity, Regime, WindowStats, compare
from vkvagent.engine.diagnosis import (
    CAUSES,
    FIXABLE,
    GIB,
    HELD,
    VETOED,
    Diagnosis,
    DiagnosisSettings,
    DiagnosisState,
    Due,
    Situation,
    diagnose,
)
from vkvagent.engine.engines import EngineWindow
from vkvagent.engine.hysteresis import Hysteresis
from vkvagent.engine.kv import Leak
from vkvagent.engine.memory import MemoryPoint, memory_growth
from vkvagent.engine.progress import ProbeFacts, Progress, Stall
from vkvagent.engine.samples import EngineSignals, GpuReading, VllmMetrics

S = DiagnosisSettings()
HOLD = S.hold
FRESH = {
    "itl": 0.0225, "per_request": 48.0, "tokens_per_s": 5515.0, "generation_tokens_per_s": 845.0,
    "requests_per_s": 4.04, "running": 17.6, "waiting": 0.0, "preemptions_per_s": 0.0,
    "kv_usage": 0.45, "prompt_share": 0.847, "ttft_p50": 0.25, "prompt_per_request": 1156.0,
    "output_per_request": 209.0, "prefix_hit_ratio": 0.4,
}  # fmt: skip
BASE = Regime(10, {name: (value,) * 10 for name, value in FRESH.items()})
CAPACITY = Capacity(requests_per_s=4.04, generation_tokens_per_s=845.0, running=17.6, regime=19)


SLOW = dict(itl=0.0225 / 0.68, per_request=48.0 * 0.68, running=25.9)


def gpu(**values: Any) -> GpuReading:
    base: dict[str, Any] = dict(
        index=0, uuid="GPU-0", name="H100", memory_used_bytes=None, memory_total_bytes=None,
        utilization_percent=98.0, temperature_c=66.0, power_w=600.0, power_limit_w=700.0,
        sm_clock_mhz=1980.0, sm_clock_max_mhz=1980.0, clock_event_reasons=(),
        ecc_uncorrected_volatile=0, xid_errors=(),
    )  # fmt: skip
    base.update(values)
    return GpuReading(**base)


HOT = gpu(clock_event_reasons=("sw_thermal_slowdown",), sm_clock_mhz=1155.0, temperature_c=91.0)


def situation(stats: WindowStats | None = None, **extra: Any) -> Situation:
    stats = window() if stats is None else stats
    fields: dict[str, Any] = dict(
        stats=stats,
        comparison=compare(stats, 19, BASE),
        regime="724-1024 generated tokens/s",
        known="724-1024 generated tokens/s",
        learning="",
        capacity=CAPACITY,
        fresh=BASE.medians,
    )
    fields.update(extra)
    return Situation(**fields)


def run(
    steps: list[Situation], settings: DiagnosisSettings = S, every: float = 30.0
) -> tuple[Diagnosis, DiagnosisState]:
    """Diagnose a sequence of situations, ``every`` seconds apart; the last verdict."""
    state = DiagnosisState()
    result = None
    for i, step in enumerate(steps):
        result, state = diagnose(settings, state, step, 1_741_000_000.0 + i * every)
    assert result is not None
    return result, state


def held(step: Situation, seconds: float = HOLD + 60) -> list[Situation]:
    return [situation()] + [step] * int(seconds / 30 + 1)


def test_the_cause_lists_split_into_fixable_and_vetoed() -> None:
    fixable = {
        "uptime_decline", "kv_pressure", "kv_stranded", "stall", "unresponsive",
        "host_memory_growth", "dead", "start_hung", "crash_loop",
    }  # fmt: skip
    assert fixable == FIXABLE
    assert {"gpu_throttle", "gpu_fault", "load_shift"} == VETOED
    assert set(CAUSES) == FIXABLE | VETOED | {"engine_down"}


# -- hysteresis --------------------------------------------------------------------------------


def test_a_window_without_a_known_rate_is_not_lighter() -> None:
    slow = situation(window(**SLOW))
    _, state = run([slow, situation()])
    assert state.speed == Hysteresis()  # fine at the same load: gone
    unrated = situation(window(requests_per_s=None, arrivals_per_s=None))  # counters reset
    _, state = run([slow, unrated])
    assert state.speed == Hysteresis()  # no rate is not a light load


def test_hysteresis_state_round_trips_through_json() -> None:
    state = DiagnosisState(
        speed=Hysteresis(True, 10.0, 910.0), kv=Hysteresis(False, 5.0, None, 5.0, 3.9, 2.9),
        progress=Progress(123.0), throttled_at=1.0, throttle_note="GPU 0 hot",
        fault_at=2.0, fault_note="GPU 0 XID 79",
    )  # fmt: skip
    assert DiagnosisState.from_json(json.loads(json.dumps(state.to_json()))) == state
    saved = state.to_json()
    del saved["kv"]["load"], saved["kv"]["cleared"]  # a state saved before they were kept
    assert DiagnosisState.from_json(saved).kv == Hysteresis(False, 5.0, None, 5.0)


# -- the stall clock ---------------------------------------------------------------------------


def test_an_answered_probe_is_never_a_stall_whatever_the_gauges_say() -> None:
    """vLLM issue 22545: after aborts the gauges can stay at a request that no longer runs."""
    stuck = metrics(num_requests_running=2.0, generation_tokens_total=100.0,
                    engine_steps_total=50.0)  # fmt: skip
    p = Progress().observe(None, stuck, 0.0)
    p = p.observe(stuck, stuck, 200.0)
    assert p.stalled(stuck, 200.0, ProbeFacts()).seconds == 200.0  # the gauges alone: a stall
    answered = ProbeFacts(answered=190.0, last_sent=190.0)
    assert p.stalled(stuck, 200.0, answered) == Stall(10.0, "requests pending")
    result, _ = run([situation(stall=p.stalled(stuck, 200.0, answered))])
    assert result.cause is None


def test_a_probe_stall_says_so() -> None:
    result, _ = run([situation(stall=Stall(S.stall_after, "a probe got no answer"))])
    assert result.cause == "stall"
    assert result.summary.startswith("a probe got no answer and no token or engine step for")
    assert result.evidence["stall_evidence"] == "a probe got no answer"


def test_unresponsive_comes_before_engine_down_and_is_fixable() -> None:
    line = "vLLM accepts connections but has not answered /metrics for 95 s"
    result, _ = run([situation(down="/metrics unreachable: timeout", unresponsive=line)])
    assert result.cause == "unresponsive" and result.fixable and result.summary == line
    result, _ = run([situation(down="/metrics unreachable: connection refused")])
    assert result.cause == "engine_down" and not result.fixable


def test_a_stall_is_diagnosed_after_stall_after_seconds() -> None:
    result, _ = run([situation(stall=Stall(S.stall_after - 1, "requests pending"))])
    assert result.cause is None
    result, _ = run([situation(stall=Stall(S.stall_after, "requests pending"))])
    assert result.cause == "stall" and result.fixable
    assert result.evidence["stalled_s"] == S.stall_after


# -- speed -------------------------------------------------------------------------------------


def test_a_held_slowdown_at_unchanged_load_and_mix_is_uptime_decline() -> None:
    slow = situation(window(**SLOW))
    early, state = run([situation(), *[slow] * 10])
    assert early.cause is None and early.summary.startswith("watching: speed 0.68")
    assert state.speed.pending_since is not None
    result, state = run(held(slow))
    assert result.cause == "uptime_decline" and result.fixable
    assert state.speed.active
    assert result.evidence["ratio"] == pytest.approx(0.68)
    assert result.evidence["baseline_itl"] == FRESH["itl"]
    assert "0.68 of this run's fresh baseline" in result.summary


def test_the_band_in_effect_is_in_the_evidence_beside_the_ratio() -> None:
    result, _ = run([speed(0.80)])
    assert (result.evidence["enter_ratio"], result.evidence["leave_ratio"]) == (0.75, 0.85)
    # A run declining on its own trend is judged by 1 - trend_loss and 1 - trend_loss / 2.
    result, _ = run([speed(0.92, decline=0.12)])
    assert result.evidence["enter_ratio"] == pytest.approx(0.90)
    assert result.evidence["leave_ratio"] == pytest.approx(0.95)
    assert result.summary.startswith("healthy: speed 0.92")
    assert run([speed(0.92, decline=0.12), speed(0.89, decline=0.12)])[0].summary.startswith(
        "watching: speed 0.89"
    )
    unknown = situation(comparison=None, regime="2048-2896 generated tokens/s")
    assert "enter_ratio" not in run([unknown])[0].evidence  # no ratio, no band


def test_a_run_falling_steadily_with_uptime_is_degraded_before_it_is_a_quarter_slower() -> None:
    # 0.88 of the fresh speed: above enter_ratio (0.75), but this run's own speed by uptime
    # has fallen 12 % on a steady trend (prevention.decline).
    mild = dict(itl=0.0225 / 0.88, per_request=48.0 * 0.88, running=20.0)
    falling = situation(window(**mild), decline=0.12)
    result, state = run(held(falling))
    assert result.cause == "uptime_decline" and result.fixable
    assert result.evidence["trend_loss"] == pytest.approx(0.12)
    assert "fallen 12% with uptime" in result.summary
    # Below 1 - trend_loss / 2, a run still declining stays degraded; above it, it is not.
    back = situation(window(itl=0.0225 / 0.93, per_request=48.0 * 0.93), decline=0.12)
    assert run([*held(falling), back])[0].cause == "uptime_decline"
    fast = situation(window(itl=0.0225 / 0.96, per_request=48.0 * 0.96), decline=0.12)
    result, state = run([*held(falling), fast])
    assert result.cause is None and not state.speed.active
    # The same speed without the trend, or with a trend under trend_loss, is only watched.
    for decline in (None, 0.08):
        quiet, state = run(held(situation(window(**mild), decline=decline)))
        assert quiet.cause is None and not state.speed.active, decline
    # A trend_loss beyond 1 - enter_ratio never makes the speed alone wait longer.
    deep = DiagnosisSettings(trend_loss=0.4)
    assert run(held(situation(window(**SLOW), decline=0.5)), deep)[0].cause == "uptime_decline"


def test_a_throttled_gpu_vetoes_the_restart_and_says_so() -> None:
    slow = situation(window(**SLOW), gpus=[(HOT,)])
    result, _ = run(held(slow))
    assert result.cause == "gpu_throttle" and result.vetoed
    assert "sw_thermal_slowdown" in str(result.evidence["gpu_throttle"])
    assert "1155/1980" in result.summary
    # A throttled GPU whose clock is not really down (power cap at 97 %) is not the reason.
    capped = gpu(clock_event_reasons=("sw_power_cap",), sm_clock_mhz=1920.0)
    result, _ = run(held(situation(window(**SLOW), gpus=[(capped,)])))
    assert result.cause == "uptime_decline"


def test_a_power_cap_the_fresh_server_ran_at_too_does_not_explain_a_slowdown() -> None:
    # A real H200 under a full bf16 load (recorded with `vkvagent gpu --record`): at its
    # 700 W cap, SM clock 1425 of 1980 MHz, sw_power_cap, all day long.
    recording = json.loads((FIXTURES / "gpu" / "h200-power-capped.json").read_text())
    [capped], problem = GpuReader(open=lambda: RecordedBackend(recording)).read()
    assert problem is None and capped.throttled_by == ("sw_power_cap",)
    assert capped.sm_clock_mhz == 1425.0 and capped.power_w == pytest.approx(691.916)
    # Without the fresh server's clock, the power cap alone is how a busy GPU runs.
    result, _ = run(held(situation(window(**SLOW), gpus=[(capped,)])))
    assert result.cause == "uptime_decline"
    # The fresh server ran capped at this load too (1440 MHz): the cap is not the cause.
    at_cap = Regime(10, {**BASE.values, "sm_clock_ratio": (1440 / 1980,) * 10})
    slow = window(**SLOW, sm_clock_ratio=1425 / 1980)
    steps = [situation(comparison=compare(window(), 19, at_cap))] + [
        situation(slow, comparison=compare(slow, 19, at_cap), gpus=[(capped,)])
    ] * int(HOLD / 30 + 2)
    result, _ = run(steps)
    assert result.cause == "uptime_decline", result.summary
    assert result.evidence["baseline_sm_clock_ratio"] == pytest.approx(1440 / 1980)
    # Slowed well below the fresh clock, by heat or by a power limit lowered since, it vetoes.
    lowered = replace(capped, sm_clock_mhz=1110.0)
    for slowed in (HOT, lowered):
        steps[-1] = situation(slow, comparison=compare(slow, 19, at_cap), gpus=[(slowed,)])
        result, _ = run(steps)
        assert result.cause == "gpu_throttle" and result.vetoed, slowed


def test_throttling_seen_within_the_hold_still_explains_the_slowdown() -> None:
    slow, hot = situation(window(**SLOW)), situation(window(**SLOW), gpus=[(HOT,)])
    steps = [slow] * 5 + [hot] + [slow] * 25  # throttled once, 2.5 min into the slowdown
    result, state = run(steps)
    assert state.speed.active and result.cause == "gpu_throttle"
    result, _ = run(steps + [slow] * 6)  # 15.5 min since the GPU was last seen throttled
    assert result.cause == "uptime_decline"


def test_a_changed_request_mix_is_load_shift_not_decline() -> None:
    # Prompts 3.4 times longer: the prompt share only moves from 0.85 to 0.95, but each
    # request brings 3.4 times the prefill.
    longer = situation(window(**SLOW, prompt_share=0.95, prompt_per_request=3930.0))
    result, _ = run(held(longer))
    assert result.cause == "load_shift" and result.vetoed
    assert "3.40x the prompt tokens per request of the fresh run" in result.summary
    shorter = situation(window(**SLOW, output_per_request=100.0))
    assert "0.48x the generated tokens per request" in run(held(shorter))[0].summary
    # Fewer prompt tokens found in the prefix cache: more prefill for the same requests.
    missed = situation(window(**SLOW, prefix_hit_ratio=0.1))
    result, _ = run(held(missed))
    assert result.cause == "load_shift"
    assert "prefix-cache hit ratio 0.10 against 0.40 fresh" in result.summary
    # Within the tolerance (1.5x either way, 0.2 of hit ratio) the slowdown is the server's.
    close = situation(window(**SLOW, prompt_per_request=1450.0, prefix_hit_ratio=0.3))
    assert run(held(close))[0].cause == "uptime_decline"


def test_queueing_beyond_the_fresh_capacity_is_load_shift() -> None:
    busy = situation(window(**SLOW, waiting=12.0, arrivals_per_s=6.0))
    result, _ = run(held(busy))
    assert result.cause == "load_shift"
    assert "6.00/s of demand" in result.summary


def test_without_a_baseline_for_this_load_nothing_is_concluded() -> None:
    unknown = situation(window(**SLOW), comparison=None, regime="2048-2896 generated tokens/s")
    result, state = run(held(unknown))
    assert result.cause is None
    assert result.summary.startswith("unknown baseline: nothing learned at 2048-2896")
    assert not state.speed.active
    learning = replace(unknown, learning="warm-up: uptime 4 min, baseline from 12 min")
    result, _ = run([learning])
    assert result.summary == "learning: warm-up: uptime 4 min, baseline from 12 min"


def speed(ratio: float, **extra: Any) -> Situation:
    return situation(window(itl=0.0225 / ratio, per_request=48 * ratio), **extra)


def test_healthy_and_watching_summaries_carry_the_ratio_and_follow_the_hysteresis() -> None:
    result, _ = run([situation()])
    assert result.cause is None and result.summary.startswith("healthy: speed 1.00")
    # Inside the band (0.75 to 0.85) the word is what the hysteresis holds: healthy until the
    # speed goes below 0.75, then watching until it is back above 0.85. A ratio read against
    # 0.85 alone called the same 0.80 watching, and a 0.85 either word by its third digit.
    assert run([situation(), speed(0.80)])[0].summary.startswith("healthy: speed 0.80")
    assert run([situation(), speed(0.849)])[0].summary.startswith("healthy: speed 0.85")
    dipped = [situation(), speed(0.70), speed(0.80)]
    assert run(dipped)[0].summary.startswith("watching: speed 0.80 of baseline")
    assert run([*dipped, speed(0.849)])[0].summary.startswith("watching: speed 0.85")
    assert run([*dipped, speed(0.86)])[0].summary.startswith("healthy: speed 0.86")
    idle = situation(window(running=0.1), comparison=None, regime="idle")
    assert run([idle])[0].summary.startswith("idle")
    assert run([situation(stats=None, comparison=None)])[0].cause is None


# -- judging the run ---------------------------------------------------------------------------

IDLE = situation(window(running=0.1), comparison=None, regime="idle")
UNKNOWN = situation(window(**SLOW), comparison=None, regime="2048-2896 generated tokens/s")


def test_a_run_diagnosed_slow_stays_due_through_idle_and_unlearned_loads() -> None:
    slow = situation(window(**SLOW))
    for quiet in (IDLE, UNKNOWN):
        result, state = run([*held(slow), *[quiet] * 240])  # two hours of nothing to compare
        assert result.cause == "uptime_decline" and result.fixable, quiet.regime
        assert result.summary.startswith("held for this run: speed 0.68 of this run's fresh")
        assert "diagnosed 2.0 h ago" in result.summary
        assert result.evidence["held_cause"] == "uptime_decline"
        assert result.evidence["held_ratio"] == pytest.approx(0.68)
        assert result.evidence["held_for_s"] == 2 * 3600 + 60  # named 16 min into the slowdown
        assert state.due is not None and state.due.cause == "uptime_decline"
        assert state.due.demand == pytest.approx(4.04)
    # When it was diagnosed, in UTC, when the samples' wall clock is known.
    timed = replace(slow, time=1_741_000_000.0)
    result, _ = run([*held(timed), IDLE])
    assert result.evidence["held_since"] == "2025-03-03T11:06:40Z"
    # Held causes are the ones that fade with the load; a stall or silence is acted on at once.
    assert FIXABLE - {"stall", "unresponsive", "dead", "start_hung", "crash_loop"} == HELD
    result, state = run([situation(stall=Stall(600.0, "requests pending")), IDLE])
    assert result.cause is None and state.due is None


def test_a_run_that_recovers_under_comparable_load_is_no_longer_due() -> None:
    slow = situation(window(**SLOW))
    result, state = run([*held(slow), *[IDLE] * 10, situation()])
    assert result.cause is None and state.due is None
    assert result.summary.startswith("healthy: speed 1.00")
    assert result.summary.endswith("recovered from uptime_decline at comparable load")
    # Between the lines (0.80: above enter, below leave) is not recovered.
    between = situation(window(itl=0.0225 / 0.8, per_request=48 * 0.8))
    result, state = run([*held(slow), between])
    assert result.cause == "uptime_decline" and state.due is not None


def test_kv_pressure_recovers_only_at_the_demand_it_was_diagnosed_at_or_more() -> None:
    pressed = situation(window(**KV_FULL, requests_per_s=3.9, arrivals_per_s=3.9))
    lighter = situation(window(requests_per_s=3.0, arrivals_per_s=3.0))  # healthy, less asked
    backlog = situation(window(requests_per_s=4.5, arrivals_per_s=3.0))  # a queue worked off
    result, state = run([*held(pressed), *[lighter] * 10, backlog])
    assert result.cause == "kv_pressure" and state.due is not None
    assert state.due.demand == pytest.approx(3.9)
    assert result.summary.startswith("held for this run: KV usage 0.96")
    result, state = run([*held(pressed), *[lighter] * 10, situation()])  # 4.04 requests/s
    assert result.cause is None and state.due is None


def test_a_held_kv_pressure_keeps_its_suggestion_and_reasons() -> None:
    """What `plan --suggested` reviews while the run waits, idle, for its window."""
    pressed = situation(
        window(**KV_FULL, requests_per_s=3.9, arrivals_per_s=3.9),
        flags={"max-num-seqs": 256}, cache_config={"gpu_memory_utilization": "0.9"},
    )  # fmt: skip
    named, state = run(held(pressed))
    assert named.suggestion and set(named.reasons) == set(named.suggestion)
    result, state = run([*held(pressed), *[IDLE] * 30])
    assert result.summary.startswith("held for this run: KV usage 0.96")
    assert (result.suggestion, result.reasons) == (named.suggestion, named.reasons)
    assert state.due is not None
    assert DiagnosisState.from_json(json.loads(json.dumps(state.to_json()))) == state


def test_a_veto_still_blocks_a_run_that_is_due() -> None:
    slow = situation(window(**SLOW))
    hot = replace(IDLE, gpus=[(HOT,)])
    faulty = replace(IDLE, gpus=[(gpu(xid_errors=(79,)),)])
    busy = situation(window(**SLOW, waiting=12.0, arrivals_per_s=6.0))
    for veto, cause in ((hot, "gpu_throttle"), (faulty, "gpu_fault"), (busy, "load_shift")):
        result, state = run([*held(slow), *[IDLE] * 10, veto])
        assert result.cause == cause and result.vetoed, cause
        assert state.due is not None  # still due, once nothing explains it away
    down = replace(IDLE, down="the unit is not active")
    result, _ = run([*held(slow), down])
    assert result.cause == "engine_down"


def test_a_new_run_is_not_due_and_the_due_cause_round_trips_through_json() -> None:
    due = Due("kv_pressure", 10.0, 1.7e9, 3.9, "KV usage 0.96", 0.9, {"max-num-seqs": 32}, {
        "max-num-seqs": "the fresh server ran 17.6 requests at once"
    })  # fmt: skip
    state = DiagnosisState(due=due, throttled_at=1.0, throttle_note="GPU 0 hot")
    assert DiagnosisState.from_json(json.loads(json.dumps(state.to_json()))) == state
    assert state.for_new_run().due is None and state.for_new_run().throttled_at == 1.0
    older = state.to_json()
    del older["due"]  # an engine.json written before runs were judged
    assert DiagnosisState.from_json(older).due is None
    with pytest.raises(ValueError, match="not a cause a run is held due for"):
        DiagnosisState.from_json({**state.to_json(), "due": {**due.to_json(), "cause": "stall"}})


# -- KV ----------------------------------------------------------------------------------------

KV_FULL = dict(kv_usage=0.96, preemptions_per_s=0.25, waiting=30.0, running=16.0)


def test_kv_pressure_at_a_load_the_fresh_server_handled_is_fixable_with_a_suggestion() -> None:
    pressed = situation(
        window(**KV_FULL, requests_per_s=3.9, arrivals_per_s=3.9),
        flags={"max-num-seqs": 256, "max-num-batched-tokens": 8192},
        cache_config={"gpu_memory_utilization": "0.9"},
    )
    result, state = run(held(pressed))
    assert result.cause == "kv_pressure" and result.fixable and state.kv.active
    assert result.evidence["fresh_capacity_requests_per_s"] == 4.04
    assert result.suggestion == {
        "gpu-memory-utilization": 0.93,
        "max-num-seqs": 32,  # 1.5 x the 17.6 requests the fresh server ran, rounded to 8
        "max-num-batched-tokens": 4096,
    }


def test_the_same_kv_picture_beyond_the_fresh_capacity_is_load() -> None:
    for rates in (
        dict(requests_per_s=4.0, arrivals_per_s=8.5),  # demand piling up
        dict(requests_per_s=6.3, arrivals_per_s=4.0),
    ):  # working off a backlog
        result, _ = run(held(situation(window(**KV_FULL, **rates))))
        assert result.cause == "load_shift", rates
        assert result.suggestion == {}


def test_kv_pressure_without_a_fresh_capacity_is_unknown_and_never_fixable() -> None:
    result, _ = run(held(situation(window(**KV_FULL), capacity=None)))
    assert result.cause is None
    assert result.summary.startswith("unknown baseline: KV usage 0.96")


def test_the_kv_signature_needs_all_three_signs_and_leaves_when_one_clearly_goes() -> None:
    for missing in (dict(kv_usage=0.7), dict(preemptions_per_s=0.0), dict(waiting=0.0)):
        _, state = run(held(situation(window(**{**KV_FULL, **missing}))))
        assert not state.kv.active, missing
    steps = held(situation(window(**KV_FULL)))
    _, state = run(steps)
    assert state.kv.active
    _, state = run([*steps, situation(window(**{**KV_FULL, "kv_usage": 0.89}))])
    assert state.kv.active  # dipping under 0.9 is not relief
    _, state = run([*steps, situation(window(**{**KV_FULL, "preemptions_per_s": 0.0}))])
    assert not state.kv.active


def test_requests_waiting_beside_free_kv_while_serving_less_is_kv_stranded() -> None:
    stranded = window(waiting=25.0, kv_usage=0.5, generation_tokens_per_s=500.0,
                      requests_per_s=2.4, arrivals_per_s=2.4, running=10.0)  # fmt: skip
    result, _ = run(held(situation(stranded, comparison=None)))
    assert result.cause == "kv_stranded" and result.fixable
    assert "500 tokens/s where the fresh server served 845" in result.summary
    # Serving as much as the fresh server did, the queue is demand, not stranding.
    busy = replace(stranded, generation_tokens_per_s=840.0)
    assert run(held(situation(busy, comparison=None)))[0].cause is None
    # Full KV is pressure, not stranding.
    assert run(held(situation(replace(stranded, kv_usage=0.85))))[0].cause != "kv_stranded"


# -- GPUs, memory, engine ----------------------------------------------------------------------


def test_an_xid_vetoes_restarts_for_fault_memory_seconds_even_though_it_is_seen_once() -> None:
    xid = situation(window(**SLOW), gpus=[(gpu(xid_errors=(79,)),)])
    after = situation(window(**SLOW))
    result, _ = run([xid, after, after])
    assert result.cause == "gpu_fault" and result.vetoed
    assert result.evidence["fault"] == "GPU 0 XID 79 (GPU has fallen off the bus; hardware)"
    later = int(S.fault_memory / 30) + 1
    result, _ = run([xid, *[after] * later])
    assert result.cause != "gpu_fault"


def test_uncorrectable_ecc_is_a_fault_and_outranks_a_stall() -> None:
    ecc = situation(
        gpus=[(gpu(ecc_uncorrected_volatile=2),)], stall=Stall(600.0, "requests pending")
    )
    result, _ = run([ecc])
    assert result.cause == "gpu_fault"
    assert "2 uncorrectable ECC errors" in result.summary


def test_engine_down_is_reported_and_left_to_systemd() -> None:
    result, state = run([situation(down="/metrics unreachable: connection refused")])
    assert result.cause == "engine_down"
    assert not result.fixable and not result.vetoed
    assert state.speed == Hysteresis()


def leak(per_request: float, *, minutes: int = 90, noise: float = 0.0) -> list[MemoryPoint]:
    out = []
    for minute in range(minutes + 1):
        served = 240.0 * minute
        wobble = noise * (1 if minute % 2 else -1)
        out.append(MemoryPoint(60.0 * minute, 6 * GIB + served * per_request + wobble, served))
    return out


def test_memory_growing_with_requests_served_is_host_memory_growth() -> None:
    points = leak(128 * 1024)  # 21600 requests x 128 KiB = 2.6 GiB in 90 min
    trend = memory_growth(S, points)
    assert trend is not None
    assert trend.per_request == pytest.approx(128 * 1024)
    assert trend.correlation > 0.999
    assert trend.grown == pytest.approx(21600 * 128 * 1024)
    result, _ = run([situation(memory=points)])
    assert result.cause == "host_memory_growth" and result.fixable
    assert result.evidence["bytes_per_request"] == pytest.approx(128 * 1024)


def test_a_memory_leak_is_timed_against_the_units_memory_max() -> None:
    # 240 requests a minute x 128 KiB: 1800 MiB an hour, from 6 + 2.64 GiB after 90 min.
    points = leak(128 * 1024)
    trend = memory_growth(S, points, limit=20 * GIB)
    assert trend is not None and trend.limit == 20 * GIB
    hours = (20 - 6 - 21600 * 128 / 2**20) / (1800 / 1024)
    assert trend.to_limit == pytest.approx(hours * 3600)
    result, _ = run([situation(memory=points, memory_limit=20 * GIB)])
    assert result.cause == "host_memory_growth" and result.harm_in == trend.to_limit
    assert result.evidence["memory_max_bytes"] == 20 * GIB
    assert result.evidence["memory_limit_in_s"] == trend.to_limit
    assert f"reaches MemoryMax (20.0 GiB) in {hours:.1f} h" in result.summary
    # Already past the limit (the kernel reclaims page cache before it kills): the harm is now.
    assert run([situation(memory=points, memory_limit=7 * GIB)])[0].harm_in == 0.0
    # Held through a moment the fit cannot be made (no memory read): the harm keeps its time.
    timed = situation(memory=points, memory_limit=20 * GIB)
    held_on, _ = run([timed, situation(comparison=None, memory_limit=20 * GIB)])
    assert held_on.cause == "host_memory_growth" and held_on.summary.startswith("held for")
    assert held_on.harm_in == pytest.approx(trend.to_limit - 30.0)
    # Unlimited: the leak is not timed, and waits for no later window.
    unlimited, _ = run([situation(memory=points)])
    assert unlimited.harm_in is None and "memory_limit_in_s" not in unlimited.evidence
    assert "MemoryMax" not in unlimited.summary


def test_settings_refuse_inverted_thresholds() -> None:
    with pytest.raises(ValueError):
        DiagnosisSettings(enter_ratio=0.9, leave_ratio=0.8)
    with pytest.raises(ValueError):
        DiagnosisSettings(kv_stranded_below=0.95, kv_full=0.9)


# -- XID classes -------------------------------------------------------------------------------


@pytest.mark.parametrize("xids", [(13,), (43,), (31, 45)])
def test_an_application_xid_vetoes_neither_a_stall_nor_a_decline(xids: tuple[int, ...]) -> None:
    app = gpu(xid_errors=xids)
    result, state = run([situation(gpus=[(app,)], stall=Stall(600.0, "requests pending"))])
    assert result.cause == "stall" and result.fixable
    assert state.fault_at is None
    result, state = run(held(situation(window(**SLOW), gpus=[(app,)])))
    assert result.cause == "uptime_decline" and result.fixable
    assert state.fault_at is None


@pytest.mark.parametrize(
    ("xid", "note"),
    [
        (79, "GPU 0 XID 79 (GPU has fallen off the bus; hardware)"),
        (48, "GPU 0 XID 48 (Double Bit ECC Error; hardware)"),
        (119, "GPU 0 XID 119 (GSP RPC Timeout; driver)"),
        (999, "GPU 0 XID 999 (not in vkvagent's XID table; unknown)"),  # unknown: a fault
    ],
)
def test_a_hardware_driver_or_unknown_xid_vetoes_a_stall_and_a_decline(xid: int, note: str) -> None:
    # With an application XID in the same reading: only the fault is named.
    faulty = gpu(xid_errors=(13, xid))
    result, state = run([situation(gpus=[(faulty,)], stall=Stall(600.0, "requests pending"))])
    assert result.cause == "gpu_fault" and result.vetoed
    assert result.evidence["fault"] == note and state.fault_note == note
    result, _ = run(held(situation(window(**SLOW), gpus=[(faulty,)])))
    assert result.cause == "gpu_fault" and result.vetoed


# -- data-parallel engines -----------------------------------------------------------------------


def engine(name: str, **values: Any) -> EngineWindow:
    base: dict[str, Any] = dict(
        engine=name, kv_usage=0.45, waiting=0.0, generation_tokens_per_s=211.0,
        preemptions_per_s=0.0,
    )  # fmt: skip
    base.update(values)
    return EngineWindow(**base)


def signals(name: str, **values: Any) -> EngineSignals:
    base: dict[str, Any] = dict(
        engine=name, kv_cache_usage=0.45, num_requests_running=4.0, num_requests_waiting=0.0,
        generation_tokens_total=1000.0, prompt_tokens_total=5000.0, engine_steps_total=500.0,
        request_success_total=20.0, num_preemptions_total=0.0,
    )  # fmt: skip
    base.update(values)
    return EngineSignals(**base)


def test_one_stuck_engine_among_busy_ones_is_a_stall_named_by_its_engine() -> None:
    """The totals move (three engines work), the fourth has requests and moves nothing."""

    def page(step: int) -> VllmMetrics:
        engines = [signals(str(i), generation_tokens_total=1000.0 + 10 * step) for i in range(3)]
        engines.append(signals("3", num_requests_running=3.0))
        return metrics(
            num_requests_running=15.0, generation_tokens_total=3000.0 + 30 * step,
            engine_steps_total=500.0 + step, per_engine=tuple(engines),
        )  # fmt: skip

    p = Progress().observe(None, page(0), 0.0)
    for step in range(1, 14):
        p = p.observe(page(step - 1), page(step), step * 10.0)
    assert p.since == 130.0 and p.advanced == 130.0  # the totals: all well
    stall = p.stalled(page(13), 130.0, ProbeFacts())
    assert stall == Stall(130.0, "requests pending on engine 3 of 4")
    result, _ = run([situation(stall=stall)])
    assert result.cause == "stall"
    assert result.summary.startswith("requests pending on engine 3 of 4 and no token")
    # The same engine with nothing to do is idle, not stuck.
    idle = page(14)
    idle = replace(idle, per_engine=(*idle.per_engine[:3], signals("3", num_requests_running=0.0)))
    assert p.observe(page(13), idle, 140.0).stalled(idle, 140.0, ProbeFacts()) == Stall()


def test_one_engine_far_behind_its_peers_is_found_held_and_named() -> None:
    peers = [engine(str(i)) for i in range(3)]
    stranded = engine("3", kv_usage=0.2, waiting=6.0, generation_tokens_per_s=40.0)
    # The totals look fine: mean KV 0.39, 6 waiting over four engines.
    lagging = situation(engines=(*peers, stranded))
    result, _ = run(held(lagging))
    assert result.cause == "kv_stranded" and result.fixable
    assert result.summary.startswith(
        "engine 3 of 4: 6.0 requests wait on it at KV usage 0.20, 0.00 preemptions/s, serving "
        "40 tokens/s where its peers serve 211, for 1"
    )
    assert "engine 3: KV 0.20, 6.0 waiting, 40 tokens/s" in str(result.evidence["engines"])
    # Not yet held for `hold`: only watched.
    result, _ = run([situation(), lagging, lagging])
    assert result.cause is None
    # Full and preempting: the engine's KV fills (leaks) while its peers have room.
    full = engine("3", kv_usage=0.97, waiting=6.0, generation_tokens_per_s=40.0,
                  preemptions_per_s=0.5)  # fmt: skip
    result, _ = run(held(situation(engines=(*peers, full))))
    assert result.cause == "kv_pressure"
    # Waiting but keeping up with its peers: nothing wrong.
    keeping_up = engine("3", waiting=6.0, generation_tokens_per_s=200.0)
    result, _ = run(held(situation(engines=(*peers, keeping_up))))
    assert result.cause is None


def test_a_lagging_engine_on_a_throttled_gpu_is_vetoed() -> None:
    peers = [engine(str(i)) for i in range(3)]
    stranded = engine("3", kv_usage=0.2, waiting=6.0, generation_tokens_per_s=40.0)
    result, _ = run(held(situation(engines=(*peers, stranded), gpus=[(HOT,)])))
    assert result.cause == "gpu_throttle" and result.vetoed


def test_a_gpu_fault_vetoes_an_unresponsive_restart() -> None:
    """A GPU that fell off the bus can hang vLLM: restarting vLLM repairs nothing."""
    line = "vLLM accepts connections but has not answered /metrics for 95 s"
    faulty = situation(gpus=[(gpu(xid_errors=(79,)),)])
    result, _ = run([faulty, situation(down="timeout", unresponsive=line)])
    assert result.cause == "gpu_fault" and result.vetoed
    assert line in result.summary and "XID 79" in str(result.evidence["fault"])


def test_a_lagging_engine_leaves_only_once_it_serves_leave_ratio_of_its_peers() -> None:
    peers = [engine(str(i)) for i in range(3)]
    behind = situation(engines=(*peers, engine("3", waiting=6.0, generation_tokens_per_s=40.0)))
    between = situation(engines=(*peers, engine("3", waiting=6.0, generation_tokens_per_s=170.0)))
    caught_up = situation(engines=(*peers, engine("3", waiting=6.0, generation_tokens_per_s=190.0)))
    result, _ = run(held(behind))
    assert result.cause == "kv_stranded"
    result, _ = run([*held(behind), between])  # 0.81 of its peers: inside the dead band
    assert result.cause == "kv_stranded"
    result, _ = run([*held(behind), caught_up])  # 0.90: over
    assert result.cause is None


def test_an_engine_whose_queue_is_unknown_is_judged_without_failing() -> None:
    lenient = DiagnosisSettings(min_waiting=0.0)
    peers = [engine(str(i)) for i in range(3)]
    unknown = engine("3", waiting=None, generation_tokens_per_s=40.0)
    result, _ = run(held(situation(engines=(*peers, unknown))), lenient)
    assert result.cause == "kv_stranded"
    assert result.summary.startswith("engine 3 of 4: ? requests wait on it")


def test_a_kv_leak_is_told_at_any_load_before_it_binds() -> None:
    # The fresh server took 0.45 of the cache for 17.6 requests, at its busiest clean load:
    # 0.45 of leaked blocks would fill the cache there (kv_full 0.9).
    peak = replace(CAPACITY, kv_usage=0.45)
    # A quiet hour: 4 requests running, which take 0.10 at the fresh share, hold 0.60.
    quiet = window(running=4.0, kv_usage=0.6, generation_tokens_per_s=200.0)
    result, _ = run(held(situation(quiet, capacity=peak, comparison=None)))
    assert result.cause == "kv_pressure" and result.fixable and not result.suggestion
    assert result.summary.startswith("KV cache leaking: 50% of the KV cache held beyond what")
    assert result.evidence["kv_leaked"] == pytest.approx(0.6 - 4.0 * 0.45 / 17.6)
    # Less than the room left at the fresh peak: it would not bind yet.
    small = window(running=4.0, kv_usage=0.4, generation_tokens_per_s=200.0)
    assert run(held(situation(small, capacity=peak, comparison=None)))[0].cause is None
    # Preempting: the cache is full whatever leaks; the storm is judged as such.
    storm = window(running=4.0, kv_usage=0.6, preemptions_per_s=0.5)
    assert not run(held(situation(storm, capacity=peak)))[1].leak.active
    # Longer prompts hold more of the cache per request: the mix explains it.
    longer = window(running=4.0, kv_usage=0.6, prompt_per_request=3000.0)
    result, _ = run(held(situation(longer, capacity=peak, comparison=None)))
    assert result.cause == "load_shift"
    # Without the fresh peak's usage there is nothing to tell a leak by.
    assert run(held(situation(quiet, comparison=None)))[0].cause is None


def test_a_kv_leak_is_judged_at_the_heaviest_load_this_run_served_cleanly() -> None:
    # The fresh hours were quiet: 4.04 requests/s took 0.45 of the cache, which leaves 0.45
    # of room. The run then served 6.06 requests/s cleanly, 0.675 of the cache fresh: from
    # then on a leak of 0.225 fills it at that load.
    peak = replace(CAPACITY, kv_usage=0.45)
    busy = situation(
        window(requests_per_s=6.06, arrivals_per_s=6.06, running=26.4, kv_usage=0.7),
        capacity=peak, comparison=None,
    )  # fmt: skip
    # A quiet hour: 4 requests running take 0.10 at the fresh share and hold 0.40.
    quiet = situation(
        window(running=4.0, kv_usage=0.4, generation_tokens_per_s=200.0),
        capacity=peak, comparison=None,
    )  # fmt: skip
    leaked = 0.4 - 4.0 * 0.45 / 17.6
    assert run(held(quiet))[0].cause is None  # 0.30 leaked is within the fresh peak's room
    result, state = run([busy, *held(quiet)])
    assert state.heaviest == pytest.approx(6.06)
    assert result.cause == "kv_pressure" and result.evidence["kv_leaked"] == pytest.approx(leaked)
    assert "the heaviest load served cleanly, 6.06 requests/s" in result.summary
    # What waiting costs once that load comes again: the share of it the leak has no room for.
    assert result.evidence["kv_leak_loss"] == pytest.approx((leaked - 0.225) / 0.675)
    # A heavier load that preempted, or queued, was not served cleanly: it does not count.
    heavier = dict(requests_per_s=9.0, arrivals_per_s=9.0, running=40.0, kv_usage=0.95)
    for unclean in (dict(preemptions_per_s=0.5), dict(waiting=20.0)):
        surge = situation(window(**heavier, **unclean), capacity=peak, comparison=None)
        assert run([busy, surge])[1].heaviest == pytest.approx(6.06)
    clean = situation(window(**heavier), capacity=peak, comparison=None)
    assert run([busy, clean])[1].heaviest == pytest.approx(9.0)
    # A load that takes nearly all the cache fresh leaves the least room, kv_leak (0.1); the
    # loss is still the share of it that no longer fits (kv_full 0.9 - leaked, of 0.85).
    heavy = Leak(leaked=0.2, load=7.63, needs=0.85, room=0.1, full=0.9)
    assert heavy.loss == pytest.approx((0.2 + 0.85 - 0.9) / 0.85)
    # A new run starts over; the state keeps it across agent restarts.
    assert state.for_new_run().heaviest is None
    assert DiagnosisState.from_json(json.loads(json.dumps(state.to_json()))) == state


def test_a_baseline_kept_before_tokens_per_request_still_tells_another_mix() -> None:
    old = {k: v for k, v in BASE.medians.items() if not k.endswith("_per_request")}
    old["per_request"] = BASE.medians["per_request"]
    shifted = situation(window(**SLOW, prompt_share=0.6), fresh=old)
    result, _ = run(held(shifted))
    assert result.cause == "load_shift" and "prompt share 0.60 against 0.85" in result.summary
