"""Suggestions as a reviewable change: the engine's argued flag suggestions (prefix caching and
block size among them), their rendering as a [vllm.flags] diff and a conf.d file, and
``vkvagent plan --suggested`` against a status.json the status module wrote."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import window_stats as window
from tests.sandbox import (
    Sandbox,
    sandbox_fixture,  # noqa: F401 - the `sandbox` fixture
    sim_argv,
)
from tests.test_actuator import STATE_DIR, output, vkvagent, write_config
from tests.test_diagnosis import CAPACITY, held, run, situation
from tests.test_diagnosis import gpu as gpu_reading
from vkvagent.atomicfile import write_atomically
from vkvagent.engine.kv import PROMPT_HEAVY, kv_advice
from vkvagent.jsonsafe import finite
from vkvagent.knowledge import advice, config, flags, status
from vkvagent.tools.cli import main

KV_FULL = dict(kv_usage=0.96, preemptions_per_s=0.25, waiting=30.0, running=16.0)
ON = {"enable_prefix_caching": "True"}
OFF = {"enable_prefix_caching": "False"}


# -- the engine: prefix caching ----------------------------------------------------------------


def test_prefix_caching_is_suggested_when_it_is_off_and_the_mix_is_mostly_prompt() -> None:
    advised = kv_advice(CAPACITY, {}, OFF, stats=window(**KV_FULL, prompt_share=0.85))
    assert advised["enable-prefix-caching"].value is True
    assert (
        "prompt tokens are 85% of the tokens processed" in advised["enable-prefix-caching"].reason
    )
    # Set off on the command line, whatever the label says.
    pinned = kv_advice(CAPACITY, {"enable-prefix-caching": False}, ON, stats=window(**KV_FULL))
    assert pinned["enable-prefix-caching"].value is True


def test_prefix_caching_is_not_suggested_where_it_cannot_pay_or_nothing_is_known() -> None:
    decode_heavy = window(**KV_FULL, prompt_share=PROMPT_HEAVY - 0.2)  # little prompt to save
    assert "enable-prefix-caching" not in kv_advice(CAPACITY, {}, OFF, stats=decode_heavy)
    # Already on: never suggested off (its idle blocks count as free, so it takes no room).
    on = kv_advice(CAPACITY, {}, ON, stats=window(**KV_FULL), prefix_hit_ratio=0.0)
    assert "enable-prefix-caching" not in on
    # Neither the flag nor a cache_config label says whether it is on; no mix measured.
    assert "enable-prefix-caching" not in kv_advice(CAPACITY, {}, {}, stats=window(**KV_FULL))
    assert "enable-prefix-caching" not in kv_advice(CAPACITY, {}, OFF)


def test_no_memory_share_is_suggested_where_kv_cache_memory_bytes_sizes_the_cache() -> None:
    sized = {"gpu_memory_utilization": "0.9", "kv_cache_memory_bytes": "8589934592"}
    assert "gpu-memory-utilization" not in kv_advice(CAPACITY, {}, sized)
    unset = {"gpu_memory_utilization": "0.9", "kv_cache_memory_bytes": "None"}
    assert kv_advice(CAPACITY, {}, unset)["gpu-memory-utilization"].value == 0.93


# -- the engine: block size --------------------------------------------------------------------


def test_an_operators_large_block_is_brought_back_to_cudas_where_prefixes_are_shared() -> None:
    advised = kv_advice(
        CAPACITY, {"block-size": 32}, ON, stats=window(**KV_FULL), prefix_hit_ratio=0.45,
        on_gpu=True,
    )  # fmt: skip
    assert advised["block-size"].value == 16
    assert "45% of prompt tokens are prefix-cache hits" in advised["block-size"].reason
    # With prefix caching suggested on at the same time, and no hit ratio measured yet.
    both = kv_advice(CAPACITY, {"block-size": 64}, OFF, stats=window(**KV_FULL), on_gpu=True)
    assert (both["enable-prefix-caching"].value, both["block-size"].value) == (True, 16)
    # 16 is a block size every release the catalogue knows accepts.
    for version in ("0.6.0", "0.8.5", "0.10.1", "0.32.0"):
        assert flags.validate({"block-size": 16}, version) == {"block-size": 16}


@pytest.mark.parametrize(
    "why, flag_values, labels, hit, on_gpu",
    [
        ("few hits: granularity costs little", {"block-size": 32}, ON, 0.05, True),
        ("not a GPU: the CPU build picks 128 itself", {"block-size": 32}, ON, 0.45, False),
        ("the platform's, not the operator's", {}, {**ON, "block_size": "128"}, 0.45, True),
        ("already CUDA's", {"block-size": 16}, ON, 0.45, True),
        ("prefix caching off and not suggested", {"block-size": 32}, OFF, None, True),
    ],
)  # fmt: skip
def test_the_block_size_is_left_alone(
    why: str, flag_values: dict[str, Any], labels: dict[str, str], hit: float | None, on_gpu: bool
) -> None:
    stats = window(**KV_FULL, prompt_share=0.3 if labels is OFF else 0.85)
    advised = kv_advice(
        CAPACITY, flag_values, labels, stats=stats, prefix_hit_ratio=hit, on_gpu=on_gpu
    )
    assert "block-size" not in advised, why


def test_a_kv_pressure_diagnosis_argues_every_flag_it_suggests() -> None:
    pressed = situation(
        window(**KV_FULL, requests_per_s=3.9, arrivals_per_s=3.9),
        flags={"max-num-seqs": 256, "max-num-batched-tokens": 8192, "block-size": 32},
        cache_config={"gpu_memory_utilization": "0.9", "enable_prefix_caching": "False"},
        gpus=[(gpu_reading(),)],
    )
    result, _ = run(held(pressed))
    assert result.cause == "kv_pressure"
    assert result.suggestion == {
        "gpu-memory-utilization": 0.93,
        "max-num-seqs": 32,
        "max-num-batched-tokens": 4096,
        "enable-prefix-caching": True,
        "block-size": 16,
    }
    assert sorted(result.reasons) == sorted(result.suggestion)
    assert "KV usage 0.96 with 0.25 preemptions/s" in result.reasons["gpu-memory-utilization"]
    assert "17.6 requests at once" in result.reasons["max-num-seqs"]
    flags.validate(result.suggestion, "0.10.1")  # all within the catalogue, on a real release


# -- rendering ---------------------------------------------------------------------------------


def report(suggestion: dict[str, Any], **verdict: Any) -> status.StatusReport:
    """A status the daemon could have written: a kv_pressure verdict with ``suggestion``."""
    fields: dict[str, Any] = dict(
        state="degraded", action="hold", cause="kv_pressure" if suggestion else None,
        reason="outside window: kv_pressure: KV usage 0.96, 0.25 preemptions/s",
        suggestion=suggestion,
    )  # fmt: skip
    fields.update(verdict)
    return status.StatusReport(
        updated=1.79e9, agent_version="test", interval=10.0, unit_name="vllm.service",
        verdict=status.Verdict(**fields),
        policy=status.PolicyStatus(mode="observe", window_open=False, budget_left=2),
    )  # fmt: skip


SUGGESTION = {"gpu-memory-utilization": 0.93, "max-num-seqs": 32, "enable-prefix-caching": True}


def test_the_suggestion_merges_into_the_table_as_the_operator_spells_it() -> None:
    current = {"max_num_seqs": 256, "gpu-memory-utilization": 0.93, "max-model-len": 8192}
    merged = advice.suggest(report(SUGGESTION), current, "0.10.1")
    assert merged.changes == {"max-num-seqs": 32, "enable-prefix-caching": True}
    assert merged.already == {"gpu-memory-utilization": 0.93}
    assert merged.after == {**current, "max_num_seqs": 32, "enable-prefix-caching": True}
    flags.validate(merged.after, "0.10.1")  # no flag given twice
    assert set(merged.reasons) == set(merged.changes)

    diff = advice.toml_diff(merged, "/etc/vkvagent")
    assert diff.splitlines() == [
        "--- [vllm.flags] effective (/etc/vkvagent)",
        "+++ [vllm.flags] suggested",
        "@@ -1,4 +1,5 @@",
        " [vllm.flags]",
        "-max_num_seqs = 256",
        "+max_num_seqs = 32",
        " gpu-memory-utilization = 0.93",
        " max-model-len = 8192",
        "+enable-prefix-caching = true",
    ]


def test_the_daemons_own_reasons_argue_the_change_and_an_older_status_gets_the_generic_one() -> (
    None
):
    argued = {"max-num-seqs": "17.6 requests at once held the KV cache cleanly"}
    merged = advice.suggest(report(SUGGESTION, reasons=argued), {}, "0.10.1")
    assert merged.reasons["max-num-seqs"] == argued["max-num-seqs"]
    assert merged.reasons["enable-prefix-caching"] == advice.WHY["enable-prefix-caching"]
    written = report(SUGGESTION, reasons=argued).to_json()
    assert status.StatusReport.from_json(written).verdict.reasons == argued
    del written["verdict"]["reasons"]  # as a daemon before this change wrote it
    assert status.StatusReport.from_json(written).verdict.reasons == {}


def test_flags_this_vllm_refuses_are_left_out_with_the_reason() -> None:
    odd = {**SUGGESTION, "swap-space": 4, "block-size": 256}
    merged = advice.suggest(report(odd), {}, "0.12.0")
    assert set(merged.changes) == set(SUGGESTION)
    assert "not settable on vLLM 0.12" in merged.left_out["swap-space"]
    assert "block-size" in merged.left_out
    # An unknown version refuses every version-limited flag, and nothing else.
    assert set(advice.suggest(report(odd), {}, None).left_out) == {"swap-space", "block-size"}


def test_the_conf_d_file_is_toml_the_loader_reads_and_makes_the_change(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    (etc / "conf.d").mkdir(parents=True)
    (etc / "config.toml").write_text("[vllm.flags]\nmax_num_seqs = 256\nmax-model-len = 8192\n")
    before = config.load(etc).vllm.flags
    merged = advice.suggest(report(SUGGESTION), before, "0.10.1")
    text = advice.conf_d_text(merged)
    lines = text.splitlines()
    keys = [flags.canonical_name(line.split(" = ")[0]) if " = " in line else "" for line in lines]
    for name in merged.changes:  # each flag with its reason on the line above it
        assert lines[keys.index(name) - 1] == f"# {merged.reasons[name]}", name
    (etc / "conf.d" / advice.FILE_NAME).write_text(text)
    assert dict(config.load(etc).vllm.flags) == merged.after


def test_a_new_suggestion_keeps_the_earlier_one_and_yields_to_later_files(tmp_path: Path) -> None:
    """Replacing 60-suggested.toml must not undo a change already accepted, and a conf.d
    file read after it wins: such a flag is left out, with the file named."""
    etc = tmp_path / "etc"
    dropins = etc / "conf.d"
    dropins.mkdir(parents=True)
    (etc / "config.toml").write_text("[vllm.flags]\nmax-num-seqs = 256\n")
    target = dropins / advice.FILE_NAME
    target.write_text("[vllm.flags]\ngpu-memory-utilization = 0.93\n")  # accepted earlier
    (dropins / "90-local.toml").write_text("[vllm.flags]\nmax_num_seqs = 128\n")
    (dropins / "10-early.toml").write_text("[vllm.flags]\nenable-prefix-caching = false\n")
    files = config.config_files(etc)
    later = advice.set_after(files, target)
    assert later == {"max-num-seqs": str(dropins / "90-local.toml")}
    effective = config.load(etc).vllm.flags
    merged = advice.suggest(report(SUGGESTION), effective, "0.10.1", later)
    assert merged.changes == {"enable-prefix-caching": True}
    assert merged.already == {"gpu-memory-utilization": 0.93}
    assert merged.left_out["max-num-seqs"].startswith(
        f"--max-num-seqs: set by {dropins / '90-local.toml'}, read after the suggested file"
    )
    target.write_text(advice.conf_d_text(merged, advice.flags_in(target)))
    assert dict(config.load(etc).vllm.flags) == merged.after
    assert config.load(etc).vllm.flags["gpu-memory-utilization"] == 0.93  # still there


def test_a_flag_that_breaks_a_combination_is_left_out_with_vllms_reason() -> None:
    current = {
        "enable-chunked-prefill": False,
        "max-model-len": 8192,
        "max-num-batched-tokens": 8192,
    }
    odd = {"max-num-batched-tokens": 4096, "max-num-seqs": 32}
    merged = advice.suggest(report(odd), current, "0.10.1")
    assert merged.changes == {"max-num-seqs": 32}
    assert "below --max-model-len 8192" in merged.left_out["max-num-batched-tokens"]
    assert merged.after == {**current, "max-num-seqs": 32}
    flags.validate(merged.after, "0.10.1")


def test_nothing_to_suggest_says_why() -> None:
    assert advice.nothing_to_suggest(None) == f"nothing to suggest: {status.NO_STATUS}"
    healthy = report({}, state="healthy", action="none", reason="healthy: speed 0.98")
    said = advice.nothing_to_suggest(healthy)
    assert said is not None and "is healthy: healthy: speed 0.98" in said
    assert advice.nothing_to_suggest(report(SUGGESTION)) is None


# -- the command, without a unit ---------------------------------------------------------------


def setup_etc(tmp_path: Path, written: status.StatusReport | None) -> Path:
    """A config directory whose state directory holds ``written``, as the daemon writes it."""
    state = tmp_path / "state"
    state.mkdir()
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "config.toml").write_text(f'[agent]\nstate_dir = "{state}"\n')
    if written is not None:
        write_status(state, written)
    return etc


def write_status(state_dir: Path, written: status.StatusReport) -> None:
    """What the daemon's _write_status does."""
    text = json.dumps(finite(written.to_json()), separators=(",", ":"))
    write_atomically(status.path(state_dir), text, 0o640)


