"""The world ``make bench-policy`` scores restart policies in: a fluid model of one vLLM server
over a simulated week, and the exact optimum of its objective (the oracle).

Everything is a deterministic function of the step ``k`` (one minute of world time) and the
uptime ``u`` (minutes since the vLLM process started), so the best restart schedule with full
knowledge of the future is a dynamic programme over (k, u), and any policy is scored from its
restart steps alone. bench/README.md defines the objective and the scenarios in words.

Per step: demand is the ServeGen week (``sim.workload.servegen_week``) scaled to
``Server.peak_rate`` requests/s, times the simulator's surge multiplier during surges. A
request asks for the Azure trace's mean output (generated tokens). Capacity follows the
simulator's engine model (``sim/capacity.py``): decode throughput ``s1 * speed * n ** 0.7`` with
``n`` running requests, ``n`` at most ``max_num_seqs`` and what the KV blocks hold (less the
leaked fraction of the ``kv-pressure`` scenario); when KV binds, preemption recomputes work, so
only ``kv_waste`` of it is goodput. Served = min(demand, capacity); nothing is served during a
cold start or a stall. Reward = served generated tokens x speed factor (the GPU's relative
speed: the uptime decline, thermal throttling, a world-time slowdown) x the clients' speed under
the flags in effect (1, but for the ``slow-flags`` scenario's new flags until rolled back).

A restart also pays for the requests in flight when it begins (``restart_cost``). Cut off (a
timer's ``systemctl restart`` of a vLLM that aborts on SIGTERM, an emergency, an OOM kill),
their tokens already streamed are wasted: half an answer each, on average. Drained (vLLM's
``--shutdown-timeout``), they finish, but nothing new is admitted until the longest of them is
done: the outage grows by that long. Every policy pays one or the other; the oracle the cheaper.

In the ``slow-flags`` scenario the operator changes vLLM's flags at a fixed step (a drained
restart that every policy gets, not one of its own), and the new flags make requests queue. A
restart keeps them; only a restart that rolls them back cures it. The state is then (k, u, the
flags in effect), and the oracle's programme has a layer for each.

The windowed oracle is the same programme with the schedule's own restarts allowed only at the
steps where a restart window is open (``window_mask``: vkvagent's default windows); OOM kills
and the operator's flag change still come when they come. Its score over the oracle's is the
cost of the windows alone; a policy's score over it, what the policy misses within them.

A scenario may also shift the ServeGen week in time (``demand_shift_h``), add the Azure trace's
minute-to-minute burstiness (``bursty``), make prompts longer from a world time on
(``prompt_shift``: a request then holds more KV blocks and takes longer to prefill), start the
week on a server that has been up for a while (``initial_uptime_h``), or vary the degradation's
onset from run to run (``onset_range_h``: a pseudo-random function of the step the run began
at, so the model stays a function of (k, u)).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from functools import cache
from pathlib import Path as FilePath
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from vkvagent.engine.policy import PolicySettings, window_state
from vkvagent.engine.slo import SloSettings
from vkvagent.sim.capacity import Scenario
from vkvagent.sim.server import SimOptions
from vkvagent.sim.workload import azure_sizes, servegen_week

Array = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]

STEP = 60.0  # seconds per step
DAY_STEPS = 1440
WEEK_STEPS = 7 * DAY_STEPS
COLD_STEPS = 3  # a restart costs a 3-minute cold start (vllm-facts.md: 90 s to 5 min)
START = datetime(2025, 3, 3, tzinfo=timezone.utc)  # a Monday, 00:00; ServeGen's t=0 is a midnight
GIB = float(1 << 30)
HOUR = 60  # steps


DRAIN_BUDGET = 120.0  # seconds a drain may take ([restart] drain_timeout)


@cache
def _trace_means() -> tuple[float, float]:
    sizes = azure_sizes()
    return (
        sum(p for p, _ in sizes) / len(sizes),
        sum(o for _, o in sizes) / len(sizes),
    )


@cache
def _longest_output() -> float:
    """The output a drain waits for: the 95th percentile of the trace's (its longest running
    request, of the few dozen in flight)."""
    outputs = sorted(o for _, o in azure_sizes())
    return float(outputs[int(0.95 * (len(outputs) - 1))])


# Requests a minute in the Azure conversation trace (AzureLLMInferenceTrace_conv.csv, its 58
# whole minutes; bench/README.md has the source): the ``bursty`` scenario's burstiness.
BURST_FILE = FilePath(__file__).with_name("azure-conv-per-minute.csv")
BURST_HALF_WINDOW = 30  # minutes either side: the rolling hourly mean a minute is compared with


@cache
def burst() -> tuple[float, ...]:
    """A demand multiplier per minute, mean 1: each minute's arrivals in the Azure trace over
    the mean of the hour around it (``BURST_HALF_WINDOW`` minutes either side, as much of it
    as the trace has), rescaled to a mean of exactly 1."""
    with BURST_FILE.open(encoding="utf-8", newline="") as f:
        counts = [float(row["requests"]) for row in csv.DictReader(f)]
    ratios = []
    for i, count in enumerate(counts):
        near = counts[max(0, i - BURST_HALF_WINDOW) : i + BURST_HALF_WINDOW + 1]
        ratios.append(count * len(near) / sum(near))
    mean = sum(ratios) / len(ratios)
    return tuple(r / mean for r in ratios)


def _unit_hash(n: npt.NDArray[np.int64]) -> Array:
    """A pseudo-random number in [0, 1) for each integer (splitmix64's finaliser): the same
    for the same integer on every platform and numpy version."""
    z = n.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    unit: Array = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return unit


@dataclass(frozen=True)
class Server:
    """One vLLM server (the simulator's Llama-3.1-8B on one 80 GB GPU) and its traffic."""

    single_stream: float = 110.0  # decode tokens/s of one request alone (sim capacity())
    max_num_seqs: int = 256
    kv_blocks: int = 10000  # sized tight: the fresh server runs at 70 % KV usage at peak
    block_size: int = 16
    peak_rate: float = 12.0  # requests/s in the busiest ServeGen window
    kv_waste: float = 0.9  # goodput left while KV binds (preempted requests recompute)
    patience: float = 60.0  # seconds a request waits before its client gives up
    prefill_speed: float = 13200.0  # prompt tokens/s (sim capacity(): 120 x single stream)
    prefix_hit: float = 0.3  # share of each prompt found in the prefix cache
    base_memory: float = 6 * GIB  # the unit's memory when fresh
    leak_per_request: float = float(SimOptions().leak_per_request)  # memory-growth scenario
    memory_max: float = 40 * GIB  # the unit's MemoryMax: the kernel OOM-kills vLLM there

    @property
    def prompt_tokens(self) -> float:
        return _trace_means()[0]

    @property
    def output_tokens(self) -> float:
        return _trace_means()[1]

    @property
    def blocks_per_request(self) -> float:
        """KV blocks a running request holds on average (its prompt and half its output)."""
        return (self.prompt_tokens + self.output_tokens / 2) / self.block_size


Span = tuple[float, float]  # (start, end) in hours after START


@dataclass(frozen=True)
class World:
    """One scenario: what degrades, when, and whether a restart cures it.

    ``uptime``: a simulator scenario whose effect follows the process's uptime (a restart
    cures it), with its onset and rates ``stretch`` times slower; ``onset_h`` overrides the
    onset (hours of uptime).
    ``hot``/``surges``: the simulator's thermal throttling and load surge, at these world
    times. ``hangs``: world times (hours) at which the engine hangs until it is restarted.
    ``slowdown``: (start hour, loss per hour, floor): the GPU slows with world time, with no
    throttle reason, and a restart does not cure it. ``memory_growth``: the unit's memory
    grows with every request served until the kernel OOM-kills vLLM. ``slow_flags``: (hour,
    clients' speed): the operator restarts vLLM with new flags at that world time, under which
    requests wait in the queue so that a client gets this fraction of the tokens/s it got
    before, at every load; the server still serves the whole demand. A restart keeps the new
    flags; a rollback (a restart with the old ones) cures it. ``quiet``: (first hour, last
    hour, demand multiplier, from): every day from the first hour of the day (UTC) to the
    last, the demand is that fraction of the ServeGen week's (idle nights), from world time
    ``from`` (hours) on. ``demand_shift_h``: the ServeGen week that many hours later (its
    hour h at world time h + shift: a host serving another continent). ``bursty``: the demand
    times the Azure trace's per-minute multiplier (``burst``), repeated. ``prompt_shift``:
    (hour, factor): from that world time on, prompts are ``factor`` times longer, at the same
    request rate and generated tokens per request. ``initial_uptime_h``: the process started
    this long before the week began (the default: it came up, its cold start over, at START).
    ``onset_range_h``: (lowest, highest): each run's onset of ``uptime``, in hours of uptime,
    drawn uniformly from this range by a pseudo-random function of the step the run began at
    (overrides ``onset_h``). ``peers_h``: a new host of a fleet group, whose peers ran the
    same server for this many hours before the week began (the same world, that much
    earlier): vkvagent starts with their cured runs and fresh baselines, as etcd hands them
    over (``bench.policy.peer_knowledge``)."""

    name: str
    summary: str
    uptime: str = "healthy"
    onset_h: float | None = None
    stretch: float = 1.0
    hot: tuple[Span, ...] = ()
    surges: tuple[Span, ...] = ()
    hangs: tuple[float, ...] = ()
    slowdown: tuple[float, float, float] | None = None
    memory_growth: bool = False
    slow_flags: tuple[float, float] | None = None
    quiet: tuple[float, float, float, float] | None = None
    demand_shift_h: float = 0.0
    bursty: bool = False
    prompt_shift: tuple[float, float] | None = None
    initial_uptime_h: float = 0.0
    onset_range_h: tuple[float, float] | None = None
    peers_h: float = 0.0
    wrong: bool = False  # any restart here is a wrong restart (nothing a restart cures)

    def __post_init__(self) -> None:
        # An OOM kill at the operator's step would need a third kind of forced restart.
        if self.slow_flags is not None and self.memory_growth:
            raise ValueError("World: slow_flags with memory_growth is not modelled")

    def uptime_effects(self, minutes: int) -> tuple[Array, Array]:
        """(speed factor, leaked KV fraction) for each uptime 0..minutes-1."""
        onset = None if self.onset_h is None else self.onset_h * 3600 / self.stretch
        scenario = Scenario(self.uptime, onset)
        seconds = [m * STEP / self.stretch for m in range(minutes)]
        speed = np.array([scenario.speed_factor(s) for s in seconds])
        leak = np.array([scenario.leaked_fraction(s) for s in seconds])
        return speed, leak


def slowed(name: str, stretch: float, label: str = "") -> World:
    """The simulator's uptime-driven scenario ``name`` with its onset and rates ``stretch``
    times slower (the simulator's are made for demos on a fast clock)."""
    if name == "uptime-decline":
        summary = (
            f"the simulator's uptime decline {stretch:g}x slower: stable {stretch:g} h, then "
            f"-{10 / stretch:.2g} %/h to 0.3; a restart cures it"
        )
    elif name == "kv-pressure":
        summary = (
            f"the simulator's KV leak {stretch:g}x slower: from {stretch / 2:g} h of uptime "
            f"{15 / stretch:.2g} % of the KV blocks an hour, up to 70 %; a restart cures it"
        )
    else:
        raise ValueError(f"slowed: no uptime-driven scenario {name!r}")
    return World(label or name, summary, uptime=name, stretch=stretch)


THROTTLED = Scenario("thermal-throttle", 0.0).speed_factor(0.0)  # 0.6
SURGE = Scenario("load-surge", 0.0).demand_multiplier(0.0)  # 3.0
SURGE_HOURS = 1.0  # the simulator's surge lasts an hour
# Clients' tokens/s per request under the slow flags: each request waits 3/7 of its decode time
# in the queue (a fluid model has no queue below capacity, so this is set, not derived).
SLOW_FLAGS_SPEED = 0.7
# Demand at night in idle-nights: a request every minute or so, far under one running.
IDLE_NIGHT = 0.01
# busy-window: the ServeGen week 7 h later, so that its busiest three hours of the day (19:00 to
# 22:00 on average over the week) fall in the default restart window, 02:00-05:00 UTC.
BUSY_SHIFT_H = 7.0
# prompt-shift: prompts this much longer (3,927 tokens against the trace's mean 1,155).
PROMPT_FACTOR = 3.4
INSTALLED_UPTIME_H = 20.0  # installed-degraded: the server's uptime when the week begins
ONSET_RANGE_H = (2.0, 10.0)  # varying-onset: each run's onset, uniformly in this range
NEW_HOST_FROM_H = 48.0  # new host Wed: it joins the group on Wednesday 00:00


def _at(day: int, hour: float) -> float:
    return day * 24 + hour


def _surge(day: int, hour: float) -> Span:
    return (_at(day, hour), _at(day, hour) + SURGE_HOURS)


# How fast the uptime-driven degradations go decides who wins; ``make bench-policy`` also
# scores these slower and faster variants (bench/README.md, "Sensitivity").
VARIANTS: tuple[World, ...] = (
    slowed("uptime-decline", 2.0, "uptime-decline 2x"),
    slowed("uptime-decline", 10.0, "uptime-decline 10x"),
    slowed("uptime-decline", 20.0, "uptime-decline 20x"),
    slowed("kv-pressure", 1.5, "kv-pressure 1.5x"),
    slowed("kv-pressure", 6.0, "kv-pressure 6x"),
    slowed("kv-pressure", 12.0, "kv-pressure 12x"),
    # The first night busy as usual: the first run learns its baselines (a run whose fresh
    # hours are all idle learns none), and the nights after it are idle.
    replace(
        slowed("uptime-decline", 5.0, "idle-nights from Tue"),
        summary="idle-nights, but Monday's night is busy as usual",
        quiet=(0.0, 7.0, IDLE_NIGHT, 24.0),
    ),
)

# World times (hours after Monday 00:00 UTC) chosen across the week, some inside the default
# restart window (daily 02:00-05:00 UTC), where a naive policy would restart for them.
WORLDS: tuple[World, ...] = (
    World("steady", "nothing degrades", wrong=True),
    slowed("uptime-decline", 5.0),
    slowed("kv-pressure", 3.0),
    World(
        "thermal-throttle",
        "speed 0.6 with thermal clock-event reasons: Mon 14-16, Tue 02:30-04:30, Wed 21-23, "
        "Fri 03-05, Sun 12-15",
        hot=(
            (_at(0, 14), _at(0, 16)),
            (_at(1, 2.5), _at(1, 4.5)),
            (_at(2, 21), _at(2, 23)),
            (_at(4, 3), _at(4, 5)),
            (_at(6, 12), _at(6, 15)),
        ),
        wrong=True,
    ),
    World(
        "load-surge",
        "demand x3 for an hour: Mon 11:00, Tue 03:00, Wed 16:00, Thu 02:00, Sat 20:00",
        surges=(_surge(0, 11), _surge(1, 3), _surge(2, 16), _surge(3, 2), _surge(5, 20)),
        wrong=True,
    ),
    World(
        "stall",
        "the engine hangs (no token; /health 200) until restarted: Mon 15:20, Wed 03:10, "
        "Thu 22:40, Sat 04:50, Sun 13:00",
        hangs=(
            _at(0, 15 + 1 / 3),
            _at(2, 3 + 1 / 6),
            _at(3, 22 + 2 / 3),
            _at(5, 4 + 5 / 6),
            _at(6, 13),
        ),
    ),
    World(
        "memory-growth",
        "64 KiB of unit memory per request served; OOM-killed at 40 GiB (about 36 h)",
        memory_growth=True,
    ),
    World(
        "uncured",
        "the GPU slows with world time from Tue 12:00, -1 %/h to 0.6, no throttle reason; a "
        "restart does not cure it",
        slowdown=(_at(1, 12), 0.01, 0.6),
        wrong=True,
    ),
    World(
        "slow-flags",
        "Wed 10:00 the operator restarts vLLM with new flags that make requests queue (a "
        "--max-num-seqs too low): clients get 0.7 of the speed; only a rollback cures it",
        slow_flags=(_at(2, 10), SLOW_FLAGS_SPEED),
        wrong=True,
    ),
    replace(
        slowed("uptime-decline", 5.0, "idle-nights"),
        summary="uptime-decline on a host whose nights are idle: demand x0.01 from 00:00 to "
        "07:00, so the restart window (02:00-05:00) has under 0.5 requests running",
        quiet=(0.0, 7.0, IDLE_NIGHT, 0.0),
    ),
    replace(
        slowed("uptime-decline", 5.0, "busy-window"),
        summary="uptime-decline on a host whose busiest hours are in the restart window: the "
        "ServeGen week 7 h later (its 19:00-22:00 at 02:00-05:00 UTC: clients at UTC-7)",
        demand_shift_h=BUSY_SHIFT_H,
    ),
    World(
        "prompt-shift",
        "from Wed 09:00 prompts are 3.4x longer, at the same requests/s and generated tokens "
        "per request: KV binds earlier, prefill takes longer; a restart does not help",
        prompt_shift=(_at(2, 9), PROMPT_FACTOR),
        wrong=True,
    ),
    replace(
        slowed("uptime-decline", 5.0, "installed-degraded"),
        summary="uptime-decline on a server already up for 20 h (speed 0.7) when the week "
        "begins: vkvagent is installed on it with an empty state",
        initial_uptime_h=INSTALLED_UPTIME_H,
    ),
    replace(
        slowed("uptime-decline", 5.0, "bursty"),
        summary="uptime-decline under the ServeGen week times the Azure trace's per-minute "
        "burstiness (arrivals over the hour's mean, repeated every 58 minutes)",
        bursty=True,
    ),
    replace(
        slowed("uptime-decline", 5.0, "varying-onset"),
        summary="uptime-decline whose onset varies from run to run: 2 to 10 h of uptime, "
        "pseudo-random by the run's first step",
        onset_range_h=ONSET_RANGE_H,
    ),
    replace(
        slowed("uptime-decline", 5.0, "new host Wed"),
        summary="uptime-decline on a new host of a fleet group, from a Wednesday (the "
        "ServeGen week 48 h on), its peer having run the same server on Monday and Tuesday",
        demand_shift_h=-NEW_HOST_FROM_H,
        peers_h=NEW_HOST_FROM_H,
    ),
)


@dataclass(frozen=True)
class Values:
    """The model at (step, uptime) pairs, as arrays (rates per second)."""

    rate: Array  # requests/s demanded
    demand: Array  # generated tokens/s demanded
    prompt: Array  # prompt tokens per request
    capacity: Array  # generated tokens/s the server could serve (were it working)
    served: Array  # generated tokens/s served
    reward: Array  # served x speed x flags
    speed: Array  # the GPU's relative speed
    flags: Array  # clients' relative speed under the flags in effect (1: the old flags)
    up: Mask  # the process answers (not in its cold start)
    stalled: Mask
    hot: Mask  # the GPU reports thermal throttling
    running: Array
    waiting: Array
    kv_usage: Array
    preemptions: Array  # per second
    itl: Array  # mean inter-token latency (s)
    ttft: Array  # mean time to first token (s)
    memory: Array  # the unit's memory (bytes)
    killed: Mask  # the kernel OOM-kills the process in this step


class RestartCost(NamedTuple):
    """What a restart costs (arrays, or scalars, like ``Values``)."""

    lost: Any  # reward: the tokens its cut-off requests had streamed, or the drain's demand
    cut_off: Any  # requests in flight it cut off
    refused: Any  # requests refused while it drained the ones in flight

    @property
    def unavailable(self) -> Any:
        """Requests it made unavailable, as an availability objective counts them."""
        return self.cut_off + self.refused


# The spread of requests' latency around the model's mean (lognormal sigma): TTFT per request,
# inter-token latency per output token. The histograms of the samples vkvagent reads
# (bench/policy.py's ``Synth``) have the same.
TTFT_SIGMA = 0.5
ITL_SIGMA = 0.3
# The standard normal CDF, from math.erf every 0.001 of z over +-9 (interpolated linearly: within
# 3e-8): numpy has no erf, and the oracle asks for it at millions of points.
Z_STEP = 0.001
Z_MAX = 9.0


@cache
def _normal_cdf() -> Array:
    z = np.arange(-round(Z_MAX / Z_STEP), round(Z_MAX / Z_STEP) + 1) * Z_STEP
    return np.array([0.5 * (1 + math.erf(x / math.sqrt(2))) for x in z])


def within(target: Any, mean: Any, sigma: float) -> Array:
    """The share of a lognormal with this ``mean`` and ``sigma`` at or below ``target``
    (arrays or scalars, broadcast)."""
    mean = np.maximum(np.asarray(mean, dtype=np.float64), 1e-300)
    z = (np.log(target) - np.log(mean)) / sigma + sigma / 2  # mu = log(mean) - sigma^2 / 2
    at = (np.clip(z, -Z_MAX, Z_MAX) + Z_MAX) / Z_STEP
    low = np.minimum(at.astype(np.int64), len(_normal_cdf()) - 2)
    cdf = _normal_cdf()
    share: Array = cdf[low] + (at - low) * (cdf[low + 1] - cdf[low])
    return share


@dataclass(frozen=True)
class Requests:
    """What the requests of some steps got (arrays, like ``Values``), as an SLO counts them."""

    demanded: Array  # requests
    tokens: Array  # the output tokens they asked for
    refused: Array  # requests refused: vLLM down (its cold start) or hung (it never answers)
    ttft_good: Array  # requests served whose first token came within the target
    itl_good: Array  # output tokens served within the target of the one before


class Model:
    """One world over ``steps`` minutes; ``evaluate(k, u)`` is the whole model."""

    def __init__(self, world: World, server: Server | None = None, steps: int = WEEK_STEPS):
        self.world, self.server, self.steps = world, server or Server(), steps
        s = self.server
        hours = np.arange(steps) * STEP / 3600
        curve = servegen_week(s.peak_rate)
        multiplier = np.ones(steps)
        for begin, end in world.surges:
            multiplier[(hours >= begin) & (hours < end)] = SURGE
        if world.quiet is not None:
            first, last, share, since = world.quiet
            night = (hours % 24 >= first) & (hours % 24 < last) & (hours >= since)
            multiplier[night] *= share
        if world.bursty:
            per_minute = np.array(burst())
            multiplier *= per_minute[np.arange(steps) % len(per_minute)]
        shift = world.demand_shift_h * 3600
        self.rate = np.array([curve(k * STEP - shift) for k in range(steps)]) * multiplier
        self.demand = self.rate * s.output_tokens
        self.prompt = np.full(steps, s.prompt_tokens)
        if world.prompt_shift is not None:
            at, factor = world.prompt_shift
            self.prompt[hours >= at] = s.prompt_tokens * factor
        self.hot = np.zeros(steps, dtype=bool)
        for begin, end in world.hot:
            self.hot[(hours >= begin) & (hours < end)] = True
        self.world_speed = np.where(self.hot, THROTTLED, 1.0)
        if world.slowdown is not None:
            begin, per_hour, floor = world.slowdown
            self.world_speed *= np.clip(1 - per_hour * (hours - begin), floor, 1.0)
        # The latest hang at or before each step (-inf: none yet).
        self.hang = np.full(steps, -np.inf)
        for at in sorted(world.hangs):
            self.hang[hours >= at] = math.floor(at * 60)
        # Requests demanded before each step, for the memory growth.
        self.requests = np.concatenate(([0.0], np.cumsum(self.rate * STEP)))
        # The uptime of the week's first step: a process that came up (its cold start over)
        # at START, or started ``initial_uptime_h`` before it.
        self.first_uptime = max(COLD_STEPS, round(world.initial_uptime_h * 60))
        self.uptimes = steps + self.first_uptime + 2
        # With an onset per run, the effects of an onset at uptime 0, shifted by the run's.
        self.onsets: npt.NDArray[np.int64] | None = None
        if world.onset_range_h is not None:
            lowest, highest = world.onset_range_h
            began = np.arange(-self.first_uptime, steps + 1, dtype=np.int64)
            hours_in = lowest + (highest - lowest) * _unit_hash(began)
            self.onsets = np.round(hours_in * 60).astype(np.int64)
            world = replace(world, onset_h=0.0)
        self.up_speed, self.leak = world.uptime_effects(self.uptimes)
        # The step at which the operator applies the slow flags (None: never).
        self.flag_step: int | None = None
        self.flag_speed = 1.0
        if world.slow_flags is not None:
            self.flag_step = round(world.slow_flags[0] * 60)
            self.flag_speed = world.slow_flags[1]

    def evaluate(self, k: Any, u: Any, slow: Any = False) -> Values:
        """The model at steps ``k`` with uptimes ``u``, and ``slow`` where the slow flags are
        in effect (arrays or scalars, broadcast)."""
        s = self.server
        k = np.asarray(k, dtype=np.int64)
        u = np.asarray(u, dtype=np.int64)
        k, u, slow = np.broadcast_arrays(k, u, np.asarray(slow, dtype=bool))
        rate, demand, prompt = self.rate[k], self.demand[k], self.prompt[k]
        up = u >= COLD_STEPS
        stalled = up & (k - u < self.hang[k])
        # Uptime since the run's onset began (the onset's own uptime where it varies).
        since = u if self.onsets is None else np.maximum(0, u - self.onset(k - u))
        speed = self.up_speed[since] * self.world_speed[k]
        leak = self.leak[since]
        # KV blocks a running request holds (its prompt and half its output): the same float
        # as ``Server.blocks_per_request`` while prompts keep the trace's mean.
        blocks = (prompt + s.output_tokens / 2) / s.block_size
        n_kv = s.kv_blocks * (1 - leak) / blocks
        n_max = np.minimum(float(s.max_num_seqs), n_kv)
        need = (demand / (s.single_stream * speed)) ** (1 / 0.7)
        kv_bound = (need > n_kv) & (n_kv < s.max_num_seqs)
        capacity = s.single_stream * speed * n_max**0.7 * np.where(kv_bound, s.kv_waste, 1.0)
        working = up & ~stalled
        served = np.where(working, np.minimum(demand, capacity), 0.0)
        running = np.where(up, np.minimum(need, n_max), 0.0)
        finished = served / s.output_tokens
        # Slow flags: every request also waits (1 / flags - 1) of its decode time (Little's
        # law), so tokens/s per request in the system is ``flags`` of the old flags'. With the
        # old flags, + 0.0: the other scenarios' values are unchanged to the bit.
        flags = np.where(slow, self.flag_speed, 1.0)
        queued = running * (1 / flags - 1)
        waiting = np.where(up, np.maximum(0.0, rate - finished) * s.patience + queued, 0.0)
        used = running * blocks + leak * s.kv_blocks
        kv_usage = np.where(up, np.minimum(1.0, used / s.kv_blocks), 0.0)
        preemptions = np.where(working & kv_bound, finished * np.minimum(1.0, need / n_kv - 1), 0.0)
        per_request = s.single_stream * speed * np.maximum(running, 1.0) ** -0.3
        prefill = prompt * (1 - s.prefix_hit) / (s.prefill_speed * speed)
        ttft = prefill * (1 + running / 32) + waiting / np.maximum(rate, 1e-9)
        if self.world.memory_growth:
            began = np.clip(k - u + COLD_STEPS, 0, k)
            memory = s.base_memory + s.leak_per_request * (self.requests[k] - self.requests[began])
            memory = np.where(up, memory, s.base_memory)
        else:
            memory = np.full(k.shape, s.base_memory)
        return Values(
            rate=rate,
            demand=demand,
            prompt=prompt,
            capacity=capacity,
            served=served,
            reward=served * speed * flags,
            speed=speed,
            flags=flags,
            up=up,
            stalled=stalled,
            hot=self.hot[k],
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            preemptions=preemptions,
            itl=1 / per_request,
            ttft=ttft,
            memory=memory,
            killed=memory >= s.memory_max,
        )

    def onset(self, began: Any) -> Any:
        """The uptime (minutes) at which the degradation of a run that began at step ``began``
        sets in, where it varies from run to run (``World.onset_range_h``)."""
        assert self.onsets is not None
        return self.onsets[np.asarray(began, dtype=np.int64) + self.first_uptime]

    def total_demand(self) -> float:
        return float(self.demand.sum() * STEP)

    def restart_cost(self, values: Values, drained: Any) -> RestartCost:
        """What a restart that finds ``values`` (arrays, or scalars) costs: its requests in
        flight cut off, or ``drained`` (where the engine works: a stalled one cannot finish
        them, so they are cut off whatever was asked)."""
        s = self.server
        working = values.up & ~values.stalled
        drained = np.asarray(drained) & working
        cut_off = np.where(values.up & ~drained, values.running, 0.0)
        wasted = cut_off * s.output_tokens / 2 * values.speed * values.flags
        drain_seconds = np.minimum(DRAIN_BUDGET, _longest_output() * values.itl)
        refused = np.where(
            drained, values.demand * drain_seconds * values.speed * values.flags, 0.0
        )
        return RestartCost(
            wasted + refused, cut_off, np.where(drained, values.rate * drain_seconds, 0.0)
        )

    def events(self, values: Values, slo: SloSettings) -> Requests:
        """What the requests of the steps of ``values`` got, against ``slo``'s latency targets
        (an undeclared one: nothing good). A request's TTFT, and an output token's inter-token
        latency, are lognormal around the step's mean (``TTFT_SIGMA``, ``ITL_SIGMA``); what
        was demanded beyond capacity waited, and missed both."""
        working = values.up & ~values.stalled
        demanded = values.rate * STEP
        served = values.served * STEP  # tokens
        ttft = itl = np.zeros(np.shape(demanded))
        if slo.ttft_seconds is not None:
            within_ttft = within(slo.ttft_seconds, values.ttft, TTFT_SIGMA)
            ttft = served / self.server.output_tokens * within_ttft
        if slo.itl_seconds is not None:
            itl = served * within(slo.itl_seconds, values.itl, ITL_SIGMA)
        return Requests(
            demanded=demanded,
            tokens=values.demand * STEP,
            refused=np.where(working, 0.0, demanded),
            ttft_good=ttft,
            itl_good=itl,
        )


# -- walking a schedule ------------------------------------------------------------------------


class Path:
    """A run through the model, one step at a time: restart at a step (a cold start begins
    there), or continue. The kernel's OOM kill restarts the process whatever the policy says,
    and so does the operator's flag change (``slow_flags``). The first step finds a server
    that has just come up (or started ``World.initial_uptime_h`` before). A restart left to
    choose (``advance``'s ``drained`` None) drains or cuts off whichever loses less reward, or
    with ``slo`` whichever makes fewer requests unavailable (the SLO oracle's choice)."""

    def __init__(self, model: Model, slo: bool = False) -> None:
        self.model, self.slo = model, slo
        self.k = 0  # the next step
        self.u = model.first_uptime - 1  # the uptime of the step before
        self.reward = 0.0
        self.restarts: list[int] = []  # steps at which a restart (by the policy) began
        self.kills: list[int] = []  # steps at which an OOM kill restarted the process
        self.applied: list[int] = []  # steps at which the operator's flag change restarted it
        self.rollbacks: list[int] = []  # the restarts that put the old flags back
        self.slow = False  # the slow flags are in effect
        self.served = np.zeros(model.steps)
        self.cumulative = np.zeros(model.steps)  # per step: the reward up to its end
        self.uptime = np.zeros(model.steps, dtype=np.int64)
        self.slowed = np.zeros(model.steps, dtype=bool)  # per step: the slow flags in effect
        self.cut_off = 0.0  # requests in flight that restarts and kills cut off
        self.refused = 0.0  # requests refused while its restarts drained
        self.in_flight_lost = 0.0  # reward their restarts lost to the requests in flight

    def advance(
        self, restart: bool = False, drained: bool | None = False, rollback: bool = False
    ) -> Values:
        """Step ``k``: restart at its start, or continue; returns the step's values. A
        restart cuts its requests in flight off, or is ``drained``; None: whichever costs
        less (the oracle's choice). A restart with ``rollback`` puts the old flags back."""
        k, u = self.k, self.u + 1
        values = self.model.evaluate(k, u, self.slow)
        if bool(values.killed):
            self.kills.append(k)
            self._pay(values, False)
            u = 0
        elif k == self.model.flag_step:
            # The operator's `vkvagent apply`: a drained restart with the new flags, the same
            # for every policy and none of its own (a restart it asked for here is this one).
            self.applied.append(k)
            self._pay(values, True)
            u, self.slow = 0, True
        elif restart:
            self.restarts.append(k)
            self._pay(values, drained)
            u = 0
            if rollback and self.slow:
                self.rollbacks.append(k)
                self.slow = False
        if u == 0:
            values = self.model.evaluate(k, u, self.slow)
        self.reward += float(values.reward) * STEP
        self.cumulative[k] = self.reward
        self.served[k] = float(values.served)
        self.uptime[k] = u
        self.slowed[k] = self.slow
        self.k, self.u = k + 1, u
        return values

    def _pay(self, values: Values, drained: bool | None) -> None:
        costs = [
            self.model.restart_cost(values, d)
            for d in ((False, True) if drained is None else (drained,))
        ]
        cost = min(costs, key=lambda c: float(c.unavailable) if self.slo else float(c.lost))
        self.reward -= float(cost.lost)
        self.in_flight_lost += float(cost.lost)
        self.cut_off += float(cost.cut_off)
        self.refused += float(cost.refused)

    def score(self) -> float:
        """Quality-weighted goodput: reward over the tokens demanded, all week."""
        return self.reward / self.model.total_demand()


def walk(
    model: Model,
    restarts: Sequence[int] | Callable[[Path], bool],
    drained: bool | None = False,
    rollbacks: Sequence[int] = (),
    slo: bool = False,
) -> Path:
    """The path of a fixed schedule (restart steps, of which ``rollbacks`` put the old flags
    back) or of a policy asked at every step (it never rolls back), each restart ``drained``
    or not (``Path.advance``; ``slo``: how it chooses)."""
    path = Path(model, slo)
    wanted = set(restarts) if not callable(restarts) else None
    back = set(rollbacks)
    while path.k < model.steps:
        if wanted is not None:
            path.advance(path.k in wanted, drained, path.k in back)
        else:
            assert callable(restarts)
            path.advance(restarts(path), drained)
    return path


# -- a week against an SLO ---------------------------------------------------------------------


@dataclass(frozen=True)
class Attainment:
    """A path's week against an SLO's targets: its events, good and all, per objective. An
    unavailable request misses availability: refused while vLLM was down or hung, cut off by a
    restart or refused while it drained. Latency is counted over the requests that were not
    refused while down or hung. The fluid model serves every other step's demand whole, so
    the requests a restart cut off or refused in its drain count in latency as the step
    before it served them, and against availability on top."""

    requests: float  # demanded
    unavailable: float
    ttft_good: float
    ttft_all: float
    itl_good: float
    itl_all: float

    def share(self, objective: str) -> float:
        """The share of ``objective``'s events that were good (its attainment)."""
        if objective == "availability":
            return 1 - self.unavailable / self.requests
        if objective == "ttft":
            return self.ttft_good / self.ttft_all
        return self.itl_good / self.itl_all

    def spent(self, slo: SloSettings, objective: str) -> float:
        """The share of ``objective``'s error budget (its bad events allowed: 1 - target of the
        week's events) that the bad events spent; above 1, the objective is missed."""
        return (1 - self.share(objective)) / (1 - slo.target(objective))

    def score(self, slo: SloSettings) -> float:
        """The mean of the declared latency objectives' attainments (availability's, where
        none is declared)."""
        latency = [o for o in slo.declared if o != "availability"] or ["availability"]
        return sum(self.share(o) for o in latency) / len(latency)


def attained(model: Model, path: Path, slo: SloSettings) -> Attainment:
    """What ``path``'s week attained against ``slo``'s targets."""
    k = np.arange(model.steps)
    got = model.events(model.evaluate(k, path.uptime, path.slowed), slo)
    refused = float(got.refused.sum())
    requests = float(got.demanded.sum())
    return Attainment(
        requests=requests,
        unavailable=refused + path.refused + path.cut_off,
        ttft_good=float(got.ttft_good.sum()),
        ttft_all=requests - refused,
        itl_good=float(got.itl_good.sum()),
        itl_all=float(got.tokens.sum()) - refused * model.server.output_tokens,
    )


# -- the oracle --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimum:
    value: float  # the programme's best: reward (token x speed), or with an SLO its Lagrangian
    restarts: tuple[int, ...]  # the steps the best schedule restarts at
    rollbacks: tuple[int, ...] = ()  # those of them that put the old flags back
    price: float = 0.0  # with an SLO: lambda, the availability budget's price it was found at
    unavailable: float = 0.0  # with an SLO: the requests its schedule makes unavailable
    # With an SLO: how much more latency attainment (the mean of the objectives') a schedule
    # that meets availability may have, at most: the duality gap's bound (``slo_optima``).
    bound: float = 0.0

    def score(self, model: Model) -> float:
        return self.value / model.total_demand()


def window_mask(policy: PolicySettings, steps: int) -> Mask:
    """Per step: whether one of ``policy``'s restart windows is open at its start
    (``window_state``, as the engine and the report's "outside window" read them)."""
    return np.array([window_state(policy, when(k))[0] for k in range(steps)], dtype=bool)


class Prices(Protocol):
    """An objective, as the dynamic programme reads it: per step ``k`` and arriving uptime
    0..n-1, rows (one per schedule sought; or one for all) of the step's reward, and of what
    a restart there costs."""

    def step(self, k: int, n: int, slow: bool) -> tuple[Array, Array, Mask]:
        """The step's reward at uptimes 0..n-1 (the slow flags in effect or not), what a
        restart that arrives at each costs (an OOM kill's: cut off), and where the kernel
        OOM-kills the process."""

    def applied(self, k: int, n: int) -> Array:
        """What the operator's flag change at step ``k`` (a drained restart) costs."""


@dataclass(frozen=True)
class Schedule:
    """One row's best schedule, followed from step 0: its own restarts (not the OOM kills),
    the rollbacks among them, and the uptime of each step (0: a restart began there)."""

    restarts: tuple[int, ...]
    rollbacks: tuple[int, ...]
    uptime: npt.NDArray[np.int64]


def programme(
    model: Model, prices: Prices, allowed: Sequence[Mask | None]
) -> tuple[Array, list[Schedule]]:
    """The best schedule of each row of ``prices``, with full knowledge of the future, by
    dynamic programming; its restarts begin only where its row of ``allowed`` is true (None:
    anywhere). OOM kills and the operator's flag change come when they come. Returns each
    row's best value and schedule.

    ``A[k][v]``: the best value from step ``k`` on, arriving with uptime ``v`` (the previous
    step's plus one); the choice at ``k`` is to keep ``v`` or restart (uptime 0, less the
    restart's cost), unless the process is OOM-killed at ``v``. Uptimes beyond ``k`` plus the
    first step's cannot be reached by step ``k``, so each step's vector is only as long as
    that. Ties keep the process running, and keep the flags.

    Where the operator applies the slow flags (``Model.flag_step``), the programme has two
    layers from there: ``new`` (the slow flags in effect) and ``old`` (rolled back). A restart
    in ``new`` either keeps the flags or rolls them back, at the same cost; in ``old`` it keeps
    them (the operator does not apply them again). ``World`` refuses OOM kills there."""
    rows, steps, first, change = len(allowed), model.steps, model.first_uptime, model.flag_step
    free = np.array([np.ones(steps, dtype=bool) if m is None else m[:steps] for m in allowed])
    old = np.zeros((rows, steps + first + 1))  # A[steps][v] = 0
    new = np.zeros((rows, steps + first + 1))
    # Per step (reversed until the end): restart bits per row in old, and in new; whether a
    # restart in new rolls back (per row: the same for every uptime, as the cost is).
    bits_old: list[npt.NDArray[np.uint8] | None] = []
    bits_new: list[npt.NDArray[np.uint8] | None] = []
    backs: list[Mask | None] = []
    for k in range(steps - 1, -1, -1):
        n = k + first + 1
        if k == change:
            reward, _, _ = prices.step(k, 1, True)  # the step in new, fresh
            old = reward + new[:, 1:2] - prices.applied(k, n)
            bits_old.append(None)
            bits_new.append(None)
            backs.append(None)
            continue
        reward, cost, killed = prices.step(k, n, False)
        keep = reward + old[:, 1 : n + 1]
        restarted = keep[:, :1] - cost
        restart = ((restarted > keep) & free[:, k : k + 1]) | killed
        bits_old.append(np.packbits(restart, axis=1))
        if change is not None and k > change:
            reward, cost, _ = prices.step(k, n, True)
            keep_new = reward + new[:, 1 : n + 1]
            back = keep[:, 0] > keep_new[:, 0]
            restarted_new = np.where(back, keep[:, 0], keep_new[:, 0])[:, None] - cost
            restart_new = (restarted_new > keep_new) & free[:, k : k + 1]
            new = np.where(restart_new, restarted_new, keep_new)
            bits_new.append(np.packbits(restart_new, axis=1))
            backs.append(back)
        else:
            bits_new.append(None)
            backs.append(None)
        old = np.where(restart, restarted, keep)
    bits_old.reverse()
    bits_new.reverse()
    backs.reverse()
    schedules = []
    for row in range(rows):
        restarts, rollbacks = [], []
        uptime = np.zeros(steps, dtype=np.int64)
        v, slow = first, False
        for k in range(steps):
            if k == change:
                v, slow = 0, True
            else:
                bits = bits_new[k] if slow else bits_old[k]
                assert bits is not None
                if np.unpackbits(bits[row], count=k + first + 1)[v]:
                    if slow or not bool(model.evaluate(k, v).killed):
                        restarts.append(k)
                    rolled = backs[k]
                    if slow and rolled is not None and bool(rolled[row]):
                        rollbacks.append(k)
                        slow = False
                    v = 0
            uptime[k] = v
            v += 1
        schedules.append(Schedule(tuple(restarts), tuple(rollbacks), uptime))
    return old[:, first], schedules


class Goodput:
    """Quality-weighted goodput's prices: a step's reward, and a restart's cost, drained or
    cut off as loses less (an OOM kill's: cut off); one row for every schedule."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def step(self, k: int, n: int, slow: bool) -> tuple[Array, Array, Mask]:
        values = self.model.evaluate(k, np.arange(n), slow)
        cut = self.model.restart_cost(values, False).lost
        drained = self.model.restart_cost(values, True).lost
        return (
            values.reward * STEP,
            np.where(values.killed, cut, np.minimum(cut, drained)),
            values.killed,
        )

    def applied(self, k: int, n: int) -> Array:
        cost: Array = self.model.restart_cost(self.model.evaluate(k, np.arange(n)), True).lost
        return cost


def oracle(model: Model, allowed: Mask | None = None) -> Optimum:
    """The best schedule for quality-weighted goodput, with full knowledge of the future
    (``programme``); with ``allowed``, the best whose own restarts all begin at steps where it
    is true (the windowed oracle)."""
    return optima(model, (allowed,))[0]


def optima(model: Model, masks: Sequence[Mask | None]) -> list[Optimum]:
    """``oracle`` for each of ``masks`` (None: unrestricted), in one pass over the model."""
    values, schedules = programme(model, Goodput(model), masks)
    return [Optimum(float(v), s.restarts, s.rollbacks) for v, s in zip(values, schedules)]


class SloPrices:
    """An SLO's prices, a Lagrangian relaxation of "meet availability, then the most latency
    attainment": per step, the declared latency objectives' good events, each over its week's
    demand (requests for TTFT, output tokens for ITL), less ``price`` (lambda, per row) x the
    requests made unavailable over the availability budget ((1 - target) x the week's
    requests). A request refused while vLLM is down or hung leaves the latency objectives'
    denominators: the programme counts it in latency as one at ``attainment`` would (per row
    and objective; Dinkelbach's linearisation of the attainment's ratio). A restart drains or
    cuts off whichever makes fewer requests unavailable (an OOM kill: cut off). The programme
    runs once per price, so what does not depend on it is worked out once, per (k, u)."""

    def __init__(self, model: Model, slo: SloSettings) -> None:
        self.model = model
        self.requests = model.rate * STEP
        total = float(self.requests.sum())
        self.budget = math.inf if slo.availability is None else (1 - slo.availability) * total
        tokens = float(model.demand.sum() * STEP)
        ttft = 0.0 if slo.ttft_seconds is None else 1 / total
        itl = 0.0 if slo.itl_seconds is None else 1 / tokens
        self.weights = (ttft, itl * model.server.output_tokens)  # per request
        self.good: list[Array] = []  # per step: the weighted good events at each uptime
        self.good_slow: dict[int, Array] = {}  # the same with the slow flags in effect
        self.unavailable: list[Array] = []  # per step: what a restart makes unavailable
        self.killed: list[Mask] = []
        for k in range(model.steps):
            u = np.arange(k + model.first_uptime + 1)
            values = model.evaluate(k, u)
            got = model.events(values, slo)
            self.good.append(ttft * got.ttft_good + itl * got.itl_good)
            cut, drained = (model.restart_cost(values, d) for d in (False, True))
            fewer = np.minimum(cut.unavailable, drained.unavailable)
            self.unavailable.append(np.where(values.killed, cut.unavailable, fewer))
            self.killed.append(values.killed)
            if model.flag_step is not None and k >= model.flag_step:
                got = model.events(model.evaluate(k, u, True), slo)
                self.good_slow[k] = ttft * got.ttft_good + itl * got.itl_good
        self.price = np.zeros(1)
        self.refund = np.zeros(1)

    def set(self, price: Sequence[float], attainment: Sequence[tuple[float, float]]) -> None:
        """The rows: each one's price, and the (TTFT, ITL) attainment at which it counts a
        refused request."""
        ttft, itl = self.weights
        self.price = np.array(price, dtype=np.float64)
        self.refund = np.array([a * ttft + b * itl for a, b in attainment])

    def step(self, k: int, n: int, slow: bool) -> tuple[Array, Array, Mask]:
        good = self.good_slow[k] if slow else self.good[k]
        price = (self.price / self.budget)[:, None]
        reward = np.repeat(good[None, :n], len(self.price), axis=0)
        refused = self.requests[k] * (self.refund[:, None] - price)
        reward[:, :COLD_STEPS] += refused
        hung = self.model.hang[k]
        if hung > -math.inf:  # the runs begun before the hang are stalled
            reward[:, max(COLD_STEPS, k - int(hung) + 1) :] += refused
        return reward, self.unavailable[k][:n] * price, self.killed[k][:n]

    def applied(self, k: int, n: int) -> Array:
        cost = self.model.restart_cost(self.model.evaluate(k, np.arange(n)), True)
        out: Array = cost.unavailable * (self.price / self.budget)[:, None]
        return out

    def spent(self, schedule: Schedule) -> float:
        """The requests ``schedule`` makes unavailable: refused while down or hung, and by
        its restarts (and the OOM kills, and the operator's drained flag change)."""
        model, u = self.model, schedule.uptime
        k = np.arange(model.steps)
        down = (u < COLD_STEPS) | (k - u < model.hang[k])
        total = float(self.requests[down].sum())
        arriving = np.concatenate(([model.first_uptime], u[:-1] + 1))
        for step in np.flatnonzero(u == 0):
            v = int(arriving[step])
            if step == model.flag_step:
                total += float(model.restart_cost(model.evaluate(step, v), True).unavailable)
            else:
                total += float(self.unavailable[step][v])
        return total


# The availability budget's price (lambda), in latency attainment per budget: tried first once
# 0 spends too much, the factor it moves by to bracket the cheapest price that keeps within the
# budget, the most it is raised to (beyond it the schedule with the fewest unavailable
# requests), the least it is lowered to (below it, what the budget left unused could buy is
# under a ten-thousandth of attainment: the bound in ``slo_optima``), and how narrow the
# bisection leaves the bracket.
PRICE_FIRST = 0.1
PRICE_FACTOR = 10.0
PRICE_MOST = 1e6
PRICE_LEAST = 1e-4
PRICE_RATIO = 1.02


class Trial(NamedTuple):
    price: float
    unavailable: float
    optimum: Optimum


def cheapest(budget: float, start: float, factor: float) -> Generator[float, Trial, Trial]:
    """The search for the smallest price whose schedule keeps within ``budget``: it yields the
    prices to try and is sent each one's trial. From ``start`` (0: first 0, then
    ``PRICE_FIRST``, by ``PRICE_FACTOR``) down or up by ``factor`` to bracket that price, then
    bisected (in log) until the bracket is ``PRICE_RATIO`` wide; the trial at its top is the
    result. Where no price up to ``PRICE_MOST`` keeps within the budget, the trial at that
    price."""
    if start == 0:
        trial = yield 0.0
        if trial.unavailable <= budget:
            return trial
        start, factor = PRICE_FIRST, PRICE_FACTOR
    trial = yield start
    low: float | None = None
    high: Trial | None = None
    while high is None:
        if trial.unavailable <= budget:
            high = trial
        elif trial.price >= PRICE_MOST:
            return trial
        else:
            low = trial.price
            trial = yield trial.price * factor
    while low is None:
        if high.price <= PRICE_LEAST:
            return high
        trial = yield high.price / factor
        if trial.unavailable <= budget:
            high = trial
        else:
            low = trial.price
    while high.price / low > PRICE_RATIO:
        trial = yield math.sqrt(low * high.price)
        if trial.unavailable <= budget:
            high = trial
        else:
            low = trial.price
    return high


# Dinkelbach's rounds, at most: each counts a refused request at the attainment of the last
# round's schedule (the first at the declared shares), and searches again from its price, by
# this factor, until the schedule stays the same.
ROUNDS = 4
ROUND_FACTOR = 1.25


def slo_optima(model: Model, slo: SloSettings, masks: Sequence[Mask | None]) -> list[Optimum]:
    """The best schedule for ``slo`` for each of ``masks`` (None: unrestricted; else the
    windowed oracle's), with full knowledge of the future: the one that meets availability
    and, within that, attains the most latency (the mean of the declared latency objectives'
    attainments), or with the most availability where no schedule meets it.

    The programme of ``SloPrices`` at the cheapest price of the availability budget that
    keeps its schedule within it (``cheapest``, every mask's search in the same passes), over
    Dinkelbach's ``ROUNDS``. A Lagrangian relaxation: a schedule that no price makes optimal
    (one inside the duality gap) is not found; nor, the attainments being ratios, may one
    that no round's linearisation does. In the last round's linearisation, no schedule that
    meets availability is better by more than the price x the share of the budget the
    schedule found leaves unused (``Optimum.bound``, over the latency objectives: their
    mean)."""
    prices = SloPrices(model, slo)
    latency = len([o for o in slo.declared if o != "availability"]) or 1
    rows = len(masks)
    attainment = [(slo.ttft_share, slo.itl_share)] * rows
    found: list[Trial | None] = [None] * rows
    for _ in range(ROUNDS):
        searches = [
            cheapest(prices.budget, 0.0 if f is None else f.price, ROUND_FACTOR) for f in found
        ]
        asks = [next(search) for search in searches]
        done: list[Trial | None] = [None] * rows
        while None in done:
            active = [i for i, d in enumerate(done) if d is None]
            prices.set([asks[i] for i in active], [attainment[i] for i in active])
            values, schedules = programme(model, prices, [masks[i] for i in active])
            for i, value, schedule in zip(active, values, schedules):
                spent = prices.spent(schedule)
                optimum = Optimum(
                    float(value), schedule.restarts, schedule.rollbacks, asks[i], spent
                )
                try:
                    asks[i] = searches[i].send(Trial(asks[i], spent, optimum))
                except StopIteration as stop:
                    done[i] = stop.value
        settled = all(
            f is not None and d is not None and f.optimum.restarts == d.optimum.restarts
            for f, d in zip(found, done)
        )
        found = done
        if settled:
            break
        for i, trial in enumerate(done):
            assert trial is not None
            path = walk(model, trial.optimum.restarts, None, trial.optimum.rollbacks, slo=True)
            got = attained(model, path, slo)
            attainment[i] = (got.share("ttft"), got.share("itl"))
    return [
        replace(f.optimum, bound=f.price * max(0.0, 1 - f.unavailable / prices.budget) / latency)
        for f in found
        if f is not None
    ]


# -- ground truth for the report ---------------------------------------------------------------

ONSET_LOSS = 0.05  # a run is degraded once a restart would win back 5 % of the demand


@dataclass(frozen=True)
class Episode:
    """A run that became degraded: the step a fresh server would first have earned
    ``ONSET_LOSS`` of the demand more, and the step of the restart (or OOM kill) that ended the
    run; None when the week ended first."""

    onset: int
    end: int | None

    @property
    def minutes(self) -> float | None:
        return None if self.end is None else float(self.end - self.onset)


def curable(model: Model, path: Path) -> npt.NDArray[np.float64]:
    """Per step: how much more (a share of the demand) a server that had just come up, and
    had not hung, would have earned than the path's server: what a restart would win back
    (with the old flags: a rollback, where the slow flags are in effect)."""
    k = np.arange(model.steps)
    now = model.evaluate(k, path.uptime, path.slowed)
    fresh = model.evaluate(k, np.full(model.steps, COLD_STEPS))
    fresh_reward = np.minimum(fresh.demand, fresh.capacity) * fresh.speed
    loss = (fresh_reward - now.reward) / np.maximum(now.demand, 1e-9)
    return np.where(now.up & (now.demand > 0), loss, 0.0)


def episodes(model: Model, path: Path) -> list[Episode]:
    """The degraded runs of a path, in order. A restart that left the slow flags in effect
    (not a rollback) ends nothing: the same flags, the same slowness."""
    degraded = curable(model, path) >= ONSET_LOSS
    ends = {k for k in (*path.restarts, *path.kills) if not path.slowed[k]}
    out: list[Episode] = []
    onset: int | None = None
    for k in range(model.steps):
        if k in ends and onset is not None:
            out.append(Episode(onset, k))
            onset = None
        if onset is None and degraded[k]:
            onset = k
    if onset is not None:
        out.append(Episode(onset, None))
    return out


def when(step: float) -> datetime:
    return START + timedelta(seconds=step * STEP)
