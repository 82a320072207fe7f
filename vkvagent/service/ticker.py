"""The daemon's schedule: one job run at a fixed rate in a thread of its own.

A tick runs at once, then every ``interval`` seconds of the monotonic clock. A tick never
overlaps the one before, and ticks missed while one ran late collapse into one run at once:
the next sample should be taken now, not several in a row. A tick that raises is logged with
its traceback, and the next one runs on time. A new interval (a reload) counts from the start
of the last tick. ``stop()`` waits for the tick under way.

One interval job needs no job store, trigger or executor, and a scheduler library costs the
daemon 1.6 MiB of resident memory (bench/README.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class Ticker:
    def __init__(self, job: Callable[[], None], interval: float) -> None:
        self._job, self.interval = job, interval
        self._stopping = threading.Event()
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vkvagent-tick", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def reschedule(self, interval: float) -> None:
        self.interval = interval
        self._changed.set()

    def stop(self) -> None:
        """Stop, after the tick under way (if any) ends."""
        self._stopping.set()
        self._changed.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                self._job()
            except Exception:  # a bug in one tick must not end the schedule
                logging.getLogger(__name__).exception("tick failed")
            while not self._stopping.is_set():
                left = began + self.interval - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
                self._changed.clear()
