"""The flag sets the hosts of a fleet group are trying or rejected, shared so that a change
reaches one host at a time and stops at the first that finds it slower or broken.

Each host puts ``PREFIX/GROUP/flags/NAME`` (``fleet_peers.PeerKeys``): its ``reconcile.Trial``
list, the set its run is trying and the sets it rejected, by flags_key and the server
identity it tried them from, and the rejection's words. No flag value and no command line
goes in: a peer matches a set by its key, which it computes from its own [vllm.flags]. A
host reads its peers' trials, and ``FlagLoop.due`` holds back a set of its [vllm.flags] that
a peer running the same server rejected, or is still trying (``reconcile.held_back``).

A peer's key over MAX_FLAGS bytes, not JSON, of another schema, naming another host or with
a trial that is not one is refused with a ``fleet.peer_refused`` event naming the peer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from vkvagent.adapters.fleet_peers import PeerKeys
from vkvagent.knowledge.fleet_view import published
from vkvagent.knowledge.reconcile import Trial

SCHEMA = 1
MAX_FLAGS = 4096  # bytes: a few trials of about 200 each
# Hosts whose trials are read: 1,000 keys of an empty list (70 bytes) or a trial (250) stay
# well within an answer's 1 MiB.
PEERS_TRIALS = 1000


class FleetTrials(PeerKeys[Trial]):
    """This host's flag trials shared with its group, and its peers' read back."""

    def share(self, trials: Sequence[Trial]) -> None:
        """Put this host's trials when they changed: none is put only to withdraw what was
        put, so a host that never tried a set writes nothing."""
        key = self.prefix + self.fleet.host
        if not trials and key not in self._shared:
            return
        document = {"schema": SCHEMA, "host": self.fleet.host,
                    "trials": [t.to_json() for t in trials]}  # fmt: skip
        self.put(key, json.dumps(document, separators=(",", ":")))

    def learned(self, fresh: bool = False) -> tuple[Trial, ...]:
        """The peers' trials (all of them, up to PEERS_TRIALS: a trial from any host holds a
        set back); ``fresh``: read now, not at most every READ_EVERY."""
        return self.read(self.prefix, parse, "flag trials", peers=PEERS_TRIALS, fresh=fresh)

    @property
    def prefix(self) -> str:
        return f"{self.fleet.prefix}flags/"


def parse(peer: str, raw: str) -> list[Trial]:
    """The trials ``peer`` published; ValueError saying why not."""
    document = published(raw, MAX_FLAGS, SCHEMA)
    if document.get("host") != peer:
        raise ValueError("it names another host")
    trials = document.get("trials")
    if not isinstance(trials, list):
        raise ValueError("trials: expected a list")
    return [Trial.from_json(peer, trial) for trial in trials]
