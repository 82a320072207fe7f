"""The flag changes against KV pressure (engine/kv.py's ``kv_advice``): within the catalogue,
from what is known, and never below what vLLM starts with."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_diagnosis import CAPACITY
from vkvagent.engine.kv import kv_advice
from vkvagent.knowledge import flags


def kv_suggestion(*args: Any) -> dict[str, Any]:
    return {name: advice.value for name, advice in kv_advice(*args).items()}


def test_kv_suggestions_stay_within_the_catalogue_and_only_use_what_is_known() -> None:
    full = kv_suggestion(CAPACITY, {"gpu-memory-utilization": 0.9, "max-num-seqs": 256,
                                    "max-num-batched-tokens": 16384}, {})  # fmt: skip
    assert full == {"gpu-memory-utilization": 0.93, "max-num-seqs": 32,
                    "max-num-batched-tokens": 8192}  # fmt: skip
    flags.validate(full, None, check_versions=False)  # raises if any is out of range
    # Already high memory, a cap already lower, a small chunk: nothing to suggest.
    tight = kv_suggestion(CAPACITY, {"gpu-memory-utilization": 0.95, "max-num-seqs": 16,
                                     "max-num-batched-tokens": 2048}, {})  # fmt: skip
    assert tight == {}
    # Nothing known but the cache_config label and the fresh concurrency.
    assert kv_suggestion(CAPACITY, {}, {"gpu_memory_utilization": "0.92"}) == {
        "gpu-memory-utilization": 0.95,
        "max-num-seqs": 32,
    }


@pytest.mark.parametrize(
    ("given", "chunk"),
    [
        ({"enable-chunked-prefill": True, "max-model-len": 8192}, 4096),
        ({"enable-chunked-prefill": False, "max-model-len": 8192}, None),  # already the floor
        ({"enable-chunked-prefill": False}, None),  # the floor is not known
        ({"max-model-len": 6000}, 6000),  # chunking unknown (V0's default may be off)
        ({}, 4096),
    ],
)
def test_the_prefill_chunk_is_never_halved_below_what_vllm_starts_with(
    given: dict[str, Any], chunk: int | None
) -> None:
    suggested = kv_suggestion(CAPACITY, {**given, "max-num-batched-tokens": 8192}, {})
    assert suggested.get("max-num-batched-tokens") == chunk
    # Whatever is suggested, vLLM starts with it.
    merged = {**given, "max-num-batched-tokens": 8192, **suggested}
    flags.validate(merged, None, check_versions=False)


def test_a_suggested_memory_share_is_one_the_agent_may_set() -> None:
    from vkvagent.engine.kv import MEMORY_SHARE_TOP
    from vkvagent.knowledge.flags import CATALOGUE

    limit = CATALOGUE["gpu-memory-utilization"]
    assert limit.minimum is not None and limit.maximum is not None
    assert limit.minimum < MEMORY_SHARE_TOP <= limit.maximum
