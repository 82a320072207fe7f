"""What the fleet benchmark measures against the real etcd (bench/fleet_etcd.py,
bench/etcd_watches.py): its watchers hear every event, and a small run prints every table."""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

import pytest

from bench import etcd_watches, fleet_etcd
from bench.etcd_meter import EtcdMeter
from tests.etcd import Etcd
from vkvagent.adapters.fleet import EtcdClient, Fleet

pytestmark = pytest.mark.fleet


def test_every_watcher_hears_each_slot_taken_and_given_back(tmp_path: Path) -> None:
    etcd = Etcd(tmp_path).start()
    try:
        fleet = Fleet(EtcdClient([etcd.url], timeout=5), group="g", host="gpu-a")
        watchers = etcd_watches.Watchers(EtcdMeter(etcd).port, fleet.slots_prefix, 5)
        try:
            watchers.wait(lambda: all(watchers.created), timeout=10)
            fleet.client.put(f"{fleet.prefix}hosts/gpu-a", "not a slot", "0")
            etcd_watches.restart(fleet)
            etcd_watches.restart(fleet)
            watchers.wait(lambda: min(watchers.events) >= 4, timeout=10)
            watchers.pump(time.perf_counter() + 0.3)  # anything more would come now
            assert watchers.events == [4] * 5  # the entry's put is not a slot's
        finally:
            watchers.close()
    finally:
        etcd.stop()


def test_a_small_run_prints_every_table() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["--hosts", "20", "--rounds", "2", "--idle", "0.2", "--restarts", "2"]
        assert fleet_etcd.main(argv) == 0
    printed = out.getvalue()
    for line in ("| slots: `Fleet.holders` (the baseline) |", "| open 20 watches |",
                 "until all 20 watchers heard both events"):  # fmt: skip
        assert line in printed
    steady = printed.split("| hosts in the group | listing every 30 s | watching |")[1]
    assert steady.count("\n| 20 | ") == 1 and steady.count("\n| 200 | ") == 1
