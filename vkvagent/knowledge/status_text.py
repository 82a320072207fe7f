"""What ``vkvagent status`` prints for people: the headline, then a line per part.

Each part of the status document has its line (``probe_line``, ``fleet_line``,
``costs_line``, ...), which other commands and the daemon's journal reuse; ``render`` puts
them together beneath the monitoring plugin's first line (``status_check.headline``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from vkvagent.engine.liveness import RESTARTS_AFTER_CLEAN_EXIT
from vkvagent.knowledge.flags import shown
from vkvagent.knowledge.status import (
    NO_STATUS,
    FlagsStatus,
    FleetStatus,
    ProbeStatus,
    SloObjective,
    SloStatus,
    StatusReport,
    duration,
    is_stale,
)
from vkvagent.knowledge.status_check import Range, headline

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return ""
    low, high = min(known), max(known)
    span = high - low or 1.0
    return "".join(
        " " if v is None else SPARKS[min(7, int((v - low) / span * 7.999))] for v in values
    )


def unit_warning(
    unit: str, restart_policy: str, wanted: bool | None, mode: str, file_state: str = ""
) -> str:
    """One line on a unit that would stay down after vLLM exits with status 0, as vLLM 0.32
    does when its engine dies, or that nothing wants ("" when neither): what happens, who
    starts it again, and what to do. ``restart_policy`` is its Restart= ("": unknown);
    ``wanted`` as ``UnitStatus.wanted`` (None: unknown); ``mode`` the policy's, which decides
    whether vkvagent starts a wanted unit that died ("": unknown); ``file_state`` its
    UnitFileState where known (``config check``), for the right command. For ``config check``
    and ``vkvagent status``; it changes no exit code."""
    if file_state in ("masked", "masked-runtime"):
        return (
            f"{unit} is masked: neither systemd nor vkvagent can start it "
            f"(systemctl unmask {unit}, then systemctl enable {unit})"
        )
    exits = "vLLM exits 0 when its engine dies (vLLM 0.32 does)"
    leaves = bool(restart_policy) and restart_policy not in RESTARTS_AFTER_CLEAN_EXIT
    if wanted is False:
        if file_state == "static":
            nobody = f"{unit} has no [Install] section and no unit wants it"
            enable = f"add WantedBy=multi-user.target under [Install], then systemctl enable {unit}"
        elif file_state:
            nobody = f"{unit} is not enabled and no unit wants it"
            enable = f"systemctl enable {unit}"
        else:  # status.json has no UnitFileState: masked reads as not wanted too
            nobody = f"{unit} is not enabled, or masked, and no unit wants it"
            enable = f"systemctl enable {unit} (unmask it first if masked)"
        if leaves:
            return (
                f"{nobody}, and it has Restart={restart_policy}: {exits}, and then neither "
                f"systemd nor vkvagent starts it again; set Restart=always, and {enable}"
            )
        return (
            f"{nobody}: it does not start at boot, and vkvagent does not start it when it is "
            f"down; {enable}"
        )
    if not leaves:
        return ""
    left = f"{unit} has Restart={restart_policy}: {exits}, and systemd then leaves it down"
    if mode == "enforce":
        return (
            f"{left}; vkvagent starts it again within a sample interval (enforce mode, "
            "max_per_day allowing), but set Restart=always to have systemd do it at once"
        )
    if mode:
        return f"{left}, and vkvagent in {mode} mode does not start it: set Restart=always"
    return f"{left}: set Restart=always"


# What each source's failure takes from the agent, in words.
_LOST = {
    "vllm": "nothing can be judged",
    "gpu": "no GPU-fault veto",
    "systemd": "no restart can happen",
}


def render(
    status: StatusReport | None,
    now: float,
    *,
    explain: bool = False,
    warning: Range | None = None,
    critical: Range | None = None,
    reason: str = NO_STATUS,
) -> str:
    """``vkvagent status``: the headline (``headline``), then the figures behind it."""
    first = headline(status, now, warning, critical, reason=reason)
    if status is None:
        return first + "\n"
    v, u, m = status.verdict, status.unit, status.now
    lines = [first]
    if is_stale(status, now):
        # The headline says what the exit code says; the last verdict is history, beneath it.
        lines.append(f"  last state  {v.state.upper()} at {_iso(float(status.updated))}")
    lines.append(f"  verdict     {v.action}: {v.reason}")
    if v.cause:
        lines.append(f"  cause       {v.cause}")
    for failure in status.failing:
        lost = _LOST.get(failure.source, "")
        lines.append(
            f"  failing     {failure.source} for "
            f"{duration(failure.failed_for(float(status.updated)))}: {failure.error}"
            + (f" ({lost})" if lost else "")
        )
    unit = status.unit_name
    if u is not None:
        lines.append(
            f"  unit        {unit} {u.active_state} ({u.sub_state}), pid {u.main_pid}, "
            f"memory {_bytes(u.memory_bytes)}, automatic restarts {u.n_restarts}"
        )
        left_down = unit_warning(unit, u.restart_policy, u.wanted, status.policy.mode)
        if left_down:
            lines.append(f"  warning     {left_down}")
    else:
        lines.append(f"  unit        {unit}: {status.unit_error or 'state unknown'}")
    vllm = status.vllm
    lines.append(
        f"  vLLM        {vllm.version or 'version unknown'}, metrics "
        f"{vllm.flavor or '-'}, uptime {duration(vllm.uptime_s)}"
        + (f"; {vllm.error}" if vllm.error else "")
    )
    ratio = v.ratio
    lines.append(
        f"  throughput  {_num(m.tokens_per_s)} tokens/s, "
        f"{_num(m.requests_per_s, 2)} requests/s; speed vs fresh baseline "
        + ("unknown" if ratio is None else f"{ratio:.2f}")
        + (
            f" (slow below {v.enter_ratio:.2f}, back above {v.leave_ratio:.2f})"
            if ratio is not None and v.enter_ratio is not None and v.leave_ratio is not None
            else ""
        )
    )
    trend = status.trend
    if trend:
        hours = (float(trend[-1].at) - float(trend[0].at)) / 3600
        lines.append(
            f"  trend       {sparkline([p.tokens_per_s for p in trend])}  tokens/s, "
            f"last {hours:.1f} h"
        )
    lines.append(
        f"  load        running {_num(m.running, 1)}, waiting {_num(m.waiting, 1)}, "
        f"KV usage {_pct(m.kv_usage)}, preemptions {_num(m.preemptions_per_s, 2)}/s, "
        f"prefix cache hits {_pct(m.prefix_hit_ratio)}"
    )
    lines.append(f"  latency     TTFT p50 {_ms(m.ttft_p50_s)}, ITL p50 {_ms(m.itl_p50_s)}")
    if status.slo is not None:
        lines.extend(slo_lines(status.slo, explain=explain))
    if status.probe is not None:
        lines.append(f"  probe       {probe_line(status.probe)}")
    for gpu in status.gpus:
        throttled = ", ".join(gpu.throttled_by) or "none"
        lines.append(
            f"  GPU {gpu.index}       {_num(gpu.temperature_c)} C, SM "
            f"{_num(gpu.sm_clock_mhz)}/{_num(gpu.sm_clock_max_mhz)} MHz, "
            f"throttled by: {throttled}"
        )
    policy = status.policy
    window = "open" if policy.window_open else f"closed, next {policy.next_window or 'none'}"
    lines.append(
        f"  policy      mode {policy.mode}, window {window}, restarts left today "
        f"{policy.budget_left}"
        + (f", paused until {policy.paused_until}" if policy.paused_until else "")
    )
    if status.fleet is not None:
        lines.append(f"  fleet       {fleet_line(status.fleet)}")
    if status.progress:
        lines.append(f"  restarting  {status.progress}")
    last = status.last_restart
    if last is not None:
        judged = {True: "recovered", False: "did not recover", None: "not judged yet"}
        lines.append(
            f"  last action {last.kind} {_iso(last.started)} ({last.reason}): "
            f"{last.outcome or 'in progress'}, {judged[last.recovered]}"
        )
        if last.costs:
            lines.append(f"              {costs_line(last.costs)}")
        for hook in last.hooks or ():
            if hook.get("problem"):
                lines.append(f"              {hook['name']} failed: {hook['problem']}")
    if status.flags is not None:
        lines.extend(flags_lines(status.flags))
    if v.suggestion:
        lines.append(
            f"  suggestion  {shown(v.suggestion)} "
            "(review it as a change: vkvagent plan --suggested)"
        )
    if explain:
        lines.append("  evidence")
        for key, value in sorted(v.evidence.items()):
            lines.append(f"    {key:34} {value}")
    if status.events:
        lines.append("")
        lines += [f"{_iso(e.time)} {e.event}: {e.message}" for e in status.events]
    return "\n".join(lines) + "\n"


def flags_lines(flags: FlagsStatus) -> list[str]:
    """[vllm.flags] against the unit, and the verdict on the last change."""
    lines = []
    running = shown({k: v for k, v in (flags.running or {}).items() if v is not None})
    if flags.problem:
        lines.append(f"  flags       {flags.problem}")
    elif flags.pending and not flags.due:
        lines.append(f"  flags       pending: {shown(flags.pending)} (running {running})")
    elif flags.desired and not flags.due:
        lines.append(f"  flags       in effect: {shown(flags.desired)}")
    if flags.due:
        lines.append(
            f"  flags       due: {flags.due} (running {running}); waiting for {flags.waiting_for}"
        )
    last = flags.last_change
    if last is not None:
        speed = ""
        if last.ratio is not None:
            speed = (
                f": {last.ratio:.2f} of the previous fresh speed ({last.speed_before:.4g} -> "
                f"{last.speed_after:.4g} tokens/s per request at {', '.join(last.loads)})"
            )
        rollback = f"; rolled back: {last.rollback}" if last.rollback else ""
        lines.append(
            f"  last change action {last.action} {shown(last.flags)}: "
            f"{last.verdict}{speed}{rollback}"
        )
    return lines


def slo_lines(slo: SloStatus, *, explain: bool = False) -> list[str]:
    """A line per objective; explained, with its burn rates beneath."""
    lines = []
    for objective in slo.objectives:
        lines.append(f"  slo         {slo_line(objective, slo.period_days)}")
        if explain:
            lines.append(
                f"              burn rate {burn_words(objective.burn_rates)} (1: the budget "
                f"lasts exactly {slo.period_days:g} d)"
            )
    return lines


def slo_line(objective: SloObjective, period_days: float) -> str:
    """An objective's attainment over the last hour, day and period, and its budget left:
    "95 % of requests' first token within 2 s: 97.1 % (1 h), 96.4 % (1 d), 96.0 % (28 d);
    budget left 20 %; burning fast"."""
    shares = objective.attainment
    if objective.budget_remaining is None and not any(v is not None for v in shares.values()):
        return f"{objective.words}: nothing counted yet"
    # Enough digits to tell the target from a miss (99.95 % for 99.9 %, 96.4 % for 95 %),
    # rounded down: 99.996 % is not 100 %.
    digits = max(1, 1 - math.floor(math.log10(max(1e-6, (1 - objective.target) * 100))))

    def share(window: str) -> str:
        value, scale = shares.get(window), 10 ** (digits + 2)
        return _pct(None if value is None else math.floor(value * scale + 1e-6) / scale, digits)

    figures = ", ".join(
        f"{share(window)} ({label})"
        for window, label in (("1h", "1 h"), ("1d", "1 d"), ("period", f"{period_days:g} d"))
    )
    burning = f"; burning {objective.burning}" if objective.burning else ""
    return f"{objective.words}: {figures}; {budget_words(objective.budget_remaining)}{burning}"


