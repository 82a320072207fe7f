"""vLLM's Prometheus exposition, normalised across versions into one ``VllmMetrics`` value.

vLLM renamed, split and removed metrics between V0 (0.6-0.10), early V1 (0.8), V1 0.9.2-0.11
(old and new names side by side) and V1 0.12+; see docs/metrics.md for the table this module
implements. Counters are summed and gauges combined across the ``engine`` label (data-parallel
ranks), and each engine's own values are kept beside the totals (``VllmMetrics.per_engine``), so
one saturated or stalled engine does not hide behind the others; ``_created`` series are never
read.

Speed: a page of several engines with full histograms is 100-300 KB, of which the agent needs
about one line in six. Each line's metric name is matched first and only wanted series are
parsed; their label sets (parsed by prometheus_client) are cached, since the same server
exposes the same series on every scrape. bench/README.md has the figures.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.parser import parse_labels

from vkvagent.engine.samples import EngineSignals, Histogram, VllmMetrics
from vkvagent.errors import VkvagentError

FLAVORS = ("v0", "v1-0.8", "v1-0.10", "v1-latest")

_P = "vllm:"
RUNNING = _P + "num_requests_running"
WAITING = _P + "num_requests_waiting"
KV_USAGE = _P + "kv_cache_usage_perc"
KV_USAGE_OLD = _P + "gpu_cache_usage_perc"
PREEMPTIONS = _P + "num_preemptions_total"
GENERATION_TOKENS = _P + "generation_tokens_total"
PROMPT_TOKENS = _P + "prompt_tokens_total"
REQUEST_SUCCESS = _P + "request_success_total"
PREFIX_QUERIES = _P + "prefix_cache_queries_total"
PREFIX_HITS = _P + "prefix_cache_hits_total"
PREFIX_QUERIES_OLD = _P + "gpu_prefix_cache_queries_total"
PREFIX_HITS_OLD = _P + "gpu_prefix_cache_hits_total"
PREFIX_HIT_RATE_V0 = _P + "gpu_prefix_cache_hit_rate"
# A histogram of tokens per engine step: its count is the number of steps, which must advance
# while requests run (the liveness signal vLLM's /health lacks). Only the count is read.
ENGINE_STEPS = _P + "iteration_tokens_total_count"
CACHE_CONFIG = _P + "cache_config_info"
PROCESS_START = "process_start_time_seconds"
TTFT = _P + "time_to_first_token_seconds"
ITL = _P + "inter_token_latency_seconds"
ITL_OLD = _P + "time_per_output_token_seconds"
HISTOGRAMS = (TTFT, ITL, ITL_OLD)
# prometheus_fastapi_instrumentator's counter, by handler, method and status class ("2xx",
# "4xx", "5xx"): the requests the API answered, for the availability objective.
HTTP_REQUESTS = "http_requests_total"

_COUNTERS = (
    PREEMPTIONS,
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    PREFIX_QUERIES,
    PREFIX_HITS,
    PREFIX_QUERIES_OLD,
    PREFIX_HITS_OLD,
    ENGINE_STEPS,
)
_GAUGES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD, PREFIX_HIT_RATE_V0, PROCESS_START)
# Values that must be finite and not negative (V0's hit rate reads -1 for "no data yet").
_CHECKED = (*_COUNTERS, HTTP_REQUESTS, RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD, PROCESS_START)
WANTED: frozenset[str] = frozenset(
    (
        *_COUNTERS,
        *_GAUGES,
        CACHE_CONFIG,
        HTTP_REQUESTS,
        *(h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_count", "_sum")),
    )
)
# Names that only exist on the V1 engine: they tell V1 from V0 when /version is unavailable.
_V1_MARKERS = (PREFIX_QUERIES, PREFIX_QUERIES_OLD)

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABELS = re.compile(r'\s*(?:[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\\n]|\\.)*"\s*(?:,\s*|$))*')
Labels = dict[str, str]
SeriesKey = tuple[str, frozenset[tuple[str, str]]]


def http_counted(labels: Mapping[str, str]) -> bool:
    """Whether an ``http_requests_total`` series counts towards availability: a POST (the
    inference handlers; the GETs are /v1/models and the like) not answered 4xx (a client's
    mistake, not the server's). Grouped classes ("5xx") and plain codes ("503") both read."""
    return labels.get("method") == "POST" and not labels.get("status", "").startswith("4")


class ExpositionError(VkvagentError, ValueError):
    """The page is not a usable vLLM exposition; the message is one line naming the problem."""


class Normaliser:
    """Turns exposition text into ``VllmMetrics``.

    Keep one per server: it caches the label sets it has parsed (bounded), which is what makes
    repeated scrapes cheap. ``model`` restricts reading to one ``model_name``."""

    def __init__(self, model: str = "", cache_limit: int = 50_000) -> None:
        self.model = model
        self._cache_limit = cache_limit
        self._series: dict[str, tuple[Labels, SeriesKey]] = {}

    def normalise(self, text: str, version: str | None = None) -> VllmMetrics:
        page = self._scan(text)
        if self.model and self.model not in page.models:
            found = ", ".join(sorted(page.models)) or "none"
            raise ExpositionError(f"model {self.model!r} is not on the page (models: {found})")
        return _reduce(page, version)

    def _scan(self, text: str) -> _Page:
        if not text.strip():
            raise ExpositionError("empty page")
        if text.lstrip()[:1] == "<":
            raise ExpositionError("got an HTML or XML document, not a Prometheus exposition")
        if not text.endswith("\n"):
            raise ExpositionError("truncated page: the last line does not end with a newline")
        if len(self._series) > self._cache_limit:
            self._series.clear()
        page = _Page()
        rows, cache, model = page.rows, self._series, self.model
        seen_keys: set[SeriesKey] = set()
        for number, line in enumerate(text.split("\n"), start=1):
            if not line or line[0] == "#":
                if line.startswith(("# TYPE ", "# HELP ")):
                    page.comment(line)
                continue
            match = _NAME.match(line)
            if match is None:
                raise ExpositionError(f"line {number}: not a metric sample: {line[:80]!r}")
            name = match.group()
            bucket = rows.get(name)
            if bucket is None:
                page.names.add(name)
                continue
            end = match.end()
            if line[end : end + 1] == "{":
                close = line.rfind("}")
                if close < 0:
                    raise ExpositionError(f"line {number}: unclosed label set: {line[:80]!r}")
                series, rest = line[: close + 1], line[close + 1 :]
            else:
                series, rest = name, line[end:]
            parsed = cache.get(series)
            if parsed is None:
                parsed = cache[series] = _parse_series(name, series, number)
            labels, key = parsed
            if key in seen_keys:
                raise ExpositionError(f"line {number}: duplicate series {series[:120]}")
            seen_keys.add(key)
            value = _parse_value(rest, number)
            model_name = labels.get("model_name")
            if model_name is not None:
                page.models.add(model_name)
                if model and model_name != model:
                    continue
            engine = labels.get("engine")
            if engine is not None:
                page.engines.add(engine)
            bucket.append((labels, value))
        page.names.update(name for name, found in rows.items() if found)
        return page


@dataclass
class _Page:
    """What one scan found: wanted series, every family name, HELP texts, models, engines."""

    rows: dict[str, list[tuple[Labels, float]]] = field(
        default_factory=lambda: {name: [] for name in WANTED}
    )
    names: set[str] = field(default_factory=set)
    help: dict[str, str] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)
    engines: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)

    def comment(self, line: str) -> None:
        parts = line.split(None, 3)
        if len(parts) >= 3:
            self.names.add(parts[2])
            if parts[1] == "HELP" and len(parts) == 4:
                self.help[parts[2]] = parts[3]


