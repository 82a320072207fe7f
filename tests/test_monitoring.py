"""The Prometheus rules (packaging/prometheus/) and the Grafana dashboard (packaging/grafana/),
checked by Prometheus' own promtool (Debian's prometheus package, installed by .ci/run):

- the rule files load (``promtool check rules``) and their unit tests pass
  (``promtool test rules``: each alert fires on V0 and V1 names, and the runbook's false
  alarms do not);
- every dashboard query parses as PromQL (written into a throw-away rule file);
- every vLLM query of the dashboard and every recording rule returns data for every metrics
  generation: fed with series from the simulator's pages of each flavour, scraped minute by
  minute, and from the real pages in tests/fixtures/metrics/.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkvagent.engine.slo import BURNS, _window_name
from vkvagent.sim.capacity import Cluster, EngineModel, Scenario, capacity
from vkvagent.sim.exposition import histogram_bounds, render
from vkvagent.sim.stats import ServerInfo
from vkvagent.sim.workload import Workload, azure_sizes, constant

PROJECT = Path(__file__).resolve().parent.parent
RULES = PROJECT / "packaging/prometheus"
DASHBOARD = PROJECT / "packaging/grafana/vkvagent.json"
PAGES = PROJECT / "tests/fixtures/metrics"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
STEPS = 15  # one-minute scrapes fed to promtool
# Grafana's variables, as a query would see them with "All" selected.
VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
             "$instance": ".*", "$agent": ".*"}  # fmt: skip
# The runbook's four panels, and the wire names of every generation each must read.
RUNBOOK_PANELS = {
    "Throughput (tokens/s)": ["vllm:generation_tokens_total"],  # one name in V0 and V1
    "KV-cache usage": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    "Preemptions (/s)": ["vllm:num_preemptions_total"],  # one name in V0 and V1
    "Prefix-cache hit ratio": [
        "vllm:prefix_cache_hits_total",  # V1 0.9.2+
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hits_total",  # early V1
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hit_rate",  # V0
    ],
}
VKVAGENT_PANELS = {
    "Verdict",
    "Diagnosed cause",
    "Speed against the fresh baseline at the same load",
    "Restarts by vkvagent",
    "Restart windows",
    "SLO attainment",
    "SLO error budget left",
    "SLO burn rate",
}
# Real pages with every family the dashboard reads (the 0.8 page is partial: the simulator's
# v1-0.8 flavour stands in for it).
REAL_PAGES = ("v0-0.6.prom", "v1-0.10.prom", "v1-0.13.prom", "v1-2026.prom")
SIM_FLAVORS = ("v0", "v1-0.8", "v1-0.10", "v1-latest")


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is not installed (apt-get install prometheus; .ci/run does)")
        pytest.skip("needs promtool (Debian's prometheus package)")
    return binary


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


# -- the dashboard ---------------------------------------------------------------------------


def panels() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for panel in json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]:
        found += [panel, *panel.get("panels", [])]
    return [panel for panel in found if panel["type"] != "row"]


def query(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def queries() -> Iterator[tuple[str, str]]:
    for panel in panels():
        for target in panel["targets"]:
            yield panel["title"], query(target["expr"])


def test_the_dashboard_is_a_grafana_dashboard_of_prometheus_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    titles = {panel["title"] for panel in panels()}
    assert set(RUNBOOK_PANELS) | VKVAGENT_PANELS <= titles


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    rules = [{"record": f"dashboard:query_{i}:check", "expr": expr}
             for i, (_title, expr) in enumerate(queries())]  # fmt: skip
    file = tmp_path / "dashboard-queries.yml"
    file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = run_promtool("check", "rules", file)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def test_each_runbook_panel_reads_every_generations_names() -> None:
    by_title = {panel["title"]: panel for panel in panels()}
    for title, names in RUNBOOK_PANELS.items():
        exprs = " ".join(target["expr"] for target in by_title[title]["targets"])
        for name in names:
            assert re.search(rf"\b{re.escape(name)}\b", exprs), f"{title} does not read {name}"


# -- the rules ---------------------------------------------------------------------------------


def test_the_rule_files_load_cleanly() -> None:
    files = sorted(RULES.glob("*.yml"))
    assert [f.name for f in files] == ["vkvagent-rules.yml", "vllm-rules.yml"]
    done = run_promtool("check", "rules", *files)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in (done.stdout + done.stderr).upper()


def test_the_rules_unit_tests_pass() -> None:
    tests = sorted((RULES / "tests").glob("*.yml"))
    assert len(tests) == 2
    done = run_promtool("test", "rules", *tests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(tests)


def test_every_alert_is_unit_tested_and_documented() -> None:
    tested = "\n".join(p.read_text() for p in (RULES / "tests").glob("*.yml"))
    for file in RULES.glob("*.yml"):
        for group in yaml.safe_load(file.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    assert f"alertname: {rule['alert']}\n" in tested, rule["alert"]
                    assert rule["labels"]["severity"] in ("info", "warning", "critical")
                    assert {"summary", "description"} <= set(rule["annotations"])


def test_the_slo_alerts_use_the_engines_burn_windows_and_thresholds() -> None:
    """The rules page on what `vkvagent status` and the slo.burning event call burning."""
    rules = yaml.safe_load((RULES / "vkvagent-rules.yml").read_text())
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    for level, (long, short, threshold) in BURNS.items():
        expr = exprs[f"VkvagentSlo{level.title()}Burn"]
        for window in (long, short):
            arm = f'vkvagent_slo_burn_rate{{window="{_window_name(window)}"}} >= {threshold:g}'
            assert arm in expr, (level, arm)


# -- every generation, through promtool --------------------------------------------------------


def parse_page(page: str) -> dict[str, float]:
    """Sample lines of a /metrics page: 'name{labels}' -> value (the series Prometheus keeps;
    _created series are left out, as the dashboard never reads them)."""
    samples = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            if not head.split("{")[0].endswith("_created"):
                samples[head] = float(value)
    return samples


def with_target(series: str, instance: str) -> str:
    name, brace, labels = series.partition("{")
    target = f'job="vllm",instance="{instance}"'
    return f"{name}{{{target}{',' + labels[:-1] if brace and labels[:-1] else ''}}}"


def promtool_values(values: list[float | None]) -> str:
    return " ".join("_" if v is None else repr(v) for v in values)


def simulated(flavor: str) -> dict[str, list[float | None]]:
    """A simulated vLLM of ``flavor`` serving 2 requests/s, scraped once a minute."""
    cap = capacity(MODEL, gpu_memory_utilization=0.9, block_size=16, max_num_seqs=256,
                   max_num_batched_tokens=8192, max_model_len=32768)  # fmt: skip
    cluster = Cluster(
        engines=[EngineModel(cap, histogram_bounds(flavor))],
        workload=Workload(constant(2.0), azure_sizes(), random.Random(5)),
        scenario=Scenario("healthy", None),
    )
    info = ServerInfo(model=MODEL, flavor=flavor, version="0.10.1", max_model_len=32768,
                      cache_config={"block_size": "16"}, start_time=0.0)  # fmt: skip
    series: dict[str, list[float | None]] = {}
    for step in range(STEPS + 1):
        cluster.advance_to(60.0 * (step + 1))
        page = render(info, [engine.stats for engine in cluster.engines], 60.0 * (step + 1))
        for name, value in parse_page(page.decode()).items():
            series.setdefault(name, [None] * step).append(value)
    return series


def real(page_name: str) -> dict[str, list[float | None]]:
    """A real page, as if scraped once a minute: counters (and histograms) growing, gauges
    steady (the gauge for the V0 hit rate, -1 before any query, set to a value)."""
    series: dict[str, list[float | None]] = {}
    for name, value in parse_page((PAGES / page_name).read_text(encoding="utf-8")).items():
        base = name.split("{")[0]
        if base.endswith(("_total", "_bucket", "_count", "_sum")):
            series[name] = [value + 60.0 * step for step in range(STEPS + 1)]
        else:
            steady = 0.5 if base == "vllm:gpu_prefix_cache_hit_rate" and value < 0 else value
            series[name] = [steady] * (STEPS + 1)
    return series


def vllm_queries() -> list[tuple[str, str]]:
    """(what, PromQL) of everything that reads vLLM's series: the dashboard's panels, and the
    recording rules (by their recorded name: the rules are loaded)."""
    found = [(title, expr) for title, expr in queries() if "vllm:" in expr]
    rules = yaml.safe_load((RULES / "vllm-rules.yml").read_text())
    for group in rules["groups"]:
        found += [(rule["record"], rule["record"]) for rule in group["rules"] if "record" in rule]
    return found


def test_every_vllm_query_returns_data_for_every_generation(tmp_path: Path) -> None:
    """absent(QUERY) must be empty at the last scrape, on each flavour's series."""
    sources = {f"sim {f}": simulated(f) for f in SIM_FLAVORS}
    sources.update({f"page {p}": real(p) for p in REAL_PAGES})
    tests = []
    for index, (source, series) in enumerate(sources.items()):
        instance = f"gpu{index}:8000"
        inputs = [{"series": with_target(name, instance), "values": promtool_values(values)}
                  for name, values in series.items()]  # fmt: skip
        # A PromQL comment names the query and the source in promtool's report.
        exprs = [{"expr": f"absent(({expr}) and on() vector(1)) # {source}: {what}\n",
                  "eval_time": f"{STEPS}m", "exp_samples": []}
                 for what, expr in vllm_queries()]  # fmt: skip
        tests.append({"interval": "1m", "input_series": inputs, "promql_expr_test": exprs})
    file = tmp_path / "generations.test.yml"
    spec = {"rule_files": [str(RULES / "vllm-rules.yml")], "evaluation_interval": "1m",
            "tests": tests}  # fmt: skip
    file.write_text(yaml.safe_dump(spec, width=1000))
    done = run_promtool("test", "rules", file)
    if done.returncode != 0:
        report = done.stdout + done.stderr  # promtool prints failures on stderr
        failing = sorted(set(re.findall(r' # (.+?)\\n", time', report)))
        pytest.fail("no data for:\n" + "\n".join(failing) + "\n" + report[-3000:])


