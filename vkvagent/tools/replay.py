"""``vkvagent replay``: the decision engine on a virtual clock over Prometheus history.

The input is Prometheus ``query_range`` responses (``query_range``: files, or fetched in
chunks), made into one sample per timestamp (``timeline``: vLLM's series read by the agent's
own normaliser, dcgm-exporter's as ``GpuReading`` values).

Then ``engine.decide`` runs once per timestamp with ``now`` at that timestamp. A restart it
decides is virtual: windows, budgets and cooldowns count it, the data is not altered, and it
is never judged (no new run follows it), so escalation cannot trigger. A real restart in the
data (a counter reset, a new ``process_start_time_seconds``) is a new run with a new baseline,
as in the daemon. In observe mode the restarts it holds back are counted as enforce mode would
have made them (``replay``). With an ``[slo]``, the summary gives each objective over the whole
span: what the engine added to its tallies at each decision (``_counted``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from vkvagent.adapters.query_range import ReplayError, Store
from vkvagent.engine import Decision, EngineState, Observation, Recent, Settings, decide
from vkvagent.engine.policy import WOULD_RESTART, RestartRecord
from vkvagent.engine.samples import Sample, utc_text
from vkvagent.engine.slo import EMPTY, OBJECTIVES, SloSettings, SloState, Tally
from vkvagent.jsonsafe import finite
from vkvagent.knowledge.reconcile import Change, FlagState, flags_key
from vkvagent.tools.timeline import Timeline, timeline

if TYPE_CHECKING:  # the fleet's client only where a fleet is
    from vkvagent.adapters.fleet_runs import ServerKnowledge

# -- the replay itself -------------------------------------------------------------------------


@dataclass
class Trace:
    """Every evaluation's numbers, for ``vkvagent replay --plot``: time (Unix seconds), the
    speed and throughput ratios against this run's fresh baseline, the band the speed is
    judged by (enter and leave) and the generated tokens/s (NaN when unknown), whether a
    window was open, the cause; the restarts' times, and those of the restarts observe mode
    held back."""

    times: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    throughput_ratio: list[float] = field(default_factory=list)
    enter: list[float] = field(default_factory=list)
    leave: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    window_open: list[bool] = field(default_factory=list)
    causes: list[str | None] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    held_back: list[float] = field(default_factory=list)

    def add(self, decision: Decision, *, held_back: bool = False) -> None:
        def number(value: object) -> float:
            return float(value) if isinstance(value, (int, float)) else math.nan

        at = decision.time.timestamp()
        self.times.append(at)
        self.ratio.append(number(decision.ratio))
        self.throughput_ratio.append(number(decision.evidence.get("throughput_ratio")))
        band = decision.band or (math.nan, math.nan)
        self.enter.append(band[0])
        self.leave.append(band[1])
        self.tokens_per_s.append(number(decision.evidence.get("generation_tokens_per_s")))
        self.window_open.append(decision.window_open)
        self.causes.append(decision.cause)
        if decision.action == "restart":
            self.restarts.append(at)
        if held_back:
            self.held_back.append(at)


@dataclass
class Result:
    """What replay found: the decisions worth showing and the summary."""

    settings: Settings
    step: float
    decisions: list[Decision] = field(default_factory=list)  # at every change, and restarts
    evaluations: int = 0
    first: datetime | None = None
    last: datetime | None = None
    runs: list[str] = field(default_factory=list)
    restarts: int = 0
    restarts_outside_window: int = 0
    # The restarts observe mode held back, as enforce mode would have made them (its
    # decisions, also in ``decisions``).
    held_back: list[Decision] = field(default_factory=list)
    cause_seconds: dict[str, float] = field(default_factory=dict)
    # Time during which the live daemon would have sent its probe (no counter moved for
    # probe_after): replay has none, so there it cannot tell idle from a hung engine.
    probe_seconds: float = 0.0
    # A new run whose cache_config_info differs is a flag change (and a new server identity):
    # each judged as the daemon judges one, by its fresh speed against the run before.
    flag_changes: list[Change] = field(default_factory=list)
    trace: Trace | None = None  # every evaluation, when asked for (``--plot``)
    # The [slo] objectives' events over the whole span, as the engine counted them.
    slo: Tally = EMPTY
    http_seen: bool = False  # the data had http_requests_total: 5xx counted for availability
    server: str = ""  # the server identity of the last run learned: its fleet runs' key

    def summary(self) -> dict[str, Any]:
        return {
            "from": utc_text(self.first.timestamp()) if self.first else None,
            "to": utc_text(self.last.timestamp()) if self.last else None,
            "step_s": self.step,
            "evaluations": self.evaluations,
            "mode": self.settings.policy.mode,
            "runs": len(self.runs),
            "server": self.server or None,
            "restarts": self.restarts,
            "restarts_outside_window": self.restarts_outside_window,
            "held_back": len(self.held_back),
            "held_back_in_window": sum(d.window_open for d in self.held_back),
            "held_back_outside_window": sum(not d.window_open for d in self.held_back),
            "held_back_at": [utc_text(d.time.timestamp()) for d in self.held_back],
            "causes": {
                cause: round(seconds / 60, 1)
                for cause, seconds in sorted(self.cause_seconds.items())
            },
            "probe_wanted_min": round(self.probe_seconds / 60, 1),
            "flag_changes": [
                {
                    "at": utc_text(c.ended),
                    "cache_config": dict(c.flags),
                    "verdict": c.verdict,
                    "ratio": None if c.ratio is None else round(c.ratio, 4),
                    "loads": list(c.loads),
                }
                for c in self.flag_changes
            ],
            "slo": slo_summary(self.settings.slo, self.slo, self.http_seen),
        }

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (a non-finite number in the evidence becomes null)."""
        decisions = [finite(d.to_json()) for d in self.decisions]
        return {"decisions": decisions, "summary": self.summary()}


