"""The decision-quality benchmark (bench/policy.py): its model, its oracle and its samples."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta

import pytest

pytest.importorskip("numpy")

import numpy as np

from bench import policy_model
from bench.policy import (
    BENCH_SLO,
    NO_PEERS,
    POLICIES,
    SAMPLE_EVERY,
    Alert,
    EngineRestart,
    Row,
    Synth,
    daily_0400,
    every_6h,
    peer_knowledge,
    process_started,
    run_vkvagent,
    summary,
    table,
    unexplained,
    vkvagent_settings,
)
from bench.policy_ceiling import grid, lull_schedule
from bench.policy_model import (
    COLD_STEPS,
    DAY_STEPS,
    GIB,
    HOUR,
    ITL_SIGMA,
    START,
    STEP,
    TTFT_SIGMA,
    WORLDS,
    Attainment,
    Model,
    Path,
    Server,
    SloPrices,
    World,
    attained,
    burst,
    episodes,
    optima,
    oracle,
    programme,
    slo_optima,
    walk,
    when,
    window_mask,
    within,
)
from vkvagent.engine import Settings
from vkvagent.engine.baseline import window_stats
from vkvagent.engine.policy import PolicySettings, window_state
from vkvagent.engine.slo import SloSettings

# Small worlds whose effects move within minutes, so that ten steps hold real choices.
FAST = (
    World("decline", "", uptime="uptime-decline", onset_h=0.0, stretch=0.02),
    World("leak", "", uptime="kv-pressure", onset_h=0.0, stretch=0.01),
    World("hang", "", hangs=(4 / 60,)),
    World("hot", "", hot=((0.0, 3 / 60),), hangs=(7 / 60,), surges=((0.0, 5 / 60),)),
    # Already up for 6 minutes, and declining, when the first step comes.
    World(
        "up-before", "", uptime="uptime-decline", onset_h=0.0, stretch=0.02, initial_uptime_h=0.1
    ),
    # Each run's decline sets in 0 to 5 minutes after it came up, by the step it began at.
    World("onsets", "", uptime="uptime-decline", stretch=0.02, onset_range_h=(0.0, 5 / 60)),
    World(
        "prompts", "", uptime="kv-pressure", onset_h=0.0, stretch=0.01, prompt_shift=(4 / 60, 1.5)
    ),
)
# The windows of the small instances: restarts may begin at steps 1, 2, 6 and 7 only.
SMALL_WINDOW = np.array([k in (1, 2, 6, 7) for k in range(10)])


def brute_force(model: Model, allowed: Sequence[bool] | None = None) -> float:
    """The best reward of every schedule, each restart drained or cut off as costs less; with
    ``allowed``, of every schedule whose restarts all begin where it is true."""
    best = 0.0
    for pattern in itertools.product((False, True), repeat=model.steps):
        restarts = [k for k, on in enumerate(pattern) if on]
        if allowed is not None and not all(allowed[k] for k in restarts):
            continue
        best = max(best, walk(model, restarts, drained=None).reward)
    return best


@pytest.mark.parametrize("world", FAST, ids=lambda w: w.name)
def test_the_oracle_is_the_best_of_every_schedule_on_small_instances(world: World) -> None:
    model = Model(world, Server(kv_blocks=2500), steps=10)
    best = oracle(model)
    assert best.value == pytest.approx(brute_force(model), rel=1e-12)
    assert walk(model, best.restarts, drained=None).reward == pytest.approx(best.value, rel=1e-12)


@pytest.mark.parametrize("world", FAST, ids=lambda w: w.name)
def test_the_windowed_oracle_is_the_best_schedule_within_the_windows(world: World) -> None:
    model = Model(world, Server(kv_blocks=2500), steps=10)
    best, windowed = optima(model, (None, SMALL_WINDOW))
    assert best == oracle(model) and windowed == oracle(model, SMALL_WINDOW)
    assert windowed.value == pytest.approx(brute_force(model, SMALL_WINDOW), rel=1e-12)
    assert all(SMALL_WINDOW[k] for k in windowed.restarts)
    path = walk(model, windowed.restarts, drained=None)
    assert path.reward == pytest.approx(windowed.value, rel=1e-12)
    assert windowed.value <= best.value
    # No window at all: the best is never to restart.
    closed = oracle(model, np.zeros(10, dtype=bool))
    assert closed.restarts == () and closed.value == pytest.approx(walk(model, []).reward)


def test_the_windowed_oracle_still_pays_for_oom_kills_outside_the_windows() -> None:
    world = World("memory", "", memory_growth=True)
    server = Server(memory_max=6 * GIB + 50 * 2**20, leak_per_request=64 * 1024)
    model = Model(world, server, steps=10)
    kills = walk(model, []).kills
    assert kills == [4] and not SMALL_WINDOW[4]  # killed outside the windows
    windowed = oracle(model, SMALL_WINDOW)
    assert windowed.value == pytest.approx(brute_force(model, SMALL_WINDOW), rel=1e-12)
    assert windowed.value <= oracle(model).value


def test_the_windowed_oracle_rolls_slow_flags_back_only_in_a_window() -> None:
    # The operator applies the slow flags at step 2; the schedule may restart, or roll them
    # back, only at steps 5 and 6.
    model = Model(World("flags", "", slow_flags=(2 / 60, 0.3)), Server(kv_blocks=2500), steps=12)
    allowed = np.array([k in (5, 6) for k in range(model.steps)])
    best_reward = 0.0
    for at_5, at_6 in itertools.product((None, "restart", "rollback"), repeat=2):
        pattern = {5: at_5, 6: at_6}
        restarts = [k for k, on in pattern.items() if on]
        rollbacks = [k for k, on in pattern.items() if on == "rollback"]
        best_reward = max(best_reward, walk(model, restarts, None, rollbacks).reward)
    windowed = oracle(model, allowed)
    assert windowed.value == pytest.approx(best_reward, rel=1e-12)
    best = oracle(model)
    assert windowed.rollbacks == (5,) and best.rollbacks == (3,)
    assert windowed.value < best.value
    path = walk(model, windowed.restarts, drained=None, rollbacks=windowed.rollbacks)
    assert path.reward == pytest.approx(windowed.value, rel=1e-12) and path.applied == [2]


def test_the_window_mask_is_vkvagents_default_window() -> None:
    mask = window_mask(vkvagent_settings().policy, 2 * DAY_STEPS)
    assert list(np.flatnonzero(mask)) == [
        *range(2 * HOUR, 5 * HOUR),
        *range(DAY_STEPS + 2 * HOUR, DAY_STEPS + 5 * HOUR),
    ]


def test_the_oracle_rolls_slow_flags_back_as_well_as_every_schedule() -> None:
    # The operator applies the slow flags at step 2; each later step may also roll them back.
    # At 0.3 of the speed, a rollback pays for its cold start within the eight steps.
    model = Model(World("flags", "", slow_flags=(2 / 60, 0.3)), Server(kv_blocks=2500), steps=8)
    assert model.flag_step == 2
    best_reward = 0.0
    for pattern in itertools.product((None, "restart", "rollback"), repeat=model.steps):
        if pattern[2] is not None or "rollback" in pattern[:2]:
            continue  # the operator's step is not the schedule's; nothing to roll back before
        restarts = [k for k, on in enumerate(pattern) if on]
        rollbacks = [k for k, on in enumerate(pattern) if on == "rollback"]
        best_reward = max(best_reward, walk(model, restarts, None, rollbacks).reward)
    best = oracle(model)
    assert best.value == pytest.approx(best_reward, rel=1e-12)
    path = walk(model, best.restarts, drained=None, rollbacks=best.rollbacks)
    assert path.reward == pytest.approx(best.value, rel=1e-12)
    assert best.rollbacks and path.applied == [2] and not path.slowed[-1]


def test_the_oracle_respects_oom_kills_it_cannot_avoid() -> None:
    # Memory grows with every request; the unit is killed once it holds 50 MiB more.
    world = World("memory", "", memory_growth=True)
    server = Server(memory_max=6 * GIB + 50 * 2**20, leak_per_request=64 * 1024)
    model = Model(world, server, steps=10)
    never = walk(model, [])
    assert never.kills, "the leak must reach the limit within ten minutes"
    best = oracle(model)
    assert best.value == pytest.approx(brute_force(model), rel=1e-12)


def test_a_score_is_the_reward_of_its_restart_times_over_the_demand() -> None:
    # The first ten minutes of ServeGen are one window: constant demand. A restart at step 2
    # loses steps 2, 3 and 4 (the cold start) of six, and what it cut off.
    model = Model(World("steady", ""), steps=6)
    assert walk(model, []).score() == pytest.approx(1.0)
    path = walk(model, [2])
    lost, _, _ = model.restart_cost(model.evaluate(2, COLD_STEPS + 2), False)
    assert path.score() == pytest.approx(3 / 6 - float(lost) / model.total_demand())
    assert list(path.uptime) == [COLD_STEPS, COLD_STEPS + 1, 0, 1, 2, 3]
    assert path.restarts == [2] and path.served[2:5].sum() == 0
    # Speed weighs the reward: throttled (0.6) for the first minute.
    hot = Model(World("hot", "", hot=((0.0, 1 / 60),)), steps=6)
    assert walk(hot, []).score() == pytest.approx((0.6 + 5) / 6)
    lost, _, _ = hot.restart_cost(hot.evaluate(0, COLD_STEPS), False)
    assert walk(hot, [0]).score() == pytest.approx(3 / 6 - float(lost) / hot.total_demand())


def test_a_path_keeps_its_reward_by_step_for_the_first_days_shortfall() -> None:
    model = Model(World("steady", ""), steps=6)
    never, path = walk(model, []), walk(model, [2])
    assert never.cumulative[-1] == pytest.approx(never.reward)
    assert path.cumulative[-1] == pytest.approx(path.reward)
    assert path.cumulative[1] == pytest.approx(never.cumulative[1])  # before the restart
    # From the restart on, it trails by the cold start and what the restart cut off.
    lost, _, _ = model.restart_cost(model.evaluate(2, COLD_STEPS + 2), False)
    per_step = never.cumulative[0]
    assert never.cumulative[4] - path.cumulative[4] == pytest.approx(3 * per_step + float(lost))
    row = Row("w", "p", 0.99, 0.997, 1, 0, 0, 0, None, 0, short_day_one=0.00114,
              short_week=0.003)  # fmt: skip
    assert "| 0.114 % / 0.300 % |" in table([row], BENCH_SLO)
    assert "| 0 / -0.005 % |" in table([replace(row, short_day_one=0, short_week=-5e-5)], BENCH_SLO)


def test_a_restart_pays_for_its_requests_in_flight_cut_off_or_drained() -> None:
    model = Model(World("steady", ""), Server(peak_rate=120.0), steps=6)
    at = model.evaluate(2, COLD_STEPS + 2)  # what the restart at step 2 finds
    running, speed, demand = float(at.running), float(at.speed), float(at.demand)
    s = model.server
    cut, drained, cheaper = (walk(model, [2], drained=d) for d in (False, True, None))
    free = float(cut.served.sum()) * STEP  # the reward with nothing to pay for (speed 1)
    assert running > 1 and cut.cut_off == pytest.approx(running) and drained.cut_off == 0
    # Cut off: half of each running answer's tokens, wasted.
    assert cut.reward == pytest.approx(free - running * s.output_tokens / 2 * speed)
    # Drained: nothing new admitted until the longest answer (451 tokens) is done.
    drain_seconds = 451 * float(at.itl)
    assert 0 < drain_seconds < 120
    assert drained.reward == pytest.approx(free - demand * drain_seconds * speed)
    assert cheaper.reward == pytest.approx(max(cut.reward, drained.reward))
    # A hung engine finishes nothing: drained or not, its requests are cut off.
    hung = Model(World("hang", "", hangs=(1 / 60,)), steps=6)
    assert walk(hung, [2], drained=True).cut_off == pytest.approx(
        float(hung.evaluate(2, COLD_STEPS + 2).running)
    )


def test_degraded_runs_and_their_delays() -> None:
    model = Model(World("hang", "", hangs=(2 / 60,)), steps=10)
    path = walk(model, [6])
    found = episodes(model, path)
    assert [(e.onset, e.end) for e in found] == [(2, 6)]
    assert found[0].minutes == 4.0
    assert [(e.onset, e.end) for e in episodes(model, walk(model, []))] == [(2, None)]


def test_the_timer_policies_restart_at_the_runbooks_and_the_guides_times() -> None:
    model = Model(World("steady", ""), steps=2 * 1440)
    assert every_6h(model) == [360, 720, 1080, 1440, 1800, 2160, 2520]
    assert daily_0400(model) == [240, 1680]


def alert_fires(served: list[float]) -> list[int]:
    model = Model(World("steady", ""), steps=len(served))
    path = Path(model)
    path.served[:] = served  # the alert reads only what came before the step it is asked at
    alert = Alert()
    fired = []
    for k in range(model.steps):
        path.k = k
        if alert(path):
            fired.append(k)
    return fired


def test_the_alert_fires_after_15_minutes_below_70_percent_of_8_hours_before() -> None:
    # Two hours at 100 tokens/s, then 60: from 09:00 the last hour is 60 % of 8 h before.
    assert alert_fires([100.0] * 120 + [60.0] * 900) == [9 * 60 + 15]
    # A steady decline of 5 % an hour keeps it firing: acted on again every 4 hours.
    declining = [100.0 * 0.95 ** (k / 60) for k in range(24 * 60)]
    assert alert_fires(declining) == [555, 555 + 240, 555 + 480, 555 + 720]


def test_synthetic_samples_read_back_as_the_models_rates() -> None:
    model = Model(World("steady", ""), steps=3 * 60)
    synth = Synth(model, seed=3)
    path = Path(model)
    points = []
    expected = []
    for k in range(model.steps):
        values = path.advance()
        for part in (1, 2):
            sample, memory = synth.sample(k * STEP + part * SAMPLE_EVERY, values, 0.0)
            assert sample.vllm is not None and memory == pytest.approx(6 * GIB, rel=0.01)
            points.append((sample.mono, sample.vllm))
        expected.append(values)
    stats = window_stats(points)
    assert stats is not None
    served = statistics.mean(float(v.served) for v in expected)
    assert stats.generation_tokens_per_s == pytest.approx(served, rel=0.03)
    assert stats.requests_per_s == pytest.approx(served / model.server.output_tokens, rel=0.03)
    assert stats.running == pytest.approx(statistics.mean(float(v.running) for v in expected),
                                          rel=0.05)  # fmt: skip
    assert stats.itl == pytest.approx(statistics.mean(float(v.itl) for v in expected), rel=0.03)
    assert stats.prompt_share == pytest.approx(
        model.server.prompt_tokens / (model.server.prompt_tokens + model.server.output_tokens),
        rel=0.03,
    )
    assert stats.preemptions_per_s == 0 and stats.waiting == 0


def test_a_restart_gives_a_new_process_and_refuses_connections_while_it_starts() -> None:
    model = Model(World("steady", ""), steps=10)
    synth = Synth(model, seed=1)
    path = Path(model)
    seen = []
    for k in range(model.steps):
        values = path.advance(k == 4)
        started = 1000.0 if k < 4 else 2000.0
        sample, _memory = synth.sample(k * STEP + SAMPLE_EVERY, values, started)
        seen.append(None if sample.vllm is None else sample.vllm.process_start_time)
    assert seen == [1000.0] * 4 + [None] * COLD_STEPS + [2000.0] * 3


def test_vkvagent_restarts_a_hung_engine_within_minutes_in_closed_loop() -> None:
    settings = Settings(policy=PolicySettings(mode="enforce"))
    model = Model(World("hang", "", hangs=(1.0,)), steps=90)
    run = run_vkvagent(model, settings, seed=2)
    assert [r.step for r in run.restarts] == run.path.restarts
    assert len(run.path.restarts) == 1
    restart = run.restarts[0]
    assert restart.cause == "stall" and not restart.inside  # 01:00 is outside the window
    assert restart.words.startswith("emergency")
    assert 60 + 2 <= restart.step <= 60 + 4  # stall_after is 120 s
    assert run.decisions == 2 * model.steps and len(run.cpu_ns) == run.decisions


def test_slow_flags_make_requests_wait_so_clients_see_their_speed() -> None:
    # The same steps with the old flags and the slow ones: the same tokens served at the same
    # per-request decode speed, but requests wait, so per request in the system is 0.7.
    model = Model(World("flags", "", slow_flags=(0.0, 0.7)), steps=60)
    stats = {}
    for slow in (False, True):
        synth = Synth(model, seed=4)
        points = []
        for k in range(model.steps):
            values = model.evaluate(k, COLD_STEPS + k, slow)
            for part in (1, 2):
                sample, _memory = synth.sample(k * STEP + part * SAMPLE_EVERY, values, 0.0)
                assert sample.vllm is not None
                points.append((sample.mono, sample.vllm))
        stats[slow] = window_stats(points)
    old, new = stats[False], stats[True]
    assert old is not None and new is not None
    assert old.in_system is not None and new.in_system is not None
    assert new.in_system / old.in_system == pytest.approx(0.7, rel=0.05)
    assert new.generation_tokens_per_s == pytest.approx(old.generation_tokens_per_s, rel=0.03)
    assert new.per_request == pytest.approx(old.per_request, rel=0.05)
    assert old.waiting == 0 and new.waiting is not None and new.waiting > 5


def test_vkvagent_rolls_slow_flags_back_once_cheaper_and_the_timers_do_not() -> None:
    # The scenario up to Thu 05:00: the operator's change Wed 10:00, the window Thu 02:00.
    world = next(w for w in WORLDS if w.name == "slow-flags")
    model = Model(world, steps=3 * DAY_STEPS + 5 * HOUR)
    change = model.flag_step
    assert change == 2 * DAY_STEPS + 10 * HOUR
    settings = opted_in()
    run = run_vkvagent(model, settings, seed=1)
    # Judged once, against the run before at the loads both learned fresh: 0.7, worse.
    [(judged_at, verdict, ratio)] = run.verdicts
    assert verdict == "worse" and ratio == pytest.approx(0.7, abs=0.05)
    assert change < judged_at < change + HOUR
    # One restart, the rollback, and no other (a restart alone is wrong). It goes outside the
    # window: 0.3 of the speed lost until Thu 02:00 is worth far more than one outage, as
    # soon as the cooldown after the operator's own restart (Wed 10:00) lets it, at 16:00.
    [(step, cause, inside, _reason)] = run.restarts
    assert cause == "flags" and not inside
    assert run.path.restarts == run.path.rollbacks == [step]
    assert not window_state(settings.policy, when(step))[0] and step > judged_at
    assert step == change + round(settings.policy.cooldown / STEP)
    assert run.path.slowed[step - 1] and not run.path.slowed[step:].any()
    # The timers restart after the change, and the alert never rolls back either: all keep
    # the slow flags to the end.
    for schedule in (every_6h(model), daily_0400(model)):
        path = walk(model, schedule)
        assert [k for k in path.restarts if k > change] and not path.rollbacks
        assert path.applied == [change] and path.slowed[change:].all()
    path = walk(model, Alert())
    assert not path.rollbacks and path.slowed[change:].all()
    # The oracle rolls back at once, in the change's own cold start.
    best = oracle(model)
    assert best.rollbacks == best.restarts == (change + 1,)


def test_idle_nights_leave_the_restart_window_idle_from_the_hour_they_begin() -> None:
    world = next(w for w in WORLDS if w.name == "idle-nights")
    quiet, plain = Model(world), Model(World("steady", ""))
    night = [k for k in range(quiet.steps) if (k * STEP / 3600) % 24 < 7]
    assert quiet.rate[night] == pytest.approx(plain.rate[night] * 0.01)
    day = [k for k in range(quiet.steps) if (k * STEP / 3600) % 24 >= 7]
    assert quiet.rate[day] == pytest.approx(plain.rate[day])
    # Under 0.5 requests running all night: the engine's "idle" regime, nothing to compare.
    values = quiet.evaluate(night, COLD_STEPS + 60)
    assert max(values.running) < 0.5
    # The variant keeps Monday's night busy, so that the first run learns its baselines.
    later = Model(World("later", "", quiet=(0.0, 7.0, 0.01, 24.0)))
    assert later.rate[:DAY_STEPS] == pytest.approx(plain.rate[:DAY_STEPS])
    assert later.rate[DAY_STEPS + 60] == pytest.approx(plain.rate[DAY_STEPS + 60] * 0.01)


def opted_in() -> Settings:
    """vkvagent's default configuration with the operator's opt-in to cross the windows when
    waiting for one costs more than the restart ([policy] outside_windows = "when_cheaper"),
    and no [slo]."""
    settings = vkvagent_settings()
    return replace(settings, policy=replace(settings.policy, outside_windows="when_cheaper"))


def world_named(name: str) -> World:
    return next(w for w in WORLDS if w.name == name)


def test_a_restart_is_wrong_where_nothing_a_restart_cures() -> None:
    wrong = {w.name for w in WORLDS if w.wrong}
    assert wrong == {"steady", "thermal-throttle", "load-surge", "uncured", "slow-flags",
                     "prompt-shift"}  # fmt: skip
    assert len({w.name for w in WORLDS}) == len(WORLDS)


def hourly_profile(model: Model) -> list[float]:
    """The mean request rate of each hour of the day (UTC) over the week."""
    return [float(model.rate.reshape(7, 24, HOUR)[:, h].mean()) for h in range(24)]


def test_busy_window_puts_the_days_busiest_hours_in_the_restart_window() -> None:
    world = world_named("busy-window")
    busy, plain = Model(world), Model(slowed_decline())
    profile = hourly_profile(busy)
    three = [sum(profile[(h + i) % 24] for i in range(3)) for h in range(24)]
    assert three.index(max(three)) == 2  # 02:00-05:00 UTC, the default window
    window = window_mask(vkvagent_settings().policy, busy.steps)
    assert busy.rate[window].mean() > 1.1 * busy.rate[~window].mean()
    # The same week, 7 hours later; the same degradation.
    assert busy.rate[7 * HOUR :] == pytest.approx(plain.rate[: -7 * HOUR])
    assert busy.up_speed == pytest.approx(plain.up_speed)
    # A restart in the window finds more requests in flight than at other hours, and pays
    # for them more, cut off (the timers') or drained (vkvagent's).
    values = busy.evaluate(np.arange(busy.steps), COLD_STEPS + HOUR)
    for drained in (False, True):
        cost, _, _ = busy.restart_cost(values, drained)
        assert cost[window].mean() > 1.1 * cost[~window].mean()
    assert values.running[window].mean() > 1.1 * values.running[~window].mean()
    # Every policy pays it: each restart of the path, at what it found there.
    model = Model(world, steps=2 * DAY_STEPS)
    for drained in (False, True):
        path = walk(model, daily_0400(model), drained=drained)
        found = [model.evaluate(k, path.uptime[k - 1] + 1) for k in path.restarts]
        paid = [model.restart_cost(v, drained) for v in found]
        assert path.in_flight_lost == pytest.approx(sum(float(c.lost) for c in paid))
        assert path.cut_off == pytest.approx(sum(float(c.cut_off) for c in paid))
        assert path.refused == pytest.approx(sum(float(c.refused) for c in paid))
        assert path.in_flight_lost > 0 and (path.cut_off > 0) != drained
        assert (path.refused > 0) == drained


def slowed_decline() -> World:
    return world_named("uptime-decline")


def test_prompt_shift_makes_prompts_longer_from_wednesday_and_no_restart_helps() -> None:
    world = world_named("prompt-shift")
    model, steady = Model(world), Model(World("steady", ""))
    shift = 2 * DAY_STEPS + 9 * HOUR
    trace = model.server.prompt_tokens
    assert model.prompt[:shift] == pytest.approx(trace)
    assert model.prompt[shift:] == pytest.approx(3.4 * trace)
    # The same requests/s and generated tokens per request.
    assert model.rate == pytest.approx(steady.rate) and model.demand == pytest.approx(steady.demand)
    # Each request holds more KV blocks, so KV binds: less capacity, a slower first token.
    k = np.arange(shift, model.steps)
    old, fresh = model.evaluate(k, COLD_STEPS + 600), model.evaluate(k, COLD_STEPS)
    before = steady.evaluate(k, COLD_STEPS + 600)
    assert (old.capacity < 0.8 * before.capacity).all() and (old.ttft > before.ttft).all()
    assert (old.served < old.demand).any() and (old.kv_usage > before.kv_usage).all()
    # A restart changes nothing of that: a fresh process has the same capacity.
    assert fresh.capacity == pytest.approx(old.capacity) and fresh.served == pytest.approx(
        old.served
    )
    assert model.evaluate(k[:10], COLD_STEPS).speed == pytest.approx(1.0)


def test_prompt_shift_shows_in_the_prompt_token_counters() -> None:
    # The samples' prompt tokens per request follow the model's: 3.4 times more after the shift.
    model = Model(World("prompts", "", prompt_shift=(1.0, 3.4)), steps=2 * HOUR)
    synth = Synth(model, seed=5)
    per_request = []
    for hour in (0, 1):
        first = last = None
        for k in range(hour * HOUR, (hour + 1) * HOUR):
            values = model.evaluate(k, COLD_STEPS + k)
            for part in (1, 2):
                sample, _memory = synth.sample(k * STEP + part * SAMPLE_EVERY, values, 0.0)
                assert sample.vllm is not None
                first = first or sample.vllm
                last = sample.vllm
        assert first is not None and last is not None
        prompt = last.prompt_tokens_total - first.prompt_tokens_total
        done = last.request_success_total - first.request_success_total
        per_request.append(prompt / done)
    assert per_request[0] == pytest.approx(model.server.prompt_tokens, rel=0.03)
    assert per_request[1] == pytest.approx(3.4 * model.server.prompt_tokens, rel=0.03)


def test_installed_degraded_starts_on_a_server_up_for_20_hours() -> None:
    world = world_named("installed-degraded")
    model = Model(world)
    assert model.first_uptime == 20 * HOUR
    never = walk(model, [])
    assert never.uptime[0] == 20 * HOUR
    first = model.evaluate(0, never.uptime[0])
    assert float(first.speed) == pytest.approx(0.7)  # 5 h stable, then -2 %/h for 15 h
    assert float(model.evaluate(0, COLD_STEPS).speed) == 1.0
    # vkvagent's first process started 20 h before the week; elsewhere it came up at START.
    assert process_started(model) == (START - timedelta(hours=20)).timestamp()
    assert (
        process_started(Model(World("steady", ""), steps=10))
        == (START - timedelta(minutes=COLD_STEPS)).timestamp()
    )
    # Every policy and the oracle start from the same uptime: the oracle restarts at once.
    short = Model(world, steps=HOUR)
    assert oracle(short).restarts[:1] == (0,)
    assert walk(short, [0]).score() > walk(short, []).score()


def test_vkvagent_installed_on_a_degraded_server_learns_from_that_first_run() -> None:
    # The late first run is restarted once it is 25 % below its late baseline; the next run's
    # fresh speed shows the restart cured it, which scales the first run's speed to fresh:
    # its 20 to 26 h of uptime then time the second run's restart, before it declines.
    model = Model(world_named("installed-degraded"), steps=20 * HOUR)
    run = run_vkvagent(model, opted_in())
    first, second = run.restarts[:2]
    assert first.cause == "uptime_decline" and second.cause == "prevention"
    uptime_h = (second.step - first.step) / HOUR
    assert 5.0 <= uptime_h <= 7.0, uptime_h  # the decline begins at 5 h of uptime


def test_bursty_demand_has_the_traces_minute_to_minute_variance() -> None:
    per_minute = burst()
    assert len(per_minute) == 58
    assert statistics.mean(per_minute) == pytest.approx(1.0, abs=1e-12)
    assert statistics.pstdev(per_minute) > 0.15
    assert min(per_minute) < 0.7 and max(per_minute) > 1.4
    model, plain = Model(world_named("bursty")), Model(slowed_decline())
    multiplier = model.rate / plain.rate
    assert multiplier[:58] == pytest.approx(per_minute)
    assert multiplier[58 : 2 * 58] == pytest.approx(per_minute)  # repeated
    assert model.rate.sum() == pytest.approx(plain.rate.sum(), rel=0.01)


def test_varying_onset_is_a_function_of_the_step_a_run_began_at() -> None:
    model = Model(world_named("varying-onset"))
    began = np.arange(-model.first_uptime, model.steps)
    onsets = model.onset(began)
    assert onsets.min() >= 2 * HOUR and onsets.max() <= 10 * HOUR
    assert float(onsets.mean()) == pytest.approx(6 * HOUR, rel=0.03)  # uniform on 2 to 10 h
    assert len(set(onsets[:100].tolist())) > 75  # runs begun a minute apart differ
    assert Model(world_named("varying-onset")).onset(began) == pytest.approx(onsets)  # fixed
    for start in (0, 500, 4321):
        uptimes = np.arange(0, 19 * HOUR)
        speed = model.evaluate(start + uptimes, uptimes).speed
        onset = int(model.onset(start))
        assert (speed[: onset + 1] == 1.0).all() and speed[onset + 1] < 1.0
        # -2 %/h after the onset, as in uptime-decline (5x): 0.84 after 8 hours of it.
        assert speed[onset + 8 * HOUR] == pytest.approx(0.84)
    # The same uptime in runs begun at other steps is another point of the decline.
    assert model.onset(0) != model.onset(500)
    at = 11 * HOUR
    assert model.evaluate(at, at).speed != model.evaluate(500 + at, at).speed


def test_the_summary_gives_vkvagents_share_of_the_windowed_oracle() -> None:
    rows = [
        Row("w", p, s, s / 0.9, 0, 0, 0, 0, None, 0, of_windowed=s / 0.8)
        for p, s in zip(POLICIES, (0.9, 0.8, 0.5, 0.6, 0.7, 0.75, 0.72))
    ]
    head, _rule, line = summary(rows).splitlines()
    assert "| windowed oracle |" in head and "| vkvagent of windowed oracle |" in head
    assert line == "| w | 1.000 | 0.889 | 0.556 | 0.667 | 0.778 | 0.833 | 0.800 | 0.900 | - |"


def test_vkvagent_restarts_a_memory_leak_in_the_last_window_before_memory_max() -> None:
    # The week's first run leaks 64 KiB a request and would reach MemoryMax (40 GiB) on
    # Tuesday afternoon: the Monday window is a day too early, Tuesday's is the last in time.
    # Each run after it, started at 02:00, would reach it the next afternoon.
    model = Model(world_named("memory-growth"), steps=2 * DAY_STEPS + 4 * HOUR)
    run = run_vkvagent(model, vkvagent_settings())
    assert [r.cause for r in run.restarts] == ["host_memory_growth"] * 2
    assert all(r.inside for r in run.restarts)
    assert [r.step // DAY_STEPS for r in run.restarts] == [1, 2]  # Tue, Wed
    assert run.path.kills == []


def test_vkvagent_restarts_a_kv_leak_before_the_days_peak_not_the_next_night() -> None:
    # The first run learned its fresh speed and usage at night (5 requests/s). By 11:00 it
    # has served 7 requests/s cleanly; the leak fills the cache at that load from about
    # 13:30, and waiting for the 02:00 window would cost the afternoon's and evening's peaks.
    model = Model(world_named("kv-pressure"), steps=16 * HOUR)
    run = run_vkvagent(model, opted_in())
    assert run.restarts, "the leak waited for the window"
    step, cause, inside, _reason = run.restarts[0]
    assert (cause, inside) == ("kv_pressure", False)
    assert 12 * HOUR <= step <= 15 * HOUR, step / HOUR


def test_vkvagent_keeps_preventing_on_idle_nights_after_a_late_first_baseline() -> None:
    # The week's first run learned its speed from 07:00, 2 h into its decline; once the next
    # run showed how much faster fresh is, that run's track is rescaled, and prevention holds
    # through Tuesday instead of losing its plan and letting a run decline again.
    model = Model(world_named("idle-nights"), steps=DAY_STEPS + 20 * HOUR)
    run = run_vkvagent(model, opted_in())
    causes = [r.cause for r in run.restarts]
    assert causes[0] == "uptime_decline" and len(causes) >= 5
    assert set(causes[1:]) == {"prevention"}, causes
    # Once a day of traffic is known, the night's restart goes at its end, not in its
    # window (02:00-05:00): the decline of the quiet hours costs nothing, and the next run
    # begins the busy day fresh.
    nights = [r.step * STEP / 3600 % 24 for r in run.restarts if r.step >= DAY_STEPS]
    assert nights and all(not h < 6.5 for h in nights), nights
    assert any(6.5 <= h < 7 for h in nights), nights


def test_vkvagent_tells_the_first_runs_decline_by_its_trend_before_a_quarter_is_lost() -> None:
    # The week's first run keeps its speed for 5 h, then loses it with uptime. Its own trend
    # says 10 % lost by about 8 h (trend_loss), where the speed alone (enter_ratio 0.75)
    # waited to 10.5 h; waiting for the 02:00 window would cost far more than the restart.
    model = Model(world_named("uptime-decline"), steps=12 * HOUR)
    run = run_vkvagent(model, opted_in())
    assert run.restarts, "the decline was not told"
    step, cause, inside, _reason = run.restarts[0]
    assert (cause, inside) == ("uptime_decline", False)
    assert 7 * HOUR <= step <= 9 * HOUR, step / HOUR


# -- the operator's objectives -----------------------------------------------------------------

# The small instances' objectives: a restart's cold start is 3 of their 10 minutes, so the
# availability budget is set to hold one or two; ITL 40 ms, where their declines cross it.
SMALL_SLO = SloSettings(availability=0.55, ttft_seconds=2.0, itl_seconds=0.04)
PRICES = (0.0, 0.05, 0.5, 5.0)


def test_within_is_the_lognormal_cdf() -> None:
    for mean, sigma in ((0.03, 0.3), (1.4, 0.5)):
        mu = math.log(mean) - sigma * sigma / 2
        targets = np.array([mean / 20, mean / 2, mean, 2 * mean, 20 * mean])
        exact = [0.5 * (1 + math.erf((math.log(t) - mu) / (sigma * math.sqrt(2)))) for t in targets]
        assert within(targets, mean, sigma) == pytest.approx(exact, abs=1e-7)
        assert float(within(mean, np.array([mean]), sigma)[0]) == pytest.approx(exact[2], abs=1e-7)


def test_a_steps_requests_are_served_within_the_targets_by_the_models_speed() -> None:
    # A hang at step 4: from there nothing is served, and everything demanded is refused.
    model = Model(World("hang", "", hangs=(4 / 60,)), steps=8)
    path = walk(model, [6])
    values = model.evaluate(np.arange(8), path.uptime)
    got = model.events(values, BENCH_SLO)
    demanded = model.rate * STEP
    assert got.demanded == pytest.approx(demanded)
    assert got.refused == pytest.approx(np.where(np.arange(8) >= 4, demanded, 0.0))
    served = values.served * STEP
    assert got.ttft_good == pytest.approx(
        served / model.server.output_tokens * within(2.0, values.ttft, TTFT_SIGMA)
    )
    assert got.itl_good == pytest.approx(served * within(0.1, values.itl, ITL_SIGMA))
    assert (got.ttft_good[:4] > 0.99 * demanded[:4]).all() and not got.itl_good[4:].any()
    # Demand beyond capacity waits: it misses both, whatever the latency of the rest.
    leak = Model(World("leak", "", uptime="kv-pressure", onset_h=0.0, stretch=0.01),
                 Server(kv_blocks=2500), steps=4)  # fmt: skip
    values = leak.evaluate(np.arange(4), COLD_STEPS + 4)
    got = leak.events(values, BENCH_SLO)
    assert (values.served < 0.6 * values.demand).all()
    assert (got.itl_good <= values.served * STEP).all()
    assert (got.ttft_good < 0.6 * got.demanded).all()
    # An objective not declared counts nothing good.
    assert not model.events(values, SloSettings(availability=0.999)).ttft_good.any()


def test_a_weeks_attainment_counts_restarts_against_availability() -> None:
    model = Model(World("steady", ""), Server(peak_rate=120.0), steps=6)
    per_step = float(model.rate[0]) * STEP  # the first ten minutes have one rate
    at = model.evaluate(2, COLD_STEPS + 2)  # what the restart at step 2 finds
    never = attained(model, walk(model, []), BENCH_SLO)
    assert never.share("availability") == 1.0 and never.requests == pytest.approx(6 * per_step)
    cut = attained(model, walk(model, [2]), BENCH_SLO)
    # Its cold start refuses three steps' requests, and it cuts off those running.
    assert cut.unavailable == pytest.approx(3 * per_step + float(at.running))
    assert cut.ttft_all == pytest.approx(3 * per_step)  # latency: the requests not refused
    assert cut.itl_all == pytest.approx(3 * per_step * model.server.output_tokens)
    drained = attained(model, walk(model, [2], drained=True), BENCH_SLO)
    drain_seconds = 451 * float(at.itl)
    assert drained.unavailable == pytest.approx(3 * per_step + float(at.rate) * drain_seconds)
    # The fluid model served the step before whole: a drain's refusal counts in availability.
    assert drained.ttft_all == cut.ttft_all and drained.ttft_good == cut.ttft_good
    # The budget spent: the bad events over (1 - target) of all.
    share = cut.share("availability")
    assert share == pytest.approx(1 - cut.unavailable / cut.requests)
    assert cut.spent(BENCH_SLO, "availability") == pytest.approx((1 - share) / 0.001)
    assert cut.score(BENCH_SLO) == pytest.approx((cut.share("ttft") + cut.share("itl")) / 2)
    assert cut.score(SloSettings(availability=0.999)) == share
    # Ten times the peak rate: more than the server can take, so most of it waited.
    assert 0 <= cut.share("ttft") < 0.01 and 0 < cut.share("itl") < 0.5


def lagrangian(
    model: Model, got: Attainment, slo: SloSettings, price: float, shares: tuple[float, float]
) -> float:
    """What the SLO programme maximises, worked out from a walk's attainment: the latency
    objectives' good events over their week's demand, a request refused while vLLM was down
    counted at ``shares``, less ``price`` x the requests unavailable over the budget."""
    tokens = float(model.demand.sum()) * STEP
    refused = got.requests - got.ttft_all
    value = 0.0
    if slo.ttft_seconds is not None:
        value += (got.ttft_good + shares[0] * refused) / got.requests
    if slo.itl_seconds is not None:
        value += (got.itl_good + shares[1] * refused * model.server.output_tokens) / tokens
    if slo.availability is not None and price:
        value -= price * got.unavailable / ((1 - slo.availability) * got.requests)
    return value


def every_schedule(model: Model, slo: SloSettings) -> list[tuple[list[int], Attainment]]:
    """Every schedule of the small instance, with its week's attainment (a restart drained
    or cut off as makes fewer requests unavailable)."""
    out = []
    for pattern in itertools.product((False, True), repeat=model.steps):
        restarts = [k for k, on in enumerate(pattern) if on]
        out.append((restarts, attained(model, walk(model, restarts, None, slo=True), slo)))
    return out


@pytest.mark.parametrize("world", FAST, ids=lambda w: w.name)
def test_the_slo_programme_is_the_best_lagrangian_of_every_schedule(world: World) -> None:
    model = Model(world, Server(kv_blocks=2500), steps=10)
    schedules = every_schedule(model, SMALL_SLO)
    prices = SloPrices(model, SMALL_SLO)
    shares = (0.9, 0.6)
    for masks in ((None,), (SMALL_WINDOW,)):
        for price in PRICES:
            prices.set([price], [shares])
            [value], [schedule] = programme(model, prices, masks)
            allowed = [s for s in schedules if masks[0] is None or all(masks[0][s[0]])]
            best = max(lagrangian(model, got, SMALL_SLO, price, shares) for _r, got in allowed)
            assert value == pytest.approx(best, rel=1e-9, abs=1e-12)
            got = attained(model, walk(model, schedule.restarts, None, slo=True), SMALL_SLO)
            assert lagrangian(model, got, SMALL_SLO, price, shares) == pytest.approx(value)
            assert prices.spent(schedule) == pytest.approx(got.unavailable)


def test_the_slo_programme_counts_oom_kills_and_rolls_slow_flags_back() -> None:
    # The kernel OOM-kills the process at step 4 unless a restart comes first.
    memory = Model(World("memory", "", memory_growth=True),
                   Server(memory_max=6 * GIB + 50 * 2**20, leak_per_request=64 * 1024),
                   steps=10)  # fmt: skip
    schedules = every_schedule(memory, SMALL_SLO)
    prices = SloPrices(memory, SMALL_SLO)
    for price in PRICES:
        prices.set([price], [(0.95, 0.95)])
        [value], _ = programme(memory, prices, (None,))
        best = max(lagrangian(memory, got, SMALL_SLO, price, (0.95, 0.95)) for _r, got in schedules)
        assert value == pytest.approx(best, rel=1e-9)
    # The operator applies flags at step 2 that make every request wait: TTFT beyond 2 s.
    flags = Model(World("flags", "", slow_flags=(2 / 60, 0.05)), Server(kv_blocks=2500), steps=8)
    slo = SloSettings(availability=0.5, ttft_seconds=2.0)
    prices = SloPrices(flags, slo)
    for price in PRICES:
        prices.set([price], [(0.95, 0.95)])
        [value], [schedule] = programme(flags, prices, (None,))
        best = -math.inf
        for pattern in itertools.product((None, "restart", "rollback"), repeat=flags.steps):
            if pattern[2] is not None or "rollback" in pattern[:2]:
                continue  # the operator's step is not the schedule's; nothing to roll back before
            restarts = [k for k, on in enumerate(pattern) if on]
            rollbacks = [k for k, on in enumerate(pattern) if on == "rollback"]
            got = attained(flags, walk(flags, restarts, None, rollbacks, slo=True), slo)
            best = max(best, lagrangian(flags, got, slo, price, (0.95, 0.95)))
        assert value == pytest.approx(best, rel=1e-9)
        if price == 0:  # latency alone: roll back at once
            assert schedule.rollbacks == (3,)


@pytest.mark.parametrize("world", FAST, ids=lambda w: w.name)
def test_the_slo_oracle_meets_availability_within_its_lagrangian_bound(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One round: a refused request counts at the declared shares, as the bound below does.
    monkeypatch.setattr(policy_model, "ROUNDS", 1)
    model = Model(world, Server(kv_blocks=2500), steps=10)
    schedules = every_schedule(model, SMALL_SLO)
    budget = (1 - 0.55) * float(model.rate.sum()) * STEP
    shares = (SMALL_SLO.ttft_share, SMALL_SLO.itl_share)
    for mask in (None, SMALL_WINDOW):
        [best] = slo_optima(model, SMALL_SLO, (mask,))
        assert mask is None or all(mask[list(best.restarts)])
        got = attained(model, walk(model, best.restarts, None, slo=True), SMALL_SLO)
        assert got.unavailable == pytest.approx(best.unavailable)
        allowed = [g for r, g in schedules if mask is None or all(mask[r])]
        meeting = [g for g in allowed if g.unavailable <= budget]
        if not meeting:  # none can: the fewest unavailable requests
            assert got.unavailable == pytest.approx(min(g.unavailable for g in allowed))
            continue
        assert got.unavailable <= budget
        # No schedule that meets availability is better by more than the price of the budget
        # it leaves unused (Lagrangian duality: the gap is at most that).
        mine = lagrangian(model, got, SMALL_SLO, 0.0, shares)
        bound = best.price * (1 - got.unavailable / budget)
        assert max(lagrangian(model, g, SMALL_SLO, 0.0, shares) for g in meeting) <= (
            mine + bound + 1e-12
        )


def test_the_slo_oracle_finds_the_best_schedule_where_the_budget_holds_one_restart() -> None:
    # A decline from the first minute, and a budget that holds one restart, not two: the
    # best is the one restart that buys the most latency, as every schedule shows.
    model = Model(FAST[0], Server(kv_blocks=2500), steps=10)
    slo = SloSettings(availability=0.6, itl_seconds=0.04)
    schedules = every_schedule(model, slo)
    budget = 0.4 * float(model.rate.sum()) * STEP
    top = max(g.score(slo) for _r, g in schedules if g.unavailable <= budget)
    [best] = slo_optima(model, slo, (None,))
    got = attained(model, walk(model, best.restarts, None, slo=True), slo)
    assert len(best.restarts) == 1 and got.unavailable <= budget
    assert got.score(slo) == pytest.approx(top, rel=1e-9)


def test_an_slo_is_scored_and_marked_in_the_tables() -> None:
    ofs = (1.0, 0.95, 0.6, 1.02, 1.01, 0.9, 0.99)
    availability = (0.9995, 0.9995, 0.9995, 0.992, 0.998, 0.999, 0.9991)
    rows = [
        Row("w", p, 0.9, of, 0, 0, 0, 0, None, 0, attainment={"availability": a},
            spent={"availability": (1 - a) / 0.001}, scored_by="latency", flagged=a < 0.999)
        for p, of, a in zip(POLICIES, ofs, availability)
    ]  # fmt: skip
    rows[0].bound, rows[1].bound = 0.0021, 0.0
    text = summary(rows)
    assert "| w | 1.000 | 0.950 | 0.600 | 1.020* | 1.010* | 0.900 | 0.990 |" in text
    assert text.splitlines()[2].endswith("| 0.0021 / 0.0000 |")
    assert "*: misses the availability objective" in text and "The oracle's bound" in text
    slo = SloSettings(availability=0.999)
    lines = table(rows, slo).splitlines()
    assert "short of oracle" not in lines[0] and "| availability |" in lines[0]
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| 0.99200 | 8.00 | no: availability | 1.020* |" in lines[5]
    # Where no schedule meets availability, the scores compare it.
    unmet = [replace(r, scored_by="availability", flagged=False) for r in rows]
    assert "No schedule meets availability in w" in summary(unmet)
    assert "*" not in summary(unmet).splitlines()[2]


def test_a_restart_outside_the_windows_needs_an_emergency_the_leak_or_the_opt_in() -> None:
    never = vkvagent_settings().policy
    opted = opted_in().policy
    assert never.outside_windows == "never" and opted.outside_windows == "when_cheaper"

    def restart(cause: str, reason: str, inside: bool = False) -> EngineRestart:
        return EngineRestart(100, cause, inside, reason)

    stall = restart("stall", "restart: emergency, any time; stall: no token for 120 s")
    leak = restart("host_memory_growth", "restart: outside window, before the OOM kill: ...")
    cheaper = restart("uptime_decline", "restart: outside window, cheaper now: waiting ...")
    budget = restart("prevention", "restart: outside window, within the error budget: ...")
    window = restart("uptime_decline", "restart: in window; uptime_decline: ...", inside=True)
    assert cheaper.words == "outside window, cheaper now" and window.words == "in window"
    for policy in (never, opted):
        assert not unexplained(policy, stall) and not unexplained(policy, leak)
        assert not unexplained(policy, window)
        assert unexplained(policy, cheaper) == unexplained(policy, budget) == (policy is never)
    # The exception is the memory leak's alone.
    other = restart("kv_pressure", "restart: outside window, before the OOM kill")
    assert unexplained(never, other)


def test_vkvagents_ledger_counts_the_requests_an_emergency_cut_off() -> None:
    model = Model(World("hang", "", hangs=(1.0,)), steps=90)
    run = run_vkvagent(model, Settings(policy=PolicySettings(mode="enforce")), seed=2)
    [record] = run.ledger
    assert record.cause == "stall" and record.cut_off == pytest.approx(run.path.cut_off)
    assert run.path.cut_off > 0
    # The samples answer every request served 200 (http_requests_total), none 5xx.
    synth = Synth(model, seed=1)
    sample, _memory = synth.sample(SAMPLE_EVERY, model.evaluate(0, COLD_STEPS), 0.0)
    assert sample.vllm is not None and sample.vllm.http_5xx_total == 0
    assert sample.vllm.http_requests_total == sample.vllm.request_success_total > 0


def test_the_ceilings_rule_restarts_each_run_from_its_uptime_at_the_first_lull() -> None:
    model = Model(world_named("steady"), steps=3 * DAY_STEPS)
    # 4.0 to 4.9 requests/s by the minute's last digit: a tenth of each day at 4.0.
    model.rate = 4.0 + 0.1 * (np.arange(model.steps) % 10)
    steps = lull_schedule(model, hours=20, quantile=0.1)
    first = 20 * HOUR - model.first_uptime  # the first step of the run at 20 h of uptime
    assert steps[0] == first + (-first) % 10  # the first minute at 4.0 from there
    assert steps[1] == steps[0] + 20 * HOUR  # the next run starts on a 4.0 minute too
    assert all(model.rate[k] == 4.0 for k in steps)
    # Without a lull asked for, at the uptime itself.
    assert lull_schedule(model, hours=20, quantile=1.0)[0] == first
    # Scored, cut off and drained: the rules that meet availability, the best first. Three
    # days' budget at 99.9 % affords no restart of a run of 20 h; runs of 80 h never restart.
    slo = vkvagent_settings(slo=True).slo
    found = grid(model, slo, 1.0, uptimes=(20, 80), quantiles=(0.1, 1.0))
    assert {(f.hours, f.quantile, f.drained) for f in found} == set(
        itertools.product((80,), (0.1, 1.0), (False, True))
    )
    assert all(f.restarts == [] and f.spent == 0 for f in found)
    # At 99 % it affords them: each rule scored as its walk, the best first.
    slo = replace(slo, availability=0.99)
    found = grid(model, slo, 1.0, uptimes=(20,), quantiles=(0.1, 1.0))
    assert len(found) == 4 and all(f.restarts for f in found)
    assert [f.of_oracle for f in found] == sorted((f.of_oracle for f in found), reverse=True)
    for f in found:
        got = attained(model, walk(model, f.restarts, f.drained, slo=True), slo)
        assert f.of_oracle == got.score(slo) and f.spent == got.spent(slo, "availability")


def test_a_new_host_of_a_fleet_starts_on_wednesday_with_its_peers_runs_and_baselines() -> None:
    world = world_named("new host Wed")
    # Its week is the ServeGen week from Wednesday 00:00: the peers' Monday and Tuesday before.
    model, plain = Model(world, steps=DAY_STEPS), Model(world_named("uptime-decline"))
    assert list(model.rate) == list(plain.rate[2 * DAY_STEPS : 3 * DAY_STEPS])
    peers = peer_knowledge(world, vkvagent_settings())
    # The peer's cured runs ended before the new host's week, within prevention's reach, and
    # its fresh baselines come named as a peer's.
    assert peers.runs and all(t.cured and t.ended is not None for t in peers.runs)
    assert all(START.timestamp() - 2 * 86400 < (t.ended or 0) < START.timestamp()
               for t in peers.runs)  # fmt: skip
    assert peers.baselines and all(b.run.endswith("@peer") for b in peers.baselines)
    assert peer_knowledge(world_named("uptime-decline"), vkvagent_settings()) == NO_PEERS
    # With them, its first run already has a plan from the peer's runs.
    engine = run_vkvagent(Model(world, steps=2 * HOUR), vkvagent_settings(), peers=peers)
    plan = engine.state.plan
    assert plan is not None and plan.peers == len(peers.runs)
