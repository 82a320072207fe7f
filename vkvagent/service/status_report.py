"""The tick's status report: ``status.StatusReport`` built from what the tick found.

``status.py`` owns the file's format and its rendering; this fills it in from the sample, the
engine's decision, the ledger's restarts, the probe, the fleet gate and what the other stages
worked out (the failing sources, the flags, the objectives), and keeps the trend, the
sparkline of the fresh speed `vkvagent status` draws (it holds no schema of its own).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import datetime, timezone

from vkvagent import __version__
from vkvagent.adapters import controls
from vkvagent.adapters.ledger import Action
from vkvagent.engine import Decision
from vkvagent.engine.policy import DAY, RestartRecord, window_state
from vkvagent.engine.rates import Rates, window_rates
from vkvagent.engine.samples import GpuReading, Sample, UnitFacts
from vkvagent.knowledge import status
from vkvagent.service.parts import Parts


class StatusReporter:
    """Builds each tick's report; keeps the trend (persisted in engine.json)."""

    def __init__(self, trend: tuple[status.TrendPoint, ...]) -> None:
        self.trend = trend

    def report(
        self,
        parts: Parts,
        sample: Sample,
        decision: Decision,
        restarts: tuple[RestartRecord, ...],
        *,
        first: Sample | None,
        failing: tuple[status.SourceFailure, ...],
        probe_failing: str,
        flags: status.FlagsStatus | None,
        slo: status.SloStatus | None,
        last_restart: status.LastRestart | None,
        events: Iterable[status.RecentEvent],
        stale_after: float | None = None,
    ) -> status.StatusReport:
        """The report of this tick; adds the trend's point when one is due. ``first``: the
        first sample kept (the rates are over the samples kept); ``events``: the recent
        events, read last (building the report may emit some: the fleet's)."""
        p = parts
        rates = _rates_since(first, sample)
        self.trend = status.add_trend(
            self.trend, sample.time, rates.tokens_per_s if rates else None, decision.ratio
        )
        wanting = decision.action == "restart" and p.actuator is not None
        group = None if p.fleet is None else p.fleet.report(wanting=wanting)
        m = sample.vllm
        interval = p.config.agent.sample_interval
        failed = tuple(f.source for f in status.failed_sources(failing, sample.time, interval))
        return status.StatusReport(
            updated=sample.time,
            pid=os.getpid(),
            pid_namespace=status.pid_namespace(),
            agent_version=__version__,
            interval=p.config.agent.sample_interval,
            unit_name=p.config.vllm.unit,
            unit=_unit_status(sample.unit),
            unit_error=sample.unit_error,
            vllm=status.VllmStatus(
                version=m.version if m else None,
                flavor=m.flavor if m else None,
                recognised=p.sampler.page_recognised,
                uptime_s=decision.uptime,
                error=sample.vllm_error,
            ),
            now=_load_now(sample, rates),
            gpus=tuple(_gpu_status(g) for g in sample.gpus),
            verdict=_verdict(sample, decision, failed),
            policy=_policy_status(p, sample, decision, restarts),
            last_restart=last_restart,
            probe=_probe_status(p, sample, decision, probe_failing),
            flags=flags,
            trend=self.trend,
            fleet=group,
            slo=slo,
            failing=failing,
            events=tuple(events),
            stale_after=stale_after,
        )


def last_restart(recent: list[Action] | None, judged: dict[int, bool]) -> status.LastRestart | None:
    """The ledger's latest action (``recent``: its latest actions, newest first; None: the
    ledger could not be read), with the engine's judgement of it."""
    if not recent:
        return None
    last = recent[0]
    hooks = last.detail.get("hooks")
    return status.LastRestart(
        kind=last.kind,
        reason=last.reason,
        started=last.started,
        id=last.id,
        ended=last.ended,
        outcome=last.outcome,
        recovered=judged.get(last.id),
        costs=last.detail.get("costs"),
        hooks=None if hooks is None else tuple(hooks),
    )


def status_line(report: status.StatusReport) -> str:
    """The report in one line, for systemd's STATUS=."""
    v = report.verdict
    ratio = "" if v.ratio is None else f", speed {v.ratio:.2f} of baseline"
    return f"{v.state}: {v.action} ({v.cause or 'no cause'}){ratio}"[:200]


