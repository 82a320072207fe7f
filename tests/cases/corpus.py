"""The annotated corpus: compact sample sequences, each with the diagnosis it must get.

In the spirit of fail2ban's sample logs: every ``*.json`` file here is one case, replayed
through ``engine.decide`` under its own fake clock (the sample times), one decision per sample.
A case says:

- ``process_start``, ``first`` (ISO UTC) and ``interval`` (seconds between samples);
- ``settings``: overrides of the engine's settings sections (``policy``, ``diagnosis``,
  ``baseline``);
- ``baseline``: this run's fresh baseline, as one dict of medians per load regime (the
  regime follows from ``generation_tokens_per_s``), each counted as ``min_values`` windows;
- ``columns`` and ``rows``: each row is what one sampling interval saw, as per-second rates
  and gauges (turned into cumulative counters and histograms here). Optional columns
  ``prefix_q`` and ``prefix_hit``: the prompt tokens per second looked up in the prefix
  cache, and found there. A row may be an object:
  ``{"repeat": N, "row": [...], "gpu": {...}, "probe": "ok"}``, ``{"repeat": N, "down":
  "why"}`` (refused) or ``{"repeat": N, "silent": "why"}`` (connected, no answer: hung);
  ``gpu`` sets ``reasons``, ``clock``, ``max``, ``xid`` and ``ecc`` on every GPU; ``unit``
  sets the unit's facts from that row on (``UnitFacts`` fields; ``active_since`` in ISO UTC),
  and ``stopped`` says the unit was stopped on purpose (``Observation.stopped``); ``probe``
  is the outcome of an active probe sent at that sample (``ok``, ``timeout``); ``"reset":
  true`` starts every counter again from zero at the entry's first sample, the process start
  unchanged (not with ``memory``, which counts the requests served from the first row);
- optional ``memory``: ``{"start": bytes, "per_request": bytes, "max": bytes}``, the
  unit's memory and its MemoryMax (optional);
- optional ``restarts``: ``[{"at": ISO, "cause": ..., "recovered": ...}]``;
- ``expect``: what the last decision must be (``cause``, ``action``, ``reason`` prefix,
  ``suggestion`` keys); no earlier decision may restart.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vkvagent.engine import EngineState, Observation, RunState, Settings
from vkvagent.engine.baseline import METRICS, Baseline, BaselineSettings, Regime
from vkvagent.engine.diagnosis import DiagnosisSettings
from vkvagent.engine.memory import MemoryPoint
from vkvagent.engine.policy import PolicySettings, RestartRecord
from vkvagent.engine.progress import ProbeFacts
from vkvagent.engine.samples import (
    THROTTLE_REASONS,
    GpuReading,
    Histogram,
    Sample,
    UnitFacts,
    VllmMetrics,
)

HERE = Path(__file__).parent
ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, math.inf)
TTFT_BOUNDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, math.inf)
COLUMNS = ("running", "waiting", "kv", "gen_tps", "prompt_tps", "req_ps", "pre_ps", "itl", "ttft")


def files() -> list[Path]:
    return sorted(HERE.glob("*.json"))


@dataclass
class Case:
    name: str
    description: str
    settings: Settings
    state: EngineState
    ticks: list[tuple[Observation, datetime]]
    expect: dict[str, Any]


def load(path: Path) -> Case:
    data = json.loads(path.read_text(encoding="utf-8"))
    overrides: dict[str, dict[str, Any]] = data.get("settings", {})
    policy: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in overrides.get("policy", {}).items()
    }
    settings = Settings(
        baseline=BaselineSettings(**overrides.get("baseline", {})),
        diagnosis=DiagnosisSettings(**overrides.get("diagnosis", {})),
        policy=PolicySettings(**policy),
    )
    started = _time(data["process_start"])
    key = f"start:{started:.3f}"
    regimes = {}
    b = settings.baseline
    for medians in data["baseline"]:
        unknown = set(medians) - set(METRICS)
        assert not unknown, f"{path.name}: unknown baseline metrics {unknown}"
        regime_key = math.floor(
            math.log2(medians["generation_tokens_per_s"]) * b.buckets_per_octave
        )
        values = {name: (float(v),) * b.min_values for name, v in medians.items()}
        regimes[regime_key] = Regime(b.min_values, values)
    state = EngineState(
        run=RunState(key=key, started=started),
        baseline=Baseline(
            run=key, regimes=regimes, busy_from=settings.baseline.warmup if regimes else None
        ),
    )
    restarts = tuple(
        RestartRecord(_time(r["at"]), r["cause"], r.get("recovered"))
        for r in data.get("restarts", [])
    )
    columns = data.get("columns", list(COLUMNS))
    ticks = list(_ticks(data, columns, started, restarts, settings))
    return Case(path.stem, data["description"], settings, state, ticks, data["expect"])


def _time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class _Counters:
    gen: float = 1e6
    prompt: float = 5e6
    req: float = 1e4
    pre: float = 0.0
    steps: float = 1e5
    itl: list[float] = dataclasses.field(default_factory=lambda: [0.0] * len(ITL_BOUNDS))
    itl_sum: float = 0.0
    ttft: list[float] = dataclasses.field(default_factory=lambda: [0.0] * len(TTFT_BOUNDS))
    ttft_sum: float = 0.0
    prefix_q: float = 0.0
    prefix_hit: float = 0.0


def _rows(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for entry in data["rows"]:
        if isinstance(entry, list):
            yield {"row": entry}
            continue
        for i in range(entry.get("repeat", 1)):
            yield entry if i == 0 else {k: v for k, v in entry.items() if k != "reset"}


def _ticks(
    data: dict[str, Any],
    columns: list[str],
    started: float,
    restarts: tuple[RestartRecord, ...],
    settings: Settings,
) -> Iterator[tuple[Observation, datetime]]:
    interval = float(data["interval"])
    wall = _time(data["first"])
    counters = _Counters()
    keep = int(settings.baseline.window / interval) + 2
    samples: list[Sample] = []
    memory: list[MemoryPoint] = []
    leak = data.get("memory")
    probe = ProbeFacts()
    unit: UnitFacts | None = None
    for entry in _rows(data):
        wall += interval
        if entry.get("reset"):  # the counters start again from zero, the process start kept
            counters = _Counters(gen=0.0, prompt=0.0, req=0.0, steps=0.0)
        mono = wall - started + 1000.0
        down = entry.get("down") or entry.get("silent") or ""
        if "unit" in entry:
            facts = dict(entry["unit"])
            if facts.get("active_since"):
                facts["active_since"] = _time(facts["active_since"])
            unit = UnitFacts(**{"invocation_id": "case", "main_pid": 1, "memory_bytes": None,
                                "n_restarts": 0, **facts})  # fmt: skip
        if down:
            samples.append(Sample(wall, mono, None, down, vllm_silent="silent" in entry, unit=unit))
        else:
            values = dict(zip(columns, entry["row"]))
            metrics = _advance(counters, values, interval, started)
            unit = unit or _unit(leak)
            samples.append(
                Sample(wall, mono, metrics, None, (_gpu(entry.get("gpu", {})),), None, unit)
            )
            if leak:
                served = counters.req - 1e4
                memory.append(
                    MemoryPoint(mono, leak["start"] + served * leak["per_request"], served)
                )
        samples = samples[-keep:]
        outcome = entry.get("probe")
        if outcome == "ok":
            probe = ProbeFacts(answered=mono, last_sent=mono)
        elif outcome is not None:
            unanswered = probe.unanswered if probe.unanswered is not None else mono
            probe = ProbeFacts(probe.answered, unanswered, last_sent=mono)
        observed = Observation(
            samples=tuple(samples),
            unit_active=(
                unit.active_state == "active" if unit else not down.startswith("inactive")
            ),
            unit_started=unit.active_since if unit else None,
            stopped=entry.get("stopped", ""),
            memory=tuple(memory),
            restarts=restarts,
            flags=MappingProxyType(data.get("flags", {})),
            probe=probe,
        )
        yield observed, datetime.fromtimestamp(wall, timezone.utc)


def _unit(leak: dict[str, Any] | None) -> UnitFacts | None:
    """The unit as systemd shows it where the case gives its MemoryMax."""
    if not leak or "max" not in leak:
        return None
    return UnitFacts("active", "running", "case", 1, None, 0, memory_max_bytes=int(leak["max"]))


def _advance(c: _Counters, v: dict[str, float], dt: float, started: float) -> VllmMetrics:
    generated = v["gen_tps"] * dt
    c.gen += generated
    c.prompt += v["prompt_tps"] * dt
    c.req += v["req_ps"] * dt
    c.pre += v["pre_ps"] * dt
    prefix = "prefix_q" in v
    if prefix:
        c.prefix_q += v["prefix_q"] * dt
        c.prefix_hit += v["prefix_hit"] * dt
    if generated > 0:
        c.steps += dt / v["itl"]
        _observe(c.itl, ITL_BOUNDS, v["itl"], generated)
        c.itl_sum += v["itl"] * generated
    if v["req_ps"] > 0:
        _observe(c.ttft, TTFT_BOUNDS, v["ttft"], v["req_ps"] * dt)
        c.ttft_sum += v["ttft"] * v["req_ps"] * dt
    return VllmMetrics(
        flavor="v1-latest",
        models=("m",),
        engines=1,
        kv_cache_usage=v["kv"],
        kv_cache_usage_max=v["kv"],
        num_requests_running=v["running"],
        num_requests_waiting=v["waiting"],
        num_preemptions_total=c.pre,
        generation_tokens_total=c.gen,
        prompt_tokens_total=c.prompt,
        request_success_total=c.req,
        prefix_cache_queries_total=c.prefix_q if prefix else None,
        prefix_cache_hits_total=c.prefix_hit if prefix else None,
        prefix_cache_unit="tokens" if prefix else None,
        prefix_cache_hit_rate=None,
        engine_steps_total=c.steps,
        process_start_time=started,
        time_to_first_token=_hist(TTFT_BOUNDS, c.ttft, c.ttft_sum),
        inter_token_latency=_hist(ITL_BOUNDS, c.itl, c.itl_sum),
        cache_config=MappingProxyType({"gpu_memory_utilization": "0.9", "block_size": "16"}),
    )


def _observe(counts: list[float], bounds: tuple[float, ...], value: float, times: float) -> None:
    index = next(i for i, bound in enumerate(bounds) if value <= bound)
    counts[index] += times


def _hist(bounds: tuple[float, ...], counts: list[float], total: float) -> Histogram:
    cumulative, running = [], 0.0
    for count in counts:
        running += count
        cumulative.append(running)
    return Histogram(bounds, tuple(cumulative), total)


def _gpu(spec: dict[str, Any]) -> GpuReading:
    reasons = tuple(spec.get("reasons", ()))
    assert all(r in THROTTLE_REASONS or r == "gpu_idle" for r in reasons), reasons
    return GpuReading(
        index=0,
        uuid="GPU-00000000-0000-4000-8000-000000000000",
        name="NVIDIA H100 80GB HBM3",
        memory_used_bytes=72 * 1024**3,
        memory_total_bytes=80 * 1024**3,
        utilization_percent=98.0,
        temperature_c=91.0 if reasons else 66.0,
        power_w=600.0,
        power_limit_w=700.0,
        sm_clock_mhz=float(spec.get("clock", 1980)),
        sm_clock_max_mhz=float(spec.get("max", 1980)),
        clock_event_reasons=reasons,
        ecc_uncorrected_volatile=int(spec.get("ecc", 0)),
        xid_errors=tuple(spec.get("xid", ())),
    )
