"""The operator's objectives (engine/slo.py): counting, budgets, burn rates, and the policy
that spends them."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from tests.conftest import window_stats
from vkvagent.engine import (
    EngineState,
    Histogram,
    Observation,
    PolicySettings,
    RestartRecord,
    Sample,
    Settings,
    VllmMetrics,
    decide,
)
from vkvagent.engine.baseline import WindowStats
from vkvagent.engine.policy import Controls, evaluate
from vkvagent.engine.prevention import DEFAULT_OUTAGE, Plan
from vkvagent.engine.rates import quantile
from vkvagent.engine.slo import (
    Budget,
    Counts,
    Interval,
    SloSettings,
    SloState,
    bracket,
    counts,
    difference,
    share_within,
)
from vkvagent.engine.tick import _budget
from vkvagent.engine.traffic import TrafficProfile, rate_bin
from vkvagent.knowledge.config import Config, RestartConfig

BOUNDS = (0.1, 0.5, 1.0, 2.5, math.inf)
SLO = SloSettings(availability=0.999, ttft_seconds=2.0, itl_seconds=0.1)
T0 = datetime(2025, 3, 4, 12, tzinfo=timezone.utc)  # a Tuesday, outside the default window


def hist(*cumulative: float) -> Histogram:
    return Histogram(BOUNDS, tuple(float(c) for c in cumulative), 0.0)


def test_a_target_between_two_bounds_is_interpolated_as_histogram_quantile_does() -> None:
    h = hist(10, 50, 80, 95, 100)
    # 2 s lies two thirds of the way from 1 to 2.5: 80 + 15 x 2/3.
    assert share_within(h, 2.0) == pytest.approx(90.0)
    assert share_within(h, 1.0) == 80.0  # on a bound: that bound's count
    assert share_within(h, 0.05) == pytest.approx(5.0)  # the first bucket from 0
    assert share_within(h, 9.0) == 95.0  # beyond the last finite bound: +Inf has no width
    # The inverse of Prometheus's histogram_quantile: the quantile at the share found is the
    # target again, wherever the target falls.
    for target in (0.03, 0.3, 0.77, 1.6, 2.4):
        share = share_within(h, target) / h.count
        assert quantile(share, h) == pytest.approx(target)
    assert bracket(BOUNDS, 2.0) == (1.0, 2.5)
    assert bracket(BOUNDS, 0.1) == (0.0, 0.1)
    assert bracket(BOUNDS, 3.0) is None


def test_histogram_deltas_are_refused_across_a_new_layout_or_a_reset() -> None:
    old, new = hist(1, 2, 3, 4, 5), hist(2, 4, 6, 8, 10)
    delta = difference(new, old)
    assert delta is not None and delta.cumulative == (1, 2, 3, 4, 5)
    assert difference(new, None) is new  # since vLLM started
    assert difference(old, new) is None  # the count went down: another run
    other = Histogram((0.2, math.inf), (1.0, 2.0), 0.0)
    assert difference(other, old) is None


def test_an_interval_counts_requests_tokens_and_what_was_refused() -> None:
    found = counts(
        SLO,
        Interval(
            30.0,
            ttft=hist(10, 50, 80, 95, 100),
            itl=hist(900, 990, 1000, 1000, 1000),
            answered=98.0,
            errors=2.0,
        ),
    )
    assert found == Counts(answered=98.0, failed=2.0, ttft_good=pytest.approx(90.0),
                           ttft_all=100.0, itl_good=900.0, itl_all=1000.0)  # fmt: skip
    # vLLM down for 30 s at this host's usual 2 requests/s: 60 refused; a gap longer than
    # MAX_GAP (the agent itself was away) is charged only that long.
    assert counts(SLO, Interval(30.0, refused_rate=2.0)).failed == 60.0
    assert counts(SLO, Interval(3600.0, refused_rate=2.0)).failed == 240.0
    # An objective not declared is not counted.
    bare = counts(SloSettings(availability=0.99), Interval(30.0, ttft=hist(1, 2, 3, 4, 5)))
    assert bare.ttft_all == 0.0


def filled(minutes: int, *, failed: float = 0.0, ttft_miss: float = 0.0) -> SloState:
    """A state with ``minutes`` of a minute's 100 requests and 1000 tokens each, ``failed`` of
    them failed and ``ttft_miss`` a share of first tokens late, up to T0."""
    state = SloState()
    for m in range(minutes):
        at = T0.timestamp() - (minutes - 1 - m) * 60
        tally = Counts(answered=100 - failed, failed=failed, ttft_good=100 * (1 - ttft_miss),
                       ttft_all=100, itl_good=1000, itl_all=1000)  # fmt: skip
        state = state.add(SLO, at, tally)
    return state


def test_attainment_budget_and_burn_rates_over_the_windows() -> None:
    state = filled(24 * 60, failed=0.05)  # 0.05 % failed: half the 0.1 % allowed
    report = {o.name: o for o in state.report(SLO, T0.timestamp())}
    availability = report["availability"]
    assert availability.attainment["1h"] == pytest.approx(0.9995)
    assert availability.attainment["1d"] == pytest.approx(0.9995)
    # A day spent half the day's share: 1/56 of the 28-day budget at this traffic.
    assert availability.budget_remaining == pytest.approx(1 - 0.5 / 28, abs=1e-3)
    assert availability.burn.rates["5m"] == pytest.approx(0.5)
    assert availability.burn.alert == ""
    assert report["itl"].attainment["period"] == 1.0
    assert availability.words == "99.9 % of requests served"
    # The last hour failing 2 % of its requests: 20 times the rate that spends the budget
    # in a period, over the hour and its last 5 minutes: a fast burn.
    burning = state
    for m in range(60):
        at = T0.timestamp() + (m + 1) * 60
        burning = burning.add(SLO, at, Counts(answered=98, failed=2))
    now = T0.timestamp() + 60 * 60
    fast = {o.name: o for o in burning.report(SLO, now)}["availability"]
    assert fast.burn.rates["1h"] == pytest.approx(20.0, rel=0.02)
    assert fast.burn.alert == "fast"
    # It stops: five quiet minutes end the fast alert even though the hour still burns.
    calm = burning
    for m in range(6):
        calm = calm.add(SLO, now + (m + 1) * 60, Counts(answered=100))
    after = {o.name: o for o in calm.report(SLO, now + 6 * 60)}["availability"]
    assert after.burn.rates["1h"] > 14.4 and after.burn.alert != "fast"


def test_buckets_older_than_their_ring_are_dropped_and_the_state_round_trips() -> None:
    state = filled(3 * 24 * 60)  # three days to Tuesday noon, a minute at a time
    fine, hourly, daily = state.rings
    assert len(fine) == 72 and len(hourly) == 24 and len(daily) == 4  # Saturday to Tuesday
    loaded = SloState.from_json(json.loads(json.dumps(state.to_json())))
    assert loaded == state
    with pytest.raises(ValueError, match=r"^slo state: "):
        SloState.from_json({"rings": [{"1": [1, 2]}], "since": None, "last_rate": None,
                            "counted": None})  # fmt: skip
    with pytest.raises(ValueError, match=r"^slo state: "):
        SloState.from_json([])
    # An engine state written before [slo] starts its tallies empty.
    old = EngineState().to_json()
    del old["slo"]
    assert EngineState.from_json(old).slo == SloState()


def test_counts_placed_late_keep_the_newer_buckets() -> None:
    """A restart's cut-off requests arrive with its record, after samples newer than it."""
    state = SloState().add(SLO, 1000.0, Counts(answered=10)).add(SLO, 1600.0, Counts(answered=50))
    state = state.add(SLO, 1300.0, Counts(failed=3), late=True)
    assert state.over(SLO, 3600, 1600.0)[:2] == (60.0, 63.0)
    assert sorted(state.rings[0]) == [3, 4, 5]
    # Older than a ring holds: that ring leaves it out, the coarser ones count it.
    late = state.add(SLO, 1600.0 - 7 * 3600, Counts(failed=1), late=True)
    assert late.rings[0] == state.rings[0] and late.over(SLO, 8 * 3600, 1600.0)[1] == 64.0
    # Late counts never date the first events counted.
    assert SloState().add(SLO, 1000.0, Counts(failed=1), late=True).since is None


