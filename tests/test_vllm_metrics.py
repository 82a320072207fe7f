"""The normaliser against real pages of every flavour and against broken ones."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import METRIC_PAGES, counter, gauge, page, read_page
from vkvagent.engine.samples import VllmMetrics
from vkvagent.knowledge.vllm_metrics import ExpositionError, Normaliser
from vkvagent.sim.stats import EngineStats

V0_07 = "v0-0.7-aibrix-doc-qwen2.5-coder-1.5b.prom"
V1_08 = "v1-0.8-production-stack-318-qwen2.5-coder-32b.prom"


def normalise(text: str, model: str = "") -> VllmMetrics:
    return Normaliser(model).normalise(text)


def test_real_v0_07_page() -> None:
    m = normalise(read_page(V0_07))
    assert m.flavor == "v0"
    assert m.models == ("Qwen/Qwen2.5-Coder-1.5B-Instruct",)
    assert m.model_name == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert m.engines == 1
    assert m.kv_cache_usage == 0.0
    assert m.num_requests_running == 0.0 and m.num_requests_waiting == 0.0
    assert m.num_preemptions_total == 0.0
    assert m.prompt_tokens_total == 148.0
    assert m.generation_tokens_total == 955.0
    assert m.request_success_total == 4.0
    assert m.prefix_cache_hit_rate is None  # the gauge reads -1: no data yet
    assert m.prefix_cache_queries_total is None  # V0 has no prefix-cache counters
    # The published page stops inside iteration_tokens_total, before its _count line.
    assert m.engine_steps_total is None
    assert m.warnings == ()
    assert m.cache_config["num_gpu_blocks"] == "81767"
    assert m.cache_config["swap_space_bytes"] == "4294967296"
    assert m.cache_config["enable_prefix_caching"] == "False"


def test_real_v1_08_fragment() -> None:
    m = normalise(read_page(V1_08))
    assert m.flavor == "v1-0.8"  # gpu_prefix_cache_queries declared, no kv_cache_usage_perc
    assert m.models == ("Qwen/Qwen2.5-Coder-32B-Instruct",)
    assert m.kv_cache_usage == 0.0
    assert m.process_start_time == pytest.approx(1.74262400557e9)
    # Declared but cut off before its sample line: absent, not zero.
    assert m.prefix_cache_queries_total is None
    assert m.generation_tokens_total is None


def test_real_v1_032_page_under_load() -> None:
    """The real vLLM 0.32 (CPU build) with six completions running (SOURCES.md)."""
    m = normalise(read_page("v1-0.32-cpu.prom"))
    assert (m.flavor, m.models, m.engines) == ("v1-latest", ("tiny-llama",), 1)
    assert (m.num_requests_running, m.num_requests_waiting) == (6.0, 0.0)
    assert m.kv_cache_usage == pytest.approx(0.0006813536225300787)
    assert (m.prompt_tokens_total, m.generation_tokens_total) == (756.0, 5167.0)
    assert m.request_success_total == 78.0
    assert (m.http_requests_total, m.http_5xx_total) == (78.0, 0.0)  # every POST answered 2xx
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (756.0, 0.0)
    assert m.prefix_cache_unit == "tokens"
    assert m.num_preemptions_total == 0.0
    assert m.engine_steps_total == 898.0
    assert m.time_to_first_token is not None and m.time_to_first_token.count == 84.0
    assert m.inter_token_latency is not None and m.inter_token_latency.count == 5083.0
    assert m.process_start_time == pytest.approx(1.79614014406e9)
    assert m.warnings == ()
    assert m.cache_config["block_size"] == "128"  # the CPU platform's default
    assert m.cache_config["gpu_memory_utilization"] == "0.2"
    assert "cpu_offload_gb" not in m.cache_config  # moved to the offload config by 0.32


EXPECTED = sorted(METRIC_PAGES.glob("*.expected.json"))


@pytest.mark.parametrize("expected_file", EXPECTED, ids=lambda p: p.name.split(".expected")[0])
def test_pages_of_every_flavour(expected_file) -> None:
    expected = json.loads(expected_file.read_text())
    page_file = expected_file.with_name(expected_file.name.replace(".expected.json", ".prom"))
    m = normalise(page_file.read_text())
    got = m.to_json()
    for key, value in expected.items():
        if key in ("ttft_count", "itl_count"):
            hist = m.time_to_first_token if key == "ttft_count" else m.inter_token_latency
            assert (hist.count if hist else None) == pytest.approx(value), key
        elif isinstance(value, float):
            assert got[key] == pytest.approx(value), key
        else:
            assert got[key] == value, key


def test_every_flavour_has_an_annotated_page() -> None:
    """v1-0.8 is covered by the real fragment above (test_real_v1_08_fragment)."""
    flavors = {json.loads(p.read_text())["flavor"] for p in EXPECTED}
    assert {"v0", "v1-0.10", "v1-latest"} <= flavors


def test_created_series_are_never_read_as_counts() -> None:
    text = page(
        counter("vllm:num_preemptions_total", 7, 'engine="0",model_name="m"'),
        gauge("vllm:num_preemptions_created", 1.7e9, 'engine="0",model_name="m"'),
        gauge("vllm:kv_cache_usage_perc", 0.5, 'engine="0",model_name="m"'),
    )
    assert normalise(text).num_preemptions_total == 7


def test_engines_are_summed_and_gauges_combined() -> None:
    def two(name: str, a: float, b: float, kind: str = "gauge") -> str:
        return (
            f'# TYPE {name} {kind}\n{name}{{engine="0",model_name="m"}} {a}\n'
            f'{name}{{engine="1",model_name="m"}} {b}\n'
        )

    m = normalise(
        page(
            two("vllm:kv_cache_usage_perc", 0.2, 0.6),
            two("vllm:num_requests_running", 3, 4),
            two("vllm:num_preemptions_total", 10, 5, "counter"),
            two("vllm:generation_tokens_total", 100, 50, "counter"),
        )
    )
    assert m.engines == 2
    assert m.kv_cache_usage == pytest.approx(0.4)
    assert m.kv_cache_usage_max == pytest.approx(0.6)
    assert m.num_requests_running == 7
    assert m.num_preemptions_total == 15
    assert m.generation_tokens_total == 150
    assert m.flavor == "v1-latest"


def test_old_and_new_names_side_by_side_are_not_double_counted() -> None:
    labels = 'engine="0",model_name="m"'
    m = normalise(
        page(
            gauge("vllm:gpu_cache_usage_perc", 0.3, labels),
            gauge("vllm:kv_cache_usage_perc", 0.3, labels),
            counter("vllm:gpu_prefix_cache_queries_total", 1000, labels),
            counter("vllm:gpu_prefix_cache_hits_total", 250, labels),
            counter("vllm:prefix_cache_queries_total", 1000, labels),
            counter("vllm:prefix_cache_hits_total", 250, labels),
        )
    )
    assert m.flavor == "v1-0.10"
    assert m.kv_cache_usage == pytest.approx(0.3)
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (1000, 250)
    assert m.prefix_cache_unit == "tokens"


def test_early_v1_prefix_cache_counts_blocks() -> None:
    text = page(
        "# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of "
        "number of queried blocks.\n# TYPE vllm:gpu_prefix_cache_queries_total counter\n"
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 64\n',
        gauge("vllm:gpu_cache_usage_perc", 0.1),
    )
    m = normalise(text)
    assert m.flavor == "v1-0.8"
    assert m.prefix_cache_queries_total == 64
    assert m.prefix_cache_unit == "blocks"


def test_itl_prefers_the_new_name_and_falls_back_to_tpot() -> None:
    def hist(name: str, counts: tuple[int, int, int]) -> str:
        lines = [f"# TYPE {name} histogram"]
        for le, c in zip(("0.01", "0.1", "+Inf"), counts):
            lines.append(f'{name}_bucket{{le="{le}",model_name="m"}} {c}')
        lines += [f'{name}_count{{model_name="m"}} {counts[-1]}', f'{name}_sum{{model_name="m"}} 1']
        return "\n".join(lines)

    new = hist("vllm:inter_token_latency_seconds", (1, 2, 3))
    old = hist("vllm:time_per_output_token_seconds", (5, 6, 9))
    kv = gauge("vllm:kv_cache_usage_perc", 0.1)
    both = normalise(page(kv, new, old)).inter_token_latency
    assert both is not None and both.count == 3
    only_old = normalise(page(kv, old)).inter_token_latency
    assert only_old is not None and only_old.count == 9
    assert only_old.bounds == (0.01, 0.1, math.inf)
    assert only_old.cumulative == (5, 6, 9)


def test_model_filter_reads_one_model_of_several() -> None:
    text = page(
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{model_name="a"} 10\n'
        'vllm:generation_tokens_total{model_name="b"} 32\n',
        gauge("vllm:gpu_cache_usage_perc", 0.1, 'model_name="a"'),
    )
    everything = normalise(text)
    assert everything.models == ("a", "b") and everything.model_name is None
    assert everything.generation_tokens_total == 42
    assert normalise(text, model="b").generation_tokens_total == 32


def test_a_page_cut_at_a_line_boundary_drops_the_signals_it_cut() -> None:
    """Cut after engine 0's generation_tokens line: summing engine 0 alone would read as a
    counter reset on the next scrape; the cut signals are dropped and named instead."""
    text = read_page("v1-2026.prom")
    cut = text.index("\n", text.index('vllm:generation_tokens_total{engine="0"')) + 1
    m = normalise(text[:cut])
    assert m.engines == 4
    assert m.generation_tokens_total is None
    assert any("generation_tokens_total ignored: no series for engine 1, 2, 3" in w
               for w in m.warnings)  # fmt: skip
    assert m.num_requests_running == 40 + 38 + 44 + 30  # families before the cut are whole
    assert m.kv_cache_usage is not None


def test_a_model_that_is_not_on_the_page_is_an_error() -> None:
    with pytest.raises(ExpositionError, match="model 'llama' is not on the page"):
        normalise(read_page(V0_07), model="llama")


def test_v0_hit_rate_gauge() -> None:
    text = page(
        gauge("vllm:gpu_cache_usage_perc", 0.1),
        gauge("vllm:gpu_prefix_cache_hit_rate", 0.42),
        gauge("vllm:num_requests_swapped", 0),
    )
    m = normalise(text)
    assert (m.flavor, m.prefix_cache_hit_rate) == ("v0", 0.42)


GOOD = page(gauge("vllm:kv_cache_usage_perc", 0.5), counter("vllm:num_preemptions_total", 3))


def http(*series: tuple[str, str, str, float]) -> str:
    """prometheus_fastapi_instrumentator's family: (handler, method, status, value) each."""
    return "# TYPE http_requests_total counter\n" + "".join(
        f'http_requests_total{{handler="{h}",method="{m}",status="{s}"}} {v}\n'
        for h, m, s, v in series
    )


