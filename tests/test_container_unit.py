"""vLLM in a podman container as vllm.service, under a real systemd 252 (tests/sandbox.py),
with the simulator as the image's server (tests/podman.py): ``apply`` rewrites vLLM's flags
after the image and keeps podman's part byte for byte, and proves them from vLLM's own
process in the container, not from podman's command line, which holds them whatever vLLM
received. One container for the module, the tests in file order."""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from collections.abc import Iterator

import pytest

from tests import podman
from tests.sandbox import MODEL, Sandbox, require
from tests.test_actuator import (
    CONFIG,
    DROPIN,
    STATE_DIR,
    VLLM,
    actions,
    cmdline,
    output,
    unit,
    vkvagent,
    write_config,
)
from tests.test_container import quadlet
from tests.test_daemon_systemd import AGENT, agent_unit
from tests.test_daemon_systemd import CONFIG as DAEMON_CONFIG
from tests.test_daemon_systemd import write_config as write_daemon_config
from tests.test_vllm_hangs import wait_for

pytestmark = pytest.mark.systemd

SIM_FLAGS = (MODEL, "--host", "127.0.0.1", "--port", "8000", "--cold-start", "2",
             "--time-scale", "30")  # fmt: skip
DEAF = "localhost/vkv-deaf"
# Container.main_pid, run inside the sandbox, where its podman and storage are.
INSPECT = """
import sys
from vkvagent import container
print(container.find(sys.argv[1:]).main_pid(sys.argv[1:]))
"""  # starts the simulator with flags of its own, not the unit's


def start(box: Sandbox, image: str, *flags: str, service: str = "") -> list[str]:
    """vllm.service running ``image`` with SIM_FLAGS and ``flags`` (``service``: lines for its
    [Service]), vkvagent's drop-in and state gone."""
    argv = podman.run_argv(image, *SIM_FLAGS, *flags)
    box.run("rm", "-rf", f"/{DROPIN}", STATE_DIR)
    box.write_unit(VLLM, podman.container_unit(argv, service=f"TimeoutStopSec=20\n{service}"))
    box.run("systemctl", "daemon-reload")
    box.run("systemctl", "restart", VLLM)
    box.wait_http(timeout=60)
    return argv


def in_the_container(box: Sandbox) -> tuple[str, ...]:
    """The simulator's own command line, in the container (not podman's, nor conmon's)."""
    done = box.run("pgrep", "-f", "^[^ ]*python[^ ]* -m vkvagent sim serve", check=False)
    (pid,) = done.stdout.split()
    return cmdline(box, int(pid))


@pytest.fixture(name="box", scope="module")
def podman_box_fixture() -> Iterator[Sandbox]:
    require()
    podman.require()
    with Sandbox() as box:
        podman.prepare(box, podman.SIM_IMAGE, podman.SIM_ENTRYPOINT)
        line = shlex.join([*podman.SIM_ENTRYPOINT, *SIM_FLAGS])
        podman.prepare(box, DEAF, ["/bin/sh", "-c", f"exec {line}", "--"])
        yield box


def test_apply_rewrites_vllms_flags_after_the_image_and_proves_them_in_the_container(
    box: Sandbox,
) -> None:
    argv = start(box, podman.SIM_IMAGE)
    image = argv.index(podman.SIM_IMAGE)
    write_config(box, {"max-num-seqs": 4})
    done = vkvagent(box, "apply", "--now")
    assert done.returncode == 0, output(done)
    written = unit(box).exec_start[0].argv
    assert written[: image + 1] == tuple(argv[: image + 1])  # podman's part, byte for byte
    assert written[image + 1 :] == (*SIM_FLAGS, "--max-num-seqs", "4")
    assert in_the_container(box)[-2:] == ("--max-num-seqs", "4")
    # Where the container keeps out of the unit's cgroup (Docker's way), the engine names its
    # first process: here the simulator itself.
    asked = box.run(sys.executable, "-c", INSPECT, *written, timeout=60).stdout.strip()
    assert cmdline(box, int(asked)) == in_the_container(box)
    action = actions(box)[-1]
    assert (action.kind, action.outcome) == ("apply", "done"), action
    assert "attest" in {s.step for s in action.steps}


def test_a_flag_vllm_in_the_container_never_received_is_rolled_back(box: Sandbox) -> None:
    """podman's MainPID shows the new flag on its command line; vLLM's process, started by an
    entrypoint that drops the arguments after the image, does not have it."""
    argv = start(box, DEAF)
    write_config(box, {"max-num-seqs": 6})
    done = vkvagent(box, "apply", "--now")
    assert done.returncode != 0, output(done)
    said = done.stdout + done.stderr
    assert "the running process's command line is not the one written" in said, output(done)
    assert "--max-num-seqs" not in in_the_container(box)
    assert "--max-num-seqs" in cmdline(box, unit(box).main_pid) or (
        unit(box).exec_start[0].argv == tuple(argv)  # rolled back already
    )
    action = actions(box)[-1]
    assert action.outcome == "rolled-back", action
    assert unit(box).exec_start[0].argv == tuple(argv)
    box.wait_http(timeout=60)


