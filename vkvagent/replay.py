"""``vkvagent replay``: the decision engine on a virtual clock over Prometheus history.

Input: Prometheus HTTP API ``query_range`` responses (``resultType: matrix``), read from files
or fetched from a Prometheus in chunks under its 11,000-points-per-series limit, holding
vLLM's raw series of any version (counters, gauges, histogram ``_bucket``/``_count``/``_sum``,
``cache_config_info``, ``process_start_time_seconds``) and, optionally, dcgm-exporter's GPU
series.

How samples are made: at each timestamp the vLLM series' values are written back as
exposition lines and read by the agent's own ``vllm_metrics.Normaliser``, so every metrics
flavour, data-parallel ``engine`` labels and the checks that make a page invalid are the code
that reads a live ``/metrics`` page. Building ``VllmMetrics`` directly would be a second
mapping of wire names to keep in step with vllm_metrics.py for little gain: only the series the
normaliser reads are kept and written back, and a replay costs about 0.6 ms a timestamp,
normaliser and engine included. The Prometheus target labels ``instance`` and ``job`` are
left out, so a server that came back on another instance (a new pod) continues the same
series; two instances with data at the same time are refused. dcgm-exporter series become
``GpuReading`` values (the clock-event reasons bitmask is NVML's).

Then ``engine.decide`` runs once per timestamp with ``now`` at that timestamp. A restart it
decides is virtual: windows, budgets and cooldowns count it, the data is not altered, and it
is never judged (no new run follows it), so escalation cannot trigger. A real restart in the
data (a counter reset, a new ``process_start_time_seconds``) is a new run with a new baseline,
as in the daemon. In observe mode the restarts it holds back are counted as enforce mode would
have made them (``replay``). With an ``[slo]``, the summary gives each objective over the whole
span: what the engine added to its tallies at each decision (``_counted``).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import statistics
import urllib.error
import urllib.parse
import urllib.request
from array import array
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vkvagent.engine import Decision, EngineState, Observation, Recent, Settings, decide
from vkvagent.engine.policy import WOULD_RESTART, RestartRecord
from vkvagent.engine.samples import GpuReading, Sample, VllmMetrics, utc_text
from vkvagent.engine.slo import EMPTY, OBJECTIVES, SloSettings, SloState, Tally
from vkvagent.errors import VkvagentError
from vkvagent.gpu import decode_clock_event_reasons
from vkvagent.jsonsafe import finite
from vkvagent.reconcile import Change, FlagState, flags_key
from vkvagent.vllm_metrics import (
    HTTP_REQUESTS,
    WANTED,
    ExpositionError,
    Normaliser,
    http_counted,
)

MAX_POINTS = 10_000  # per series per query: under Prometheus' 11,000, with a margin
MAX_RESPONSE_BYTES = 1 << 30
# Timestamps replay can put on a calendar (1970 to 9999), and the most evaluations one replay
# makes: a point far from the others would otherwise fill the gap with billions of them.
MAX_TIME = 253402300799.0
MAX_EVALUATIONS = 4_000_000
TARGET_LABELS = ("instance", "job")  # added by Prometheus, not by vLLM
PROCESS_START = "process_start_time_seconds"
PROCESS_MEMORY = "process_resident_memory_bytes"  # the API server's RSS: unit memory, at least
MIB = 1 << 20

# dcgm-exporter field -> GpuReading field.
DCGM_REASONS = ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
DCGM_FIELDS = {
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_MAX_SM_CLOCK": "sm_clock_max_mhz",
    "DCGM_FI_DEV_FB_USED": "memory_used_mib",
    "DCGM_FI_DEV_FB_FREE": "memory_free_mib",
    "DCGM_FI_DEV_FB_RESERVED": "memory_reserved_mib",
    "DCGM_FI_DEV_GPU_UTIL": "utilization_percent",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_uncorrected_volatile",
    **dict.fromkeys(DCGM_REASONS, "reasons"),
}


class ReplayError(VkvagentError):
    """Input replay cannot use; the message is one line naming the source and the problem."""


# -- reading query_range responses -------------------------------------------------------------


@dataclass
class Series:
    """One raw series: its name, its labels (without ``__name__``), its points in time order."""

    name: str
    labels: dict[str, str]
    times: Sequence[float] = field(default_factory=list)
    values: Sequence[float] = field(default_factory=list)


def _kept(name: str, labels: Mapping[str, str]) -> bool:
    """Whether replay reads the series: what the normaliser reads, and the GPUs' and memory.
    The rest of ``vllm:*`` (``_created``, histograms it never reads) cannot change a sample,
    nor can the API's GETs and 4xx answers."""
    if name == HTTP_REQUESTS:
        return http_counted(labels)
    return name in WANTED or name in DCGM_FIELDS or name == PROCESS_MEMORY


