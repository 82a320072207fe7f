"""The command line's conventions: errors on stderr as `vkvagent: ...`, a closed pipe ends
quietly, every option has help, and the help says what the code does."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from vkvagent.engine.policy import Controls, PolicySettings, evaluate
from vkvagent.tools.cli import _parser, main
from vkvagent.tools.exitcodes import ExitCode

RECORDING = FIXTURES / "gpu" / "h100x2-throttled.json"


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_gpu_without_nvml_says_so_on_stderr_with_the_prefix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-recording.json"
    path = config(tmp_path, f'[gpu]\nrecording = "{missing}"\n')
    assert main(["gpu", "--config", path]) == 1
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err.startswith("vkvagent: NVML unavailable: ") and str(missing) in said.err
    assert len(said.err.splitlines()) == 1


def test_gpu_with_one_gpu_missing_prints_the_others_and_warns_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, f'[gpu]\nrecording = "{RECORDING}"\ndevices = [0, 7]\n')
    assert main(["gpu", "--config", path]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("GPU 0 ") and "not present" not in said.out
    assert said.err == "vkvagent: warning: GPU index [7] not present (3 GPUs)\n"


class ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_went_away_ends_the_command_quietly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, "")
    Path(path).chmod(0o600)
    assert main(["config", "check", path], ClosedPipe()) == ExitCode.BROKEN_PIPE
    assert capsys.readouterr().err == ""
    # An error is still said, on stderr, whatever became of stdout.
    assert main(["config", "check", str(tmp_path / "absent.toml")], ClosedPipe()) == 1
    assert capsys.readouterr().err.startswith("vkvagent: ")


def test_vkvagent_piped_into_a_closed_reader_exits_141_without_a_word(tmp_path: Path) -> None:
    """`vkvagent ... | head -1`: the reader closed before the output came."""
    path = config(tmp_path, "")
    Path(path).chmod(0o600)
    child = subprocess.Popen(
        [sys.executable, "-m", "vkvagent", "config", "check", path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # no reader is left: the first write fails with EPIPE
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == ExitCode.BROKEN_PIPE
    assert err == ""


def options(
    parser: argparse.ArgumentParser, path: str = "vkvagent"
) -> Iterator[tuple[str, argparse.Action]]:
    """(command, action) for every argument of the parser and its sub-commands; a
    sub-command's own entry as an action whose help is its line in the list."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for entry in action._choices_actions:
                yield path, entry
            for name, sub in action.choices.items():
                yield from options(sub, f"{path} {name}")
        else:
            yield path, action


def test_every_command_and_option_has_help_text() -> None:
    found = list(options(_parser()))
    assert len(found) > 60  # the walk reached the sub-commands
    missing = [f"{path} {a.option_strings or a.dest}" for path, a in found if not a.help]
    assert missing == []


def test_pause_holds_every_restart_emergencies_included_as_its_help_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert "not even an emergency's" in " ".join(listed.split())
    settings = PolicySettings(mode="enforce", windows=())
    now = datetime(2025, 3, 4, 3, 0, tzinfo=timezone.utc)
    paused = Controls(paused_until=now.timestamp() + 3600)
    for cause in settings.emergency:
        args = dict(cause=cause, wanted=True, uptime=20000.0, request_rate=2.0, history=(), now=now)
        assert evaluate(settings, controls=Controls(), **args).action == "restart"
        held = evaluate(settings, controls=paused, **args)
        assert held.action == "hold" and held.reason.startswith("paused until"), cause


def test_a_demo_time_scale_that_is_not_above_0_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--time-scale", "-5"]) == 2
    assert (
        capsys.readouterr().err == "vkvagent: demo: --time-scale must be a number above 0, not -5\n"
    )
