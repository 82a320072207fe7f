"""The flags loop's I/O: keeping vLLM's flags as [vllm.flags] says (``reconcile.py`` judges).

Each tick, ``FlagLoop`` takes the ledger's newest flag change (the daemon's or `vkvagent
apply`'s) as the one to judge, against the engine's run before it; works out the change the
next restart should carry (``FlagsDue``: a slower change to roll back, else [vllm.flags] where
the unit runs other values and the set was not rejected) and hands the engine what it may
propose a restart for; rejects a set vLLM failed with; gives the verdict on the last change
once its run can be compared; says each of these once as a ``flags.*`` event; and builds the
status's ``flags`` part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from vkvagent.actuation.actuator import ActuatorError, Plan
from vkvagent.actuation.outcome import Outcome
from vkvagent.adapters.ledger import Action, Ledger, LedgerError
from vkvagent.engine import Decision, EngineState
from vkvagent.engine.policy import FLAGS
from vkvagent.knowledge import status
from vkvagent.knowledge.flags import rendered, shown
from vkvagent.knowledge.reconcile import (
    UNASKED,
    FlagState,
    Trial,
    change_of,
    flags_key,
    held_back,
)
from vkvagent.knowledge.vllm_command import VllmCommandError, parse_command
from vkvagent.service.parts import Parts

if TYPE_CHECKING:  # etcd's client only for a fleet
    from vkvagent.adapters.fleet_flags import FleetTrials


@dataclass(frozen=True)
class FlagsDue:
    """A flag change waiting for a restart: [vllm.flags] to apply, or a slower change to
    roll back."""

    kind: str  # apply | rollback
    what: str  # "apply --max-num-seqs 4": for the decision's reason and the events
    plan: Plan
    key: str  # flags_key of the set applied (of the set rolled back, for a rollback)


class FlagLoop:
    """The flags loop's state (persisted in engine.json) and what it says."""

    def __init__(self, state: FlagState, emit: Callable[..., None]) -> None:
        self.state = state
        self.emit = emit
        self._said: tuple[str, ...] = ()  # the pending, held or refused flags last reported
        self.held: Trial | None = None  # the peer's trial that holds [vllm.flags] back

    def notice(self, recent: list[Action] | None, engine: EngineState, parts: Parts) -> None:
        """Take the ledger's newest flag change (the daemon's or `vkvagent apply`'s) as the
        one to judge, against the engine's run before it. ``recent``: the ledger's latest
        actions, newest first (None: the ledger could not be read)."""
        if recent is None:
            return
        run, ignore = engine.run, parts.drain_flag_names()
        for action in recent:
            if action.kind != "apply" or action.outcome != "done":
                continue
            if self.state.last is not None and action.id <= self.state.last.action:
                return
            # The daemon's own change is noticed before the engine reads the new run; one of
            # `vkvagent apply` may be noticed after: then the engine's previous run stands.
            earlier = run.started is None or run.started < action.started
            base = engine.baseline if earlier else engine.previous
            before = run.key if earlier else None if base is None else base.run
            change = change_of(
                action.id, action.started, action.ended, action.detail, ignore, before,
                None if base is None else base.server,
            )  # fmt: skip
            if change is not None:
                self.state = self.state.noticed(change)
                return

    def due(
        self,
        parts: Parts,
        plan: Plan | str | None,
        peers: Sequence[Trial] = (),
        server: str = "",
        now: float = 0.0,
    ) -> FlagsDue | None:
        """The flag change the next restart should carry: a slower change to put back, else
        [vllm.flags] when the unit runs other values and the set was not rejected, here or
        by a peer of the group that runs the same ``server``, and no such peer is trying it
        (``peers``: their trials; ``now``: UTC seconds)."""
        self.held = None
        last = self.state.last
        if last is not None and last.rollback_due and parts.actuator is not None:
            try:
                back = parts.actuator.plan_back(last.before)
            except ActuatorError:
                return None
            if back.changed:
                what = f"roll back {shown(last.flags)} ({last.ratio or 0:.2f} of the fresh speed)"
                return FlagsDue("rollback", what, back, last.key)
            # Someone put it back already (`vkvagent rollback`): nothing left to do.
            self.state = self.state.rolled_back("by someone: the line before runs")
        if not isinstance(plan, Plan):
            return None
        ignore = parts.drain_flag_names()
        key = desired_key(plan, ignore)
        self.state = self.state.desired(key)
        changes = pending(plan, ignore)
        if not plan.changed or not changes or key in self.state.rejected:
            return None
        self.held = held_back(peers, key, server, now)
        if self.held is not None:
            return None
        return FlagsDue("apply", f"apply {shown(changes)}", plan, key)

    def trials(self, host: str) -> list[Trial]:
        """What this host tells its group of its flag sets (``FlagState.trials``)."""
        return self.state.trials(host)

    def announce(
        self, group: FleetTrials, due: FlagsDue, server: str, now: float
    ) -> FlagsDue | None:
        """Just before a restart that would carry [vllm.flags] (``due``), take the set's turn
        in the group (``FleetTrials.turn``: one host at a time), read the peers' trials
        afresh and, when none holds the set back, tell the group this host is trying it.
        None: held back, by the peer that has the turn, is trying the set or rejected it,
        or by etcd not answering."""
        if due.kind != "apply":
            return due
        host = group.fleet.host
        mine = Trial(host, due.key, server, "trying", now)
        with group.turn(mine) as other:
            self.held = other or held_back(group.learned(fresh=True), due.key, server, now)
            if self.held is None:
                group.share([*self.trials(host), mine])
                self.held = group.unanswered(mine)  # the read or the put: the group not told
        return due if self.held is None else None

    def slower(self, due: FlagsDue | None) -> float | None:
        """``Observation.flags_slower``: for a rollback, the speed the change was judged at."""
        last = self.state.last
        if due is None or due.kind != "rollback" or last is None:
            return None
        return last.ratio

    def say(
        self, parts: Parts, plan: Plan | str | None, due: FlagsDue | None, decision: Decision
    ) -> None:
        """An event when flags become pending (and when they will be applied), or are
        refused; once each. systemd not answering changes nothing."""
        if isinstance(plan, str) and plan.startswith("unknown"):
            return
        apply = parts.config.vllm.apply_flags
        said: tuple[str, ...] = ()
        if isinstance(plan, str):
            said = ("refused", plan)
        elif due is not None:
            said = ("pending", due.what)
        elif self.held is not None:
            said = ("held", held_words(self.held))
        if said == self._said:
            return
        self._said = said
        if self.held is not None and said[:1] == ("held",) and isinstance(plan, Plan):
            self.emit(
                "flags.held",
                f"[vllm.flags] held back: {said[1]}",
                flags=rendered(pending(plan, parts.drain_flag_names())),
                peer=self.held.host,
                trial=self.held.state,
            )
        elif isinstance(plan, str) and said:
            self.emit(
                "flags.refused",
                f"[vllm.flags] refused, not applied until the config changes: {plan}",
                flags=rendered(parts.config.vllm.flags),
                error=plan,
            )
        elif due is not None:
            self.emit(
                "flags.pending",
                f"flags pending: {due.what}; waiting for {waiting_for(apply, decision, due)}",
                kind=due.kind,
                flags=rendered(due.plan.changes),
                apply=apply,
                next_window=decision.next_window.astimezone(timezone.utc).isoformat()
                if decision.next_window
                else None,
            )

    def carried(
        self, ledger: Ledger, due: FlagsDue, outcome: Outcome | None, server: str = ""
    ) -> None:
        """What a restart that carried a flag change did with it. A set is rejected only when
        vLLM failed with it (not ready, or not proven): a refused D-Bus call or a foreign
        drop-in says nothing about the flags. ``server``: the one it was tried from."""
        if outcome is None or outcome.result == "aborted":
            return  # nothing reached the unit: due again at the next restart
        if due.kind == "rollback":
            how = f"{outcome.result} (action {outcome.action_id})"
            if outcome.result != "done":
                how += f": {outcome.message}"
            self.state = self.state.rolled_back(how)
            return
        if (
            outcome.result == "done"
            or outcome.gpus_held
            or not _vllm_failed(ledger, outcome.action_id)
        ):
            return  # (GPUs held by other processes: the flags were never tried)
        why = f"vLLM did not start or run with them (action {outcome.action_id}): "
        why += outcome.vllm_error or outcome.message
        self.state = self.state.reject(due.key, why, server)
        self.emit(
            "flags.refused",
            f"{due.what} refused, not tried again until [vllm.flags] changes: {why}",
            flags=rendered(due.plan.changes),
            error=why,
        )

    def judge(self, parts: Parts, decision: Decision) -> None:
        """The verdict on the last flag change, once its run can be compared."""
        run = decision.state
        self.state, judged = self.state.judge(
            run_started=run.run.started,
            run_uptime=decision.uptime,
            previous=run.previous,
            current=run.baseline,
            settings=parts.settings.baseline,
            margin=parts.config.vllm.rollback_margin,
        )
        if judged is None:
            return
        change, found = judged.change, judged.comparison
        if found is None:
            message = f"no verdict on flag change {change.action}: {judged.why}"
        else:
            message = (
                f"flag change {change.action} ({shown(change.flags)}): {change.verdict}, "
                f"{found.ratio:.2f} of the previous flags' fresh speed at "
                f"{', '.join(found.loads)}"
            )
            if change.verdict == "worse":
                message += "; the previous command line goes back at the next restart allowed"
        self.emit(
            "flags.judged",
            message,
            action=change.action,
            flags=rendered(change.flags),
            verdict=change.verdict,
            ratio=change.ratio,
            speed_before=change.speed_before,
            speed_after=change.speed_after,
            loads=list(change.loads),
        )

    def status(
        self, parts: Parts, plan: Plan | str | None, due: FlagsDue | None, decision: Decision
    ) -> status.FlagsStatus | None:
        cfg, last = parts.config.vllm, self.state.last
        if not cfg.flags and last is None:
            return None
        running: dict[str, Any] | None = None
        waiting: dict[str, Any] | None = None
        problem = plan if isinstance(plan, str) else None
        if isinstance(plan, Plan):
            ignore = parts.drain_flag_names()
            running = running_values(plan)
            waiting = pending(plan, ignore) or None
            why = self.state.rejected.get(desired_key(plan, ignore))
            if waiting and why:
                problem = f"rejected: {why}"
            elif waiting and self.held is not None:
                problem = f"held back: {held_words(self.held)}"
        # The status's part is the change's own document, less what only the loop needs.
        change = None if last is None else status.FlagChange.from_json(last.to_json())
        return status.FlagsStatus(
            apply=cfg.apply_flags,
            desired=dict(cfg.flags),
            running=running,
            pending=waiting,
            due=None if due is None else due.what,
            waiting_for=None if due is None else waiting_for(cfg.apply_flags, decision, due),
            problem=problem,
            last_change=change,
        )


