"""vkvagent replay: Prometheus query_range history through the decision engine.

The histories are made the way Prometheus would record them: the simulator's engine model
advanced step by step, its /metrics page rendered (``sim.exposition.render``) and parsed into
series at each step, with ``instance``/``job`` target labels, then written out as a
``query_range`` response. GPU series are what dcgm-exporter would export for the simulator's
GPUs. One test runs a real Prometheus (Debian's package) scraping a running simulator.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import parse_labels

from tests.httpserver import RawServer, free_port
from tests.simproc import SimProcess, get
from vkvagent.adapters import query_range
from vkvagent.engine import ACTIONS, Settings
from vkvagent.engine.diagnosis import CAUSES
from vkvagent.engine.policy import PLANNED
from vkvagent.engine.prevention import Track
from vkvagent.knowledge.config import Config
from vkvagent.processes import stop_process
from vkvagent.sim.capacity import Cluster, EngineModel, Scenario, capacity
from vkvagent.sim.exposition import histogram_bounds, render
from vkvagent.sim.stats import ServerInfo
from vkvagent.sim.workload import Workload, azure_sizes, constant
from vkvagent.tools import timeline
from vkvagent.tools.cli import main

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
START = datetime(2025, 3, 3, 0, 0, tzinfo=timezone.utc)  # a Monday, 00:00 UTC
VLLM = "10.0.0.7:8000"
DCGM = "10.0.0.7:9400"
SIZES = azure_sizes()
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
# Restarts wait for the window (outside_windows = "never", the default).
ENFORCE = '[policy]\nmode = "enforce"\nwindows = ["daily 03:15-06:00"]\n'


# -- histories made from the simulator ---------------------------------------------------------


def new_cluster(
    scenario: str, onset: float | None, flavor: str, seed: int, memory: float = 0.9
) -> Cluster:
    cap = capacity(MODEL, gpu_memory_utilization=memory, block_size=16, max_num_seqs=256,
                   max_num_batched_tokens=8192, max_model_len=32768)  # fmt: skip
    return Cluster(
        engines=[EngineModel(cap, histogram_bounds(flavor))],
        workload=Workload(constant(2.0), SIZES, random.Random(seed)),
        scenario=Scenario(scenario, onset),
    )


class Recorder:
    """Series as Prometheus stores them, built point by point; ``response()`` is what
    /api/v1/query_range would answer for all of them."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[dict[str, str], list]] = {}
        self._parsed: dict[str, tuple[str, dict[str, str]]] = {}

    def add(self, t: float, name: str, labels: dict[str, str], value: float) -> None:
        key = (name, tuple(sorted(labels.items())))
        entry = self.series.get(key)
        if entry is None:
            entry = self.series[key] = ({"__name__": name, **labels}, [])
        entry[1].append([t, repr(float(value))])

    def scrape(self, t: float, page: bytes, target: dict[str, str]) -> None:
        """Ingest one /metrics page as Prometheus does: every sample line a series."""
        for line in page.decode().split("\n"):
            if not line or line.startswith("#"):
                continue
            head, value = line.rsplit(" ", 1)
            parsed = self._parsed.get(head)
            if parsed is None:
                name, _, rest = head.partition("{")
                parsed = self._parsed[head] = (name, parse_labels(rest[:-1]) if rest else {})
            self.add(t, parsed[0], {**parsed[1], **target}, float(value))

    def response(self) -> dict[str, Any]:
        result = [{"metric": metric, "values": values} for metric, values in self.series.values()]
        return {"status": "success", "data": {"resultType": "matrix", "result": result}}


@functools.cache
def history(
    scenario: str,
    hours: float,
    *,
    onset: float | None = None,
    step: float = 15.0,
    gpus: int = 0,
    flavor: str = "v1-latest",
    restart_at: float | None = None,
    new_instance: bool = False,
    cold_start: float = 120.0,
    restart_memory: float | None = None,
) -> str:
    """A query_range response (JSON text) of ``hours`` of a simulated vLLM from START, scraped
    every ``step`` s; ``restart_at`` (hours) restarts it for real: a new process after a cold
    start with no data, on a new instance if ``new_instance``, with ``--gpu-memory-utilization
    restart_memory`` (0.9 before) if given, which cache_config_info then shows."""
    recorder = Recorder()
    started, seed, instance = START.timestamp(), 7, VLLM
    memory = 0.9
    cache_config = {"block_size": "16"}
    if restart_memory is not None:
        cache_config["gpu_memory_utilization"] = str(memory)
    cluster = new_cluster(scenario, onset, flavor, seed)
    t, end = started, started + hours * 3600
    while t + step <= end + 1e-9:
        t += step
        if restart_at is not None and t >= START.timestamp() + restart_at * 3600:
            restart_at, started, seed = None, t + cold_start, seed + 1
            if restart_memory is not None:
                memory = restart_memory
                cache_config = {**cache_config, "gpu_memory_utilization": str(memory)}
            cluster = new_cluster(scenario, onset, flavor, seed, memory)
            instance = "10.0.0.8:8000" if new_instance else instance
        if t < started:
            continue  # the port is closed while the model loads: no scrape succeeds
        cluster.advance_to(t - started)
        info = ServerInfo(model=MODEL, flavor=flavor, version="0.11.0", max_model_len=32768,
                          cache_config=cache_config, start_time=started)  # fmt: skip
        page = render(info, cluster.published(), t)
        recorder.scrape(t, page, {"instance": instance, "job": "vllm"})
        for index, device in enumerate(cluster.gpu_recording(gpus)["devices"]):
            labels = {"gpu": str(index), "UUID": device["uuid"], "modelName": device["name"],
                      "Hostname": "gpu-7", "instance": DCGM, "job": "dcgm"}  # fmt: skip
            fields = {
                "DCGM_FI_DEV_GPU_TEMP": device["temperature"],
                "DCGM_FI_DEV_SM_CLOCK": device["sm_clock"],
                "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": device["clock_event_reasons"],
                "DCGM_FI_DEV_FB_USED": device["memory_used"] // 2**20,
                "DCGM_FI_DEV_FB_FREE": (device["memory_total"] - device["memory_used"]) // 2**20,
                "DCGM_FI_DEV_POWER_USAGE": device["power_mw"] / 1000,
                "DCGM_FI_DEV_XID_ERRORS": 0,
            }
            for name, value in fields.items():
                recorder.add(t, name, labels, value)
    return json.dumps(recorder.response())


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    path.chmod(0o600)
    return path


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["replay", *argv], out, err)
    return code, out.getvalue(), err.getvalue()


