"""The operator's commands around a restart: ``[restart] pre_stop`` before vLLM is touched (take
the host out of a load balancer) and ``post_ready`` once it serves again (put it back).

A hook is an argv list run without a shell, with a timeout, its output captured for the
event. Its environment is the daemon's plus ``VKVAGENT_HOOK``, ``VKVAGENT_UNIT``,
``VKVAGENT_CAUSE`` and ``VKVAGENT_ACTION``, so one script can serve every unit and both hooks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

OUTPUT_LIMIT = 4096  # characters of a hook's output kept for the event: the end, where errors are


@dataclass(frozen=True)
class HookResult:
    name: str  # pre_stop | post_ready
    argv: tuple[str, ...]
    status: int | None  # the exit status; None when it did not run or ran out of time
    seconds: float
    output: str  # stdout and stderr together, the last OUTPUT_LIMIT characters
    problem: str | None = None  # why it failed, one line; None when it exited 0

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "argv": list(self.argv),
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "output": self.output,
            "problem": self.problem,
        }

    def event(self, action: int) -> tuple[str, str, dict[str, object]]:
        """The event that reports this run: (name, message, fields)."""
        said = f"{self.name} {'ran' if self.ok else 'failed: ' + str(self.problem)}"
        fields: dict[str, object] = {
            "action": action,
            "hook": self.name,
            "argv": list(self.argv),
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "output": self.output,
        }
        if self.problem:
            fields["error"] = self.problem
        return ("restart.hook" if self.ok else "restart.hook_failed", said, fields)


def check_argv(argv: Sequence[str]) -> str | None:
    """What keeps ``argv`` from running as a hook, or None. The program is named by an absolute
    path: the daemon's PATH is systemd's, not the operator's shell's."""
    if not argv:
        return None  # no hook
    program = Path(argv[0])
    if not program.is_absolute():
        return f"{argv[0]!r} is not an absolute path (hooks run without a shell or PATH search)"
    if not program.is_file():
        return f"{argv[0]} does not exist"
    if not os.access(program, os.X_OK):
        return f"{argv[0]} is not executable"
    return None


def run_hook(name: str, argv: Sequence[str], env: Mapping[str, str], timeout: float) -> HookResult:
    """Run one hook to its end or its timeout (then it is killed, with its process group)."""
    started = time.monotonic()
    environment = {**os.environ, **env, "VKVAGENT_HOOK": name}
    try:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,  # its children are killed with it on a timeout
        )
    except OSError as exc:
        return HookResult(
            name, tuple(argv), None, time.monotonic() - started, "", f"cannot run: {exc}"
        )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        try:
            out, _ = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a child in a session of its own holds the pipe
            out = b""
        return HookResult(
            name,
            tuple(argv),
            None,
            time.monotonic() - started,
            _tail(out),
            f"still running after {timeout:g} s: killed",
        )
    seconds = time.monotonic() - started
    status = process.returncode
    if status == 0:
        problem = None
    elif status < 0:
        problem = f"killed by signal {-status}"
    else:
        problem = f"exited with status {status}"
    return HookResult(name, tuple(argv), status, seconds, _tail(out), problem)


def _tail(data: bytes) -> str:
    return data.decode("utf-8", "replace")[-OUTPUT_LIMIT:]
