"""A simulated GPU host for engine tests: the simulator's engine model as vLLM, sampled like
the daemon samples it, with restarts that really start a fresh process (a fresh Cluster).

Samples are built straight from the engine model's counters (what ``sim.exposition.render``
prints and ``vllm_metrics.Normaliser`` reads back; ``test_engine`` checks the two agree),
which keeps a simulated day of ticks to a few seconds.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import MappingProxyType

from vkvagent.adapters.gpu import GpuReader, RecordedBackend
from vkvagent.engine import Decision, EngineState, Observation, Settings, decide
from vkvagent.engine.memory import MemoryPoint
from vkvagent.engine.policy import RestartRecord
from vkvagent.engine.prevention import Track
from vkvagent.engine.samples import Histogram, Sample, VllmMetrics
from vkvagent.sim.capacity import Cluster, EngineModel, Scenario, capacity
from vkvagent.sim.exposition import histogram_bounds
from vkvagent.sim.workload import Workload, azure_sizes, constant

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIZES = azure_sizes()
BOUNDS = histogram_bounds("v1-latest")
LEAK_PER_REQUEST = 64 * 1024  # the simulator's memory-growth leak (sim/server.py)
BASE_MEMORY = 6 * 1024**3


def new_cluster(
    scenario: str, onset: float | None, rate: float, seed: int, kv_blocks: int | None
) -> Cluster:
    cap = capacity(
        MODEL,
        gpu_memory_utilization=0.9,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=32768,
        num_gpu_blocks_override=kv_blocks,
    )
    return Cluster(
        engines=[EngineModel(cap, BOUNDS)],
        workload=Workload(constant(rate), SIZES, random.Random(seed)),
        scenario=Scenario(scenario, onset),
    )


def cluster_metrics(cluster: Cluster, start_time: float) -> VllmMetrics:
    """What vLLM's /metrics says about the cluster now, normalised."""
    stats = [engine.stats for engine in cluster.engines]

    def hist(name: str) -> Histogram:
        bounds = stats[0].histograms[name].bounds
        cumulative = [0.0] * (len(bounds) + 1)
        total = 0.0
        for engine in stats:
            for i, value in enumerate(engine.histograms[name].cumulative()):
                cumulative[i] += value
            total += engine.histograms[name].sum
        return Histogram((*bounds, math.inf), tuple(cumulative), total)

    kv = [s.kv_usage for s in stats]
    blocks = cluster.engines[0].cap.num_gpu_blocks
    return VllmMetrics(
        flavor="v1-latest",
        models=(MODEL,),
        engines=len(stats),
        kv_cache_usage=sum(kv) / len(kv),
        kv_cache_usage_max=max(kv),
        num_requests_running=float(sum(s.running for s in stats)),
        num_requests_waiting=float(sum(s.waiting for s in stats)),
        num_preemptions_total=sum(s.preemptions for s in stats),
        generation_tokens_total=sum(s.generation_tokens for s in stats),
        prompt_tokens_total=sum(s.prompt_tokens for s in stats),
        request_success_total=sum(sum(s.finished.values()) for s in stats),
        prefix_cache_queries_total=sum(s.prefix_queries for s in stats),
        prefix_cache_hits_total=sum(s.prefix_hits for s in stats),
        prefix_cache_unit="tokens",
        prefix_cache_hit_rate=None,
        engine_steps_total=hist("iteration_tokens_total").count,
        process_start_time=start_time,
        time_to_first_token=hist("time_to_first_token_seconds"),
        inter_token_latency=hist("inter_token_latency_seconds"),
        cache_config=MappingProxyType(
            {"block_size": "16", "gpu_memory_utilization": "0.9", "num_gpu_blocks": str(blocks)}
        ),
        version="0.11.0",
    )