def _parse_series(name: str, series: str, number: int) -> tuple[Labels, SeriesKey]:
    labels: Labels = {}
    if series != name:
        text = series[len(name) + 1 : -1]
        # Checked first: prometheus_client's parse_labels loops forever on some malformed
        # input (a stray "}"), and a hung scrape is worse than a refused one.
        if not _LABELS.fullmatch(text):
            raise ExpositionError(f"line {number}: bad labels in {series[:120]!r}")
        try:
            labels = parse_labels(text)
        except ValueError as exc:
            raise ExpositionError(f"line {number}: bad labels in {series[:120]!r}: {exc}") from None
    return labels, (name, frozenset(labels.items()))


def _parse_value(rest: str, number: int) -> float:
    parts = rest.split()
    if len(parts) not in (1, 2):  # value, then an optional timestamp
        raise ExpositionError(f"line {number}: expected a value after the series, got {rest!r}")
    try:
        return float(parts[0])
    except ValueError:
        raise ExpositionError(f"line {number}: bad value {parts[0]!r}") from None


# -- reduction to one normalised value ---------------------------------------------------------


def _reduce(page: _Page, version: str | None) -> VllmMetrics:
    rows = page.rows
    if not any(name.startswith(_P) for name in page.names):
        raise ExpositionError("no vLLM metrics on the page (is this a vLLM /metrics endpoint?)")
    _drop_incomplete(page)
    for name in _CHECKED:
        for _labels, value in rows[name]:
            _check_finite_non_negative(name, value)
    kv_name = KV_USAGE if rows[KV_USAGE] else KV_USAGE_OLD
    kv_values = _per_engine(rows[kv_name])
    for value in kv_values:
        if value > 1.0 + 1e-6:
            raise ExpositionError(f"{kv_name} = {value:g}, outside 0..1")
    # Both generations of prefix-cache counters carry the same value while they coexist.
    new_prefix = bool(rows[PREFIX_QUERIES])
    queries = PREFIX_QUERIES if new_prefix else PREFIX_QUERIES_OLD
    hits = PREFIX_HITS if new_prefix else PREFIX_HITS_OLD
    itl = ITL if rows[ITL + "_bucket"] else ITL_OLD
    http = [(labels, value) for labels, value in rows[HTTP_REQUESTS] if http_counted(labels)]
    # Declared (a TYPE line, or GETs only) before any POST was answered: none yet, not unknown.
    http_total = _sum(http) if http else 0.0 if HTTP_REQUESTS in page.names else None
    return VllmMetrics(
        flavor=_flavor(page),
        models=tuple(sorted(page.models)),
        engines=max(1, len(page.engines)),
        kv_cache_usage=sum(kv_values) / len(kv_values) if kv_values else None,
        kv_cache_usage_max=max(kv_values) if kv_values else None,
        num_requests_running=_sum_per_engine(rows[RUNNING]),
        num_requests_waiting=_sum_per_engine(rows[WAITING]),
        num_preemptions_total=_sum(rows[PREEMPTIONS]),
        generation_tokens_total=_sum(rows[GENERATION_TOKENS]),
        prompt_tokens_total=_sum(rows[PROMPT_TOKENS]),
        request_success_total=_sum(rows[REQUEST_SUCCESS]),
        prefix_cache_queries_total=_sum(rows[queries]),
        prefix_cache_hits_total=_sum(rows[hits]),
        prefix_cache_unit=_prefix_unit(page, queries) if rows[queries] else None,
        prefix_cache_hit_rate=_hit_rate(rows[PREFIX_HIT_RATE_V0]),
        engine_steps_total=_sum(rows[ENGINE_STEPS]),
        process_start_time=min((v for _l, v in rows[PROCESS_START]), default=None),
        time_to_first_token=_histogram(page, TTFT),
        inter_token_latency=_histogram(page, itl),
        cache_config=_cache_config(rows[CACHE_CONFIG]),
        version=version,
        warnings=tuple(page.warnings),
        per_engine=_engine_signals(page, kv_name),
        http_requests_total=http_total,
        # 0 beside a known total (not None) even before any 5xx: the first ones must count.
        http_5xx_total=None if http_total is None else _sum_5xx(http),
    )


