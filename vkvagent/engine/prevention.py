"""Prevention: restart before this server slows down, from what its own past runs did.

A run diagnosed with ``uptime_decline`` whose restart cured it (the next run was as fast as
its fresh self again) shows at what uptime this server begins to lose speed, and how fast.
Each run keeps its speed, against its fresh baseline at the window's exact load, by half hour
of uptime (``Track``); the run in progress's own fit (``decline``) tells diagnosis it is
declining before it is a quarter slower. From the cured runs of the same server (vLLM
version, model, cache config, flags), a hinge fit gives the onset ``u0`` and the rate ``r``
(fraction of speed lost per second after it).

Restarting every ``T`` seconds then loses ``(C + r (T - u0)^2 / 2) / T`` of the service, with
``C`` the service a restart itself costs (its outage, measured between runs). That is least at
``T* = sqrt(u0^2 + 2 C / r)``, the renewal optimum: the runbook's fixed timer, timed from this
host's own runs. A run of the same server is due for a preventive restart from ``T*`` on, and
the policy decides where it goes (in a window, or at once when waiting costs more).

A run first seen late (vkvagent installed on a server up for hours) is tracked against its late
baseline, a speed already lost; once the next run's fresh speed says how much faster the
restart made it, its track is scaled to that fresh speed and counts like any other. So is a
run whose first busy hours came ``LATE_START`` or more into it (a quiet night), once the next
run is more than ``SLOWED_BASELINE`` faster than its baseline: that baseline was learned
already slowed. The run
in progress adds its own points where no cured run has any (before the late run was first
seen): a run that keeps its speed moves the onset on.

Evidence ages: runs that ended more than ``max_age`` ago no longer count, so a server that
stopped declining (an upgrade is another server anyway) is let run long enough, once, to show
it. Pure: values in, values out; ``to_json``/``from_json`` make it persistable.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vkvagent.engine.samples import optional_float

BUCKET = 1800.0  # seconds of uptime per point of a run's speed track
TRACKED = 48 * 3600.0  # uptime tracked: a decline that waits longer is left to diagnosis
KEPT = 6  # degraded runs kept per engine state (the newest)
MIN_POINTS = 6  # buckets the fit needs
MIN_FIT = 0.6  # share of the loss's variance the hinge must explain
DEFAULT_OUTAGE = 180.0  # seconds a restart is taken to cost before one was measured
# A cured run first compared this late in it, whose successor was this much faster: its
# baseline was learned already slowed.
LATE_START = 2 * 3600.0
SLOWED_BASELINE = 0.03


@dataclass(frozen=True)
class PreventionSettings:
    """How past runs are trusted (durations in seconds)."""

    max_age: float = 7 * 86400.0  # a cured run counts this long after it ended
    min_runs: int = 1  # cured runs of this server needed before a preventive restart


@dataclass(frozen=True)
class Track:
    """One run's speed by uptime: per bucket, the sum and number of speed ratios seen."""

    run: str
    server: str = ""
    buckets: Mapping[int, tuple[float, int]] = field(default_factory=dict)
    ended: float | None = None  # UTC Unix seconds the next run was first seen (once ended)
    outage: float | None = None  # seconds from its last sample to the next run's first
    next_run: str | None = None  # the run that followed it, whose fresh speed judges the cure
    cured: bool | None = None  # whether that run was as fast as this one's fresh self
    # Tracked against the run's own late baseline (speeds relative to a slowed server): not
    # used until the next run's fresh speed rescales it (``judged``).
    late: bool = False

    def add(self, uptime: float, ratio: float) -> Track:
        if not 0 <= uptime < TRACKED:
            return self
        index = int(uptime // BUCKET)
        total, n = self.buckets.get(index, (0.0, 0))
        buckets = dict(self.buckets)
        buckets[index] = (total + ratio, n + 1)
        return replace(self, buckets=buckets)

    def points(self) -> list[tuple[float, float]]:
        """(uptime in seconds at the bucket's middle, mean speed lost), by uptime."""
        return [
            ((index + 0.5) * BUCKET, 1.0 - total / n)
            for index, (total, n) in sorted(self.buckets.items())
            if n
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "server": self.server,
            "buckets": {str(k): [t, n] for k, (t, n) in sorted(self.buckets.items())},
            "ended": self.ended,
            "outage": self.outage,
            "next_run": self.next_run,
            "cured": self.cured,
            "late": self.late,
        }

    @classmethod
    def from_json(cls, data: Any) -> Track:
        """The inverse of ``to_json``; ValueError (one line) for anything malformed."""
        try:
            buckets = {}
            for key, (total, n) in data["buckets"].items():
                if not isinstance(n, int) or n < 0 or optional_float(total) is None:
                    raise ValueError(f"bucket {key}: bad value")
                buckets[int(key)] = (float(total), n)
            cured = data["cured"]
            if cured is not None and not isinstance(cured, bool):
                raise ValueError("cured must be true, false or null")
            late = data.get("late", False)  # absent in state saved before late tracks
            if not isinstance(late, bool):
                raise ValueError("late must be true or false")
            return cls(
                run=str(data["run"]),
                server=str(data["server"]),
                buckets=buckets,
                ended=optional_float(data["ended"]),
                outage=optional_float(data["outage"]),
                next_run=None if data["next_run"] is None else str(data["next_run"]),
                cured=cured,
                late=late,
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"track: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class Plan:
    """When this server's runs are best restarted, and why."""

    at: float  # T*: the uptime (seconds) a preventive restart is due from
    onset: float  # u0, seconds of uptime
    rate: float  # speed lost per second after the onset
    outage: float  # seconds of service a restart costs
    runs: int  # cured runs it rests on
    peers: int = 0  # of them, the fleet's: other hosts' runs of this server
    measured: bool = False  # ``outage`` was measured between runs, drain and all

    def cost_rate(self, period: float) -> float:
        """The share of the service lost by restarting every ``period`` seconds: one outage
        and the speed lost up to it, per second of the run (least at ``at``)."""
        lost = max(0.0, period - self.onset)
        return (self.outage + self.rate / 2 * lost * lost) / period

    def cost_of_waiting(self, uptime: float, seconds: float) -> float:
        """Service seconds lost, beyond what the renewal optimum loses, by restarting
        ``seconds`` later than at ``uptime`` (past T*, where the loss rate exceeds the
        optimum's average cost rate ``loss(T*)``)."""
        start, end = max(uptime, self.at), uptime + seconds
        if end <= start:
            return 0.0
        return self.rate / 2 * ((end - self.at) ** 2 - (start - self.at) ** 2)

    def words(self) -> str:
        fleet = f" ({self.peers} of them other hosts')" if self.peers else ""
        return (
            f"{self.runs} cured run(s) of this server{fleet} lost speed from "
            f"{self.onset / 3600:.1f} h of uptime at {self.rate * 360000:.2g} %/h; a restart "
            f"costs {self.outage / 60:.0f} min, so restart from {self.at / 3600:.1f} h"
        )

    def evidence(self) -> dict[str, float | int]:
        return {
            "prevent_at_s": self.at,
            "prevent_onset_s": self.onset,
            "prevent_loss_per_h": self.rate * 3600,
            "prevent_outage_s": self.outage,
            "prevent_runs": self.runs,
            "prevent_peer_runs": self.peers,
        }


def plan(
    settings: PreventionSettings,
    tracks: Sequence[Track],
    server: str,
    now: float,
    current: Track | None = None,
    peers: Sequence[Track] = (),
) -> Plan | None:
    """The plan for ``server`` from its cured runs that ended within ``max_age`` of ``now``
    (UTC Unix seconds), with the points of ``current``, the run in progress; None while the
    cured runs are too few or show no clear decline. ``peers``: the cured runs other hosts of
    the fleet published; they count while this host has fewer than ``min_runs`` of its own
    (a new host, or its first run after an upgrade), those that disagree with the others
    left out (``agreeing``), and their outages while it has measured none."""

    def usable(t: Track) -> bool:
        fresh = t.ended is not None and 0 <= now - t.ended <= settings.max_age
        return bool(t.cured) and not t.late and t.server == server and fresh

    own = [t for t in tracks if usable(t)]
    borrowed = [] if len(own) >= settings.min_runs else agreeing([t for t in peers if usable(t)])
    cured = [*own, *borrowed]
    if not server or len(cured) < settings.min_runs:
        return None
    # One point per bucket, the runs' mean: at most TRACKED / BUCKET points to fit.
    pooled: dict[float, list[float]] = {}
    for track in cured:
        for uptime, loss in track.points():
            pooled.setdefault(uptime, []).append(loss)
    # The run in progress fills the uptimes no cured run saw: before a late run was first
    # seen. Where they saw it, its own points are no better (a run's first busy hours are its
    # baseline, at a speed of 1 by definition).
    if current is not None and current.server == server and not current.late:
        for uptime, loss in current.points():
            pooled.setdefault(uptime, [loss])
    fit = hinge([(u, sum(v) / len(v)) for u, v in sorted(pooled.items())])
    if fit is None:
        return None
    onset, rate = fit
    outages = sorted(t.outage for t in tracks if t.outage is not None and t.server == server)
    outages = outages or sorted(t.outage for t in borrowed if t.outage is not None)
    outage = outages[len(outages) // 2] if outages else DEFAULT_OUTAGE
    at = math.sqrt(onset * onset + 2 * outage / rate)
    return Plan(at=at, onset=onset, rate=rate, outage=outage, runs=len(cured),
                peers=len(borrowed), measured=bool(outages))  # fmt: skip


# A peer's run whose own decline reaches a tenth of the speed at an uptime this many times
# sooner or later than the runs' median is left out: another GPU, a noisy neighbour, a bug.
DISAGREES = 2.0
JUDGED_FROM = 3  # peers' runs with a fit of their own needed to call one an outlier


def agreeing(runs: Sequence[Track]) -> list[Track]:
    """The peers' runs to trust: with JUDGED_FROM or more that show a decline of their own,
    those whose decline reaches a tenth of the speed within DISAGREES times of their median
    uptime for it (runs too short to fit add their points, unjudged)."""
    tenth = {}
    for run in runs:
        fit = hinge(run.points())
        if fit is not None:
            tenth[run.run] = fit[0] + 0.1 / fit[1]
    if len(tenth) < JUDGED_FROM:
        return list(runs)
    middle = statistics.median(tenth.values())
    return [
        r
        for r in runs
        if r.run not in tenth or middle / DISAGREES <= tenth[r.run] <= middle * DISAGREES
    ]


def hinge(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """The best fit of ``loss = max(0, rate * (uptime - onset))`` to (uptime, loss) points,
    by least squares over each point's uptime as the onset; None with fewer than MIN_POINTS
    points, no decline, or a fit explaining less than MIN_FIT of the variance."""
    if len(points) < MIN_POINTS:
        return None
    losses = [loss for _u, loss in points]
    mean = sum(losses) / len(losses)
    spread = sum((loss - mean) ** 2 for loss in losses)
    if spread <= 0:
        return None
    best: tuple[float, float, float] | None = None  # (error, onset, rate)
    for onset in sorted({0.0, *(u for u, _loss in points)}):
        after = [(u - onset, loss) for u, loss in points if u > onset]
        xx = sum(x * x for x, _loss in after)
        if xx <= 0:
            continue
        rate = sum(x * loss for x, loss in after) / xx
        if rate <= 0:
            continue
        error = sum(loss * loss for u, loss in points if u <= onset)
        error += sum((loss - rate * x) ** 2 for x, loss in after)
        if best is None or error < best[0]:
            best = (error, onset, rate)
    if best is None or 1 - best[0] / spread < MIN_FIT:
        return None
    return best[1], best[2]


def decline(track: Track | None, uptime: float | None) -> float | None:
    """The speed ``track``'s run has lost by ``uptime`` on its own trend: the hinge fit of its
    completed half hours, carried no further than the half hour after the last of them (not
    across hours without points: idle, or past TRACKED). None without a clear decline (fewer
    than MIN_POINTS half hours, no fit). It tells the first run of a server declining long
    before it is a quarter slower."""
    if track is None or uptime is None:
        return None
    done = tuple(p for p in track.points() if p[0] + BUCKET / 2 <= uptime)
    fit = _hinge(done)  # refitted once a half hour completes, not every tick
    if fit is None:
        return None
    onset, rate = fit
    return rate * max(0.0, min(uptime, done[-1][0] + 1.5 * BUCKET) - onset)


@functools.lru_cache(maxsize=16)  # a few engines in one process (tests, the fleet) share it
def _hinge(points: tuple[tuple[float, float], ...]) -> tuple[float, float] | None:
    return hinge(points)


# A gap between two runs longer than this is not a restart's outage (the agent was stopped).
MAX_OUTAGE = 3600.0


def ended(
    tracks: Sequence[Track], track: Track, next_run: str, at: float, gap: float | None
) -> tuple[Track, ...]:
    """The tracks kept with ``track`` added, its run ended: ``next_run`` followed it, first
    seen at ``at`` (UTC), ``gap`` seconds after its last sample; the newest KEPT."""
    outage = gap if gap is not None and 0 < gap <= MAX_OUTAGE else None
    done = replace(track, ended=at, outage=outage, next_run=next_run)
    return (*tracks, done)[-KEPT:]


def judged(
    tracks: Sequence[Track], run: str, cured: bool, speedup: float | None = None
) -> tuple[Track, ...]:
    """The tracks with the one ``run`` followed judged: cured or not, by ``run``'s fresh speed
    over the one it was judged against (``speedup``). A late track cured, or one whose
    baseline was learned already slowed, is scaled by it to its speed against ``run``'s
    fresh self."""
    return tuple(
        _judged(t, cured, speedup) if t.next_run == run and t.cured is None else t for t in tracks
    )


def _judged(track: Track, cured: bool, speedup: float | None) -> Track:
    # A baseline learned hours into the run (its first busy hours came late) that the next
    # run beat by more than noise was learned already slowed: rescaled like a late one's.
    slowed = (
        bool(track.buckets)
        and min(track.buckets) * BUCKET >= LATE_START
        and (speedup or 0.0) > 1 + SLOWED_BASELINE
    )
    if cured and speedup and (track.late or slowed):
        scaled = {k: (total / speedup, n) for k, (total, n) in track.buckets.items()}
        return replace(track, buckets=scaled, late=False, cured=True)
    return replace(track, cured=cured)