@pytest.mark.parametrize(
    ("family", "answered", "errors"),
    [
        (
            http(
                ("/v1/chat/completions", "POST", "2xx", 90),
                ("/v1/chat/completions", "POST", "4xx", 7),  # a client's mistake: not counted
                ("/v1/chat/completions", "POST", "5xx", 3),
                ("/v1/completions", "POST", "2xx", 40),
                ("/v1/completions", "POST", "5xx", 1),
                ("/v1/models", "GET", "2xx", 12),  # not a request for tokens
                ("/v1/models", "GET", "5xx", 2),
            ),
            134.0,
            4.0,
        ),
        # Ungrouped status codes (should_group_status_codes=False) read the same way.
        (
            http(
                ("/v1/completions", "POST", "200", 8),
                ("/v1/completions", "POST", "503", 2),
                ("/v1/completions", "POST", "429", 5),
            ),
            10.0,
            2.0,
        ),
        # No 5xx yet: 0, not unknown, so the first ones count as they come.
        (http(("/v1/completions", "POST", "2xx", 8)), 8.0, 0.0),
        # Declared, with no POST answered yet (only its TYPE line, or GETs): none yet.
        (http(), 0.0, 0.0),
        (http(("/v1/models", "GET", "2xx", 3)), 0.0, 0.0),
        ("", None, None),  # V0, or a page without the instrumentator
    ],
    ids=["grouped", "codes", "no-5xx", "declared", "gets-only", "absent"],
)
def test_http_requests_count_the_api_posts_answered_and_their_5xx(
    family: str, answered: float | None, errors: float | None
) -> None:
    m = normalise(GOOD + family)
    assert (m.http_requests_total, m.http_5xx_total) == (answered, errors)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty page"),
        ("<!DOCTYPE html><html><body>502 Bad Gateway</body></html>\n", "HTML"),
        (GOOD.rstrip("\n"), "truncated page"),
        (GOOD + 'vllm:num_requests_running{model_name="m"\n', "line 7: unclosed label set"),
        (GOOD + 'vllm:num_requests_running{model_name="m} 1\n', "line 7: bad labels"),
        # prometheus_client's parse_labels loops forever on this one: refused before it runs
        (GOOD + 'vllm:num_requests_running{model_name="m"}} 1\n', "line 7: bad labels"),
        (GOOD + 'vllm:num_requests_running{model_name="m" engine="0"} 1\n', "line 7: bad labels"),
        (GOOD + "\x00\x01garbage\n", "line 7: not a metric sample"),
        (GOOD + 'vllm:num_requests_running{model_name="m"} fast\n', "line 7: bad value"),
        (GOOD + 'vllm:num_requests_running{model_name="m"}\n', "line 7: expected a value"),
        (page(gauge("vllm:kv_cache_usage_perc", float("nan"))), "not a finite number"),
        (page(gauge("vllm:num_requests_waiting", float("inf"))), "not a finite number"),
        (page(counter("vllm:prompt_tokens_total", -5)), "negative"),
        (GOOD + http(("/v1/completions", "POST", "2xx", -1)), "http_requests_total is negative"),
        (page(gauge("vllm:kv_cache_usage_perc", 37)), "outside 0..1"),
        (GOOD + 'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n', "duplicate series"),
        (page(gauge("process_cpu_seconds_total", 3, "")), "no vLLM metrics"),
    ],
)
def test_bad_pages_are_refused_with_a_one_line_reason(text: str, problem: str) -> None:
    with pytest.raises(ExpositionError) as caught:
        normalise(text)
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("histogram", "problem"),
    [
        (
            page(
                "# TYPE vllm:time_to_first_token_seconds histogram\n"
                'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3\n'
            ),
            'no le="+Inf" bucket',
        ),
        (
            page(
                "# TYPE vllm:time_to_first_token_seconds histogram\n"
                'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3\n'
                'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2\n'
            ),
            "not cumulative",
        ),
        (
            page(
                "# TYPE vllm:time_to_first_token_seconds histogram\n"
                'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2\n'
                'vllm:time_to_first_token_seconds_count{model_name="m"} 5\n'
            ),
            "differs from the +Inf bucket",
        ),
    ],
)
def test_an_inconsistent_histogram_costs_that_signal_only(histogram: str, problem: str) -> None:
    m = normalise(GOOD + histogram)
    assert m.time_to_first_token is None
    assert m.num_preemptions_total == 3
    assert len(m.warnings) == 1
    assert problem in m.warnings[0] and "time_to_first_token" in m.warnings[0]