def _policy_status(
    parts: Parts, sample: Sample, decision: Decision, restarts: tuple[RestartRecord, ...]
) -> status.PolicyStatus:
    pol, at = parts.settings.policy, sample.time
    is_open, upcoming = window_state(pol, decision.time)
    recent_restarts = sum(1 for r in restarts if r.age(at, sample.mono) < DAY and not r.aborted)
    paused_until = controls.read(parts.state_dir).paused_until
    return status.PolicyStatus(
        mode=pol.mode,
        window_open=is_open,
        budget_left=max(0, pol.max_per_day - recent_restarts),
        next_window=upcoming.isoformat() if upcoming else None,
        paused_until=_iso(paused_until) if paused_until and paused_until > at else None,
    )


def _probe_status(
    parts: Parts, sample: Sample, decision: Decision, failing: str
) -> status.ProbeStatus:
    in_flight = parts.prober.in_flight
    last = parts.prober.last
    return status.ProbeStatus(
        enabled=parts.config.probe.enabled,
        wanted=decision.probe_wanted,
        in_flight_s=None if in_flight is None else max(0.0, sample.mono - in_flight),
        last=None
        if last is None
        else status.LastProbe(last.time, last.outcome, last.latency, last.detail),
        failing=failing or None,
    )


def _rates_since(first: Sample | None, sample: Sample) -> Rates | None:
    """Rates over the samples kept: from the first to this one."""
    if first is None or first.vllm is None or sample.vllm is None or sample.mono <= first.mono:
        return None
    return window_rates([(first.mono, first.vllm), (sample.mono, sample.vllm)])


def _unit_status(unit: UnitFacts | None) -> status.UnitStatus | None:
    if unit is None:
        return None
    return status.UnitStatus(
        active_state=unit.active_state,
        sub_state=unit.sub_state,
        main_pid=unit.main_pid,
        n_restarts=unit.n_restarts,
        memory_bytes=unit.memory_bytes,
        restart_policy=unit.restart_policy,
        wanted=unit.wanted,
    )


def _load_now(sample: Sample, rates: Rates | None) -> status.LoadNow:
    m = sample.vllm
    return status.LoadNow(
        tokens_per_s=rates.tokens_per_s if rates else None,
        requests_per_s=rates.requests_per_s if rates else None,
        kv_usage=m.kv_cache_usage if m else None,
        preemptions_per_s=rates.preemptions_per_s if rates else None,
        prefix_hit_ratio=rates.prefix_cache_hit_ratio if rates else None,
        ttft_p50_s=rates.ttft_p50 if rates else None,
        itl_p50_s=rates.itl_p50 if rates else None,
        running=m.num_requests_running if m else None,
        waiting=m.num_requests_waiting if m else None,
    )


def _gpu_status(g: GpuReading) -> status.GpuStatus:
    return status.GpuStatus(
        index=g.index,
        temperature_c=g.temperature_c,
        sm_clock_mhz=g.sm_clock_mhz,
        sm_clock_max_mhz=g.sm_clock_max_mhz,
        clock_event_reasons=tuple(g.clock_event_reasons),
        throttled_by=tuple(g.throttled_by),
    )


def _verdict(sample: Sample, decision: Decision, failed: tuple[str, ...]) -> status.Verdict:
    state = status.verdict_state(
        action=decision.action,
        cause=decision.cause,
        reason=decision.reason,
        has_data=sample.vllm is not None or sample.unit is not None,
        failed=failed,
    )
    return status.Verdict(
        state=state,
        action=decision.action,
        reason=decision.reason,
        cause=decision.cause,
        ratio=decision.ratio,
        enter_ratio=decision.band[0] if decision.band else None,
        leave_ratio=decision.band[1] if decision.band else None,
        stalled_s=decision.stalled_s,
        evidence=dict(decision.evidence),
        suggestion=dict(decision.suggestion),
        reasons=dict(decision.suggestion_reasons),
    )


def _iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, timezone.utc).isoformat()
