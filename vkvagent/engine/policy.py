"""Policy: whether a restart that would help may happen now.

A restart costs a cold start (minutes of no service), so it belongs where it costs least: in
the operator's calendar windows, when traffic is low, not too often, and never in a loop that
does not help. Emergencies (by default only a stall: nothing is being served anyway) may go
outside the windows. A scheduled restart (maximum uptime) is an explicit opt-in, run in the
next window like any other. A slowdown (a diagnosed ``uptime_decline``, one this server's past
runs predict: ``prevention``, or slower flags to roll back) may go outside the windows when
waiting for the next one would cost more service than the restart itself
(``outside_windows = "when_cheaper"``).

Pure: the restart history, the operator's pause/resume and ``now`` (an aware datetime) come in
as values; the verdict says what it would do and, when it does not act, what blocked it.
Windows are evaluated in their IANA time zone and compared as UTC instants, so daylight-saving
changes neither skip nor double a window.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from functools import cached_property
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from vkvagent.engine.diagnosis import FIXABLE, VETOED
from vkvagent.engine.liveness import CAUSES as DOWN
from vkvagent.engine.liveness import CRASH_LOOP, DEAD
from vkvagent.engine.prevention import DEFAULT_OUTAGE, Plan
from vkvagent.engine.samples import utc_text
from vkvagent.engine.slo import Budget, Spend
from vkvagent.engine.traffic import PROFILE_MIN_VALUES, TrafficProfile, bin_top, rate_bin

MODES = ("off", "observe", "enforce")
# How a verdict held back only by observe mode begins: replay counts those restarts.
WOULD_RESTART = "observe mode: would restart now"
OUTSIDE_WINDOWS = ("never", "when_cheaper")
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
SCHEDULED = "scheduled"  # the cause of a restart for reaching the maximum uptime
FLAGS = "flags"  # the cause of a restart that changes vLLM's flags ([vllm] apply_flags)
PREVENTION = "prevention"  # a restart before the slowdown this server's past runs predict
# Restarts nothing was found wrong before: never judged as a cure.
PLANNED = (FLAGS, SCHEDULED, PREVENTION)
# What outside_windows may weigh against a restart: a slowdown, diagnosed or predicted,
# slower flags due for a rollback (with the speed they cost: an operator's change has none),
# and a leaking KV cache (the share of its heaviest clean load it no longer holds).
SLOWDOWNS = ("uptime_decline", PREVENTION, FLAGS, "kv_pressure")
DAY = 86400.0


@dataclass(frozen=True)
class RestartWindow:
    """Days of the week (0 = Monday) and a local start and end in minutes after midnight. An
    end before the start crosses midnight: the window belongs to the day it starts."""

    days: frozenset[int]
    start: int
    end: int

    def occurrences(self, around: date, zone: ZoneInfo) -> list[tuple[datetime, datetime]]:
        """(start, end) as UTC instants for windows starting from the day before ``around``
        to a week after it."""
        out = []
        for offset in range(-1, 8):
            day = around + timedelta(days=offset)
            if day.weekday() not in self.days:
                continue
            end_day = day if self.end > self.start else day + timedelta(days=1)
            start, end = _instant(day, self.start, zone), _instant(end_day, self.end, zone)
            if end <= start:  # both ends fell in the spring-forward gap: keep the length
                length = (self.end - self.start) % 1440 or 1440
                end = start + timedelta(minutes=length)
            out.append((start, end))
        return out


def _instant(day: date, minutes: int, zone: ZoneInfo) -> datetime:
    # A local time that does not exist (spring forward) reads with the offset before the
    # change (fold=0), i.e. as the instant an unchanged clock would have shown it.
    if minutes == 1440:
        day, minutes = day + timedelta(days=1), 0
    local = datetime(day.year, day.month, day.day, minutes // 60, minutes % 60, tzinfo=zone)
    return local.astimezone(timezone.utc)


_WINDOW = re.compile(r"^\s*(\S+)\s+(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


def parse_window(text: str) -> RestartWindow:
    """``DAYS HH:MM-HH:MM``: DAYS is ``daily``, ``*``, a day (``mon``), a range (``mon-fri``,
    ``fri-mon`` wraps) or a comma list of those (``mon,wed,fri-sun``); the end may be
    ``24:00``, and one before the start means the window crosses midnight from the days
    named (``sun 23:00-01:00``: Sunday 23:00 to Monday 01:00).
    ValueError (one line) otherwise."""
    found = _WINDOW.match(text)
    if not found:
        raise ValueError(f"window {text!r}: expected DAYS HH:MM-HH:MM (e.g. mon-fri 01:00-05:00)")
    days_text, sh, sm, eh, em = found.groups()
    start, end = int(sh) * 60 + int(sm), int(eh) * 60 + int(em)
    if int(sm) > 59 or int(em) > 59 or start > 1439 or end > 1440:
        raise ValueError(f"window {text!r}: times must be 00:00 to 23:59 (the end up to 24:00)")
    if start == end:
        raise ValueError(f"window {text!r}: start and end are equal (use 00:00-24:00 all day)")
    return RestartWindow(_parse_days(days_text, text), start, end)


def _parse_days(spec: str, text: str) -> frozenset[int]:
    if spec.lower() in ("daily", "*"):
        return frozenset(range(7))
    days: set[int] = set()
    for part in spec.lower().split(","):
        ends = part.split("-")
        if len(ends) > 2 or not all(e in DAYS for e in ends):
            raise ValueError(
                f"window {text!r}: bad days {part!r} (allowed: daily, *, {', '.join(DAYS)}, "
                "ranges like mon-fri, comma lists)"
            )
        first, last = DAYS.index(ends[0]), DAYS.index(ends[-1])
        days.update((first + i) % 7 for i in range((last - first) % 7 + 1))
    return frozenset(days)


@dataclass(frozen=True)
class PolicySettings:
    """When restarts may happen. Durations in seconds; windows as ``parse_window`` reads."""

    mode: str = "observe"  # off: do nothing; observe: decide and log, never act; enforce
    timezone: str = "UTC"  # IANA zone the windows are written in
    windows: tuple[str, ...] = ("daily 02:00-05:00",)  # none: only emergencies
    max_request_rate: float = 0.0  # traffic gate in a window (requests/s); 0: no gate
    # Traffic gate relative to this host: the request rate must be at or below this percentile
    # of its own rates at the same local hour (TrafficProfile); 0: no gate.
    max_request_rate_percentile: float = 0.0
    min_interval: float = 3600.0  # between two restarts, whatever the cause
    max_per_day: int = 4  # restarts in any rolling 24 hours (the runbook's 6-hourly cron: 4)
    cooldown: float = 21600.0  # after a restart, non-emergency causes wait this long
    emergency: tuple[str, ...] = ("stall", "unresponsive")  # causes allowed outside windows
    max_uptime: float = 0.0  # opt-in scheduled restart after this uptime; 0: never
    escalate_after: int = 2  # restarts in a row that did not help: stop until resumed
    drain_max_in_flight: int = 0  # handed to the actuator; emergencies skip the drain
    drain_timeout: float = 120.0  # [restart]'s: the longest a drain refuses new requests
    # Whether a restart for anything but an emergency may go outside the windows: never (the
    # operator's windows hold), or "when_cheaper": when waiting for the next window costs more
    # than the restart (with an [slo], more latency budget than the availability budget it
    # spends, and only while the budget left covers it; else service lost against the outage).
    outside_windows: str = "never"
    prevent: bool = True  # restart before the slowdown this server's past runs predict

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode {self.mode!r} (allowed: {', '.join(MODES)})")
        if self.outside_windows not in OUTSIDE_WINDOWS:
            problems.append(
                f"outside_windows {self.outside_windows!r} (allowed: {', '.join(OUTSIDE_WINDOWS)})"
            )
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            problems.append(f"timezone {self.timezone!r} is not an IANA zone (e.g. Europe/Paris)")
        for text in self.windows:
            try:
                parse_window(text)
            except ValueError as exc:
                problems.append(str(exc))
        unknown = [c for c in self.emergency if c not in FIXABLE]
        if unknown:
            problems.append(f"emergency causes {unknown} (allowed: {', '.join(sorted(FIXABLE))})")
        if self.max_per_day < 1 or self.escalate_after < 1:
            problems.append("max_per_day and escalate_after must be at least 1")
        if not 0 <= self.max_request_rate_percentile <= 100:
            problems.append(
                f"max_request_rate_percentile {self.max_request_rate_percentile:g} "
                "(allowed: 0 to 100)"
            )
        if problems:
            raise ValueError("policy: " + "; ".join(problems))

    @cached_property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @cached_property
    def parsed(self) -> tuple[RestartWindow, ...]:
        return tuple(parse_window(text) for text in self.windows)


@dataclass(frozen=True)
class RestartRecord:
    """A restart (any cause) as the ledger records it: one that happened, or an attempt
    aborted before it reached systemd."""

    time: float  # UTC Unix seconds when it began
    cause: str
    recovered: bool | None = None  # did performance come back; None: not judged (yet)
    # Refused before anything reached systemd (preflight, drain timeout): no restart happened,
    # so it counts for the retry back-off only, never for budgets, cooldown or escalation.
    aborted: bool = False
    # The monotonic time it began, when taken on this boot's clock (the ledger keeps it with
    # the boot's id): ages are then immune to steps of the wall clock.
    mono: float | None = None
    # What it cost the clients, availability spent: the requests in flight it cut off, and
    # those estimated to have arrived while vLLM was down (the actuator's counts: the
    # daemon's own restarts leave no sample of that time; where the daemon sampled another
    # process's restart, its samples count the refusals instead). None: not known.
    cut_off: float | None = None
    refused: float | None = None
    ended: float | None = None  # UTC when it ended, vLLM answering again: ``refused``'s span

    def age(self, at: float, mono: float | None) -> float:
        """Seconds since it began: on the monotonic clock when both ends have it, else on
        the wall clock, where a time in the future (the clock was stepped back) reads as now,
        so a step back never forgets a restart."""
        if self.mono is not None and mono is not None:
            return max(0.0, mono - self.mono)
        return max(0.0, at - self.time)


@dataclass(frozen=True)
class Controls:
    """The operator's commands: ``vkvagent pause --until`` and ``vkvagent resume``."""

    paused_until: float | None = None  # UTC Unix seconds
    resumed_at: float | None = None  # UTC Unix seconds; restarts before it no longer escalate


