"""The simulator's /metrics page against the fixture pages of every vLLM version it imitates,
and through the agent's own normaliser."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import read_page
from vkvagent.engine.samples import VllmMetrics
from vkvagent.knowledge.vllm_metrics import FLAVORS, WANTED, Normaliser
from vkvagent.sim.exposition import (
    CONTENT_TYPE,
    build_1_2_5_buckets,
    families,
    histogram_bounds,
    render,
)
from vkvagent.sim.stats import EngineStats, HttpStats, Observations, ServerInfo

V0_07 = "v0-0.7-aibrix-doc-qwen2.5-coder-1.5b.prom"
V1_08 = "v1-0.8-production-stack-318-qwen2.5-coder-32b.prom"
REAL_032 = "v1-0.32-cpu.prom"  # the real vLLM 0.32 under load (SOURCES.md)
# Families whose values the simulator derives rather than copies from EngineStats (no swap, no
# CPU cache, a lifetime-average throughput, no deferred waiting): their lines are compared
# without the value.
V0_DERIVED = frozenset(
    {
        "vllm:num_requests_swapped",
        "vllm:cpu_cache_usage_perc",
        "vllm:avg_prompt_throughput_toks_per_s",
        "vllm:avg_generation_throughput_toks_per_s",
    }
)


@dataclass(frozen=True)
class FixturePage:
    name: str
    flavor: str
    max_model_len: int  # as the page's 1-2-5 token buckets show
    cut: bool = False  # a published fragment: compare what it shows, as a prefix
    same_families: bool = True  # the simulator prints exactly the page's vllm: families
    derived: frozenset[str] = field(default_factory=frozenset)


PAGES = (
    FixturePage("v0-0.6.prom", "v0", 32768, derived=V0_DERIVED),
    FixturePage(V0_07, "v0", 32768, cut=True, derived=V0_DERIVED),
    FixturePage(V1_08, "v1-0.8", 32768, cut=True),
    FixturePage("v1-0.10.prom", "v1-0.10", 40960),
    # v1-latest prints vLLM 0.32's family set, calibrated against a real 0.32 page (the last
    # one here). The older pages' families are all in it, but later releases added families
    # (0.13 to 2026: num_requests_waiting_by_reason, prompt_tokens_by_source,
    # prompt_tokens_cached, request_prefill_kv_computed_tokens, request_num_preemptions and a
    # fifth finished_reason, "repetition"; by 0.32: estimated_*_per_gpu,
    # prompt_tokens_cached_by_source, admission_rejections): theirs are compared as prefixes.
    FixturePage("v1-0.13.prom", "v1-latest", 65536, same_families=False),
    FixturePage(
        "v1-2026.prom",
        "v1-latest",
        40960,
        same_families=False,
        derived=frozenset({"vllm:num_requests_waiting_by_reason"}),
    ),
    FixturePage(REAL_032, "v1-latest", 512),
)
PAGE_IDS = ["-".join(p.name.replace(".prom", "").split("-")[:2]) for p in PAGES]
assert len(set(PAGE_IDS)) == len(PAGE_IDS)
START = 1_755_012_345.67


# -- reading a fixture page back into simulator inputs -------------------------------------------

_SCALARS = {
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
    "kv_cache_usage_perc": "kv_usage",
    "gpu_cache_usage_perc": "kv_usage",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "num_preemptions": "preemptions",
    "prefix_cache_queries": "prefix_queries",
    "gpu_prefix_cache_queries": "prefix_queries",
    "prefix_cache_hits": "prefix_hits",
    "gpu_prefix_cache_hits": "prefix_hits",
}


@dataclass
class PageInputs:
    model: str = ""
    cache_config: dict[str, str] = field(default_factory=dict)
    engines: dict[str, EngineStats] = field(default_factory=dict)
    lora_time: float = 0.0
    process_start: float = START
    http: HttpStats | None = None  # None: the page has no http_requests_total


def page_inputs(text: str) -> PageInputs:
    """What the simulator would need to print this page: the model, cache config and, per
    engine, the values of the families it copies from EngineStats."""
    out = PageInputs()
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    sums: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "process_start_time_seconds":
            out.process_start = family.samples[0].value
        if family.name == "http_requests":
            out.http = HttpStats()
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "http_requests_total":
                    answered = (labels["handler"], labels["method"], labels["status"])
                    out.http.answered[answered] = sample.value
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        name = family.name[len("vllm:") :]
        for sample in family.samples:
            labels = dict(sample.labels)
            if name == "cache_config_info":
                out.cache_config = {k: v for k, v in labels.items() if k != "engine"}
                continue
            if name == "lora_requests_info":
                out.lora_time = sample.value
                continue
            out.model = labels["model_name"]
            engine_id = labels.get("engine", "0")
            engine = out.engines.setdefault(engine_id, EngineStats(finished={}))
            key = (engine_id, name)
            if family.type == "histogram":
                if sample.name.endswith("_bucket"):
                    buckets.setdefault(key, {})[float(labels["le"])] = sample.value
                elif sample.name.endswith("_sum"):
                    sums[key] = sample.value
            elif name == "request_success":
                engine.finished[labels["finished_reason"]] = sample.value
            elif name == "gpu_prefix_cache_hit_rate" and sample.value >= 0:
                # V0 prints hits / queries; any pair with that ratio reproduces it.
                engine.prefix_queries, engine.prefix_hits = 100.0, round(sample.value * 100)
            elif name in _SCALARS:
                setattr(engine, _SCALARS[name], sample.value)
    for (engine_id, name), cumulative in buckets.items():
        bounds = tuple(sorted(b for b in cumulative if b != math.inf))
        running = [cumulative[b] for b in bounds]
        counts = [later - earlier for earlier, later in zip([0.0, *running], running)]
        counts.append(cumulative.get(math.inf, running[-1]) - running[-1])  # 0 on a cut page
        out.engines[engine_id].histograms[name] = Observations(
            bounds, counts, sums.get((engine_id, name), 0.0)
        )
    return out


def render_like(fixture: FixturePage) -> tuple[str, str]:
    """The fixture page and the simulator's page for the same inputs."""
    text = read_page(fixture.name)
    inputs = page_inputs(text)
    info = ServerInfo(
        model=inputs.model,
        flavor=fixture.flavor,
        version="0.0.0",
        max_model_len=fixture.max_model_len,
        cache_config=inputs.cache_config,
        start_time=inputs.process_start,
    )
    engines = [inputs.engines[k] for k in sorted(inputs.engines, key=int)]
    return text, render(info, engines, now=inputs.lora_time, http=inputs.http).decode("utf-8")


