"""Benchmark: decision quality of restart policies over a simulated week (``make bench-policy``).

Every scenario of ``bench.policy_model.WORLDS`` is a week of the same fluid model; every policy
is scored on it from its restart times: never restart, every 6 h (the runbook's CronJob), daily
at 04:00 (the guide's cron line), the runbook's alert acted on, vkvagent's default configuration
in enforce mode, the oracle (the exact optimum, by dynamic programming) and the windowed oracle
(the optimum whose own restarts begin in vkvagent's default restart windows). vkvagent runs the
real ``engine.decide`` on samples synthesised from the model every 30 s, in closed loop: its
restarts change what the model serves and what the next samples say. Where the operator changes
vLLM's flags (``slow-flags``), vkvagent also runs the daemon's flags loop (``knowledge.reconcile``)
that judges the change and rolls a slower one back. bench/README.md has the definitions and the
latest table.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path as FilePath
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from bench.policy_model import (
    COLD_STEPS,
    DAY_STEPS,
    HOUR,
    ITL_SIGMA,
    START,
    STEP,
    TTFT_SIGMA,
    VARIANTS,
    WEEK_STEPS,
    WORLDS,
    Episode,
    Mask,
    Model,
    Path,
    Server,
    Values,
    World,
    attained,
    episodes,
    optima,
    slo_optima,
    walk,
    when,
    window_mask,
    within,
)
from vkvagent.adapters.fleet_runs import ServerKnowledge, digest
from vkvagent.adapters.gpu import GpuReader, RecordedBackend
from vkvagent.engine import (
    Decision,
    EngineState,
    FlagValue,
    GpuReading,
    Histogram,
    Observation,
    Recent,
    Sample,
    Settings,
    UnitFacts,
    VllmMetrics,
    decide,
)  # fmt: skip
from vkvagent.engine.diagnosis import FIXABLE
from vkvagent.engine.policy import PolicySettings, RestartRecord, window_state
from vkvagent.engine.slo import SloSettings
from vkvagent.knowledge.config import Config, SloConfig
from vkvagent.knowledge.flags import shown
from vkvagent.knowledge.reconcile import Change, FlagState, flags_key
from vkvagent.sim.exposition import histogram_bounds

SAMPLE_EVERY = 30.0  # seconds between samples, and between two decisions
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BOUNDS = histogram_bounds("v1-latest")
ITL_BOUNDS = BOUNDS["inter_token_latency_seconds"]
TTFT_BOUNDS = BOUNDS["time_to_first_token_seconds"]
MONO = 1_000_000.0  # the monotonic clock at START
# The operator's [vllm.flags] in the slow-flags scenario, and the command line they replace.
# They only name the change for the flags loop; what they do is the model's (``slow_flags``).
SLOW_FLAGS: Mapping[str, FlagValue] = MappingProxyType({"max-num-seqs": 24})
OLD_ARGV = ("vllm", "serve", MODEL)


# The operator's objectives of ``--slo``: 99.9 % of requests served, 95 % of first tokens within
# 2 s, 95 % of output tokens within 100 ms of the one before, over the simulated week. Without
# ``--slo`` the columns are measured against them too, and nothing optimises them.
BENCH_SLO_CONFIG = SloConfig(availability=0.999, period_days=7.0, ttft_seconds=2.0, itl_seconds=0.1)
BENCH_SLO = BENCH_SLO_CONFIG.settings()


def vkvagent_settings(slo: bool = False) -> Settings:
    """vkvagent's default configuration (``Config()``), in enforce mode; with ``slo``, the
    operator's [slo] (``BENCH_SLO_CONFIG``) and opt-in to cross the windows within its budget
    (``[policy] outside_windows = "when_cheaper"``)."""
    config = Config()
    if slo:
        policy = replace(config.policy, outside_windows="when_cheaper")
        config = replace(config, slo=BENCH_SLO_CONFIG, policy=policy)
    return config.engine_settings("enforce")


# -- the timer and alert policies --------------------------------------------------------------


def every_6h(model: Model) -> list[int]:
    """The runbook's CronJob ``0 */6 * * *``: 00:00, 06:00, 12:00, 18:00 (not the first
    instant, when the server has just started)."""
    return list(range(6 * HOUR, model.steps, 6 * HOUR))


def daily_0400(model: Model) -> list[int]:
    """The guide's ``0 4 * * * systemctl restart vllm.service``."""
    return list(range(4 * HOUR, model.steps, DAY_STEPS))


