"""The flags loop: keep vLLM's command line as ``[vllm.flags]`` says, and judge every change.

``[vllm] apply_flags`` says when a flag set the unit does not run yet is applied:
``next-window`` (the policy proposes a restart for it, cause ``flags``, in the next window it
allows), ``with-next-restart`` (only when a restart happens anyway) or ``manual`` (only
``vkvagent apply``). Any restart the daemon makes in a window carries the pending flags unless
manual, so a diagnosed restart and a flag change cost one restart, not two; an emergency's
carries none.

Each change the ledger records (the daemon's, or ``vkvagent apply``'s) is judged once: the
fresh speed of the run it started against the run just before it, at the loads both served
while fresh (``engine.speed_change``). Slower by more than ``rollback_margin`` rejects the set
and makes its rollback due (the previous command line, at the next restart the policy
allows); vLLM failing to start or run with a set rejects it too. A rejected or invalid set is
not tried again until ``[vllm.flags]`` asks for another. Too little comparable load is no
verdict, never a rollback.

Pure: the daemon brings the ledger's actions, the engine's baselines and the plan, and does
what ``FlagState`` decides; ``to_json``/``from_json`` keep it in engine.json.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vkvagent.engine import BaselineSettings, SpeedChange, speed_change
from vkvagent.engine.baseline import Baseline
from vkvagent.engine.samples import FlagValue, optional_float

APPLY_MODES = ("next-window", "with-next-restart", "manual")
# A change's verdict: what its run's fresh speed says, against the run before it.
VERDICTS = ("better", "same", "worse", "not judged", "no verdict")
UNJUDGED = "not judged"


def flags_key(flags: Mapping[str, object]) -> str:
    """A flag set's name for remembering it: the same flags and values, the same key."""
    text = json.dumps(sorted(flags.items()), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Change:
    """A flag change that took effect (a ledger action ``done``), and its verdict."""

    action: int  # the ledger's id
    started: float  # UTC seconds: the action began ...
    ended: float  # ... and ended; the run it started began in between
    flags: Mapping[str, FlagValue]  # the flags whose values it changed
    key: str  # flags_key of the whole set it applied
    before: tuple[str, ...]  # the command line it replaced: what a rollback puts back
    # The engine's run before it, when known: its fresh speed is what the change is judged
    # against (a run in between that learned nothing would leave an older one in its place).
    previous_run: str | None = None
    server_before: str | None = None  # the server identity of that run: what a peer matches
    verdict: str = UNJUDGED
    ratio: float | None = None  # the new run's fresh speed / the previous run's
    speed_before: float | None = None  # generated tokens/s per request in the system
    speed_after: float | None = None
    loads: tuple[str, ...] = ()  # the loads compared
    rollback: str | None = None  # for a worse one: how putting it back went; None: not yet

    @property
    def rollback_due(self) -> bool:
        return self.verdict == "worse" and self.rollback is None and bool(self.before)

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "started": self.started,
            "ended": self.ended,
            "flags": dict(self.flags),
            "key": self.key,
            "before": list(self.before),
            "previous_run": self.previous_run,
            "server_before": self.server_before,
            "verdict": self.verdict,
            "ratio": self.ratio,
            "speed_before": self.speed_before,
            "speed_after": self.speed_after,
            "loads": list(self.loads),
            "rollback": self.rollback,
        }

    @classmethod
    def from_json(cls, data: Any) -> Change:
        if data["verdict"] not in VERDICTS:
            raise ValueError(f"unknown verdict {data['verdict']!r}")
        return cls(
            action=int(data["action"]),
            started=float(data["started"]),
            ended=float(data["ended"]),
            flags=dict(data["flags"]),
            key=str(data["key"]),
            before=tuple(str(a) for a in data["before"]),
            previous_run=None if data.get("previous_run") is None else str(data["previous_run"]),
            server_before=None if data.get("server_before") is None else str(data["server_before"]),
            verdict=data["verdict"],
            ratio=optional_float(data.get("ratio")),
            speed_before=optional_float(data.get("speed_before")),
            speed_after=optional_float(data.get("speed_after")),
            loads=tuple(str(load) for load in data.get("loads", ())),
            rollback=None if data.get("rollback") is None else str(data["rollback"]),
        )


