"""Carried baselines: one fresh run's baselines standing in for the next run's.

A run learns its own fresh baselines at the loads it sees; at a load it has not learned yet,
the earlier fresh runs of the same server (``server_identity``: vLLM's version, the model, the
cache config and the configured flags), this host's or a fleet peer's, stand in, once this
run has proven at least ``CARRY_SPEED`` as fast at every load both know. The same comparison
of fresh speeds judges the restart between two runs: did it bring the fresh speed back
(``restored``)?
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from vkvagent.engine.baseline import Baseline
from vkvagent.engine.samples import FlagValue, VllmMetrics

if TYPE_CHECKING:  # tick imports this module: its settings are a type here
    from vkvagent.engine.tick import Settings


def fresh_speeds(settings: Settings, previous: Baseline, current: Baseline) -> list[float]:
    """This run's fresh speed over the previous run's (mean ITL), at each regime this run
    learned and the previous one learned or implies (``Baseline.modelled``)."""
    b = settings.baseline
    ratios = []
    for key in current.known_keys(b):
        load = current.regimes[key].median("generation_tokens_per_s")
        before = previous.known(key, b) or previous.modelled(load, b)
        old = before.median("itl") if before is not None else None
        new = current.regimes[key].median("itl")
        if old is not None and new:
            ratios.append(old / new)
    return ratios


def carried(settings: Settings, previous: Baseline | None, current: Baseline) -> Baseline | None:
    """The previous run's own fresh baselines, to stand in at loads this run has not learned:
    only from the same server (vLLM version, model, cache config and configured flags), and
    once this run has been at least CARRY_SPEED as fast at every load both learned. A
    restart that did not restore the speed, an upgrade, a flag change or a baseline learned
    late carries nothing. A run's own loads always take precedence, so what is passed on from
    run to run is, per load, the newest fresh run that learned it."""
    if previous is None or not previous.regimes or not current.server:
        return None
    if previous.late(settings.baseline):  # it may hold a slowness: never the standard
        return None
    if previous.server != current.server:
        return None
    speeds = fresh_speeds(settings, previous, current)
    return previous if speeds and min(speeds) >= CARRY_SPEED else None


def stand_in(
    settings: Settings, earlier: Sequence[Baseline | None], current: Baseline
) -> tuple[Baseline, ...]:
    """The ``earlier`` baselines that may stand in for this run's (``carried``), in their
    order: the previous run's first, then the fleet's peers' of the same server
    (``Observation.peer_baselines``), so that a new host, or the first run after an upgrade
    that a peer has already run, is judged at the loads a peer learned while fresh."""
    return tuple(b for b in earlier if b is not None and carried(settings, b, current) is not None)


def merged(settings: Settings, standing: Sequence[Baseline]) -> Baseline | None:
    """``standing`` as one baseline: at each load, the first that learned it."""
    if not standing:
        return None
    found = standing[0]
    for other in standing[1:]:
        found = found.merged(other, settings.baseline)
    return found


def supplier(settings: Settings, standing: Sequence[Baseline], key: int | None) -> str:
    """The run whose baseline stands in at regime ``key`` (the first's where none learned
    it: a modelled load)."""
    return next((b.run for b in standing if b.known(key, settings.baseline)), standing[0].run)


def peer_of(run: str) -> str | None:
    """The host whose baseline a run name is, for a peer's (``RUN@HOST``); None for this
    host's own runs."""
    _run, at, host = run.rpartition("@")
    return host if at and host else None


def restored(
    settings: Settings, previous: Baseline, current: Baseline
) -> tuple[bool | None, float | None]:
    """Whether this run's fresh speed matches the previous run's, where both know the same
    regime: the judgement of the restart in between (None until it can be told), and the
    median of this run's speed over the previous run's."""
    ratios = fresh_speeds(settings, previous, current)
    if not ratios:
        return None, None
    ratio = sorted(ratios)[len(ratios) // 2]
    if ratio >= settings.diagnosis.leave_ratio:
        return True, ratio
    if ratio < settings.diagnosis.enter_ratio:
        return False, ratio
    return None, ratio


# A run whose fresh speed is at least this fraction of the previous run's is judged, at loads it
# has not learned, against the previous run's baselines (the noise between two fresh runs of
# one server is a few percent; a slower run would be held to a speed it never had).
CARRY_SPEED = 0.95


def server_identity(metrics: VllmMetrics, flags: Mapping[str, FlagValue]) -> str:
    """What must not change for one run's baselines to stand for another's: vLLM's version,
    the model, the cache config it reports and the flags configured for it."""
    facts = [metrics.version, list(metrics.models), sorted(metrics.cache_config.items())]
    text = json.dumps([*facts, sorted(flags.items())], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