_Key = tuple[str, frozenset[tuple[str, str]]]


class Store:
    """The series of one or more responses that replay reads, merged by label set
    (overlapping chunks or files give each point once, the last one read winning). Points are
    kept as arrays of doubles: a week of a server's series at 15 s is a few million."""

    def __init__(self) -> None:
        self._series: dict[_Key, tuple[array[float], array[float]]] = {}
        self.names: set[str] = set()  # every series name seen, read or not

    def add(self, response: Any, source: str) -> None:
        """Take one parsed ``query_range`` response; ReplayError names what is wrong."""
        for name, labels, times, values in _matrix(response, source):
            self.names.add(name)
            if not _kept(name, labels):
                continue
            key = (name, frozenset(labels.items()))
            entry = self._series.get(key)
            if entry is None:
                entry = self._series[key] = (array("d"), array("d"))
            entry[0].extend(times)
            entry[1].extend(values)

    def series(self) -> list[Series]:
        out = []
        for (name, labels), (times, values) in sorted(self._series.items(), key=_order):
            if all(earlier < later for earlier, later in zip(times, times[1:])):
                out.append(Series(name, dict(labels), times, values))
                continue
            points = dict(zip(times, values))  # out of order, or overlapping: merge
            ordered = array("d", sorted(points))
            out.append(
                Series(name, dict(labels), ordered, array("d", (points[t] for t in ordered)))
            )
        return out


def _order(item: tuple[_Key, object]) -> tuple[str, list[tuple[str, str]]]:
    return item[0][0], sorted(item[0][1])


def _matrix(
    response: Any, source: str
) -> Iterator[tuple[str, dict[str, str], list[float], list[float]]]:
    def bad(problem: str) -> ReplayError:
        return ReplayError(f"{source}: {problem}")

    if not isinstance(response, dict):
        raise bad("not a Prometheus query_range response (expected a JSON object)")
    status = response.get("status")
    if status == "error":
        raise bad(f"Prometheus error: {response.get('errorType')}: {response.get('error')}")
    if status != "success":
        raise bad(f'"status" is {json.dumps(status)}, not "success"')
    data = response.get("data")
    if not isinstance(data, dict):
        raise bad('no "data" object')
    kind = data.get("resultType")
    if kind != "matrix":
        raise bad(
            f'resultType is {json.dumps(kind)}, not "matrix" (save /api/v1/query_range '
            "responses, not /api/v1/query)"
        )
    result = data.get("result")
    if not isinstance(result, list):
        raise bad('"data.result" is not a list')
    for index, entry in enumerate(result):
        if not isinstance(entry, dict):
            raise bad(f"result[{index}] is not an object")
        metric = entry.get("metric")
        if not isinstance(metric, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metric.items()
        ):
            raise bad(f'result[{index}]: "metric" is not an object of string labels')
        name = metric.get("__name__")
        if not name:
            raise bad(
                f"result[{index}] has no __name__: query raw series (a selector), not an expression"
            )
        values = entry.get("values", [])
        if not isinstance(values, list):
            raise bad(f'result[{index}] ({name}): "values" is not a list')
        times, numbers = [], []
        for position, pair in enumerate(values):
            point = _point(pair)
            if point is None:
                raise bad(
                    f'result[{index}] ({name}): values[{position}] is not [time, "value"]: '
                    f"{json.dumps(pair)[:60]}"
                )
            if not 0 <= point[0] <= MAX_TIME:
                raise bad(
                    f"result[{index}] ({name}): values[{position}]: time {point[0]:g} is not "
                    "between 1970 and 9999 (Unix seconds)"
                )
            times.append(point[0])
            numbers.append(point[1])
        labels = {k: v for k, v in metric.items() if k != "__name__"}
        yield name, labels, times, numbers


