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

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import IntEnum
from pathlib import Path
from typing import Any, TypeVar

from vkvagent.errors import VkvagentError

FILE_NAME = "status.json"
VERSION = 1
STATES = ("healthy", "degraded", "acting", "escalated", "critical", "unknown")
# The words the report uses for its parts, so its readers need not load the adapters.
PROBE_OUTCOMES = ("ok", "timeout", "error", "refused", "unusable")  # probe.Prober's results
FLEET_STATES = ("idle", "waiting", "holding", "unreachable")  # what a host does in its group
CRITICAL_CAUSES = ("engine_down", "gpu_fault")
TREND_EVERY = 300.0  # seconds between two points of the trend
TREND_KEPT = 144  # 12 hours of them
SPARKS = "▁▂▃▄▅▆▇█"

_T = TypeVar("_T")


class StatusCode(IntEnum):
    """``vkvagent status``'s exit codes (README, "Exit codes")."""

    HEALTHY = 0
    DEGRADED = 1  # or acting on it
    CRITICAL = 2  # escalated, vLLM down, a GPU fault
    UNKNOWN = 3  # no daemon, no data, or its last word is too old


class StatusError(VkvagentError):
    """status.json cannot be read (permissions), or is not a status document; one line."""


# -- the document -----------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitStatus:
    """The vLLM unit as systemd reported it with the sample."""

    active_state: str
    sub_state: str
    main_pid: int
    n_restarts: int  # automatic restarts by Restart= since the last requested start
    memory_bytes: int | None = None  # MemoryCurrent; None when not accounted

    def to_json(self) -> dict[str, Any]:
        return {
            "active_state": self.active_state,
            "sub_state": self.sub_state,
            "main_pid": self.main_pid,
            "memory_bytes": self.memory_bytes,
            "n_restarts": self.n_restarts,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "unit") -> UnitStatus:
        f = _Fields(data, where)
        return cls(
            active_state=f.text("active_state"),
            sub_state=f.text("sub_state"),
            main_pid=f.integer("main_pid"),
            n_restarts=f.integer("n_restarts"),
            memory_bytes=f.integer_or_none("memory_bytes"),
        )


@dataclass(frozen=True)
class VllmStatus:
    """The vLLM server: its version, how its /metrics page read, how long it has run."""

    version: str | None = None
    flavor: str | None = None  # the /metrics layout recognised (vllm_metrics' flavours)
    recognised: bool | None = None  # None: vLLM did not answer
    uptime_s: float | None = None
    error: str | None = None  # why the scrape failed

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "flavor": self.flavor,
            "recognised": self.recognised,
            "uptime_s": self.uptime_s,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "vllm") -> VllmStatus:
        f = _Fields(data, where)
        return cls(
            version=f.text_or_none("version"),
            flavor=f.text_or_none("flavor"),
            recognised=f.flag_or_none("recognised"),
            uptime_s=f.number_or_none("uptime_s"),
            error=f.text_or_none("error"),
        )


@dataclass(frozen=True)
class LoadNow:
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

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "kv_usage": self.kv_usage,
            "preemptions_per_s": self.preemptions_per_s,
            "prefix_hit_ratio": self.prefix_hit_ratio,
            "ttft_p50_s": self.ttft_p50_s,
            "itl_p50_s": self.itl_p50_s,
            "running": self.running,
            "waiting": self.waiting,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "now") -> LoadNow:
        f = _Fields(data, where)
        return cls(
            tokens_per_s=f.number_or_none("tokens_per_s"),
            requests_per_s=f.number_or_none("requests_per_s"),
            kv_usage=f.number_or_none("kv_usage"),
            preemptions_per_s=f.number_or_none("preemptions_per_s"),
            prefix_hit_ratio=f.number_or_none("prefix_hit_ratio"),
            ttft_p50_s=f.number_or_none("ttft_p50_s"),
            itl_p50_s=f.number_or_none("itl_p50_s"),
            running=f.number_or_none("running"),
            waiting=f.number_or_none("waiting"),
        )


@dataclass(frozen=True)
class GpuStatus:
    """One GPU's temperature and clocks, and why NVML says its clock is held down."""

    index: int
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    clock_event_reasons: tuple[str, ...] = ()
    throttled_by: tuple[str, ...] = ()  # the clock-event reasons that are throttling

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "temperature_c": self.temperature_c,
            "sm_clock_mhz": self.sm_clock_mhz,
            "sm_clock_max_mhz": self.sm_clock_max_mhz,
            "clock_event_reasons": list(self.clock_event_reasons),
            "throttled_by": list(self.throttled_by),
        }

    @classmethod
    def from_json(cls, data: object, where: str = "gpus[]") -> GpuStatus:
        f = _Fields(data, where)
        return cls(
            index=f.integer("index"),
            temperature_c=f.number_or_none("temperature_c"),
            sm_clock_mhz=f.number_or_none("sm_clock_mhz"),
            sm_clock_max_mhz=f.number_or_none("sm_clock_max_mhz"),
            clock_event_reasons=f.texts("clock_event_reasons"),
            throttled_by=f.texts("throttled_by"),
        )


