"""The timeline replay runs over: the recorded series made into one ``Sample`` per timestamp.

At each timestamp the vLLM series' values are written back as exposition lines and read by the
agent's own ``vllm_metrics.Normaliser``, so every metrics flavour, data-parallel ``engine``
labels and the checks that make a page invalid are the code that reads a live ``/metrics``
page. Building ``VllmMetrics`` directly would be a second mapping of wire names to keep in step
with vllm_metrics.py for little gain: only the series the normaliser reads are kept and written
back, and a replay costs about 0.6 ms a timestamp, normaliser and engine included. The
Prometheus target labels ``instance`` and ``job`` are left out, so a server that came back on
another instance (a new pod) continues the same series; two instances with data at the same
time are refused. dcgm-exporter series become ``GpuReading`` values (the clock-event reasons
bitmask is NVML's). Holes in the data become timestamps without vLLM's series, which the engine
reads as invalid samples, as it would live.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from vkvagent.adapters.gpu import decode_clock_event_reasons
from vkvagent.adapters.query_range import DCGM_FIELDS, PROCESS_MEMORY, ReplayError, Series
from vkvagent.engine.samples import GpuReading, Sample, VllmMetrics, utc_text
from vkvagent.knowledge.vllm_metrics import HTTP_REQUESTS, WANTED, ExpositionError, Normaliser

# The most evaluations one replay makes: a point far from the others would otherwise fill the
# gap with billions of them.
MAX_EVALUATIONS = 4_000_000
TARGET_LABELS = ("instance", "job")  # added by Prometheus, not by vLLM
PROCESS_START = "process_start_time_seconds"
MIB = 1 << 20


class _Cursor:
    """Reads one series forward in time: its value at ``t``, or the latest before ``t`` no
    older than ``within`` (query_range grids from different queries need not align)."""

    def __init__(self, series: Series) -> None:
        self.series, self.index = series, -1

    def at(self, t: float, within: float) -> float | None:
        times = self.series.times
        while self.index + 1 < len(times) and times[self.index + 1] <= t + 1e-6:
            self.index += 1
        if self.index < 0 or t - times[self.index] > within + 1e-6:
            return None
        return self.series.values[self.index]


@dataclass
class _Gpu:
    """One GPU's dcgm-exporter series, by GpuReading field."""

    index: int
    uuid: str
    name: str
    fields: dict[str, _Cursor] = field(default_factory=dict)
    top_clock: float | None = None  # the highest SM clock in the input
    last_xid: float | None = None


def _line(name: str, labels: Mapping[str, str]) -> str:
    """The series as an exposition line begins, without Prometheus' target labels."""
    kept = [(k, v) for k, v in sorted(labels.items()) if k not in TARGET_LABELS]
    if not kept:
        return name
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in kept) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@dataclass
class Timeline:
    """The samples to replay, built lazily from the series (``samples()``)."""

    step: float
    first: float
    last: float
    vllm: dict[str, list[_Cursor]]  # exposition series text -> its series (one per instance)
    memory: list[_Cursor]
    gpus: list[_Gpu]
    times: list[float]
    model: str = ""
    header: str = ""  # comment lines every page begins with

    def samples(self) -> Iterator[tuple[Sample, float | None]]:
        """Each timestamp's Sample, with the API server's memory (bytes) when known."""
        normaliser = Normaliser(self.model)
        tolerance = self.step / 2
        for t in self.times:
            lines = []
            for text, cursors in self.vllm.items():
                for cursor in cursors:
                    value = cursor.at(t, tolerance)
                    if value is not None:
                        lines.append(f"{text} {value!r}\n")
                        break
            gpus = self._gpus(t)
            metrics: VllmMetrics | None = None
            error = None
            if not any(line.startswith("vllm:") for line in lines):
                error = "no vLLM series at this time (target down, or not scraped)"
            else:
                try:
                    metrics = normaliser.normalise(self.header + "".join(lines))
                except ExpositionError as exc:
                    error = str(exc)
            memory = next(
                (v for v in (c.at(t, tolerance) for c in self.memory) if v is not None), None
            )
            yield Sample(t, t, metrics, error, gpus), memory

    def _gpus(self, t: float) -> tuple[GpuReading, ...]:
        out = []
        for gpu in self.gpus:
            values = {name: c.at(t, self.step) for name, c in gpu.fields.items()}
            if all(v is None for v in values.values()):
                continue
            xid = values.get("xid")
            new_xid: tuple[int, ...] = ()
            if xid is not None:
                if xid and xid != gpu.last_xid:
                    new_xid = (int(xid),)
                gpu.last_xid = xid
            used, free = values.get("memory_used_mib"), values.get("memory_free_mib")
            reasons = values.get("reasons")
            top = values.get("sm_clock_max_mhz") or gpu.top_clock
            ecc = values.get("ecc_uncorrected_volatile")
            out.append(
                GpuReading(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    name=gpu.name,
                    memory_used_bytes=None if used is None else int(used * MIB),
                    memory_total_bytes=(
                        None
                        if used is None or free is None
                        else int((used + free + (values.get("memory_reserved_mib") or 0)) * MIB)
                    ),
                    utilization_percent=values.get("utilization_percent"),
                    temperature_c=values.get("temperature_c"),
                    power_w=values.get("power_w"),
                    power_limit_w=values.get("power_limit_w"),
                    sm_clock_mhz=values.get("sm_clock_mhz"),
                    sm_clock_max_mhz=top,
                    clock_event_reasons=(
                        decode_clock_event_reasons(int(reasons)) if reasons is not None else ()
                    ),
                    ecc_uncorrected_volatile=None if ecc is None else int(ecc),
                    xid_errors=new_xid,
                )
            )
        return tuple(out)


