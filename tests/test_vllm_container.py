"""The real vLLM 0.32 (CPU build, tests/realvllm.py) in a podman container as vllm.service,
under a real systemd 252 (tests/sandbox.py, tests/podman.py): the image's entrypoint is
vLLM's API server and the unit passes vLLM's flags after the image, as operators run
vllm/vllm-openai. vLLM's venv and model are bind-mounted read-only.

1. The daemon, as vkvagent.service, applies an edit of [vllm.flags] in its window and proves
   it from vLLM's own process in the container (podman's part of the line byte for byte);
   rolls back a flag that breaks vLLM's start, with vLLM's own error line; and finds the
   engine's worker stopped through a probe that goes unanswered, and restarts vLLM.
2. ``vkvagent restart`` under three streaming clients: vLLM drains the streams in flight
   through podman's stop (SIGTERM passed on to the container).

About 5 minutes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import podman
from tests.realvllm import (
    BASE_FLAGS,
    ENTRYPOINT,
    HOME,
    MODEL,
    PYTHON,
    QUICK_START,
    SERVED,
    START_TIMEOUT,
    complete,
    processes,
    require,
    wait_until,
)
from tests.sandbox import Sandbox
from tests.test_actuator import actions, cmdline, unit
from tests.test_daemon_systemd import AGENT, agent_unit, log
from tests.test_vllm_drain import (
    ATTEMPTS,
    HELD,
    configure,
    nothing_cut_off,
    restart_when_the_engine_holds_a_young_stream,
    stop_requested,
    under_way_at_the_stop,
)
from tests.test_vllm_hangs import at, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.systemd]

IMAGE = "localhost/vllm-cpu"
DRAIN = 30
INTERVAL = 2.0  # the daemon's seconds between samples
STALL_AFTER = 20.0
FLAGS = (
    "--model", str(MODEL), "--served-model-name", SERVED, "--host", "127.0.0.1", "--port",
    "8000", *QUICK_START, *BASE_FLAGS, "--shutdown-timeout", str(DRAIN),
)  # fmt: skip
ENGINE = ("--ipc=host", "--tmpfs", "/tmp", "-e", "HOME=/tmp")


@pytest.fixture(name="box", scope="module")
def container_box_fixture() -> Iterator[Sandbox]:
    require()
    podman.require()
    with Sandbox() as box:
        podman.prepare(box, IMAGE, [str(PYTHON), "-m", ENTRYPOINT])
        base = str(Path(PYTHON).resolve().parent.parent)  # the venv's interpreter
        argv = podman.run_argv(IMAGE, *FLAGS, engine=ENGINE, mounts=[str(HOME), base])
        box.write_unit(
            "vllm.service",
            # KillMode=mixed: the stop's SIGTERM goes to podman alone, which passes it on to
            # vLLM's API server; under the default, it would reach vLLM's engine as well.
            podman.container_unit(
                argv, service="TimeoutStopSec=60\nKillMode=mixed\nRestart=always"
            ),
        )
        box.run("systemctl", "daemon-reload")
        box.run("systemctl", "start", "vllm.service")
        box.wait_http(timeout=START_TIMEOUT)
        yield box


@pytest.fixture(autouse=True)
def _each_alone(box: Sandbox) -> Iterator[None]:
    """What a test left behind, a daemon still running or vLLM down, is not the next one's."""
    yield
    box.run("systemctl", "stop", AGENT, check=False)
    box.run("systemctl", "start", "vllm.service", check=False)
    box.wait_http(timeout=START_TIMEOUT)


DAEMON_CONFIG = f"""\
[agent]
sample_interval = {INTERVAL:g}
[vllm]
url = "http://127.0.0.1:8000"
[gpu]
enabled = false
[probe]
after = 10
timeout = 10
[restart]
ready_timeout = {START_TIMEOUT:g}
job_timeout = {START_TIMEOUT:g}
[diagnosis]
stall_after = {STALL_AFTER:g}
[policy]
mode = "enforce"
windows = ["daily 00:00-24:00"]
# Three restarts in as many minutes: no interval, cooldown or budget between them.
min_interval = 0
cooldown = 0
max_per_day = 100
[vllm.flags]
max-num-seqs = 4
"""


def the_daemons(box: Sandbox, name: str, began: float) -> dict[str, Any]:
    """The daemon's ``name`` event since ``began``, waited for."""
    return wait_for(box, name, began, timeout=START_TIMEOUT + 60)