def proposed(apply: str, due: FlagsDue | None) -> str:
    """``Observation.flags_due``: the change the engine may propose a restart for, under
    ``apply`` (apply_flags). A rollback in every mode but manual; [vllm.flags] only under
    next-window."""
    if due is None or apply == "manual":
        return ""
    return due.what if due.kind == "rollback" or apply == "next-window" else ""


def in_effect(parts: Parts, plan: Plan | str | None) -> dict[str, Any]:
    """The managed flags as the unit's command line sets them (the drain's left out): part
    of the server's identity, so a run is compared only with runs of the same flags. The
    configured ones when the command line cannot be read."""
    if not isinstance(plan, Plan):
        return dict(parts.config.vllm.flags)
    ignore = parts.drain_flag_names()
    running = running_values(plan).items()
    return {k: v for k, v in running if v is not None and k not in ignore}


def pending(plan: Plan, ignore: frozenset[str]) -> dict[str, Any]:
    """The values of [vllm.flags] the unit does not run (the drain's, ``ignore``, left
    out)."""
    return {k: v for k, v in plan.changes.items() if k not in ignore}


def desired_key(plan: Plan, ignore: frozenset[str]) -> str:
    """The name of the flag set ``plan`` applies, the drain's flags (``ignore``) left out."""
    return flags_key({k: v for k, v in plan.flags.items() if k not in ignore})


