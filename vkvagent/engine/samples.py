"""The values the engine reads: one observation of the server and its parts.

Plain frozen dataclasses that import nothing of vkvagent, so anything may import them: the
adapters that make them (``vllm_metrics``, ``gpu``, ``sampler``), the history that stores them,
and the engine that judges them; with the few helpers every reader of them shares (a time, a
number as words write it, a number read back from JSON state).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, Union

FlagValue = Union[bool, int, float, str]
"""A flag's value once validated: bool, int, float or one of the flag's choices."""


def utc_text(at: float) -> str:
    """``at`` (UTC, Unix seconds) as reasons, evidence and reports write it."""
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def num_text(value: float | None, spec: str = ".2f") -> str:
    """A number as reasons and evidence write it: ``"?"`` when it is not known."""
    return "?" if value is None else format(value, spec)


def optional_float(value: Any) -> float | None:
    """A number or None from JSON state; ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number or null, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram: ``cumulative[i]`` observations were ``<= bounds[i]``."""

    bounds: tuple[float, ...]  # ascending upper bounds, the last one +Inf
    cumulative: tuple[float, ...]
    sum: float

    @property
    def count(self) -> float:
        return self.cumulative[-1]

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "sum": self.sum,
            "buckets": {_format_le(b): c for b, c in zip(self.bounds, self.cumulative)},
        }


@dataclass(frozen=True)
class EngineSignals:
    """One data-parallel engine's signals (one ``engine`` label value), read from the same wire
    names as the totals. ``None`` where the page lacks the signal for this engine: a family cut
    short for any engine is ``None`` for every engine, as the total is."""

    engine: str
    kv_cache_usage: float | None  # 0..1
    num_requests_running: float | None
    num_requests_waiting: float | None
    generation_tokens_total: float | None
    prompt_tokens_total: float | None
    engine_steps_total: float | None
    request_success_total: float | None
    num_preemptions_total: float | None

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class VllmMetrics:
    """One scrape of one vLLM server, in version-independent terms.

    ``None`` means the page does not carry that signal (the version lacks it, or the page is
    partial); counters are cumulative since the vLLM process started."""

    flavor: str
    models: tuple[str, ...]
    engines: int
    kv_cache_usage: float | None  # 0..1, mean over engines (equal-sized pools)
    kv_cache_usage_max: float | None  # the fullest engine
    num_requests_running: float | None
    num_requests_waiting: float | None
    num_preemptions_total: float | None
    generation_tokens_total: float | None
    prompt_tokens_total: float | None
    request_success_total: float | None
    prefix_cache_queries_total: float | None
    prefix_cache_hits_total: float | None
    prefix_cache_unit: str | None  # "tokens", or "blocks" on early V1
    prefix_cache_hit_rate: float | None  # V0's gauge; -1 (no data) reads as None
    engine_steps_total: float | None  # advances while the engine makes progress
    process_start_time: float | None  # Unix time the serving process started
    time_to_first_token: Histogram | None
    inter_token_latency: Histogram | None
    cache_config: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    version: str | None = None
    warnings: tuple[str, ...] = ()  # signals dropped as inconsistent, each with its reason
    # One entry per ``engine`` label, in engine order; empty on a page without that label.
    # Left out of equality: the history keeps the totals only, and a sample read back from it
    # must equal the one stored.
    per_engine: tuple[EngineSignals, ...] = field(default=(), compare=False)
    # prometheus_fastapi_instrumentator's http_requests_total for the API's POST handlers:
    # every answer but a 4xx (a client's mistake), and of those the 5xx. None where the page
    # has no such family (V0, multiprocess mode).
    http_requests_total: float | None = None
    http_5xx_total: float | None = None

    @property
    def model_name(self) -> str | None:
        return self.models[0] if len(self.models) == 1 else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "flavor": self.flavor,
            "version": self.version,
            "model_name": self.model_name,
        }
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "per_engine":
                if value:  # only on a data-parallel page
                    out[name] = [engine.to_json() for engine in value]
                continue
            if isinstance(value, Histogram):
                value = value.to_json()
            elif name == "cache_config" and not value:
                value = None  # a page without cache_config_info: missing, like every signal
            elif isinstance(value, (tuple, MappingProxyType)):
                value = list(value) if isinstance(value, tuple) else dict(value)
            out[name] = value
        return out


def _format_le(bound: float) -> str:
    return "+Inf" if bound == math.inf else f"{bound:g}"


# The reasons that mean the GPU is being slowed against the workload's will.
THROTTLE_REASONS = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    }
)


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one moment; None where the device does not report a value."""

    index: int
    uuid: str
    name: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_percent: float | None
    temperature_c: float | None
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: float | None
    sm_clock_max_mhz: float | None
    clock_event_reasons: tuple[str, ...]
    ecc_uncorrected_volatile: int | None
    xid_errors: tuple[int, ...]  # XID codes NVML reported since the previous reading

    @property
    def throttled_by(self) -> tuple[str, ...]:
        return tuple(r for r in self.clock_event_reasons if r in THROTTLE_REASONS)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["clock_event_reasons"] = list(self.clock_event_reasons)
        out["xid_errors"] = list(self.xid_errors)
        out["throttled_by"] = list(self.throttled_by)
        return out


