"""The KV cache: its symptoms, and the flag changes that give it more room.

Three symptoms of the cache, each told against the fresh server: pressure (near full,
preempting, requests waiting), stranding (requests waiting beside free KV while the server
serves clearly less than its fresh self did without a queue) and a leak (blocks held beyond
what the running requests take at their fresh share, enough that the heaviest load this run
served cleanly would fill the cache). Diagnosis holds them (``Hysteresis``) and names the
cause; against pressure, ``kv_advice`` argues the flag changes an operator may review
(docs/tuning.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vkvagent.engine.baseline import Capacity, WindowStats
from vkvagent.engine.samples import FlagValue, num_text

if TYPE_CHECKING:  # diagnosis imports this module: its settings are a type here
    from vkvagent.engine.diagnosis import DiagnosisSettings


# The largest --gpu-memory-utilization a suggestion goes to: what is left is the CUDA context,
# activations and fragmentation (flags.CATALOGUE lets an operator go to 0.98).
MEMORY_SHARE_TOP = 0.95
# Prefix caching can only save prompt work: suggested when prompt tokens are at least this share
# of the tokens processed (docs/tuning.md).
PROMPT_HEAVY = 0.5
# Prefix-cache hits / queries at or above this: requests share prefixes, so the block size,
# the granularity of a hit, matters.
PREFIX_SHARED = 0.2
# CUDA's default block size (vLLM's CacheConfig); other platforms pick their own (CPU: 128).
CUDA_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Leak:
    """KV blocks held beyond what the running requests take at their fresh share."""

    leaked: float  # the share of the cache leaked
    load: float  # the heaviest load (requests/s) this run served cleanly, or the fresh peak's
    needs: float  # the KV usage that load takes on the fresh server
    room: float  # the leak at which that load fills the cache (kv_full), at least kv_leak
    full: float  # kv_full

    @property
    def loss(self) -> float:
        """The share of that load the leak leaves no room for: what waiting costs once it
        comes again (the cache holds kv_full - leaked of the ``needs`` it takes)."""
        return min(1.0, max(0.0, self.leaked + self.needs - self.full) / self.needs)


def kv_leak(
    s: DiagnosisSettings,
    stats: WindowStats | None,
    fresh: Mapping[str, float],
    capacity: Capacity | None,
    heaviest: float | None,
) -> Leak | None:
    """The usage beyond what the running requests take at their fresh share (a request's
    share hardly depends on the load, so any fresh regime tells; the request mix is checked
    apart), against the room the heaviest load this run served cleanly leaves: the fresh
    peak's usage scaled by the load (a lower bound: a busier server holds each request
    longer). None without a fresh share and a fresh peak to tell by."""
    if stats is None or stats.kv_usage is None or stats.running is None:
        return None
    usage, running = fresh.get("kv_usage"), fresh.get("running")
    if not usage or not running or capacity is None or not capacity.kv_usage:
        return None
    if not capacity.requests_per_s > 0:
        return None
    load = max(capacity.requests_per_s, heaviest or 0.0)
    needs = capacity.kv_usage * load / capacity.requests_per_s
    leaked = stats.kv_usage - stats.running * usage / running
    return Leak(leaked, load, needs, max(s.kv_leak, s.kv_full - needs), s.kv_full)


def kv_signature(s: DiagnosisSettings, stats: WindowStats) -> bool:
    """KV near full, preemptions going on and requests waiting: all three together."""
    return (
        stats.kv_usage is not None
        and stats.kv_usage >= s.kv_full
        and (stats.preemptions_per_s or 0.0) >= s.min_preemptions_per_s
        and (stats.waiting or 0.0) >= s.min_waiting
    )


def kv_clear(s: DiagnosisSettings, stats: WindowStats) -> bool:
    """KV pressure is over: usage well below full, or no preemption, or no queue."""
    return (
        stats.kv_usage is None
        or stats.kv_usage < s.kv_stranded_below
        or (stats.preemptions_per_s or 0.0) < s.min_preemptions_per_s
        or (stats.waiting or 0.0) < s.min_waiting
    )


def stranded_signature(
    s: DiagnosisSettings, stats: WindowStats | None, capacity: Capacity | None
) -> bool | None:
    """Requests wait beside free KV while the server serves clearly less than the load its
    fresh self served without a queue. None: no fresh capacity to compare with."""
    if stats is None or stats.kv_usage is None or stats.waiting is None:
        return None
    if stats.waiting < s.min_waiting or stats.kv_usage >= s.kv_stranded_below:
        return False
    if capacity is None or stats.generation_tokens_per_s is None:
        return None
    return stats.generation_tokens_per_s < capacity.generation_tokens_per_s * s.enter_ratio


@dataclass(frozen=True)
class Advice:
    """One flag change a diagnosis suggests, and why (words with the numbers behind them)."""

    value: FlagValue
    reason: str


def kv_advice(
    capacity: Capacity,
    flags: Mapping[str, FlagValue],
    cache_config: Mapping[str, str],
    *,
    stats: WindowStats | None = None,
    prefix_hit_ratio: float | None = None,
    on_gpu: bool = False,
) -> dict[str, Advice]:
    """Flag changes that give KV more room or ask less of it, for an operator to review, each
    argued: a little more memory for the cache; at most 1.5 times the concurrency the fresh
    server needed at its heaviest clean load (more only preempts); half the prefill chunk;
    prefix caching where the request mix is mostly prompt; CUDA's block size where an
    operator's larger one costs prefix-cache hits. Only values derived from what is known,
    each within the catalogue's limits; unknown never suggests (docs/tuning.md).

    ``flags``: the flags in effect; ``cache_config``: vLLM's ``cache_config_info`` labels;
    ``on_gpu``: NVML saw a GPU (the block size is only suggested there: other platforms pick
    their own, the CPU build 128)."""
    out: dict[str, Advice] = {}
    pressure = (
        f"KV usage {num_text(stats.kv_usage)} with "
        f"{num_text(stats.preemptions_per_s)} preemptions/s"
        if stats is not None
        else "KV pressure"
    )
    memory = _number(flags.get("gpu-memory-utilization"))
    if memory is None:
        memory = _number(cache_config.get("gpu_memory_utilization"))
    top = MEMORY_SHARE_TOP
    # vLLM 0.32's --kv-cache-memory-bytes sizes the KV cache itself: the share does not.
    sized = _number(cache_config.get("kv_cache_memory_bytes"))
    if memory is not None and memory < top and not sized:
        share = round(min(top, memory + 0.03), 2)
        out["gpu-memory-utilization"] = Advice(
            share,
            f"{pressure} at a load the fresh server served cleanly: {memory:g} -> {share:g} "
            "gives the KV cache more blocks (what is left after weights and activations is "
            f"KV), the remedy vLLM's preemption warning names; never above {top:g}",
        )
    seqs = _number(flags.get("max-num-seqs"))
    if capacity.running is not None:
        cap = max(8, math.ceil(capacity.running * 1.5 / 8) * 8)
        if seqs is None or cap < seqs:
            was = "no cap set" if seqs is None else f"{seqs:g} allowed"
            out["max-num-seqs"] = Advice(
                cap,
                f"the fresh server ran {capacity.running:.1f} requests at once at its heaviest "
                f"clean load ({capacity.requests_per_s:.2f} requests/s); {cap} (1.5 times that, "
                f"in steps of 8) keeps the batch the KV cache held ({was}): more are admitted "
                "only to be preempted",
            )
    batched = _number(flags.get("max-num-batched-tokens"))
    chunked = flags.get("enable-chunked-prefill")
    length = _number(flags.get("max-model-len"))
    # Without chunked prefill a step must hold a whole prompt: never below --max-model-len,
    # and nothing when that is not known (vLLM refuses to start below it).
    if batched is not None and batched > 2048 and (chunked is not False or length is not None):
        # Never below 2048, nor below the sequences one step must hold.
        sequences = _number(out["max-num-seqs"].value) if "max-num-seqs" in out else seqs
        floor = max(2048, sequences or 1, length if chunked is not True and length else 0)
        chunk = int(max(floor, batched // 2))
        if chunk < batched:
            out["max-num-batched-tokens"] = Advice(
                chunk,
                f"half the prefill chunk ({batched:g} -> {chunk}): a step admits fewer new "
                "prompt tokens into the KV cache at once, so a burst of long prompts preempts "
                "less; never below 2048, --max-num-seqs, nor, without chunked prefill, "
                "--max-model-len",
            )
    caching = _flag_bool(
        flags.get("enable-prefix-caching"), cache_config.get("enable_prefix_caching")
    )
    prompt_share = stats.prompt_share if stats is not None else None
    if caching is False and prompt_share is not None and prompt_share >= PROMPT_HEAVY:
        caching = True
        out["enable-prefix-caching"] = Advice(
            True,
            f"prompt tokens are {prompt_share:.0%} of the tokens processed and prefix caching "
            "is off: a prefix that requests share (a system prompt, a conversation so far) is "
            "prefilled and held in KV once per request instead of once; cached blocks no "
            "request holds count as free, so it takes no KV room from running requests",
        )
    block = _number(flags.get("block-size"))  # only an operator's own choice, never a platform's
    shared = (
        prefix_hit_ratio >= PREFIX_SHARED
        if prefix_hit_ratio is not None
        else prompt_share is not None and prompt_share >= PROMPT_HEAVY
    )
    if on_gpu and caching and block is not None and block > CUDA_BLOCK_SIZE and shared:
        hits = (
            f"{prefix_hit_ratio:.0%} of prompt tokens are prefix-cache hits"
            if prefix_hit_ratio is not None
            else f"prompt tokens are {num_text(prompt_share, '.0%')} of the tokens processed"
        )
        out["block-size"] = Advice(
            CUDA_BLOCK_SIZE,
            f"{hits}, and a hit is counted in whole blocks: with --block-size {block:g} each "
            f"shared prefix loses on average {block / 2:g} tokens of hits and each request "
            f"half a block of KV; {CUDA_BLOCK_SIZE} is CUDA's default",
        )
    return out


def _flag_bool(value: FlagValue | None, label: str | None) -> bool | None:
    """A boolean flag in effect: as set on the command line, else as cache_config_info shows
    it (``"True"``/``"False"``); None when neither says."""
    if isinstance(value, bool):
        return value
    if label in ("True", "False"):
        return label == "True"
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