def parse(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def label_names(family: Metric) -> frozenset[str]:
    return frozenset(name for sample in family.samples for name in sample.labels)


def blocks(text: str) -> dict[str, list[str]]:
    """The page's lines grouped by family (the name on its HELP/TYPE lines), in page order."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            current = out.setdefault(line.split()[2], [])
        elif not line or line.startswith("#"):
            continue  # the fragments' "# --- ..." notes
        current.append(line)
    return out


def simulated_keys(text: str) -> list[str]:
    """The families the simulator prints as vLLM does: vLLM's own and, of the instrumentator's
    families, http_requests_total (with its _created)."""
    return [name for name in blocks(text) if name.startswith(("vllm:", "http_requests_"))]


# -- fidelity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", PAGES, ids=PAGE_IDS)
def test_every_fixture_family_is_printed_with_its_type_and_labels(fixture: FixturePage) -> None:
    text, sim = render_like(fixture)
    ours = parse(sim)
    for name, family in parse(text).items():
        if name.startswith(("http_", "process_", "python_")) and fixture.flavor == "v0":
            # The 0.7 page ends with a process fragment from another capture (its start time
            # is two months after the page's lora timestamp); V0 behind its multiprocessing
            # front end prints no process families, as the whole 0.6 page shows.
            continue
        if name.startswith("http_") and name not in ("http_requests", "http_requests_created"):
            continue  # the instrumentator's families that nothing reads: not simulated
        assert name in ours, f"{fixture.name}: {name} missing"
        assert ours[name].type == family.type, name
        if family.samples:  # a cut page may declare a family and stop before its samples
            assert label_names(ours[name]) == label_names(family), name
        if family.documentation and name.startswith(("vllm:", "http_requests")):
            assert ours[name].documentation == family.documentation, name


@pytest.mark.parametrize("fixture", PAGES, ids=PAGE_IDS)
def test_page_reproduces_the_fixture_lines(fixture: FixturePage) -> None:
    """Fed the fixture's own values, the simulator prints the fixture's vllm: and
    http_requests_total lines: HELP, TYPE, label sets and order, float formatting, histogram
    layout. Only _created timestamps and the derived families' values may differ."""
    text, sim = render_like(fixture)
    expected, ours = blocks(text), blocks(sim)

    def comparable(name: str, lines: list[str]) -> list[str]:
        if name.endswith("_created") or name in fixture.derived:
            return [line if line[0] == "#" else line.rsplit(" ", 1)[0] for line in lines]
        return lines

    for name in simulated_keys(text):
        want = comparable(name, expected[name])
        got = comparable(name, ours[name])
        if not want[0].startswith("# HELP"):  # the 0.7 page begins after a HELP line
            got = [line for line in got if not line.startswith("# HELP")]
        if fixture.same_families and not fixture.cut:
            assert got == want, name
        else:
            assert got[: len(want)] == want, name
    if fixture.same_families and not fixture.cut:
        assert simulated_keys(sim) == simulated_keys(text)
    else:  # the page's families appear in the page's order
        ours_in_order = iter(simulated_keys(sim))
        assert all(name in ours_in_order for name in simulated_keys(text))


@pytest.mark.parametrize(
    "fixture",
    [p for p in PAGES if not p.cut],
    ids=[i for p, i in zip(PAGES, PAGE_IDS) if not p.cut],
)
def test_agent_reads_the_same_series_as_on_the_fixture(fixture: FixturePage) -> None:
    """The converse: no series the agent reads is printed unless that version prints it."""
    text, sim = render_like(fixture)

    def wanted(page: str) -> set[str]:
        return {s.name for f in parse(page).values() for s in f.samples} & WANTED

    assert wanted(sim) == wanted(text)


@pytest.mark.parametrize("fixture", PAGES, ids=PAGE_IDS)
def test_histogram_bounds_match_the_fixture_buckets(fixture: FixturePage) -> None:
    bounds = histogram_bounds(fixture.flavor, fixture.max_model_len)
    seen = set()
    for family in text_string_to_metric_families(read_page(fixture.name)):
        if family.type != "histogram" or not family.name.startswith("vllm:"):
            continue
        name = family.name[len("vllm:") :]
        seen.add(name)
        les = sorted(
            {float(s.labels["le"]) for s in family.samples if "le" in s.labels} - {math.inf}
        )
        if fixture.cut:
            assert list(bounds[name][: len(les)]) == les, name
        else:
            assert list(bounds[name]) == les, name
    if fixture.same_families and not fixture.cut:
        assert set(bounds) == seen
    assert seen <= set(bounds)


def test_v0_and_v1_latency_buckets() -> None:
    assert histogram_bounds("v0")["time_to_first_token_seconds"][::15] == (0.001, 10.0)
    for flavor in ("v1-0.8", "v1-0.10", "v1-latest"):
        ttft = histogram_bounds(flavor)["time_to_first_token_seconds"]
        assert (ttft[0], ttft[-1], len(ttft)) == (0.001, 2560.0, 22)
    assert "inter_token_latency_seconds" in histogram_bounds("v1-latest")
    assert "time_per_output_token_seconds" not in histogram_bounds("v1-latest")
    assert "time_per_output_token_seconds" in histogram_bounds("v1-0.10")
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert histogram_bounds("v1-0.10", 1000)["request_prompt_tokens"][-1] == 1000


# -- _created ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_created_series_only_on_single_process_flavours(flavor: str) -> None:
    engines = 1 if flavor in ("v0", "v1-0.8") else 3
    sim = render(server(flavor), [engine(i) for i in range(engines)], now=START + 60).decode()
    found = parse(sim)
    created = [name for name in found if name.endswith("_created")]
    if flavor == "v0":
        assert created == []
        assert "_created" not in sim
        return
    for name, family in found.items():
        if not name.startswith("vllm:") or family.type not in ("counter", "histogram"):
            continue
        companion = found[name + "_created"]
        assert companion.type == "gauge"
        series = {
            frozenset((k, v) for k, v in s.labels.items() if k != "le") for s in family.samples
        }
        assert {frozenset(s.labels.items()) for s in companion.samples} == series, name
        assert {s.value for s in companion.samples} == {START}
    assert len(created) == sum(
        1 for f in found.values() if f.name.startswith("vllm:") and f.type != "gauge"
    )


# -- through the agent ---------------------------------------------------------------------------

CACHE_CONFIG = {"block_size": "16", "num_gpu_blocks": "25031", "enable_prefix_caching": "True"}


def server(flavor: str, model: str = "Qwen/Qwen3-8B") -> ServerInfo:
    return ServerInfo(
        model=model,
        flavor=flavor,
        version="0.0.0",
        max_model_len=40960,
        cache_config=CACHE_CONFIG,
        start_time=START,
    )


def engine(index: int, flavor: str = "v1-latest") -> EngineStats:
    """Engine 0 and engine 1 differ in every value; 2+ repeat engine 1."""
    first = index == 0
    stats = EngineStats(
        running=3 if first else 1,
        waiting=2 if first else 0,
        kv_usage=0.25 if first else 0.75,
        prompt_tokens=1000.0 if first else 500.0,
        generation_tokens=100.0 if first else 50.0,
        preemptions=1.0 if first else 0.0,
        finished={"stop": 7.0, "length": 2.0, "abort": 1.0 if first else 0.0},
        prefix_queries=800.0 if first else 400.0,
        prefix_hits=320.0 if first else 100.0,
    )
    bounds = histogram_bounds(flavor, 40960)
    stats.histograms = {name: Observations(b) for name, b in bounds.items()}
    stats.histograms["time_to_first_token_seconds"].observe(0.05, 10 if first else 4)
    itl = (
        "inter_token_latency_seconds" if flavor == "v1-latest" else "time_per_output_token_seconds"
    )
    stats.histograms[itl].observe(0.02, 90 if first else 46)
    stats.histograms["iteration_tokens_total"].observe(64.0, 30 if first else 20)
    return stats


def normalise(flavor: str, engines: int) -> VllmMetrics:
    page = render(server(flavor), [engine(i, flavor) for i in range(engines)], now=START + 100)
    return Normaliser().normalise(page.decode("utf-8"))


@pytest.mark.parametrize("flavor", FLAVORS)
def test_round_trip_through_the_normaliser(flavor: str) -> None:
    two = flavor in ("v1-0.10", "v1-latest")
    m = normalise(flavor, 2 if two else 1)
    assert m.flavor == flavor
    assert m.engines == (2 if two else 1)
    assert m.model_name == "Qwen/Qwen3-8B"
    assert m.warnings == ()
    assert m.generation_tokens_total == (150.0 if two else 100.0)
    assert m.prompt_tokens_total == (1500.0 if two else 1000.0)
    assert m.num_preemptions_total == 1.0
    assert m.request_success_total == (19.0 if two else 10.0)
    assert m.num_requests_running == (4.0 if two else 3.0)
    assert m.num_requests_waiting == 2.0
    assert m.kv_cache_usage == (0.5 if two else 0.25)
    assert m.kv_cache_usage_max == (0.75 if two else 0.25)
    assert m.time_to_first_token is not None and m.inter_token_latency is not None
    assert m.time_to_first_token.count == (14.0 if two else 10.0)
    assert m.inter_token_latency.count == (136.0 if two else 90.0)
    assert m.engine_steps_total == (50.0 if two else 30.0)
    assert dict(m.cache_config) == CACHE_CONFIG
    if flavor == "v0":
        assert m.process_start_time is None  # multiprocess pages have no process families
        assert m.prefix_cache_queries_total is None
        assert m.prefix_cache_hit_rate == 0.4
    else:
        assert m.process_start_time == START
        assert m.prefix_cache_hit_rate is None
    if flavor == "v1-0.8":  # early V1 counted whole blocks of 16 tokens
        assert m.prefix_cache_unit == "blocks"
        assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (50.0, 20.0)
    elif flavor != "v0":
        assert m.prefix_cache_unit == "tokens"
        assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (1200.0, 420.0)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_http_requests_are_printed_where_that_version_counts_them(flavor: str) -> None:
    """vLLM's API server counts its answers from 0.8.3 on (the instrumentator): declared before
    the first answer, then a series per handler, method and status class as each first comes.
    The agent reads POSTs not answered 4xx, and the 5xx among them."""
    http = HttpStats()
    engines = [engine(0, flavor)]
    fresh = render(server(flavor), engines, now=START, http=http).decode()
    http.count("/v1/completions", "POST", 200, times=5)
    http.count("/v1/models", "GET", 200)
    http.count("/v1/completions", "POST", 404)
    http.count("/v1/completions", "POST", 500)
    http.count("/v1/completions", "POST", 503)
    http.count("/v1/completions", "POST", 500, times=0)  # no answer: no series
    page = render(server(flavor), engines, now=START, http=http)
    m, before = Normaliser().normalise(page.decode()), Normaliser().normalise(fresh)
    without = Normaliser().normalise(render(server(flavor), engines, now=START).decode())
    assert (without.http_requests_total, without.http_5xx_total) == (None, None)
    if flavor in ("v0", "v1-0.8"):
        assert b"http_" not in page
        assert (m.http_requests_total, m.http_5xx_total) == (None, None)
        return
    assert "# TYPE http_requests_total counter" in fresh and "http_requests_total{" not in fresh
    assert (before.http_requests_total, before.http_5xx_total) == (0.0, 0.0)
    assert (m.http_requests_total, m.http_5xx_total) == (7.0, 2.0)
    series = [dict(k) for k in samples(page, "http_requests_total")]
    assert [(s["handler"], s["method"], s["status"]) for s in series] == [
        ("/v1/completions", "POST", "2xx"),
        ("/v1/models", "GET", "2xx"),
        ("/v1/completions", "POST", "4xx"),
        ("/v1/completions", "POST", "5xx"),
    ]


def test_four_engines_sum_and_average() -> None:
    m = normalise("v1-latest", 4)
    assert m.engines == 4
    assert m.generation_tokens_total == 100.0 + 3 * 50.0
    assert m.kv_cache_usage == (0.25 + 3 * 0.75) / 4


# -- details -------------------------------------------------------------------------------------


def samples(page: bytes, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {
        frozenset(s.labels.items()): s.value
        for f in text_string_to_metric_families(page.decode())
        for s in f.samples
        if s.name == name
    }


def one(page: bytes, name: str, **labels: str) -> float:
    matches = [
        value for key, value in samples(page, name).items() if set(labels.items()) <= set(key)
    ]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def test_v1_latest_derived_families() -> None:
    page = render(server("v1-latest"), [engine(0), engine(1)], now=START)
    assert one(page, "vllm:num_requests_waiting_by_reason", engine="0", reason="capacity") == 2
    assert one(page, "vllm:num_requests_waiting_by_reason", engine="0", reason="deferred") == 0
    by_source = "vllm:prompt_tokens_by_source_total"
    assert one(page, by_source, engine="0", source="local_compute") == 1000 - 320
    assert one(page, by_source, engine="0", source="local_cache_hit") == 320
    assert one(page, by_source, engine="1", source="external_kv_transfer") == 0
    assert one(page, "vllm:prompt_tokens_cached_total", engine="1") == 100
    assert one(page, "vllm:engine_sleep_state", engine="1", sleep_state="awake") == 1
    assert one(page, "vllm:engine_sleep_state", engine="1", sleep_state="discard_all") == 0
    reasons = {dict(k)["finished_reason"] for k in samples(page, "vllm:request_success_total")}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    config = samples(page, "vllm:cache_config_info")
    assert set(config) == {frozenset({**CACHE_CONFIG, "engine": e}.items()) for e in "01"}


def test_v1_010_prints_old_and_new_names_with_equal_values() -> None:
    page = render(server("v1-0.10"), [engine(0), engine(1)], now=START)
    pairs = [
        ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("vllm:gpu_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("vllm:gpu_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    ]
    for old, new in pairs:
        assert samples(page, old) == samples(page, new)
    assert "vllm:inter_token_latency_seconds" not in page.decode()


def test_v0_prints_only_reasons_seen_and_its_gauges() -> None:
    stats = engine(0, "v0")
    stats.finished = {"stop": 3.0, "length": 0.0, "abort": 0.0}
    page = render(server("v0"), [stats], now=START + 10)
    assert set(samples(page, "vllm:request_success_total")) == {
        frozenset({"model_name": "Qwen/Qwen3-8B", "finished_reason": "stop"}.items())
    }
    assert one(page, "vllm:gpu_prefix_cache_hit_rate") == 0.4
    assert one(page, "vllm:cpu_prefix_cache_hit_rate") == -1
    assert one(page, "vllm:num_requests_swapped") == 0
    assert one(page, "vllm:avg_generation_throughput_toks_per_s") == 100 / 10
    assert one(page, "vllm:lora_requests_info") == START + 10
    assert "engine=" not in page.decode()
    # Before the first request ends, multiprocess V0 has no request_success family at all.
    fresh = render(server("v0"), [EngineStats()], now=START)
    assert "request_success" not in fresh.decode()
    assert one(fresh, "vllm:gpu_prefix_cache_hit_rate") == -1


def test_unfilled_histograms_render_as_zeros_with_the_version_buckets() -> None:
    for flavor in FLAVORS:
        page = render(server(flavor), [EngineStats()], now=START)
        for name, bounds in histogram_bounds(flavor, 40960).items():
            buckets = samples(page, f"vllm:{name}_bucket")
            assert len(buckets) == len(bounds) + 1, (flavor, name)
            assert set(buckets.values()) == {0.0}
            assert samples(page, f"vllm:{name}_count") == {
                frozenset(dict(k for k in key if k[0] != "le").items()): 0.0 for key in buckets
            }


def test_v1_keeps_finish_reasons_it_does_not_pre_create() -> None:
    stats = engine(0, "v1-0.10")
    stats.finished["error"] = 2.0
    page = render(server("v1-0.10"), [stats], now=START)
    assert one(page, "vllm:request_success_total", finished_reason="error") == 2
    assert one(page, "vllm:request_success_total", finished_reason="length") == 2


def test_family_lists() -> None:
    counts = {flavor: len(families(flavor)) for flavor in FLAVORS}
    assert counts == {"v0": 28, "v1-0.8": 23, "v1-0.10": 26, "v1-latest": 39}
    for flavor in FLAVORS:
        assert len(set(families(flavor))) == counts[flavor]
        assert all(name.startswith("vllm:") for name in families(flavor))


def test_label_values_are_escaped() -> None:
    model = 'org/model "quoted" \\ back\nslash'
    page = render(server("v1-latest", model), [engine(0)], now=START)
    assert page.decode("utf-8").count("\n") == len(page.decode("utf-8").splitlines())
    assert Normaliser().normalise(page.decode("utf-8")).model_name == model


def test_page_format() -> None:
    page = render(server("v1-latest"), [engine(0)], now=START)
    assert isinstance(page, bytes) and page.endswith(b"\n")
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    lines = page.decode().splitlines()
    first_vllm = next(i for i, line in enumerate(lines) if "vllm:" in line)
    process = next(i for i, line in enumerate(lines) if line.startswith("process_start_time"))
    assert process < first_vllm  # the default registry's collectors come first
    assert one(page, "process_start_time_seconds") == START


@pytest.mark.parametrize(
    ("flavor", "count", "message"),
    [
        ("v2", 1, "unknown flavor"),
        ("v0", 2, "no engine label"),
        ("v1-0.8", 2, "no engine label"),
        ("v1-latest", 0, "at least one engine"),
    ],
)
def test_bad_arguments(flavor: str, count: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render(server(flavor), [EngineStats() for _ in range(count)], now=START)


def test_flavours_render_independently_in_one_process() -> None:
    pages: Iterable[bytes] = [
        render(server(flavor), [EngineStats()], now=START) for flavor in (*FLAVORS, "v0")
    ]
    v0_first, *_middle, v0_last = list(pages)
    assert v0_first == v0_last
    assert b"_created" not in v0_last