@dataclass(frozen=True)
class Verdict:
    """What the policy allows: restart now, hold (a reason blocks it) or none (nothing to do)."""

    action: str
    reason: str
    cause: str | None
    window_open: bool
    next_window: datetime | None  # the next window start after now (UTC), if any
    drain_max_in_flight: int | None = None  # for a restart: None means do not drain


def window_state(settings: PolicySettings, now: datetime) -> tuple[bool, datetime | None]:
    """Whether a window is open at ``now`` (aware), and when the next one starts."""
    now = now.astimezone(timezone.utc)
    local = now.astimezone(settings.zone).date()
    is_open, upcoming = False, None
    for window in settings.parsed:
        for start, end in window.occurrences(local, settings.zone):
            if start <= now < end:
                is_open = True
            if start > now and (upcoming is None or start < upcoming):
                upcoming = start
    return is_open, upcoming


# After an aborted attempt the next waits this long, doubling with each one in a row up to the
# cap, so a unit that cannot be restarted (start limit, drain that never empties) is asked a
# few times an hour, not every tick. An emergency (an engine that serves nothing) is tried
# again every RETRY_FIRST whatever came before: its attempts skip the drain that may be what
# failed.
RETRY_FIRST = 60.0
RETRY_MAX = 3600.0


def retry_wait(
    history: Sequence[RestartRecord],
    controls: Controls,
    at: float,
    *,
    emergency: bool = False,
    mono: float | None = None,
) -> tuple[int, float, float]:
    """The aborted attempts in a row since the last restart that happened (or the last
    resume), how long ago the last of them was, and how long after it the next may be
    tried."""
    streak, since = 0, math.inf
    for record in sorted(history, key=lambda r: r.age(at, mono)):
        if not record.aborted or (
            controls.resumed_at is not None and record.time <= controls.resumed_at
        ):
            break
        streak, since = streak + 1, min(since, record.age(at, mono))
    if not streak:
        return 0, 0.0, 0.0
    return (
        streak,
        since,
        min(RETRY_FIRST * 2 ** (streak - 1), RETRY_FIRST if emergency else RETRY_MAX),
    )


