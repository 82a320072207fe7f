"""One observation of the server: vLLM's metrics and the GPUs at one moment."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vkvagent.cgroup import CGROUP_ROOT, read_anon
from vkvagent.gpu import GpuReader, GpuReading
from vkvagent.metrics import VllmMetrics
from vkvagent.systemd import SystemdError, UnitState
from vkvagent.vllm import PageError, ScrapeError, VllmClient


@dataclass(frozen=True)
class UnitFacts:
    """The vLLM unit as systemd saw it with the sample: its state, its invocation (new at
    every start, however it was started) and the memory of its whole cgroup: all of it
    (MemoryCurrent) and its anonymous part (memory.stat's ``anon``), which is what a leak
    grows and page cache is not."""

    active_state: str
    sub_state: str
    invocation_id: str
    main_pid: int
    memory_bytes: int | None  # MemoryCurrent; None when not accounted
    n_restarts: int  # automatic restarts by Restart=
    # memory.stat's anon; None when unreadable (cgroup v1), and by default: a sample stored
    # before it was recorded has none.
    memory_anon_bytes: int | None = None
    active_since: float | None = None  # UTC when the unit last became active

    @property
    def growth_bytes(self) -> int | None:
        """The memory whose growth is judged: anon when known, else MemoryCurrent."""
        return self.memory_bytes if self.memory_anon_bytes is None else self.memory_anon_bytes

    @property
    def growth_source(self) -> str:
        """Which memory ``growth_bytes`` is: "anon" or "MemoryCurrent"."""
        return "MemoryCurrent" if self.memory_anon_bytes is None else "anon"

    @classmethod
    def of(cls, state: UnitState, cgroup_root: str | Path = CGROUP_ROOT) -> UnitFacts:
        """The facts of ``state``, with the anon memory read from the unit's cgroup under
        ``cgroup_root`` (a file read, no D-Bus)."""
        return cls(
            state.active_state,
            state.sub_state,
            state.invocation_id,
            state.main_pid,
            state.memory_current,
            state.n_restarts,
            read_anon(state.control_group, cgroup_root),
            state.active_enter_timestamp / 1e6 if state.active_enter_timestamp else None,
        )


@dataclass(frozen=True)
class Sample:
    """What the agent saw at ``time``. A source that failed leaves its value None and says why
    in its ``*_error`` field; the sample is still recorded, marked invalid, never dropped."""

    time: float  # UTC, Unix seconds: when it was taken, for people and retention
    mono: float  # monotonic seconds at the same moment: the only clock rates are computed on
    vllm: VllmMetrics | None
    vllm_error: str | None = None
    gpus: tuple[GpuReading, ...] = ()
    gpu_error: str | None = None
    unit: UnitFacts | None = None
    unit_error: str | None = None
    # vLLM accepted the connection and did not answer in time (hung), rather than refused it
    vllm_silent: bool = False

    @property
    def valid(self) -> bool:
        return self.vllm is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "valid": self.valid,
            "vllm": self.vllm.to_json() if self.vllm else None,
            "vllm_error": self.vllm_error,
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "gpu_error": self.gpu_error,
            "unit": None if self.unit is None else dataclasses.asdict(self.unit),
            "unit_error": self.unit_error,
            "vllm_silent": self.vllm_silent,
        }


class Sampler:
    """Takes Samples from the sources. Never raises for a source that fails: its error goes
    into the sample, which is then kept as invalid.

    vLLM's version (GET /version, else the configured one) is asked once per vLLM process:
    again only after a failed scrape or a new ``process_start_time``, since only a restart can
    change it. It is asked after /metrics answered, so against a hung vLLM a sample waits
    out one request's timeouts, not two."""

    def __init__(
        self,
        vllm: VllmClient,
        gpus: GpuReader | None = None,
        *,
        unit: Callable[[], UnitState] | None = None,
        version: str = "",
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.vllm, self.gpus, self.unit = vllm, gpus, unit
        self._configured_version = version or None
        self._version: str | None = None
        self._started: float | None = None
        self._wall, self._mono = wall, mono
        self.page_recognised: bool | None = None  # the last page's; None: vLLM did not answer

    def take(self) -> Sample:
        at, mono = self._wall(), self._mono()
        metrics, error, silent = None, None, False
        self.page_recognised = None
        try:
            metrics = self.vllm.scrape(self._version)
            if self._version is None:
                self._version = self.vllm.version() or self._configured_version
                metrics = dataclasses.replace(metrics, version=self._version)
        except ScrapeError as exc:
            error, silent = str(exc), exc.silent
            self._version = None
            if isinstance(exc, PageError):
                self.page_recognised = False
        else:
            self.page_recognised = True
        if metrics is not None and metrics.process_start_time != self._started:
            if self._started is not None:
                self._version = None  # a new vLLM process: ask its version next time
            self._started = metrics.process_start_time
        readings, gpu_error = self.gpus.read() if self.gpus is not None else ((), None)
        facts, unit_error = None, None
        if self.unit is not None:
            try:
                facts = UnitFacts.of(self.unit())
            except SystemdError as exc:
                unit_error = str(exc)
        return Sample(at, mono, metrics, error, readings, gpu_error, facts, unit_error, silent)
