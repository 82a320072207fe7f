"""The simulated engine moves the way vLLM does, degrades with uptime, and is deterministic."""

from __future__ import annotations

import random

import pytest

from vkvagent.adapters.gpu import GpuReader, RecordedBackend
from vkvagent.sim.capacity import (
    SCENARIOS,
    STEP,
    Cluster,
    EngineModel,
    Scenario,
    capacity,
    model_billions,
)
from vkvagent.sim.workload import Workload, azure_sizes, constant, servegen_week

BOUNDS = {
    "time_to_first_token_seconds": (0.01, 0.1, 0.5, 1.0, 5.0, 30.0),
    "inter_token_latency_seconds": (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
    "e2e_request_latency_seconds": (1.0, 5.0, 20.0, 60.0, 300.0),
}
SIZES = azure_sizes()


def cluster(
    rate: float = 4.0,
    scenario: str = "healthy",
    onset: float | None = None,
    seed: int = 7,
    engines: int = 1,
    **flags: object,
) -> Cluster:
    settings: dict[str, object] = dict(
        gpu_memory_utilization=0.9, block_size=16, max_num_seqs=256,
        max_num_batched_tokens=8192, max_model_len=32768,
    )  # fmt: skip
    settings.update(flags)
    cap = capacity("meta-llama/Llama-3.1-8B-Instruct", **settings)  # type: ignore[arg-type]
    return Cluster(
        engines=[EngineModel(cap, BOUNDS) for _ in range(engines)],
        workload=Workload(constant(rate), SIZES, random.Random(seed)),
        scenario=Scenario(scenario, onset),
    )


def tokens_per_s(c: Cluster, start: float, end: float) -> float:
    c.advance_to(start)
    before = c.state()["generation_tokens"]
    c.advance_to(end)
    return (c.state()["generation_tokens"] - before) / (end - start)


def mean_itl(c: Cluster) -> float:
    h = c.engines[0].stats.histograms["inter_token_latency_seconds"]
    return h.sum / h.count


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_same_seed_gives_the_same_trajectory_however_time_is_advanced(scenario: str) -> None:
    a, b = (
        cluster(seed=3, scenario=scenario, onset=600),
        cluster(seed=3, scenario=scenario, onset=600),
    )
    a.advance_to(1800.0)
    for t in range(0, 1801, 7):  # small, uneven advances, as a jittery wall clock gives
        b.advance_to(float(t))
    b.advance_to(1800.0)
    assert a.state() == b.state()
    assert a.engines[0].stats == b.engines[0].stats
    assert a.http == b.http
    c = cluster(seed=4, scenario=scenario, onset=600)
    c.advance_to(1800.0)
    assert c.state() != a.state()


def test_throughput_grows_sublinearly_and_each_request_slows_with_concurrency() -> None:
    light, heavy = cluster(rate=1.0), cluster(rate=8.0)
    light_tps, heavy_tps = tokens_per_s(light, 600, 2400), tokens_per_s(heavy, 600, 2400)
    assert heavy_tps > 2 * light_tps  # more demand, more output...
    assert heavy.state()["running"] > light.state()["running"]
    assert mean_itl(heavy) > 1.3 * mean_itl(light)  # ...but each request decodes slower


def test_kv_usage_follows_tokens_in_flight_and_full_kv_makes_requests_wait() -> None:
    roomy = cluster(rate=6.0)
    tight = cluster(rate=6.0, num_gpu_blocks_override=2000)  # 32k tokens of KV
    roomy.advance_to(1800)
    tight.advance_to(1800)
    assert 0.0 < roomy.state()["kv_usage"] < 0.5
    assert roomy.state()["preemptions"] == 0 and roomy.state()["waiting"] == 0
    assert tight.state()["kv_usage"] > 0.8
    assert tight.state()["waiting"] > 0
    assert tight.state()["preemptions"] > 0


def test_max_num_seqs_caps_the_batch() -> None:
    capped = cluster(rate=8.0, max_num_seqs=8)
    for t in range(60, 1200, 60):
        capped.advance_to(float(t))
        assert capped.state()["running"] <= 8
    assert capped.state()["waiting"] > 0


def test_flags_move_capacity_in_vllms_directions() -> None:
    def cap(**flags: object):  # type: ignore[no-untyped-def]
        settings: dict[str, object] = dict(
            gpu_memory_utilization=0.9, block_size=16, max_num_seqs=256,
            max_num_batched_tokens=8192, max_model_len=32768,
        )  # fmt: skip
        settings.update(flags)
        return capacity("Qwen/Qwen2.5-32B-Instruct", **settings)  # type: ignore[arg-type]

    base = cap()
    assert cap(gpu_memory_utilization=0.95).num_gpu_blocks > base.num_gpu_blocks
    assert cap(gpu_memory_utilization=0.5).num_gpu_blocks < base.num_gpu_blocks
    # Bigger blocks: fewer of them for the same memory, and fewer prefix-cache hits.
    assert cap(block_size=32).num_gpu_blocks == pytest.approx(base.num_gpu_blocks / 2, abs=1)
    assert cap(block_size=32).prefix_hit_ratio < base.prefix_hit_ratio
    assert cap(enable_prefix_caching=False).prefix_hit_ratio == 0
    assert cap(kv_cache_dtype="fp8").num_gpu_blocks > 1.9 * base.num_gpu_blocks
    assert cap(enforce_eager=True).single_stream_speed < base.single_stream_speed
    assert cap(tensor_parallel_size=2).num_gpu_blocks > 2 * base.num_gpu_blocks
    assert model_billions("meta-llama/Llama-3.3-70B-Instruct") == 70
    assert model_billions("Qwen/Qwen2.5-Coder-1.5B-Instruct") == 1.5
    assert model_billions("some/model") == 8


def test_uptime_decline_is_stable_for_an_hour_then_loses_speed() -> None:
    healthy, declining = cluster(rate=3.0), cluster(rate=3.0, scenario="uptime-decline")
    assert tokens_per_s(declining, 600, 3000) == tokens_per_s(healthy, 600, 3000)
    assert declining.scenario.speed_factor(3000) == 1.0
    assert declining.scenario.speed_factor(3600 + 3 * 3600) == pytest.approx(0.7)
    for c in (healthy, declining):
        c.advance_to(5 * 3600)
    assert mean_itl(declining) > 1.05 * mean_itl(healthy)


def test_kv_pressure_brings_preemptions_at_a_load_the_fresh_server_handled() -> None:
    fresh = cluster(rate=5.0, scenario="kv-pressure", num_gpu_blocks_override=6000)
    fresh.advance_to(1800)
    assert fresh.state()["preemptions"] == 0  # the fresh run handles this load
    fresh.advance_to(5 * 3600)
    late = fresh.state()
    assert late["preemptions"] > 100
    assert late["kv_usage"] > 0.9


def test_stall_stops_tokens_while_requests_run() -> None:
    c = cluster(rate=3.0, scenario="stall", onset=600)
    c.advance_to(590)
    assert c.state()["generation_tokens"] > 0
    c.advance_to(700)
    frozen = c.state()
    c.advance_to(1200)
    after = c.state()
    assert after["generation_tokens"] == frozen["generation_tokens"]
    assert after["running"] > 0 and after["waiting"] > frozen["waiting"]
    assert after["stalled"] and not after["dead"]


def test_thermal_throttle_slows_decode_and_shows_in_the_gpu_readings() -> None:
    c = cluster(rate=3.0, scenario="thermal-throttle", onset=300)
    c.advance_to(200)
    cool, _ = GpuReader(open=lambda: RecordedBackend(c.gpu_recording(2))).read()
    assert all(g.throttled_by == () for g in cool)
    c.advance_to(900)
    assert c.scenario.speed_factor(900) == 0.6
    hot, problem = GpuReader(open=lambda: RecordedBackend(c.gpu_recording(2))).read()
    assert problem is None and len(hot) == 2
    assert hot[0].throttled_by == ("sw_thermal_slowdown", "hw_thermal_slowdown")
    assert hot[0].sm_clock_mhz is not None and hot[0].sm_clock_mhz < 0.7 * 1980


def test_load_surge_triples_demand_for_an_hour() -> None:
    s = Scenario("load-surge", onset=100)
    assert [s.demand_multiplier(t) for t in (50, 100, 3000, 3700, 5000)] == [1, 3, 3, 1, 1]


def test_engine_dead_after_onset() -> None:
    c = cluster(scenario="engine-dead", onset=60)
    c.advance_to(30)
    assert not c.dead
    c.advance_to(61)
    assert c.dead


def test_a_restart_cures_uptime_degradation() -> None:
    old = cluster(rate=3.0, scenario="uptime-decline", seed=8)
    old.advance_to(6 * 3600)
    assert old.scenario.speed_factor(old.now) < 0.8
    # The restart is a new process: uptime from zero, and for its first hour it behaves
    # exactly like a server that never degrades, given the same traffic.
    restarted = cluster(rate=3.0, scenario="uptime-decline", seed=8)
    healthy = cluster(rate=3.0, scenario="healthy", seed=8)
    restarted.advance_to(3500)
    healthy.advance_to(3500)
    assert restarted.engines[0].stats == healthy.engines[0].stats
    assert mean_itl(old) > mean_itl(restarted)


def test_data_parallel_engines_share_the_demand() -> None:
    c = cluster(rate=6.0, engines=2)
    c.advance_to(1200)
    served = [e.served for e in c.engines]
    assert all(n > 0 for n in served) and abs(served[0] - served[1]) <= max(served) * 0.2


def test_servegen_week_is_scaled_to_its_peak_and_repeats() -> None:
    curve = servegen_week(peak=10.0)
    rates = [curve(t) for t in range(0, 7 * 86400, 600)]
    assert max(rates) == pytest.approx(10.0)
    assert min(rates) > 0
    assert curve(3600.0) == curve(3600.0 + 7 * 86400)


def test_step_is_fixed() -> None:
    c = cluster()
    c.advance_to(STEP * 10 + STEP / 2)
    assert c.now == STEP * 10


def test_heat_and_demand_follow_the_world_not_the_process() -> None:
    """A restart cures what uptime causes, never a hot GPU or a surge of demand."""
    hot = cluster(rate=3.0, scenario="thermal-throttle", onset=600)
    hot.world_offset = 3600.0  # restarted an hour into the world's throttling
    hot.advance_to(60)
    assert hot.state()["speed_factor"] == 0.6
    aged = cluster(rate=3.0, scenario="uptime-decline", onset=600)
    aged.world_offset = 3 * 3600.0  # the world's clock means nothing to uptime decline
    aged.advance_to(60)
    assert aged.state()["speed_factor"] == 1.0


def test_finished_requests_are_answered_2xx_and_a_drain_refuses_with_5xx() -> None:
    """The API server's http_requests_total: each finished request answered its client; while
    it drains for a shutdown, what comes in is answered HTTP 500, and what is in flight still
    finishes."""
    completions = ("/v1/completions", "POST")
    c = cluster(rate=4.0)
    c.advance_to(300)
    assert c.served > 0 and c.refused == 0
    assert c.http.answered == {(*completions, "2xx"): c.served}
    in_flight, served = c.in_flight, c.served
    c.admitting = False
    c.advance_to(330)
    assert c.state()["admitting"] is False
    assert c.refused > 0 and c.served > served and c.in_flight < in_flight
    assert c.http.answered == {(*completions, "2xx"): c.served, (*completions, "5xx"): c.refused}
