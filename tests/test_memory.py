"""Memory growth (engine/memory.py): what is not a per-request leak."""

from __future__ import annotations

from tests.test_diagnosis import GIB, S, leak
from vkvagent.engine.memory import memory_growth


def test_memory_that_is_flat_noisy_short_or_from_an_earlier_run_is_not_growth() -> None:
    assert memory_growth(S, leak(0.0, noise=GIB)) is None  # big swings, no trend
    assert memory_growth(S, leak(1024)) is None  # grows, but 20 MiB is not a problem
    assert memory_growth(S, leak(128 * 1024, minutes=50)) is None  # not an hour yet
    assert memory_growth(S, leak(128 * 1024), since=60.0 * 45) is None  # this run: 45 min
    assert memory_growth(S, []) is None
