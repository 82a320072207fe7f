"""Where replay's data comes from: Prometheus HTTP API ``query_range`` responses
(``resultType: matrix``), read from files or fetched from a Prometheus in chunks under its
11,000-points-per-series limit, and the times and durations their command line takes.

The responses hold vLLM's raw series of any version (counters, gauges, histogram
``_bucket``/``_count``/``_sum``, ``cache_config_info``, ``process_start_time_seconds``) and,
optionally, dcgm-exporter's GPU series. Only the series replay reads are kept (``Store``), as
arrays of doubles; ``timeline`` makes samples of them. Every problem with the input is a
one-line ``ReplayError`` naming its source.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vkvagent.engine.samples import utc_text
from vkvagent.errors import VkvagentError
from vkvagent.knowledge.vllm_metrics import HTTP_REQUESTS, WANTED, http_counted

MAX_POINTS = 10_000  # per series per query: under Prometheus' 11,000, with a margin
MAX_RESPONSE_BYTES = 1 << 30
# Timestamps replay can put on a calendar (1970 to 9999).
MAX_TIME = 253402300799.0
PROCESS_MEMORY = "process_resident_memory_bytes"  # the API server's RSS: unit memory, at least

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
