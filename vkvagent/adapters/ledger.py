"""The restart ledger: every restart and flag change, step by step, committed as it happens.

Each action (a restart, a flag change, a rollback) is one row; each step it takes is recorded
before it is attempted and again when it is done. After a crash or ``kill -9`` the next start
finds the open action and its last step, and the actuator completes or undoes it
(``Actuator.recover``). Kept in its own SQLite file beside the history: samples expire, the
ledger does not.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vkvagent.errors import NeedsOperator, VkvagentError

FILE_NAME = "ledger.sqlite3"
SCHEMA_VERSION = 1
_SCHEMA = (
    """CREATE TABLE actions (
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,           -- restart | apply | rollback
        reason TEXT NOT NULL,
        started REAL NOT NULL,        -- UTC Unix seconds
        ended REAL,
        outcome TEXT,                 -- NULL while open; done | rolled-back | failed | aborted
        detail TEXT NOT NULL          -- JSON: intended argv, previous drop-in, ...
    )""",
    """CREATE TABLE steps (
        action_id INTEGER NOT NULL REFERENCES actions (id),
        at REAL NOT NULL,
        step TEXT NOT NULL,
        state TEXT NOT NULL,          -- begin | done | failed
        note TEXT NOT NULL DEFAULT ''
    )""",
    "CREATE INDEX steps_action ON steps (action_id)",
)


class LedgerError(VkvagentError):
    """The ledger cannot be opened or written; one line naming the file."""


class NewerLedgerError(LedgerError, NeedsOperator):
    """The ledger's schema is newer than this code's: a downgrade. It is left untouched."""


@dataclass(frozen=True)
class Step:
    at: float
    step: str
    state: str
    note: str


@dataclass(frozen=True)
class Action:
    id: int
    kind: str
    reason: str
    started: float
    ended: float | None
    outcome: str | None
    detail: dict[str, Any]
    steps: tuple[Step, ...]

    @property
    def open(self) -> bool:
        return self.outcome is None

    @property
    def last_step(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    def reached(self, step: str) -> bool:
        """Whether ``step`` was begun (it may or may not have finished)."""
        return any(s.step == step for s in self.steps)

    def finished(self, step: str) -> bool:
        return any(s.step == step and s.state == "done" for s in self.steps)

    def mono_on(self, boot: str) -> float | None:
        """The monotonic time the action began, when it was taken during boot ``boot`` (the
        monotonic clock starts again at every boot, so another boot's means nothing here)."""
        clock = self.detail.get("clock")
        if not isinstance(clock, dict) or not boot or clock.get("boot") != boot:
            return None
        mono = clock.get("mono")
        return (
            float(mono) if isinstance(mono, (int, float)) and not isinstance(mono, bool) else None
        )


def boot_id(proc: Path = Path("/proc")) -> str:
    """This boot's id (new at every boot), or "" when it cannot be read."""
    try:
        return (proc / "sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


class Ledger:
    def __init__(self, state_dir: str | Path, *, boot: str | None = None) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.boot = boot_id() if boot is None else boot  # stamps monotonic times
        try:
            self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            # Owner and group only, whatever the umask of whoever creates it (SQLite gives its
            # -wal and -shm files the database's mode).
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640))
            # Opened by the daemon's main thread, used by its scheduler's, one at a time.
            self._db = sqlite3.connect(
                str(self.path), timeout=5.0, isolation_level=None, check_same_thread=False
            )
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version <= SCHEMA_VERSION:  # a newer one is refused below, before any write
                self._db.execute("PRAGMA journal_mode = WAL")
                self._db.execute("PRAGMA synchronous = FULL")  # an action must survive a power cut
                with self._transaction():
                    if self._db.execute("PRAGMA user_version").fetchone()[0] == 0:
                        for statement in _SCHEMA:
                            self._db.execute(statement)
                        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except (sqlite3.Error, OSError) as exc:
            raise LedgerError(f"{self.path}: cannot open: {exc}") from None
        if version > SCHEMA_VERSION:  # a downgrade: its actions may mean what this code cannot
            self._db.close()
            raise NewerLedgerError(
                f"{self.path}: ledger schema {version} is newer than this vkvagent supports "
                f"({SCHEMA_VERSION})"
            )

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def begin(
        self, kind: str, reason: str, now: float, detail: dict[str, Any], mono: float | None = None
    ) -> int:
        """Record an action beginning at ``now`` (UTC) and, when given, ``mono`` (monotonic,
        kept with this boot's id: ``Action.mono_on``)."""
        if mono is not None:
            detail = {**detail, "clock": {"mono": mono, "boot": self.boot}}
        with self._transaction():
            cursor = self._db.execute(
                "INSERT INTO actions (kind, reason, started, detail) VALUES (?, ?, ?, ?)",
                (kind, reason, now, json.dumps(detail, sort_keys=True)),
            )
            return int(cursor.lastrowid or 0)

    def step(self, action_id: int, step: str, state: str, now: float, note: str = "") -> None:
        with self._transaction():
            self._db.execute(
                "INSERT INTO steps (action_id, at, step, state, note) VALUES (?, ?, ?, ?, ?)",
                (action_id, now, step, state, note),
            )

    def end(
        self, action_id: int, outcome: str, now: float, notes: Mapping[str, Any] | None = None
    ) -> None:
        """End the action; ``notes`` (what it cost, the hooks' output) join its detail."""
        with self._transaction():
            if notes:
                row = self._db.execute(
                    "SELECT detail FROM actions WHERE id = ?", (action_id,)
                ).fetchone()
                detail = {**json.loads(row[0]), **notes} if row else dict(notes)
                self._db.execute(
                    "UPDATE actions SET detail = ? WHERE id = ? AND outcome IS NULL",
                    (json.dumps(detail, sort_keys=True), action_id),
                )
            self._db.execute(
                "UPDATE actions SET outcome = ?, ended = ? WHERE id = ? AND outcome IS NULL",
                (outcome, now, action_id),
            )

    def open_action(self) -> Action | None:
        """The action a crash interrupted, if any (at most one: actions run one at a time)."""
        found = self._select("outcome IS NULL", (), 1)
        return found[0] if found else None

    def action(self, action_id: int) -> Action:
        return self._select("id = ?", (action_id,), 1)[0]

    def recent(self, limit: int = 20) -> list[Action]:
        """The latest actions, newest first."""
        return self._select("1", (), limit)

    def since(self, when: float, limit: int = 1000) -> list[Action]:
        """Actions still open, or ended at or after ``when`` (UTC Unix seconds)."""
        return self._select("ended IS NULL OR ended >= ?", (when,), limit)

    def _select(self, where: str, params: tuple[Any, ...], limit: int) -> list[Action]:
        try:
            rows = self._db.execute(
                "SELECT id, kind, reason, started, ended, outcome, detail FROM actions "
                f"WHERE {where} ORDER BY id DESC LIMIT ?",  # where: a constant of this module
                (*params, limit),
            ).fetchall()
            out = []
            for row in rows:
                steps = tuple(
                    Step(*s)
                    for s in self._db.execute(
                        "SELECT at, step, state, note FROM steps WHERE action_id = ? "
                        "ORDER BY rowid",
                        (row[0],),
                    )
                )
                action_id, kind, reason, started, ended, outcome, detail = row
                out.append(
                    Action(
                        action_id, kind, reason, started, ended, outcome, json.loads(detail), steps
                    )
                )
            return out
        except sqlite3.Error as exc:
            raise LedgerError(f"{self.path}: cannot read: {exc}") from None

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise LedgerError(f"{self.path}: cannot write: {exc}") from None
