"""What ``vkvagent status`` shows: the daemon's last view, kept in the state directory.

The daemon writes ``status.json`` (atomically) after every evaluation; ``vkvagent status``
reads it, so it answers while the daemon runs and after it stopped, without touching vLLM,
the GPU or D-Bus. The verdict maps onto Nagios-style exit codes: 0 healthy, 1 degraded or
acting, 2 escalated or critical, 3 unknown (no daemon, no data, or a stale file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from enum import IntEnum
from pathlib import Path
from typing import Any

FILE_NAME = "status.json"
VERSION = 1
STATES = ("healthy", "degraded", "acting", "escalated", "critical", "unknown")
CRITICAL_CAUSES = ("engine_down", "gpu_fault")
TREND_EVERY = 300.0  # seconds between two points of the trend
TREND_KEPT = 144  # 12 hours of them
SPARKS = "▁▂▃▄▅▆▇█"


class StatusCode(IntEnum):
    """``vkvagent status``'s exit codes (README, "Exit codes")."""

    HEALTHY = 0
    DEGRADED = 1  # or acting on it
    CRITICAL = 2  # escalated, vLLM down, a GPU fault
    UNKNOWN = 3  # no daemon, no data, or its last word is too old


def verdict_state(*, action: str, cause: str | None, reason: str, has_data: bool) -> str:
    """One word for a decision: what the exit code and the ``vkvagent_verdict`` metric say."""
    if reason.startswith("escalated"):
        return "escalated"
    if cause in CRITICAL_CAUSES:
        return "critical"
    if not has_data:
        return "unknown"
    if action == "restart":
        return "acting"
    if cause is not None:
        return "degraded"
    return "healthy"


def exit_code(status: Mapping[str, Any] | None, now: float) -> StatusCode:
    if status is None or is_stale(status, now):
        return StatusCode.UNKNOWN
    state = status["verdict"]["state"]
    if state in ("escalated", "critical"):
        return StatusCode.CRITICAL
    if state in ("degraded", "acting"):
        return StatusCode.DEGRADED
    if state == "healthy":
        return StatusCode.HEALTHY
    return StatusCode.UNKNOWN


def is_stale(status: Mapping[str, Any], now: float) -> bool:
    """The daemon has not written for three intervals (at least a minute), or, while it
    restarts vLLM, for longer than the restart may take: stopped or hung."""
    limit = max(60.0, 3 * float(status["interval"]), float(status.get("stale_after") or 0))
    return now - float(status["updated"]) > limit


def add_trend(
    trend: Sequence[Sequence[Any]], at: float, tokens_per_s: float | None, ratio: float | None
) -> list[list[Any]]:
    """The trend with a point for ``at`` when TREND_EVERY has passed since the last one."""
    points = [list(p) for p in trend]
    if tokens_per_s is not None and (not points or at - float(points[-1][0]) >= TREND_EVERY):
        points.append([round(at, 1), round(tokens_per_s, 2), ratio])
    return points[-TREND_KEPT:]


def path(state_dir: Path) -> Path:
    return state_dir / FILE_NAME


class StatusError(Exception):
    """status.json exists but cannot be read (permissions); one line."""


def read(state_dir: Path) -> dict[str, Any] | None:
    """The last status the daemon wrote; None when there is none (or it is damaged)."""
    try:
        data = json.loads(path(state_dir).read_text(encoding="utf-8"))
    except PermissionError:
        raise StatusError(
            f"{path(state_dir)}: permission denied (the state is readable by root and the "
            "vkvagent group)"
        ) from None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return None
    return data


def daemon_alive(status: Mapping[str, Any]) -> bool:
    """Whether the process that wrote the status still runs (same host, same PID space)."""
    try:
        os.kill(int(status["pid"]), 0)
    except PermissionError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


# -- for people -------------------------------------------------------------------------------


