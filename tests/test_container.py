"""vLLM in a container: the engine's part of ExecStart found and kept byte for byte, vLLM's
flags rewritten after the image, and the lines that cannot be read refused in one line."""

from __future__ import annotations

import shlex

import pytest

from vkvagent import container
from vkvagent.flags import VllmCommandError, apply_flags, parse_command

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
