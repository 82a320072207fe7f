"""GPU readings through NVML, behind a small backend so the logic runs without a GPU.

``NvmlBackend`` is the only code that calls pynvml (nvidia-ml-py). ``RecordedBackend`` replays
a recording of the same raw values (``vkvagent gpu --record FILE`` makes one on a GPU host), so
decoding, units and error handling are tested anywhere. No driver or no GPU is not an error for
the agent: ``GpuReader`` reports "unavailable" and everything else keeps working.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from vkvagent.engine.gpu_faults import is_fault
from vkvagent.engine.samples import GpuReading
from vkvagent.errors import VkvagentError

# nvmlClocksEventReason* bits from nvml.h (named ClocksThrottleReason* before driver 535).
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
# How long and how many drained XID events a reader keeps for ``GpuReader.faults``.
XID_FAULT_WINDOW = 3600.0
XID_LOG_SIZE = 256

# What the reader asks a backend for, per device. Units are NVML's own.
QUERIES = (
    "uuid",
    "name",
    "memory_used",
    "memory_total",
    "utilization_gpu",
    "temperature",
    "power_mw",
    "power_limit_mw",
    "sm_clock",
    "sm_clock_max",
    "clock_event_reasons",
    "ecc_uncorrected_volatile",
    # [[pid, GPU memory in bytes or None], ...]: the compute processes on it (CUDA contexts:
    # vLLM's API server, engine and workers). Graphics processes (a display server) are left
    # out: they hold a few hundred MiB that vLLM's utilisation share leaves room for.
    "processes",
)
# NVML_VALUE_NOT_AVAILABLE for a process's memory (MIG, some vGPUs), where pynvml does not
# already turn it into None.
_NOT_AVAILABLE = 2**64 - 1


@dataclass(frozen=True)
class GpuProcess:
    """A process holding a GPU, as NVML lists it."""

    index: int  # the GPU
    pid: int  # in NVML's (the host's) PID namespace
    used_bytes: int | None  # None: the driver does not say (MIG, some vGPUs)


class GpuError(VkvagentError):
    """NVML could not give a reading."""


class NvmlUnsupported(GpuError):
    """This device or driver does not report the value (e.g. ECC on a consumer GPU)."""


class NvmlUnavailable(GpuError):
    """NVML cannot be used at all: no library, no driver, no GPU, or no permission."""


def decode_clock_event_reasons(mask: int) -> tuple[str, ...]:
    """Names of the bits set in a clocks-event (throttle) reason mask; unknown bits by value."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    unknown = mask & ~sum(bit for bit, _name in CLOCK_EVENT_REASONS)
    if unknown:
        names.append(f"unknown_0x{unknown:x}")
    return tuple(names)


@dataclass(frozen=True)
class XidEvent:
    """One XID as the reader drained it from the backend."""

    index: int  # the GPU's index; -1 where NVML could not say which GPU
    xid: int
    seen_at: float  # the reader's monotonic clock when it was drained


class Backend(Protocol):
    def device_count(self) -> int: ...

    def query(self, index: int, what: str) -> Any:
        """One raw value (see QUERIES); raises NvmlUnsupported when not reported."""

    def xid_events(self) -> list[tuple[int, int]]:
        """(device index, XID) pairs that happened since the last call."""