def test_a_clock_set_back_by_a_whole_ring_keeps_what_comes_after() -> None:
    """The buckets ahead of a sample's time are the clock's error, whatever the step."""
    newest = 100 * 86400.0
    for back in (6 * 3600.0 - 300, 6 * 3600.0, 6 * 3600.0 + 300, 29 * 86400.0, 30 * 86400.0):
        state = SloState().add(SLO, newest, Counts(answered=10))
        at = newest - back
        state = state.add(SLO, at, Counts(answered=5))
        assert state.over(SLO, 300, at + 1)[:2] == (5.0, 5.0), back
        assert state.over(SLO, 28 * 86400, at + 1)[:2] == (5.0, 5.0), back


def test_settings_are_checked() -> None:
    assert SLO.declared == ("availability", "ttft", "itl")
    assert SloSettings().declared == ()
    with pytest.raises(ValueError, match=r"availability 1 .*ttft_seconds 0"):
        SloSettings(availability=1.0, ttft_seconds=0.0)


# -- counted by the engine, from samples --------------------------------------------------------


def metrics(n: int, *, start: float, errors: int = 0) -> VllmMetrics:
    """vLLM after ``n`` requests (ten tokens each), ``errors`` of which answered 5xx; the
    requests' TTFT and tokens' ITL shaped like ``hist``'s (90 % and 99 % within target)."""
    return VllmMetrics(
        flavor="v1-latest", models=("m",), engines=1, kv_cache_usage=0.1,
        kv_cache_usage_max=0.1, num_requests_running=2.0, num_requests_waiting=0.0,
        num_preemptions_total=0.0, generation_tokens_total=10.0 * n,
        prompt_tokens_total=50.0 * n, request_success_total=float(n - errors),
        prefix_cache_queries_total=None, prefix_cache_hits_total=None, prefix_cache_unit=None,
        prefix_cache_hit_rate=None, engine_steps_total=10.0 * n, process_start_time=start,
        time_to_first_token=hist(*(n * x / 100 for x in (10, 50, 80, 95, 100))),
        inter_token_latency=hist(*(n * 10 * x / 100 for x in (99, 100, 100, 100, 100))),
        http_requests_total=float(n), http_5xx_total=float(errors),
    )  # fmt: skip


