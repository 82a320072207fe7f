"""vllm.service as operators run it in a container: ``podman run ... IMAGE FLAGS``, inside the
systemd sandbox (tests/sandbox.py), with podman 4.3 from Debian 12.

What runs there (shared/reference/containers.md): vfs storage of the sandbox's own, crun with
``--cgroups=disabled`` (the container's processes stay in the unit's cgroup), the host's
network, and keyrings off (systemd-nspawn's seccomp filter forbids keyctl to the services it
starts). No registry is reachable: the image is an empty one imported in the test, whose
ENTRYPOINT is the server's command, like vllm/vllm-openai's ``vllm serve``, with the host's
system and Python bind-mounted read-only."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.sandbox import PROJECT, Sandbox, exec_line

PODMAN = (
    "/usr/bin/podman", "--storage-driver", "vfs", "--root", "/var/lib/vkv-ps",
    "--runroot", "/run/vkv-pr",
)  # fmt: skip
SIM_IMAGE = "localhost/vkv-sim"
SIM_ENTRYPOINT = (sys.executable, "-m", "vkvagent", "sim", "serve")


def require() -> None:
    if shutil.which("podman") is None or shutil.which("crun") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("podman or crun missing (CI=true: not skipped): make deps installs them")
        pytest.skip("podman or crun missing: make deps installs them")


def prepare(box: Sandbox, image: str, entrypoint: Sequence[str]) -> None:
    """podman's settings for the sandbox, and ``image``: empty, starting ``entrypoint``."""
    conf = box.root / "etc/containers/containers.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("[containers]\nkeyring = false\n")
    box.run("mkdir", "-p", "/var/lib/vkv-empty")
    change = "ENTRYPOINT " + "[" + ", ".join(f'"{part}"' for part in entrypoint) + "]"
    box.run(
        "sh", "-c", f"tar -C /var/lib/vkv-empty -c . | {' '.join(PODMAN)} import "
        f"--change '{change}' - {image}",
        timeout=120,
    )  # fmt: skip


def run_argv(
    image: str, *flags: str, engine: Sequence[str] = (), mounts: Sequence[str] = ()
) -> list[str]:
    """``podman run`` of ``image`` with vLLM's ``flags`` after it, as operators write it."""
    binds = []
    paths = (str(Path(p).resolve()) for p in (sys.base_prefix, str(PROJECT), *mounts))
    for path in ("/usr", "/lib", "/lib64", "/bin", "/etc", *paths):  # /lib may be a link
        binds += ["-v", f"{path}:{path}:ro"]
    return [
        *PODMAN, "run", "--rm", "--name", "vllm", "--runtime", "crun", "--cgroups=disabled",
        "--network=host", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=8192:8192",
        "-e", "PYTHONDONTWRITEBYTECODE=1", "-e", "PYTHONUNBUFFERED=1", *engine, *binds,
        image, *flags,
    ]  # fmt: skip


def container_unit(argv: Sequence[str], service: str = "") -> str:
    """vllm.service running ``argv`` (a ``podman run``), with the ExecStartPre= that clears a
    container left by an unclean stop."""
    return (
        "[Unit]\nDescription=vLLM in a podman container\n"
        "[Service]\n"
        f"ExecStartPre=-{' '.join(PODMAN)} rm -f vllm\n"
        f"ExecStart={exec_line(argv)}\n"
        f"{service}\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
