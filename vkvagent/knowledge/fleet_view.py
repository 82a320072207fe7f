"""What the hosts of a fleet group say of themselves, and ``vkvagent fleet status``'s view.

Each daemon with ``[fleet]`` publishes a ``HostEntry`` of its own in etcd (``fleet.Gate``): a
digest of its status.json, its verdict and cause, vLLM's version and uptime, the speed against
its baseline and its last restart. Nothing secret goes in: no command line, no flags, no key,
no hook's output, no evidence. ``FleetView`` is the group as read back. Each entry is checked
(its size, JSON, schema and the host it names), so that a bad one is refused by name and never
hides the others, and a host that stopped publishing counts as unknown, as a stale
status.json does for ``vkvagent status``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vkvagent.knowledge.status import (
    STATES,
    LastRestart,
    SlotHolder,
    StatusCode,
    StatusError,
    StatusReport,
    _Part,
    duration,
    exit_code,
)

SCHEMA = 1  # the entries' layout; a newer one is refused, not guessed at
MAX_ENTRY = 4096  # bytes: an entry is about 700; anything bigger is not one of vkvagent's
REASON_CHARS = 200
# The exit code of the group: the worst host's, critical before unknown before degraded (as
# Nagios ranks a cluster's states).
WORST_LAST = (StatusCode.HEALTHY, StatusCode.DEGRADED, StatusCode.UNKNOWN, StatusCode.CRITICAL)
COLUMNS = ("HOST", "STATE", "CAUSE", "VLLM", "UPTIME", "SPEED", "LAST ACTION", "SLOT", "ENTRY")


@dataclass(frozen=True)
class HostEntry(_Part):
    """One host of a group, as it last published itself."""

    host: str
    published: float  # UTC seconds
    stale_after: float  # seconds after ``published`` that it no longer says how the host is
    agent_version: str
    state: str  # one of status.STATES
    code: int  # its `vkvagent status` exit code when published
    action: str  # restart, hold, none
    reason: str
    cause: str | None = None
    ratio: float | None = None  # speed over the fresh baseline at this load
    vllm_version: str | None = None
    uptime_s: float | None = None
    last_restart: LastRestart | None = None  # without the hooks' output

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **super().to_json()}

    def facts(self) -> tuple[object, ...]:
        """What publishes the entry at once when it changes. The speed, the reason and the
        uptime change with every sample: they wait for the next publish (the uptime is
        shown as published plus the entry's age)."""
        return (self.state, self.code, self.cause, self.action, self.vllm_version,
                self.last_restart)  # fmt: skip

    @classmethod
    def of(cls, report: StatusReport, host: str, now: float, every: float) -> HostEntry:
        """The entry of a host whose daemon wrote ``report`` and publishes at least every
        ``every`` seconds: stale once three of its samples are missed after that, or a
        restart's length (then it publishes nothing until the restart ends)."""
        v, last = report.verdict, report.last_restart
        return cls(
            host=host,
            published=round(now, 3),
            stale_after=max(every + 3 * report.interval, report.stale_after or 0.0),
            agent_version=report.agent_version,
            state=v.state,
            code=int(exit_code(report, now)),
            action=v.action,
            reason=v.reason[:REASON_CHARS],
            cause=v.cause,
            ratio=v.ratio,
            vllm_version=report.vllm.version,
            uptime_s=report.vllm.uptime_s,
            last_restart=None
            if last is None
            else dataclasses.replace(last, reason=last.reason[:REASON_CHARS], hooks=None),
        )

    @classmethod
    def parse(cls, host: str, raw: str) -> HostEntry:
        """The entry published under ``host``'s key; StatusError saying why it is refused."""
        try:
            data = published(raw, MAX_ENTRY, SCHEMA)
        except ValueError as exc:
            raise StatusError(str(exc)) from None
        entry = cls.from_json(data)
        if entry.host != host:
            raise StatusError(f"it names another host, {entry.host!r}")
        if entry.state not in STATES or entry.code not in list(StatusCode):
            raise StatusError(f"state {entry.state!r}, code {entry.code}: not vkvagent's")
        return entry


def published(raw: str, limit: int, schema: int) -> dict[str, Any]:
    """What a peer published under one of its keys: a JSON object of ``schema``, at most
    ``limit`` bytes; ValueError saying why not (a newer schema named as such)."""
    size = len(raw.encode("utf-8"))
    if size > limit:
        raise ValueError(f"{size} bytes, over the {limit} it may have")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("not JSON") from None
    said = data.get("schema") if isinstance(data, dict) else None
    if not isinstance(data, dict) or said != schema:
        newer = isinstance(said, int) and said > schema
        raise ValueError(
            f"schema {said!r}: "
            + (f"newer than this vkvagent reads ({schema})" if newer else f"expected {schema}")
        )
    return data


@dataclass(frozen=True)
class Peer:
    """A host's line in the view: its entry, how old it is and the slot it holds."""

    entry: HostEntry
    age: float  # seconds since it was published
    slot: int | None  # the group's restart slot it holds, as etcd's slot keys say

    @property
    def stale(self) -> bool:
        return self.age > self.entry.stale_after

    @property
    def code(self) -> StatusCode:
        return StatusCode.UNKNOWN if self.stale else StatusCode(self.entry.code)

    def seen(self) -> dict[str, Any]:
        """What the reader adds to the entry in ``--json``."""
        return {"age_s": round(self.age, 3), "stale": self.stale, "exit_code": int(self.code),
                "slot": self.slot}  # fmt: skip


@dataclass(frozen=True)
class Refused:
    """A key under the group's hosts that is not an entry this vkvagent reads."""

    host: str
    error: str


@dataclass(frozen=True)
class FleetView:
    """The group as ``vkvagent fleet status`` shows it."""

    group: str
    max_concurrent: int
    hosts: tuple[Peer, ...]
    refused: tuple[Refused, ...]
    holders: tuple[SlotHolder, ...]

    @classmethod
    def of(
        cls,
        group: str,
        max_concurrent: int,
        now: float,
        entries: Iterable[tuple[str, str]],
        holders: Iterable[SlotHolder],
    ) -> FleetView:
        """From the group's ``(host, raw entry)`` pairs and its slot holders, read at ``now``."""
        held = tuple(holders)
        slots = {h.host: h.slot for h in held}
        hosts, refused = [], []
        for host, raw in entries:
            try:
                entry = HostEntry.parse(host, raw)
            except StatusError as exc:
                refused.append(Refused(host, str(exc)))
                continue
            hosts.append(Peer(entry, max(0.0, now - entry.published), slots.get(host)))
        return cls(
            group,
            max_concurrent,
            tuple(sorted(hosts, key=lambda p: p.entry.host)),
            tuple(sorted(refused, key=lambda r: r.host)),
            held,
        )

    @property
    def code(self) -> StatusCode:
        """The worst host's code; unknown with no host, or an entry refused."""
        codes = [p.code for p in self.hosts]
        if not codes or self.refused:
            codes.append(StatusCode.UNKNOWN)
        return max(codes, key=WORST_LAST.index)

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "max_concurrent": self.max_concurrent,
            "code": int(self.code),
            "hosts": [{**p.entry.to_json(), **p.seen()} for p in self.hosts],
            "refused": [{"host": r.host, "error": r.error} for r in self.refused],
            "holders": [h.to_json() for h in self.holders],
        }

    def render(self, now: float) -> str:
        """A line per host under a line for the group."""
        held = ", ".join(f"{h.host} (slot {h.slot})" for h in self.holders)
        lines = [
            f"fleet group {self.group}: {len(self.hosts)} host{'s' * (len(self.hosts) != 1)}, "
            f"{len(self.holders)} of {self.max_concurrent} restart slots held"
            + (f" by {held}" if held else "")
        ]
        rows = [COLUMNS, *(_row(p, now) for p in self.hosts)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines += [f"refused {r.host}: {r.error}" for r in self.refused]
        if not self.hosts and not self.refused:
            lines.append("no host has published an entry (is the daemon running with [fleet]?)")
        return "\n".join(lines) + "\n"


def _row(peer: Peer, now: float) -> tuple[str, ...]:
    """A host's cells, in COLUMNS' order."""
    e, last = peer.entry, peer.entry.last_restart
    action = "-"
    if last is not None:
        action = f"{last.kind} {last.outcome or 'in progress'}"
        if last.recovered is not None:
            action += ", recovered" if last.recovered else ", not recovered"
        action += f", {duration(now - last.started)} ago"
    entry = f"{duration(peer.age)} ago" + (f", stale (was {e.state})" if peer.stale else "")
    return (
        e.host,
        "unknown" if peer.stale else e.state,
        e.cause or "-",
        e.vllm_version or "-",
        duration(e.uptime_s if e.uptime_s is None or peer.stale else e.uptime_s + peer.age),
        "-" if e.ratio is None else f"{e.ratio:.2f}",
        action,
        "-" if peer.slot is None else str(peer.slot),
        entry,
    )
