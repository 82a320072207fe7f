"""The agent's own metrics: gauges read from the typed status report, as the daemon hands it
over after each tick (counters are tested with the daemon, in test_daemon.py)."""

from __future__ import annotations

from prometheus_client import generate_latest

from tests.test_status import full_report, report
from vkvagent import __version__
from vkvagent.exporter import AgentMetrics


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
    ):
        assert absent not in page, absent