def budget_words(left: float | None) -> str:
    """An objective's budget left: "budget left 20 %", "budget left -35 % (overspent)"."""
    return f"budget left {_pct(left)}" + (" (overspent)" if left is not None and left < 0 else "")


def burn_words(rates: Mapping[str, Any]) -> str:
    """Burn rates by window: "5m 25.0, 30m 12.0, 1h 20.1, 6h 3.3" (1: the budget spent in
    exactly one period)."""
    return ", ".join(f"{window} {_num(rate, 1)}" for window, rate in rates.items())


def costs_line(costs: Mapping[str, Any]) -> str:
    """What the last restart cost the clients (``actuator.Costs`` as the ledger keeps it)."""
    how = {
        "vllm": "drained by vLLM",
        "quiet": "waited for a quiet moment",
        "busy": "no quiet moment came",
        "none": "not drained",
    }.get(costs.get("drain_mode", ""), "drain unknown")
    if costs.get("drain_seconds") is not None:
        how += f" in {costs['drain_seconds']:.1f} s"
    parts = [how]
    if costs.get("aborted") is not None and costs.get("in_flight") is not None:
        parts.append(f"{costs['aborted']:.0f} of {costs['in_flight']:.0f} in flight cut off")
    if costs.get("down_seconds") is not None:
        down = f"down {costs['down_seconds']:.1f} s"
        if costs.get("missed") is not None:
            down += f" (about {costs['missed']:.0f} requests turned away)"
        parts.append(down)
    return ", ".join(parts)


