"""What the daemon notices in each sample and probe, and says once: the watches.

The sampler and the prober (``sampler.py``, ``probe.py``) read; these remember what they read
before, so that a change is told once, not every tick: a source that starts failing or answers
again (``SourceWatch``), vLLM's process ending without vkvagent asking and why it is down, read
from the journal (``UnitWatch``), a probe that starts failing or is answered again
(``ProbeWatch``, which also sends the probe the engine asks for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vkvagent.adapters import unitlog
from vkvagent.adapters.exporter import AgentMetrics
from vkvagent.adapters.probe import ProbeResult
from vkvagent.engine.samples import Sample, UnitFacts
from vkvagent.knowledge import status
from vkvagent.service.parts import Parts

JOURNAL_LAG = 30.0  # seconds journald may take to hold a dead process's last lines

Emit = Callable[..., None]  # RememberedEvents.emit: (name, message, **fields)
Write = Callable[[str, Callable[[], object]], None]  # StateWrites.write: (what, write)


class SourceWatch:
    """The sources of a sample (vLLM, the GPUs, systemd): an event when one starts failing
    and when it answers again; each failing one's error and first failed sample for the
    status."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.failing: dict[str, str] = {}  # source -> its last error
        # source -> its first failed sample's UTC and monotonic times
        self.since: dict[str, tuple[float, float]] = {}

    def note(self, sample: Sample) -> None:
        for source, error in (
            ("vllm", sample.vllm_error),
            ("gpu", sample.gpu_error),
            ("systemd", sample.unit_error),
        ):
            before = self.failing.get(source)
            if error is not None:
                self.failing[source] = error
                self.since.setdefault(source, (sample.time, sample.mono))
            if error is not None and before is None:
                self.emit("source.failed", f"{source}: {error}", source=source, error=error)
            elif error is None and before is not None:
                del self.failing[source]
                del self.since[source]
                self.emit(
                    "source.recovered", f"{source} answers again", source=source, error=before
                )

    def failures(self, now_mono: float) -> tuple[status.SourceFailure, ...]:
        """The failing sources for the status, each with how long it has failed."""
        return tuple(
            status.SourceFailure(source, self.failing[source], since, now_mono - mono)
            for source, (since, mono) in self.since.items()
        )


