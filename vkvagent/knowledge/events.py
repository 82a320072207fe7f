"""Structured events: one per thing the daemon concludes or does, for journald and the SIEM.

Every event has a stable name (``VKV_EVENT=restart.completed``), a fixed ``MESSAGE_ID`` per
name, a syslog ``PRIORITY``, a one-line ``MESSAGE`` for people, and every input, threshold and
reason as its own field. Under systemd (stderr is the journal: ``JOURNAL_STREAM``) events go to
journald through its native protocol, so fields stay fields; anywhere else they are one JSON
object per line on stderr. Each event is stamped, stripped of secrets and rendered, in that
order. docs/events.md is the catalogue.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import time
import uuid
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, TextIO

from vkvagent import apikey
from vkvagent.jsonsafe import finite

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "vkvagent"
_ID_NAMESPACE = uuid.UUID("6f1c2b53-64c6-4c1e-9d5b-0c8d2f7e9a41")

# syslog priorities, as journald stores them
EMERG, ALERT, CRIT, ERR, WARNING, NOTICE, INFO, DEBUG = range(8)


@dataclass(frozen=True)
class EventType:
    priority: int
    summary: str

    def message_id(self, name: str) -> str:
        """Fixed for the name forever: derived from it, never from the text."""
        return uuid.uuid5(_ID_NAMESPACE, name).hex


CATALOGUE: Mapping[str, EventType] = {
    "agent.started": EventType(INFO, "the daemon loaded its config and state and is ready"),
    "agent.reloaded": EventType(NOTICE, "SIGHUP: a new config was validated and is in use"),
    "agent.reload_failed": EventType(ERR, "SIGHUP: the new config is invalid; the old stays"),
    "agent.stopping": EventType(INFO, "SIGTERM or SIGINT: the daemon is stopping"),
    "agent.action_recovered": EventType(
        NOTICE, "an action a crash interrupted was completed or undone at start-up"
    ),
    "decision.changed": EventType(INFO, "the decision (action, cause or reason) changed"),
    "decision.unchanged": EventType(INFO, "periodic reminder of a decision that still holds"),
    "restart.started": EventType(NOTICE, "vkvagent begins restarting the unit"),
    "restart.completed": EventType(NOTICE, "the unit restarted and answers again"),
    "restart.failed": EventType(ERR, "a restart failed or was aborted"),
    "restart.rolled_back": EventType(WARNING, "a flag change failed and was rolled back"),
    "restart.hook": EventType(INFO, "a pre_stop or post_ready command ran; its output is here"),
    "restart.hook_failed": EventType(
        WARNING, "a pre_stop (restart abandoned) or post_ready (restart done) command failed"
    ),
    "restart.recovered": EventType(INFO, "after a restart the fresh speed came back"),
    "restart.not_recovered": EventType(WARNING, "a restart did not restore the fresh speed"),
    "policy.escalated": EventType(
        CRIT, "restarts in a row did not help: no more until `vkvagent resume`"
    ),
    "flags.pending": EventType(
        NOTICE, "the unit runs other flags than [vllm.flags] (or a slower change): when they go"
    ),
    "flags.refused": EventType(
        ERR, "a flag set is invalid, or did not start: not tried again until the config changes"
    ),
    "flags.held": EventType(
        NOTICE, "[vllm.flags] waits: a peer of the fleet is trying the set, or rejected it"
    ),
    "flags.judged": EventType(
        NOTICE, "the verdict on a flag change: its run's fresh speed against the run before"
    ),
    "unit.exited": EventType(
        WARNING,
        "vLLM's process ended without vkvagent asking (a crash, or a stop someone asked "
        "for), with its exit and error line",
    ),
    "probe.failed": EventType(
        WARNING, "the active probe got no answer, an error, or cannot be sent (once per kind)"
    ),
    "probe.recovered": EventType(INFO, "the active probe is answered again"),
    "source.failed": EventType(WARNING, "a source (vLLM, GPU, systemd) stopped answering"),
    "source.recovered": EventType(INFO, "a source answers again"),
    "state.write_failed": EventType(ERR, "the state directory could not be written"),
    "state.write_recovered": EventType(INFO, "the state directory can be written again"),
    "fleet.slot_acquired": EventType(
        NOTICE, "a slot of the fleet group was taken (etcd lease): the restart may begin"
    ),
    "fleet.slot_waited": EventType(
        INFO, "every slot of the group is held: the restart waits (once per change of holders)"
    ),
    "fleet.slot_released": EventType(INFO, "the slot was given back after the restart"),
    "fleet.slot_lost": EventType(
        ERR, "the slot's lease expired while held (keepalive failed): others may restart"
    ),
    "fleet.unreachable": EventType(
        WARNING, "etcd does not answer: restarts held (or emergencies only, as configured)"
    ),
    "fleet.reachable": EventType(INFO, "etcd answers again: restarts are coordinated again"),
    "fleet.peer_refused": EventType(
        WARNING, "what a peer published (runs, flag trials) is not what vkvagent reads: left out"
    ),
    "slo.burning": EventType(
        WARNING, "an objective of [slo] burns its error budget fast or slowly (once per rise)"
    ),
    "slo.recovered": EventType(INFO, "an objective's budget no longer burns above its alerts"),
}

_PRIORITY_NAMES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")


def field_name(key: str) -> str:
    """A journal field name for ``key``: upper case, ``[A-Z0-9_]``, prefixed ``VKV_``."""
    cleaned = "".join(c if c.isalnum() else "_" for c in key.upper())
    return "VKV_" + cleaned.strip("_")


def flatten(fields: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings become ``parent_child`` keys (evidence, suggestion)."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}_"))
        else:
            out[name] = value
    return out


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return ",".join(_text(v) for v in value)
    return str(value)


def journal_datagram(fields: Mapping[str, Any]) -> bytes:
    """journald's native protocol: ``KEY=value\\n``, or for a value with a newline,
    ``KEY\\n`` + its length (64-bit little endian) + the value + ``\\n``."""
    out = bytearray()
    for key, value in fields.items():
        data = _text(value).encode("utf-8", "replace")
        name = key.encode("ascii")
        if b"\n" in data:
            out += name + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name + b"=" + data + b"\n"
    return bytes(out)


def journal_fields(event: Mapping[str, Any]) -> dict[str, Any]:
    """A rendered event as journal fields."""
    name = str(event["event"])
    kind = CATALOGUE[name]
    fields: dict[str, Any] = {
        "MESSAGE": event.get("message", name),
        "PRIORITY": kind.priority,
        "MESSAGE_ID": kind.message_id(name),
        "SYSLOG_IDENTIFIER": IDENTIFIER,
        "VKV_EVENT": name,
    }
    skip = {"event", "message", "level", "timestamp"}
    for key, value in flatten({k: v for k, v in event.items() if k not in skip}).items():
        if value is not None:
            fields[field_name(key)] = value
    return fields


class JournalWriter:
    """Sends each event as one datagram to journald's socket. A datagram journald refuses
    (too large) is sent again with its fields cut to 4 KiB each."""

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        self.path = path
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def write(self, fields: Mapping[str, Any]) -> None:
        try:
            self.socket.sendto(journal_datagram(fields), self.path)
        except OSError:
            cut = {k: _text(v)[:4096] for k, v in fields.items()}
            try:
                self.socket.sendto(journal_datagram(cut), self.path)
            except OSError as exc:  # journald gone: stderr still reaches someone
                print(f"vkvagent: journald: {exc}: {fields.get('MESSAGE')}", file=sys.stderr)


def under_journald(stream: TextIO = sys.stderr) -> bool:
    """Whether ``stream`` is connected to the journal (systemd sets JOURNAL_STREAM to the
    device and inode of the stream it gave the service)."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    if not expected or not os.path.exists(JOURNAL_SOCKET):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