class NvmlBackend:
    """The real thing: pynvml calls and nothing else."""

    def __init__(self) -> None:
        try:
            import pynvml  # noqa: PLC0415 - only hosts with a GPU need it loaded

            pynvml.nvmlInit()
        except Exception as exc:  # pynvml raises NVMLError subclasses, or ImportError/OSError
            raise NvmlUnavailable(_nvml_message(exc)) from None
        self._nvml = pynvml
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        try:
            self._open_xid_events()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass

    def device_count(self) -> int:
        return int(self._call(self._nvml.nvmlDeviceGetCount))

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call(self._nvml.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def query(self, index: int, what: str) -> Any:
        n, handle = self._nvml, self._handle(index)
        if what == "clock_event_reasons":
            read = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
            read = read or n.nvmlDeviceGetCurrentClocksThrottleReasons  # drivers before 535
            return int(self._call(read, handle))
        calls: dict[str, Callable[[], Any]] = {
            "uuid": lambda: _text(n.nvmlDeviceGetUUID(handle)),
            "name": lambda: _text(n.nvmlDeviceGetName(handle)),
            "memory_used": lambda: int(n.nvmlDeviceGetMemoryInfo(handle).used),
            "memory_total": lambda: int(n.nvmlDeviceGetMemoryInfo(handle).total),
            "utilization_gpu": lambda: n.nvmlDeviceGetUtilizationRates(handle).gpu,
            "temperature": lambda: n.nvmlDeviceGetTemperature(handle, n.NVML_TEMPERATURE_GPU),
            "power_mw": lambda: n.nvmlDeviceGetPowerUsage(handle),
            "power_limit_mw": lambda: n.nvmlDeviceGetEnforcedPowerLimit(handle),
            "sm_clock": lambda: n.nvmlDeviceGetClockInfo(handle, n.NVML_CLOCK_SM),
            "sm_clock_max": lambda: n.nvmlDeviceGetMaxClockInfo(handle, n.NVML_CLOCK_SM),
            "ecc_uncorrected_volatile": lambda: n.nvmlDeviceGetTotalEccErrors(
                handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
            ),
            "processes": lambda: [
                [int(p.pid), _process_memory(p.usedGpuMemory)]
                for p in n.nvmlDeviceGetComputeRunningProcesses(handle)
            ],
        }
        return self._call(calls[what])

    def xid_events(self) -> list[tuple[int, int]]:
        found: list[tuple[int, int]] = []
        if self._events is None:
            return found
        uuids = {self.query(i, "uuid"): i for i in self._handles}
        while True:
            try:
                event = self._nvml.nvmlEventSetWait_v2(self._events, 0)
            except self._nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing pending
                return found
            try:
                index = uuids.get(_text(self._nvml.nvmlDeviceGetUUID(event.device)), -1)
            except self._nvml.NVMLError:
                index = -1
            found.append((index, int(event.eventData)))

    def _open_xid_events(self) -> None:
        n = self._nvml
        try:
            self._events = n.nvmlEventSetCreate()
            for index in range(self.device_count()):
                n.nvmlDeviceRegisterEvents(
                    self._handle(index), n.nvmlEventTypeXidCriticalError, self._events
                )
        except (n.NVMLError, NvmlUnsupported):  # not every device or driver supports events
            self._events = None

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        n = self._nvml
        try:
            return function(*args)
        except n.NVMLError as exc:
            # Only "this device does not report that" leaves a gap in one value; anything else
            # (driver gone, GPU lost, no permission) means NVML cannot be trusted right now.
            if exc.value in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_NOT_FOUND):
                raise NvmlUnsupported(str(exc)) from None
            raise NvmlUnavailable(_nvml_message(exc)) from None


class RecordedBackend:
    """Replays ``record()`` output: ``{"devices": [{query: value | {"error": "..."}}],
    "xid_events": [[index, xid], ...]}``; XID events are delivered on the first read.
    A recording made before ``processes`` was recorded reads as a driver that does not
    list them (``GpuReader.processes`` says so); every other value reads as before."""

    def __init__(self, recording: dict[str, Any]) -> None:
        self._devices: list[dict[str, Any]] = recording["devices"]
        self._xids = [(int(i), int(x)) for i, x in recording.get("xid_events", [])]

    @classmethod
    def load(cls, path: str) -> RecordedBackend:
        with open(path, encoding="utf-8") as handle:
            return cls(json.load(handle))

    def device_count(self) -> int:
        return len(self._devices)

    def query(self, index: int, what: str) -> Any:
        value = self._devices[index].get(what, {"error": "not recorded"})
        if isinstance(value, dict):
            raise NvmlUnsupported(str(value.get("error")))
        return value

    def xid_events(self) -> list[tuple[int, int]]:
        found, self._xids = self._xids, []
        return found