def escalated(
    settings: PolicySettings, history: Sequence[RestartRecord], controls: Controls
) -> int:
    """How many restarts in a row, since the last resume, did not restore performance, once
    that reaches ``escalate_after`` (else 0). Planned restarts (``PLANNED``) are not
    judged."""
    judged = [
        r
        for r in sorted(history, key=lambda r: r.time)
        if r.cause not in PLANNED
        and not r.aborted
        and (controls.resumed_at is None or r.time > controls.resumed_at)
    ]
    streak = 0
    for record in reversed(judged):
        if record.recovered is not False:
            break
        streak += 1
    return streak if streak >= settings.escalate_after else 0


def evaluate(
    settings: PolicySettings,
    *,
    cause: str | None,
    wanted: bool,
    uptime: float | None,
    request_rate: float | None,
    history: Sequence[RestartRecord],
    controls: Controls,
    now: datetime,
    traffic: TrafficProfile | None = None,
    mono: float | None = None,
    flags_due: str = "",
    plan: Plan | None = None,
    loss: float | None = None,
    harm_in: float | None = None,
    budget: Budget | None = None,
    crash_window: float = 3600.0,
) -> Verdict:
    """The verdict for a diagnosed ``cause``; ``wanted`` says a restart would fix it. With no
    such cause, a flag change (``flags_due`` says which) is proposed, else a preventive restart
    once ``plan`` (this server's past runs) says so: from its uptime T*, in the last window
    before it, or at the end of this host's quiet hours (``_prevention``); else a scheduled
    restart once the uptime passes ``max_uptime``; all wait for a window like any cause, and a
    diagnosed ``uptime_decline`` in quiet hours for their end too. ``loss``: the share of speed
    a diagnosed ``uptime_decline`` or flags due for a rollback cost, weighed against a restart
    outside the windows. ``harm_in``: the seconds until the harm a cause foretells (a leak
    reaching MemoryMax); its restart waits for the last window that opens well before it.
    ``traffic``: this host's rates by local hour, for the percentile gate and the quiet hours.
    ``mono``: the monotonic time of ``now``, which the intervals, cooldown, budget and back-off
    are measured on for every restart that has one (``RestartRecord.age``). ``budget``: the
    operator's objectives ([slo]): a restart that is no emergency goes only while the
    availability budget left covers it and, for a cause diagnosed, when it saves more latency
    budget than it spends, but at the end of quiet hours (``_budget_holds``). A vLLM that serves
    nothing (``liveness.CAUSES``: dead, a hung start, a crash loop) interrupts nobody: it goes
    at any hour, without a drain, the minimum interval or the cooldown, but within the daily
    budget, and a crash loop's starts back off (``_crash_backoff``) within ``crash_window``."""
    is_open, upcoming = window_state(settings, now)

    def verdict(action: str, reason: str, drain: int | None = None) -> Verdict:
        return Verdict(action, reason, cause, is_open, upcoming, drain)

    due = settings.max_uptime > 0 and uptime is not None and uptime >= settings.max_uptime
    calm = not wanted and cause not in (*VETOED, *DOWN, "engine_down")
    prevention, held = "", ""
    if calm:
        prevention, held = _prevention(
            settings, plan, uptime, is_open, upcoming, now, history, controls, traffic
        )
    if flags_due and cause is None:  # not over a veto: the new run would be judged under it
        cause, wanted = FLAGS, True
    elif prevention in (DUE, QUIET_END):
        cause, wanted = PREVENTION, True
    elif due and calm:
        cause, wanted = SCHEDULED, True
    elif prevention == HELD:
        cause, wanted = PREVENTION, True
    if settings.mode == "off":
        return verdict("none", "mode off")
    if not wanted:
        return verdict("none", "nothing a restart would fix")

    at = now.timestamp()
    streak = escalated(settings, history, controls)
    if streak:
        return verdict(
            "hold",
            f"escalated: the last {streak} restarts did not restore "
            "performance; waiting for `vkvagent resume`",
        )
    if cause in ("uptime_decline", PREVENTION) and _slowdown_uncured(history, controls):
        return verdict(
            "hold",
            "escalated: the last restart for uptime_decline did not restore the fresh speed "
            "(a slowdown a restart does not cure); waiting for `vkvagent resume`",
        )
    if controls.paused_until is not None and at < controls.paused_until:
        return verdict("hold", f"paused until {utc_text(controls.paused_until)}")
    down = cause in DOWN
    emergency = cause in settings.emergency or down
    if cause == CRASH_LOOP:
        backoff = _crash_backoff(settings, history, controls, at, mono, crash_window)
        if backoff:
            return verdict("hold", backoff)
    aborted, since_aborted, wait = retry_wait(history, controls, at, emergency=emergency, mono=mono)
    if aborted and since_aborted < wait:
        return verdict(
            "hold",
            f"retry back-off: {aborted} restart attempt(s) in a row aborted, the last "
            f"{_ago(since_aborted)} ago; next try in {_ago(wait - since_aborted)}",
        )
    past = sorted(r.age(at, mono) for r in history if not r.aborted)  # ages, youngest first
    if past and past[0] < settings.min_interval and not down:
        return verdict(
            "hold",
            f"min interval: last restart {_ago(past[0])} ago "
            f"(at least {_ago(settings.min_interval)} apart)",
        )
    recent = [age for age in past if age < DAY]
    if len(recent) >= settings.max_per_day:
        return verdict(
            "hold",
            f"budget: {len(recent)} restarts in the last 24 h (at most {settings.max_per_day})",
        )
    cheaper = ""
    if not emergency:
        if past and past[0] < settings.cooldown:
            return verdict(
                "hold",
                f"cooldown: last restart {_ago(past[0])} ago (cooldown {_ago(settings.cooldown)})",
            )
        if cause == PREVENTION and prevention == HELD:
            return verdict("hold", held)
        quiet_end = cause == PREVENTION and prevention == QUIET_END
        # A decline with uptime diagnosed in quiet hours costs next to nothing there either:
        # as prevention, it goes in their last minutes, and the next run starts the busy
        # hours fresh.
        if cause == "uptime_decline":
            end, waits = _quiet_stretch(settings, traffic, now)
            if end is not None and waits:
                return verdict("hold", f"{cause} {_quiet_wait(end)}")
            quiet_end = end is not None
        if not is_open and quiet_end:
            cheaper = "outside window, at the end of this host's quiet hours"
        elif not is_open:
            cheaper = _before_harm(cause, upcoming, now, harm_in) or _cheaper_now(
                settings, cause, plan, loss, uptime, upcoming, now, budget
            )
            if not cheaper:
                following = (
                    f" (next {utc_text(upcoming.timestamp())})" if upcoming else " (none set)"
                )
                return verdict("hold", f"outside window{following}")
        elif not_yet := _not_yet(harm_in, upcoming, now):
            return verdict("hold", not_yet)
        if budget is not None and harm_in is None:  # a foretold OOM kill goes regardless
            spent = _budget_holds(settings, cause, budget, upcoming, now, traffic, quiet_end)
            if spent:
                return verdict("hold", spent)
        if settings.max_request_rate > 0:
            if request_rate is None:
                return verdict("hold", "traffic gate: request rate unknown")
            if request_rate > settings.max_request_rate:
                return verdict(
                    "hold",
                    f"traffic gate: {request_rate:.2f} requests/s above "
                    f"{settings.max_request_rate:g}",
                )
        if settings.max_request_rate_percentile > 0:
            busy = _busier_than_usual(settings, traffic, request_rate, now)
            if busy:
                return verdict("hold", busy)
    drain = None if emergency else settings.drain_max_in_flight
    where = (
        "vLLM serves nothing, any time"
        if down
        else "emergency, any time"
        if emergency
        else cheaper or "in window"
    )
    if settings.mode == "observe":
        return verdict("hold", f"{WOULD_RESTART} ({where})", drain)
    return verdict("restart", f"restart: {where}", drain)