def test_plan_suggested_without_a_status_fails_and_says_why(tmp_path: Path) -> None:
    etc = setup_etc(tmp_path, None)
    out, err = io.StringIO(), io.StringIO()
    assert main(["plan", "--suggested", "--config", str(etc)], out, err) == 1
    assert err.getvalue().startswith("vkvagent: nothing to suggest: no status yet")
    assert out.getvalue() == ""


def test_plan_suggested_with_a_healthy_status_says_there_is_nothing(tmp_path: Path) -> None:
    etc = setup_etc(tmp_path, report({}, state="healthy", action="none", reason="healthy"))
    out, err = io.StringIO(), io.StringIO()
    assert main(["plan", "--suggested", "--config", str(etc)], out, err) == 0
    assert out.getvalue().startswith("nothing to suggest: the last diagnosis")
    assert len(out.getvalue().splitlines()) == 1
    out = io.StringIO()
    assert main(["plan", "--suggested", "--json", "--config", str(etc)], out, err) == 0
    assert json.loads(out.getvalue())["diagnosis"]["state"] == "healthy"


def test_write_needs_suggested(tmp_path: Path) -> None:
    etc = setup_etc(tmp_path, None)
    err = io.StringIO()
    assert main(["plan", "--write", str(tmp_path / "x.toml"), "--config", str(etc)], None, err) == 2
    assert "--write needs --suggested" in err.getvalue()