def replay_json(tmp_path: Path, *texts: str, config: str = ENFORCE, extra: tuple[str, ...] = ()):
    files = [str(write(tmp_path / f"range-{i}.json", text)) for i, text in enumerate(texts)]
    cfg = write(tmp_path / "config.toml", config)
    code, out, err = run_cli(*files, "--config", str(cfg), "--json", *extra)
    assert code == 0, err
    assert err == ""
    data: dict[str, Any] = json.loads(out)
    check_structure(data)
    return data


def at(hours: float, minutes: float = 0) -> str:
    moment = START.timestamp() + hours * 3600 + minutes * 60
    return datetime.fromtimestamp(moment, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def head(reason: str) -> str:
    found = re.match(r"^[A-Za-z _-]+(?::[A-Za-z _-]+)?", reason)
    return found.group().strip() if found else reason


def check_structure(data: dict[str, Any]) -> None:
    """What --json promises: every decision's fields and types, one at every change of action
    or cause and at every restart made or held back, and a summary that agrees with them."""
    assert set(data) == {"decisions", "summary"}
    decisions = data["decisions"]
    assert decisions
    for d in decisions:
        assert ISO.match(d["time"]), d["time"]
        assert d["action"] in ACTIONS
        assert d["cause"] is None or d["cause"] in (*CAUSES, *PLANNED)
        assert isinstance(d["reason"], str) and d["reason"]
        assert isinstance(d["window_open"], bool)
        assert d["ratio"] is None or isinstance(d["ratio"], (int, float))
        assert isinstance(d["probe_wanted"], bool)
    times = [d["time"] for d in decisions]
    assert times == sorted(times)
    for a, b in zip(decisions, decisions[1:-1]):
        change = (a["action"], a["cause"], head(a["reason"]), a["evidence"]["run"]) != (
            b["action"], b["cause"], head(b["reason"]), b["evidence"]["run"]
        )  # fmt: skip
        assert change or b["action"] == "restart" or b["time"] in data["summary"]["held_back_at"]
    summary = data["summary"]
    restarts = [d for d in decisions if d["action"] == "restart"]
    assert summary["restarts"] == len(restarts)
    assert summary["restarts_outside_window"] == sum(not d["window_open"] for d in restarts)
    held = [d for d in decisions if d["time"] in summary["held_back_at"]]
    assert len(held) == summary["held_back"] == len(set(summary["held_back_at"]))
    assert all(d["action"] == "hold" and d["reason"].startswith("observe mode: ") for d in held)
    assert summary["held_back_in_window"] == sum(d["window_open"] for d in held)
    assert summary["held_back_outside_window"] == sum(not d["window_open"] for d in held)
    assert not (held and restarts)  # observe mode holds back every restart, enforce none
    assert set(summary["causes"]) == {d["cause"] for d in decisions if d["cause"]}
    assert all(isinstance(m, (int, float)) and m > 0 for m in summary["causes"].values())
    assert summary["from"] == decisions[0]["time"] and summary["to"] == decisions[-1]["time"]


# -- scenarios ---------------------------------------------------------------------------------


def test_uptime_decline_is_held_outside_the_window_and_restarted_when_it_opens(
    tmp_path: Path,
) -> None:
    data = replay_json(tmp_path, history("uptime-decline", 3.75, onset=1800.0, step=30.0))
    decisions = data["decisions"]
    found = next(d for d in decisions if d["cause"] == "uptime_decline")
    assert found["action"] == "hold" and not found["window_open"]
    assert found["reason"].startswith("outside window (next 2025-03-03T03:15:00Z)")
    assert found["ratio"] < 0.75
    assert at(2, 30) < found["time"] < at(3, 15)
    [restart] = [d for d in decisions if d["action"] == "restart"]
    assert restart["time"] == at(3, 15) and restart["window_open"]
    assert restart["cause"] == "uptime_decline" and restart["reason"].startswith("restart: ")
    # Virtual: the data goes on declining, and the policy counts the restart it decided.
    after = [d for d in decisions if d["time"] > restart["time"]]
    assert after and all(d["action"] == "hold" for d in after)
    assert after[0]["reason"].startswith("min interval: last restart 0 min ago")
    summary = data["summary"]
    assert summary["restarts"] == 1 and summary["restarts_outside_window"] == 0
    assert summary["runs"] == 1 and summary["mode"] == "enforce" and summary["step_s"] == 30.0
    assert summary["evaluations"] == 3.75 * 3600 / 30
    # The cause holds from its first decision to the end of the data.
    held = datetime.fromisoformat(summary["to"][:-1]) - datetime.fromisoformat(found["time"][:-1])
    assert summary["causes"]["uptime_decline"] == pytest.approx(held.total_seconds() / 60 + 0.5)


def test_with_the_fleets_runs_a_replay_plans_a_first_restart_before_the_decline(
    tmp_path: Path,
) -> None:
    """The daemon of a new host in a [fleet] group plans from its peers' cured runs; replay,
    given them as a file (what etcdctl prints of the group's runs keys), decides as it did:
    a preventive restart due an hour in, before the decline is worth a diagnosis. Without
    them, the first restart waits for the decline."""
    text = history("uptime-decline", 3.75, onset=1800.0, step=30.0)
    # Restarts may recur hourly (the defaults space them 6 h apart, beyond this data).
    config = ENFORCE + "cooldown = 3600\nmax_per_day = 24\n"
    alone = replay_json(tmp_path, text, config=config)
    server = alone["summary"]["server"]
    assert isinstance(server, str) and server
    assert "prevention" not in {d["cause"] for d in alone["decisions"]}
    # Two peers' runs of this server, ended the day before: speed lost from half an hour of
    # uptime, 20 % an hour, cured by their restart (3 min).
    lines = []
    for peer in ("gpu-1", "gpu-2"):
        track = Track(run=f"{peer}-run", server=server)
        for minute in range(10, 180):
            track = track.add(minute * 60.0, 1.0 - max(0.0, 0.2 * (minute / 60 - 0.5)))
        done = replace(track, ended=START.timestamp() - 86400, outage=180.0, next_run="n",
                       cured=True)  # fmt: skip
        document = {"schema": 1, "host": peer, "server": server, "runs": [done.to_json()]}
        lines.append(json.dumps(document))
    peers = write(tmp_path / "runs.jsonl", "\n".join(lines) + "\n")
    data = replay_json(tmp_path, text, config=config, extra=("--fleet-runs", str(peers)))
    first = next(d for d in data["decisions"] if d["cause"] is not None)
    assert first["cause"] == "prevention" and first["action"] == "hold"
    assert first["reason"].startswith("outside window") and at(1) <= first["time"] < at(1, 1)
    assert first["evidence"]["prevent_peer_runs"] == 2
    assert first["evidence"]["prevent_at_s"] < 3600
    # The file is checked as the daemon checks what etcd holds.
    code, _out, err = run_cli(str(write(tmp_path / "r.json", text)), "--fleet-runs",
                              str(write(tmp_path / "bad.jsonl", "{\n")))  # fmt: skip
    assert code == 1 and "bad.jsonl:1: not a host's runs: not JSON" in err


def test_the_word_shown_follows_the_hysteresis_and_the_band_is_shown_beside_the_ratio(
    tmp_path: Path,
) -> None:
    """As the run slows, its speed wanders about 0.85 for an hour before it falls below 0.75.
    The word read against 0.85 alone flipped at every wobble (healthy 0.85, watching 0.85,
    14 times); the hysteresis the decision uses does not."""
    declining = history("uptime-decline", 3.75, onset=1800.0, step=30.0)
    data = replay_json(tmp_path, declining)
    quiet = [d for d in data["decisions"] if d["reason"].startswith(("healthy: ", "watching: "))]
    words: dict[float, set[str]] = {}
    for d in quiet:
        words.setdefault(round(d["ratio"], 2), set()).add(d["reason"].split(":")[0])
    assert all(len(shown) == 1 for shown in words.values()), words
    for before, after in zip(quiet, quiet[1:]):  # each a change of word
        if after["reason"].startswith("watching: speed"):
            assert after["ratio"] < after["enter_ratio"], after
        elif after["reason"].startswith("healthy: "):
            assert after["ratio"] > before["leave_ratio"], after
    assert [d["reason"].split(":")[0] for d in quiet] == ["healthy", "watching"]
    # The band is beside every known ratio: in --json, and in the timeline.
    known = [d for d in data["decisions"] if d["ratio"] is not None]
    bands = [((d["enter_ratio"], d["leave_ratio"]), "trend_loss" in d["evidence"]) for d in known]
    # (A run declining on its own trend is judged higher: 1 - trend_loss, 1 - trend_loss / 2.)
    assert set(bands) == {((0.75, 0.85), False), ((0.9, 0.95), True)}
    assert all(d["enter_ratio"] is None for d in data["decisions"] if d["ratio"] is None)
    path = write(tmp_path / "range.json", declining)
    code, out, _err = run_cli(str(path), "--config", str(write(tmp_path / "c.toml", ENFORCE)))
    assert code == 0
    [watching] = [line for line in out.splitlines() if "  watching: speed" in line]
    assert re.search(r" ratio 0\.7\d  band 0\.75-0\.85  window closed  watching: ", watching)


def test_replay_says_where_the_live_daemon_would_have_probed(tmp_path: Path) -> None:
    """vLLM 0.32's hung engine (the simulator's `hang`): gauges 0, counters still. Without a
    probe it reads as idle, and replay says that there it cannot tell."""
    text = history("hang", 1.0, onset=1800.0)
    data = replay_json(tmp_path, text)
    hung = [d for d in data["decisions"] if d["time"] > at(0, 31)]
    assert hung and hung[0]["probe_wanted"] and hung[0]["cause"] is None
    assert not any(d["probe_wanted"] for d in data["decisions"] if d["time"] < at(0, 30))
    assert 25 <= data["summary"]["probe_wanted_min"] <= 30  # from 60 s after the hang on
    path = write(tmp_path / "range.json", text)
    code, out, _err = run_cli(str(path), "--config", str(write(tmp_path / "c.toml", ENFORCE)))
    assert code == 0
    assert "; the live daemon would probe here (replay has no probe)" in out
    assert out.splitlines()[-1].startswith("probe: for ")


def test_a_healthy_server_is_never_restarted_and_the_timeline_reads_well(tmp_path: Path) -> None:
    path = write(tmp_path / "range.json", history("healthy", 1.0))
    cfg = write(tmp_path / "config.toml", ENFORCE)
    code, out, err = run_cli(str(path), "--config", str(cfg))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (
        "replay 2025-03-03T00:00:15Z to 2025-03-03T01:00:00Z: 240 evaluations every 15 s, "
        "1 vLLM run, policy mode enforce"
    )
    assert lines[-1] == "summary: 0 restarts (0 outside a window); causes: none"  # no probe
    assert re.match(r"^2025-03-03 00:00:15Z  none +- +ratio - +band - +window closed  learning: ",
                    lines[1])  # fmt: skip
    healthy = [line for line in lines if "healthy: speed" in line]
    assert healthy and "2025-03-03 00:2" in healthy[0]  # known once warm-up and learning pass
    assert not any(" restart " in line or " hold " in line for line in lines)
    data = replay_json(tmp_path, history("healthy", 1.0))
    assert data["summary"]["causes"] == {} and data["summary"]["restarts"] == 0
    ratios = [d["ratio"] for d in data["decisions"] if d["ratio"] is not None]
    assert ratios and all(0.85 < r < 1.15 for r in ratios)


def test_thermal_throttling_seen_in_dcgm_series_vetoes_the_restart(tmp_path: Path) -> None:
    all_day = '[policy]\nmode = "enforce"\nwindows = ["daily 00:00-24:00"]\n'
    data = replay_json(tmp_path, history("thermal-throttle", 1.0, onset=1800.0, gpus=2, step=30.0),
                       config=all_day)  # fmt: skip
    decisions = data["decisions"]
    assert data["summary"]["restarts"] == 0
    throttled = [d for d in decisions if d["cause"] == "gpu_throttle"]
    assert throttled and throttled[0]["time"] == at(0, 30)  # the first throttled scrape
    slow = [d for d in throttled if d["action"] == "hold"]
    assert slow and all(d["reason"].startswith("vetoed: gpu_throttle: speed 0.") for d in slow)
    assert all(d["window_open"] for d in slow)  # vetoed, not waiting for a window
    evidence = str(slow[-1]["evidence"]["gpu_throttle"])
    assert "sw_thermal_slowdown+hw_thermal_slowdown" in evidence
    assert "SM clock 1155/1980 MHz" in evidence  # the maximum: the highest clock in the input
    assert set(data["summary"]["causes"]) == {"gpu_throttle"}


@pytest.mark.parametrize("how", ["process start time", "counter reset only", "new instance"])
def test_a_real_restart_in_the_data_starts_a_new_run_and_baseline(tmp_path: Path, how: str) -> None:
    text = history("healthy", 1.0, step=30.0, restart_at=0.5, new_instance=how == "new instance")
    if how == "counter reset only":  # e.g. a page without process_start_time_seconds
        response = json.loads(text)
        result = response["data"]["result"]
        result[:] = [r for r in result if r["metric"]["__name__"] != timeline.PROCESS_START]
        text = json.dumps(response)
    data = replay_json(tmp_path, text)
    decisions = data["decisions"]
    assert data["summary"]["runs"] == 2 and data["summary"]["restarts"] == 0
    runs = list(dict.fromkeys(d["evidence"]["run"] for d in decisions))
    assert len(runs) == 2
    if how != "counter reset only":
        assert runs[1] == f"start:{START.timestamp() + 0.5 * 3600 + 120:.3f}"
    # The gap while the new process loaded is seen, then the new run learns from scratch.
    down = [d for d in decisions if d["cause"] == "engine_down"]
    assert [d["time"] for d in down] == [at(0.5)]
    assert data["summary"]["causes"] == {"engine_down": 2.0}
    new = [d for d in decisions if d["evidence"]["run"] == runs[1]]
    assert new[0]["reason"].startswith("learning: ")
    assert any(d["reason"].startswith("learning: warm-up: uptime ") for d in new)
    # Its fresh baseline was learned and compared with the previous run's: the same speed.
    assert new[-1]["reason"].startswith("healthy: ") and new[-1]["recovered"] is True


@pytest.mark.parametrize(("memory", "verdict"), [(0.5, "same"), (0.245, "worse")])
def test_a_new_cache_config_is_a_flag_change_judged_by_its_fresh_speed(
    tmp_path: Path, memory: float, verdict: str
) -> None:
    """A restart with another memory share: cache_config_info changes, so the new run is a new
    server identity (the old run's baselines do not stand in for it), and its fresh speed is
    compared with the old run's, as the daemon judges a flag change. 0.5 of 80 GB still holds
    this load (0.89 of the speed before: two runs' noise at 7 requests running, inside the
    0.20 margin); at 0.245 the KV cache falls short and requests queue (0.77)."""
    text = history("healthy", 2.0, step=30.0, restart_at=1.0, restart_memory=memory)
    data = replay_json(tmp_path, text)
    (change,) = data["summary"]["flag_changes"]
    assert change["at"] == at(1.0, 2)  # the first scrape of the new process
    assert change["cache_config"] == {"gpu_memory_utilization": str(memory)}
    assert change["verdict"] == verdict, change
    assert change["loads"] and (change["ratio"] < 0.8) == (verdict == "worse")
    new_run = data["decisions"][-1]["evidence"]["run"]
    assert all(
        "baseline_run" not in d["evidence"]
        for d in data["decisions"]
        if d["evidence"]["run"] == new_run
    )
    code, out, _err = run_cli(
        str(tmp_path / "range-0.json"), "--config", str(tmp_path / "config.toml")
    )
    assert code == 0
    shown = f"flag change at {at(1.0, 2)} (cache_config gpu_memory_utilization {memory}): "
    assert shown + verdict in out


def test_memory_growing_with_requests_served_is_found_from_the_process_rss(
    tmp_path: Path,
) -> None:
    response = json.loads(history("memory-growth", 1.25, step=30.0))
    result = response["data"]["result"]
    served: dict[float, float] = {}
    for entry in result:
        if entry["metric"]["__name__"] == "vllm:request_success_total":
            for t, value in entry["values"]:
                served[t] = served.get(t, 0.0) + float(value)
    rss = next(e for e in result if e["metric"]["__name__"] == query_range.PROCESS_MEMORY)
    rss["values"] = [[t, str(6 * 2**30 + served[t] * 256 * 1024)] for t, _v in rss["values"]]
    config = (
        '[policy]\nmode = "enforce"\nwindows = ["daily 00:00-24:00"]\n'
        "[diagnosis]\nmemory_min_growth = 5e8\n"
    )
    data = replay_json(tmp_path, json.dumps(response), config=config)
    [restart] = [d for d in data["decisions"] if d["action"] == "restart"]
    assert restart["cause"] == "host_memory_growth" and restart["window_open"]
    assert restart["evidence"]["bytes_per_request"] == pytest.approx(256 * 1024)
    assert restart["time"] >= at(1, 0)  # it takes memory_min_span (an hour) of this run


@pytest.mark.parametrize("flavor", ["v0", "v1-0.8", "v1-0.10"])
def test_every_metrics_flavour_replays_through_the_normaliser(tmp_path: Path, flavor: str) -> None:
    data = replay_json(tmp_path, history("healthy", 0.6, step=30.0, flavor=flavor))
    decisions = data["decisions"]
    assert data["summary"]["evaluations"] == 72 and data["summary"]["step_s"] == 30.0
    assert not any(d["cause"] for d in decisions)  # every page read: never "engine down"
    assert decisions[-1]["reason"].startswith("healthy: speed ")
    # V0's multiprocess page has no process_start_time_seconds: the run starts at its first
    # sample instead.
    run = (
        f"mono:{START.timestamp() + 30:.3f}" if flavor == "v0" else f"start:{START.timestamp():.3f}"
    )
    assert decisions[-1]["evidence"]["run"] == run


def test_several_files_and_overlapping_chunks_merge_into_one_history(tmp_path: Path) -> None:
    whole = json.loads(history("healthy", 0.6, step=30.0))
    first, second = json.loads(json.dumps(whole)), json.loads(json.dumps(whole))
    middle = START.timestamp() + 1200
    for response, keep in ((first, lambda t: t <= middle + 300), (second, lambda t: t >= middle)):
        for series in response["data"]["result"]:
            series["values"] = [v for v in series["values"] if keep(v[0])]
    merged = replay_json(tmp_path, json.dumps(second), json.dumps(first))
    alone = replay_json(tmp_path, json.dumps(whole))
    assert merged == alone


def test_the_instance_option_picks_one_server_of_several(tmp_path: Path) -> None:
    response = json.loads(history("healthy", 0.6, step=30.0))
    result = response["data"]["result"]
    other = [json.loads(json.dumps(r)) for r in result if r["metric"]["instance"] == VLLM]
    for series in other:
        series["metric"]["instance"] = "10.0.0.9:8000"
        series["values"] = [[t, "0"] for t, _v in series["values"]]
    response["data"]["result"] = result + other
    path = write(tmp_path / "two.json", json.dumps(response))
    cfg = write(tmp_path / "config.toml", ENFORCE)
    code, _out, err = run_cli(str(path), "--config", str(cfg))
    assert code == 1
    assert err == (
        "vkvagent: vLLM series of instances '10.0.0.7:8000' and '10.0.0.9:8000' overlap in "
        'time: replay one server at a time (--instance 10.0.0.7:8000, or instance="10.0.0.7:8000"'
        " in the selector)\n"
    )
    chosen = replay_json(tmp_path, json.dumps(response), extra=("--instance", VLLM))
    assert chosen == replay_json(tmp_path, history("healthy", 0.6, step=30.0))


def test_observe_mode_is_the_default_and_never_restarts(tmp_path: Path) -> None:
    window = '[policy]\nwindows = ["daily 03:15-06:00"]\n'
    declining = history("uptime-decline", 3.75, onset=1800.0, step=30.0)
    data = replay_json(tmp_path, declining, config=window)
    assert data["summary"]["mode"] == "observe" and data["summary"]["restarts"] == 0
    would = [d for d in data["decisions"] if d["reason"].startswith("observe mode: would restart")]
    # The window holds by default: the decline waits for 03:15, not a restart sooner.
    assert would and would[0]["time"] == at(3, 15) and would[0]["action"] == "hold"
    assert would[0]["window_open"] and "cheaper now" not in would[0]["reason"]
    waiting = next(d for d in data["decisions"] if d["cause"] == "uptime_decline")
    assert waiting["time"] < at(3, 15) and waiting["reason"].startswith("outside window")
    forced = replay_json(tmp_path, declining, config=window, extra=("--mode", "enforce"))
    assert forced["summary"]["restarts"] == 1


# Windows and spacing that make a slow run due three times in the 3.75 h history: first in the
# window, then twice outside it, when waiting for tomorrow's costs more (the opt-in).
WHEN_CHEAPER = 'outside_windows = "when_cheaper"\n'
SHORT = (
    '[policy]\nwindows = ["daily 03:00-03:20"]\nmin_interval = 600.0\ncooldown = 1200.0\n'
    + WHEN_CHEAPER
)


@pytest.mark.parametrize(
    ("config", "held", "inside"),
    [
        ('[policy]\nwindows = ["daily 03:15-06:00"]\n' + WHEN_CHEAPER, [at(2, 51)], 0),
        ('[policy]\nwindows = ["daily 03:15-06:00"]\n', [at(3, 15)], 1),  # the default
        (SHORT, [at(3), at(3, 20), at(3, 40)], 1),
    ],
    ids=["outside-a-window", "in-a-window", "spaced-by-the-budgets"],
)
def test_observe_mode_counts_the_restarts_it_holds_back_as_enforce_would_make_them(
    tmp_path: Path, config: str, held: list[str], inside: int
) -> None:
    """Never cured, the slow run is "would restart now" tick after tick: counted once each
    time enforce mode would have restarted."""
    declining = history("uptime-decline", 3.75, onset=1800.0, step=30.0)
    data = replay_json(tmp_path, declining, config=config)
    summary = data["summary"]
    assert (summary["mode"], summary["restarts"]) == ("observe", 0)
    assert summary["held_back_at"] == held and summary["held_back"] == len(held)
    assert summary["held_back_in_window"] == inside
    assert summary["held_back_outside_window"] == len(held) - inside
    forced = replay_json(tmp_path, declining, config=config, extra=("--mode", "enforce"))
    made = [d for d in forced["decisions"] if d["action"] == "restart"]
    assert [d["time"] for d in made] == held
    assert forced["summary"]["restarts_outside_window"] == len(held) - inside
    assert forced["summary"]["held_back"] == 0
    # The text says it in the summary, and marks each one in the timeline.
    path = write(tmp_path / "range.json", declining)
    code, out, _err = run_cli(str(path), "--config", str(write(tmp_path / "c.toml", config)))
    assert code == 0
    plural = "s" if len(held) != 1 else ""
    assert out.splitlines()[-1].startswith(
        f"summary: {len(held)} restart{plural} held back by observe mode ({inside} in a window, "
        f"{len(held) - inside} outside); causes: uptime_decline "
    )
    marked = [line for line in out.splitlines() if "counted as a restart observe mode held" in line]
    assert [line[:20] for line in marked] == [t.replace("T", " ")[:19] + "Z" for t in held]


# -- the operator's objectives over the replayed span -----------------------------------------

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"


def slo_replay(tmp_path: Path, text: str, slo: str) -> tuple[dict[str, Any], list[str]]:
    """``vkvagent replay`` of ``text`` with ENFORCE and the [slo] table ``slo``: its
    summary.slo (--json) and its text's lines."""
    config = ENFORCE + "[slo]\n" + slo
    summary = replay_json(tmp_path, text, config=config)["summary"]["slo"]
    code, out, err = run_cli(
        str(tmp_path / "range-0.json"), "--config", str(tmp_path / "config.toml")
    )
    assert (code, err) == (0, "")
    return summary, out.splitlines()


def by_hand(response: dict[str, Any], histogram: str) -> tuple[list[float], list[float]]:
    """A histogram's observations over the trace, bound by bound: each ``_bucket`` series'
    last scrape less its first, summed over the series of that bound."""
    counts: dict[float, float] = {}
    for entry in response["data"]["result"]:
        metric, values = entry["metric"], entry["values"]
        if metric["__name__"] == histogram + "_bucket":
            bound = float(metric["le"])
            counts[bound] = counts.get(bound, 0.0) + float(values[-1][1]) - float(values[0][1])
    bounds = sorted(counts)
    return bounds, [counts[b] for b in bounds]


def share_within(bounds: list[float], counts: list[float], target: float) -> float:
    """The share of the observations at or below ``target``, linear inside the bucket that
    holds it and from 0 in the first, as Prometheus's histogram_quantile interpolates."""
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if target <= bound:
            return (below + (count - below) * (target - lower) / (bound - lower)) / counts[-1]
        lower, below = bound, count
    raise AssertionError(f"{target} is beyond the last bound")


def test_latency_attainment_over_a_replay_is_the_share_the_traces_buckets_give(
    tmp_path: Path,
) -> None:
    """summary.slo's TTFT and ITL attainment is what the trace's buckets say from its first
    scrape to its last, the target interpolated inside its bucket (within 0.005: the issue's
    bar). The engine counts it interval by interval; replay adds up what it counted."""
    text = history("uptime-decline", 3.75, onset=1800.0, step=30.0)
    slo = "ttft_seconds = 0.3\nttft_share = 0.9\nitl_seconds = 0.03\nitl_share = 0.8\n"
    got, lines = slo_replay(tmp_path, text, slo)
    assert list(got) == ["ttft", "itl"]  # the declared objectives, no availability
    response = json.loads(text)
    for name, histogram, target, share in (("ttft", TTFT, 0.3, 0.9), ("itl", ITL, 0.03, 0.8)):
        bounds, counts = by_hand(response, histogram)
        assert target not in bounds  # inside a bucket: the interpolation counts
        expected = share_within(bounds, counts, target)
        assert 0.5 < expected < 0.95, (name, expected)  # neither none nor all of them
        o = got[name]
        assert (o["target"], o["events"]) == (share, pytest.approx(counts[-1]))
        assert o["attainment"] == pytest.approx(expected, abs=0.005)
        assert o["budget_spent"] == pytest.approx((1 - o["attainment"]) / (1 - share))
    # The text ends with the same, a line per objective.
    assert lines[-3].startswith("slo over the data as it was ")
    ttft, itl = got["ttft"], got["itl"]
    assert lines[-2] == (
        f"  ttft: {ttft['attainment'] * 100:.1f} % of {ttft['events']:,.0f} requests good "
        "(objective: 90 % of requests' first token within 0.3 s), "
        f"{ttft['budget_spent'] * 100:.0f} % of its error budget spent (over)"
    )
    assert lines[-1].startswith(f"  itl: {itl['attainment'] * 100:.1f} % of ")
    assert "(objective: 80 % of output tokens within 30 ms)" in lines[-1]


def with_http(text: str, errors_every: int) -> tuple[str, float, float]:
    """``text`` with prometheus_fastapi_instrumentator's series for vLLM: a POST answered 2xx
    for each request it finished, a 5xx every ``errors_every`` scrapes, and beside them the
    answers that do not count: 4xx, GETs, and another program's on another instance. Returns
    the text and, by hand, the 2xx and 5xx from the first scrape to the last."""
    response = json.loads(text)
    result = response["data"]["result"]
    finished: dict[float, float] = {}
    for entry in result:
        if entry["metric"]["__name__"] == "vllm:request_success_total":
            for t, value in entry["values"]:
                finished[t] = finished.get(t, 0.0) + float(value)
    times = sorted(finished)

    def add(instance: str, handler: str, method: str, status: str, value: Any) -> None:
        metric = {"__name__": "http_requests_total", "handler": handler, "method": method,
                  "status": status, "instance": instance, "job": "vllm"}  # fmt: skip
        points = [[t, repr(float(value(k, t)))] for k, t in enumerate(times)]
        result.append({"metric": metric, "values": points})

    chat = "/v1/chat/completions"
    add(VLLM, chat, "POST", "2xx", lambda k, t: finished[t])
    add(VLLM, chat, "POST", "5xx", lambda k, t: k // errors_every)
    add(VLLM, chat, "POST", "4xx", lambda k, t: 3 * k)  # a client's mistakes
    add(VLLM, "/v1/models", "GET", "5xx", lambda k, t: k)
    add("10.0.0.7:9100", "/api", "POST", "5xx", lambda k, t: 100 * k)  # not vLLM's
    answered = finished[times[-1]] - finished[times[0]]
    return json.dumps(response), answered, float((len(times) - 1) // errors_every)


def test_availability_over_a_replay_counts_the_5xx_vllm_answered(tmp_path: Path) -> None:
    text, answered, errors = with_http(history("healthy", 1.0, step=30.0), errors_every=10)
    assert errors == 11
    store = query_range.Store()
    store.add(json.loads(text), "range.json")
    kept = {(s.labels["status"], s.labels["instance"]) for s in store.series()
            if s.name == "http_requests_total"}  # fmt: skip
    assert kept == {("2xx", VLLM), ("5xx", VLLM), ("5xx", "10.0.0.7:9100")}  # POSTs, not 4xx
    o = slo_replay(tmp_path, text, "availability = 0.999\n")[0]["availability"]
    assert o["events"] == answered + errors
    assert o["attainment"] == pytest.approx(answered / (answered + errors), abs=1e-9)
    assert o["budget_spent"] == pytest.approx(errors / ((answered + errors) * 0.001))
    assert 1 < o["budget_spent"] < 2  # 11 of about 7,000: over a 99.9 % objective's budget
    assert o["counted_from"] == "http_requests_total"


def test_availability_over_a_replay_counts_the_requests_refused_while_vllm_loaded(
    tmp_path: Path,
) -> None:
    """A real restart in the data: the requests this host sends (2 a second) were refused for
    the four scrapes the new vLLM took to load, 30 s each. Without http_requests_total the
    requests served are the ones vLLM finished."""
    slo = "availability = 0.999\n"
    got, lines = slo_replay(tmp_path, history("healthy", 1.0, step=30.0, restart_at=0.5), slo)
    o = got["availability"]
    refused = o["events"] * (1 - o["attainment"])
    assert refused == pytest.approx(4 * 30 * 2.0, rel=0.2)
    assert o["counted_from"] == "request_success_total"  # and the text says what that misses
    assert lines[-1].endswith(
        f", {o['budget_spent'] * 100:.0f} % of its error budget spent (over); no "
        "http_requests_total in the data: 5xx answers not counted"
    )
    calm, _lines = slo_replay(tmp_path, history("healthy", 1.0, step=30.0), slo)
    assert calm["availability"]["attainment"] == 1.0 and calm["availability"]["budget_spent"] == 0


def test_without_an_slo_the_summary_has_no_objectives(tmp_path: Path) -> None:
    data = replay_json(tmp_path, history("healthy", 0.2))
    assert data["summary"]["slo"] == {}


def test_engine_settings_come_from_the_config() -> None:
    assert Config().engine_settings() == Settings()
    assert Config().engine_settings("enforce").policy.mode == "enforce"


# -- bad input: one line, exit 1 (2 for a wrong command line) ----------------------------------

GOOD = history("healthy", 0.2)


def valid(**change: Any) -> str:
    response = json.loads(GOOD)
    response.update(change)
    return json.dumps(response)


def with_entry(entry: Any) -> str:
    response = json.loads(GOOD)
    response["data"]["result"].append(entry)
    return json.dumps(response)


BAD_FILES = [
    ("<html>502</html>", "not JSON: Expecting value: line 1 column 1 (char 0)"),
    ("[1, 2]", "not a Prometheus query_range response (expected a JSON object)"),
    (valid(status="error", errorType="bad_data", error="parse error"),
     "Prometheus error: bad_data: parse error"),
    (valid(status="pending"), '"status" is "pending", not "success"'),
    (valid(data=None), 'no "data" object'),
    (valid(data={"resultType": "vector", "result": []}),
     'resultType is "vector", not "matrix" (save /api/v1/query_range responses, not '
     "/api/v1/query)"),
    (valid(data={"resultType": "matrix"}), '"data.result" is not a list'),
    (with_entry({"metric": {"job": "x"}, "values": []}),
     "has no __name__: query raw series (a selector), not an expression"),
    (with_entry({"metric": {"__name__": "vllm:x", "a": 1}, "values": []}),
     '"metric" is not an object of string labels'),
    (with_entry({"metric": {"__name__": "vllm:x"}, "values": [[1, 2]]}),
     '(vllm:x): values[0] is not [time, "value"]: [1, 2]'),
    (with_entry({"metric": {"__name__": "vllm:x"}, "values": [["1", "2"]]}),
     '(vllm:x): values[0] is not [time, "value"]: ["1", "2"]'),
    (with_entry({"metric": {"__name__": "vllm:x"}, "values": [[1, "two"]]}),
     '(vllm:x): values[0] is not [time, "value"]: [1, "two"]'),
    (json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "up"}, "values": [[1, "1"]]}]}}),
     "no vLLM series (vllm:*) in the input (found: up)"),
    (json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "vllm:num_requests_running"}, "values": []}]}}),
     "the vLLM series hold no points in the range: nothing to replay"),
    (json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"__name__": "vllm:num_requests_running"},
         "values": [[1, "1"], [301, "1"]]}]}}),
     "step 300 s is too coarse for the 300 s baseline window: use at most 150 s"),
]  # fmt: skip