@dataclass(frozen=True)
class UnitFacts:
    """The vLLM unit as systemd saw it with the sample: its state, its invocation (new at
    every start, however it was started) and the memory of its whole cgroup: all of it
    (MemoryCurrent) and its anonymous part (memory.stat's ``anon``), which is what a leak
    grows and page cache is not."""

    active_state: str
    sub_state: str
    invocation_id: str
    main_pid: int
    memory_bytes: int | None  # MemoryCurrent; None when not accounted
    n_restarts: int  # automatic restarts by Restart=
    # memory.stat's anon; None when unreadable (cgroup v1), and by default: a sample stored
    # before it was recorded has none.
    memory_anon_bytes: int | None = None
    active_since: float | None = None  # UTC when the unit last became active
    memory_max_bytes: int | None = None  # MemoryMax, where the kernel OOM-kills; None: unlimited
    # Restart= (no, on-failure, always, ...): what systemd does when vLLM exits; "": unknown.
    restart_policy: str = ""
    wanted: bool | None = None  # enabled, or wanted by another unit, and not masked
    last_exit: str = ""  # how the main process last ended ("exited with status 0"); "": never

    @property
    def growth_bytes(self) -> int | None:
        """The memory whose growth is judged: anon when known, else MemoryCurrent."""
        return self.memory_bytes if self.memory_anon_bytes is None else self.memory_anon_bytes

    @property
    def growth_source(self) -> str:
        """Which memory ``growth_bytes`` is: "anon" or "MemoryCurrent"."""
        return "MemoryCurrent" if self.memory_anon_bytes is None else "anon"


@dataclass(frozen=True)
class Sample:
    """What the agent saw at ``time``. A source that failed leaves its value None and says why
    in its ``*_error`` field; the sample is still recorded, marked invalid, never dropped."""

    time: float  # UTC, Unix seconds: when it was taken, for people and retention
    mono: float  # monotonic seconds at the same moment: the only clock rates are computed on
    vllm: VllmMetrics | None
    vllm_error: str | None = None
    gpus: tuple[GpuReading, ...] = ()
    gpu_error: str | None = None
    unit: UnitFacts | None = None
    unit_error: str | None = None
    # vLLM accepted the connection and did not answer in time (hung), rather than refused it
    vllm_silent: bool = False

    @property
    def valid(self) -> bool:
        return self.vllm is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "valid": self.valid,
            "vllm": self.vllm.to_json() if self.vllm else None,
            "vllm_error": self.vllm_error,
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "gpu_error": self.gpu_error,
            "unit": None if self.unit is None else dataclasses.asdict(self.unit),
            "unit_error": self.unit_error,
            "vllm_silent": self.vllm_silent,
        }
