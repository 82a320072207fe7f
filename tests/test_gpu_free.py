"""The GPUs free before vLLM starts (adapters/gpu_free.py), on recorded NVML process lists and
a /proc tree written as the kernel shows it: the unit's leftovers killed and their memory
back, anyone else's refused and never killed, a leftover that will not go bounded, and
vLLM's words for GPU memory it cannot get. A real GPU's process list when one is present."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.conftest import FIXTURES
from tests.test_actuator_gpu import actuator
from vkvagent.actuation.actuator import ActuatorError
from vkvagent.adapters.gpu import (
    GpuProcess,
    GpuReader,
    NvmlBackend,
    NvmlUnavailable,
    RecordedBackend,
)
from vkvagent.adapters.gpu_free import (
    UNSEEN_GRACE,
    GpuFree,
    GpusBusy,
    GpusHeldByOthers,
    GpusNotFreed,
    clear_gpus,
    holders,
    is_gpu_memory_failure,
    unit_cgroup,
)
from vkvagent.adapters.systemd import UnitState

UNIT = "vllm.service"
V2 = "0::/system.slice/vllm.service\n"  # cgroup v2, as /proc/PID/cgroup reads
V1 = "12:memory:/system.slice/vllm.service\n1:name=systemd:/system.slice/vllm.service\n"
OTHER = "0::/user.slice/user-1000.slice/session-3.scope\n"
GiB = 2**30
BASE = GiB // 2  # what the driver keeps on a GPU with no process


class World:
    """A recorded NVML whose process lists and used memory follow the /proc tree: a process
    killed leaves both, and the driver frees its memory after ``free_after`` polls."""

    def __init__(self, tmp_path: Path, processes: dict[int, tuple[str, str, int]]) -> None:
        self.proc = tmp_path / "proc"
        self.proc.mkdir(exist_ok=True)
        self.recording = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())
        self.killed: list[int] = []
        self.stuck: set[int] = set()  # processes that ignore SIGKILL (stuck in the driver)
        self.kept: dict[int, int] = {}  # GPU -> bytes the driver has not freed yet
        self.free_after = 0  # polls until the memory of a killed process is back
        self.lists = 0  # how often NVML was asked for its processes
        self.after_list: Callable[[], None] | None = None
        for pid, (name, cgroup, _gpu) in processes.items():
            self.write(pid, name, cgroup)
        for index, device in enumerate(self.recording["devices"]):
            device["processes"] = [
                [pid, 30 * GiB] for pid, (_n, _c, gpu) in processes.items() if gpu == index
            ]
        world = self

        class Backend(RecordedBackend):
            def query(self, index: int, what: str) -> Any:
                device = world.recording["devices"][index]
                if what == "memory_used":
                    held = sum(used or 0 for _pid, used in device["processes"])
                    return BASE + held + world.kept.get(index, 0)
                if what == "processes":
                    world.lists += 1
                    listed = copy.deepcopy(device["processes"])
                    if world.after_list:
                        world.after_list()
                    return listed
                return super().query(index, what)

        self.reader = GpuReader(open=lambda: Backend(self.recording))
        self.now = 0.0

    def write(self, pid: int, name: str, cgroup: str) -> None:
        (self.proc / str(pid)).mkdir(exist_ok=True)
        (self.proc / str(pid) / "comm").write_text(name + "\n")
        (self.proc / str(pid) / "cgroup").write_text(cgroup)

    def kill(self, pid: int) -> None:
        self.killed.append(pid)
        if pid in self.stuck:
            return
        for index, device in enumerate(self.recording["devices"]):
            for listed, used in device["processes"]:
                if listed == pid and self.free_after:
                    self.kept[index] = self.kept.get(index, 0) + used
            device["processes"] = [p for p in device["processes"] if p[0] != pid]
        for entry in (self.proc / str(pid)).iterdir():
            entry.unlink()
        (self.proc / str(pid)).rmdir()

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.free_after:
            self.free_after -= 1
            if not self.free_after:
                self.kept.clear()

    def clear(self, timeout: float = 10.0, **options: Any) -> GpuFree:
        options.setdefault("kill", self.kill)
        return clear_gpus(
            self.reader, UNIT, timeout=timeout, proc=self.proc,
            clock=lambda: self.now, sleep=self.sleep, **options,
        )  # fmt: skip


def test_the_units_leftovers_are_killed_named_and_their_memory_comes_back(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0), 4101: ("VLLM::Worker_TP", V1, 1)})
    world.free_after = 3  # the driver takes three polls to give the memory back
    freed = world.clear()
    assert world.killed == [4100, 4101]
    assert [str(h) for h in freed.killed] == [
        "PID 4100 (VLLM::EngineCor) on GPU 0, 30.0 GiB",
        "PID 4101 (VLLM::Worker_TP) on GPU 1, 30.0 GiB",
    ]
    assert freed.seconds == pytest.approx(1.5)  # not before the memory was back
    assert freed.unchecked is None
    assert freed.fields() == {
        "gpu_leftovers_killed": [str(h) for h in freed.killed],
        "gpu_leftovers": [
            {"pid": 4100, "name": "VLLM::EngineCor", "gpu": 0, "bytes": 30 * GiB},
            {"pid": 4101, "name": "VLLM::Worker_TP", "gpu": 1, "bytes": 30 * GiB},
        ],
        "gpu_free_seconds": 1.5,
    }
    assert world.reader.processes() == ((), None)
    assert all(r.memory_used_bytes == BASE for r in world.reader.read()[0][:2])


def test_a_process_on_two_gpus_is_killed_once_and_named_on_each(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0)})
    world.recording["devices"][1]["processes"] = [[4100, GiB]]
    freed = world.clear()
    assert world.killed == [4100]
    assert [(h.process.index, h.process.used_bytes) for h in freed.killed] == [
        (0, 30 * GiB),
        (1, GiB),
    ]


def test_anyone_elses_process_refuses_the_start_and_is_never_killed(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0), 777: ("python3", OTHER, 1)})
    with pytest.raises(GpusHeldByOthers) as refused:
        world.clear()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "the GPUs are held by processes that are not vllm.service's: "
        "PID 777 (python3) on GPU 1, 30.0 GiB; vkvagent kills no other process"
    )
    assert refused.value.pids == (777,)
    assert world.killed == []  # not even the unit's own: nothing is done before a refusal


def test_a_leftover_that_will_not_go_is_bounded(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0)})
    world.stuck.add(4100)
    with pytest.raises(GpusNotFreed, match=r"still hold the GPUs 5 s after SIGKILL: PID 4100"):
        world.clear(timeout=5.0)
    assert world.killed == [4100]  # once: a second SIGKILL changes nothing
    assert 5.0 <= world.now <= 5.5


def test_memory_that_never_comes_back_is_bounded_and_named(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0)})
    world.free_after = 10**6  # the process left NVML's list; its memory did not
    with pytest.raises(GpusNotFreed) as failed:
        world.clear(timeout=3.0)
    assert "GPU 0 still uses 30.5 GiB, 30.5 GiB before the 30.0 GiB its leftovers held" in str(
        failed.value
    )
    assert 3.0 <= world.now <= 3.5


def test_a_leftover_vkvagent_may_not_kill_says_what_it_needs(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0)})

    def refused(pid: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    with pytest.raises(GpusNotFreed, match=r"may not kill PID 4100 .*needs CAP_KILL"):
        world.clear(kill=refused)


def test_a_pid_reused_by_someone_else_before_the_kill_is_not_killed(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0)})
    # The leftover exits right after NVML listed it, and its PID goes to another user's job.
    world.after_list = lambda: world.write(4100, "python3", OTHER)
    with pytest.raises(GpusHeldByOthers, match=r"PID 4100 \(python3\)"):
        world.clear()
    assert world.killed == []


def test_free_gpus_and_no_nvml_need_nothing_and_say_so(tmp_path: Path) -> None:
    assert World(tmp_path, {}).clear() == GpuFree()

    def absent() -> RecordedBackend:
        raise NvmlUnavailable("libnvidia-ml.so.1 not found")

    freed = clear_gpus(GpuReader(open=absent), UNIT, timeout=1.0, proc=tmp_path)
    assert freed.killed == ()
    assert freed.unchecked == "NVML unavailable: libnvidia-ml.so.1 not found"
    assert freed.fields() == {"gpu_unchecked": freed.unchecked}


def test_a_recording_from_before_process_lists_is_read_and_checks_nothing(
    tmp_path: Path,
) -> None:
    old = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())
    for device in old["devices"]:
        del device["processes"]
    reader = GpuReader(open=lambda: RecordedBackend(old))
    freed = clear_gpus(reader, UNIT, timeout=1.0, proc=tmp_path)
    assert freed.unchecked is not None and "not recorded" in freed.unchecked
    assert reader.read()[1] is None  # every other value reads as before


def test_a_process_gone_since_nvml_listed_it_is_left_out(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("VLLM::EngineCor", V2, 0)})
    listed, _ = world.reader.processes()
    for entry in (world.proc / "4100").iterdir():  # exited between NVML's list and /proc
        entry.unlink()
    assert holders(listed, UNIT, world.proc) == []


def test_a_process_proc_does_not_show_is_given_a_moment_then_refused(tmp_path: Path) -> None:
    world = World(tmp_path, {})
    world.recording["devices"][0]["processes"] = [[9999, 2 * GiB]]
    with pytest.raises(GpusHeldByOthers) as refused:
        world.clear(timeout=60.0)
    assert "PID 9999 (not in /proc) on GPU 0, 2.0 GiB" in str(refused.value)
    assert refused.value.pids == (9999,)
    assert UNSEEN_GRACE <= world.now < UNSEEN_GRACE + 1  # not the whole timeout
    world.now = 0.0
    world.after_list = lambda: world.recording["devices"][0].update(processes=[])
    assert world.clear(timeout=60.0).killed == ()  # the driver caught up: free


@pytest.mark.parametrize(
    ("cgroup_text", "expected", "ours"),
    [
        (V2, "", True),
        (V1, "", True),
        ("0::/system.slice/vllm.service/libpod-payload-4c1d\n", "", True),  # podman, quadlet
        ("0::/gpu.slice/gpu-a.slice/vllm.service\n", "", True),  # Slice=gpu-a.slice
        ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service\n", "", False),
        ("0::/machine.slice/machine-c1.scope/payload/system.slice/vllm.service\n", "", False),
        ("0::/system.slice/vllm.service-watch.service\n", "", False),
        ("0::/system.slice/docker-4c1d.scope\n", "", False),
        ("0::/gpu.slice/vllm.service\n", "/system.slice/vllm.service", False),
        ("0::/gpu.slice/vllm.service\n", "/gpu.slice/vllm.service", True),
        ("0::/\n", "", False),
        ("garbage without colons\n", "", False),
    ],
)  # fmt: skip
def test_which_processes_are_the_units(
    tmp_path: Path, cgroup_text: str, expected: str, ours: bool
) -> None:
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "cgroup").write_text(cgroup_text)
    (tmp_path / "5" / "comm").write_text("VLLM::Worker_TP\n")
    found = holders([GpuProcess(0, 5, None)], UNIT, tmp_path, cgroup=expected)
    assert [(h.name, h.ours) for h in found] == [("VLLM::Worker_TP", ours)]


def test_a_container_outside_the_units_cgroup_is_the_units_when_named(tmp_path: Path) -> None:
    world = World(tmp_path, {4100: ("python3", "0::/system.slice/docker-4c1d.scope\n", 0)})
    freed = world.clear(owned=["/system.slice/docker-4c1d.scope"])
    assert world.killed == [4100] and len(freed.killed) == 1


@pytest.mark.parametrize(
    ("slice_name", "path"),
    [
        ("system.slice", "/system.slice/vllm.service"),
        ("gpu-a.slice", "/gpu.slice/gpu-a.slice/vllm.service"),
        ("-.slice", "/vllm.service"),
    ],
)
def test_the_units_cgroup_from_its_slice(slice_name: str, path: str) -> None:
    assert unit_cgroup(UNIT, slice_name) == path


def test_the_sigkill_reaches_a_real_process_of_the_unit(tmp_path: Path) -> None:
    """The default kill (a pidfd where the kernel has them), on a real child that a written
    /proc entry places in the unit: NVML's recorded list follows the child's life."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(15, 1); time.sleep(60)"]
    )
    proc = tmp_path / "proc"
    (proc / str(child.pid)).mkdir(parents=True)
    (proc / str(child.pid) / "cgroup").write_text(V2)
    (proc / str(child.pid) / "comm").write_text("VLLM::EngineCor\n")
    recording = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())

    class Backend(RecordedBackend):
        def query(self, index: int, what: str) -> Any:
            if what == "processes":
                return [[child.pid, None]] if index == 0 and child.poll() is None else []
            return super().query(index, what)

    try:
        freed = clear_gpus(
            GpuReader(open=lambda: Backend(recording)), UNIT, timeout=10.0, proc=proc
        )
        assert child.wait(5) == -signal.SIGKILL
        assert [str(h) for h in freed.killed] == [f"PID {child.pid} (VLLM::EngineCor) on GPU 0"]
    finally:
        child.kill()
        child.wait()


