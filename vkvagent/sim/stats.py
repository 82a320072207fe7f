"""What a simulated vLLM engine has counted: the values vLLM's own metric loggers hold.

The engine model (``capacity.py``) fills these; the exposition (``exposition.py``) renders them
in a chosen vLLM version's format. Histograms use the version's bucket bounds, so the engine
asks the exposition for them (``exposition.histogram_bounds``). ``HttpStats`` is the API
server's own counter (prometheus_fastapi_instrumentator's), which the cluster and the HTTP
server (``server.py``) both fill.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort")
# The handler the simulated workload's clients call: each request it finishes answered one.
COMPLETIONS = "/v1/completions"


@dataclass
class Observations:
    """A histogram being filled: per-bucket counts, the last one for values above every bound."""

    bounds: tuple[float, ...]  # finite upper bounds, ascending
    counts: list[float] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0.0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: float = 1.0) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    @property
    def count(self) -> float:
        return sum(self.counts)

    def cumulative(self) -> list[float]:
        """Counts at or below each bound, then the total (the +Inf bucket)."""
        out, running = [], 0.0
        for c in self.counts:
            running += c
            out.append(running)
        return out


@dataclass
class EngineStats:
    """One data-parallel engine's counters, gauges and histograms (keyed by vLLM's metric name
    without the ``vllm:`` prefix, e.g. ``time_to_first_token_seconds``)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    finished: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0.0))
    prefix_queries: float = 0.0  # tokens
    prefix_hits: float = 0.0
    histograms: dict[str, Observations] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerInfo:
    """What does not change while the server runs."""

    model: str  # the served model name (model_name label)
    flavor: str  # one of vkvagent.knowledge.vllm_metrics.FLAVORS
    version: str  # what GET /version answers
    max_model_len: int
    cache_config: dict[str, str]  # vllm:cache_config_info labels (without engine)
    start_time: float  # Unix time the process started (process_start_time_seconds, _created)


@dataclass
class HttpStats:
    """``http_requests_total`` as vLLM's API server holds it: answers by (handler, method,
    status class such as "2xx"), each series in the order it was first counted, the order
    prometheus_client prints them in. The instrumentator creates a series on its first
    answer, so none has a zero count."""

    answered: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def count(self, handler: str, method: str, status: int, times: float = 1.0) -> None:
        if times <= 0:
            return
        key = (handler, method, f"{status // 100}xx")
        self.answered[key] = self.answered.get(key, 0.0) + times