def _point(pair: Any) -> tuple[float, float] | None:
    if not isinstance(pair, list) or len(pair) != 2:
        return None
    at, text = pair
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
        return None
    if not isinstance(text, str):
        return None
    try:
        return float(at), float(text)
    except ValueError:
        return None


def load_files(paths: Sequence[Path]) -> Store:
    """The series of ``query_range`` response files."""
    store = Store()
    for path in paths:
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ReplayError(f"{path}: {exc.strerror or exc}") from None
        try:
            response = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ReplayError(f"{path}: not JSON: {exc}") from None
        store.add(response, str(path))
    return store


# -- fetching from Prometheus ------------------------------------------------------------------


def chunks(start: float, end: float, step: float, max_points: int) -> list[tuple[float, float]]:
    """(start, end) of each query_range call: the same grid (start + k * step) throughout,
    at most ``max_points`` points each."""
    if not (step > 0 and end >= start and max_points >= 1):
        raise ValueError("chunks: need step > 0, end >= start, max_points >= 1")
    out = []
    first = start
    while first <= end + 1e-9:
        last = min(end, first + (max_points - 1) * step)
        out.append((first, last))
        first = last + step
    return out


def fetch(
    url: str,
    selectors: Sequence[str],
    start: float,
    end: float,
    step: float,
    *,
    timeout: float = 60.0,
    max_points: int = MAX_POINTS,
) -> Store:
    """``query_range`` of each selector over [start, end], in chunks, from the Prometheus at
    ``url`` (its base URL). Proxy variables are not used (as for vLLM)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ReplayError(f"--prometheus {url!r}: expected http://HOST:PORT or https://...")
    endpoint = url.rstrip("/") + "/api/v1/query_range"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    store = Store()
    for selector in selectors:
        for first, last in chunks(start, end, step, max_points):
            form = {"query": selector, "start": _num(first), "end": _num(last), "step": _num(step)}
            response = _post(opener, endpoint, form, timeout)
            store.add(response, f"{endpoint} ({selector}, {utc_text(first)} to {utc_text(last)})")
    return store


def _num(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _post(
    opener: urllib.request.OpenerDirector, endpoint: str, form: Mapping[str, str], timeout: float
) -> Any:
    body = urllib.parse.urlencode(form).encode()
    request = urllib.request.Request(
        endpoint,
        data=body,
        headers={"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"},
    )
    where = f"Prometheus at {endpoint}"
    try:
        with opener.open(request, timeout=timeout) as answer:
            data = answer.read(MAX_RESPONSE_BYTES + 1)
            # read(n) returns what came before the peer hung up; the length says what is due.
            cut = len(data) <= MAX_RESPONSE_BYTES and bool(getattr(answer, "length", None))
    except urllib.error.HTTPError as exc:
        detail = _error_detail(exc)
        raise ReplayError(f"{where} answered HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise ReplayError(f"cannot reach {where}: {_reason(exc.reason)}") from None
    except (OSError, http.client.HTTPException) as exc:  # timeouts, resets mid-body
        raise ReplayError(f"cannot read from {where}: {_reason(exc)}") from None
    if cut:
        raise ReplayError(f"cannot read from {where}: the answer was cut short")
    if len(data) > MAX_RESPONSE_BYTES:
        raise ReplayError(f"{where}: response over {MAX_RESPONSE_BYTES} bytes; use a larger --step")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReplayError(f"{where}: answer is not JSON: {exc}") from None


def _error_detail(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read(1 << 16))
        return f"{body['errorType']}: {body['error']}"
    except Exception:  # not Prometheus' JSON error: the status line says enough
        return str(exc.reason)


def _reason(reason: object) -> str:
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


# -- time on the command line ------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """``15``, ``15s``, ``1m``, ``6h``, ``2d``, ``1w`` in seconds; ValueError otherwise."""
    found = _DURATION.match(text.strip())
    if not found:
        raise ValueError(f"{text!r} is not a duration (e.g. 15s, 5m, 6h, 2d)")
    return float(found.group(1)) * _UNITS[found.group(2) or "s"]


def parse_time(text: str, now: float) -> float:
    """Unix seconds, ISO 8601 (UTC when it has no offset), ``now`` or ``now-DURATION``."""
    text = text.strip()
    if text == "now":
        return now
    if text.startswith("now-"):
        return now - parse_duration(text[4:])
    try:
        return float(text)
    except ValueError:
        pass
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time (Unix seconds, ISO 8601 such as 2025-03-03T04:00:00Z, "
            "now, now-6h)"
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return at.timestamp()


# -- series to samples -------------------------------------------------------------------------


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


# -- the replay itself -------------------------------------------------------------------------


@dataclass
class Trace:
    """Every evaluation's numbers, for ``vkvagent replay --plot``: time (Unix seconds), the
    speed and throughput ratios against this run's fresh baseline, the band the speed is
    judged by (enter and leave) and the generated tokens/s (NaN when unknown), whether a
    window was open, the cause; the restarts' times, and those of the restarts observe mode
    held back."""

    times: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    throughput_ratio: list[float] = field(default_factory=list)
    enter: list[float] = field(default_factory=list)
    leave: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    window_open: list[bool] = field(default_factory=list)
    causes: list[str | None] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    held_back: list[float] = field(default_factory=list)

    def add(self, decision: Decision, *, held_back: bool = False) -> None:
        def number(value: object) -> float:
            return float(value) if isinstance(value, (int, float)) else math.nan

        at = decision.time.timestamp()
        self.times.append(at)
        self.ratio.append(number(decision.ratio))
        self.throughput_ratio.append(number(decision.evidence.get("throughput_ratio")))
        band = decision.band or (math.nan, math.nan)
        self.enter.append(band[0])
        self.leave.append(band[1])
        self.tokens_per_s.append(number(decision.evidence.get("generation_tokens_per_s")))
        self.window_open.append(decision.window_open)
        self.causes.append(decision.cause)
        if decision.action == "restart":
            self.restarts.append(at)
        if held_back:
            self.held_back.append(at)


@dataclass
class Result:
    """What replay found: the decisions worth showing and the summary."""

    settings: Settings
    step: float
    decisions: list[Decision] = field(default_factory=list)  # at every change, and restarts
    evaluations: int = 0
    first: datetime | None = None
    last: datetime | None = None
    runs: list[str] = field(default_factory=list)
    restarts: int = 0
    restarts_outside_window: int = 0
    # The restarts observe mode held back, as enforce mode would have made them (its
    # decisions, also in ``decisions``).
    held_back: list[Decision] = field(default_factory=list)
    cause_seconds: dict[str, float] = field(default_factory=dict)
    # Time during which the live daemon would have sent its probe (no counter moved for
    # probe_after): replay has none, so there it cannot tell idle from a hung engine.
    probe_seconds: float = 0.0
    # A new run whose cache_config_info differs is a flag change (and a new server identity):
    # each judged as the daemon judges one, by its fresh speed against the run before.
    flag_changes: list[Change] = field(default_factory=list)
    trace: Trace | None = None  # every evaluation, when asked for (``--plot``)
    # The [slo] objectives' events over the whole span, as the engine counted them.
    slo: Tally = EMPTY

    def summary(self) -> dict[str, Any]:
        return {
            "from": utc_text(self.first.timestamp()) if self.first else None,
            "to": utc_text(self.last.timestamp()) if self.last else None,
            "step_s": self.step,
            "evaluations": self.evaluations,
            "mode": self.settings.policy.mode,
            "runs": len(self.runs),
            "restarts": self.restarts,
            "restarts_outside_window": self.restarts_outside_window,
            "held_back": len(self.held_back),
            "held_back_in_window": sum(d.window_open for d in self.held_back),
            "held_back_outside_window": sum(not d.window_open for d in self.held_back),
            "held_back_at": [utc_text(d.time.timestamp()) for d in self.held_back],
            "causes": {
                cause: round(seconds / 60, 1)
                for cause, seconds in sorted(self.cause_seconds.items())
            },
            "probe_wanted_min": round(self.probe_seconds / 60, 1),
            "flag_changes": [
                {
                    "at": utc_text(c.ended),
                    "cache_config": dict(c.flags),
                    "verdict": c.verdict,
                    "ratio": None if c.ratio is None else round(c.ratio, 4),
                    "loads": list(c.loads),
                }
                for c in self.flag_changes
            ],
            "slo": slo_summary(self.settings.slo, self.slo),
        }

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (a non-finite number in the evidence becomes null)."""
        decisions = [finite(d.to_json()) for d in self.decisions]
        return {"decisions": decisions, "summary": self.summary()}


