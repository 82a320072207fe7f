"""The active probe: one tiny completion, to learn whether vLLM serves when its gauges cannot say.

A hung vLLM 0.32 engine keeps /health at 200 and /metrics fast, and its gauges keep the last
values the engine published: often 0 running and 0 waiting, which reads as idle while clients
wait. Only a request tells the two apart. The daemon sends one (one output token, greedy, to
the served model, under its own timeout) when the engine's counters have not moved for a while
(the engine decides when: ``Decision.probe_wanted``), never more than one at a time, in a thread
of its own so a hung server never holds up the tick.

Outcomes: ``ok`` (a completion came back), ``timeout`` (the connection was accepted and nothing
came back in time: what a hung server does), ``error`` (vLLM answered 5xx, or broke the
connection off), ``refused`` (nothing listens: vLLM is down or still loading; /metrics says as
much) and ``unusable`` (any other answer below 500: a redirect, a wrong model name, a 401
for an API key the probe lacks or vLLM refuses; it can tell nothing until the configuration is
fixed). The probe carries vLLM's API key (vkvagent.apikey) when vkvagent has one. Only
``timeout`` and ``error`` count as an unanswered probe for the stall diagnosis.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from vkvagent.adapters.vllm import ScrapeError, VllmClient
from vkvagent.engine.progress import ProbeFacts

UNANSWERED = frozenset({"timeout", "error"})  # outcomes that count towards a stall
PROMPT = "ping"  # a token or two in every tokenizer; prefix caching makes repeats cheaper


@dataclass(frozen=True)
class ProbeResult:
    """One probe: when it was sent (monotonic and UTC), what came of it, after how long."""

    sent: float  # monotonic seconds
    time: float  # UTC Unix seconds
    outcome: str  # one of status.PROBE_OUTCOMES
    latency: float  # seconds from sending to the answer, or to giving up
    detail: str = ""  # the error, for every outcome but ok

    @property
    def unanswered(self) -> bool:
        return self.outcome in UNANSWERED

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "outcome": self.outcome,
            "latency_s": self.latency,
            "detail": self.detail,
        }


def outcome_of(error: ScrapeError | None) -> str:
    """The outcome a probe's error stands for (None: it was answered)."""
    if error is None:
        return "ok"
    if error.silent:
        return "timeout"
    if error.refused:
        return "refused"
    if error.status is not None and error.status < 500:
        return "unusable"  # a redirect, a wrong model, a missing API key: nothing of the engine
    return "error"


class Prober:
    """Sends probes one at a time and remembers what the engine needs of them (``facts``).

    ``client`` carries the probe's timeout as its read timeout; ``wall`` and ``mono`` are the
    daemon's clocks."""

    def __init__(
        self,
        client: VllmClient,
        *,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self._wall, self._mono = wall, mono
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._in_flight: float | None = None  # monotonic time the probe in flight was sent
        self._finished: list[ProbeResult] = []  # not yet collected
        self._answered: float | None = None  # sent time of the last answered probe
        self._unanswered: float | None = None  # the latest unanswered one since then
        self._last_sent: float | None = None
        self.last: ProbeResult | None = None

    @property
    def in_flight(self) -> float | None:
        """When the probe in flight was sent (monotonic), or None."""
        with self._lock:
            return self._in_flight

    def send(self, model: str) -> bool:
        """Send a probe to ``model`` unless one is in flight; whether one was sent."""
        with self._lock:
            if self._in_flight is not None:
                return False
            sent = self._in_flight = self._last_sent = self._mono()
        at = self._wall()
        thread = threading.Thread(
            target=self._run, args=(model, sent, at), name="vkvagent-probe", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (resource limits): no probe this time
            with self._lock:
                self._in_flight = None
            return False
        self._thread = thread
        return True

    def collect(self) -> list[ProbeResult]:
        """The probes finished since the last call, oldest first."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def facts(self) -> ProbeFacts:
        """What the engine reads: the last answered probe, the latest unanswered one since
        and the last sent (monotonic send times)."""
        with self._lock:
            return ProbeFacts(self._answered, self._unanswered, self._last_sent)

    def wait(self, timeout: float | None = None) -> None:
        """Until the probe in flight has finished, or ``timeout`` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _unauthorized(self, exc: ScrapeError) -> str:
        """A 401: a configuration problem, not a fault of vLLM's, in words that say which."""
        key = self.client.api_key
        if key is None:
            return (
                f"{exc}: vLLM wants an API key and vkvagent found none: set [vllm] "
                "api_key_file, or give vLLM its key in its unit (--api-key, "
                "Environment=VLLM_API_KEY or EnvironmentFile=)"
            )
        return (
            f"{exc}: vLLM refuses the API key from {key.source}, a configuration problem, not "
            "a fault of vLLM's: give vkvagent the key vLLM has"
        )

    def _run(self, model: str, sent: float, at: float) -> None:
        error: ScrapeError | None = None
        try:
            answer = self.client.post_json(
                "/v1/completions",
                {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
            )
            if not isinstance(answer, dict) or not answer.get("choices"):
                error = ScrapeError(
                    f"{self.client.base}/v1/completions: no completion in the answer"
                )
        except ScrapeError as exc:
            error = ScrapeError(self._unauthorized(exc), status=401) if exc.status == 401 else exc
        except Exception as exc:  # a bug must not leave the probe in flight for ever
            error = ScrapeError(f"probe failed: {type(exc).__name__}: {exc}")
        outcome = outcome_of(error)
        result = ProbeResult(sent, at, outcome, self._mono() - sent, str(error or ""))
        with self._lock:
            self._in_flight = None
            self._finished.append(result)
            self.last = result
            if outcome == "ok":
                self._answered, self._unanswered = sent, None
            elif result.unanswered:
                self._unanswered = sent
