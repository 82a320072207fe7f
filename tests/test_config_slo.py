"""[slo]: the operator's objectives in the config, and what `config check` says of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vkvagent.adapters.history import History
from vkvagent.engine.samples import Sample
from vkvagent.engine.slo import SloSettings
from vkvagent.knowledge import config
from vkvagent.knowledge.config import Config, ConfigError, SloConfig
from vkvagent.knowledge.vllm_metrics import Normaliser
from vkvagent.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
# The issue's example: 99.9 % of requests served, TTFT <= 2 s and ITL <= 100 ms for 95 %.
EXAMPLE = SloSettings(availability=0.999, ttft_seconds=2.0, itl_seconds=0.1)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o600)
    return path


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    """A config directory whose state_dir (the history config check reads) is the test's."""
    directory = tmp_path / "etc"
    write(directory / "conf.d" / "00-state.toml", f"[agent]\nstate_dir = '{tmp_path / 'state'}'\n")
    return directory


def test_nothing_is_declared_by_default_and_the_defaults_are_the_engines() -> None:
    assert Config().slo.settings() == SloSettings()
    assert Config().engine_settings().slo.declared == ()


def test_the_table_reaches_the_engine(etc: Path) -> None:
    write(etc / "config.toml", "[slo]\navailability = 0.999\nttft_seconds = 2\nitl_seconds = 0.1\n")
    loaded = config.load(etc, as_root=False)
    assert loaded.engine_settings().slo == EXAMPLE
    assert isinstance(loaded.slo.ttft_seconds, float)  # written 2, read as a number of seconds
    assert EXAMPLE.declared == ("availability", "ttft", "itl")
    write(etc / "config.toml", "[slo]\nttft_seconds = 1.5\nttft_share = 0.99\nperiod_days = 7\n")
    slo = config.load(etc, as_root=False).engine_settings().slo
    assert (slo.declared, slo.ttft_share, slo.period) == (("ttft",), 0.99, 7 * 86400.0)


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        ("[slo]\navailability = 1\n", 2,
         "slo.availability: 1 is out of range (allowed: 0.5 to 0.99999)"),
        ("[slo]\n\nttft_seconds = 0\n", 3,
         "slo.ttft_seconds: 0 is out of range (allowed: 0.001 to 3600)"),
        ("[slo]\nitl_seconds = '100ms'\n", 2,
         'slo.itl_seconds: expected a number, got string "100ms" (allowed: 0.0001 to 60)'),
        ("[slo]\nttft_share = 95\n", 2, "slo.ttft_share: 95 is out of range (allowed: 0.5 to"),
        ("[slo]\nperiod_days = 0.5\n", 2, "slo.period_days: 0.5 is out of range (allowed: 1 to"),
        ("[slo]\navailability = true\n", 2, "slo.availability: expected a number, got boolean"),
        ("[slo]\nlatency = 2\n", 2, "slo.latency: unknown key (allowed: availability, itl_"),
    ],
)  # fmt: skip
def test_values_out_of_range_are_refused_at_their_line(
    etc: Path, text: str, line: int, expected: str
) -> None:
    path = write(etc / "config.toml", text)
    with pytest.raises(ConfigError) as caught:
        config.load(etc, as_root=False)
    (problem,) = caught.value.problems
    assert problem.startswith(f"{path}:{line}: "), problem
    assert expected in problem, problem