def run_ticks(
    samples: list[Sample],
    restarts: tuple[RestartRecord, ...] | Callable[[float], tuple[RestartRecord, ...]] = (),
) -> tuple[EngineState, Settings]:
    """The engine's state after a tick at each sample; ``restarts``: the ledger, or the
    ledger as it reads at a time."""
    settings = Settings(slo=SLO)
    state = EngineState()
    for i in range(len(samples)):
        now = datetime.fromtimestamp(samples[i].time, timezone.utc)
        ledger = restarts(samples[i].time) if callable(restarts) else restarts
        observed = Observation(samples=tuple(samples[: i + 1]), unit_active=True,
                               restarts=ledger)  # fmt: skip
        state = decide(settings, state, observed, now).state
    return state, settings


def test_the_engine_counts_answers_5xx_latency_and_the_requests_refused_while_down() -> None:
    start = T0.timestamp() - 3600
    samples = []
    for i in range(11):  # 10 requests/s for 100 s, then 10 s refused, then 100 s more
        at = T0.timestamp() + 10 * i
        samples.append(Sample(at, 1000.0 + 10 * i, metrics(100 * i, start=start, errors=i)))
    # The agent started on a vLLM up for an hour: what it served before is not counted.
    state, settings = run_ticks(samples)
    tally = state.slo.over(settings.slo, 3600, samples[-1].time)
    assert tally[:2] == (990.0, 1000.0)  # 10 5xx of the 1000 requests since the first look
    assert tally[2:4] == (pytest.approx(900.0), 1000.0)  # 90 % within 2 s
    assert tally[4:] == (9900.0, 10000.0)
    # vLLM stops answering for 20 s, then a new process starts and serves 50 requests: the
    # 20 s at the last rate seen (10/s) are refused, and the new run is counted from its
    # start, which came after the last look.
    down = [Sample(samples[-1].time + 10 * k, samples[-1].mono + 10 * k, None,
                   "connection refused") for k in (1, 2)]  # fmt: skip
    again = down[-1].time + 10
    back = Sample(again, down[-1].mono + 10, metrics(50, start=again - 5))
    state, settings = run_ticks([*samples, *down, back])
    tally = state.slo.over(settings.slo, 3600, back.time)
    assert tally[:2] == (990.0 + 50.0, 1000.0 + 200.0 + 50.0)
    # The rate of the last interval between two answers: 50 in the 30 s since the last one.
    assert state.slo.last_rate == pytest.approx(50 / 30)


