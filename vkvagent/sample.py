"""One observation of the server: vLLM's metrics and the GPUs at one moment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vkvagent.gpu import GpuReading
from vkvagent.metrics import VllmMetrics


@dataclass(frozen=True)
class Sample:
    """What the agent saw at ``time``. A source that failed leaves its value None and says why
    in its ``*_error`` field; the sample is still recorded, marked invalid, never dropped."""

    time: float  # UTC, Unix seconds: when it was taken, for people and retention
    mono: float  # monotonic seconds at the same moment: the only clock rates are computed on
    vllm: VllmMetrics | None
    vllm_error: str | None = None
    gpus: tuple[GpuReading, ...] = ()
    gpu_error: str | None = None

    @property
    def valid(self) -> bool:
        return self.vllm is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "valid": self.valid,
            "vllm": self.vllm.to_json() if self.vllm else None,
            "vllm_error": self.vllm_error,
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "gpu_error": self.gpu_error,
        }
