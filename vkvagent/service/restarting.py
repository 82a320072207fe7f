"""The daemon's restarts: the ones the ledger holds, and the one it carries out.

``RestartBook`` reads the ledger's restarts (the daemon's and manual ones) as the policy needs
them (each placed once on the monotonic clock, with its judged outcome and its cost to the
clients), and writes the engine's judgement of the last one (did the fresh speed come back?)
once. ``Restarter`` carries out a restart the engine decided: a slot of the fleet's group
first when one is configured, the watchdog extended for as long as it may take, the
actuator's progress told to systemd and the status, a stop request (or the loss of the fleet
slot) while draining abandoning it; and at start-up, the completion of an interrupted action.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vkvagent.actuation.actuator import Actuator, ActuatorError
from vkvagent.actuation.outcome import Outcome
from vkvagent.adapters.exporter import AgentMetrics
from vkvagent.adapters.ledger import Action, Ledger, LedgerError
from vkvagent.engine import Decision
from vkvagent.engine.liveness import CAUSES as DOWN
from vkvagent.engine.policy import DAY, FLAGS, RestartRecord
from vkvagent.knowledge import status
from vkvagent.knowledge.reconcile import change_of
from vkvagent.service.flag_loop import FlagsDue
from vkvagent.service.parts import Parts

if TYPE_CHECKING:
    from vkvagent.adapters import fleet

RESTART_KINDS = ("restart", "apply", "rollback")

Emit = Callable[..., None]  # RememberedEvents.emit: (name, message, **fields)


class RestartBook:
    """The ledger's restarts for the policy's budgets, and the judgement of each."""

    def __init__(self, judged: dict[int, bool], emit: Emit, metrics: AgentMetrics) -> None:
        self.judged = judged  # ledger action id -> whether it restored the fresh speed
        self.emit, self.metrics = emit, metrics
        self._mono: dict[int, float] = {}  # ledger action id -> its monotonic start

    def records(self, ledger: Ledger, at: float, now_mono: float) -> tuple[RestartRecord, ...]:
        """Restarts in the ledger (the daemon's and manual ones) for the policy's budgets,
        each with its judged outcome, and the aborted attempts for its retry back-off.

        Each is placed on the monotonic clock, so a step of the wall clock changes no age:
        at the time the ledger took on this boot's clock, else (another boot's) at its
        wall-clock age when the daemon first read it, no less than zero, fixed from then on.
        A step back never forgets a restart; a step forward never ages one."""
        try:
            actions = ledger.since(at - 8 * DAY)
        except LedgerError:
            return ()
        boot = ledger.boot
        placed: dict[int, float] = {}
        for a in actions:
            began = self._mono.get(a.id)
            if began is None:
                began = a.mono_on(boot)
            if began is None:
                began = now_mono - max(0.0, at - a.started)
            placed[a.id] = began
        self._mono = placed
        return tuple(
            RestartRecord(
                a.started,
                a.reason.split(":", 1)[0],
                # A restart that failed (vLLM not back in time) helped nothing: it escalates
                # like one that did not restore the fresh speed.
                False if a.outcome == "failed" else self.judged.get(a.id),
                aborted=a.outcome == "aborted",
                mono=placed[a.id],
                cut_off=_cost(a.detail, "aborted"),
                refused=_cost(a.detail, "missed"),
                ended=a.ended,
            )
            for a in reversed(actions)
            if a.kind in RESTART_KINDS
        )

    def judge(
        self, recent: list[Action] | None, decision: Decision, ignore: frozenset[str]
    ) -> None:
        """Write the engine's judgement of the last restart (did the fresh speed come back?)
        to that restart, once. ``recent``: the ledger's latest actions, newest first (None:
        the ledger could not be read); ``ignore``: the drain's flags."""
        if decision.recovered is None or recent is None:
            return
        actions = [a for a in recent if a.kind in RESTART_KINDS and a.outcome == "done"]
        if not actions or actions[0].id in self.judged:
            return
        action = actions[0]
        if change_of(action.id, action.started, action.ended, action.detail, ignore):
            return  # new flags: the flags loop judges that run, against the flags before
        # Only the action that started this vLLM process (not a crash or an operator's
        # restart since) is judged by this run's speed.
        began = decision.state.run.started
        if began is not None and not action.started - 1 <= began <= (action.ended or began) + 1:
            return
        self.judged[action.id] = decision.recovered
        cause = action.reason.split(":", 1)[0]
        if decision.recovered:
            self.emit(
                "restart.recovered",
                f"action {action.id} ({cause}) restored the fresh speed",
                action=action.id,
                cause=cause,
            )
        else:
            self.metrics.count_restart(cause, "not-recovered")
            self.emit(
                "restart.not_recovered",
                f"action {action.id} ({cause}) did not restore the fresh speed",
                action=action.id,
                cause=cause,
            )