def test_requests_a_restart_cut_off_are_counted_once() -> None:
    start = T0.timestamp() - 3600
    samples = [Sample(T0.timestamp() + 10 * i, 1000.0 + 10 * i, metrics(100 * i, start=start))
               for i in range(5)]  # fmt: skip
    cut = RestartRecord(T0.timestamp() + 15, "stall", cut_off=7.0, refused=90.0)
    # The ledger's restarts from before the counting began (the [slo] newly declared) belong
    # to no period counted: they neither count nor date the period's start.
    before = RestartRecord(T0.timestamp() - 20 * 86400, "stall", cut_off=5.0, refused=300.0)
    ledger = (cut, RestartRecord(T0.timestamp() + 12, "x"), before)
    state, settings = run_ticks(samples, restarts=ledger)
    tally = state.slo.over(settings.slo, 3600, samples[-1].time)
    assert tally[1] - tally[0] == 97.0  # counted once
    assert state.slo.over(settings.slo, 28 * 86400, samples[-1].time)[1] - tally[1] == 0.0
    assert state.slo.counted == cut.time and state.slo.since == samples[0].time


def test_a_restart_on_a_host_idle_since_the_slo_was_declared_counts() -> None:
    """Idle samples count no event, but the counting began with the first of them."""
    start = T0.timestamp() - 3600
    idle = [Sample(T0.timestamp() + 10 * i, 1000.0 + 10 * i, metrics(0, start=start))
            for i in range(6)]  # fmt: skip
    restart = RestartRecord(T0.timestamp() + 25, "stall", cut_off=7.0, refused=90.0)
    state, settings = run_ticks(idle, restarts=lambda at: (restart,) if at > restart.time else ())
    good, total = state.slo.over(settings.slo, 3600, idle[-1].time)[:2]
    assert (good, total) == (0.0, 97.0) and state.slo.since == idle[0].time


def test_an_outage_the_samples_counted_is_not_counted_again_from_its_restart_record() -> None:
    """An operator's `vkvagent restart` while the daemon samples: its record, open while it
    runs, gets the actuator's counts once vLLM is back. The samples counted the refusals
    already (10 requests/s for 120 s): the record adds its cut-offs only. The daemon's own
    restart leaves no sample of its outage: there the record's refusals count."""
    start = T0.timestamp() - 3600
    samples = [Sample(T0.timestamp() + 10 * i, 1000.0 + 10 * i, metrics(100 * i, start=start))
               for i in range(5)]  # fmt: skip
    down = [Sample(T0.timestamp() + 40 + 10 * k, 1040.0 + 10 * k, None, "connection refused")
            for k in range(1, 13)]  # fmt: skip
    again = down[-1].time + 10
    after = [Sample(again + 10 * k, down[-1].mono + 10 + 10 * k, metrics(50 + 100 * k,
                    start=again - 5)) for k in range(3)]  # fmt: skip
    done = RestartRecord(T0.timestamp() + 45, "manual", cut_off=3.0, refused=120.0,
                         ended=again - 2)  # fmt: skip

    def ledger(at: float) -> tuple[RestartRecord, ...]:
        if at < done.time:
            return ()
        if done.ended is not None and at < done.ended:
            return (RestartRecord(done.time, "manual"),)  # under way: no costs yet
        return (done,)

    state, settings = run_ticks([*samples, *down, *after], ledger)
    good, total = state.slo.over(settings.slo, 3600, after[-1].time)[:2]
    assert total - good == 3.0 + 1200.0
    own = run_ticks([*samples, *after], ledger)[0]  # no sample of the outage
    good, total = own.slo.over(settings.slo, 3600, after[-1].time)[:2]
    assert total - good == 3.0 + 120.0
    # The stretch of refusals the samples counted, kept with the state.
    assert state.slo.refusing == ((samples[-1].time, down[-1].time),)
    assert SloState.from_json(json.loads(json.dumps(state.slo.to_json()))) == state.slo


