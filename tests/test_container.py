"""vLLM in a container: the engine's part of ExecStart found and kept byte for byte, vLLM's
flags rewritten after the image, and the lines that cannot be read refused in one line."""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from vkvagent import container
from vkvagent.actuation import unit_dropin
from vkvagent.actuation.actuator import Actuator, ActuatorError, RestartSettings
from vkvagent.actuation.drain import engine_stop_too_short
from vkvagent.adapters.ledger import Ledger
from vkvagent.adapters.systemd import ExecCommand, Systemd, UnitState
from vkvagent.adapters.vllm import VllmClient
from vkvagent.knowledge.dropin import DropinFile, split_exec_start
from vkvagent.knowledge.vllm_command import VllmCommandError, apply_flags, parse_command

IMAGE = "vllm/vllm-openai:v0.11.0"
PODMAN = [
    "/usr/bin/podman", "run", "--rm", "--name", "vllm", "--device", "nvidia.com/gpu=all",
    "-p", "8000:8000", "-v", "/srv/models:/models:ro", "--ipc=host", "-it",
]  # fmt: skip
DOCKER = [
    "/usr/bin/docker", "run", "--rm", "--gpus", "all", "--runtime", "nvidia", "-e",
    "HF_HOME=/models", "-p8000:8000", "--shm-size=16g",
]  # fmt: skip


@pytest.mark.parametrize("engine", [PODMAN, DOCKER, ["/usr/bin/env", "nerdctl", "run", "-d"]])
def test_the_image_is_found_and_vllms_flags_follow_it(engine: list[str]) -> None:
    argv = [*engine, IMAGE, "--model", "/models/llama", "--max-num-seqs", "256"]
    command = parse_command(argv)
    assert command.container is not None and argv[command.container.image] == IMAGE
    assert command.entrypoint == "serve" and command.model == "/models/llama"
    assert command.values() == {"max-num-seqs": 256}
    after = apply_flags(argv, {"max-num-seqs": 64, "gpu-memory-utilization": 0.9})
    # The engine's part and the image stay as they were, byte for byte.
    assert after[: len(engine) + 1] == argv[: len(engine) + 1]
    assert after[len(engine) + 1 :] == [
        "--model", "/models/llama", "--gpu-memory-utilization", "0.9", "--max-num-seqs", "64",
    ]  # fmt: skip


def test_vllms_command_named_after_the_image_is_read_as_it_is() -> None:
    argv = [*PODMAN, "localhost/vllm-cpu", "python3", "-m", "vllm.entrypoints.openai.api_server",
            "--model", "/m", "--max-num-seqs", "8"]  # fmt: skip
    command = parse_command(argv)
    assert command.entrypoint == "api_server" and command.launcher[0] == "python3"
    assert command.values() == {"max-num-seqs": 8}
    # `--name vllm` before the image is the engine's, not vLLM's launcher.
    assert command.launcher_start == len(PODMAN) + 1


def test_engine_options_in_every_form() -> None:
    argv = [
        "podman",
        "--root",
        "/var/lib/ps",
        "--storage-driver=vfs",
        "run",
        "--rm",
        "-e",
        "A=1",
        "-eB=2",
        "--env=C=3",
        "-dit",
        "--network",
        "host",
        "--",
        "img",
        "--model",
        "m",
    ]
    found = container.find(argv)
    assert found is not None and argv[found.image] == "img"
    assert found.option("e", "env") == "C=3" and found.option("network") == "host"
    assert found.option("rm") is None and ("rm", None) in found.options
    assert container.find(["docker", "container", "run", "img"]) is not None
    assert container.find(["vllm", "serve", "m"]) is None
    # A word of vLLM's that names an engine is vLLM's.
    assert container.find(["vllm", "serve", "m", "--served-model-name", "docker"]) is None
    assert parse_command(["python3", "-m", "vllm", "serve", "podman"]).model == "podman"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["podman", "run", "--frobnicate", "x", IMAGE],
         "an option vkvagent does not know before the image (--frobnicate): whether it takes a "
         "value decides where the image is; write it as --frobnicate=VALUE if it takes one"),
        (["podman", "run", "-Z", IMAGE], "(-Z)"),
        (["docker", "compose", "up", "vllm"], "ExecStart runs `docker compose`: vkvagent cannot "
         "see vLLM's command line in it, so it changes no flags"),
        (["podman", "run", "--rm"], "ExecStart runs `podman run` without an image"),
        (["podman", "run", "--name"], "podman: --name needs a value"),
    ],
)  # fmt: skip
def test_what_cannot_be_read_is_refused_in_one_line(argv: list[str], said: str) -> None:
    with pytest.raises(VllmCommandError) as caught:
        parse_command(argv)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_an_image_that_looks_like_a_flag_value_is_read_as_the_engine_reads_it() -> None:
    # --pull takes a value: "always" is it, and the image is the next word.
    argv = ["podman", "run", "--pull", "always", "vllm-openai", "--model", "m"]
    command = parse_command(argv)
    assert command.container is not None and argv[command.container.image] == "vllm-openai"
    # --rm takes none: "always" would be the image, and vLLM's part starts after it.
    assert container.find(["podman", "run", "--rm", "always", "x"]) == container.Container(
        "podman", 0, 3, (("rm", None),), 1
    )