def test_a_share_or_period_without_its_objective_is_a_warning(
    etc: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(etc / "config.toml", "[slo]\nperiod_days = 7\nttft_share = 0.99\n")
    notes: list[str] = []
    assert config.load(etc, as_root=False, notes=notes).slo.settings().declared == ()
    assert notes == [
        f"{path}:2: slo.period_days: set without availability, ttft_seconds or itl_seconds: "
        f"{config.UNDECLARED}",
        f"{path}:3: slo.ttft_share: set without slo.ttft_seconds: {config.UNDECLARED}",
    ]
    assert main(["config", "check", str(etc)]) == 0
    err = capsys.readouterr().err
    assert f"vkvagent: warning: {path}:3: slo.ttft_share: set without slo.ttft_seconds" in err
    # With availability declared, the period shapes it; an ITL share still shapes nothing,
    # unless it is the default written out (as `config check` prints it).
    text = "[slo]\navailability = 0.99\nperiod_days = 7\nitl_share = {}\nttft_share = 0.95\n"
    write(etc / "config.toml", text.format(0.9))
    notes.clear()
    config.load(etc, as_root=False, notes=notes)
    assert notes == [f"{path}:4: slo.itl_share: set without slo.itl_seconds: {config.UNDECLARED}"]
    write(etc / "config.toml", text.format(0.95))
    notes.clear()
    config.load(etc, as_root=False, notes=notes)
    assert notes == []


def test_what_the_engine_refuses_is_located_at_the_key() -> None:
    # Beyond the config's own ranges only by building the section directly: the engine's
    # rules stay the last word, and are reported where the key was set.
    built = Config(slo=SloConfig(availability=1.0))
    problems = config._engine_problems(built, {("slo", "availability"): "f.toml:3"})
    assert problems == [
        "f.toml:3: slo.availability: availability 1 (allowed: above 0, below 1) "
        "(availability = 1.0)"
    ]


def test_the_example_file_shows_the_table_commented_out_with_the_issues_example(
    tmp_path: Path,
) -> None:
    example = (ROOT / "config.example.toml").read_text(encoding="utf-8")
    block = example[example.index("\n# [slo]\n") : example.index("\n[fleet]")]
    assert "\n# availability = 0.999\n" in block and "\n# ttft_seconds = 2.0\n" in block
    assert "\n# itl_seconds = 0.1\n" in block and "\n# ttft_share = 0.95\n" in block
    # Uncommented, the table declares the example; the doc lines stay comments.
    keys = re.sub(r"^# (\[slo\]|[a-z_]+ = )", r"\1", block, flags=re.MULTILINE)
    loaded = config.load(write(tmp_path / "slo.toml", keys), as_root=False)
    assert loaded.engine_settings().slo == EXAMPLE


def test_config_check_shows_the_objectives_set_and_the_others_as_examples(
    etc: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(etc / "config.toml", "[slo]\nttft_seconds = 2\n")
    assert main(["config", "check", str(etc)]) == 0
    out = capsys.readouterr().out
    assert "\n[slo]\n# availability = 0.999\nperiod_days = 28.0\nttft_seconds = 2.0\n" in out
    printed = write(etc.parent / "printed.toml", out)
    assert config.load(printed, as_root=False) == config.load(etc, as_root=False)


def test_config_check_says_which_buckets_a_target_falls_between(
    etc: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        etc / "config.toml", "[slo]\navailability = 0.999\nttft_seconds = 2\nitl_seconds = 0.09\n"
    )
    assert main(["config", "check", str(etc)]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("# configuration OK; ")
    assert said.err == ""
    # No history yet: every vLLM version's buckets agree on these targets.
    assert (
        "\n# slo: ttft_seconds 2 falls between vLLM's buckets 1 and 2.5 s: attainment is "
        "interpolated within that bucket, as histogram_quantile does (buckets of every vLLM "
        "version; the running vLLM's are unknown: "
    ) in said.out
    assert "# slo: itl_seconds 0.09 falls between vLLM's buckets 0.075 and 0.1 s" in said.out
    assert "no history database" in said.out
    assert "slo: availability" not in said.out  # no histogram behind it


def test_a_target_beyond_the_last_bucket_is_a_warning(
    etc: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(etc / "config.toml", "[slo]\nttft_seconds = 15\nitl_seconds = 0.1\n")
    assert main(["config", "check", str(etc)]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("# configuration valid, with 1 warning(s) on stderr; ")
    # V1 pages have buckets up to 2560 s; V0's stop at 10 s.
    assert (
        "# slo: ttft_seconds 15 falls between vLLM's buckets 10 and 20 s: attainment is "
        "interpolated within that bucket, as histogram_quantile does (buckets of vLLM V1; "
    ) in said.out
    assert "# slo: itl_seconds 0.1 is one of vLLM's bucket bounds (0.1 s): attainment is " in (
        said.out
    )
    (warning,) = said.err.splitlines()
    assert warning.startswith(
        "vkvagent: warning: slo: ttft_seconds 15 is beyond vLLM's last finite bucket bound, "
        "10 s: only what that bound holds counts as within the target (buckets of vLLM V0; "
    )


def test_config_check_reads_the_running_vllms_buckets_from_the_history(
    etc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = (ROOT / "tests" / "fixtures" / "metrics" / "v1-0.32-cpu.prom").read_text()
    metrics = Normaliser().normalise(page, "0.32.0")
    with History(tmp_path / "state") as history:
        history.append(Sample(time=1_764_000_000.0, mono=10.0, vllm=metrics))
        # The newest sample has no vLLM (it was down): the one before has its buckets.
        history.append(Sample(time=1_764_000_010.0, mono=20.0, vllm=None, vllm_error="refused"))
    write(etc / "config.toml", "[slo]\nttft_seconds = 3000\n")
    assert main(["config", "check", str(etc)]) == 0
    said = capsys.readouterr()
    assert said.err == (
        "vkvagent: warning: slo: ttft_seconds 3000 is beyond vLLM's last finite bucket bound, "
        "2560 s: only what that bound holds counts as within the target (buckets of vLLM "
        f"0.32.0, its sample of 2025-11-24T16:00:00Z in {history.path})\n"
    )