def replay(
    settings: Settings, line: Timeline, *, trace: bool = False, margin: float = 0.20
) -> Result:
    """Run the engine over the timeline, one decision per timestamp; ``trace`` keeps every
    evaluation's numbers in ``Result.trace``; ``margin``: [vllm] rollback_margin, for the
    verdict on each flag change."""
    result = Result(settings, line.step, trace=Trace() if trace else None)
    flags = _FlagChanges(settings, margin)
    recent = Recent(settings.baseline, margin=2 * line.step)
    restarts: list[RestartRecord] = []
    # Observe mode holds every restart back, so the run is never cured and the same "would
    # restart now" comes back every tick while its cause lasts: counted per tick, one slow
    # night would be hundreds of restarts. Each is counted where enforce mode, with the ones
    # counted before it as its restart history, would have restarted (that history's min
    # interval, daily budget and cooldown are what keep the daemon from restarting twice for
    # one episode). The engine's state depends on neither the mode nor that history, and a
    # history only ever holds a restart back, so this is exactly what `--mode enforce` makes
    # of the same data, for one more decision on those ticks alone.
    enforced = replace(settings, policy=replace(settings.policy, mode="enforce"))
    held: list[RestartRecord] = []
    state = EngineState()
    previous: Decision | None = None
    previous_key: tuple[Any, ...] | None = None
    for sample, rss in line.samples():
        recent.add(sample, rss)
        now = datetime.fromtimestamp(sample.time, timezone.utc)
        observed = Observation(
            samples=tuple(recent.samples), memory=recent.memory, restarts=tuple(restarts)
        )
        decision = decide(settings, state, observed, now)
        result.slo = _counted(result.slo, state.slo, decision.state.slo)
        counted = False
        if decision.action == "hold" and decision.reason.startswith(WOULD_RESTART):
            enforcing = replace(observed, restarts=tuple(held))
            counted = decide(enforced, state, enforcing, now).action == "restart"
            if counted:
                held.append(RestartRecord(sample.time, decision.cause or "?"))
                result.held_back.append(_slim(decision))
        state = decision.state
        flags.observe(sample, decision)
        result.evaluations += 1
        if result.trace is not None:
            result.trace.add(decision, held_back=counted)
        result.first = result.first or now
        result.last = now
        run = state.run.key
        if run is not None and (not result.runs or result.runs[-1] != run):
            result.runs.append(run)
        if decision.cause is not None:
            result.cause_seconds[decision.cause] = (
                result.cause_seconds.get(decision.cause, 0.0) + line.step
            )
        result.probe_seconds += line.step if decision.probe_wanted else 0.0
        key = decision.key()
        if decision.action == "restart":
            restarts.append(RestartRecord(sample.time, decision.cause or "?"))
            result.restarts += 1
            result.restarts_outside_window += not decision.window_open
        if key != previous_key or decision.action == "restart" or counted:
            result.decisions.append(_slim(decision))
        previous, previous_key = decision, key
    if previous is not None and result.decisions[-1].time != previous.time:
        result.decisions.append(_slim(previous))  # the timeline ends where the data does
    result.flag_changes = flags.changes()
    return result


