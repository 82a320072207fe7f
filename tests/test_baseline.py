"""Baselines are learned per run, after the warm-up, per load regime, from robust medians."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from tests.conftest import metrics
from tests.conftest import window_stats as stats
from vkvagent.engine.baseline import (
    Baseline,
    BaselineSettings,
    Regime,
    compare,
    regime_label,
    regime_of,
    speed_change,
    window_stats,
)
from vkvagent.engine.samples import Histogram

INF = math.inf
SETTINGS = BaselineSettings()


def itl(cumulative: tuple[float, ...], total: float) -> Histogram:
    return Histogram(bounds=(0.01, 0.025, 0.05, INF), cumulative=cumulative, sum=total)


def test_window_stats_reads_rates_load_and_the_exact_mean_latency() -> None:
    # 100 s apart: 1000 tokens generated, 4000 prompt tokens, 5 requests done, queue grew by 5.
    # Every ITL observation is 0.02 s, inside the (0.01, 0.025] bucket: the bucketed p50 can
    # only interpolate (0.0175), the mean from _sum/_count is exact.
    before = metrics(
        generation_tokens_total=0.0, prompt_tokens_total=0.0, request_success_total=0.0,
        num_requests_running=10.0, num_requests_waiting=0.0, kv_cache_usage=0.4,
        inter_token_latency=itl((0, 0, 0, 0), 0.0),
    )  # fmt: skip
    after = metrics(
        generation_tokens_total=1000.0, prompt_tokens_total=4000.0, request_success_total=5.0,
        num_requests_running=10.0, num_requests_waiting=5.0, kv_cache_usage=0.6,
        inter_token_latency=itl((0, 1000, 1000, 1000), 20.0),
    )  # fmt: skip
    got = window_stats([(0.0, before), (100.0, after)])
    assert got is not None
    assert got.generation_tokens_per_s == 10.0 and got.tokens_per_s == 50.0
    assert got.prompt_share == pytest.approx(0.8)
    assert got.itl == pytest.approx(0.02)
    assert got.itl_p50 == pytest.approx(0.0175)
    assert got.per_request == pytest.approx(10.0 / 10.0)
    assert got.waiting == 2.5 and got.kv_usage == pytest.approx(0.5)
    # what a client sees: 10 tokens/s shared by the 12.5 requests in the system
    assert got.in_system == pytest.approx(10.0 / 12.5)
    # demand = completions (0.05/s) + the queue's growth (5 requests in 100 s)
    assert got.arrivals_per_s == pytest.approx(0.10)
    assert window_stats([(0.0, before)]) is None


def test_a_counter_reset_inside_the_window_does_not_make_a_negative_latency() -> None:
    a = metrics(generation_tokens_total=500.0, inter_token_latency=itl((0, 500, 500, 500), 9.0))
    b = metrics(generation_tokens_total=100.0, inter_token_latency=itl((0, 100, 100, 100), 2.0))
    got = window_stats([(0.0, a), (10.0, b)])
    assert got is not None and got.itl == pytest.approx(0.02)


def test_regimes_are_half_octaves_of_generated_tokens_and_idle_has_none() -> None:
    assert regime_of(stats(generation_tokens_per_s=845.0), SETTINGS) == 19  # 724-1024
    assert regime_of(stats(generation_tokens_per_s=1024.0), SETTINGS) == 20
    assert regime_of(stats(generation_tokens_per_s=1023.0), SETTINGS) == 19
    assert regime_label(19, SETTINGS) == "724-1024 generated tokens/s"
    assert regime_of(stats(running=0.2), SETTINGS) is None  # idle
    assert regime_of(stats(generation_tokens_per_s=0.0), SETTINGS) is None  # stalled
    assert regime_of(stats(generation_tokens_per_s=None), SETTINGS) is None
    coarse = BaselineSettings(buckets_per_octave=1)
    assert regime_of(stats(generation_tokens_per_s=845.0), coarse) == 9  # 512-1024


def learn(baseline: Baseline, count: int, *, uptime: float, mono: float = 0.0) -> Baseline:
    for i in range(count):
        window = stats(itl=0.02 + i * 1e-4)
        baseline = baseline.learn(
            window, mono=mono + 60.0 * i, uptime=uptime + 60.0 * i, settings=SETTINGS
        )
    return baseline


def test_nothing_is_learned_before_the_warm_up_ends_and_after_the_run_stops_being_fresh() -> None:
    empty = Baseline(run="r")
    # The window must start after the warm-up: at uptime 700 s a 300 s window began at 400 s.
    assert empty.learn(stats(), mono=0.0, uptime=700.0, settings=SETTINGS) is empty
    assert empty.learn(stats(), mono=0.0, uptime=None, settings=SETTINGS) is empty
    assert empty.learn(stats(running=0.1), mono=0.0, uptime=1000.0, settings=SETTINGS) is empty
    learned = empty.learn(stats(), mono=0.0, uptime=900.0, settings=SETTINGS)
    assert learned.regimes[19].count == 1 and learned.last_added == 0.0
    assert learned.busy_from == 900.0 and not learned.late(SETTINGS)
    assert learned.fresh_until(SETTINGS) == 900.0 + SETTINGS.learn_for
    # Fresh for learn_for from the first busy window, then nothing more.
    stale = 900.0 + SETTINGS.learn_for + 1
    assert learned.learn(stats(), mono=stale, uptime=stale, settings=SETTINGS) is learned


def test_a_run_idle_at_first_is_fresh_from_its_first_busy_window() -> None:
    # Restarted at the start of an idle night: its loads come five hours later.
    first = 5 * 3600.0
    b = learn(Baseline(run="r"), SETTINGS.min_values, uptime=first)
    assert b.known(19, SETTINGS) is not None and b.busy_from == first
    assert not b.late(SETTINGS) and b.fresh_until(SETTINGS) == first + SETTINGS.learn_for
    # A run first busy past learn_within (or first seen then) still learns, but late: what
    # it lost before is in its baseline, so it is marked, and stands in for no other run.
    late = learn(Baseline(run="r"), SETTINGS.min_values, uptime=SETTINGS.learn_within + 60)
    assert late.known(19, SETTINGS) is not None and late.late(SETTINGS)
    assert late.fresh_until(SETTINGS) == SETTINGS.learn_within
    assert speed_change(b, late, SETTINGS) is None
    again = Baseline.from_json(json.loads(json.dumps(late.to_json())))
    assert again == late and again.late(SETTINGS)


def test_a_regime_is_unknown_until_min_values_windows_at_most_one_per_interval() -> None:
    b = Baseline(run="r")
    b = b.learn(stats(), mono=0.0, uptime=1000.0, settings=SETTINGS)
    assert b.learn(stats(), mono=30.0, uptime=1030.0, settings=SETTINGS) is b  # too soon
    b = learn(Baseline(run="r"), SETTINGS.min_values - 1, uptime=1000.0)
    assert b.known(19, SETTINGS) is None
    assert b.known(None, SETTINGS) is None
    b = learn(b, 1, uptime=2000.0, mono=2000.0)
    assert b.known(19, SETTINGS) is not None
    assert b.known_keys(SETTINGS) == [19]
    assert b.known(20, SETTINGS) is None


def test_a_complete_regime_stops_learning_so_later_degradation_cannot_creep_in() -> None:
    b = learn(Baseline(run="r"), SETTINGS.max_values, uptime=1000.0)
    assert b.regimes[19].count == SETTINGS.max_values
    slow = stats(itl=0.05)
    assert b.learn(slow, mono=1e5, uptime=3000.0, settings=SETTINGS) is b


def test_the_baseline_is_the_median_so_one_odd_window_does_not_move_it() -> None:
    regime = Regime()
    for value in (0.020, 0.021, 0.022, 0.019, 0.5):  # one window with a huge hiccup
        regime = regime.add({"itl": value})
    assert regime.median("itl") == pytest.approx(0.021)
    assert regime.median("ttft_p50") is None


def test_capacity_is_the_heaviest_known_load_served_without_preemption_or_queue() -> None:
    b = Baseline(run="r")
    for load, preempting, waiting in ((845.0, 0.0, 0.0), (1300.0, 0.0, 0.0), (1800.0, 0.2, 9.0)):
        for i in range(SETTINGS.min_values):
            window = stats(
                generation_tokens_per_s=load, requests_per_s=load / 210,
                preemptions_per_s=preempting, waiting=waiting, running=load / 48,
            )  # fmt: skip
            b = b.learn(window, mono=load * 100 + 60 * i, uptime=1000.0, settings=SETTINGS)
    capacity = b.capacity(SETTINGS)
    assert capacity is not None
    assert capacity.generation_tokens_per_s == 1300.0
    assert capacity.requests_per_s == pytest.approx(1300 / 210)
    assert capacity.running == pytest.approx(1300 / 48)
    assert Baseline(run="r").capacity(SETTINGS) is None


def test_comparison_needs_both_speed_measures_down_to_call_the_server_slow() -> None:
    base = learn(Baseline(run="r"), SETTINGS.min_values, uptime=1000.0).regimes[19]
    same = compare(stats(itl=base.medians["itl"]), 19, base)
    assert same.ratio == pytest.approx(1.0)
    slower = compare(stats(itl=base.medians["itl"] / 0.7, per_request=48.0 * 0.7), 19, base)
    assert slower.ratio == pytest.approx(0.7)
    assert slower.decode == pytest.approx(0.7) and slower.per_request == pytest.approx(0.7)
    # Only the token latency is up (e.g. longer prompts chunked in): not enough on its own.
    mixed = compare(stats(itl=base.medians["itl"] / 0.7), 19, base)
    assert mixed.decode == pytest.approx(0.7)
    assert mixed.ratio == pytest.approx(1.0)
    assert compare(stats(itl=None, per_request=None), 19, base).ratio is None


def test_baselines_survive_a_json_round_trip_and_reject_garbage_in_one_line() -> None:
    b = learn(Baseline(run="start:1741032000.000"), 12, uptime=1000.0)
    again = Baseline.from_json(json.loads(json.dumps(b.to_json())))
    assert again == b
    assert again.regimes[19].medians == b.regimes[19].medians
    # A metric a later vkvagent keeps is left out, not fatal: a downgrade keeps the rest.
    later = {"run": "r", "regimes": {"19": {"count": 1, "values": {"itl": [0.02], "new": [1.0]}}}}
    assert Baseline.from_json(later).regimes[19].values == {"itl": (0.02,)}
    for bad in (
        None,
        {"run": 3, "regimes": {}},
        {"run": "r", "server": 7, "regimes": {}},
        {"run": "r", "regimes": {"19": {"count": 1, "values": {"itl": ["x"]}}}},
        {"run": "r", "regimes": {"19": {"count": -1, "values": {}}}},
        {"run": "r", "regimes": {"x": {"count": 1, "values": {}}}},
        {"run": "r", "regimes": {"19": {"count": 1, "values": {"itl": [float("nan")]}}}},
    ):
        with pytest.raises(ValueError, match=r"^baseline: ") as caught:
            Baseline.from_json(bad)
        assert "\n" not in str(caught.value)


def test_settings_refuse_impossible_values() -> None:
    with pytest.raises(ValueError):
        BaselineSettings(min_values=10, max_values=5)
    with pytest.raises(ValueError):
        BaselineSettings(window=0)
    with pytest.raises(ValueError):
        BaselineSettings(buckets_per_octave=0)
    assert replace(SETTINGS, buckets_per_octave=4).buckets_per_octave == 4


def _run(name: str, speeds: dict[int, float], count: int = SETTINGS.min_values) -> Baseline:
    """A run whose regimes (by key) learned ``count`` windows at these in_system speeds."""
    regimes = {key: Regime(count, {"in_system": (speed,) * count}) for key, speed in speeds.items()}
    return Baseline(run=name, regimes=regimes)


def test_a_flag_changes_speed_is_judged_at_the_loads_both_runs_learned() -> None:
    before = _run("start:1", {20: 100.0, 22: 80.0, 24: 60.0})
    slower = _run("start:2", {22: 56.0, 24: 42.0, 26: 10.0})
    change = speed_change(before, slower, SETTINGS)
    assert change is not None
    assert change.ratio == pytest.approx(0.7)  # both shared loads at 0.7; load 26 not compared
    assert (change.before, change.after) == (70.0, 49.0)
    assert change.loads == (regime_label(22, SETTINGS), regime_label(24, SETTINGS))
    assert change.verdict(0.10) == "worse" and change.verdict(0.5) == "same"
    faster = speed_change(before, _run("start:3", {20: 130.0}), SETTINGS)
    assert faster is not None and faster.verdict(0.10) == "better"
    # No load in common, a load not yet known (too few windows), or an older baseline without
    # the measure: no verdict.
    assert speed_change(before, _run("start:4", {30: 5.0}), SETTINGS) is None
    assert speed_change(before, _run("start:5", {20: 5.0}, count=1), SETTINGS) is None
    old = Baseline("start:0", {20: Regime(10, {"itl": (0.02,) * 10})})
    assert speed_change(old, _run("start:6", {20: 5.0}), SETTINGS) is None


def test_an_unlearned_load_is_judged_by_the_speed_the_learned_ones_imply() -> None:
    # A fresh server whose per-token latency grows as load^0.43 (the simulator's decode model).
    def regime(load: float) -> Regime:
        itl = 0.02 * (load / 1000.0) ** 0.43
        values = {"generation_tokens_per_s": load, "itl": itl, "per_request": 1 / itl,
                  "kv_usage": load / 4000.0, "running": load * itl}  # fmt: skip
        n = SETTINGS.min_values
        return Regime(n, {name: (v,) * n for name, v in values.items()})

    def key(load: float) -> int:
        return math.floor(math.log2(load) * SETTINGS.buckets_per_octave)

    learned = Baseline(run="r", regimes={key(700.0): regime(700.0), key(1400.0): regime(1400.0)})
    between = learned.modelled(1000.0, SETTINGS)
    assert between is not None
    assert between.median("itl") == pytest.approx(0.02, rel=1e-6)
    assert between.median("per_request") == pytest.approx(50.0, rel=1e-6)
    assert between.median("generation_tokens_per_s") == 1000.0
    # Half an octave beyond the known loads, not further; never at a learned load.
    assert learned.modelled(1800.0, SETTINGS) is not None
    assert learned.modelled(2400.0, SETTINGS) is None
    assert learned.modelled(350.0, SETTINGS) is None
    assert learned.modelled(700.0, SETTINGS) is None
    # One known load says nothing of the others.
    one = Baseline(run="r", regimes={key(700.0): regime(700.0)})
    assert one.modelled(1000.0, SETTINGS) is None
    assert learned.modelled(None, SETTINGS) is None
    # Inside a learned regime too, where the run's speed by uptime is judged: its median is
    # one load, and the regime spans a factor 1.41 of them.
    inside = learned.at_load(1100.0, SETTINGS)
    assert inside is not None and key(1100.0) == key(1400.0)
    assert inside.median("itl") == pytest.approx(0.02 * 1.1**0.43, rel=1e-6)
    assert one.at_load(700.0, SETTINGS) is None and learned.at_load(2400.0, SETTINGS) is None


def test_a_run_first_seen_after_its_fresh_hours_learns_late() -> None:
    # vkvagent started (or lost its state) when vLLM had been up for 3 hours.
    seen = Baseline(run="r", seen_from=3 * 3600.0)
    b = learn(seen, SETTINGS.min_values, uptime=3 * 3600.0)
    assert b.known(19, SETTINGS) is not None and b.late(SETTINGS)
    # Seen from its start, the same windows are fresh.
    assert not learn(Baseline(run="r", seen_from=60.0), SETTINGS.min_values,
                     uptime=3 * 3600.0).late(SETTINGS)  # fmt: skip
    assert Baseline.from_json(json.loads(json.dumps(b.to_json()))) == b
