"""vkvagent.actuation.restarted: when the run a restart brought up counts as ready, and when
Restart= starting it again ends the wait. The unit's states are systemd's as the sandbox
showed them (tests/test_systemd.py has the NRestarts that a start asked for keeps)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vkvagent.actuation.restarted import NotReady, wait_ready
from vkvagent.adapters.systemd import UnitState
from vkvagent.engine.samples import VllmMetrics
from vkvagent.knowledge.vllm_metrics import Normaliser

# The real vLLM 0.32's page, taken idle: ready as soon as the new run answers.
FIXTURE = Path(__file__).parent / "fixtures/metrics/v1-0.32-cpu.prom"
PAGE = replace(Normaliser().normalise(FIXTURE.read_text()), num_requests_running=0.0)

OLD, NEW, NEWER = "a" * 32, "b" * 32, "c" * 32
RUNNING = UnitState(
    "vllm.service", "loaded", "active", "running", "success", 42, NEW, 0, 0, None,
    (), "/etc/systemd/system/vllm.service", (), 5, 10_000_000,
)  # fmt: skip


def waited(*states: UnitState, replaced: str | None = OLD) -> tuple[VllmMetrics, int]:
    """wait_ready over ``states``, one a poll (the last one repeated), vLLM answering
    idle; the metrics it returned and the polls it took."""
    polls = []

    def read_unit() -> UnitState:
        polls.append(1)
        return states[min(len(polls), len(states)) - 1]

    clock = iter(range(1000))
    metrics = wait_ready(
        "vllm.service", replaced, read_unit=read_unit, scrape=lambda: PAGE,
        timeout=100, poll_interval=1, clock=lambda: float(next(clock)),
        sleep=lambda _s: None, progress=lambda _m: None,
    )  # fmt: skip
    return metrics, len(polls)


def test_a_restart_asked_for_while_restart_waited_keeps_nrestarts_and_is_ready() -> None:
    # The rollback's restart came while Restart= waited to start the broken line again:
    # systemd kept NRestarts=1 on the new run, which serves.
    starting = replace(RUNNING, active_state="activating", sub_state="start", n_restarts=1)
    _, polls = waited(starting, replace(RUNNING, n_restarts=1))
    assert polls == 2


@pytest.mark.parametrize(
    "later",
    [
        replace(RUNNING, active_state="activating", sub_state="auto-restart", result="exit-code"),
        replace(RUNNING, active_state="activating", sub_state="start", n_restarts=1),
    ],
    ids=["seen waiting", "counted between two polls"],
)
def test_the_new_run_dying_and_restarted_by_restart_ends_the_wait(later: UnitState) -> None:
    starting = replace(RUNNING, active_state="activating", sub_state="start")
    with pytest.raises(NotReady, match="exited and Restart= is starting it again"):
        waited(starting, later)


def test_a_start_someone_else_asked_for_meanwhile_is_not_a_crash() -> None:
    # `systemctl restart vllm` while vkvagent waits: a new invocation, NRestarts unchanged.
    starting = replace(RUNNING, active_state="activating", sub_state="start")
    _, polls = waited(starting, replace(RUNNING, invocation_id=NEWER))
    assert polls == 2


def test_the_replaced_run_is_not_the_first_reading_of_the_new_one() -> None:
    # Still the old invocation (the stop not through yet), then the new run, counted from
    # itself: its NRestarts, 2, is the one it started with.
    old = replace(RUNNING, active_state="deactivating", sub_state="stop-sigterm", invocation_id=OLD)
    _, polls = waited(old, replace(RUNNING, n_restarts=2))
    assert polls == 2


def test_a_failed_unit_ends_the_wait_with_systemds_result() -> None:
    failed = replace(RUNNING, active_state="failed", sub_state="failed", result="exit-code")
    with pytest.raises(NotReady, match=r"vllm.service failed \(failed, exit-code\)"):
        waited(failed)