class _FlagChanges:
    """The flag changes the data shows (a new run with another cache_config_info), judged
    with reconcile.FlagState as the daemon judges its own."""

    def __init__(self, settings: Settings, margin: float) -> None:
        self.settings, self.margin = settings, margin
        self.state = FlagState()
        self.found: dict[int, Change] = {}
        self._last: tuple[str | None, Mapping[str, str], float] | None = None  # run, config, time

    def observe(self, sample: Sample, decision: Decision) -> None:
        run = decision.state.run
        if sample.vllm is not None:
            config = sample.vllm.cache_config
            last = self._last
            if last is not None and run.key != last[0] and config != last[1]:
                labels = sorted(set(config) | set(last[1]))
                changed = {k: config.get(k) for k in labels if config.get(k) != last[1].get(k)}
                change = Change(
                    action=len(self.found) + 1,
                    started=last[2],
                    ended=sample.time,
                    flags=changed,  # type: ignore[arg-type]
                    key=flags_key(config),
                    before=(),  # replay puts nothing back
                )
                self.state = self.state.noticed(change)
            self._last = (run.key, config, sample.time)
        self.state, _judged = self.state.judge(
            run_started=run.started,
            run_uptime=decision.uptime,
            previous=decision.state.previous,
            current=decision.state.baseline,
            settings=self.settings.baseline,
            margin=self.margin,
        )
        if self.state.last is not None:
            self.found[self.state.last.action] = self.state.last

    def changes(self) -> list[Change]:
        return [self.found[k] for k in sorted(self.found)]


