"""A held symptom (engine/hysteresis.py): the hold, the two lines, and bursty traffic's light
minutes."""

from __future__ import annotations

import pytest

from vkvagent.engine.hysteresis import Hysteresis


def test_a_symptom_becomes_active_only_after_the_hold_and_leaves_above_the_upper_line() -> None:
    h = Hysteresis()
    h = h.step(True, False, 0.0, hold=900.0)
    assert not h.active and h.pending_since == 0.0
    h = h.step(True, False, 899.0, hold=900.0)
    assert not h.active
    h = h.step(True, False, 900.0, hold=900.0)
    assert h.active and h.active_since == 900.0 and h.held_for(960.0) == 960.0
    assert h.step(False, False, 1000.0, hold=900.0) == h  # between the lines: still active
    assert h.step(None, None, 1000.0, hold=900.0) == h  # no evidence: unchanged
    assert h.step(False, True, 1000.0, hold=900.0) == Hysteresis()


def test_noise_between_the_lines_neither_resets_nor_fires_the_clock() -> None:
    h = Hysteresis().step(True, False, 0.0, hold=900.0)
    h = h.step(False, False, 400.0, hold=900.0)  # 0.78: between enter 0.75 and leave 0.85
    assert h.pending_since == 0.0 and not h.active
    h = h.step(True, False, 800.0, hold=900.0)  # crossed again within the hold: same clock
    h = h.step(False, False, 850.0, hold=900.0)
    assert h.pending_since == 0.0 and not h.active
    assert h.step(True, False, 960.0, hold=900.0).active
    assert h.step(False, True, 960.0, hold=900.0) == Hysteresis()  # clearly back: reset


def test_one_dip_before_a_quiet_night_and_one_after_are_not_a_held_symptom() -> None:
    h = Hysteresis().step(True, False, 0.0, hold=900.0)  # 23:50, one slow window
    h = h.step(None, None, 3600.0, hold=900.0)  # the quiet night: no evidence at all
    assert h == Hysteresis()  # not crossed again within the hold: forgotten
    h = h.step(True, False, 8400.0, hold=900.0)  # 02:10, one slow window again
    assert not h.active and h.pending_since == 8400.0


def test_a_lighter_window_is_no_evidence_against_a_pending_symptom() -> None:
    # Bursty traffic: slow at 5.7 requests/s, fine at 2.9, slow again 10 minutes on.
    h = Hysteresis().step(True, False, 0.0, hold=900.0, load=5.7)
    h = h.step(True, False, 300.0, hold=900.0, load=4.2)  # a window across both: the lightest
    assert h.load == 4.2
    light = h.step(False, True, 420.0, hold=900.0, load=2.9)  # back to 0.95, at half the load
    assert (light.pending_since, light.load) == (0.0, 4.2)  # never seen that light: kept
    assert light.step(True, False, 960.0, hold=900.0, load=5.7).active  # held the 15 min
    # A window as heavy as the lightest it was seen at (less its noise) shows it gone.
    assert h.step(False, True, 420.0, hold=900.0, load=3.8) == Hysteresis()
    # Not seen again within the hold, it is forgotten as any other.
    assert light.step(False, True, 1300.0, hold=900.0, load=2.9) == Hysteresis()
    # Crossed again after that, its load starts over.
    stale = light.step(None, None, 1300.0, hold=900.0).step(True, False, 1400.0, 900.0, load=6.0)
    assert stale.pending_since == 1400.0 and stale.load == 6.0
    # Active, it is cleared at any load: the run stays due for its cause (Due) instead.
    active = light.step(True, False, 960.0, hold=900.0, load=5.7)
    assert active.step(False, True, 1000.0, hold=900.0, load=2.9) == Hysteresis()


def test_a_symptom_crossed_at_a_load_it_was_seen_gone_at_starts_over() -> None:
    # Slow once at 6 requests/s, then fine for 14 minutes as the evening's load falls to 4,
    # then slow once at 4: the fine windows at 4 show that one alone, not a held symptom.
    h = Hysteresis().step(True, False, 0.0, hold=900.0, load=6.0)
    for t in range(30, 900, 30):
        h = h.step(False, True, float(t), hold=900.0, load=max(4.0, 5.3 - 0.05 * (t // 30 - 1)))
    assert h.pending_since == 0.0 and h.cleared == pytest.approx(5.3)
    again = h.step(True, False, 900.0, hold=900.0, load=4.0)
    assert not again.active and again.pending_since == 900.0 and again.cleared is None
    # Crossed at a load heavier than any it was seen gone at, the clock runs on.
    assert h.step(True, False, 900.0, hold=900.0, load=6.0).active
