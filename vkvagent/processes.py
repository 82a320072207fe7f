"""Stopping a child process: SIGTERM, a grace period, then SIGKILL.

The demo, the benchmarks and the tests start helpers of their own (the simulator, etcd,
Prometheus, a scraper) and must not leave them behind. The agent itself starts
no process to stop: systemd stops vLLM, and ``hooks.py`` kills a hook's process group on a
timeout with its own output handling.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from typing import Any

STOP_TIMEOUT = 10.0  # seconds a child has to exit on SIGTERM before it is SIGKILLed


def stop_process(process: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> int:
    """Stop ``process`` and return its exit status (negative: the signal that ended it).

    SIGTERM first, because it is the signal a program ends cleanly on: the simulator drains
    and exits 0, etcd and Prometheus close their stores, a Python child runs its ``finally``
    blocks (the benchmark's scraper prints its count there). SIGKILL after ``timeout``
    seconds, because a child that ignores SIGTERM, hangs, or drains for longer must still not
    outlive whatever started it; after SIGKILL the wait is unbounded, as nothing can delay
    that exit but the kernel.

    A process that has already exited is not signalled and its status is returned; one that
    exits between the check and the signal is no error either (ProcessLookupError is ignored).
    Only ``wait()`` is used: a caller that reads the child's pipes reads them afterwards, so
    one that keeps stderr for its error message still has it.
    """
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        return process.wait()
