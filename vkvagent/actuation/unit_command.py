"""The unit's command line as systemd and /proc know it: the unit file's own ExecStart (what
vkvagent's drop-in is derived from, to notice an edit), the file a generator made the unit
from (Quadlet's ``.container``), and the command line vLLM's process runs with (its
``/proc/PID/cmdline`` and environment, found in a container too), compared with the one
written.

Apart from the actuator because it is a question of its own (which command line is which);
the actuator acts on the answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from vkvagent import apikey
from vkvagent.adapters.cgroup import pids_in
from vkvagent.adapters.systemd import Systemd, SystemdError, UnitState
from vkvagent.container import Container
from vkvagent.knowledge.dropin import (
    ExecCommand,
    ExecSyntaxError,
    expand_exec_env,
    parse_dropin,
    split_exec_start,
)
from vkvagent.knowledge.vllm_command import VllmCommandError, parse_command


def fragment_command(state: UnitState) -> ExecCommand | None:
    """The unit file's own ExecStart, whatever drop-ins say; None when it cannot be read."""
    try:
        text = Path(state.fragment_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    exec_start = parse_dropin(text).exec_start  # a unit file reads like a drop-in
    if exec_start is None:
        return None
    try:
        commands = split_exec_start(exec_start, specifiers=specifiers(state.name), strict=False)
    except ExecSyntaxError:
        return None
    return commands[-1] if commands else None


def fragment_argv(state: UnitState) -> tuple[str, ...] | None:
    command = fragment_command(state)
    return apikey.mask_argv(command.argv) if command is not None else None


def specifiers(unit: str) -> dict[str, str]:
    """The unit-name specifiers of ``unit`` (``vllm@a.service``: %n, %N, %p, %i, %I, %j)."""
    name, _dot, _kind = unit.rpartition(".")
    prefix, at, instance = name.partition("@")
    return {
        "n": unit, "N": name, "p": prefix, "P": prefix, "i": instance if at else "",
        "I": instance if at else "", "j": prefix.rsplit("-", 1)[-1], "J": prefix.rsplit("-", 1)[-1],
    }  # fmt: skip


def is_quadlet(source_path: str) -> bool:
    """Whether a unit is Quadlet's: generated from the ``.container`` file ``source_path``."""
    return source_path.endswith(".container")


def source_path(systemd: Systemd, unit: str) -> str:
    """The file a generator made ``unit`` from; "" for a unit file, or when systemd cannot say
    now (the actuator's preflight then reports why)."""
    try:
        return systemd.unit(unit).source_path
    except SystemdError:
        return ""


def own(state: UnitState) -> tuple[str, ...] | None:
    """What vkvagent's drop-in is derived from, to notice later that it changed: the unit
    file's own ExecStart, or Quadlet's whole ``.container`` file (the unit it generates holds
    the drop-in's Exec= too). None when it cannot be read."""
    if not is_quadlet(state.source_path):
        return fragment_argv(state)
    try:
        return (Path(state.source_path).read_text(encoding="utf-8"),)
    except (OSError, UnicodeDecodeError):
        return None


def vllms_command(
    state: UnitState, argv: tuple[str, ...], proc: Path
) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """vLLM's own command line as it runs, and the part of ``argv`` it must equal. In a
    container MainPID is the engine, whose argv is the unit's whatever vLLM received: the
    process that proves the flags is vLLM's in the container, found in the unit's cgroup
    (podman with --cgroups=split or disabled, Quadlet) or through the engine by the
    container's name (Docker); its arguments are compared with those after the image.
    (None, argv) when it cannot be found: cache_config_info alone proves the flags."""
    written = parse_command(argv)
    engine = written.container
    if engine is None:
        return cmdline(proc, state.main_pid), argv
    for pid in container_pids(state, engine, argv, proc):
        running = cmdline(proc, pid) or ()
        try:
            inside = parse_command(running)
        except VllmCommandError:
            continue
        if inside.container is None:  # vLLM itself, not the engine's copy of the line
            return running[inside.args_start :], argv[written.args_start :]
    return None, argv


def container_pids(
    state: UnitState, engine: Container, argv: tuple[str, ...], proc: Path
) -> Iterator[int]:
    """The processes that may be vLLM's in a container: the unit's but its MainPID, then the
    container's first process by the engine's word (asked only if those are not)."""
    yield from (pid for pid in pids_in(state.control_group, proc) if pid != state.main_pid)
    pid = engine.main_pid(argv)
    if pid is not None:
        yield pid


def cmdline(proc: Path, pid: int) -> tuple[str, ...] | None:
    if pid <= 0:
        return None
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    argv = (part.decode("utf-8", "surrogateescape") for part in raw.split(b"\0")[:-1])
    return apikey.mask_argv(tuple(argv))  # as systemd's ExecStart reads (systemd.UnitState)


def environ(proc: Path, pid: int) -> dict[str, str] | None:
    if pid <= 0:
        return None
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode("utf-8", "surrogateescape").partition("=") for item in raw.split(b"\0"))
    return {name: value for name, _eq, value in pairs if name}


def same_command(
    running: tuple[str, ...], intended: tuple[str, ...], environ: dict[str, str] | None
) -> bool:
    """The process's argv against the written one, after systemd's ``$VAR`` expansion with
    the process's own environment (``$EXTRA_ARGS`` may become several words). Without the
    environment, arguments with ``$`` are compared by position only."""
    if environ is not None:  # the key `--api-key ${VAR}` expands to is masked in ``running``
        return running == apikey.mask_argv(expand_exec_env(intended, environ))
    if len(running) != len(intended):
        return False
    return all("$" in want or got == want for got, want in zip(running, intended))