@dataclass
class SimHost:
    """One host running the simulated vLLM, sampled every ``interval`` seconds, with the
    engine deciding every ``decide_every`` seconds; a "restart" decision restarts it after a
    ``cold_start`` during which /metrics is unreachable."""

    scenario: str
    settings: Settings
    start: datetime  # when the first vLLM process started (UTC)
    onset: float | None = None
    rate: float = 4.0
    seed: int = 7
    kv_blocks: int | None = None
    interval: float = 10.0
    decide_every: float = 30.0
    cold_start: float = 120.0
    obey: bool = True  # carry out restart decisions
    gpus: int = 1
    leak: bool = False  # feed the unit's memory, growing with requests served
    peer_runs: tuple[Track, ...] = ()  # other hosts' cured runs, as the fleet shares them

    decisions: list[Decision] = field(default_factory=list)
    restarts: list[RestartRecord] = field(default_factory=list)
    state: EngineState = field(default_factory=EngineState)

    def __post_init__(self) -> None:
        self.cluster = new_cluster(self.scenario, self.onset, self.rate, self.seed, self.kv_blocks)
        self.process_start = self.start.timestamp()
        self.down_until = 0.0
        self.clock = self.process_start  # wall time (UTC seconds)
        self.samples: deque[Sample] = deque(
            maxlen=int(self.settings.baseline.window / self.interval) + 2
        )
        self.memory: deque[MemoryPoint] = deque(maxlen=1500)  # one a minute
        self.served_before = 0  # requests served by earlier processes (for the leak)

    def mono(self, wall: float) -> float:
        return wall - self.start.timestamp() + 5000.0

    def run_until(self, hours: float) -> list[Decision]:
        """Advance to ``hours`` after the first start; returns the decisions made on the way."""
        end = self.start.timestamp() + hours * 3600
        made: list[Decision] = []
        next_decision = self.clock + self.decide_every
        while self.clock + self.interval <= end + 1e-9:
            self.clock += self.interval
            self.samples.append(self._sample())
            if self.clock + 1e-9 >= next_decision:
                next_decision += self.decide_every
                made.append(self._decide())
        self.decisions += made
        return made

    def _sample(self) -> Sample:
        wall, mono = self.clock, self.mono(self.clock)
        if wall < self.down_until:
            return Sample(wall, mono, None, "connection refused")
        self.cluster.advance_to(wall - self.process_start)
        metrics = cluster_metrics(self.cluster, self.process_start)
        recording = self.cluster.gpu_recording(self.gpus)
        readings, error = GpuReader(open=lambda: RecordedBackend(recording)).read()
        if self.leak and (not self.memory or mono - self.memory[-1].mono >= 60):
            served = self.cluster.served
            self.memory.append(
                MemoryPoint(mono, BASE_MEMORY + served * LEAK_PER_REQUEST, float(served))
            )
        return Sample(wall, mono, metrics, None, readings, error)

    def _decide(self) -> Decision:
        now = datetime.fromtimestamp(self.clock, timezone.utc)
        observed = Observation(
            samples=tuple(self.samples),
            unit_active=True,
            memory=tuple(self.memory),
            restarts=tuple(self.restarts),
            peer_runs=self.peer_runs,
        )
        decision = decide(self.settings, self.state, observed, now)
        self.state = decision.state
        if decision.recovered is not None and self.restarts and self.restarts[-1].recovered is None:
            last = self.restarts[-1]
            self.restarts[-1] = RestartRecord(last.time, last.cause, decision.recovered)
        if decision.action == "restart" and self.obey:
            self._restart(decision)
        return decision

    def _restart(self, decision: Decision) -> None:
        self.restarts.append(RestartRecord(self.clock, decision.cause or "?"))
        self.down_until = self.clock + self.cold_start
        self.process_start = self.down_until
        self.seed += 1
        scenario = self.cluster.scenario
        self.cluster = new_cluster(
            scenario.name, scenario.onset, self.rate, self.seed, self.kv_blocks
        )
        self.memory.clear()


def hours_after(start: datetime, decision: Decision) -> float:
    return (decision.time - start).total_seconds() / 3600


def transitions(decisions: Sequence[Decision]) -> list[str]:
    """One line per change of action, cause or reason's first word: a readable timeline."""
    out, last = [], None
    for d in decisions:
        key = (d.action, d.cause, d.reason.split(":")[0])
        if key != last:
            ratio = "-" if d.ratio is None else f"{d.ratio:.2f}"
            out.append(f"{d.time:%a %H:%M} {d.action:7} {d.cause or '-':18} r={ratio} {d.reason}")
            last = key
    return out