def _drop_incomplete(page: _Page) -> None:
    """A series present for some engines only means the page was cut at a line boundary:
    its sum would be too low, and the next scrape would look like a counter reset."""
    if not page.engines:
        return
    for name, found in page.rows.items():
        present = {labels.get("engine") for labels, _value in found}
        if found and None not in present and present != page.engines:
            missing = ", ".join(sorted(page.engines - present))
            page.warnings.append(
                f"{name} ignored: no series for engine {missing} (page cut short?)"
            )
            found.clear()


def _flavor(page: _Page) -> str:
    names = page.names
    if not (page.engines or any(marker in names for marker in _V1_MARKERS)):
        return "v0"
    if KV_USAGE in names:
        return "v1-0.10" if KV_USAGE_OLD in names else "v1-latest"
    return "v1-0.8"


def _check_finite_non_negative(name: str, value: float) -> None:
    if math.isnan(value) or math.isinf(value):
        raise ExpositionError(f"{name} is {value}, not a finite number")
    if value < 0:
        raise ExpositionError(f"{name} is negative ({value:g})")


def _sum(rows: list[tuple[Labels, float]]) -> float | None:
    return sum(value for _labels, value in rows) if rows else None


def _sum_5xx(rows: list[tuple[Labels, float]]) -> float:
    return sum((value for labels, value in rows if labels.get("status", "").startswith("5")), 0.0)


