"""The simulator's ``/metrics`` page, printed the way a chosen vLLM version prints it.

Each flavour (``knowledge.vllm_metrics.FLAVORS``) lists its families in the order, with the HELP
text, type, labels and histogram buckets of that version's metric loggers (the sources are
tests/fixtures/metrics/SOURCES.md and docs/metrics.md):

* ``v0``: the V0 engine (0.6-0.7) behind its multiprocessing front end, so the page is what
  ``MultiProcessCollector`` prints: no ``_created`` series, histograms ``_sum`` first, no
  ``python_*``/``process_*`` families, ``request_success_total`` only for reasons seen so far;
* ``v1-0.8``: early V1, labels ``model_name`` only, ``gpu_*`` names, prefix cache in blocks;
* ``v1-0.10``: V1 0.10.1, ``engine`` label, old and new names side by side;
* ``v1-latest``: a 2026 V1 build (0.12+ names plus waiting-by-reason, prompt tokens by
  source, ...).

From 0.8.3 (vLLM PR #15657, #15894) the API server also counts its answers with
prometheus_fastapi_instrumentator: ``http_requests_total{handler,method,status}`` follows
vLLM's families on the ``v1-0.10`` and ``v1-latest`` pages (the V0 and early V1 ones predate
it). Only that family of the instrumentator's is printed: it is the one the agent reads.

The V1 flavours are single-process pages: prometheus_client's GC, platform and process
collectors first, then vLLM's families, each counter and histogram followed by its
``_created`` gauge. The page is rendered by ``prometheus_client.generate_latest`` from
families built at collect time, so label order, float formatting and ``_created`` placement are
the library's own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Callable

from prometheus_client.exposition import generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from vkvagent.engine.slo import ITL_BOUNDS, TTFT_BOUNDS
from vkvagent.sim.stats import EngineStats, HttpStats, Observations, ServerInfo

__all__ = ["CONTENT_TYPE", "build_1_2_5_buckets", "families", "histogram_bounds", "render"]

# prometheus_client's float formatting (untyped upstream), as it prints le="0.001", le="1.0".
_go_float: Callable[[float], str] = floatToGoString
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_P = "vllm:"

# -- bucket lists --------------------------------------------------------------------------------

# fmt: off
TTFT_V0, TTFT_V1 = TTFT_BOUNDS["V0"], TTFT_BOUNDS["V1"]  # the agent's facts (engine/slo.py)
TPOT_V0, TPOT_V1 = ITL_BOUNDS["V0"], ITL_BOUNDS["V1"]
REQUEST_LATENCY_V0 = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                      50.0, 60.0)
REQUEST_LATENCY_V1 = (*REQUEST_LATENCY_V0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens per engine step. V0 and early V1 used the CUDA-graph capture sizes (up to max_num_seqs
# 256 on V0, 512 on V1); V1 from about 0.10 a fixed list.
ITERATION_V0 = (1.0, 2.0, 4.0, *(float(n) for n in range(8, 257, 8)))
ITERATION_V1_CUDAGRAPH = (1.0, 2.0, 4.0, *(float(n) for n in range(8, 513, 8)))
ITERATION_V1 = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
                16384.0)
REQUEST_PARAMS_N = (1.0, 2.0, 5.0, 10.0, 20.0)
REQUEST_NUM_PREEMPTIONS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
# fmt: on


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` inclusive."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1


# -- values derived from EngineStats -------------------------------------------------------------


@dataclass(frozen=True)
class _Context:
    info: ServerInfo
    now: float
    block_size: int


# (context, engine, value of the extra label or "") -> sample value
Value = Callable[[_Context, EngineStats, str], float]


def _zero(_c: _Context, _e: EngineStats, _l: str) -> float:
    return 0.0


def _minus_one(_c: _Context, _e: EngineStats, _l: str) -> float:
    return -1.0


def _stat(field: str) -> Value:
    """A family whose value is one EngineStats field, as vLLM's loggers hold it."""

    def value(_c: _Context, e: EngineStats, _l: str) -> float:
        return float(getattr(e, field))

    return value