class UnitWatch:
    """vLLM's unit as the samples saw it: why it is down (for the engine) and its process
    ending without vkvagent asking (``unit.exited``)."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self._seen: UnitFacts | None = None  # the unit as the last sample saw it
        self._active_run = ""  # the invocation last seen active: its stop is an exit
        # Why vLLM is down, read from the journal per state of the unit (why_down): (the
        # unit's state, who stopped it, vLLM's own error line, when first read, monotonic).
        self._down_read: tuple[tuple[Any, ...], str, str, float] | None = None

    def note(self, sample: Sample, down: dict[str, str], unit: str) -> None:
        """Report vLLM's process ending without vkvagent asking (a crash, the OOM killer, an
        engine that died and took the API server with it), with how it ended and its own
        error line. systemd's Restart= brings it back, or, when it stays down and nobody
        stopped it, the engine decides to start it (``dead``); the exits count toward a crash
        loop either way. A stop someone asked for is said as such."""
        before, now = self._seen, sample.unit
        if now is not None:
            self._seen = now
            if now.active_state == "active":
                self._active_run = now.invocation_id
        if before is None or now is None:
            return
        line = down.get("exit_line", "")
        fields: dict[str, Any] = {
            "unit": unit,
            "n_restarts": now.n_restarts,
            "active_state": now.active_state,
            "exit": now.last_exit or None,
            "error": line or None,
        }
        said = f"vLLM {now.last_exit or 'exited'}" + (f" ({line})" if line else "")
        # NRestarts counts Restart='s starts; a requested start sets it to 0 or keeps it.
        if now.n_restarts > 0 and now.n_restarts != before.n_restarts:
            self.emit(
                "unit.exited",
                f"{unit}: {said}; systemd's Restart= started it again (automatic restart "
                f"{now.n_restarts} since the last requested start)",
                restarted_by_systemd=True,
                stopped_by=None,
                **fields,
            )
        # From active, or from the stop of an active run that a tick caught half-way (vLLM's
        # shutdown takes seconds); not a start that failed.
        elif now.active_state in ("failed", "inactive") and (
            before.active_state == "active"
            or (before.active_state == "deactivating" and before.invocation_id == self._active_run)
        ):
            stopped = down.get("stopped", "")
            if stopped:
                what = f"stopped on purpose ({stopped}); vkvagent leaves it down"
            else:  # vLLM 0.32 exits 0 when its engine dies: Restart=on-failure leaves it down.
                what = (
                    f"{said}, and systemd will not start it again (Restart="
                    f"{now.restart_policy or 'unknown'}); nobody stopped it"
                )
            self.emit(
                "unit.exited",
                f"{unit} is {now.active_state}: {what}",
                restarted_by_systemd=False,
                stopped_by=stopped or None,
                **fields,
            )

    def why_down(self, sample: Sample, unit_name: str) -> dict[str, str]:
        """With vLLM not answering: whether someone stopped its unit on purpose (a stop job
        or a kill they asked systemd for since it last became active) and vLLM's own error
        line, from the journal, read again when the unit's state changes, and while no line
        was found in the first JOURNAL_LAG seconds (journald may not have the dying process's
        last lines yet; a clean stop has none, and is not read again every tick)."""
        unit = sample.unit
        if unit is None or (sample.vllm is not None and unit.active_state == "active"):
            self._down_read = None  # the next outage reads afresh, if in the same state
            return {}
        key = (unit.active_state, unit.sub_state, unit.invocation_id, unit.n_restarts)
        read = self._down_read
        first = read[3] if read is not None and read[0] == key else sample.mono
        if read is None or read[0] != key or (not read[2] and sample.mono - first < JOURNAL_LAG):
            since = unit.active_since or 0.0
            stopped = (
                unitlog.stopped_on_purpose(unit_name, since)
                if unit.active_state in ("inactive", "failed", "deactivating")
                else ""
            )
            line = unitlog.why_it_failed(unit_name, since) or ""
            self._down_read = read = (key, stopped, line, first)
        return {"stopped": read[1], "exit_line": read[2]}


class ProbeWatch:
    """The active probe: sent when the engine asks, its results into the history and the
    metrics, an event when probes start failing (once per kind of failure) and when one is
    answered again."""

    def __init__(self, emit: Emit, write: Write, metrics: AgentMetrics) -> None:
        self.emit, self.write, self.metrics = emit, write, metrics
        self.failing = ""  # "outcome: detail" of the failing probes, reported once

    def send(self, parts: Parts, sample: Sample) -> None:
        """Send the probe the engine asked for (never when switched off: its settings then
        want none), unless one is in flight."""
        cfg = parts.config
        model = (
            cfg.probe.model or cfg.vllm.model or (sample.vllm.model_name if sample.vllm else None)
        )
        if model:
            # The operator's key file, else the key the unit gives vLLM now.
            parts.prober.client.api_key = parts.api_key or parts.sampler.unit_key
            parts.prober.send(model)
        else:
            self.failed("unusable", "vLLM names several models or none: set [probe] model to one")

    def note(self, parts: Parts, result: ProbeResult) -> None:
        """A finished probe: into the history and the metrics; an event when probes start
        failing (once per kind of failure) and when one is answered again."""
        self.write("history", lambda: parts.history.append_probe(result))
        self.metrics.count_probe(result.outcome, result.latency)
        if result.outcome != "ok":
            self.failed(result.outcome, result.detail, result.latency)
        elif self.failing:
            self.failing = ""
            self.emit(
                "probe.recovered",
                f"the probe is answered again, in {result.latency:.2f} s",
                outcome=result.outcome,
                latency_s=result.latency,
            )

    def failed(self, outcome: str, detail: str, latency: float | None = None) -> None:
        if self.failing.startswith(f"{outcome}:"):
            return
        self.failing = f"{outcome}: {detail}"
        meaning = {
            "timeout": "no answer in time: the engine may be hung",
            "error": "vLLM answered with an error",
            "refused": "nothing listens: vLLM is down or loading",
            "unusable": "it can tell nothing until this is fixed",
        }[outcome]
        self.emit(
            "probe.failed",
            f"probe {outcome} ({meaning}): {detail}",
            outcome=outcome,
            latency_s=latency,
            error=detail,
        )
