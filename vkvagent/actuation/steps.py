"""The steps of an action, as the ledger journals them: their names (``STEPS``), the journal
around each step as it runs (``Step``), and what an interrupted action's steps say.

Each step is written to the ledger before and after it runs, so that ``Actuator.recover()``
can tell how far a crash let the action go. ``VKVAGENT_KILL_AT=<step>`` makes the process
SIGKILL itself when that step begins: the fault injection the reliability tests use to prove
it. It does nothing unless set.

Apart from the actuator because the journal is the one record a restart and a recovery after
a crash share; the actuator decides what each step does.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from vkvagent.adapters.ledger import Action, Ledger

STEPS = (
    "preflight", "pre_stop", "drain", "write", "reload", "restart", "ready", "attest",
    "post_ready",
)  # fmt: skip


class Step:
    """One step of action ``action``, journaled: begun on entry (SIGKILL here when
    ``VKVAGENT_KILL_AT`` names it), done or failed (with the error) on exit. ``note``: what
    the step records on beginning; ``wall`` stamps both."""

    def __init__(
        self, ledger: Ledger, action: int, step: str, note: str, wall: Callable[[], float]
    ) -> None:
        self.ledger, self.action, self.step, self.note, self.wall = ledger, action, step, note, wall

    def __enter__(self) -> None:
        self.ledger.step(self.action, self.step, "begin", self.wall(), self.note)
        if os.environ.get("VKVAGENT_KILL_AT") == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def __exit__(self, kind: object, exc: object, _tb: object) -> None:
        state = "done" if kind is None else "failed"
        said = "" if exc is None else str(exc)
        self.ledger.step(self.action, self.step, state, self.wall(), said)


def first_index(action: Action, step: str) -> int | None:
    """Where ``step`` was first begun in ``action``'s steps."""
    return next((i for i, s in enumerate(action.steps) if s.step == step), None)


def restart_note(action: Action) -> str | None:
    """The invocation the last restart step replaced (its note), None if unrecorded."""
    notes = [s.note for s in action.steps if s.step == "restart" and s.state == "begin"]
    return notes[-1] if notes and notes[-1] else None


def last_restart(action: Action, start: int) -> tuple[str, bool] | None:
    """The last restart step begun at or after step ``start``: its note (the invocation it
    replaced) and whether it was done; None when there is none."""
    begun = [
        i
        for i, s in enumerate(action.steps)
        if i >= start and s.step == "restart" and s.state == "begin"
    ]
    if not begun:
        return None
    done = any(s.step == "restart" and s.state == "done" for s in action.steps[begun[-1] :])
    return action.steps[begun[-1]].note, done