@dataclass
class Alert:
    """The runbook's alert acted on: every 5 minutes, the last hour's mean throughput
    (generated tokens/s served) against the same hour 8 h earlier; below 0.7 for 15 minutes
    (``for: 15m``) it fires, and a firing alert is acted on by a restart, repeated every 4 h
    while it keeps firing (Alertmanager's default ``repeat_interval``)."""

    ratio: float = 0.7
    every: int = 5
    pending_for: int = 15
    repeat: int = 4 * HOUR
    pending_since: int | None = None
    acted: int | None = None

    def __call__(self, path: Path) -> bool:
        k = path.k
        if k % self.every or k < 9 * HOUR:
            return False
        now = float(path.served[k - HOUR : k].mean())
        before = float(path.served[k - 9 * HOUR : k - 8 * HOUR].mean())
        if not (before > 0 and now < self.ratio * before):
            self.pending_since = self.acted = None
            return False
        if self.pending_since is None:
            self.pending_since = k
        if k - self.pending_since < self.pending_for:
            return False
        if self.acted is None or k - self.acted >= self.repeat:
            self.acted = k
            return True
        return False


# -- vkvagent in closed loop -------------------------------------------------------------------


def _gpu_readings() -> dict[str, tuple[GpuReading, ...]]:
    """One GPU as NVML reports it (through the recorded-readings backend): hot and throttled,
    busy, or idle; the values of the simulator's ``Cluster.gpu_recording``."""
    out = {}
    for kind, temp, power, clock, reasons, util in (
        ("hot", 91, 520000, 1155, 0x60, 98),
        ("busy", 66, 640000, 1980, 0, 98),
        ("idle", 38, 90000, 345, 0x1, 0),
    ):
        device = {
            "uuid": "GPU-51570000-0000-4000-8000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_used": (72 * 2**30),
            "memory_total": 80 * 2**30,
            "utilization_gpu": util,
            "temperature": temp,
            "power_mw": power,
            "power_limit_mw": 700000,
            "sm_clock": clock,
            "sm_clock_max": 1980,
            "clock_event_reasons": reasons,
            "ecc_uncorrected_volatile": 0,
        }
        recording = {"devices": [device], "xid_events": []}
        readings, error = GpuReader(open=functools.partial(RecordedBackend, recording)).read()
        assert error is None
        out[kind] = readings
    return out


@dataclass
class _Counters:
    """One vLLM process's cumulative counters and histograms."""

    started: float  # process_start_time (UTC)
    generation: float = 0.0
    prompt: float = 0.0
    success: float = 0.0
    preemptions: float = 0.0
    steps: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    itl: list[float] = field(default_factory=lambda: [0.0] * (len(ITL_BOUNDS) + 1))
    itl_sum: float = 0.0
    ttft: list[float] = field(default_factory=lambda: [0.0] * (len(TTFT_BOUNDS) + 1))
    ttft_sum: float = 0.0


