"""What the hosts of a fleet group learn from each other: their cured runs, by server.

A host's cured runs (``prevention.Track``: the speed a run kept by half hour of uptime until a
restart cured it, and that restart's outage) are what prevention times its restarts from.
Replicas of one server (the same vLLM, model, cache config and flags:
``carry.server_identity``) lose speed alike, so each host publishes its own runs of the server
it runs, ``PREFIX/GROUP/runs/SERVER/NAME``, under its entry's lease (``Fleet.put_own``), when
they change: a run ends cured a few times a week, a few revisions a week. A host reads its
peers' runs of its server (PEERS_READ of them, every READ_EVERY), and ``prevention.plan`` uses
them while it has fewer than ``min_runs`` of its own (a new host, or its first run after an
upgrade, which is a new server), leaving out those that disagree with the others.

A peer's key is refused, with a ``fleet.peer_refused`` event naming the peer (once per value),
when it is over MAX_RUNS bytes, not JSON, of another schema, names another host or server, or
holds a run that is not a cured one of the server; it never reaches the engine. With etcd
unreachable a host goes on with the runs it last read: the gate's listing says etcd is
unreachable, once.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from vkvagent.adapters.fleet import ENTRY_LEASE, PUBLISH_EVERY, Emit, Fleet, FleetError
from vkvagent.adapters.query_range import ReplayError
from vkvagent.engine.prevention import Track
from vkvagent.knowledge.fleet_view import published

SCHEMA = 1
MAX_RUNS = 32 * 1024  # bytes: KEPT runs of TRACKED / BUCKET points each are about 8 kB
PEERS_READ = 20  # peers whose runs are read: up to KEPT runs each, plenty for one fit
READ_EVERY = 1800.0  # seconds between two reads of the peers' runs of the same server
# Seconds without asking etcd again after it did not answer: the tick pays a request's
# timeout for the runs once a minute at most while etcd is down.
RETRY_AFTER = 60.0


class FleetRuns:
    """This host's runs shared with its group, and its peers' read back."""

    def __init__(self, fleet: Fleet, emit: Emit, mono: Callable[[], float] = time.monotonic):
        self.fleet, self.emit, self._mono = fleet, emit, mono
        self._shared: str | None = None  # the value last put
        self._read: tuple[str, float] | None = None  # the server and time of the last read
        self._learned: tuple[Track, ...] = ()
        self._refused: set[tuple[str, str]] = set()  # (peer, digest of its value) told
        self._quiet_until = -float("inf")  # no request before: etcd did not answer

    def prefix(self, server: str) -> str:
        return f"{self.fleet.prefix}runs/{server}/"

    def share(self, server: str, tracks: Sequence[Track]) -> None:
        """Put this host's cured runs of ``server`` when they changed. A failed put is tried
        again RETRY_AFTER later; the gate's listing tells of an etcd that does not answer."""
        mine = [t.to_json() for t in tracks if t.cured and not t.late and t.server == server]
        if not server or not mine or self._mono() < self._quiet_until:
            return
        document = {"schema": SCHEMA, "host": self.fleet.host, "server": server, "runs": mine}
        value = json.dumps(document, separators=(",", ":"))
        if value == self._shared:
            return
        try:
            ttl = math.ceil(ENTRY_LEASE * PUBLISH_EVERY)
            self.fleet.put_own(self.prefix(server) + self.fleet.host, value, ttl)
        except FleetError:
            self._quiet_until = self._mono() + RETRY_AFTER
            return
        self._shared = value

    def learned(self, server: str) -> tuple[Track, ...]:
        """The peers' cured runs of ``server``: read again every READ_EVERY, and at once for
        another server; what was last read while etcd does not answer (asked again
        RETRY_AFTER later)."""
        if not server:
            return ()
        now, read = self._mono(), self._read
        known = self._learned if read is not None and read[0] == server else ()
        if (read is not None and read[0] == server and now - read[1] < READ_EVERY) or (
            now < self._quiet_until
        ):
            return known
        prefix = self.prefix(server)
        try:
            found = self.fleet.client.range_prefix(prefix, PEERS_READ + 1)  # ours among them
        except FleetError:
            self._quiet_until = now + RETRY_AFTER
            return known
        runs: list[Track] = []
        for kv in found:
            peer = kv["key"][len(prefix) :]
            if peer == self.fleet.host:
                continue
            try:
                runs += parse(peer, server, kv["value"])
            except ValueError as exc:
                self._refuse(peer, server, kv["value"], str(exc))
        self._read, self._learned = (server, now), tuple(runs)
        return self._learned

    def _refuse(self, peer: str, server: str, value: str, why: str) -> None:
        told = (peer, hashlib.sha256(value.encode("utf-8", "replace")).hexdigest())
        if told in self._refused:
            return
        self._refused.add(told)
        self.emit(
            "fleet.peer_refused",
            f"{peer}'s runs of server {server} refused: {why}",
            group=self.fleet.group,
            peer=peer,
            server=server,
            error=why,
        )


def load(path: Path) -> tuple[Track, ...]:
    """The runs of a file of the group's runs keys, one value a line, as ``etcdctl get
    --prefix --print-value-only PREFIX/GROUP/runs/SERVER/`` prints them: for ``vkvagent replay
    --fleet-runs``. ReplayError naming the line that is not one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    runs: list[Track] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except (ValueError, RecursionError):
            document = None  # parse says so
        names = document if isinstance(document, dict) else {}
        try:
            runs += parse(str(names.get("host")), str(names.get("server")), line)
        except ValueError as exc:
            raise ReplayError(f"{path}:{number}: not a host's runs: {exc}") from None
    return tuple(runs)


def parse(peer: str, server: str, raw: str) -> list[Track]:
    """The cured runs of ``server`` that ``peer`` published; ValueError saying why not."""
    document = published(raw, MAX_RUNS, SCHEMA)
    if document.get("host") != peer or document.get("server") != server:
        raise ValueError("it names another host or server")
    runs = document.get("runs")
    if not isinstance(runs, list):
        raise ValueError("runs: expected a list")
    tracks = [Track.from_json(run) for run in runs]
    if any(t.server != server or t.cured is not True or t.late for t in tracks):
        raise ValueError("a run that is not a cured one of this server")
    return tracks
