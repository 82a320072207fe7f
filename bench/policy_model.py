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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from functools import cache
from pathlib import Path as FilePath
from typing import Any

import numpy as np
import numpy.typing as npt

from vkvagent.engine.policy import PolicySettings, window_state
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
    (overrides ``onset_h``)."""

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

    def restart_cost(self, values: Values, drained: Any) -> tuple[Any, Any]:
        """(reward lost, requests cut off) by a restart that finds ``values`` (arrays, or
        scalars): its requests in flight cut off, or ``drained`` (where the engine works: a
        stalled one cannot finish them, so they are cut off whatever was asked)."""
        s = self.server
        working = values.up & ~values.stalled
        drained = np.asarray(drained) & working
        cut_off = np.where(values.up & ~drained, values.running, 0.0)
        wasted = cut_off * s.output_tokens / 2 * values.speed * values.flags
        drain_seconds = np.minimum(DRAIN_BUDGET, _longest_output() * values.itl)
        refused = np.where(
            drained, values.demand * drain_seconds * values.speed * values.flags, 0.0
        )
        return wasted + refused, cut_off


# -- walking a schedule ------------------------------------------------------------------------


class Path:
    """A run through the model, one step at a time: restart at a step (a cold start begins
    there), or continue. The kernel's OOM kill restarts the process whatever the policy says,
    and so does the operator's flag change (``slow_flags``). The first step finds a server
    that has just come up (or started ``World.initial_uptime_h`` before)."""

    def __init__(self, model: Model) -> None:
        self.model = model
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
        choices = (False, True) if drained is None else (drained,)
        lost, cut_off = min(self.model.restart_cost(values, d) for d in choices)
        self.reward -= float(lost)
        self.in_flight_lost += float(lost)
        self.cut_off += float(cut_off)

    def score(self) -> float:
        """Quality-weighted goodput: reward over the tokens demanded, all week."""
        return self.reward / self.model.total_demand()


def walk(
    model: Model,
    restarts: Sequence[int] | Callable[[Path], bool],
    drained: bool | None = False,
    rollbacks: Sequence[int] = (),
) -> Path:
    """The path of a fixed schedule (restart steps, of which ``rollbacks`` put the old flags
    back) or of a policy asked at every step (it never rolls back), each restart ``drained``
    or not (``Path.advance``)."""
    path = Path(model)
    wanted = set(restarts) if not callable(restarts) else None
    back = set(rollbacks)
    while path.k < model.steps:
        if wanted is not None:
            path.advance(path.k in wanted, drained, path.k in back)
        else:
            assert callable(restarts)
            path.advance(restarts(path), drained)
    return path


# -- the oracle --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimum:
    value: float  # the best reward (token x speed) over the whole run
    restarts: tuple[int, ...]  # the steps the best schedule restarts at
    rollbacks: tuple[int, ...] = ()  # those of them that put the old flags back

    def score(self, model: Model) -> float:
        return self.value / model.total_demand()


def window_mask(policy: PolicySettings, steps: int) -> Mask:
    """Per step: whether one of ``policy``'s restart windows is open at its start
    (``window_state``, as the engine and the report's "outside window" read them)."""
    return np.array([window_state(policy, when(k))[0] for k in range(steps)], dtype=bool)


def oracle(model: Model, allowed: Mask | None = None) -> Optimum:
    """The best schedule with full knowledge of the future, by dynamic programming; with
    ``allowed``, the best whose own restarts all begin at steps where it is true (the
    windowed oracle; OOM kills and the operator's flag change come when they come).

    ``A[k][v]``: the best reward from step ``k`` on, arriving with uptime ``v`` (the previous
    step's plus one); the choice at ``k`` is to keep ``v`` or restart (uptime 0, less the
    restart's cost: drained or not, whichever is cheaper), unless the process is OOM-killed at
    ``v`` (cut off). Uptimes beyond ``k`` plus the first step's cannot be reached by step
    ``k``, so each step's vector is only as long as that (ties keep the process running)."""
    return optima(model, (allowed,))[0]


def optima(model: Model, masks: Sequence[Mask | None]) -> list[Optimum]:
    """``oracle`` for each of ``masks`` (None: unrestricted), in one pass over the model."""
    if model.flag_step is not None:
        return [_oracle_with_flags(model, model.flag_step, m) for m in masks]
    steps, first = model.steps, model.first_uptime
    afters = [np.zeros(steps + first + 1) for _ in masks]  # A[steps][v] = 0
    chosen: list[list[npt.NDArray[np.uint8]]] = [[] for _ in masks]
    for k in range(steps - 1, -1, -1):
        n = k + first + 1  # arriving uptimes 0..k+first
        values = model.evaluate(k, np.arange(n))
        cut, _ = model.restart_cost(values, False)
        drained, _ = model.restart_cost(values, True)
        cost = np.where(values.killed, cut, np.minimum(cut, drained))
        for i, mask in enumerate(masks):
            keep = values.reward * STEP + afters[i][1 : n + 1]
            restarted = keep[0] - cost
            if mask is None or mask[k]:
                restart = (restarted > keep) | values.killed
            else:
                restart = values.killed
            afters[i] = np.where(restart, restarted, keep)
            chosen[i].append(np.packbits(restart))
    out = []
    for i, after in enumerate(afters):
        bits = chosen[i][::-1]
        restarts, v = [], first
        for k in range(steps):
            if np.unpackbits(bits[k], count=k + first + 1)[v]:
                if not bool(model.evaluate(k, v).killed):
                    restarts.append(k)
                v = 0
            v += 1
        out.append(Optimum(float(after[first]), tuple(restarts)))
    return out


def _oracle_with_flags(model: Model, change: int, allowed: Mask | None = None) -> Optimum:
    """``oracle`` in a world whose operator applies the slow flags at step ``change`` (a
    drained restart no schedule can refuse). From there the programme has two layers: ``new``
    (the slow flags in effect) and ``old`` (rolled back). A restart in ``new`` either keeps
    the flags or rolls them back, at the same cost; in ``old`` it keeps them (the operator does
    not apply them again). Ties keep the process running, and keep the flags. With
    ``allowed``, the schedule restarts (and rolls back) only where it is true."""
    assert not model.world.memory_growth  # World refuses it: no OOM kill to choose around
    steps, first = model.steps, model.first_uptime
    old = np.zeros(steps + first + 1)
    new = np.zeros(steps + first + 1)
    # Per step (reversed until the end): restart bits in old, and in new; whether a restart
    # in new rolls back (the same for every uptime: the cost does not depend on the choice).
    restart_old: list[npt.NDArray[np.uint8] | None] = []
    restart_new: list[npt.NDArray[np.uint8] | None] = []
    roll_back: list[bool] = []
    for k in range(steps - 1, -1, -1):
        n = k + first + 1
        u = np.arange(n)
        free = allowed is None or bool(allowed[k])
        at_old = model.evaluate(k, u)
        keep_old = at_old.reward * STEP + old[1 : n + 1]
        if k == change:
            first_new = model.evaluate(k, 0, True)
            lost, _ = model.restart_cost(at_old, True)
            old = float(first_new.reward) * STEP + new[1] - lost
            restart_old.append(None)
            restart_new.append(None)
            roll_back.append(False)
            continue
        restarted = keep_old[0] - _cheaper_cost(model, at_old)
        restart = (restarted > keep_old) & free
        next_old = np.where(restart, restarted, keep_old)
        restart_old.append(np.packbits(restart))
        if k > change:
            at_new = model.evaluate(k, u, True)
            keep_new = at_new.reward * STEP + new[1 : n + 1]
            back = bool(keep_old[0] > keep_new[0])
            restarted_new = (keep_old[0] if back else keep_new[0]) - _cheaper_cost(model, at_new)
            restart = (restarted_new > keep_new) & free
            new = np.where(restart, restarted_new, keep_new)
            restart_new.append(np.packbits(restart))
            roll_back.append(back)
        else:
            restart_new.append(None)
            roll_back.append(False)
        old = next_old
    restart_old.reverse()
    restart_new.reverse()
    roll_back.reverse()
    restarts, rollbacks = [], []
    v, slow = first, False
    for k in range(steps):
        if k == change:
            v, slow = 0, True
        else:
            bits = restart_new[k] if slow else restart_old[k]
            assert bits is not None
            if np.unpackbits(bits, count=k + first + 1)[v]:
                restarts.append(k)
                if slow and roll_back[k]:
                    rollbacks.append(k)
                    slow = False
                v = 0
        v += 1
    return Optimum(float(old[first]), tuple(restarts), tuple(rollbacks))


def _cheaper_cost(model: Model, values: Values) -> Any:
    """What a restart that finds ``values`` loses, drained or cut off, whichever is less."""
    cut, _ = model.restart_cost(values, False)
    drained, _ = model.restart_cost(values, True)
    return np.minimum(cut, drained)


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
