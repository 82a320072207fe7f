"""``vkvagent replay --plot FILE.png``: a replay as a picture.

Three panels on one time axis: the speed against this run's fresh baseline (the ratio the
engine acts on, with the throughput ratio and the band it is judged by: enter and leave), the
generated tokens/s, and the cause named at each moment. Restart windows are shaded and
restarts drawn as red lines across all three; in observe mode, the restarts it held back as
dashed ones. Needs matplotlib (the ``plot`` extra), which the agent itself never imports: this
module loads it only when asked to draw, and ``require`` says in one line when it is missing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from vkvagent.engine.diagnosis import FIXABLE, VETOED
from vkvagent.errors import VkvagentError
from vkvagent.tools.replay import restarts_words

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from vkvagent.tools.replay import Result, Trace


class PlotError(VkvagentError):
    """The picture cannot be drawn; the message is one line."""


def require() -> None:
    """PlotError unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401, PLC0415 - optional, loaded only to draw
    except ImportError as exc:
        raise PlotError(
            f"--plot needs matplotlib ({exc}); install it with: pip install 'vkvagent[plot]'"
        ) from None


def draw(result: Result, path: Path) -> None:
    """Write the replay's picture to ``path`` (PNG, or any format matplotlib knows by the
    file's suffix). ``result`` must come from a replay run with ``trace=True``."""
    figure = picture(result)
    try:
        figure.savefig(path, dpi=100)
    except (OSError, ValueError) as exc:
        raise PlotError(f"--plot {path}: {exc}") from None


def picture(result: Result) -> Figure:
    """The replay's figure, drawn and not yet written."""
    require()
    from matplotlib.figure import Figure  # noqa: PLC0415 - optional, loaded only to draw

    trace = result.trace
    if trace is None or not trace.times:
        raise PlotError("--plot: nothing to draw (no evaluation)")
    times = [datetime.fromtimestamp(t, timezone.utc) for t in trace.times]
    step = result.step
    figure = Figure(figsize=(13, 7.5), layout="constrained")
    speed, tokens, causes = figure.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.4]}
    )
    d = result.settings.diagnosis
    speed.plot(times, trace.ratio, color="tab:blue", linewidth=1.0, label="speed / baseline")
    speed.plot(times, trace.throughput_ratio, color="tab:gray", linewidth=0.6, alpha=0.7,
               label="throughput / baseline")  # fmt: skip
    # The band in effect, where there is a ratio to judge: a declining run's sits higher.
    for values, color, name, setting, declining in (
        (trace.enter, "tab:red", "enter", d.enter_ratio, 1 - d.trend_loss),
        (trace.leave, "tab:green", "leave", d.leave_ratio, 1 - d.trend_loss / 2),
    ):
        label = f"{name} {setting:g} ({max(setting, declining):g} declining)"
        speed.plot(times, values, color=color, linestyle=":", linewidth=0.8,
                   drawstyle="steps-post", label=label)  # fmt: skip
    top = max((r for r in trace.ratio if math.isfinite(r)), default=1.2)
    speed.set_ylim(0, max(1.3, min(top * 1.05, 3.0)))
    speed.set_ylabel("against fresh baseline")
    tokens.plot(times, trace.tokens_per_s, color="tab:purple", linewidth=0.8)
    tokens.set_ylabel("generated tokens/s")
    tokens.set_ylim(bottom=0)
    _causes(causes, trace, step)
    for axes in (speed, tokens, causes):
        for begin, end in _spans(trace.times, trace.window_open, step):
            axes.axvspan(_utc(begin), _utc(end), color="tab:green", alpha=0.10, linewidth=0)
        for at in trace.restarts:
            axes.axvline(_utc(at), color="tab:red", linewidth=1.2)
        for at in trace.held_back:
            axes.axvline(_utc(at), color="tab:red", linewidth=1.2, linestyle="--")
    if trace.restarts or not trace.held_back:
        speed.plot([], [], color="tab:red", linewidth=1.2, label="restart")
    if trace.held_back:
        speed.plot([], [], color="tab:red", linewidth=1.2, linestyle="--",
                   label="held back (observe mode)")  # fmt: skip
    speed.fill_between([], [], color="tab:green", alpha=0.10, label="restart window")
    speed.legend(loc="lower left", fontsize="small", ncols=3)
    summary = result.summary()
    figure.suptitle(
        f"vkvagent replay {summary['from']} to {summary['to']} (mode {summary['mode']}): "
        f"{restarts_words(summary)}",
        fontsize="medium",
    )
    causes.set_xlabel("UTC")
    return figure


def _utc(at: float) -> float:
    """Unix seconds in matplotlib's date units."""
    from matplotlib import dates  # noqa: PLC0415 - optional, loaded only to draw

    date2num: Callable[[datetime], float] = dates.date2num  # untyped upstream
    return float(date2num(datetime.fromtimestamp(at, timezone.utc)))


def _spans(times: Sequence[float], flags: Sequence[bool], step: float) -> list[tuple[float, float]]:
    """(start, end) of each run of consecutive evaluations with the flag set."""
    out: list[tuple[float, float]] = []
    begin: float | None = None
    for index, (at, on) in enumerate(zip(times, flags)):
        if on and begin is None:
            begin = at
        last = index + 1 == len(times) or not flags[index + 1]
        if on and last and begin is not None:
            out.append((begin, at + step))
            begin = None
    return out


def _causes(axes: Axes, trace: Trace, step: float) -> None:
    """One row per cause named, a bar wherever it was."""
    named = sorted({c for c in trace.causes if c is not None})
    for row, cause in enumerate(named):
        spans = _spans(trace.times, [c == cause for c in trace.causes], step)
        color = "tab:orange" if cause in FIXABLE else "tab:blue" if cause in VETOED else "black"
        for begin, end in spans:
            axes.axvspan(_utc(begin), _utc(end), ymin=(row + 0.15) / len(named),
                         ymax=(row + 0.85) / len(named), color=color, linewidth=0)  # fmt: skip
    axes.set_yticks([(row + 0.5) / len(named) for row in range(len(named))], named)
    axes.set_ylim(0, 1)
    axes.set_ylabel("cause")
    if not named:
        axes.set_yticks([])
        axes.text(0.5, 0.5, "no cause named", ha="center", va="center", transform=axes.transAxes)
