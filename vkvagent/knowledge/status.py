"""What ``vkvagent status`` shows: the daemon's last view, kept in the state directory.

The daemon writes ``status.json`` (atomically) after every evaluation; ``vkvagent status``
reads it, so it answers while the daemon runs and after it stopped, without touching vLLM,
the GPU or D-Bus. The verdict maps onto Nagios-style exit codes: 0 healthy, 1 degraded or
acting, 2 escalated or critical, 3 unknown (no daemon, no data, or a stale file).

``StatusReport`` is the document's one schema: the daemon builds it and writes its
``to_json()``; ``vkvagent status`` and the exporter read the typed report, never the dict.
``from_json()`` takes what older versions wrote: a key they lacked reads as its default.
The operator's thresholds and the plugin's output line are ``status_check``'s; the text for
people is ``status_text``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, TypeVar

from vkvagent import __version__
from vkvagent.engine.policy import PLANNED
from vkvagent.errors import VkvagentError

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
_PARTS: dict[str, type[_Part]] = {}  # every part of a document, by its class name


class _Part:
    """A part of the document: a frozen dataclass whose fields are its keys, in order.

    Reading takes what older versions wrote: a key they lacked (or null) reads as the field's
    default; a value of the wrong type, or a required key missing, is a StatusError naming
    its place. The type of each key is its field's annotation, kept as text by ``from
    __future__ import annotations``: ``_read`` knows the few forms the schema uses, and a
    part by its class name, wherever it is defined (the fleet's entries are parts too)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _PARTS[cls.__name__] = cls

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
            return _PARTS[kind].from_json(value, at)
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


def duration(seconds: float | None) -> str:
    """A duration for people: "45 s", "12 min", "2.5 h"."""
    if seconds is None:
        return "-"
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def stale_reason(status: StatusReport, now: float) -> str:
    alive = {True: "running but silent", False: "not running", None: "not visible from here"}
    age = duration(now - float(status.updated))
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


def path(state_dir: Path) -> Path:
    return state_dir / FILE_NAME


def read(state_dir: Path) -> StatusReport | None:
    """The last status the daemon wrote; None when there is none. StatusError: unreadable,
    damaged, another version's, or not a status document."""
    where = path(state_dir)
    try:
        data = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except PermissionError:
        raise StatusError(
            f"{where}: permission denied (the state is readable by root and the vkvagent group)"
        ) from None
    except OSError as exc:
        raise StatusError(f"{where}: {exc.strerror or exc}") from None
    except ValueError:  # the daemon writes it whole: something else wrote this
        raise StatusError(f"{where}: damaged, not JSON (the daemon rewrites it)") from None
    if isinstance(data, dict) and "version" in data and data["version"] != VERSION:
        raise StatusError(
            f"{where}: written by another version of vkvagent (status version "
            f"{data.get('version')}, this one reads {VERSION}): restart the daemon after an upgrade"
        )
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
