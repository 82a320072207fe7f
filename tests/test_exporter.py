"""The agent's own metrics: gauges read from the typed status report, as the daemon hands it
over after each tick (counters are tested with the daemon, in test_daemon.py)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_status import full_report, report
from vkvagent import __version__
from vkvagent.adapters.exporter import AgentMetrics


def page_of(metrics: AgentMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_gauges_follow_the_last_report() -> None:
    metrics = AgentMetrics()
    assert "vkvagent_verdict" not in page_of(metrics)  # no status yet: counters only
    metrics.update(full_report())
    page = page_of(metrics)
    for line in (
        f'vkvagent_info{{flavor="v1-latest",mode="enforce",unit="vllm.service",'
        f'version="{__version__}",vllm_version="0.11.0"}} 1.0',
        'vkvagent_verdict{state="acting"} 1.0',
        'vkvagent_verdict{state="healthy"} 0.0',
        'vkvagent_cause{cause="uptime_decline"} 1.0',
        "vkvagent_throughput_ratio 0.7",
        "vkvagent_window_open 0.0",
        "vkvagent_restart_budget_remaining 2.0",
        "vkvagent_escalated 0.0",
        "vkvagent_metrics_schema_recognised 1.0",
        "vkvagent_probe_last_latency_seconds 30.0",
        "vkvagent_probe_last_ok 0.0",
        "vkvagent_probe_last_timestamp_seconds 1.79999997e+09",
        "vkvagent_probe_in_flight_seconds 12.0",
        'vkvagent_gpu_temperature_celsius{gpu="0"} 71.0',
        'vkvagent_gpu_sm_clock_hertz{gpu="0"} 1.41e+09',
        'vkvagent_gpu_clock_event{gpu="0",reason="sw_power_cap"} 1.0',
        'vkvagent_fleet_state{group="default",state="waiting"} 1.0',
        'vkvagent_fleet_slots_held{group="default"} 1.0',
        'vkvagent_fleet_max_concurrent{group="default"} 1.0',
    ):
        assert line + "\n" in page, line


def test_what_an_old_report_lacks_is_absent_not_zero() -> None:
    metrics = AgentMetrics()
    metrics.update(report("healthy"))
    page = page_of(metrics)
    assert 'vkvagent_verdict{state="healthy"} 1.0\n' in page
    assert "vkvagent_last_evaluation_timestamp_seconds 1.8e+09\n" in page
    for absent in (
        "vkvagent_probe_last_ok ",
        "vkvagent_probe_in_flight_seconds ",
        "vkvagent_metrics_schema_recognised ",
        "vkvagent_cause{",
        "vkvagent_gpu_temperature_celsius{",
        "vkvagent_fleet_state",
        "vkvagent_slo_",  # no [slo]
    ):
        assert absent not in page, absent


def test_the_objectives_are_gauges_by_objective_and_window() -> None:
    """Read back by prometheus_client's own parser, as Prometheus would scrape them."""
    metrics = AgentMetrics()
    metrics.update(full_report())
    families = {f.name: f for f in text_string_to_metric_families(page_of(metrics))}
    samples = {
        name: {tuple(sorted(s.labels.items())): s.value for s in families[name].samples}
        for name in (
            "vkvagent_slo_target",
            "vkvagent_slo_attainment",
            "vkvagent_slo_budget_remaining",
            "vkvagent_slo_burn_rate",
        )
    }
    assert all(families[name].type == "gauge" for name in samples)
    assert samples["vkvagent_slo_target"] == {
        (("objective", "availability"),): 0.999,
        (("objective", "ttft"),): 0.95,
    }
    assert samples["vkvagent_slo_budget_remaining"] == {
        (("objective", "availability"),): -0.45,
        (("objective", "ttft"),): 0.2,
    }
    attainment = samples["vkvagent_slo_attainment"]
    assert {labels[1][1] for labels in attainment} == {"1h", "1d", "period"}
    assert attainment[(("objective", "ttft"), ("window", "period"))] == 0.96
    burn = samples["vkvagent_slo_burn_rate"]
    assert {labels[1][1] for labels in burn} == {"5m", "30m", "1h", "6h"}
    assert burn[(("objective", "ttft"), ("window", "1h"))] == 16.0
    assert len(burn) == 8 and len(attainment) == 6


def test_an_objective_with_nothing_counted_has_no_figures_only_its_target() -> None:
    fresh = {"objective": "itl", "words": "95 % of output tokens within 100 ms", "target": 0.95,
             "attainment": {"1h": None, "1d": None, "period": None},
             "burn_rates": {"5m": None, "30m": None, "1h": None, "6h": None}}  # fmt: skip
    metrics = AgentMetrics()
    metrics.update(report("healthy", slo={"period_days": 28, "objectives": [fresh]}))
    page = page_of(metrics)
    assert 'vkvagent_slo_target{objective="itl"} 0.95\n' in page
    shown = {f.name: f.samples for f in text_string_to_metric_families(page)}
    assert shown["vkvagent_slo_attainment"] == shown["vkvagent_slo_burn_rate"] == []
    assert shown["vkvagent_slo_budget_remaining"] == []
