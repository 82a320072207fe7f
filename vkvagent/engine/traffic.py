"""The traffic profile: this host's request rates by local hour of the day.

What is a busy hour depends on the host: the policy's percentile traffic gate holds a window
busier than this host usually is at that hour, prevention restarts in its quiet hours, and an
[slo]'s availability counts the requests its clients send while vLLM is down. All of them read
one profile the engine keeps in its state: per local hour (the policy's time zone), how many
minutes fell in each quarter-octave bin of request rate, old weeks fading.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any
from zoneinfo import ZoneInfo

# The traffic profile: one value a minute per local hour of the day, in quarter-octave bins of
# request rate; an hour's percentile is known once it holds an hour of values, and an hour that
# reaches two weeks of values is halved, so old weeks fade and the profile stays small.
PROFILE_EVERY = 60.0  # seconds between two values kept
PROFILE_MIN_VALUES = 60  # values an hour of the day needs before its percentile is known
PROFILE_MAX_VALUES = 14 * 60  # values an hour of the day holds before all of them are halved
PROFILE_BINS_PER_OCTAVE = 4
PROFILE_FLOOR = 1 / 64  # requests/s; slower counts as idle (bin -1)
# Values each hour of the day needs before its median rate tells prevention's quiet hours: half
# an hour's (a restart's outage leaves its hour short of a full one).
TYPICAL_MIN_VALUES = 30


def rate_bin(rate: float) -> int:
    """The profile bin of a request rate: -1 below PROFILE_FLOOR, then quarter octaves."""
    if not rate >= PROFILE_FLOOR:  # also NaN
        return -1
    return math.floor(math.log2(rate / PROFILE_FLOOR) * PROFILE_BINS_PER_OCTAVE)


def bin_top(index: int) -> float:
    """The highest rate (requests/s) a bin holds."""
    return PROFILE_FLOOR * 2 ** ((index + 1) / PROFILE_BINS_PER_OCTAVE)


def _percentile(counts: Mapping[int, float], percent: float) -> int:
    """The bin holding the ``percent``-th percentile of ``counts`` (bin -> n, not empty)."""
    total, running = sum(counts.values()), 0.0
    for index in sorted(counts):
        running += counts[index]
        if running >= total * percent / 100 - 1e-9:
            return index
    return max(counts)


def _bin_middle(index: int) -> float:
    return 0.0 if index < 0 else PROFILE_FLOOR * 2 ** ((index + 0.5) / PROFILE_BINS_PER_OCTAVE)


@dataclass(frozen=True)
class TrafficProfile:
    """This host's request rates by local hour of the day (in the policy's time zone), for the
    percentile traffic gate and prevention's quiet hours: per hour, how many minutes fell in
    each rate bin. Pure: ``record`` returns a new profile (itself when a value is not due
    yet)."""

    hours: Mapping[int, Mapping[int, float]] = field(default_factory=dict)  # hour -> bin -> n
    last: float | None = None  # UTC Unix seconds of the last value kept

    @cached_property
    def typical(self) -> tuple[float, ...] | None:
        """Each local hour's median rate (its bin's middle, the idle bin's 0), once every hour
        holds TYPICAL_MIN_VALUES values, else None; worked out once per profile (a minute)."""
        if any(self.count(hour) < TYPICAL_MIN_VALUES for hour in range(24)):
            return None
        return tuple(_bin_middle(_percentile(self.hours[hour], 50)) for hour in range(24))

    def record(self, rate: float, now: datetime, zone: ZoneInfo) -> TrafficProfile:
        """The profile with ``rate`` (requests/s) at ``now``, at most one value a minute."""
        at = now.timestamp()
        if self.last is not None and 0 <= at - self.last < PROFILE_EVERY:
            return self
        hour = now.astimezone(zone).hour
        counts = dict(self.hours.get(hour, {}))
        index = rate_bin(rate)
        counts[index] = counts.get(index, 0.0) + 1.0
        if sum(counts.values()) >= PROFILE_MAX_VALUES:
            counts = {k: n / 2 for k, n in counts.items() if n / 2 >= 0.25}
        hours = dict(self.hours)
        hours[hour] = counts
        return TrafficProfile(hours, at)

    def median(self, hour: int) -> float | None:
        """The hour's median request rate (its bin's middle), once it holds
        TYPICAL_MIN_VALUES values."""
        if self.count(hour) < TYPICAL_MIN_VALUES:
            return None
        return _bin_middle(_percentile(self.hours[hour], 50))

    def count(self, hour: int) -> float:
        return sum(self.hours.get(hour, {}).values())

    def percentile_bin(self, hour: int, percent: float) -> int | None:
        """The bin holding the ``percent``-th percentile of the hour's rates; None until the
        hour holds PROFILE_MIN_VALUES values."""
        if self.count(hour) < PROFILE_MIN_VALUES:
            return None
        return _percentile(self.hours[hour], percent)

    def to_json(self) -> dict[str, Any]:
        return {
            "last": self.last,
            "hours": {
                str(h): {str(b): n for b, n in sorted(c.items())}
                for h, c in sorted(self.hours.items())
            },
        }

    @classmethod
    def from_json(cls, data: Any) -> TrafficProfile:
        """The inverse of ``to_json``; ValueError (one line) for anything malformed."""
        try:
            last = data["last"]
            if last is not None and (isinstance(last, bool) or not isinstance(last, (int, float))):
                raise ValueError(f"last must be a number or null, got {last!r}")
            hours: dict[int, dict[int, float]] = {}
            for hour, counts in data["hours"].items():
                if not 0 <= int(hour) <= 23:
                    raise ValueError(f"hour {hour!r} out of 0-23")
                hours[int(hour)] = {}
                for index, n in counts.items():
                    if isinstance(n, bool) or not isinstance(n, (int, float)) or not n >= 0:
                        raise ValueError(f"hour {hour}: bad count {n!r}")
                    hours[int(hour)][int(index)] = float(n)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"traffic profile: malformed ({type(exc).__name__}: {exc})") from None
        except ValueError as exc:
            raise ValueError(f"traffic profile: {exc}") from None
        return cls(hours, None if last is None else float(last))