@pytest.mark.parametrize(
    ("stops", "grace"),
    [
        ([["/usr/bin/podman", "stop", "-t", "130", "vllm"]], 130),
        ([["/usr/bin/podman", "stop", "-t130", "vllm"]], 130),
        ([["/usr/bin/docker", "stop", "--time=5", "vllm"]], 5),
        ([["/usr/bin/docker", "stop", "--timeout", "20", "vllm"]], 20),
        (
            [
                [
                    "/usr/bin/env",
                    "podman",
                    "--log-level",
                    "error",
                    "container",
                    "stop",
                    "-t7",
                    "vllm",
                ]
            ],
            7,
        ),
        ([["/usr/bin/docker", "stop", "vllm"]], 10),  # the engine's default
        ([["/usr/bin/podman", "kill", "vllm"]], 0),
        ([["/usr/bin/podman", "stop", "vllm", "-t", "120"]], 120),  # options after the name
        ([["/usr/bin/podman", "stop", "--ignore", "-i", "--time", "30", "vllm"]], 30),
        ([["/usr/bin/docker", "kill", "--signal=KILL", "vllm"]], 0),
        ([["/usr/bin/docker", "kill", "-s", "TERM", "vllm"]], None),  # a signal, no stop
        ([["/usr/bin/podman", "stop", "--frobnicate", "vllm"]], None),  # not read: no claim
        ([["/usr/bin/podman", "stop", "-t", "90", "vllm"], ["/usr/bin/podman", "rm", "vllm"]], 90),
        ([["/usr/bin/podman", "stop", "-t", "-1", "vllm"]], None),  # waits for ever
        ([["/bin/kill", "-TERM", "$MAINPID"]], None),  # systemd's stop, not the engine's
        # Quadlet's ExecStop (podman 5.4): rm -f stops with the container's stop timeout.
        ([["/usr/bin/podman", "rm", "-v", "-f", "-i", "--cidfile=/run/vllm.cid"]], 10),
        ([["/usr/bin/podman", "rm", "--force", "--time", "45", "vllm"]], 45),
        ([["/usr/bin/podman", "rm", "vllm"]], None),  # refused while it runs: no stop
        ([["/usr/bin/docker", "rm", "-f", "vllm"]], 0),  # Docker's rm -f kills
        ([["/usr/bin/podman", "rm", "--force=false", "vllm"]], None),
        ([["/usr/bin/docker", "stop", "--signal=SIGKILL", "vllm"]], 0),
        ([["/usr/bin/docker", "stop", "-s", "SIGTERM", "-t", "60", "vllm"]], 60),
        ([], None),
    ],
)
def test_how_long_execstop_lets_vllm_drain(stops: list[list[str]], grace: int | None) -> None:
    run = container.find([*PODMAN, IMAGE, "--model", "m"])
    assert run is not None
    found = container.stop_grace(run, stops)
    assert (found[0] if found else None) == grace
    if found:
        assert found[1].startswith(("podman ", "docker ")) and "vllm" in found[1]


