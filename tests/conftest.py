from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vkvagent.engine.baseline import WindowStats
from vkvagent.engine.samples import VllmMetrics

FIXTURES = Path(__file__).parent / "fixtures"
METRIC_PAGES = FIXTURES / "metrics"


def read_page(name: str) -> str:
    return (METRIC_PAGES / name).read_text(encoding="utf-8")


def page(*families: str) -> str:
    """A small exposition page from family blocks; every line newline-terminated."""
    return "".join(block.strip("\n") + "\n" for block in families)


def counter(name: str, value: float, labels: str = 'model_name="m"') -> str:
    return f"# HELP {name} help\n# TYPE {name} counter\n{name}{{{labels}}} {value}\n"


def gauge(name: str, value: float, labels: str = 'model_name="m"') -> str:
    return f"# HELP {name} help\n# TYPE {name} gauge\n{name}{{{labels}}} {value}\n"


@pytest.fixture(autouse=True)
def _umask_kept() -> Iterator[None]:
    """A test that runs `vkvagent run` in-process tightens the process's umask; the systemd
    sandboxes of later tests need the usual one for the directories they create."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield
    os.umask(previous)


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


def metrics(**values: object) -> VllmMetrics:
    """A VllmMetrics with every signal absent except those given."""
    fields: dict[str, object] = {name: None for name in VllmMetrics.__dataclass_fields__}
    fields.update(flavor="v1-latest", models=("m",), engines=1, prefix_cache_unit=None)
    del fields["cache_config"], fields["version"], fields["warnings"], fields["per_engine"]
    fields.update(values)
    return VllmMetrics(**fields)  # type: ignore[arg-type]


def window_stats(**values: float | None) -> WindowStats:
    """A window of a steady server at 845 generated tokens/s (regime 19), unless told
    otherwise: the engine tests' common starting point."""
    base: dict[str, float | None] = dict(
        seconds=300.0, running=17.6, waiting=0.0, kv_usage=0.45, tokens_per_s=5515.0,
        generation_tokens_per_s=845.0, requests_per_s=4.04, arrivals_per_s=4.04,
        preemptions_per_s=0.0, itl=0.0225, itl_p50=0.018, ttft_p50=0.25, prompt_share=0.847,
        per_request=48.0, prompt_per_request=1156.0, output_per_request=209.0,
    )  # fmt: skip
    base.update(values)
    return WindowStats(**base)  # type: ignore[arg-type]