def test_a_stall_keeps_the_rate_its_clients_sent_for_the_requests_it_refuses() -> None:
    start = T0.timestamp() - 3600
    busy = [Sample(T0.timestamp() + 10 * i, 1000.0 + 10 * i, metrics(100 * i, start=start))
            for i in range(31)]  # fmt: skip
    frozen = metrics(3000, start=start)  # two requests running, nothing completes
    stalled = [Sample(busy[-1].time + 10 * k, busy[-1].mono + 10 * k, frozen)
               for k in range(1, 121)]  # fmt: skip
    state, settings = run_ticks([*busy, *stalled])
    assert state.slo.last_rate == pytest.approx(10.0)
    good, total = state.slo.over(settings.slo, 3600, stalled[-1].time)[:2]
    # Once it is a stall, it refuses what the clients sent before it, 10 requests/s, to the end.
    ((first, last),) = state.slo.refusing
    assert last == stalled[-1].time and stalled[0].time < first < stalled[-1].time
    assert total - good == pytest.approx(10.0 * (last - first))


# -- spending the budget -----------------------------------------------------------------------

ENFORCE = PolicySettings(mode="enforce", windows=("daily 02:00-05:00",))
IN = datetime(2025, 3, 5, 3, tzinfo=timezone.utc)


def budget(state: SloState, now: datetime, rate: float = 1.0, outage: float = 180.0) -> Budget:
    return Budget(SLO, state, now.timestamp(), rate, outage)


def verdict(settings: PolicySettings, now: datetime, b: Budget, cause: str = "uptime_decline"):  # type: ignore[no-untyped-def]
    return evaluate(
        settings, cause=cause, wanted=True, uptime=20 * 3600.0, request_rate=1.0, history=(),
        controls=Controls(), now=now, budget=b,
    )  # fmt: skip


def day_to(
    now: datetime, last_hour_miss: float, failed: float = 0.0, miss: float = 0.1
) -> SloState:
    """A day to ``now`` at 100 requests a minute, ``failed`` of them failed, ``miss`` of them
    late for 2 s but in the last hour ``last_hour_miss``; a fresh run missed for 1 %. At this
    traffic the 28-day availability budget allows 4,032 failed requests (0.1 %)."""
    state = SloState(last_fresh=Counts(ttft_good=99, ttft_all=100).tally())
    for m in range(24 * 60):
        late = last_hour_miss if m >= 23 * 60 else miss
        tally = Counts(answered=100 - failed, failed=failed, ttft_good=100 * (1 - late),
                       ttft_all=100)  # fmt: skip
        state = state.add(SLO, now.timestamp() - 86400 + (m + 1) * 60, tally)
    return state


def test_a_restart_goes_only_while_the_budget_covers_it_and_it_saves_more_than_it_spends() -> None:
    day = day_to(IN, 0.1)
    # In the window at 1 request/s, a 3-minute outage refuses 180 requests, 4.5 % of the
    # budget; 9 % more of the requests late for the 23 h to the next window is 6.2 % of the
    # TTFT budget: it goes.
    went = verdict(ENFORCE, IN, budget(day, IN))
    assert went.action == "restart"
    # A day that spent the whole budget (2.9 % failed): held, whatever the windows say.
    spent = verdict(ENFORCE, IN, budget(day_to(IN, 0.1, failed=2.9), IN, rate=0.1))
    assert spent.action == "hold" and spent.reason.startswith("error budget: a restart spends")
    assert spent.reason.endswith("the budget left does not cover it")
    # A planned restart has no latency to show: only the budget left binds.
    flags = evaluate(ENFORCE, cause=None, wanted=False, uptime=20 * 3600.0, request_rate=0.1,
                     history=(), controls=Controls(), now=IN, budget=budget(day, IN, rate=0.1),
                     flags_due="apply --max-num-seqs 8")  # fmt: skip
    assert flags.action == "restart"
    # A run whose latency is as fresh saves nothing: held. A quiet last hour does not hide
    # what the day's busy hours missed.
    flat = verdict(ENFORCE, IN, budget(day_to(IN, 0.01, miss=0.01), IN))
    assert flat.action == "hold" and flat.reason.endswith("no more than it spends")
    assert verdict(ENFORCE, IN, budget(day_to(IN, 0.01), IN)).action == "restart"
    # Outside the windows: only with the operator's opt-in, and only where it saves more
    # than it spends: 13 h to the next window save 3.5 % of the TTFT budget, more than a
    # restart at 0.1 requests/s spends (0.45 %), less than one at 1 request/s (4.5 %).
    out = IN + timedelta(hours=10)
    late = day_to(out, 0.1)
    assert verdict(ENFORCE, out, budget(late, out, rate=0.1)).reason.startswith("outside window (")
    opted = replace(ENFORCE, outside_windows="when_cheaper")
    cheap = verdict(opted, out, budget(late, out, rate=0.1))
    assert cheap.action == "restart"
    assert cheap.reason.startswith("restart: outside window, within the error budget: a restart")
    assert verdict(opted, out, budget(late, out, rate=1.0)).reason.startswith("outside window (")
    # An emergency spends whatever it must.
    assert verdict(ENFORCE, out, budget(late, out, rate=1.0), cause="stall").action == "restart"
    # Nothing counted yet (a new install): the objectives cannot weigh it; the windows decide.
    assert verdict(ENFORCE, IN, budget(SloState(), IN)).action == "restart"


