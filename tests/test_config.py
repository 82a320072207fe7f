"""Config files: merge order, typed values, located errors, refusal of unsafe files."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vkvagent.engine import Settings
from vkvagent.engine.baseline import BaselineSettings
from vkvagent.engine.diagnosis import DiagnosisSettings
from vkvagent.engine.liveness import LivenessSettings
from vkvagent.engine.policy import PolicySettings
from vkvagent.engine.slo import SloSettings
from vkvagent.knowledge import config, toml_schema
from vkvagent.knowledge.config import Config, ConfigError
from vkvagent.tools.cli import main

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


def test_a_directory_whose_toml_files_would_not_be_read_is_refused(etc: Path) -> None:
    # conf.d named in place of the directory above it: its files are not read as drop-ins.
    write(etc / "conf.d" / "50-enforce.toml", "[policy]\nmode = 'enforced'\n")
    with pytest.raises(config.ConfigError, match=r"conf.d: 50-enforce.toml would not be read: "):
        config.load(etc / "conf.d", as_root=False)
    with pytest.raises(config.ConfigError, match=r"mode"):  # read from the directory above
        config.load(etc, as_root=False)
    # An empty directory holds nothing to miss: the defaults.
    (etc / "empty").mkdir()
    assert config.load(etc / "empty", as_root=False) == config.Config()


def test_a_vllm_url_the_client_cannot_read_is_refused(etc: Path) -> None:
    for url in ("ftp://x", "http://", "http://host:port", "http://host:99999"):
        write(etc / "config.toml", f"[vllm]\nurl = '{url}'\n")
        with pytest.raises(config.ConfigError, match=r"is not an http\(s\) URL"):
            config.load(etc, as_root=False)
    for url in ("https://vllm.internal:8443", "127.0.0.1:8000", "http://[::1]:8000/v"):
        write(etc / "config.toml", f"[vllm]\nurl = '{url}'\n")
        assert config.load(etc, as_root=False).vllm.url == url


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
        (
            "[vllm]\nurll = 'x'\n",
            2,
            "vllm.urll: unknown key (allowed: api_key_file, apply_flags, ca_file",
        ),
        (
            "[vlm]\nurl = 'x'\n",
            1,
            "vlm: unknown section (allowed: agent, baseline, diagnosis, fleet, gpu, history, "
            "metrics, policy, probe, restart, slo, vllm)",
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
        ("[vllm]\nunit = '../../tmp/x.service'\n", 2, "vllm.unit: '../../tmp/x.service' is not"),
        ("[vllm]\nunit = 'vllm.socket'\n", 2, "vllm.unit: 'vllm.socket' is not a service unit"),
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


# -- the decision engine's sections ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "engine"),
    [
        ("baseline", BaselineSettings),
        ("diagnosis", DiagnosisSettings),
        ("policy", PolicySettings),
        ("slo", SloSettings),
    ],
)
def test_engine_sections_mirror_the_engine_settings_key_for_key(name: str, engine: type) -> None:
    section = getattr(Config(), name)
    keys = {f.name: f.default for f in dataclasses.fields(section)}
    wanted = {f.name: f.default for f in dataclasses.fields(engine)}
    if name == "policy":  # the drain belongs to [restart], which the actuator reads too
        for key in ("drain_max_in_flight", "drain_timeout"):
            assert wanted.pop(key) == getattr(Config().restart, key)
        # A crash loop's thresholds are the operator's policy, and liveness's to apply.
        for key in ("crash_loop_exits", "crash_loop_window"):
            assert keys.pop(key) == getattr(LivenessSettings(), key)
    if name == "diagnosis":  # the probe's pace belongs to [probe], which the daemon reads too
        assert wanted.pop("probe_after") == Config().probe.after
    assert keys == wanted
    for spec in dataclasses.fields(section):
        assert spec.metadata["doc"].endswith("."), spec.name


def test_the_defaults_build_the_engine_defaults_and_never_restart(etc: Path) -> None:
    loaded = config.load(etc, as_root=False)
    assert loaded.engine_settings() == Settings()
    assert loaded.policy.mode == "observe"  # an operator must opt in to enforce


def test_engine_sections_reach_the_engine(etc: Path) -> None:
    write(
        etc / "config.toml",
        "[baseline]\nwindow = 120\nmin_values = 5\n[diagnosis]\nenter_ratio = 0.7\n"
        "[policy]\nmode = 'enforce'\ntimezone = 'Europe/Paris'\n"
        "windows = ['mon-fri 01:00-05:00', 'sat,sun 22:00-06:00']\nemergency = []\n"
        "max_uptime = 21600\n[restart]\ndrain_max_in_flight = 4\n",
    )
    settings = config.load(etc, as_root=False).engine_settings()
    assert (settings.baseline.window, settings.baseline.min_values) == (120.0, 5)
    assert settings.diagnosis.enter_ratio == 0.7
    p = settings.policy
    assert (p.mode, p.timezone, p.emergency, p.max_uptime) == (
        "enforce",
        "Europe/Paris",
        (),
        21600.0,
    )
    assert p.windows == ("mon-fri 01:00-05:00", "sat,sun 22:00-06:00")
    assert p.drain_max_in_flight == 4 and isinstance(p.max_uptime, float)


def test_the_drain_a_restart_is_priced_at_is_vllms_own_from_vllm_flags(etc: Path) -> None:
    """[vllm.flags] shutdown-timeout overrides [restart] drain_timeout on vLLM's command line
    (``Actuator.drain_flags``), so it bounds the drain the [slo] budget prices a restart at."""
    write(etc / "config.toml", "[restart]\ndrain_timeout = 90\n")
    assert config.load(etc, as_root=False).engine_settings().policy.drain_timeout == 90.0
    write(
        etc / "config.toml", "[restart]\ndrain_timeout = 90\n[vllm.flags]\nshutdown_timeout = 20\n"
    )
    assert config.load(etc, as_root=False).engine_settings().policy.drain_timeout == 20.0


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        ("[policy]\nmode = 'on'\n", 2,
         'policy.mode: string "on" is not allowed (allowed: off, observe, enforce)'),
        ("[policy]\ntimezone = 'Mars/Olympus'\n", 2,
         'policy.timezone: string "Mars/Olympus" is not an IANA time zone (allowed: names like '
         "UTC, Europe/Paris)"),
        ("[policy]\ntimezone = '../etc/passwd'\n", 2, "is not an IANA time zone"),
        ("[policy]\nwindows = ['mon-fri 01:00-05:00', 'mon-fry 1:00-2:00']\n", 2,
         "policy.windows: list item string \"mon-fry 1:00-2:00\": bad days 'mon-fry' (allowed: "
         "daily, *, mon, tue"),
        ("[policy]\nwindows = ['daily 25:00-03:00']\n", 2,
         "times must be 00:00 to 23:59 (the end up to 24:00)"),
        ("[policy]\nwindows = 'daily 01:00-02:00'\n", 2,
         "policy.windows: expected a list of strings, got string"),
        ("[policy]\nemergency = ['stall', 'gpu_throttle']\n", 2,
         'policy.emergency: list item string "gpu_throttle": string "gpu_throttle" is not '
         "allowed (allowed: crash_loop, dead, host_memory_growth, kv_pressure, kv_stranded, "
         "stall, start_hung, unresponsive, uptime_decline)"),
        ("[policy]\nmax_per_day = 0\n", 2, "policy.max_per_day: 0 is out of range (allowed: 1 to"),
        ("[baseline]\nwindow = 5\n", 2, "baseline.window: 5 is out of range (allowed: 10 to 3600)"),
        ("[diagnosis]\nkv_full = 1.5\n", 2, "diagnosis.kv_full: 1.5 is out of range"),
        ("\n[diagnosis]\nhold = 60\nenter_ratio = 0.9\n", 4,
         "diagnosis.enter_ratio: need 0 < enter_ratio <= leave_ratio (enter_ratio = 0.9, "
         "leave_ratio = 0.85)"),
        ("[diagnosis]\nkv_full = 0.5\n", 2,
         "diagnosis.kv_full: need 0 < kv_stranded_below <= kv_full <= 1 (kv_stranded_below = "
         "0.8, kv_full = 0.5)"),
        ("[baseline]\nmax_values = 5\n", 2,
         "baseline.max_values: need 1 <= min_values <= max_values (min_values = 10, "
         "max_values = 5)"),
    ],
)  # fmt: skip
def test_engine_keys_are_checked_alone_and_together(
    etc: Path, text: str, line: int, expected: str
) -> None:
    path = write(etc / "config.toml", text)
    with pytest.raises(ConfigError) as caught:
        config.load(etc, as_root=False)
    assert len(caught.value.problems) == 1, caught.value.problems
    problem = caught.value.problems[0]
    assert problem.startswith(f"{path}:{line}: "), problem
    assert expected in problem, problem


def test_contradictions_across_files_are_located_and_reported_with_the_rest(etc: Path) -> None:
    main_file = write(etc / "config.toml", "[diagnosis]\nleave_ratio = 0.8\n[vllm]\nurll = 1\n")
    dropin = write(etc / "conf.d" / "50.toml", "[diagnosis]\nenter_ratio = 0.82\n")
    with pytest.raises(ConfigError) as caught:
        config.load(etc, as_root=False)
    assert caught.value.problems[0].startswith(f"{main_file}:4: vllm.urll: unknown key")
    assert caught.value.problems[1] == (
        f"{dropin}:2: diagnosis.enter_ratio: need 0 < enter_ratio <= leave_ratio "
        "(enter_ratio = 0.82, leave_ratio = 0.8)"
    )
    assert len(caught.value.problems) == 2


def test_restart_hooks_must_be_programs_that_can_run(etc: Path, tmp_path: Path) -> None:
    script = write(tmp_path / "lb", "#!/bin/sh\n", mode=0o755)
    main_file = write(
        etc / "config.toml",
        f'[restart]\npre_stop = ["{script}", "out"]\npost_ready = ["lb", "in"]\n',
    )
    with pytest.raises(ConfigError) as caught:
        config.load(etc, as_root=False)
    assert list(caught.value.problems) == [
        f"{main_file}:3: restart.post_ready: the post_ready program 'lb' is not an absolute "
        'path (hooks run without a shell or PATH search) (post_ready = ["lb", "in"])'
    ]
    write(etc / "config.toml", f'[restart]\npre_stop = ["{script}", "out"]\n')
    loaded = config.load(etc, as_root=False)
    assert loaded.restart.pre_stop == (str(script), "out")
    assert loaded.restart.post_ready == () and loaded.restart.when_busy == "proceed"


@pytest.mark.parametrize(
    ("written", "read"),
    [("vllm", "vllm.service"), ("vllm@a", "vllm@a.service"), ("vllm-0.10", "vllm-0.10.service"),
     ("vllm.service", "vllm.service"), ("vllm@a.service", "vllm@a.service")],
)  # fmt: skip
def test_a_unit_name_without_a_suffix_is_a_service_as_systemctl_reads_it(
    etc: Path, written: str, read: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main_file = write(etc / "config.toml", f"[vllm]\nunit = '{written}'\n", mode=0o600)
    notes: list[str] = []
    assert config.load(etc, as_root=False, notes=notes).vllm.unit == read
    said = [f'{main_file}:2: vllm.unit: "{written}" read as "{read}"'] if written != read else []
    assert notes == said
    assert main(["config", "check", str(etc)]) == 0
    out = capsys.readouterr().out
    assert f'\nunit = "{read}"\n' in out
    assert all(f"# {note}\n" in out for note in said)


def test_a_conf_d_file_not_named_toml_is_reported_and_editor_leftovers_are_not(
    etc: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(etc / "config.toml", "[vllm]\nmodel = 'm'\n", mode=0o600)
    typo = write(etc / "conf.d" / "60-win.tom", "[policy]\nmode = 'enforce'\n", mode=0o600)
    for leftover in ("60-win.toml~", ".60-win.toml.swp", "60-win.toml.dpkg-old", "60.toml.bak",
                     "60.toml.rpmsave"):  # fmt: skip
        write(etc / "conf.d" / leftover, "[policy]\nmode = 'enforce'\n", mode=0o600)
    (etc / "conf.d" / "old").mkdir()  # a directory is nobody's config file either
    notes: list[str] = []
    assert config.load(etc, as_root=False, notes=notes).policy.mode == "observe"
    assert notes == [f"{typo}: ignored: conf.d reads only *.toml files"]
    assert main(["config", "check", str(etc)]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("# configuration valid, with 1 warning(s) on stderr; read: ")
    assert f"vkvagent: warning: {typo}: ignored: conf.d reads only *.toml files\n" in said.err
    assert "60-win.toml~" not in said.err and ".swp" not in said.err


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
    assert example == toml_schema.render(Config(), with_docs=True), "run: make config-example"
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
            f"{key} = {toml_schema.toml_value(tuple(value) if isinstance(value, list) else value)}"
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
            assert got == value or (key == "unit" and got == f"{value}.service")