def test_the_actuator_frees_the_gpus_before_it_starts_a_unit_that_is_down(
    tmp_path: Path,
) -> None:
    world = World(tmp_path, {777: ("python3", OTHER, 0)})
    acting = actuator(tmp_path, world.recording, world.reader)
    acting.proc = world.proc
    down = UnitState(
        UNIT, "loaded", "failed", "failed", "exit-code", 0, "ab" * 16, 0, 0, None, (),
        "/etc/systemd/system/vllm.service", (), 5, 10_000_000,
    )  # fmt: skip
    with pytest.raises(ActuatorError, match=r"not vllm.service's: PID 777"):
        acting._free_gpus(down)
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
        ("(EngineCore_DP0 pid=4100) ValueError: Free memory on device cuda:0 (1.2/139.8 GiB) "
         "on startup is less than desired GPU memory utilization (0.9, 125.8 GiB). Decrease "
         "GPU memory utilization or reduce GPU memory used by other processes.", True),
        ("ValueError: Available memory on node 0 (5.85/9.71 GiB) on startup is less than "
         "desired GPU memory utilization (0.4, 3.88 GiB).", True),
        ("ValueError: No available memory for the cache blocks. Try increasing "
         "`gpu_memory_utilization` when initializing the engine.", True),
        ("ValueError: User-specified max_model_len (100000) is greater than ...", False),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
        (None, False),
    ],
)  # fmt: skip
def test_vllms_words_for_gpu_memory_it_cannot_get(line: str | None, meant: bool) -> None:
    assert is_gpu_memory_failure(line) is meant


