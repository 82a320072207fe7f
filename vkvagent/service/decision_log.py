"""The decision's events: ``decision.changed`` when what the engine decides changes, a
``decision.unchanged`` reminder while it does not, and ``policy.escalated`` when the policy
escalates. The engine decides every tick; this says only what a reader needs to hear.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vkvagent.engine import Decision


class DecisionLog:
    """A decision event when it changes, and a reminder while it does not."""

    def __init__(self, emit: Callable[..., None]) -> None:
        self.emit = emit
        self._logged: tuple[Any, ...] | None = None
        self._logged_at = -math.inf

    def say(self, decision: Decision, reminder: float) -> None:
        """Say ``decision`` if it differs from the last one said, or ``reminder`` seconds
        after that."""
        # What vkvagent does, what it finds wrong and, when it holds back, what blocks it. With
        # nothing to do, a reason that only rewords that (the load moving between two regimes:
        # "healthy" then "unknown baseline") waits for the reminder.
        action, cause, head, run = decision.key()
        key = (action, cause, head if action != "none" else None, run)
        at = decision.time.timestamp()
        changed = key != self._logged
        if not changed and at - self._logged_at < reminder:
            return
        if changed and decision.reason.startswith("escalated"):
            self.emit("policy.escalated", decision.reason, cause=decision.cause)
        self._logged, self._logged_at = key, at
        self.emit(
            "decision.changed" if changed else "decision.unchanged",
            f"{decision.action}: {decision.reason}",
            **decision_fields(decision),
        )


def decision_fields(decision: Decision) -> dict[str, Any]:
    return {
        "action": decision.action,
        "cause": decision.cause,
        "reason": decision.reason,
        "ratio": decision.ratio,
        "window_open": decision.window_open,
        "next_window": decision.next_window.isoformat() if decision.next_window else None,
        "uptime_s": decision.uptime,
        "evidence": {k: v for k, v in decision.evidence.items() if v is not None},
        "suggestion": dict(decision.suggestion),
    }
