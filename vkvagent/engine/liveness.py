"""Whether vLLM is up at all: a unit that died and stayed down, a start that never answers, and
exits that come too often (a crash loop).

vLLM 0.32 exits with status 0 when its engine core dies, so ``Restart=on-failure`` leaves it
down; a start can hang before the port opens (tensor parallelism waiting for its engine
processes); and some versions crash every few hours. vkvagent's other causes are about a vLLM
that serves badly. These are about one that does not serve, so a restart interrupts nobody:
they go at any hour, outside the windows, without a drain, but within the daily budget and,
for a crash loop, with a back-off that doubles with each start vkvagent made for it.

Told apart here, from the unit's facts in each sample (its ActiveState, NRestarts, Restart=,
whether it is wanted) and what the caller read from systemd's journal (a stop job someone
asked for):

- ``dead``: the unit is inactive or failed, it is wanted (enabled, or wanted by another unit,
  and not masked), systemd will not start it again, and nobody stopped it on purpose;
- ``start_hung``: the unit is active, has not answered since it became active, and that was
  longer ago than the start timeout: three times the longest start measured on this host (at
  least ``START_FLOOR``), or the configured one;
- ``crash_loop``: at least ``crash_loop_exits`` exits nobody asked for (systemd's restarts
  counted by NRestarts, and a unit going down unasked) within ``crash_loop_window``, while vLLM
  does not serve.

Everything else that is down (stopped on purpose, not wanted, systemd restarting it, a start
still within its time) is ``engine_down``: reported, never acted on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from vkvagent.engine.samples import Sample, UnitFacts

DEAD, START_HUNG, CRASH_LOOP = "dead", "start_hung", "crash_loop"
CAUSES = (DEAD, START_HUNG, CRASH_LOOP)
START_FLOOR = 120.0  # seconds: the shortest learned start timeout
START_FACTOR = 3.0  # a learned start timeout is this many times the longest start measured
STARTS_KEPT = 5  # the newest starts measured, of which the longest sets the timeout
# Restart= values under which systemd starts vLLM again after it exits with status 0.
RESTARTS_AFTER_CLEAN_EXIT = ("always", "on-success")


@dataclass(frozen=True)
class LivenessSettings:
    # Seconds a start may take, whoever started it, before it counts as failed; 0: learned
    # from this host's starts (``START_FACTOR`` times the longest, at least ``START_FLOOR``),
    # and ``start_default`` until one is measured.
    start_timeout: float = 0.0
    start_default: float = 600.0
    crash_loop_exits: int = 3  # exits within crash_loop_window that make a crash loop
    crash_loop_window: float = 3600.0

    def __post_init__(self) -> None:
        if self.start_timeout < 0 or self.start_default <= 0:
            raise ValueError("liveness: start_timeout must be at least 0, start_default above 0")
        if self.crash_loop_exits < 2 or self.crash_loop_window <= 0:
            raise ValueError("liveness: crash_loop_exits must be at least 2, the window above 0")


@dataclass(frozen=True)
class LivenessState:
    """What the samples said of the unit so far."""

    unit: tuple[str, int] | None = None  # (ActiveState, NRestarts) of the last sample read
    exits: tuple[float, ...] = ()  # monotonic times of the exits nobody asked for
    starts: tuple[float, ...] = ()  # seconds the newest starts took, up to an answer
    # UTC time the unit became active, while a start is watched unanswered (None: none is).
    loading: float | None = None

    def timeout(self, settings: LivenessSettings) -> float:
        """The start timeout in effect: the operator's, else learned, else the default."""
        if settings.start_timeout > 0:
            return settings.start_timeout
        if self.starts:
            return max(START_FLOOR, START_FACTOR * max(self.starts))
        return settings.start_default

    def to_json(self) -> dict[str, Any]:
        return {
            "unit": list(self.unit) if self.unit else None,
            "exits": list(self.exits),
            "starts": list(self.starts),
            "loading": self.loading,
        }

    @classmethod
    def from_json(cls, data: Any) -> LivenessState:
        unit = data.get("unit")
        loading = data.get("loading")
        return cls(
            unit=(str(unit[0]), int(unit[1])) if unit else None,
            exits=tuple(float(t) for t in data.get("exits") or ()),
            starts=tuple(float(t) for t in data.get("starts") or ()),
            loading=None if loading is None else float(loading),
        )

    def forget_monotonic(self) -> LivenessState:
        """After a reboot the exits' monotonic times mean nothing: they are dropped."""
        return replace(self, exits=())


