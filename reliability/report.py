"""One row of the reliability table per fault class, and the table itself."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field

COLUMNS = ("fault class", "trials", "faults injected", "bad inputs tried", "failures", "data lost")


@dataclass
class Row:
    """What one fault class did. ``failures`` holds one line per failed check (empty: none
    failed); ``lost`` counts records that existed before a fault and were gone after it (ledger
    actions, committed samples, a drop-in that was neither the old one nor the new one).
    ``faults`` and ``inputs`` are None where the column does not apply."""

    name: str
    trials: int = 0
    faults: int | None = None
    inputs: int | None = None
    failures: list[str] = field(default_factory=list)
    lost: int = 0
    notes: list[str] = field(default_factory=list)  # figures worth printing under the table
    seconds: float = 0.0

    def fail(self, message: str) -> None:
        self.failures.append(" ".join(message.split())[:400])

    def check(self, ok: bool, message: str) -> bool:
        if not ok:
            self.fail(message)
        return ok


def table(rows: Sequence[Row]) -> str:
    """The table in Markdown, then the notes and the first failures of each row."""

    def cell(value: int | None) -> str:
        return "-" if value is None else f"{value:,}"

    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.trials:,} | {cell(row.faults)} | {cell(row.inputs)} "
            f"| {len(row.failures)} | {row.lost} |"
        )
    details = []
    for row in rows:
        for note in row.notes:
            details.append(f"- {row.name}: {note}")
        for failure in row.failures[:5]:
            details.append(f"- {row.name}: FAILED: {failure}")
        if len(row.failures) > 5:
            details.append(f"- {row.name}: ... and {len(row.failures) - 5} more failures")
    return "\n".join([*lines, *([""] if details else []), *details]) + "\n"


def need_sandbox() -> None:
    """Raise (RuntimeError) where no systemd sandbox can boot: a class that needs one fails
    rather than passing by skipping (tests call tests.sandbox.require(), which skips)."""
    # Imported here: tests.sandbox brings pytest, which the soak's process must not carry.
    reason = importlib.import_module("tests.sandbox").available()
    if reason is not None:
        raise RuntimeError(f"systemd sandbox: {reason}")


def passed(rows: Sequence[Row]) -> bool:
    return all(not row.failures and row.lost == 0 for row in rows)
