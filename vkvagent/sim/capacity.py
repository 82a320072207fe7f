"""The simulated inference engine: capacity, scheduling, KV cache, preemption, degradation.

A deliberately small model that moves in the directions vLLM moves:
- total decode throughput grows sublinearly with the batch (``n ** 0.7``), so each request's
  decode speed falls as concurrency rises;
- each request holds ``ceil(tokens / block_size)`` KV blocks; requests wait when KV or
  ``--max-num-seqs`` is full, and a running request that cannot get a block preempts the most
  recently admitted one (V1 recompute: its blocks are freed and its tokens prefilled again);
- the KV pool comes from ``--gpu-memory-utilization``, the model size and ``--block-size``;
  prefix caching skips part of each prompt, less with bigger blocks.

Degradations (``Scenario``) depend on the process's uptime, so a restart cures them, as in the
field. Time advances in fixed steps of ``STEP`` simulated seconds, whatever the wall clock does,
so a seed gives the same trajectory at any time scale.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vkvagent.sim.stats import COMPLETIONS, EngineStats, HttpStats, Observations
from vkvagent.sim.workload import Request, Workload

STEP = 0.5  # simulated seconds per step
GIB = 1024**3
GPU_MEMORY = 80 * GIB  # one H100 80GB per tensor-parallel rank
LENGTH_CAPPED_OUTPUT = 500  # requests asking for this many tokens or more end by "length"

SCENARIOS = {
    # name: (onset in seconds of uptime, what it does)
    "healthy": (0.0, "no degradation"),
    "uptime-decline": (3600.0, "stable, then decode speed falls 10 % per hour of uptime"),
    "kv-pressure": (1800.0, "KV blocks leak with uptime: preemption storms at usual load"),
    "stall": (1800.0, "tokens stop while requests run; /health stays 200"),
    # vLLM 0.32 with its engine process stopped: the API server answers /health and /metrics,
    # the counters stop and the gauges keep what the engine last published, 0 pending in two
    # trials of three, while every request waits for ever.
    "hang": (1800.0, "the engine hangs: counters stop, gauges read 0 pending, requests wait"),
    "memory-growth": (0.0, "host memory grows with every request served"),
    "thermal-throttle": (1800.0, "GPU clocks drop (thermal slowdown): speed down 40 %"),
    "load-surge": (1800.0, "demand tripled for an hour"),
    "engine-dead": (1800.0, "the engine dies: /health 503, then the process exits"),
}


WORLD_SCENARIOS = frozenset({"thermal-throttle", "load-surge"})


@dataclass(frozen=True)
class Scenario:
    """A degradation and the uptime at which it begins."""

    name: str = "healthy"
    onset: float | None = None  # None: the scenario's default

    def __post_init__(self) -> None:
        if self.name not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.name!r} (allowed: {', '.join(SCENARIOS)})")

    @property
    def starts_at(self) -> float:
        return SCENARIOS[self.name][0] if self.onset is None else self.onset

    @property
    def external(self) -> bool:
        """Heat and demand come from outside the process: they follow the world's clock, not
        the process's uptime, so a restart does not end them (``Cluster.world_offset``)."""
        return self.name in WORLD_SCENARIOS

    def active(self, name: str, uptime: float) -> bool:
        return self.name == name and uptime >= self.starts_at

    def speed_factor(self, uptime: float) -> float:
        if self.active("uptime-decline", uptime):
            return max(0.3, 1.0 - 0.10 * (uptime - self.starts_at) / 3600.0)
        if self.active("thermal-throttle", uptime):
            return 0.6
        return 1.0

    def leaked_fraction(self, uptime: float) -> float:
        if self.active("kv-pressure", uptime):
            return min(0.7, 0.15 * (uptime - self.starts_at) / 3600.0)
        return 0.0

    def demand_multiplier(self, uptime: float) -> float:
        in_surge = self.active("load-surge", uptime) and uptime < self.starts_at + 3600.0
        return 3.0 if in_surge else 1.0


@dataclass(frozen=True)
class Capacity:
    """What one data-parallel engine can do, derived from the flags and the model's size."""

    num_gpu_blocks: int
    num_cpu_blocks: int  # V0's swap space, in blocks
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    single_stream_speed: float  # decode tokens/s of one request alone
    prefill_speed: float  # prompt tokens/s
    prefix_hit_ratio: float  # share of each prompt served from the prefix cache


