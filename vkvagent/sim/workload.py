"""Simulated demand: when requests arrive (a rate curve) and how big they are (a real mix).

Arrivals are a Poisson process whose rate follows either a constant or a real week of
production traffic (ServeGen) scaled to a chosen peak. Request sizes are drawn from a real hour
of Azure conversation requests. Everything draws from one seeded generator, so a seed and a
sequence of intervals give the same requests every time.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
import random
from dataclasses import dataclass
from importlib import resources
from typing import Callable

RateCurve = Callable[[float], float]  # simulated seconds -> requests per second

WEEK = 7 * 86400.0


@dataclass(frozen=True)
class Request:
    arrival: float  # simulated seconds since the server started
    prompt_tokens: int
    output_tokens: int


def _data(name: str) -> str:
    return resources.files("vkvagent.sim").joinpath(f"data/{name}").read_text(encoding="utf-8")


def constant(rate: float) -> RateCurve:
    return lambda _t: rate


def servegen_week(peak: float) -> RateCurve:
    """The ServeGen week (10-minute windows, diurnal; its t=0 is a midnight) scaled so its
    busiest window is ``peak`` requests/s. Repeats weekly."""
    rows = list(csv.DictReader(io.StringIO(_data("servegen-week.csv"))))
    starts = [float(r["window_start_s"]) for r in rows]
    rates = [float(r["total_rate_rps"]) for r in rows]
    scale = peak / max(rates)

    def rate(t: float) -> float:
        at = t % WEEK
        return rates[max(0, bisect.bisect_right(starts, at) - 1)] * scale

    return rate


def azure_sizes() -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of every request in the Azure conversation hour."""
    rows = csv.DictReader(io.StringIO(_data("azure-conv-sizes.csv")))
    return [(int(r["prompt_tokens"]), max(1, int(r["output_tokens"]))) for r in rows]


class Workload:
    """Draws the requests arriving in each interval; ``multiplier`` scales demand (surges)."""

    def __init__(self, rate: RateCurve, sizes: list[tuple[int, int]], rng: random.Random) -> None:
        self.rate = rate
        self.sizes = sizes
        self.rng = rng

    def arrivals(self, start: float, end: float, multiplier: float = 1.0) -> list[Request]:
        """Requests arriving in [start, end), in arrival order."""
        expected = max(0.0, self.rate(start) * multiplier * (end - start))
        count = _poisson(self.rng, expected)
        times = sorted(start + self.rng.random() * (end - start) for _ in range(count))
        return [Request(t, *self.rng.choice(self.sizes)) for t in times]


def _poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    if mean > 50:  # normal approximation: exact enough, and constant time
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k