_running = _stat("running")
_waiting = _stat("waiting")
_kv_usage = _stat("kv_usage")
_preemptions = _stat("preemptions")
_prompt_tokens = _stat("prompt_tokens")
_generation_tokens = _stat("generation_tokens")
_prefix_queries = _stat("prefix_queries")
_prefix_hits = _stat("prefix_hits")


# Early V1 counted the prefix cache in whole blocks, not tokens.
def _prefix_query_blocks(c: _Context, e: EngineStats, _l: str) -> float:
    return float(math.floor(e.prefix_queries / c.block_size))


def _prefix_hit_blocks(c: _Context, e: EngineStats, _l: str) -> float:
    return float(math.floor(e.prefix_hits / c.block_size))


def _cached_prompt_tokens(_c: _Context, e: EngineStats, _l: str) -> float:
    return float(min(e.prefix_hits, e.prompt_tokens))


def _hit_rate_v0(_c: _Context, e: EngineStats, _l: str) -> float:
    # V0's gauge: -1 until the cache has been queried.
    return e.prefix_hits / e.prefix_queries if e.prefix_queries > 0 else -1.0


def _lifetime_rate(c: _Context, tokens: float) -> float:
    # V0 averaged over its last 5 s logging interval; a stateless page can only offer the
    # average since start, which has the same unit and order of magnitude.
    elapsed = c.now - c.info.start_time
    return tokens / elapsed if elapsed > 0 else 0.0


def _avg_prompt_throughput(c: _Context, e: EngineStats, _l: str) -> float:
    return _lifetime_rate(c, e.prompt_tokens)


def _avg_generation_throughput(c: _Context, e: EngineStats, _l: str) -> float:
    return _lifetime_rate(c, e.generation_tokens)


def _waiting_by_reason(_c: _Context, e: EngineStats, reason: str) -> float:
    # The simulated scheduler only waits for capacity; the reasons sum to num_requests_waiting.
    return float(e.waiting) if reason == "capacity" else 0.0


def _sleep_state(_c: _Context, _e: EngineStats, state: str) -> float:
    return 1.0 if state == "awake" else 0.0


def _prompt_tokens_by_source(_c: _Context, e: EngineStats, source: str) -> float:
    cached = min(e.prefix_hits, e.prompt_tokens)
    if source == "local_compute":
        return float(e.prompt_tokens - cached)
    if source == "local_cache_hit":
        return float(cached)
    return 0.0


# -- family definitions --------------------------------------------------------------------------

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
_SUCCESS, _CACHE_CONFIG, _LORA = "success", "cache_config", "lora"


@dataclass(frozen=True)
class _Family:
    name: str  # without the vllm: prefix and, for counters, without _total
    kind: str  # GAUGE, COUNTER, HISTOGRAM, or one of the special kinds
    help: str
    value: Value = _zero
    label: str = ""  # an extra label, e.g. "reason"
    label_values: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms; None: 1-2-5 up to max_model_len
    per_server: bool = False  # one series for the server (the API server's), no engine label


def _gauge(name: str, help_: str, value: Value, label: str = "", *values: str) -> _Family:
    return _Family(name, GAUGE, help_, value, label, values)


def _counter(name: str, help_: str, value: Value, label: str = "", *values: str) -> _Family:
    return _Family(name, COUNTER, help_, value, label, values)


def _histogram(name: str, help_: str, buckets: tuple[float, ...] | None = None) -> _Family:
    return _Family(name, HISTOGRAM, help_, buckets=buckets)