@dataclass(frozen=True)
class Verdict:
    """The engine's decision, and the one word (``state``, one of STATES) that sums it up."""

    state: str
    action: str  # restart, hold, none
    reason: str
    cause: str | None = None
    ratio: float | None = None  # speed over the fresh baseline at this load
    evidence: dict[str, Any] = field(default_factory=dict)
    suggestion: dict[str, Any] = field(default_factory=dict)  # vLLM flags to review

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "action": self.action,
            "cause": self.cause,
            "reason": self.reason,
            "ratio": self.ratio,
            "evidence": dict(self.evidence),
            "suggestion": dict(self.suggestion),
        }

    @classmethod
    def from_json(cls, data: object, where: str = "verdict") -> Verdict:
        f = _Fields(data, where)
        return cls(
            state=f.text("state"),
            action=f.text("action"),
            reason=f.text("reason"),
            cause=f.text_or_none("cause"),
            ratio=f.number_or_none("ratio"),
            evidence=f.mapping("evidence"),
            suggestion=f.mapping("suggestion"),
        )


@dataclass(frozen=True)
class PolicyStatus:
    """What the policy allows now."""

    mode: str  # off, observe, enforce
    window_open: bool
    budget_left: int  # restarts still allowed in the rolling 24 hours
    next_window: str | None = None  # ISO 8601, when the window is closed
    paused_until: str | None = None  # ISO 8601, while `vkvagent pause` holds

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "window_open": self.window_open,
            "next_window": self.next_window,
            "budget_left": self.budget_left,
            "paused_until": self.paused_until,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "policy") -> PolicyStatus:
        f = _Fields(data, where)
        return cls(
            mode=f.text("mode"),
            window_open=f.flag("window_open"),
            budget_left=f.integer("budget_left"),
            next_window=f.text_or_none("next_window"),
            paused_until=f.text_or_none("paused_until"),
        )


@dataclass(frozen=True)
class LastRestart:
    """The ledger's latest action (vkvagent's or the operator's), as it stands."""

    kind: str  # restart, apply, rollback, ...
    reason: str
    started: float  # UTC seconds
    id: int | None = None
    ended: float | None = None
    outcome: str | None = None  # None while in progress
    recovered: bool | None = None  # the engine's judgement; None: not judged yet
    # The ledger's records, passed through: actuator.Costs and hooks.HookResult as JSON.
    costs: dict[str, Any] | None = None
    hooks: tuple[dict[str, Any], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "reason": self.reason,
            "started": self.started,
            "ended": self.ended,
            "outcome": self.outcome,
            "recovered": self.recovered,
            "costs": None if self.costs is None else dict(self.costs),
            "hooks": None if self.hooks is None else [dict(h) for h in self.hooks],
        }

    @classmethod
    def from_json(cls, data: object, where: str = "last_restart") -> LastRestart:
        f = _Fields(data, where)
        return cls(
            kind=f.text("kind"),
            reason=f.text("reason"),
            started=f.number("started"),
            id=f.integer_or_none("id"),
            ended=f.number_or_none("ended"),
            outcome=f.text_or_none("outcome"),
            recovered=f.flag_or_none("recovered"),
            costs=_costs(f.mapping_or_none("costs"), f"{where}.costs"),
            hooks=None if f.data.get("hooks") is None else f.parts("hooks", _object_item),
        )


def _costs(costs: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """The ledger's ``actuator.Costs``, passed through once its values are what
    ``costs_line`` prints."""
    if costs is not None:
        f = _Fields(costs, where)
        f.text_or_none("drain_mode")
        for key in ("in_flight", "aborted", "drain_seconds", "down_seconds", "missed"):
            f.number_or_none(key)
    return costs


@dataclass(frozen=True)
class LastProbe:
    """How the last active probe went (``probe.ProbeResult``)."""

    time: float  # UTC seconds, when it was sent
    outcome: str  # one of PROBE_OUTCOMES
    latency_s: float  # to the answer, or to giving up
    detail: str = ""  # the error, for every outcome but ok

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "outcome": self.outcome,
            "latency_s": self.latency_s,
            "detail": self.detail,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "probe.last") -> LastProbe:
        f = _Fields(data, where)
        return cls(
            time=f.number("time"),
            outcome=f.text("outcome"),
            latency_s=f.number("latency_s"),
            detail=f.text_or_none("detail") or "",
        )


