"""What ``vkvagent status`` shows: the daemon's last view, kept in the state directory.

The daemon writes ``status.json`` (atomically) after every evaluation; ``vkvagent status``
reads it, so it answers while the daemon runs and after it stopped, without touching vLLM,
the GPU or D-Bus. The verdict maps onto Nagios-style exit codes: 0 healthy, 1 degraded or
acting, 2 escalated or critical, 3 unknown (no daemon, no data, or a stale file).

``StatusReport`` is the document's one schema: the daemon builds it and writes its
``to_json()``; ``vkvagent status`` and the exporter read the typed report, never the dict.
``from_json()`` takes what older versions wrote: a key they lacked reads as its default.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import IntEnum
from pathlib import Path
from typing import Any, TypeVar

from vkvagent import __version__
from vkvagent.engine.liveness import RESTARTS_AFTER_CLEAN_EXIT
from vkvagent.engine.policy import PLANNED
from vkvagent.errors import VkvagentError
from vkvagent.flags import shown

FILE_NAME = "status.json"
VERSION = 1
STATES = ("healthy", "degraded", "impaired", "acting", "escalated", "critical", "unknown")
# What the agent reads to act: vLLM's /metrics, the GPUs (the fault veto), the unit over D-Bus
# (restarts). One failing for FAILING_FOR intervals, not a blip, makes the status "impaired":
# never healthy while no restart, or no safe one, can happen.
SOURCES = ("vllm", "gpu", "systemd")
FAILING_FOR = 3  # sample intervals
EVENTS_KEPT = 5  # the daemon's last events in the status, as `systemctl status` shows a journal
# The words the report uses for its parts, so its readers need not load the adapters.
PROBE_OUTCOMES = ("ok", "timeout", "error", "refused", "unusable")  # probe.Prober's results
FLEET_STATES = ("idle", "waiting", "holding", "unreachable")  # what a host does in its group
CRITICAL_CAUSES = ("engine_down", "gpu_fault", "dead", "start_hung", "crash_loop")
TREND_EVERY = 300.0  # seconds between two points of the trend
TREND_KEPT = 144  # 12 hours of them
SPARKS = "▁▂▃▄▅▆▇█"

_T = TypeVar("_T")


class StatusCode(IntEnum):
    """``vkvagent status``'s exit codes (docs/status.md, "Verdict states and exit codes")."""

    HEALTHY = 0
    DEGRADED = 1  # or acting on it, or the agent cannot act (impaired)
    CRITICAL = 2  # escalated, vLLM down, a GPU fault
    UNKNOWN = 3  # no daemon, no data, or its last word is too old


class StatusError(VkvagentError):
    """status.json cannot be read (permissions), or is not a status document; one line."""


# -- the document ---------------------------------------------------------------------------

_P = TypeVar("_P", bound="_Part")