def probe_line(probe: ProbeStatus) -> str:
    """The active probe: switched off, in flight, or how the last one went."""
    if not probe.enabled:
        return "off"
    parts = []
    if probe.in_flight_s is not None:
        parts.append(f"in flight for {duration(probe.in_flight_s)}")
    last = probe.last
    if last is not None:
        parts.append(
            f"last {last.outcome} in {last.latency_s:.2f} s at {_iso(last.time)}"
            + (f" ({last.detail})" if last.detail else "")
        )
    elif probe.failing:
        parts.append(f"cannot be sent: {probe.failing}")
    else:
        parts.append("none sent yet (sent when no token moves for a while)")
    return "; ".join(parts)


def fleet_line(fleet: FleetStatus) -> str:
    """The group's slot holders and this host's state in it, in one line."""
    group, n = fleet.group, fleet.max_concurrent
    if fleet.state == "unreachable":
        held = "held" if fleet.on_unreachable == "hold" else "held but for emergencies"
        return f"group {group}: etcd unreachable, restarts {held} ({fleet.error})"
    holders = fleet.holders
    shown = ", ".join(
        f"{h.host} (slot {h.slot}, since {_iso(h.since)}, {h.cause or '-'})" for h in holders
    )
    return (
        f"group {group}, {len(holders)} of {n} slots held" + (f": {shown}" if shown else "")
        + f"; this host ({fleet.host}) {fleet.state}"
    )  # fmt: skip


def _iso(at: float | None) -> str:
    if at is None:
        return "-"
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 100:.{digits}f} %"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"