_CACHE_CONFIG_HELP = "Information of the LLMEngine CacheConfig"
_SUCCESS_HELP = "Count of successfully processed requests."
_RUNNING_V1 = _gauge(
    "num_requests_running", "Number of requests in model execution batches.", _running
)
_WAITING = _gauge("num_requests_waiting", "Number of requests waiting to be processed.", _waiting)
_PREEMPTIONS = _counter(
    "num_preemptions", "Cumulative number of preemption from the engine.", _preemptions
)
_PROMPT = _counter("prompt_tokens", "Number of prefill tokens processed.", _prompt_tokens)
_GENERATION = _counter(
    "generation_tokens", "Number of generation tokens processed.", _generation_tokens
)
_REQUEST_PROMPT = _histogram("request_prompt_tokens", "Number of prefill tokens processed.")
_REQUEST_GENERATION = _histogram(
    "request_generation_tokens", "Number of generation tokens processed."
)
_ITERATION_HELP = "Histogram of number of tokens per engine_step."
_MAX_GENERATION = _histogram(
    "request_max_num_generation_tokens",
    "Histogram of maximum number of requested generation tokens.",
)
_PARAMS_N = _histogram(
    "request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N
)
_PARAMS_MAX_TOKENS = _histogram(
    "request_params_max_tokens", "Histogram of the max_tokens request parameter."
)
_TTFT_HELP = "Histogram of time to first token in seconds."
_TPOT_HELP = "Histogram of time per output token in seconds."


def _phase_families(buckets: tuple[float, ...]) -> tuple[_Family, ...]:
    return (
        _histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            buckets,
        ),
        _histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            buckets,
        ),
        _histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            buckets,
        ),
        _histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            buckets,
        ),
    )


_V1_E2E = _histogram(
    "e2e_request_latency_seconds",
    "Histogram of e2e request latency in seconds.",
    REQUEST_LATENCY_V1,
)

# V0 0.6-0.7 (vllm/engine/metrics.py), in the order of the real 0.7 page.
_V0 = (
    _Family("cache_config_info", _CACHE_CONFIG, _CACHE_CONFIG_HELP),
    _gauge("num_requests_running", "Number of requests currently running on GPU.", _running),
    _gauge("num_requests_swapped", "Number of requests swapped to CPU.", _zero),
    _WAITING,
    _gauge("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", _kv_usage),
    _gauge("cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", _zero),
    _gauge("cpu_prefix_cache_hit_rate", "CPU prefix cache block hit rate.", _minus_one),
    _gauge("gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate.", _hit_rate_v0),
    _gauge(
        "avg_prompt_throughput_toks_per_s",
        "Average prefill throughput in tokens/s.",
        _avg_prompt_throughput,
    ),
    _gauge(
        "avg_generation_throughput_toks_per_s",
        "Average generation throughput in tokens/s.",
        _avg_generation_throughput,
    ),
    _Family("lora_requests_info", _LORA, "Running stats on lora requests."),
    _PREEMPTIONS,
    _PROMPT,
    _GENERATION,
    _Family("request_success", _SUCCESS, _SUCCESS_HELP),
    _histogram("iteration_tokens_total", _ITERATION_HELP, ITERATION_V0),
    _histogram("time_to_first_token_seconds", _TTFT_HELP, TTFT_V0),
    _histogram("time_per_output_token_seconds", _TPOT_HELP, TPOT_V0),
    _histogram(
        "e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds.",
        REQUEST_LATENCY_V0,
    ),
    *_phase_families(REQUEST_LATENCY_V0),
    _REQUEST_PROMPT,
    _REQUEST_GENERATION,
    _PARAMS_N,
    _MAX_GENERATION,
    _PARAMS_MAX_TOKENS,
)


def _v1_histograms(
    iteration: tuple[float, ...], per_token: tuple[_Family, ...]
) -> tuple[_Family, ...]:
    return (
        _REQUEST_PROMPT,
        _REQUEST_GENERATION,
        _histogram("iteration_tokens_total", _ITERATION_HELP, iteration),
        _MAX_GENERATION,
        _PARAMS_N,
        _PARAMS_MAX_TOKENS,
        _histogram("time_to_first_token_seconds", _TTFT_HELP, TTFT_V1),
        *per_token,
        _V1_E2E,
        *_phase_families(REQUEST_LATENCY_V1),
    )


_TPOT_V1 = _histogram("time_per_output_token_seconds", _TPOT_HELP, TPOT_V1)