def _crash_backoff(
    settings: PolicySettings,
    history: Sequence[RestartRecord],
    controls: Controls,
    at: float,
    mono: float | None,
    window: float,
) -> str:
    """Why a start for a crash loop waits: after ``escalate_after`` starts for a vLLM that
    died (``dead``, ``crash_loop``) within ``window`` (since the last resume) it stops until
    resumed; before that, each start waits twice as long as the one before (RETRY_FIRST,
    doubling, at most RETRY_MAX)."""
    ages = sorted(
        r.age(at, mono)
        for r in history
        if r.cause in (DEAD, CRASH_LOOP)
        and not r.aborted
        and (controls.resumed_at is None or r.time > controls.resumed_at)
        and r.age(at, mono) < window
    )
    if not ages:
        return ""
    if len(ages) >= settings.escalate_after:
        return (
            f"escalated: vLLM still exits after {len(ages)} starts in the last {_ago(window)} "
            "(a crash loop); waiting for `vkvagent resume`"
        )
    wait = min(RETRY_FIRST * 2 ** (len(ages) - 1), RETRY_MAX)
    if ages[0] < wait:
        return (
            f"crash loop back-off: {len(ages)} start(s) for it, the last {_ago(ages[0])} ago; "
            f"next in {_ago(wait - ages[0])}"
        )
    return ""


