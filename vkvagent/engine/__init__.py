"""The decision engine: pure functions over values, no clock, no I/O.

``decide(settings, state, observation, now) -> Decision`` is one tick: the baseline
(``baseline``), the diagnosis (``diagnosis``) and the policy (``policy``) over windows of
samples (``rates``). The values it reads (``samples``) and the GPU fault table
(``gpu_faults``) import nothing of vkvagent. Nothing in this package imports an adapter: the
daemon, replay, the demo and the benchmark feed it the same way, and tests/test_layers.py
keeps it so.
"""

from vkvagent.engine.baseline import BaselineSettings, SpeedChange, speed_change
from vkvagent.engine.diagnosis import (
    CAUSES,
    FIXABLE,
    VETOED,
    DiagnosisSettings,
    MemoryPoint,
    ProbeFacts,
)
from vkvagent.engine.policy import Controls, PolicySettings, RestartRecord, TrafficProfile
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
    Recent,
    RunState,
    Settings,
    decide,
    server_identity,
)

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
