"""The daemon's schedule: one job run at a fixed rate in a thread of its own.

A tick runs at once, then at every ``interval`` seconds of the monotonic clock after the
first. A tick never overlaps the one before: the points that pass while a tick runs late are
skipped, and the next tick runs at the next point. A tick that raises is logged with its
traceback, and the next one runs on time. A new interval (a reload) counts from the moment
it is set. ``stop()`` waits for the tick under way. (This is the interval job the daemon ran
before with a scheduler library: ``max_instances=1``, ``coalesce=True``.)

One interval job needs no job store, trigger or executor, and a scheduler library cost the
daemon 1.6 MiB of resident memory (docs/development.md).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable


class Ticker:
    def __init__(self, job: Callable[[], None], interval: float) -> None:
        self._job, self._interval = job, interval
        self._lock = threading.Lock()
        self._next = 0.0  # the next point on the monotonic clock
        self._stopping = threading.Event()
        self._changed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vkvagent-tick", daemon=True)

    def start(self) -> None:
        self._next = time.monotonic()
        self._thread.start()

    def reschedule(self, interval: float) -> None:
        with self._lock:
            self._interval = interval
            self._next = time.monotonic() + interval
        self._changed.set()

    def stop(self) -> None:
        """Stop, after the tick under way (if any) ends."""
        self._stopping.set()
        self._changed.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._changed.clear()
            with self._lock:
                left = self._next - time.monotonic()
            if left > 0:
                self._changed.wait(left)  # woken early by a reschedule or stop
                continue
            try:
                self._job()
            except BaseException:  # a bug in one tick must not end the schedule
                logging.getLogger(__name__).exception("tick failed")
            with self._lock:
                now = time.monotonic()
                if self._next <= now:  # else a reschedule during the tick set the next point
                    self._next += (
                        math.floor((now - self._next) / self._interval) + 1
                    ) * self._interval