@dataclass(frozen=True)
class ProbeStatus:
    """The active probe: switched on, wanted by the engine, in flight, how the last went."""

    enabled: bool = False
    wanted: bool = False
    in_flight_s: float | None = None  # how long the one in flight has waited
    last: LastProbe | None = None
    failing: str | None = None  # "outcome: detail" while probes fail (or cannot be sent)

    def to_json(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "wanted": self.wanted,
            "in_flight_s": self.in_flight_s,
            "last": None if self.last is None else self.last.to_json(),
            "failing": self.failing,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "probe") -> ProbeStatus:
        f = _Fields(data, where)
        return cls(
            enabled=bool(f.flag_or_none("enabled")),
            wanted=bool(f.flag_or_none("wanted")),
            in_flight_s=f.number_or_none("in_flight_s"),
            last=f.part("last", LastProbe.from_json),
            failing=f.text_or_none("failing"),
        )


@dataclass(frozen=True)
class SlotHolder:
    """A host holding one of its fleet group's restart slots, as its etcd key says."""

    slot: int
    host: str
    pid: int | None = None
    cause: str = ""
    reason: str = ""
    since: float | None = None  # UTC seconds
    lease: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "host": self.host,
            "pid": self.pid,
            "cause": self.cause,
            "reason": self.reason,
            "since": self.since,
            "lease": self.lease,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "fleet.holders[]") -> SlotHolder:
        f = _Fields(data, where)
        return cls(
            slot=f.integer("slot"),
            host=f.text("host"),
            pid=f.integer_or_none("pid"),
            cause=f.text_or_none("cause") or "",
            reason=f.text_or_none("reason") or "",
            since=f.number_or_none("since"),
            lease=f.text_or_none("lease") or "",
        )


@dataclass(frozen=True)
class FleetStatus:
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

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "host": self.host,
            "max_concurrent": self.max_concurrent,
            "lease_ttl": self.lease_ttl,
            "on_unreachable": self.on_unreachable,
            "state": self.state,
            "error": self.error,
            "holders": [h.to_json() for h in self.holders],
            "listed": self.listed,
        }

    @classmethod
    def from_json(cls, data: object, where: str = "fleet") -> FleetStatus:
        f = _Fields(data, where)
        return cls(
            group=f.text("group"),
            host=f.text("host"),
            max_concurrent=f.integer("max_concurrent"),
            state=f.text("state"),
            on_unreachable=f.text_or_none("on_unreachable") or "hold",
            lease_ttl=f.number_or_none("lease_ttl"),
            error=f.text_or_none("error"),
            holders=f.parts("holders", SlotHolder.from_json),
            listed=f.number_or_none("listed"),
        )


@dataclass(frozen=True)
class TrendPoint:
    """One point of the sparkline's trend, written as ``[at, tokens_per_s, ratio]``."""

    at: float  # UTC seconds
    tokens_per_s: float | None
    ratio: float | None = None

    def to_json(self) -> list[Any]:
        return [self.at, self.tokens_per_s, self.ratio]

    @classmethod
    def from_json(cls, data: object, where: str = "trend[]") -> TrendPoint:
        if not isinstance(data, list) or len(data) != 3:
            raise StatusError(f"{where}: expected [at, tokens_per_s, ratio], got {_kind(data)}")
        f = _Fields(dict(zip(("at", "tokens_per_s", "ratio"), data)), where)
        return cls(f.number("at"), f.number_or_none("tokens_per_s"), f.number_or_none("ratio"))