def sparkline(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return ""
    low, high = min(known), max(known)
    span = high - low or 1.0
    return "".join(
        " " if v is None else SPARKS[min(7, int((v - low) / span * 7.999))] for v in values
    )


def render(status: Mapping[str, Any] | None, now: float, *, explain: bool = False) -> str:
    if status is None:
        return "vkvagent: no status yet: the daemon has not run (or cannot write its state)\n"
    v, u, m = status["verdict"], status.get("unit") or {}, status.get("now") or {}
    lines = []
    age = now - float(status["updated"])
    head = f"vkvagent {status['agent_version']}: {v['state'].upper()}"
    if is_stale(status, now):
        alive = "running but silent" if daemon_alive(status) else "not running"
        head += f" (last update {_ago(age)} ago; daemon {alive})"
    lines.append(head)
    lines.append(f"  verdict     {v['action']}: {v['reason']}")
    if v.get("cause"):
        lines.append(f"  cause       {v['cause']}")
    unit = status["unit_name"]
    if u:
        lines.append(
            f"  unit        {unit} {u['active_state']} ({u['sub_state']}), pid {u['main_pid']}, "
            f"memory {_bytes(u.get('memory_bytes'))}, automatic restarts {u['n_restarts']}"
        )
    else:
        lines.append(f"  unit        {unit}: {status.get('unit_error') or 'state unknown'}")
    vllm = status.get("vllm") or {}
    lines.append(
        f"  vLLM        {vllm.get('version') or 'version unknown'}, metrics "
        f"{vllm.get('flavor') or '-'}, uptime {_duration(vllm.get('uptime_s'))}"
        + (f"; {vllm['error']}" if vllm.get("error") else "")
    )
    ratio = v.get("ratio")
    lines.append(
        f"  throughput  {_num(m.get('tokens_per_s'))} tokens/s, "
        f"{_num(m.get('requests_per_s'), 2)} requests/s; speed vs fresh baseline "
        + ("unknown" if ratio is None else f"{ratio:.2f}")
    )
    trend = status.get("trend") or []
    if trend:
        hours = (float(trend[-1][0]) - float(trend[0][0])) / 3600
        lines.append(
            f"  trend       {sparkline([p[1] for p in trend])}  tokens/s, last {hours:.1f} h"
        )
    lines.append(
        f"  load        running {_num(m.get('running'), 1)}, waiting {_num(m.get('waiting'), 1)}, "
        f"KV usage {_pct(m.get('kv_usage'))}, preemptions {_num(m.get('preemptions_per_s'), 2)}/s, "
        f"prefix cache hits {_pct(m.get('prefix_hit_ratio'))}"
    )
    lines.append(
        f"  latency     TTFT p50 {_ms(m.get('ttft_p50_s'))}, ITL p50 {_ms(m.get('itl_p50_s'))}"
    )
    probe = status.get("probe")
    if probe:
        lines.append(f"  probe       {probe_line(probe)}")
    for gpu in status.get("gpus") or []:
        throttled = ", ".join(gpu.get("throttled_by") or []) or "none"
        lines.append(
            f"  GPU {gpu['index']}       {_num(gpu.get('temperature_c'))} C, SM "
            f"{_num(gpu.get('sm_clock_mhz'))}/{_num(gpu.get('sm_clock_max_mhz'))} MHz, "
            f"throttled by: {throttled}"
        )
    policy = status["policy"]
    window = "open" if policy["window_open"] else f"closed, next {policy['next_window'] or 'none'}"
    lines.append(
        f"  policy      mode {policy['mode']}, window {window}, restarts left today "
        f"{policy['budget_left']}"
        + (f", paused until {policy['paused_until']}" if policy.get("paused_until") else "")
    )
    if status.get("fleet"):
        lines.append(f"  fleet       {fleet_line(status['fleet'])}")
    if status.get("progress"):
        lines.append(f"  restarting  {status['progress']}")
    last = status.get("last_restart")
    if last:
        judged = {True: "recovered", False: "did not recover", None: "not judged yet"}
        lines.append(
            f"  last action {last['kind']} {_iso(last['started'])} ({last['reason']}): "
            f"{last['outcome'] or 'in progress'}, {judged[last.get('recovered')]}"
        )
        if last.get("costs"):
            lines.append(f"              {costs_line(last['costs'])}")
        for hook in last.get("hooks") or ():
            if hook.get("problem"):
                lines.append(f"              {hook['name']} failed: {hook['problem']}")
    pending = status.get("pending_flags")
    if pending:
        lines.append(f"  flags       pending: {pending}")
    suggestion = v.get("suggestion") or {}
    if suggestion:
        shown = ", ".join(f"--{k} {val}" for k, val in suggestion.items())
        lines.append(f"  suggestion  {shown} (review, then set [vllm.flags])")
    if explain:
        lines.append("  evidence")
        for key, value in sorted((v.get("evidence") or {}).items()):
            lines.append(f"    {key:34} {value}")
    return "\n".join(lines) + "\n"


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


def probe_line(probe: Mapping[str, Any]) -> str:
    """The active probe: switched off, in flight, or how the last one went."""
    if not probe.get("enabled"):
        return "off"
    parts = []
    if probe.get("in_flight_s") is not None:
        parts.append(f"in flight for {_duration(probe['in_flight_s'])}")
    last = probe.get("last")
    if last:
        parts.append(
            f"last {last['outcome']} in {last['latency_s']:.2f} s at {_iso(last['time'])}"
            + (f" ({last['detail']})" if last.get("detail") else "")
        )
    elif probe.get("failing"):
        parts.append(f"cannot be sent: {probe['failing']}")
    else:
        parts.append("none sent yet (sent when no token moves for a while)")
    return "; ".join(parts)


def fleet_line(fleet: Mapping[str, Any]) -> str:
    """The group's slot holders and this host's state in it, in one line."""
    group, n = fleet["group"], fleet["max_concurrent"]
    if fleet["state"] == "unreachable":
        held = "held" if fleet["on_unreachable"] == "hold" else "held but for emergencies"
        return f"group {group}: etcd unreachable, restarts {held} ({fleet['error']})"
    holders = fleet.get("holders") or []
    shown = ", ".join(
        f"{h['host']} (slot {h['slot']}, since {_iso(h.get('since'))}, {h.get('cause') or '-'})"
        for h in holders
    )
    return (
        f"group {group}, {len(holders)} of {n} slots held" + (f": {shown}" if shown else "")
        + f"; this host ({fleet['host']}) {fleet['state']}"
    )  # fmt: skip


def _iso(at: float | None) -> str:
    if at is None:
        return "-"
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _ago(seconds: float) -> str:
    return _duration(seconds)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f} %"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"
