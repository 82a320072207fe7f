"""Rates and quantiles agree with what Prometheus' increase() and histogram_quantile() give."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import metrics
from vkvagent.engine.rates import histogram_increase, increase, is_reset, quantile, window_rates
from vkvagent.engine.samples import Histogram

INF = math.inf


def hist(cumulative: tuple[float, ...], total: float = 0.0) -> Histogram:
    bounds = (0.01, 0.05, 0.1, 0.5, 1.0, INF)[-len(cumulative) :]
    return Histogram(bounds=bounds, cumulative=cumulative, sum=total)


def test_increase_sums_deltas_and_treats_a_drop_as_a_restart_from_zero() -> None:
    assert increase([10, 15, 25], [False, False]) == 15
    # 100 -> 130, restart, 20 counted since the restart, -> 50
    assert increase([100, 130, 20, 50], [False, False, False]) == 30 + 20 + 30
    # a reset flagged by the caller wins even if the new value is higher
    assert increase([5, 9], [True]) == 9
    # a missing value is bridged, and a reset on either side of it counts
    assert increase([None, 3, None, 7], [False, False, False]) == 4
    assert increase([0, 50, None, 150], [False, False, False]) == 150
    assert increase([40, None, 5], [True, False]) == 5
    assert increase([None, 3, None], [False, False]) is None
    assert increase([1], []) is None


def test_a_new_process_start_time_is_a_restart_even_when_counters_grew() -> None:
    before = metrics(process_start_time=1000.0, generation_tokens_total=50.0)
    after = metrics(process_start_time=2000.0, generation_tokens_total=80.0)
    assert is_reset(before, after)
    assert not is_reset(before, metrics(process_start_time=1000.0, generation_tokens_total=80.0))
    assert is_reset(metrics(generation_tokens_total=80.0), metrics(generation_tokens_total=1.0))


def test_quantile_interpolates_like_histogram_quantile() -> None:
    # 10 observations: 2 <= 0.1, 8 <= 0.5, 10 <= 1
    h = Histogram(bounds=(0.1, 0.5, 1.0, INF), cumulative=(2, 8, 10, 10), sum=4.0)
    # rank 5 falls in (0.1, 0.5]: 0.1 + 0.4 * (5 - 2) / 6
    assert quantile(0.5, h) == pytest.approx(0.3)
    # rank 9 in (0.5, 1]: 0.5 + 0.5 * (9 - 8) / 2
    assert quantile(0.9, h) == pytest.approx(0.75)
    # rank 1 in the first bucket, lower bound 0
    assert quantile(0.1, h) == pytest.approx(0.05)
    # in +Inf: the highest finite bound, as Prometheus does
    tail = Histogram(bounds=(0.1, 0.5, 1.0, INF), cumulative=(0, 0, 1, 10), sum=50.0)
    assert quantile(0.99, tail) == 1.0
    assert quantile(0.5, Histogram(bounds=(0.1, INF), cumulative=(0, 0), sum=0)) is None
    assert quantile(0.5, None) is None


def test_histogram_increase_uses_bucket_deltas_and_survives_a_restart() -> None:
    a, b = hist((1, 2, 3)), hist((1, 5, 9), 2.0)
    restarted = hist((0, 1, 1), 0.5)
    later = hist((0, 3, 4), 1.0)
    total = histogram_increase([a, b, restarted, later], [False, True, False])
    assert total is not None
    assert total.cumulative == ((1 - 1) + 0 + 0, (5 - 2) + 1 + 2, (9 - 3) + 1 + 3)
    assert total.sum == pytest.approx(2.0 + 0.5 + 0.5)


def test_histogram_layout_change_restarts_the_window() -> None:
    old = Histogram(bounds=(0.1, INF), cumulative=(1, 2), sum=0.1)
    new_a = Histogram(bounds=(0.1, 0.2, INF), cumulative=(1, 1, 1), sum=0.1)
    new_b = Histogram(bounds=(0.1, 0.2, INF), cumulative=(3, 4, 5), sum=0.9)
    total = histogram_increase([old, old, new_a, new_b], [False, False, False])
    assert total is not None and total.bounds == (0.1, 0.2, INF)
    assert total.cumulative == (1 + 2, 1 + 3, 1 + 4)


def test_window_rates_from_consecutive_scrapes() -> None:
    ttft0 = Histogram(bounds=(0.1, 1.0, INF), cumulative=(0, 0, 0), sum=0)
    ttft1 = Histogram(bounds=(0.1, 1.0, INF), cumulative=(5, 10, 10), sum=2.0)
    points = [
        (
            100.0,
            metrics(
                generation_tokens_total=1000.0,
                prompt_tokens_total=4000.0,
                num_preemptions_total=0.0,
                request_success_total=10.0,
                prefix_cache_queries_total=0.0,
                prefix_cache_hits_total=0.0,
                num_requests_running=4.0,
                kv_cache_usage=0.2,
                time_to_first_token=ttft0,
            ),
        ),
        (
            110.0,
            metrics(
                generation_tokens_total=1500.0,
                prompt_tokens_total=6000.0,
                num_preemptions_total=3.0,
                request_success_total=15.0,
                prefix_cache_queries_total=2000.0,
                prefix_cache_hits_total=500.0,
                num_requests_running=8.0,
                kv_cache_usage=0.6,
                time_to_first_token=ttft1,
            ),
        ),
    ]
    r = window_rates(points)
    assert r is not None
    assert r.seconds == 10
    assert r.generation_tokens_per_s == 50
    assert r.prompt_tokens_per_s == 200
    assert r.tokens_per_s == 250
    assert r.preemptions_per_s == pytest.approx(0.3)
    assert r.requests_per_s == pytest.approx(0.5)
    assert r.prefix_cache_hit_ratio == pytest.approx(0.25)
    assert r.ttft_p50 == pytest.approx(0.1)  # rank 5 is exactly the first bucket's top
    assert r.ttft_p90 == pytest.approx(0.1 + 0.9 * (9 - 5) / 5)
    assert r.mean_running == 6 and r.mean_kv_usage == pytest.approx(0.4)
    assert r.resets == 0
    assert r.itl_p50 is None and r.engine_steps_per_s is None  # not on these scrapes


def test_window_rates_across_a_vllm_restart() -> None:
    points = [
        (0.0, metrics(generation_tokens_total=900.0, process_start_time=1.0)),
        (10.0, metrics(generation_tokens_total=1000.0, process_start_time=1.0)),
        (20.0, metrics(generation_tokens_total=40.0, process_start_time=2.0)),
        (30.0, metrics(generation_tokens_total=140.0, process_start_time=2.0)),
    ]
    r = window_rates(points)
    assert r is not None and r.resets == 1
    assert r.generation_tokens_per_s == pytest.approx((100 + 40 + 100) / 30)


def test_window_rates_needs_two_points_and_forward_time() -> None:
    one = (5.0, metrics(generation_tokens_total=1.0))
    assert window_rates([]) is None
    assert window_rates([one]) is None
    assert window_rates([one, (5.0, metrics(generation_tokens_total=2.0))]) is None
    # a point out of order is dropped rather than producing a negative interval
    r = window_rates(
        [
            one,
            (3.0, metrics(generation_tokens_total=9.0)),
            (15.0, metrics(generation_tokens_total=21.0)),
        ]
    )
    assert r is not None and r.generation_tokens_per_s == pytest.approx(2.0)
    # after a reboot monotonic time starts again: never a negative span or rate
    times = [100.0, 200.0, 5.0, 15.0]
    late = window_rates([(t, metrics(generation_tokens_total=t * 10)) for t in times])
    assert late is not None and late.seconds == 100 and late.generation_tokens_per_s == 10


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.integers(0, 10_000), min_size=1, max_size=30),
    restart_at=st.sets(st.integers(1, 29)),
)
def test_increase_equals_the_tokens_actually_produced(steps, restart_at) -> None:
    """Simulate a counter through restarts: the computed increase equals the true production
    (tokens produced before the first scrape after a restart are counted from zero)."""
    values, resets, produced, counter = [0.0], [], 0.0, 0.0
    for i, step in enumerate(steps, start=1):
        reset = i in restart_at
        counter = (0.0 if reset else counter) + step
        produced += step
        values.append(counter)
        resets.append(reset)
    assert increase(values, resets) == pytest.approx(produced)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 1000), min_size=2, max_size=8),
    q=st.floats(0.01, 0.99),
)
def test_quantile_stays_inside_the_bucket_that_holds_the_rank(counts, q) -> None:
    bounds = (*tuple(0.01 * 2**i for i in range(len(counts) - 1)), INF)
    cumulative = tuple(float(sum(counts[: i + 1])) for i in range(len(counts)))
    h = Histogram(bounds=bounds, cumulative=cumulative, sum=0.0)
    value = quantile(q, h)
    if cumulative[-1] == 0:
        assert value is None
        return
    assert value is not None
    assert 0 <= value <= bounds[-2]
    rank = q * cumulative[-1]
    index = next((i for i, c in enumerate(cumulative[:-1]) if c >= rank), len(bounds) - 1)
    lower = 0.0 if index == 0 else bounds[index - 1]
    upper = bounds[min(index, len(bounds) - 2)]
    assert lower - 1e-12 <= value <= upper + 1e-12
