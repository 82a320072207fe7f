"""The decision engine: ``decide(settings, state, observed, now) -> Decision``.

One pure function shared by the daemon, replay, the demo and the benchmark: baseline, then
diagnosis, then policy. Everything it needs comes in as values (recent samples, the unit's
state and memory, the restart history, the operator's pause/resume, ``now``); everything it
concludes goes out as a value, including why it did not act and the state to pass to the next
call (this run's baseline, the held symptoms, the stall clock). It reads no clock, does no I/O
and keeps nothing between calls; ``EngineState.to_json`` is what a caller persists.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from vkvagent.engine import carry, policy
from vkvagent.engine.baseline import (
    Baseline,
    BaselineSettings,
    Comparison,
    WindowStats,
    compare,
    regime_label,
    regime_of,
    window_stats,
)
from vkvagent.engine.diagnosis import (
    Diagnosis,
    DiagnosisSettings,
    DiagnosisState,
    Evidence,
    EvidenceValue,
    Situation,
    diagnose,
)
from vkvagent.engine.engines import engine_windows
from vkvagent.engine.liveness import LivenessSettings, LivenessState, judge, observe
from vkvagent.engine.memory import MemoryPoint
from vkvagent.engine.policy import Controls, PolicySettings, RestartRecord
from vkvagent.engine.prevention import (
    DEFAULT_OUTAGE,
    Plan,
    PreventionSettings,
    Track,
    decline,
    ended,
    judged,
    plan,
)
from vkvagent.engine.progress import ProbeFacts, Stall
from vkvagent.engine.rates import counters, is_reset
from vkvagent.engine.samples import (
    FlagValue,
    GpuReading,
    Sample,
    VllmMetrics,
    optional_float,
    utc_text,
)
from vkvagent.engine.slo import Budget, SloSettings, SloState, count_samples
from vkvagent.engine.traffic import TrafficProfile

ACTIONS = ("restart", "hold", "none")


@dataclass(frozen=True)
class Settings:
    """The engine's settings, one part per stage."""

    baseline: BaselineSettings = field(default_factory=BaselineSettings)
    diagnosis: DiagnosisSettings = field(default_factory=DiagnosisSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    prevention: PreventionSettings = field(default_factory=PreventionSettings)
    slo: SloSettings = field(default_factory=SloSettings)
    liveness: LivenessSettings = field(default_factory=LivenessSettings)


@dataclass(frozen=True)
class Observation:
    """What the caller observed, up to ``now``.

    ``samples``: the recent samples, oldest first, covering at least the baseline window
    (more is harmless: only the trailing window is summarised; samples already seen by an
    earlier call are recognised by their monotonic time). ``memory``: the unit's memory
    (systemd's MemoryCurrent) with ``request_success_total`` at the same moment, oldest first,
    since this vLLM run began (earlier points are ignored); one point a minute is plenty.
    """

    samples: Sequence[Sample]
    unit_active: bool | None = None  # systemd ActiveState == "active"; None: not known
    unit_started: float | None = None  # UTC when the unit became active: uptime fallback
    memory: Sequence[MemoryPoint] = ()
    restarts: Sequence[RestartRecord] = ()
    controls: Controls = field(default_factory=Controls)
    flags: Mapping[str, FlagValue] = field(default_factory=dict)  # vLLM flags in effect
    probe: ProbeFacts = field(default_factory=ProbeFacts)  # the active probe's findings
    # A flag change waiting for a restart ("apply --max-num-seqs 64"): with nothing to fix,
    # the policy proposes one for it, in a window like a scheduled restart. Empty: none.
    flags_due: str = ""
    # For a rollback in ``flags_due``: the fresh speed the change gave, over the one before
    # it (the flags loop's judgement); the rest is lost until it is rolled back. None: not a
    # rollback, or not judged.
    flags_slower: float | None = None
    # The unit was stopped on purpose (systemd's line for a stop job someone asked for, or a
    # kill on a client's request, since it last became active): a down unit is left down.
    # "": nobody did.
    stopped: str = ""
    # vLLM's own error line from the journal of the run that ended, for the evidence; "": none.
    exit_line: str = ""
    # The cured runs other hosts of the fleet published (prevention's evidence), for a host
    # with too few of its own: ``prevention.plan``'s ``peers``.
    peer_runs: Sequence[Track] = ()
    # Their fresh baselines of this server (each run named ``RUN@HOST``), to stand in at loads
    # this run has not learned when its previous run cannot (``carry.stand_in``).
    peer_baselines: Sequence[Baseline] = ()


@dataclass(frozen=True)
class RunState:
    """Which vLLM run the samples belong to, and how far they have been read."""

    key: str | None = None  # "start:<process_start_time>" or "mono:<first sample>"
    started: float | None = None  # process_start_time (UTC), when the page has it
    first_mono: float | None = None  # monotonic time of the run's first sample seen
    cursor: float | None = None  # monotonic time of the last sample read
    counters: tuple[float | None, ...] = ()  # that sample's cumulative counters

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "started": self.started,
            "first_mono": self.first_mono,
            "cursor": self.cursor,
            "counters": list(self.counters),
        }

    @classmethod
    def from_json(cls, data: Any) -> RunState:
        return cls(
            key=None if data["key"] is None else str(data["key"]),
            started=optional_float(data["started"]),
            first_mono=optional_float(data["first_mono"]),
            cursor=optional_float(data["cursor"]),
            counters=tuple(optional_float(v) for v in data["counters"]),
        )


