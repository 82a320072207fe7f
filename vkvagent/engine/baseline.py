"""Baselines: what this vLLM run did while it was fresh, per load regime.

A server is slow only relative to itself at the same load: each request decodes slower as the
batch grows, so a busy afternoon is not a degradation and a quiet night does not prove health.
A baseline is therefore learned per vLLM run (a new process or a counter reset starts a new
one), only after the warm-up and only while the run is fresh, separately for each load regime.
A run is fresh for ``learn_for`` from its first busy window, not from its start: a server
restarted at the start of an idle night meets its loads only in the morning, and idle hours
do not wear it (a run that sat idle all of its first ``learn_within`` still learns then, as
does one first seen long after its start, but its baseline is *late*: what it lost before
cannot be seen, and it never stands in for another run).
Each regime keeps the values of up to ``max_values`` windows; its baseline is their median,
which one odd window cannot move. A regime with fewer than ``min_values`` windows is unknown,
and unknown never restarts.

The regime is the decode load served (generation tokens/s, a few buckets per octave), not the
number of running requests: concurrency is a consequence of speed (Little's law: running =
tokens/s x seconds per token), so a server that slows down runs more requests at once and
would leave the regime it was learned in just as the slowdown becomes worth acting on (the
simulator's uptime decline moves mean concurrency from 17.6 to 22.5 at 84 % speed, out of its
bucket). The load served stays put while the server keeps up, and at equal load a slower
server shows longer inter-token latency and more requests in flight. The mean concurrency is
kept per regime as evidence.

Pure: values in, values out. ``Baseline.to_json``/``from_json`` make it persistable.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from vkvagent.engine.rates import Point, increase, is_reset, window_rates
from vkvagent.engine.samples import Histogram, VllmMetrics

# What a window is summarised by (WindowStats field names), kept per regime.
METRICS = (
    "itl",
    "itl_p50",
    "ttft_p50",
    "tokens_per_s",
    "generation_tokens_per_s",
    "per_request",
    "in_system",
    "requests_per_s",
    "preemptions_per_s",
    "running",
    "waiting",
    "kv_usage",
    "prompt_share",
    "prompt_per_request",
    "output_per_request",
    "prefix_hit_ratio",
    "sm_clock_ratio",
)


@dataclass(frozen=True)
class BaselineSettings:
    """How baselines are learned (all durations in seconds)."""

    window: float = 300.0  # samples summarised by one measurement (the trailing window)
    warmup: float = 600.0  # uptime excluded: CUDA graphs, caches and the first burst settle
    learn_for: float = 7200.0  # from its first busy window, how long the run counts as fresh
    learn_within: float = 28800.0  # a first busy window later than this uptime learns "late"
    value_interval: float = 60.0  # at most one window value kept per this many seconds
    min_values: int = 10  # windows a regime needs before its baseline is known
    max_values: int = 60  # windows kept per regime; then it is complete
    buckets_per_octave: int = 2  # regime resolution: 2 means 1024-1448, 1448-2048 tokens/s...
    min_running: float = 0.5  # below this mean concurrency the server is idle: no regime

    def __post_init__(self) -> None:
        if not (self.window > 0 and self.value_interval > 0 and self.warmup >= 0):
            raise ValueError("baseline: window and value_interval must be > 0, warmup >= 0")
        if self.learn_within < self.warmup:
            raise ValueError("baseline: learn_within must be at least the warm-up")
        if not 1 <= self.min_values <= self.max_values:
            raise ValueError("baseline: need 1 <= min_values <= max_values")
        if not 1 <= self.buckets_per_octave <= 8:
            raise ValueError("baseline: buckets_per_octave must be 1 to 8")


@dataclass(frozen=True)
class WindowStats:
    """What one window of scrapes says, in the terms baselines are kept in."""

    seconds: float
    running: float | None  # mean running requests
    waiting: float | None  # mean waiting requests
    kv_usage: float | None  # mean KV-cache usage, 0..1
    tokens_per_s: float | None  # prompt + generation tokens per second
    generation_tokens_per_s: float | None
    requests_per_s: float | None  # completed requests per second: the load served
    arrivals_per_s: float | None  # completions plus the growth of requests in the system
    preemptions_per_s: float | None
    itl: float | None  # mean inter-token latency (s): exact, unlike a bucketed p50
    itl_p50: float | None
    ttft_p50: float | None
    prompt_share: float | None  # prompt tokens / all tokens: the request mix
    per_request: float | None  # generation tokens/s per running request
    # Generation tokens/s per request in the system (running + waiting): a client's speed,
    # queueing included. A flag that caps the batch keeps per_request and makes requests wait.
    in_system: float | None = None
    # Mean over the window's samples of the slowest GPU's SM clock / its maximum: a busy GPU
    # at its power cap runs well below the maximum, fresh or not (None: no GPU readings).
    sm_clock_ratio: float | None = None
    prefix_hit_ratio: float | None = None  # prefix-cache hits / queries (None: none queried)
    # The request mix: prompt and generated tokens per completed request. Relative, unlike
    # the prompt share, which from the usual 0.85 cannot move much whatever prompts do.
    prompt_per_request: float | None = None
    output_per_request: float | None = None

    def values(self) -> dict[str, float]:
        """The METRICS this window has, by name."""
        out = {}
        for name in METRICS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def window_stats(points: Sequence[Point], min_running: float = 0.5) -> WindowStats | None:
    """Summarise consecutive scrapes (oldest first); None with fewer than two."""
    rates = window_rates(points)
    if rates is None:
        return None
    scrapes = [m for _t, m in points]
    resets = [is_reset(a, b) for a, b in zip(scrapes, scrapes[1:])]
    tokens = rates.tokens_per_s
    generated = rates.generation_tokens_per_s
    running = rates.mean_running
    present = None if running is None else running + (rates.mean_waiting or 0.0)
    return WindowStats(
        seconds=rates.seconds,
        running=running,
        waiting=rates.mean_waiting,
        kv_usage=rates.mean_kv_usage,
        tokens_per_s=tokens,
        generation_tokens_per_s=generated,
        requests_per_s=rates.requests_per_s,
        arrivals_per_s=_arrivals(rates.requests_per_s, scrapes, rates.seconds),
        preemptions_per_s=rates.preemptions_per_s,
        itl=_histogram_mean([m.inter_token_latency for m in scrapes], resets),
        itl_p50=rates.itl_p50,
        ttft_p50=rates.ttft_p50,
        prompt_share=(
            rates.prompt_tokens_per_s / tokens
            if tokens and rates.prompt_tokens_per_s is not None
            else None
        ),
        per_request=(
            generated / running
            if generated is not None and running is not None and running >= min_running
            else None
        ),
        in_system=(
            generated / present
            if generated is not None and present is not None and present >= min_running
            else None
        ),
        prefix_hit_ratio=rates.prefix_cache_hit_ratio,
        prompt_per_request=_ratio(rates.prompt_tokens_per_s, rates.requests_per_s),
        output_per_request=_ratio(generated, rates.requests_per_s),
    )


def _arrivals(completed: float | None, scrapes: list[VllmMetrics], seconds: float) -> float | None:
    """Demand: what was completed plus what piled up (running + waiting) over the window,
    the only estimate of arrivals vLLM's metrics allow when requests queue."""
    if completed is None:
        return None
    first, last = scrapes[0], scrapes[-1]
    if first.num_requests_running is None or last.num_requests_running is None:
        return completed
    before = first.num_requests_running + (first.num_requests_waiting or 0.0)
    after = last.num_requests_running + (last.num_requests_waiting or 0.0)
    return max(0.0, completed + (after - before) / seconds)