def _per_engine(rows: list[tuple[Labels, float]]) -> list[float]:
    return list(_gauge_copies(rows).values())


def _gauge_copies(rows: list[tuple[Labels, float]]) -> dict[tuple[str | None, str | None], float]:
    """One value per (model, engine). Multiprocess vLLM can print a gauge once per API-server
    process (a ``pid`` label) with only one of them live: the largest is the engine's value."""
    engines: dict[tuple[str | None, str | None], float] = {}
    for labels, value in rows:
        key = (labels.get("model_name"), labels.get("engine"))
        engines[key] = max(value, engines.get(key, value))
    return engines


def _sum_per_engine(rows: list[tuple[Labels, float]]) -> float | None:
    return sum(_per_engine(rows)) if rows else None


def _engine_signals(page: _Page, kv_name: str) -> tuple[EngineSignals, ...]:
    """Each engine's signals, from the rows ``_reduce`` reads (after ``_drop_incomplete``)."""
    if not page.engines:
        return ()
    rows = page.rows
    kv = _engine_gauge(rows[kv_name], mean=True)
    running = _engine_gauge(rows[RUNNING])
    waiting = _engine_gauge(rows[WAITING])
    generation = _engine_counter(rows[GENERATION_TOKENS])
    prompt = _engine_counter(rows[PROMPT_TOKENS])
    steps = _engine_counter(rows[ENGINE_STEPS])
    success = _engine_counter(rows[REQUEST_SUCCESS])
    preemptions = _engine_counter(rows[PREEMPTIONS])
    return tuple(
        EngineSignals(
            engine=engine,
            kv_cache_usage=kv.get(engine),
            num_requests_running=running.get(engine),
            num_requests_waiting=waiting.get(engine),
            generation_tokens_total=generation.get(engine),
            prompt_tokens_total=prompt.get(engine),
            engine_steps_total=steps.get(engine),
            request_success_total=success.get(engine),
            num_preemptions_total=preemptions.get(engine),
        )
        for engine in sorted(page.engines, key=_engine_order)
    )


def _engine_order(engine: str) -> tuple[int, int, str]:
    return (0, int(engine), engine) if engine.isdecimal() else (1, 0, engine)


def _by_engine(values: Iterable[tuple[str | None, float]]) -> dict[str, list[float]]:
    """Values grouped by engine; empty when any value belongs to no engine in particular (a
    series without the label cannot be attributed, so no engine gets a partial value)."""
    out: dict[str, list[float]] = {}
    for engine, value in values:
        if engine is None:
            return {}
        out.setdefault(engine, []).append(value)
    return out