class Synth:
    """Samples of the model's server every ``SAMPLE_EVERY`` seconds, as the daemon would take
    them: counters that advance by what the model serves (with Poisson-like noise on the
    request count and noisy gauges), histograms whose mean is the model's inter-token latency
    and TTFT, a new ``process_start_time`` (and counters from zero) after each restart,
    connection refused during a cold start, the GPU's thermal reasons while it is hot, and the
    unit's memory."""

    def __init__(self, model: Model, seed: int) -> None:
        self.model, self.server = model, model.server
        self.rng = random.Random(seed)
        self.gpus = _gpu_readings()
        self.run: _Counters | None = None
        self.cache_config = MappingProxyType(
            {
                "block_size": str(self.server.block_size),
                "gpu_memory_utilization": "0.9",
                "num_gpu_blocks": str(self.server.kv_blocks),
            }
        )

    def sample(self, t: float, values: Values, run_started: float) -> tuple[Sample, float]:
        """The sample at ``t`` seconds after START, covering the ``SAMPLE_EVERY`` seconds
        before it (all in one step whose values are ``values``), and the unit's memory."""
        wall, mono = START.timestamp() + t, MONO + t
        memory = float(values.memory) * (1 + self.rng.gauss(0, 0.002))
        if not bool(values.up):
            self.run = None
            return Sample(wall, mono, None, "connection refused"), memory
        if self.run is None or self.run.started != run_started:
            self.run = _Counters(run_started)
        self._advance(self.run, values)
        metrics, gpus = self._metrics(self.run, values), self._gpus(values)
        return Sample(wall, mono, metrics, None, gpus, unit=self._unit(memory)), memory

    def _unit(self, memory: float) -> UnitFacts:
        """The unit as systemd shows it: its memory and MemoryMax (the engine times a leak
        against it)."""
        run = self.run
        assert run is not None
        return UnitFacts(
            "active", "running", f"{run.started:.0f}", 1, int(memory), 0,
            memory_max_bytes=int(self.server.memory_max),
        )  # fmt: skip

    def _advance(self, c: _Counters, v: Values) -> None:
        s, rng, dt = self.server, self.rng, SAMPLE_EVERY
        done = float(v.served) * dt / s.output_tokens  # requests finished in the interval
        if done > 0:
            noise = min(1.5, max(0.5, 1 + rng.gauss(0, 1 / math.sqrt(max(done, 1.0)))))
            finished = done * noise
            tokens = float(v.served) * dt * noise * (1 + rng.gauss(0, 0.02))
            c.success += round(finished)
            c.generation += tokens
            prompt = finished * float(v.prompt) * (1 + rng.gauss(0, 0.03))
            c.prompt += prompt
            c.prefix_queries += prompt
            c.prefix_hits += prompt * s.prefix_hit
            itl = float(v.itl) * (1 + rng.gauss(0, 0.02))
            _fill(c.itl, ITL_BOUNDS, tokens, itl, ITL_SIGMA)
            c.itl_sum += tokens * itl
            ttft = float(v.ttft) * (1 + rng.gauss(0, 0.05))
            _fill(c.ttft, TTFT_BOUNDS, finished, ttft, TTFT_SIGMA)
            c.ttft_sum += finished * ttft
            c.steps += dt / float(v.itl)
            preempted = float(v.preemptions) * dt
            if preempted > 0:
                c.preemptions += max(0, round(rng.gauss(preempted, math.sqrt(preempted))))

    def _metrics(self, c: _Counters, v: Values) -> VllmMetrics:
        rng = self.rng
        running = float(v.running) * max(0.0, 1 + rng.gauss(0, 0.08))
        waiting = float(v.waiting) * max(0.0, 1 + rng.gauss(0, 0.15))
        kv = min(1.0, float(v.kv_usage) * max(0.0, 1 + rng.gauss(0, 0.02)))
        return VllmMetrics(
            flavor="v1-latest",
            models=(MODEL,),
            engines=1,
            kv_cache_usage=kv,
            kv_cache_usage_max=kv,
            num_requests_running=float(round(running)),
            num_requests_waiting=float(round(waiting)),
            num_preemptions_total=c.preemptions,
            generation_tokens_total=c.generation,
            prompt_tokens_total=c.prompt,
            request_success_total=c.success,
            # Every request the model serves is answered 200; it has no 5xx.
            http_requests_total=c.success,
            http_5xx_total=0.0,
            prefix_cache_queries_total=c.prefix_queries,
            prefix_cache_hits_total=c.prefix_hits,
            prefix_cache_unit="tokens",
            prefix_cache_hit_rate=None,
            engine_steps_total=c.steps,
            process_start_time=c.started,
            time_to_first_token=Histogram((*TTFT_BOUNDS, math.inf), tuple(c.ttft), c.ttft_sum),
            inter_token_latency=Histogram((*ITL_BOUNDS, math.inf), tuple(c.itl), c.itl_sum),
            cache_config=self.cache_config,
            version="0.11.0",
        )

    def _gpus(self, v: Values) -> tuple[GpuReading, ...]:
        if bool(v.hot):
            return self.gpus["hot"]
        return self.gpus["busy" if float(v.running) > 0 else "idle"]


def _fill(cumulative: list[float], bounds: Sequence[float], count: float, mean: float,
          sigma: float) -> None:  # fmt: skip
    if count <= 0 or mean <= 0:
        return
    for i, share in enumerate(within(np.array(bounds), mean, sigma)):
        cumulative[i] += count * float(share)
    cumulative[-1] += count


class EngineRestart(NamedTuple):
    """A restart vkvagent decided: the step it began at, its cause, whether a window was open,
    and the decision's reason."""

    step: int
    cause: str
    inside: bool
    reason: str

    @property
    def words(self) -> str:
        """Where the reason says it went: "in window", "emergency", "outside window, cheaper
        now", ... (its words after "restart: ", up to the details)."""
        return self.reason.removeprefix("restart: ").split(";")[0].split(":")[0]


@dataclass
class EngineRun:
    """What vkvagent did in one scenario."""

    path: Path
    decisions: int = 0
    cpu_ns: list[int] = field(default_factory=list)  # decide()'s CPU time per tick
    restarts: list[EngineRestart] = field(default_factory=list)
    # The restart history it was given, as the daemon's ledger keeps it: the operator's apply,
    # each restart's verdict and the requests it cut off.
    ledger: list[RestartRecord] = field(default_factory=list)
    detected: list[int] = field(default_factory=list)  # steps a run's first fixable cause came
    causes: dict[str, float] = field(default_factory=dict)  # minutes per named cause
    # The flags loop's verdicts: step, verdict, the new run's fresh speed over the previous's.
    verdicts: list[tuple[int, str, float | None]] = field(default_factory=list)
    state: EngineState = field(default_factory=EngineState)  # the engine's at the end


NO_PEERS = ServerKnowledge()


