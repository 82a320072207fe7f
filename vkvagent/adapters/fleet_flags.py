"""The flag sets the hosts of a fleet group are trying or rejected, shared so that a change
reaches one host at a time and stops at the first that finds it slower or broken.

Each host puts ``PREFIX/GROUP/flags/NAME`` (``fleet_peers.PeerKeys``): its ``reconcile.Trial``
list, the set its run is trying and the sets it rejected, by flags_key and the server
identity it tried them from, and the rejection's words. No flag value and no command line
goes in: a peer matches a set by its key, which it computes from its own [vllm.flags]. A
host reads its peers' trials, and ``FlagLoop.due`` holds back a set of its [vllm.flags] that
a peer running the same server rejected, or is still trying (``reconcile.held_back``).

Just before the restart that would carry a set, a host takes the set's turn (``turn``): it
creates ``PREFIX/GROUP/flag-turns/SERVER/KEY`` in one transaction, reads its peers' trials
afresh and puts its own, then revokes the key's lease. Of hosts announcing the same set at
once, one creates the key and the others find it: the one that goes has read every earlier
trial, and each later host reads its trial. Without etcd's answer to any of these, the set
waits: it is never tried untold.

A peer's key over MAX_FLAGS bytes, not JSON, of another schema, naming another host or with
a trial that is not one is refused with a ``fleet.peer_refused`` event naming the peer.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence

from vkvagent.adapters.fleet import FleetError
from vkvagent.adapters.fleet_peers import PeerKeys
from vkvagent.knowledge.fleet_view import published
from vkvagent.knowledge.reconcile import UNASKED, Trial

SCHEMA = 1
MAX_FLAGS = 4096  # bytes: a few trials of about 200 each
# Hosts whose trials are read: 1,000 keys of an empty list (70 bytes) or a trial (250) stay
# well within an answer's 1 MiB.
PEERS_TRIALS = 1000
# Tries to take a set's turn when its holder lets go between this host's create and read.
TAKE_TRIES = 3
TURN_TTL = 60  # seconds a turn outlives a host that died holding it (it takes a few requests)


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

    @contextlib.contextmanager
    def turn(self, mine: Trial) -> Iterator[Trial | None]:
        """This host's turn to announce its trial of a set (``mine``), for as long as the
        ``with`` lasts: None when it has the turn, else why not: the trial of the peer that
        has it, or ``unanswered``'s. The key is under a lease of its own, revoked when the
        ``with`` ends: a host that dies holding it lets go within TURN_TTL."""
        key = f"{self.fleet.prefix}flag-turns/{mine.server}/{mine.key}"
        try:
            lease, holder = (None, self.unanswered(mine)) if self.quiet else self._take(key, mine)
        except FleetError:
            self.went_quiet()
            lease, holder = None, self.unanswered(mine)
        if lease is None:
            yield holder
            return
        try:
            yield None
        finally:
            with contextlib.suppress(FleetError):  # else it ends by itself
                self.fleet.client.revoke(lease)

    def unanswered(self, mine: Trial) -> Trial | None:
        """What holds ``mine`` back while etcd does not answer (None when it does): a set
        waits for its group rather than go untold, as a restart waits for a slot."""
        if not self.quiet:
            return None
        return Trial("etcd", mine.key, mine.server, UNASKED, None, "etcd did not answer")

    def _take(self, key: str, mine: Trial) -> tuple[str | None, Trial | None]:
        """Create the turn's ``key`` under a new lease: (the lease, None) once created, else
        (None, the holder's trial). Raises FleetError, the lease revoked."""
        lease, _granted = self.fleet.client.grant(TURN_TTL)
        value = json.dumps({"host": mine.host, "since": mine.since})
        taken = False
        try:
            for _ in range(TAKE_TRIES):
                taken = self.fleet.client.create(key, value, lease)
                if taken:
                    return lease, None
                found = self.fleet.client.range_prefix(key, 1)
                if found:  # else its holder let go in between: try again
                    return None, _holder(found[0]["value"], mine)
            return None, Trial("another host", mine.key, mine.server, "trying", mine.since)
        finally:
            if not taken:  # or no answer: the create may have been done all the same
                with contextlib.suppress(FleetError):
                    self.fleet.client.revoke(lease)

    @property
    def prefix(self) -> str:
        return f"{self.fleet.prefix}flags/"


def _holder(raw: str, mine: Trial) -> Trial:
    """The trial of the peer that has the turn of ``mine``'s set, from its key's value."""
    try:
        said = json.loads(raw)
        return Trial(str(said["host"]), mine.key, mine.server, "trying", float(said["since"]))
    except (ValueError, TypeError, KeyError):
        return Trial("another host", mine.key, mine.server, "trying", mine.since)


def parse(peer: str, raw: str) -> list[Trial]:
    """The trials ``peer`` published; ValueError saying why not."""
    document = published(raw, MAX_FLAGS, SCHEMA)
    if document.get("host") != peer:
        raise ValueError("it names another host")
    trials = document.get("trials")
    if not isinstance(trials, list):
        raise ValueError("trials: expected a list")
    return [Trial.from_json(peer, trial) for trial in trials]