def test_the_vkvagent_panels_read_the_agents_metrics(tmp_path: Path) -> None:
    """The vkvagent panels return data on the series `vkvagent run` exports."""
    target = 'job="vkvagent",instance="gpu0:9849"'
    series = {
        f'vkvagent_info{{{target},version="0.1.0",vllm_version="0.10.1",flavor="v1-0.10",'
        'unit="vllm.service",mode="enforce"}': "1x15",
        f'vkvagent_verdict{{{target},state="healthy"}}': "1x15",
        f'vkvagent_verdict{{{target},state="degraded"}}': "0x15",
        f'vkvagent_cause{{{target},cause="uptime_decline"}}': "1x15",
        f"vkvagent_throughput_ratio{{{target}}}": "0.9x15",
        f'vkvagent_restarts_total{{{target},reason="uptime_decline",result="completed"}}': "0+1x15",
        f"vkvagent_window_open{{{target}}}": "0x7 1x7",
        f"vkvagent_restart_budget_remaining{{{target}}}": "3x15",
        f"vkvagent_metrics_schema_recognised{{{target}}}": "1x15",
        f'vkvagent_slo_target{{{target},objective="ttft"}}': "0.95x15",
        f'vkvagent_slo_budget_remaining{{{target},objective="ttft"}}': "0.4x15",
    }
    for window in ("1h", "1d", "period"):
        series[f'vkvagent_slo_attainment{{{target},objective="ttft",window="{window}"}}'] = (
            "0.97x15"
        )
    for window in ("5m", "30m", "1h", "6h"):
        series[f'vkvagent_slo_burn_rate{{{target},objective="ttft",window="{window}"}}'] = "0.6x15"
    inputs = [{"series": name, "values": values} for name, values in series.items()]
    exprs = [{"expr": f"absent(({expr}) and on() vector(1))", "eval_time": "14m", "exp_samples": []}
             for _title, expr in queries() if "vkvagent_" in expr]  # fmt: skip
    assert len(exprs) >= len(VKVAGENT_PANELS)
    file = tmp_path / "agent.test.yml"
    test = {"interval": "1m", "input_series": inputs, "promql_expr_test": exprs}
    file.write_text(yaml.safe_dump({"rule_files": [], "tests": [test]}, width=1000))
    done = run_promtool("test", "rules", file)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