def test_duplicates_are_found_whatever_the_label_order() -> None:
    text = page(
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
        'vllm:num_requests_running{model_name="m",engine="0"} 2\n'
    )
    with pytest.raises(ExpositionError, match="duplicate series"):
        normalise(text)


def test_a_reused_normaliser_gives_the_same_answer_and_bounds_its_cache() -> None:
    normaliser = Normaliser(cache_limit=10)
    text = read_page(V0_07)
    first = normaliser.normalise(text)
    for _ in range(3):
        assert normaliser.normalise(text) == first
    assert len(normaliser._series) <= 10 + 60  # cleared once over the limit, then refilled


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=400))
def test_any_text_is_either_read_or_refused_cleanly(text: str) -> None:
    try:
        normalise(text)
    except ExpositionError as exc:
        assert "\n" not in str(exc)


LINES = [
    line for line in read_page(V0_07).splitlines(keepends=True) if not line.startswith("# ---")
]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mangled_real_pages_are_either_read_or_refused_cleanly(data: st.DataObject) -> None:
    lines = list(LINES)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(lines) - 1))
        action = data.draw(st.sampled_from(["cut", "drop", "dup", "garble"]))
        if action == "cut":
            lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))]
        elif action == "drop":
            del lines[i]
        elif action == "dup":
            lines.insert(i, lines[i])
        else:
            lines[i] = data.draw(st.text(max_size=30)) + lines[i]
        if not lines:
            break
    try:
        m = normalise("".join(lines))
    except ExpositionError as exc:
        assert "\n" not in str(exc)
    else:
        assert m.flavor == "v0"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_counters_sum_and_kv_combines_over_any_number_of_engines(data: st.DataObject) -> None:
    engines = data.draw(st.integers(1, 6))
    values = data.draw(st.lists(st.integers(0, 10**12), min_size=engines, max_size=engines))
    kv = data.draw(st.lists(st.floats(0, 1), min_size=engines, max_size=engines))
    shuffle = data.draw(st.randoms(use_true_random=False))
    lines = ["# TYPE vllm:generation_tokens_total counter"]
    for engine, value in enumerate(values):
        labels = [f'engine="{engine}"', 'model_name="m"']
        shuffle.shuffle(labels)
        lines.append(f"vllm:generation_tokens_total{{{','.join(labels)}}} {value}")
    lines.append("# TYPE vllm:kv_cache_usage_perc gauge")
    for engine, usage in enumerate(kv):
        lines.append(f'vllm:kv_cache_usage_perc{{engine="{engine}",model_name="m"}} {usage!r}')
    m = normalise("\n".join(lines) + "\n")
    assert m.generation_tokens_total == sum(values)
    assert m.kv_cache_usage == pytest.approx(sum(kv) / len(kv))
    assert m.kv_cache_usage_max == max(kv)
    assert m.engines == engines
    # the same page cut after any line of the first family: that family is dropped, not undercounted
    cut = data.draw(st.integers(1, engines - 1)) if engines > 1 else None
    if cut is not None:
        partial = normalise("\n".join([*lines[: 1 + cut], *lines[1 + engines :]]) + "\n")
        assert partial.generation_tokens_total is None and partial.warnings


