"""One observation of the server: vLLM's metrics and the GPUs at one moment."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

from vkvagent.gpu import GpuReader, GpuReading
from vkvagent.metrics import VllmMetrics
from vkvagent.systemd import SystemdError, UnitState
from vkvagent.vllm import PageError, ScrapeError, VllmClient


@dataclass(frozen=True)
class UnitFacts:
    """The vLLM unit as systemd saw it with the sample: its state, its invocation (new at
    every start, however it was started) and the memory of its whole cgroup."""

    active_state: str
    sub_state: str
    invocation_id: str
    main_pid: int
    memory_bytes: int | None  # MemoryCurrent; None when not accounted
    n_restarts: int  # automatic restarts by Restart=

    @classmethod
    def of(cls, state: UnitState) -> UnitFacts:
        return cls(
            state.active_state,
            state.sub_state,
            state.invocation_id,
            state.main_pid,
            state.memory_current,
            state.n_restarts,
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
        metrics, error = None, None
        self.page_recognised = None
        try:
            metrics = self.vllm.scrape(self._version)
            if self._version is None:
                self._version = self.vllm.version() or self._configured_version
                metrics = dataclasses.replace(metrics, version=self._version)
        except ScrapeError as exc:
            error = str(exc)
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
        return Sample(at, mono, metrics, error, readings, gpu_error, facts, unit_error)
