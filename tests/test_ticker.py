"""The daemon's schedule: at once, then at a fixed rate; never overlapping, the points a late
tick passed skipped; a failing tick logged and the schedule kept; a new interval counted from
the reload; stop waits for the tick."""

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
    assert len(starts) >= 3
    # The points the late tick passed (0.1 to 0.5) are skipped, not made up for in a row: the
    # next tick is at the next point, 0.6, and the rate holds from there.
    assert starts[1] - starts[0] == pytest.approx(0.6, abs=0.05)
    assert all(b - a == pytest.approx(0.1, abs=0.05) for a, b in zip(starts[1:], starts[2:]))


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


def test_a_new_interval_counts_from_the_reload() -> None:
    ran: list[float] = []
    ticker = Ticker(lambda: ran.append(time.monotonic()), interval=3600.0)
    ticker.start()
    time.sleep(0.2)
    reloaded = time.monotonic()
    ticker.reschedule(0.3)
    time.sleep(0.45)
    ticker.stop()
    assert len(ran) == 2  # the hour's wait ended by the reload, not after it
    assert ran[1] - reloaded == pytest.approx(0.3, abs=0.05)


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
