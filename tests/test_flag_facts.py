"""vkvagent's flag catalogue, its command-line reader and the simulator, checked against what
vLLM's own argument parser says (vkvagent/knowledge/data/vllm-options-*.json, written from an
installed vLLM by tools/vllm_flag_facts.py). The last test checks that file against the real
vLLM 0.32 of `make vllm-real`, so the facts cannot drift from the parser they describe."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests import realvllm
from vkvagent.knowledge import flags, vllm_command
from vkvagent.sim import serve_args as sim_flags

FACTS = vllm_command.parser_facts()
RELEASE = flags.parse_version(realvllm.VERSION)
OPTIONS: Mapping[str, Mapping[str, Any]] = FACTS[RELEASE]["options"]
# How vLLM converts an integer flag's value: plain, or with suffixes (8k), or also "auto".
INTEGER_KINDS = ("int", "human_readable_int", "human_readable_int_or_auto")


def test_there_are_facts_for_the_vllm_the_tests_run() -> None:
    assert FACTS[RELEASE]["vllm_version"] == realvllm.VERSION
    assert len(OPTIONS) > 300  # 0.32 has 316 options: a parser read whole, not a stub


@pytest.mark.parametrize(
    "spec", [f for f in flags.CATALOGUE.values() if f.available(RELEASE)], ids=str
)
def test_every_flag_vkvagent_may_set_exists_in_vllms_parser_as_the_catalogue_says(
    spec: flags.Flag,
) -> None:
    option = OPTIONS.get(spec.name)
    assert option is not None, f"{spec.option} is not a vLLM {realvllm.VERSION} option"
    if spec.kind == "bool":
        assert option["kind"] == "bool"
        negatable = (
            spec.negation_since is None or flags.parse_version(spec.negation_since) <= RELEASE
        )
        assert option["negatable"] == negatable
    elif spec.kind == "int":
        assert option["kind"] in INTEGER_KINDS
        assert option["choices"] is None
    elif spec.kind == "float":
        assert option["kind"] == "float"
    else:  # choice: vkvagent's choices are values vLLM takes
        shown = [str(choice) for choice in spec.choices]
        if option["choices"] is None:
            assert option["kind"] in INTEGER_KINDS
            assert all(isinstance(choice, int) for choice in spec.choices)
        else:
            assert set(shown) <= set(option["choices"]), set(shown) - set(option["choices"])


@pytest.mark.parametrize(
    "spec", [f for f in flags.CATALOGUE.values() if not f.available(RELEASE)], ids=str
)
def test_every_flag_vkvagent_refuses_for_this_release_is_gone_from_it(spec: flags.Flag) -> None:
    assert spec.name not in OPTIONS
    with pytest.raises(flags.FlagError) as problems:
        flags.validate({spec.name: 1}, realvllm.VERSION)
    assert spec.option in str(problems.value)


@pytest.mark.parametrize("name", sorted(flags.FOREIGN))
def test_every_flag_vkvagent_will_not_touch_is_a_real_option(name: str) -> None:
    assert name in OPTIONS, f"the refusal of --{name} names no option vLLM has"


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_command_line_reader_reads_each_option_as_vllm_does(name: str) -> None:
    """``vllm serve --x [values] MODEL``: the model is found after every option, and the
    option holds exactly its values."""
    option = OPTIONS[name]
    spelled = "--" + name
    if not option["takes_value"]:
        argv, value = ["vllm", "serve", spelled, "the-model"], None
    elif option["nargs"] in ("+", "*"):
        argv, value = ["vllm", "serve", "the-model", spelled, "a", "b"], "a b"
    else:
        argv, value = ["vllm", "serve", spelled, "a", "the-model"], "a"
    command = vllm_command.parse_command(argv)
    assert command.model == ("a" if name == "model" else "the-model")
    assert command.raw(name) == value
    if option["negatable"]:
        negated = vllm_command.parse_command(["vllm", "serve", "--no-" + name, "the-model"])
        assert negated.model == "the-model"


SIM_FLAVOR = next(
    flavor for flavor, version in sim_flags.FLAVOR_VERSIONS.items() if version == realvllm.VERSION
)
SIM_TABLE = sim_flags._TABLES[SIM_FLAVOR]  # the simulator's flags, by option string


def _real(option: str) -> Mapping[str, Any]:
    for facts in OPTIONS.values():
        if option in facts["options"]:
            return facts
    raise AssertionError(f"the simulator takes {option}, vLLM {realvllm.VERSION} does not")


@pytest.mark.parametrize(
    "option", sorted(o for o in SIM_TABLE if o.startswith("--") and not o.startswith("--no-"))
)
def test_the_simulators_flags_are_vllms(option: str) -> None:
    """What the simulator of this release accepts, vLLM accepts, in the same form: never looser
    (it may know fewer flags; it refuses those as unrecognized)."""
    sim, real = SIM_TABLE[option], _real(option)
    assert set(sim.options) <= set(real["options"])
    if sim.kind == "bool":
        assert (real["kind"], real["negatable"]) == ("bool", True)
    elif sim.kind == "true":
        assert (real["kind"], real["negatable"]) == ("bool", False)
    elif sim.kind == "names":
        assert real["nargs"] == "+"
    else:
        assert real["takes_value"]
        if sim.type_name in ("int", "float", *INTEGER_KINDS):
            assert sim.type_name == real["kind"]
    if sim.choices is not None and real["choices"] is not None:
        assert {str(c) for c in sim.choices} <= set(real["choices"])


@pytest.mark.vllm
def test_the_facts_are_what_the_installed_vllm_says() -> None:
    """The committed facts file, written again from the real vLLM's parser, is unchanged
    (`make vllm-flag-facts` writes it)."""
    realvllm.require_installed()
    done = subprocess.run(
        [str(realvllm.PYTHON), "tools/vllm_flag_facts.py"],
        capture_output=True, text=True, timeout=300, check=False,
        cwd=Path(__file__).resolve().parent.parent,  # the repository, where tools/ is
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    committed = vllm_command.FACTS_DIR / f"{vllm_command.FACTS_PREFIX}{realvllm.VERSION}.json"
    assert done.stdout == committed.read_text()


def test_a_missing_real_vllm_names_the_make_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert realvllm.missing(tmp_path) == f"vLLM's venv is missing under {tmp_path}"
    monkeypatch.setenv("CI", "true")
    with pytest.raises(
        pytest.fail.Exception, match=r"run `make vllm-real` \(CI=true: not skipped\)"
    ):
        realvllm.require_installed(tmp_path)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="run `make vllm-real`"):
        realvllm.require_installed(tmp_path)
