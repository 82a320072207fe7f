"""What the hosts of a fleet group learn from each other: their cured runs, by server.

A host's cured runs (``prevention.Track``: the speed a run kept by half hour of uptime until a
restart cured it, and that restart's outage) are what prevention times its restarts from.
Replicas of one server (the same vLLM, model, cache config and flags:
``carry.server_identity``) lose speed alike, so each host publishes its own runs of the server
it runs, ``PREFIX/GROUP/runs/SERVER/NAME``, under its entry's lease (``Fleet.put_own``), when
they change: a run ends cured a few times a week, a few revisions a week. A host reads its
peers' runs of its server (``fleet_peers.PeerKeys``), and ``prevention.plan`` uses
them while it has fewer than ``min_runs`` of its own (a new host, or its first run after an
upgrade, which is a new server), leaving out those that disagree with the others.

A peer's key is refused, with a ``fleet.peer_refused`` event naming the peer (once per value),
when it is over MAX_RUNS bytes, not JSON, of another schema, names another host or server, or
holds a run that is not a cured one of the server; it never reaches the engine. With etcd
unreachable a host goes on with the runs it last read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from vkvagent.adapters.fleet_peers import PeerKeys
from vkvagent.adapters.query_range import ReplayError
from vkvagent.engine.prevention import Track
from vkvagent.knowledge.fleet_view import published

SCHEMA = 1
MAX_RUNS = 32 * 1024  # bytes: KEPT runs of TRACKED / BUCKET points each are about 8 kB


class FleetRuns(PeerKeys[Track]):
    """This host's runs shared with its group, and its peers' read back."""

    def prefix(self, server: str) -> str:
        return f"{self.fleet.prefix}runs/{server}/"

    def share(self, server: str, tracks: Sequence[Track]) -> None:
        """Put this host's cured runs of ``server`` when they changed."""
        mine = [t.to_json() for t in tracks if t.cured and not t.late and t.server == server]
        if server and mine:
            document = {"schema": SCHEMA, "host": self.fleet.host, "server": server, "runs": mine}
            self.put(
                self.prefix(server) + self.fleet.host, json.dumps(document, separators=(",", ":"))
            )

    def learned(self, server: str) -> tuple[Track, ...]:
        """The peers' cured runs of ``server``."""
        if not server:
            return ()
        what = f"runs of server {server}"
        return self.read(
            self.prefix(server), lambda p, raw: parse(p, server, raw), what, server=server
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