def _slowdown_uncured(history: Sequence[RestartRecord], controls: Controls) -> bool:
    """Whether the last judged restart for ``uptime_decline`` since the last resume did not
    restore the fresh speed: the slowdown is not one a restart cures (the world's, not the
    process's), so restarting for it again would only add outages."""
    judged = [
        r
        for r in history
        if r.cause == "uptime_decline"
        and not r.aborted
        and r.recovered is not None
        and (controls.resumed_at is None or r.time > controls.resumed_at)
    ]
    return bool(judged) and max(judged, key=lambda r: r.time).recovered is False


# What ``_prevention`` says of a preventive restart: due now; due now at the end of a quiet
# stretch (where it costs next to nothing, window or not); or held for that end ("": none).
DUE, QUIET_END, HELD = "due", "quiet end", "held"
# An hour whose median request rate is at most QUIET of the day's mean (of the hours' medians)
# is quiet; a restart held for the end of a quiet stretch goes in its last QUIET_LAST seconds.
QUIET = 0.1
QUIET_LAST = 600.0


def _prevention(
    settings: PolicySettings,
    plan: Plan | None,
    uptime: float | None,
    is_open: bool,
    upcoming: datetime | None,
    now: datetime,
    history: Sequence[RestartRecord],
    controls: Controls,
    traffic: TrafficProfile | None,
) -> tuple[str, str]:
    """Whether a preventive restart is due (DUE, QUIET_END, HELD or ""), and why it is held.
    Due from the plan's uptime on, or in a window when restarting now costs less per hour of
    the run than at the next window; never sooner than the cooldown and the daily budget let
    restarts recur (spread evenly, not four in a row and a long wait); never after a restart
    for the slowdown did not cure it.

    In this host's quiet hours (``TrafficProfile.typical``, once a day of its traffic is
    known), the run's decline costs next to nothing, and so would the restart: it is held
    for the stretch's last QUIET_LAST seconds, and goes there if the run would reach the
    plan's uptime before the same moment a day later. The next run then starts the busy
    hours fresh, not aged by the quiet ones (``_quiet_hours_apply``)."""
    if not settings.prevent or plan is None or uptime is None:
        return "", ""
    if _slowdown_uncured(history, controls):
        return "", ""
    floor = max(settings.cooldown, DAY / settings.max_per_day)
    at = max(plan.at, floor)
    end, waits = _quiet_stretch(settings, traffic, now) if uptime >= floor else (None, False)
    if end is not None and waits:
        if uptime < at:
            return "", ""
        return HELD, f"prevention {_quiet_wait(end)}"
    if end is not None:
        return (QUIET_END, "") if uptime + DAY >= at else ("", "")
    if uptime >= at:
        return DUE, ""
    if not is_open or uptime < settings.cooldown or upcoming is None:
        return "", ""
    later = uptime + (upcoming - now).total_seconds()
    if later >= at and plan.cost_rate(uptime) <= plan.cost_rate(later):
        return DUE, ""
    return "", ""


