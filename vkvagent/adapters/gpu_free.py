"""The GPUs free before vLLM starts: no process of the run before still holds them.

When vLLM's API server dies hard, its ``VLLM::EngineCore`` and ``Worker_TP*`` processes can
survive it and keep their GPU memory (vllm#55510, #57650). The next start then fails with
"Free memory on device ... is less than desired GPU memory utilization", and a supervisor
loops on it. Before vkvagent starts a unit that is down, ``clear_gpus`` lists the processes
NVML sees on the watched GPUs:

- a process in the unit's cgroup (``/proc/PID/cgroup``; a container the unit runs with
  podman or quadlet is below it) is a leftover of the run before: it is SIGKILLed and named.
  Not SIGTERM: the run it served is gone, there is nothing left to drain, and an engine or
  worker that outlived its API server is often blocked in NCCL or the driver, where SIGTERM
  waits for nothing; systemd's own stop ends with SIGKILL for the same processes;
- a process of anyone else is not vkvagent's to kill: the start is refused, naming the PIDs;
- then the leftovers must be gone from NVML's list and their memory back (NVML's used memory
  down by what they held), polled, within ``timeout``.

Which cgroup is the unit's: once a unit is stopped systemd may report its ControlGroup as
"", so the caller passes the one it knows (ControlGroup while set, else ``unit_cgroup(unit,
Slice)``); without one, the unit's name directly under system slices (``/system.slice/
vllm.service``, ``/gpu.slice/vllm.service``), never a user's own unit of that name
(``/user.slice/.../user@1000.service/...``) nor a container's (``/machine.slice/...``).

Call it only while the unit is down: every process of its cgroup is then a leftover.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vkvagent.adapters.cgroup import below, systemd_paths
from vkvagent.adapters.gpu import GpuProcess, GpuReader
from vkvagent.errors import VkvagentError

POLL = 0.5  # seconds between two looks at NVML while the memory comes back
# A process NVML lists that /proc does not have (it exited and the driver lags, or it lives in
# a PID namespace vkvagent cannot see) is given this long to leave the list.
UNSEEN_GRACE = 5.0
# The memory is back when NVML's used memory fell by this share of what the leftovers held
# (per-process figures and the device's total are counted a little differently).
MEMORY_BACK = 0.9
_MAX_CGROUP_BYTES = 64 * 1024  # a /proc/PID/cgroup is one line on v2, about 15 on v1


class GpusBusy(VkvagentError):
    """The GPUs are not free for a start: held by processes vkvagent may not kill, or still
    held ``timeout`` seconds after the unit's leftovers were killed."""


class GpusHeldByOthers(GpusBusy):
    """Processes that are not the unit's hold the GPUs; ``pids`` names them."""

    def __init__(self, message: str, pids: Sequence[int]) -> None:
        super().__init__(message)
        self.pids = tuple(pids)


class GpusNotFreed(GpusBusy):
    """The unit's leftovers (or their memory) did not go within the timeout, or could not be
    killed."""


@dataclass(frozen=True)
class Holder:
    """A process on a GPU, with its name (``/proc/PID/comm``) and whether it is the unit's."""

    process: GpuProcess
    name: str
    ours: bool

    def __str__(self) -> str:
        used = self.process.used_bytes
        memory = f", {used / 2**30:.1f} GiB" if used is not None else ""
        return f"PID {self.process.pid} ({self.name}) on GPU {self.process.index}{memory}"

    def to_json(self) -> dict[str, Any]:
        """For an event's fields: ``bytes`` is None where the driver does not say."""
        p = self.process
        return {"pid": p.pid, "name": self.name, "gpu": p.index, "bytes": p.used_bytes}


@dataclass(frozen=True)
class GpuFree:
    """What ``clear_gpus`` found and did before a start."""

    killed: tuple[Holder, ...] = ()  # the unit's leftovers, SIGKILLed (or gone by themselves)
    seconds: float = 0.0  # from the first look until they and their memory were gone
    unchecked: str | None = None  # why nothing could be checked (no NVML, no process list)

    def fields(self) -> dict[str, Any]:
        """An event's fields: ``gpu_leftovers_killed`` (one text per process), ``gpu_leftovers``
        (pid, name, gpu, bytes each), ``gpu_free_seconds``; or ``gpu_unchecked``."""
        if self.unchecked is not None:
            return {"gpu_unchecked": self.unchecked}
        if not self.killed:
            return {}
        return {
            "gpu_leftovers_killed": [str(h) for h in self.killed],
            "gpu_leftovers": [h.to_json() for h in self.killed],
            "gpu_free_seconds": round(self.seconds, 1),
        }