def test_a_young_period_spends_its_budget_paced_and_at_the_quietest_hour() -> None:
    # A day counted of a 28-day period may spend a quarter of the period's budget at once.
    went = day_to(IN, 0.1, failed=0.5)  # 720 failed of the 4,032 allowed: 18 %
    assert verdict(ENFORCE, IN, budget(went, IN)).action == "restart"  # 4.5 % of 7 % left
    spent = day_to(IN, 0.1, failed=0.7)  # 25 %: nothing left to spend yet
    held = verdict(ENFORCE, IN, budget(spent, IN))
    assert held.reason.startswith("error budget: ") and "the budget left does not cover it" in (
        held.reason
    )
    # This host is quiet at 04:00, an hour still in the window: a restart waits for it.
    quiet = {h: {rate_bin(0.05 if h == 4 else 1.0): 60.0} for h in range(24)}
    traffic = TrafficProfile(quiet)
    day = day_to(IN, 0.1)
    waits = evaluate(
        ENFORCE, cause="uptime_decline", wanted=True, uptime=20 * 3600.0, request_rate=1.0,
        history=(), controls=Controls(), now=IN, budget=budget(day, IN), traffic=traffic,
    )  # fmt: skip
    assert waits.action == "hold"
    assert waits.reason.startswith(
        "error budget: a restart at 2025-03-05T04:00:00Z, this host's quieter hour, spends"
    )
    # A quieter hour outside the windows is no reason to wait, unless the operator opted in.
    late = {h: {rate_bin(0.05 if h == 9 else 1.0): 60.0} for h in range(24)}
    goes = evaluate(
        ENFORCE, cause="uptime_decline", wanted=True, uptime=20 * 3600.0, request_rate=1.0,
        history=(), controls=Controls(), now=IN, budget=budget(day, IN),
        traffic=TrafficProfile(late),
    )  # fmt: skip
    assert goes.action == "restart"


def test_a_restart_that_costs_nothing_now_does_not_wait_for_an_hour_that_costs_nothing() -> None:
    # Availability alone (no latency saved, nothing lost by waiting), and the window's hours
    # idle: a scheduled restart there refuses nothing, and so would one at any later hour of
    # it. It goes now, in every hour of the window, not at the next one.
    alone = SloSettings(availability=0.999)
    idle = TrafficProfile({h: {rate_bin(0.0 if h in (2, 3, 4) else 1.0): 60.0} for h in range(24)})
    scheduled = replace(ENFORCE, max_uptime=3600.0)
    for minutes in (10, 70, 150):
        now = IN.replace(hour=2) + timedelta(minutes=minutes)
        day = SloState().add(alone, now.timestamp() - 86400, Counts(answered=1e5))
        went = evaluate(
            scheduled, cause=None, wanted=False, uptime=20 * 3600.0, request_rate=0.0,
            history=(), controls=Controls(), now=now, traffic=idle,
            budget=Budget(alone, day, now.timestamp(), 0.0, 180.0),
        )  # fmt: skip
        assert went.action == "restart", (now, went.reason)


