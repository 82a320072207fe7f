"""The real vLLM 0.32 (CPU build, tests/realvllm.py) in a podman container as vllm.service,
under a real systemd 252 (tests/sandbox.py, tests/podman.py): the image's entrypoint is
vLLM's API server and the unit passes vLLM's flags after the image, as operators run
vllm/vllm-openai. vLLM's venv and model are bind-mounted read-only.

One restart shows what a container changes: ``vkvagent apply`` under three streaming clients
rewrites the flags after the image (podman's part byte for byte), vLLM drains the streams in
flight through podman's stop (SIGTERM passed on to the container), and the new flag is proven
from vLLM's own process in the container. About 2 minutes."""

from __future__ import annotations

import json
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
    SERVED,
    START_TIMEOUT,
    processes,
    require,
)
from tests.sandbox import Sandbox
from tests.test_actuator import actions, cmdline, output, unit, vkvagent
from tests.test_vllm_drain import (
    ASKED,
    COMMAND_TIMEOUT,
    GO,
    configure,
    restart_when_the_engine_holds_a_young_stream,
    stop_requested,
)

pytestmark = [pytest.mark.vllm, pytest.mark.systemd]

IMAGE = "localhost/vllm-cpu"
DRAIN = 30
FLAGS = (
    "--model", str(MODEL), "--served-model-name", SERVED, "--host", "127.0.0.1", "--port",
    "8000", "--enforce-eager", *BASE_FLAGS, "--shutdown-timeout", str(DRAIN),
)  # fmt: skip
ENGINE = ("--ipc=host", "--tmpfs", "/tmp", "-e", "HOME=/tmp")


def apply(box: Sandbox) -> tuple[str, dict[str, Any]]:
    """``vkvagent apply --now``: its output, and the costs the ledger recorded."""
    done = vkvagent(box, "apply", "--now", "--reason", "test", timeout=COMMAND_TIMEOUT)
    assert done.returncode == 0, output(done)
    costs = actions(box)[-1].detail["costs"]
    assert isinstance(costs, dict)
    return done.stdout, costs


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
            podman.container_unit(argv, service="TimeoutStopSec=60\nRestart=always"),
        )
        box.run("systemctl", "daemon-reload")
        box.run("systemctl", "start", "vllm.service")
        box.wait_http(timeout=START_TIMEOUT)
        yield box


def test_a_flag_change_is_proven_in_the_container_and_a_restart_drains_through_podman(
    box: Sandbox,
) -> None:
    configure(box, "[vllm.flags]", "max-num-seqs = 4")
    before = unit(box).exec_start[0].argv
    image = before.index(IMAGE)
    said, _costs = apply(box)
    # podman's part of the line is the unit's own; vLLM's flags, in the container, are vLLM's.
    written = unit(box).exec_start[0].argv
    assert written[: image + 1] == before[: image + 1]
    assert [written[i + 1] for i, word in enumerate(written) if word == "--max-num-seqs"] == ["4"]
    (server,) = processes(box, f"{PYTHON} -m {ENTRYPOINT}")
    assert cmdline(box, server)[3:] == written[image + 1 :]
    action = actions(box)[-1]
    assert (action.kind, action.outcome) == ("apply", "done"), said
    assert "attest" in {s.step for s in action.steps}

    # A restart while the engine holds a young stream (as test_vllm_drain, tried again when
    # vkvagent's scrape before the stop came late and found the engine between requests).
    box.run("mkdir", "-p", "/var/lib/lb")
    hold = ["/bin/sh", "-c", f"touch {ASKED}; while [ ! -e {GO} ]; do sleep 0.01; done"]
    configure(box, f"pre_stop = {json.dumps(hold)}")
    for _attempt in range(3):
        said, costs, streams, young, let_go = restart_when_the_engine_holds_a_young_stream(
            box, clients=3
        )
        stop = stop_requested(box)
        if costs["in_flight"] or stop - let_go < 0.3:
            break
    print(f"\nthe real vLLM in podman, a restart under 3 streaming clients: "
          f"{json.dumps(costs)}; clients: {streams.outcomes()}")  # fmt: skip
    assert costs["drain_mode"] == "vllm" and costs["in_flight"] >= 1, said
    assert costs["aborted"] == 0, said
    # The stream the engine held when the stop was asked for finished whole, through podman's
    # stop (test_vllm_drain has why a request sent in the instant of the stop is not asked).
    held = [s for s in streams.streams if s.started == young]
    assert [(s.outcome, s.ended > stop) for s in held] == [("ok", True)], streams.outcomes()
