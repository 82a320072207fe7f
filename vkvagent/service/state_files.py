"""The daemon's own files in the state directory, and how a failed write is borne.

``engine.json`` carries what the daemon learned (the engine state and its baselines, the
restarts it judged, the trend, the flags loop's state) across its own restarts: a missing or
damaged file costs the learning, never the start. ``status.json`` is written atomically each
tick. ``StateWrites`` runs every write to the state directory so that a failure is an event
(once until it works again), never the end of the loop: the next tick tries again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vkvagent.adapters.history import HistoryError
from vkvagent.adapters.ledger import LedgerError
from vkvagent.atomicfile import write_atomically
from vkvagent.engine import EngineState
from vkvagent.jsonsafe import finite
from vkvagent.knowledge import status
from vkvagent.knowledge.reconcile import FlagState

STATE_FILE = "engine.json"
JUDGED_KEPT = 50  # the restarts whose judgement engine.json keeps, the latest


@dataclass
class SavedState:
    """What engine.json holds."""

    engine: EngineState = field(default_factory=EngineState)
    judged: dict[int, bool] = field(default_factory=dict)  # ledger action id -> recovered
    trend: tuple[status.TrendPoint, ...] = ()
    flags: FlagState = field(default_factory=FlagState)


def load(state_dir: Path, emit: Callable[..., None]) -> SavedState:
    """The state as the last run left it. A missing or damaged file costs the learned
    baselines, never the start."""
    path = state_dir / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        engine = EngineState.from_json(data["engine"])
        judged = {int(k): bool(v) for k, v in data.get("judged", {}).items()}
        trend = _trend(data.get("trend", []))
        flag_state = FlagState.from_json(data.get("flags"))
    except FileNotFoundError:
        return SavedState()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        emit(
            "state.write_failed",
            f"{path}: unreadable ({exc}); starting with no baseline",
            what="state",
            error=str(exc),
        )
        return SavedState()
    return SavedState(engine, judged, trend, flag_state)


def save(state_dir: Path, state: SavedState) -> None:
    judged = dict(sorted(state.judged.items())[-JUDGED_KEPT:])
    data = {
        "engine": state.engine.to_json(),
        "judged": {str(k): v for k, v in judged.items()},
        "trend": [point.to_json() for point in state.trend],
        "flags": state.flags.to_json(),
    }
    write_atomically(
        state_dir / STATE_FILE,
        json.dumps(finite(data), separators=(",", ":")),
        0o640,
    )


def write_status(state_dir: Path, report: status.StatusReport) -> None:
    write_atomically(
        # Compact: json's C encoder (indent= would take the pure-Python one, 4x slower).
        status.path(state_dir),
        json.dumps(finite(report.to_json()), separators=(",", ":")),
        0o640,
    )


def _trend(points: object) -> tuple[status.TrendPoint, ...]:
    """The saved trend; a damaged one costs only the sparkline, never the baselines."""
    if not isinstance(points, list):
        return ()
    try:
        return tuple(status.TrendPoint.from_json(point) for point in points)
    except status.StatusError:
        return ()


class StateWrites:
    """Runs the writes to the state directory; a failure is an event (once until it works
    again), never the end of the loop: the next tick tries again."""

    def __init__(self, emit: Callable[..., None]) -> None:
        self.emit = emit
        self.failing: dict[str, str] = {}  # what -> its last error

    def write(self, what: str, write: Callable[[], object]) -> None:
        try:
            write()
        except (OSError, HistoryError, LedgerError) as exc:
            if what not in self.failing:
                self.failing[what] = str(exc)
                self.emit(
                    "state.write_failed",
                    f"cannot write the {what}: {exc}",
                    what=what,
                    error=str(exc),
                )
            return
        if what in self.failing:
            del self.failing[what]
            self.emit("state.write_recovered", f"the {what} is written again", what=what)