def test_a_restart_saves_only_what_this_run_misses() -> None:
    # The day missed 10 % for 2 s, the last hour 1 %, as fresh. Restarted an hour ago, the
    # run misses no more than a fresh one: a restart now saves nothing. Not known when the
    # run started, or a run a day old, the late hours count.
    day = day_to(IN, 0.01)
    run = Budget(SLO, day, IN.timestamp(), 1.0, 180.0, run_started=IN.timestamp() - 3600)
    spend = run.spend(3600.0)
    assert spend is not None and spend.saving == pytest.approx(0.0, abs=1e-4)
    held = verdict(ENFORCE, IN, run)
    assert held.action == "hold" and held.reason.endswith("no more than it spends")
    # 9 % more requests late for an hour, of the 5 % a 28-day period may miss.
    missed = pytest.approx(0.09 * 3600 / (28 * 86400 * 0.05), rel=0.01)
    for started in (None, IN.timestamp() - 2 * 86400):
        old = replace(run, run_started=started)
        assert old.spend(3600.0).saving == missed  # type: ignore[union-attr]
        assert verdict(ENFORCE, IN, old).action == "restart"
    # Two hours into the run, one of them late: some of it, at most all.
    two = replace(run, run_started=IN.timestamp() - 7200).spend(3600.0)
    assert two is not None and two.saving is not None and 0.0001 < two.saving < 0.0027
    # A start after now (the wall clock set back) is not known: the last day counts.
    ahead = replace(run, run_started=IN.timestamp() + 60).spend(3600.0)
    assert ahead is not None and ahead.saving == missed
    # The engine dates the run by its uptime, however it knows it.
    assert _budget(Settings(), EngineState(), None, IN, 3600.0).run_started == run.run_started
    assert _budget(Settings(), EngineState(), None, IN).run_started is None


def test_a_decline_at_the_end_of_a_quiet_night_is_held_by_the_budget_left_alone() -> None:
    # Nights idle to 07:00, the operator opted in: a decline diagnosed at 03:00 waits for
    # 06:50. There it goes though it saves no more than it spends (the day's misses were
    # as fresh): the hour is the cheapest to come. The budget left still binds.
    opted = replace(ENFORCE, outside_windows="when_cheaper")
    nights = TrafficProfile({h: {rate_bin(0.0 if h < 7 else 1.0): 60.0} for h in range(24)})
    end = IN.replace(hour=6, minute=55)

    def decided(now: datetime, state: SloState):  # type: ignore[no-untyped-def]
        return evaluate(
            opted, cause="uptime_decline", wanted=True, uptime=20 * 3600.0, request_rate=0.1,
            history=(), controls=Controls(), now=now, budget=budget(state, now, rate=0.1),
            traffic=nights,
        )  # fmt: skip

    assert decided(IN, day_to(IN, 0.01, miss=0.01)).reason.startswith("uptime_decline waits")
    flat = day_to(end, 0.01, miss=0.01)
    assert budget(flat, end, rate=0.1).spend(3600.0).saving == 0.0  # type: ignore[union-attr]
    went = decided(end, flat)
    assert (went.action, went.reason) == (
        "restart", "restart: outside window, at the end of this host's quiet hours"
    )  # fmt: skip
    spent = decided(end, day_to(end, 0.01, failed=2.9, miss=0.01))
    assert spent.action == "hold" and spent.reason.endswith("the budget left does not cover it")
    # So is a preventive restart there: no later hour is cheaper (the one after midnight
    # would be held for this one again).
    due = Plan(at=6 * 3600.0, onset=5 * 3600.0, rate=1e-5, outage=180.0, runs=2)
    planned = evaluate(
        opted, cause=None, wanted=False, uptime=20 * 3600.0, request_rate=0.1, history=(),
        controls=Controls(), now=end, budget=budget(flat, end, rate=0.1), traffic=nights,
        plan=due,
    )  # fmt: skip
    assert (planned.action, planned.cause) == ("restart", "prevention")


