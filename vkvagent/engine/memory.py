"""Memory growth: the vLLM unit's memory rising in step with the requests it served.

A per-request leak on the host (``host_memory_growth``) shows as memory that follows the
requests served, not the time: a least-squares line of bytes against requests over this run,
steep, steady and grown enough to matter, and, with the unit's MemoryMax, when it gets there
at the run's pace (the harm a restart forestalls). A caller keeps the points (``Recent``),
diagnosis names the cause from the trend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # diagnosis imports this module: its settings and evidence are types here
    from vkvagent.engine.diagnosis import DiagnosisSettings, EvidenceValue


@dataclass(frozen=True)
class MemoryPoint:
    """The vLLM unit's memory at one moment (systemd's MemoryCurrent), with the requests the
    run had served by then (``request_success_total``)."""

    mono: float
    bytes: float
    requests_served: float


@dataclass(frozen=True)
class MemoryTrend:
    """Memory rising with requests served: the fit behind ``host_memory_growth``."""

    grown: float  # bytes, along the fitted line over the requests served in the series
    per_request: float  # bytes per request served (the slope)
    correlation: float
    current: float  # bytes now
    span: float  # seconds covered
    limit: float | None = None  # the unit's MemoryMax; None: unlimited
    # Seconds until ``current`` reaches ``limit`` at the series' mean growth per second (its
    # requests at the rate they came); None without a limit.
    to_limit: float | None = None

    def evidence(self) -> dict[str, EvidenceValue]:
        found: dict[str, EvidenceValue] = {
            "memory_growth_bytes": self.grown,
            "bytes_per_request": self.per_request,
            "memory_correlation": self.correlation,
            "memory_bytes": self.current,
            "memory_span_s": self.span,
        }
        if self.limit is not None and self.to_limit is not None:
            found["memory_max_bytes"] = self.limit
            found["memory_limit_in_s"] = self.to_limit
        return found


def memory_growth(
    s: DiagnosisSettings,
    points: Sequence[MemoryPoint],
    since: float | None = None,
    limit: float | None = None,
) -> MemoryTrend | None:
    """Memory that rises steadily with requests served (a per-request leak), or None.

    A least-squares line of bytes against requests served, over this run's points (those
    from monotonic time ``since`` on; oldest first): it must span ``memory_min_span``,
    follow requests closely (correlation) and have grown ``memory_min_growth``. At most
    ``_FIT_POINTS`` points, evenly spread, enter the fit, so a long series costs no more.
    With ``limit`` (MemoryMax), when the growth reaches it at the series' pace."""
    first = 0 if since is None else _first_from(points, since)
    if len(points) - first < 6 or points[-1].mono - points[first].mono < s.memory_min_span:
        return None
    step = max(1, (len(points) - first) // _FIT_POINTS)
    kept = list(points[first::step])
    if kept[-1] is not points[-1]:
        kept.append(points[-1])
    n = len(kept)
    mean_r = sum(p.requests_served for p in kept) / n
    mean_b = sum(p.bytes for p in kept) / n
    srr = sum((p.requests_served - mean_r) ** 2 for p in kept)
    sbb = sum((p.bytes - mean_b) ** 2 for p in kept)
    srb = sum((p.requests_served - mean_r) * (p.bytes - mean_b) for p in kept)
    if srr <= 0 or sbb <= 0:
        return None
    slope = srb / srr
    correlation = srb / math.sqrt(srr * sbb)
    grown = slope * (kept[-1].requests_served - kept[0].requests_served)
    if slope <= 0 or correlation < s.memory_min_correlation or grown < s.memory_min_growth:
        return None
    span = kept[-1].mono - kept[0].mono
    to_limit = None if limit is None else max(0.0, limit - kept[-1].bytes) * span / grown
    return MemoryTrend(grown, slope, correlation, kept[-1].bytes, span, limit, to_limit)


_FIT_POINTS = 64


def _first_from(points: Sequence[MemoryPoint], since: float) -> int:
    """Index of the first point at or after ``since`` (binary search; bisect's ``key`` needs
    Python 3.10)."""
    low, high = 0, len(points)
    while low < high:
        middle = (low + high) // 2
        if points[middle].mono < since:
            low = middle + 1
        else:
            high = middle
    return low
