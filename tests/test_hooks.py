"""The operator's pre_stop and post_ready commands, run for real (vkvagent/hooks.py)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from vkvagent.hooks import OUTPUT_LIMIT, check_argv, run_hook

SH = "/bin/sh"


def test_a_hook_runs_without_a_shell_and_sees_the_action_in_its_environment() -> None:
    result = run_hook(
        "pre_stop",
        [SH, "-c", 'echo "$VKVAGENT_HOOK $VKVAGENT_UNIT $VKVAGENT_ACTION"; echo "$1"', "-", "a;b"],
        {"VKVAGENT_UNIT": "vllm.service", "VKVAGENT_ACTION": "7"},
        timeout=10,
    )
    assert result.ok and result.status == 0
    # "a;b" reached the program as one argument: no shell parsed the argv.
    assert result.output == "pre_stop vllm.service 7\na;b\n"
    assert result.event(7) == (
        "restart.hook",
        "pre_stop ran",
        {
            "action": 7, "hook": "pre_stop", "argv": list(result.argv), "status": 0,
            "seconds": round(result.seconds, 3), "output": result.output,
        },
    )  # fmt: skip


def test_a_failing_hook_says_how_with_its_output() -> None:
    result = run_hook("post_ready", [SH, "-c", "echo no route >&2; exit 3"], {}, timeout=10)
    assert not result.ok
    assert (result.status, result.problem, result.output) == (
        3,
        "exited with status 3",
        "no route\n",
    )
    name, message, fields = result.event(2)
    assert (name, message) == ("restart.hook_failed", "post_ready failed: exited with status 3")
    assert fields["error"] == "exited with status 3"


def test_a_hook_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    began = time.monotonic()
    result = run_hook(
        "pre_stop", [SH, "-c", f"sleep 30 & echo $! > {child}; echo waiting; wait"], {}, 1.0
    )
    assert time.monotonic() - began < 10
    assert (result.status, result.problem) == (None, "still running after 1 s: killed")
    assert result.output == "waiting\n"
    pid = int(child.read_text())
    time.sleep(0.2)
    assert (
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


def test_a_hook_that_cannot_start_is_a_failure_not_an_exception(tmp_path: Path) -> None:
    result = run_hook("pre_stop", [str(tmp_path / "missing")], {}, 5)
    assert not result.ok and result.status is None
    assert result.problem is not None and result.problem.startswith("cannot run: ")


def test_only_the_end_of_a_long_output_is_kept() -> None:
    result = run_hook(
        "pre_stop", [SH, "-c", "head -c 100000 /dev/zero | tr '\\0' x; echo END"], {}, 10
    )
    assert len(result.output) == OUTPUT_LIMIT and result.output.endswith("xEND\n")


def test_a_hook_must_name_an_executable_by_its_absolute_path(tmp_path: Path) -> None:
    script = tmp_path / "lb"
    script.write_text("#!/bin/sh\n")
    assert check_argv([]) is None  # no hook
    assert check_argv(["sh", "-c", "true"]) == (
        "'sh' is not an absolute path (hooks run without a shell or PATH search)"
    )
    assert check_argv([str(tmp_path / "none")]) == f"{tmp_path / 'none'} does not exist"
    assert check_argv([str(script)]) == f"{script} is not executable"
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    assert check_argv([str(script), "drain"]) is None
    assert os.access(SH, os.X_OK) and check_argv([SH]) is None