@dataclass(frozen=True)
class StatusReport:
    """status.json: the daemon's view at its last evaluation."""

    updated: float  # UTC seconds of the sample
    agent_version: str
    interval: float  # the daemon's sample interval, seconds
    unit_name: str
    verdict: Verdict
    policy: PolicyStatus
    pid: int | None = None  # the daemon's
    unit: UnitStatus | None = None  # None: systemd not asked, or did not answer
    unit_error: str | None = None
    vllm: VllmStatus = field(default_factory=VllmStatus)
    now: LoadNow = field(default_factory=LoadNow)
    gpus: tuple[GpuStatus, ...] = ()
    last_restart: LastRestart | None = None
    probe: ProbeStatus | None = None  # None: written before the probe existed
    # The [vllm.flags] the unit does not run with yet; a string when they could not be planned.
    pending_flags: dict[str, Any] | str | None = None
    trend: tuple[TrendPoint, ...] = ()
    fleet: FleetStatus | None = None  # None: no [fleet]
    stale_after: float | None = None  # while restarting: the longest the restart may take
    progress: str | None = None  # while restarting: the actuator's last word

    def to_json(self) -> dict[str, Any]:
        """The document as written; ``stale_after`` and ``progress`` only while restarting."""
        document = {
            "version": VERSION,
            "updated": self.updated,
            "pid": self.pid,
            "agent_version": self.agent_version,
            "interval": self.interval,
            "unit_name": self.unit_name,
            "unit": None if self.unit is None else self.unit.to_json(),
            "unit_error": self.unit_error,
            "vllm": self.vllm.to_json(),
            "now": self.now.to_json(),
            "gpus": [g.to_json() for g in self.gpus],
            "verdict": self.verdict.to_json(),
            "policy": self.policy.to_json(),
            "last_restart": None if self.last_restart is None else self.last_restart.to_json(),
            "probe": None if self.probe is None else self.probe.to_json(),
            "pending_flags": (
                dict(self.pending_flags)
                if isinstance(self.pending_flags, dict)
                else self.pending_flags
            ),
            "trend": [p.to_json() for p in self.trend],
            "fleet": None if self.fleet is None else self.fleet.to_json(),
        }
        if self.stale_after is not None:
            document["stale_after"] = self.stale_after
        if self.progress is not None:
            document["progress"] = self.progress
        return document

    @classmethod
    def from_json(cls, data: object) -> StatusReport:
        """A status document of this VERSION, as this or an older vkvagent wrote it."""
        f = _Fields(data, "")
        version = f.data.get("version")
        if version != VERSION:
            shown = version if _is_integer(version) else _kind(version)
            raise StatusError(f"version: expected {VERSION}, got {shown}")
        pending = f.value(
            "pending_flags", lambda v: isinstance(v, (dict, str)), "an object or text"
        )
        return cls(
            updated=f.number("updated"),
            agent_version=f.text("agent_version"),
            interval=f.number("interval"),
            unit_name=f.text("unit_name"),
            verdict=Verdict.from_json(f.data.get("verdict"), "verdict"),
            policy=PolicyStatus.from_json(f.data.get("policy"), "policy"),
            pid=f.integer_or_none("pid"),
            unit=f.part("unit", UnitStatus.from_json),
            unit_error=f.text_or_none("unit_error"),
            vllm=f.part("vllm", VllmStatus.from_json) or VllmStatus(),
            now=f.part("now", LoadNow.from_json) or LoadNow(),
            gpus=f.parts("gpus", GpuStatus.from_json),
            last_restart=f.part("last_restart", LastRestart.from_json),
            probe=f.part("probe", ProbeStatus.from_json),
            pending_flags=dict(pending) if isinstance(pending, dict) else pending,
            trend=f.parts("trend", TrendPoint.from_json),
            fleet=f.part("fleet", FleetStatus.from_json),
            stale_after=f.number_or_none("stale_after"),
            progress=f.text_or_none("progress"),
        )