def _quiet_stretch(
    settings: PolicySettings, traffic: TrafficProfile | None, now: datetime
) -> tuple[datetime | None, bool]:
    """When the quiet stretch of this host's traffic ``now`` falls in ends, where restarts
    keep to quiet hours (``_quiet_hours_apply``; else None), and whether a restart waits for
    it: it ends later than QUIET_LAST from now."""
    end = _quiet_end(traffic, now, settings.zone) if _quiet_hours_apply(settings) else None
    return end, end is not None and (end - now).total_seconds() > QUIET_LAST


def _quiet_wait(end: datetime) -> str:
    return (
        f"waits for the end of this host's quiet hours ({utc_text(end.timestamp())}), to "
        f"restart in their last {QUIET_LAST / 60:.0f} minutes"
    )


def _quiet_hours_apply(settings: PolicySettings) -> bool:
    """Whether prevention and a diagnosed ``uptime_decline`` keep to this host's quiet hours:
    only where restarts may go outside the windows (``when_cheaper``, with windows set: the
    stretch may end outside them), and without traffic gates, which pick the quiet moment by
    the operator's own measure (the stretch's last minutes, just before the busy hours, are
    the likeliest to be gated)."""
    return (
        settings.outside_windows == "when_cheaper"
        and bool(settings.parsed)
        and settings.max_request_rate <= 0
        and settings.max_request_rate_percentile <= 0
    )