def replay(
    settings: Settings,
    line: Timeline,
    *,
    trace: bool = False,
    margin: float = 0.20,
    peers: ServerKnowledge | None = None,
) -> Result:
    """Run the engine over the timeline, one decision per timestamp; ``trace`` keeps every
    evaluation's numbers in ``Result.trace``; ``margin``: [vllm] rollback_margin, for the
    verdict on each flag change; ``peers``: the fleet's runs and baselines, as the daemon
    read them (``fleet_runs.load``)."""
    result = Result(settings, line.step, trace=Trace() if trace else None)
    flags = _FlagChanges(settings, margin)
    recent = Recent(settings.baseline, margin=2 * line.step)
    restarts: list[RestartRecord] = []
    # Observe mode holds every restart back, so the run is never cured and the same "would
    # restart now" comes back every tick while its cause lasts: counted per tick, one slow
    # night would be hundreds of restarts. Each is counted where enforce mode, with the ones
    # counted before it as its restart history, would have restarted (that history's min
    # interval, daily budget and cooldown are what keep the daemon from restarting twice for
    # one episode). The engine's state depends on neither the mode nor that history, and a
    # history only ever holds a restart back, so this is exactly what `--mode enforce` makes
    # of the same data, for one more decision on those ticks alone.
    enforced = replace(settings, policy=replace(settings.policy, mode="enforce"))
    held: list[RestartRecord] = []
    state = EngineState()
    previous: Decision | None = None
    previous_key: tuple[Any, ...] | None = None
    for sample, rss in line.samples():
        recent.add(sample, rss)
        now = datetime.fromtimestamp(sample.time, timezone.utc)
        observed = Observation(
            samples=tuple(recent.samples), memory=recent.memory, restarts=tuple(restarts),
            peer_runs=peers.runs if peers else (), peer_baselines=peers.baselines if peers else (),
        )  # fmt: skip
        decision = decide(settings, state, observed, now)
        result.slo = _counted(result.slo, state.slo, decision.state.slo)
        result.http_seen |= sample.vllm is not None and sample.vllm.http_requests_total is not None
        counted = False
        if decision.action == "hold" and decision.reason.startswith(WOULD_RESTART):
            enforcing = replace(observed, restarts=tuple(held))
            counted = decide(enforced, state, enforcing, now).action == "restart"
            if counted:
                held.append(RestartRecord(sample.time, decision.cause or "?"))
                result.held_back.append(_slim(decision))
        state = decision.state
        result.server = state.baseline.server if state.baseline is not None else result.server
        flags.observe(sample, decision)
        result.evaluations += 1
        if result.trace is not None:
            result.trace.add(decision, held_back=counted)
        result.first = result.first or now
        result.last = now
        run = state.run.key
        if run is not None and (not result.runs or result.runs[-1] != run):
            result.runs.append(run)
        if decision.cause is not None:
            result.cause_seconds[decision.cause] = (
                result.cause_seconds.get(decision.cause, 0.0) + line.step
            )
        result.probe_seconds += line.step if decision.probe_wanted else 0.0
        key = decision.key()
        if decision.action == "restart":
            restarts.append(RestartRecord(sample.time, decision.cause or "?"))
            result.restarts += 1
            result.restarts_outside_window += not decision.window_open
        if key != previous_key or decision.action == "restart" or counted:
            result.decisions.append(_slim(decision))
        previous, previous_key = decision, key
    if previous is not None and result.decisions[-1].time != previous.time:
        result.decisions.append(_slim(previous))  # the timeline ends where the data does
    result.flag_changes = flags.changes()
    return result