@dataclass(frozen=True)
class Judged:
    """A verdict reached this tick, for the event that tells it."""

    change: Change
    comparison: SpeedChange | None  # None: no verdict (the run ended or its fresh period did)
    why: str


@dataclass(frozen=True)
class FlagState:
    """What the loop remembers: the last change and the flag sets it will not try again."""

    last: Change | None = None
    rejected: Mapping[str, str] = field(default_factory=dict)  # flags_key -> why
    # flags_key -> the server identity the rejected set was tried from, where known: what a
    # peer of the fleet matches (``trials``)
    origins: Mapping[str, str] = field(default_factory=dict)

    def noticed(self, change: Change) -> FlagState:
        """With ``change`` (the ledger's newest flag change) as the last, if it is new."""
        if self.last is not None and change.action <= self.last.action:
            return self
        return replace(self, last=change)

    def reject(self, key: str, why: str, server: str = "") -> FlagState:
        """With set ``key`` rejected (tried from ``server``, if known)."""
        origins = {**self.origins, key: server} if server else self.origins
        return replace(self, rejected={**self.rejected, key: why}, origins=origins)

    def desired(self, key: str) -> FlagState:
        """With [vllm.flags] asking for set ``key``: a rejection lasts until the config asks
        for another set, so only this set's is kept."""
        kept = {k: why for k, why in self.rejected.items() if k == key}
        if kept == self.rejected:
            return self
        return replace(self, rejected=kept, origins={k: self.origins[k] for k in kept
                                                      if k in self.origins})  # fmt: skip

    def rolled_back(self, how: str) -> FlagState:
        assert self.last is not None
        return replace(self, last=replace(self.last, rollback=how))

    def judge(
        self,
        *,
        run_started: float | None,
        run_uptime: float | None,
        previous: Baseline | None,
        current: Baseline | None,
        settings: BaselineSettings,
        margin: float,
    ) -> tuple[FlagState, Judged | None]:
        """Judge the last change once the run it started and the run before it have learned
        a load in common. ``run_started``: the engine's run's process start time (UTC)."""
        change = self.last
        if change is None or change.verdict != UNJUDGED:
            return self, None
        if run_started is None or run_started < change.started - 1:
            return self, None  # still the run before the change (or no start time to tell)
        if run_started > change.ended + 1:
            why = "the run it started ended before it could be judged"
            return self._concluded(replace(change, verdict="no verdict"), None, why)
        if previous is not None and change.previous_run not in (None, previous.run):
            why = "the run before it learned no load while fresh"
            return self._concluded(replace(change, verdict="no verdict"), None, why)
        found = (
            speed_change(previous, current, settings)
            if previous is not None and current is not None
            else None
        )
        if found is None:
            fresh_until = (
                current.fresh_until(settings) if current is not None else settings.learn_within
            ) + settings.window
            if run_uptime is not None and run_uptime > fresh_until:
                why = "no load both runs served while fresh"
                return self._concluded(replace(change, verdict="no verdict"), None, why)
            return self, None
        verdict = found.verdict(margin)
        judged = replace(
            change,
            verdict=verdict,
            ratio=found.ratio,
            speed_before=found.before,
            speed_after=found.after,
            loads=found.loads,
        )
        state, concluded = self._concluded(judged, found, "")
        if verdict == "worse":
            state = state.reject(
                change.key,
                f"slower: {found.ratio:.2f} of the previous flags' fresh speed "
                f"(action {change.action})",
                change.server_before or "",
            )
        return state, concluded

    def trials(self, host: str) -> list[Trial]:
        """What this host tells its group (``fleet_flags``): the set its run is trying, not
        judged yet, and the sets it rejected, each with the server it was tried from (a
        rejection whose server is not known stays home)."""
        last, told = self.last, []
        if last is not None and last.verdict == UNJUDGED and last.server_before:
            told.append(Trial(host, last.key, last.server_before, "trying", last.ended))
        for key, why in sorted(self.rejected.items()):
            if self.origins.get(key):
                told.append(Trial(host, key, self.origins[key], "rejected", None, why))
        return told

    def _concluded(
        self, change: Change, found: SpeedChange | None, why: str
    ) -> tuple[FlagState, Judged]:
        return replace(self, last=change), Judged(change, found, why)

    def to_json(self) -> dict[str, Any]:
        return {
            "last": None if self.last is None else self.last.to_json(),
            "rejected": dict(self.rejected),
            "origins": dict(self.origins),
        }

    @classmethod
    def from_json(cls, data: Any) -> FlagState:
        """The inverse of ``to_json``; ValueError (one line) for anything malformed."""
        if data is None:
            return cls()
        try:
            last = None if data["last"] is None else Change.from_json(data["last"])
            rejected = {str(k): str(v) for k, v in data["rejected"].items()}
            origins = {str(k): str(v) for k, v in (data.get("origins") or {}).items()}
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"flag state: {type(exc).__name__}: {exc}") from None
        return cls(last, rejected, origins)


