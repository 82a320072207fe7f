"""The stall clocks (engine/progress.py): work without progress, by the gauges and by the
active probe."""

from __future__ import annotations

from dataclasses import replace

from tests.conftest import metrics
from vkvagent.engine.progress import ProbeFacts, Progress, Stall


def test_the_stall_clock_runs_while_work_is_pending_and_no_counter_moves() -> None:
    busy = metrics(num_requests_running=4.0, generation_tokens_total=100.0,
                   engine_steps_total=50.0)  # fmt: skip
    moved = replace(busy, engine_steps_total=51.0)
    none = ProbeFacts()
    p = Progress().observe(None, busy, 0.0)  # first sample: the clock starts, no accusation
    assert p.since == 0.0 and p.advanced == 0.0
    p = p.observe(busy, busy, 10.0)
    assert p.stalled(busy, 130.0, none) == Stall(130.0, "requests pending")
    assert p.observe(busy, moved, 140.0).since == 140.0  # one engine step is progress
    idle = replace(busy, num_requests_running=0.0)
    assert p.observe(busy, idle, 140.0).since == 140.0  # nothing to do is not a stall
    assert p.observe(busy, idle, 140.0).advanced == 0.0  # ...nor progress
    assert p.stalled(idle, 500.0, none) == Stall()
    queued = replace(busy, num_requests_running=0.0, num_requests_waiting=3.0)
    assert p.stalled(queued, 130.0, none).seconds == 130.0  # a queue nobody serves stalls too
    blind = metrics(num_requests_running=4.0)  # no counters at all: cannot tell
    assert p.observe(blind, blind, 50.0).since == 50.0


def test_a_probe_without_an_answer_is_pending_work_counted_from_the_last_progress() -> None:
    """The hung vLLM 0.32 engine: gauges frozen at 0 pending, counters still, /metrics fast."""
    frozen = metrics(num_requests_running=0.0, generation_tokens_total=100.0,
                     engine_steps_total=50.0)  # fmt: skip
    p = Progress().observe(None, frozen, 0.0)
    for t in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0):
        p = p.observe(frozen, frozen, t)
    assert p.advanced == 0.0 and p.stalled(frozen, 60.0, ProbeFacts()) == Stall()  # idle?
    in_flight = ProbeFacts(last_sent=30.0)
    assert p.stalled(frozen, 60.0, in_flight) == Stall()  # not unanswered until it gives up
    timed_out = ProbeFacts(unanswered=30.0, last_sent=30.0)
    assert p.stalled(frozen, 60.0, timed_out) == Stall(60.0, "a probe got no answer")
    # A probe sent before the counters last moved says nothing of the engine since.
    moved = replace(frozen, generation_tokens_total=101.0)
    later = p.observe(frozen, moved, 70.0)
    assert later.stalled(moved, 100.0, timed_out) == Stall()
