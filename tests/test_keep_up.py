"""Keeping vLLM up, with the simulator as vllm.service under a real systemd 252 and
``vkvagent run`` as vkvagent.service in enforce mode (tests/sandbox.py): a vLLM that exited 0
under ``Restart=on-failure`` is started again and a deliberate ``systemctl stop`` is left
alone; a start that never opens its port is restarted and then escalated; a crash loop is
named while systemd restarts it, and vkvagent's own starts for one stop at ``escalate_after``.
Each test boots its own container (the real vLLM's exit is in tests/test_vllm_real.py)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sandbox import Sandbox, sim_unit
from tests.test_actuator import actions
from tests.test_daemon_systemd import AGENT, CONFIG_DIR, boot, events, log, write_config

pytestmark = pytest.mark.systemd

INTERVAL = 1.0
CONFIG = """\
[agent]
sample_interval = {interval:g}
[vllm]
url = "http://127.0.0.1:8000"
connect_timeout = 0.5
read_timeout = 2
[gpu]
enabled = false
[probe]
enabled = false
[restart]
ready_timeout = {ready:g}
start_timeout = {start:g}
job_timeout = 30
graceful_shutdown = false
[policy]
mode = "enforce"
crash_loop_exits = 3
"""


@contextlib.contextmanager
def agent(vllm: str, *, ready: float = 30, start: float = 0) -> Iterator[Sandbox]:
    """A container with ``vllm`` as vllm.service and vkvagent running against it."""
    with boot({"vllm.service": vllm}) as box:
        write_config(box, CONFIG.format(interval=INTERVAL, ready=ready, start=start))
        box.run("systemctl", "start", AGENT)  # Type=notify: back once READY=1 came
        yield box


def wait_for(box: Sandbox, what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s:\n{log(box)}")


def decisions(box: Sandbox, cause: str) -> list[dict[str, Any]]:
    return [e for e in events(box, "decision.changed") if e.get("VKV_CAUSE") == cause]


def unit(box: Sandbox) -> dict[str, str]:
    props = "ActiveState,SubState,MainPID,InvocationID,NRestarts"
    shown = box.run("systemctl", "show", "-p", props, "vllm.service").stdout
    return dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)


def status(box: Sandbox) -> dict[str, Any]:
    done = box.run(
        sys.executable, "-m", "vkvagent", "status", "--json", "--config", CONFIG_DIR, check=False
    )
    return dict(json.loads(done.stdout))


def test_a_vllm_that_exited_0_is_started_again_and_one_stopped_on_purpose_is_left_down() -> None:
    with agent(sim_unit(service="Restart=on-failure")) as box:
        checked = box.run(
            sys.executable, "-m", "vkvagent", "config", "check", CONFIG_DIR, check=False
        )
        assert checked.returncode == 0, checked.stderr
        assert (
            "vkvagent: warning: vllm.service has Restart=on-failure: vLLM exits 0 when its "
            "engine dies"
        ) in checked.stderr
        box.wait_http()
        time.sleep(3 * INTERVAL)  # the daemon has seen it serve
        before = unit(box)
        # vLLM exits 0 (as 0.32 does when its engine dies): Restart=on-failure leaves it down.
        died = time.monotonic()
        box.run("kill", "-TERM", before["MainPID"])
        started = wait_for(
            box, "a start", lambda: events(box, "restart.started"), timeout=10 * INTERVAL
        )[-1]
        took = time.monotonic() - died
        assert started["VKV_CAUSE"] == "dead", started["MESSAGE"]
        assert "exited with status 0 and nobody stopped it" in started["VKV_REASON"]
        assert "Restart=on-failure leaves it down" in started["VKV_REASON"]
        assert started["VKV_DRAIN"] == "false"
        completed = wait_for(
            box, "the start's end", lambda: events(box, "restart.completed"), timeout=30
        )[-1]
        assert completed["VKV_RESULT"] == "done", completed["MESSAGE"]
        box.wait_http()
        back = time.monotonic() - died
        after = unit(box)
        assert after["ActiveState"] == "active" and after["InvocationID"] != before["InvocationID"]
        shown = box.run(
            sys.executable, "-m", "vkvagent", "status", "--config", CONFIG_DIR, check=False
        ).stdout
        assert "  warning     vllm.service has Restart=on-failure" in shown, shown
        (exited,) = events(box, "unit.exited")
        assert exited["VKV_EXIT"] == "exited with status 0"
        assert exited["VKV_RESTARTED_BY_SYSTEMD"] == "false" and "VKV_STOPPED_BY" not in exited
        print(f"\nexited 0: vkvagent began the start {took:.1f} s after, vLLM answered "
              f"{back:.1f} s after")  # fmt: skip
        # One sample interval to see it down, a tick and systemd's start.
        assert took <= 2 * INTERVAL + 2.0, log(box)

        # A person stops it, once the daemon saw it serve again: left down, and said so.
        time.sleep(3 * INTERVAL)
        box.run("systemctl", "stop", "vllm.service")
        reported = wait_for(
            box,
            "the stop reported",
            lambda: [e for e in events(box, "unit.exited") if "VKV_STOPPED_BY" in e],
            timeout=10 * INTERVAL,
        )[-1]
        assert reported["VKV_STOPPED_BY"].startswith("systemd: Stop")
        time.sleep(5 * INTERVAL)
        assert unit(box)["ActiveState"] == "inactive"
        assert len(events(box, "restart.started")) == 1
        down = decisions(box, "engine_down")[-1]
        assert "; stopped on purpose (systemd: Stop" in down["VKV_REASON"]
        box.run("systemctl", "stop", AGENT)
        found = actions(box)
    assert [(a.kind, a.outcome) for a in found] == [("restart", "done")]
    assert found[0].reason.startswith("dead: restart: vLLM serves nothing, any time")


def test_a_start_that_never_opens_its_port_is_restarted_then_escalated() -> None:
    # The model never loads; vkvagent's start timeout is 4 s and a restart waits 5 s for it.
    vllm = sim_unit("--cold-start", "1e9", service="Restart=always")
    with agent(vllm, ready=5, start=4) as box:
        escalated = wait_for(
            box, "the escalation", lambda: events(box, "policy.escalated"), timeout=60
        )[-1]
        assert escalated["VKV_CAUSE"] == "start_hung"
        assert escalated["MESSAGE"].startswith(
            "escalated: the last 2 restarts did not restore performance"
        )
        starts = events(box, "restart.started")
        assert [s["VKV_CAUSE"] for s in starts] == ["start_hung", "start_hung"]
        assert "has not answered (start_timeout 4 s)" in starts[0]["VKV_REASON"]
        time.sleep(3 * INTERVAL)
        assert len(events(box, "restart.started")) == 2  # nothing more: a person must look
        shown = status(box)
        assert shown["verdict"]["state"] == "escalated" and shown["exit_code"] == 2
        box.run("systemctl", "stop", AGENT)
        found = actions(box)
    assert [(a.kind, a.outcome) for a in found] == [("restart", "failed")] * 2


def test_a_crash_loop_is_named_while_systemd_restarts_it_and_adds_no_start() -> None:
    # The engine dies 1.5 s (45 simulated s) after each start; Restart=always brings it back.
    vllm = sim_unit(
        "--scenario",
        "engine-dead",
        "--scenario-onset",
        "45",
        service="Restart=always\nRestartSec=1",
    )
    with agent(vllm) as box:
        named = wait_for(box, "the crash loop", lambda: decisions(box, "crash_loop"), timeout=40)
        reason = named[-1]["VKV_REASON"]
        assert reason.startswith("reported: crash_loop: 3 exits in the last 60 min"), reason
        # With vLLM's own error line, once journald has it: under load it can come a tick
        # after the unit's state says the process is gone.
        said = wait_for(
            box,
            "vLLM's error line",
            lambda: [r for r in [status(box)["verdict"]["reason"]] if "EngineDead" in r],
            timeout=30,
        )
        assert "crash loop from 3): vllm.v1.engine.exceptions.EngineDead" in said[0], said
        assert events(box, "restart.started") == []
        assert status(box)["verdict"]["state"] == "critical"


def test_vkvagents_own_starts_for_a_vllm_that_keeps_dying_stop_at_escalate_after() -> None:
    # Under Restart=on-failure each death leaves the unit down: vkvagent starts it (dead),
    # twice (escalate_after), and then holds: a person must look.
    vllm = sim_unit("--scenario", "engine-dead", "--scenario-onset", "45", service="")
    with agent(vllm) as box:
        escalated = wait_for(
            box, "the escalation", lambda: events(box, "policy.escalated"), timeout=40
        )[-1]
        assert escalated["VKV_CAUSE"] == "crash_loop"
        assert escalated["MESSAGE"].startswith("escalated: vLLM still exits after 2 starts")
        time.sleep(3 * INTERVAL)
        starts = events(box, "restart.started")
        assert [s["VKV_CAUSE"] for s in starts] == ["dead", "dead"]
        assert unit(box)["ActiveState"] in ("inactive", "failed")