def test_the_daemon_applies_flags_in_the_container_undoes_a_broken_one_and_finds_a_stall(
    box: Sandbox,
) -> None:
    config = box.root / "etc/vkvagent/config.toml"
    config.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    config.write_text(DAEMON_CONFIG)
    before = unit(box).exec_start[0].argv
    image = before.index(IMAGE)
    box.write_unit(AGENT, agent_unit(watchdog=30))
    box.run("systemctl", "daemon-reload")
    began = time.time()
    box.run("systemctl", "start", AGENT)

    # The flag, at the window: podman's part of the line is the unit's own; vLLM's flags, in
    # the container, are vLLM's, and the proof comes from vLLM's process there.
    applied = the_daemons(box, "restart.completed", began)
    assert (applied["VKV_CAUSE"], applied["VKV_RESULT"]) == ("flags", "done"), log(box)
    written = unit(box).exec_start[0].argv
    assert written[: image + 1] == before[: image + 1]
    assert [written[i + 1] for i, word in enumerate(written) if word == "--max-num-seqs"] == ["4"]
    (server,) = processes(box, f"{PYTHON} -m {ENTRYPOINT}")
    assert cmdline(box, server)[3:] == written[image + 1 :]
    action = actions(box)[-1]
    assert (action.kind, action.outcome) == ("apply", "done")
    assert [s.step for s in action.steps if s.state == "done"][-2:] == ["ready", "attest"]

    # A flag the tiny model cannot take (2048 positions): vLLM exits in its start, and the line
    # before comes back, with vLLM's own words from the container's output in the journal.
    broken = time.time()
    config.write_text(DAEMON_CONFIG + "max-model-len = 100000\n")
    box.run("systemctl", "reload", AGENT)
    undone = the_daemons(box, "restart.rolled_back", broken)
    assert undone["VKV_FLAGS"] == "--max-model-len 100000", undone
    assert undone["VKV_VLLM_ERROR"].startswith("Value error, User-specified max_model_len"), undone
    assert unit(box).exec_start[0].argv == written
    wait_until(lambda: complete(box, max_tokens=4)[0] == 200, 60, "vLLM serving again")

    # The engine's worker stopped with no traffic: /health 200, every gauge 0, nothing moves;
    # only the probe can tell, and vLLM is restarted as an emergency.
    stalled = time.time()
    (worker,) = processes(box, "VLLM::Worker")
    box.run("kill", "-STOP", str(worker))
    started = wait_for(box, "restart.started", stalled, timeout=STALL_AFTER + 60)
    assert started["VKV_CAUSE"] == "stall", started["MESSAGE"]
    assert started["VKV_EVIDENCE_STALL_EVIDENCE"] == "a probe got no answer", log(box)
    completed = the_daemons(box, "restart.completed", stalled)
    assert completed["VKV_RESULT"] == "done", completed["MESSAGE"]
    wait_until(lambda: complete(box, max_tokens=4)[0] == 200, 60, "vLLM serving again")
    box.run("systemctl", "stop", AGENT)
    print(
        f"\nthe daemon, vLLM in podman: flags applied {at(applied) - began:.0f} s after the "
        f"start; the broken flag undone {at(undone) - broken:.0f} s after the reload; the "
        f"stall restarted {at(started) - stalled:.0f} s after SIGSTOP"
    )


def test_a_restart_drains_the_streams_in_flight_through_podman(box: Sandbox) -> None:
    # A restart while the engine holds a young stream (as test_vllm_drain, tried again when
    # the stop came after that stream ended).
    box.run("mkdir", "-p", "/var/lib/lb")
    configure(box, *HELD)
    for _attempt in range(ATTEMPTS):
        said, costs, streams, young, _let_go = restart_when_the_engine_holds_a_young_stream(
            box, clients=3
        )
        stop = stop_requested(box)
        nothing_cut_off(streams, young, costs, said)
        if under_way_at_the_stop(streams, young, stop, costs):
            break
    print(f"\nthe real vLLM in podman, a restart under 3 streaming clients: "
          f"{json.dumps(costs)}; clients: {streams.outcomes()}")  # fmt: skip
    assert costs["drain_mode"] == "vllm" and costs["in_flight"] >= 1, said
    assert costs["aborted"] == 0, said
    # The stream the engine held when the stop was asked for finished whole, through podman's
    # stop (test_vllm_drain has why a request sent in the instant of the stop is not asked).
    held = [s for s in streams.streams if s.started == young]
    assert [(s.outcome, s.ended > stop) for s in held] == [("ok", True)], streams.outcomes()