# -- per-engine signals ----------------------------------------------------------------------


def _sim_page(flavor: str, engines: list[EngineStats]) -> str:
    from vkvagent.sim.exposition import histogram_bounds, render
    from vkvagent.sim.stats import Observations, ServerInfo

    info = ServerInfo("m", flavor, "0.0.0", 4096, {"block_size": "16"}, 1.7e9)
    for stats in engines:
        stats.histograms = {
            name: Observations(b) for name, b in histogram_bounds(flavor, 4096).items()
        }
    for steps, stats in enumerate(engines, start=1):
        stats.histograms["iteration_tokens_total"].observe(8, times=100 * steps)
    return render(info, engines, now=1.7e9 + 60).decode()


def test_each_engine_of_a_four_engine_page_keeps_its_own_signals() -> None:
    m = normalise(read_page("v1-2026.prom"))
    assert [e.engine for e in m.per_engine] == ["0", "1", "2", "3"]
    assert [e.kv_cache_usage for e in m.per_engine] == [0.75, 0.625, 0.875, 0.5]
    assert [e.num_requests_running for e in m.per_engine] == [40, 38, 44, 30]
    assert [e.num_requests_waiting for e in m.per_engine] == [6, 0, 3, 2]
    assert [e.generation_tokens_total for e in m.per_engine] == [1e6, 8e5, 1.2e6, 6e5]
    assert [e.prompt_tokens_total for e in m.per_engine] == [5e6, 4e6, 6e6, 3e6]
    assert [e.engine_steps_total for e in m.per_engine] == [26000, 22000, 31000, 17000]
    # every finished_reason: stop + length + abort + error + repetition
    assert [e.request_success_total for e in m.per_engine] == [4400, 3500, 5200, 2700]
    assert [e.num_preemptions_total for e in m.per_engine] == [40, 10, 70, 0]
    # the totals are as before (v1-2026.expected.json)
    assert (m.kv_cache_usage, m.kv_cache_usage_max) == (0.6875, 0.875)
    assert (m.num_requests_running, m.num_requests_waiting) == (152, 11)
    assert (m.generation_tokens_total, m.engine_steps_total) == (3.6e6, 96000)
    assert (m.request_success_total, m.num_preemptions_total) == (15800, 120)
    got = m.to_json()["per_engine"]
    assert len(got) == 4 and got[2]["engine"] == "2" and got[2]["kv_cache_usage"] == 0.875
    assert json.loads(json.dumps(m.to_json())) == m.to_json()
    # not compared: the history keeps the totals only, and a value read back equals the original
    assert replace(m, per_engine=()) == m