def timeline(
    series: Sequence[Series],
    *,
    step: float | None = None,
    model: str = "",
    instance: str = "",
    seen: Collection[str] = (),
) -> Timeline:
    """The timestamps and series to replay: vLLM's (with the same target's
    ``process_start_time_seconds``, ``process_resident_memory_bytes`` and
    ``http_requests_total``) and the GPUs'.
    ``step``: the query's resolution (else the most common spacing in the data); ``seen``:
    every name in the input, for the error when no vLLM series is there."""
    vllm = [s for s in series if s.name.startswith("vllm:")]
    if instance:
        vllm = [s for s in vllm if s.labels.get("instance") == instance]
    if not vllm:
        names = sorted(seen or {s.name for s in series})
        found = names[:5]
        where = f" of instance {instance!r}" if instance else ""
        raise ReplayError(
            f"no vLLM series (vllm:*){where} in the input"
            + (f" (found: {', '.join(found)}{', ...' if len(names) > 5 else ''})" if found else "")
        )
    _check_instances(vllm)
    targets = {s.labels.get("instance") for s in vllm}
    # The target's own series only: another program on the host may count HTTP requests.
    own = [
        s
        for s in series
        if s.name in (PROCESS_START, PROCESS_MEMORY, HTTP_REQUESTS)
        and s.labels.get("instance") in targets
    ]
    times = sorted({t for s in vllm for t in s.times})
    if not times:
        raise ReplayError("the vLLM series hold no points in the range: nothing to replay")
    if step is None:
        gaps = [b - a for a, b in zip(times, times[1:]) if b - a > 1e-6]
        if not gaps:
            raise ReplayError("the vLLM series have a single timestamp: nothing to replay")
        step = statistics.median_low(gaps)
    if step <= 0 or (times[-1] - times[0]) / step >= MAX_EVALUATIONS:
        raise ReplayError(
            f"{utc_text(times[0])} to {utc_text(times[-1])} every {step:g} s is over "
            f"{MAX_EVALUATIONS:,} evaluations: replay a shorter range or use a larger step"
        )
    times = _fill_gaps(times, step)

    # Only the series the normaliser reads are written back: the others (``_created``, series
    # it never reads) cannot change what it finds, flavour included (docs/metrics.md).
    texts: dict[str, list[_Cursor]] = {}
    for s in [*vllm, *own]:
        if s.name in WANTED:
            texts.setdefault(_line(s.name, s.labels), []).append(_Cursor(s))
    memory = [_Cursor(s) for s in own if s.name == PROCESS_MEMORY]
    # The live page declares the family from vLLM's start, before any POST is answered, and
    # the normaliser reads that as none yet (not unknown): Prometheus keeps no TYPE lines.
    http = any(s.name == HTTP_REQUESTS for s in own)
    header = f"# TYPE {HTTP_REQUESTS} counter\n" if http else ""
    return Timeline(step, times[0], times[-1], texts, memory, _gpus(series), times, model, header)


def _check_instances(vllm: Sequence[Series]) -> None:
    spans: dict[str, tuple[float, float]] = {}
    for s in vllm:
        if not s.times:
            continue
        name = s.labels.get("instance", "")
        low, high = spans.get(name, (s.times[0], s.times[-1]))
        spans[name] = (min(low, s.times[0]), max(high, s.times[-1]))
    ordered = sorted(spans.items(), key=lambda item: item[1])
    for (a, (_a0, a1)), (b, (b0, _b1)) in zip(ordered, ordered[1:]):
        if b0 <= a1:
            raise ReplayError(
                f"vLLM series of instances {a!r} and {b!r} overlap in time: replay one server "
                f'at a time (--instance {a}, or instance="{a}" in the selector)'
            )


def _fill_gaps(times: list[float], step: float) -> list[float]:
    """The timestamps, with one every ``step`` where the data has a hole (a server down or
    not scraped), so the engine sees the gap as it would live."""
    out: list[float] = []
    for t in times:
        if out and t - out[-1] > 1.5 * step:
            before, missing = out[-1], int((t - out[-1]) / step + 0.5)
            filled = (before + k * step for k in range(1, missing))
            out += [at for at in filled if at < t - step / 2]
        out.append(t)
    return out


def _gpus(series: Sequence[Series]) -> list[_Gpu]:
    dcgm = [s for s in series if s.name in DCGM_FIELDS]
    hosts = sorted({s.labels["Hostname"] for s in dcgm if "Hostname" in s.labels})
    if len(hosts) > 1:
        raise ReplayError(
            f"GPU series from {len(hosts)} hosts ({', '.join(hosts[:4])}): keep this host's "
            f'(e.g. Hostname="{hosts[0]}" in the DCGM selector)'
        )
    gpus: dict[str, _Gpu] = {}
    for s in dcgm:
        labels = s.labels
        key = labels.get("UUID") or labels.get("gpu") or "0"
        gpu = gpus.get(key)
        if gpu is None:
            number = labels.get("gpu", "")
            gpu = gpus[key] = _Gpu(
                index=int(number) if number.isdigit() else len(gpus),
                uuid=labels.get("UUID", ""),
                name=labels.get("modelName", ""),
            )
        kind = DCGM_FIELDS[s.name]
        gpu.fields.setdefault(kind, _Cursor(s))
        if kind == "sm_clock_mhz" and s.values:
            top = max(s.values)
            gpu.top_clock = top if gpu.top_clock is None else max(gpu.top_clock, top)
    return sorted(gpus.values(), key=lambda g: g.index)