def _quiet_end(traffic: TrafficProfile | None, now: datetime, zone: ZoneInfo) -> datetime | None:
    """When the quiet stretch of this host's traffic ``now`` falls in ends (the start of its
    next hour that is not quiet, in UTC), by each local hour's median rate; None when ``now``
    is not in one, or the rate of some hour is not known yet (or of none: an idle host)."""
    rates = traffic.typical if traffic is not None else None
    quiet = QUIET * sum(rates) / len(rates) if rates is not None else 0.0
    if rates is None or not quiet > 0:
        return None
    local = now.astimezone(zone)
    if rates[local.hour] > quiet:
        return None
    top = local.replace(minute=0, second=0, microsecond=0)
    # Some hour is above a tenth of the mean: this ends within the day.
    ahead = next(h for h in range(1, 25) if rates[(local.hour + h) % 24] > quiet)
    return (top + timedelta(hours=ahead)).astimezone(timezone.utc)


# A foretold harm (``harm_in``) waits for the next window only if that opens within this share
# of the time left: the projection assumes the pace so far, and a busier day comes sooner.
HARM_SHARE = 0.75
# Before a harm the next window comes too late for, the restart goes this long ahead of it:
# late enough that the run has its time, early enough to drain and start again.
HARM_LEAD = 3600.0


def _not_yet(harm_in: float | None, upcoming: datetime | None, now: datetime) -> str:
    """Why a foretold harm waits: a window to come still opens well before it. "" to go."""
    if harm_in is None or upcoming is None:
        return ""
    if (upcoming - now).total_seconds() >= HARM_SHARE * harm_in:
        return ""
    return (
        f"not yet: the harm is {_ago(harm_in)} away, after the next window "
        f"({utc_text(upcoming.timestamp())})"
    )


def _before_harm(
    cause: str | None, upcoming: datetime | None, now: datetime, harm_in: float | None
) -> str:
    """Why a foretold harm (a leak reaching MemoryMax: the kernel's OOM kill cuts off every
    request, a drained restart none) goes outside the windows, whatever they say: it comes
    before the next window, and within HARM_LEAD. "" to wait."""
    wait = (upcoming - now).total_seconds() if upcoming is not None else math.inf
    if harm_in is None or harm_in >= wait or harm_in > HARM_LEAD:
        return ""
    following = f"the next window ({_ago(wait)})" if upcoming is not None else "any window"
    return (
        f"outside window, before the OOM kill: {cause} reaches MemoryMax in {_ago(harm_in)}, "
        f"before {following}"
    )


def _cheaper_now(
    settings: PolicySettings,
    cause: str | None,
    plan: Plan | None,
    loss: float | None,
    uptime: float | None,
    upcoming: datetime | None,
    now: datetime,
    budget: Budget | None,
) -> str:
    """Why a restart goes outside the windows where the operator opted in (``when_cheaper``):
    with an [slo], only while the availability budget left covers it, and, with a latency
    objective, when it saves more latency budget until the next window than it spends;
    without one, when a slowdown's waiting would lose more service (speed lost x time) than
    the restart's outage. "" to wait."""
    if settings.outside_windows != "when_cheaper" or upcoming is None:
        return ""  # the windows hold (without windows, only emergencies restart)
    wait = (upcoming - now).total_seconds()
    spend = budget.spend(wait) if budget is not None else None
    if spend is not None and spend.cost > spend.left:
        return ""
    if spend is not None and spend.saving is not None:
        if spend.saving <= spend.cost:
            return ""
        return f"outside window, within the error budget: {spend.words()}"
    # No latency objective to weigh (or nothing counted yet): service lost against the outage.
    if cause not in SLOWDOWNS or uptime is None:
        return ""
    outage = plan.outage if plan is not None else DEFAULT_OUTAGE
    if cause == PREVENTION and plan is not None:
        lost = plan.cost_of_waiting(uptime, wait)
    elif loss is not None and loss > 0:
        lost = loss * wait
    else:
        return ""
    if not lost > outage:
        return ""
    return (
        f"outside window, cheaper now: waiting ({_ago(wait)} to the next window) would lose "
        f"{lost / 60:.0f} min of service, a restart {outage / 60:.0f} min"
    )