def _histogram_mean(hists: list[Histogram | None], resets: list[bool]) -> float | None:
    # Sum and count increase like counters; their ratio is the window's mean observation.
    count = increase([h.count if h else None for h in hists], resets)
    total = increase([h.sum if h else None for h in hists], resets)
    if not count or total is None:
        return None
    return total / count


def regime_of(stats: WindowStats, settings: BaselineSettings) -> int | None:
    """The load bucket of a window (generation tokens/s); None when idle or not producing."""
    served = stats.generation_tokens_per_s
    if stats.running is None or stats.running < settings.min_running or not served:
        return None
    return load_key(served, settings)


def load_key(load: float, settings: BaselineSettings) -> int:
    """The regime a load (generation tokens/s, above 0) falls in."""
    return math.floor(math.log2(load) * settings.buckets_per_octave)


def regime_label(key: int, settings: BaselineSettings) -> str:
    """``4096-5793 tokens/s``: the decode load a regime covers."""
    low = 2 ** (key / settings.buckets_per_octave)
    high = 2 ** ((key + 1) / settings.buckets_per_octave)
    return f"{low:.0f}-{high:.0f} generated tokens/s"


# The speeds modelled across loads (Baseline.modelled), and how far beyond the known loads:
# one bucket is half an octave of load at the default resolution.
MODELLED = ("itl", "per_request", "in_system")
MODEL_REACH = 1


