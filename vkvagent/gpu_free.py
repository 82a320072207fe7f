"""The GPUs free before vLLM starts: no process of the run before still holds them.

When vLLM's API server dies hard, its ``VLLM::EngineCore`` and ``Worker_TP*`` processes can
survive it and keep their GPU memory (vllm#55510, #57650). The next start then fails with
"Free memory on device ... is less than desired GPU memory utilization", and a supervisor
loops on it. Before vkvagent starts vLLM, it lists the processes NVML sees on the GPUs:

- a process of the unit (its cgroup, read from ``/proc/PID/cgroup``, names the unit) is a
  leftover of the run before: it is killed (SIGKILL: the run it served is gone, and its
  memory must come back now), and named;
- any other process is not vkvagent's to kill: the start is refused, naming the PIDs;
- then the memory must come back, polled through NVML, within ``timeout``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vkvagent.errors import VkvagentError
from vkvagent.gpu import GpuProcess, GpuReader

POLL = 0.5  # seconds between two looks at NVML while the memory comes back


class GpusBusy(VkvagentError):
    """The GPUs are held by processes vkvagent may not kill, or still after ``timeout``."""


@dataclass(frozen=True)
class Holder:
    """A process on a GPU, with its name and whether it is the unit's."""

    process: GpuProcess
    name: str
    ours: bool

    def __str__(self) -> str:
        used = self.process.used_bytes
        memory = f", {used / 2**30:.1f} GiB" if used is not None else ""
        return f"PID {self.process.pid} ({self.name}) on GPU {self.process.index}{memory}"


def holders(processes: Sequence[GpuProcess], unit: str, proc: Path = Path("/proc")) -> list[Holder]:
    """Who holds the GPUs: each process with its name and whether the unit's cgroup has it.
    A process gone since NVML listed it is left out."""
    found = []
    for process in processes:
        try:
            cgroups = (proc / str(process.pid) / "cgroup").read_text()
            name = (proc / str(process.pid) / "comm").read_text().strip()
        except OSError:
            continue
        found.append(Holder(process, name, _in_unit(cgroups, unit)))
    return found


def _in_unit(cgroups: str, unit: str) -> bool:
    """Whether a /proc/PID/cgroup text puts the process in ``unit``'s cgroup (or below it):
    the cgroup v2 line (``0::/system.slice/vllm.service``) or v1's ``name=systemd`` one."""
    for line in cgroups.splitlines():
        _id, controllers, path = line.split(":", 2)
        if controllers in ("", "name=systemd") and unit in path.split("/"):
            return True
    return False


def free_gpus(
    reader: GpuReader,
    unit: str,
    *,
    timeout: float,
    proc: Path = Path("/proc"),
    kill: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGKILL),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Holder]:
    """Make sure no process holds the GPUs before ``unit`` starts vLLM; the unit's leftovers
    it killed. Raises GpusBusy when another's process holds them, or when they are still
    held ``timeout`` seconds after the kill. Nothing to check without NVML: returns []."""
    listed, _problem = reader.processes()
    found = holders(listed, unit, proc)
    others = [h for h in found if not h.ours]
    if others:
        raise GpusBusy(
            f"the GPUs are held by processes that are not {unit}'s: "
            f"{'; '.join(str(h) for h in others)}; vkvagent kills no other process: free "
            "the GPUs, then vLLM can start"
        )
    for holder in found:
        with contextlib.suppress(ProcessLookupError):  # gone by itself
            kill(holder.process.pid)
    deadline = clock() + timeout
    while found:
        listed, _problem = reader.processes()
        left = [h for h in holders(listed, unit, proc) if h.ours]
        if not left:
            break
        if clock() >= deadline:
            raise GpusBusy(
                f"{unit}'s processes of the run before still hold the GPUs {timeout:g} s "
                f"after SIGKILL: {'; '.join(str(h) for h in left)} (a process stuck in the "
                "driver needs a GPU reset or a person)"
            )
        sleep(POLL)
    return found


# vLLM's words when the GPU memory it wants is taken (vllm/v1/worker/gpu_worker.py; 0.32 and
# earlier wrote "Free memory on device (X/Y GiB) on startup is less than desired GPU memory
# utilization"; the CPU build says "Available memory on node").
_NO_MEMORY = ("less than desired GPU memory utilization", "No available memory for the cache")


def is_gpu_memory_failure(line: str | None) -> bool:
    """Whether vLLM's error line says the GPU memory it wants is taken: a start that fails
    for that while other processes hold the GPU is not its flags' fault."""
    return line is not None and any(words in line for words in _NO_MEMORY)
