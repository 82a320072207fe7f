"""Finding vLLM's reason for not starting in what its unit logged: real logs of vLLM 0.32
(tests/fixtures/vllm/, captured from the CPU build; paths shortened)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkvagent.adapters.unitlog import MAX_LINE, error_line

LOGS = Path(__file__).parent / "fixtures" / "vllm"


@pytest.mark.parametrize(
    ("log", "reason"),
    [
        # pydantic's "1 validation error for ModelConfig" wraps the line that says it.
        (
            "start-refused-max-model-len.log",
            "Value error, User-specified max_model_len (100000) is greater than the derived "
            "max_model_len (max_position_embeddings=2048.0",
        ),
        # A worker's ValueError, 120 lines before the engine core's and the API server's
        # "Engine core initialization failed. See root cause above."
        (
            "start-refused-memory.log",
            "ValueError: Available memory on node 0 (5.85/9.71 GiB) on startup is less than "
            "desired CPU memory utilization (0.98, 9.52 GiB).",
        ),
        # argparse, after 300 lines of usage.
        (
            "start-refused-unknown-flag.log",
            "api_server.py: error: unrecognized arguments: --no-such-flag",
        ),
        # SIGKILL leaves no root cause: the API server's own error is the best there is.
        (
            "engine-core-killed.log",
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        ),
    ],
)
def test_the_root_cause_is_found_in_a_real_vllm_log(log: str, reason: str) -> None:
    found = error_line((LOGS / log).read_text().splitlines())
    assert found is not None and found.startswith(reason), found
    assert "pid=" not in found and " ERROR " not in found  # vLLM's logger prefix is gone
    assert len(found) <= MAX_LINE


def test_a_log_without_an_error_has_no_reason() -> None:
    lines = (LOGS / "start-refused-memory.log").read_text().splitlines()[:40]
    assert error_line(lines) is None  # start-up chatter, warnings that quote an OSError
    assert error_line([]) is None


def test_a_long_error_is_cut_to_one_bounded_line() -> None:
    found = error_line(["RuntimeError: " + "x" * 2000])
    assert found is not None and len(found) == MAX_LINE and found.endswith("...")