class _FlagChanges:
    """The flag changes the data shows (a new run with another cache_config_info), judged
    with reconcile.FlagState as the daemon judges its own."""

    def __init__(self, settings: Settings, margin: float) -> None:
        self.settings, self.margin = settings, margin
        self.state = FlagState()
        self.found: dict[int, Change] = {}
        self._last: tuple[str | None, Mapping[str, str], float] | None = None  # run, config, time

    def observe(self, sample: Sample, decision: Decision) -> None:
        run = decision.state.run
        if sample.vllm is not None:
            config = sample.vllm.cache_config
            last = self._last
            if last is not None and run.key != last[0] and config != last[1]:
                labels = sorted(set(config) | set(last[1]))
                changed = {k: config.get(k) for k in labels if config.get(k) != last[1].get(k)}
                change = Change(
                    action=len(self.found) + 1,
                    started=last[2],
                    ended=sample.time,
                    flags=changed,  # type: ignore[arg-type]
                    key=flags_key(config),
                    before=(),  # replay puts nothing back
                )
                self.state = self.state.noticed(change)
            self._last = (run.key, config, sample.time)
        self.state, _judged = self.state.judge(
            run_started=run.started,
            run_uptime=decision.uptime,
            previous=decision.state.previous,
            current=decision.state.baseline,
            settings=self.settings.baseline,
            margin=self.margin,
        )
        if self.state.last is not None:
            self.found[self.state.last.action] = self.state.last

    def changes(self) -> list[Change]:
        return [self.found[k] for k in sorted(self.found)]


def _counted(total: Tally, before: SloState, after: SloState) -> Tally:
    """``total`` with what one decision added to the objectives' tallies. The engine only
    adds to its buckets, and drops those older than the period, which it no longer adds to:
    so what it added is what the daily buckets it changed hold more than before. Exact over
    a replay of any length, where the last state's buckets hold the last period only."""
    if after.rings is before.rings:
        return total
    old = before.rings[-1]
    for index, tally in after.rings[-1].items():
        was = old.get(index, EMPTY)
        if tally != was:
            total = tuple(t + new - prior for t, new, prior in zip(total, tally, was))
    return total


# What availability's requests were counted from (``summary.slo.availability.counted_from``).
ANSWERED, FINISHED = "http_requests_total", "request_success_total"


def slo_summary(settings: SloSettings, tally: Tally, http: bool) -> dict[str, dict[str, Any]]:
    """Each declared objective over the replayed span: its target, its events, the share of
    them that were good (``attainment``) and the error budget they spent (the bad events over
    events x (1 - target): 1.0 is all of it); None for both where the data has no events.
    Availability also says what its requests were counted from: ``http_requests_total``
    (5xx counted), else vLLM's finished requests (``request_success_total``: no 5xx)."""
    out: dict[str, dict[str, Any]] = {}
    for name in settings.declared:
        i = OBJECTIVES.index(name)
        good, events = tally[2 * i], tally[2 * i + 1]
        target = settings.target(name)
        known = events > 0
        out[name] = {
            "target": target,
            "events": events,
            "attainment": min(1.0, good / events) if known else None,
            "budget_spent": max(0.0, events - good) / (events * (1 - target)) if known else None,
        }
        if name == "availability":
            out[name]["counted_from"] = ANSWERED if http else FINISHED
    return out


def _slim(decision: Decision) -> Decision:
    # Decisions kept for the output do not need the engine state they carried.
    return replace(decision, state=EngineState())


def check_step(settings: Settings, step: float) -> None:
    """A step that leaves fewer than two samples in half the baseline window would leave
    every decision at "learning"; refuse it."""
    if step > settings.baseline.window / 2:
        raise ReplayError(
            f"step {step:g} s is too coarse for the {settings.baseline.window:g} s baseline "
            f"window: use at most {settings.baseline.window / 2:g} s"
        )


