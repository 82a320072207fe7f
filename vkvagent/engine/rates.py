"""Rates and quantiles over a window of consecutive scrapes, as Prometheus computes them.

``increase`` and ``histogram_increase`` sum per-interval deltas and treat a drop as a counter
reset (vLLM restarted: counting began again from zero), like Prometheus' ``increase()`` without
its extrapolation to the window edges. ``quantile`` is ``histogram_quantile()``: linear
interpolation inside the bucket, the highest finite bound when the rank falls in +Inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from vkvagent.engine.samples import Histogram, VllmMetrics

Point = tuple[float, VllmMetrics]  # (monotonic seconds, scrape)


def counters(metrics: VllmMetrics) -> tuple[float | None, ...]:
    """The cumulative counters whose drop means vLLM restarted; compact enough for a caller
    to keep between scrapes (the engine does)."""
    return (
        metrics.generation_tokens_total,
        metrics.prompt_tokens_total,
        metrics.request_success_total,
        metrics.num_preemptions_total,
        metrics.engine_steps_total,
    )


def is_reset(before: VllmMetrics, after: VllmMetrics) -> bool:
    """Whether vLLM restarted between two scrapes: a new process start time, or any counter
    going down. One verdict for the whole interval, so every counter is treated alike."""
    if (
        before.process_start_time is not None
        and after.process_start_time is not None
        and before.process_start_time != after.process_start_time
    ):
        return True
    return any(
        old is not None and new is not None and new < old
        for old, new in zip(counters(before), counters(after))
    )


def increase(values: Sequence[float | None], resets: Sequence[bool]) -> float | None:
    """Total increase of a counter; ``resets[i]`` says vLLM restarted between values i and
    i+1. A missing value is bridged: its neighbours are compared, with either interval's reset.
    None when fewer than two values are present."""
    total: float | None = None
    previous: float | None = None
    reset_since = False
    for index, value in enumerate(values):
        if index > 0:
            reset_since = reset_since or resets[index - 1]
        if value is None:
            continue
        if previous is not None:
            grown = value if reset_since or value < previous else value - previous
            total = (total or 0.0) + grown
        previous, reset_since = value, False
    return total


def histogram_increase(
    hists: Sequence[Histogram | None], resets: Sequence[bool]
) -> Histogram | None:
    """Bucket-wise increase of a histogram over the intervals; None when nothing to compare."""
    total: list[float] | None = None
    bounds: tuple[float, ...] = ()
    total_sum = 0.0
    for (old, new), reset in zip(zip(hists, hists[1:]), resets):
        if old is None or new is None:
            continue
        if total is not None and new.bounds != bounds:
            total, total_sum = None, 0.0  # the layout changed (new vLLM version): start over
        if reset or old.bounds != new.bounds or new.count < old.count:
            delta = list(new.cumulative)
            delta_sum = new.sum
        else:
            delta = [n - o for n, o in zip(new.cumulative, old.cumulative)]
            delta_sum = new.sum - old.sum
        bounds = new.bounds
        total = delta if total is None else [t + d for t, d in zip(total, delta)]
        total_sum += delta_sum
    if total is None:
        return None
    return Histogram(bounds=bounds, cumulative=tuple(total), sum=total_sum)


def quantile(q: float, hist: Histogram | None) -> float | None:
    """The q-quantile (0..1) of a cumulative histogram; None when it holds no observation."""
    if hist is None or hist.count <= 0 or len(hist.bounds) < 2:
        return None
    rank = q * hist.count
    finite = len(hist.bounds) - 1
    index = next((i for i in range(finite) if hist.cumulative[i] >= rank), finite)
    if index == finite:
        return hist.bounds[finite - 1]
    upper = hist.bounds[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = hist.bounds[index - 1], hist.cumulative[index - 1]
    inside = hist.cumulative[index] - below
    if inside <= 0:
        return upper
    return lower + (upper - lower) * ((rank - below) / inside)  # exact at the bucket edges


@dataclass(frozen=True)
class Rates:
    """What a window of scrapes says: per-second rates, latency quantiles and mean load."""

    seconds: float
    resets: int
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    requests_per_s: float | None
    preemptions_per_s: float | None
    engine_steps_per_s: float | None
    prefix_cache_hit_ratio: float | None  # hits / queries in the window
    ttft_p50: float | None
    ttft_p90: float | None
    itl_p50: float | None
    itl_p90: float | None
    mean_running: float | None
    mean_waiting: float | None
    mean_kv_usage: float | None

    @property
    def tokens_per_s(self) -> float | None:
        if self.prompt_tokens_per_s is None or self.generation_tokens_per_s is None:
            return None
        return self.prompt_tokens_per_s + self.generation_tokens_per_s


def window_rates(points: Sequence[Point]) -> Rates | None:
    """Rates over consecutive scrapes, oldest first; None with fewer than two or no time span.
    Times must be monotonic; a point whose time is not after the last one kept is dropped."""
    kept: list[Point] = []
    for point in points:
        if not kept or point[0] > kept[-1][0]:
            kept.append(point)
    points = kept
    if len(points) < 2:
        return None
    seconds = points[-1][0] - points[0][0]
    scrapes = [m for _t, m in points]
    resets = [is_reset(a, b) for a, b in zip(scrapes, scrapes[1:])]

    def per_second(read: Callable[[VllmMetrics], float | None]) -> float | None:
        grown = increase([read(m) for m in scrapes], resets)
        return None if grown is None else grown / seconds

    queries = increase([m.prefix_cache_queries_total for m in scrapes], resets)
    hits = increase([m.prefix_cache_hits_total for m in scrapes], resets)
    ttft = histogram_increase([m.time_to_first_token for m in scrapes], resets)
    itl = histogram_increase([m.inter_token_latency for m in scrapes], resets)
    return Rates(
        seconds=seconds,
        resets=sum(resets),
        prompt_tokens_per_s=per_second(lambda m: m.prompt_tokens_total),
        generation_tokens_per_s=per_second(lambda m: m.generation_tokens_total),
        requests_per_s=per_second(lambda m: m.request_success_total),
        preemptions_per_s=per_second(lambda m: m.num_preemptions_total),
        engine_steps_per_s=per_second(lambda m: m.engine_steps_total),
        prefix_cache_hit_ratio=hits / queries if queries and hits is not None else None,
        ttft_p50=quantile(0.5, ttft),
        ttft_p90=quantile(0.9, ttft),
        itl_p50=quantile(0.5, itl),
        itl_p90=quantile(0.9, itl),
        mean_running=mean([m.num_requests_running for m in scrapes]),
        mean_waiting=mean([m.num_requests_waiting for m in scrapes]),
        mean_kv_usage=mean([m.kv_cache_usage for m in scrapes]),
    )


def mean(values: Sequence[float | None]) -> float | None:
    """The mean of the values present; None when none is."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
