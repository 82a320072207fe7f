"""The fuzz targets of ``make reliability`` (reliability/fuzz.py) at the small hypothesis
profile, and the bugs they found, each pinned by a plain example."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability import fuzz
from reliability.report import table
from tests.sandbox import require
from vkvagent.adapters import query_range
from vkvagent.knowledge import config, toml_schema
from vkvagent.knowledge.config import Config, ConfigError
from vkvagent.tools import replay


@pytest.mark.parametrize("target", list(fuzz.TARGETS))
def test_fuzz_target_at_the_ci_profile(target: str) -> None:
    before = fuzz.COUNTS[target]
    fuzz.TARGETS[target](fuzz.CI)()  # raises hypothesis' shrunk failure
    assert fuzz.COUNTS[target] - before >= 5


@pytest.mark.systemd
def test_drop_ins_read_back_by_a_real_systemd() -> None:
    """Hostile argvs (and rewritten vllm command lines, when the flags target ran first)
    rendered as drop-ins: systemd's ExecStart over D-Bus, and the started process's argv,
    are exactly the intended argv."""
    require()
    row = fuzz.run_systemd(fuzz.CI, executed=8)
    assert not row.failures, row.failures
    # 15 generated argvs and the explicit ones, whatever ran before; rewritten command lines
    # come on top when the flags target ran first in this process.
    assert (row.inputs or 0) >= 15


# -- what fuzzing found ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("points", "message"),
    [
        # datetime cannot hold it: was "internal error: ValueError: year ... is out of range"
        ([[1e15, "1"], [1e15 + 15, "1"]], "time 1e+15 is not between 1970 and 9999"),
        ([[-1e12, "1"], [-1e12 + 15, "1"]], "time -1e+12 is not between 1970 and 9999"),
        # one point far from the rest: the gap was filled with 1e11 timestamps (MemoryError)
        ([[1, "1"], [2, "1"], [1e11, "1"]], "is over 4,000,000 evaluations"),
    ],
)
def test_replay_refuses_times_it_cannot_replay_in_one_line(
    tmp_path: Path, points: list[list[object]], message: str
) -> None:
    path = tmp_path / "range.json"
    path.write_text(fuzz.query_range(points))
    with pytest.raises(query_range.ReplayError) as raised:
        replay.run(Config().engine_settings(), query_range.load_files([path]))
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("text", ["😀", "a\x7fb", 'é\u2028\x01\n"\\', "\U0010ffff"])
def test_rendered_config_loads_back(tmp_path: Path, text: str) -> None:
    """`vkvagent config check` prints the effective config as TOML; characters beyond U+FFFF
    were written as JSON's surrogate pairs, which TOML refuses, and DEL was left raw."""
    path = tmp_path / "c.toml"
    path.write_text(f"[vllm]\nmodel = {fuzz._toml_string(text)}\n")
    loaded = config.load(path, as_root=False)
    assert loaded.vllm.model == text
    again = tmp_path / "again.toml"
    again.write_text(toml_schema.render(loaded))
    assert config.load(again, as_root=False) == loaded


@pytest.mark.parametrize("key", ["\r", "a\nb", "x\u2028y", "é"])
def test_a_problem_with_an_odd_key_stays_one_line(tmp_path: Path, key: str) -> None:
    path = tmp_path / "c.toml"
    quoted = fuzz._toml_string(key)
    path.write_text(f"[agent]\n{quoted} = 1\n[vllm.flags]\n{quoted} = 1\n")
    with pytest.raises(ConfigError) as raised:
        config.load(path, as_root=False)
    assert len(raised.value.problems) == 2
    for problem in raised.value.problems:
        assert fuzz.one_line(problem), repr(problem)
        assert problem.startswith(f"{path}:")


def test_the_table_counts_what_ran() -> None:
    row = fuzz.run_target("flags", fuzz.CI)
    assert not row.failures and row.inputs == row.trials and row.trials >= 5
    assert "| fuzz: flag rewriter |" in table([row])
