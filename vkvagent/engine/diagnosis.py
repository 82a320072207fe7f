"""Diagnosis: why the server is slow, with the numbers that say so.

A restart helps only against some causes, so the engine names the cause before anything else.
Symptoms (speed below the baseline, KV pressure, requests waiting beside free KV, no progress,
memory rising with requests served) must hold for a while (hysteresis: enter below one ratio,
leave above a higher one) before they count. Explanations that a restart cannot fix (a
throttled or faulty GPU, more or different demand than the fresh server saw) veto them.

Restart-fixable: uptime_decline, kv_pressure, kv_stranded, stall, unresponsive,
host_memory_growth. Vetoed: gpu_throttle, gpu_fault, load_shift. Reported only: engine_down
(systemd's ``Restart=`` handles a dead process; a model still loading is not a fault).

Every duration is measured on the monotonic clock of the samples (``Sample.mono``): a step of
the wall clock neither fires a held symptom early nor holds it back.

Pure: every function takes values (the window's statistics, the baseline comparison, GPU
readings, the held-symptom state) and returns values, the new state included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Union

from vkvagent.engine import liveness
from vkvagent.engine.baseline import Capacity, Comparison, WindowStats
from vkvagent.engine.gpu_faults import describe_xid, is_fault
from vkvagent.engine.liveness import Found
from vkvagent.engine.samples import (
    EngineSignals,
    FlagValue,
    GpuReading,
    Sample,
    VllmMetrics,
    utc_text,
)

FIXABLE = frozenset(
    {"uptime_decline", "kv_pressure", "kv_stranded", "stall", "unresponsive", "host_memory_growth"}
    | set(liveness.CAUSES)
)
VETOED = frozenset({"gpu_throttle", "gpu_fault", "load_shift"})
# Causes a run stays due for once diagnosed (judge the run, not only the moment): a slowing or
# filling server's symptoms fade at idle or unlearned loads, the cause does not. A stall or
# silence is acted on at once, as an emergency; once it ends there is nothing left to hold.
HELD = FIXABLE - {"stall", "unresponsive", *liveness.CAUSES}
# Held causes that show only under load: recovery counts at the demand they were diagnosed at or
# more (a leaky KV cache looks healthy at night). Demand, not the load served: under KV
# pressure the server serves less, so its served load falls into a lighter regime.
LOAD_BOUND = frozenset({"kv_pressure", "kv_stranded"})
CAUSES = (*sorted(FIXABLE), *sorted(VETOED), "engine_down")
# The largest --gpu-memory-utilization a suggestion goes to: what is left is the CUDA context,
# activations and fragmentation (flags.CATALOGUE lets an operator go to 0.98).
MEMORY_SHARE_TOP = 0.95
# Prefix caching can only save prompt work: suggested when prompt tokens are at least this share
# of the tokens processed (docs/tuning.md).
PROMPT_HEAVY = 0.5
# Prefix-cache hits / queries at or above this: requests share prefixes, so the block size,
# the granularity of a hit, matters.
PREFIX_SHARED = 0.2
# CUDA's default block size (vLLM's CacheConfig); other platforms pick their own (CPU: 128).
CUDA_BLOCK_SIZE = 16

EvidenceValue = Union[float, int, str, bool, None]
Evidence = Mapping[str, EvidenceValue]
GIB = 1 << 30


@dataclass(frozen=True)
class DiagnosisSettings:
    """Thresholds (ratios are current / baseline; durations in seconds)."""

    enter_ratio: float = 0.75  # speed below this fraction of the baseline: degraded...
    leave_ratio: float = 0.85  # ...until it is back above this one
    # ...or below 1 - this (back above 1 - this / 2), in a run whose own speed has fallen
    # steadily with uptime by this much (prevention.decline): a decline told hours before it
    # costs a quarter of the speed.
    trend_loss: float = 0.1
    hold: float = 900.0  # how long a symptom must last before it counts
    kv_full: float = 0.9  # mean KV usage at or above this is "near full"
    kv_stranded_below: float = 0.8  # requests waiting while usage is below this: stranded
    # KV blocks leak: the cache holds at least this share beyond what the running requests
    # take at their fresh share, and enough that the heaviest load this run served cleanly
    # would fill it (kv_full). It shows at any load, a quiet window's too, before the blocks
    # bind at the peak.
    kv_leak: float = 0.1
    min_waiting: float = 1.0  # mean waiting requests that count as "requests wait"
    min_preemptions_per_s: float = 0.01  # preemption rate that counts as "preempting"
    load_tolerance: float = 0.1  # load above fresh capacity x (1 + this) is more load
    # Another request mix: prompt or generated tokens per request more than (1 + this) times,
    # or less than 1 / (1 + this) times, the fresh run's.
    mix_tolerance: float = 0.5
    prefix_drop: float = 0.2  # the prefix-cache hit ratio this far below the fresh run's: too
    stall_after: float = 120.0  # requests pending and no token or step for this long
    # The active probe (vkvagent.probe) is wanted once no token or step has moved for this
    # long, at most once per this long; 0: never probe.
    probe_after: float = 60.0
    unresponsive_after: float = 90.0  # /metrics accepts connections but never answers: this long
    throttle_clock_drop: float = 0.1  # throttled: SM clock below the fresh one x (1 - this)
    fault_memory: float = 3600.0  # an XID keeps vetoing restarts this long
    memory_min_span: float = 3600.0  # this run's memory series must cover this long
    memory_min_growth: float = 2.0 * GIB  # bytes grown in this run, along with requests
    memory_min_correlation: float = 0.9  # how steadily memory follows requests served

    def __post_init__(self) -> None:
        if not 0 < self.enter_ratio <= self.leave_ratio:
            raise ValueError("diagnosis: need 0 < enter_ratio <= leave_ratio")
        if not 0 < self.kv_stranded_below <= self.kv_full <= 1:
            raise ValueError("diagnosis: need 0 < kv_stranded_below <= kv_full <= 1")


# -- state carried between calls ---------------------------------------------------------------


# A window at this share of the lightest load a symptom was seen at, or more, can show it gone:
# the same load, give or take its minute-to-minute noise.
SAME_LOAD_SHARE = 0.9


@dataclass(frozen=True)
class Hysteresis:
    """A symptom that must hold for ``hold`` seconds to become active, and stays active until
    its leaving condition is seen. Times are monotonic seconds (``Sample.mono``)."""

    active: bool = False
    pending_since: float | None = None
    active_since: float | None = None
    last_entering: float | None = None  # when the entering threshold was last crossed
    load: float | None = None  # the lightest load (requests/s) it was crossed at
    # The heaviest of the lighter loads it was seen gone at: evidence once it is crossed at a
    # load as light.
    cleared: float | None = None

    def step(
        self,
        entering: bool | None,
        leaving: bool | None,
        now: float,
        hold: float,
        load: float | None = None,
    ) -> Hysteresis:
        """``entering``: the symptom's threshold is crossed now; ``leaving``: it is clearly
        gone. In between (or None: no evidence, e.g. no baseline at this load) nothing
        changes, so noise around the entering threshold neither resets the clock nor fires:
        the symptom becomes active when it is crossed again ``hold`` after it first was. A
        symptom not crossed again within ``hold`` is forgotten, so one dip before a quiet night
        and one after it are not a held symptom. With ``load`` (the window's), a lighter window
        (under SAME_LOAD_SHARE of the lightest load it was crossed at) does not show a pending
        symptom gone: bursty traffic's light minutes are no evidence against a slowdown seen
        at its heavy ones. They count once it is crossed at a load that light: if one showed
        it gone there, it starts over. An active one is cleared as before: the run stays due
        for its cause (``Due``), which recovers only under comparable load."""
        seen_at = None if self.active else self.load
        lighter = seen_at is not None and load is not None and load < seen_at * SAME_LOAD_SHARE
        if leaving and not lighter:
            return Hysteresis()
        if self.active:
            return self
        if not entering:
            if self.last_entering is not None and now - self.last_entering > hold:
                return Hysteresis()
            if leaving and load is not None:  # (lighter, so load is known) kept for later
                return replace(self, cleared=max(self.cleared or 0.0, load))
            return self
        # Not crossed within the hold, or crossed at a load it was seen gone at since: it
        # starts over from this crossing.
        starts_over = (self.last_entering is not None and now - self.last_entering > hold) or (
            load is not None and self.cleared is not None and self.cleared >= load * SAME_LOAD_SHARE
        )
        since = self.pending_since if self.pending_since is not None and not starts_over else now
        loads = [x for x in (None if starts_over else self.load, load) if x is not None]
        lightest = min(loads) if loads else None
        if now - since >= hold:
            return Hysteresis(True, since, now, now, lightest)
        cleared = None if starts_over else self.cleared
        return Hysteresis(False, since, None, now, lightest, cleared)

    def held_for(self, now: float) -> float:
        return 0.0 if self.pending_since is None else now - self.pending_since

    def to_json(self) -> dict[str, Any]:
        return {
            "active": self.active,
            "pending_since": self.pending_since,
            "active_since": self.active_since,
            "last_entering": self.last_entering,
            "load": self.load,
            "cleared": self.cleared,
        }

    @classmethod
    def from_json(cls, data: Any) -> Hysteresis:
        return cls(
            bool(data["active"]),
            optional_float(data["pending_since"]),
            optional_float(data["active_since"]),
            optional_float(data.get("last_entering")),
            optional_float(data.get("load")),  # these two absent in state saved before them
            optional_float(data.get("cleared")),
        )


@dataclass(frozen=True)
class Progress:
    """The stall clocks (monotonic seconds): ``since``, when the engine last showed progress
    or had, by its gauges, nothing to do; ``advanced``, when a work counter last moved (the
    first sample of a run counts as a move, rather than accuse the engine)."""

    since: float | None = None
    advanced: float | None = None
    # With several data-parallel engines, ``since`` of each (engine label, since): one engine
    # stuck among busy ones moves the totals nowhere near a stall.
    engines: tuple[tuple[str, float], ...] = ()

    def observe(self, before: VllmMetrics | None, after: VllmMetrics, mono: float) -> Progress:
        moved = before is None or self.advanced is None or _advanced(before, after)
        advanced = mono if moved else self.advanced
        since = mono if moved or self.since is None or _pending(after) <= 0 else self.since
        return Progress(since, advanced, self._engines(before, after, mono))

    def _engines(
        self, before: VllmMetrics | None, after: VllmMetrics, mono: float
    ) -> tuple[tuple[str, float], ...]:
        if len(after.per_engine) < 2:
            return ()
        clocks = dict(self.engines)
        previous = {e.engine: e for e in before.per_engine} if before is not None else {}
        out: list[tuple[str, float]] = []
        for engine in after.per_engine:
            old, since = previous.get(engine.engine), clocks.get(engine.engine)
            if old is None or since is None or _advanced(old, engine) or _pending(engine) <= 0:
                since = mono
            out.append((engine.engine, since))
        return tuple(out)

    def stalled(self, latest: VllmMetrics, mono: float, probe: ProbeFacts) -> Stall:
        """How long the engine has had work and made no progress: work by its gauges (no
        longer counted from a probe answered since), or a probe sent since its counters last
        moved that got no answer (then counted from that last move: the probe proves the
        engine was not idle but stuck)."""
        answered = probe.answered if probe.answered is not None else -math.inf
        gauges, evidence = 0.0, "requests pending"
        if self.since is not None and _pending(latest) > 0:
            gauges = max(0.0, mono - max(self.since, answered))
        signals = {e.engine: e for e in latest.per_engine}
        for engine, since in self.engines:
            signal = signals.get(engine)
            if signal is not None and _pending(signal) > 0:
                stuck = max(0.0, mono - max(since, answered))
                if stuck > gauges:
                    gauges = stuck
                    evidence = f"requests pending on engine {engine} of {len(signals)}"
        probed = 0.0
        if (
            probe.unanswered is not None
            and self.advanced is not None
            and probe.unanswered >= self.advanced
        ):
            probed = max(0.0, mono - max(self.advanced, answered))
        if probed > gauges:
            return Stall(probed, "a probe got no answer")
        return Stall(gauges, evidence if gauges else "")


@dataclass(frozen=True)
class Stall:
    """How long the engine has had work without progress, and what says it had work."""

    seconds: float = 0.0
    evidence: str = ""  # "requests pending" (the gauges), "a probe got no answer", or ""


@dataclass(frozen=True)
class ProbeFacts:
    """What the active probe found (monotonic send times): the last probe answered, the
    latest unanswered one since (timed out, or a server error) and the last sent. All None:
    no probe (replay, or the probe switched off)."""

    answered: float | None = None
    unanswered: float | None = None
    last_sent: float | None = None


def _pending(signals: VllmMetrics | EngineSignals) -> float:
    return (signals.num_requests_running or 0) + (signals.num_requests_waiting or 0)


def _advanced(before: VllmMetrics | EngineSignals, after: VllmMetrics | EngineSignals) -> bool:
    compared = False
    for read in _WORK:
        old, new = read(before), read(after)
        if old is not None and new is not None:
            compared = True
            if new != old:  # up, or down after a reset: either way the engine moved
                return True
    return not compared  # nothing to compare: cannot tell, so do not accuse


_WORK: tuple[Callable[[VllmMetrics | EngineSignals], float | None], ...] = (
    lambda m: m.generation_tokens_total,
    lambda m: m.engine_steps_total,
    lambda m: m.prompt_tokens_total,
    lambda m: m.request_success_total,
)


@dataclass(frozen=True)
class Due:
    """A fixable cause diagnosed in this run: the run stays due for a restart, through idle
    and unknown-baseline moments, until it is restarted (a new run drops it) or recovers
    under comparable load (``_recovered``)."""

    cause: str
    since: float  # monotonic time it was first diagnosed in this run
    at: float | None  # the same moment in UTC Unix seconds (for people), when known
    demand: float | None  # the highest demand (requests/s) it was diagnosed at (None: unknown)
    summary: str  # what was diagnosed, in words (the latest diagnosis of it)
    ratio: float | None = None  # the speed then, against the fresh baseline
    # The flags suggested then (kv_pressure), and why: still the advice while it is held.
    suggestion: Mapping[str, FlagValue] = field(default_factory=dict)
    reasons: Mapping[str, str] = field(default_factory=dict)
    harm_at: float | None = None  # monotonic time the foretold harm comes (``harm_in``)

    def noted(self, found: Diagnosis, demand: float | None, ratio: float | None, now: float) -> Due:
        """Diagnosed again: the latest words, advice and foretold harm, the highest demand
        it showed at (while clients give up, arrivals read low: the highest is the closest to
        what was asked)."""
        known = [d for d in (self.demand, demand) if d is not None]
        top = max(known) if known else None
        harm_at = None if found.harm_in is None else now + found.harm_in
        return replace(
            self, cause=found.cause or self.cause, summary=found.summary, demand=top,
            ratio=ratio, suggestion=found.suggestion, reasons=found.reasons, harm_at=harm_at,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "since": self.since,
            "at": self.at,
            "demand": self.demand,
            "summary": self.summary,
            "ratio": self.ratio,
            "suggestion": dict(self.suggestion),
            "reasons": dict(self.reasons),
            "harm_at": self.harm_at,
        }

    @classmethod
    def from_json(cls, data: Any) -> Due:
        cause = str(data["cause"])
        if cause not in HELD:
            raise ValueError(f"due: {cause!r} is not a cause a run is held due for")
        since = optional_float(data["since"])
        if since is None:
            raise ValueError("due: since must be a number")
        return cls(
            cause=cause,
            since=since,
            at=optional_float(data.get("at")),
            demand=optional_float(data.get("demand")),
            summary=str(data.get("summary", "")),
            ratio=optional_float(data.get("ratio")),
            suggestion=_flag_values(data.get("suggestion") or {}),
            reasons={str(k): str(v) for k, v in (data.get("reasons") or {}).items()},
            harm_at=optional_float(data.get("harm_at")),
        )


@dataclass(frozen=True)
class DiagnosisState:
    """Everything diagnosis remembers between calls."""

    speed: Hysteresis = Hysteresis()
    kv: Hysteresis = Hysteresis()
    stranded: Hysteresis = Hysteresis()
    lagging: Hysteresis = Hysteresis()  # one data-parallel engine far behind the others
    leak: Hysteresis = Hysteresis()  # KV blocks held beyond what the running requests take
    progress: Progress = Progress()
    throttled_at: float | None = None  # monotonic time a throttled GPU was last seen
    throttle_note: str = ""
    fault_at: float | None = None  # monotonic time a GPU fault was last seen
    fault_note: str = ""
    # vLLM's silence: since when (monotonic) it accepts connections without answering, and
    # when (UTC, to compare with the unit's start) it last answered /metrics at all.
    silent_since: float | None = None
    answered_at: float | None = None
    due: Due | None = None  # the cause this run is due for a restart for (judge the run)
    # The heaviest demand (requests/s) this run served cleanly, no preemption and no queue:
    # the load a leaking KV cache must still hold (the fresh hours may have been quiet ones).
    heaviest: float | None = None

    def for_new_run(self) -> DiagnosisState:
        """A new vLLM process: symptoms and the cause it was due for start over; what the
        GPUs did is kept."""
        return DiagnosisState(
            throttled_at=self.throttled_at,
            throttle_note=self.throttle_note,
            fault_at=self.fault_at,
            fault_note=self.fault_note,
            silent_since=self.silent_since,
            answered_at=self.answered_at,
        )

    def heard(self, sample: Sample) -> DiagnosisState:
        """Track vLLM's silence over one more sample, valid or not."""
        if sample.vllm is not None:
            return replace(self, silent_since=None, answered_at=sample.time)
        if sample.vllm_silent:
            since = self.silent_since if self.silent_since is not None else sample.mono
            return replace(self, silent_since=since)
        return replace(self, silent_since=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "speed": self.speed.to_json(),
            "kv": self.kv.to_json(),
            "stranded": self.stranded.to_json(),
            "lagging": self.lagging.to_json(),
            "leak": self.leak.to_json(),
            "progress_since": self.progress.since,
            "progress_advanced": self.progress.advanced,
            "progress_engines": dict(self.progress.engines),
            "throttled_at": self.throttled_at,
            "throttle_note": self.throttle_note,
            "fault_at": self.fault_at,
            "fault_note": self.fault_note,
            "silent_since": self.silent_since,
            "answered_at": self.answered_at,
            "due": self.due.to_json() if self.due is not None else None,
            "heaviest": self.heaviest,
        }

    @classmethod
    def from_json(cls, data: Any) -> DiagnosisState:
        return cls(
            speed=Hysteresis.from_json(data["speed"]),
            kv=Hysteresis.from_json(data["kv"]),
            stranded=Hysteresis.from_json(data["stranded"]),
            lagging=Hysteresis.from_json(data["lagging"]) if "lagging" in data else Hysteresis(),
            leak=Hysteresis.from_json(data["leak"]) if "leak" in data else Hysteresis(),
            progress=Progress(
                optional_float(data["progress_since"]),
                optional_float(data.get("progress_advanced")),
                tuple(
                    (str(engine), float(since))
                    for engine, since in (data.get("progress_engines") or {}).items()
                ),
            ),
            throttled_at=optional_float(data["throttled_at"]),
            throttle_note=str(data["throttle_note"]),
            fault_at=optional_float(data["fault_at"]),
            fault_note=str(data["fault_note"]),
            silent_since=optional_float(data.get("silent_since")),
            answered_at=optional_float(data.get("answered_at")),
            # States written before runs were judged have none: nothing is held.
            due=Due.from_json(data["due"]) if data.get("due") is not None else None,
            heaviest=optional_float(data.get("heaviest")),
        )


def optional_float(value: Any) -> float | None:
    """A number or None from JSON state; ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number or null, got {value!r}")
    return float(value)


# -- inputs and result -------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPoint:
    """The vLLM unit's memory at one moment (systemd's MemoryCurrent), with the requests the
    run had served by then (``request_success_total``)."""

    mono: float
    bytes: float
    requests_served: float


@dataclass(frozen=True)
class Situation:
    """What the engine hands diagnosis for one evaluation."""

    stats: WindowStats | None  # the current window; None when too short to judge
    comparison: Comparison | None  # against the baseline of its regime; None: unknown
    regime: str  # the current regime, in words ("running 16-22.6", or "idle")
    known: str  # the regimes the baseline knows, in words
    learning: str  # why there is no baseline yet (warm-up), or ""
    capacity: Capacity | None = None  # the heaviest load the fresh run served cleanly
    gpus: Sequence[tuple[GpuReading, ...]] = ()  # readings of each sample not seen before
    stall: Stall = Stall()
    unresponsive: str | None = None  # vLLM silent past unresponsive_after, in words
    memory: Sequence[MemoryPoint] = ()  # oldest first
    memory_limit: float | None = None  # the unit's MemoryMax, bytes; None: unlimited
    run_began: float | None = None  # monotonic time this vLLM run began
    decline: float | None = None  # speed this run lost by now on its own trend, if it declines
    down: str | None = None  # why there is no live engine to judge, if so
    # With vLLM down: the cause of liveness's to act on (a dead unit, a hung start, a crash
    # loop); None: down for a reason only reported (engine_down).
    liveness: Found | None = None
    flags: Mapping[str, FlagValue] = field(default_factory=dict)  # the flags in effect
    cache_config: Mapping[str, str] = field(default_factory=dict)
    # Whose fresh baseline ``comparison`` is against: "this run's", or "an earlier run's" at a
    # load this run has not learned (engine.CARRY_SPEED).
    baseline_of: str = "this run's"
    engines: Sequence[EngineWindow] = ()  # each data-parallel engine over the window (2 or more)
    prefix_hit_ratio: float | None = None  # prefix-cache hits / queries over the window
    time: float | None = None  # UTC Unix seconds of the latest sample (for people)
    # The fresh server's medians (METRICS) to tell another request mix and a KV leak by: the
    # compared regime's, else the fresh capacity's (per request, neither depends much on the
    # load).
    fresh: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineWindow:
    """One data-parallel engine over the window: its means and rates (None: not on the page)."""

    engine: str
    kv_usage: float | None
    waiting: float | None
    generation_tokens_per_s: float | None
    preemptions_per_s: float | None

    def words(self) -> str:
        return (
            f"engine {self.engine}: KV {_num(self.kv_usage)}, {_num(self.waiting, '.1f')} "
            f"waiting, {_num(self.generation_tokens_per_s, '.0f')} tokens/s"
        )


@dataclass(frozen=True)
class Diagnosis:
    """The cause (None: nothing wrong, or nothing known), the numbers behind it, and a line
    saying why. ``symptom`` says what is wrong even when the cause vetoes a restart."""

    cause: str | None
    summary: str
    evidence: Evidence = field(default_factory=dict)
    symptom: str | None = None
    suggestion: Mapping[str, FlagValue] = field(default_factory=dict)
    reasons: Mapping[str, str] = field(default_factory=dict)  # why each suggested flag
    # Seconds until the harm the cause foretells (a leak reaching MemoryMax; 0 once there):
    # the policy restarts in the last window before it. None: nothing foretold, or untimed.
    harm_in: float | None = None
    # Named, but nothing for vkvagent to do now (a crash loop systemd is restarting).
    reported: bool = False

    @property
    def fixable(self) -> bool:
        return self.cause in FIXABLE and not self.reported

    @property
    def vetoed(self) -> bool:
        return self.cause in VETOED


def diagnose(
    settings: DiagnosisSettings, state: DiagnosisState, situation: Situation, now: float
) -> tuple[Diagnosis, DiagnosisState]:
    """One evaluation: update the held symptoms and what the GPUs did, then name the cause.

    Order: engine_down, gpu_fault, stall, then the held symptoms (KV pressure, stranded KV,
    memory growth, speed), each checked against what would explain it instead. Then the
    run is judged: a cause in HELD diagnosed in this run stays the cause while nothing is
    seen (idle, an unlearned load, a symptom building up again), until the run recovers
    under comparable load; a veto, a stall or a dead engine still decides."""
    found, state = _diagnose(settings, state, situation, now)
    return _judge_run(settings, state, situation, found, now)


def _judge_run(
    s: DiagnosisSettings,
    state: DiagnosisState,
    situation: Situation,
    found: Diagnosis,
    now: float,
) -> tuple[Diagnosis, DiagnosisState]:
    due, cmp, stats = state.due, situation.comparison, situation.stats
    if found.cause in HELD:
        ratio = cmp.ratio if cmp is not None else None
        demand = _demand(stats) if stats is not None else None
        if due is None:
            due = Due(found.cause or "", now, situation.time, demand, found.summary, ratio)
        due = due.noted(found, demand, ratio, now)
        return found, replace(state, due=due)
    if due is None or found.cause is not None:  # a veto, a stall, a dead engine: it decides
        return found, state
    if _recovered(s, state, situation, due):
        return replace(
            found, summary=f"{found.summary}; recovered from {due.cause} at comparable load"
        ), replace(state, due=None)
    evidence = dict(found.evidence)
    evidence["held_cause"] = due.cause
    evidence["held_for_s"] = now - due.since
    if due.at is not None:
        evidence["held_since"] = utc_text(due.at)
    if due.ratio is not None:
        evidence["held_ratio"] = due.ratio
    when = f" at {utc_text(due.at)}" if due.at is not None else ""
    return Diagnosis(
        due.cause,
        f"held for this run: {due.summary} (diagnosed {_span(now - due.since)} ago{when}); "
        f"now {found.summary}",
        evidence,
        symptom=found.symptom or due.cause,
        suggestion=due.suggestion,
        reasons=due.reasons,
        harm_in=None if due.harm_at is None else max(0.0, due.harm_at - now),
    ), state


def _recovered(s: DiagnosisSettings, state: DiagnosisState, situation: Situation, due: Due) -> bool:
    """The run serves as fast as its fresh self again, at a load it has a baseline for, with
    no symptom building up; for a cause that shows only under load (LOAD_BOUND), at the
    demand it was diagnosed at or more."""
    cmp, stats = situation.comparison, situation.stats
    if cmp is None or cmp.ratio is None or cmp.ratio <= s.leave_ratio or stats is None:
        return False
    if any(
        h.pending_since is not None for h in (state.speed, state.kv, state.stranded, state.leak)
    ):
        return False
    asked = _asked(stats) or 0.0
    return due.cause not in LOAD_BOUND or due.demand is None or asked >= due.demand


def _asked(stats: WindowStats) -> float | None:
    """Requests/s arriving: after a storm the server completes its backlog faster than
    requests arrive, which is not more demand (``_demand`` takes the larger, for vetoes).
    None where neither rate is known (a counter reset in the window)."""
    if stats.arrivals_per_s is not None:
        return stats.arrivals_per_s
    return stats.requests_per_s


def _span(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else _minutes(seconds)


def _diagnose(
    settings: DiagnosisSettings, state: DiagnosisState, situation: Situation, now: float
) -> tuple[Diagnosis, DiagnosisState]:
    s = settings
    fresh_clock = (
        situation.comparison.baseline.get("sm_clock_ratio") if situation.comparison else None
    )
    state = _remember_gpus(s, state, situation.gpus, fresh_clock, now)
    faulty = state.fault_at is not None and now - state.fault_at < s.fault_memory
    if situation.unresponsive is not None:
        if faulty:  # a GPU fault can hang vLLM, and a restart does not repair the GPU
            return Diagnosis(
                "gpu_fault",
                f"GPU fault: {state.fault_note}; {situation.unresponsive}",
                {"fault": state.fault_note, "detail": situation.unresponsive},
                symptom="no answer",
            ), state
        return Diagnosis(
            "unresponsive",
            situation.unresponsive,
            {"detail": situation.down or situation.unresponsive},
            symptom="no answer",
        ), state
    down = situation.liveness
    if down is not None and faulty:
        return Diagnosis(
            "gpu_fault",
            f"GPU fault: {state.fault_note}; vLLM is down ({down.summary}) and starting it "
            "again does not repair a GPU",
            {"fault": state.fault_note, **down.evidence},
            symptom="engine down",
        ), state
    if down is not None:
        return Diagnosis(
            down.cause, down.summary, down.evidence, symptom="engine down", reported=down.reported
        ), state
    if situation.down is not None:
        return Diagnosis(
            "engine_down",
            f"engine down: {situation.down}",
            {"detail": situation.down},
            symptom="engine down",
        ), state
    stats, cmp = situation.stats, situation.comparison
    state = _step_symptoms(s, state, situation, now)
    # One engine far behind its peers enters below enter_ratio of them and leaves only
    # once it serves leave_ratio: ``lagging`` is the engine still behind by the latter.
    lagging = _lagging(s, situation.engines, s.leave_ratio)
    if situation.engines:
        entering = _lagging(s, situation.engines, s.enter_ratio) is not None
        state = replace(state, lagging=state.lagging.step(entering, lagging is None, now, s.hold))
    evidence: dict[str, EvidenceValue] = _window_evidence(stats, cmp, situation)
    if cmp is not None and cmp.ratio is not None:
        evidence["enter_ratio"], evidence["leave_ratio"] = speed_band(s, situation)

    if faulty:
        evidence["fault"] = state.fault_note
        return Diagnosis(
            "gpu_fault",
            f"GPU fault: {state.fault_note}; a restart of vLLM does not repair a GPU",
            evidence,
            symptom="GPU fault",
        ), state

    stall = situation.stall
    if stall.seconds >= s.stall_after:
        evidence["stalled_s"] = stall.seconds
        evidence["stall_evidence"] = stall.evidence
        line = (
            f"{stall.evidence} and no token or engine step for "
            f"{stall.seconds:.0f} s (limit {s.stall_after:.0f} s)"
        )
        return Diagnosis("stall", line, evidence, symptom="no progress"), state

    throttle = _throttle(s, state, now)
    if throttle:
        evidence["gpu_throttle"] = throttle
    capacity = situation.capacity
    if capacity is not None:
        evidence["fresh_capacity_requests_per_s"] = capacity.requests_per_s
        evidence["fresh_capacity_generation_tokens_per_s"] = capacity.generation_tokens_per_s

    if state.kv.active and stats is not None:
        return _kv_pressure(s, state, situation, evidence, throttle, now), state

    if state.stranded.active and stats is not None and capacity is not None:
        symptom = (
            f"{_num(stats.waiting, '.1f')} requests wait while KV usage is "
            f"{_num(stats.kv_usage)}, serving {_num(stats.generation_tokens_per_s, '.0f')}"
            f" tokens/s where the fresh server served "
            f"{capacity.generation_tokens_per_s:.0f} without a queue"
        )
        vetoed = _veto(s, stats, situation.fresh, capacity, throttle, evidence, symptom)
        if vetoed:
            return vetoed, state
        return Diagnosis(
            "kv_stranded",
            f"{symptom}, for {_minutes(state.stranded.held_for(now))}",
            evidence,
            symptom=symptom,
        ), state

    if state.lagging.active and lagging is not None and stats is not None:
        engine, symptom = lagging
        vetoed = _veto(s, stats, situation.fresh, capacity, throttle, evidence, symptom)
        if vetoed:
            return vetoed, state
        # Full and preempting: its KV leaks or fills; otherwise its requests are stranded.
        full = (engine.kv_usage or 0.0) >= s.kv_full and (
            engine.preemptions_per_s or 0.0
        ) >= s.min_preemptions_per_s
        return Diagnosis(
            "kv_pressure" if full else "kv_stranded",
            f"{symptom}, for {_minutes(state.lagging.held_for(now))}",
            evidence,
            symptom=symptom,
        ), state

    leak = _kv_leak(s, stats, situation.fresh, capacity, state.heaviest)
    if state.leak.active and leak is not None and stats is not None and capacity is not None:
        evidence["kv_leaked"] = leak.leaked
        evidence["kv_leak_loss"] = leak.loss
        symptom = (
            f"{leak.leaked:.0%} of the KV cache held beyond what {_num(stats.running, '.1f')} "
            f"running requests take at their fresh share (KV usage {_num(stats.kv_usage)}); "
            f"the heaviest load served cleanly, {leak.load:.2f} requests/s, takes KV usage "
            f"{leak.needs:.2f} fresh and leaves {leak.room:.0%}"
        )
        vetoed = _veto(s, stats, situation.fresh, None, throttle="", evidence=evidence,
                       symptom=symptom)  # fmt: skip
        if vetoed:
            return vetoed, state
        return Diagnosis(
            "kv_pressure",
            f"KV cache leaking: {symptom}, for {_minutes(state.leak.held_for(now))}",
            evidence,
            symptom=symptom,
        ), state

    growth = memory_growth(s, situation.memory, situation.run_began, situation.memory_limit)
    if growth is not None:
        evidence.update(growth.evidence())
        line = (
            f"unit memory grew {growth.grown / GIB:.1f} GiB in step with requests served "
            f"({growth.per_request:.0f} bytes each, r={growth.correlation:.2f})"
        )
        if growth.limit is not None and growth.to_limit is not None:
            line += (
                f"; at this run's pace it reaches MemoryMax ({growth.limit / GIB:.1f} GiB) "
                f"in {_span(growth.to_limit)}"
            )
        return Diagnosis(
            "host_memory_growth", line, evidence, symptom="memory growth", harm_in=growth.to_limit
        ), state

    if state.speed.active and stats is not None and cmp is not None and cmp.ratio is not None:
        symptom = (
            f"speed {cmp.ratio:.2f} of {situation.baseline_of} fresh baseline at {situation.regime}"
        )
        vetoed = _veto(s, stats, situation.fresh, capacity, throttle, evidence, symptom)
        if vetoed:
            return vetoed, state
        line = f"{symptom} for {_minutes(state.speed.held_for(now))}, at unchanged load and mix"
        if situation.decline is not None and _declining(s, situation):  # for mypy: not None
            evidence["trend_loss"] = situation.decline
            line += f"; this run's speed has fallen {situation.decline:.0%} with uptime"
        return Diagnosis("uptime_decline", line, evidence, symptom=symptom), state

    if throttle:
        return Diagnosis(
            "gpu_throttle", f"GPU throttled ({throttle}); speed not below baseline", evidence
        ), state
    return Diagnosis(None, _quiet_summary(s, state, situation, now), evidence), state


def _step_symptoms(
    s: DiagnosisSettings, state: DiagnosisState, situation: Situation, now: float
) -> DiagnosisState:
    stats, capacity, fresh = situation.stats, situation.capacity, situation.fresh
    cmp = situation.comparison
    ratio = cmp.ratio if cmp is not None else None
    slow, back = speed_band(s, situation)
    load = None if stats is None else _asked(stats)
    speed = state.speed.step(
        None if ratio is None else ratio < slow,
        None if ratio is None else ratio > back,
        now,
        s.hold,
        load,
    )
    kv = None if stats is None else _kv_signature(s, stats)
    kv_gone = None if stats is None else _kv_clear(s, stats)
    stranded = _stranded_signature(s, stats, capacity)
    # Under pressure (preempting) the cache is full whatever leaks: the storm is its own
    # symptom, and a leak is told only by a server not preempting.
    calm = stats is not None and (stats.preemptions_per_s or 0.0) < s.min_preemptions_per_s
    heaviest = state.heaviest
    if stats is not None and calm and (stats.waiting or 0.0) < 0.5:
        heaviest = max(heaviest or 0.0, _demand(stats))
    leak = _kv_leak(s, stats, fresh, capacity, heaviest)
    leaking = None if leak is None else leak.leaked >= leak.room and calm
    sealed = None if leak is None else leak.leaked < leak.room / 2
    return replace(
        state,
        heaviest=heaviest,
        speed=speed,
        leak=state.leak.step(leaking, sealed, now, s.hold),
        kv=state.kv.step(kv, kv_gone, now, s.hold, load),
        stranded=state.stranded.step(
            stranded, None if stranded is None else not stranded, now, s.hold, load
        ),
    )


def speed_band(s: DiagnosisSettings, situation: Situation) -> tuple[float, float]:
    """The speed ratio's hysteresis band in effect: slow below the first, back above the
    second. Declining, it enters below 1 - trend_loss and leaves only above 1 - trend_loss / 2."""
    slow, back = s.enter_ratio, s.leave_ratio
    if _declining(s, situation):
        slow, back = max(slow, 1 - s.trend_loss), max(back, 1 - s.trend_loss / 2)
    return float(slow), float(back)


def _declining(s: DiagnosisSettings, situation: Situation) -> bool:
    return situation.decline is not None and situation.decline >= s.trend_loss


def _lagging(
    s: DiagnosisSettings, engines: Sequence[EngineWindow], ratio: float
) -> tuple[EngineWindow, str] | None:
    """One data-parallel engine with requests waiting on it that serves less than ``ratio``
    of what its peers serve (their median): saturated or stranded while the totals, averaged
    and summed over every engine, look fine. The engine and the words."""
    if len(engines) < 2:
        return None
    for engine in engines:
        rate = engine.generation_tokens_per_s
        peers = sorted(
            e.generation_tokens_per_s
            for e in engines
            if e is not engine and e.generation_tokens_per_s is not None
        )
        if rate is None or not peers or (engine.waiting or 0.0) < s.min_waiting:
            continue
        peer = peers[len(peers) // 2]
        if peer > 0 and rate < peer * ratio:
            return engine, (
                f"engine {engine.engine} of {len(engines)}: {_num(engine.waiting, '.1f')} "
                "requests wait "
                f"on it at KV usage {_num(engine.kv_usage)}, {_num(engine.preemptions_per_s)} "
                f"preemptions/s, serving {rate:.0f} tokens/s where its peers serve {peer:.0f}"
            )
    return None


@dataclass(frozen=True)
class Leak:
    """KV blocks held beyond what the running requests take at their fresh share."""

    leaked: float  # the share of the cache leaked
    load: float  # the heaviest load (requests/s) this run served cleanly, or the fresh peak's
    needs: float  # the KV usage that load takes on the fresh server
    room: float  # the leak at which that load fills the cache (kv_full), at least kv_leak
    full: float  # kv_full

    @property
    def loss(self) -> float:
        """The share of that load the leak leaves no room for: what waiting costs once it
        comes again (the cache holds kv_full - leaked of the ``needs`` it takes)."""
        return min(1.0, max(0.0, self.leaked + self.needs - self.full) / self.needs)


def _kv_leak(
    s: DiagnosisSettings,
    stats: WindowStats | None,
    fresh: Mapping[str, float],
    capacity: Capacity | None,
    heaviest: float | None,
) -> Leak | None:
    """The usage beyond what the running requests take at their fresh share (a request's
    share hardly depends on the load, so any fresh regime tells; the request mix is checked
    apart), against the room the heaviest load this run served cleanly leaves: the fresh
    peak's usage scaled by the load (a lower bound: a busier server holds each request
    longer). None without a fresh share and a fresh peak to tell by."""
    if stats is None or stats.kv_usage is None or stats.running is None:
        return None
    usage, running = fresh.get("kv_usage"), fresh.get("running")
    if not usage or not running or capacity is None or not capacity.kv_usage:
        return None
    if not capacity.requests_per_s > 0:
        return None
    load = max(capacity.requests_per_s, heaviest or 0.0)
    needs = capacity.kv_usage * load / capacity.requests_per_s
    leaked = stats.kv_usage - stats.running * usage / running
    return Leak(leaked, load, needs, max(s.kv_leak, s.kv_full - needs), s.kv_full)


def _kv_signature(s: DiagnosisSettings, stats: WindowStats) -> bool:
    """KV near full, preemptions going on and requests waiting: all three together."""
    return (
        stats.kv_usage is not None
        and stats.kv_usage >= s.kv_full
        and (stats.preemptions_per_s or 0.0) >= s.min_preemptions_per_s
        and (stats.waiting or 0.0) >= s.min_waiting
    )


def _kv_clear(s: DiagnosisSettings, stats: WindowStats) -> bool:
    """KV pressure is over: usage well below full, or no preemption, or no queue."""
    return (
        stats.kv_usage is None
        or stats.kv_usage < s.kv_stranded_below
        or (stats.preemptions_per_s or 0.0) < s.min_preemptions_per_s
        or (stats.waiting or 0.0) < s.min_waiting
    )


def _stranded_signature(
    s: DiagnosisSettings, stats: WindowStats | None, capacity: Capacity | None
) -> bool | None:
    """Requests wait beside free KV while the server serves clearly less than the load its
    fresh self served without a queue. None: no fresh capacity to compare with."""
    if stats is None or stats.kv_usage is None or stats.waiting is None:
        return None
    if stats.waiting < s.min_waiting or stats.kv_usage >= s.kv_stranded_below:
        return False
    if capacity is None or stats.generation_tokens_per_s is None:
        return None
    return stats.generation_tokens_per_s < capacity.generation_tokens_per_s * s.enter_ratio


def _kv_pressure(
    s: DiagnosisSettings,
    state: DiagnosisState,
    situation: Situation,
    evidence: dict[str, EvidenceValue],
    throttle: str,
    now: float,
) -> Diagnosis:
    """KV pressure is a degradation only at a load the fresh server handled cleanly; at more
    demand than that it is load. Demand is estimated as arrivals (completions plus the growth
    of the queue), since a degraded server completes less than it is asked. A throttled GPU
    or a changed request mix (longer outputs fill the KV cache at the same request rate)
    explains it just as well, and a restart cures neither."""
    stats = situation.stats
    assert stats is not None
    symptom = (
        f"KV usage {_num(stats.kv_usage)}, {_num(stats.preemptions_per_s)} "
        f"preemptions/s, {_num(stats.waiting, '.1f')} waiting, for "
        f"{_minutes(state.kv.held_for(now))}"
    )
    capacity = situation.capacity
    if throttle or mix_change(s, stats, situation.fresh):
        vetoed = _veto(s, stats, situation.fresh, capacity, throttle, evidence, symptom)
        if vetoed is not None:
            return vetoed
    if capacity is None:
        return Diagnosis(
            None,
            f"unknown baseline: {symptom}, but this run has no fresh "
            "preemption-free baseline to tell load from degradation",
            evidence,
            symptom=symptom,
        )
    demand = _demand(stats)
    if demand > capacity.requests_per_s * (1 + s.load_tolerance):
        return Diagnosis(
            "load_shift",
            f"{symptom} at {demand:.2f} requests/s of demand, "
            f"beyond the {capacity.requests_per_s:.2f}/s the fresh server served "
            "without preemption",
            evidence,
            symptom=symptom,
        )
    advice = kv_advice(
        capacity,
        situation.flags,
        situation.cache_config,
        stats=stats,
        prefix_hit_ratio=situation.prefix_hit_ratio,
        on_gpu=any(situation.gpus),
    )
    return Diagnosis(
        "kv_pressure",
        f"{symptom} at {demand:.2f} requests/s of demand, a load "
        f"the fresh server served without preemption "
        f"({capacity.requests_per_s:.2f}/s)",
        evidence,
        symptom=symptom,
        suggestion={name: a.value for name, a in advice.items()},
        reasons={name: a.reason for name, a in advice.items()},
    )


MIX = (("prompt_per_request", "prompt tokens"), ("output_per_request", "generated tokens"))
OLD_MIX_TOLERANCE = 0.15  # the prompt share's, for baselines kept before tokens per request


def mix_change(s: DiagnosisSettings, stats: WindowStats, fresh: Mapping[str, float]) -> str:
    """How the request mix differs from the fresh run's, in words; "" when it does not: the
    tokens per request, prompt or generated, beyond ``mix_tolerance`` either way, or fewer
    prompt tokens found in the prefix cache (more prefill for the same requests)."""
    for name, words in MIX:
        now, then = getattr(stats, name), fresh.get(name)
        if now and then and max(now / then, then / now) > 1 + s.mix_tolerance:
            return f"{now / then:.2f}x the {words} per request of the fresh run"
    # A baseline kept before tokens per request were: the prompt share, as it was told.
    share, fresh_share = stats.prompt_share, fresh.get("prompt_share")
    if (
        fresh.get("prompt_per_request") is None
        and share is not None
        and fresh_share is not None
        and abs(share - fresh_share) > OLD_MIX_TOLERANCE
    ):
        return f"prompt share {share:.2f} against {fresh_share:.2f} fresh"
    hits, fresh_hits = stats.prefix_hit_ratio, fresh.get("prefix_hit_ratio")
    if hits is not None and fresh_hits is not None and fresh_hits - hits > s.prefix_drop:
        return f"prefix-cache hit ratio {hits:.2f} against {fresh_hits:.2f} fresh"
    return ""


def _demand(stats: WindowStats) -> float:
    """The load asked of the server: arrivals, or completions when it is working off a
    backlog (then it serves more than it is asked, and more than its fresh self did)."""
    return max(stats.arrivals_per_s or 0.0, stats.requests_per_s or 0.0)


def _veto(
    s: DiagnosisSettings,
    stats: WindowStats,
    fresh: Mapping[str, float],
    capacity: Capacity | None,
    throttle: str,
    evidence: dict[str, EvidenceValue],
    symptom: str,
) -> Diagnosis | None:
    """The explanation a restart cannot fix, if one explains the symptom."""
    if throttle:
        return Diagnosis(
            "gpu_throttle",
            f"{symptom}, and the GPU is throttled ({throttle})",
            evidence,
            symptom=symptom,
        )
    mix = mix_change(s, stats, fresh)
    if mix:
        return Diagnosis(
            "load_shift", f"{symptom}, but the request mix changed: {mix}", evidence,
            symptom=symptom,
        )  # fmt: skip
    demand = _demand(stats)
    queueing = (stats.waiting or 0.0) >= s.min_waiting
    if (
        queueing
        and capacity is not None
        and demand > capacity.requests_per_s * (1 + s.load_tolerance)
    ):
        return Diagnosis(
            "load_shift",
            f"{symptom}, but requests queue at {demand:.2f}/s of "
            f"demand, beyond the {capacity.requests_per_s:.2f}/s the fresh server "
            "served",
            evidence,
            symptom=symptom,
        )
    return None


# -- GPUs --------------------------------------------------------------------------------------


def _remember_gpus(
    s: DiagnosisSettings,
    state: DiagnosisState,
    gpus: Sequence[tuple[GpuReading, ...]],
    fresh_clock: float | None,
    now: float,
) -> DiagnosisState:
    """Throttling and faults are seen in some samples only (an XID is reported once); keep
    the latest of each, so it vetoes for as long as it can explain a held symptom. Only
    hardware, driver and unknown XIDs are faults: an application one is what a restart fixes
    (``engine.gpu_faults.XIDS``)."""
    throttled: list[str] = []
    faults: list[str] = []
    for readings in gpus:
        for gpu in readings:
            if _throttled(s, gpu, fresh_clock):
                throttled.append(
                    f"GPU {gpu.index} {'+'.join(gpu.throttled_by)}, SM clock "
                    f"{gpu.sm_clock_mhz:.0f}/{gpu.sm_clock_max_mhz:.0f} MHz"
                )
            faults.extend(
                f"GPU {gpu.index} {describe_xid(xid)}" for xid in gpu.xid_errors if is_fault(xid)
            )
            if gpu.ecc_uncorrected_volatile:
                faults.append(
                    f"GPU {gpu.index} {gpu.ecc_uncorrected_volatile} uncorrectable ECC errors"
                )
    if throttled:
        state = replace(state, throttled_at=now, throttle_note=throttled[-1])
    if faults:
        state = replace(state, fault_at=now, fault_note="; ".join(dict.fromkeys(faults)))
    return state


def _throttled(s: DiagnosisSettings, gpu: GpuReading, fresh_clock: float | None) -> bool:
    """Slowed against the workload's will, and by more than the fresh server was at this
    load (``fresh_clock``: its SM clock / maximum, when known).

    A busy GPU at its power cap runs far below its maximum clock all day (an H200 under a
    full load: 1425 of 1980 MHz at 700 W, recorded in tests/fixtures/gpu), so the power cap
    counts only against the fresh server's clock: alone, it neither explains a slowdown nor
    stops a baseline from being learned. Heat and hardware slowdowns count against the
    maximum clock until the fresh one is known."""
    clock, top = gpu.sm_clock_mhz, gpu.sm_clock_max_mhz
    if not gpu.throttled_by or clock is None or not top:
        return False
    if fresh_clock is None and gpu.throttled_by == ("sw_power_cap",):
        return False
    reference = 1.0 if fresh_clock is None else min(1.0, fresh_clock)
    return clock / top < reference * (1 - s.throttle_clock_drop)


def _throttle(s: DiagnosisSettings, state: DiagnosisState, now: float) -> str:
    """The throttling that can still explain a symptom held for ``hold``, or ""."""
    if state.throttled_at is not None and now - state.throttled_at <= s.hold:
        return state.throttle_note
    return ""


# -- memory ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryTrend:
    """Memory rising with requests served: the fit behind ``host_memory_growth``."""

    grown: float  # bytes, along the fitted line over the requests served in the series
    per_request: float  # bytes per request served (the slope)
    correlation: float
    current: float  # bytes now
    span: float  # seconds covered
    limit: float | None = None  # the unit's MemoryMax; None: unlimited
    # Seconds until ``current`` reaches ``limit`` at the series' mean growth per second (its
    # requests at the rate they came); None without a limit.
    to_limit: float | None = None

    def evidence(self) -> dict[str, EvidenceValue]:
        found: dict[str, EvidenceValue] = {
            "memory_growth_bytes": self.grown,
            "bytes_per_request": self.per_request,
            "memory_correlation": self.correlation,
            "memory_bytes": self.current,
            "memory_span_s": self.span,
        }
        if self.limit is not None and self.to_limit is not None:
            found["memory_max_bytes"] = self.limit
            found["memory_limit_in_s"] = self.to_limit
        return found


def memory_growth(
    s: DiagnosisSettings,
    points: Sequence[MemoryPoint],
    since: float | None = None,
    limit: float | None = None,
) -> MemoryTrend | None:
    """Memory that rises steadily with requests served (a per-request leak), or None.

    A least-squares line of bytes against requests served, over this run's points (those
    from monotonic time ``since`` on; oldest first): it must span ``memory_min_span``,
    follow requests closely (correlation) and have grown ``memory_min_growth``. At most
    ``_FIT_POINTS`` points, evenly spread, enter the fit, so a long series costs no more.
    With ``limit`` (MemoryMax), when the growth reaches it at the series' pace."""
    first = 0 if since is None else _first_from(points, since)
    if len(points) - first < 6 or points[-1].mono - points[first].mono < s.memory_min_span:
        return None
    step = max(1, (len(points) - first) // _FIT_POINTS)
    kept = list(points[first::step])
    if kept[-1] is not points[-1]:
        kept.append(points[-1])
    n = len(kept)
    mean_r = sum(p.requests_served for p in kept) / n
    mean_b = sum(p.bytes for p in kept) / n
    srr = sum((p.requests_served - mean_r) ** 2 for p in kept)
    sbb = sum((p.bytes - mean_b) ** 2 for p in kept)
    srb = sum((p.requests_served - mean_r) * (p.bytes - mean_b) for p in kept)
    if srr <= 0 or sbb <= 0:
        return None
    slope = srb / srr
    correlation = srb / math.sqrt(srr * sbb)
    grown = slope * (kept[-1].requests_served - kept[0].requests_served)
    if slope <= 0 or correlation < s.memory_min_correlation or grown < s.memory_min_growth:
        return None
    span = kept[-1].mono - kept[0].mono
    to_limit = None if limit is None else max(0.0, limit - kept[-1].bytes) * span / grown
    return MemoryTrend(grown, slope, correlation, kept[-1].bytes, span, limit, to_limit)


_FIT_POINTS = 64


def _first_from(points: Sequence[MemoryPoint], since: float) -> int:
    """Index of the first point at or after ``since`` (binary search; bisect's ``key`` needs
    Python 3.10)."""
    low, high = 0, len(points)
    while low < high:
        middle = (low + high) // 2
        if points[middle].mono < since:
            low = middle + 1
        else:
            high = middle
    return low


# -- suggestion --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Advice:
    """One flag change a diagnosis suggests, and why (words with the numbers behind them)."""

    value: FlagValue
    reason: str


def kv_advice(
    capacity: Capacity,
    flags: Mapping[str, FlagValue],
    cache_config: Mapping[str, str],
    *,
    stats: WindowStats | None = None,
    prefix_hit_ratio: float | None = None,
    on_gpu: bool = False,
) -> dict[str, Advice]:
    """Flag changes that give KV more room or ask less of it, for an operator to review, each
    argued: a little more memory for the cache; at most 1.5 times the concurrency the fresh
    server needed at its heaviest clean load (more only preempts); half the prefill chunk;
    prefix caching where the request mix is mostly prompt; CUDA's block size where an
    operator's larger one costs prefix-cache hits. Only values derived from what is known,
    each within the catalogue's limits; unknown never suggests (docs/tuning.md).

    ``flags``: the flags in effect; ``cache_config``: vLLM's ``cache_config_info`` labels;
    ``on_gpu``: NVML saw a GPU (the block size is only suggested there: other platforms pick
    their own, the CPU build 128)."""
    out: dict[str, Advice] = {}
    pressure = (
        f"KV usage {_num(stats.kv_usage)} with {_num(stats.preemptions_per_s)} preemptions/s"
        if stats is not None
        else "KV pressure"
    )
    memory = _number(flags.get("gpu-memory-utilization"))
    if memory is None:
        memory = _number(cache_config.get("gpu_memory_utilization"))
    top = MEMORY_SHARE_TOP
    # vLLM 0.32's --kv-cache-memory-bytes sizes the KV cache itself: the share does not.
    sized = _number(cache_config.get("kv_cache_memory_bytes"))
    if memory is not None and memory < top and not sized:
        share = round(min(top, memory + 0.03), 2)
        out["gpu-memory-utilization"] = Advice(
            share,
            f"{pressure} at a load the fresh server served cleanly: {memory:g} -> {share:g} "
            "gives the KV cache more blocks (what is left after weights and activations is "
            f"KV), the remedy vLLM's preemption warning names; never above {top:g}",
        )
    seqs = _number(flags.get("max-num-seqs"))
    if capacity.running is not None:
        cap = max(8, math.ceil(capacity.running * 1.5 / 8) * 8)
        if seqs is None or cap < seqs:
            was = "no cap set" if seqs is None else f"{seqs:g} allowed"
            out["max-num-seqs"] = Advice(
                cap,
                f"the fresh server ran {capacity.running:.1f} requests at once at its heaviest "
                f"clean load ({capacity.requests_per_s:.2f} requests/s); {cap} (1.5 times that, "
                f"in steps of 8) keeps the batch the KV cache held ({was}): more are admitted "
                "only to be preempted",
            )
    batched = _number(flags.get("max-num-batched-tokens"))
    chunked = flags.get("enable-chunked-prefill")
    length = _number(flags.get("max-model-len"))
    # Without chunked prefill a step must hold a whole prompt: never below --max-model-len,
    # and nothing when that is not known (vLLM refuses to start below it).
    if batched is not None and batched > 2048 and (chunked is not False or length is not None):
        # Never below 2048, nor below the sequences one step must hold.
        sequences = _number(out["max-num-seqs"].value) if "max-num-seqs" in out else seqs
        floor = max(2048, sequences or 1, length if chunked is not True and length else 0)
        chunk = int(max(floor, batched // 2))
        if chunk < batched:
            out["max-num-batched-tokens"] = Advice(
                chunk,
                f"half the prefill chunk ({batched:g} -> {chunk}): a step admits fewer new "
                "prompt tokens into the KV cache at once, so a burst of long prompts preempts "
                "less; never below 2048, --max-num-seqs, nor, without chunked prefill, "
                "--max-model-len",
            )
    caching = _flag_bool(
        flags.get("enable-prefix-caching"), cache_config.get("enable_prefix_caching")
    )
    prompt_share = stats.prompt_share if stats is not None else None
    if caching is False and prompt_share is not None and prompt_share >= PROMPT_HEAVY:
        caching = True
        out["enable-prefix-caching"] = Advice(
            True,
            f"prompt tokens are {prompt_share:.0%} of the tokens processed and prefix caching "
            "is off: a prefix that requests share (a system prompt, a conversation so far) is "
            "prefilled and held in KV once per request instead of once; cached blocks no "
            "request holds count as free, so it takes no KV room from running requests",
        )
    block = _number(flags.get("block-size"))  # only an operator's own choice, never a platform's
    shared = (
        prefix_hit_ratio >= PREFIX_SHARED
        if prefix_hit_ratio is not None
        else prompt_share is not None and prompt_share >= PROMPT_HEAVY
    )
    if on_gpu and caching and block is not None and block > CUDA_BLOCK_SIZE and shared:
        hits = (
            f"{prefix_hit_ratio:.0%} of prompt tokens are prefix-cache hits"
            if prefix_hit_ratio is not None
            else f"prompt tokens are {_num(prompt_share, '.0%')} of the tokens processed"
        )
        out["block-size"] = Advice(
            CUDA_BLOCK_SIZE,
            f"{hits}, and a hit is counted in whole blocks: with --block-size {block:g} each "
            f"shared prefix loses on average {block / 2:g} tokens of hits and each request "
            f"half a block of KV; {CUDA_BLOCK_SIZE} is CUDA's default",
        )
    return out


def _flag_values(data: object) -> dict[str, FlagValue]:
    """A suggestion read back from engine.json: flag names and plain values only."""
    if not isinstance(data, Mapping):
        raise ValueError("due: suggestion must be an object")
    out: dict[str, FlagValue] = {}
    for name, value in data.items():
        if not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"due: suggestion {name!r} must be a number, a boolean or text")
        out[str(name)] = value
    return out


def _flag_bool(value: FlagValue | None, label: str | None) -> bool | None:
    """A boolean flag in effect: as set on the command line, else as cache_config_info shows
    it (``"True"``/``"False"``); None when neither says."""
    if isinstance(value, bool):
        return value
    if label in ("True", "False"):
        return label == "True"
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


# -- words -------------------------------------------------------------------------------------


def _window_evidence(
    stats: WindowStats | None, cmp: Comparison | None, situation: Situation
) -> dict[str, EvidenceValue]:
    out: dict[str, EvidenceValue] = {"regime": situation.regime}
    if situation.engines:
        out["engines"] = "; ".join(e.words() for e in situation.engines)
    if stats is not None:
        out.update(stats.values())
        out["arrivals_per_s"] = stats.arrivals_per_s
        out["window_s"] = stats.seconds
    if cmp is not None:
        out["ratio"] = cmp.ratio
        out["decode_ratio"] = cmp.decode
        out["per_request_ratio"] = cmp.per_request
        out["throughput_ratio"] = cmp.throughput
        out["ttft_ratio"] = cmp.ttft
        for name in (
            "itl", "per_request", "running", "requests_per_s", "prompt_share", "sm_clock_ratio",
            "prompt_per_request", "output_per_request",
        ):  # fmt: skip
            if name in cmp.baseline:
                out["baseline_" + name] = cmp.baseline[name]
    return out


def _quiet_summary(
    s: DiagnosisSettings, state: DiagnosisState, situation: Situation, now: float
) -> str:
    """Why nothing is wrong, or why nothing can be said yet."""
    stats, cmp = situation.stats, situation.comparison
    if stats is None:
        return "learning: not enough samples in this run's window yet"
    if situation.regime == "idle":
        return "idle: no request running, nothing to compare"
    if cmp is None or cmp.ratio is None:
        if situation.learning:
            return f"learning: {situation.learning}"
        return (
            f"unknown baseline: nothing learned at {situation.regime} "
            f"(known: {situation.known or 'none'})"
        )
    if state.speed.pending_since is not None:
        return (
            f"watching: speed {cmp.ratio:.2f} of baseline at {situation.regime} for "
            f"{_minutes(state.speed.held_for(now))} (needs {_minutes(s.hold)})"
        )
    if state.kv.pending_since is not None or state.stranded.pending_since is not None:
        return f"watching: KV signature building up at {situation.regime}"
    # Within the band, what the hysteresis holds decides the word, as it decides the action:
    # a ratio read against the leaving line alone flipped between words at one speed.
    return f"healthy: speed {cmp.ratio:.2f} of baseline at {situation.regime}"


def _num(value: float | None, spec: str = ".2f") -> str:
    return "?" if value is None else format(value, spec)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min"