def _line(points: Sequence[tuple[float, float]], x: float) -> float:
    """The line through two points, at ``x`` (flat if both are at one x)."""
    (x0, y0), (x1, y1) = points
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
    return y0 + slope * (x - x0)


@dataclass(frozen=True)
class Regime:
    """The windows kept for one concurrency regime: per metric, its values, oldest first."""

    count: int = 0
    values: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    def add(self, values: Mapping[str, float]) -> Regime:
        merged = dict(self.values)
        for name, value in values.items():
            merged[name] = (*merged.get(name, ()), value)
        return Regime(self.count + 1, merged)

    @cached_property
    def medians(self) -> Mapping[str, float]:
        """The baseline: each metric's median over the kept windows."""
        return {name: statistics.median(v) for name, v in self.values.items() if v}

    def median(self, name: str) -> float | None:
        return self.medians.get(name)


@dataclass(frozen=True)
class Capacity:
    """The heaviest load this run's fresh server served cleanly: no preemption, no queue."""

    requests_per_s: float
    generation_tokens_per_s: float
    running: float | None  # the concurrency that load took
    regime: int
    kv_usage: float | None = None  # the KV-cache usage it took


@dataclass(frozen=True)
class Baseline:
    """One vLLM run's fresh behaviour, per regime. ``run`` names the run it belongs to."""

    run: str
    regimes: Mapping[int, Regime] = field(default_factory=dict)
    last_added: float | None = None  # monotonic time of the last window kept
    server: str = ""  # engine.server_identity of the run: another run's stands in only if equal
    busy_from: float | None = None  # the uptime of the first window kept: fresh from there
    # The uptime this run was first seen at, when it was seen before it learned anything.
    seen_from: float | None = None

    def late(self, settings: BaselineSettings) -> bool:
        """Learned after ``learn_within`` of uptime, or by an agent that first saw the run
        after its fresh hours: whatever the run lost before is in it."""
        if self.seen_from is not None and self.seen_from > settings.warmup + settings.learn_for:
            return True
        return self.busy_from is not None and self.busy_from > settings.learn_within

    def fresh_until(self, settings: BaselineSettings) -> float:
        """The uptime after which nothing this run learns counts as fresh (a late baseline
        still learns, for ``learn_for`` from its first busy window)."""
        if self.busy_from is None or self.late(settings):
            return settings.learn_within
        return self.busy_from + settings.learn_for

    def known(self, key: int | None, settings: BaselineSettings) -> Regime | None:
        """The regime's values if there are enough of them, else None (unknown)."""
        if key is None:
            return None
        regime = self.regimes.get(key)
        return regime if regime is not None and regime.count >= settings.min_values else None

    def known_keys(self, settings: BaselineSettings) -> list[int]:
        return sorted(k for k, r in self.regimes.items() if r.count >= settings.min_values)

    def modelled(self, load: float | None, settings: BaselineSettings) -> Regime | None:
        """At a load (generated tokens/s) in no regime learned, the fresh speed the learned
        ones imply: the per-token latency and the tokens/s per request, each a power of the
        load between the two known regimes around it (or the two nearest, beyond them: a
        line in log-log through their median loads), the rest the nearest known regime's.
        Only from two known regimes or more, and between them or at most ``MODEL_REACH``
        buckets beyond; else None."""
        if load and load > 0 and self.known(load_key(load, settings), settings) is not None:
            return None
        return self.at_load(load, settings)

    def at_load(self, load: float | None, settings: BaselineSettings) -> Regime | None:
        """The fresh speed at exactly this load, as ``modelled`` implies it, in a learned
        regime too: within one (a factor 1.41 of load) a client's speed still falls with the
        load, which a run's speed by uptime must not take for a decline. None from fewer than
        two known regimes, or beyond ``MODEL_REACH``."""
        keys = self.known_keys(settings)
        if not load or load <= 0 or len(keys) < 2:
            return None
        key = load_key(load, settings)
        if not keys[0] - MODEL_REACH <= key <= keys[-1] + MODEL_REACH:
            return None
        nearest = self.regimes[min(keys, key=lambda k: (abs(k - key), k))]
        medians = dict(nearest.medians)
        medians["generation_tokens_per_s"] = load
        x = math.log(load)
        for name in MODELLED:
            found = []
            for k in keys:
                served = self.regimes[k].median("generation_tokens_per_s")
                value = self.regimes[k].median(name)
                if served and value and served > 0 and value > 0:
                    found.append((math.log(served), math.log(value)))
            if len(found) < 2:
                medians.pop(name, None)
                continue
            found.sort()
            above = next((i for i, (fx, _fy) in enumerate(found) if fx > x), len(found))
            i = min(max(above, 1), len(found) - 1)
            medians[name] = math.exp(_line(found[i - 1 : i + 1], x))
        return Regime(settings.min_values, {n: (v,) for n, v in medians.items()})

    def learn(
        self, stats: WindowStats, *, mono: float, uptime: float | None, settings: BaselineSettings
    ) -> Baseline:
        """This baseline with ``stats`` kept, when the window is busy, past the warm-up, fresh
        (within ``learn_for`` of the first window kept), not too soon after the last one kept,
        and its regime still needs values; else itself."""
        if uptime is None or uptime - stats.seconds < settings.warmup:
            return self
        key = regime_of(stats, settings)
        if key is None:
            return self
        busy_from = uptime if self.busy_from is None else self.busy_from
        if uptime > busy_from + settings.learn_for:
            return self
        if self.last_added is not None and 0 <= mono - self.last_added < settings.value_interval:
            return self
        regime = self.regimes.get(key, Regime())
        if regime.count >= settings.max_values:
            return self
        regimes = dict(self.regimes)
        regimes[key] = regime.add(stats.values())
        return replace(self, regimes=regimes, last_added=mono, busy_from=busy_from)

    def merged(self, older: Baseline, settings: BaselineSettings) -> Baseline:
        """This baseline, with ``older``'s known regimes where this one does not know them."""
        regimes = dict(self.regimes)
        for key in older.known_keys(settings):
            if self.known(key, settings) is None:
                regimes[key] = older.regimes[key]
        return replace(self, regimes=regimes)

    def capacity(self, settings: BaselineSettings) -> Capacity | None:
        """The heaviest known regime that ran clean (median preemptions 0, median queue under
        half a request), by its median request rate and generation tokens/s."""
        best: Capacity | None = None
        for key in self.known_keys(settings):
            regime = self.regimes[key]
            rate = regime.median("requests_per_s")
            served = regime.median("generation_tokens_per_s")
            if rate is None or served is None:
                continue
            if (regime.median("preemptions_per_s") or 0.0) > 0:
                continue
            if (regime.median("waiting") or 0.0) >= 0.5:
                continue
            if best is None or rate > best.requests_per_s:
                best = Capacity(
                    rate, served, regime.median("running"), key, regime.median("kv_usage")
                )
        return best

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "server": self.server,
            "last_added": self.last_added,
            "busy_from": self.busy_from,
            "seen_from": self.seen_from,
            "regimes": {
                str(key): {"count": r.count, "values": {n: list(v) for n, v in r.values.items()}}
                for key, r in sorted(self.regimes.items())
            },
        }

    @classmethod
    def from_json(cls, data: Any) -> Baseline:
        """The inverse of ``to_json``; ValueError (one line) for anything malformed."""
        try:
            run, server = data["run"], data.get("server", "")
            # A baseline kept before busy_from was its warm-up's: fresh from the run's start.
            last, busy_from = data.get("last_added"), data.get("busy_from", 0.0)
            if not isinstance(run, str) or not (last is None or _is_number(last)):
                raise ValueError("run must be a string and last_added a number or null")
            seen_from = data.get("seen_from")
            if not all(v is None or _is_number(v) for v in (busy_from, seen_from)):
                raise ValueError("busy_from and seen_from must be numbers or null")
            if not isinstance(server, str):
                raise ValueError("server must be a string")
            regimes = {}
            for key, entry in data["regimes"].items():
                values = {}
                for name, seq in entry["values"].items():
                    if not all(_is_number(v) for v in seq):
                        raise ValueError(f"regime {key}: bad values for {name!r}")
                    if name in METRICS:  # one a later version added is left out, not fatal
                        values[name] = tuple(float(v) for v in seq)
                count = entry["count"]
                if not isinstance(count, int) or count < 0:
                    raise ValueError(f"regime {key}: bad count {count!r}")
                regimes[int(key)] = Regime(count, values)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"baseline: malformed ({type(exc).__name__}: {exc})") from None
        except ValueError as exc:
            raise ValueError(f"baseline: {exc}") from None
        return cls(
            run,
            regimes,
            None if last is None else float(last),
            server,
            None if busy_from is None or not regimes else float(busy_from),
            None if seen_from is None else float(seen_from),
        )


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


