"""The soak of ``make reliability`` (reliability/soak.py), six simulated hours instead of a
week: the daemon against the simulator's ServeGen week on a fast clock, flat in memory, file
descriptors, threads and history, every sample stored, and its decisions equal to those of
``replay.replay`` over what it recorded."""

from __future__ import annotations

import time

from reliability import soak
from tests.simproc import SimProcess, get


def test_six_simulated_hours_are_flat_lossless_and_replay_to_the_same_decisions() -> None:
    row = soak.run(days=0.25, interval=30.0, scale=2400.0, retention_days=0.1, peak=4.0)
    assert not row.failures, "\n".join(row.failures + row.notes)
    assert row.lost == 0
    assert any("0 differences" in note for note in row.notes), row.notes


def test_the_simulator_renders_a_page_per_scrape_when_asked() -> None:
    """The soak's simulator runs 2400x: with the 50 ms render cache, two scrapes a tick apart
    (12.5 ms) read one page, two simulated minutes old, and a healthy engine looks stalled."""
    pages = {}
    for interval in ("5", "0"):
        with SimProcess(
            "meta-llama/Llama-3.1-8B-Instruct", "--time-scale", "2400", "--rate", "4",
            "--render-interval", interval,
        ) as sim:  # fmt: skip
            first = get(sim.url + "/metrics")[1]
            time.sleep(0.0125)
            pages[interval] = (first, get(sim.url + "/metrics")[1])
    assert pages["5"][0] == pages["5"][1]
    assert pages["0"][0] != pages["0"][1]
    with SimProcess("m", "--render-interval", "-1", wait=False) as sim:
        assert sim.process is not None and sim.process.wait(timeout=30) == 2