def test_a_flag_vllm_refuses_in_the_container_is_rolled_back_with_its_own_words(
    box: Sandbox,
) -> None:
    """vLLM's output reaches the journal through podman (conmon), under the unit: the line
    that says why the start failed is the one vLLM wrote in the container."""
    argv = start(box, podman.SIM_IMAGE)
    write_config(box, {"max-model-len": 10_000_000})
    done = vkvagent(box, "apply", "--now")
    assert done.returncode == 1, output(done)
    assert "rolled-back: " in done.stderr
    assert "User-specified max_model_len (10000000) is greater than the derived" in done.stderr
    assert unit(box).exec_start[0].argv == tuple(argv)
    box.wait_http(timeout=60)


def test_a_stall_in_the_container_is_found_and_the_unit_restarted_by_the_daemon(
    box: Sandbox,
) -> None:
    """The simulator in the container stalls 20 s after it starts (600 simulated s): tokens
    stop, /health says 200. The daemon restarts the unit, and podman starts a new container."""
    start(box, podman.SIM_IMAGE, "--scenario", "stall", "--scenario-onset", "600", "--rate", "4")
    before = in_the_container(box)
    write_daemon_config(box, DAEMON_CONFIG.format(read_timeout=5))
    box.write_unit(AGENT, agent_unit())
    box.run("systemctl", "daemon-reload")
    began = time.time()
    box.run("systemctl", "start", AGENT)
    try:
        started = wait_for(box, "restart.started", began, timeout=60)
        completed = wait_for(box, "restart.completed", began, timeout=60)
    finally:
        box.run("systemctl", "stop", AGENT)
    assert started["VKV_CAUSE"] == "stall" and completed["VKV_RESULT"] == "done", completed
    box.wait_http(timeout=60)
    assert in_the_container(box) == before  # the same command line, in a new container
    assert [(a.kind, a.outcome) for a in actions(box)] == [("restart", "done")]


def test_an_execstop_that_would_cut_vllms_drain_short_stands_and_vkvagent_drains_around_it(
    box: Sandbox,
) -> None:
    """``podman stop -t 5`` in ExecStop= kills the container 5 s after vLLM's SIGTERM: a drain
    through vLLM's --shutdown-timeout 30 would be cut short. The operator's ExecStop= stands:
    vkvagent gives vLLM no --shutdown-timeout there, says why in ``plan`` and ``config
    check``, and drains by waiting for a quiet moment, also when the operator gave vLLM the
    flag. With ``-t 60``, vLLM drains itself."""
    drain = {"drain_timeout": 30, "graceful_shutdown": True}
    for grace, flags in ((5, ()), (5, ("--shutdown-timeout", "30")), (60, ())):
        stop = f"ExecStop={' '.join(podman.PODMAN)} stop -t {grace} vllm"
        start(box, podman.SIM_IMAGE, *flags, service=stop)
        write_config(box, {}, restart=drain)
        planned = vkvagent(box, "plan")
        assert planned.returncode == 0, output(planned)
        checked = box.run(
            sys.executable, "-m", "vkvagent", "config", "check", CONFIG, check=False, timeout=60
        )
        assert checked.returncode == 0, output(checked)
        cut = f"stop -t {grace} vllm` kills vLLM's container {grace} s after its stop signal"
        if grace == 60:
            assert "--shutdown-timeout 30: vLLM drains when stopped" in planned.stdout
            assert "kills vLLM's container" not in planned.stdout + checked.stderr
        else:
            assert "no --shutdown-timeout: ExecStop= `podman " in planned.stdout, output(planned)
            assert (
                cut in planned.stdout and "give the engine's stop -t 60 or more" in planned.stdout
            )
            assert cut in checked.stderr, output(checked)
        done = vkvagent(box, "restart", "--reason", "test")
        assert done.returncode == 0, output(done)
        costs = actions(box)[-1].detail["costs"]
        assert costs["drain_mode"] in ("quiet", "busy"), (grace, flags, costs)
        written = unit(box).exec_start[0].argv
        assert ("--shutdown-timeout" in written) == (grace == 60 or bool(flags)), written
        box.wait_http(timeout=60)


def test_a_container_command_line_vkvagent_cannot_read_is_refused_in_one_line(
    box: Sandbox,
) -> None:
    argv = podman.run_argv(podman.SIM_IMAGE, *SIM_FLAGS, engine=["--frobnicate", "x"])
    box.run("rm", "-f", f"/{DROPIN}")  # an earlier test's, which would override the line
    box.write_unit(VLLM, podman.container_unit(argv))
    box.run("systemctl", "daemon-reload")
    write_config(box, {"max-num-seqs": 4})
    done = vkvagent(box, "plan")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "an option vkvagent does not know before the image " in lines[0]
    assert "(--frobnicate)" in lines[0], output(done)
    assert not (box.root / DROPIN).exists()