def held_words(trial: Trial) -> str:
    """Why a peer's trial holds [vllm.flags] back, in words."""
    if trial.state == "rejected":
        return f"{trial.host} rejected it: {trial.why}"
    if trial.state == UNASKED:
        return f"the group could not be asked ({trial.why}); it waits for etcd"
    since = datetime.fromtimestamp(trial.since or 0.0, timezone.utc).strftime("%Y-%m-%d %H:%M")
    return f"{trial.host} is trying it since {since} UTC; its verdict first"


def waiting_for(apply: str, decision: Decision, due: FlagsDue) -> str:
    """What a due flag change waits for, in words."""
    if apply == "manual":
        command = "apply" if due.kind == "apply" else "rollback"
        return f"`vkvagent {command}` (apply_flags = manual)"
    if apply == "with-next-restart" and due.kind == "apply":
        return "the next restart (apply_flags = with-next-restart)"
    if decision.cause == FLAGS:
        return "a restart now" if decision.action == "restart" else decision.reason.split(";")[0]
    return "the next restart the policy allows, once nothing else is wrong"


def running_values(plan: Plan) -> dict[str, Any]:
    """The values the unit's command line gives the flags ``plan`` sets (None: unset)."""
    try:
        running = parse_command(plan.before)
    except VllmCommandError:
        return {}
    return {name: running.value(name) for name in plan.flags}


def _vllm_failed(ledger: Ledger, action_id: int) -> bool:
    """Whether an action failed at vLLM's start or its proof, not before."""
    try:
        action = ledger.action(action_id)
    except LedgerError:
        return False
    return action.reached("ready") and not action.finished("attest")