def test_without_a_stop_timeout_execstop_gets_the_one_the_container_was_run_with() -> None:
    run = container.find([*DOCKER, "--stop-timeout", "120", IMAGE, "--model", "m"])
    assert run is not None
    assert container.stop_grace(run, [["/usr/bin/docker", "stop", "vllm"]]) == (
        120,
        "docker stop vllm",
    )


def test_the_unit_quadlet_generates_is_read_with_its_stop() -> None:
    """The service podman 5.4.2's Quadlet writes for a .container with ``Exec=`` and
    ``PodmanArgs=--stop-timeout 30`` (``quadlet -dryrun``, %t and %N resolved as systemd
    shows them): vLLM's flags after the image, and podman's rm -f that stops it after 30 s."""
    start = (
        "/usr/bin/podman run --name vllm --cidfile=/run/vllm.cid --replace --rm --cgroups=split "
        "--sdnotify=conmon -d --stop-timeout 30 localhost/vllm:test --model /models/m "
        "--max-num-seqs 4"
    )
    stop = "/usr/bin/podman rm -v -f -i --cidfile=/run/vllm.cid"
    run = container.find(shlex.split(start))
    assert run is not None
    assert shlex.split(start)[run.image + 1 :] == ["--model", "/models/m", "--max-num-seqs", "4"]
    assert container.stop_grace(run, [shlex.split(stop)]) == (30, stop.replace("/usr/bin/", ""))


def unit_with(start: str, stop: str) -> UnitState:
    """An active vllm.service running ``start``, stopped by ``stop``."""
    argv = tuple(shlex.split(start))
    return UnitState(
        "vllm.service", "loaded", "active", "running", "success", 41, "ab" * 16, 1, 0, 0,
        (ExecCommand(argv[0], argv, False),), "/etc/systemd/system/vllm.service", (), 5,
        10_000_000, "/system.slice/vllm.service", exec_stop=(tuple(shlex.split(stop)),),
    )  # fmt: skip


RUN = "/usr/bin/podman run --name vllm --cgroups=split IMAGE --model m"
QUADLET_STOP = "/usr/bin/podman rm -v -f -i --cidfile=/run/vllm.cid"


def test_an_execstop_too_short_for_the_drain_is_named_with_the_fix_its_engine_takes() -> None:
    """engine_stop_too_short: a drain of 90 s needs 120 s before the engine kills vLLM. The
    fix named is the one the ExecStop= takes: -t for stop; for Quadlet's podman rm -f, the
    run's --stop-timeout; for docker rm -f, which kills at once, a stop before it."""

    def said(start: str, stop: str) -> str:
        return engine_stop_too_short(unit_with(start, stop), 90)

    assert "give the engine's stop -t 120 or more" in said(RUN, "/usr/bin/podman stop vllm")
    quadlet = said(RUN, QUADLET_STOP)
    assert quadlet.startswith(f"ExecStop= `{QUADLET_STOP[9:]}` kills")
    assert "--stop-timeout 120 or more (Quadlet: PodmanArgs=)" in quadlet
    docker = said(RUN.replace("podman", "docker"), "/usr/bin/docker rm -f vllm")
    assert "kills vLLM's container 0 s after" in docker
    assert "stop the container with `docker stop -t 120` first" in docker
    longer = RUN.replace("--cgroups", "--stop-timeout 120 --cgroups")
    assert said(longer, "/usr/bin/podman rm -f vllm") == ""


def test_plan_names_a_stop_too_short_while_vllms_version_is_not_known(tmp_path: Path) -> None:
    """vLLM down (no version to read): plan says the drain is cut short, as config check
    does; a version known to lack --shutdown-timeout, or graceful_shutdown off: nothing."""

    class OneUnit(Systemd):  # the unit as systemd would show it; no bus needed
        def unit(self, name: str) -> UnitState:
            return unit_with(RUN, QUADLET_STOP)

    def actuator(graceful: bool) -> Actuator:
        return Actuator(
            unit="vllm.service", systemd=OneUnit("unix:path=/nonexistent"),
            ledger=Ledger(tmp_path), dropin=DropinFile("vllm.service", tmp_path, tmp_path),
            probe=VllmClient("http://127.0.0.1:9"), state_dir=tmp_path,
            settings=RestartSettings(drain_timeout=90, graceful_shutdown=graceful),
        )  # fmt: skip

    assert "kills vLLM's container 10 s after" in actuator(True).drain_cut_short(None)
    assert "kills vLLM's container 10 s after" in actuator(True).drain_cut_short("0.32.0")
    assert actuator(True).drain_cut_short("0.5.0") == ""  # no --shutdown-timeout to cut
    assert actuator(False).drain_cut_short(None) == ""


