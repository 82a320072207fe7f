"""Taking one observation of the server: vLLM's metrics, the GPUs and the unit at one moment."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from vkvagent.apikey import ApiKey
from vkvagent.cgroup import CGROUP_ROOT, read_anon
from vkvagent.engine.samples import Sample, UnitFacts
from vkvagent.gpu import GpuReader
from vkvagent.systemd import SystemdError, UnitState
from vkvagent.vllm import PageError, ScrapeError, VllmClient


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
        self.unit_key: ApiKey | None = None  # vLLM's API key, as the unit last gave it

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
                state = self.unit()
                facts, self.unit_key = unit_facts(state), state.api_key
            except SystemdError as exc:
                unit_error = str(exc)
        return Sample(at, mono, metrics, error, readings, gpu_error, facts, unit_error, silent)


def unit_facts(state: UnitState, cgroup_root: str | Path = CGROUP_ROOT) -> UnitFacts:
    """The facts of ``state``, with the anon memory read from the unit's cgroup under
    ``cgroup_root`` (a file read, no D-Bus)."""
    return UnitFacts(
        state.active_state,
        state.sub_state,
        state.invocation_id,
        state.main_pid,
        state.memory_current,
        state.n_restarts,
        read_anon(state.control_group, cgroup_root),
        state.active_enter_timestamp / 1e6 if state.active_enter_timestamp else None,
        state.memory_max,
        state.restart_policy,
        state.wanted,
        state.exit_text,
    )
