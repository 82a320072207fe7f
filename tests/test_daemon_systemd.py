"""vkvagent.service (Type=notify, WatchdogSec=) next to vllm.service (the simulator) in a real
systemd 252 (tests/sandbox.py): the closed loop through D-Bus, its journald events read back
with ``journalctl VKV_EVENT=...``, the watchdog killing a hung loop, and SIGHUP with a broken
config. Each test boots its own container."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox import PROJECT, Sandbox, exec_line, require, sim_unit
from tests.test_actuator import actions
from vkvagent.adapters.systemd import Systemd
from vkvagent.knowledge.events import CATALOGUE

pytestmark = pytest.mark.systemd

AGENT = "vkvagent.service"
CONFIG_DIR = "/etc/vkvagent"


def agent_unit(watchdog: float = 5.0) -> str:
    run = exec_line([sys.executable, "-m", "vkvagent", "run", "--config", CONFIG_DIR])
    return (
        "[Unit]\n"
        "Description=vkvagent (under test)\n"
        "After=vllm.service\n"
        "[Service]\n"
        "Type=notify\n"
        "NotifyAccess=main\n"
        f"WatchdogSec={watchdog:g}\n"
        "TimeoutAbortSec=3\n"
        "Restart=on-failure\n"
        "RestartSec=1\n"
        f"ExecStart={run}\n"
        "ExecReload=/bin/kill -HUP $MAINPID\n"
        f"Environment=PYTHONDONTWRITEBYTECODE=1 PYTHONPATH={PROJECT}\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


CONFIG = """\
[agent]
sample_interval = 1.0
[vllm]
url = "http://127.0.0.1:8000"
read_timeout = {read_timeout}
[gpu]
enabled = false
[restart]
ready_timeout = 30
job_timeout = 30
drain_timeout = 5
drain_max_in_flight = 100000
graceful_shutdown = false
[diagnosis]
stall_after = 10
[policy]
mode = "enforce"
min_interval = 3600
"""


@contextlib.contextmanager
def boot(units: dict[str, str], read_timeout: float = 5.0) -> Iterator[Sandbox]:
    """A container with ``units`` running and vkvagent.service installed, not started."""
    require()
    with Sandbox(units={**units, AGENT: agent_unit()}, enable=list(units)) as box:
        write_config(box, CONFIG.format(read_timeout=read_timeout))
        yield box


def write_config(box: Sandbox, text: str) -> None:
    directory = box.root / CONFIG_DIR.lstrip("/")
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    (directory / "config.toml").write_text(text)
    (directory / "config.toml").chmod(0o644)


def events(box: Sandbox, name: str) -> list[dict[str, Any]]:
    done = box.run("journalctl", "-o", "json", "--no-pager", f"VKV_EVENT={name}")
    return [json.loads(line) for line in done.stdout.split("\n") if line.strip()]


def wait_event(box: Sandbox, name: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = events(box, name)
        if found:
            return found[-1]
        time.sleep(0.5)
    raise AssertionError(f"no {name} event within {timeout} s:\n" + log(box))


def log(box: Sandbox) -> str:
    return "\n".join(box.messages(AGENT)[-30:])


def prop(box: Sandbox, unit: str, name: str) -> str:
    return box.run("systemctl", "show", "-p", name, "--value", unit).stdout.strip()


def test_the_closed_loop_restarts_a_stalled_vllm_through_dbus() -> None:
    # The simulator stalls at 600 simulated seconds of uptime (20 s real at 30x): requests
    # stay running, tokens stop, /health stays 200. `stall` is an emergency: any time.
    vllm = sim_unit("--scenario", "stall", "--scenario-onset", "600", "--rate", "4")
    with boot({"vllm.service": vllm}) as box:
        box.run("systemctl", "start", AGENT)  # Type=notify: returns once READY=1 came
        assert prop(box, AGENT, "ActiveState") == "active"
        with Systemd(box.bus_address, timeout=10) as bus:
            before = bus.unit("vllm.service").invocation_id

        completed = wait_event(box, "restart.completed", timeout=90)
        started = events(box, "restart.started")[-1]
        assert started["VKV_CAUSE"] == "stall"
        assert float(started["VKV_EVIDENCE_STALLED_S"]) >= 10
        assert started["PRIORITY"] == "5"
        assert started["MESSAGE_ID"] == CATALOGUE["restart.started"].message_id("restart.started")
        assert completed["VKV_CAUSE"] == "stall" and completed["VKV_RESULT"] == "done"
        assert completed["_SYSTEMD_UNIT"] == AGENT and completed["SYSLOG_IDENTIFIER"] == "vkvagent"
        assert completed["MESSAGE"].startswith("restarted vllm.service (stall)")

        with Systemd(box.bus_address, timeout=10) as bus:
            after = bus.unit("vllm.service")
        assert after.invocation_id != before and after.active_state == "active"
        box.wait_http()  # the new vLLM answers
        found = actions(box)
        assert [(a.kind, a.outcome) for a in found] == [("restart", "done")]
        assert found[0].reason.startswith("stall: restart: emergency")
        # One decision, one restart: the agent itself was never restarted.
        assert prop(box, AGENT, "NRestarts") == "0"
        done = box.run(
            sys.executable, "-m", "vkvagent", "status", "--json", "--config", CONFIG_DIR,
            check=False,
        )  # fmt: skip
        shown = json.loads(done.stdout)
        assert shown["last_restart"]["outcome"] == "done"
        assert shown["exit_code"] == done.returncode


def test_a_drained_restart_gives_vllm_its_drain_and_runs_the_hooks() -> None:
    """A stall outside the emergencies is restarted in the window, drained: the daemon's
    first restart gives vLLM --shutdown-timeout in the drop-in, runs pre_stop and post_ready
    around it, and reports what it cost."""
    vllm = sim_unit("--scenario", "stall", "--scenario-onset", "600", "--rate", "4")
    with boot({"vllm.service": vllm}) as box:
        write_config(
            box,
            CONFIG.format(read_timeout=5.0).replace(
                "graceful_shutdown = false\n",
                'pre_stop = ["/bin/sh", "-c", "echo out of rotation"]\n'
                'post_ready = ["/bin/true"]\n',
            )
            + 'windows = ["daily 00:00-24:00"]\nemergency = []\n',  # [policy]'s
        )
        box.run("systemctl", "start", AGENT)
        completed = wait_event(box, "restart.completed", timeout=90)
        assert completed["VKV_CAUSE"] == "stall" and completed["VKV_DRAIN_MODE"] == "quiet"
        assert float(completed["VKV_IN_FLIGHT"]) >= 0 and "VKV_DOWN_SECONDS" in completed
        hooks = {event["VKV_HOOK"]: event for event in events(box, "restart.hook")}
        assert hooks["pre_stop"]["VKV_OUTPUT"] == "out of rotation\n"
        assert hooks["pre_stop"]["VKV_STATUS"] == hooks["post_ready"]["VKV_STATUS"] == "0"
        (action,) = actions(box)
        assert (action.kind, action.outcome) == ("apply", "done")
        assert action.detail["changes"] == {"shutdown-timeout": 5}
        dropin = box.root / "etc/systemd/system/vllm.service.d/90-vkvagent.conf"
        assert dropin.read_text().endswith("\nTimeoutStopSec=35\nKillMode=mixed\n")
        done = box.run(
            sys.executable, "-m", "vkvagent", "status", "--json", "--config", CONFIG_DIR,
            check=False,
        )  # fmt: skip
        costs = json.loads(done.stdout)["last_restart"]["costs"]
        assert costs["drain_mode"] == "quiet" and costs["down_seconds"] > 0


def test_a_refused_restart_backs_off_instead_of_retrying_every_tick() -> None:
    # StartLimitBurst=1: the start at boot used it up, so the actuator refuses to restart
    # (it would leave the unit failed). The agent ticks every second; it must not ask again
    # each tick, but wait a minute after the first refusal.
    vllm = sim_unit(
        "--scenario", "stall", "--scenario-onset", "600", "--rate", "4",
        unit="StartLimitBurst=1\nStartLimitIntervalSec=3600",
    )  # fmt: skip
    with boot({"vllm.service": vllm}) as box:
        box.run("systemctl", "start", AGENT)
        failed = wait_event(box, "restart.failed", timeout=90)
        assert "StartLimitBurst=1" in failed["MESSAGE"], failed["MESSAGE"]
        time.sleep(10)  # ten ticks
        assert len(events(box, "restart.started")) == 1, log(box)
        done = box.run(
            sys.executable, "-m", "vkvagent", "status", "--json", "--config", CONFIG_DIR,
            check=False,
        )  # fmt: skip
        verdict = json.loads(done.stdout)["verdict"]
        assert verdict["cause"] == "stall" and verdict["action"] == "hold"
        assert verdict["reason"].startswith("retry back-off: 1 restart attempt(s)"), verdict
        box.run("systemctl", "stop", AGENT)
        assert [(a.kind, a.outcome) for a in actions(box)] == [("restart", "aborted")]


HANG = (
    "import socket, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 8000)); s.listen(64)\n"
    "time.sleep(10**6)\n"
)


def test_the_watchdog_kills_a_hung_loop() -> None:
    # A vLLM that accepts and never answers, and a read timeout longer than WatchdogSec=5:
    # the tick hangs past the watchdog, so systemd kills the agent and starts it again.
    hung = (
        "[Service]\n"
        f"ExecStart={exec_line([sys.executable, '-c', HANG])}\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
    with boot({"vllm.service": hung}, read_timeout=20.0) as box:
        box.run("systemctl", "start", AGENT)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and prop(box, AGENT, "NRestarts") == "0":
            time.sleep(0.5)
        assert prop(box, AGENT, "NRestarts") != "0", log(box)
        assert any("Watchdog timeout" in m for m in box.messages(AGENT)), log(box)


def test_sighup_with_a_broken_config_keeps_the_old_one() -> None:
    with boot({"vllm.service": sim_unit()}) as box:
        box.run("systemctl", "start", AGENT)
        pid = prop(box, AGENT, "MainPID")
        write_config(box, CONFIG.format(read_timeout=5.0) + 'max_per_day = "many"\n')
        box.run("systemctl", "reload", AGENT)
        failed = wait_event(box, "agent.reload_failed", timeout=15)
        assert "policy.max_per_day" in failed["MESSAGE"]
        assert failed["PRIORITY"] == "3"
        time.sleep(2)
        assert prop(box, AGENT, "ActiveState") == "active"
        assert prop(box, AGENT, "MainPID") == pid
        # Fixed, it is taken.
        write_config(box, CONFIG.format(read_timeout=5.0).replace("enforce", "observe"))
        box.run("systemctl", "reload", AGENT)
        reloaded = wait_event(box, "agent.reloaded", timeout=15)
        assert reloaded["VKV_MODE"] == "observe"
        assert prop(box, AGENT, "MainPID") == pid


def test_journal_fields_are_native() -> None:
    """Multi-line values and evidence arrive as separate journal fields, not a JSON blob."""
    with boot({"vllm.service": sim_unit()}) as box:
        box.run("systemctl", "start", AGENT)
        first = wait_event(box, "decision.changed", timeout=20)
        started = events(box, "agent.started")[-1]
        assert started["VKV_CONFIG"] == f"{CONFIG_DIR}/config.toml"
        assert started["VKV_MODE"] == "enforce" and started["PRIORITY"] == "6"
        assert first["VKV_ACTION"] in ("none", "hold")
        assert "VKV_REASON" in first and "VKV_WINDOW_OPEN" in first
        box.run("systemctl", "stop", AGENT)
        assert events(box, "agent.stopping")
        assert Path(box.root / "var/lib/vkvagent/status.json").exists()