# Early V1 (vllm/v1/metrics/loggers.py, 0.8.x), one engine, model_name only.
_V1_08 = (
    _RUNNING_V1,
    _WAITING,
    _gauge("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", _kv_usage),
    _counter(
        "gpu_prefix_cache_queries",
        "GPU prefix cache queries, in terms of number of queried blocks.",
        _prefix_query_blocks,
    ),
    _counter(
        "gpu_prefix_cache_hits",
        "GPU prefix cache hits, in terms of number of cached blocks.",
        _prefix_hit_blocks,
    ),
    _PREEMPTIONS,
    _PROMPT,
    _GENERATION,
    _Family("request_success", _SUCCESS, _SUCCESS_HELP),
    *_v1_histograms(ITERATION_V1_CUDAGRAPH, (_TPOT_V1,)),
    _Family("cache_config_info", _CACHE_CONFIG, _CACHE_CONFIG_HELP),
)

_KV_USAGE = _gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", _kv_usage)
_PREFIX_QUERIES = _counter(
    "prefix_cache_queries",
    "Prefix cache queries, in terms of number of queried tokens.",
    _prefix_queries,
)
_PREFIX_HITS = _counter(
    "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", _prefix_hits
)

# V1 0.10.1: the deprecated names beside their successors, carrying the same values. The
# deprecated HELP strings are concatenated upstream without a space ("usage.DEPRECATED",
# "queriedtokens").
_V1_010 = (
    _RUNNING_V1,
    _WAITING,
    _gauge(
        "gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage."
        "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        _kv_usage,
    ),
    _counter(
        "gpu_prefix_cache_queries",
        "GPU prefix cache queries, in terms of number of queried"
        "tokens. DEPRECATED: Use vllm:prefix_cache_queries instead.",
        _prefix_queries,
    ),
    _counter(
        "gpu_prefix_cache_hits",
        "GPU prefix cache hits, in terms of number of cached "
        "tokens. DEPRECATED: Use vllm:prefix_cache_hits instead.",
        _prefix_hits,
    ),
    _KV_USAGE,
    _PREFIX_QUERIES,
    _PREFIX_HITS,
    _PREEMPTIONS,
    _PROMPT,
    _GENERATION,
    _Family("request_success", _SUCCESS, _SUCCESS_HELP),
    *_v1_histograms(ITERATION_V1, (_TPOT_V1,)),
    _Family("cache_config_info", _CACHE_CONFIG, _CACHE_CONFIG_HELP),
)


def _cached_by_source(_c: _Context, e: EngineStats, source: str) -> float:
    # Every simulated hit comes from the GPU's own cache; the tiers sum to prefix_cache_hits.
    return float(e.prefix_hits) if source == "device" else 0.0


def _mfu_counter(name: str, what: str) -> _Family:
    # Zero on a page that does not estimate utilisation (the CPU build's, and the simulator's).
    return _counter(
        f"estimated_{name}_per_gpu",
        f"Estimated number of {what} per GPU (for Model Flops Utilization calculations).",
        _zero,
    )