def model_billions(model: str) -> float:
    """Parameter count from a model name ("Llama-3.1-70B" -> 70); 8 when it does not say."""
    found = [float(n) for n in re.findall(r"(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", model)]
    return found[-1] if found and found[-1] > 0 else 8.0


def capacity(
    model: str,
    *,
    gpu_memory_utilization: float,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    enforce_eager: bool = False,
    enable_prefix_caching: bool = True,
    tensor_parallel_size: int = 1,
    num_gpu_blocks_override: int | None = None,
    swap_space: float = 0.0,
) -> Capacity:
    billions = model_billions(model)
    memory = GPU_MEMORY * tensor_parallel_size
    weights = billions * 1e9 * 2  # bf16
    overhead = 2 * GIB + (0 if enforce_eager else 1 * GIB)  # activations; CUDA graphs
    kv_token_bytes = 131072 * (billions / 8) ** 0.42  # Llama-3-8B: 128 KiB per token
    if kv_cache_dtype.startswith("fp8"):
        kv_token_bytes /= 2
    free = max(0.0, memory * gpu_memory_utilization - weights - overhead)
    blocks = num_gpu_blocks_override or int(free // (kv_token_bytes * block_size))
    speed = 110.0 * (8 / billions) ** 0.6 * tensor_parallel_size**0.5
    return Capacity(
        num_gpu_blocks=blocks,
        num_cpu_blocks=int(swap_space * GIB // (kv_token_bytes * block_size)),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        single_stream_speed=speed * (0.85 if enforce_eager else 1.0),
        prefill_speed=speed * 120 * min(1.0, max_num_batched_tokens / 8192) ** 0.3,
        prefix_hit_ratio=0.3 * (16 / block_size) ** 0.3 if enable_prefix_caching else 0.0,
    )


@dataclass
class _Sequence:
    request: Request
    generated: float = 0.0  # kept across preemptions
    admitted: float = 0.0
    prefill_left: float = 0.0
    first_token: float | None = None
    blocks: int = 0  # KV blocks held; 0 exactly when not running
    admissions: int = 0

    @property
    def target(self) -> int:
        return self.request.output_tokens


class EngineModel:
    """One data-parallel engine: a scheduler over a KV pool, filling ``EngineStats``."""

    def __init__(self, cap: Capacity, histograms: dict[str, tuple[float, ...]]) -> None:
        self.cap = cap
        self.stats = EngineStats(
            histograms={name: Observations(bounds) for name, bounds in histograms.items()}
        )
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.used_blocks = 0
        self.leaked_blocks = 0
        self.served = 0

    def submit(self, request: Request) -> None:
        limit = self.cap.max_model_len
        if request.prompt_tokens + request.output_tokens > limit:  # vLLM caps the output
            request = Request(request.arrival, min(request.prompt_tokens, limit - 1),
                              max(1, limit - request.prompt_tokens))  # fmt: skip
        self.waiting.append(_Sequence(request))

    def step(self, now: float, speed_factor: float, leaked_fraction: float, stalled: bool) -> None:
        """Advance by STEP simulated seconds starting at ``now``."""
        self.leaked_blocks = int(self.cap.num_gpu_blocks * leaked_fraction)
        while self.running and self._free() < 0:
            self._preempt(self.running[-1])
        if not stalled:
            self._admit(now)
            prefilled = self._prefill(now, speed_factor)
            self._decode(now, speed_factor, prefilled)
        stats = self.stats
        stats.running, stats.waiting = len(self.running), len(self.waiting)
        total = max(1, self.cap.num_gpu_blocks)
        stats.kv_usage = min(1.0, (self.used_blocks + self.leaked_blocks) / total)

    def _free(self) -> int:
        return self.cap.num_gpu_blocks - self.used_blocks - self.leaked_blocks

    def _blocks(self, tokens: float) -> int:
        return math.ceil(tokens / self.cap.block_size)

    def _admit(self, now: float) -> None:
        stats = self.stats
        while self.waiting and len(self.running) < self.cap.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.request.prompt_tokens + seq.generated
            need = self._blocks(tokens + 1)
            if need > self._free():
                return  # first come, first served: the head waits for room
            self.waiting.popleft()
            seq.blocks = need
            self.used_blocks += need
            seq.admitted = now
            seq.admissions += 1
            if seq.admissions == 1:  # first admission: the prefix cache may hold a part
                prompt = seq.request.prompt_tokens
                hits = prompt * self.cap.prefix_hit_ratio
                stats.prefix_queries += prompt
                stats.prefix_hits += hits
                seq.prefill_left = prompt - hits
                self._observe("request_queue_time_seconds", now - seq.request.arrival)
            else:  # re-admitted after a preemption: recompute everything it had
                seq.prefill_left = tokens
            self.running.append(seq)

    def _prefill(self, now: float, speed_factor: float) -> float:
        budget = self.cap.prefill_speed * speed_factor * STEP
        used = 0.0
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefill_left <= 0:
                continue
            take = min(seq.prefill_left, budget)
            seq.prefill_left -= take
            budget -= take
            used += take
            if seq.prefill_left <= 0 and seq.first_token is None:
                seq.first_token = now + STEP
                self.stats.prompt_tokens += seq.request.prompt_tokens
                self._observe("time_to_first_token_seconds", seq.first_token - seq.request.arrival)
                self._observe("request_prefill_time_seconds", seq.first_token - seq.admitted)
        return used

    def _decode(self, now: float, speed_factor: float, prefilled: float) -> None:
        decoding = [s for s in self.running if s.prefill_left <= 0]
        if not decoding:
            return
        n = len(decoding)
        speed = self.cap.single_stream_speed * n**-0.3 * speed_factor  # per request
        steps = speed * STEP  # engine iterations in this interval, one token each
        self._observe("iteration_tokens_total", n + prefilled / max(steps, 1.0), steps)
        for latency in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
            self._observe(latency, 1.0 / speed, steps * n)
        for seq in decoding:
            if seq.blocks == 0:  # preempted earlier in this loop
                continue
            grown = min(float(seq.target), seq.generated + speed * STEP)
            need = self._blocks(seq.request.prompt_tokens + grown) - seq.blocks
            while need > self._free() and self.running[-1] is not seq:
                self._preempt(self.running[-1])
            if need > self._free():
                self._preempt(seq)
                continue
            seq.blocks += max(0, need)
            self.used_blocks += max(0, need)
            self.stats.generation_tokens += grown - seq.generated
            seq.generated = grown
            if grown >= seq.target:
                self._finish(seq, now + STEP)

    def _preempt(self, seq: _Sequence) -> None:
        self.running.remove(seq)
        self.used_blocks -= seq.blocks
        seq.blocks = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _finish(self, seq: _Sequence, now: float) -> None:
        self.running.remove(seq)
        self.used_blocks -= seq.blocks
        self.served += 1
        request = seq.request
        reason = "length" if request.output_tokens >= LENGTH_CAPPED_OUTPUT else "stop"
        self.stats.finished[reason] = self.stats.finished.get(reason, 0.0) + 1
        first = seq.first_token if seq.first_token is not None else now
        self._observe("e2e_request_latency_seconds", now - request.arrival)
        self._observe("request_decode_time_seconds", now - first)
        self._observe("request_inference_time_seconds", now - seq.admitted)
        self._observe("request_prompt_tokens", request.prompt_tokens)
        self._observe("request_generation_tokens", request.output_tokens)

    def _observe(self, name: str, value: float, times: float = 1.0) -> None:
        histogram = self.stats.histograms.get(name)
        if histogram is not None and times > 0:
            histogram.observe(value, times)


@dataclass
class Cluster:
    """Every data-parallel engine of one server, fed by one workload, on one simulated clock."""

    engines: list[EngineModel]
    workload: Workload
    scenario: Scenario = field(default_factory=Scenario)
    now: float = 0.0  # simulated seconds since the process started (its uptime)
    world_offset: float = 0.0  # simulated seconds the world had run when the process started
    admitting: bool = True  # False while it drains for a shutdown: no new request comes in
    http: HttpStats = field(default_factory=HttpStats)  # the API server's answers
    refused: int = 0  # requests answered HTTP 500 because they came in while it drained
    _next_engine: int = 0
    _answered: int = 0  # finished requests already counted in ``http``

    def scenario_time(self, uptime: float) -> float:
        """The time the scenario's effects follow: the world's for heat and demand, the
        process's uptime for everything a restart cures."""
        return uptime + self.world_offset if self.scenario.external else uptime

    def advance_to(self, uptime: float) -> None:
        """Run whole steps up to ``uptime``."""
        while self.now + STEP <= uptime:
            self._step()

    def _step(self) -> None:
        scenario, now = self.scenario, self.now
        t = self.scenario_time(now)
        arriving = self.workload.arrivals(now, now + STEP, scenario.demand_multiplier(t))
        if self.admitting:
            for request in arriving:
                self.engines[self._next_engine].submit(request)
                self._next_engine = (self._next_engine + 1) % len(self.engines)
        else:  # what vLLM answers a request that comes in while it drains
            self.refused += len(arriving)
            self.http.count(COMPLETIONS, "POST", 500, len(arriving))
        for engine in self.engines:
            engine.step(
                now,
                scenario.speed_factor(t),
                scenario.leaked_fraction(t),
                stalled=self.stalled,
            )
        # Each finished request stands for a client's completion, answered 200.
        served = self.served
        self.http.count(COMPLETIONS, "POST", 200, served - self._answered)
        self._answered = served
        self.now = now + STEP

    @property
    def served(self) -> int:
        return sum(engine.served for engine in self.engines)

    @property
    def in_flight(self) -> int:
        return sum(len(e.running) + len(e.waiting) for e in self.engines)

    @property
    def stalled(self) -> bool:
        """The engine serves nothing: stalled, hung or dead."""
        return any(
            self.scenario.active(name, self.now) for name in ("stall", "hang", "engine-dead")
        )

    @property
    def hung(self) -> bool:
        return self.scenario.active("hang", self.now)

    def published(self) -> list[EngineStats]:
        """What each engine's loggers publish to /metrics: a hung engine's gauges read 0
        pending (what it last published, in two trials of three with vLLM 0.32)."""
        if self.hung:
            return [dataclasses.replace(e.stats, running=0, waiting=0) for e in self.engines]
        return [e.stats for e in self.engines]

    @property
    def dead(self) -> bool:
        return self.scenario.active("engine-dead", self.now)

    def state(self) -> dict[str, Any]:
        """A JSON-ready summary for the control endpoint and tests."""
        engines = [e.stats for e in self.engines]
        return {
            "uptime": self.now,
            "scenario": self.scenario.name,
            "scenario_starts_at": self.scenario.starts_at,
            "served": self.served,
            "refused": self.refused,
            "admitting": self.admitting,
            "running": sum(s.running for s in engines),
            "waiting": sum(s.waiting for s in engines),
            "kv_usage": sum(s.kv_usage for s in engines) / len(engines),
            "generation_tokens": sum(s.generation_tokens for s in engines),
            "prompt_tokens": sum(s.prompt_tokens for s in engines),
            "preemptions": sum(s.preemptions for s in engines),
            "num_gpu_blocks": self.engines[0].cap.num_gpu_blocks,
            "speed_factor": self.scenario.speed_factor(self.scenario_time(self.now)),
            "stalled": self.scenario.active("stall", self.now),
            "hung": self.hung,
            "dead": self.dead,
        }

    def gpu_recording(self, gpus: int) -> dict[str, Any]:
        """GPU readings in the format of ``vkvagent gpu --record`` (the agent's recorded-
        readings mode reads it): hot and slowed during thermal throttling."""
        hot = self.scenario.active("thermal-throttle", self.scenario_time(self.now))
        busy = any(engine.running for engine in self.engines)
        devices = [
            {
                "uuid": f"GPU-5157{index:04x}-0000-4000-8000-{index:012x}",
                "name": "NVIDIA H100 80GB HBM3",
                "memory_used": int(GPU_MEMORY * 0.9),
                "memory_total": GPU_MEMORY,
                "utilization_gpu": 98 if busy else 0,
                "temperature": 91 if hot else (66 if busy else 38),
                "power_mw": 520000 if hot else (640000 if busy else 90000),
                "power_limit_mw": 700000,
                "sm_clock": 1155 if hot else (1980 if busy else 345),
                "sm_clock_max": 1980,
                "clock_event_reasons": 0x60 if hot else (0 if busy else 0x1),
                "ecc_uncorrected_volatile": 0,
            }
            for index in range(gpus)
        ]
        return {"devices": devices, "xid_events": []}
