"""The policy restarts only in its windows (time zones and DST included), not too often,
never in a loop that does not help, and always says what blocked it."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from vkvagent.engine.policy import (
    DAY,
    FLAGS,
    SCHEDULED,
    Controls,
    PolicySettings,
    RestartRecord,
    Verdict,
    escalated,
    evaluate,
    parse_window,
    window_state,
)
from vkvagent.engine.traffic import (
    TrafficProfile,
)

UTC = timezone.utc
ENFORCE = PolicySettings(mode="enforce", windows=("daily 02:00-05:00",))
CHEAPER = replace(ENFORCE, outside_windows="when_cheaper")  # the operator's opt-in
IN = datetime(2025, 3, 4, 3, 0, tzinfo=UTC)  # a Tuesday, inside the window
OUT = datetime(2025, 3, 4, 14, 0, tzinfo=UTC)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def restart(hours_before: float, now: datetime = IN, **values: Any) -> RestartRecord:
    return RestartRecord(
        (now - timedelta(hours=hours_before)).timestamp(), values.pop("cause", "stall"), **values
    )


def verdict(
    settings: PolicySettings = ENFORCE,
    now: datetime = IN,
    cause: str | None = "uptime_decline",
    **values: Any,
) -> Verdict:
    args: dict[str, Any] = dict(
        cause=cause, wanted=cause is not None, uptime=20000.0, request_rate=2.0, history=(),
        controls=Controls(), now=now,
    )  # fmt: skip
    args.update(values)
    return evaluate(settings, **args)


# -- windows -----------------------------------------------------------------------------------


def test_window_specs_read_days_ranges_lists_and_times() -> None:
    w = parse_window("mon-fri 22:00-02:00")
    assert w.days == {0, 1, 2, 3, 4} and (w.start, w.end) == (22 * 60, 2 * 60)
    assert parse_window("fri-mon 01:00-05:00").days == {4, 5, 6, 0}
    assert parse_window("mon,wed,sat-sun 00:00-24:00").days == {0, 2, 5, 6}
    assert parse_window("daily 3:15 - 4:45").days == set(range(7))
    assert parse_window("* 00:00-01:00").days == set(range(7))
    for bad in ("mon 25:00-26:00", "mon 02:00-02:00", "funday 01:00-02:00", "mon 1-2",
                "mon-tue-wed 01:00-02:00", "mon 00:60-01:00", ""):  # fmt: skip
        with pytest.raises(ValueError, match=r"^window ") as caught:
            parse_window(bad)
        assert "\n" not in str(caught.value)


def test_a_window_crossing_midnight_belongs_to_the_day_it_starts() -> None:
    settings = PolicySettings(windows=("fri 22:00-02:00",))
    assert window_state(settings, at("2025-03-07T23:00:00Z"))[0]  # Friday night
    assert window_state(settings, at("2025-03-08T01:59:00Z"))[0]  # ... into Saturday
    assert not window_state(settings, at("2025-03-08T02:00:00Z"))[0]
    assert not window_state(settings, at("2025-03-07T21:59:00Z"))[0]
    assert not window_state(settings, at("2025-03-09T01:00:00Z"))[0]  # no Saturday window
    _, upcoming = window_state(settings, at("2025-03-08T02:00:00Z"))
    assert upcoming == at("2025-03-14T22:00:00Z")


def test_several_windows_and_the_next_start() -> None:
    settings = PolicySettings(windows=("mon-fri 02:00-04:00", "sat,sun 00:00-08:00"))
    assert window_state(settings, at("2025-03-08T07:00:00Z"))[0]  # Saturday morning
    assert not window_state(settings, at("2025-03-07T07:00:00Z"))[0]  # Friday morning
    assert window_state(settings, at("2025-03-07T07:00:00Z"))[1] == at("2025-03-08T00:00:00Z")
    assert window_state(settings, at("2025-03-09T09:00:00Z"))[1] == at("2025-03-10T02:00:00Z")
    assert window_state(PolicySettings(windows=()), IN) == (False, None)


def test_windows_follow_their_time_zone() -> None:
    settings = PolicySettings(windows=("daily 02:00-05:00",), timezone="America/Los_Angeles")
    assert window_state(settings, at("2025-01-15T11:00:00Z"))[0]  # 03:00 PST
    assert not window_state(settings, at("2025-01-15T03:00:00Z"))[0]  # 03:00 UTC
    assert window_state(settings, at("2025-01-15T03:00:00Z"))[1] == at("2025-01-15T10:00:00Z")


def test_spring_forward_shortens_a_window_in_the_gap_and_skips_nothing() -> None:
    # Paris, 2025-03-30: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
    settings = PolicySettings(windows=("daily 02:00-04:00",), timezone="Europe/Paris")
    before = at("2025-03-30T00:30:00Z")
    assert window_state(settings, before) == (False, at("2025-03-30T01:00:00Z"))
    assert window_state(settings, at("2025-03-30T01:00:00Z"))[0]  # 03:00 CEST: it opens
    assert window_state(settings, at("2025-03-30T01:59:00Z"))[0]
    assert not window_state(settings, at("2025-03-30T02:00:00Z"))[0]  # 04:00 CEST
    assert window_state(settings, at("2025-03-31T00:00:00Z"))[0]  # next day: 02:00 CEST
    assert window_state(settings, at("2025-03-29T01:00:00Z"))[0]  # day before: 02:00 CET


def test_fall_back_keeps_the_window_open_through_the_repeated_hour() -> None:
    # Paris, 2025-10-26: 03:00 CEST falls back to 02:00 CET (01:00 UTC); 02:xx happens twice.
    settings = PolicySettings(windows=("daily 01:30-03:30",), timezone="Europe/Paris")
    assert window_state(settings, at("2025-10-25T23:30:00Z"))[0]  # 01:30 CEST
    assert window_state(settings, at("2025-10-26T00:30:00Z"))[0]  # 02:30 CEST
    assert window_state(settings, at("2025-10-26T01:30:00Z"))[0]  # 02:30 CET, again
    assert window_state(settings, at("2025-10-26T02:29:00Z"))[0]  # 03:29 CET
    assert not window_state(settings, at("2025-10-26T02:30:00Z"))[0]
    assert window_state(settings, at("2025-10-26T02:30:00Z"))[1] == at("2025-10-27T00:30:00Z")


# -- the gates ---------------------------------------------------------------------------------


def test_in_the_window_with_nothing_against_it_the_verdict_is_restart_with_a_drain() -> None:
    v = verdict()
    assert (v.action, v.reason, v.cause) == ("restart", "restart: in window", "uptime_decline")
    assert v.window_open and v.drain_max_in_flight == 0
    assert v.next_window == at("2025-03-05T02:00:00Z")


def test_outside_the_window_it_holds_and_names_the_next_one() -> None:
    v = verdict(now=OUT)
    assert v.action == "hold"
    assert v.reason == "outside window (next 2025-03-05T02:00:00Z)"
    assert not v.window_open
    v = verdict(PolicySettings(mode="enforce", windows=()), now=OUT)
    assert v.reason == "outside window (none set)"


def test_a_stall_is_an_emergency_any_time_and_is_not_drained() -> None:
    v = verdict(now=OUT, cause="stall")
    assert v.action == "restart" and v.reason == "restart: emergency, any time"
    assert v.drain_max_in_flight is None
    # ... and not a cooldown matter either, but the minimum interval still applies.
    assert verdict(now=OUT, cause="stall", history=(restart(1.5, OUT),)).action == "restart"
    v = verdict(now=OUT, cause="stall", history=(restart(0.5, OUT),))
    assert v.action == "hold" and v.reason.startswith("min interval: last restart 30 min ago")
    # Other causes can be made emergencies; vetoed ones cannot.
    settings = PolicySettings(mode="enforce", emergency=("stall", "kv_pressure"))
    assert verdict(settings, now=OUT, cause="kv_pressure").action == "restart"
    with pytest.raises(ValueError, match="emergency causes"):
        PolicySettings(emergency=("gpu_throttle",))


def test_nothing_to_fix_means_none_and_off_means_none() -> None:
    v = verdict(cause=None)
    assert v.action == "none" and v.reason == "nothing a restart would fix"
    v = verdict(cause="gpu_throttle", wanted=False)
    assert v.action == "none"
    v = verdict(PolicySettings(mode="off"))
    assert v.action == "none" and v.reason == "mode off"


def test_observe_mode_decides_everything_but_never_acts() -> None:
    observe = PolicySettings(mode="observe", windows=("daily 02:00-05:00",))
    v = verdict(observe)
    assert v.action == "hold" and v.reason == "observe mode: would restart now (in window)"
    assert verdict(observe, now=OUT).reason.startswith("outside window")


def test_cooldown_then_budget_over_a_rolling_day() -> None:
    v = verdict(history=(restart(1.5),))
    assert v.action == "hold" and v.reason == "cooldown: last restart 1.5 h ago (cooldown 6.0 h)"
    # Longer than the default window (3 h): one window holds one restart for a slow cause.
    assert verdict(history=(restart(5.9),)).reason.startswith("cooldown: ")
    assert verdict(history=(restart(6.1),)).action == "restart"
    four = (restart(23), restart(16), restart(12), restart(9))
    v = verdict(history=four)
    assert v.action == "hold" and v.reason == "budget: 4 restarts in the last 24 h (at most 4)"
    assert verdict(history=(restart(25), restart(16), restart(12), restart(9))).action == "restart"
    # With only the wall clock, one recorded in the future (the clock was stepped back since)
    # counts as just now: a step back never forgets a restart.
    assert verdict(history=(restart(-2),)).reason.startswith("min interval: last restart 0 min")


def test_ages_run_on_the_monotonic_clock_whatever_the_wall_clock_does() -> None:
    """A restart 10 min ago (monotonic) while the wall clock was stepped a day either way."""
    for step in (-DAY, +DAY):
        record = RestartRecord(IN.timestamp() - 600 - step, "uptime_decline", mono=5000.0)
        v = verdict(history=(record,), mono=5600.0)
        assert v.action == "hold" and v.reason.startswith("min interval: last restart 10 min ago")
    # The same record 7 h later on the monotonic clock, whatever the wall clock says.
    assert verdict(history=(record,), mono=5000.0 + 7 * 3600).action == "restart"
    # A record without a monotonic time (another boot's) is aged on the wall clock.
    assert verdict(history=(restart(0.5),), mono=5600.0).reason.startswith("min interval")


def test_the_traffic_gate_holds_a_busy_window() -> None:
    gated = PolicySettings(mode="enforce", max_request_rate=1.0)
    assert verdict(gated, request_rate=0.5).action == "restart"
    v = verdict(gated, request_rate=2.5)
    assert v.action == "hold" and v.reason == "traffic gate: 2.50 requests/s above 1"
    assert verdict(gated, request_rate=None).reason == "traffic gate: request rate unknown"
    assert verdict(gated, request_rate=50.0, cause="stall", now=OUT).action == "restart"


def history(rates: list[float], hour: int = 3, zone: str = "UTC") -> TrafficProfile:
    """A profile holding ``rates``, one a minute at ``hour`` local, on the days before IN."""
    profile, day = TrafficProfile(), IN.date() - timedelta(days=30)
    local = ZoneInfo(zone)
    for index, rate in enumerate(rates):
        when = datetime(day.year, day.month, day.day, hour, tzinfo=local)
        when += timedelta(days=index // 60, minutes=index % 60)
        profile = profile.record(rate, when, local)
    return profile


def test_the_percentile_gate_holds_a_window_busier_than_this_host_usually_is_then() -> None:
    gated = PolicySettings(mode="enforce", max_request_rate_percentile=25)
    # Two days at 03:00: a quarter of the minutes at 1 request/s, the rest busier.
    profile = history([1.0, 4.0, 4.0, 8.0] * 30)
    v = verdict(gated, request_rate=0.9, traffic=profile)
    assert v.action == "restart"
    v = verdict(gated, request_rate=3.0, traffic=profile)
    assert v.action == "hold"
    assert v.reason == (
        "traffic gate: 3.00 requests/s above this host's 25th percentile at 03:00 (up to 1.2/s)"
    )
    assert verdict(replace(gated, max_request_rate_percentile=75), request_rate=3.0,
                   traffic=profile).action == "restart"  # fmt: skip
    # Another hour of the day has no history yet: the gate holds, and says why.
    v = verdict(gated, request_rate=0.1, traffic=profile, now=IN + timedelta(hours=1))
    assert v.reason == (
        "traffic gate: 0 of 60 minutes of this host's traffic known at 04:00, too few for its "
        "25th percentile"
    )
    assert verdict(gated, request_rate=0.1, traffic=history([0.1] * 59)).action == "hold"
    assert verdict(gated, request_rate=0.1, traffic=history([0.1] * 60)).action == "restart"
    assert verdict(gated, request_rate=None, traffic=profile).reason == (
        "traffic gate: request rate unknown"
    )
    # Emergencies pass; the absolute gate still applies on its own.
    assert verdict(gated, request_rate=50.0, cause="stall", traffic=None).action == "restart"
    both = replace(gated, max_request_rate=0.5)
    assert verdict(both, request_rate=0.9, traffic=profile).reason.startswith("traffic gate: 0.90")


def test_pause_until_a_time() -> None:
    paused = Controls(paused_until=(IN + timedelta(hours=1)).timestamp())
    v = verdict(controls=paused, cause="stall")
    assert v.action == "hold" and v.reason == "paused until 2025-03-04T04:00:00Z"
    assert verdict(controls=paused, now=IN + timedelta(hours=1)).action == "restart"


def test_restarts_that_did_not_help_escalate_until_resumed() -> None:
    failed = (restart(50, recovered=False, cause="uptime_decline"),
              restart(26, recovered=False, cause="uptime_decline"))  # fmt: skip
    v = verdict(history=failed, cause="stall")
    assert v.action == "hold" and v.reason.startswith("escalated: the last 2 restarts")
    resumed = Controls(resumed_at=(IN - timedelta(hours=10)).timestamp())
    assert verdict(history=failed, controls=resumed).action == "restart"
    # One that helped breaks the streak; one not judged yet does too.
    assert escalated(ENFORCE, (*failed, restart(3, recovered=True)), Controls()) == 0
    assert escalated(ENFORCE, (*failed, restart(3)), Controls()) == 0
    assert escalated(ENFORCE, failed[:1], Controls()) == 0
    # Scheduled restarts are not judged on recovery.
    assert escalated(ENFORCE, (*failed, restart(3, cause=SCHEDULED)), Controls()) == 2


def test_aborted_attempts_back_off_doubling_to_an_hour_and_count_for_nothing_else() -> None:
    def aborted(minutes_before: float) -> RestartRecord:
        return restart(minutes_before / 60, aborted=True, cause="uptime_decline")

    v = verdict(history=(aborted(0.5),))
    assert v.action == "hold"
    assert v.reason == (
        "retry back-off: 1 restart attempt(s) in a row aborted, the last 0 min ago; "
        "next try in 0 min"
    )
    assert verdict(history=(aborted(1.5),)).action == "restart"  # 1 min after the first
    # Each one in a row doubles the wait: 1, 2, 4 min ...
    three = (aborted(30), aborted(20), aborted(3))
    assert verdict(history=three).reason.startswith("retry back-off: 3 restart attempt(s)")
    assert verdict(history=(aborted(30), aborted(20), aborted(5))).action == "restart"
    # ... up to an hour, however many there were.
    many = tuple(aborted(600 - 10 * i) for i in range(12))  # the last 490 min ago
    assert verdict(history=(*many[:-1], aborted(59))).action == "hold"
    assert verdict(history=(*many[:-1], aborted(61))).action == "restart"
    # A restart that happened ends the streak; aborted ones never count as restarts.
    streak_then_restart = (aborted(300), aborted(290), aborted(280), restart(2), aborted(0.5))
    assert verdict(history=streak_then_restart).reason.startswith("retry back-off: 1 ")
    assert escalated(ENFORCE, (restart(50, recovered=False), restart(26, recovered=False),
                               aborted(60)), Controls()) == 2  # fmt: skip
    v = verdict(history=(aborted(200), aborted(190), aborted(180)), cause="stall")
    assert v.action == "restart"  # no cooldown, no min interval, no budget spent
    # An emergency is tried again every minute, however many attempts failed before.
    assert verdict(history=many, cause="stall").action == "restart"  # the last 490 min ago
    assert verdict(history=(*many, aborted(0.5)), cause="stall").action == "hold"
    assert verdict(history=(*many, aborted(1.5)), cause="stall").action == "restart"
    # One recorded in the future (the wall clock stepped back since) counts as just now.
    assert verdict(history=(aborted(-120),)).action == "hold"
    # `vkvagent resume` starts afresh.
    resumed = Controls(resumed_at=(IN - timedelta(minutes=1)).timestamp())
    assert verdict(history=(aborted(30), aborted(20), aborted(3)), controls=resumed).action == (
        "restart"
    )


def test_a_scheduled_restart_is_opt_in_and_waits_for_the_window() -> None:
    assert verdict(cause=None, uptime=10 * 86400).action == "none"  # not asked for
    daily = PolicySettings(mode="enforce", max_uptime=86400.0)
    v = verdict(daily, cause=None, uptime=86400.0 + 60)
    assert v.action == "restart" and v.cause == SCHEDULED
    assert verdict(daily, cause=None, uptime=3600.0).action == "none"
    v = verdict(daily, now=OUT, cause=None, uptime=90000.0)
    assert v.action == "hold" and v.cause == SCHEDULED and v.reason.startswith("outside")
    # A broken GPU or a dead engine is no time for a scheduled restart.
    assert verdict(daily, cause="gpu_fault", wanted=False, uptime=90000.0).action == "none"


def test_a_flag_change_waits_for_the_window_and_never_escalates() -> None:
    due = "apply --max-num-seqs 64"
    v = verdict(cause=None, flags_due=due)
    assert (v.action, v.cause) == ("restart", FLAGS)
    v = verdict(now=OUT, cause=None, flags_due=due)
    assert (v.action, v.cause) == ("hold", FLAGS) and v.reason.startswith("outside window")
    observe = replace(ENFORCE, mode="observe")
    assert verdict(observe, cause=None, flags_due=due).reason.startswith(
        "observe mode: would restart now (in window)"
    )
    # Before a scheduled restart; after a cause to fix (that restart carries the flags).
    daily = replace(ENFORCE, max_uptime=3600.0)
    assert verdict(daily, cause=None, flags_due=due).cause == FLAGS
    assert verdict(cause="kv_pressure", flags_due=due).cause == "kv_pressure"
    # Never over a veto: the new flags' run would be judged under throttling or a surge.
    assert verdict(cause="gpu_fault", wanted=False, flags_due=due).action == "none"
    assert verdict(cause="load_shift", wanted=False, flags_due=due).action == "none"
    # A flag change is never judged as a cure: two in a row that "did not recover" (the new
    # flags' speed is judged separately) do not stop the restarts of the causes.
    history = [restart(10, cause=FLAGS, recovered=False), restart(9, cause=FLAGS, recovered=False)]
    assert escalated(ENFORCE, history, Controls()) == 0


def test_settings_report_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as caught:
        PolicySettings(mode="act", timezone="Mars/Olympus", windows=("someday 1-2",),
                       max_per_day=0)  # fmt: skip
    message = str(caught.value)
    assert message.startswith("policy: ")
    for part in ("mode 'act'", "Mars/Olympus", "someday", "max_per_day"):
        assert part in message
    assert PolicySettings(timezone="Asia/Kolkata").zone.key == "Asia/Kolkata"


def test_a_window_inside_the_spring_forward_gap_still_opens() -> None:
    """Paris skips 02:00-03:00 on 2025-03-30: a 02:00-03:00 window still opens for an hour."""
    from datetime import datetime, timezone

    from vkvagent.engine.policy import PolicySettings, window_state

    settings = PolicySettings(timezone="Europe/Paris", windows=("daily 02:00-03:00",))
    during = datetime(2025, 3, 30, 1, 30, tzinfo=timezone.utc)  # 03:30 local, after the jump
    before = datetime(2025, 3, 30, 0, 30, tzinfo=timezone.utc)  # 01:30 local
    is_open, upcoming = window_state(settings, before)
    assert not is_open and upcoming == datetime(2025, 3, 30, 1, 0, tzinfo=timezone.utc)
    assert window_state(settings, during)[0]


def test_apply_at_next_window_waits_for_the_window_then_returns() -> None:
    """`vkvagent apply --at-next-window` sleeps until a window opens (on injected clocks)."""
    import io
    from datetime import datetime, timedelta, timezone

    import pytest as _pytest

    from vkvagent.engine.policy import PolicySettings
    from vkvagent.tools.actions import wait_for_window
    from vkvagent.tools.exitcodes import CommandError

    settings = PolicySettings(timezone="UTC", windows=("daily 02:00-04:00",))
    clock = [datetime(2026, 3, 2, 23, 0, tzinfo=timezone.utc)]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += timedelta(seconds=seconds)

    out = io.StringIO()
    wait_for_window(settings, out, now=lambda: clock[0], sleep=sleep)
    assert clock[0] >= datetime(2026, 3, 3, 2, 0, tzinfo=timezone.utc)
    assert clock[0] < datetime(2026, 3, 3, 4, 0, tzinfo=timezone.utc)
    assert max(slept) <= 300  # wakes at least every 5 minutes while waiting
    assert out.getvalue() == "waiting for the restart window at 2026-03-03T02:00:00+00:00\n"
    slept.clear()
    wait_for_window(settings, io.StringIO(), now=lambda: clock[0], sleep=sleep)
    assert slept == []  # already open: at once
    with _pytest.raises(CommandError, match="no restart window"):
        wait_for_window(PolicySettings(windows=()), io.StringIO(), now=lambda: clock[0])


def test_a_foretold_harm_restarts_in_the_last_window_before_it_or_just_ahead_of_it() -> None:
    """A memory leak timed against MemoryMax (``harm_in``) waits for a later window that
    opens well before it; when none does, it goes an hour ahead of it, drained."""
    h = 3600.0
    leak = dict(cause="host_memory_growth", harm_in=40 * h)  # the next window is 23 h away
    held = verdict(**leak)
    assert (held.action, held.reason) == (
        "hold",
        "not yet: the harm is 40.0 h away, after the next window (2025-03-05T02:00:00Z)",
    )
    assert verdict(**{**leak, "harm_in": 28 * h}).action == "restart"  # 23 h > 0.75 x 28 h
    assert verdict(**{**leak, "harm_in": None}).action == "restart"  # untimed: as before
    # Outside the windows (the next opens in 12 h): it waits until the harm is an hour away,
    # then goes, drained, whatever the windows say: the kernel's OOM kill would cut off every
    # request. This is the one slowdown the default policy lets cross a window.
    assert verdict(now=OUT, **{**leak, "harm_in": 5 * h}).reason.startswith("outside window (")
    near = verdict(now=OUT, **{**leak, "harm_in": 50 * 60.0})
    assert (near.action, near.reason, near.drain_max_in_flight) == (
        "restart",
        "restart: outside window, before the OOM kill: host_memory_growth reaches MemoryMax in "
        "50 min, before the next window (12.0 h)",
        0,
    )
    assert ENFORCE.outside_windows == "never"
    # With no window at all, too: the leak is no emergency, but the kill is coming.
    bare = PolicySettings(mode="enforce", windows=())
    assert verdict(bare, now=OUT, **{**leak, "harm_in": 50 * 60.0}).action == "restart"
    assert verdict(bare, now=OUT, **{**leak, "harm_in": 5 * h}).action == "hold"
    # The budget still binds, as for any restart.
    full = tuple(restart(hours, now=OUT) for hours in (7, 13, 19, 23))
    assert verdict(now=OUT, history=full, **{**leak, "harm_in": 50 * 60.0}).action == "hold"


def test_a_leaking_kv_cache_goes_outside_the_windows_when_waiting_costs_more() -> None:
    # By default the windows hold, however much waiting costs.
    held = verdict(now=OUT, cause="kv_pressure", loss=0.1)
    assert held.reason == "outside window (next 2025-03-05T02:00:00Z)"
    # The operator's opt-in: 12 h to the next window; the leak no longer holds 10 % of the
    # heaviest clean load.
    leak = verdict(CHEAPER, now=OUT, cause="kv_pressure", loss=0.1)
    assert (leak.action, leak.reason) == (
        "restart",
        "restart: outside window, cheaper now: waiting (12.0 h to the next window) would lose "
        "72 min of service, a restart 3 min",
    )
    assert leak.drain_max_in_flight == 0
    # A KV storm with no leak measured (loss unknown) waits for the window, as before.
    assert verdict(CHEAPER, now=OUT, cause="kv_pressure").reason.startswith("outside window (")
    # Near the window, a small loss is not worth a restart.
    dawn = at("2025-03-05T01:30:00Z")
    assert verdict(now=dawn, cause="kv_pressure", loss=0.05).reason.startswith("outside window")