@pytest.mark.parametrize("flavor", ["v1-0.10", "v1-latest"])
def test_each_engine_of_a_simulated_data_parallel_page(flavor: str) -> None:
    first = EngineStats(running=3, waiting=2, kv_usage=0.25, prompt_tokens=1000.0,
                        generation_tokens=100.0, preemptions=1.0,
                        finished={"stop": 7.0, "length": 2.0, "abort": 1.0})  # fmt: skip
    second = EngineStats(running=1, waiting=0, kv_usage=0.75, prompt_tokens=500.0,
                         generation_tokens=50.0, finished={"stop": 4.0})  # fmt: skip
    m = normalise(_sim_page(flavor, [first, second]))
    assert m.engines == 2 and m.flavor == flavor
    zero, one = m.per_engine
    assert (zero.engine, one.engine) == ("0", "1")
    assert (zero.kv_cache_usage, one.kv_cache_usage) == (0.25, 0.75)
    assert (zero.num_requests_running, one.num_requests_running) == (3, 1)
    assert (zero.num_requests_waiting, one.num_requests_waiting) == (2, 0)
    assert (zero.prompt_tokens_total, one.prompt_tokens_total) == (1000, 500)
    assert (zero.generation_tokens_total, one.generation_tokens_total) == (100, 50)
    assert (zero.num_preemptions_total, one.num_preemptions_total) == (1, 0)
    assert (zero.request_success_total, one.request_success_total) == (10, 4)
    assert (zero.engine_steps_total, one.engine_steps_total) == (100, 200)
    assert (m.kv_cache_usage, m.num_requests_running, m.generation_tokens_total) == (0.5, 4, 150)
    assert (m.request_success_total, m.engine_steps_total) == (14, 300)


