"""Config files: merge order, typed values, located errors, refusal of unsafe files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vkvagent import config
from vkvagent.cli import main
from vkvagent.config import Config, ConfigError

ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(mode)
    return path


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    directory = tmp_path / "etc"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    return directory


def test_no_file_gives_the_documented_defaults(etc: Path) -> None:
    loaded = config.load(etc, as_root=False)
    assert loaded == Config()
    assert loaded.vllm.url == "http://127.0.0.1:8000"
    assert loaded.history.retention_days == 8.0
    assert loaded.agent.state_dir == "/var/lib/vkvagent"


def test_dropins_are_read_in_name_order_and_later_wins_key_by_key(etc: Path) -> None:
    write(etc / "config.toml", '[vllm]\nurl = "http://10.0.0.1:8000"\nread_timeout = 3\n')
    write(etc / "conf.d" / "20-late.toml", "[vllm]\nread_timeout = 9.5\n")
    write(etc / "conf.d" / "10-early.toml", "[vllm]\nread_timeout = 1\nmodel = 'llama'\n")
    write(etc / "conf.d" / "ignored.txt", "not toml at all [")
    loaded = config.load(etc, as_root=False)
    assert loaded.vllm.url == "http://10.0.0.1:8000"  # main file, untouched by drop-ins
    assert loaded.vllm.model == "llama"  # 10-early
    assert loaded.vllm.read_timeout == 9.5  # 20-late beats 10-early beats the main file
    assert isinstance(loaded.vllm.read_timeout, float)
    assert [p.name for p in config.config_files(etc)] == [
        "config.toml",
        "10-early.toml",
        "20-late.toml",
    ]


def test_a_single_file_is_read_alone(etc: Path) -> None:
    write(etc / "conf.d" / "10.toml", "[gpu]\nenabled = false\n")
    single = write(etc / "other.toml", "[gpu]\ndevices = [0, 3]\n")
    loaded = config.load(single, as_root=False)
    assert loaded.gpu.devices == (0, 3)
    assert loaded.gpu.enabled is True


def test_the_values_are_immutable(etc: Path) -> None:
    loaded = config.load(etc, as_root=False)
    with pytest.raises(AttributeError):
        loaded.vllm.url = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        ("[vllm]\nurll = 'x'\n", 2, "vllm.urll: unknown key (allowed: connect_timeout,"),
        (
            "[vlm]\nurl = 'x'\n",
            1,
            "vlm: unknown section (allowed: agent, gpu, history, restart, vllm)",
        ),
        (
            "\n\n[vllm]\nread_timeout = 'fast'\n",
            4,
            'read_timeout: expected a number, got string "fast"',
        ),
        (
            "[vllm]\nread_timeout = 0\n",
            2,
            "vllm.read_timeout: 0 is out of range (allowed: 0.1 to 300)",
        ),
        (
            "[vllm]\nmax_page_bytes = 1.5\n",
            2,
            "max_page_bytes: expected an integer, got number 1.5",
        ),
        ("[gpu]\nenabled = 1\n", 2, "gpu.enabled: expected true or false, got integer 1"),
        ("[gpu]\ndevices = 0\n", 2, "gpu.devices: expected a list of integers, got integer 0"),
        ("[gpu]\ndevices = [0, -1]\n", 2, "gpu.devices: list item integer -1: -1 is out of range"),
        ("[vllm]\nread_timeout = nan\n", 2, "vllm.read_timeout: must be finite"),
        ("vllm = 3\n", 1, "vllm: expected a table [vllm]"),
        ("[vllm]\nurl = 'a'\nurl = 'b'\n", 3, "syntax error: Cannot overwrite a value"),
        ("[vllm\n", 1, "syntax error"),
    ],
)
def test_errors_name_file_line_key_and_what_is_allowed(
    etc: Path, text: str, line: int, expected: str
) -> None:
    path = write(etc / "config.toml", text)
    with pytest.raises(ConfigError) as caught:
        config.load(etc, as_root=False)
    assert len(caught.value.problems) == 1
    problem = caught.value.problems[0]
    assert problem.startswith(f"{path}:{line}: "), problem
    assert expected in problem


def test_vllm_flags_are_checked_by_the_flag_catalogue(etc: Path) -> None:
    write(
        etc / "config.toml",
        "[vllm.flags]\ngpu-memory-utilization = 0.88\nenable_prefix_caching = true\n",
    )
    write(etc / "conf.d" / "10.toml", "[vllm.flags]\nmax-num-seqs = 128\n")
    loaded = config.load(etc, as_root=False)
    assert dict(loaded.vllm.flags) == {
        "gpu-memory-utilization": 0.88,
        "enable_prefix_caching": True,
        "max-num-seqs": 128,
    }
    bad = write(
        etc / "config.toml",
        "[vllm.flags]\nmax-num-seqs = 0\ntrust-remote-code = true\nblock-size = 'x'\nfoo = 1\n",
    )
    with pytest.raises(ConfigError) as caught:
        config.load(etc, as_root=False)
    problems = caught.value.problems
    assert problems[0].startswith(f"{bad}:2: vllm.flags.max-num-seqs: 0 is out of range")
    assert problems[1].startswith(
        f"{bad}:3: vllm.flags.trust-remote-code: not a flag vkvagent sets"
    )
    assert problems[2].startswith(f"{bad}:4: vllm.flags.block-size: ")
    assert problems[3].startswith(f"{bad}:5: vllm.flags.foo: unknown flag (allowed: ")
    assert len(problems) == 4


def test_every_problem_in_every_file_is_reported_at_once(etc: Path) -> None:
    write(etc / "config.toml", "[vllm]\nurll = 'x'\n[agent]\nsample_interval = -1\n")
    dropin = write(etc / "conf.d" / "50.toml", "[history]\nretention = 3\n")
    with pytest.raises(ConfigError) as caught:
        config.load(etc, as_root=False)
    problems = caught.value.problems
    assert len(problems) == 3
    assert any(p.startswith(f"{etc / 'config.toml'}:4: agent.sample_interval") for p in problems)
    assert any(p.startswith(f"{dropin}:2: history.retention: unknown key") for p in problems)


def test_an_explicit_path_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        config.load(tmp_path / "missing.toml", as_root=False)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"), reason="needs root")
@pytest.mark.parametrize(
    ("target", "change", "reason"),
    [
        ("file", lambda p: p.chmod(0o664), "writable by group or others (mode 0664)"),
        ("file", lambda p: p.chmod(0o646), "writable by group or others (mode 0646)"),
        ("dir", lambda p: p.chmod(0o777), "writable by group or others (mode 0777)"),
        ("file", lambda p: os.chown(p, 1000, 0), "owned by uid 1000, not root"),
        ("dropin", lambda p: p.chmod(0o666), "writable by group or others (mode 0666)"),
    ],
)
def test_root_refuses_files_others_could_have_written(etc: Path, target, change, reason) -> None:
    assert os.geteuid() == 0, "CI runs these as root; they must not skip there"
    main_file = write(etc / "config.toml", "[vllm]\nmodel = 'x'\n", mode=0o644)
    dropin = write(etc / "conf.d" / "10.toml", "[gpu]\nenabled = false\n", mode=0o640)
    (etc / "conf.d").chmod(0o755)
    config.load(etc)  # safe as written
    victim = {"file": main_file, "dir": etc, "dropin": dropin}[target]
    change(victim)
    with pytest.raises(ConfigError) as caught:
        config.load(etc)
    assert caught.value.problems == (f"{victim}: refused: {reason}; it controls a root service",)


def test_the_example_file_documents_every_key_with_its_default() -> None:
    example = (ROOT / "config.example.toml").read_text(encoding="utf-8")
    assert example == config.render(Config(), with_docs=True), "run: make config-example"
    assert config.load(ROOT / "config.example.toml", as_root=False) == Config()


def test_config_check_prints_the_effective_config(etc: Path, capsys) -> None:
    write(etc / "config.toml", "[vllm]\nmodel = 'm'\n", mode=0o600)
    write(etc / "conf.d" / "1.toml", "[history]\nretention_days = 2\n", mode=0o600)
    assert main(["config", "check", str(etc)]) == 0
    out = capsys.readouterr().out
    assert 'model = "m"' in out and "retention_days = 2.0" in out
    # What it prints is itself a valid config that loads to the same values.
    printed = write(etc / "printed.toml", out, mode=0o600)
    assert config.load(printed) == config.load(etc)


def test_config_check_reports_problems_and_fails(etc: Path, capsys) -> None:
    path = write(etc / "config.toml", "[vllm]\ntimeout = 3\n", mode=0o600)
    assert main(["config", "check", str(etc)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"vkvagent: {path}:2: vllm.timeout: unknown key")
    assert "Traceback" not in err


keys = st.sampled_from(["url", "model", "read_timeout", "max_page_bytes", "unit", "bogus"])
values = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(keys, values, max_size=4))
def test_any_value_is_either_accepted_with_its_type_or_refused_cleanly(
    tmp_path_factory, table
) -> None:
    directory = tmp_path_factory.mktemp("cfg")
    lines = ["[vllm]"]
    for key, value in table.items():
        lines.append(
            f"{key} = {config._toml_value(tuple(value) if isinstance(value, list) else value)}"
        )
    path = write(directory / "c.toml", "\n".join(lines) + "\n", mode=0o600)
    try:
        loaded = config.load(path)
    except ConfigError as exc:
        assert all(p.startswith(f"{path}:") for p in exc.problems)
    else:
        for key, value in table.items():
            got = getattr(loaded.vllm, key)
            assert type(got) is type(getattr(Config().vllm, key))
            assert got == value
