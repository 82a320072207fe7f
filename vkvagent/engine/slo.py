"""Service-level objectives: what the operator promised clients, measured from vLLM's metrics.

An objective is a share of events that must be good over a period: requests served
(``availability``), requests whose first token came within ``ttft_seconds`` (``ttft``), output
tokens that came within ``itl_seconds`` of the one before (``itl``). What the period may spend
on bad events is the error budget: a restart spends availability (the requests refused while
vLLM is down, and those it cut off), a slow server spends latency.

Counted per interval between two samples of one vLLM run: latency from the TTFT and ITL
histograms' bucket deltas, a target between two bounds interpolated as Prometheus's
``histogram_quantile`` does (``share_within``); availability from the requests answered
(``http_requests_total`` by status where vLLM exposes it, else ``request_success_total``) and
the bad ones: HTTP 5xx answers, requests a restart cut off (``RestartRecord.cut_off``) and the
requests this host's traffic would have sent while vLLM was down, loading or stalled
(``expected`` rate x time). Tallies are kept in buckets of three sizes (5 minutes for 6 hours,
hours for a day, days for the period), enough for the status's hour, day and period and the
multiwindow burn rates of the SRE workbook (``BURNS``). Pure, like the rest of the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vkvagent.engine.rates import is_reset
from vkvagent.engine.samples import Histogram, Sample, VllmMetrics

if TYPE_CHECKING:  # tick imports this module: its observation is a type here
    from vkvagent.engine.tick import Observation

OBJECTIVES = ("availability", "ttft", "itl")
# The status's windows: seconds, with the period's own length standing for "period".
WINDOWS = {"1h": 3600.0, "1d": 86400.0}
# Multiwindow burn-rate alerts (Google SRE workbook, "Alerting on SLOs"): a burn rate is the
# budget spent per unit of time over the rate that would spend all of it in one period; an
# alert needs both the long and the short window above the threshold (the short one makes it
# stop soon after the burning does).
BURNS = {
    "fast": (3600.0, 300.0, 14.4),  # 2 % of a 30-day budget in an hour: page
    "slow": (21600.0, 1800.0, 6.0),  # 5 % in six hours: page, or a ticket
}
# Bucket sizes (seconds) and how many of each are kept; the daily ring is the period's length.
RINGS = ((300.0, 72), (3600.0, 24))
DAY = 86400.0
# The stretches of refusals counted from samples that are kept, to tell a restart's record
# whose outage the samples counted already (more than the ledger's restarts of a day).
REFUSING_KEPT = 16
# An interval longer than this (the agent itself was down) is not charged to vLLM beyond it.
MAX_GAP = 120.0


@dataclass(frozen=True)
class SloSettings:
    """The operator's objectives ([slo]); an objective whose target is None is not declared."""

    availability: float | None = None  # share of requests served, e.g. 0.999
    period_days: float = 28.0  # the error budget's period
    ttft_seconds: float | None = None  # time to the first token ...
    ttft_share: float = 0.95  # ... within which this share of requests must get it
    itl_seconds: float | None = None  # inter-token latency ...
    itl_share: float = 0.95  # ... within which this share of output tokens must come

    def __post_init__(self) -> None:
        problems = []
        for name in ("availability", "ttft_share", "itl_share"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                problems.append(f"{name} {value:g} (allowed: above 0, below 1)")
        for name in ("ttft_seconds", "itl_seconds"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} {value:g} (allowed: above 0)")
        if not 1 <= self.period_days <= 366:
            problems.append(f"period_days {self.period_days:g} (allowed: 1 to 366)")
        if problems:
            raise ValueError("slo: " + "; ".join(problems))

    @property
    def declared(self) -> tuple[str, ...]:
        """The objectives set, in OBJECTIVES order."""
        targets = (self.availability, self.ttft_seconds, self.itl_seconds)
        return tuple(o for o, t in zip(OBJECTIVES, targets) if t is not None)

    @property
    def period(self) -> float:
        return self.period_days * DAY

    def target(self, objective: str) -> float:
        """The share of good events ``objective`` asks for."""
        if objective == "availability":
            assert self.availability is not None
            return self.availability
        return self.ttft_share if objective == "ttft" else self.itl_share

    def words(self, objective: str) -> str:
        """The objective as an operator writes it: "99.9 % of requests served"."""
        share = f"{self.target(objective) * 100:g} %"
        if objective == "availability":
            return f"{share} of requests served"
        if objective == "ttft":
            return f"{share} of requests' first token within {self.ttft_seconds:g} s"
        return f"{share} of output tokens within {(self.itl_seconds or 0) * 1000:g} ms"


def share_within(hist: Histogram, target: float) -> float:
    """How many of ``hist``'s observations were at or below ``target``: the cumulative count
    at the bucket bounds around it, interpolated linearly inside the bucket as Prometheus's
    ``histogram_quantile`` does (the first bucket from 0). A target beyond the last finite
    bound counts only what that bound holds: +Inf's bucket has no width to interpolate in."""
    below, lower = 0.0, 0.0
    for bound, cumulative in zip(hist.bounds, hist.cumulative):
        if bound == math.inf:
            return below
        if target <= bound:
            if bound <= lower:
                return cumulative
            return below + (cumulative - below) * (max(target, lower) - lower) / (bound - lower)
        below, lower = cumulative, bound
    return below


def bracket(bounds: Sequence[float], target: float) -> tuple[float, float] | None:
    """The bucket bounds ``target`` falls between (the first bucket's lower bound 0): how
    closely a histogram with these bounds can tell the target; None beyond the last finite
    bound."""
    lower = 0.0
    for bound in bounds:
        if bound == math.inf:
            return None
        if target <= bound:
            return lower, bound
        lower = bound
    return None


def difference(new: Histogram | None, old: Histogram | None) -> Histogram | None:
    """The observations between two scrapes of one histogram (``old`` None: since vLLM
    started); None where they cannot be compared (a new layout, a count gone down)."""
    if new is None:
        return None
    if old is None:
        return new
    if old.bounds != new.bounds or new.count < old.count:
        return None
    cumulative = tuple(max(0.0, a - b) for a, b in zip(new.cumulative, old.cumulative))
    return Histogram(new.bounds, cumulative, new.sum - old.sum)


# vLLM's latency histograms' finite bucket bounds, by engine: what a target can be told against
# where no page of the running vLLM is at hand (``config check``). V1 added bounds above V0's;
# its inter-token latency keeps V0's time-per-output-token bounds. The simulator prints them.
TTFT_BOUNDS: dict[str, tuple[float, ...]] = {
    "V0": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
           7.5, 10.0),
}  # fmt: skip
TTFT_BOUNDS["V1"] = (*TTFT_BOUNDS["V0"], 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BOUNDS: dict[str, tuple[float, ...]] = {
    "V0": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
}
ITL_BOUNDS["V1"] = (*ITL_BOUNDS["V0"], 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


# A tally: (good, all) events per objective, in OBJECTIVES order, flattened.
Tally = tuple[float, ...]
EMPTY: Tally = (0.0,) * (2 * len(OBJECTIVES))


def _plus(a: Tally, b: Tally, weight: float = 1.0) -> Tally:
    return tuple(x + weight * y for x, y in zip(a, b))


@dataclass(frozen=True)
class Counts:
    """One interval's events."""

    answered: float = 0.0  # requests vLLM answered (2xx, or finished)
    failed: float = 0.0  # requests answered 5xx, cut off, or refused while vLLM was down
    ttft_good: float = 0.0
    ttft_all: float = 0.0
    itl_good: float = 0.0
    itl_all: float = 0.0

    def tally(self) -> Tally:
        return (
            self.answered,
            self.answered + self.failed,
            self.ttft_good,
            self.ttft_all,
            self.itl_good,
            self.itl_all,
        )


@dataclass(frozen=True)
class Burn:
    """One objective's burn rates and the alert they raise ("" when none)."""

    rates: Mapping[str, float | None]  # window name ("5m", "1h", ...) -> burn rate
    alert: str  # "fast", "slow" or ""


@dataclass(frozen=True)
class Objective:
    """One declared objective as the status, the metrics and the events show it."""

    name: str
    words: str
    target: float
    attainment: Mapping[str, float | None]  # "1h", "1d", "period" -> share good; None: no events
    budget_remaining: float | None  # share of the period's budget left (below 0: overspent)
    burn: Burn

    def to_json(self) -> dict[str, Any]:
        return {
            "objective": self.name,
            "words": self.words,
            "target": self.target,
            "attainment": dict(self.attainment),
            "budget_remaining": self.budget_remaining,
            "burn_rates": dict(self.burn.rates),
            "burning": self.burn.alert or None,
        }


def _window_name(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds >= 3600 else f"{seconds / 60:g}m"


@dataclass(frozen=True)
class SloState:
    """The tallies by bucket, the traffic rate last seen (for the requests a down vLLM
    refused when this host's profile does not know the hour yet), and the newest restart whose
    cut-off requests were counted."""

    rings: tuple[Mapping[int, Tally], ...] = ({}, {}, {})
    since: float | None = None  # UTC time of the first events counted
    last_rate: float | None = None  # requests/s
    counted: float | None = None  # UTC time of the newest restart record counted
    # The latency of runs while fresh: the run being counted, its tally so far, and the last
    # fresh tally of a run: what a restart brings back.
    run: str = ""
    fresh: Tally = EMPTY
    last_fresh: Tally = EMPTY
    # The newest stretches (UTC first, last) in which samples counted requests refused: a
    # restart's record overlapping one (another process's, while the daemon sampled) adds
    # its cut-offs only.
    refusing: tuple[tuple[float, float], ...] = ()

    def add(
        self, settings: SloSettings, at: float, counts: Counts, *, late: bool = False
    ) -> SloState:
        """The state with ``counts`` in the buckets holding ``at`` (UTC), old buckets dropped.
        A sample's ``at`` far behind the newest bucket means the wall clock was set back: the
        buckets ahead of it go. ``late``: counts placed after newer ones (a restart's, with
        its record), which drop nothing newer."""
        if counts == _NOTHING:
            return self
        tally = counts.tally()
        rings = []
        for (size, kept), held in zip(self._sizes(settings), self.rings):
            index = math.floor(at / size)
            ring = held
            if not late and max(held, default=index) >= index + kept:
                ring = {i: t for i, t in held.items() if i <= index}
            newest = max(index, max(ring, default=index))
            if index <= newest - kept:  # older than the ring holds (a late restart record)
                rings.append(ring)
                continue
            if index in ring:  # the bucket still filling: nothing to drop
                new = dict(ring)
            else:  # kept relative to the newest bucket: a late record drops nothing newer
                new = {i: t for i, t in ring.items() if newest - kept < i}
            new[index] = _plus(new.get(index, EMPTY), tally)
            rings.append(new)
        since = at if self.since is None and not late else self.since
        return replace(self, rings=tuple(rings), since=since)

    def counted_fresh(self, run: str, counts: Counts) -> SloState:
        """The state with ``counts`` in run ``run``'s fresh tally; a new run's first counts
        keep the last run's as the latency a restart brings back."""
        if run != self.run:
            kept = self.fresh if self.fresh[3] or self.fresh[5] else self.last_fresh
            return replace(self, run=run, fresh=counts.tally(), last_fresh=kept)
        return replace(self, fresh=_plus(self.fresh, counts.tally()))

    def refused_until(self, at: float, gap: float) -> SloState:
        """The state with the ``gap`` seconds to ``at`` (UTC) counted as refused: the newest
        stretch carried on where it ended at the sample before, else a new one."""
        spans = self.refusing
        if spans and spans[-1][1] >= at - gap - 1:
            return replace(self, refusing=(*spans[:-1], (spans[-1][0], at)))
        return replace(self, refusing=(*spans[-REFUSING_KEPT + 1 :], (at - gap, at)))

    def fresh_miss(self) -> dict[str, float]:
        """Each latency objective's miss rate while the last run was fresh (this one's, once
        it has events), where known."""
        out = {}
        for source in (self.last_fresh, self.fresh):
            for i, name in enumerate(OBJECTIVES):
                share = _share(source, i)
                if name != "availability" and share is not None:
                    out[name] = 1 - share
        return out

    @staticmethod
    def _sizes(settings: SloSettings) -> tuple[tuple[float, int], ...]:
        return (*RINGS, (DAY, math.ceil(settings.period_days) + 1))

    def over(self, settings: SloSettings, seconds: float, now: float) -> Tally:
        """The tally of the trailing ``seconds`` before ``now``, from the finest ring that
        covers them, the oldest bucket weighted by its share inside the window."""
        for (size, kept), ring in zip(self._sizes(settings), self.rings):
            if seconds <= size * (kept - 1) or size == DAY:
                return _sum(ring, size, now - seconds, now)
        return EMPTY

    def report(self, settings: SloSettings, now: float) -> tuple[Objective, ...]:
        """Each declared objective over the last hour, day and period, its budget left and its
        burn rates."""
        windows = {**WINDOWS, "period": settings.period}
        scale = self.scale(settings, now)
        spans = sorted({w for long, short, _ in BURNS.values() for w in (long, short)})
        tallies = {w: self.over(settings, s, now) for w, s in windows.items()}
        burns = {_window_name(s): self.over(settings, s, now) for s in spans}
        out = []
        for i, name in enumerate(OBJECTIVES):
            if name not in settings.declared:
                continue
            allowed = 1 - settings.target(name)
            rates = {w: _burn(t, i, allowed) for w, t in burns.items()}
            alert = ""
            for level, (long, short, threshold) in BURNS.items():
                both = (rates[_window_name(long)], rates[_window_name(short)])
                if all(r is not None and r >= threshold for r in both):
                    alert = level
                    break
            period = tallies["period"]
            out.append(
                Objective(
                    name=name,
                    words=settings.words(name),
                    target=settings.target(name),
                    attainment={w: _share(t, i) for w, t in tallies.items()},
                    budget_remaining=_remaining(period, i, allowed, scale),
                    burn=Burn(rates, alert),
                )
            )
        return tuple(out)

    def scale(self, settings: SloSettings, now: float) -> float:
        """How many times the events counted so far a whole period holds: 1 once a period is
        counted; before that, the period's events at the rate seen so far (at least an
        hour's). A budget is the period's, never a day's."""
        counted = now - self.since if self.since is not None else 0.0
        return max(1.0, settings.period / max(counted, 3600.0))

    def to_json(self) -> dict[str, Any]:
        return {
            "rings": [{str(k): list(v) for k, v in sorted(dict(r).items())} for r in self.rings],
            "since": self.since,
            "last_rate": self.last_rate,
            "counted": self.counted,
            "run": self.run,
            "fresh": list(self.fresh),
            "last_fresh": list(self.last_fresh),
            "refusing": [list(span) for span in self.refusing],
        }

    @classmethod
    def from_json(cls, data: Any) -> SloState:
        """The inverse of ``to_json``; ValueError (one line) for anything malformed."""
        try:
            rings = tuple(
                {int(key): _tally(values) for key, values in ring.items()} for ring in data["rings"]
            )
            if len(rings) != 3:
                raise ValueError(f"expected 3 rings, got {len(rings)}")
            return cls(
                rings,
                _time(data["since"]),
                _time(data["last_rate"]),
                _time(data["counted"]),
                str(data["run"]),
                _tally(data["fresh"]),
                _tally(data["last_fresh"]),
                tuple(_span(span) for span in data.get("refusing", ())),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"slo state: malformed ({type(exc).__name__}: {exc})") from None
        except ValueError as exc:
            raise ValueError(f"slo state: {exc}") from None


_NOTHING = Counts()


def _tally(values: Any) -> Tally:
    tally = tuple(float(v) for v in values)
    if len(tally) != len(EMPTY) or not all(0 <= v < math.inf for v in tally):
        raise ValueError(f"bad tally {values!r}")
    return tally


def _span(value: Any) -> tuple[float, float]:
    first, last = (_time(v) for v in value)
    if first is None or last is None or first > last:
        raise ValueError(f"bad span {value!r}")
    return first, last


def _time(value: Any) -> float | None:
    """A finite number or None from the state file; ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number or null, got {value!r}")
    return float(value)


def _sum(ring: Mapping[int, Tally], size: float, start: float, end: float) -> Tally:
    total = [0.0] * len(EMPTY)
    for index in range(math.floor(start / size), math.floor(end / size) + 1):
        tally = ring.get(index)
        if tally is None:
            continue
        begin = index * size
        # The oldest bucket counts by its share inside the window; one still filling (it
        # holds ``end``) counts whole: it holds nothing later.
        inside = 1.0 if begin + size > end else (begin + size - max(begin, start)) / size
        for i, value in enumerate(tally):
            total[i] += inside * value
    return tuple(total)


def _share(tally: Tally, i: int) -> float | None:
    good, total = tally[2 * i], tally[2 * i + 1]
    return min(1.0, good / total) if total > 0 else None


def _burn(tally: Tally, i: int, allowed: float) -> float | None:
    share = _share(tally, i)
    return None if share is None else (1 - share) / allowed


def _remaining(tally: Tally, i: int, allowed: float, scale: float) -> float | None:
    """The share of the period's budget left: its bad events over what the period's events
    (``scale`` times those counted) allow."""
    good, total = tally[2 * i], tally[2 * i + 1]
    if total <= 0:
        return None
    return 1 - (total - good) / (allowed * total * scale)


@dataclass(frozen=True)
class Interval:
    """What one interval between two samples says for the objectives."""

    seconds: float
    ttft: Histogram | None = None  # the TTFT observations in it
    itl: Histogram | None = None
    answered: float | None = None  # requests answered (2xx, or finished)
    errors: float = 0.0  # 5xx answers
    refused_rate: float | None = None  # requests/s refused (vLLM down, loading or stalled)


def counts(settings: SloSettings, interval: Interval) -> Counts:
    """The events of one interval."""
    failed = interval.errors
    if interval.refused_rate is not None:
        failed += interval.refused_rate * min(interval.seconds, MAX_GAP)
    out = Counts(answered=max(0.0, interval.answered or 0.0), failed=max(0.0, failed))
    if settings.ttft_seconds is not None and interval.ttft is not None:
        good = share_within(interval.ttft, settings.ttft_seconds)
        out = replace(out, ttft_good=good, ttft_all=interval.ttft.count)
    if settings.itl_seconds is not None and interval.itl is not None:
        good = share_within(interval.itl, settings.itl_seconds)
        out = replace(out, itl_good=good, itl_all=interval.itl.count)
    return out


def count_samples(
    settings: SloSettings,
    slo: SloState,
    observed: Observation,
    fresh: Sequence[Sample],
    *,
    stalled: bool,
    unresponsive: bool,
    down_rate: float | None,
    fresh_run: bool,
    rate: float | None,
    halted: bool,
) -> SloState:
    """The objectives' tallies with the samples not read before, and the requests restarts
    cut off or refused: each interval between two answers of one run by its counters' and
    histograms' deltas; one in which vLLM was down, loading, stalled or unresponsive as the
    requests this host sends then (``down_rate``); a new run's first answer from its process
    start, when that came after the answer before (else its counters hold what vLLM served
    before the agent looked). A restart's record adds its cut-offs, and the refusals the
    actuator counted where no sample counted any (the daemon's own restarts leave none);
    restarts from before the first sample read are not of the period counted.
    ``fresh_run``: this run is fresh, its latency is what a restart brings back. ``rate``:
    the requests/s clients send, else what the intervals answered; kept as it was while
    ``halted`` (vLLM has work and completes none: what it answers is not what is sent)."""
    if slo.since is None and fresh:
        slo = replace(slo, since=fresh[0].time)
    for record in sorted(observed.restarts, key=lambda r: r.time):
        if slo.since is None or record.time < slo.since:
            continue  # from before the counting began
        if slo.counted is not None and record.time <= slo.counted:
            continue
        ended = record.ended if record.ended is not None else record.time
        sampled = any(a <= ended and record.time <= b for a, b in slo.refusing)
        failed = (record.cut_off or 0.0) + (0.0 if sampled else record.refused or 0.0)
        if failed > 0:
            slo = replace(slo.add(settings, record.time, Counts(failed=failed), late=True),
                          counted=record.time)  # fmt: skip
    if not fresh:
        return slo
    first, seen = fresh[0].mono, None
    before = next((x for x in reversed(observed.samples) if x.mono < first), None)
    valid = next((x for x in reversed(observed.samples) if x.mono < first and x.vllm), None)
    for sample in fresh:
        found: Interval | None = None
        metrics = sample.vllm
        if metrics is None or observed.unit_active is False or stalled:
            # Down, loading, stalled or hung: what this host's clients send meanwhile is
            # refused. A scrape that only timed out (vLLM silent) is not, until vLLM is
            # unresponsive: the next answer's counters say what it served meanwhile.
            if metrics is not None or not sample.vllm_silent or unresponsive:
                gap = sample.mono - before.mono if before is not None else 0.0
                found = Interval(gap, refused_rate=down_rate)
                slo = slo.refused_until(sample.time, gap)
        elif valid is not None and valid.vllm and not is_reset(valid.vllm, metrics):
            found = scraped_interval(valid.vllm, metrics, sample.mono - valid.mono)
        elif valid is not None and (metrics.process_start_time or 0) >= valid.time:
            # vLLM started after the last look: its counters hold only this run's.
            found = scraped_interval(None, metrics, sample.mono - valid.mono)
        if found is not None and found.answered is not None and found.seconds > 0:
            seen = (found.answered + found.errors) / found.seconds
        if found is not None:
            tally = counts(settings, found)
            slo = slo.add(settings, sample.time, tally)
            if fresh_run and metrics is not None and metrics.process_start_time:
                slo = slo.counted_fresh(f"{metrics.process_start_time:.3f}", tally)
        before = sample
        if metrics is not None:
            valid = sample
    rate = rate if rate is not None else seen
    return slo if rate is None or halted else replace(slo, last_rate=rate)


def scraped_interval(old: VllmMetrics | None, new: VllmMetrics, seconds: float) -> Interval:
    """What vLLM's counters say of the time between two scrapes of one run (``old`` None:
    since it started)."""

    def grown(read: Callable[[VllmMetrics], float | None]) -> float | None:
        after, earlier = read(new), read(old) if old is not None else 0.0
        return None if after is None or earlier is None else max(0.0, after - earlier)

    requests = grown(lambda m: m.http_requests_total)
    errors = grown(lambda m: m.http_5xx_total) if requests is not None else None
    answered = requests - (errors or 0.0) if requests is not None else None
    return Interval(
        seconds,
        ttft=difference(new.time_to_first_token, old.time_to_first_token if old else None),
        itl=difference(new.inter_token_latency, old.inter_token_latency if old else None),
        answered=answered if answered is not None else grown(lambda m: m.request_success_total),
        errors=errors or 0.0,
    )


def _busy_hours(
    hourly: Mapping[int, Tally], span: Tally, seconds: float, now: float
) -> list[Tally]:
    """The hours of the last ``seconds`` before ``now`` (``span``: their tally) that carried
    at least their share of its requests."""
    first = math.ceil((now - seconds) / 3600.0)
    hours = seconds / 3600.0
    return [t for i, t in hourly.items() if i >= first and t[1] * hours >= span[1] > 0]


# Before a whole period is counted, a restart may spend this share of the period's budget at
# once, and more as the period goes by: a first week cannot spend a month's budget.
UP_FRONT = 0.25


@dataclass(frozen=True)
class Spend:
    """What a restart now would cost and save, each a share of its objective's budget over
    the period."""

    cost: float  # availability budget a restart now spends (its outage, drain and cut-offs)
    per_rate: float  # what it spends for each request/s the host is asked at its time
    left: float  # availability budget it may still spend: the period's so far, paced
    saving: float | None  # latency budget it saves until ``horizon``; None: cannot tell
    horizon: float  # seconds the saving is counted over

    @property
    def losing(self) -> float:
        """Latency budget lost for each second a restart waits."""
        return (self.saving or 0.0) / self.horizon if self.horizon > 0 else 0.0

    def words(self) -> str:
        return (
            f"a restart spends {self.cost * 100:.1f} % of the availability budget "
            f"({self.left * 100:.0f} % left to spend)"
            + (
                ""
                if self.saving is None
                else f" and saves {self.saving * 100:.1f} % of the latency budget over the "
                f"next {self.horizon / 3600:.1f} h"
            )
        )


@dataclass(frozen=True)
class Budget:
    """What the policy weighs a restart by, with an [slo]: the objectives' tallies, this
    host's request rate now and how long a restart refuses requests."""

    settings: SloSettings
    state: SloState
    now: float  # UTC
    rate: float | None  # requests/s a restart now would refuse
    outage: float  # seconds it refuses them: vLLM's start, and the drain before it
    run_started: float | None = None  # UTC; None: not known, the last day counts

    def spend(self, horizon: float) -> Spend | None:
        """A restart now: its cost (the requests refused in its outage and drain) over the
        period's availability budget (``SloState.scale``), what is left to spend (paced:
        ``UP_FRONT`` of it at once, the rest as the period is counted), and what it saves of
        the latency objectives' budgets over ``horizon`` seconds (this run's miss rate over
        its last hour or day, the higher, down to the last fresh run's). None without an
        availability objective, or before any request was counted."""
        s, state, now = self.settings, self.state, self.now
        if s.availability is None:
            return None
        period = state.over(s, s.period, now)
        good, total = period[0], period[1]
        scale = state.scale(s, now)
        allowed = total * scale * (1 - s.availability)
        if not allowed:
            return None
        per_rate = self.outage / allowed
        cost = (self.rate or 0.0) * per_rate
        left = max(UP_FRONT, 1 / scale) - (total - good) / allowed
        # The latency budget saved: the share of events a fresh run would not miss, for the
        # ``horizon``'s share of the period, over the share the objective may miss. The miss
        # rate now is the worst of the last hour's, the last day's and its busiest hours':
        # a quiet hour hides what the busy ones miss, and a server that slows with uptime
        # misses more at its next peak than on average at its last. This run's misses only:
        # a restart cannot save what the run before it missed.
        saving: float | None = None
        fresh = state.fresh_miss()
        started = self.run_started
        age = DAY if started is None or started > now else min(DAY, now - started)
        recent = [state.over(s, min(3600.0, age), now), day := state.over(s, age, now)]
        recent += _busy_hours(state.rings[1], day, age, now)
        for i, name in enumerate(OBJECTIVES):
            shares = [x for x in (_share(t, i) for t in recent) if x is not None]
            if name == "availability" or name not in fresh or not shares:
                continue
            excess = max(0.0, 1 - min(shares) - fresh[name])
            saving = (saving or 0.0) + excess * horizon / (s.period * (1 - s.target(name)))
        return Spend(cost, per_rate, left, saving, horizon)
