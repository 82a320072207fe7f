"""Whether this host should get traffic: the answer behind ``GET /ready``, for load balancers.

vLLM's own ``/health`` answers 200 while its engine is hung, so a load balancer that trusts it
keeps sending requests into a stall (85 minutes in one reported case). vkvagent knows more:
the progress of vLLM's counters and its probe, whether the unit is up, and its own restarts.
Not ready, with the reason, while vLLM:

- makes no progress with work pending (``verdict.stalled_s`` above 0: at the first sample
  without a token or engine step while requests run, wait, or a probe goes unanswered, long
  before ``stall_after`` names a stall; a busy vLLM moves its counters at every engine step,
  many times a second, so a whole sample interval without one is no busy server's pause);
- is down, loading, hung, crash-looping or unresponsive (its cause), or vetoed for a GPU fault;
- is being restarted or drained by vkvagent (the status says ``acting``), or vkvagent gave up
  on it (``escalated``);
- or when vkvagent's own status is missing or stale: it cannot vouch for vLLM.

Pure: the status in, the answer out; the exporter serves it.
"""

from __future__ import annotations

from typing import NamedTuple

from vkvagent.knowledge.status import CRITICAL_CAUSES, StatusReport, is_stale, stale_reason

# Causes under which vLLM serves nothing (the critical ones: down, dead, a hung start, a crash
# loop) or should not be sent more (a GPU fault; a stall or a hung API, an emergency).
NOT_SERVING = (*CRITICAL_CAUSES, "stall", "unresponsive")
# The daemon writes a status every sample interval: one this many intervals old means its
# loop stopped (a restart in progress excepted: ``stale_after``). Tighter than the status
# check's minute, which a person reads; a load balancer asks every second or two.
STALE_INTERVALS = 3


class Ready(NamedTuple):
    ready: bool
    reason: str  # one line


def readiness(report: StatusReport | None, now: float) -> Ready:
    """Whether vLLM should get traffic now, and why (not)."""
    if report is None:
        return Ready(False, "vkvagent has no status yet")
    if _stale(report, now):
        return Ready(False, f"vkvagent's status is {stale_reason(report, now)}")
    verdict = report.verdict
    if verdict.state == "acting":
        return Ready(False, f"vkvagent is restarting vLLM: {verdict.reason}")
    if verdict.state == "escalated":
        return Ready(False, f"escalated: {verdict.reason}")
    if verdict.cause in NOT_SERVING:
        return Ready(False, f"{verdict.cause}: {verdict.reason}")
    if verdict.stalled_s > 0:
        return Ready(False, f"no progress for {verdict.stalled_s:.0f} s with work pending (stall?)")
    if report.vllm.recognised is None:
        return Ready(False, f"vLLM does not answer /metrics: {report.vllm.error or 'no answer'}")
    return Ready(True, f"vLLM serves ({verdict.state})")


def _stale(report: StatusReport, now: float) -> bool:
    limit = max(STALE_INTERVALS * float(report.interval), float(report.stale_after or 0))
    return is_stale(report, now) or now - float(report.updated) > limit
