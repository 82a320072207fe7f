"""Sampling real sources: a failing source gives an invalid sample, never an exception."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from tests.conftest import FIXTURES, read_page
from tests.httpserver import HttpServer, RawServer, free_port, read_request
from vkvagent.gpu import GpuReader, NvmlUnavailable, RecordedBackend
from vkvagent.history import History
from vkvagent.sample import Sampler
from vkvagent.vllm import VllmClient

PAGE = read_page("v1-0.10.prom").encode()


def recorded_gpus() -> GpuReader:
    backend = RecordedBackend.load(str(FIXTURES / "gpu" / "h100x2-throttled.json"))
    return GpuReader(open=lambda: backend)


def test_a_good_scrape_and_gpus_make_a_valid_sample(tmp_path: Path) -> None:
    routes = {
        "/metrics": lambda h: h.reply(200, PAGE),
        "/version": lambda h: h.reply(
            200, b'{"version": "0.10.1"}', content_type="application/json"
        ),
    }
    with HttpServer(routes) as server:
        sampler = Sampler(
            VllmClient(server.url), recorded_gpus(), wall=lambda: 1e9, mono=lambda: 5.0
        )
        first, second = sampler.take(), sampler.take()
        version_calls = [path for path, _ in server.requests if path == "/version"]
    assert first.valid and first.vllm_error is None and first.gpu_error is None
    assert first.time == 1e9 and first.mono == 5.0
    assert first.vllm is not None and first.vllm.version == "0.10.1"
    assert first.vllm.flavor == "v1-0.10" and len(first.gpus) == 3
    assert second.vllm is not None and second.vllm.version == "0.10.1"
    assert len(version_calls) == 1  # asked once per vLLM process, not per sample
    with History(tmp_path) as history:
        history.append(first)
        assert history.samples() == [first]


def test_vllm_down_gives_an_invalid_sample_that_is_still_kept(tmp_path: Path) -> None:
    def no_driver() -> RecordedBackend:
        raise NvmlUnavailable("NVML Shared Library Not Found")

    sampler = Sampler(VllmClient(f"http://127.0.0.1:{free_port()}"), GpuReader(open=no_driver))
    sample = sampler.take()
    assert not sample.valid and sample.vllm is None
    assert sample.vllm_error is not None and "connection refused" in sample.vllm_error
    assert sample.gpu_error == "NVML unavailable: NVML Shared Library Not Found"
    with History(tmp_path) as history:
        history.append(sample)
        assert history.latest() == sample


def test_a_hung_vllm_costs_a_sample_one_request_timeout_not_two() -> None:
    asked: list[bytes] = []

    def hang(conn: socket.socket, stop: threading.Event) -> None:
        asked.append(read_request(conn).split(b" ")[1])
        stop.wait()  # accepts, reads the request, never answers

    with RawServer(hang) as server:
        sample = Sampler(VllmClient(server.url, connect_timeout=0.2, read_timeout=0.3)).take()
    assert not sample.valid
    assert sample.vllm_error == f"{server.url}/metrics: no data for 0.3 s (read timeout)"
    assert asked == [b"/metrics"]  # /version was not asked to wait as long again


def test_the_configured_version_is_a_fallback_for_a_server_without_version() -> None:
    routes = {"/metrics": lambda h: h.reply(200, PAGE)}
    with HttpServer(routes) as server:
        sample = Sampler(VllmClient(server.url), version="0.10.1").take()
    assert sample.vllm is not None and sample.vllm.version == "0.10.1"


def test_a_broken_page_is_an_invalid_sample() -> None:
    routes = {"/metrics": lambda h: h.reply(200, b"<html>502 Bad Gateway</html>\n")}
    with HttpServer(routes) as server:
        sample = Sampler(VllmClient(server.url), version="0.10.1").take()
    assert not sample.valid
    assert sample.vllm_error is not None and "HTML" in sample.vllm_error


def test_the_units_state_goes_into_the_sample_and_its_failure_too() -> None:
    from vkvagent.sample import UnitFacts
    from vkvagent.systemd import ExecCommand, SystemdError, UnitState

    state = UnitState(
        "vllm.service", "loaded", "active", "running", "success", 42, "ab" * 16, 1, 0,
        3 * 2**30, (ExecCommand("/usr/bin/vllm", ("vllm", "serve", "m"), False),),
        "/etc/systemd/system/vllm.service", (), 5, 10_000_000,
    )  # fmt: skip
    routes = {"/metrics": lambda h: h.reply(200, PAGE)}
    with HttpServer(routes) as server:
        sample = Sampler(VllmClient(server.url), unit=lambda: state).take()
    assert sample.unit == UnitFacts("active", "running", "ab" * 16, 42, 3 * 2**30, 0)
    assert sample.to_json()["unit"]["invocation_id"] == "ab" * 16

    def no_bus() -> UnitState:
        raise SystemdError("read", "vllm.service", "unavailable", "no system bus")

    sample = Sampler(VllmClient(f"http://127.0.0.1:{free_port()}"), unit=no_bus).take()
    assert sample.unit is None and sample.unit_error is not None