def _engine_counter(rows: list[tuple[Labels, float]]) -> dict[str, float]:
    """Each engine's counter: its series summed (``finished_reason`` and, with no model chosen,
    every model's)."""
    grouped = _by_engine((labels.get("engine"), value) for labels, value in rows)
    return {engine: sum(values) for engine, values in grouped.items()}


def _engine_gauge(rows: list[tuple[Labels, float]], mean: bool = False) -> dict[str, float]:
    """Each engine's gauge: the live copy across ``pid`` labels, then summed (or averaged) over
    models as the total is."""
    grouped = _by_engine((engine, value) for (_model, engine), value in _gauge_copies(rows).items())
    if mean:
        return {engine: sum(values) / len(values) for engine, values in grouped.items()}
    return {engine: sum(values) for engine, values in grouped.items()}


def _hit_rate(rows: list[tuple[Labels, float]]) -> float | None:
    for _labels, value in rows:
        if math.isnan(value) or math.isinf(value):
            raise ExpositionError(f"{PREFIX_HIT_RATE_V0} is {value}, not a finite number")
    rates = [value for _labels, value in rows if value >= 0]  # -1 means "no data yet"
    for value in rates:
        if value > 1.0 + 1e-6:
            raise ExpositionError(f"{PREFIX_HIT_RATE_V0} = {value}, outside 0..1")
    return sum(rates) / len(rates) if rates else None


def _prefix_unit(page: _Page, name: str) -> str:
    # Early V1 counted queried blocks; its HELP text says so. Everything later counts tokens.
    return "blocks" if "block" in page.help.get(name, "").lower() else "tokens"


def _histogram(page: _Page, name: str) -> Histogram | None:
    """The histogram summed over series, or None (with a warning) when it is incomplete.

    Published pages are often cut short, and multiprocess vLLM reads buckets and counts
    without a lock, so an inconsistent histogram costs that signal, not the whole sample."""
    bucket_rows = page.rows[name + "_bucket"]
    if not bucket_rows:
        return None
    by_bound: dict[float, float] = {}
    for labels, value in bucket_rows:
        try:
            bound = float(labels["le"])
        except (KeyError, ValueError):
            bound = math.nan
        if math.isnan(bound):
            raise ExpositionError(f"{name}_bucket has a bad or missing le label")
        if math.isnan(value) or value < 0 or math.isinf(value):
            raise ExpositionError(f"{name}_bucket{{le={labels.get('le')}}} is {value:g}")
        by_bound[bound] = by_bound.get(bound, 0.0) + value
    bounds = tuple(sorted(by_bound))
    cumulative = tuple(by_bound[b] for b in bounds)
    count = _sum(page.rows[name + "_count"])
    total = _sum(page.rows[name + "_sum"])
    problem = None
    if bounds[-1] != math.inf:
        problem = 'no le="+Inf" bucket (page cut short?)'
    elif any(later < earlier for earlier, later in zip(cumulative, cumulative[1:])):
        problem = "buckets are not cumulative"
    elif count is not None and not math.isclose(count, cumulative[-1], rel_tol=1e-9):
        problem = f"_count {count:g} differs from the +Inf bucket {cumulative[-1]:g}"
    elif total is not None and not math.isfinite(total):
        problem = f"_sum is {total}"
    if problem:
        page.warnings.append(f"{name} ignored: {problem}")
        return None
    return Histogram(bounds=bounds, cumulative=cumulative, sum=total or 0.0)


def _cache_config(rows: list[tuple[Labels, float]]) -> Mapping[str, str]:
    if not rows:
        return MappingProxyType({})
    # One entry per engine in DP deployments; they describe the same configuration.
    labels = min((labels for labels, _value in rows), key=lambda lab: lab.get("engine", ""))
    return MappingProxyType({k: v for k, v in sorted(labels.items()) if k != "engine"})
