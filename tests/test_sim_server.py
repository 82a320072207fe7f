"""The simulator as a real process: vLLM's start-up, endpoints, flags, scenarios, signals."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.httpserver import free_port
from tests.simproc import SimProcess, get, post_json
from vkvagent.adapters.gpu import reader_for
from vkvagent.adapters.vllm import VllmClient
from vkvagent.knowledge.vllm_metrics import FLAVORS, Normaliser

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def test_the_port_refuses_connections_until_the_model_has_loaded() -> None:
    with SimProcess(MODEL, "--time-scale", "10", cold_start=10.0, wait=False) as sim:
        time.sleep(0.3)  # 3 s of a 10 s simulated load
        with pytest.raises(OSError):
            get(sim.url + "/health", timeout=0.5)
        sim.wait_ready(timeout=5)
        status, body = get(sim.url + "/v1/models")
        assert status == 200
        model = json.loads(body)["data"][0]
        assert model["id"] == MODEL and model["max_model_len"] == 32768
        assert json.loads(get(sim.url + "/version")[1]) == {"version": "0.32.0"}


def test_a_bad_flag_fails_the_start_like_vllm() -> None:
    port = str(free_port())
    for bad, message in (
        (["--gpu-memory-utilization", "abc"], "invalid float value: 'abc'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "vkvagent", "sim", "serve", MODEL, "--port", port, *bad],
            check=False, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 2
        assert done.stderr.startswith("vllm serve: error: ") and message in done.stderr


@pytest.mark.parametrize("flavor", FLAVORS)
def test_each_flavour_is_read_by_the_agent_with_the_flags_in_cache_config(flavor: str) -> None:
    flags = ["--gpu-memory-utilization", "0.8", "--block-size", "32", "--max-model-len", "16384"]
    with SimProcess(MODEL, *flags, "--metrics-flavor", flavor, "--time-scale", "60") as sim:
        time.sleep(0.5)
        client = VllmClient(sim.url)
        metrics = client.scrape(client.version())
    assert metrics.flavor == flavor
    assert metrics.model_name == MODEL
    assert metrics.cache_config["gpu_memory_utilization"] == "0.8"
    assert metrics.cache_config["block_size"] == "32"
    assert int(metrics.cache_config["num_gpu_blocks"]) > 1000
    assert metrics.generation_tokens_total is not None and metrics.generation_tokens_total > 0


def post(url: str, body: dict[str, Any]) -> int:
    """POST ``body`` as JSON; the status answered, errors included."""
    request = urllib.request.Request(url, data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=2.0) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def http_series(page: bytes) -> dict[tuple[str, str, str], float]:
    """http_requests_total by (handler, method, status)."""
    return {
        (s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(page.decode())
        for s in family.samples
        if s.name == "http_requests_total"
    }


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}


def test_the_agent_reads_the_answers_consistently_with_the_finished_requests() -> None:
    """http_requests_total counts the workload's finished requests (request_success_total)
    as completions answered 2xx, plus the server's own answers on vLLM's API routes by their
    status class; /metrics, /health, /version and the /sim/ endpoints are not counted."""
    with SimProcess(MODEL, "--time-scale", "60", "--render-interval", "0") as sim:
        time.sleep(0.3)
        statuses = [post(sim.url + "/v1/completions", COMPLETION) for _ in range(3)]
        statuses.append(post(sim.url + "/v1/completions", {**COMPLETION, "model": "other"}))
        statuses += [get(sim.url + path)[0] for path in ("/v1/models", "/v1/models", "/nope")]
        sim.state()
        get(sim.url + "/version")
        page = get(sim.url + "/metrics")[1]
    assert statuses == [200, 200, 200, 404, 200, 200, 404]
    m = Normaliser().normalise(page.decode())
    assert m.request_success_total is not None and m.request_success_total > 0
    assert m.http_requests_total == m.request_success_total + 3  # the POSTs not answered 4xx
    assert m.http_5xx_total == 0
    assert http_series(page) == {
        ("/v1/completions", "POST", "2xx"): m.request_success_total + 3,
        ("/v1/completions", "POST", "4xx"): 1,
        ("/v1/models", "GET", "2xx"): 2,
        ("none", "GET", "4xx"): 1,  # a path vLLM has no route for
    }


def test_a_drain_answers_500_and_they_show_as_5xx() -> None:
    """On SIGTERM with --shutdown-timeout, what comes in while it drains is answered 500: the
    probe's completions and the workload's requests alike, counted as 5xx on /metrics."""
    with SimProcess(MODEL, "--time-scale", "60", "--rate", "4", "--shutdown-timeout", "3",
                    "--render-interval", "0") as sim:  # fmt: skip
        time.sleep(0.3)
        # Stalled, what is in flight never finishes: the drain takes all its 3 s.
        post_json(sim.url + "/sim/scenario", {"scenario": "stall", "after": 0})
        assert sim.process is not None
        sim.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while sim.state()["admitting"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        statuses = [post(sim.url + "/v1/completions", COMPLETION) for _ in range(3)]
        refused_before = sim.state()["refused"]
        m = Normaliser().normalise(get(sim.url + "/metrics")[1].decode())
        refused_after = sim.state()["refused"]
        assert sim.process.wait(timeout=10) == 0
    assert statuses == [500, 500, 500]
    assert m.http_5xx_total is not None
    assert 3 + refused_before <= m.http_5xx_total <= 3 + refused_after
    assert m.request_success_total is not None and m.http_requests_total is not None
    assert m.http_requests_total - m.http_5xx_total == m.request_success_total


def test_simulated_time_runs_time_scale_times_faster() -> None:
    with SimProcess(MODEL, "--time-scale", "120") as sim:
        real_start = time.monotonic()
        first = sim.state()
        time.sleep(1.0)
        second = sim.state()
        real = time.monotonic() - real_start  # includes both requests: an upper bound
    simulated = second["uptime"] - first["uptime"]
    assert 120 * (1.0 - 0.05) - 0.5 <= simulated <= 120 * real + 0.5
    assert second["served"] > first["served"]


def test_a_stall_switched_at_run_time_freezes_tokens_and_health_stays_200() -> None:
    with SimProcess(MODEL, "--time-scale", "60", "--rate", "4") as sim:
        time.sleep(0.5)
        post_json(sim.url + "/sim/scenario", {"scenario": "stall", "after": 0})
        time.sleep(0.2)
        frozen = sim.state()
        time.sleep(0.5)
        later = sim.state()
        assert get(sim.url + "/health")[0] == 200
    assert later["stalled"] and later["generation_tokens"] == frozen["generation_tokens"]
    assert later["running"] > 0


def test_a_dead_engine_answers_503_then_the_process_exits_0_as_vllm_does() -> None:
    # Death 30 simulated s (3 real s) in; then vLLM's launcher exits within 5 s (0.5 real s).
    with SimProcess(MODEL, "--time-scale", "10", "--scenario", "engine-dead",
                    "--scenario-onset", "30") as sim:  # fmt: skip
        assert get(sim.url + "/health")[0] == 200
        deadline = time.monotonic() + 10
        while get(sim.url + "/health")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sim.process is not None
        assert sim.process.wait(timeout=10) == 0


def test_memory_growth_really_grows_the_process() -> None:
    def rss(pid: int) -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(
            next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]
        )

    with SimProcess(MODEL, "--time-scale", "60", "--rate", "20", "--scenario",
                    "memory-growth", "--leak-per-request", "65536") as sim:  # fmt: skip
        assert sim.process is not None
        before = rss(sim.process.pid)
        time.sleep(1.5)
        state = sim.state()
        after = rss(sim.process.pid)
    assert state["host_memory_leaked_bytes"] >= 65536 * 100
    assert (after - before) * 1024 >= state["host_memory_leaked_bytes"] * 0.8


def test_thermal_throttle_shows_in_the_gpu_recording(tmp_path: Path) -> None:
    recording = tmp_path / "gpus.json"
    with SimProcess(MODEL, "--time-scale", "60", "--tensor-parallel-size", "2",
                    "--scenario", "thermal-throttle", "--scenario-onset", "30",
                    "--gpu-recording", str(recording)) as sim:  # fmt: skip
        time.sleep(1.0)
        assert sim.state()["speed_factor"] == 0.6
        readings, problem = reader_for((), str(recording)).read()
    assert problem is None and len(readings) == 2
    assert "hw_thermal_slowdown" in readings[0].throttled_by


def test_sigterm_stops_it_cleanly() -> None:
    with SimProcess(MODEL) as sim:
        started = time.monotonic()
        assert sim.stop() == 0
        assert time.monotonic() - started < 3


def test_a_restart_cures_uptime_degradation() -> None:
    args = (MODEL, "--time-scale", "3600", "--scenario", "uptime-decline", "--scenario-onset", "0")
    with SimProcess(*args) as old:
        time.sleep(1.5)
        aged = old.state()
    with SimProcess(*args) as new:  # the restart: a new process, its uptime from zero
        fresh = new.state()
    assert aged["uptime"] > 5000 and aged["speed_factor"] < 0.9
    assert fresh["uptime"] < aged["uptime"]
    assert fresh["speed_factor"] > aged["speed_factor"]
