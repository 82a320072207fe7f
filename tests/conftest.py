from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from vkvagent.engine.baseline import WindowStats
from vkvagent.engine.samples import VllmMetrics
from vkvagent.knowledge import hardening

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
def _no_unit_installed_on_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """`config check` reads vkvagent.service's sandbox from this host, where tests/
    test_packaging.py installs the deb for a while: a test beside it on another worker would
    see that unit's sandbox and its warnings. Tests read an empty root; test_hardening's own
    ``root`` fixture installs the unit where it wants it."""
    monkeypatch.setattr(hardening, "ROOT", FIXTURES / "no-root")


# No time limit on an example: on 2 cores shared by several test workers and a vLLM, a fast
# example can take over Hypothesis's 200 ms now and then, and fail a test at random. Speed is
# the benchmarks' to measure (bench/), not the property tests'.
settings.register_profile("vkvagent", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("vkvagent")

# The modules with tests marked `vllm` (the real vLLM). `make unit` runs those tests alone,
# first; a `pytest -n N` over all of them still runs one vLLM at a time (each takes a core and
# 3 GB): pytest-xdist's scheduler sees test ids, not marks, so the modules are named here, and
# a `vllm` test elsewhere stops the run.
REAL_VLLM_MODULES = frozenset({
    "tests/test_flag_facts.py", "tests/test_vllm_drain.py", "tests/test_vllm_hangs.py",
    "tests/test_vllm_real.py", "tests/test_vllm_auth.py", "tests/test_vllm_container.py",
})  # fmt: skip


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that boot a systemd first: they are the long ones (a minute or more each),
    so under pytest-xdist the short ones fill in around them instead of one of them ending
    the run alone."""
    stray = [
        item.nodeid
        for item in items
        if item.get_closest_marker("vllm") and _module(item.nodeid) not in REAL_VLLM_MODULES
    ]
    if stray:
        raise pytest.UsageError(f"add their modules to REAL_VLLM_MODULES (conftest.py): {stray}")
    booting = {_module(item.nodeid) for item in items if item.get_closest_marker("systemd")}
    items.sort(key=lambda item: _module(item.nodeid) not in booting)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist: a module's tests on one worker, as in a serial run (its module
    fixtures, such as a built package or a booted sandbox, are made once), and the real
    vLLM's modules together on one."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):  # type: ignore[misc]  # xdist has no type hints
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "the real vLLM" if module in REAL_VLLM_MODULES else module

    return ByModule(config, log)


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