def peer_knowledge(world: World, settings: Settings, seed: int = 1) -> ServerKnowledge:
    """A new host's peer's cured runs and fresh baseline (``World.peers_h``), as the daemon
    publishes them (``FleetRuns.share``): vkvagent over the same world ``peers_h`` earlier,
    for ``peers_h``; its cured runs' end times as of the new host's clock; its newest fresh
    baseline that knows a load, as its ``digest``, named as a peer's (``RUN@peer``)."""
    if world.peers_h <= 0:
        return NO_PEERS
    before = replace(world, demand_shift_h=world.demand_shift_h + world.peers_h, peers_h=0.0)
    state = run_vkvagent(Model(before, steps=round(world.peers_h * 60)), settings, seed).state
    back = world.peers_h * 3600
    runs = tuple(replace(t, ended=t.ended - back) for t in state.past
                 if t.cured and t.ended is not None)  # fmt: skip
    fresh = [b for b in (state.baseline, state.previous)
             if b is not None and b.known_keys(settings.baseline)
             and not b.late(settings.baseline)]  # fmt: skip
    shared = (replace(digest(b, settings.baseline), run=f"{b.run}@peer") for b in fresh[:1])
    return ServerKnowledge(runs, tuple(shared))


def process_started(model: Model) -> float:
    """The week's first ``process_start_time``: the process came up (its cold start over) at
    START, or started ``World.initial_uptime_h`` before it, where vkvagent is installed on a
    running server."""
    return START.timestamp() - model.first_uptime * STEP


def run_vkvagent(
    model: Model,
    settings: Settings,
    seed: int = 1,
    margin: float | None = None,
    peers: ServerKnowledge = NO_PEERS,
) -> EngineRun:
    """The real engine, deciding every ``SAMPLE_EVERY`` seconds on synthesised samples; a
    restart it decides begins at the next step (a cold start, then a new process).

    With the daemon's flags loop around it, as ``Daemon.tick`` runs it: the operator's flag
    change (``vkvagent apply``, a ledger action) is judged once the run it started and the run
    before it have learned a load in common (``FlagState.judge``, ``margin``: ``[vllm]
    rollback_margin``); a slower one is due to be rolled back, which the engine proposes as a
    restart with cause ``flags`` (``Observation.flags_due``, ``apply_flags = next-window``),
    and any restart the daemon makes while it is due carries it. ``peers``: a fleet's, for a
    new host (``peer_knowledge``)."""
    vllm = Config().vllm
    assert vllm.apply_flags == "next-window"  # the default: a rollback waits for a window
    margin = vllm.rollback_margin if margin is None else margin
    path = Path(model)
    out = EngineRun(path)
    synth = Synth(model, seed)
    recent = Recent(settings.baseline, 2 * SAMPLE_EVERY)
    restarts = out.ledger
    state = EngineState()
    flags = FlagState()
    configured: Mapping[str, FlagValue] = {}  # the flags in effect, as the daemon passes them
    started = process_started(model)
    restart_next, drained, rollback, named = False, False, False, False
    per_step = round(STEP / SAMPLE_EVERY)
    for k in range(model.steps):
        before = path.cut_off
        values = path.advance(restart_next, drained, rollback)
        if restart_next and path.cut_off > before:  # the actuator counts what it cut off
            restarts[-1] = replace(restarts[-1], cut_off=path.cut_off - before)
        if path.u == 0:  # a restart (the policy's, an OOM kill, the operator's): a new process
            started = START.timestamp() + k * STEP
            named = False
            if path.applied and path.applied[-1] == k:
                flags, configured = _operator_applied(flags, restarts, started), SLOW_FLAGS
            elif rollback:  # the daemon passes the flags the unit runs: the old ones again
                configured = {}
        restart_next = rollback = False
        for part in range(1, per_step + 1):
            t = k * STEP + part * SAMPLE_EVERY
            sample, memory = synth.sample(t, values, started)
            recent.add(sample, memory)
            due = _rollback_due(flags)  # from the last tick's verdict, as the daemon's
            observed = Observation(
                samples=tuple(recent.samples),
                unit_active=True,
                memory=recent.memory,
                restarts=tuple(restarts),
                flags=configured,
                flags_due=due,
                flags_slower=flags.last.ratio if due and flags.last is not None else None,
                peer_runs=peers.runs,
                peer_baselines=peers.baselines,
            )
            now = datetime.fromtimestamp(sample.time, timezone.utc)
            began = time.process_time_ns()
            decision = decide(settings, state, observed, now)
            out.cpu_ns.append(time.process_time_ns() - began)
            state = decision.state
            out.decisions += 1
            flags, judged = flags.judge(
                run_started=state.run.started,
                run_uptime=decision.uptime,
                previous=state.previous,
                current=state.baseline,
                settings=settings.baseline,
                margin=margin,
            )
            if judged is not None:
                out.verdicts.append((k, judged.change.verdict, judged.change.ratio))
            _judge(restarts, decision)
            if decision.cause is not None:
                out.causes[decision.cause] = out.causes.get(decision.cause, 0.0) + 0.5
            # A slower flag change named is a cause found that a restart (the rollback) fixes.
            worse = judged is not None and judged.change.verdict == "worse"
            if (decision.cause in FIXABLE or worse) and not named:
                out.detected.append(k)
                named = True
            if decision.action == "restart" and not restart_next:
                restarts.append(RestartRecord(sample.time, decision.cause or "?"))
                out.restarts.append(
                    EngineRestart(
                        k + 1, decision.cause or "?", decision.window_open, decision.reason
                    )
                )
                # vLLM drains by its --shutdown-timeout ([restart] graceful_shutdown), except
                # in an emergency.
                restart_next, drained = True, decision.drain_max_in_flight is not None
                if due:  # the restart carries the rollback, whatever its cause (reconcile.py)
                    rollback = True
                    flags = flags.rolled_back(f"done (action {len(restarts)})")
    out.state = state
    return out