def _without_secrets(event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Every text of the event without vLLM's API key (``apikey.redact``): a journal line or
    a command line quoted in it may hold one."""
    for key, value in event.items():
        event[key] = _redacted(value)
    return event


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return apikey.redact(value)
    if isinstance(value, (list, tuple)):
        return [_redacted(item) for item in value]
    if isinstance(value, dict):
        return {key: _redacted(item) for key, item in value.items()}
    return value


class Events:
    """The emitter. ``emit(name, message, **fields)``; the name must be in CATALOGUE.
    ``now`` stamps each event (the demo's clock runs fast)."""

    def __init__(
        self,
        *,
        journal: JournalWriter | None = None,
        stream: TextIO | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.journal = journal
        self.stream = stream if stream is not None else sys.stderr
        self._now = now

    @classmethod
    def for_environment(cls, now: Callable[[], float] = time.time) -> Events:
        """Native journald under systemd, JSON lines on stderr otherwise."""
        return cls(journal=JournalWriter() if under_journald() else None, now=now)

    @classmethod
    def for_command(cls) -> Events | None:
        """An operator's command (``apply``, ``restart``, ``rollback``): its outcome goes to
        journald, where the daemon's go, so the SIEM sees every restart whoever asked for it.
        None without journald: the terminal already has the outcome in words."""
        return cls(journal=JournalWriter()) if os.path.exists(JOURNAL_SOCKET) else None

    def emit(self, name: str, message: str, **fields: Any) -> None:
        if name not in CATALOGUE:
            raise ValueError(f"unknown event {name!r}")
        event: dict[str, Any] = {"message": message, **fields, "event": name}
        event["timestamp"] = datetime.fromtimestamp(self._now(), timezone.utc).isoformat()
        self._render(_without_secrets(event))

    def _render(self, event: MutableMapping[str, Any]) -> None:
        if self.journal is not None:
            self.journal.write(journal_fields(event))
            return
        name = str(event.pop("event"))
        kind = CATALOGUE[name]
        line = {
            "timestamp": event.pop("timestamp"),
            "level": _PRIORITY_NAMES[kind.priority],
            "event": name,
            "message_id": kind.message_id(name),
            "message": event.pop("message", name),
            **event,
        }
        self.stream.write(json.dumps(finite(line), default=str) + "\n")
        self.stream.flush()