def test_a_leak_about_to_reach_memorymax_goes_whatever_the_budget_says() -> None:
    """The one slowdown that crosses the windows also goes in one the budget would hold: the
    kernel's OOM kill would cut off every request."""
    spent = day_to(IN, 0.1, failed=2.9)  # the whole budget spent
    leak = evaluate(
        ENFORCE, cause="host_memory_growth", wanted=True, uptime=20 * 3600.0,
        request_rate=1.0, history=(), controls=Controls(), now=IN, budget=budget(spent, IN),
        harm_in=3600.0,
    )  # fmt: skip
    assert (leak.action, leak.reason) == ("restart", "restart: in window")
    growth = evaluate(
        ENFORCE, cause="host_memory_growth", wanted=True, uptime=20 * 3600.0,
        request_rate=1.0, history=(), controls=Controls(), now=IN, budget=budget(spent, IN),
    )  # fmt: skip
    assert growth.action == "hold" and growth.reason.startswith("error budget: ")


def test_a_scrape_that_timed_out_loses_no_answer_and_refuses_nothing() -> None:
    start = T0.timestamp() - 3600
    samples = [Sample(T0.timestamp() + 10 * i, 1000.0 + 10 * i, metrics(100 * i, start=start))
               for i in range(6)]  # fmt: skip
    samples[3] = Sample(samples[3].time, samples[3].mono, None, "timed out", vllm_silent=True)
    state, settings = run_ticks(samples)
    tally = state.slo.over(settings.slo, 3600, samples[-1].time)
    assert tally[:2] == (500.0, 500.0)  # every answer since the first look, none failed
    # Refused outright (nothing listens): the interval's requests count as failed.
    samples[3] = Sample(samples[3].time, samples[3].mono, None, "connection refused")
    state, settings = run_ticks(samples)
    assert state.slo.over(settings.slo, 3600, samples[-1].time)[:2] == (500.0, 600.0)


def test_a_wall_clock_set_back_far_does_not_blind_the_tallies() -> None:
    ahead = SloState().add(SLO, T0.timestamp() + 86400, Counts(answered=5))  # a day ahead
    state = ahead.add(SLO, T0.timestamp(), Counts(answered=10))
    assert state.over(SLO, 3600, T0.timestamp())[:2] == (10.0, 10.0)
    # A state file holding what no state can: refused in one line, never read.
    data = state.to_json()
    with pytest.raises(ValueError, match=r"^slo state: "):
        SloState.from_json({**data, "counted": float("nan")})
    with pytest.raises(ValueError, match=r"^slo state: "):
        SloState.from_json({**data, "rings": [{"1": [1, 1, 0, 0, float("inf"), 0]}, {}, {}]})


def test_a_restart_is_priced_with_the_drain_the_operator_allows() -> None:
    """A drain refuses new requests until the longest in flight is done: about twice the mean
    answer at this ITL, and at most [restart] drain_timeout, which the engine is given."""
    slow = window_stats(itl=1.0)  # 209-token answers at 1 s a token: 418 s to drain

    def outage(stats: WindowStats, drain_timeout: float) -> float:
        settings = Settings(policy=PolicySettings(drain_timeout=drain_timeout))
        return _budget(settings, EngineState(), stats, T0).outage

    assert outage(slow, 120.0) - outage(slow, 30.0) == 90.0
    assert outage(window_stats(), 120.0) == outage(window_stats(), 30.0)  # 9.4 s either way
    restart = replace(RestartConfig(), drain_timeout=30.0)
    assert replace(Config(), restart=restart).engine_settings().policy.drain_timeout == 30.0


def test_an_outage_measured_between_runs_is_not_priced_with_a_second_drain() -> None:
    """A restart's outage measured from the last run's last sample to the next run's first
    holds the drain it made; only the outage taken before any was measured is added one."""
    slow, settings = window_stats(itl=1.0), Settings(policy=PolicySettings(drain_timeout=120.0))
    planned = Plan(at=36000.0, onset=18000.0, rate=1e-5, outage=DEFAULT_OUTAGE, runs=2)

    def outage(plan: Plan) -> float:
        return _budget(settings, EngineState(plan=plan), slow, T0).outage

    assert outage(planned) == DEFAULT_OUTAGE + 120.0  # no restart measured yet
    assert outage(replace(planned, outage=240.0, measured=True)) == 240.0