class Restarter:
    """Carries out the restarts the engine decides, one at a time."""

    def __init__(
        self,
        emit: Emit,
        notify: Callable[[str], None],
        metrics: AgentMetrics,
        stopping: threading.Event,
        show: Callable[[status.StatusReport], None],
    ) -> None:
        self.emit, self.notify, self.metrics = emit, notify, metrics
        self.stopping = stopping  # set: abandon a restart still draining
        self.show = show  # writes a status while the restart runs
        # The status while restarting: the conductor sets it before the restart, clears it
        # after; the progress is written into it.
        self.acting: status.StatusReport | None = None
        self._held: tuple[fleet.Gate, fleet.Slot] | None = None  # the fleet slot held
        self._progress_at = 0.0  # when the restart's progress was last written to it

    def restart(
        self,
        parts: Parts,
        actuator: Actuator,
        decision: Decision,
        carried: FlagsDue | None = None,
    ) -> Outcome | None:
        """Restart, after taking a slot of the fleet's group when one is configured (none
        free, or etcd unreachable under on_unreachable = hold: not this tick; the next tick
        decides again). The slot is given back after the outcome, whatever it is."""
        gate = parts.fleet
        if gate is None:
            return self._act(parts, actuator, decision, carried)
        cause = decision.cause or "unknown"
        emergency = cause in (*parts.settings.policy.emergency, *DOWN)
        with gate.slot(
            cause=cause, reason=f"{cause}: {decision.reason}", emergency=emergency
        ) as turn:
            if not turn.allowed:
                return None
            slot = turn.admission.slot
            self._held = None if slot is None else (gate, slot)
            turn.result = "refused"  # until the actuator says what the restart came to
            try:
                outcome = self._act(parts, actuator, decision, carried)
            finally:
                self._held = None
            if outcome is not None:
                turn.result = outcome.result
        return outcome

    def _act(
        self,
        parts: Parts,
        actuator: Actuator,
        decision: Decision,
        carried: FlagsDue | None,
    ) -> Outcome | None:
        """Restart, carrying the flag change that is due (``carried``), if any."""
        cause = decision.cause or "unknown"
        reason = f"{cause}: {decision.reason}"
        if carried is not None and cause != FLAGS:
            reason += f"; flags: {carried.what}"
        drain = decision.drain_max_in_flight is not None
        self.emit(
            "restart.started",
            f"restarting {actuator.unit}: {reason}",
            cause=cause,
            reason=decision.reason,
            ratio=decision.ratio,
            drain=drain,
            evidence=dict(decision.evidence),
            flags=None if carried is None else carried.what,
        )
        # The action may outlast WatchdogSec (a cold start takes minutes): give systemd its
        # own bound for the time being, then the unit's again.
        watchdog = os.environ.get("WATCHDOG_USEC")
        if watchdog:
            self.notify(f"WATCHDOG_USEC={int(parts.action_seconds * 1e6)}")
        try:
            with actuator.exclusive():
                outcome = actuator.restart(
                    reason,
                    drain=drain,
                    cause=cause,
                    plan=None if carried is None else carried.plan,
                    down=cause in DOWN,
                )
        except (ActuatorError, LedgerError) as exc:
            self.metrics.count_restart(cause, "failed")
            self.emit("restart.failed", f"restart refused: {exc}", cause=cause, error=str(exc))
            return None
        finally:
            if watchdog:
                self.notify(f"WATCHDOG_USEC={watchdog}")
            self.notify("WATCHDOG=1")
        cut_off = outcome.costs.aborted if outcome.costs is not None else None
        self.metrics.count_restart(cause, outcome.result, cut_off)
        for name, message, fields in outcome.events(actuator.unit, cause):
            self.emit(name, message, **fields)
        return outcome

    def progress(self, message: str) -> None:
        """The actuator's word while it drains or waits: the loop is alive. A stop request
        while draining abandons the restart before anything changed, as does the loss of the
        fleet slot (past the drain, the restart goes on: a unit left stopped is worse)."""
        self.notify(f"WATCHDOG=1\nSTATUS={message}")
        acting, now = self.acting, time.monotonic()
        if acting is not None and now - self._progress_at >= 1.0:
            self._progress_at = now
            # `vkvagent status` shows how the restart goes
            acting = self.acting = replace(acting, progress=message)
            self.show(acting)
        if self.stopping.is_set() and message.startswith("draining"):
            raise ActuatorError("vkvagent is stopping: restart abandoned while draining")
        held = self._held
        lost = held is not None and not held[0].check(held[1])  # emits it once
        if lost and message.startswith("draining"):
            raise ActuatorError("fleet slot lost: restart abandoned while draining")

    def recover(self, actuator: Actuator | None) -> None:
        """Complete or undo an action a previous run left half-done."""
        if actuator is None:
            return
        try:
            with actuator.exclusive():
                outcome = actuator.recover()
        except (ActuatorError, LedgerError) as exc:
            self.emit(
                "agent.action_recovered",
                f"interrupted action: {exc}",
                result="failed",
                error=str(exc),
            )
            return
        if outcome is not None:
            self.emit(
                "agent.action_recovered",
                f"action {outcome.action_id}: {outcome.message} ({outcome.result})",
                action=outcome.action_id,
                result=outcome.result,
            )


def _cost(detail: dict[str, Any], name: str) -> float | None:
    """One of a restart's costs to the clients as the actuator wrote them in the ledger:
    ``aborted``, the requests in flight it cut off, or ``missed``, those estimated to have
    arrived while vLLM was down (None: vLLM was never stopped, or it did not say; a value
    that is not a finite count reads as None)."""
    costs = detail.get("costs")
    value = costs.get(name) if isinstance(costs, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None
