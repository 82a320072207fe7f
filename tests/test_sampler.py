"""Sampling real sources: a failing source gives an invalid sample, never an exception."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from tests.conftest import FIXTURES, read_page
from tests.httpserver import HttpServer, RawServer, free_port, read_request
from vkvagent.adapters.gpu import GpuReader, NvmlUnavailable, RecordedBackend
from vkvagent.adapters.history import History
from vkvagent.adapters.sampler import Sampler, unit_facts
from vkvagent.adapters.vllm import VllmClient
from vkvagent.engine.samples import Sample

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
    from vkvagent.adapters.systemd import ExecCommand, SystemdError, UnitState
    from vkvagent.engine.samples import UnitFacts

    state = UnitState(
        "vllm.service", "loaded", "active", "running", "success", 42, "ab" * 16, 1, 0,
        3 * 2**30, (ExecCommand("/usr/bin/vllm", ("vllm", "serve", "m"), False),),
        "/etc/systemd/system/vllm.service", (), 5, 10_000_000,
        restart_policy="on-failure", unit_file_state="enabled",
        exec_main_code=1, exec_main_status=0,
    )  # fmt: skip
    routes = {"/metrics": lambda h: h.reply(200, PAGE)}
    with HttpServer(routes) as server:
        sample = Sampler(VllmClient(server.url), unit=lambda: state).take()
    assert sample.unit == UnitFacts(
        "active", "running", "ab" * 16, 42, 3 * 2**30, 0,
        restart_policy="on-failure", wanted=True, last_exit="exited with status 0",
    )  # fmt: skip
    assert sample.to_json()["unit"]["invocation_id"] == "ab" * 16

    def no_bus() -> UnitState:
        raise SystemdError("read", "vllm.service", "unavailable", "no system bus")

    sample = Sampler(VllmClient(f"http://127.0.0.1:{free_port()}"), unit=no_bus).take()
    assert sample.unit is None and sample.unit_error is not None


def test_unit_facts_judge_growth_by_anon_memory_and_fall_back_to_memory_current(
    tmp_path: Path,
) -> None:
    """MemoryCurrent counts the page cache too; memory.stat's anon does not. Where anon cannot
    be read (cgroup v1, no such file), growth is judged on MemoryCurrent."""
    from dataclasses import replace

    from vkvagent.adapters.systemd import ExecCommand, UnitState

    state = UnitState(
        "vllm.service", "loaded", "active", "running", "success", 42, "ab" * 16, 1, 0,
        20 * 2**30, (ExecCommand("/usr/bin/vllm", ("vllm", "serve", "m"), False),),
        "/etc/systemd/system/vllm.service", (), 5, 10_000_000, "/system.slice/vllm.service",
    )  # fmt: skip
    cgroup = tmp_path / "v2" / "system.slice" / "vllm.service"
    cgroup.mkdir(parents=True)
    anon = 6 * 2**30
    (cgroup / "memory.stat").write_text(
        f"anon {anon}\nfile {13 * 2**30}\nkernel 201326592\nkernel_stack 14680064\n"
        f"shmem 1073741824\nfile_mapped 2147483648\nanon_thp 0\ninactive_anon 4096\n"
        f"active_anon {anon - 4096}\ninactive_file 4294967296\nactive_file 9663676416\n"
    )
    facts = unit_facts(state, tmp_path / "v2")
    assert (facts.memory_bytes, facts.memory_anon_bytes) == (20 * 2**30, anon)
    assert (facts.growth_bytes, facts.growth_source) == (anon, "anon")
    assert Sample(0.0, 0.0, None, unit=facts).to_json()["unit"]["memory_anon_bytes"] == anon
    assert facts.memory_max_bytes is None  # unlimited
    limited = unit_facts(replace(state, memory_max=40 * 2**30), tmp_path / "v2")
    assert limited == replace(facts, memory_max_bytes=40 * 2**30)

    fallback = unit_facts(state, tmp_path / "v1")  # no memory.stat there, as on cgroup v1
    assert fallback == replace(facts, memory_anon_bytes=None)
    assert (fallback.growth_bytes, fallback.growth_source) == (20 * 2**30, "MemoryCurrent")
    stopped = unit_facts(replace(state, memory_current=None, control_group=""), tmp_path / "v2")
    assert (stopped.memory_anon_bytes, stopped.growth_bytes) == (None, None)
    assert stopped.growth_source == "MemoryCurrent"
    empty = replace(facts, memory_anon_bytes=0)  # known to be none: not a fallback
    assert (empty.growth_bytes, empty.growth_source) == (0, "anon")


def test_vllms_memory_is_read_from_its_containers_cgroup_when_the_engine_keeps_it_apart(
    tmp_path: Path,
) -> None:
    """Docker runs a container in its own ``docker-ID.scope``: the unit's cgroup holds only the
    ``docker run`` client. The engine is asked where the container's first process is, once
    per start of the unit (an ``inspect`` costs tens of ms), and its cgroup's memory is vLLM's.
    With a recorded /proc and cgroup tree, and a ``docker`` that answers as Docker does."""
    from dataclasses import replace

    from vkvagent.adapters.sampler import MemoryGroup
    from vkvagent.adapters.systemd import ExecCommand, UnitState

    bin_dir, proc, root = tmp_path / "bin", tmp_path / "proc", tmp_path / "v2"
    asked = tmp_path / "asked"
    for name in ("docker", "podman"):
        engine = bin_dir / name
        engine.parent.mkdir(exist_ok=True)
        engine.write_text(  # `ENGINE inspect --format {{.State.Pid}} NAME`, logged
            f'#!/bin/sh\necho "$*" >> {asked}\n'
            f'[ "$1 $3 $4" = "inspect {{{{.State.Pid}}}} vllm" ] && cat {tmp_path}/pid\n'
        )
        engine.chmod(0o755)
    (tmp_path / "pid").write_text("4242\n")
    (proc / "4242").mkdir(parents=True)
    (proc / "4242/cgroup").write_text("0::/system.slice/docker-9f2c.scope\n")
    scope = root / "system.slice/docker-9f2c.scope"
    scope.mkdir(parents=True)
    (scope / "memory.stat").write_text(f"anon {7 * 2**30}\nfile {2**30}\n")
    (scope / "memory.current").write_text(f"{8 * 2**30}\n")
    (scope / "memory.max").write_text(f"{40 * 2**30}\n")
    unit_group = root / "system.slice/vllm.service"
    unit_group.mkdir(parents=True)
    (unit_group / "memory.stat").write_text(f"anon {30 * 2**20}\n")

    run = (str(bin_dir / "docker"), "run", "--rm", "--name", "vllm", "--gpus", "all",
           "vllm/vllm-openai:v0.11.0", "--model", "/models/llama")  # fmt: skip
    state = UnitState(
        "vllm.service", "loaded", "active", "running", "success", 41, "ab" * 16, 1, 0,
        40 * 2**20, (ExecCommand(run[0], run, False),), "/etc/systemd/system/vllm.service",
        (), 5, 10_000_000, "/system.slice/vllm.service",
    )  # fmt: skip
    groups = MemoryGroup(proc)

    def asks() -> int:
        return len(asked.read_text().splitlines()) if asked.exists() else 0

    assert groups.of(state, 100.0) == "/system.slice/docker-9f2c.scope"
    facts = unit_facts(state, root, groups.of(state, 102.0))
    assert (facts.memory_anon_bytes, facts.memory_bytes) == (7 * 2**30, 8 * 2**30)
    assert facts.memory_max_bytes == 40 * 2**30  # docker run --memory: where the kernel kills
    assert asks() == 1  # once for this start
    # The unit's own memory when vLLM runs in it (no container; or no group named).
    assert unit_facts(state, root).memory_anon_bytes == 30 * 2**20
    assert unit_facts(state, root).memory_bytes == 40 * 2**20

    # A new start of the unit: the engine is asked again. While it cannot say (the container
    # not made yet), no memory (the client's few MB, then vLLM's GBs, would read as growth),
    # and it is asked again RETRY seconds later, not every tick.
    restarted = replace(state, invocation_id="cd" * 16)
    (tmp_path / "pid").write_text("")
    assert groups.of(restarted, 200.0) is None
    assert groups.of(restarted, 200.0 + MemoryGroup.RETRY - 1) is None
    unknown = unit_facts(restarted, root, None)
    assert (unknown.memory_bytes, unknown.memory_anon_bytes, unknown.memory_max_bytes) == (
        None, None, None,
    )  # fmt: skip
    assert asks() == 2
    (tmp_path / "pid").write_text("4242\n")
    assert groups.of(restarted, 200.0 + MemoryGroup.RETRY) == "/system.slice/docker-9f2c.scope"
    assert asks() == 3

    # podman --cgroups=split (Quadlet's default): the container in a cgroup below the unit's.
    (proc / "4242/cgroup").write_text("0::/system.slice/vllm.service/libpod-payload-1\n")
    podman_run = (str(bin_dir / "podman"), *run[1:])
    split = replace(
        state, invocation_id="ef" * 16, exec_start=(ExecCommand(podman_run[0], podman_run, False),)
    )
    assert groups.of(split, 300.0) == "/system.slice/vllm.service" and asks() == 4
    # Said on the command line (Quadlet writes --cgroups=split): nothing asked.
    said = (*podman_run[:2], "--cgroups=split", *podman_run[2:])
    quadlet = replace(
        split, invocation_id="fe" * 16, exec_start=(ExecCommand(said[0], said, False),)
    )
    assert groups.of(quadlet, 320.0) == "/system.slice/vllm.service" and asks() == 4
    # A container without a name to ask about: the unit's cgroup, nothing asked.
    unnamed = tuple(word for word in run if word not in ("--name", "vllm"))
    anonymous = replace(
        state, invocation_id="23" * 16, exec_start=(ExecCommand(run[0], unnamed, False),)
    )
    assert groups.of(anonymous, 350.0) == "/system.slice/vllm.service" and asks() == 4
    # vLLM itself as the unit's command: nothing to ask.
    bare = replace(
        state,
        invocation_id="01" * 16,
        exec_start=(ExecCommand("/usr/bin/vllm", ("vllm", "serve", "m"), False),),
    )
    assert groups.of(bare, 400.0) == "/system.slice/vllm.service" and asks() == 4
    stopped = replace(bare, control_group="")
    assert groups.of(stopped, 500.0) == ""