class _Part:
    """A part of the document: a frozen dataclass whose fields are its keys, in order.

    Reading takes what older versions wrote: a key they lacked (or null) reads as the field's
    default; a value of the wrong type, or a required key missing, is a StatusError naming
    its place. The type of each key is its field's annotation, kept as text by ``from
    __future__ import annotations``: ``_read`` knows the few forms the schema uses."""

    def to_json(self) -> dict[str, Any]:
        parts = dataclasses.fields(self)  # type: ignore[arg-type]
        return {f.name: _written(getattr(self, f.name)) for f in parts}

    @classmethod
    def from_json(cls: type[_P], data: object, where: str = "") -> _P:
        if not isinstance(data, dict):
            raise StatusError(f"{where or 'status'}: expected an object, got {_kind(data)}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            at = f"{where}.{f.name}" if where else f.name
            value = data.get(f.name)
            if value is not None:
                values[f.name] = _read(str(f.type), value, at)
                if "check" in f.metadata:
                    f.metadata["check"](value, at)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                if "None" not in str(f.type):  # required: older versions wrote it too
                    raise StatusError(f"{at}: expected {_expected(str(f.type))}, got nothing")
                values[f.name] = None
        return cls(**values)


def _written(value: object) -> Any:
    if isinstance(value, _Part):
        return value.to_json()
    if isinstance(value, tuple):
        return [_written(item) for item in value]
    if isinstance(value, dict):
        return dict(value)
    return value


# The annotations the schema uses, each with its test and its name in an error.
_SCALARS: dict[str, tuple[Callable[[object], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "text"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "dict[str, Any]": (lambda v: isinstance(v, dict), "an object"),
}


def _options(annotation: str) -> list[str]:
    """``float | None`` -> ``["float"]``: the kinds a non-null value may be."""
    return [kind.strip() for kind in annotation.split("|") if kind.strip() != "None"]


def _expected(annotation: str) -> str:
    names = []
    for kind in _options(annotation):
        if kind in _SCALARS:
            names.append(_SCALARS[kind][1])
        else:
            names.append("a list" if kind.startswith("tuple[") else "an object")
    return " or ".join(names)


def _read(annotation: str, value: object, at: str) -> Any:
    """``value`` (not null) as the annotation says: a scalar, ``tuple[X, ...]`` from a list,
    or a part of the document by its class name."""
    for kind in _options(annotation):
        if kind in _SCALARS:
            if _SCALARS[kind][0](value):
                return dict(value) if isinstance(value, dict) else value
        elif kind.startswith("tuple[") and kind.endswith(", ...]"):
            if isinstance(value, list):
                item = kind[len("tuple[") : -len(", ...]")]
                return tuple(_read(item, v, f"{at}[{i}]") for i, v in enumerate(value))
        else:  # a part of the document, which checks its own shape
            part: type[_Part] = globals()[kind]
            return part.from_json(value, at)
    raise StatusError(f"{at}: expected {_expected(annotation)}, got {_kind(value)}")


# ``actuator.Costs`` as the ledger keeps it: what ``costs_line`` prints.
_COSTS = {
    "drain_mode": "str",
    "in_flight": "float",
    "aborted": "float",
    "drain_seconds": "float",
    "down_seconds": "float",
    "missed": "float",
}


def _costs(costs: dict[str, Any], where: str) -> None:
    """The ledger's costs are passed through as they are, once their values fit."""
    for key, kind in _COSTS.items():
        if costs.get(key) is not None:
            _read(kind, costs[key], f"{where}.{key}")


@dataclass(frozen=True)
class UnitStatus(_Part):
    """The vLLM unit as systemd reported it with the sample."""

    active_state: str
    sub_state: str
    main_pid: int
    n_restarts: int  # automatic restarts by Restart= since the last requested start
    memory_bytes: int | None = None  # MemoryCurrent; None when not accounted
    restart_policy: str = ""  # Restart=; "": unknown
    wanted: bool | None = None  # enabled, or wanted by another unit, and not masked


@dataclass(frozen=True)
class VllmStatus(_Part):
    """The vLLM server: its version, how its /metrics page read, how long it has run."""

    version: str | None = None
    flavor: str | None = None  # the /metrics layout recognised (vllm_metrics' flavours)
    recognised: bool | None = None  # None: vLLM did not answer
    uptime_s: float | None = None
    error: str | None = None  # why the scrape failed


@dataclass(frozen=True)
class LoadNow(_Part):
    """Throughput, load and latency over the samples kept (None: not known)."""

    tokens_per_s: float | None = None
    requests_per_s: float | None = None
    kv_usage: float | None = None  # 0..1
    preemptions_per_s: float | None = None
    prefix_hit_ratio: float | None = None
    ttft_p50_s: float | None = None
    itl_p50_s: float | None = None
    running: float | None = None
    waiting: float | None = None


@dataclass(frozen=True)
class GpuStatus(_Part):
    """One GPU's temperature and clocks, and why NVML says its clock is held down."""

    index: int
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    clock_event_reasons: tuple[str, ...] = ()
    throttled_by: tuple[str, ...] = ()  # the clock-event reasons that are throttling


@dataclass(frozen=True)
class Verdict(_Part):
    """The engine's decision, and the one word (``state``, one of STATES) that sums it up."""

    state: str
    action: str  # restart, hold, none
    reason: str
    cause: str | None = None
    ratio: float | None = None  # speed over the fresh baseline at this load
    # The band ``ratio`` is judged by: slow below enter_ratio, back above leave_ratio.
    enter_ratio: float | None = None
    leave_ratio: float | None = None
    # How long vLLM has had work without making progress (no token, no engine step); 0 when
    # it progresses or has nothing to do. A stall is diagnosed once it reaches stall_after.
    stalled_s: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)
    suggestion: dict[str, Any] = field(default_factory=dict)  # vLLM flags to review
    reasons: dict[str, Any] = field(default_factory=dict)  # why each suggested flag (text)


@dataclass(frozen=True)
class PolicyStatus(_Part):
    """What the policy allows now."""

    mode: str  # off, observe, enforce
    window_open: bool
    budget_left: int  # restarts still allowed in the rolling 24 hours
    next_window: str | None = None  # ISO 8601, when the window is closed
    paused_until: str | None = None  # ISO 8601, while `vkvagent pause` holds


@dataclass(frozen=True)
class LastRestart(_Part):
    """The ledger's latest action (vkvagent's or the operator's), as it stands."""

    kind: str  # restart, apply, rollback, ...
    reason: str
    started: float  # UTC seconds
    id: int | None = None
    ended: float | None = None
    outcome: str | None = None  # None while in progress
    recovered: bool | None = None  # the engine's judgement; None: not judged yet
    # The ledger's records, passed through: actuator.Costs and hooks.HookResult as JSON.
    costs: dict[str, Any] | None = field(default=None, metadata={"check": _costs})
    hooks: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class LastProbe(_Part):
    """How the last active probe went (``probe.ProbeResult``)."""

    time: float  # UTC seconds, when it was sent
    outcome: str  # one of PROBE_OUTCOMES
    latency_s: float  # to the answer, or to giving up
    detail: str = ""  # the error, for every outcome but ok


@dataclass(frozen=True)
class ProbeStatus(_Part):
    """The active probe: switched on, wanted by the engine, in flight, how the last went."""

    enabled: bool = False
    wanted: bool = False
    in_flight_s: float | None = None  # how long the one in flight has waited
    last: LastProbe | None = None
    failing: str | None = None  # "outcome: detail" while probes fail (or cannot be sent)


@dataclass(frozen=True)
class FlagChange(_Part):
    """The last flag change and its verdict: its run's fresh speed against the run before."""

    action: int  # the ledger's id
    flags: dict[str, Any]  # the flags whose values it changed
    verdict: str  # better | same | worse | not judged | no verdict
    ratio: float | None = None  # fresh speed after / before
    speed_before: float | None = None  # generated tokens/s per request in the system
    speed_after: float | None = None
    loads: tuple[str, ...] = ()  # the loads compared
    rollback: str | None = None  # for a worse one: how putting it back went


@dataclass(frozen=True)
class FlagsStatus(_Part):
    """[vllm.flags] against the unit: as desired, as running, what is pending and what for."""

    apply: str  # [vllm] apply_flags
    desired: dict[str, Any]
    running: dict[str, Any] | None = None  # those flags' values on the unit's command line
    pending: dict[str, Any] | None = None  # the ones whose values differ
    due: str | None = None  # what the next restart carries: "apply ..." or "roll back ..."
    waiting_for: str | None = None  # what that change waits for
    problem: str | None = None  # why they cannot be planned, or are not applied (rejected)
    last_change: FlagChange | None = None


@dataclass(frozen=True)
class SlotHolder(_Part):
    """A host holding one of its fleet group's restart slots, as its etcd key says."""

    slot: int
    host: str
    pid: int | None = None
    cause: str = ""
    reason: str = ""
    since: float | None = None  # UTC seconds
    lease: str = ""


@dataclass(frozen=True)
class FleetStatus(_Part):
    """This host in its fleet group (``fleet.Gate.report``): its state and the slot holders."""

    group: str
    host: str
    max_concurrent: int
    state: str  # one of FLEET_STATES
    on_unreachable: str = "hold"  # hold, or emergencies
    lease_ttl: float | None = None
    error: str | None = None  # why etcd is unreachable
    holders: tuple[SlotHolder, ...] = ()
    listed: float | None = None  # UTC seconds, when the holders were last listed


@dataclass(frozen=True)
class TrendPoint(_Part):
    """One point of the sparkline's trend, written as ``[at, tokens_per_s, ratio]``."""

    at: float  # UTC seconds
    tokens_per_s: float | None
    ratio: float | None = None

    def to_json(self) -> list[Any]:  # type: ignore[override]
        return [self.at, self.tokens_per_s, self.ratio]

    @classmethod
    def from_json(cls, data: object, where: str = "trend[]") -> TrendPoint:
        if not isinstance(data, list) or len(data) != 3:
            raise StatusError(f"{where}: expected [at, tokens_per_s, ratio], got {_kind(data)}")
        return super().from_json(dict(zip(("at", "tokens_per_s", "ratio"), data)), where)


@dataclass(frozen=True)
class SourceFailure(_Part):
    """A source the agent reads to act (one of SOURCES), failing in every sample since
    ``since``."""

    source: str
    error: str  # the last failure, one line
    since: float  # UTC seconds, the first failed sample of this run of failures
    # How long it had failed when the status was written, on the monotonic clock, which
    # a step of the wall clock (NTP) cannot shorten; None from an older vkvagent.
    seconds: float | None = None

    def failed_for(self, at: float) -> float:
        """Seconds failed as of ``at``, the status's ``updated``."""
        return at - self.since if self.seconds is None else self.seconds


@dataclass(frozen=True)
class RecentEvent(_Part):
    """One of the daemon's last events (events.py's catalogue), for people."""

    time: float  # UTC seconds
    event: str  # its name, e.g. source.failed
    message: str


def _figures(figures: dict[str, Any], where: str) -> None:
    """An objective's figures by window: each a number, or null (no events in it)."""
    for window, value in figures.items():
        if value is not None and not math.isfinite(_read("float", value, f"{where}.{window}")):
            raise StatusError(f"{where}.{window}: expected a finite number, got {value!r}")


@dataclass(frozen=True)
class SloObjective(_Part):
    """One objective of [slo] as the engine's tallies have it: ``engine.slo.Objective``'s
    own document."""

    objective: str  # availability, ttft or itl
    words: str  # as the operator declared it: "95 % of requests' first token within 2 s"
    target: float  # the share of good events it asks for
    # "1h", "1d", "period" -> the share of good events (None: none counted in it)
    attainment: dict[str, Any] = field(default_factory=dict, metadata={"check": _figures})
    budget_remaining: float | None = None  # share of the period's budget left; below 0: overspent
    # "5m", "30m", "1h", "6h" -> the budget spent over the window against the rate that would
    # spend it in exactly one period (1: on course; 14.4 over an hour: 2 % of a month's gone)
    burn_rates: dict[str, Any] = field(default_factory=dict, metadata={"check": _figures})
    burning: str | None = None  # the burn alert raised: fast or slow; None: neither


@dataclass(frozen=True)
class SloStatus(_Part):
    """The operator's objectives ([slo]): their budgets' period and each one declared."""

    period_days: float
    objectives: tuple[SloObjective, ...] = ()

    def fast(self) -> list[str]:
        """The objectives whose budget burns fast (the page-worthy multiwindow alert)."""
        return [o.objective for o in self.objectives if o.burning == "fast"]


@dataclass(frozen=True)
class StatusReport(_Part):
    """status.json: the daemon's view at its last evaluation."""

    updated: float  # UTC seconds of the sample
    agent_version: str
    interval: float  # the daemon's sample interval, seconds
    unit_name: str
    verdict: Verdict
    policy: PolicyStatus
    pid: int | None = None  # the daemon's
    pid_namespace: int | None = None  # its PID namespace (inode): where that PID means it
    unit: UnitStatus | None = None  # None: systemd not asked, or did not answer
    unit_error: str | None = None
    vllm: VllmStatus = field(default_factory=VllmStatus)
    now: LoadNow = field(default_factory=LoadNow)
    gpus: tuple[GpuStatus, ...] = ()
    last_restart: LastRestart | None = None
    probe: ProbeStatus | None = None  # None: written before the probe existed
    flags: FlagsStatus | None = None  # None: no [vllm.flags] and no flag change seen
    trend: tuple[TrendPoint, ...] = ()
    fleet: FleetStatus | None = None  # None: no [fleet]
    slo: SloStatus | None = None  # None: no objective declared in [slo]
    failing: tuple[SourceFailure, ...] = ()  # every source failing now, however briefly
    events: tuple[RecentEvent, ...] = ()  # the last EVENTS_KEPT, oldest first
    stale_after: float | None = None  # while restarting: the longest the restart may take
    progress: str | None = None  # while restarting: the actuator's last word

    def to_json(self) -> dict[str, Any]:
        """The document as written; ``stale_after`` and ``progress`` only while restarting."""
        document = {"version": VERSION, **super().to_json()}
        for key in ("stale_after", "progress"):
            if document[key] is None:
                del document[key]
        return document

    @classmethod
    def from_json(cls, data: object, where: str = "") -> StatusReport:
        """A status document of this VERSION, as this or an older vkvagent wrote it."""
        version = data.get("version") if isinstance(data, dict) else VERSION
        if version != VERSION:
            shown = version if _is_integer(version) else _kind(version)
            raise StatusError(f"version: expected {VERSION}, got {shown}")
        return super().from_json(data, where)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_KINDS = (
    (str, "text"),
    (int, "an integer"),
    (float, "a number"),
    (dict, "an object"),
    (list, "a list"),
)


def _kind(value: object) -> str:
    """A JSON value's kind, for an error message (never the value: it may be long)."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true or false"
    for kind, name in _KINDS:
        if isinstance(value, kind):
            return name
    return type(value).__name__


# -- reading it -------------------------------------------------------------------------------


def verdict_state(
    *,
    action: str,
    cause: str | None,
    reason: str,
    has_data: bool,
    failed: Sequence[str] = (),
) -> str:
    """One word for a decision: what the exit code and the ``vkvagent_verdict`` metric say.
    ``failed``: the sources failed for FAILING_FOR intervals (``failed_sources``). The agent
    cannot act through them ("impaired") unless a worse word applies, or, for vLLM's
    /metrics, the engine names a cause: a dead or hung vLLM is the verdict, not a blind agent."""
    if reason.startswith("escalated"):
        return "escalated"
    if cause in CRITICAL_CAUSES:
        return "critical"
    if any(source != "vllm" or cause is None for source in failed):
        return "impaired"
    if not has_data:
        return "unknown"
    if action == "restart":
        return "acting"
    if cause is not None and cause not in PLANNED:
        return "degraded"
    return "healthy"


def exit_code(status: StatusReport | None, now: float) -> StatusCode:
    if status is None or is_stale(status, now):
        return StatusCode.UNKNOWN
    state = status.verdict.state
    if state in ("escalated", "critical"):
        return StatusCode.CRITICAL
    if state in ("degraded", "impaired", "acting"):
        return StatusCode.DEGRADED
    if state == "healthy":
        return StatusCode.HEALTHY
    return StatusCode.UNKNOWN


def failed_sources(
    failing: Sequence[SourceFailure], at: float, interval: float
) -> list[SourceFailure]:
    """The sources that have failed for FAILING_FOR sample intervals or more at ``at``."""
    return [f for f in failing if f.failed_for(at) >= FAILING_FOR * interval]


def is_stale(status: StatusReport, now: float) -> bool:
    """The status no longer says how things are: the process that wrote it is gone (stopped
    or crashed: no need to wait a minute to say so), or it has not written for three
    intervals (at least a minute), or, while it restarts vLLM, for longer than the restart
    may take (hung)."""
    if daemon_running(status) is False:
        return True
    limit = max(60.0, 3 * float(status.interval), float(status.stale_after or 0))
    return now - float(status.updated) > limit


def add_trend(
    trend: Sequence[TrendPoint], at: float, tokens_per_s: float | None, ratio: float | None
) -> tuple[TrendPoint, ...]:
    """The trend with a point for ``at`` when TREND_EVERY has passed since the last one."""
    points = tuple(trend)
    if tokens_per_s is not None and (not points or at - points[-1].at >= TREND_EVERY):
        points += (TrendPoint(round(at, 1), round(tokens_per_s, 2), ratio),)
    return points[-TREND_KEPT:]


NO_STATUS = "no status yet: the daemon has not run (or cannot write its state)"


def stale_reason(status: StatusReport, now: float) -> str:
    alive = {True: "running but silent", False: "not running", None: "not visible from here"}
    age = _duration(now - float(status.updated))
    # No semicolon: Nagios keeps the first line in status.dat, where it separates fields.
    return f"stale: last update {age} ago, daemon {alive[daemon_running(status)]}"


def shown_json(
    status: StatusReport | None,
    now: float,
    unit_name: str,
    *,
    code: StatusCode | None = None,
    reason: str = NO_STATUS,
) -> dict[str, Any]:
    """What ``vkvagent status --json`` prints: always every key of the document, plus
    ``stale``, ``last_state`` (the state the daemon wrote) and ``exit_code`` (``code`` where
    thresholds decided it). A stale status's verdict is "unknown", as its exit code says,
    its reason saying why. With no status (``reason``: why) the state is "unknown" and what
    only a daemon knows (when, its interval, the policy's window) is null."""
    if status is not None:
        stale = is_stale(status, now)
        document = status.to_json()
        if stale:
            document["verdict"].update(
                state="unknown",
                reason=f"{stale_reason(status, now)}; last verdict: {status.verdict.reason}",
            )
        return {
            **document,
            "stale": stale,
            "last_state": status.verdict.state,
            "exit_code": int(exit_code(status, now) if code is None else code),
        }
    blank = StatusReport(
        updated=0.0, agent_version=__version__, interval=0.0, unit_name=unit_name,
        verdict=Verdict(state="unknown", action="none", reason=reason),
        policy=PolicyStatus(mode="", window_open=False, budget_left=0),
    ).to_json()  # fmt: skip
    blank.update(updated=None, interval=None)
    blank["policy"] = dict.fromkeys(blank["policy"])
    return {**blank, "stale": False, "last_state": None, "exit_code": int(StatusCode.UNKNOWN)}


# -- the monitoring-plugin check ----------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """A threshold in the monitoring-plugins' range syntax: ``[@]start:end``, ``~`` for no
    start, no end for none. It alerts outside start..end (inside, with ``@``)."""

    text: str
    start: float
    end: float
    inside: bool = False

    @classmethod
    def parse(cls, text: str) -> Range:
        """StatusError for anything else, and for a bare number: the guidelines read ``0.8`` as
        0..0.8, alerting on a speed ratio above 0.8, never what a speed threshold means."""
        body = text[1:] if text.startswith("@") else text
        if ":" not in body:
            raise StatusError(
                f"threshold {text!r}: a bare number is the range 0..{body} (an alert above it);"
                f" for an alert below it, write {body}:"
            )
        start, _, end = body.partition(":")
        try:
            low = -math.inf if start == "~" else float(start or 0)
            high = math.inf if end == "" else float(end)
        except ValueError:
            raise StatusError(
                f"threshold {text!r}: expected [@]start:end (e.g. 0.8: alerts below 0.8)"
            ) from None
        if low > high or math.isnan(low) or math.isnan(high):
            raise StatusError(f"threshold {text!r}: its start is above its end")
        return cls(text, low, high, inside=text.startswith("@"))

    def alerts(self, value: float) -> bool:
        within = self.start <= value <= self.end
        return within if self.inside else not within


def checked(
    status: StatusReport | None,
    now: float,
    warning: Range | None = None,
    critical: Range | None = None,
) -> tuple[StatusCode, str]:
    """The exit code with the thresholds on the speed ratio applied, and an objective's budget
    burning fast (a warning: the page-worthy alert of the SRE workbook, while the verdict's own
    critical states stay vLLM down, a GPU fault or escalation), and what raised it in words
    ("" when nothing did). An unknown ratio, or status, meets no threshold."""
    code = exit_code(status, now)
    if status is None or code == StatusCode.UNKNOWN:
        return code, ""
    ratio = status.verdict.ratio
    for limit, name, level in (
        (critical, "critical", StatusCode.CRITICAL),
        (warning, "warning", StatusCode.DEGRADED),
    ):
        if ratio is not None and limit is not None and limit.alerts(ratio) and level > code:
            return level, f"speed ratio {ratio:.2f} outside the {name} range {limit.text}"
    burning = [] if status.slo is None else status.slo.fast()
    if burning and code < StatusCode.DEGRADED:
        return StatusCode.DEGRADED, f"{', '.join(burning)} error budget burning fast"
    return code, ""


def perfdata(
    status: StatusReport, warning: Range | None = None, critical: Range | None = None
) -> str:
    """Performance data as the plugin guidelines write it, ``'label'=value[UOM];[warn];
    [crit];[min];[max]`` (U: not known), for graphs: speed ratio, KV usage, throughput
    (generated tokens/s) and restarts left today; with [slo], each objective's attainment
    over the period and its budget left (below 0 when overspent)."""
    v, m = status.verdict, status.now

    def value(x: float | None, digits: int) -> str:
        return "U" if x is None else f"{x:.{digits}f}"

    def percent(x: float | None, digits: int) -> str:
        return "U" if x is None else f"{x * 100:.{digits}f}%"  # U takes no unit

    limits = ";".join(r.text if r else "" for r in (warning, critical))
    data = (
        f"speed_ratio={value(v.ratio, 3)};{limits};0 kv_usage={percent(m.kv_usage, 1)};;;0;100 "
        f"throughput={value(m.tokens_per_s, 1)};;;0 restarts_left={status.policy.budget_left};;;0"
    )
    for o in status.slo.objectives if status.slo is not None else ():
        data += (
            f" slo_{o.objective}={percent(o.attainment.get('period'), 3)};;;0;100"
            f" slo_{o.objective}_budget={percent(o.budget_remaining, 1)};;;;100"
        )
    return data


def headline(
    status: StatusReport | None,
    now: float,
    warning: Range | None = None,
    critical: Range | None = None,
    *,
    reason: str = NO_STATUS,
) -> str:
    """The first line, on stdout in every state (a monitoring plugin's output): the state in
    one word and, when the status is current, its performance data after ``|``."""
    if status is None:
        return f"vkvagent {__version__}: UNKNOWN - {reason}"
    version = status.agent_version
    if is_stale(status, now):
        return f"vkvagent {version}: UNKNOWN ({stale_reason(status, now)})"
    code, why = checked(status, now, warning, critical)
    state = status.verdict.state.upper()
    if why:
        word = "CRITICAL" if code == StatusCode.CRITICAL else "WARNING"
        state = f"{word} - {why} (verdict {state})"
    failed = failed_sources(status.failing, float(status.updated), float(status.interval))
    if failed and status.verdict.state == "impaired":
        state += f" ({', '.join(f.source for f in failed)} failing)"
    return f"vkvagent {version}: {state} | {perfdata(status, warning, critical)}"


def path(state_dir: Path) -> Path:
    return state_dir / FILE_NAME


def read(state_dir: Path) -> StatusReport | None:
    """The last status the daemon wrote; None when there is none (or it is damaged, or of
    another version). StatusError: unreadable, or not a status document."""
    try:
        data = json.loads(path(state_dir).read_text(encoding="utf-8"))
    except PermissionError:
        raise StatusError(
            f"{path(state_dir)}: permission denied (the state is readable by root and the "
            "vkvagent group)"
        ) from None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return None
    try:
        return StatusReport.from_json(data)
    except StatusError as exc:
        raise StatusError(f"{path(state_dir)}: {exc}") from None


@functools.lru_cache(maxsize=1)  # a process keeps its PID namespace: one stat, not one a tick
def pid_namespace() -> int | None:
    """This process's PID namespace, as the inode of /proc/self/ns/pid (None: no /proc)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def daemon_running(status: StatusReport) -> bool | None:
    """Whether the process that wrote the status still runs; None where this reader cannot
    tell: no PID, or another PID namespace (a monitoring container), where the PID means
    another process. A PID reused since reads as running, which errs towards staleness."""
    if status.pid is None or status.pid_namespace is None:
        return None
    if status.pid_namespace != pid_namespace():
        return None
    try:
        os.kill(status.pid, 0)
    except PermissionError:
        return True
    except (OSError, ValueError):
        return False
    return True


# -- for people -------------------------------------------------------------------------------


def sparkline(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return ""
    low, high = min(known), max(known)
    span = high - low or 1.0
    return "".join(
        " " if v is None else SPARKS[min(7, int((v - low) / span * 7.999))] for v in values
    )


def unit_warning(
    unit: str, restart_policy: str, wanted: bool | None, mode: str, file_state: str = ""
) -> str:
    """One line on a unit that would stay down after vLLM exits with status 0, as vLLM 0.32
    does when its engine dies, or that nothing wants ("" when neither): what happens, who
    starts it again, and what to do. ``restart_policy`` is its Restart= ("": unknown);
    ``wanted`` as ``UnitStatus.wanted`` (None: unknown); ``mode`` the policy's, which decides
    whether vkvagent starts a wanted unit that died ("": unknown); ``file_state`` its
    UnitFileState where known (``config check``), for the right command. For ``config check``
    and ``vkvagent status``; it changes no exit code."""
    if file_state in ("masked", "masked-runtime"):
        return (
            f"{unit} is masked: neither systemd nor vkvagent can start it "
            f"(systemctl unmask {unit}, then systemctl enable {unit})"
        )
    exits = "vLLM exits 0 when its engine dies (vLLM 0.32 does)"
    leaves = bool(restart_policy) and restart_policy not in RESTARTS_AFTER_CLEAN_EXIT
    if wanted is False:
        if file_state == "static":
            nobody = f"{unit} has no [Install] section and no unit wants it"
            enable = f"add WantedBy=multi-user.target under [Install], then systemctl enable {unit}"
        elif file_state:
            nobody = f"{unit} is not enabled and no unit wants it"
            enable = f"systemctl enable {unit}"
        else:  # status.json has no UnitFileState: masked reads as not wanted too
            nobody = f"{unit} is not enabled, or masked, and no unit wants it"
            enable = f"systemctl enable {unit} (unmask it first if masked)"
        if leaves:
            return (
                f"{nobody}, and it has Restart={restart_policy}: {exits}, and then neither "
                f"systemd nor vkvagent starts it again; set Restart=always, and {enable}"
            )
        return (
            f"{nobody}: it does not start at boot, and vkvagent does not start it when it is "
            f"down; {enable}"
        )
    if not leaves:
        return ""
    left = f"{unit} has Restart={restart_policy}: {exits}, and systemd then leaves it down"
    if mode == "enforce":
        return (
            f"{left}; vkvagent starts it again within a sample interval (enforce mode, "
            "max_per_day allowing), but set Restart=always to have systemd do it at once"
        )
    if mode:
        return f"{left}, and vkvagent in {mode} mode does not start it: set Restart=always"
    return f"{left}: set Restart=always"


# What each source's failure takes from the agent, in words.
_LOST = {
    "vllm": "nothing can be judged",
    "gpu": "no GPU-fault veto",
    "systemd": "no restart can happen",
}


def render(
    status: StatusReport | None,
    now: float,
    *,
    explain: bool = False,
    warning: Range | None = None,
    critical: Range | None = None,
    reason: str = NO_STATUS,
) -> str:
    """``vkvagent status``: the headline (``headline``), then the figures behind it."""
    first = headline(status, now, warning, critical, reason=reason)
    if status is None:
        return first + "\n"
    v, u, m = status.verdict, status.unit, status.now
    lines = [first]
    if is_stale(status, now):
        # The headline says what the exit code says; the last verdict is history, beneath it.
        lines.append(f"  last state  {v.state.upper()} at {_iso(float(status.updated))}")
    lines.append(f"  verdict     {v.action}: {v.reason}")
    if v.cause:
        lines.append(f"  cause       {v.cause}")
    for failure in status.failing:
        lost = _LOST.get(failure.source, "")
        lines.append(
            f"  failing     {failure.source} for "
            f"{_duration(failure.failed_for(float(status.updated)))}: {failure.error}"
            + (f" ({lost})" if lost else "")
        )
    unit = status.unit_name
    if u is not None:
        lines.append(
            f"  unit        {unit} {u.active_state} ({u.sub_state}), pid {u.main_pid}, "
            f"memory {_bytes(u.memory_bytes)}, automatic restarts {u.n_restarts}"
        )
        left_down = unit_warning(unit, u.restart_policy, u.wanted, status.policy.mode)
        if left_down:
            lines.append(f"  warning     {left_down}")
    else:
        lines.append(f"  unit        {unit}: {status.unit_error or 'state unknown'}")
    vllm = status.vllm
    lines.append(
        f"  vLLM        {vllm.version or 'version unknown'}, metrics "
        f"{vllm.flavor or '-'}, uptime {_duration(vllm.uptime_s)}"
        + (f"; {vllm.error}" if vllm.error else "")
    )
    ratio = v.ratio
    lines.append(
        f"  throughput  {_num(m.tokens_per_s)} tokens/s, "
        f"{_num(m.requests_per_s, 2)} requests/s; speed vs fresh baseline "
        + ("unknown" if ratio is None else f"{ratio:.2f}")
        + (
            f" (slow below {v.enter_ratio:.2f}, back above {v.leave_ratio:.2f})"
            if ratio is not None and v.enter_ratio is not None and v.leave_ratio is not None
            else ""
        )
    )
    trend = status.trend
    if trend:
        hours = (float(trend[-1].at) - float(trend[0].at)) / 3600
        lines.append(
            f"  trend       {sparkline([p.tokens_per_s for p in trend])}  tokens/s, "
            f"last {hours:.1f} h"
        )
    lines.append(
        f"  load        running {_num(m.running, 1)}, waiting {_num(m.waiting, 1)}, "
        f"KV usage {_pct(m.kv_usage)}, preemptions {_num(m.preemptions_per_s, 2)}/s, "
        f"prefix cache hits {_pct(m.prefix_hit_ratio)}"
    )
    lines.append(f"  latency     TTFT p50 {_ms(m.ttft_p50_s)}, ITL p50 {_ms(m.itl_p50_s)}")
    if status.slo is not None:
        lines.extend(slo_lines(status.slo, explain=explain))
    if status.probe is not None:
        lines.append(f"  probe       {probe_line(status.probe)}")
    for gpu in status.gpus:
        throttled = ", ".join(gpu.throttled_by) or "none"
        lines.append(
            f"  GPU {gpu.index}       {_num(gpu.temperature_c)} C, SM "
            f"{_num(gpu.sm_clock_mhz)}/{_num(gpu.sm_clock_max_mhz)} MHz, "
            f"throttled by: {throttled}"
        )
    policy = status.policy
    window = "open" if policy.window_open else f"closed, next {policy.next_window or 'none'}"
    lines.append(
        f"  policy      mode {policy.mode}, window {window}, restarts left today "
        f"{policy.budget_left}"
        + (f", paused until {policy.paused_until}" if policy.paused_until else "")
    )
    if status.fleet is not None:
        lines.append(f"  fleet       {fleet_line(status.fleet)}")
    if status.progress:
        lines.append(f"  restarting  {status.progress}")
    last = status.last_restart
    if last is not None:
        judged = {True: "recovered", False: "did not recover", None: "not judged yet"}
        lines.append(
            f"  last action {last.kind} {_iso(last.started)} ({last.reason}): "
            f"{last.outcome or 'in progress'}, {judged[last.recovered]}"
        )
        if last.costs:
            lines.append(f"              {costs_line(last.costs)}")
        for hook in last.hooks or ():
            if hook.get("problem"):
                lines.append(f"              {hook['name']} failed: {hook['problem']}")
    if status.flags is not None:
        lines.extend(flags_lines(status.flags))
    if v.suggestion:
        lines.append(
            f"  suggestion  {shown(v.suggestion)} "
            "(review it as a change: vkvagent plan --suggested)"
        )
    if explain:
        lines.append("  evidence")
        for key, value in sorted(v.evidence.items()):
            lines.append(f"    {key:34} {value}")
    if status.events:
        lines.append("")
        lines += [f"{_iso(e.time)} {e.event}: {e.message}" for e in status.events]
    return "\n".join(lines) + "\n"


def flags_lines(flags: FlagsStatus) -> list[str]:
    """[vllm.flags] against the unit, and the verdict on the last change."""
    lines = []
    running = shown({k: v for k, v in (flags.running or {}).items() if v is not None})
    if flags.problem:
        lines.append(f"  flags       {flags.problem}")
    elif flags.pending and not flags.due:
        lines.append(f"  flags       pending: {shown(flags.pending)} (running {running})")
    elif flags.desired and not flags.due:
        lines.append(f"  flags       in effect: {shown(flags.desired)}")
    if flags.due:
        lines.append(
            f"  flags       due: {flags.due} (running {running}); waiting for {flags.waiting_for}"
        )
    last = flags.last_change
    if last is not None:
        speed = ""
        if last.ratio is not None:
            speed = (
                f": {last.ratio:.2f} of the previous fresh speed ({last.speed_before:.4g} -> "
                f"{last.speed_after:.4g} tokens/s per request at {', '.join(last.loads)})"
            )
        rollback = f"; rolled back: {last.rollback}" if last.rollback else ""
        lines.append(
            f"  last change action {last.action} {shown(last.flags)}: "
            f"{last.verdict}{speed}{rollback}"
        )
    return lines


def slo_lines(slo: SloStatus, *, explain: bool = False) -> list[str]:
    """A line per objective; explained, with its burn rates beneath."""
    lines = []
    for objective in slo.objectives:
        lines.append(f"  slo         {slo_line(objective, slo.period_days)}")
        if explain:
            lines.append(
                f"              burn rate {burn_words(objective.burn_rates)} (1: the budget "
                f"lasts exactly {slo.period_days:g} d)"
            )
    return lines


def slo_line(objective: SloObjective, period_days: float) -> str:
    """An objective's attainment over the last hour, day and period, and its budget left:
    "95 % of requests' first token within 2 s: 97.1 % (1 h), 96.4 % (1 d), 96.0 % (28 d);
    budget left 20 %; burning fast"."""
    shares = objective.attainment
    if objective.budget_remaining is None and not any(v is not None for v in shares.values()):
        return f"{objective.words}: nothing counted yet"
    # Enough digits to tell the target from a miss (99.95 % for 99.9 %, 96.4 % for 95 %),
    # rounded down: 99.996 % is not 100 %.
    digits = max(1, 1 - math.floor(math.log10(max(1e-6, (1 - objective.target) * 100))))

    def share(window: str) -> str:
        value, scale = shares.get(window), 10 ** (digits + 2)
        return _pct(None if value is None else math.floor(value * scale + 1e-6) / scale, digits)

    figures = ", ".join(
        f"{share(window)} ({label})"
        for window, label in (("1h", "1 h"), ("1d", "1 d"), ("period", f"{period_days:g} d"))
    )
    burning = f"; burning {objective.burning}" if objective.burning else ""
    return f"{objective.words}: {figures}; {budget_words(objective.budget_remaining)}{burning}"


def budget_words(left: float | None) -> str:
    """An objective's budget left: "budget left 20 %", "budget left -35 % (overspent)"."""
    return f"budget left {_pct(left)}" + (" (overspent)" if left is not None and left < 0 else "")


def burn_words(rates: Mapping[str, Any]) -> str:
    """Burn rates by window: "5m 25.0, 30m 12.0, 1h 20.1, 6h 3.3" (1: the budget spent in
    exactly one period)."""
    return ", ".join(f"{window} {_num(rate, 1)}" for window, rate in rates.items())


def costs_line(costs: Mapping[str, Any]) -> str:
    """What the last restart cost the clients (``actuator.Costs`` as the ledger keeps it)."""
    how = {
        "vllm": "drained by vLLM",
        "quiet": "waited for a quiet moment",
        "busy": "no quiet moment came",
        "none": "not drained",
    }.get(costs.get("drain_mode", ""), "drain unknown")
    if costs.get("drain_seconds") is not None:
        how += f" in {costs['drain_seconds']:.1f} s"
    parts = [how]
    if costs.get("aborted") is not None and costs.get("in_flight") is not None:
        parts.append(f"{costs['aborted']:.0f} of {costs['in_flight']:.0f} in flight cut off")
    if costs.get("down_seconds") is not None:
        down = f"down {costs['down_seconds']:.1f} s"
        if costs.get("missed") is not None:
            down += f" (about {costs['missed']:.0f} requests turned away)"
        parts.append(down)
    return ", ".join(parts)


def probe_line(probe: ProbeStatus) -> str:
    """The active probe: switched off, in flight, or how the last one went."""
    if not probe.enabled:
        return "off"
    parts = []
    if probe.in_flight_s is not None:
        parts.append(f"in flight for {_duration(probe.in_flight_s)}")
    last = probe.last
    if last is not None:
        parts.append(
            f"last {last.outcome} in {last.latency_s:.2f} s at {_iso(last.time)}"
            + (f" ({last.detail})" if last.detail else "")
        )
    elif probe.failing:
        parts.append(f"cannot be sent: {probe.failing}")
    else:
        parts.append("none sent yet (sent when no token moves for a while)")
    return "; ".join(parts)


def fleet_line(fleet: FleetStatus) -> str:
    """The group's slot holders and this host's state in it, in one line."""
    group, n = fleet.group, fleet.max_concurrent
    if fleet.state == "unreachable":
        held = "held" if fleet.on_unreachable == "hold" else "held but for emergencies"
        return f"group {group}: etcd unreachable, restarts {held} ({fleet.error})"
    holders = fleet.holders
    shown = ", ".join(
        f"{h.host} (slot {h.slot}, since {_iso(h.since)}, {h.cause or '-'})" for h in holders
    )
    return (
        f"group {group}, {len(holders)} of {n} slots held" + (f": {shown}" if shown else "")
        + f"; this host ({fleet.host}) {fleet.state}"
    )  # fmt: skip


def _iso(at: float | None) -> str:
    if at is None:
        return "-"
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 100:.{digits}f} %"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"