def _counted(total: Tally, before: SloState, after: SloState) -> Tally:
    """``total`` with what one decision added to the objectives' tallies. The engine only
    adds to its buckets, and drops those older than the period, which it no longer adds to:
    so what it added is what the daily buckets it changed hold more than before. Exact over
    a replay of any length, where the last state's buckets hold the last period only."""
    if after.rings is before.rings:
        return total
    old = before.rings[-1]
    for index, tally in after.rings[-1].items():
        was = old.get(index, EMPTY)
        if tally != was:
            total = tuple(t + new - prior for t, new, prior in zip(total, tally, was))
    return total


def slo_summary(settings: SloSettings, tally: Tally) -> dict[str, dict[str, float | None]]:
    """Each declared objective over the replayed span: its target, its events, the share of
    them that were good (``attainment``) and the error budget they spent (the bad events over
    events x (1 - target): 1.0 is all of it); None for both where the data has no events."""
    out: dict[str, dict[str, float | None]] = {}
    for name in settings.declared:
        i = OBJECTIVES.index(name)
        good, events = tally[2 * i], tally[2 * i + 1]
        target = settings.target(name)
        known = events > 0
        out[name] = {
            "target": target,
            "events": events,
            "attainment": min(1.0, good / events) if known else None,
            "budget_spent": max(0.0, events - good) / (events * (1 - target)) if known else None,
        }
    return out


def _slim(decision: Decision) -> Decision:
    # Decisions kept for the output do not need the engine state they carried.
    return replace(decision, state=EngineState())


def check_step(settings: Settings, step: float) -> None:
    """A step that leaves fewer than two samples in half the baseline window would leave
    every decision at "learning"; refuse it."""
    if step > settings.baseline.window / 2:
        raise ReplayError(
            f"step {step:g} s is too coarse for the {settings.baseline.window:g} s baseline "
            f"window: use at most {settings.baseline.window / 2:g} s"
        )


# -- output ------------------------------------------------------------------------------------