def _operator_applied(flags: FlagState, restarts: list[RestartRecord], at: float) -> FlagState:
    """The operator's `vkvagent apply` of ``SLOW_FLAGS`` at ``at``: a ledger action (reason
    ``manual``) that the policy counts as a restart and the flags loop takes as the change to
    judge; it ends once vLLM is ready, after the cold start."""
    restarts.append(RestartRecord(at, "manual"))
    change = Change(
        action=len(restarts),
        started=at,
        ended=at + COLD_STEPS * STEP,
        flags=SLOW_FLAGS,
        key=flags_key(SLOW_FLAGS),
        before=OLD_ARGV,
    )
    return flags.noticed(change)


def _rollback_due(flags: FlagState) -> str:
    """``Observation.flags_due`` for a slower change not yet rolled back, worded like the
    daemon's ``_flags_due``; empty otherwise."""
    last = flags.last
    if last is None or not last.rollback_due:
        return ""
    return f"roll back {shown(last.flags)} ({last.ratio or 0:.2f} of the fresh speed)"


def _judge(restarts: list[RestartRecord], decision: Decision) -> None:
    """Record the engine's judgement of the last restart, as the daemon's ledger does."""
    if decision.recovered is not None and restarts and restarts[-1].recovered is None:
        restarts[-1] = replace(restarts[-1], recovered=decision.recovered)


# -- the report --------------------------------------------------------------------------------

POLICIES = ("oracle", "windowed oracle", "never", "every 6 h", "daily 04:00", "alert", "vkvagent")
# Where vkvagent's restart reasons say it crossed a window on the operator's opt-in ([policy]
# outside_windows = "when_cheaper"): within the budget of an [slo], or cheaper now without one,
# or at the end of this host's quiet hours.
OPT_IN = (
    "outside window, within the error budget",
    "outside window, cheaper now",
    "outside window, at the end of this host's quiet hours",
)
# The one crossing allowed by default: a memory leak restarted, drained, before the kernel's
# OOM kill at MemoryMax.
BEFORE_OOM_KILL = ("host_memory_growth", "outside window, before the OOM kill")


def unexplained(policy: PolicySettings, restart: EngineRestart) -> bool:
    """Whether vkvagent's ``restart`` crossed the windows with nothing to allow it: no cause
    in ``emergency``, no leak about to reach MemoryMax, no opt-in."""
    if restart.inside or restart.cause in policy.emergency:
        return False
    cause, words = BEFORE_OOM_KILL
    if restart.cause == cause and restart.words.startswith(words):
        return False
    return not (policy.outside_windows == "when_cheaper" and restart.words.startswith(OPT_IN))


@dataclass
class Row:
    world: str
    policy: str
    score: float  # quality-weighted goodput
    of_oracle: float  # against the declared [slo] where there is one (``slo_score``)
    restarts: int
    outside: int  # restarts outside the default restart windows
    wrong: int
    kills: int  # OOM kills
    delay_min: float | None  # median minutes from a run's degradation to its restart
    missed: int  # degraded runs still degraded at the end of the week
    cut_off: float = 0.0  # requests in flight that its restarts (and OOM kills) cut off
    # What the requests in flight cost its restarts and OOM kills (cut off: their wasted
    # tokens; drained: the demand refused meanwhile), a share of the week's demand.
    in_flight: float = 0.0
    # How far its reward trails the oracle's, a share of the week's demand: by the end of the
    # first day (a learning policy's first run), and over the week.
    short_day_one: float = 0.0
    short_week: float = 0.0
    of_windowed: float = 0.0  # score over the windowed oracle's, as ``of_oracle``
    detected_min: float | None = None  # vkvagent: median minutes to its first fixable cause
    detected: int = 0  # vkvagent: degraded runs in which it named a fixable cause
    degraded: int = 0  # degraded runs
    # Per objective of the declared [slo] (else of BENCH_SLO's targets): its attainment over
    # the week, and the share of its error budget that spent (above 1: missed).
    attainment: dict[str, float] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)
    slo_score: float = 0.0  # the mean of the latency objectives' attainments
    # What ``of_oracle`` compares: goodput (no [slo]); with one, latency attainment
    # (``slo_score``) where the oracle meets availability, else availability (no schedule
    # meets it: the oracle has the most).
    scored_by: str = "goodput"
    # Scored by latency, but its availability objective missed: the comparison is marked.
    flagged: bool = False
    # The SLO oracles: at most how much more latency attainment a schedule that meets
    # availability may have (``Optimum.bound``).
    bound: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def missed_objectives(self) -> list[str]:
        return [o for o, spent in self.spent.items() if spent > 1]


