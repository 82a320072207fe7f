"""The container engine's part of a command line: ``podman run``, ``docker run`` or
``nerdctl run``, their options, and the image after which vLLM's own arguments start.

An ``ExecStart=`` such as ``/usr/bin/podman run --rm --name vllm -p 8000:8000 -v /m:/m:ro
vllm/vllm-openai:v0.11.0 --model /m/llama`` belongs to the engine up to the image and to vLLM
after it: the image's entrypoint is ``vllm serve``, unless the line names vLLM's command
after the image. Finding the image means knowing which of the engine's options take a value;
``--name vllm`` does, ``--rm`` does not. An option this module does not know, spelled without
``=``, could be either, so the line is refused rather than guessed at. ``--opt=value`` is
always understood.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vkvagent.errors import VkvagentError

ENGINES = ("podman", "docker", "nerdctl")


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Options of `podman run`, `docker run` and `nerdctl run` (podman 4 to 5, Docker 20 to 28,
# nerdctl 1 to 2) that take a value, and the short options among them.
_RUN_VALUE = _words("""
add-host annotation arch attach authfile blkio-weight blkio-weight-device cap-add cap-drop
cgroup-conf cgroup-parent cgroupns cgroups chrootdirs cidfile conmon-pidfile cpu-count
cpu-percent cpu-period cpu-quota cpu-rt-period cpu-rt-runtime cpu-shares cpus cpuset-cpus
cpuset-mems decryption-key detach-keys device device-cgroup-rule device-read-bps
device-read-iops device-write-bps device-write-iops dns dns-opt dns-option dns-search
entrypoint env env-file env-merge expose gidmap gpus group-add group-entry health-cmd
health-interval health-log-destination health-max-log-count health-max-log-size
health-on-failure health-retries health-start-interval health-start-period
health-startup-cmd health-startup-interval health-startup-retries health-startup-success
health-startup-timeout health-timeout hostname hostuser image-volume init-path
io-maxbandwidth io-maxiops ip ip6 ipc isolation kernel-memory label label-file link
link-local-ip log-driver log-opt mac-address memory memory-reservation memory-swap
memory-swappiness mount name network net network-alias oom-score-adj os passwd-entry
personality pid pidfile pids-limit platform pod pod-id-file preserve-fd preserve-fds publish
pull rdt-class requires restart retry retry-delay runtime sdnotify seccomp-policy secret
security-opt shm-size shm-size-systemd stop-signal stop-timeout storage-opt subgidname
subuidname sysctl systemd timeout tmpfs uidmap ulimit umask unsetenv user userns uts variant
volume volume-driver volumes-from workdir
""")
_RUN_SHORT_VALUE = frozenset("acehlmpuvw")
# Global options, between the engine and `run`, that take a value.
_GLOBAL_VALUE = _words("""
cgroup-manager conmon config connection context events-backend host hooks-dir identity
imagestore log-level module namespace address network-cmd-path network-config-dir root
runroot runtime runtime-flag snapshotter data-root cni-path cni-netconfpath ssh
storage-driver storage-opt tlscacert tlscert tlskey tmpdir url volumepath db-backend
""")
_GLOBAL_SHORT_VALUE = frozenset("cHlna")
# Options that take no value.
_SHORT_BOOLEANS = frozenset("dDiItPq")
_BOOLEANS = _words("""
rm detach interactive tty init privileged read-only read-only-tmpfs replace publish-all
quiet sig-proxy no-healthcheck no-hosts oom-kill-disable disable-content-trust http-proxy
rootfs tls-verify help debug remote syslog experimental tls tlsverify no-hostname env-host
""")
_LAUNCHER = re.compile(r"vllm|vkvagent|python(\d+(\.\d+)?)?")  # what starts vLLM outside one
# What an engine runs that is no `run`: vkvagent can watch and restart it, not rewrite it.
_OTHER_COMMANDS = ("compose", "start", "play", "kube", "container start", "stack")


class ContainerError(VkvagentError, ValueError):
    """A container command line vkvagent cannot read (one line, saying why)."""


@dataclass(frozen=True)
class Container:
    """Where the engine's part of ``argv`` is: ``argv[start]`` is the engine's program and
    ``argv[image]`` the image; ``options`` the run options before the image, as (name
    without dashes, value or None)."""

    engine: str
    start: int
    image: int
    options: tuple[tuple[str, str | None], ...]
    globals_end: int = 0  # argv[start:globals_end]: the engine with its global options

    def option(self, *names: str) -> str | None:
        """The last value given to any of ``names`` (long names, or one letter)."""
        found = [value for name, value in self.options if name in names]
        return found[-1] if found else None

    def main_pid(self, argv: Sequence[str], timeout: float = 10.0) -> int | None:
        """The host PID of the container's first process, asked of the engine by the
        container's ``--name`` (``ENGINE inspect``); None without a name, or when the engine
        does not answer with one. For engines that keep the container out of the unit's
        cgroup (Docker's own ``docker-ID.scope``)."""
        name = self.option("name")
        if not name:
            return None
        engine = [
            *argv[self.start : self.globals_end],
            "inspect",
            "--format",
            "{{.State.Pid}}",
            name,
        ]
        try:
            done = subprocess.run(
                engine, check=False, capture_output=True, text=True, timeout=timeout
            )
        except (OSError, subprocess.SubprocessError):
            return None
        pid = done.stdout.strip()
        return int(pid) if done.returncode == 0 and pid.isdigit() and int(pid) > 0 else None


def engine_version(argv: Sequence[str]) -> str | None:
    """The version of the container engine ``argv`` runs (``ENGINE --version``: "podman
    version 4.3.1"); None when ``argv`` runs none or the engine does not say."""
    start = _engine_at(argv)
    return None if start is None else _version((*argv[: start + 1], "--version"))


# Where Quadlet is installed: as systemd's generator, and as the program that link names.
QUADLET = ("/usr/lib/systemd/system-generators/podman-system-generator",
           "/usr/libexec/podman/quadlet")  # fmt: skip
QUADLET_DROPINS = (4, 8, 0)  # the first podman whose Quadlet reads NAME.container.d/


def quadlet_version(argv: Sequence[str]) -> str | None:
    """The version of the Quadlet that generates a unit running ``argv``: the generator's own
    (``quadlet -version``: "5.4.2"), else that of the podman it runs, which ships with it."""
    for program in QUADLET:
        if os.access(program, os.X_OK):
            found = _version((program, "-version"))
            if found is not None:
                return found
    return engine_version(argv)


_VERSIONS: dict[tuple[str, ...], tuple[str | None, float]] = {}
_ASK_AGAIN = 300.0  # seconds before a command that did not say its version is asked again


def _version(command: tuple[str, ...]) -> str | None:
    """Asked once a process once it answers, and at most every _ASK_AGAIN while it does not:
    the daemon plans flags on every tick, a version changes only with its package, and an
    engine that hangs costs its 10 s timeout."""
    found, asked = _VERSIONS.get(command, (None, -_ASK_AGAIN))
    if found is not None or time.monotonic() - asked < _ASK_AGAIN:
        return found
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=10)
        said = re.search(r"\d+(\.\d+)+", done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        said = None
    _VERSIONS[command] = (said.group() if said else None, time.monotonic())
    return _VERSIONS[command][0]


def _engine_at(argv: Sequence[str]) -> int | None:
    """Where ``argv`` names a container engine's program (after ``/usr/bin/env``, say)."""
    return next((i for i, word in enumerate(argv) if os.path.basename(word) in ENGINES), None)


def find(argv: Sequence[str]) -> Container | None:
    """The engine's part of ``argv``, or None when it runs no container engine. Raises
    ContainerError for an engine command vkvagent cannot read through (an unknown option
    before the image; `compose` or `start`, which name no vLLM command line)."""
    args = tuple(argv)
    for start, token in enumerate(args):
        engine = os.path.basename(token)
        if engine in ENGINES:
            return _run(args, start, engine)
        if _LAUNCHER.fullmatch(engine):  # vLLM (or the simulator) first: `--name docker` is its
            return None
    return None


def _run(argv: tuple[str, ...], start: int, engine: str) -> Container:
    i = globals_end = _options(argv, start + 1, _GLOBAL_VALUE, _GLOBAL_SHORT_VALUE, engine, [])
    rest = " ".join(argv[i : i + 2])
    if argv[i : i + 2] == ("container", "run"):
        i += 1
    if argv[i : i + 1] != ("run",):
        other = next((c for c in _OTHER_COMMANDS if rest.startswith(c)), None)
        what = f"`{engine} {other}`" if other else f"{engine} without `run`"
        raise ContainerError(
            f"ExecStart runs {what}: vkvagent cannot see vLLM's command line in it, so it "
            "changes no flags (it watches and restarts the unit as ever)"
        )
    options: list[tuple[str, str | None]] = []
    image = _options(argv, i + 1, _RUN_VALUE, _RUN_SHORT_VALUE, engine, options)
    if image >= len(argv):
        raise ContainerError(f"ExecStart runs `{engine} run` without an image")
    return Container(engine, start, image, tuple(options), globals_end)


# What `ENGINE stop`, `kill` and `rm` take, before or after the container's name.
_STOP_VALUE = _words("time timeout signal cidfile filter")
_STOP_SHORT_VALUE = frozenset("ts")
_STOP_BOOLEANS = _words("all ignore latest force volumes depend")
_STOP_SHORT_BOOLEANS = frozenset("ailfv")
_KILL_SIGNALS = ("KILL", "SIGKILL", "9")
DEFAULT_STOP_TIMEOUT = 10  # podman's and Docker's, unless `run --stop-timeout` says otherwise


def stop_grace(run: Container, stops: Sequence[Sequence[str]]) -> tuple[int, str] | None:
    """How long the unit's ``ExecStop=`` commands let vLLM's container run after its stop
    signal before the engine kills it, and the command that says so: ``ENGINE stop -t N``
    and ``podman rm -f -t N`` (Quadlet's ExecStop; without ``-t``, the run line's
    ``--stop-timeout`` or the engine's 10 s), ``ENGINE kill`` and ``docker rm -f`` (0 s).
    None when no ExecStop= stops the container through an engine: then systemd's own stop
    (SIGTERM to ``ENGINE run``, passed on to the container) and TimeoutStopSec= decide."""
    found: list[tuple[int, str]] = []
    for stop in stops:
        argv = tuple(stop)
        start = _engine_at(argv)
        if start is None:
            continue
        engine = os.path.basename(argv[start])
        try:
            i = _options(argv, start + 1, _GLOBAL_VALUE, _GLOBAL_SHORT_VALUE, engine, [])
            if argv[i : i + 1] == ("container",):
                i += 1
            command = argv[i] if i < len(argv) else ""
            options: list[tuple[str, str | None]] = []
            while command in ("stop", "kill", "rm") and i + 1 < len(argv):  # names, options
                i = _options(
                    argv, i + 1, _STOP_VALUE, _STOP_SHORT_VALUE, engine, options,
                    _STOP_BOOLEANS, _STOP_SHORT_BOOLEANS,
                )  # fmt: skip
        except ContainerError:
            continue
        said = " ".join((engine, *argv[start + 1 :]))
        signals = [v for n, v in options if n in ("s", "signal") and v is not None]
        forced = any(n in ("f", "force") and v != "false" for n, v in options)  # else no stop
        killing = not signals or signals[-1].upper() in _KILL_SIGNALS
        if command == "kill" and killing:
            found.append((0, said))  # another signal is no stop: systemd's own follows
        elif command == "stop" and signals and killing:
            found.append((0, said))  # stop --signal=KILL: no grace
        elif command == "rm" and forced and engine != "podman":
            found.append((0, said))  # docker's and nerdctl's rm -f kill
        elif command == "stop" or (command == "rm" and forced):
            given = [v for n, v in options if n in ("t", "time", "timeout") and v is not None]
            default = run.option("stop-timeout") or str(DEFAULT_STOP_TIMEOUT)
            seconds = given[-1] if given else default
            if seconds.isdigit():  # -1 (podman: wait for ever) sets no limit
                found.append((int(seconds), said))
    return min(found) if found else None


def _options(
    argv: Sequence[str],
    i: int,
    long_values: frozenset[str],
    short_values: frozenset[str],
    engine: str,
    out: list[tuple[str, str | None]],
    booleans: frozenset[str] = _BOOLEANS,
    short_booleans: frozenset[str] = _SHORT_BOOLEANS,
) -> int:
    """Read options from ``argv[i]`` on into ``out``; the index of the first other token."""
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        token = argv[i]
        if token == "--":
            return i + 1
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            if eq:
                out.append((name, value))
            elif name in long_values:
                if i + 1 >= len(argv):
                    raise ContainerError(f"{engine}: {token} needs a value")
                out.append((name, argv[i + 1]))
                i += 1
            elif name in booleans:
                out.append((name, None))
            else:
                raise ContainerError(_unknown(engine, token))
        else:  # -it, -p8000:8000, -p 8000:8000, -e=X
            for k, letter in enumerate(token[1:], 1):
                if letter in short_values:
                    if k + 1 < len(token):
                        out.append((letter, token[k + 1 :].removeprefix("=")))
                    elif i + 1 < len(argv):
                        out.append((letter, argv[i + 1]))
                        i += 1
                    else:
                        raise ContainerError(f"{engine}: {token} needs a value")
                    break
                if letter not in short_booleans:
                    raise ContainerError(_unknown(engine, token))
                out.append((letter, None))
        i += 1
    return i


def _unknown(engine: str, token: str) -> str:
    return (
        f"ExecStart passes {engine} an option vkvagent does not know before the image "
        f"({token}): whether it takes a value decides where the image is; write it as "
        f"{token}=VALUE if it takes one"
    )