# V1 as of vLLM 0.32 (0.12+ names, no TPOT, no gpu_*), a superset of 0.12/0.13's families,
# calibrated family by family against a real 0.32 page (tests/fixtures/metrics/v1-0.32-cpu.prom).
_V1_LATEST = (
    _mfu_counter("flops", "floating point operations"),
    _mfu_counter("read_bytes", "bytes read from memory"),
    _mfu_counter("write_bytes", "bytes written to memory"),
    _RUNNING_V1,
    _WAITING,
    _gauge(
        "num_requests_waiting_by_reason",
        "Number of waiting requests by reason. "
        "Reason labels: 'capacity' = waiting for scheduling capacity; "
        "'deferred' = deferred by transient constraints "
        "(LoRA budget, KV transfer, blocked status). "
        "Sum of all reasons equals vllm:num_requests_waiting.",
        _waiting_by_reason,
        "reason",
        "capacity",
        "deferred",
    ),
    _gauge(
        "engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; "
        "awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; "
        "discard_all = 1 means sleep level 2.",
        _sleep_state,
        "sleep_state",
        "awake",
        "weights_offloaded",
        "discard_all",
    ),
    _KV_USAGE,
    _PREFIX_QUERIES,
    _PREFIX_HITS,
    _counter(
        "external_prefix_cache_queries",
        "External prefix cache queries from KV connector "
        "cross-instance cache sharing, in terms of number of queried tokens.",
        _zero,
    ),
    _counter(
        "external_prefix_cache_hits",
        "External prefix cache hits from KV connector "
        "cross-instance cache sharing, in terms of number of cached tokens.",
        _zero,
    ),
    _counter(
        "mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", _zero
    ),
    _counter("mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", _zero),
    _PREEMPTIONS,
    _PROMPT,
    _counter(
        "prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        _prompt_tokens_by_source,
        "source",
        "local_compute",
        "local_cache_hit",
        "external_kv_transfer",
    ),
    _counter(
        "prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        _cached_prompt_tokens,
    ),
    _counter(
        "prompt_tokens_cached_by_source",
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
        "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
        "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
        "vllm:external_prefix_cache_hits.",
        _cached_by_source,
        "source",
        "device",
        "host",
        "p2p",
        "disk",
        "external_unspecified",
    ),
    _GENERATION,
    _Family("request_success", _SUCCESS, _SUCCESS_HELP),
    _Family(
        "admission_rejections",
        COUNTER,
        "Number of admission attempts rejected by a queue limit, by reason.",
        _zero,
        "reason",
        ("max_num_queued_reqs", "max_num_queued_tokens"),
        per_server=True,
    ),
    *_v1_histograms(
        ITERATION_V1,
        (
            _histogram(
                "inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                TPOT_V1,
            ),
            _histogram(
                "request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                TPOT_V1,
            ),
        ),
    ),
    _histogram(
        "request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        REQUEST_NUM_PREEMPTIONS,
    ),
    _histogram(
        "request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
    ),
    _Family("cache_config_info", _CACHE_CONFIG, _CACHE_CONFIG_HELP),
)


@dataclass(frozen=True)
class _Layout:
    families: tuple[_Family, ...]
    engine_label: bool  # every engine metric (and cache_config_info) has engine="0", "1", ...
    single_process: bool  # _created series and the python/process families
    finish_reasons: tuple[str, ...]  # request_success series pre-created per engine (V1)
    http: bool = False  # the API server's http_requests_total follows vLLM's families


_LAYOUTS: Mapping[str, _Layout] = {
    "v0": _Layout(_V0, engine_label=False, single_process=False, finish_reasons=()),
    "v1-0.8": _Layout(
        _V1_08, engine_label=False, single_process=True, finish_reasons=("stop", "length", "abort")
    ),
    "v1-0.10": _Layout(
        _V1_010,
        engine_label=True,
        single_process=True,
        finish_reasons=("stop", "length", "abort"),
        http=True,
    ),
    "v1-latest": _Layout(
        _V1_LATEST,
        engine_label=True,
        single_process=True,
        finish_reasons=("stop", "length", "abort", "error", "repetition"),
        http=True,
    ),
}


def _layout(flavor: str) -> _Layout:
    try:
        return _LAYOUTS[flavor]
    except KeyError:
        raise ValueError(f"unknown flavor {flavor!r}; expected one of {sorted(_LAYOUTS)}") from None


def families(flavor: str) -> tuple[str, ...]:
    """The ``vllm:`` families the flavour prints, in page order (counters without ``_total``)."""
    return tuple(_P + f.name for f in _layout(flavor).families)


@functools.lru_cache(maxsize=64)
def _bounds(flavor: str, max_model_len: int) -> Mapping[str, tuple[float, ...]]:
    tokens = build_1_2_5_buckets(max_model_len)
    return {
        f.name: f.buckets if f.buckets is not None else tokens
        for f in _layout(flavor).families
        if f.kind == HISTOGRAM
    }