def test_engines_are_in_numeric_order() -> None:
    m = normalise(_sim_page("v1-latest", [EngineStats(running=i) for i in range(12)]))
    assert [e.engine for e in m.per_engine] == [str(i) for i in range(12)]
    assert [e.num_requests_running for e in m.per_engine] == list(range(12))


@pytest.mark.parametrize("name", [V0_07, V1_08, "v0-0.6.prom"])
def test_a_page_without_an_engine_label_has_no_per_engine_signals(name: str) -> None:
    m = normalise(read_page(name))
    assert m.per_engine == ()
    assert "per_engine" not in m.to_json()


def test_a_single_engine_with_the_label_has_one_entry() -> None:
    m = normalise(read_page("v1-0.32-cpu.prom"))  # engine="0" on every vllm: family
    (engine,) = m.per_engine
    assert (engine.engine, engine.num_requests_running, engine.engine_steps_total) == (
        "0", 6.0, 898.0,
    )  # fmt: skip
    assert engine.kv_cache_usage == m.kv_cache_usage


def test_a_multiprocess_gauge_per_engine_is_its_live_copy() -> None:
    m = normalise(read_page("v1-0.10-multiproc.prom"))  # kv usage printed per pid: 0.625, 0
    (engine,) = m.per_engine
    assert engine.engine == "0" and engine.kv_cache_usage == 0.625 == m.kv_cache_usage
    assert engine.num_requests_running == 22 and engine.request_success_total == 1700


def test_a_family_cut_short_is_none_for_every_engine() -> None:
    text = read_page("v1-2026.prom")
    cut = text.index("\n", text.index('vllm:generation_tokens_total{engine="0"')) + 1
    m = normalise(text[:cut])
    assert [e.engine for e in m.per_engine] == ["0", "1", "2", "3"]
    assert all(e.generation_tokens_total is None for e in m.per_engine)
    assert any("generation_tokens_total ignored" in w for w in m.warnings)
    assert [e.num_requests_running for e in m.per_engine] == [40, 38, 44, 30]
    assert all(e.engine_steps_total is None for e in m.per_engine)  # after the cut

    two = page(
        counter("vllm:prompt_tokens_total", 5, 'engine="0",model_name="m"'),
        gauge("vllm:kv_cache_usage_perc", 0.5, 'engine="0",model_name="m"'),
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n',
    )
    m = normalise(two)
    assert m.prompt_tokens_total is None and [w.split()[0] for w in m.warnings] == [
        "vllm:prompt_tokens_total"
    ]
    assert [(e.prompt_tokens_total, e.kv_cache_usage) for e in m.per_engine] == [
        (None, 0.5), (None, 0.25),
    ]  # fmt: skip


