"""The soak of ``make reliability`` (reliability/soak.py), six simulated hours instead of a
week: the daemon against the simulator's ServeGen week on a fast clock, flat in memory, file
descriptors, threads and history, every sample stored, and its decisions equal to those of
``replay.replay`` over what it recorded."""

from __future__ import annotations

from reliability import soak


def test_six_simulated_hours_are_flat_lossless_and_replay_to_the_same_decisions() -> None:
    row = soak.run(days=0.25, interval=30.0, scale=2400.0, retention_days=0.1, peak=4.0)
    assert not row.failures, "\n".join(row.failures + row.notes)
    assert row.lost == 0
    assert any("0 differences" in note for note in row.notes), row.notes
