"""The drain before a restart: how the requests in flight are let finish before vLLM stops,
and what the stop cost its clients.

Two ways to drain. vLLM drains by itself on SIGTERM when it runs with ``--shutdown-timeout``
(``DRAIN_FLAG``): systemd's stop then waits the drain out (``stop_settings``), unless the
unit's stop signals vLLM's engine too (``stop_reaches_the_engine``) or kills its container
sooner (``engine_stop_too_short``). Otherwise the actuator waits for a quiet moment before
the stop (``wait_for_quiet``). ``Stop`` watches one stop through /metrics and says what it
cost (``Costs``).

Apart from the actuator because it is a piece of its own, with its own measurements: the
actuator decides when to drain; this module knows how vLLM and systemd drain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vkvagent import container
from vkvagent.adapters.cgroup import pids_in
from vkvagent.adapters.systemd import UnitState
from vkvagent.engine.samples import FlagValue, VllmMetrics
from vkvagent.knowledge import flags as vflags
from vkvagent.knowledge.vllm_command import VllmCommandError, apply_flags, parse_command

# TimeoutStopSec= beyond vLLM's --shutdown-timeout: its teardown after the drain (the worker's
# exit took 8 s on 0.32's CPU build), so that systemd's SIGKILL never cuts the drain short.
STOP_MARGIN = 30
DRAIN_FLAG = vflags.CATALOGUE["shutdown-timeout"]  # vLLM's own drain on SIGTERM


@dataclass(frozen=True)
class Costs:
    """What a restart cost vLLM's clients, as /metrics showed it. ``drain_mode``: how the requests
    in flight were let finish: ``vllm`` (its graceful shutdown), ``quiet`` (a wait for a quiet
    moment), ``busy`` (no quiet moment came within drain_timeout: restarted anyway, as
    when_busy = proceed says), ``none`` (cut off: an emergency, or --no-drain)."""

    drain_mode: str
    in_flight: float | None  # requests running + waiting when the stop was requested
    aborted: float | None  # of those, cut off by the stop (None: vLLM did not say)
    drain_seconds: float | None  # the stop until nothing was in flight (or vLLM went away)
    down_seconds: float | None  # the stop until ready again: no new request was admitted
    missed: float | None  # requests estimated to have arrived meanwhile (the run's mean rate)

    def to_json(self) -> dict[str, Any]:
        return {
            key: round(value, 3) if isinstance(value, float) else value
            for key, value in self.__dict__.items()
        }


class Stop:
    """One stop of vLLM, watched through /metrics from just before the restart job: the
    requests in flight when it was asked for, how long vLLM's own drain took (``drain``
    "vllm", its ``shutdown`` timeout), and what was cut off (``Costs``). ``waited``: the
    quiet-moment wait before it, if any. ``scrape`` reads /metrics (None: no answer)."""

    def __init__(
        self,
        before: UnitState,
        drain: str,
        waited: float | None,
        shutdown: int,
        *,
        scrape: Callable[[], VllmMetrics | None],
        clock: Callable[[], float],
        wall: Callable[[], float],
        progress: Callable[[str], None],
    ) -> None:
        self.drain, self.waited, self.shutdown = drain, waited, shutdown
        self._scrape, self._clock, self._progress = scrape, clock, progress
        metrics = scrape()
        self.in_flight = in_flight(metrics)
        self.busy = self.in_flight or 0.0  # the last non-zero count seen
        self.rate: float | None = None  # the run's mean requests/s until the stop
        start = before.exec_main_start_timestamp / 1e6
        if metrics is not None and metrics.request_success_total is not None and start:
            uptime = wall() - start
            self.rate = metrics.request_success_total / uptime if uptime >= 60 else None
        self.drained_at: float | None = None  # when none were left in flight
        self.gone_at: float | None = None  # when vLLM stopped answering
        self.stopped_at: float | None = None  # when systemd's job (stop and start) ended
        self.requested = clock()  # the restart job is asked for now

    def tick(self) -> None:
        """While systemd stops a vLLM that drains: watch the requests in flight fall."""
        if self.gone_at is not None:
            return
        metrics = self._scrape()
        now = self._clock()
        if metrics is None:
            self.gone_at = now
            return
        left = in_flight(metrics) or 0.0
        if left:
            self.busy = left
            self._progress(
                f"stopping: vLLM finishing {left:.0f} requests in flight "
                f"({now - self.requested:.0f} s of at most {self.shutdown} s)"
            )
        elif self.drained_at is None:
            self.drained_at = now

    def costs(self, ready_at: float | None) -> Costs:
        drained: float | None = self.waited
        aborted: float | None = self.in_flight  # stopped without a drain: all of them
        if self.drain == "vllm":
            # None left in flight; vLLM went away (it exits once its drain is over, so it may
            # go between two looks that saw requests in flight); or it was gone before a
            # first look.
            ends = (self.drained_at, self.gone_at, self.stopped_at)
            end = next((t for t in ends if t is not None), None)
            drained = None if end is None else end - self.requested
            # vLLM aborts what is left only at its --shutdown-timeout.
            aborted = self.busy if drained is not None and drained >= self.shutdown else 0.0
        down = None if ready_at is None else ready_at - self.requested
        missed = None if self.rate is None or down is None else self.rate * down
        return Costs(self.drain, self.in_flight, aborted, drained, down, missed)


def wait_for_quiet(
    max_in_flight: int,
    timeout: float,
    poll_interval: float,
    *,
    scrape: Callable[[], VllmMetrics | None],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    progress: Callable[[str], None],
) -> str:
    """Wait for a quiet moment (at most ``max_in_flight`` requests in flight), for a vLLM that
    cannot drain by itself: "" when it came (or vLLM does not say), else, past ``timeout``,
    how busy vLLM still is (the caller's when_busy says whether to go on)."""
    deadline = clock() + timeout
    while True:
        metrics = scrape()
        count = in_flight(metrics)
        if count is None or count <= max_in_flight:
            return ""
        if clock() >= deadline:
            return f"still {count:.0f} requests in flight after {timeout:g} s"
        progress(f"draining: {count:.0f} requests in flight")
        sleep(poll_interval)


def may_drain_itself(graceful_shutdown: bool, vllm_version: str | None) -> bool:
    """graceful_shutdown on, and a vLLM version known to have --shutdown-timeout."""
    if not graceful_shutdown or vllm_version is None:
        return False
    try:
        return DRAIN_FLAG.available(vflags.parse_version(vllm_version))
    except ValueError:
        return False


def drains_for(argv: tuple[str, ...]) -> int:
    """The seconds ``argv``'s vLLM drains after SIGTERM (its --shutdown-timeout); 0: none."""
    try:
        value = parse_command(argv).value("shutdown-timeout")
    except VllmCommandError:
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def engine_stop_too_short(state: UnitState, drain: int) -> str:
    """Why a drain of ``drain`` seconds through vLLM's --shutdown-timeout cannot happen in
    this unit: its ExecStop= stops vLLM's container through the engine, which kills it sooner
    than the drain and vLLM's teardown (STOP_MARGIN) take. The operator's ExecStop= stands:
    vkvagent then drains by waiting for a quiet moment before the stop. "" when it fits, or
    when the unit runs no container (or no command) or stops none through an engine."""
    if not state.exec_start:
        return ""
    try:
        run = container.find(tuple(state.exec_start[-1].argv))
    except container.ContainerError:
        return ""
    if run is None or not drain:
        return ""
    grace, need = container.stop_grace(run, state.exec_stop), drain + STOP_MARGIN
    if grace is None or grace[0] >= need:
        return ""
    if " rm " not in f" {grace[1]} ":
        fix = f"give the engine's stop -t {need} or more"
    elif run.engine == "podman":  # Quadlet's rm -f: stopped after the run's timeout
        fix = f"run the container with --stop-timeout {need} or more (Quadlet: PodmanArgs=)"
    else:
        fix = f"stop the container with `{run.engine} stop -t {need}` first"
    return (
        f"ExecStop= `{grace[1]}` kills vLLM's container {grace[0]} s after its stop signal, "
        f"before a drain of {drain} s and vLLM's teardown end: vkvagent drains by waiting for "
        f"a quiet moment before the stop instead; {fix} to let vLLM drain itself"
    )


def stop_settings(argv: tuple[str, ...]) -> dict[str, str]:
    """How systemd must stop a command line whose vLLM drains on SIGTERM: wait the drain out
    (TimeoutStopSec=), and signal the API server alone (KillMode=mixed). A SIGTERM of their own
    kills the engine and its workers at once, failing the requests in flight (measured on 0.32);
    from the API server they get the drain."""
    seconds = drains_for(argv)
    return {"TimeoutStopSec": str(seconds + STOP_MARGIN), "KillMode": "mixed"} if seconds else {}


def stop_reaches_the_engine(state: UnitState, proc: Path) -> bool:
    """Whether systemd's stop sends its SIGTERM to vLLM's engine core and workers as well
    as to the API server (KillMode=control-group, with more processes in the unit's cgroup
    than its main one): they then fail the requests in flight at once instead of draining
    them (measured on 0.32, docs/operations.md), so the drain is a quiet moment's."""
    if state.kill_mode != "control-group":
        return False
    return any(pid != state.main_pid for pid in pids_in(state.control_group, proc))


def in_flight(metrics: VllmMetrics | None) -> float | None:
    """Requests running and waiting; None when vLLM does not say."""
    if metrics is None or metrics.num_requests_running is None:
        return None
    return metrics.num_requests_running + (metrics.num_requests_waiting or 0)


def drain_change(
    current: tuple[str, ...],
    wanted: Mapping[str, FlagValue],
    kill_mode: str,
    vllm_version: str | None,
) -> tuple[tuple[str, ...], dict[str, FlagValue]] | None:
    """The command line ``current`` with the drain's flags ``wanted`` set, and those whose
    value it changes; None when it needs no change (it has them, and the unit's stop,
    ``kill_mode``, reaches vLLM's API server alone) or cannot take one."""
    try:
        running = parse_command(current)
        changes = {n: v for n, v in wanted.items() if running.value(n) != v}
        # The flags alone do not drain where the unit's stop signals vLLM's engine too:
        # the drop-in's KillMode=mixed (``stop_settings``) is then the change.
        if not changes and kill_mode != "control-group":
            return None
        return tuple(apply_flags(current, wanted, vllm_version=vllm_version)), changes
    except VllmCommandError:
        # Not vLLM's command line, or one with its API key: plan() would refuse it, a
        # restart need not.
        return None
