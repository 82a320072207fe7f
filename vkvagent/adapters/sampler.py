"""Taking one observation of the server: vLLM's metrics, the GPUs and the unit at one moment."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from vkvagent import container
from vkvagent.adapters.cgroup import CGROUP_ROOT, below, read_anon, read_memory, systemd_paths
from vkvagent.adapters.gpu import GpuReader
from vkvagent.adapters.systemd import SystemdError, UnitState
from vkvagent.adapters.vllm import PageError, ScrapeError, VllmClient
from vkvagent.apikey import ApiKey
from vkvagent.engine.samples import Sample, UnitFacts


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
        self.memory_group = MemoryGroup()

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
                group = self.memory_group.of(state, mono)
                facts, self.unit_key = unit_facts(state, group=group), state.api_key
            except SystemdError as exc:
                unit_error = str(exc)
        return Sample(at, mono, metrics, error, readings, gpu_error, facts, unit_error, silent)


def unit_facts(
    state: UnitState, cgroup_root: str | Path = CGROUP_ROOT, group: str | None = ""
) -> UnitFacts:
    """The facts of ``state``, with the anon memory read from the unit's cgroup under
    ``cgroup_root`` (a file read, no D-Bus), or from ``group`` when vLLM's container lives
    in a cgroup of its own (MemoryGroup): its charge and limit then too. ``group`` None:
    where vLLM's memory is is not known yet, and none is reported."""
    memory, limit = state.memory_current, state.memory_max
    if group is None:
        memory, limit = None, None
    elif group and group != state.control_group:
        memory, limit = read_memory(group, cgroup_root)
    return UnitFacts(
        state.active_state,
        state.sub_state,
        state.invocation_id,
        state.main_pid,
        memory,
        state.n_restarts,
        None if group is None else read_anon(group or state.control_group, cgroup_root),
        state.active_enter_timestamp / 1e6 if state.active_enter_timestamp else None,
        limit,
        state.restart_policy,
        state.wanted,
        state.exit_text,
    )


def _in_the_units_cgroup(run: container.Container) -> bool:
    """podman keeps the container in (or below) the unit's cgroup with ``--cgroups=split``
    (Quadlet's), ``disabled`` or ``no-conmon``: nothing to ask the engine."""
    return run.engine == "podman" and run.option("cgroups") in ("split", "disabled", "no-conmon")


class MemoryGroup:
    """The cgroup that holds vLLM's memory: the unit's, unless a container engine keeps the
    container in a cgroup of its own (Docker's ``docker-ID.scope``, podman's
    ``libpod-ID.scope`` unless ``--cgroups`` says otherwise), where the unit's memory is only
    the engine's client. The engine is asked where the container's first process is
    (``ENGINE inspect`` of its ``--name``) once per start of the unit, and, until it answers,
    at most every ``RETRY`` seconds, the memory unknown meanwhile: the client's few MB, then
    vLLM's GBs, would read as growth. A unit that runs no container, or one without a name to
    ask about, is the unit's cgroup."""

    RETRY = 30.0
    ASK_TIMEOUT = 3.0  # the tick waits for the engine's answer: a hung dockerd costs this

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._known: tuple[str, str] | None = None  # (invocation, cgroup)
        self._asked: tuple[str, float] = ("", 0.0)  # (invocation, when)

    def of(self, state: UnitState, mono: float) -> str | None:
        """The cgroup to read; None while the engine has not said where the container is."""
        unit, invocation = state.control_group, state.invocation_id
        if not unit or not state.exec_start:
            return unit
        if self._known is not None and self._known[0] == invocation:
            return self._known[1]
        if self._asked[0] == invocation and mono - self._asked[1] < self.RETRY:
            return None
        self._asked = (invocation, mono)
        found = self._find(state)
        if found is not None:
            self._known = (invocation, found)
        return found

    def _find(self, state: UnitState) -> str | None:
        argv = state.exec_start[-1].argv
        try:
            engine = container.find(argv)
        except container.ContainerError:  # plan and apply say why; the unit's memory here
            engine = None
        if engine is None or not engine.option("name") or _in_the_units_cgroup(engine):
            return state.control_group
        pid = engine.main_pid(argv, timeout=self.ASK_TIMEOUT)
        try:
            text = (self.proc / str(pid) / "cgroup").read_text("utf-8", "replace") if pid else ""
        except OSError:
            text = ""
        paths = systemd_paths(text)
        if not paths:
            return None
        return state.control_group if below(paths[0], state.control_group) else paths[0]