def _outside(policy: PolicySettings, steps: Sequence[int]) -> int:
    return sum(not window_state(policy, START + timedelta(seconds=k * STEP))[0] for k in steps)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _detected(episode: Episode, detected: Sequence[int]) -> int | None:
    """Minutes from a degraded run's onset to vkvagent's first fixable cause in that run."""
    for step in detected:
        if step >= episode.onset and (episode.end is None or step < episode.end):
            return step - episode.onset
    return None


def _wrong(
    world: World, path: Path, policy: PolicySettings, decided: Mapping[int, EngineRestart]
) -> int:
    """The path's restarts where nothing a restart cures (in slow-flags, a rollback is the one
    that is right), and those of vkvagent's (``decided``, by step) that crossed the windows
    with nothing to allow it."""
    rollbacks = set(path.rollbacks)
    return sum(
        (world.wrong and k not in rollbacks) or (k in decided and unexplained(policy, decided[k]))
        for k in path.restarts
    )


def score_world(
    world: World,
    settings: Settings,
    seed: int = 1,
    server: Server | None = None,
    window: Mask | None = None,
) -> tuple[list[Row], EngineRun]:
    """Every policy's row in ``world``, and vkvagent's run; ``window``: ``window_mask`` of
    ``settings.policy`` for the week, if already computed. With an [slo] in ``settings`` the
    oracles optimise it and every policy is scored against it; else the oracles optimise
    quality-weighted goodput, and the objective columns are against ``BENCH_SLO``'s targets."""
    model = Model(world, server)
    if window is None or len(window) != model.steps:
        window = window_mask(settings.policy, model.steps)
    slo = settings.slo if settings.slo.declared else None
    targets = slo or BENCH_SLO
    if slo is None:
        best, windowed = optima(model, (None, window))
    else:
        best, windowed = slo_optima(model, slo, (None, window))
    chosen = slo is not None  # the oracles drain or cut off as their objective prefers
    paths: dict[str, Path] = {
        "oracle": walk(model, best.restarts, None, best.rollbacks, chosen),
        "windowed oracle": walk(model, windowed.restarts, None, windowed.rollbacks, chosen),
        "never": walk(model, []),
        "every 6 h": walk(model, every_6h(model)),
        "daily 04:00": walk(model, daily_0400(model)),
        "alert": walk(model, Alert()),
    }
    engine = run_vkvagent(model, settings, seed, peers=peer_knowledge(world, settings, seed))
    paths["vkvagent"] = engine.path
    got = {name: attained(model, path, targets) for name, path in paths.items()}
    assert window[list(windowed.restarts)].all()
    if slo is None:
        assert abs(paths["oracle"].score() - best.score(model)) < 1e-9, (
            "the oracle's walk must score its DP value"
        )
        assert abs(paths["windowed oracle"].score() - windowed.score(model)) < 1e-9
        assert paths["windowed oracle"].score() <= paths["oracle"].score() + 1e-12
    else:
        for name, optimum in (("oracle", best), ("windowed oracle", windowed)):
            assert math.isclose(got[name].unavailable, optimum.unavailable, rel_tol=1e-9), (
                "the oracle's walk must spend the availability its programme counted"
            )

    scored_by = "goodput"
    if slo is not None:
        meets = "availability" not in slo.declared or got["oracle"].spent(slo, "availability") <= 1
        scored_by = "latency" if meets else "availability"

    def score(name: str) -> float:
        if slo is None:
            return paths[name].score()
        return got[name].score(slo) if scored_by == "latency" else got[name].share(scored_by)

    top, top_windowed = score("oracle"), score("windowed oracle")
    rows = []
    demand = model.total_demand()

    def behind(path: Path, step: int) -> float:
        """How far ``path``'s reward trails the oracle's by the end of ``step``."""
        return float(paths["oracle"].cumulative[step] - path.cumulative[step]) / demand

    decided = {r.step: r for r in engine.restarts}
    optimal = {"oracle": best, "windowed oracle": windowed}
    for name in POLICIES:
        path = paths[name]
        found = episodes(model, path)
        done = [e.minutes for e in found if e.minutes is not None]
        row = Row(
            world=world.name,
            policy=name,
            score=path.score(),
            of_oracle=score(name) / top,
            restarts=len(path.restarts),
            outside=_outside(settings.policy, path.restarts),
            wrong=_wrong(world, path, settings.policy, decided if name == "vkvagent" else {}),
            kills=len(path.kills),
            delay_min=_median(done),
            missed=len(found) - len(done),
            cut_off=path.cut_off,
            in_flight=path.in_flight_lost / demand,
            short_day_one=behind(path, min(DAY_STEPS, model.steps) - 1),
            short_week=behind(path, model.steps - 1),
            of_windowed=score(name) / top_windowed,
            attainment={o: got[name].share(o) for o in targets.declared},
            spent={o: got[name].spent(targets, o) for o in targets.declared},
            slo_score=got[name].score(targets),
            scored_by=scored_by,
        )
        row.flagged = scored_by == "latency" and "availability" in row.missed_objectives()
        if slo is not None and name in optimal:
            row.bound = optimal[name].bound
        if name == "vkvagent":
            named = [d for d in (_detected(e, engine.detected) for e in found) if d is not None]
            row.detected_min = _median([float(d) for d in named])
            row.detected, row.degraded = len(named), len(found)
        rows.append(row)
    return rows, engine


