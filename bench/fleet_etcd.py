"""What a fleet's host entries cost etcd (`make bench-fleet`; the real etcd, about a minute).

A real etcd (Debian's etcd-server, one member on loopback, as tests/test_fleet.py starts it)
and ``--hosts`` simulated hosts of one group, each a ``Fleet`` of its own (its own lease) with
an entry of the daemon's size, from ``--threads`` threads. In one run, ``--rounds`` times:

- **publish**: every host publishes its entry (``Fleet.put_own``: its lease's keepalive, a
  put; the first round grants the leases), what a daemon does every 5 minutes and at each
  change of its verdict;
- **slots**: every host lists the group's slots (``Fleet.holders``: one range read), what each
  daemon already does every 30 s: the baseline the publish is taken against;
- **fleet status**: the group's entries read (``Fleet.entries``: ENTRIES_PAGE a request) and
  the slots, into the view ``vkvagent fleet status`` prints.

For each: the median latency and its p99, the requests a second etcd sustained, etcd's CPU
seconds (its /proc stat) and the bytes its gRPC server sent (its /metrics; the JSON gateway
is a gRPC client of it), and the database's growth (``etcd_mvcc_db_total_size_in_use_in_bytes``:
etcd does not compact unless told, so each put stays). Then the steady load of the fleet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench import etcd_watches
from bench.etcd_meter import IN_USE, SENT, SETTLE, EtcdMeter
from tests.etcd import Etcd
from vkvagent.adapters.fleet import ENTRIES_PAGE, LIST_EVERY, PUBLISH_EVERY, Fleet
from vkvagent.knowledge.config import FleetConfig
from vkvagent.knowledge.fleet_view import FleetView, HostEntry
from vkvagent.knowledge.status import LastRestart

GROUP = "bench"


def entry(host: str, now: float) -> str:
    """An entry as a daemon publishes it: a degraded host whose last restart helped."""
    last = LastRestart(
        kind="restart", reason="uptime_decline: speed 0.71 of the fresh 812 tokens/s at this load",
        started=now - 86400, id=412, ended=now - 86310, outcome="done", recovered=True,
        costs={"drain_mode": "vllm", "in_flight": 3.0, "aborted": 0.0, "drain_seconds": 2.07,
               "down_seconds": 41.06, "missed": 39.2},
    )  # fmt: skip
    published = HostEntry(
        host=host, published=now, stale_after=360.0, agent_version="0.1.0", state="degraded",
        code=1, action="hold", reason="outside window (next 2026-12-07T02:00:00Z): "
        "uptime_decline, speed 0.71 of the fresh baseline", cause="uptime_decline", ratio=0.71,
        vllm_version="0.32.0", uptime_s=111600.0, last_restart=last,
    )  # fmt: skip
    return json.dumps(published.to_json(), separators=(",", ":"))


@dataclass(frozen=True)
class Round:
    seconds: list[float]  # each call's latency
    wall: float  # the round's
    cpu: float  # etcd's CPU seconds in it
    sent: float  # bytes etcd's gRPC server sent in it
    grown: float  # bytes the database grew by in it
    requests: int  # HTTP requests made in it


def measure(
    meter: EtcdMeter, calls: Sequence[Callable[[], object]], threads: int, per: int
) -> Round:
    """Run ``calls`` on ``threads`` threads; ``per``: HTTP requests each makes."""

    def timed(call: Callable[[], object]) -> float:
        began = time.perf_counter()
        call()
        return time.perf_counter() - began

    before = (meter.cpu(), meter.metric(SENT), meter.metric(IN_USE))
    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        seconds = list(pool.map(timed, calls))
    wall = time.perf_counter() - began
    time.sleep(SETTLE)
    after = (meter.cpu(), meter.metric(SENT), meter.metric(IN_USE))
    cpu, bytes_sent, grown = (b - a for a, b in zip(before, after))
    return Round(seconds, wall, cpu, bytes_sent, grown, per * len(calls))


def p99(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def row(name: str, rounds: Sequence[Round], baseline: float | None = None) -> str:
    """One line of the table: medians over the rounds (the first, granting leases, left out
    when there are more)."""
    kept = rounds[1:] if len(rounds) > 2 else rounds
    median = statistics.median(statistics.median(r.seconds) for r in kept) * 1000
    tail = statistics.median(p99(r.seconds) for r in kept) * 1000
    rate = statistics.median(r.requests / r.wall for r in kept)
    cpu = statistics.median(r.cpu / r.requests for r in kept) * 1e6
    sent = statistics.median(r.sent / len(r.seconds) for r in kept)
    grown = statistics.median(r.grown / len(r.seconds) for r in kept)
    ratio = "" if baseline is None else f"{median / baseline:.2f}"
    return (f"| {name} | {median:.2f} | {tail:.2f} | {ratio} | {rate:.0f} | {cpu:.0f} "
            f"| {sent:,.0f} | {grown:,.0f} |")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of idle watching")
    parser.add_argument("--restarts", type=int, default=20, help="restarts the watchers hear")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="vkv-bench-etcd.") as directory:
        etcd = Etcd(Path(directory)).start()
        try:
            meter = EtcdMeter(etcd)
            cfg = FleetConfig(endpoints=(etcd.url,), group=GROUP, timeout=10.0)
            hosts = [Fleet.from_config(dataclasses.replace(cfg, name=f"gpu-{i:05}"))
                     for i in range(args.hosts)]  # fmt: skip
            now = time.time()
            values = {h.host: entry(h.host, now) for h in hosts}
            ttl = int(3 * PUBLISH_EVERY)
            publish, slots, status = [], [], []
            reader = Fleet.from_config(cfg)
            pages = -(-args.hosts // ENTRIES_PAGE)

            def publishing(host: Fleet) -> Callable[[], None]:
                return lambda: host.put_own(host.hosts_prefix + host.host, values[host.host], ttl)

            def reading() -> FleetView:
                return FleetView.of(GROUP, 1, time.time(), reader.entries(), reader.holders())

            for _ in range(args.rounds):
                publish.append(measure(meter, [publishing(h) for h in hosts], args.threads, 2))
                slots.append(measure(meter, [h.holders for h in hosts], args.threads, 1))
                status.append(measure(meter, [reading], 1, pages + 1))
            watching = etcd_watches.measure(meter, hosts, args.idle, args.restarts)
        finally:
            etcd.stop()

    entry_bytes = statistics.median(len(v) for v in values.values())
    baseline = statistics.median(statistics.median(r.seconds) for r in slots[1:] or slots) * 1000
    print(f"etcd {etcd.binary}, {args.hosts} hosts, {args.threads} threads, {args.rounds} rounds "
          f"(medians; the first round, which grants the leases, left out); an entry "
          f"{entry_bytes:.0f} bytes of JSON\n")  # fmt: skip
    print(
        "| call | median (ms) | p99 (ms) | median over the slots' | requests/s | etcd CPU "
        "per request (µs) | bytes etcd sent per call | database growth per call (bytes) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(row("slots: `Fleet.holders` (the baseline)", slots))
    print(row("publish: `Fleet.put_own` (keepalive, put)", publish, baseline))
    print(row(f"fleet status: {pages} pages of entries and the slots", status, baseline))

    kept = publish[1:] or publish
    grown = statistics.median(r.grown / len(r.seconds) for r in kept)
    cpu_publish = statistics.median(r.cpu / len(r.seconds) for r in kept)
    cpu_slots = statistics.median(r.cpu / len(r.seconds) for r in slots[1:] or slots)
    print("\nThe steady load, a publish every PUBLISH_EVERY and a listing every LIST_EVERY:\n")
    print(
        "| hosts | publishes/s | listings/s | etcd CPU (% of a core) | database growth a day "
        "without compaction |"
    )
    print("|---|---|---|---|---|")
    for n in (args.hosts, 10 * args.hosts):
        puts, lists = n / PUBLISH_EVERY, n / LIST_EVERY
        cpu = (puts * cpu_publish + lists * cpu_slots) * 100
        print(f"| {n:,} | {puts:.1f} | {lists:.1f} | {cpu:.1f} | "
              f"{puts * grown * 86400 / 1e6:,.0f} MB |")  # fmt: skip
    etcd_watches.report(watching, args.hosts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
