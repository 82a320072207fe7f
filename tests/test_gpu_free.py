"""The GPUs free before vLLM starts (vkvagent/gpu_free.py), on recorded NVML process lists and
a /proc tree written as the kernel shows it: the unit's leftovers killed and their memory
back, anyone else's refused and never killed, a leftover that will not go bounded, and
vLLM's words for GPU memory it cannot get. A real GPU's process list when one is present."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES
from tests.test_actuator_gpu import actuator
from vkvagent.actuator import ActuatorError
from vkvagent.gpu import GpuReader, NvmlBackend, NvmlUnavailable, RecordedBackend
from vkvagent.gpu_free import GpusBusy, free_gpus, holders, is_gpu_memory_failure

UNIT = "vllm.service"
V2 = "0::/system.slice/vllm.service\n"  # cgroup v2, as /proc/PID/cgroup reads
V1 = "12:memory:/system.slice/vllm.service\n1:name=systemd:/system.slice/vllm.service\n"
OTHER = "0::/user.slice/user-1000.slice/session-3.scope\n"


class World:
    """A recorded NVML whose process lists follow the /proc tree: a process killed leaves
    both, as the driver frees its memory."""

    def __init__(self, tmp_path: Path, processes: dict[int, tuple[str, str, int]]) -> None:
        self.proc = tmp_path / "proc"
        self.recording = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())
        self.killed: list[int] = []
        self.stuck: set[int] = set()  # processes that ignore SIGKILL (stuck in the driver)
        for pid, (name, cgroup, _gpu) in processes.items():
            (self.proc / str(pid)).mkdir(parents=True)
            (self.proc / str(pid) / "comm").write_text(name + "\n")
            (self.proc / str(pid) / "cgroup").write_text(cgroup)
        for index, device in enumerate(self.recording["devices"]):
            device["processes"] = [
                [pid, 30 * 2**30] for pid, (_n, _c, gpu) in processes.items() if gpu == index
            ]
        self.reader = GpuReader(open=lambda: RecordedBackend(self.recording))
        self.now = 0.0

    def kill(self, pid: int) -> None:
        self.killed.append(pid)
        if pid in self.stuck:
            return
        for device in self.recording["devices"]:
            device["processes"] = [p for p in device["processes"] if p[0] != pid]
        for entry in (self.proc / str(pid)).iterdir():
            entry.unlink()
        (self.proc / str(pid)).rmdir()

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def free(self, timeout: float = 10.0) -> list[Any]:
        return free_gpus(
            self.reader, UNIT, timeout=timeout, proc=self.proc, kill=self.kill,
            clock=lambda: self.now, sleep=self.sleep,
        )  # fmt: skip


def test_the_units_leftovers_are_killed_named_and_their_memory_comes_back(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0), 4101: ("VLLM::Worker_TP", V1, 1)})
    freed = world.free()
    assert world.killed == [4100, 4101]
    assert [str(h) for h in freed] == [
        "PID 4100 (VLLM::EngineCor) on GPU 0, 30.0 GiB",
        "PID 4101 (VLLM::Worker_TP) on GPU 1, 30.0 GiB",
    ]
    assert world.reader.processes() == ((), None)


def test_anyone_elses_process_refuses_the_start_and_is_never_killed(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0), 777: ("python3", OTHER, 1)})
    with pytest.raises(GpusBusy, match=r"not vllm.service's: PID 777 \(python3\) on GPU 1"):
        world.free()
    assert world.killed == []


def test_a_leftover_that_will_not_go_is_bounded(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0)})
    world.stuck.add(4100)
    with pytest.raises(GpusBusy, match=r"still hold the GPUs 5 s after SIGKILL: PID 4100"):
        world.free(timeout=5.0)
    assert 5.0 <= world.now <= 5.5


def test_free_gpus_and_no_nvml_need_nothing(tmp_path: Path) -> None:
    assert World(tmp_path, {}).free() == []

    def absent() -> RecordedBackend:
        raise NvmlUnavailable("libnvidia-ml.so.1 not found")

    assert free_gpus(GpuReader(open=absent), UNIT, timeout=1.0, proc=tmp_path) == []


def test_a_process_gone_since_nvml_listed_it_is_left_out(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0)})
    listed, _ = world.reader.processes()
    (world.proc / "4100" / "comm").unlink()  # exited between NVML's list and /proc
    assert holders(listed, UNIT, world.proc) == []


def test_the_actuator_frees_the_gpus_before_it_starts_a_unit_that_is_down(
    tmp_path: Path,
) -> None:
    world = World(tmp_path, {777: ("python3", OTHER, 0)})
    acting = actuator(tmp_path, world.recording, world.reader)
    acting.proc = world.proc
    with pytest.raises(ActuatorError, match=r"not vllm.service's: PID 777"):
        acting._free_gpus()
    # A start that failed for GPU memory those processes held: not the flags' fault.
    line = (
        "ValueError: Free memory on device (10.2/79.1 GiB) on startup is less than desired "
        "GPU memory utilization (0.9, 71.2 GiB). Decrease GPU memory utilization or reduce "
        "GPU memory used by other processes."
    )
    assert acting._gpus_held(line) == "PID 777 (python3) on GPU 0, 30.0 GiB"
    assert acting._gpus_held("ValueError: max_model_len 100000 > 2048") == ""


@pytest.mark.parametrize(
    ("line", "meant"),
    [
        ("ValueError: Free memory on device (10.2/79.1 GiB) on startup is less than desired "
         "GPU memory utilization (0.9, 71.2 GiB).", True),
        ("ValueError: Available memory on node 0 (5.85/9.71 GiB) on startup is less than "
         "desired GPU memory utilization (0.4, 3.88 GiB).", True),
        ("ValueError: No available memory for the cache blocks. Try increasing "
         "`gpu_memory_utilization` when initializing the engine.", True),
        ("ValueError: User-specified max_model_len (100000) is greater than ...", False),
        (None, False),
    ],
)  # fmt: skip
def test_vllms_words_for_gpu_memory_it_cannot_get(line: str | None, meant: bool) -> None:
    assert is_gpu_memory_failure(line) is meant


def test_a_real_gpus_processes_are_listed_with_their_memory() -> None:
    """On a machine with an NVIDIA GPU: NVML's list, each process with its name."""
    try:
        backend = NvmlBackend()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVIDIA GPU here: {exc}")
    reader = GpuReader(open=lambda: backend)
    try:
        listed, problem = reader.processes()
        assert problem is None
        for process in listed:
            assert process.pid > 0 and 0 <= process.index < backend.device_count()
        assert all(h.name for h in holders(listed, UNIT))
    finally:
        reader.reset()