def _budget_holds(
    settings: PolicySettings,
    cause: str | None,
    budget: Budget,
    upcoming: datetime | None,
    now: datetime,
    traffic: TrafficProfile | None,
    quiet_end: bool = False,
) -> str:
    """Why the operator's objectives hold a restart the windows allow: the availability
    budget left to spend does not cover it; for a cause diagnosed (a planned one has no
    latency to show yet), it would save no more latency budget before the next window than
    it spends; or a quieter hour to come costs less, the latency lost waiting for it
    included (``_quieter_later``). At a ``quiet_end`` (the last minutes of this host's quiet
    hours) the budget left alone binds: no later hour is cheaper, and a decline with uptime
    is weighed as prevention is, by the busy hours to come, which its past misses do not
    show. "" to go, and when nothing is counted yet."""
    wait = (upcoming - now).total_seconds() if upcoming is not None else DAY
    spend = budget.spend(wait)
    if spend is None:
        return ""
    if spend.cost > spend.left:
        return f"error budget: {spend.words()}; the budget left does not cover it"
    if quiet_end:
        return ""
    if cause not in PLANNED and spend.saving is not None and spend.saving <= spend.cost:
        return f"error budget: {spend.words()}; no more than it spends"
    return _quieter_later(settings, spend, now, traffic)


# A later hour is worth waiting for when it costs at most this share of a restart now.
QUIETER = 0.8


def _quieter_later(
    settings: PolicySettings, spend: Spend, now: datetime, traffic: TrafficProfile | None
) -> str:
    """Why a restart waits for a later hour of this day (the next 23 starts of an hour) that
    this host's traffic makes cheaper: its usual rate's outage, plus the latency budget lost
    meanwhile, at most QUIETER of a restart now. Only hours where one may go: in a window,
    unless the operator opted in to any time. "" when none is, or the profile knows none."""
    if traffic is None:
        return ""
    top = now.replace(minute=0, second=0, microsecond=0)
    anywhere = settings.outside_windows == "when_cheaper"
    spans = [] if anywhere else _window_spans(settings, now)
    best: tuple[float, datetime] | None = None
    for ahead in range(1, 24):
        at = top + timedelta(hours=ahead)
        rate = traffic.median(at.astimezone(settings.zone).hour)
        if rate is None or not (anywhere or any(a <= at < b for a, b in spans)):
            continue
        total = rate * spend.per_rate + spend.losing * (at - now).total_seconds()
        if best is None or total < best[0]:
            best = (total, at)
    # Strictly cheaper: a restart that costs nothing now has nothing to wait for.
    if best is None or best[0] >= QUIETER * spend.cost:
        return ""
    return (
        f"error budget: a restart at {utc_text(best[1].timestamp())}, this host's quieter "
        f"hour, spends {best[0] * 100:.1f} % of the budgets (waiting included) against "
        f"{spend.cost * 100:.1f} % now"
    )


def _window_spans(settings: PolicySettings, now: datetime) -> list[tuple[datetime, datetime]]:
    """The windows' occurrences around ``now`` (UTC instants)."""
    local = now.astimezone(settings.zone).date()
    return [span for w in settings.parsed for span in w.occurrences(local, settings.zone)]


def _busier_than_usual(
    settings: PolicySettings,
    traffic: TrafficProfile | None,
    request_rate: float | None,
    now: datetime,
) -> str:
    """Why the percentile gate holds, or "" when the rate is at or below this host's
    percentile for this local hour. Too little history at this hour holds: the operator asked
    for a quiet moment by this host's standard, which cannot be told yet."""
    percent = settings.max_request_rate_percentile
    hour = now.astimezone(settings.zone).hour
    if request_rate is None:
        return "traffic gate: request rate unknown"
    limit = traffic.percentile_bin(hour, percent) if traffic is not None else None
    if limit is None:
        known = traffic.count(hour) if traffic is not None else 0.0
        return (
            f"traffic gate: {known:.0f} of {PROFILE_MIN_VALUES} minutes of this host's traffic "
            f"known at {hour:02d}:00, too few for its {percent:g}th percentile"
        )
    if rate_bin(request_rate) > limit:
        return (
            f"traffic gate: {request_rate:.2f} requests/s above this host's {percent:g}th "
            f"percentile at {hour:02d}:00 (up to {bin_top(limit):.2g}/s)"
        )
    return ""


def _ago(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min"
