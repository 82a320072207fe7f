"""GPU vetoes: what the GPUs did that explains a symptom a restart of vLLM cannot fix.

A throttled GPU (its SM clock below the fresh server's at this load) slows the server as a
degraded one would, and a faulty one (hardware, driver or unknown XIDs, uncorrectable ECC
errors; ``engine.gpu_faults``) is not repaired by a restart. Both show in some samples only
(an XID is reported once), so the latest of each is kept in the diagnosis state, and vetoes
for as long as it can explain a held symptom (``gpu_throttle``, ``gpu_fault``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from vkvagent.engine.gpu_faults import describe_xid, is_fault
from vkvagent.engine.samples import GpuReading

if TYPE_CHECKING:  # diagnosis imports this module: its settings and state are types here
    from vkvagent.engine.diagnosis import DiagnosisSettings, DiagnosisState


def remember(
    s: DiagnosisSettings,
    state: DiagnosisState,
    gpus: Sequence[tuple[GpuReading, ...]],
    fresh_clock: float | None,
    now: float,
) -> DiagnosisState:
    """Throttling and faults are seen in some samples only (an XID is reported once); keep
    the latest of each, so it vetoes for as long as it can explain a held symptom. Only
    hardware, driver and unknown XIDs are faults: an application one is what a restart fixes
    (``engine.gpu_faults.XIDS``)."""
    throttled: list[str] = []
    faults: list[str] = []
    for readings in gpus:
        for gpu in readings:
            if is_throttled(s, gpu, fresh_clock):
                throttled.append(
                    f"GPU {gpu.index} {'+'.join(gpu.throttled_by)}, SM clock "
                    f"{gpu.sm_clock_mhz:.0f}/{gpu.sm_clock_max_mhz:.0f} MHz"
                )
            faults.extend(
                f"GPU {gpu.index} {describe_xid(xid)}" for xid in gpu.xid_errors if is_fault(xid)
            )
            if gpu.ecc_uncorrected_volatile:
                faults.append(
                    f"GPU {gpu.index} {gpu.ecc_uncorrected_volatile} uncorrectable ECC errors"
                )
    if throttled:
        state = replace(state, throttled_at=now, throttle_note=throttled[-1])
    if faults:
        state = replace(state, fault_at=now, fault_note="; ".join(dict.fromkeys(faults)))
    return state


def is_throttled(s: DiagnosisSettings, gpu: GpuReading, fresh_clock: float | None) -> bool:
    """Slowed against the workload's will, and by more than the fresh server was at this
    load (``fresh_clock``: its SM clock / maximum, when known).

    A busy GPU at its power cap runs far below its maximum clock all day (an H200 under a
    full load: 1425 of 1980 MHz at 700 W, recorded in tests/fixtures/gpu), so the power cap
    counts only against the fresh server's clock: alone, it neither explains a slowdown nor
    stops a baseline from being learned. Heat and hardware slowdowns count against the
    maximum clock until the fresh one is known."""
    clock, top = gpu.sm_clock_mhz, gpu.sm_clock_max_mhz
    if not gpu.throttled_by or clock is None or not top:
        return False
    if fresh_clock is None and gpu.throttled_by == ("sw_power_cap",):
        return False
    reference = 1.0 if fresh_clock is None else min(1.0, fresh_clock)
    return clock / top < reference * (1 - s.throttle_clock_drop)


def throttle(s: DiagnosisSettings, state: DiagnosisState, now: float) -> str:
    """The throttling that can still explain a symptom held for ``hold``, or ""."""
    if state.throttled_at is not None and now - state.throttled_at <= s.hold:
        return state.throttle_note
    return ""
