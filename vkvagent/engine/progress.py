"""Progress: whether the engine is moving, and how long it has had work without moving.

A stall is told by clocks, not by one sample: when a work counter last moved, and since when
the engine has had work by its gauges, overall and on each data-parallel engine (one engine
stuck among busy ones moves the totals nowhere near a stall). The active probe's findings
(``ProbeFacts``, from adapters.probe) settle what the gauges cannot: an answered probe proves
the engine alive, an unanswered one that it was not idle but stuck. Diagnosis names the
``stall`` from the ``Stall`` these clocks give; tick carries the clocks in the diagnosis state.

Every time is monotonic seconds (``Sample.mono``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from vkvagent.engine.samples import EngineSignals, VllmMetrics


@dataclass(frozen=True)
class Progress:
    """The stall clocks (monotonic seconds): ``since``, when the engine last showed progress
    or had, by its gauges, nothing to do; ``advanced``, when a work counter last moved (the
    first sample of a run counts as a move, rather than accuse the engine)."""

    since: float | None = None
    advanced: float | None = None
    # With several data-parallel engines, ``since`` of each (engine label, since): one engine
    # stuck among busy ones moves the totals nowhere near a stall.
    engines: tuple[tuple[str, float], ...] = ()

    def observe(self, before: VllmMetrics | None, after: VllmMetrics, mono: float) -> Progress:
        moved = before is None or self.advanced is None or _advanced(before, after)
        advanced = mono if moved else self.advanced
        since = mono if moved or self.since is None or _pending(after) <= 0 else self.since
        return Progress(since, advanced, self._engines(before, after, mono))

    def _engines(
        self, before: VllmMetrics | None, after: VllmMetrics, mono: float
    ) -> tuple[tuple[str, float], ...]:
        if len(after.per_engine) < 2:
            return ()
        clocks = dict(self.engines)
        previous = {e.engine: e for e in before.per_engine} if before is not None else {}
        out: list[tuple[str, float]] = []
        for engine in after.per_engine:
            old, since = previous.get(engine.engine), clocks.get(engine.engine)
            if old is None or since is None or _advanced(old, engine) or _pending(engine) <= 0:
                since = mono
            out.append((engine.engine, since))
        return tuple(out)

    def stalled(self, latest: VllmMetrics, mono: float, probe: ProbeFacts) -> Stall:
        """How long the engine has had work and made no progress: work by its gauges (no
        longer counted from a probe answered since), or a probe sent since its counters last
        moved that got no answer (then counted from that last move: the probe proves the
        engine was not idle but stuck)."""
        answered = probe.answered if probe.answered is not None else -math.inf
        gauges, evidence = 0.0, "requests pending"
        if self.since is not None and _pending(latest) > 0:
            gauges = max(0.0, mono - max(self.since, answered))
        signals = {e.engine: e for e in latest.per_engine}
        for engine, since in self.engines:
            signal = signals.get(engine)
            if signal is not None and _pending(signal) > 0:
                stuck = max(0.0, mono - max(since, answered))
                if stuck > gauges:
                    gauges = stuck
                    evidence = f"requests pending on engine {engine} of {len(signals)}"
        probed = 0.0
        if (
            probe.unanswered is not None
            and self.advanced is not None
            and probe.unanswered >= self.advanced
        ):
            probed = max(0.0, mono - max(self.advanced, answered))
        if probed > gauges:
            return Stall(probed, "a probe got no answer")
        return Stall(gauges, evidence if gauges else "")


@dataclass(frozen=True)
class Stall:
    """How long the engine has had work without progress, and what says it had work."""

    seconds: float = 0.0
    evidence: str = ""  # "requests pending" (the gauges), "a probe got no answer", or ""


@dataclass(frozen=True)
class ProbeFacts:
    """What the active probe found (monotonic send times): the last probe answered, the
    latest unanswered one since (timed out, or a server error) and the last sent. All None:
    no probe (replay, or the probe switched off)."""

    answered: float | None = None
    unanswered: float | None = None
    last_sent: float | None = None


def _pending(signals: VllmMetrics | EngineSignals) -> float:
    return (signals.num_requests_running or 0) + (signals.num_requests_waiting or 0)


def _advanced(before: VllmMetrics | EngineSignals, after: VllmMetrics | EngineSignals) -> bool:
    compared = False
    for read in _WORK:
        old, new = read(before), read(after)
        if old is not None and new is not None:
            compared = True
            if new != old:  # up, or down after a reset: either way the engine moved
                return True
    return not compared  # nothing to compare: cannot tell, so do not accuse


_WORK: tuple[Callable[[VllmMetrics | EngineSignals], float | None], ...] = (
    lambda m: m.generation_tokens_total,
    lambda m: m.engine_steps_total,
    lambda m: m.prompt_tokens_total,
    lambda m: m.request_success_total,
)