# -- output ------------------------------------------------------------------------------------


def describe(result: Result) -> str:
    """A readable timeline: one line per change, then the summary."""
    s = result.summary()
    runs = f"{s['runs']} vLLM run{'s' if s['runs'] != 1 else ''}"
    lines = [
        f"replay {s['from']} to {s['to']}: {s['evaluations']} evaluations every "
        f"{result.step:g} s, {runs}, policy mode {s['mode']}"
    ]
    held = {d.time for d in result.held_back}
    for d in result.decisions:
        ratio = "-" if d.ratio is None else f"{d.ratio:.2f}"
        band = "-" if d.band is None else f"{d.band[0]:.2f}-{d.band[1]:.2f}"
        window = "open  " if d.window_open else "closed"
        probe = "; the live daemon would probe here (replay has no probe)" if d.probe_wanted else ""
        counted = "; counted as a restart observe mode held back" if d.time in held else ""
        lines.append(
            f"{d.time:%Y-%m-%d %H:%M:%S}Z  {d.action:7} {d.cause or '-':18} ratio {ratio:5} "
            f"band {band:9}  window {window}  {d.reason}{counted}{probe}"
        )
    causes = ", ".join(f"{c} {m:g} min" for c, m in s["causes"].items()) or "none"
    lines.append(f"summary: {restarts_words(s)}; causes: {causes}")
    for change in result.flag_changes:
        shown = ", ".join(f"{k} {v}" for k, v in change.flags.items())
        speed = "" if change.ratio is None else f", {change.ratio:.2f} of the fresh speed before"
        at = utc_text(change.ended)
        lines.append(f"flag change at {at} (cache_config {shown}): {change.verdict}{speed}")
    if s["probe_wanted_min"]:
        lines.append(
            f"probe: for {s['probe_wanted_min']:g} min no token moved, where the live daemon "
            "sends its probe; replay has none, so a hung engine whose gauges read 0 looks idle "
            "there"
        )
    lines += slo_words(result.settings.slo, s["slo"])
    return "\n".join(lines) + "\n"


NO_5XX = "; no http_requests_total in the data: 5xx answers not counted"

# What an objective's events are, in the text.
_EVENTS = {"availability": "requests", "ttft": "requests", "itl": "output tokens"}


def slo_words(settings: SloSettings, summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The text's SLO block: a line per declared objective (none without an [slo])."""
    if not summary:
        return []
    lines = ["slo over the data as it was (restarts decided here are virtual and spend nothing):"]
    for name, o in summary.items():
        objective = f"objective: {settings.words(name)}"
        if o["attainment"] is None:
            lines.append(f"  {name}: no {_EVENTS[name]} in the data ({objective})")
            continue
        # One decimal more than the target has: 99.95 % against 99.9 %, 96.3 % against 95 %.
        decimals = len(f"{o['target'] * 100:g}".partition(".")[2]) + 1
        spent = o["budget_spent"] * 100
        lines.append(
            f"  {name}: {o['attainment'] * 100:.{decimals}f} % of {o['events']:,.0f} "
            f"{_EVENTS[name]} good ({objective}), {spent:.0f} % of its error budget spent"
            + (" (over)" if spent > 100 else "")
            + (NO_5XX if o.get("counted_from") == FINISHED else "")
        )
    return lines


def restarts_words(summary: Mapping[str, Any]) -> str:
    """The restarts of a replay's summary in words, for the text and the plot's title: in
    observe mode (which makes none), those it held back and where they fell against the
    windows."""
    if summary["mode"] == "observe":
        held = summary["held_back"]
        return (
            f"{held} restart{'s' if held != 1 else ''} held back by observe mode "
            f"({summary['held_back_in_window']} in a window, "
            f"{summary['held_back_outside_window']} outside)"
        )
    made = summary["restarts"]
    return (
        f"{made} restart{'s' if made != 1 else ''} "
        f"({summary['restarts_outside_window']} outside a window)"
    )


def run(
    settings: Settings,
    store: Store,
    *,
    step: float | None = None,
    model: str = "",
    instance: str = "",
    trace: bool = False,
    margin: float = 0.20,
    peers: ServerKnowledge | None = None,
) -> Result:
    """Replay ``store``'s series with ``settings`` (and the fleet's ``peers``)."""
    line = timeline(store.series(), step=step, model=model, instance=instance, seen=store.names)
    check_step(settings, line.step)
    return replay(settings, line, trace=trace, margin=margin, peers=peers)