def test_a_series_without_an_engine_label_is_not_given_to_any_engine() -> None:
    m = normalise(
        page(
            gauge("vllm:kv_cache_usage_perc", 0.5, 'engine="0",model_name="m"'),
            counter("vllm:prompt_tokens_total", 7, 'model_name="m"'),
        )
    )
    assert m.prompt_tokens_total == 7
    assert [(e.engine, e.kv_cache_usage, e.prompt_tokens_total) for e in m.per_engine] == [
        ("0", 0.5, None)
    ]


def test_the_model_filter_applies_per_engine() -> None:
    def four(name: str, values: tuple[float, float, float, float], kind: str) -> str:
        lines = [f"# TYPE {name} {kind}"]
        for (model, engine), value in zip((("a", "0"), ("a", "1"), ("b", "0"), ("b", "1")), values):
            lines.append(f'{name}{{engine="{engine}",model_name="{model}"}} {value}')
        return "\n".join(lines)

    text = page(
        four("vllm:kv_cache_usage_perc", (0.1, 0.2, 0.5, 0.9), "gauge"),
        four("vllm:num_requests_running", (1, 2, 30, 40), "gauge"),
        four("vllm:generation_tokens_total", (10, 20, 300, 400), "counter"),
    )
    b = normalise(text, model="b")
    assert [(e.engine, e.kv_cache_usage, e.num_requests_running, e.generation_tokens_total)
            for e in b.per_engine] == [("0", 0.5, 30, 300), ("1", 0.9, 40, 400)]  # fmt: skip
    both = normalise(text)  # no model chosen: models combined per engine, as in the totals
    assert [(e.num_requests_running, e.generation_tokens_total) for e in both.per_engine] == [
        (31, 310), (42, 420),
    ]  # fmt: skip
    assert [e.kv_cache_usage for e in both.per_engine] == pytest.approx([0.3, 0.55])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_per_engine_values_add_up_to_the_totals(data: st.DataObject) -> None:
    engines = data.draw(st.integers(1, 12))
    names = ("generation_tokens_total", "prompt_tokens_total", "request_success_total",
             "num_preemptions_total", "iteration_tokens_total_count")  # fmt: skip
    counters = {
        name: data.draw(st.lists(st.integers(0, 10**12), min_size=engines, max_size=engines))
        for name in names
    }
    running = data.draw(st.lists(st.integers(0, 500), min_size=engines, max_size=engines))
    kv = data.draw(st.lists(st.floats(0, 1), min_size=engines, max_size=engines))
    order = data.draw(st.permutations(range(engines)))
    lines = []
    for name, values in counters.items():
        lines.append(f"# TYPE vllm:{name} counter")
        for engine in order:
            if name == "request_success_total":  # split over two finished_reasons
                half = values[engine] // 2
                for reason, part in (("stop", half), ("length", values[engine] - half)):
                    lines.append(
                        f'vllm:{name}{{engine="{engine}",finished_reason="{reason}",'
                        f'model_name="m"}} {part}'
                    )
            else:
                lines.append(f'vllm:{name}{{engine="{engine}",model_name="m"}} {values[engine]}')
    lines.append("# TYPE vllm:num_requests_running gauge")
    lines += [
        f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {running[e]}' for e in order
    ]
    lines.append("# TYPE vllm:kv_cache_usage_perc gauge")
    lines += [f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {kv[e]!r}' for e in order]
    m = normalise("\n".join(lines) + "\n")
    assert [e.engine for e in m.per_engine] == [str(i) for i in range(engines)]
    for field, total in (
        ("generation_tokens_total", m.generation_tokens_total),
        ("prompt_tokens_total", m.prompt_tokens_total),
        ("request_success_total", m.request_success_total),
        ("num_preemptions_total", m.num_preemptions_total),
        ("engine_steps_total", m.engine_steps_total),
        ("num_requests_running", m.num_requests_running),
    ):
        assert sum(getattr(e, field) for e in m.per_engine) == total, field
    assert [e.generation_tokens_total for e in m.per_engine] == counters[names[0]]
    assert [e.engine_steps_total for e in m.per_engine] == counters[names[-1]]
    assert [e.kv_cache_usage for e in m.per_engine] == kv
    assert max(kv) == m.kv_cache_usage_max
    assert m.kv_cache_usage == pytest.approx(sum(kv) / len(kv))
    assert all(e.num_requests_waiting is None for e in m.per_engine)  # not on the page