QUADLET_FILE = """[Unit]
Description=vLLM
[Container]
Image=localhost/vllm:test
ContainerName=vllm
PodmanArgs=--stop-timeout 80 --ipc=host
Volume=/srv/models:/models:ro
Exec="/models/My Model" --served-model-name "at 50%%" --max-num-seqs 8
[Service]
TimeoutStopSec=20
"""


def quadlet() -> str:
    """Debian 13's Quadlet, which `make deps` fetches (Debian 12's podman has none)."""
    program = os.environ.get("VKVAGENT_QUADLET", "")
    if not os.access(program, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail("no Quadlet (CI=true: not skipped): make deps fetches it")
        pytest.skip("no Quadlet: make deps fetches it")
    return program


def generated(program: str, *dirs: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    """The command line of the vllm.service Quadlet generates from ``dirs`` (``-dryrun``), as
    systemd reads it, and the last value of each of the unit's keys."""
    done = subprocess.run(
        [program, "-dryrun"], env={"QUADLET_UNIT_DIRS": ":".join(map(str, dirs))},
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    unit = done.stdout.split("---vllm.service---\n", 1)[1]
    keys = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line)
    (command,) = split_exec_start(keys["ExecStart"], specifiers={"t": "/run", "N": "vllm"})
    return command.argv, keys


class Generated(Systemd):
    """A unit as systemd shows it, running ``argv``, generated from ``source``; no bus."""

    argv: tuple[str, ...] = ()
    source = ""

    def unit(self, name: str) -> UnitState:
        return replace(unit_with(shlex.join(self.argv), QUADLET_STOP), source_path=self.source)


def acting_on(systemd: Systemd, dropin: DropinFile, state_dir: Path) -> Actuator:
    return Actuator(
        unit="vllm.service", systemd=systemd, ledger=Ledger(state_dir), dropin=dropin,
        probe=VllmClient("http://127.0.0.1:9"), state_dir=state_dir,
        settings=RestartSettings(drain_timeout=45, graceful_shutdown=True),
    )  # fmt: skip


def test_quadlet_generates_the_command_line_planned_from_vkvagents_container_dropin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quadlet 5.4 itself reads the .container and the drop-in vkvagent writes beside it: the
    unit it generates runs exactly the planned command line (podman's part untouched, vLLM's
    arguments quoted through Exec=, a space and a % included), stopped as the drain needs."""
    program = quadlet()
    monkeypatch.setattr(container, "QUADLET", (program,))  # the generator, not podman 4.3
    files, mine = tmp_path / "containers", tmp_path / "etc"
    files.mkdir()
    (files / "vllm.container").write_text(QUADLET_FILE)
    before, _keys = generated(program, files)

    systemd = Generated("unix:path=/nonexistent")
    systemd.argv, systemd.source = before, str(files / "vllm.container")
    dropin = unit_dropin.dropin_for("vllm.service", systemd.source, tmp_path)
    assert dropin.path == unit_dropin.QUADLET_UNIT_DIR / "vllm.container.d" / "90-vkvagent.conf"
    dropin.path = mine / "vllm.container.d" / dropin.path.name
    actuator = acting_on(systemd, dropin, tmp_path)
    plan = actuator.plan({"max-num-seqs": 4}, "0.32.0")
    image = before.index("localhost/vllm:test")
    assert plan.after[: image + 1] == before[: image + 1]
    assert plan.after[image + 1 :] == (
        "/models/My Model", "--served-model-name", "at 50%", "--max-num-seqs", "4",
        "--shutdown-timeout", "45",
    )  # fmt: skip
    actuator._write(plan.after, systemd.unit("vllm.service"))  # what apply writes
    assert "[Container]\nExec=" in dropin.path.read_text()
    after, keys = generated(program, files, mine)
    assert after == plan.after
    assert (keys["TimeoutStopSec"], keys["KillMode"]) == ("75", "mixed")  # 45 s and a margin
    # The .container edited since: not for vkvagent to build on.
    (files / "vllm.container").write_text(QUADLET_FILE.replace("--max-num-seqs 8", "--seed 1"))
    with pytest.raises(ActuatorError, match=r"vllm\.container changed since vkvagent derived"):
        actuator._check_foreign(systemd.unit("vllm.service"))


QUADLET_RUN = (
    "/opt/none/podman", "run", "--name", "vllm", "--cidfile=/run/vllm.cid", "--replace", "--rm",
    "--cgroups=split", "--sdnotify=conmon", "-d", "localhost/vllm:test", "/models/m",
)  # fmt: skip


def test_a_drop_in_of_the_wrong_kind_or_one_left_from_before_quadlet_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop-in's kind is chosen when vkvagent reads the unit: a unit that Quadlet generates
    since then (or no longer) is refused, adopt included, rather than given a drop-in its
    generator or systemd would ignore. So is a Quadlet unit that a service drop-in of
    vkvagent's, written before the move, still overrides."""
    systemd = Generated("unix:path=/nonexistent")
    systemd.argv, systemd.source = QUADLET_RUN, "/etc/containers/systemd/vllm.container"
    as_service = acting_on(systemd, DropinFile("vllm.service", tmp_path / "sd", tmp_path), tmp_path)
    for act in (lambda: as_service.plan({"max-num-seqs": 4}, "0.32.0"), as_service.adopt):
        with pytest.raises(ActuatorError, match="now generated by Quadlet, since vkvagent read"):
            act()
    assert not (tmp_path / "sd").exists()
    dropin = unit_dropin.dropin_for("vllm.service", systemd.source, tmp_path)
    quadlet = acting_on(systemd, dropin, tmp_path)
    monkeypatch.setattr(container, "QUADLET", ())  # no generator, no podman: version unknown
    monkeypatch.setattr(unit_dropin, "SYSTEMD_UNIT_DIR", tmp_path / "sd")
    assert quadlet.plan({"max-num-seqs": 4}, "0.32.0").after[-2:] == ("--max-num-seqs", "4")
    left = tmp_path / "sd" / "vllm.service.d" / "90-vkvagent.conf"
    left.parent.mkdir(parents=True)
    left.write_text("[Service]\nExecStart=\nExecStart=/usr/bin/vllm serve m\n")
    with pytest.raises(ActuatorError, match=f"{left}, written before the unit was Quadlet's"):
        quadlet.plan({"max-num-seqs": 4}, "0.32.0")
    left.unlink()
    systemd.argv = (*QUADLET_RUN[:2], "--env", "VLLM_API_KEY=s3cret", *QUADLET_RUN[2:])
    with pytest.raises(ActuatorError, match="give it by EnvironmentFile= or Secret=") as said:
        quadlet.plan({"max-num-seqs": 4}, "0.32.0")
    assert "s3cret" not in str(said.value)
    systemd.source = ""  # a unit file again
    with pytest.raises(ActuatorError, match="no longer generated by Quadlet"):
        quadlet.plan({"max-num-seqs": 4}, "0.32.0")


def test_an_engine_that_does_not_say_its_version_is_asked_again_only_after_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = tmp_path / "asked"
    program = tmp_path / "podman"
    program.write_text(f"#!/bin/sh\necho x >>{asked}\n[ -e {tmp_path}/fixed ] || exit 1\n"
                       "echo 'podman version 5.4.2'\n")  # fmt: skip
    program.chmod(0o755)
    argv = [str(program), "run", "IMAGE"]
    assert container.engine_version(argv) is None
    assert container.engine_version(argv) is None  # not asked again at once
    (tmp_path / "fixed").touch()
    assert asked.read_text().count("x") == 1
    monkeypatch.setattr(container, "_ASK_AGAIN", 0.0)
    assert container.engine_version(argv) == "5.4.2"
    monkeypatch.setattr(container, "_ASK_AGAIN", 1e9)
    assert container.engine_version(argv) == "5.4.2"  # an answer is kept
    assert asked.read_text().count("x") == 2
