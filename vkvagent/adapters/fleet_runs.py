"""What the hosts of a fleet group learn from each other of a server: its cured runs and its
fresh speed by load.

A host's cured runs (``prevention.Track``: the speed a run kept by half hour of uptime until a
restart cured it, and that restart's outage) are what prevention times its restarts from, and
a run's fresh baseline (``Baseline``: its speed at each load it learned while fresh) is what
the run is judged against. Replicas of one server (the same vLLM, model, cache config and
flags: ``carry.server_identity``) run alike, so each host publishes what it knows of the
server it runs, ``PREFIX/GROUP/runs/SERVER/NAME``, under its entry's lease (``Fleet.put_own``),
when it changes: a run ends cured a few times a week, and a fresh baseline is put when it
knows another load (each known load by its medians, ``digest``), a few puts a run. A host
reads its peers' of its server (``fleet_peers.PeerKeys``): ``prevention.plan`` uses their runs
while it has fewer than ``min_runs`` of its own (a new host, or its first run after an
upgrade, which is a new server), leaving out those that disagree with the others; their
baselines stand in at the loads neither this run nor the previous one learned, each once this
run proved as fast as it where both learned (``carry.stand_in``).

A peer's key is refused, with a ``fleet.peer_refused`` event naming the peer (once per value),
when it is over MAX_RUNS bytes, not JSON, of another schema, names another host or server, or
holds a run that is not a cured one of the server or a baseline of another server; it never
reaches the engine. With etcd unreachable a host goes on with what it last
read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

from vkvagent.adapters.fleet import Emit, Fleet
from vkvagent.adapters.fleet_peers import PeerKeys
from vkvagent.adapters.query_range import ReplayError
from vkvagent.engine import BaselineSettings
from vkvagent.engine.baseline import Baseline, Regime
from vkvagent.engine.prevention import Track
from vkvagent.knowledge.fleet_view import published

SCHEMA = 1
MAX_RUNS = 32 * 1024  # bytes: KEPT runs of TRACKED / BUCKET points each are about 8 kB

Learned = Union[Track, Baseline]


@dataclass(frozen=True)
class ServerKnowledge:
    """What the peers published of one server: their cured runs and fresh baselines."""

    runs: tuple[Track, ...] = ()
    baselines: tuple[Baseline, ...] = ()

    @classmethod
    def of(cls, learned: Sequence[Learned]) -> ServerKnowledge:
        return cls(
            tuple(t for t in learned if isinstance(t, Track)),
            tuple(b for b in learned if isinstance(b, Baseline)),
        )


class FleetRuns(PeerKeys[Learned]):
    """What this host knows of its server shared with its group, and its peers' read back."""

    def __init__(self, fleet: Fleet, emit: Emit, mono: Callable[[], float] = time.monotonic):
        super().__init__(fleet, emit, mono)
        # the baseline last put: what it knew (server, run, known loads), and its digest
        self._digest: tuple[tuple[object, ...], dict[str, Any]] | None = None

    def prefix(self, server: str) -> str:
        return f"{self.fleet.prefix}runs/{server}/"

    def share(
        self,
        server: str,
        tracks: Sequence[Track],
        baseline: Baseline | None,
        settings: BaselineSettings,
    ) -> None:
        """Put this host's cured runs of ``server``, and its run's fresh ``baseline`` of it,
        when they changed (the baseline when it knows another load)."""
        mine = [t.to_json() for t in tracks if t.cured and not t.late and t.server == server]
        fresh = self._fresh(server, baseline, settings)
        if not server or not (mine or fresh):
            return
        document = {"schema": SCHEMA, "host": self.fleet.host, "server": server, "runs": mine}
        if fresh:
            document["baseline"] = fresh
        self.put(self.prefix(server) + self.fleet.host, json.dumps(document, separators=(",", ":")))

    def _fresh(
        self, server: str, baseline: Baseline | None, settings: BaselineSettings
    ) -> dict[str, Any] | None:
        """``baseline``'s known loads by their medians, if it is a fresh one of ``server``;
        the same as last time while it knows the same loads, so that its medians moving
        puts nothing; and the last one put of ``server`` while a new run knows no load yet
        (or is late), so that a restart does not withdraw it from the peers."""
        kept = self._digest[1] if self._digest and self._digest[0][0] == server else None
        if baseline is None or baseline.server != server or baseline.late(settings):
            return kept
        known = baseline.known_keys(settings)
        if not known:
            return kept
        facts = (server, baseline.run, tuple(known))
        if self._digest is None or self._digest[0] != facts:
            self._digest = (facts, digest(baseline, settings).to_json())
        return self._digest[1]

    def learned(self, server: str) -> ServerKnowledge:
        """The peers' cured runs and fresh baselines of ``server``."""
        if not server:
            return ServerKnowledge()
        what = f"runs of server {server}"
        found = self.read(
            self.prefix(server), lambda p, raw: parse(p, server, raw), what, server=server
        )
        return ServerKnowledge.of(found)


def digest(baseline: Baseline, settings: BaselineSettings) -> Baseline:
    """What a host tells its peers of a fresh baseline: its known loads, each by its medians
    (the windows' values stay home): 1.9 kB for the bench's 3 loads, where the whole is 32."""
    regimes = {
        key: Regime(baseline.regimes[key].count,
                    {name: (median,) for name, median in baseline.regimes[key].medians.items()})
        for key in baseline.known_keys(settings)
    }  # fmt: skip
    return replace(baseline, regimes=regimes, last_added=None)


def load(path: Path) -> ServerKnowledge:
    """What a file of the group's runs keys holds, one value a line, as ``etcdctl get
    --prefix --print-value-only PREFIX/GROUP/runs/SERVER/`` prints them: for ``vkvagent replay
    --fleet-runs``. ReplayError naming the line that is not one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    found: list[Learned] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except (ValueError, RecursionError):
            document = None  # parse says so
        names = document if isinstance(document, dict) else {}
        try:
            found += parse(str(names.get("host")), str(names.get("server")), line)
        except ValueError as exc:
            raise ReplayError(f"{path}:{number}: not a host's runs: {exc}") from None
    return ServerKnowledge.of(found)


def parse(peer: str, server: str, raw: str) -> list[Learned]:
    """The cured runs and fresh baseline (its run named ``RUN@PEER``) of ``server`` that
    ``peer`` published; ValueError saying why not."""
    document = published(raw, MAX_RUNS, SCHEMA)
    if document.get("host") != peer or document.get("server") != server:
        raise ValueError("it names another host or server")
    runs = document.get("runs")
    if not isinstance(runs, list):
        raise ValueError("runs: expected a list")
    tracks = [Track.from_json(run) for run in runs]
    if any(t.server != server or t.cured is not True or t.late for t in tracks):
        raise ValueError("a run that is not a cured one of this server")
    found: list[Learned] = list(tracks)
    if document.get("baseline") is not None:
        baseline = Baseline.from_json(document["baseline"])
        if baseline.server != server:
            raise ValueError("a baseline of another server")
        found.append(replace(baseline, run=f"{baseline.run}@{peer}"))
    return found
