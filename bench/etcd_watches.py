"""Watching the group's slots against listing them (`make bench-fleet`, after the entries).

Each daemon lists its group's slots (``PREFIX/GROUP/slot-``) every LIST_EVERY seconds for its
status. The alternative is a watch: one stream a host, open for as long as the daemon runs, on
which etcd sends each slot taken or given back. Against the real etcd, with ``--hosts``
watches open through its JSON gateway (as ``EtcdClient`` speaks to it: one HTTP/1.1 stream
each, read with one selector):

- **open**: the streams opened, until etcd confirmed every one;
- **idle**: etcd's CPU over ``--idle`` seconds with every stream open and nothing changing,
  less its CPU over as long without them;
- **a restart**: one host takes a slot and gives it back (``Fleet.acquire``, ``Slot.release``),
  ``--restarts`` times; each is two events, and the time until every watcher had both;
- **listing** (the baseline, in the same run): every host lists the slots once.

Then the steady load of both ways at 1x and 10x the hosts, a restart a host a day.
"""

from __future__ import annotations

import base64
import json
import selectors
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.etcd_meter import SENT, SETTLE, TICKS, EtcdMeter
from vkvagent.adapters.fleet import LIST_EVERY, Fleet, prefix_end

DAY = 86400.0
EVENT = b'"kv":'  # once in each event etcd sends (it may send several in one message)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Watchers:
    """``count`` watch streams on ``prefix``, each a socket to etcd's JSON gateway."""

    def __init__(self, port: int, prefix: str, count: int) -> None:
        request = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}}
        body = json.dumps(request).encode()
        head = (
            f"POST /v3/watch HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.selector = selectors.DefaultSelector()
        self.events = [0] * count  # events each stream has received
        self.created = [False] * count
        self._tails = [b""] * count  # the last bytes read: a marker may span two reads
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(head.encode() + body)
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ, i)

    def pump(self, until: float) -> None:
        """Read what etcd sent until ``until`` (perf_counter) or nothing is left to wait for."""
        while (left := until - time.perf_counter()) > 0:
            for key, _ in self.selector.select(min(left, 0.05)):
                i = key.data
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                if not data:
                    raise RuntimeError(f"etcd closed watch stream {i}")
                seen = self._tails[i] + data
                self.created[i] = self.created[i] or b'"created":true' in seen
                self.events[i] += seen.count(EVENT) - self._tails[i].count(EVENT)
                self._tails[i] = seen[-len(EVENT) :]

    def wait(self, done: Callable[[], bool], timeout: float = 60.0) -> float:
        """Seconds until ``done()``; RuntimeError past ``timeout``."""
        began = time.perf_counter()
        while not done():
            if time.perf_counter() - began > timeout:
                raise RuntimeError("the watchers did not all hear it in time")
            self.pump(time.perf_counter() + 0.01)
        return time.perf_counter() - began

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


@dataclass(frozen=True)
class Figures:
    open_s: float  # seconds until every stream was confirmed
    open_cpu: float  # etcd CPU seconds opening them
    idle_cpu: float  # etcd CPU seconds per second with them open and idle, over its own idle
    resolution: float  # of idle_cpu: a tick of /proc's CPU times over the idle seconds
    bare: tuple[float, float]  # a restart with no watcher: etcd CPU seconds, bytes sent
    watched: tuple[float, float]  # a restart with every host watching: the same
    heard: list[float]  # each watched restart: seconds until every watcher had both events
    listing: tuple[float, float]  # a host's listing of the slots: etcd CPU seconds, bytes


def restart(host: Fleet) -> None:
    """A restart's slot, taken and given back: two events under the slots' prefix."""
    slot, _ = host.acquire("bench", "a restart")
    assert slot is not None, "no free slot"
    slot.release()


def spent(meter: EtcdMeter, calls: Sequence[Callable[[], object]]) -> tuple[float, float]:
    """Run ``calls`` in turn: etcd's CPU seconds and the bytes it sent, per call."""
    cpu, out = meter.cpu(), meter.metric(SENT)
    for call in calls:
        call()
    time.sleep(SETTLE)
    return (meter.cpu() - cpu) / len(calls), (meter.metric(SENT) - out) / len(calls)


def measure(meter: EtcdMeter, fleet: Sequence[Fleet], idle: float, restarts: int) -> Figures:
    first = fleet[0]
    bare = spent(meter, [lambda: restart(first)] * restarts)
    listing = spent(meter, [host.holders for host in fleet])
    cpu = meter.cpu()
    time.sleep(idle)
    alone = (meter.cpu() - cpu) / idle  # etcd's own idle: its raft ticks, its backend
    cpu = meter.cpu()
    watchers = Watchers(meter.port, first.slots_prefix, len(fleet))
    try:
        open_s = watchers.wait(lambda: all(watchers.created))
        open_cpu = meter.cpu() - cpu
        time.sleep(SETTLE)  # the opening settles before the idle is counted
        cpu, began = meter.cpu(), time.perf_counter()
        watchers.pump(began + idle)
        idle_cpu = (meter.cpu() - cpu) / (time.perf_counter() - began) - alone
        heard: list[float] = []

        def watched() -> None:
            began = time.perf_counter()
            restart(first)
            goal = 2 * (len(heard) + 1)
            watchers.wait(lambda: min(watchers.events) >= goal)
            heard.append(time.perf_counter() - began)

        watched_cost = spent(meter, [watched] * restarts)
    finally:
        watchers.close()
    resolution = 1 / TICKS / idle
    return Figures(open_s, open_cpu, idle_cpu, resolution, bare, watched_cost, heard, listing)


def report(figures: Figures, hosts: int) -> None:
    f = figures
    told = f.watched[0] - f.bare[0]  # what telling every watcher of a restart costs etcd
    print(f"\nWatching the slots, {hosts} watch streams, {len(f.heard)} restarts:\n")
    print("| | seconds | etcd CPU (ms) | bytes etcd sent |")
    print("|---|---|---|---|")
    print(f"| open {hosts:,} watches | {f.open_s:.2f} | {f.open_cpu * 1000:.0f} | |")
    print(f"| a second of them idle, over etcd's own idle (to {f.resolution * 1000:.1f}) | | "
          f"{f.idle_cpu * 1000:.2f} | |")  # fmt: skip
    print(f"| a restart's slot, nobody watching | | {f.bare[0] * 1000:.1f} | {f.bare[1]:,.0f} |")
    print(
        f"| a restart's slot, until all {hosts:,} watchers heard both events: median "
        f"(slowest of {len(f.heard)}) | {statistics.median(f.heard):.3f} ({max(f.heard):.3f}) "
        f"| {f.watched[0] * 1000:.1f} | {f.watched[1]:,.0f} |"
    )
    print(f"| a host's listing of the slots (the baseline) | | {f.listing[0] * 1000:.2f} "
          f"| {f.listing[1]:,.0f} |")  # fmt: skip
    # A restart is told to every watcher of the group: that part grows with its square.
    print("\nThe steady load of each way, a restart a host a day (etcd CPU, % of a core):\n")
    print("| hosts in the group | listing every 30 s | watching | watching over listing |")
    print("|---|---|---|---|")
    for n in (hosts, 10 * hosts):
        listing = n / LIST_EVERY * f.listing[0]
        watching = f.idle_cpu * n / hosts + n / DAY * told * n / hosts
        print(f"| {n:,} | {listing * 100:.2f} | {watching * 100:.2f} | {watching / listing:.2f} |")
