"""vkvagent against the real vLLM 0.32 (CPU build, tests/realvllm.py) when it hangs, as
vllm.service under a real systemd 252 (tests/sandbox.py), with ``vkvagent run`` as
vkvagent.service in enforce mode and no restart window (only emergencies may restart):

- gauges frozen at requests running that no longer run (vLLM issue 22545, put in front of the
  real vLLM by tests/gaugeproxy.py): the probe is answered, nothing is restarted;
- the engine's worker process stopped (SIGSTOP) under client traffic: /health stays 200,
  /metrics answers, the counters stop and the gauges keep their last values. A stall, restarted
  as an emergency within ``stall_after`` plus two sample intervals, and vLLM serves again;
- the API server stopped (SIGSTOP): /metrics accepts connections and never answers. Unresponsive,
  restarted, serving again.

One container for the module; the tests run in file order and each leaves vLLM serving.
5 to 7 minutes in all."""

from __future__ import annotations

import http.client
import json
import re
import sys
import threading
import time
from typing import Any

import pytest

from tests.realvllm import (
    START_TIMEOUT,
    Traffic,
    complete,
    processes,
    vllm_box_fixture,  # noqa: F401 - the `vllm_box` fixture
    wait_until,
)
from tests.sandbox import PROJECT, Sandbox, exec_line
from tests.test_actuator import actions, unit
from tests.test_daemon_systemd import AGENT, agent_unit, events, log

pytestmark = [pytest.mark.vllm, pytest.mark.systemd]

INTERVAL = 5.0  # seconds between samples
STALL_AFTER = 30.0
UNRESPONSIVE_AFTER = 20.0
SCRAPE_LIMIT = 1.0 + 3.0  # connect_timeout + read_timeout: what one hung scrape waits
TICK = 1.0  # a tick's own time, from its sample to its event in the journal
PROXY = "vllm-frozen-gauges.service"
CONFIG = """\
[agent]
sample_interval = {interval:g}
[vllm]
url = "http://127.0.0.1:{port}"
connect_timeout = 1
read_timeout = 3
[gpu]
enabled = false
[probe]
after = 10
timeout = 10
[restart]
ready_timeout = {timeout:g}
job_timeout = {timeout:g}
[diagnosis]
stall_after = {stall:g}
unresponsive_after = {unresponsive:g}
[policy]
mode = "enforce"
windows = []
"""


# The history read inside the container (SQLite cannot open it through /proc/PID/root).
PROBES = """
import json, sys
from vkvagent.adapters.history import History
with History(sys.argv[1], readonly=True) as history:
    print(json.dumps([p.to_json() for p in history.probes()]))
"""


def start_agent(box: Sandbox, port: int = 8000) -> float:
    """vkvagent.service (re)started on a fresh config and state; when (Unix seconds)."""
    began = time.time()
    box.run("systemctl", "stop", AGENT, check=False)
    box.run("rm", "-rf", "/var/lib/vkvagent")
    (box.root / "etc/vkvagent").mkdir(mode=0o755, parents=True, exist_ok=True)
    (box.root / "etc/vkvagent/config.toml").write_text(
        CONFIG.format(
            interval=INTERVAL,
            port=port,
            timeout=START_TIMEOUT,
            stall=STALL_AFTER,
            unresponsive=UNRESPONSIVE_AFTER,
        )
    )
    box.write_unit(AGENT, agent_unit(watchdog=START_TIMEOUT))
    box.run("systemctl", "daemon-reload")
    box.run("systemctl", "start", AGENT)
    wait_for(box, "agent.started", began, timeout=30)
    return began


def at(event: dict[str, Any]) -> float:
    """When journald received the event (Unix seconds)."""
    return int(event["__REALTIME_TIMESTAMP"]) / 1e6


def since(box: Sandbox, name: str, began: float) -> list[dict[str, Any]]:
    """This test's ``name`` events: those from ``began`` on."""
    return [e for e in events(box, name) if at(e) >= began]


def wait_for(box: Sandbox, name: str, began: float, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = since(box, name, began)
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"no {name} event within {timeout:g} s:\n" + log(box))


def restarted_for(box: Sandbox, cause: str, began: float, within: float) -> dict[str, Any]:
    """Wait for vkvagent's restart of vLLM for ``cause`` and its end; its restart.started."""
    started = wait_for(box, "restart.started", began, timeout=within + 30)
    assert started["VKV_CAUSE"] == cause, started["MESSAGE"]
    completed = wait_for(box, "restart.completed", began, timeout=START_TIMEOUT + 60)
    assert completed["VKV_CAUSE"] == cause, completed["MESSAGE"]
    return started