def histogram_bounds(flavor: str, max_model_len: int = 32768) -> dict[str, tuple[float, ...]]:
    """For each histogram the flavour prints (keyed by its name without ``vllm:``), the finite
    bucket bounds of that version. Token-count histograms are 1-2-5 up to ``max_model_len``:
    pass the server's (``ServerInfo.max_model_len``), as ``render`` uses it for histograms an
    engine leaves unfilled."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    return dict(_bounds(flavor, max_model_len))


# -- rendering -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _le_values(bounds: tuple[float, ...]) -> tuple[str, ...]:
    return (*(_go_float(b) for b in bounds), "+Inf")


class _Page(Collector):
    """Builds one page's families from the engines' stats at collect time."""

    def __init__(
        self,
        info: ServerInfo,
        engines: Sequence[EngineStats],
        now: float,
        layout: _Layout,
        http: HttpStats | None,
    ) -> None:
        self.info = info
        self.engines = engines
        self.layout = layout
        self.http = http
        self.bounds = _bounds(info.flavor, info.max_model_len)
        try:
            block_size = int(info.cache_config.get("block_size", "16"))
        except ValueError:
            block_size = 16
        self.context = _Context(info, now, max(1, block_size))
        if layout.engine_label:
            self.labels = [
                {"model_name": info.model, "engine": str(i)} for i in range(len(engines))
            ]
        else:
            self.labels = [{"model_name": info.model}]

    def collect(self) -> Iterator[Metric]:
        if self.layout.single_process:
            yield from _process_families(self.info.start_time)
        for family in self.layout.families:
            metric = self._family(family)
            # MultiProcessCollector only knows families that have a value on file.
            if metric.samples or self.layout.single_process:
                yield metric
        if self.layout.http and self.http is not None:
            yield self._http_requests(self.http)

    def _family(self, f: _Family) -> Metric:
        name = _P + f.name
        if f.kind == HISTOGRAM:
            return self._histogram(name, f)
        if f.kind == _CACHE_CONFIG:
            return self._cache_config(name, f.help)
        if f.kind == _LORA:
            metric = Metric(name, f.help, GAUGE)
            labels = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
            metric.samples.append(Sample(name, labels, self.context.now))
            return metric
        metric = Metric(name, f.help, COUNTER if f.kind == _SUCCESS else f.kind)
        owners = list(zip(self.labels, self.engines))
        if f.per_server:
            owners = [({"model_name": self.info.model}, self.engines[0])]
        if f.kind == _SUCCESS:
            series = self._success_series()
        elif f.label:
            series = [
                ({**labels, f.label: value}, f.value(self.context, engine, value))
                for value in f.label_values
                for labels, engine in owners
            ]
        else:
            series = [(labels, f.value(self.context, engine, "")) for labels, engine in owners]
        samples = metric.samples
        if metric.type == GAUGE:
            samples.extend(Sample(name, labels, value) for labels, value in series)
        elif self.layout.single_process:
            total, created, start = name + "_total", name + "_created", self.info.start_time
            for labels, value in series:
                samples.append(Sample(total, labels, value))
                samples.append(Sample(created, labels, start))
        else:
            samples.extend(Sample(name + "_total", labels, value) for labels, value in series)
        return metric

    def _success_series(self) -> list[tuple[dict[str, str], float]]:
        reasons = self.layout.finish_reasons
        if not reasons:
            # V0 creates a finished_reason series when the first request ends that way.
            return [
                ({**labels, "finished_reason": reason}, float(count))
                for labels, engine in zip(self.labels, self.engines)
                for reason, count in engine.finished.items()
                if count > 0
            ]
        extra = [r for e in self.engines for r in e.finished if r not in reasons]
        return [
            ({**labels, "finished_reason": reason}, float(engine.finished.get(reason, 0.0)))
            for reason in (*reasons, *dict.fromkeys(extra))
            for labels, engine in zip(self.labels, self.engines)
        ]

    def _http_requests(self, http: HttpStats) -> Metric:
        # Declared, without series, until the first answer: a labelled Counter with no child.
        name = "http_requests"
        metric = Metric(name, "Total number of requests by method, status and handler.", COUNTER)
        total, created, start = name + "_total", name + "_created", self.info.start_time
        for (handler, method, status), value in http.answered.items():
            labels = {"handler": handler, "method": method, "status": status}
            metric.samples.append(Sample(total, labels, value))
            if self.layout.single_process:
                # Really the time of the series' first answer; nothing reads it.
                metric.samples.append(Sample(created, labels, start))
        return metric

    def _cache_config(self, name: str, help_: str) -> Metric:
        metric = Metric(name, help_, GAUGE)
        config = dict(self.info.cache_config)
        if self.layout.engine_label:
            for i in range(len(self.engines)):
                metric.samples.append(Sample(name, {**config, "engine": str(i)}, 1.0))
        else:
            metric.samples.append(Sample(name, config, 1.0))
        return metric

    def _histogram(self, name: str, f: _Family) -> Metric:
        metric = Metric(name, f.help, HISTOGRAM)
        samples = metric.samples
        bucket, count, total = name + "_bucket", name + "_count", name + "_sum"
        created, start = name + "_created", self.info.start_time
        single_process = self.layout.single_process
        for labels, engine in zip(self.labels, self.engines):
            observations = engine.histograms.get(f.name)
            if observations is None:
                observations = Observations(self.bounds[f.name])
            cumulative = observations.cumulative()
            buckets = [
                Sample(bucket, {**labels, "le": le}, value)
                for le, value in zip(_le_values(observations.bounds), cumulative)
            ]
            if single_process:  # as a prometheus_client Histogram prints itself
                samples.extend(buckets)
                samples.append(Sample(count, labels, cumulative[-1]))
                samples.append(Sample(total, labels, observations.sum))
                samples.append(Sample(created, labels, start))
            else:  # as MultiProcessCollector prints a histogram read from its files
                samples.append(Sample(total, labels, observations.sum))
                samples.extend(buckets)
                samples.append(Sample(count, labels, cumulative[-1]))
        return metric


_PROCESS_REGISTRY: CollectorRegistry | None = None


def _process_families(start_time: float) -> Iterable[Metric]:
    """prometheus_client's GC, platform and process collectors, as the default registry has
    them, with the process start time of the simulated server."""
    global _PROCESS_REGISTRY  # noqa: PLW0603 - built once, on first use
    if _PROCESS_REGISTRY is None:
        registry = CollectorRegistry()
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        ProcessCollector(registry=registry)
        _PROCESS_REGISTRY = registry
    start = GaugeMetricFamily(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        value=start_time,
    )
    seen = False
    for metric in _PROCESS_REGISTRY.collect():
        if metric.name == start.name:
            seen = True
            yield start
        else:
            yield metric
    if not seen:  # no /proc (not Linux): keep the one process family the agent reads
        yield start


def render(
    info: ServerInfo,
    engines: Sequence[EngineStats],
    now: float,
    http: HttpStats | None = None,
) -> bytes:
    """The full ``/metrics`` page of ``info.flavor`` (text format 0.0.4, UTF-8; serve it as
    ``CONTENT_TYPE``). ``engines`` are the data-parallel engines in rank order; the flavours
    without an ``engine`` label (``v0``, ``v1-0.8``) take exactly one. ``now`` (Unix time)
    stamps V0's ``lora_requests_info`` and its average-throughput gauges. ``http`` is what the
    API server answered, for the flavours that print ``http_requests_total``; None prints no
    such family, as an API server without the instrumentator (one 2026 build dropped it)."""
    layout = _layout(info.flavor)
    if not engines:
        raise ValueError("render needs at least one engine")
    if not layout.engine_label and len(engines) != 1:
        raise ValueError(
            f"flavor {info.flavor} has no engine label, so it prints one engine, not {len(engines)}"
        )
    return generate_latest(_Page(info, engines, now, layout, http))