def observe(
    settings: LivenessSettings,
    state: LivenessState,
    fresh: Sequence[Sample],
    *,
    stopped: str,
) -> LivenessState:
    """Read the samples not read before: count the exits (NRestarts rising; the unit going
    down when nobody stopped it, ``stopped`` empty) and measure each start watched from its
    beginning to its first answer."""
    for sample in fresh:
        unit = sample.unit
        if unit is None:
            continue
        exits = 0
        if state.unit is not None:
            was_state, was_restarts = state.unit
            if unit.n_restarts > was_restarts:  # a requested start never raises it
                exits = unit.n_restarts - was_restarts
            elif (
                unit.active_state in ("inactive", "failed")
                and was_state in ("active", "activating", "reloading")
                and not stopped
            ):
                exits = 1
        kept = tuple(t for t in state.exits if sample.mono - t < settings.crash_loop_window)
        state = replace(
            state,
            unit=(unit.active_state, unit.n_restarts),
            exits=kept + (sample.mono,) * exits,
            loading=_loading(state, unit, sample),
        )
        if state.loading is not None and sample.vllm is not None:
            took = max(0.0, sample.time - state.loading)
            state = replace(state, starts=(*state.starts, took)[-STARTS_KEPT:], loading=None)
    return state


def _loading(state: LivenessState, unit: UnitFacts, sample: Sample) -> float | None:
    """The activation watched unanswered: seen active, not answering, since it began."""
    if unit.active_state != "active" or unit.active_since is None:
        return None
    if state.loading == unit.active_since:
        return state.loading
    # Only a start seen from its first moments is measured: a daemon that comes to a vLLM
    # already loading, or serving for days, would measure its own arrival.
    if sample.vllm is None and sample.time - unit.active_since < 2 * 60:
        return unit.active_since
    return None


@dataclass(frozen=True)
class Found:
    """A cause this module names, with its one-line summary and evidence."""

    cause: str
    summary: str
    evidence: dict[str, Any]
    reported: bool = False  # nothing for vkvagent to do now: systemd is starting it


def judge(
    settings: LivenessSettings,
    state: LivenessState,
    latest: Sample | None,
    *,
    stopped: str,
    exit_line: str,
    answered_at: float | None,
    mono: float,
) -> tuple[Found | None, str]:
    """With vLLM not answering (the caller knows): the cause to act on, if any, else why it is
    only reported (for ``engine_down``'s summary)."""
    unit = latest.unit if latest is not None else None
    if unit is None:
        return None, ""
    exits = [t for t in state.exits if mono - t < settings.crash_loop_window]
    evidence: dict[str, Any] = {
        "active_state": unit.active_state,
        "sub_state": unit.sub_state,
        "exits": len(exits),
        "restart_policy": unit.restart_policy or None,
    }
    if unit.last_exit:
        evidence["last_exit"] = unit.last_exit
    if exit_line:
        evidence["error"] = exit_line
    why = f": {exit_line}" if exit_line else ""
    looping = len(exits) >= settings.crash_loop_exits
    loop = (
        f"{len(exits)} exits in the last {settings.crash_loop_window / 60:.0f} min "
        f"(crash loop from {settings.crash_loop_exits}){why}"
    )
    if unit.active_state in ("inactive", "failed"):
        if stopped:
            return None, f"stopped on purpose ({stopped}); left down"
        if unit.wanted is False:
            return None, "the unit is not enabled, nor wanted by another unit; left down"
        if unit.sub_state == "auto-restart":
            restarting = Found(CRASH_LOOP, f"{loop}; systemd's Restart= starts it", evidence, True)
            return (restarting if looping else None), "systemd's Restart= is starting it again"
        exited = unit.last_exit or f"{unit.active_state} ({unit.sub_state})"
        if looping:
            return Found(CRASH_LOOP, f"{loop}; down now, {exited}", evidence), ""
        stays = (
            f"Restart={unit.restart_policy} leaves it down"
            if unit.restart_policy and unit.restart_policy not in RESTARTS_AFTER_CLEAN_EXIT
            else "systemd will not start it again"
        )
        return Found(DEAD, f"vLLM {exited} and nobody stopped it; {stays}{why}", evidence), ""
    if unit.active_state != "active" or unit.active_since is None:
        moving = Found(CRASH_LOOP, loop, evidence, True) if looping else None
        return moving, f"the unit is {unit.active_state}"
    loading = latest.time - unit.active_since if latest is not None else 0.0
    if answered_at is not None and answered_at >= unit.active_since:
        return None, ""  # it answered in this activation: not a start (unresponsive's domain)
    limit = state.timeout(settings)
    evidence.update(loading_s=loading, start_timeout_s=limit)
    if loading >= limit:
        learned = "" if settings.start_timeout else f", {_learned(state)}"
        return Found(
            START_HUNG,
            f"started {loading:.0f} s ago and has not answered (start_timeout {limit:.0f} s"
            f"{learned}){why}",
            evidence,
        ), ""
    if looping:
        found = Found(CRASH_LOOP, f"{loop}; starting again ({loading:.0f} s)", evidence, True)
        return found, ""
    return None, f"still loading ({loading:.0f} s of at most {limit:.0f} s)"


def _learned(state: LivenessState) -> str:
    if not state.starts:
        return "none measured yet"
    return f"{START_FACTOR:g} x the longest of {len(state.starts)} starts measured"