# -- the command, against a real unit (systemd sandbox, the simulator as vllm.service) ----------

CONFIG_DIR = "/etc/vkvagent"
SUGGESTED_FILE = f"{CONFIG_DIR}/conf.d/{advice.FILE_NAME}"


def suggestion_for_the_simulator() -> dict[str, Any]:
    """What the engine suggests for the sandbox's vLLM under KV pressure: its flags and its
    cache_config_info with prefix caching off, the mix mostly prompt, on a GPU."""
    advised = kv_advice(
        CAPACITY,
        {"max-num-seqs": 256, "max-num-batched-tokens": 8192, "block-size": 32},
        {"gpu_memory_utilization": "0.9", "enable_prefix_caching": "False"},
        stats=window(**KV_FULL),
        on_gpu=True,
    )
    return {name: a.value for name, a in advised.items()}


def sandbox_status(box: Sandbox, suggestion: dict[str, Any]) -> None:
    state = box.root / STATE_DIR.lstrip("/")
    state.mkdir(mode=0o750, parents=True, exist_ok=True)
    write_status(state, report(suggestion))


def printed_conf_d(stdout: str) -> str:
    """The conf.d file as `plan --suggested` printed it: after its heading, before the unit."""
    after_heading = stdout.split(f"as a conf.d file ({SUGGESTED_FILE}):\n", 1)[1]
    return after_heading.split("unit:   ", 1)[0]