# -- a real GPU ------------------------------------------------------------------------------

_HOLD = """
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30)) == 0
print("holding", flush=True)
time.sleep(120)
"""


def _nvml() -> NvmlBackend | None:
    """NVML, or None where this machine has no NVIDIA device; a GPU machine whose NVML does not
    load fails the test rather than skipping it."""
    try:
        backend = NvmlBackend()
    except NvmlUnavailable as exc:
        if list(Path("/dev").glob("nvidia[0-9]*")):
            pytest.fail(f"an NVIDIA device is present but NVML does not load: {exc}")
        return None
    if backend.device_count() == 0:
        backend.close()
        return None
    return backend


@pytest.mark.gpu
def test_a_real_gpus_holder_is_listed_refused_or_killed_and_its_memory_comes_back() -> None:
    """On a machine with an NVIDIA GPU: a child holding 1 GiB of GPU 0 is listed by NVML with
    its memory; as someone else's it refuses the start and lives; as the unit's (its own
    cgroup named as the unit's) it is SIGKILLed and its memory comes back."""
    backend = _nvml()
    if backend is None:
        pytest.skip("no NVIDIA device on this machine")
    reader = GpuReader(devices=(0,), open=lambda: backend)
    child = subprocess.Popen([sys.executable, "-c", _HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "holding\n"
        deadline = time.monotonic() + 30
        mine: list[GpuProcess] = []
        while not mine and time.monotonic() < deadline:
            listed, problem = reader.processes()
            assert problem is None
            mine = [p for p in listed if p.pid == child.pid]
            time.sleep(0.2)
        assert mine, f"NVML does not list PID {child.pid} holding GPU 0: {listed}"
        assert mine[0].used_bytes is None or mine[0].used_bytes >= 2**30
        own = next(  # the child's cgroup: v2's line, or v1's name=systemd one
            line.split(":", 2)[2]
            for line in Path(f"/proc/{child.pid}/cgroup").read_text().splitlines()
            if line.split(":", 2)[1] in ("", "name=systemd")
        )

        def only_the_child(pid: int) -> None:
            assert pid == child.pid, f"PID {pid} shares the test's cgroup and holds a GPU"
            child.send_signal(signal.SIGKILL)

        with pytest.raises(GpusHeldByOthers) as refused:
            clear_gpus(reader, UNIT, timeout=30.0, cgroup="/system.slice/nothing.service")
        assert child.pid in refused.value.pids and child.poll() is None

        freed = clear_gpus(reader, UNIT, timeout=30.0, cgroup=own, kill=only_the_child)
        assert [h.process.pid for h in freed.killed] == [child.pid]
        assert child.wait(10) == -signal.SIGKILL
        assert child.pid not in [p.pid for p in reader.processes()[0]]
    finally:
        child.kill()
        child.wait()
        reader.reset()


def test_gpus_busy_is_the_one_error_the_actuator_catches() -> None:
    assert issubclass(GpusHeldByOthers, GpusBusy) and issubclass(GpusNotFreed, GpusBusy)