def test_a_unit_quadlet_generates_keeps_its_flags_and_says_why(box: Sandbox) -> None:
    """What Quadlet's generator writes for /etc/containers/systemd/vllm.container (podman 4.4
    and newer; Debian 12's 4.3 has none): a service whose SourcePath= is the .container file.
    Written by hand here, under /run/systemd/system, which systemd reads as it reads the
    generator's directory."""
    box.run("rm", "-f", f"/etc/systemd/system/{VLLM}", f"/{DROPIN}")
    argv = podman.run_argv(podman.SIM_IMAGE, *SIM_FLAGS)
    generated = podman.container_unit(argv).replace(
        "[Unit]\n", "[Unit]\nSourcePath=/etc/containers/systemd/vllm.container\n"
    )
    (box.root / "run/systemd/system").mkdir(parents=True, exist_ok=True)
    (box.root / "run/systemd/system" / VLLM).write_text(generated)
    box.run("systemctl", "daemon-reload")
    write_config(box, {"max-num-seqs": 4})
    done = vkvagent(box, "plan")
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert "generated by Quadlet from /etc/containers/systemd/vllm.container" in line, line
    version = box.run("podman", "--version").stdout.split()[-1]  # Debian 12's: 4.3.1
    assert f"whose drop-ins podman {version} does not read (Quadlet does from podman 4.8)" in line
    assert not (box.root / DROPIN).exists()
    (box.root / "run/systemd/system" / VLLM).unlink()


CONTAINER_DROPIN = "etc/containers/systemd/vllm.container.d/90-vkvagent.conf"


def test_a_quadlet_container_gets_its_flags_through_its_own_dropin(box: Sandbox) -> None:
    """Debian 13's Quadlet (podman 5.4) as the sandbox systemd's generator, and Debian 12's
    podman 4.3 running what it generates from /etc/containers/systemd/vllm.container: apply
    writes vllm.container.d/, not vllm.service.d/, and the flag reaches the simulator in the
    container; a rollback removes it again."""
    generator = box.root / "usr/lib/systemd/system-generators/podman-system-generator"
    shutil.copy(quadlet(), generator)
    argv = podman.run_argv(podman.SIM_IMAGE, *SIM_FLAGS)
    run, image = argv.index("run"), argv.index(podman.SIM_IMAGE)
    assert argv[run + 1 : run + 4] == ["--rm", "--name", "vllm"]  # Quadlet's own, below
    (box.root / "etc/containers/systemd").mkdir(parents=True, exist_ok=True)
    (box.root / "etc/containers/systemd/vllm.container").write_text(
        "[Container]\nImage=localhost/vkv-sim\nContainerName=vllm\n"
        f"GlobalArgs={shlex.join(podman.PODMAN[1:])}\n"
        f"PodmanArgs={shlex.join(argv[run + 4 : image])}\n"
        f"Exec={shlex.join(SIM_FLAGS)}\n[Service]\nTimeoutStopSec=20\n"
        # podman 4.3's rm --cidfile leaves the file, which its next run refuses; 4.4's removes it
        "ExecStopPost=-/bin/rm -f %t/%N.cid\n"
    )
    box.run("rm", "-rf", f"/etc/systemd/system/{VLLM}", f"/{DROPIN}", STATE_DIR)
    box.run("systemctl", "daemon-reload")
    box.run("systemctl", "restart", VLLM)
    box.wait_http(timeout=60)
    before = unit(box).exec_start[0].argv
    assert before[-len(SIM_FLAGS) - 1 :] == ("localhost/vkv-sim", *SIM_FLAGS), before
    write_config(box, {"max-num-seqs": 4})
    done = vkvagent(box, "apply", "--now")
    assert done.returncode == 0, output(done)
    assert "Exec=" in (box.root / CONTAINER_DROPIN).read_text()
    assert not (box.root / DROPIN).exists()
    written = unit(box).exec_start[0].argv
    assert written == (*before, "--max-num-seqs", "4"), written
    assert in_the_container(box)[-2:] == ("--max-num-seqs", "4")
    action = actions(box)[-1]
    assert (action.kind, action.outcome) == ("apply", "done"), action
    assert "attest" in {s.step for s in action.steps}
    done = vkvagent(box, "rollback", "--reason", "test")
    assert done.returncode == 0, output(done)
    assert not (box.root / CONTAINER_DROPIN).exists()
    assert unit(box).exec_start[0].argv == before
    box.wait_http(timeout=60)
    assert "--max-num-seqs" not in in_the_container(box)