def unit_cgroup(unit: str, slice: str = "system.slice") -> str:
    """The cgroup systemd gives ``unit`` in ``slice`` (its Slice property): slices nest by
    their dashes, ``gpu-a.slice`` under ``gpu.slice``; ``-.slice`` is the root."""
    path = ""
    if slice and slice != "-.slice":
        words = slice.removesuffix(".slice").split("-")
        path = "".join("/" + "-".join(words[: i + 1]) + ".slice" for i in range(len(words)))
    return f"{path}/{unit}"


def holders(
    processes: Sequence[GpuProcess],
    unit: str,
    proc: Path = Path("/proc"),
    *,
    cgroup: str = "",
    owned: Sequence[str] = (),
) -> list[Holder]:
    """Who holds the GPUs: each process with its name and whether it is the unit's (in
    ``cgroup``, or one of ``owned``, or below; see the module's text without ``cgroup``). A
    process /proc does not show (gone since NVML listed it) is left out."""
    found, _unseen = _sorted(processes, unit, proc, cgroup, owned)
    return found


def clear_gpus(
    reader: GpuReader,
    unit: str,
    *,
    timeout: float,
    cgroup: str = "",
    owned: Sequence[str] = (),
    proc: Path = Path("/proc"),
    kill: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> GpuFree:
    """Make the watched GPUs free for a start of ``unit``, which must be down: its leftovers
    killed, and gone with their memory within ``timeout`` seconds.

    ``cgroup``: the unit's (see the module's text); ``owned``: other cgroups whose processes
    are the unit's too (a container it runs that lives outside its cgroup, e.g. Docker's
    ``/system.slice/docker-ID.scope``). ``kill(pid)`` replaces the SIGKILL (tests); each PID
    is checked to be the unit's again just before it is signalled.

    Raises ``GpusHeldByOthers`` (one line naming the PIDs; none is signalled) when anyone
    else's process holds the GPUs, and ``GpusNotFreed`` when the leftovers or their memory
    are still there after ``timeout``, or vkvagent may not kill them. Without NVML, or a
    driver that lists no processes, nothing is checked: ``unchecked`` says why."""
    started = clock()
    listed, problem = reader.processes()
    if problem is not None:
        return GpuFree(unchecked=problem)
    found, unseen = _sorted(listed, unit, proc, cgroup, owned)
    _refuse_others(found, unit)
    if not found and not unseen:
        return GpuFree(seconds=clock() - started)
    before = _memory_used(reader)
    killed: dict[tuple[int, int], Holder] = {}  # by PID and GPU: a process can hold several
    signalled: set[int] = set()
    while True:
        for holder in found:  # ours alone by now; one of the unit's listed later is a leftover
            if holder.process.pid not in signalled:
                _kill(holder, unit, proc, cgroup, owned, kill)
                signalled.add(holder.process.pid)
            killed.setdefault((holder.process.pid, holder.process.index), holder)
        short = _memory_short(reader, before, list(killed.values()))
        waited = clock() - started
        if not found and not unseen and not short:
            return GpuFree(tuple(killed.values()), waited)
        if unseen and not found and waited >= min(timeout, UNSEEN_GRACE):
            raise GpusHeldByOthers(
                f"the GPUs are held by processes /proc does not show (another PID namespace?): "
                f"{'; '.join(_unseen_text(p) for p in unseen)}; vkvagent kills no process it "
                f"cannot tell is {unit}'s: free the GPUs, then vLLM can start",
                [p.pid for p in unseen],
            )
        if waited >= timeout:
            left = "; ".join([str(h) for h in found] + [_unseen_text(p) for p in unseen])
            raise GpusNotFreed(
                f"{unit}'s processes of the run before still hold the GPUs {timeout:g} s after "
                f"SIGKILL: {left or short} (a process stuck in the driver needs a GPU reset or "
                "a person)"
            )
        sleep(POLL)
        listed, problem = reader.processes()
        if problem is not None:
            raise GpusNotFreed(f"cannot tell whether the GPUs are free for {unit}: {problem}")
        found, unseen = _sorted(listed, unit, proc, cgroup, owned)
        _refuse_others(found, unit)


# vLLM's words when the GPU memory it wants is taken (vllm/v1/worker: "Free memory on device
# (X/Y GiB) on startup is less than desired GPU memory utilization (U, Z GiB)", "cuda:0"
# after "device" in later releases; the CPU build says "Available memory on node"; V0 said
# "No available memory for the cache blocks" when others held what it profiled as free).
_NO_MEMORY = ("less than desired GPU memory utilization", "No available memory for the cache")


def is_gpu_memory_failure(line: str | None) -> bool:
    """Whether vLLM's error line says the GPU memory it wants is taken: a start that fails
    for that while other processes hold the GPU is not its flags' fault."""
    return line is not None and any(words in line for words in _NO_MEMORY)


# -- helpers ---------------------------------------------------------------------------------


def _sorted(
    processes: Sequence[GpuProcess], unit: str, proc: Path, cgroup: str, owned: Sequence[str]
) -> tuple[list[Holder], list[GpuProcess]]:
    """The listed processes /proc shows, each as a Holder, and those it does not show."""
    found, unseen = [], []
    for process in processes:
        read = _cgroups_and_name(proc, process.pid)
        if read is None:
            unseen.append(process)
            continue
        cgroups, name = read
        found.append(Holder(process, name, _in_unit(cgroups, unit, cgroup, owned)))
    return found, unseen


def _cgroups_and_name(proc: Path, pid: int) -> tuple[str, str] | None:
    try:
        with open(proc / str(pid) / "cgroup", "rb") as handle:
            cgroups = handle.read(_MAX_CGROUP_BYTES).decode("utf-8", "replace")
    except OSError:
        return None  # gone, or not in this PID namespace
    try:
        name = (proc / str(pid) / "comm").read_text("utf-8", "replace").strip()
    except OSError:
        name = "?"
    return cgroups, name or "?"


def _in_unit(cgroups: str, unit: str, cgroup: str, owned: Sequence[str]) -> bool:
    """Whether a /proc/PID/cgroup text puts the process in the unit's cgroup or below it: the
    cgroup v2 line (``0::/system.slice/vllm.service``) or v1's ``name=systemd`` one."""
    for path in systemd_paths(cgroups):
        if any(below(path, root) for root in (cgroup, *owned) if root):
            return True
        if not cgroup and _system_unit(path, unit):
            return True
    return False


def _system_unit(path: str, unit: str) -> bool:
    """``unit`` with nothing but slices above it: the system manager's unit of that name."""
    parts = path.strip("/").split("/")
    if unit not in parts:
        return False
    above = parts[: parts.index(unit)]
    return all(part.endswith(".slice") and part != "user.slice" for part in above)


def _refuse_others(found: Sequence[Holder], unit: str) -> None:
    others = [h for h in found if not h.ours]
    if others:
        raise GpusHeldByOthers(
            f"the GPUs are held by processes that are not {unit}'s: "
            f"{'; '.join(str(h) for h in others)}; vkvagent kills no other process: free "
            "the GPUs, then vLLM can start",
            [h.process.pid for h in others],
        )


def _kill(
    holder: Holder,
    unit: str,
    proc: Path,
    cgroup: str,
    owned: Sequence[str],
    kill: Callable[[int], None] | None,
) -> None:
    """SIGKILL a leftover if it is still the unit's: with a pidfd, the PID checked is the
    process signalled even if it exits and its number is reused meanwhile."""
    pid = holder.process.pid

    def still_ours() -> bool:
        read = _cgroups_and_name(proc, pid)
        return read is not None and _in_unit(read[0], unit, cgroup, owned)

    try:
        if kill is not None:
            if still_ours():
                kill(pid)
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # gone by itself
        except (AttributeError, OSError):  # Python or kernel without pidfds (before 5.3)
            if still_ours():
                os.kill(pid, signal.SIGKILL)
            return
        try:
            if still_ours():
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)
    except ProcessLookupError:
        pass  # gone by itself
    except PermissionError:
        raise GpusNotFreed(
            f"vkvagent may not kill {holder}, {unit}'s leftover of the run before: it needs "
            "CAP_KILL for a process of another user (the vkvagent unit's "
            "CapabilityBoundingSet=)"
        ) from None


