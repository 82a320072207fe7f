"""The decision engine: pure functions over values, no clock, no I/O.

``decide(settings, state, observation, now) -> Decision`` is one tick (``tick``): the
baseline (``baseline``, carried from run to run: ``carry``), the diagnosis (``diagnosis``,
from its held symptoms: ``hysteresis``, ``progress``, ``kv``, ``memory``, ``engines``,
``gpu_vetoes``) and the policy (``policy``, with this host's ``traffic`` and its ``slo``) over
windows of samples (``rates``) a caller keeps (``recent``). The values it reads (``samples``)
and the GPU fault table (``gpu_faults``) import nothing of vkvagent. Nothing in this package
imports an adapter: the daemon, replay, the demo and the benchmark feed it the same way, and
tests/test_layers.py keeps it so.
"""

from vkvagent.engine.baseline import BaselineSettings, SpeedChange, speed_change
from vkvagent.engine.carry import server_identity
from vkvagent.engine.diagnosis import CAUSES, FIXABLE, VETOED, DiagnosisSettings
from vkvagent.engine.memory import MemoryPoint
from vkvagent.engine.policy import Controls, PolicySettings, RestartRecord
from vkvagent.engine.progress import ProbeFacts
from vkvagent.engine.recent import Recent
from vkvagent.engine.samples import (
    EngineSignals,
    FlagValue,
    GpuReading,
    Histogram,
    Sample,
    UnitFacts,
    VllmMetrics,
)
from vkvagent.engine.tick import (
    ACTIONS,
    Decision,
    EngineState,
    Observation,
    RunState,
    Settings,
    decide,
)
from vkvagent.engine.traffic import TrafficProfile

__all__ = [
    "ACTIONS",
    "CAUSES",
    "FIXABLE",
    "VETOED",
    "BaselineSettings",
    "Controls",
    "Decision",
    "DiagnosisSettings",
    "EngineSignals",
    "EngineState",
    "FlagValue",
    "GpuReading",
    "Histogram",
    "MemoryPoint",
    "Observation",
    "PolicySettings",
    "ProbeFacts",
    "Recent",
    "RestartRecord",
    "RunState",
    "Sample",
    "Settings",
    "SpeedChange",
    "TrafficProfile",
    "UnitFacts",
    "VllmMetrics",
    "decide",
    "server_identity",
    "speed_change",
]