# Named by the message: the texts hold the simulator's series in an order that varies from one
# process to another, and pytest-xdist's workers must all collect the same test names.
@pytest.mark.parametrize(("text", "message"), BAD_FILES, ids=[m for _, m in BAD_FILES])
def test_bad_files_fail_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "bad.json", text)
    code, out, err = run_cli(str(path), "--config", str(write(tmp_path / "c.toml", "")))
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("vkvagent: ") and message in err, err


def test_a_missing_file_and_a_bad_config_fail_in_one_line(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.toml", "")
    code, _out, err = run_cli(str(tmp_path / "nope.json"), "--config", str(cfg))
    assert (code, err) == (1, f"vkvagent: {tmp_path / 'nope.json'}: No such file or directory\n")
    path = write(tmp_path / "range.json", GOOD)
    bad = write(tmp_path / "bad.toml", "[diagnosis]\nenter_ratio = 0.9\n")
    code, _out, err = run_cli(str(path), "--config", str(bad))
    assert code == 1
    assert err == (
        f"vkvagent: {bad}:2: diagnosis.enter_ratio: need 0 < enter_ratio <= leave_ratio "
        "(enter_ratio = 0.9, leave_ratio = 0.85)\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "replay: give query_range FILEs, or --prometheus URL --match ..."),
        (("f.json", "--prometheus", "http://127.0.0.1:9"), "give FILEs or --prometheus, not both"),
        (("--prometheus", "http://127.0.0.1:9", "--start", "now-1h"),
         "--prometheus needs --match SELECTOR and --start TIME"),
        (("--prometheus", "http://x", "--match", "up", "--start", "soon"), "'soon' is not a time"),
        (("--prometheus", "http://x", "--match", "up", "--start", "now", "--end", "now-1h"),
         "need --end after --start"),
        (("--prometheus", "http://x", "--match", "up", "--start", "now-1h", "--step", "fast"),
         "'fast' is not a duration"),
        (("f.json", "--start", "now-1h"), "--match, --start and --end go with --prometheus"),
    ],
)  # fmt: skip
def test_a_wrong_command_line_exits_2(tmp_path: Path, argv: tuple[str, ...], message: str) -> None:
    code, _out, err = run_cli(*argv, "--config", str(write(tmp_path / "c.toml", "")))
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_an_unreachable_or_silent_prometheus_fails_in_one_line(tmp_path: Path) -> None:
    port = free_port()
    cfg = write(tmp_path / "c.toml", "")
    code, out, err = run_cli("--prometheus", f"http://127.0.0.1:{port}", "--match", "up",
                             "--start", "now-1h", "--config", str(cfg))  # fmt: skip
    assert (code, out) == (1, "")
    assert err == (
        f"vkvagent: cannot reach Prometheus at http://127.0.0.1:{port}/api/v1/query_range: "
        "Connection refused\n"
    )
    with RawServer(lambda conn, stop: stop.wait(5)) as silent:
        began = time.monotonic()
        with pytest.raises(query_range.ReplayError, match=r"timed out$"):
            query_range.fetch(silent.url, ["up"], 0, 60, 15, timeout=0.3)
        assert time.monotonic() - began < 3
    code, _out, err = run_cli("--prometheus", "ftp://x", "--match", "up", "--start", "now-1h",
                              "--config", str(cfg))  # fmt: skip
    assert code == 1 and "expected http://HOST:PORT" in err