@dataclass(frozen=True)
class Comparison:
    """The current window against the baseline of its regime; ratios are current over
    baseline, oriented so that below 1 means slower."""

    regime: int
    ratio: float | None  # the speed verdict: the larger of decode and per_request
    decode: float | None  # baseline mean ITL / current mean ITL
    per_request: float | None  # generation tokens/s per running request, current / baseline
    throughput: float | None  # all tokens/s, current / baseline (evidence only)
    ttft: float | None  # baseline TTFT p50 / current (evidence only: queueing moves it)
    baseline: Mapping[str, float]


def compare(stats: WindowStats, key: int, regime: Regime) -> Comparison:
    """Compare like with like. The speed ratio takes the larger of the two speed measures, so
    a restart needs both the per-token latency and the per-request output rate to be down."""
    base = regime.medians
    decode = _ratio(base.get("itl"), stats.itl)
    per_request = _ratio(stats.per_request, base.get("per_request"))
    present = [r for r in (decode, per_request) if r is not None]
    return Comparison(
        regime=key,
        ratio=max(present) if present else None,
        decode=decode,
        per_request=per_request,
        throughput=_ratio(stats.tokens_per_s, base.get("tokens_per_s")),
        ttft=_ratio(base.get("ttft_p50"), stats.ttft_p50),
        baseline=base,
    )


