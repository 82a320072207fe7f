"""What a caller keeps between calls: the recent samples and the unit's memory points.

``decide`` keeps nothing between calls but its state; the samples it judges and the memory
series behind ``host_memory_growth`` are the caller's. ``Recent`` keeps them the one way the
daemon and replay share, so both feed the engine alike: the trailing baseline window of
samples (plus a margin), and one memory point a minute for 50 hours.
"""

from __future__ import annotations

from collections import deque

from vkvagent.engine.baseline import BaselineSettings
from vkvagent.engine.memory import MemoryPoint
from vkvagent.engine.samples import Sample

MEMORY_EVERY = 60.0  # seconds between two memory points
MEMORY_KEPT = 3000  # memory points kept (50 hours at one a minute)


class Recent:
    """The samples and memory points a caller keeps for ``decide``: the trailing baseline
    window of samples (plus a margin) and one memory point a minute. Shared by the daemon and
    replay, so both feed the engine the same way."""

    def __init__(self, settings: BaselineSettings, margin: float) -> None:
        self.keep = settings.window + margin
        self.samples: deque[Sample] = deque()
        self.memory: list[MemoryPoint] = []
        self.memory_source = ""

    def add(self, sample: Sample, memory_bytes: float | None, memory_source: str = "") -> None:
        """Add a sample, with the unit's memory at that moment when known. ``memory_source``
        names what the memory is (``anon``, ``MemoryCurrent``): a series changing source
        starts again, or the switch would read as growth."""
        if self.samples and sample.mono < self.samples[-1].mono:
            self.samples.clear()  # the monotonic clock began again: the host rebooted
        self.samples.append(sample)
        while sample.mono - self.samples[0].mono > self.keep:
            self.samples.popleft()
        served = sample.vllm.request_success_total if sample.vllm is not None else None
        if memory_bytes is None or served is None:
            return
        if memory_source != self.memory_source:
            self.memory_source, self.memory = memory_source, []
        if not self.memory or sample.mono - self.memory[-1].mono >= MEMORY_EVERY:
            self.memory.append(MemoryPoint(sample.mono, memory_bytes, served))
            if len(self.memory) > MEMORY_KEPT:
                del self.memory[: len(self.memory) - MEMORY_KEPT]