class _Fields:
    """One JSON object of a status document, read key by key. A key older versions did not
    write reads as None (or empty); a value of the wrong type is a StatusError naming it."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, dict):
            raise StatusError(f"{where or 'status'}: expected an object, got {_kind(data)}")
        self.data: dict[str, Any] = data
        self.where = where

    def _at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def value(self, key: str, fits: Callable[[object], bool], kind: str) -> Any:
        """The value at ``key`` if it ``fits``; None when absent or null."""
        value = self.data.get(key)
        if value is not None and not fits(value):
            raise StatusError(f"{self._at(key)}: expected {kind}, got {_kind(value)}")
        return value

    def _required(self, key: str, fits: Callable[[object], bool], kind: str) -> Any:
        value = self.value(key, fits, kind)
        if value is None:
            raise StatusError(f"{self._at(key)}: expected {kind}, got {_kind(None)}")
        return value

    def text(self, key: str) -> str:
        return str(self._required(key, _is_text, "text"))

    def text_or_none(self, key: str) -> str | None:
        value = self.value(key, _is_text, "text")
        return None if value is None else str(value)

    def number(self, key: str) -> float:
        value: float = self._required(key, _is_number, "a number")
        return value

    def number_or_none(self, key: str) -> float | None:
        value: float | None = self.value(key, _is_number, "a number")
        return value

    def integer(self, key: str) -> int:
        return int(self._required(key, _is_integer, "an integer"))

    def integer_or_none(self, key: str) -> int | None:
        value = self.value(key, _is_integer, "an integer")
        return None if value is None else int(value)

    def flag(self, key: str) -> bool:
        return bool(self._required(key, _is_flag, "true or false"))

    def flag_or_none(self, key: str) -> bool | None:
        value = self.value(key, _is_flag, "true or false")
        return None if value is None else bool(value)

    def mapping_or_none(self, key: str) -> dict[str, Any] | None:
        value = self.value(key, _is_object, "an object")
        return None if value is None else dict(value)

    def mapping(self, key: str) -> dict[str, Any]:
        return self.mapping_or_none(key) or {}

    def texts(self, key: str) -> tuple[str, ...]:
        return self.parts(key, _text_item)

    def part(self, key: str, read: Callable[[object, str], _T]) -> _T | None:
        """A nested object read by ``read``; None when absent or null."""
        value = self.data.get(key)
        return None if value is None else read(value, self._at(key))

    def parts(self, key: str, read: Callable[[object, str], _T]) -> tuple[_T, ...]:
        """A list, each item read by ``read``; empty when absent or null."""
        items = self.value(key, _is_list, "a list") or []
        return tuple(read(item, f"{self._at(key)}[{i}]") for i, item in enumerate(items))


def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_flag(value: object) -> bool:
    return isinstance(value, bool)


def _is_object(value: object) -> bool:
    return isinstance(value, dict)


def _is_list(value: object) -> bool:
    return isinstance(value, list)


def _text_item(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise StatusError(f"{where}: expected text, got {_kind(value)}")
    return value


def _object_item(value: object, where: str) -> dict[str, Any]:
    return dict(_Fields(value, where).data)


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


def verdict_state(*, action: str, cause: str | None, reason: str, has_data: bool) -> str:
    """One word for a decision: what the exit code and the ``vkvagent_verdict`` metric say."""
    if reason.startswith("escalated"):
        return "escalated"
    if cause in CRITICAL_CAUSES:
        return "critical"
    if not has_data:
        return "unknown"
    if action == "restart":
        return "acting"
    if cause is not None:
        return "degraded"
    return "healthy"


def exit_code(status: StatusReport | None, now: float) -> StatusCode:
    if status is None or is_stale(status, now):
        return StatusCode.UNKNOWN
    state = status.verdict.state
    if state in ("escalated", "critical"):
        return StatusCode.CRITICAL
    if state in ("degraded", "acting"):
        return StatusCode.DEGRADED
    if state == "healthy":
        return StatusCode.HEALTHY
    return StatusCode.UNKNOWN


def is_stale(status: StatusReport, now: float) -> bool:
    """The daemon has not written for three intervals (at least a minute), or, while it
    restarts vLLM, for longer than the restart may take: stopped or hung."""
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


def daemon_alive(status: StatusReport) -> bool:
    """Whether the process that wrote the status still runs (same host, same PID space)."""
    if status.pid is None:
        return False
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


def render(status: StatusReport | None, now: float, *, explain: bool = False) -> str:
    if status is None:
        return "vkvagent: no status yet: the daemon has not run (or cannot write its state)\n"
    v, u, m = status.verdict, status.unit, status.now
    lines = []
    age = now - float(status.updated)
    head = f"vkvagent {status.agent_version}: {v.state.upper()}"
    if is_stale(status, now):
        alive = "running but silent" if daemon_alive(status) else "not running"
        head += f" (last update {_ago(age)} ago; daemon {alive})"
    lines.append(head)
    lines.append(f"  verdict     {v.action}: {v.reason}")
    if v.cause:
        lines.append(f"  cause       {v.cause}")
    unit = status.unit_name
    if u is not None:
        lines.append(
            f"  unit        {unit} {u.active_state} ({u.sub_state}), pid {u.main_pid}, "
            f"memory {_bytes(u.memory_bytes)}, automatic restarts {u.n_restarts}"
        )
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
    if status.pending_flags:
        lines.append(f"  flags       pending: {status.pending_flags}")
    if v.suggestion:
        shown = ", ".join(f"--{k} {val}" for k, val in v.suggestion.items())
        lines.append(f"  suggestion  {shown} (review, then set [vllm.flags])")
    if explain:
        lines.append("  evidence")
        for key, value in sorted(v.evidence.items()):
            lines.append(f"    {key:34} {value}")
    return "\n".join(lines) + "\n"


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


def _ago(seconds: float) -> str:
    return _duration(seconds)


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


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f} %"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"
