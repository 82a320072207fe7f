"""The flag catalogue, validation, and command-line rewriting; rewrites are cross-checked with
the simulator's model of each vLLM release's parser (test tooling: agent code never imports it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reliability.fuzz import valid_value
from vkvagent.engine.samples import FlagValue
from vkvagent.knowledge.flags import (
    CATALOGUE,
    FOREIGN,
    FlagError,
    canonical_name,
    parse_version,
    render_flag,
    render_value,
    validate,
)
from vkvagent.knowledge.vllm_command import VllmCommandError, apply_flags, parse_command
from vkvagent.sim import serve_args as sim

LATEST = "0.18.0"

# --------------------------------------------------------------------------------------------
# The catalogue


def test_catalogue_entries_are_complete() -> None:
    for name, flag in CATALOGUE.items():
        assert name == flag.name == canonical_name(name)
        assert flag.kind in ("float", "int", "bool", "choice")
        assert flag.doc.endswith(".") and "\n" not in flag.doc
        if flag.kind in ("float", "int"):
            assert flag.minimum is not None and flag.maximum is not None
            assert flag.minimum <= flag.maximum
        if flag.kind == "choice":
            assert flag.choices
        if flag.min_version or flag.max_version:
            assert flag.version_note
        assert name not in FOREIGN


def test_attestable_flags_and_their_labels() -> None:
    """What vllm:cache_config_info shows, and under which label."""
    labels = {n: f.attest_label for n, f in CATALOGUE.items() if f.attest_label}
    assert labels == {
        "gpu-memory-utilization": "gpu_memory_utilization",
        "block-size": "block_size",
        "enable-prefix-caching": "enable_prefix_caching",
        "kv-cache-dtype": "cache_dtype",
        "swap-space": "swap_space_bytes",
        "cpu-offload-gb": "cpu_offload_gb",
    }
    for name in ("max-num-seqs", "max-num-batched-tokens", "max-model-len", "preemption-mode"):
        assert CATALOGUE[name].attest_label is None


@pytest.mark.parametrize(
    ("name", "version", "available"),
    [
        ("swap-space", "0.6.6", True),
        ("swap-space", "0.10.1", True),
        ("swap-space", "0.11.0", False),
        ("swap-space", "0.18.0", False),
        ("preemption-mode", "0.7.3", True),
        ("preemption-mode", "0.8.0", False),  # forces the V0 fallback (#18115)
        ("preemption-mode", "0.11.0", False),
        ("shutdown-timeout", "0.17.1", False),
        ("shutdown-timeout", "0.18.0rc1", True),
        ("shutdown-timeout", "0.30.0", True),
        ("max-num-seqs", "0.4.0", True),
    ],
)
def test_version_gates(name: str, version: str, available: bool) -> None:
    assert CATALOGUE[name].available(parse_version(version)) is available


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("0.10.1", (0, 10, 1)),
        ("v0.9.2", (0, 9, 2)),
        ("0.11.0rc2", (0, 11, 0)),
        ("0.10.2.dev5+g1234abc", (0, 10, 2)),
        ("0.9.0.post1+cu128", (0, 9, 0)),
        ("1", (1, 0, 0)),
        (" 0.18 ", (0, 18, 0)),
    ],
)
def test_parse_version(text: str, version: tuple[int, int, int]) -> None:
    assert parse_version(text) == version


@pytest.mark.parametrize("text", ["", "dev", "latest", "x0.1"])
def test_parse_version_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_version(text)


# --------------------------------------------------------------------------------------------
# validate


def test_validate_types_and_names() -> None:
    assert validate(
        {
            "max_num_seqs": "128",
            "--gpu-memory-utilization": 0.88,
            "block-size": "16",
            "enable-prefix-caching": "False",
            "enforce_eager": True,
            "cpu-offload-gb": 2,
            "kv-cache-dtype": "fp8",
            "max-model-len": 32768,
        },
        "0.10.1",
    ) == {
        "gpu-memory-utilization": 0.88,
        "block-size": 16,
        "enable-prefix-caching": False,
        "max-num-seqs": 128,
        "max-model-len": 32768,
        "kv-cache-dtype": "fp8",
        "enforce-eager": True,
        "cpu-offload-gb": 2.0,
    }
    assert isinstance(validate({"cpu-offload-gb": 2}, None)["cpu-offload-gb"], float)


def refused(flags: Mapping[str, object], version: str | None = LATEST) -> list[str]:
    with pytest.raises(FlagError) as caught:
        validate(flags, version)
    problems = list(caught.value.problems)
    assert str(caught.value) == "\n".join(problems)
    for problem in problems:
        assert "\n" not in problem
        assert problem.startswith(("--", "vLLM version", "'"))
    return problems


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"frobnicate": 1}, "--frobnicate: unknown flag (allowed: gpu-memory-utilization, "),
        ({"no-enforce-eager": True}, "--no-enforce-eager: set --enforce-eager to false"),
        ({"trust-remote-code": True}, "--trust-remote-code: not a flag vkvagent sets: it lets"),
        ({"model": "x"}, "--model: not a flag vkvagent sets"),
        ({"port": 8001}, "--port: not a flag vkvagent sets"),
        ({"api_key": "k"}, "--api-key: not a flag vkvagent sets: it is a secret"),
        ({"tensor-parallel-size": 2}, "--tensor-parallel-size: not a flag vkvagent sets: it"),
        ({"served-model-name": "m"}, "--served-model-name: not a flag vkvagent sets"),
        ({"host": "::"}, "--host: not a flag vkvagent sets"),
        ({"max-num-seqs": 0}, "--max-num-seqs: 0 is out of range (allowed: 1 to 4096)"),
        ({"max-num-seqs": 4097}, "--max-num-seqs: 4097 is out of range (allowed: 1 to 4096)"),
        ({"max-num-seqs": 1.5}, "--max-num-seqs: expected an integer, got number 1.5"),
        ({"max-num-seqs": True}, "--max-num-seqs: expected an integer, got boolean True"),
        ({"max-num-seqs": "12 --x"}, "--max-num-seqs: expected an integer, got string '12 --x'"),
        (
            {"gpu-memory-utilization": 0.99},
            "--gpu-memory-utilization: 0.99 is out of range (allowed: 0.1 to 0.98)",
        ),
        ({"gpu-memory-utilization": math.nan}, "--gpu-memory-utilization: must be finite"),
        ({"gpu-memory-utilization": "inf"}, "--gpu-memory-utilization: expected a number"),
        ({"block-size": 24}, "--block-size: integer 24 is not allowed (allowed: 8, 16, 32, 64"),
        ({"kv-cache-dtype": "fp4"}, "--kv-cache-dtype: string 'fp4' is not allowed (allowed: auto"),
        ({"enforce-eager": "yes"}, "--enforce-eager: expected true or false, got string 'yes'"),
        ({"enforce-eager": 1}, "--enforce-eager: expected true or false, got integer 1"),
        ({"shutdown-timeout": -1}, "--shutdown-timeout: -1 is out of range (allowed: 0 to 3600)"),
    ],
)
def test_validate_refuses(flags: dict[str, object], expected: str) -> None:
    (problem,) = refused(flags)
    assert problem.startswith(expected), problem


def test_validate_lists_every_problem() -> None:
    problems = refused(
        {"model": "x", "max-num-seqs": 0, "swap-space": 4, "nope": 1, "block-size": 7}, "0.11.0"
    )
    assert [p.split(":")[0] for p in problems] == [
        "--model",
        "--max-num-seqs",
        "--swap-space",
        "--nope",
        "--block-size",
    ]


def test_validate_shows_odd_names_on_one_line() -> None:
    (problem,) = refused({"x\n[Service]": 1})
    assert problem.startswith("'x\\n[Service]': unknown flag (allowed: ")


def test_validate_refuses_a_flag_given_twice() -> None:
    (problem,) = refused({"max-num-seqs": 1, "max_num_seqs": 2})
    assert problem.startswith("--max-num-seqs: given twice")


@pytest.mark.parametrize(
    ("flags", "version", "expected"),
    [
        (
            {"shutdown-timeout": 30},
            "0.17.1",
            "--shutdown-timeout: not settable on vLLM 0.17.1: the flag was added in 0.18 "
            "(PR #36666) (allowed: vLLM >= 0.18)",
        ),
        ({"swap-space": 4}, "0.11.0", "--swap-space: not settable on vLLM 0.11.0: the V1"),
        ({"preemption-mode": "swap"}, "0.10.1", "--preemption-mode: not settable on vLLM 0.10.1"),
        (
            {"shutdown-timeout": 30},
            None,
            "--shutdown-timeout: the vLLM version is unknown and this flag is only set on "
            "vLLM >= 0.18",
        ),
        ({"max-num-seqs": 8}, "latest", "vLLM version 'latest': not a version number"),
    ],
)
def test_validate_refuses_by_version(
    flags: dict[str, object], version: str | None, expected: str
) -> None:
    (problem,) = refused(flags, version)
    assert problem.startswith(expected), problem


def test_validate_without_a_version_takes_ungated_flags() -> None:
    assert validate({"max-num-seqs": 8, "enforce-eager": False}, None) == {
        "max-num-seqs": 8,
        "enforce-eager": False,
    }
    assert validate({"swap-space": 8, "preemption-mode": "swap"}, "0.6.6") == {
        "swap-space": 8.0,
        "preemption-mode": "swap",
    }


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            {"max-num-seqs": 256, "max-num-batched-tokens": 128},
            "--max-num-batched-tokens: 128 is below --max-num-seqs 256",
        ),
        (
            {
                "max-num-batched-tokens": 4096,
                "max-model-len": 8192,
                "enable-chunked-prefill": False,
            },
            "--max-num-batched-tokens: 4096 is below --max-model-len 8192 with chunked prefill off",
        ),
        ({"preemption-mode": "swap", "swap-space": 0}, "--preemption-mode: swap needs CPU swap"),
    ],
)
def test_validate_refuses_combinations_vllm_refuses(
    flags: dict[str, object], expected: str
) -> None:
    (problem,) = refused(flags, "0.6.6")
    assert problem.startswith(expected), problem


INJECTIONS = [
    "16 --trust-remote-code",
    "16\n[Service]\nExecStartPre=/bin/sh",
    "0.9;rm",
    "fp8\0",
    "auto'",
    'auto"',
    "auto\\",
    "%n",
    "$HOME",
    "${X}",
    "--enforce-eager",
    " 16",
    "16 ",
    "true --x",
]


@pytest.mark.parametrize("name", list(CATALOGUE))
@pytest.mark.parametrize("value", INJECTIONS)
def test_no_value_can_add_an_argument(name: str, value: str) -> None:
    """Typed values only: text with whitespace, quotes, '%', '$', ';'... is never accepted
    (' 16' and '16 ' read as numbers once stripped, and are then written as '16')."""
    try:
        typed = validate({name: value}, "0.6.6" if name == "preemption-mode" else LATEST)
    except FlagError:
        return
    for token in render_flag(name, typed[name]):
        assert token.strip() == token and all(c.isalnum() or c in "._+-" for c in token)


@given(st.text())
def test_arbitrary_text_values_are_refused_or_plain(text: str) -> None:
    for name in CATALOGUE:
        try:
            typed = validate({name: text}, "0.6.6" if name == "preemption-mode" else LATEST)
        except FlagError:
            continue
        rendered = render_flag(name, typed[name])
        assert all(token.isascii() and " " not in token for token in rendered)


# --------------------------------------------------------------------------------------------
# Rendering values


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.88, "0.88"), (0.9, "0.9"), (4.0, "4"), (0.0, "0"), (16, "16"), ("fp8_e4m3", "fp8_e4m3")],
)
def test_render_value(value: FlagValue, text: str) -> None:
    assert render_value(value) == text


@pytest.mark.parametrize("value", ["a b", "x;y", "", "--x", math.inf, True, "é", "a\nb"])
def test_render_value_refuses(value: Any) -> None:
    with pytest.raises(ValueError):
        render_value(value)


@given(st.floats(min_value=0.5, max_value=0.98))
def test_float_values_read_back_exactly(value: float) -> None:
    assert float(render_value(value)) == value


@pytest.mark.parametrize(
    ("name", "value", "version", "tokens"),
    [
        ("enforce-eager", True, "0.6.6", ["--enforce-eager"]),
        ("enforce-eager", False, "0.8.5", []),  # store_true only: False is the default
        ("enforce-eager", False, "0.9.0", ["--no-enforce-eager"]),
        ("enforce-eager", False, None, ["--no-enforce-eager"]),
        ("enable-prefix-caching", False, "0.6.4", []),
        ("enable-prefix-caching", False, "0.6.6", ["--no-enable-prefix-caching"]),
        ("enable-chunked-prefill", False, "0.6.6", ["--enable-chunked-prefill", "false"]),
        ("enable-chunked-prefill", True, "0.6.6", ["--enable-chunked-prefill"]),
        ("enable-chunked-prefill", False, "0.10.1", ["--no-enable-chunked-prefill"]),
        ("gpu-memory-utilization", 0.85, None, ["--gpu-memory-utilization", "0.85"]),
        ("max_num_seqs", 64, None, ["--max-num-seqs", "64"]),
    ],
)
def test_render_flag(name: str, value: FlagValue, version: str | None, tokens: list[str]) -> None:
    assert render_flag(name, value, version) == tokens


@pytest.mark.parametrize(
    ("name", "value"),
    [("enforce-eager", 1), ("max-num-seqs", "64"), ("max-num-seqs", 1.0), ("model", "x")],
)
def test_render_flag_refuses(name: str, value: FlagValue) -> None:
    with pytest.raises(ValueError):
        render_flag(name, value)


# --------------------------------------------------------------------------------------------
# parse_command


@pytest.mark.parametrize(
    ("argv", "wrapper", "launcher", "entrypoint", "model"),
    [
        (["vllm", "serve", "m"], [], ["vllm", "serve"], "serve", "m"),
        (
            ["/opt/venv/bin/vllm", "serve", "org/m", "--port", "8001"],
            [],
            ["/opt/venv/bin/vllm", "serve"],
            "serve",
            "org/m",
        ),
        (
            ["/usr/bin/env", "VLLM_USE_V1=0", "HF_HOME=/x", "vllm", "serve", "--model", "m"],
            ["/usr/bin/env", "VLLM_USE_V1=0", "HF_HOME=/x"],
            ["vllm", "serve"],
            "serve",
            "m",
        ),
        (
            ["python", "-m", "vllm.entrypoints.openai.api_server", "--model=m"],
            [],
            ["python", "-m", "vllm.entrypoints.openai.api_server"],
            "api_server",
            "m",
        ),
        (
            ["/srv/venv/bin/python3.11", "-u", "-X", "dev", "-mvllm.entrypoints.openai.api_server"],
            [],
            ["/srv/venv/bin/python3.11", "-u", "-X", "dev", "-mvllm.entrypoints.openai.api_server"],
            "api_server",
            None,
        ),
        (
            ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "m"],
            [],
            ["python3", "-m", "vllm.entrypoints.cli.main", "serve"],
            "serve",
            "m",
        ),
        (
            ["/usr/bin/uv", "run", "--python", "python3.12", "vllm", "serve", "m"],
            ["/usr/bin/uv", "run", "--python", "python3.12"],
            ["vllm", "serve"],
            "serve",
            "m",
        ),
        (
            ["nice", "-n", "5", "vllm", "serve", "--trust-remote-code", "m", "--dtype", "half"],
            ["nice", "-n", "5"],
            ["vllm", "serve"],
            "serve",
            "m",
        ),
        (
            ["/venv/bin/python3", "-m", "vkvagent", "sim", "serve", "m", "--cold-start", "2"],
            [],
            ["/venv/bin/python3", "-m", "vkvagent", "sim", "serve"],
            "sim",
            "m",
        ),
        (
            ["/usr/bin/vkvagent", "sim", "serve", "--time-scale", "30", "m"],
            [],
            ["/usr/bin/vkvagent", "sim", "serve"],
            "sim",
            "m",
        ),
        (
            ["vllm", "serve", "--served-model-name", "a", "b", "--max-num-seqs", "4"],
            [],
            ["vllm", "serve"],
            "serve",
            None,
        ),
    ],
)
def test_parse_command_launchers(
    argv: list[str], wrapper: list[str], launcher: list[str], entrypoint: str, model: str | None
) -> None:
    command = parse_command(argv)
    assert list(command.wrapper) == wrapper
    assert list(command.launcher) == launcher
    assert command.entrypoint == entrypoint
    assert command.model == model


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["/bin/bash", "-c", "exec vllm serve m"], "ExecStart runs a shell script"),
        (["/usr/bin/python3", "server.py"], "not a vLLM server command line"),
        (["vllm", "bench", "serve"], "not a vLLM server command line"),
        (["python", "-m", "http.server"], "not a vLLM server command line"),
        ([], "not a vLLM server command line"),
    ],
)
def test_parse_command_refuses(argv: list[str], message: str) -> None:
    with pytest.raises(VllmCommandError, match=message):
        parse_command(argv)


def test_parse_command_reads_every_spelling() -> None:
    command = parse_command(
        [
            "vllm",
            "serve",
            "m",
            "--max_num_seqs=64",
            "--gpu-memory-utilization",
            "0.8",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "32",  # the last one wins
            "--enforce_eager",
            "--max-model-len",
            "32k",
            "--max-num-batched-tokens=8K",
            "--block-size",
            "oops",
            "--kv-cache-dtype=fp8",
            "--config",
            "/etc/vllm/serve.yaml",
            "--seed",
            "-1",
        ]
    )
    assert command.values() == {
        "gpu-memory-utilization": 0.8,
        "block-size": "oops",  # vLLM would refuse it; kept as text
        "enable-prefix-caching": False,
        "max-num-seqs": 32,
        "max-num-batched-tokens": 8192,
        "max-model-len": 32000,
        "kv-cache-dtype": "fp8",
        "enforce-eager": True,
    }
    assert [o.value for o in command.occurrences("max-num-seqs")] == ["64", "32"]
    assert command.raw("seed") == "-1"
    assert command.config_file == "/etc/vllm/serve.yaml"
    assert command.value("swap-space") is None


def test_parse_command_v0_store_boolean() -> None:
    command = parse_command(
        ["vllm", "serve", "m", "--enable-chunked-prefill", "False", "--enforce-eager", "true"]
    )
    assert command.value("enable-chunked-prefill") is False
    assert command.value("enforce-eager") is True  # 'true' is left as a stray positional
    assert command.positionals[-1] == 6


def test_parse_command_end_of_options() -> None:
    command = parse_command(["vllm", "serve", "--", "--max-num-seqs", "4"])
    assert command.values() == {}
    assert command.model == "--max-num-seqs"


# --------------------------------------------------------------------------------------------
# apply_flags


def test_apply_flags_example() -> None:
    argv = [
        "/usr/bin/env",
        "CUDA_VISIBLE_DEVICES=0",
        "/opt/venv/bin/vllm",
        "serve",
        "org/model",
        "--max_num_seqs=64",
        "--gpu-memory-utilization",
        "0.9",
        "--trust-remote-code",
        "--max-num-seqs",
        "32",
        "--enable-prefix-caching",
        "-tp",
        "2",
        "--no-enable_prefix_caching",
        "--port",
        "8001",
    ]
    flags = validate({"max-num-seqs": 128, "enable-prefix-caching": True, "block-size": 32}, None)
    assert apply_flags(argv, flags) == [
        "/usr/bin/env",
        "CUDA_VISIBLE_DEVICES=0",
        "/opt/venv/bin/vllm",
        "serve",
        "org/model",
        "--gpu-memory-utilization",
        "0.9",
        "--trust-remote-code",
        "-tp",
        "2",
        "--port",
        "8001",
        "--block-size",
        "32",
        "--enable-prefix-caching",
        "--max-num-seqs",
        "128",
    ]


def test_apply_flags_before_end_of_options_and_old_booleans() -> None:
    argv = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    argv += ["--enable-chunked-prefill", "true", "--enforce-eager", "--", "extra"]
    flags = {"enable-chunked-prefill": False, "enforce-eager": False}
    assert apply_flags(argv, flags, vllm_version="0.6.6") == [
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "m",
        "--enable-chunked-prefill",
        "false",
        "--",
        "extra",
    ]


def test_apply_flags_refuses() -> None:
    with pytest.raises(ValueError, match="not a flag vkvagent sets"):
        apply_flags(["vllm", "serve", "m"], {"trust-remote-code": True})
    with pytest.raises(ValueError, match="unsafe flag value"):
        apply_flags(["vllm", "serve", "m"], {"kv-cache-dtype": "fp8 --trust-remote-code"})
    with pytest.raises(VllmCommandError):
        apply_flags(["/bin/sh", "-c", "vllm serve m"], {"max-num-seqs": 1})


FLAG_SETS = st.sets(st.sampled_from(list(CATALOGUE))).flatmap(
    lambda names: st.fixed_dictionaries({n: valid_value(n) for n in sorted(names)})
)

WRAPPERS = [[], ["/usr/bin/env", "A=1", "B=x y"], ["/usr/bin/nice", "-n", "5"]]
LAUNCHERS = [
    ["vllm", "serve", "org/m"],
    ["/opt/venv/bin/vllm", "serve", "m"],
    ["/opt/venv/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
    ["/opt/venv/bin/python3", "-m", "vkvagent", "sim", "serve", "m", "--time-scale", "30"],
]
UNMANAGED = [
    ["--trust-remote-code"],
    ["--dtype", "half"],
    ["--served-model-name", "a", "b"],
    ["-tp", "2"],
    ["--seed=3"],
    ["--compilation-config.level", "3"],
    ["--disable-log-stats"],
    ["--port", "8001"],
    ["--config", "x.yaml"],
]
RAW_VALUES = ["16", "0.9", "auto", "32k", "fp8", "recompute", "x", "-1", "1e3"]


@st.composite
def managed_piece(draw: st.DrawFn) -> tuple[str, list[str]]:
    """One managed flag in any spelling vLLM accepts (and a few it would refuse)."""
    name = draw(st.sampled_from(list(CATALOGUE)))
    spelled = name.replace("-", "_") if draw(st.booleans()) else name
    if CATALOGUE[name].kind == "bool":
        form = draw(st.sampled_from(["on", "off", "v0"]))
        if form == "off":
            return name, ["--no-" + spelled]
        if form == "v0" and CATALOGUE[name].store_boolean_until:
            return name, ["--" + spelled, draw(st.sampled_from(["true", "False"]))]
        return name, ["--" + spelled]
    value = draw(st.sampled_from(RAW_VALUES))
    if draw(st.booleans()):
        return name, [f"--{spelled}={value}"]
    return name, ["--" + spelled, value]


@st.composite
def command_lines(draw: st.DrawFn) -> tuple[list[str], list[tuple[str | None, list[str]]]]:
    head = draw(st.sampled_from(WRAPPERS)) + draw(st.sampled_from(LAUNCHERS))
    pieces: list[tuple[str | None, list[str]]] = draw(
        st.lists(
            st.one_of(st.sampled_from(UNMANAGED).map(lambda p: (None, p)), managed_piece()),
            max_size=12,
        )
    )
    return head, pieces


@settings(max_examples=300)
@given(line=command_lines(), flags=FLAG_SETS)
def test_apply_sets_each_flag_once_and_keeps_the_rest(
    line: tuple[list[str], list[tuple[str | None, list[str]]]], flags: dict[str, FlagValue]
) -> None:
    head, pieces = line
    argv = head + [token for _, piece in pieces for token in piece]
    before = parse_command(argv)
    out = apply_flags(argv, flags)
    after = parse_command(out)
    # every flag set, to exactly the value asked, spelled once
    for name, value in flags.items():
        assert after.value(name) == value
        assert len(after.occurrences(name)) == 1
    # everything else unchanged and in its place
    kept = head + [t for name, piece in pieces if name not in flags for t in piece]
    tail = [t for name in CATALOGUE if name in flags for t in render_flag(name, flags[name])]
    assert out == kept + tail
    for name in CATALOGUE:
        if name not in flags:
            assert after.value(name) == before.value(name)
    assert (after.model, after.wrapper, after.launcher, after.config_file) == (
        before.model,
        before.wrapper,
        before.launcher,
        before.config_file,
    )
    # idempotent
    assert apply_flags(out, flags) == out


# --------------------------------------------------------------------------------------------
# Against the simulator's model of each release's parser


def _sim_value(args: sim.ServeArgs, name: str) -> object:
    return getattr(args, name.replace("-", "_"))


@settings(max_examples=200, deadline=None)
@given(flavor=st.sampled_from(list(sim.FLAVOR_VERSIONS)), flags=FLAG_SETS, data=st.data())
def test_rewritten_command_is_accepted_by_each_release(
    flavor: str, flags: dict[str, FlagValue], data: st.DataObject
) -> None:
    version = sim.FLAVOR_VERSIONS[flavor]
    flags = {n: v for n, v in flags.items() if CATALOGUE[n].available(parse_version(version))}
    tokens = flags.get("max-num-batched-tokens")
    if isinstance(tokens, int):  # vLLM refuses fewer tokens than sequences (or, unchunked, len)
        flags["max-num-seqs"] = min(int(flags.get("max-num-seqs", 1)), tokens)
        if flags.get("enable-chunked-prefill") is False and "max-model-len" in flags:
            flags["max-model-len"] = min(int(flags["max-model-len"]), tokens)
    if flags.get("preemption-mode") == "swap":
        flags["swap-space"] = max(float(flags.get("swap-space", 4)), 1.0)
    if flags.get("enable-chunked-prefill") is False and flavor == "v0":
        flags.pop("max-num-batched-tokens", None)  # V0 wants max_model_len tokens then
    typed = validate(flags, version)
    existing = data.draw(
        st.lists(
            st.sampled_from(
                [
                    ["--max_num_seqs=64"],
                    ["--gpu-memory-utilization", "0.9"],
                    ["--enforce-eager"],
                    ["--max-num-seqs", "32"],
                    ["--kv_cache_dtype", "auto"],
                    ["--trust-remote-code"],
                    ["--dtype", "half"],
                    ["--block-size=16"],
                ]
            ),
            max_size=5,
        )
    )
    argv = ["vllm", "serve", "m"] + [t for piece in existing for t in piece]
    out = apply_flags(argv, typed, vllm_version=version)
    args = sim.parse_serve_args(out[2:], flavor, entrypoint="serve")
    for name, value in typed.items():
        if name == "enable-chunked-prefill" and flavor in ("v1-0.8", "v1-0.10"):
            continue  # V1 before 0.11 always chunks (the simulator pins it on)
        assert _sim_value(args, name) == value, name
    labels = sim.cache_config_labels(args, flavor, num_gpu_blocks=1000)
    for name, value in typed.items():
        assert CATALOGUE[name].attested(value, labels) in (True, None), (name, labels)


def test_attested_reads_each_release_s_labels() -> None:
    for flavor, version in sim.FLAVOR_VERSIONS.items():
        args = sim.parse_serve_args(
            ["m", "--gpu-memory-utilization", "0.85", "--block-size", "32"]
            + (["--swap-space", "8"] if parse_version(version) < (0, 11, 0) else []),
            flavor,
        )
        labels = sim.cache_config_labels(args, flavor, num_gpu_blocks=10)
        assert CATALOGUE["gpu-memory-utilization"].attested(0.85, labels) is True
        assert CATALOGUE["gpu-memory-utilization"].attested(0.9, labels) is False
        assert CATALOGUE["block-size"].attested(32, labels) is True
        assert CATALOGUE["enable-prefix-caching"].attested(flavor != "v0", labels) is True
        assert CATALOGUE["kv-cache-dtype"].attested("auto", labels) is True
        assert CATALOGUE["max-num-seqs"].attested(5, labels) is None
        if "swap_space_bytes" in labels:
            assert CATALOGUE["swap-space"].attested(8.0, labels) is True
            assert CATALOGUE["swap-space"].attested(4.0, labels) is False
    assert CATALOGUE["cpu-offload-gb"].attested(1.0, {}) is None
    assert CATALOGUE["block-size"].attested(16, {"block_size": "x"}) is False


def test_the_agent_does_not_import_the_simulator() -> None:
    import vkvagent.knowledge.dropin
    import vkvagent.knowledge.flags

    for module in (vkvagent.knowledge.flags, vkvagent.knowledge.dropin):
        assert module.__file__ is not None
        with open(module.__file__, encoding="utf-8") as source:
            assert "vkvagent.sim" not in source.read()
