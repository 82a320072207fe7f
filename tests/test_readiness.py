"""``GET /ready`` for load balancers: the answer from the last status (knowledge/readiness.py),
and the exporter serving it beside the metrics over real loopback HTTP."""

from __future__ import annotations

import http.client
import socket
import time
from dataclasses import replace
from typing import Any

import pytest

from tests.test_status import GONE, NOW, report
from vkvagent.adapters.exporter import AgentMetrics, Exporter
from vkvagent.knowledge.readiness import readiness
from vkvagent.knowledge.status import StatusReport

SERVING = {"version": "0.32.0", "flavor": "v1-latest", "recognised": True, "uptime_s": 7200.0}


def status(state: str = "healthy", **verdict: Any) -> StatusReport:
    shown = {"state": state, "action": "none", "cause": None, "reason": "healthy: speed 1.00"}
    return report(state, vllm=SERVING, verdict={**shown, **verdict})


def test_a_vllm_that_serves_is_ready() -> None:
    assert readiness(status(), NOW) == (True, "vLLM serves (healthy)")
    # A slow vLLM still serves: degraded is no reason to take it out of rotation.
    slow = status("degraded", action="hold", cause="uptime_decline", reason="outside window")
    assert readiness(slow, NOW).ready


@pytest.mark.parametrize(
    ("verdict", "reason"),
    [
        ({"stalled_s": 5.0}, "no progress for 5 s with work pending (stall?)"),
        ({"cause": "stall", "reason": "restart: emergency"}, "stall: restart: emergency"),
        ({"cause": "unresponsive", "reason": "restart: x"}, "unresponsive: restart: x"),
        ({"cause": "engine_down", "reason": "engine down: x"}, "engine_down: engine down: x"),
        ({"cause": "dead", "reason": "restart: x"}, "dead: restart: x"),
        ({"cause": "start_hung", "reason": "restart: x"}, "start_hung: restart: x"),
        ({"cause": "crash_loop", "reason": "reported: x"}, "crash_loop: reported: x"),
        ({"cause": "gpu_fault", "reason": "vetoed: x"}, "gpu_fault: vetoed: x"),
        ({"state": "acting", "reason": "restart: in window"}, "vkvagent is restarting vLLM: "),
        ({"state": "escalated", "reason": "escalated: the last 2"}, "escalated: escalated: the"),
    ],
)
def test_vllm_is_not_ready_while_it_serves_nothing_or_is_being_restarted(
    verdict: dict[str, Any], reason: str
) -> None:
    answer = readiness(status(**verdict), NOW)
    assert not answer.ready and answer.reason.startswith(reason), answer


def test_no_status_a_stale_one_or_a_silent_vllm_is_not_ready() -> None:
    assert readiness(None, NOW) == (False, "vkvagent has no status yet")
    assert readiness(status(), NOW + 3600).reason.startswith("vkvagent's status is stale")
    gone = report("healthy", pid=GONE, vllm=SERVING)
    assert not readiness(gone, NOW).ready
    silent = report("healthy", vllm={"recognised": None, "error": "connection refused"})
    assert readiness(silent, NOW) == (False, "vLLM does not answer /metrics: connection refused")


def test_a_status_three_intervals_old_is_stale_but_for_a_restart_in_progress() -> None:
    """The loop writes every interval (10 s here): a minute is too long for a balancer."""
    assert readiness(status(), NOW + 29).ready
    assert readiness(status(), NOW + 31) == (
        False, "vkvagent's status is stale: last update 31 s ago, daemon running but silent"
    )  # fmt: skip
    # A restart holds the loop for as long as it may take: it stays "restarting", not stale.
    acting = replace(status("acting", reason="restart: emergency"), stale_after=300.0)
    assert readiness(acting, NOW + 200).reason.startswith("vkvagent is restarting vLLM")
    assert readiness(acting, NOW + 301).reason.startswith("vkvagent's status is stale")


def test_a_source_the_agent_lacks_is_no_reason_to_take_vllm_out() -> None:
    """Impaired: NVML or D-Bus failing stops vkvagent acting, not vLLM serving."""
    assert readiness(status("impaired"), NOW) == (True, "vLLM serves (impaired)")


def test_the_exporter_answers_ready_beside_the_metrics() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics = AgentMetrics()
    exporter = Exporter(metrics, f"127.0.0.1:{port}", "")
    try:

        def get(path: str, method: str = "GET") -> tuple[int, str]:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request(method, path)
            answer = connection.getresponse()
            body = answer.read().decode()
            connection.close()
            return answer.status, body

        assert get("/ready") == (503, "not ready: vkvagent has no status yet\n")
        metrics.update(replace(status(), updated=time.time()))
        assert get("/ready") == (200, "ready: vLLM serves (healthy)\n")
        assert get("/ready", "HEAD") == (200, "")
        stalled = replace(status(cause="stall", reason="restart: emergency"), updated=time.time())
        metrics.update(stalled)
        assert get("/ready") == (503, "not ready: stall: restart: emergency\n")
        code, page = get("/metrics")
        assert code == 200 and "vkvagent_ready 0.0" in page and "vkvagent_verdict" in page
    finally:
        exporter.close()
