"""What the hosts of a fleet group tell each other in etcd, beyond their entries: each host
puts values of its own (``Fleet.put_own``, under its entry's lease, so a host gone for good
takes them with it) and reads its peers' back, for ``fleet_runs`` (the cured runs of a server)
and ``fleet_flags`` (the flag sets a host is trying or rejected).

``PeerKeys`` puts a value only when it changed, and reads a prefix at most every READ_EVERY:
what a host learns changes a few times a week, and every put is a revision etcd keeps until
it compacts. A peer's value that ``parse`` refuses is told once per value, as a
``fleet.peer_refused`` event naming the peer, and never reaches the daemon. With etcd not
answering, what was last read stands and etcd is asked again RETRY_AFTER later: the gate's
listing says etcd is unreachable, once.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from vkvagent.adapters.fleet import (
    ENTRY_LEASE,
    PUBLISH_EVERY,
    RETRY_AFTER,
    Emit,
    Fleet,
    FleetError,
)

PEERS_READ = 20  # peers' values read a time: plenty for what one host learns from
READ_EVERY = 1800.0  # seconds between two reads of the same prefix

T = TypeVar("T")


class PeerKeys(Generic[T]):
    """This host's values put in etcd when they change, and its peers' read back."""

    def __init__(self, fleet: Fleet, emit: Emit, mono: Callable[[], float] = time.monotonic):
        self.fleet, self.emit, self._mono = fleet, emit, mono
        self._shared: dict[str, tuple[str, str | None]] = {}  # key -> value put, its lease
        self._read: dict[str, tuple[float, tuple[T, ...]]] = {}  # prefix -> when, what
        self._refused: set[tuple[str, str]] = set()  # (peer, digest of its value) told
        self._quiet_until = -float("inf")  # no request before: etcd did not answer

    @property
    def quiet(self) -> bool:
        """Whether etcd is left alone for now: it did not answer less than RETRY_AFTER ago."""
        return self._mono() < self._quiet_until

    def went_quiet(self) -> None:
        """etcd did not answer: ask it nothing for RETRY_AFTER."""
        self._quiet_until = self._mono() + RETRY_AFTER

    def put(self, key: str, value: str) -> None:
        """Put this host's ``value`` at ``key`` if it changed, or its lease did (an etcd that
        did not hear from this host for a lease's time deleted the key with it). A failed put
        is tried again RETRY_AFTER later."""
        if self._shared.get(key) == (value, self.fleet.own_lease):
            return
        if self.quiet:
            return
        try:
            self.fleet.put_own(key, value, math.ceil(ENTRY_LEASE * PUBLISH_EVERY))
        except FleetError:
            self.went_quiet()
            return
        self._shared[key] = (value, self.fleet.own_lease)

    def read(
        self,
        prefix: str,
        parse: Callable[[str, str], Sequence[T]],
        what: str,
        *,
        peers: int = PEERS_READ,
        fresh: bool = False,
        **fields: str,
    ) -> tuple[T, ...]:
        """What the peers put under ``prefix`` (``peers`` of them, this host's own left out),
        each value parsed by ``parse(peer, value)``: ValueError refuses it, told as ``what``
        ("gpu-b's WHAT refused: why", with the event's ``fields``). Read again every
        READ_EVERY, or now if ``fresh``; what was last read while etcd does not answer."""
        now = self._mono()
        when, known = self._read.get(prefix, (-float("inf"), ()))
        if (now - when < READ_EVERY and not fresh) or now < self._quiet_until:
            return known
        try:
            found = self.fleet.client.range_prefix(prefix, peers + 1)  # ours among them
        except FleetError:
            self.went_quiet()
            return known
        learned: list[T] = []
        for kv in found:
            peer = kv["key"][len(prefix) :]
            if peer == self.fleet.host:
                continue
            try:
                learned += parse(peer, kv["value"])
            except ValueError as exc:
                message = f"{peer}'s {what} refused: {exc}"
                self._refuse(peer, kv["value"], message, error=str(exc), **fields)
        self._read[prefix] = (now, tuple(learned))
        return self._read[prefix][1]

    def _refuse(self, peer: str, value: str, message: str, **fields: str) -> None:
        told = (peer, hashlib.sha256(value.encode("utf-8", "replace")).hexdigest())
        if told in self._refused:
            return
        self._refused.add(told)
        self.emit("fleet.peer_refused", message, group=self.fleet.group, peer=peer, **fields)
