"""``vkvagent status`` as a monitoring plugin (Nagios, Icinga): thresholds, exit code, first line.

The monitoring-plugin guidelines' parts, over a status document: a threshold ``Range`` on the
speed ratio (``-w``/``-c``), the exit code with the thresholds applied (``checked``), the
performance data for graphs (``perfdata``), and the one line a plugin prints (``headline``),
which Nagios keeps. ``status`` holds the document and its own exit code; this applies the
operator's thresholds to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vkvagent import __version__
from vkvagent.knowledge.status import (
    NO_STATUS,
    StatusCode,
    StatusError,
    StatusReport,
    exit_code,
    failed_sources,
    is_stale,
    stale_reason,
)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Range:
    """A threshold in the monitoring-plugins' range syntax: ``[@]start:end``, ``~`` for no
    start, no end for none. It alerts outside start..end (inside, with ``@``)."""

    text: str
    start: float
    end: float
    inside: bool = False

    @classmethod
    def parse(cls, text: str) -> Range:
        """StatusError for anything else, and for a bare number: the guidelines read ``0.8`` as
        0..0.8, alerting on a speed ratio above 0.8, never what a speed threshold means."""
        body = text[1:] if text.startswith("@") else text
        expected = f"threshold {text!r}: expected [@]start:end (e.g. 0.8: alerts below 0.8)"
        if ":" not in body and _number(body):
            raise StatusError(
                f"threshold {text!r}: a bare number is the range 0..{body} (an alert above it);"
                f" for an alert below it, write {body}:"
            )
        start, colon, end = body.partition(":")
        if not colon:
            raise StatusError(expected)
        try:
            low = -math.inf if start == "~" else float(start or 0)
            high = math.inf if end == "" else float(end)
        except ValueError:
            raise StatusError(expected) from None
        if low > high or math.isnan(low) or math.isnan(high):
            raise StatusError(f"threshold {text!r}: its start is above its end")
        return cls(text, low, high, inside=text.startswith("@"))

    def alerts(self, value: float) -> bool:
        within = self.start <= value <= self.end
        return within if self.inside else not within


def checked(
    status: StatusReport | None,
    now: float,
    warning: Range | None = None,
    critical: Range | None = None,
) -> tuple[StatusCode, str]:
    """The exit code with the thresholds on the speed ratio applied, and an objective's budget
    burning fast (a warning: the page-worthy alert of the SRE workbook, while the verdict's own
    critical states stay vLLM down, a GPU fault or escalation), and what raised it in words
    ("" when nothing did). An unknown ratio, or status, meets no threshold."""
    code = exit_code(status, now)
    if status is None or code == StatusCode.UNKNOWN:
        return code, ""
    ratio = status.verdict.ratio
    for limit, name, level in (
        (critical, "critical", StatusCode.CRITICAL),
        (warning, "warning", StatusCode.DEGRADED),
    ):
        if ratio is not None and limit is not None and limit.alerts(ratio) and level > code:
            return level, f"speed ratio {ratio:.2f} outside the {name} range {limit.text}"
    burning = [] if status.slo is None else status.slo.fast()
    if burning and code < StatusCode.DEGRADED:
        return StatusCode.DEGRADED, f"{', '.join(burning)} error budget burning fast"
    return code, ""


def perfdata(
    status: StatusReport, warning: Range | None = None, critical: Range | None = None
) -> str:
    """Performance data as the plugin guidelines write it, ``'label'=value[UOM];[warn];
    [crit];[min];[max]`` (U: not known), for graphs: speed ratio, KV usage, throughput
    (generated tokens/s) and restarts left today; with [slo], each objective's attainment
    over the period and its budget left (below 0 when overspent)."""
    v, m = status.verdict, status.now

    def value(x: float | None, digits: int) -> str:
        return "U" if x is None else f"{x:.{digits}f}"

    def percent(x: float | None, digits: int) -> str:
        return "U" if x is None else f"{x * 100:.{digits}f}%"  # U takes no unit

    limits = ";".join(r.text if r else "" for r in (warning, critical))
    data = (
        f"speed_ratio={value(v.ratio, 3)};{limits};0 kv_usage={percent(m.kv_usage, 1)};;;0;100 "
        f"throughput={value(m.tokens_per_s, 1)};;;0 restarts_left={status.policy.budget_left};;;0"
    )
    for o in status.slo.objectives if status.slo is not None else ():
        data += (
            f" slo_{o.objective}={percent(o.attainment.get('period'), 3)};;;0;100"
            f" slo_{o.objective}_budget={percent(o.budget_remaining, 1)};;;;100"
        )
    return data


def headline(
    status: StatusReport | None,
    now: float,
    warning: Range | None = None,
    critical: Range | None = None,
    *,
    reason: str = NO_STATUS,
) -> str:
    """The first line, on stdout in every state (a monitoring plugin's output): the state in
    one word and, when the status is current, its performance data after ``|``."""
    if status is None:
        return f"vkvagent {__version__}: UNKNOWN - {reason}"
    version = status.agent_version
    if is_stale(status, now):
        return f"vkvagent {version}: UNKNOWN ({stale_reason(status, now)})"
    code, why = checked(status, now, warning, critical)
    state = status.verdict.state.upper()
    if why:
        word = "CRITICAL" if code == StatusCode.CRITICAL else "WARNING"
        state = f"{word} - {why} (verdict {state})"
    failed = failed_sources(status.failing, float(status.updated), float(status.interval))
    if failed and status.verdict.state == "impaired":
        state += f" ({', '.join(f.source for f in failed)} failing)"
    return f"vkvagent {version}: {state} | {perfdata(status, warning, critical)}"