@dataclass(frozen=True)
class EngineState:
    """Everything carried from one call to the next (persist it with ``to_json``)."""

    run: RunState = field(default_factory=RunState)
    baseline: Baseline | None = None  # this run's
    # The last run's: to judge whether a restart helped, and to stand in at loads this run
    # has not learned (``carry.carried``).
    previous: Baseline | None = None
    diagnosis: DiagnosisState = field(default_factory=DiagnosisState)
    recovered: bool | None = None  # did this run's fresh speed match the previous run's
    seen: float | None = None  # monotonic time of the newest sample read, valid or not
    traffic: TrafficProfile = field(default_factory=TrafficProfile)  # for the percentile gate
    track: Track | None = None  # this run's speed by uptime
    past: tuple[Track, ...] = ()  # earlier runs that ended due for uptime_decline
    slo: SloState = field(default_factory=SloState)  # the objectives' tallies
    liveness: LivenessState = field(default_factory=LivenessState)  # exits and starts seen
    # The prevention plan from ``past``, and the hour (UTC) it was made for: derived from
    # them alone, so neither persisted nor compared.
    plan: Plan | None = field(default=None, compare=False)
    planned_at: float | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 2,
            "run": self.run.to_json(),
            "baseline": self.baseline.to_json() if self.baseline else None,
            "previous": self.previous.to_json() if self.previous else None,
            "diagnosis": self.diagnosis.to_json(),
            "recovered": self.recovered,
            "seen": self.seen,
            "traffic": self.traffic.to_json(),
            "track": self.track.to_json() if self.track else None,
            "past": [t.to_json() for t in self.past],
            "slo": self.slo.to_json(),
            "liveness": self.liveness.to_json(),
        }

    @classmethod
    def from_json(cls, data: Any) -> EngineState:
        """The inverse of ``to_json``; ValueError (one line) for anything malformed, so a
        corrupt state file costs the learned baselines, never the daemon."""
        try:
            if data.get("version") not in (1, 2):
                raise ValueError(f"unknown version {data.get('version')!r}")
            # Version 1 held the symptoms' times on the wall clock: they start over.
            diagnosis = (
                DiagnosisState.from_json(data["diagnosis"])
                if data["version"] == 2
                else DiagnosisState()
            )
            recovered = data["recovered"]
            if recovered is not None and not isinstance(recovered, bool):
                raise ValueError("recovered must be true, false or null")
            return cls(
                run=RunState.from_json(data["run"]),
                baseline=Baseline.from_json(data["baseline"]) if data["baseline"] else None,
                previous=Baseline.from_json(data["previous"]) if data["previous"] else None,
                diagnosis=diagnosis,
                recovered=recovered,
                seen=optional_float(data["seen"]),
                # States written before the percentile gate have no profile: start one.
                traffic=(
                    TrafficProfile.from_json(data["traffic"])
                    if data.get("traffic") is not None
                    else TrafficProfile()
                ),
                # States written before prevention have no tracks: they start now.
                track=Track.from_json(data["track"]) if data.get("track") else None,
                past=tuple(Track.from_json(t) for t in data.get("past") or ()),
                # States written before [slo] have no tallies: counting starts now.
                slo=SloState.from_json(data["slo"]) if data.get("slo") else SloState(),
                liveness=(
                    LivenessState.from_json(data["liveness"])
                    if data.get("liveness")
                    else LivenessState()
                ),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"engine state: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class Decision:
    """One evaluation's outcome. ``action``: restart (act now), hold (a restart would help or
    a symptom is present, but ``reason`` blocks it) or none (nothing to do). ``reason`` always
    says why, starting with the deciding word ("restart", "outside window", "cooldown",
    "budget", "vetoed", "unknown baseline", "observe mode", "healthy", ...)."""

    time: datetime
    action: str
    cause: str | None
    reason: str
    evidence: Evidence
    ratio: float | None  # current speed / the fresh baseline at the same regime (this run's,
    # or the previous run's at a load this run has not learned: evidence baseline_run)
    window_open: bool
    next_window: datetime | None
    uptime: float | None
    state: EngineState
    suggestion: Mapping[str, FlagValue] = field(default_factory=dict)  # kv_pressure flags
    suggestion_reasons: Mapping[str, str] = field(default_factory=dict)  # why each one
    recovered: bool | None = None  # whether the last restart restored the fresh speed
    drain_max_in_flight: int | None = None  # for a restart; None: do not drain (emergency)
    # The engine's counters have not moved for probe_after: only a request can tell idle from
    # hung, so the caller should send the active probe (replay, which has none, says so).
    probe_wanted: bool = False
    # How long the engine has had work without progress (``Stall.seconds``); 0 when it
    # progresses or is idle. The stall is a cause only from stall_after; readiness uses it
    # at once.
    stalled_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The decision as replay's JSON prints it (the state is persisted separately)."""
        return {
            "time": utc_text(self.time.timestamp()),
            "action": self.action,
            "cause": self.cause,
            "reason": self.reason,
            "window_open": self.window_open,
            "next_window": utc_text(self.next_window.timestamp()) if self.next_window else None,
            "ratio": _rounded(self.ratio),
            "enter_ratio": _rounded(self.band[0]) if self.band else None,
            "leave_ratio": _rounded(self.band[1]) if self.band else None,
            "uptime": _rounded(self.uptime),
            "evidence": {k: _rounded(v) for k, v in self.evidence.items()},
            "suggestion": dict(self.suggestion),
            "recovered": self.recovered,
            "drain_max_in_flight": self.drain_max_in_flight,
            "probe_wanted": self.probe_wanted,
        }

    @property
    def band(self) -> tuple[float, float] | None:
        """The hysteresis band ``ratio`` is judged by: slow below the first, back above the
        second (the [diagnosis] ratios, or the trend's in a declining run); None without a
        ratio."""
        enter, leave = self.evidence.get("enter_ratio"), self.evidence.get("leave_ratio")
        if self.ratio is None or not isinstance(enter, float) or not isinstance(leave, float):
            return None  # (the engine writes both as floats)
        return enter, leave

    def key(self) -> tuple[Any, ...]:
        """What makes a decision worth showing again: its action, cause, reason's head and
        run. A reason's numbers change every tick; its head names the situation."""
        found = _REASON_HEAD.match(self.reason)
        head = found.group().strip() if found else self.reason
        return self.action, self.cause, head, self.evidence.get("run")


_REASON_HEAD = re.compile(r"^[A-Za-z _-]+(?::[A-Za-z _-]+)?")


def _rounded(value: EvidenceValue) -> EvidenceValue:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    return value


def decide(
    settings: Settings, state: EngineState, observed: Observation, now: datetime
) -> Decision:
    """Evaluate once. ``now`` must be timezone-aware; ``state`` is the previous decision's
    (``EngineState()`` the first time)."""
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("decide: now must be a timezone-aware datetime")
    b, d = settings.baseline, settings.diagnosis
    state = _after_reboot(state, observed.samples)
    fresh = [s for s in observed.samples if state.seen is None or s.mono > state.seen]
    # Durations (held symptoms, the stall, silence, restarts' ages) run on the samples'
    # monotonic clock; the wall clock only places windows and hours of the day.
    mono = observed.samples[-1].mono if observed.samples else now.timestamp()
    heard = state.diagnosis
    for sample in fresh:
        heard = heard.heard(sample)
    state = replace(
        state,
        diagnosis=heard,
        liveness=observe(settings.liveness, state.liveness, fresh, stopped=observed.stopped),
    )
    valid = _ordered(observed.samples)
    state = _read_samples(settings, state, valid)
    latest = valid[-1] if valid else None
    segment = _segment(valid, b.window)
    stats = _stats(segment, b)
    uptime = _uptime(state.run, latest, observed.unit_started)

    baseline = state.baseline or Baseline(run=state.run.key or "none")
    if not baseline.server and latest is not None and latest.vllm is not None:
        baseline = replace(baseline, server=carry.server_identity(latest.vllm, observed.flags))
    if baseline.seen_from is None and not baseline.regimes and uptime is not None:
        baseline = replace(baseline, seen_from=uptime)
    key = regime_of(stats, b) if stats else None
    # What this server does when fresh: this run's baselines, and at the loads it has not
    # learned, the previous run's or a peer's where they may stand in (``carry.stand_in``).
    standing = carry.stand_in(settings, (state.previous, *observed.peer_baselines), baseline)
    carried = carry.merged(settings, standing)
    reference = baseline if carried is None else baseline.merged(carried, b)
    regime = reference.known(key, b)
    # A load no fresh run learned: the speed the learned loads imply; not while this run is
    # fresh and may learn it itself.
    modelled = regime is None and stats is not None and not _fresh(b, baseline, uptime)
    if modelled:
        regime = reference.modelled(stats.generation_tokens_per_s if stats else None, b)
    own = baseline.known(key, b)
    borrowed = (
        carry.supplier(settings, standing, key)
        if standing and regime is not None and own is None
        else None
    )
    comparison = compare(stats, key, regime) if stats and regime and key is not None else None
    capacity = reference.capacity(b)
    down, dead = _down(observed), None
    if down is not None:
        dead, note = judge(
            settings.liveness,
            state.liveness,
            observed.samples[-1] if observed.samples else None,
            stopped=observed.stopped,
            exit_line=observed.exit_line,
            answered_at=state.diagnosis.answered_at,
            mono=mono,
        )
        down = f"{down}; {note}" if note else down
    situation = Situation(
        stats=stats,
        comparison=comparison,
        regime="idle" if key is None else regime_label(key, b),
        known=", ".join(regime_label(k, b) for k in baseline.known_keys(b)),
        learning=_learning(b, baseline, uptime),
        capacity=capacity,
        gpus=[s.gpus for s in fresh],
        stall=(
            state.diagnosis.progress.stalled(latest.vllm, latest.mono, observed.probe)
            if latest is not None and latest.vllm is not None
            else Stall()
        ),
        unresponsive=_unresponsive(d, state.diagnosis, observed, mono),
        memory=observed.memory,
        memory_limit=_memory_limit(observed.samples),
        run_began=latest.mono - uptime if latest is not None and uptime is not None else None,
        decline=decline(state.track, uptime),
        down=down,
        liveness=dead,
        flags=observed.flags,
        cache_config=latest.vllm.cache_config if latest is not None and latest.vllm else {},
        baseline_of=_baseline_of(b, baseline, borrowed, modelled and regime is not None),
        engines=engine_windows(segment) if stats is not None else (),
        prefix_hit_ratio=stats.prefix_hit_ratio if stats is not None else None,
        time=latest.time if latest is not None else None,
        fresh=(
            comparison.baseline
            if comparison is not None
            else reference.regimes[capacity.regime].medians
            if capacity is not None
            else {}
        ),
    )
    diagnosis, dstate = diagnose(d, state.diagnosis, situation, mono)

    quiet = (
        diagnosis.cause is None
        and dstate.speed.pending_since is None
        and dstate.kv.pending_since is None
        and dstate.leak.pending_since is None
        and (dstate.throttled_at is None or mono - dstate.throttled_at > d.hold)
    )
    if stats is not None and latest is not None and quiet:
        baseline = baseline.learn(stats, mono=latest.mono, uptime=uptime, settings=b)
    recovered = state.recovered
    past = state.past
    if recovered is None and state.previous is not None:
        recovered, speedup = carry.restored(settings, state.previous, baseline)
        if recovered is not None and state.run.key is not None:
            past = judged(past, state.run.key, recovered, speedup)
    seen = max((s.mono for s in fresh), default=state.seen)
    traffic = state.traffic
    if stats is not None and stats.requests_per_s is not None:
        traffic = traffic.record(stats.requests_per_s, now, settings.policy.zone)
    track = state.track or Track(run=state.run.key or "none")
    late = borrowed is None and baseline.late(b)  # the speed is against a late baseline
    speed = _speed_at_load(b, reference, stats, comparison)
    if (
        speed is not None
        and uptime is not None
        and diagnosis.cause in (None, "uptime_decline")
        and (late == track.late or not track.buckets)  # a track's points are of one kind
    ):
        track = replace(track.add(uptime, speed), late=late)
    state = replace(
        state, baseline=baseline, diagnosis=dstate, recovered=recovered, seen=seen,
        traffic=traffic, track=replace(track, server=baseline.server), past=past,
        planned_at=state.planned_at if past is state.past else None,
    )  # fmt: skip
    state = _planned(settings.prevention, state, now.timestamp(), observed.peer_runs)
    if settings.slo.declared:
        slo = count_samples(
            settings.slo,
            state.slo,
            observed,
            fresh,
            stalled=diagnosis.cause == "stall",
            unresponsive=diagnosis.cause == "unresponsive",
            down_rate=_expected_rate(settings.policy, state, now),
            fresh_run=_fresh(b, baseline, uptime) and baseline.busy_from is not None,
            rate=stats.requests_per_s if stats else None,
            halted=situation.stall.seconds > 0 or diagnosis.cause in ("stall", "unresponsive"),
        )
        state = replace(state, slo=slo)

    verdict = policy.evaluate(
        settings.policy,
        cause=diagnosis.cause,
        wanted=diagnosis.fixable,
        uptime=uptime,
        request_rate=stats.requests_per_s if stats else None,
        history=observed.restarts,
        controls=observed.controls,
        now=now,
        mono=mono,
        traffic=traffic,
        flags_due=observed.flags_due,
        plan=state.plan,
        loss=_loss(dstate, comparison, diagnosis, observed),
        harm_in=diagnosis.harm_in,
        budget=_budget(settings, state, stats, now, uptime) if settings.slo.declared else None,
        crash_window=settings.liveness.crash_loop_window,
    )
    action, reason = _action(
        settings.policy, diagnosis, verdict, uptime, observed.flags_due, state.plan
    )
    evidence = dict(diagnosis.evidence)
    evidence["uptime_s"] = uptime
    evidence["run"] = state.run.key
    if borrowed is not None and comparison is not None:
        evidence["baseline_run"] = borrowed
    if modelled and comparison is not None:
        evidence["baseline_modelled"] = True
    if state.plan is not None:
        evidence.update(state.plan.evidence())
    return Decision(
        time=now,
        action=action,
        cause=verdict.cause if verdict.cause in policy.PLANNED else diagnosis.cause,
        reason=reason,
        evidence=evidence,
        ratio=comparison.ratio if comparison and diagnosis.cause != "engine_down" else None,
        window_open=verdict.window_open,
        next_window=verdict.next_window,
        uptime=uptime,
        state=state,
        suggestion=diagnosis.suggestion,
        suggestion_reasons=diagnosis.reasons,
        recovered=recovered,
        drain_max_in_flight=verdict.drain_max_in_flight if action == "restart" else None,
        probe_wanted=_probe_wanted(d, dstate, observed, latest, mono),
        stalled_s=situation.stall.seconds,
    )


def _action(
    settings: PolicySettings,
    diagnosis: Diagnosis,
    verdict: policy.Verdict,
    uptime: float | None,
    flags_due: str,
    plan: Plan | None,
) -> tuple[str, str]:
    """Combine what diagnosis found with what the policy allows into (action, reason)."""
    if settings.mode == "off":
        return "none", verdict.reason
    if verdict.cause == policy.FLAGS:
        return verdict.action, f"{verdict.reason}; flags: {flags_due}"
    if verdict.cause == policy.PREVENTION and plan is not None:
        return verdict.action, f"{verdict.reason}; prevention: {plan.words()}"
    if verdict.cause == policy.SCHEDULED:
        why = f"scheduled: uptime {(uptime or 0) / 3600:.1f} h >= {settings.max_uptime / 3600:g} h"
        return verdict.action, f"{verdict.reason}; {why}"
    if diagnosis.fixable:
        return verdict.action, f"{verdict.reason}; {diagnosis.cause}: {diagnosis.summary}"
    if diagnosis.reported:
        return "none", f"reported: {diagnosis.cause}: {diagnosis.summary}"
    if diagnosis.vetoed:
        action = "hold" if diagnosis.symptom else "none"
        return action, f"vetoed: {diagnosis.cause}: {diagnosis.summary}"
    return "none", diagnosis.summary


# -- reading samples ---------------------------------------------------------------------------


def _ordered(samples: Sequence[Sample]) -> list[Sample]:
    """Valid samples in increasing monotonic time (a repeated or earlier time is dropped)."""
    out: list[Sample] = []
    for sample in samples:
        if sample.vllm is not None and (not out or sample.mono > out[-1].mono):
            out.append(sample)
    return out


def _after_reboot(state: EngineState, samples: Sequence[Sample]) -> EngineState:
    """A persisted state read after the host rebooted: the monotonic clock began again, so
    every sample looks older than the last one read. Forget how far samples were read and
    every time held on the old clock (symptoms, GPU faults: a reboot resets the GPUs too); the
    run itself is then recognised (or not) by its process start time and counters."""
    if not samples or state.seen is None or max(s.mono for s in samples) >= state.seen:
        return state
    return replace(
        state,
        seen=None,
        run=replace(state.run, cursor=None),
        diagnosis=DiagnosisState(),
        liveness=state.liveness.forget_monotonic(),
    )


def _read_samples(settings: Settings, state: EngineState, valid: list[Sample]) -> EngineState:
    """Advance the run tracking and the stall clock over the samples not read before. A new
    process start time or a counter going down starts a new run (and a new baseline)."""
    run, progress = state.run, state.diagnosis.progress
    for index, sample in enumerate(valid):
        if run.cursor is not None and sample.mono <= run.cursor:
            continue
        metrics = sample.vllm
        assert metrics is not None
        before = valid[index - 1].vllm if index > 0 else None
        restarted = is_reset(before, metrics) if before is not None else _differs(run, metrics)
        if run.key is None or restarted:
            state = _new_run(
                settings, replace(state, diagnosis=replace(state.diagnosis, progress=progress)),
                sample,
            )  # fmt: skip
            run, progress, before = state.run, state.diagnosis.progress, None
        progress = progress.observe(before, metrics, sample.mono)
        run = replace(
            run,
            cursor=sample.mono,
            counters=counters(metrics),
            started=metrics.process_start_time or run.started,
        )
    return replace(state, run=run, diagnosis=replace(state.diagnosis, progress=progress))


def _differs(run: RunState, metrics: VllmMetrics) -> bool:
    """Whether a sample with no predecessor in the window belongs to another run than the
    last one read (compared with what was kept of it)."""
    if run.key is None:
        return False
    start = metrics.process_start_time
    if start is not None and run.started is not None and start != run.started:
        return True
    return any(
        old is not None and new is not None and new < old
        for old, new in zip(run.counters, counters(metrics))
    )


def _new_run(settings: Settings, state: EngineState, sample: Sample) -> EngineState:
    """A new vLLM run: its fresh baseline starts empty, and the one it is judged by is the
    last run's, with the earlier runs' loads that run matched (``carry.carried``): the fresh runs
    of one server pass on what each learned, as long as each agrees with the one before."""
    metrics = sample.vllm
    assert metrics is not None
    start = metrics.process_start_time
    key = f"start:{start:.3f}" if start is not None else f"mono:{sample.mono:.3f}"
    old = state.baseline
    keep = state.previous
    if old is not None and old.regimes:
        carried = carry.carried(settings, state.previous, old)
        keep = old if carried is None else old.merged(carried, settings.baseline)
    past = state.past
    due = state.diagnosis.due
    if state.track is not None and due is not None and due.cause == "uptime_decline":
        gap = sample.mono - state.run.cursor if state.run.cursor is not None else None
        past = ended(past, state.track, key, sample.time, gap)
    return EngineState(
        run=RunState(key=key, started=start, first_mono=sample.mono),
        baseline=Baseline(run=key),
        previous=keep if state.run.key is not None else state.previous,
        diagnosis=state.diagnosis.for_new_run(),
        recovered=None,
        seen=state.seen,
        traffic=state.traffic,
        past=past,  # the plan is made again: another run may be another server
        slo=state.slo,
        liveness=state.liveness,  # exits and starts span runs: a crash loop is many
    )


def _segment(valid: list[Sample], window: float) -> list[Sample]:
    """The trailing ``window`` seconds of this run: samples after the last restart."""
    if not valid:
        return []
    newest = valid[-1].mono
    first = len(valid) - 1
    while first > 0 and newest - valid[first - 1].mono <= window:
        before, after = valid[first - 1].vllm, valid[first].vllm
        assert before is not None and after is not None
        if is_reset(before, after):
            break
        first -= 1
    return valid[first:]


def _stats(segment: list[Sample], settings: BaselineSettings) -> WindowStats | None:
    """The window's statistics, when it covers at least half the configured window."""
    if len(segment) < 2 or segment[-1].mono - segment[0].mono < settings.window / 2:
        return None
    points = [(s.mono, s.vllm) for s in segment if s.vllm is not None]
    stats = window_stats(points, settings.min_running)
    clocks = [c for c in (_slowest_clock(s.gpus) for s in segment) if c is not None]
    if stats is None or not clocks:
        return stats
    return replace(stats, sm_clock_ratio=sum(clocks) / len(clocks))


def _slowest_clock(gpus: Sequence[GpuReading]) -> float | None:
    """The lowest SM clock / maximum among the GPUs (the slowest bounds the engine)."""
    ratios = [
        g.sm_clock_mhz / g.sm_clock_max_mhz
        for g in gpus
        if g.sm_clock_mhz is not None and g.sm_clock_max_mhz
    ]
    return min(ratios) if ratios else None


def _uptime(run: RunState, latest: Sample | None, unit_started: float | None) -> float | None:
    """Seconds since the vLLM process started: from its start time when the page has it,
    else from the unit's start, else from the first sample of the run."""
    if latest is None:
        return None
    if run.started is not None:
        return max(0.0, latest.time - run.started)
    if unit_started is not None:
        return max(0.0, latest.time - unit_started)
    if run.first_mono is not None:
        return latest.mono - run.first_mono
    return None


def _unresponsive(
    s: DiagnosisSettings, state: DiagnosisState, observed: Observation, mono: float
) -> str | None:
    """vLLM, active and past its start-up (it answered since the unit became active: a model
    still loading has not, and refuses connections anyway), accepting connections on /metrics
    without answering for ``unresponsive_after``: a hung API server. None otherwise."""
    if observed.unit_active is not True or state.silent_since is None:
        return None
    silent = mono - state.silent_since
    if silent < s.unresponsive_after or state.answered_at is None:
        return None
    if observed.unit_started is not None and state.answered_at < observed.unit_started:
        return None
    error = observed.samples[-1].vllm_error if observed.samples else None
    return (
        f"vLLM accepts connections but has not answered /metrics for {silent:.0f} s "
        f"(limit {s.unresponsive_after:.0f} s) while its unit is active: {error or 'no answer'}"
    )


def _probe_wanted(
    s: DiagnosisSettings,
    state: DiagnosisState,
    observed: Observation,
    latest: Sample | None,
    mono: float,
) -> bool:
    """Whether a probe should go now: vLLM answers /metrics, its counters have not moved for
    ``probe_after`` (idle, or hung behind gauges that still read the last values), and no probe
    went in that time."""
    advanced = state.progress.advanced
    if s.probe_after <= 0 or latest is None or latest.mono != mono or advanced is None:
        return False
    if observed.unit_active is False or mono - advanced < s.probe_after:
        return False
    last = observed.probe.last_sent
    return last is None or mono - last >= s.probe_after


def _down(observed: Observation) -> str | None:
    if observed.unit_active is False:
        return "the unit is not active"
    if not observed.samples:
        return "no sample"
    last = observed.samples[-1]
    if last.vllm is None:
        return f"/metrics unreachable: {last.vllm_error or 'no valid sample'}"
    return None


def _expected_rate(policy: PolicySettings, state: EngineState, now: datetime) -> float | None:
    """The requests/s this host's clients send at this local hour (its median, once the
    traffic profile knows the hour), else the rate last seen."""
    hour = now.astimezone(policy.zone).hour
    typical = state.traffic.median(hour)
    return typical if typical is not None else state.slo.last_rate


def _budget(
    settings: Settings,
    state: EngineState,
    stats: WindowStats | None,
    now: datetime,
    uptime: float | None = None,
) -> Budget:
    """What a restart now would cost in the objectives' budgets: the requests this host sends
    now (the window's rate, else this hour's usual one) refused for the restart's outage and
    drain; and what it saves, from this run's ``uptime`` on."""
    rate = stats.requests_per_s if stats is not None else None
    plan = state.plan
    outage = plan.outage if plan is not None else DEFAULT_OUTAGE
    # A drain refuses new requests until the longest in flight is done: about twice the
    # mean answer at this ITL, up to the drain's limit. An outage measured between two runs
    # (from the last sample before the restart) holds its drain already.
    measured = plan is not None and plan.measured
    if not measured and stats is not None and stats.output_per_request and stats.itl:
        outage += min(settings.policy.drain_timeout, 2 * stats.output_per_request * stats.itl)
    return Budget(
        settings.slo,
        state.slo,
        now.timestamp(),
        rate if rate is not None else _expected_rate(settings.policy, state, now),
        outage,
        now.timestamp() - uptime if uptime is not None else None,
    )


# The plan is made again every hour on the hour (evidence ages), and whenever the past runs
# change: for the hour, not the moment, so a state loaded mid-hour plans as replay does.
PLAN_EVERY = 3600.0


def _planned(
    settings: PreventionSettings, state: EngineState, now: float, peers: Sequence[Track]
) -> EngineState:
    """The state with its prevention plan up to date (a plan costs milliseconds: not every
    tick); the peers' runs that arrived since count at the next hour."""
    hour = math.floor(now / PLAN_EVERY) * PLAN_EVERY
    if state.planned_at == hour:
        return state
    server = state.baseline.server if state.baseline is not None else ""
    found = plan(settings, state.past, server, hour, current=state.track, peers=peers)
    return replace(state, plan=found, planned_at=hour)


def _loss(
    state: DiagnosisState,
    comparison: Comparison | None,
    diagnosis: Diagnosis,
    observed: Observation,
) -> float | None:
    """The share of its fresh speed the server is losing to what a restart would end: a run
    diagnosed ``uptime_decline`` (now, or as last measured when nothing compares now: idle,
    an unlearned load), or, with nothing wrong, slower flags due for a rollback; for a
    leaking KV cache, the share of the heaviest load this run served cleanly that it no
    longer holds."""
    cause = diagnosis.cause
    if cause is None and observed.flags_due and observed.flags_slower is not None:
        return max(0.0, 1.0 - observed.flags_slower)
    if cause == "kv_pressure":
        leak = diagnosis.evidence.get("kv_leak_loss")
        return float(leak) if isinstance(leak, float) else None
    if cause != "uptime_decline":
        return None
    ratio = comparison.ratio if comparison is not None else None
    if ratio is None and state.due is not None:
        ratio = state.due.ratio
    return None if ratio is None else max(0.0, 1.0 - ratio)


def _speed_at_load(
    settings: BaselineSettings,
    reference: Baseline,
    stats: WindowStats | None,
    comparison: Comparison | None,
) -> float | None:
    """The speed ratio of ``comparison``, against the fresh speed at exactly this load where
    the learned loads imply it (``Baseline.at_load``), not the regime's median: so a morning's
    rising load is not a decline with uptime."""
    if stats is None or comparison is None or comparison.ratio is None:
        return None
    exact = reference.at_load(stats.generation_tokens_per_s, settings)
    ratio = compare(stats, comparison.regime, exact).ratio if exact is not None else None
    return comparison.ratio if ratio is None else ratio


def _memory_limit(samples: Sequence[Sample]) -> float | None:
    """The unit's MemoryMax as last read: a sample whose unit could not be read (a D-Bus
    error) leaves it as it was."""
    for sample in reversed(samples):
        if sample.unit is not None:
            limit = sample.unit.memory_max_bytes
            return None if limit is None else float(limit)
    return None


def _learning(settings: BaselineSettings, baseline: Baseline, uptime: float | None) -> str:
    if uptime is None:
        return ""
    ready = settings.warmup + settings.window / 2
    if uptime < ready:
        return f"warm-up: uptime {uptime / 60:.0f} min, baseline from {ready / 60:.0f} min"
    if baseline.busy_from is None:
        return f"waiting for load to learn this run's baseline (uptime {uptime / 60:.0f} min)"
    if uptime <= baseline.busy_from + settings.learn_for and not baseline.known_keys(settings):
        return f"collecting this run's baseline (uptime {uptime / 60:.0f} min)"
    return ""


def _fresh(settings: BaselineSettings, baseline: Baseline, uptime: float | None) -> bool:
    return uptime is not None and uptime <= baseline.fresh_until(settings)


def _baseline_of(
    settings: BaselineSettings, own: Baseline, borrowed: str | None, modelled: bool
) -> str:
    """Whose fresh baseline a comparison is against, in words."""
    if modelled:
        return "the learned loads' modelled"
    if borrowed is not None:
        peer = carry.peer_of(borrowed)
        return "an earlier run's" if peer is None else f"peer {peer}'s"
    if own.late(settings) and own.busy_from is not None:
        return f"this run's late (learned from {own.busy_from / 3600:.1f} h of uptime)"
    return "this run's"