class Counters:
    """Reads vLLM's work counters from outside every half second: when they last moved."""

    WORK = re.compile(
        r"^vllm:(?:generation_tokens_total|request_success_total|iteration_tokens_total_count)"
        r"(?:\{[^}]*\})? (\S+)$",
        re.MULTILINE,
    )

    def __init__(self, box: Sandbox) -> None:
        self.box, self.moves = box, [time.time()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Counters:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def moved_before(self, moment: float) -> float:
        return max(t for t in self.moves if t <= moment)

    def _watch(self) -> None:
        last = None
        while not self._stop.wait(0.5):
            try:
                _status, page = self.box.http_get(8000, "/metrics", timeout=2)
            except (OSError, http.client.HTTPException):
                continue  # restarting
            total = sum(float(v) for v in self.WORK.findall(page.decode()))
            if last is not None and total != last:
                self.moves.append(time.time())
            last = total


def ready_during_hang(box: Sandbox, within: float) -> tuple[float, int]:
    """When vkvagent's /ready (its metrics address) first said 503, and what vLLM's /health
    said at that moment."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        code, _body = box.http_get(9849, "/ready", timeout=2)
        if code == 503:
            return time.time(), box.http_get(8000, "/health", timeout=5)[0]
        time.sleep(0.5)
    raise AssertionError(f"/ready never said 503 within {within:g} s:\n" + log(box))


def serves_again(box: Sandbox) -> None:
    box.wait_http(timeout=30)
    assert complete(box, max_tokens=8)[0] == 200


def test_frozen_gauges_with_a_probe_that_answers_restart_nothing(vllm_box: Sandbox) -> None:
    """The gauges say 3 requests run, no counter moves (no traffic): without the probe that is
    a stall after 30 s (tests/cases/frozen-gauges-probe-answers.json). The probe, answered by
    the real vLLM through the proxy, says the engine is idle and well."""
    proxy = exec_line([sys.executable, "-m", "tests.gaugeproxy", "8001", "8000", "3"])
    vllm_box.write_unit(
        PROXY,
        f"[Service]\nExecStart={proxy}\nEnvironment=PYTHONDONTWRITEBYTECODE=1 "
        f"PYTHONPATH={PROJECT}\n",
    )
    vllm_box.run("systemctl", "daemon-reload")
    vllm_box.run("systemctl", "start", PROXY)
    vllm_box.wait_http(port=8001, path="/metrics", timeout=30)
    _status, page = vllm_box.http_get(8001, "/metrics")
    assert b'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0' in page
    invocation = unit(vllm_box).invocation_id
    began = start_agent(vllm_box, port=8001)
    time.sleep(STALL_AFTER + 30)
    vllm_box.run("systemctl", "stop", AGENT, PROXY)
    assert since(vllm_box, "restart.started", began) == [], log(vllm_box)
    assert unit(vllm_box).invocation_id == invocation
    decisions = [e["MESSAGE"] for e in since(vllm_box, "decision.changed", began)]
    assert not any("stall" in d for d in decisions), decisions
    probes = json.loads(
        vllm_box.run(sys.executable, "-c", PROBES, "/var/lib/vkvagent", timeout=60).stdout
    )
    assert len(probes) >= 3 and {p["outcome"] for p in probes} == {"ok"}, probes
    assert max(p["latency_s"] for p in probes) < 10


def test_a_stopped_engine_worker_is_a_stall_restarted_at_once(vllm_box: Sandbox) -> None:
    began = start_agent(vllm_box)
    before = len(actions(vllm_box))
    with Traffic(vllm_box, clients=2) as traffic, Counters(vllm_box) as counters:
        wait_until(lambda: traffic.count("ok") >= 5, 60, "completions before the hang")
        (worker,) = processes(vllm_box, "VLLM::Worker")
        stopped = time.time()
        vllm_box.run("kill", "-STOP", str(worker))
        # vkvagent's /ready tells the load balancer before the stall is named; vLLM's own
        # /health answers 200 throughout.
        unready, health = ready_during_hang(vllm_box, within=STALL_AFTER + 3 * INTERVAL)
        started = restarted_for(vllm_box, "stall", began, within=STALL_AFTER + 3 * INTERVAL)
        assert health == 200 and unready < at(started)
        print(f"\nstopped worker: /ready said 503 {unready - stopped:.1f} s after SIGSTOP, "
              f"while vLLM's /health said {health}")  # fmt: skip
        served = traffic.count("ok")
        wait_until(lambda: traffic.count("ok") >= served + 3, 60, "completions after")
    serves_again(vllm_box)
    # Outputs already on their way finish after the stop: the engine's last progress is when
    # its counters last moved, as /metrics showed them every half second.
    last = max(stopped, counters.moved_before(at(started)))
    took = at(started) - last
    print(f"\nstopped worker: the counters last moved {last - stopped:.1f} s after SIGSTOP; "
          f"restart began {took:.1f} s after that ({started['VKV_EVIDENCE_STALL_EVIDENCE']}); "
          f"clients: {dict(sorted(traffic.outcomes.items()))}")  # fmt: skip
    # The stall clock starts at the first sample that saw the last progress (up to one interval
    # after it), and the stall is found at the first sample stall_after later (up to one more):
    # stall_after plus two intervals, and the tick's own time to the journal (TICK).
    assert STALL_AFTER - TICK <= took <= STALL_AFTER + 2 * INTERVAL + TICK, log(vllm_box)
    assert started["VKV_DRAIN"] == "false"  # an emergency: nothing to drain from a hung engine
    assert started["VKV_EVIDENCE_STALL_EVIDENCE"] in ("requests pending", "a probe got no answer")
    action = actions(vllm_box)[-1]
    assert len(actions(vllm_box)) == before + 1
    assert (action.kind, action.outcome) == ("restart", "done")
    assert action.reason.startswith("stall: ")


def test_a_stopped_api_server_is_unresponsive_and_restarted(vllm_box: Sandbox) -> None:
    began = start_agent(vllm_box)
    time.sleep(3 * INTERVAL)  # vLLM answered since it became active: not loading
    main_pid = unit(vllm_box).main_pid
    stopped = time.time()
    vllm_box.run("kill", "-STOP", str(main_pid))
    # The first silent sample comes within an interval; each later tick waits out its scrape.
    limit = UNRESPONSIVE_AFTER + INTERVAL + 3 * SCRAPE_LIMIT
    started = restarted_for(vllm_box, "unresponsive", began, within=limit)
    serves_again(vllm_box)
    took = at(started) - stopped
    print(f"\nstopped API server: restart began {took:.1f} s after SIGSTOP")
    assert UNRESPONSIVE_AFTER <= took <= limit, log(vllm_box)
    assert "has not answered /metrics for" in started["VKV_REASON"]
    assert unit(vllm_box).main_pid != main_pid
    vllm_box.run("systemctl", "stop", AGENT)
