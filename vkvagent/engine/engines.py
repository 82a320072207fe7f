"""Data-parallel engines: each one over the window, and the one far behind its peers.

With ``--data-parallel-size`` above 1, vLLM runs several engines behind one API server, and
its page gives each one's signals besides the totals (``VllmMetrics.per_engine``). Summed and
averaged over every engine, the totals can look fine while one engine is saturated or its
requests are stranded: each engine's window (``EngineWindow``, made by tick) lets diagnosis
compare it with its peers (``lagging``), and says in the evidence how each one fares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkvagent.engine.rates import mean
from vkvagent.engine.samples import Sample, num_text

if TYPE_CHECKING:  # diagnosis imports this module: its settings are a type here
    from vkvagent.engine.diagnosis import DiagnosisSettings


@dataclass(frozen=True)
class EngineWindow:
    """One data-parallel engine over the window: its means and rates (None: not on the page)."""

    engine: str
    kv_usage: float | None
    waiting: float | None
    generation_tokens_per_s: float | None
    preemptions_per_s: float | None

    def words(self) -> str:
        return (
            f"engine {self.engine}: KV {num_text(self.kv_usage)}, {num_text(self.waiting, '.1f')} "
            f"waiting, {num_text(self.generation_tokens_per_s, '.0f')} tokens/s"
        )


def lagging_engine(
    s: DiagnosisSettings, engines: Sequence[EngineWindow], ratio: float
) -> tuple[EngineWindow, str] | None:
    """One data-parallel engine with requests waiting on it that serves less than ``ratio``
    of what its peers serve (their median): saturated or stranded while the totals, averaged
    and summed over every engine, look fine. The engine and the words."""
    if len(engines) < 2:
        return None
    for engine in engines:
        rate = engine.generation_tokens_per_s
        peers = sorted(
            e.generation_tokens_per_s
            for e in engines
            if e is not engine and e.generation_tokens_per_s is not None
        )
        if rate is None or not peers or (engine.waiting or 0.0) < s.min_waiting:
            continue
        peer = peers[len(peers) // 2]
        if peer > 0 and rate < peer * ratio:
            return engine, (
                f"engine {engine.engine} of {len(engines)}: {num_text(engine.waiting, '.1f')} "
                f"requests wait on it at KV usage {num_text(engine.kv_usage)}, "
                f"{num_text(engine.preemptions_per_s)} preemptions/s, serving {rate:.0f} "
                f"tokens/s where its peers serve {peer:.0f}"
            )
    return None


def engine_windows(segment: list[Sample]) -> tuple[EngineWindow, ...]:
    """Each data-parallel engine over the window: mean gauges and counter rates, from the
    per-engine signals of the page (none with fewer than two engines)."""
    pages = [s.vllm for s in segment if s.vllm is not None]
    if len(pages) < 2 or len(pages[-1].per_engine) < 2:
        return ()
    seconds = segment[-1].mono - segment[0].mono
    first = {e.engine: e for e in pages[0].per_engine}
    out = []
    for last in pages[-1].per_engine:
        seen = [e for page in pages for e in page.per_engine if e.engine == last.engine]
        start = first.get(last.engine)
        out.append(
            EngineWindow(
                engine=last.engine,
                kv_usage=mean([e.kv_cache_usage for e in seen]),
                waiting=mean([e.num_requests_waiting for e in seen]),
                generation_tokens_per_s=_rate(
                    start.generation_tokens_total if start else None,
                    last.generation_tokens_total,
                    seconds,
                ),
                preemptions_per_s=_rate(
                    start.num_preemptions_total if start else None,
                    last.num_preemptions_total,
                    seconds,
                ),
            )
        )
    return tuple(out)


def _rate(old: float | None, new: float | None, seconds: float) -> float | None:
    if old is None or new is None or seconds <= 0 or new < old:
        return None
    return (new - old) / seconds
