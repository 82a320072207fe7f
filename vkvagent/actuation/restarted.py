"""The vLLM a restart brought up: when it serves again (``wait_ready``), and whether it runs
the flags a change wrote (``attest_refusal``).

Ready is more than systemd's "active": /metrics must answer from a process newer than the
one replaced and, with traffic, its tokens must advance. A unit that failed or that Restart=
is starting again is not waited on: that would only spend the start limit a rollback needs.

Apart from the actuator because it is what a restart, a rollback and a recovery after a crash
all wait for and prove in the same way; the actuator decides what follows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from vkvagent.actuation import unit_command
from vkvagent.adapters.systemd import UnitState
from vkvagent.adapters.vllm import ScrapeError
from vkvagent.engine.samples import FlagValue, VllmMetrics
from vkvagent.errors import VkvagentError
from vkvagent.knowledge import flags as vflags


class NotReady(VkvagentError):
    """The restarted unit failed, exited, or did not serve in time; one line saying why."""


def wait_ready(
    unit: str,
    replaced: str | None,
    *,
    read_unit: Callable[[], UnitState],
    scrape: Callable[[], VllmMetrics],
    timeout: float,
    poll_interval: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    progress: Callable[[str], None],
) -> VllmMetrics:
    """Until /metrics (``scrape``, which raises ScrapeError) answers from a process newer than
    invocation ``replaced`` (None: any) and, with traffic, tokens advance. NotReady past
    ``timeout`` or when the unit failed or exited; ``read_unit``'s own errors pass through."""
    deadline = clock() + timeout
    last: VllmMetrics | None = None
    first: UnitState | None = None  # the first reading of the new run
    problem = "not started"
    while clock() < deadline:
        state = read_unit()
        if state.active_state == "failed" or (
            state.active_state == "inactive" and state.sub_state == "dead"
        ):
            raise NotReady(
                f"{unit} {state.active_state} ({state.sub_state}, {state.result}) after the restart"
            )
        fresh = replaced is None or state.invocation_id != replaced
        if fresh and first is None:
            first = state
        if state.sub_state == "auto-restart" or (first is not None and restarted(first, state)):
            # The new process died and Restart= starts it again: waiting on would only
            # spend the start limit a rollback needs.
            raise NotReady(f"{unit} exited and Restart= is starting it again ({state.result})")
        if fresh and state.active_state == "active":
            try:
                metrics = scrape()
            except ScrapeError as exc:
                problem = str(exc)
            else:
                busy = (metrics.num_requests_running or 0) > 0
                if not busy or (last is not None and advanced(last, metrics)):
                    return metrics
                last, problem = metrics, "requests running, tokens not advancing yet"
        progress(f"waiting for {unit}: {problem}")
        sleep(poll_interval)
    raise NotReady(f"{unit} not ready within {timeout:g} s: {problem}")


def restarted(first: UnitState, now: UnitState) -> bool:
    """Whether Restart= started the unit again since the reading ``first`` of the run a
    restart brought up: NRestarts grew. Not whether it is above 0: systemd clears it at the
    next start only when the unit went down for good, so a restart asked for while Restart=
    was waiting to start the unit keeps its count (tests/test_systemd.py). A new invocation
    with the same count is a start someone asked for, not a crash."""
    return now.n_restarts > first.n_restarts


def advanced(before: VllmMetrics, after: VllmMetrics) -> bool:
    """Whether vLLM made progress between two scrapes: tokens generated or engine steps."""
    pairs = (
        (before.generation_tokens_total, after.generation_tokens_total),
        (before.engine_steps_total, after.engine_steps_total),
    )
    return any(old is not None and new is not None and new > old for old, new in pairs)


def attest_refusal(
    state: UnitState,
    argv: tuple[str, ...],
    flags: Mapping[str, FlagValue],
    metrics: VllmMetrics,
    proc: Path,
) -> str:
    """Why the unit, as ``state`` shows it and ``proc`` its processes, is not running the
    command line ``argv`` a change wrote, or ``flags`` are not in effect as ``metrics``'
    cache_config_info shows them; "" when nothing contradicts them."""
    running, argv = unit_command.vllms_command(state, argv, proc)
    environ = unit_command.environ(proc, state.main_pid)
    if running is not None and not unit_command.same_command(running, argv, environ):
        return (
            f"the running process's command line is not the one written: {' '.join(running)[:200]}"
        )
    for name, value in flags.items():
        spec = vflags.CATALOGUE[name]
        if spec.attested(value, metrics.cache_config) is False:
            return (
                f"--{name} is not in effect: cache_config_info shows "
                f"{spec.attest_label}={metrics.cache_config.get(spec.attest_label or '')}"
            )
    return ""
