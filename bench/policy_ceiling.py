"""How close to the SLO oracle a rule that cannot see ahead gets (``make bench-policy-ceiling``).

The SLO oracle knows every minute's traffic and the run's whole decline. A rule that knows
neither can still restart each run once it is old enough, at a lull: at the first minute,
from an uptime of ``hours``, whose request rate is at or below the ``quantile`` of the day
before it. This module scores that rule over a grid of both, cutting the requests in flight
off or draining them, under the benchmark's [slo], against the oracle. The best of the grid
is picked in hindsight, per scenario: a ceiling for rules of this shape, not a policy. It
says how much of vkvagent's distance to the oracle an online rule can close.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from bench.policy import vkvagent_settings
from bench.policy_model import (
    DAY_STEPS,
    HOUR,
    VARIANTS,
    WORLDS,
    Model,
    attained,
    slo_optima,
    walk,
    when,
)
from vkvagent.engine.slo import SloSettings

UPTIMES_H = tuple(range(20, 46, 2))
QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)  # 1.0: no lull asked for, at the uptime


def lull_schedule(model: Model, hours: float, quantile: float) -> list[int]:
    """The steps at which the rule restarts: the first step, from ``hours`` of uptime, whose
    rate is at or below the ``quantile`` of the day before it (of what there is of it)."""
    steps, uptime = [], model.first_uptime
    for k in range(model.steps):
        if uptime >= hours * HOUR:
            before = model.rate[max(0, k - DAY_STEPS) : k] if k else model.rate[:1]
            if model.rate[k] <= np.quantile(before, quantile):
                steps.append(k)
                uptime = 0
        uptime += 1
    return steps


class Found(NamedTuple):
    """One rule of the grid, scored."""

    of_oracle: float  # its latency attainment's score over the oracle's
    spent: float  # the availability budget it spends
    hours: float
    quantile: float
    drained: bool
    restarts: list[int]


def grid(
    model: Model,
    slo: SloSettings,
    top: float,
    uptimes: Sequence[float] = UPTIMES_H,
    quantiles: Sequence[float] = QUANTILES,
) -> list[Found]:
    """Every rule of the grid that meets availability, the best first; ``top``: the oracle's
    score."""
    found = []
    for hours in uptimes:
        for quantile in quantiles:
            steps = lull_schedule(model, hours, quantile)
            for drained in (False, True):
                got = attained(model, walk(model, steps, drained, slo=True), slo)
                spent = got.spent(slo, "availability")
                if spent <= 1:
                    score = got.score(slo) / top
                    found.append(Found(score, spent, hours, quantile, drained, steps))
    return sorted(found, key=lambda f: -f.of_oracle)


def _best(found: Sequence[Found], drained: bool) -> str:
    best = next((f for f in found if f.drained == drained), None)
    if best is None:
        return "none meets availability"
    return (
        f"{best.of_oracle:.3f} ({best.hours:g} h, quantile {best.quantile:g}: "
        f"{len(best.restarts)} restarts, {best.spent:.2f} of the budget)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", action="append", help="only these (repeatable)")
    args = parser.parse_args(argv)
    every = (*WORLDS, *VARIANTS)
    worlds = [w for w in every if w.name in args.scenario] if args.scenario else list(WORLDS)
    if not worlds:
        parser.error(f"no such scenario (have: {', '.join(w.name for w in every)})")
    slo = vkvagent_settings(slo=True).slo
    print("| scenario | oracle's restarts | the best rule, cut off | the best rule, drained |")
    print("|---|---|---|---|")
    for world in worlds:
        model = Model(world)
        (best,) = slo_optima(model, slo, (None,))
        path = walk(model, best.restarts, None, best.rollbacks, slo=True)
        oracle = attained(model, path, slo)
        found = grid(model, slo, oracle.score(slo))
        times = ", ".join(f"{when(k):%a %H:%M}" for k in best.restarts) or "none"
        spent = oracle.spent(slo, "availability")
        print(
            f"| {world.name} | {times} ({spent:.2f} of the budget) | {_best(found, False)} | "
            f"{_best(found, True)} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