def describe(result: Result) -> str:
    """A readable timeline: one line per change, then the summary."""
    s = result.summary()
    runs = f"{s['runs']} vLLM run{'s' if s['runs'] != 1 else ''}"
    lines = [
        f"replay {s['from']} to {s['to']}: {s['evaluations']} evaluations every "
        f"{result.step:g} s, {runs}, policy mode {s['mode']}"
    ]
    held = {d.time for d in result.held_back}
    for d in result.decisions:
        ratio = "-" if d.ratio is None else f"{d.ratio:.2f}"
        band = "-" if d.band is None else f"{d.band[0]:.2f}-{d.band[1]:.2f}"
        window = "open  " if d.window_open else "closed"
        probe = "; the live daemon would probe here (replay has no probe)" if d.probe_wanted else ""
        counted = "; counted as a restart observe mode held back" if d.time in held else ""
        lines.append(
            f"{d.time:%Y-%m-%d %H:%M:%S}Z  {d.action:7} {d.cause or '-':18} ratio {ratio:5} "
            f"band {band:9}  window {window}  {d.reason}{counted}{probe}"
        )
    causes = ", ".join(f"{c} {m:g} min" for c, m in s["causes"].items()) or "none"
    lines.append(f"summary: {restarts_words(s)}; causes: {causes}")
    for change in result.flag_changes:
        shown = ", ".join(f"{k} {v}" for k, v in change.flags.items())
        speed = "" if change.ratio is None else f", {change.ratio:.2f} of the fresh speed before"
        at = utc_text(change.ended)
        lines.append(f"flag change at {at} (cache_config {shown}): {change.verdict}{speed}")
    if s["probe_wanted_min"]:
        lines.append(
            f"probe: for {s['probe_wanted_min']:g} min no token moved, where the live daemon "
            "sends its probe; replay has none, so a hung engine whose gauges read 0 looks idle "
            "there"
        )
    lines += slo_words(result.settings.slo, s["slo"])
    return "\n".join(lines) + "\n"


# What an objective's events are, in the text.
_EVENTS = {"availability": "requests", "ttft": "requests", "itl": "output tokens"}


def slo_words(settings: SloSettings, summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The text's SLO block: a line per declared objective (none without an [slo])."""
    if not summary:
        return []
    lines = ["slo over the data as it was (restarts decided here are virtual and spend nothing):"]
    for name, o in summary.items():
        objective = f"objective: {settings.words(name)}"
        if o["attainment"] is None:
            lines.append(f"  {name}: no {_EVENTS[name]} in the data ({objective})")
            continue
        # One decimal more than the target has: 99.95 % against 99.9 %, 96.3 % against 95 %.
        decimals = len(f"{o['target'] * 100:g}".partition(".")[2]) + 1
        spent = o["budget_spent"] * 100
        lines.append(
            f"  {name}: {o['attainment'] * 100:.{decimals}f} % of {o['events']:,.0f} "
            f"{_EVENTS[name]} good ({objective}), {spent:.0f} % of its error budget spent"
            + (" (over)" if spent > 100 else "")
        )
    return lines


def restarts_words(summary: Mapping[str, Any]) -> str:
    """The restarts of a replay's summary in words, for the text and the plot's title: in
    observe mode (which makes none), those it held back and where they fell against the
    windows."""
    if summary["mode"] == "observe":
        held = summary["held_back"]
        return (
            f"{held} restart{'s' if held != 1 else ''} held back by observe mode "
            f"({summary['held_back_in_window']} in a window, "
            f"{summary['held_back_outside_window']} outside)"
        )
    made = summary["restarts"]
    return (
        f"{made} restart{'s' if made != 1 else ''} "
        f"({summary['restarts_outside_window']} outside a window)"
    )


def run(
    settings: Settings,
    store: Store,
    *,
    step: float | None = None,
    model: str = "",
    instance: str = "",
    trace: bool = False,
    margin: float = 0.20,
) -> Result:
    """Replay ``store``'s series with ``settings``."""
    line = timeline(store.series(), step=step, model=model, instance=instance, seen=store.names)
    check_step(settings, line.step)
    return replay(settings, line, trace=trace, margin=margin)