def _minutes(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 90:
        return f"{value / 60:.1f} h"
    return f"{value:.0f} min"


def _share(value: float) -> str:
    """A share of the week's demand, in percent ("0" below what three decimals show)."""
    return "0" if abs(value) < 5e-6 else f"{value * 100:.3f} %"


def objective_names(slo: SloSettings) -> dict[str, str]:
    """Each declared objective's column head."""
    heads = {
        "availability": "availability",
        "ttft": f"TTFT <= {slo.ttft_seconds or 0:g} s",
        "itl": f"ITL <= {(slo.itl_seconds or 0) * 1000:g} ms",
    }
    return {o: heads[o] for o in slo.declared}


def _attainment(objective: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.5f}" if objective == "availability" else f"{value:.4f}"


def _meets(row: Row) -> str:
    missed = row.missed_objectives()
    return "no: " + ", ".join(missed) if missed else "yes"


def _of(value: float, flagged: bool) -> str:
    """A score over the oracle's, marked where the policy misses the availability objective."""
    return f"{value:.3f}{'*' if flagged else ''}"


def _notes(rows: Sequence[Row]) -> list[str]:
    """What the marks and the scores of ``rows`` need said under the table."""
    notes = []
    if any(r.flagged for r in rows):
        notes.append(
            "*: misses the availability objective; its score over the oracle's compares "
            "latency attainment alone."
        )
    if any(r.bound is not None for r in rows):
        notes.append(
            "The oracle's bound: no schedule that meets availability has more latency "
            "attainment than the oracle by more than this (the Lagrangian duality gap, at most)."
        )
    unmet = sorted({r.world for r in rows if r.scored_by == "availability"})
    if unmet:
        notes.append(
            f"No schedule meets availability in {', '.join(unmet)}: there the oracles have "
            "the most, and the score over the oracle's compares availability."
        )
    return ["", *notes] if notes else []


def table(rows: Sequence[Row], slo: SloSettings) -> str:
    """Every policy's row; the objective columns are ``slo``'s. The shortfall of goodput
    against the oracle's only where that is what the oracle optimises."""
    heads = objective_names(slo)
    spent = " / ".join(heads)
    shortfall = all(r.scored_by == "goodput" for r in rows)
    lines = [
        "| scenario | policy | goodput | "
        + " | ".join(heads.values())
        + f" | budget spent: {spent} | meets | of oracle | restarts | outside window | wrong "
        "| OOM kills | requests cut off | in-flight cost "
        + ("| short of oracle: day 1 / week " if shortfall else "")
        + "| degraded -> restart (median) | still degraded at end |",
        "|---" * (14 + shortfall + len(heads)) + "|",
    ]
    for r in rows:
        attainments = " | ".join(_attainment(o, r.attainment.get(o)) for o in heads)
        budgets = " / ".join(f"{r.spent[o]:.2f}" if o in r.spent else "-" for o in heads)
        short = f"| {_share(r.short_day_one)} / {_share(r.short_week)} " if shortfall else ""
        lines.append(
            f"| {r.world} | {r.policy} | {r.score:.4f} | {attainments} | {budgets} "
            f"| {_meets(r)} | {_of(r.of_oracle, r.flagged)} | {r.restarts} | "
            f"{r.outside} | {r.wrong} | {r.kills} | {r.cut_off:.0f} | {_share(r.in_flight)} "
            f"{short}| {_minutes(r.delay_min)} | {r.missed} |"
        )
    return "\n".join(lines + _notes(rows))


def summary(rows: Sequence[Row]) -> str:
    """Each scenario's scores over the oracle's; with an [slo], the oracles' duality bound."""
    worlds = list(dict.fromkeys(r.world for r in rows))
    bounds = any(r.bound is not None for r in rows)
    head = (
        "| scenario | "
        + " | ".join(POLICIES)
        + " | vkvagent of windowed oracle"
        + " | vkvagent names a fixable cause after (in degraded runs) |"
        + (" oracle's bound: oracle / windowed |" if bounds else "")
    )
    lines = [head, "|---" * (len(POLICIES) + 3 + bounds) + "|"]
    for w in worlds:
        mine = {r.policy: r for r in rows if r.world == w}
        cells = [_of(mine[p].of_oracle, mine[p].flagged) if p in mine else "-" for p in POLICIES]
        cells.append(
            _of(mine["vkvagent"].of_windowed, mine["vkvagent"].flagged)
            if "vkvagent" in mine
            else "-"
        )
        detected = "-"
        if "vkvagent" in mine and mine["vkvagent"].degraded:
            ours = mine["vkvagent"]
            detected = f"{_minutes(ours.detected_min)} ({ours.detected} of {ours.degraded})"
        if bounds:
            detected += " | " + " / ".join(
                f"{mine[p].bound:.4f}" if p in mine and mine[p].bound is not None else "-"
                for p in ("oracle", "windowed oracle")
            )
        lines.append(f"| {w} | " + " | ".join(cells) + f" | {detected} |")
    return "\n".join(lines + _notes(rows))


def restart_words(engine: EngineRun, policy: PolicySettings) -> str:
    """vkvagent's restarts: when, for what, and where its reason says it went (marked where
    nothing allowed it outside the windows)."""
    return (
        ", ".join(
            f"{when(r.step):%a %H:%M} {r.cause} ({r.words})"
            + (" [not allowed]" if unexplained(policy, r) else "")
            for r in engine.restarts
        )
        or "none"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", action="append", help="only these (repeatable)")
    parser.add_argument("--json", type=FilePath, help="also write the rows here")
    parser.add_argument("--seed", type=int, default=1, help="the samples' noise")
    parser.add_argument(
        "--no-variants", action="store_true", help="skip the slower and faster degradations"
    )
    parser.add_argument(
        "--slo",
        action="store_true",
        help="declare the [slo] of availability 0.999, TTFT <= 2 s for 95 %% and ITL <= 100 ms "
        'for 95 %%, with [policy] outside_windows = "when_cheaper": vkvagent decides by it, '
        "the oracles optimise it, and every policy is scored against it",
    )
    args = parser.parse_args(argv)
    every = (*WORLDS, *VARIANTS)
    worlds = [w for w in every if w.name in args.scenario] if args.scenario else list(WORLDS)
    if not args.scenario and not args.no_variants:
        worlds += VARIANTS
    if not worlds:
        parser.error(f"no such scenario (have: {', '.join(w.name for w in every)})")
    settings = vkvagent_settings(args.slo)
    targets = settings.slo if settings.slo.declared else BENCH_SLO
    words = "; ".join(targets.words(o) for o in targets.declared)
    if args.slo:
        print(f"Objective: the [slo] ({words}); vkvagent with outside_windows = when_cheaper.")
    else:
        print(f"Objective: quality-weighted goodput; no [slo]. The columns are against: {words}.")
    print()
    began = time.monotonic()
    window = window_mask(settings.policy, WEEK_STEPS)
    rows: list[Row] = []
    cpu: list[int] = []
    restarts: list[str] = []
    for world in worlds:
        t0 = time.monotonic()
        found, engine = score_world(world, settings, args.seed, window=window)
        rows += found
        cpu += engine.cpu_ns
        causes = ", ".join(f"{c} {m / 60:.1f} h" for c, m in sorted(engine.causes.items()))
        listed = restart_words(engine, settings.policy)
        restarts.append(f"- {world.name}: {listed}")
        verdicts = "".join(
            f"; flag change judged {verdict} ({ratio or 0:.2f}) {when(k):%a %H:%M}"
            for k, verdict, ratio in engine.verdicts
        )
        print(
            f"{world.name}: {time.monotonic() - t0:.0f} s; vkvagent named {causes or 'nothing'};"
            f" restarted {listed}{verdicts}",
            file=sys.stderr,
        )
    variants = {w.name for w in VARIANTS}
    main_rows = [r for r in rows if r.world not in variants]
    if main_rows:
        print(summary(main_rows))
        print()
        print(table(main_rows, targets))
        print()
    if len(main_rows) < len(rows):
        print(summary([r for r in rows if r.world in variants]))
        print()
    print("vkvagent's restarts: when, the cause, and where the reason says it went:")
    print("\n".join(restarts))
    print()
    cpu_ms = sorted(n / 1e6 for n in cpu)
    print(
        f"decide() CPU time per tick over {len(cpu_ms)} ticks: median "
        f"{statistics.median(cpu_ms):.3f} ms, p90 {cpu_ms[int(0.9 * len(cpu_ms))]:.3f} ms, "
        f"p99 {cpu_ms[int(0.99 * len(cpu_ms))]:.3f} ms"
    )
    print(f"whole run: {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps({"rows": [r.to_json() for r in rows]}, indent=1) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