@pytest.mark.systemd
def test_plan_suggested_shows_the_change_and_its_file_gives_the_same_command_line(
    sandbox: Sandbox,
) -> None:
    write_config(sandbox, {"max-num-seqs": 256, "max-num-batched-tokens": 8192, "block-size": 32})
    suggestion = suggestion_for_the_simulator()
    assert set(suggestion) == {
        "gpu-memory-utilization", "max-num-seqs", "max-num-batched-tokens",
        "enable-prefix-caching", "block-size",
    }  # fmt: skip
    sandbox_status(sandbox, suggestion)

    shown = vkvagent(sandbox, "plan", "--suggested", config=CONFIG_DIR)
    assert shown.returncode == 0, output(shown)
    text = shown.stdout
    assert text.startswith("diagnosis: kv_pressure at ")
    for line in (
        "-max-num-seqs = 256", "+max-num-seqs = 32", "-max-num-batched-tokens = 8192",
        "+max-num-batched-tokens = 4096", "-block-size = 32", "+block-size = 16",
        "+gpu-memory-utilization = 0.93", "+enable-prefix-caching = true",
    ):  # fmt: skip
        assert f"\n{line}\n" in text, line
    after = re.search(r"^after:  (.*)$", text, re.M)
    before = re.search(r"^before: (.*)$", text, re.M)
    assert after and before and before.group(1) == shlex.join(sim_argv())
    for token in ("--gpu-memory-utilization 0.93", "--block-size 16", "--enable-prefix-caching",
                  "--max-num-seqs 32", "--max-num-batched-tokens 4096"):  # fmt: skip
        assert token in after.group(1), token
    assert not (sandbox.root / SUGGESTED_FILE.lstrip("/")).exists()  # printed, not written

    # The printed file, dropped in: `vkvagent plan` now plans what --suggested showed.
    dropped = sandbox.root / SUGGESTED_FILE.lstrip("/")
    dropped.parent.mkdir(mode=0o755, exist_ok=True)
    dropped.write_text(printed_conf_d(text))
    dropped.chmod(0o644)
    planned = vkvagent(sandbox, "plan", config=CONFIG_DIR)
    assert planned.returncode == 0, output(planned)
    assert f"\nafter:  {after.group(1)}\n" in planned.stdout

    # Asked again, nothing is left to suggest: every flag is in [vllm.flags] already.
    again = vkvagent(sandbox, "plan", "--suggested", config=CONFIG_DIR)
    assert again.returncode == 0, output(again)
    assert "nothing to suggest: [vllm.flags] already has every flag" in again.stdout


@pytest.mark.systemd
def test_plan_suggested_writes_the_file_and_answers_in_json(sandbox: Sandbox) -> None:
    write_config(sandbox, {"max-num-seqs": 256})
    sandbox_status(sandbox, {"max-num-seqs": 32, "swap-space": 4})  # 4 GiB: no V1 has it
    done = vkvagent(
        sandbox, "plan", "--suggested", "--json", "--write", SUGGESTED_FILE, config=CONFIG_DIR
    )
    assert done.returncode == 0, output(done)
    shown = json.loads(done.stdout)
    assert shown["changes"] == {"max-num-seqs": 32}
    assert "not settable on vLLM 0.32" in shown["left_out"]["swap-space"]
    written = sandbox.root / SUGGESTED_FILE.lstrip("/")
    assert written.read_text() == shown["conf_d"]["text"]
    assert oct(written.stat().st_mode & 0o777) == "0o644"
    planned = vkvagent(sandbox, "plan", "--json", config=CONFIG_DIR)
    assert planned.returncode == 0, output(planned)
    assert json.loads(planned.stdout)["after"] == shown["plan"]["after"]