@dataclass(frozen=True)
class Trial:
    """A flag set a host of the group tried from a server (``carry.server_identity`` of the
    run before it): ``trying`` (its run not judged yet) or ``rejected`` (slower than the
    flags before it, or vLLM failed with it: ``why``)."""

    host: str
    key: str  # flags_key of the whole set
    server: str
    state: str  # trying | rejected
    since: float | None = None  # UTC seconds the trying set took effect
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "server": self.server, "state": self.state,
                "since": self.since, "why": self.why}  # fmt: skip

    @classmethod
    def from_json(cls, host: str, data: Any) -> Trial:
        """The inverse of ``to_json``; ValueError (one line) for anything else."""
        try:
            trial = cls(host, str(data["key"]), str(data["server"]), str(data["state"]),
                        optional_float(data.get("since")), str(data.get("why") or ""))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trial: {type(exc).__name__}: {exc}") from None
        trying = trial.state == "trying"
        if trial.state not in TRIAL_STATES or trying != (trial.since is not None):
            raise ValueError(f"trial: state {trial.state!r} with since {trial.since!r}")
        if trial.since is not None and not 0 < trial.since < LATEST:
            raise ValueError(f"trial: since {trial.since!r} is not a time")
        return trial


TRIAL_STATES = ("trying", "rejected")
# Not a peer's: a set held back because its group could not be asked (etcd did not answer).
UNASKED = "unasked"
# A peer's trial holds a set back for at most this long: a verdict comes within the run's
# fresh period (hours), or "no verdict" once it is over; one older is a host that stalled.
TRIAL_FOR = 2 * 86400.0
LATEST = 1e11  # UTC seconds (the year 5138): a trial's time beyond is not one


def held_back(trials: Sequence[Trial], key: str, server: str, now: float) -> Trial | None:
    """The peer's trial that holds set ``key`` back on a host that runs ``server``: one that
    rejected it from the same server, else one that has been trying it within TRIAL_FOR of
    ``now``, either way (a peer's clock may be ahead; one dated further ahead is a lie), so
    that a change reaches one host of the group at a time and stops at the first that finds
    it slower or broken."""
    same = [t for t in trials if t.key == key and t.server == server]
    rejected = [t for t in same if t.state == "rejected"]
    trying = [t for t in same if t.since is not None and abs(now - t.since) < TRIAL_FOR]
    found = rejected or trying
    return found[0] if found else None


def change_of(
    action: int,
    started: float,
    ended: float | None,
    detail: Mapping[str, Any],
    ignore: frozenset[str],
    previous_run: str | None = None,
    server_before: str | None = None,
) -> Change | None:
    """The flag change a ledger action (``apply``, ``done``) made, or None when it changed
    only flags in ``ignore`` (the drain's, which a plain restart adds) or none."""
    changes = detail.get("changes") or {}
    flags = detail.get("flags") or {}
    if not isinstance(changes, dict) or not set(changes) - ignore or ended is None:
        return None
    return Change(
        action=action,
        started=started,
        ended=ended,
        flags={k: v for k, v in changes.items() if k not in ignore},
        key=flags_key({k: v for k, v in flags.items() if k not in ignore}),
        before=tuple(str(a) for a in detail.get("before") or ()),
        previous_run=previous_run,
        server_before=server_before,
    )
