"""The daemon's schedule: at once, then at a fixed rate; never overlapping; missed ticks
collapsed into one; a failing tick logged and the schedule kept; stop waits for the tick."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from vkvagent.service.ticker import Ticker


def test_the_first_tick_runs_at_once_and_the_next_after_the_interval() -> None:
    ran: list[float] = []
    first = threading.Event()
    ticker = Ticker(lambda: (ran.append(time.monotonic()), first.set()), interval=3600.0)
    began = time.monotonic()
    ticker.start()
    assert first.wait(5)
    time.sleep(0.2)
    ticker.stop()
    assert len(ran) == 1
    assert ran[0] - began < 5


def test_a_late_tick_is_not_overlapped_and_the_missed_ones_collapse_into_one() -> None:
    running, starts, overlaps = threading.Lock(), [], []

    def first_slow() -> None:
        if not running.acquire(blocking=False):
            overlaps.append(time.monotonic())
            return
        starts.append(time.monotonic())
        if len(starts) == 1:
            time.sleep(0.5)  # five intervals late
        running.release()

    ticker = Ticker(first_slow, interval=0.1)
    ticker.start()
    time.sleep(0.85)
    ticker.stop()
    assert overlaps == []
    # The five missed intervals are one tick, right after the late one; then the rate again,
    # not four more ticks in a row to make up for them.
    assert starts[1] - starts[0] == pytest.approx(0.5, abs=0.1)
    assert all(b - a >= 0.08 for a, b in zip(starts[1:], starts[2:]))
    assert 3 <= len(starts) <= 6


def test_a_tick_that_raises_is_logged_and_the_schedule_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def failing() -> None:
        calls.append(1)
        raise RuntimeError("a bug")

    ticker = Ticker(failing, interval=0.05)
    with caplog.at_level(logging.ERROR, logger="vkvagent.service.ticker"):
        ticker.start()
        time.sleep(0.5)
        ticker.stop()
    assert len(calls) >= 3
    assert "tick failed" in caplog.text
    assert "RuntimeError: a bug" in caplog.text


def test_a_new_interval_counts_from_the_last_tick() -> None:
    ran: list[float] = []
    ticker = Ticker(lambda: ran.append(time.monotonic()), interval=3600.0)
    ticker.start()
    time.sleep(0.2)
    ticker.reschedule(0.05)
    time.sleep(0.5)
    ticker.stop()
    assert len(ran) >= 4  # the hour's wait ended at once: the tick was overdue


def test_stop_waits_for_the_tick_under_way() -> None:
    started, finished = threading.Event(), threading.Event()

    def tick() -> None:
        started.set()
        time.sleep(0.3)
        finished.set()

    ticker = Ticker(tick, interval=3600.0)
    ticker.start()
    assert started.wait(5)
    ticker.stop()
    assert finished.is_set()
