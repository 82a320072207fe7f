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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

from vkvagent.engine import gpu_vetoes, liveness
from vkvagent.engine.baseline import Capacity, Comparison, WindowStats
from vkvagent.engine.engines import EngineWindow, lagging_engine
from vkvagent.engine.hysteresis import Hysteresis
from vkvagent.engine.kv import kv_advice, kv_clear, kv_leak, kv_signature, stranded_signature
from vkvagent.engine.liveness import Found
from vkvagent.engine.memory import MemoryPoint, memory_growth
from vkvagent.engine.progress import Progress, Stall
from vkvagent.engine.samples import (
    FlagValue,
    GpuReading,
    Sample,
    num_text,
    optional_float,
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
    # The active probe (vkvagent.adapters.probe) is wanted once no token or step has moved for this
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

    speed: Hysteresis = field(default_factory=Hysteresis)
    kv: Hysteresis = field(default_factory=Hysteresis)
    stranded: Hysteresis = field(default_factory=Hysteresis)
    # One data-parallel engine far behind the others:
    lagging: Hysteresis = field(default_factory=Hysteresis)
    # KV blocks held beyond what the running requests take:
    leak: Hysteresis = field(default_factory=Hysteresis)
    progress: Progress = field(default_factory=Progress)
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


# -- inputs and result -------------------------------------------------------------------------


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
    stall: Stall = field(default_factory=Stall)
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
    # load this run has not learned (carry.CARRY_SPEED).
    baseline_of: str = "this run's"
    engines: Sequence[EngineWindow] = ()  # each data-parallel engine over the window (2 or more)
    prefix_hit_ratio: float | None = None  # prefix-cache hits / queries over the window
    time: float | None = None  # UTC Unix seconds of the latest sample (for people)
    # The fresh server's medians (METRICS) to tell another request mix and a KV leak by: the
    # compared regime's, else the fresh capacity's (per request, neither depends much on the
    # load).
    fresh: Mapping[str, float] = field(default_factory=dict)


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
    state = gpu_vetoes.remember(s, state, situation.gpus, fresh_clock, now)
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
    lagging = lagging_engine(s, situation.engines, s.leave_ratio)
    if situation.engines:
        entering = lagging_engine(s, situation.engines, s.enter_ratio) is not None
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

    throttle = gpu_vetoes.throttle(s, state, now)
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
            f"{num_text(stats.waiting, '.1f')} requests wait while KV usage is "
            f"{num_text(stats.kv_usage)}, serving {num_text(stats.generation_tokens_per_s, '.0f')}"
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

    leak = kv_leak(s, stats, situation.fresh, capacity, state.heaviest)
    if state.leak.active and leak is not None and stats is not None and capacity is not None:
        evidence["kv_leaked"] = leak.leaked
        evidence["kv_leak_loss"] = leak.loss
        symptom = (
            f"{leak.leaked:.0%} of the KV cache held beyond what {num_text(stats.running, '.1f')} "
            f"running requests take at their fresh share (KV usage {num_text(stats.kv_usage)}); "
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
    kv = None if stats is None else kv_signature(s, stats)
    kv_gone = None if stats is None else kv_clear(s, stats)
    stranded = stranded_signature(s, stats, capacity)
    # Under pressure (preempting) the cache is full whatever leaks: the storm is its own
    # symptom, and a leak is told only by a server not preempting.
    calm = stats is not None and (stats.preemptions_per_s or 0.0) < s.min_preemptions_per_s
    heaviest = state.heaviest
    if stats is not None and calm and (stats.waiting or 0.0) < 0.5:
        heaviest = max(heaviest or 0.0, _demand(stats))
    leak = kv_leak(s, stats, fresh, capacity, heaviest)
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
        f"KV usage {num_text(stats.kv_usage)}, {num_text(stats.preemptions_per_s)} "
        f"preemptions/s, {num_text(stats.waiting, '.1f')} waiting, for "
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


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min"
