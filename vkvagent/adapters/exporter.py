"""vkvagent's own Prometheus metrics (``vkvagent_*``), from the status the daemon just wrote
(``status.StatusReport``).

Served on 127.0.0.1 by default (``[metrics] listen``) and/or written to a node_exporter
textfile (``[metrics] textfile``). Gauges are read from the latest status at scrape time;
the counters (decisions, restarts, source errors) count since the daemon started, as
Prometheus counters do. The same address answers ``GET /ready`` for load balancers
(``readiness``): 200 while vLLM serves, 503 and the reason otherwise.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from vkvagent import __version__
from vkvagent.knowledge.readiness import readiness
from vkvagent.knowledge.status import (
    FAILING_FOR,
    FLEET_STATES,
    PROBE_OUTCOMES,
    SOURCES,
    STATES,
    FleetStatus,
    GpuStatus,
    SloStatus,
    StatusReport,
    failed_sources,
)


class AgentMetrics(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: StatusReport | None = None
        self.decisions: Counter[str] = Counter()
        self.restarts: Counter[tuple[str, str]] = Counter()
        self.cut_off = 0.0  # requests in flight that the restarts cut off
        self.source_errors: Counter[str] = Counter({"vllm": 0, "gpu": 0, "systemd": 0})
        self.probes: Counter[str] = Counter()
        self.probe_seconds = 0.0  # the latency of every probe, added up (a summary's _sum)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def update(self, status: StatusReport) -> None:
        with self._lock:
            self._status = status

    def status(self) -> StatusReport | None:
        with self._lock:
            return self._status

    def count(self, *, action: str, errors: Mapping[str, bool]) -> None:
        with self._lock:
            self.decisions[action] += 1
            for source, failed in errors.items():
                self.source_errors[source] += failed

    def count_restart(self, reason: str, result: str, cut_off: float | None = None) -> None:
        with self._lock:
            self.restarts[(reason, result)] += 1
            self.cut_off += cut_off or 0.0

    def count_probe(self, outcome: str, latency: float) -> None:
        with self._lock:
            self.probes[outcome] += 1
            self.probe_seconds += latency

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            status = self._status
            decisions, restarts, cut_off = dict(self.decisions), dict(self.restarts), self.cut_off
            errors = dict(self.source_errors)
            probes, probe_seconds = dict(self.probes), self.probe_seconds
        yield from _gauge(
            "vkvagent_ready",
            "1 while vLLM should get traffic (GET /ready answers 200), 0 while it should not.",
            readiness(status, time.time()).ready,
        )
        counter = CounterMetricFamily(
            "vkvagent_decisions", "Evaluations by the action decided.", labels=["action"]
        )
        for action in ("restart", "hold", "none"):
            counter.add_metric([action], decisions.get(action, 0))
        yield counter
        counter = CounterMetricFamily(
            "vkvagent_restarts",
            "Restarts by vkvagent, by reason (cause) and result.",
            labels=["reason", "result"],
        )
        for (reason, result), n in sorted(restarts.items()):
            counter.add_metric([reason, result], n)
        yield counter
        yield CounterMetricFamily(
            "vkvagent_restart_requests_cut_off",
            "Requests in flight that vkvagent's restarts cut off (vLLM's engine's count).",
            value=cut_off,
        )
        counter = CounterMetricFamily(
            "vkvagent_scrape_errors", "Samples a source failed, by source.", labels=["source"]
        )
        for source, n in sorted(errors.items()):
            counter.add_metric([source], n)
        yield counter
        counter = CounterMetricFamily(
            "vkvagent_probes",
            "Active probes (one-token completions) by outcome: ok, timeout (no answer: hung?), "
            "error (5xx or broken off), refused (nothing listens), unusable (4xx).",
            labels=["outcome"],
        )
        for outcome in PROBE_OUTCOMES:
            counter.add_metric([outcome], probes.get(outcome, 0))
        yield counter
        yield CounterMetricFamily(
            "vkvagent_probe_seconds",
            "Seconds the active probes took, added up (over vkvagent_probes_total: the mean).",
            value=probe_seconds,
        )
        if status is not None:
            yield from _gauges(status)


def _gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(name, doc, value=float(value))


def _gauges(status: StatusReport) -> Iterator[Metric]:
    verdict, policy, vllm = status.verdict, status.policy, status.vllm
    info = GaugeMetricFamily(
        "vkvagent_info",
        "The agent, the vLLM it watches, and the policy mode.",
        labels=["version", "vllm_version", "flavor", "unit", "mode"],
    )
    info.add_metric(
        [__version__, vllm.version or "", vllm.flavor or "", status.unit_name, policy.mode], 1
    )
    yield info
    state = GaugeMetricFamily(
        "vkvagent_verdict", "1 for the current verdict, 0 for the others.", labels=["state"]
    )
    for name in STATES:
        state.add_metric([name], 1 if verdict.state == name else 0)
    yield state
    cause = GaugeMetricFamily(
        "vkvagent_cause", "1 for the cause diagnosed now (absent when none).", labels=["cause"]
    )
    if verdict.cause:
        cause.add_metric([verdict.cause], 1)
    yield cause
    yield from _gauge(
        "vkvagent_throughput_ratio",
        "Speed now over this run's fresh baseline at the same load (absent when unknown).",
        verdict.ratio,
    )
    failed = {f.source for f in failed_sources(status.failing, status.updated, status.interval)}
    sources = GaugeMetricFamily(
        "vkvagent_source_failed",
        f"1 while a source the agent needs to act has failed for {FAILING_FOR} sample intervals "
        "or more (vllm: /metrics, gpu: NVML, systemd: the unit over D-Bus), 0 otherwise; "
        "`vkvagent status` says why.",
        labels=["source"],
    )
    for source in SOURCES:
        sources.add_metric([source], 1 if source in failed else 0)
    yield sources
    yield from _gauge("vkvagent_window_open", "1 inside a restart window.", policy.window_open)
    yield from _gauge(
        "vkvagent_restart_budget_remaining",
        "Restarts still allowed in the rolling 24 hours.",
        policy.budget_left,
    )
    yield from _gauge(
        "vkvagent_escalated",
        "1 when restarts stopped helping and vkvagent waits for `vkvagent resume`.",
        verdict.state == "escalated",
    )
    yield from _gauge(
        "vkvagent_metrics_schema_recognised",
        "1 when vLLM's /metrics page was read as a known version's.",
        vllm.recognised,
    )
    probe = status.probe
    last = probe.last if probe is not None else None
    yield from _gauge(
        "vkvagent_probe_last_latency_seconds",
        "How long the last active probe took, to its answer or to giving up.",
        last.latency_s if last is not None else None,
    )
    yield from _gauge(
        "vkvagent_probe_last_ok",
        "1 when the last active probe was answered, 0 when not (absent before the first).",
        last.outcome == "ok" if last is not None else None,
    )
    yield from _gauge(
        "vkvagent_probe_last_timestamp_seconds",
        "When the last active probe was sent (Unix seconds); probes go only while no token moves.",
        last.time if last is not None else None,
    )
    yield from _gauge(
        "vkvagent_probe_in_flight_seconds",
        "How long the probe in flight has waited (absent when none is).",
        probe.in_flight_s if probe is not None else None,
    )
    yield from _gauge(
        "vkvagent_last_evaluation_timestamp_seconds",
        "When the last evaluation ran (Unix seconds).",
        status.updated,
    )
    readings: tuple[tuple[str, Callable[[GpuStatus], float | None], str, float], ...] = (
        ("vkvagent_gpu_temperature_celsius", lambda g: g.temperature_c, "GPU temperature.", 1.0),
        ("vkvagent_gpu_sm_clock_hertz", lambda g: g.sm_clock_mhz, "GPU SM clock.", 1e6),
    )
    for name, reading, doc, scale in readings:
        family = GaugeMetricFamily(name, doc, labels=["gpu"])
        for gpu in status.gpus:
            value = reading(gpu)
            if value is not None:
                family.add_metric([str(gpu.index)], value * scale)
        yield family
    events = GaugeMetricFamily(
        "vkvagent_gpu_clock_event",
        "1 for each clock-event (throttle) reason NVML reports now.",
        labels=["gpu", "reason"],
    )
    for gpu in status.gpus:
        for reason in gpu.clock_event_reasons:
            events.add_metric([str(gpu.index), reason], 1)
    yield events
    if status.fleet is not None:
        yield from _fleet(status.fleet)
    if status.slo is not None:
        yield from _slo(status.slo)


def _fleet(fleet: FleetStatus) -> Iterator[Metric]:
    group = [fleet.group]
    state = GaugeMetricFamily(
        "vkvagent_fleet_state",
        "1 for this host's state in its fleet group (unreachable: etcd does not answer, "
        "restarts are held), 0 for the others.",
        labels=["group", "state"],
    )
    for name in FLEET_STATES:
        state.add_metric([*group, name], 1 if fleet.state == name else 0)
    yield state
    held = GaugeMetricFamily(
        "vkvagent_fleet_slots_held",
        "Hosts of the group holding a restart slot, as last listed.",
        labels=["group"],
    )
    held.add_metric(group, len(fleet.holders))
    yield held
    limit = GaugeMetricFamily(
        "vkvagent_fleet_max_concurrent",
        "Hosts of the group allowed to restart at once.",
        labels=["group"],
    )
    limit.add_metric(group, fleet.max_concurrent)
    yield limit


def _slo(slo: SloStatus) -> Iterator[Metric]:
    """The operator's objectives ([slo]); a window with no events has no series."""
    target = GaugeMetricFamily(
        "vkvagent_slo_target",
        "The share of good events each objective of [slo] asks for (availability: requests "
        "served; ttft, itl: requests, output tokens within the latency declared).",
        labels=["objective"],
    )
    attainment = GaugeMetricFamily(
        "vkvagent_slo_attainment",
        "The share of good events over the last hour (1h), day (1d) and the budget's period.",
        labels=["objective", "window"],
    )
    budget = GaugeMetricFamily(
        "vkvagent_slo_budget_remaining",
        "The share of the period's error budget left (below 0: overspent).",
        labels=["objective"],
    )
    burn = GaugeMetricFamily(
        "vkvagent_slo_burn_rate",
        "The error budget spent over the window against the rate that would spend it in "
        "exactly one period (1: on course; the alert rules compare a long and a short window).",
        labels=["objective", "window"],
    )
    for o in slo.objectives:
        target.add_metric([o.objective], o.target)
        if o.budget_remaining is not None:
            budget.add_metric([o.objective], o.budget_remaining)
        for family, figures in ((attainment, o.attainment), (burn, o.burn_rates)):
            for window, value in figures.items():
                if value is not None:
                    family.add_metric([o.objective, window], value)
    yield from (target, attainment, budget, burn)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A load balancer checks every second: no line per request on stderr."""


class Exporter:
    """Serves ``metrics`` and ``/ready`` on ``listen`` (host:port; "" for none) and writes
    ``textfile``."""

    def __init__(self, metrics: AgentMetrics, listen: str, textfile: str) -> None:
        self.metrics, self.textfile = metrics, textfile
        self._server: Any = None
        if listen:
            host, _, port = listen.rpartition(":")
            host = host.strip("[]")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET  # an IPv6 address
            server = type("_Server", (ThreadingWSGIServer,), {"address_family": family})
            self._server = make_server(
                host, int(port), self._app(make_wsgi_app(metrics.registry)), server,
                handler_class=_Quiet,
            )  # fmt: skip
            thread = threading.Thread(target=self._server.serve_forever, daemon=True)
            thread.start()

    def _app(self, served: Any) -> Any:
        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO") != "/ready":
                return served(environ, start_response)  # type: ignore[no-any-return]
            ready, reason = readiness(self.metrics.status(), time.time())
            body = f"{'ready' if ready else 'not ready'}: {reason}\n".encode()
            start_response(
                "200 OK" if ready else "503 Service Unavailable",
                [
                    ("Content-Type", "text/plain; charset=utf-8"),
                    ("Content-Length", str(len(body))),
                    ("Cache-Control", "no-store"),
                ],
            )
            return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]

        return app

    def publish(self) -> None:
        """Write the textfile (atomically: node_exporter never reads half of it)."""
        if self.textfile:
            write_to_textfile(self.textfile, self.metrics.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
