"""The operator's commands to the daemon: ``vkvagent pause`` and ``vkvagent resume``.

Kept as ``controls.json`` in the state directory, written atomically by the command and read
by the daemon at every evaluation, so they work whether or not the daemon runs at the time.
"""

from __future__ import annotations

import json
from pathlib import Path

from vkvagent.atomicfile import write_atomically
from vkvagent.engine.policy import Controls

FILE_NAME = "controls.json"


def read(state_dir: Path) -> Controls:
    """The controls in force; none when the file is missing or unreadable."""
    try:
        data = json.loads((state_dir / FILE_NAME).read_text(encoding="utf-8"))
        return Controls(
            paused_until=_number(data.get("paused_until")),
            resumed_at=_number(data.get("resumed_at")),
        )
    except (OSError, ValueError, AttributeError, TypeError):
        return Controls()


def write(
    state_dir: Path, *, paused_until: float | None = None, resumed_at: float | None = None
) -> None:
    """Pause until a time, or resume (which also ends a pause)."""
    current = read(state_dir)
    data = {
        "paused_until": None if resumed_at is not None else paused_until or current.paused_until,
        "resumed_at": resumed_at if resumed_at is not None else current.resumed_at,
    }
    state_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    write_atomically(state_dir / FILE_NAME, json.dumps(data) + "\n", 0o640)


def _number(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]