def _memory_used(reader: GpuReader) -> dict[int, int]:
    readings, _problem = reader.read(consume_xids=False)  # the sampler's XIDs stay its own
    return {r.index: r.memory_used_bytes for r in readings if r.memory_used_bytes is not None}


def _memory_short(reader: GpuReader, before: dict[int, int], killed: list[Holder]) -> str:
    """Where NVML's used memory has not fallen by what the killed leftovers held ("" when
    it has everywhere, or nothing can be told: unknown sizes, no memory figures)."""
    held: dict[int, int] = {}
    for holder in killed:
        if holder.process.used_bytes is not None:
            held[holder.process.index] = held.get(holder.process.index, 0) + (
                holder.process.used_bytes
            )
    held = {gpu: size for gpu, size in held.items() if gpu in before and size > 0}
    if not held:
        return ""
    now = _memory_used(reader)
    short = [
        f"GPU {gpu} still uses {now[gpu] / 2**30:.1f} GiB, {before[gpu] / 2**30:.1f} GiB "
        f"before the {size / 2**30:.1f} GiB its leftovers held were freed"
        for gpu, size in sorted(held.items())
        if gpu in now and now[gpu] > before[gpu] - MEMORY_BACK * size
    ]
    return "; ".join(short)


def _unseen_text(process: GpuProcess) -> str:
    used = process.used_bytes
    memory = f", {used / 2**30:.1f} GiB" if used is not None else ""
    return f"PID {process.pid} (not in /proc) on GPU {process.index}{memory}"