@dataclass(frozen=True)
class SpeedChange:
    """A later run's fresh speed against an earlier run's, at the loads both learned while
    fresh: per load, the median generated tokens/s per request in the system (``in_system``:
    what a client waits for, queueing included)."""

    ratio: float  # the median over the loads of later / earlier
    before: float  # the earlier run's speed, median over the loads
    after: float  # the later run's
    loads: tuple[str, ...]  # the loads compared, as regime_label names them

    def verdict(self, margin: float) -> str:
        """``worse``, ``better`` or ``same``: beyond ``margin`` (a fraction) either way."""
        if self.ratio < 1 - margin:
            return "worse"
        if self.ratio > 1 + margin:
            return "better"
        return "same"


def speed_change(
    earlier: Baseline, later: Baseline, settings: BaselineSettings
) -> SpeedChange | None:
    """How ``later``'s fresh speed compares with ``earlier``'s; None while no load is known
    to both (not enough comparable load is no verdict), or when either was learned late."""
    if earlier.late(settings) or later.late(settings):
        return None
    keys = sorted(set(earlier.known_keys(settings)) & set(later.known_keys(settings)))
    pairs = [
        (earlier.regimes[k].median("in_system"), later.regimes[k].median("in_system"), k)
        for k in keys
    ]
    found = [(old, new, k) for old, new, k in pairs if old and new is not None]
    if not found:
        return None
    return SpeedChange(
        ratio=statistics.median(new / old for old, new, _k in found),
        before=statistics.median(old for old, _new, _k in found),
        after=statistics.median(new for _old, new, _k in found),
        loads=tuple(regime_label(k, settings) for _old, _new, k in found),
    )


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator
