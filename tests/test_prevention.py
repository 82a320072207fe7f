"""Prevention: the decline this server's past runs showed, fitted, and the restart it times."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from vkvagent.engine.policy import PREVENTION, Controls, PolicySettings, RestartRecord, evaluate
from vkvagent.engine.prevention import (
    BUCKET,
    DEFAULT_OUTAGE,
    KEPT,
    Plan,
    PreventionSettings,
    Track,
    decline,
    ended,
    hinge,
    judged,
    plan,
)
from vkvagent.engine.traffic import TYPICAL_MIN_VALUES, TrafficProfile, rate_bin

HOUR = 3600.0
NOW = 1.74e9
SETTINGS = PreventionSettings()


def declining(run: str, *, onset_h: float = 5.0, per_h: float = 0.02, hours: float = 17.0,
              noise: float = 0.02, seed: int = 1) -> Track:  # fmt: skip
    """A run's track: stable for ``onset_h``, then ``per_h`` of its speed lost an hour, one
    noisy ratio a minute from 10 minutes of uptime."""
    rng = random.Random(seed)
    track = Track(run=run, server="s")
    for minute in range(10, int(hours * 60)):
        u = minute * 60.0
        ratio = 1.0 - max(0.0, per_h * (u / HOUR - onset_h)) + rng.gauss(0.0, noise)
        track = track.add(u, ratio)
    return track


def cured(track: Track, *, ended_at: float = NOW - HOUR, outage: float = 200.0) -> Track:
    (done,) = ended((), track, "next", ended_at, outage)
    (judged_track,) = judged((done,), "next", True)
    return judged_track


def test_the_hinge_fit_finds_onset_and_rate_through_noise() -> None:
    points = declining("a").points()
    assert len(points) == math.ceil(17 * HOUR / BUCKET)
    fit = hinge(points)
    assert fit is not None
    onset, rate = fit
    assert abs(onset / HOUR - 5.0) <= 1.0
    assert rate * HOUR == pytest.approx(0.02, rel=0.2)
    # Noise alone, too few points, or a speed that only rises: no decline to prevent.
    assert hinge(declining("flat", per_h=0.0).points()) is None
    assert hinge(points[:5]) is None
    assert hinge([(u, -loss) for u, loss in points]) is None


def test_a_run_in_progress_tells_its_own_decline_from_its_completed_half_hours() -> None:
    # 2 %/h from 5 h of uptime: at 10.9 h the trend says 12 % lost, whatever the noise.
    track = declining("r", hours=10.9)
    loss = decline(track, 10.9 * HOUR)
    assert loss is not None and loss == pytest.approx(0.118, abs=0.02)
    # The half hour under way (from 10.5 h) does not count: an odd minute in it moves nothing.
    odd = track.add(10.8 * HOUR, 0.2)
    assert decline(odd, 10.9 * HOUR) == loss
    # A run keeping its speed, or too young for MIN_POINTS half hours, has no trend.
    assert decline(declining("flat", per_h=0.0, hours=11.0), 11 * HOUR) is None
    assert decline(declining("young", onset_h=0.5, per_h=0.1, hours=3.0), 2.9 * HOUR) is None
    assert decline(None, 11 * HOUR) is None and decline(track, None) is None
    # Not carried across hours without points (idle, or past TRACKED): at most the half hour
    # after the last one completed.
    stopped = decline(track, 60 * HOUR)
    assert stopped is not None and stopped == pytest.approx(decline(track, 11.5 * HOUR))
    assert stopped < 0.15


def test_the_plan_restarts_at_the_renewal_optimum() -> None:
    found = plan(SETTINGS, [cured(declining("a"))], "s", NOW)
    assert found is not None and found.runs == 1 and found.outage == 200.0 and found.measured
    # T* = sqrt(u0^2 + 2 C / r): the uptime where the speed lost since the last restart
    # outweighs one more outage.
    assert found.at == pytest.approx(math.sqrt(found.onset**2 + 2 * 200.0 / found.rate))
    assert 5.0 < found.at / HOUR < 7.0
    # The share of service lost per period is least at T*.
    assert found.cost_rate(found.at) < found.cost_rate(found.at - HOUR)
    assert found.cost_rate(found.at) < found.cost_rate(found.at + HOUR)
    # Waiting costs nothing before T*, and more the longer past it.
    assert found.cost_of_waiting(found.at - 2 * HOUR, HOUR) == 0.0
    assert 0 < found.cost_of_waiting(found.at, HOUR) < found.cost_of_waiting(found.at, 2 * HOUR)
    assert "1 cured run(s) of this server lost speed from" in found.words()


def test_only_cured_recent_runs_of_the_same_server_count() -> None:
    run = declining("a")
    assert plan(SETTINGS, [run], "s", NOW) is None  # never judged
    done = ended((), run, "next", NOW - HOUR, 200.0)
    assert plan(SETTINGS, judged(done, "next", False), "s", NOW) is None  # did not help
    good = judged(done, "next", True)
    assert plan(SETTINGS, good, "s", NOW) is not None
    assert plan(SETTINGS, good, "another server", NOW) is None
    assert plan(SETTINGS, good, "s", NOW + SETTINGS.max_age) is None  # too old
    assert plan(PreventionSettings(min_runs=2), good, "s", NOW) is None
    # A judgement is for the run that followed: another run's does not touch it.
    assert judged(done, "other", True) == done
    # A gap longer than an hour is not a restart's outage: the default stands in.
    long_gap = judged(ended((), run, "next", NOW - HOUR, 2 * HOUR), "next", True)
    assert long_gap[0].outage is None
    found = plan(SETTINGS, long_gap, "s", NOW)
    assert found is not None and found.outage == DEFAULT_OUTAGE and not found.measured
    # Only the newest KEPT runs are kept.
    many: tuple[Track, ...] = ()
    for i in range(KEPT + 2):
        many = ended(many, Track(run=f"r{i}"), f"r{i + 1}", NOW, 100.0)
    assert [t.run for t in many] == [f"r{i}" for i in range(2, KEPT + 2)]


def test_a_new_host_plans_from_its_peers_runs_until_it_has_its_own() -> None:
    peers = [cured(declining(f"peer-{i}", seed=i), outage=300.0) for i in range(3)]
    assert plan(SETTINGS, [], "s", NOW) is None  # alone, a new host has nothing to plan from
    borrowed = plan(SETTINGS, [], "s", NOW, peers=peers)
    assert borrowed is not None and (borrowed.runs, borrowed.peers) == (3, 3)
    assert borrowed.outage == 300.0  # the restart's cost the peers measured
    assert 5.0 < borrowed.at / HOUR < 7.5
    assert "3 cured run(s) of this server (3 of them other hosts') lost speed" in borrowed.words()
    assert borrowed.evidence()["prevent_peer_runs"] == 3
    # Once it has a cured run of its own, its own runs and outage decide.
    own = cured(declining("own", onset_h=8.0), outage=120.0)
    mine = plan(SETTINGS, [own], "s", NOW, peers=peers)
    assert mine is not None and (mine.runs, mine.peers, mine.outage) == (1, 0, 120.0)
    assert mine.at > borrowed.at
    # Peers' runs of another server, or too old, do not count.
    assert plan(SETTINGS, [], "another server", NOW, peers=peers) is None
    assert plan(SETTINGS, [], "s", NOW + SETTINGS.max_age, peers=peers) is None


def test_a_peers_run_that_disagrees_with_the_others_is_left_out() -> None:
    agreeing = [cured(declining(f"peer-{i}", seed=i)) for i in range(3)]
    # A run that loses ten times faster (another GPU, a noisy neighbour): left out.
    odd = cured(declining("odd", onset_h=1.0, per_h=0.2, seed=9))
    found = plan(SETTINGS, [], "s", NOW, peers=[*agreeing, odd])
    assert found is not None and found.peers == 3
    alone = plan(SETTINGS, [], "s", NOW, peers=agreeing)
    assert alone is not None and found.at == alone.at
    # Two runs cannot tell which of them is odd: both count.
    pair = plan(SETTINGS, [], "s", NOW, peers=[agreeing[0], odd])
    assert pair is not None and pair.peers == 2


def test_a_track_survives_json_and_refuses_garbage() -> None:
    track = cured(declining("a"))
    assert Track.from_json(json.loads(json.dumps(track.to_json()))) == track
    data = track.to_json()
    data["cured"] = "yes"
    with pytest.raises(ValueError, match="cured"):
        Track.from_json(data)
    with pytest.raises(ValueError, match="track: KeyError"):
        Track.from_json({"run": "a"})
    # State saved before late tracks: not late.
    del data["late"]
    data["cured"] = True
    assert Track.from_json(data) == track
    assert Track.from_json({**data, "late": True}).late
    with pytest.raises(ValueError, match="late"):
        Track.from_json({**data, "late": 1})


def test_a_late_run_counts_once_the_next_run_says_how_slow_it_already_was() -> None:
    # vkvagent installed on a server up 20 h, already at 0.7 of its fresh speed: its late
    # baseline is that speed, so the run's own ratios start at 1.0 and fall 2 %/h of fresh.
    track = Track(run="installed", server="s")
    for minute in range(20 * 60, 26 * 60):
        u = minute * 60.0
        track = track.add(u, 1.0 - 0.02 * (u / HOUR - 20.0) / 0.7)
    late = ended((), replace(track, late=True), "next", NOW - HOUR, 200.0)
    # Until the next run's fresh speed is known, its points are relative to a slowed server.
    assert plan(SETTINGS, judged(late, "next", True), "s", NOW) is None
    # The next run is 1/0.7 as fast as the late baseline: the points are scaled to its speed.
    (scaled,) = judged(late, "next", True, speedup=1 / 0.7)
    assert not scaled.late and scaled.cured
    first = scaled.points()[0]
    assert first[0] == pytest.approx(20.25 * HOUR)
    # Lost of the fresh speed: 0.3 when first seen, 2 %/h since (the bucket's mean minute).
    assert first[1] == pytest.approx(0.3 + 0.02 * 14.5 / 60)
    # With the run in progress, stable for its first 5 h, the onset is no earlier than that.
    current = declining("now", hours=5.0, noise=0.0)
    found = plan(SETTINGS, (scaled,), "s", NOW, current=current)
    assert found is not None and found.runs == 1
    assert found.onset >= 4.5 * HOUR
    # Another server's run in progress, or one tracked late itself, adds nothing.
    alone = plan(SETTINGS, (scaled,), "s", NOW)
    assert alone is not None and alone.onset < found.onset
    assert plan(SETTINGS, (scaled,), "s", NOW, current=replace(current, server="t")) == alone
    assert plan(SETTINGS, (scaled,), "s", NOW, current=replace(current, late=True)) == alone
    # Where a cured run has points, the run in progress adds none: its first busy hours are
    # its baseline, a speed of 1 by definition.
    fresh = (cured(declining("a")),)
    assert plan(SETTINGS, fresh, "s", NOW, current=current) == plan(SETTINGS, fresh, "s", NOW)
    # Judged not cured, a late run stays out.
    assert plan(SETTINGS, judged(late, "next", False, speedup=1.0), "s", NOW) is None


def test_a_run_whose_baseline_came_late_in_it_is_rescaled_by_the_next_runs_speed() -> None:
    # Its first busy hours came 7 h into the run (a quiet night), 2 h into a decline of 2 %/h:
    # its baseline is 0.96 of the fresh speed, and its own ratios start at 1.0 there.
    track = Track(run="quiet-start", server="s")
    for minute in range(7 * 60, 17 * 60):
        u = minute * 60.0
        track = track.add(u, (1.0 - 0.02 * (u / HOUR - 5.0)) / 0.96)
    done = ended((), track, "next", NOW - HOUR, 200.0)
    # The next run, fresh, is 1/0.96 as fast: the points become speed lost of that.
    (scaled,) = judged(done, "next", True, speedup=1 / 0.96)
    assert scaled.cured and scaled.points()[0][1] == pytest.approx(0.04 + 0.02 * 14.5 / 60)
    # With the run in progress stable for its first 5 h, one decline from 5 h on.
    current = declining("now", hours=5.0, noise=0.0)
    found = plan(SETTINGS, (scaled,), "s", NOW, current=current)
    assert found is not None
    assert found.onset == pytest.approx(5 * HOUR, abs=0.75 * HOUR)
    assert found.rate * HOUR == pytest.approx(0.02, rel=0.15)
    # Within noise of its successor (3 %), a run's own baseline stands.
    (kept,) = judged(done, "next", True, speedup=1.02)
    assert kept.cured and kept.buckets == track.buckets
    # So does the baseline of a run compared from its first minutes, whatever the next run's
    # speed says (fresh runs differ by a few percent): a constant offset would hide its onset.
    early = ended((), declining("a"), "next", NOW - HOUR, 200.0)
    (unscaled,) = judged(early, "next", True, speedup=1.05)
    assert unscaled.cured and unscaled.buckets == early[0].buckets


# The operator's opt-in to restarts outside the windows when waiting costs more.
WINDOWED = PolicySettings(
    mode="enforce", windows=("daily 02:00-05:00",), outside_windows="when_cheaper"
)
PLAN = plan(SETTINGS, [cured(declining("a"))], "s", NOW)


def at(hour: float) -> datetime:
    return datetime(2025, 3, 4, tzinfo=timezone.utc) + timedelta(hours=hour)


def verdict(settings: PolicySettings, uptime_h: float, when: datetime, **kw: object):  # type: ignore[no-untyped-def]
    fields: dict[str, object] = dict(
        cause=None, wanted=False, uptime=uptime_h * HOUR, request_rate=1.0, history=(),
        controls=Controls(), now=when, plan=PLAN,
    )  # fmt: skip
    fields.update(kw)
    return evaluate(settings, **fields)  # type: ignore[arg-type]


def test_a_preventive_restart_goes_when_waiting_for_the_window_costs_more() -> None:
    assert PLAN is not None
    # Before the plan's uptime (at least the cooldown, and a day over the daily budget):
    # nothing to do.
    assert verdict(WINDOWED, 5.0, at(12)).action == "none"
    # Past it, outside the window: waiting 14 h would lose more than one outage.
    now = verdict(WINDOWED, 8.5, at(12))
    assert (now.action, now.cause) == ("restart", PREVENTION)
    assert now.reason.startswith("restart: outside window, cheaper now: waiting (14.0 h")
    assert now.drain_max_in_flight == 0  # planned: drained
    # Just before the window opens, waiting is cheaper.
    assert verdict(WINDOWED, 8.5, at(25.9)).reason.startswith("outside window (next")
    # By default (outside_windows = "never"): prevention restarts in the last window before it
    # is due.
    never = PolicySettings(mode="enforce", windows=WINDOWED.windows)
    assert verdict(never, 8.5, at(12)).reason.startswith("outside window (next")
    inside = verdict(never, 6.5, at(26))
    assert (inside.action, inside.cause) == ("restart", PREVENTION)
    assert verdict(never, 4.0, at(26)).action == "none"  # younger than the cooldown
    # Off, or with no plan: nothing.
    off = PolicySettings(mode="enforce", windows=WINDOWED.windows, prevent=False)
    assert verdict(off, 20.0, at(12)).action == "none"
    assert verdict(WINDOWED, 20.0, at(12), plan=None).action == "none"
    # A veto still decides.
    assert verdict(WINDOWED, 20.0, at(12), cause="gpu_fault").action == "none"


def test_a_diagnosed_decline_restarts_now_unless_its_last_restart_did_not_cure_it() -> None:
    kw = dict(cause="uptime_decline", wanted=True, plan=None)
    now = verdict(WINDOWED, 17.0, at(12), loss=0.25, **kw)
    assert now.action == "restart" and "cheaper now" in now.reason
    # A small loss just before the window: wait for it.
    assert verdict(WINDOWED, 17.0, at(25.5), loss=0.02, **kw).action == "hold"
    uncured = (RestartRecord(NOW - 10 * HOUR, "uptime_decline", recovered=False),)
    held = verdict(WINDOWED, 17.0, at(12), loss=0.25, history=uncured, **kw)
    assert held.action == "hold" and held.reason.startswith("escalated: the last restart for")
    resumed = verdict(WINDOWED, 17.0, at(12), loss=0.25, history=uncured,
                      controls=Controls(resumed_at=NOW), **kw)  # fmt: skip
    assert resumed.action == "restart"


def test_slower_flags_are_rolled_back_when_waiting_costs_more_an_apply_waits() -> None:
    kw = dict(flags_due="roll back max-num-seqs=24 (0.71 of the fresh speed)", plan=None)
    back = verdict(WINDOWED, 3.0, at(12), loss=0.29, **kw)
    assert (back.action, back.cause) == ("restart", "flags") and "cheaper now" in back.reason
    # The operator's own change costs no speed: it waits for the window.
    apply = verdict(WINDOWED, 3.0, at(12), flags_due="apply max-num-seqs=64", plan=None)
    assert apply.action == "hold" and apply.reason.startswith("outside window (next")


def test_no_windows_vetoes_and_an_uncured_slowdown_keep_prevention_back() -> None:
    assert PLAN is not None
    # No windows means emergencies only: a slowdown is never "cheaper now".
    none = PolicySettings(mode="enforce", windows=())
    prevented = verdict(none, 20.0, at(12))
    assert prevented.action == "hold" and prevented.reason == "outside window (none set)"
    decline = verdict(none, 17.0, at(12), cause="uptime_decline", wanted=True, loss=0.3)
    assert decline.action == "hold" and decline.reason.startswith("outside window (none set)")
    # A load beyond the fresh capacity or a throttled GPU explains the moment: no
    # preventive restart into it.
    for vetoed in ("load_shift", "gpu_throttle"):
        assert verdict(WINDOWED, 20.0, at(12), cause=vetoed).action == "none"
    # The last restart for the slowdown did not cure it: nothing to prevent.
    uncured = (RestartRecord(NOW - 10 * HOUR, "uptime_decline", recovered=False),)
    assert verdict(WINDOWED, 20.0, at(12), history=uncured).action == "none"


def traffic(rate_at: dict[int, float], values: float = TYPICAL_MIN_VALUES) -> TrafficProfile:
    """A profile with ``values`` minutes at each hour's rate (requests/s)."""
    return TrafficProfile({h: {rate_bin(r): values} for h, r in rate_at.items()})


QUIET_NIGHTS = traffic({h: 0.0 if h < 7 else 4.0 for h in range(24)})


def test_the_profiles_typical_rates_are_known_once_every_hour_has_half_an_hour() -> None:
    rates = QUIET_NIGHTS.typical
    assert rates is not None and rates[:7] == (0.0,) * 7  # idle counts as no traffic
    assert all(r == pytest.approx(4.0, rel=0.1) for r in rates[7:])  # a bin's middle rate
    short = TrafficProfile({**QUIET_NIGHTS.hours, 13: {rate_bin(4.0): TYPICAL_MIN_VALUES - 1}})
    assert short.typical is None
    assert traffic({h: 4.0 for h in range(23)}).typical is None
    # The median: one busy night among two quiet ones leaves the hour quiet.
    mixed = {rate_bin(4.0): 60.0, rate_bin(0.0): 120.0}
    assert TrafficProfile({**QUIET_NIGHTS.hours, 3: mixed}).typical == rates
    # Derived, not state: a profile read back has it.
    assert TrafficProfile.from_json(QUIET_NIGHTS.to_json()).typical == rates


def test_prevention_goes_at_the_end_of_a_quiet_night_not_at_its_start() -> None:
    assert PLAN is not None and PLAN.at < 6 * HOUR  # due from the cooldown's 6 h
    # 02:00 in the window, 8 h of uptime, nights idle: the run's decline costs nothing until
    # 07:00, and a restart then starts the day fresher. It waits for the last quiet moments,
    # whatever the rate now (clients come early or late; the usual hours decide).
    for rate in (0.0, 4.0, None):
        held = verdict(WINDOWED, 8.0, at(2), traffic=QUIET_NIGHTS, request_rate=rate)
        assert (held.action, held.cause) == ("hold", PREVENTION)
        assert held.reason == (
            "prevention waits for the end of this host's quiet hours (2025-03-04T07:00:00Z), "
            "to restart in their last 10 minutes"
        )
    assert verdict(WINDOWED, 12.7, at(6.8), traffic=QUIET_NIGHTS).action == "hold"
    # In them it goes, outside the window: waiting for the next would cost far more.
    late = verdict(WINDOWED, 12.9, at(6.9), traffic=QUIET_NIGHTS)
    assert (late.action, late.cause) == ("restart", PREVENTION)
    assert late.reason == "restart: outside window, at the end of this host's quiet hours"
    # A run younger than the plan's uptime goes there too (at least the cooldown old): it
    # would reach that uptime in the busy hours. Younger than the cooldown: not yet.
    young = verdict(WINDOWED, 6.2, at(6.9), traffic=QUIET_NIGHTS)
    assert (young.action, young.cause) == ("restart", PREVENTION)
    assert verdict(WINDOWED, 5.5, at(6.9), traffic=QUIET_NIGHTS).action == "none"
    # In a busy hour, the plan's uptime decides, as without a profile.
    busy = verdict(WINDOWED, 6.1, at(12), traffic=QUIET_NIGHTS)
    assert (busy.action, busy.cause) == ("restart", PREVENTION)
    # No day of traffic known yet, or outside_windows = "never" (the quiet hours may end
    # outside the windows): this window, as before.
    unknown = traffic({h: 0.0 if h < 7 else 4.0 for h in range(20)})
    never = PolicySettings(mode="enforce", windows=WINDOWED.windows)  # the default
    for settings, profile in ((WINDOWED, unknown), (never, QUIET_NIGHTS)):
        inside = verdict(settings, 8.0, at(2), traffic=profile)
        assert (inside.action, inside.reason) == ("restart", "restart: in window")
    # No windows at all: emergencies only, quiet hours or not.
    none = PolicySettings(mode="enforce", windows=())
    for hour in (2.0, 6.9):
        held = verdict(none, 12.9, at(hour), traffic=QUIET_NIGHTS)
        assert (held.action, held.reason) == ("hold", "outside window (none set)")
    # A traffic gate picks the quiet moment by the operator's measure: the window, gated.
    known = traffic({h: 0.0 if h < 7 else 4.0 for h in range(24)}, values=60)
    for gated in (
        PolicySettings(mode="enforce", windows=WINDOWED.windows, max_request_rate=0.2),
        PolicySettings(mode="enforce", windows=WINDOWED.windows, max_request_rate_percentile=90),
    ):
        assert verdict(gated, 8.0, at(2), traffic=known, request_rate=0.0).action == "restart"


def test_a_decline_diagnosed_in_a_quiet_night_goes_at_its_end_too() -> None:
    # 02:00 in the window, the decline diagnosed, nights idle: as prevention, the restart
    # waits for the last quiet minutes, and the next run starts the day fresh.
    kw = dict(cause="uptime_decline", wanted=True, traffic=QUIET_NIGHTS, plan=None)
    held = verdict(WINDOWED, 20.0, at(2), **kw)
    assert (held.action, held.cause) == ("hold", "uptime_decline")
    assert held.reason == (
        "uptime_decline waits for the end of this host's quiet hours (2025-03-04T07:00:00Z), "
        "to restart in their last 10 minutes"
    )
    late = verdict(WINDOWED, 24.9, at(6.9), **kw)
    assert (late.action, late.cause) == ("restart", "uptime_decline")
    assert late.reason == "restart: outside window, at the end of this host's quiet hours"
    # Without the operator's opt-in the quiet hours may not end outside the windows: the
    # window's start, as before. Another slowdown does not age with the quiet hours: at once.
    never = PolicySettings(mode="enforce", windows=WINDOWED.windows)
    assert verdict(never, 20.0, at(2), **kw).reason == "restart: in window"
    kv = {**kw, "cause": "kv_pressure"}
    assert verdict(WINDOWED, 20.0, at(2), **kv).reason == "restart: in window"
    # Out of quiet hours (a busy night), it goes in the window as before.
    busy = traffic({h: 4.0 for h in range(24)})
    assert verdict(WINDOWED, 20.0, at(2), **{**kw, "traffic": busy}).action == "restart"


def test_quiet_hours_are_the_hosts_local_ones_across_a_daylight_saving_change() -> None:
    # Berlin, 30 March 2025: clocks go from 02:00 to 03:00. The quiet hours (local 00-07)
    # end at 07:00 CEST, 05:00 UTC, 5 h after 00:00 UTC (01:00 CET), not 6.
    berlin = replace(WINDOWED, timezone="Europe/Berlin")
    night = datetime(2025, 3, 30, 0, tzinfo=timezone.utc)
    held = verdict(berlin, 8.0, night, traffic=QUIET_NIGHTS)
    assert held.action == "hold" and "(2025-03-30T05:00:00Z)" in held.reason
    assert verdict(berlin, 13.0, night + timedelta(hours=4.9), traffic=QUIET_NIGHTS).action == (
        "restart"
    )


def test_what_holds_every_restart_still_shows_over_a_quiet_hours_wait() -> None:
    # Two restarts that did not help, or a pause, say so, not that prevention waits.
    failed = tuple(
        RestartRecord(NOW - h * HOUR, "kv_pressure", recovered=False) for h in (30.0, 20.0)
    )
    escalated = verdict(WINDOWED, 8.0, at(2), traffic=QUIET_NIGHTS, history=failed)
    assert escalated.action == "hold" and escalated.reason.startswith("escalated")
    paused = Controls(paused_until=at(10).timestamp())
    stopped = verdict(WINDOWED, 8.0, at(2), traffic=QUIET_NIGHTS, controls=paused)
    assert stopped.reason.startswith("paused until")
    # So do the minimum interval and the daily budget.
    apart = PolicySettings(mode="enforce", windows=WINDOWED.windows, min_interval=8 * HOUR)
    recent = (RestartRecord(at(2).timestamp() - 7 * HOUR, "stall"),)
    spaced = verdict(apart, 8.0, at(2), traffic=QUIET_NIGHTS, history=recent)
    assert spaced.reason.startswith("min interval")


def test_a_slow_plan_does_not_restart_at_every_quiet_nights_end() -> None:
    # A decline from 40 h of uptime: at the end of a quiet night 7 h into the run, the run
    # would not reach the plan's uptime before the next night's end. It waits.
    onset, rate = 40 * HOUR, 0.02 / HOUR
    slow = Plan(math.sqrt(onset**2 + 2 * 200.0 / rate), onset, rate, 200.0, 1)
    kw = dict(traffic=QUIET_NIGHTS, plan=slow)
    assert verdict(WINDOWED, 7.0, at(6.9), **kw).action == "none"
    # 17 h into it, it would: the restart goes now, not in tomorrow's busy hours.
    assert verdict(WINDOWED, 17.0, at(6.9), **kw).action == "restart"


def test_a_window_long_before_the_plans_uptime_waits_for_a_later_one() -> None:
    # A decline from 28 h of uptime at 2 %/h: T* is 28.1 h.
    onset, rate = 28 * HOUR, 0.02 / HOUR
    slow = Plan(math.sqrt(onset**2 + 2 * 200.0 / rate), onset, rate, 200.0, 1)
    # 7 h of uptime in a window, the next window at 31 h: restarting every 7 h would cost
    # more than every 31 h.
    assert slow.cost_rate(7 * HOUR) > slow.cost_rate(31 * HOUR)
    assert verdict(WINDOWED, 7.0, at(26), plan=slow).action == "none"
    # At 28 h, the next window (52 h) is far past T*: this window is the last before it.
    last = verdict(WINDOWED, 28.0, at(26), plan=slow)
    assert (last.action, last.cause) == ("restart", PREVENTION)