# -- a real Prometheus scraping the simulator --------------------------------------------------

SELECTOR = '{__name__=~"vllm:.*|process_start_time_seconds"}'
# Small enough for seconds of data: the simulator runs 20x faster than real time.
QUICK = (
    "[baseline]\nwindow = 10\nwarmup = 0\nlearn_for = 60\nvalue_interval = 1\nmin_values = 2\n"
    '[policy]\nmode = "enforce"\nwindows = ["daily 00:00-24:00"]\n'
)


@contextlib.contextmanager
def prometheus(target: str) -> Iterator[str]:
    """Debian's prometheus on a free loopback port, scraping ``target`` every second, with
    its configuration and data in a temporary directory."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (apt-get install prometheus; .ci/run does)"
    with tempfile.TemporaryDirectory(prefix="vkvagent-prometheus-") as directory:
        root = Path(directory)
        (root / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: vllm\n    static_configs:\n"
            f"      - targets: ['{target}']\n",
            encoding="utf-8",
        )
        url = f"http://127.0.0.1:{free_port()}"
        process = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address={url[7:]}",
             "--log.level=warn"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 20
            while True:
                assert process.poll() is None, process.communicate()[0]
                with contextlib.suppress(OSError):
                    if get(url + "/-/ready", timeout=0.5)[0] == 200:
                        break
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.1)
            yield url
        finally:
            stop_process(process)
            process.communicate()  # read what it wrote (little, at warn level); close the pipe


@pytest.mark.skipif(
    shutil.which("prometheus") is None and not os.environ.get("CI"),
    reason="needs Debian's prometheus package (CI installs it)",
)
def test_replay_reads_a_real_prometheus_scraping_the_simulator(tmp_path: Path) -> None:
    cfg = write(tmp_path / "config.toml", QUICK)
    sim = SimProcess(MODEL, "--time-scale", "20", "--seed", "3")
    with contextlib.ExitStack() as stack:
        # Prometheus first: its first scrape waits ~5 s for service discovery anyway.
        url = stack.enter_context(prometheus(sim.url[len("http://") :]))
        began = time.time()
        stack.enter_context(sim)
        started = float(re.search(rb"^process_start_time_seconds (\S+)$",
                                  get(sim.url + "/metrics")[1], re.M).group(1))  # type: ignore[union-attr]  # fmt: skip
        # Until Prometheus holds 10 s of scrapes (its first one comes within a second or so).
        deadline = time.monotonic() + 40
        while True:
            time.sleep(0.5)
            store = query_range.fetch(url, [SELECTOR], began - 5, time.time(), 1.0)
            running = [s for s in store.series() if s.name == "vllm:num_requests_running"]
            if running and len(running[0].times) >= 10:
                break
            assert time.monotonic() < deadline, "prometheus did not scrape the simulator"
        end = time.time()
        code, out, err = run_cli(
            "--prometheus", url, "--match", SELECTOR, "--start", f"{began - 5:.3f}",
            "--end", f"{end:.3f}", "--step", "1s", "--config", str(cfg), "--json",
        )  # fmt: skip
        assert (code, err) == (0, "")
        data = json.loads(out)
        check_structure(data)
        # Chunks of 4 points give exactly what one query gives.
        whole = query_range.fetch(url, [SELECTOR], began - 5, end, 1.0).series()
        chunked = query_range.fetch(url, [SELECTOR], began - 5, end, 1.0, max_points=4).series()
        assert chunked == whole
        # A selector Prometheus refuses comes back as its own error, in one line.
        code, _out, err = run_cli("--prometheus", url, "--match", "{", "--start", "now-1m",
                                  "--step", "1s", "--config", str(cfg))  # fmt: skip
        assert code == 1 and err.startswith(f"vkvagent: Prometheus at {url}/api/v1/query_range "
                                            "answered HTTP 400: bad_data: ")  # fmt: skip
    decisions, summary = data["decisions"], data["summary"]
    assert began - 5 <= datetime.fromisoformat(summary["from"][:-1]).replace(
        tzinfo=timezone.utc).timestamp() and summary["to"] <= datetime.fromtimestamp(
        end, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # fmt: skip
    assert summary["evaluations"] >= 10 and summary["runs"] == 1 and summary["restarts"] == 0
    assert {d["evidence"]["run"] for d in decisions} == {f"start:{started:.3f}"}
    assert decisions[0]["reason"].startswith("learning: ")
    assert any(d["reason"].startswith("healthy: speed ") for d in decisions), decisions
    assert not any(d["cause"] for d in decisions)
    assert math.isfinite(summary["step_s"]) and summary["step_s"] == 1.0
