"""stop_process(): SIGTERM, then SIGKILL after the timeout, on real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from vkvagent.processes import stop_process


def child(code: str) -> subprocess.Popen[str]:
    """``code`` in a Python child that prints "ready" once it is set up."""
    process = subprocess.Popen(
        [sys.executable, "-c", f"{code}\nprint('ready', flush=True)\nimport time\ntime.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    process.stdout.close()  # it prints nothing more
    return process


def test_a_child_that_ends_on_sigterm_returns_minus_15_at_once() -> None:
    process = child("")
    began = time.monotonic()
    assert stop_process(process, timeout=30) == -signal.SIGTERM
    assert time.monotonic() - began < 5  # not the timeout


def test_a_child_that_handles_sigterm_returns_its_own_status() -> None:
    process = child("import signal, sys\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(3))")
    assert stop_process(process, timeout=30) == 3


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    process = child("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)")
    began = time.monotonic()
    assert stop_process(process, timeout=0.5) == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - began < 5


def test_a_child_that_already_exited_is_no_error() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    process.wait()
    assert stop_process(process) == 4
    assert stop_process(process) == 4  # twice is no error either


def test_a_child_that_exited_unreaped_is_not_signalled() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert process.returncode is None  # a zombie that Popen has not seen end yet
    assert stop_process(process, timeout=0.5) == 0


def test_a_child_reaped_behind_popens_back_is_no_error() -> None:
    process = child("")
    os.kill(process.pid, signal.SIGKILL)
    os.waitpid(process.pid, 0)  # its pid is gone: kill() would raise ProcessLookupError
    assert stop_process(process, timeout=0.5) == 0  # Popen's status for a child it cannot wait for