class RecordingFile(RecordedBackend):
    """A recording that another process keeps current (the simulator): re-read whenever the
    file changes, each version's XID events delivered once."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: float | None = None
        super().__init__({"devices": []})

    def device_count(self) -> int:
        try:
            changed = os.stat(self.path).st_mtime_ns
            if changed != self._seen:
                with open(self.path, encoding="utf-8") as handle:
                    recording = json.load(handle)
                RecordedBackend.__init__(self, recording)
                self._seen = changed
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise NvmlUnavailable(f"GPU recording {self.path}: {exc}") from None
        return super().device_count()


def record(backend: Backend) -> dict[str, Any]:
    """Every raw value the reader uses, from every device, as JSON-ready data."""
    devices = []
    for index in range(backend.device_count()):
        values: dict[str, Any] = {}
        for what in QUERIES:
            try:
                values[what] = backend.query(index, what)
            except NvmlUnsupported as exc:
                values[what] = {"error": str(exc)}
        devices.append(values)
    return {"devices": devices, "xid_events": [list(e) for e in backend.xid_events()]}


class GpuReader:
    """Turns backend values into ``GpuReading``s.

    ``open`` is the backend factory (NvmlBackend by default). If it fails, the reason is kept
    and returned by every ``read()`` without retrying, until ``reset()``: a host without a
    driver costs nothing per sample and is reported once, not once per tick.

    The backend hands each XID event out once, so the reader keeps what it drained (the last
    ``keep`` events of the last ``fault_window`` seconds, by ``mono``): ``read()`` reports each
    XID once, to its one consumer (the sampler), and ``faults()`` tells anyone else (the
    actuator) about the recent fault-class ones without taking them from ``read()``."""

    def __init__(
        self,
        devices: Sequence[int] = (),
        open: Callable[[], Backend] = NvmlBackend,
        retry: bool = False,
        mono: Callable[[], float] = time.monotonic,
        fault_window: float = XID_FAULT_WINDOW,
        keep: int = XID_LOG_SIZE,
    ) -> None:
        self._wanted = tuple(devices)
        self._open = open
        self._retry = retry  # try again on every read (a recording file that may appear later)
        self._mono = mono
        self.fault_window = fault_window
        self._backend: Backend | None = None
        self.unavailable: str | None = None
        self._xid_log: deque[XidEvent] = deque(maxlen=keep)  # for faults()
        self._unread: deque[XidEvent] = deque(maxlen=keep)  # for the next consuming read()
        self._lock = threading.Lock()

    def reset(self) -> None:
        close = getattr(self._backend, "close", None)
        if close:
            close()
        self._backend, self.unavailable = None, None

    def read(self, consume_xids: bool = True) -> tuple[tuple[GpuReading, ...], str | None]:
        """The watched GPUs' readings, and why they are missing or partial (or None).

        Each reading's ``xid_errors`` are the XIDs drained since the previous consuming read,
        by this call or by ``faults()``; ``consume_xids=False`` reports them and leaves them
        for the next read (current values for someone who is not the sampler)."""
        with self._lock:
            if self.unavailable and not self._retry:
                return (), self.unavailable
            try:
                backend = self._opened()
                count = backend.device_count()
                self._drain(backend)
                xids: dict[int, list[int]] = {}
                for event in self._unread:
                    xids.setdefault(event.index, []).append(event.xid)
                indices = [i for i in (self._wanted or range(count)) if i < count]
                missing = [i for i in self._wanted if i >= count]
                readings = tuple(_reading(backend, i, tuple(xids.get(i, ()))) for i in indices)
            except NvmlUnavailable as exc:
                return (), self._lost(exc)
            except (NvmlUnsupported, ValueError, TypeError, AttributeError, KeyError) as exc:
                # A device that will not even say how many GPUs there are, or a recording with
                # values of the wrong type: no readings this time, and say why.
                return (), f"GPU readings failed: {type(exc).__name__}: {exc}"
            if consume_xids:
                self._unread.clear()
            problem = f"GPU index {missing} not present ({count} GPUs)" if missing else None
            return readings, problem

    def processes(self) -> tuple[tuple[GpuProcess, ...], str | None]:
        """The processes holding the watched GPUs, and why they cannot be listed (or None):
        NVML unavailable, or a driver that does not list them."""
        with self._lock:
            if self.unavailable and not self._retry:
                return (), self.unavailable
            try:
                backend = self._opened()
                count = backend.device_count()
                found = tuple(
                    GpuProcess(index, int(pid), None if used is None else int(used))
                    for index in (self._wanted or range(count))
                    if index < count
                    for pid, used in backend.query(index, "processes")
                )
            except NvmlUnavailable as exc:
                return (), self._lost(exc)
            except (NvmlUnsupported, ValueError, TypeError, KeyError) as exc:
                return (), f"GPU processes cannot be listed: {type(exc).__name__}: {exc}"
            return found, None

    def faults(self, within: float | None = None) -> list[XidEvent]:
        """The fault-class XIDs (``is_fault``) of the watched GPUs drained in the last
        ``within`` seconds (default and at most ``fault_window``), whoever drained them, oldest
        first; events NVML could not place on a GPU (index -1) count too. Drains the backend
        first, and consumes nothing: ``read()`` still reports each XID once."""
        with self._lock:
            if not self.unavailable or self._retry:
                try:
                    backend = self._opened()
                    backend.device_count()  # a recording file reloads here
                    self._drain(backend)
                except NvmlUnavailable as exc:
                    self._lost(exc)
                except (NvmlUnsupported, ValueError, TypeError, AttributeError, KeyError):
                    pass  # what was drained before still counts
            since = self._mono() - (self.fault_window if within is None else within)
            return [
                event
                for event in self._xid_log
                if event.seen_at >= since
                and is_fault(event.xid)
                and (event.index < 0 or not self._wanted or event.index in self._wanted)
            ]

    def _opened(self) -> Backend:
        if self._backend is None:
            self._backend = self._open()
        return self._backend

    def _lost(self, exc: NvmlUnavailable) -> str:
        self.reset()
        self.unavailable = f"NVML unavailable: {exc}"
        return self.unavailable

    def _drain(self, backend: Backend) -> None:
        now = self._mono()
        for index, xid in backend.xid_events():
            event = XidEvent(int(index), int(xid), now)
            self._xid_log.append(event)
            self._unread.append(event)
        while self._xid_log and self._xid_log[0].seen_at < now - self.fault_window:
            self._xid_log.popleft()


def reader_for(
    devices: Sequence[int], recording: str = "", fault_window: float = XID_FAULT_WINDOW
) -> GpuReader:
    """The reader the configuration asks for: NVML, or a recording file. ``fault_window``:
    how long a fault XID keeps the actuator from restarting ([diagnosis] fault_memory)."""
    if recording:
        return GpuReader(
            devices, open=lambda: RecordingFile(recording), retry=True, fault_window=fault_window
        )
    return GpuReader(devices, fault_window=fault_window)


def _reading(backend: Backend, index: int, xids: tuple[int, ...]) -> GpuReading:
    def get(what: str) -> Any:
        try:
            return backend.query(index, what)
        except NvmlUnsupported:
            return None

    def scaled(what: str, factor: float) -> float | None:
        value = get(what)
        return None if value is None else float(value) * factor

    mask = get("clock_event_reasons")
    return GpuReading(
        index=index,
        uuid=str(get("uuid") or ""),
        name=str(get("name") or ""),
        memory_used_bytes=get("memory_used"),
        memory_total_bytes=get("memory_total"),
        utilization_percent=scaled("utilization_gpu", 1.0),
        temperature_c=scaled("temperature", 1.0),
        power_w=scaled("power_mw", 1e-3),
        power_limit_w=scaled("power_limit_mw", 1e-3),
        sm_clock_mhz=scaled("sm_clock", 1.0),
        sm_clock_max_mhz=scaled("sm_clock_max", 1.0),
        clock_event_reasons=decode_clock_event_reasons(mask) if mask is not None else (),
        ecc_uncorrected_volatile=get("ecc_uncorrected_volatile"),
        xid_errors=xids,
    )


def _process_memory(used: Any) -> int | None:
    return None if used is None or int(used) >= _NOT_AVAILABLE else int(used)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
