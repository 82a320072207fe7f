"""``vkvagent replay --plot FILE.png``: the picture, and a clear error without matplotlib."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.test_replay import ENFORCE, history, run_cli, write
from vkvagent.adapters import query_range
from vkvagent.engine import Settings
from vkvagent.engine.policy import PolicySettings
from vkvagent.tools import plot, replay

PNG = b"\x89PNG\r\n\x1a\n"


def test_replay_draws_speed_windows_causes_and_restarts_to_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    data = write(tmp_path / "range.json", history("uptime-decline", 3.75, onset=1800.0, step=30.0))
    cfg = write(tmp_path / "config.toml", ENFORCE)
    picture = tmp_path / "replay.png"
    code, out, err = run_cli(str(data), "--config", str(cfg), "--json", "--plot", str(picture))
    assert (code, err) == (0, "")
    assert json.loads(out)["summary"]["restarts"] == 1  # the output is unchanged by --plot
    content = picture.read_bytes()
    assert content.startswith(PNG) and len(content) > 20_000
    width, height = int.from_bytes(content[16:20], "big"), int.from_bytes(content[20:24], "big")
    assert (width, height) == (1300, 750)


def test_the_trace_keeps_every_evaluation_for_the_picture() -> None:
    store = query_range.Store()
    store.add(json.loads(history("uptime-decline", 3.75, onset=1800.0, step=30.0)), "range")
    settings = Settings(policy=PolicySettings(mode="enforce", windows=("daily 03:15-05:00",)))
    result = replay.run(settings, store, trace=True)
    trace = result.trace
    assert trace is not None and len(trace.times) == result.evaluations == 450
    assert len(trace.ratio) == len(trace.tokens_per_s) == len(trace.causes) == 450
    assert trace.restarts == [d.time.timestamp() for d in result.decisions if d.action == "restart"]
    assert "uptime_decline" in trace.causes and any(trace.window_open)
    assert replay.run(settings, store).trace is None  # kept only when asked for


def test_observe_mode_draws_and_titles_the_restarts_it_held_back() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib import dates

    store = query_range.Store()
    store.add(json.loads(history("uptime-decline", 3.75, onset=1800.0, step=30.0)), "range")
    settings = Settings(policy=PolicySettings(windows=("daily 03:15-06:00",)))  # observe
    result = replay.run(settings, store, trace=True)
    assert result.trace is not None and result.trace.restarts == []
    assert result.trace.held_back == [d.time.timestamp() for d in result.held_back] != []
    figure = plot.picture(result)
    title = figure.get_suptitle()
    # The windows hold by default: the restart enforce mode would make waits for 03:15.
    assert title.endswith(": 1 restart held back by observe mode (1 in a window, 0 outside)")
    assert "(mode observe)" in title
    held = dates.date2num(result.held_back[0].time)
    for axes in figure.axes:  # a dashed line across each panel, where the restart was held
        dashed = [
            list(line.get_xdata()) for line in axes.get_lines() if line.get_linestyle() == "--"
        ]
        assert [x for x in dashed if x] == [[held, held]]  # (and the legend's empty one)
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert "held back (observe mode)" in labels and "restart" not in labels
    # The band drawn is the one in effect: higher once the run declines on its own trend.
    band = {line.get_label(): line.get_ydata() for line in figure.axes[0].get_lines()}
    enter = [x for x in band["enter 0.75 (0.9 declining)"] if not math.isnan(x)]  # (NaN: no ratio)
    leave = [x for x in band["leave 0.85 (0.95 declining)"] if not math.isnan(x)]
    assert sorted(set(enter)) == [0.75, 0.9] and sorted(set(leave)) == [0.85, 0.95]


def test_spans_of_consecutive_flags() -> None:
    flags = [False, True, True, False, True]
    assert plot._spans([0.0, 10.0, 20.0, 30.0, 40.0], flags, 10.0) == [(10.0, 30.0), (40.0, 50.0)]
    assert plot._spans([], [], 10.0) == []


def test_without_matplotlib_plot_fails_in_one_line_before_replaying(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a missing package looks like
    picture = tmp_path / "replay.png"
    code, out, err = run_cli(str(tmp_path / "missing.json"), "--plot", str(picture))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("vkvagent: --plot needs matplotlib (")
    assert err.rstrip().endswith("install it with: pip install 'vkvagent[plot]'")
    assert not picture.exists()
