"""The restart procedure and flag changes end to end, against a real systemd 252 booted in
systemd-nspawn (tests/sandbox.py) with the simulator as vllm.service.

The agent's own CLI runs inside the container (``python -m vkvagent apply --now ...``), so it
uses the container's system bus, /proc and loopback as it would on a host. Every assertion is
on what really happened: exit codes and messages, the drop-in on disk, ExecStart read back
over D-Bus, the running process's /proc/<pid>/cmdline, vLLM's cache_config_info, the ledger
and systemd's journal. Each test boots its own container (``sandbox``): no restart, start-limit
count or drop-in leaks from one test to the next."""

from __future__ import annotations

import fcntl
import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import metrics
from tests.sandbox import (
    Sandbox,
    exec_line,
    reach_python,
    require,
    sandbox_fixture,  # noqa: F401 - the `sandbox` fixture
    sim_argv,
    sim_unit,
)
from vkvagent.actuation.steps import STEPS
from vkvagent.adapters.ledger import FILE_NAME, Action, Ledger
from vkvagent.adapters.systemd import Systemd, UnitState
from vkvagent.knowledge.dropin import HEADER, parse_dropin, split_exec_start

pytestmark = pytest.mark.systemd

VLLM = "vllm.service"
CONFIG = "/etc/vkvagent/config.toml"
STATE_DIR = "/var/lib/vkvagent"
DROPIN = "etc/systemd/system/vllm.service.d/90-vkvagent.conf"  # under the container's root
BIG_MODEL = "Qwen/Qwen2.5-32B-Instruct"  # 0.6 of an 80 GB GPU leaves its weights no KV room

FLAGS = {
    "gpu-memory-utilization": 0.8,
    "block-size": 32,
    "max-num-seqs": 64,
    "enable-prefix-caching": False,
}
# How vkvagent writes them: after the last option, in its catalogue's order.
RENDERED = (
    "--gpu-memory-utilization", "0.8", "--block-size", "32", "--no-enable-prefix-caching",
    "--max-num-seqs", "64",
)  # fmt: skip
ORIGINAL = tuple(sim_argv())
CHANGED = (*ORIGINAL, *RENDERED)
TIMING = re.compile(r"vLLM's own start ([0-9.]+) s, vkvagent's ([0-9.]+) s\)")


# -- helpers -----------------------------------------------------------------------------------


def write_config(
    box: Sandbox,
    flags: Mapping[str, object],
    *,
    path: str = CONFIG,
    state_dir: str = STATE_DIR,
    owner: int | None = None,
    timeout: float = 30,
    restart: Mapping[str, object] | None = None,
) -> None:
    """The agent's config in the container: root-owned, 0644, in a 0755 directory (``owner``
    chowns the directory and the state directory's parent to that uid, for a non-root run).
    ``restart``: [restart] keys besides (or instead of) the ones below."""
    restart = {
        "ready_timeout": timeout,
        "job_timeout": timeout,
        "drain_timeout": 2,
        # The simulator's traffic never stops: draining is not what most tests here are
        # about, nor is the --shutdown-timeout a drain would add (the drain tests set these).
        "drain_max_in_flight": 100000,
        "graceful_shutdown": False,
        **(restart or {}),
    }
    lines = [
        "[agent]",
        f'state_dir = "{state_dir}"',
        "[vllm]",
        'url = "http://127.0.0.1:8000"',
        "[restart]",
        *(f"{key} = {json.dumps(value)}" for key, value in restart.items()),
        "[policy]",
        'windows = ["daily 00:00-24:00"]',  # always open: apply --at-next-window goes at once
        "[vllm.flags]",
    ]
    for name, value in flags.items():
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        lines.append(f"{name} = {shown}")
    file = box.root / path.lstrip("/")
    file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    file.parent.chmod(0o755)
    file.write_text("\n".join(lines) + "\n")
    file.chmod(0o644)
    if owner is not None:
        box.run("chown", str(owner), str(Path(path).parent))


def vkvagent(
    box: Sandbox,
    *args: str,
    config: str = CONFIG,
    env: Mapping[str, str] | None = None,
    user: int | None = None,
    timeout: float = 90,
) -> subprocess.CompletedProcess[str]:
    """``vkvagent ARGS --config CONFIG`` run inside the container; never raises on its exit.
    No fault is injected unless ``env`` asks for one."""
    return box.run(
        sys.executable, "-m", "vkvagent", *args, "--config", config,
        check=False, timeout=timeout, env={"VKVAGENT_KILL_AT": "", **(env or {})}, user=user,
    )  # fmt: skip


def output(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def unit(box: Sandbox) -> UnitState:
    with Systemd(box.bus_address, timeout=10) as systemd:
        return systemd.unit(VLLM)


def cmdline(box: Sandbox, pid: int) -> tuple[str, ...]:
    raw = (box.root / f"proc/{pid}/cmdline").read_bytes()
    return tuple(part.decode() for part in raw.split(b"\0")[:-1])


def running_argv(box: Sandbox) -> tuple[str, ...]:
    """The command line systemd has (D-Bus) after checking that the running process has the
    same (/proc), and that the unit is active."""
    state = unit(box)
    assert (state.active_state, state.sub_state) == ("active", "running"), state
    assert len(state.exec_start) == 1
    argv = state.exec_start[0].argv
    assert cmdline(box, state.main_pid) == argv
    return argv


def cache_config(box: Sandbox) -> dict[str, str]:
    """vllm:cache_config_info's labels, from the running server's /metrics."""
    box.wait_http(timeout=30)
    status, page = box.http_get(8000, "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(page.decode()):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError("no vllm:cache_config_info on /metrics")


def dropin_text(box: Sandbox) -> str | None:
    path = box.root / DROPIN
    return path.read_text() if path.exists() else None


def dropin_argv(text: str) -> tuple[str, ...]:
    parsed = parse_dropin(text)
    assert parsed.exec_start is not None and parsed.resets
    (command,) = split_exec_start(parsed.exec_start)
    return command.argv


def actions(box: Sandbox, state_dir: str = STATE_DIR) -> list[Action]:
    """Every action in the container's ledger, oldest first.

    Read from a copy of its files (the database and its write-ahead log): SQLite resolves the
    symbolic link /proc/<pid>/root on its own, to the host's /, so it cannot open the file
    through ``box.root``. The agent has exited when this is called, so the copy is whole."""
    source = box.root / state_dir.lstrip("/")
    with tempfile.TemporaryDirectory(prefix="vkv-ledger.") as copy:
        for name in (FILE_NAME, f"{FILE_NAME}-wal"):
            if (source / name).exists():
                shutil.copyfile(source / name, Path(copy) / name)
        with Ledger(copy) as ledger:
            return list(reversed(ledger.recent(1000)))


def steps(action: Action) -> list[tuple[str, str]]:
    return [(step.step, step.state) for step in action.steps]


def restarts_requested(action: Action) -> int:
    return sum(1 for step in action.steps if (step.step, step.state) == ("restart", "begin"))


def startup_complete(box: Sandbox, invocation: str) -> float:
    """When vLLM (or the simulator, which says the same) of ``invocation`` logged that it
    serves: the journal's "Application startup complete." (Unix seconds)."""
    (at,) = [
        int(entry["__REALTIME_TIMESTAMP"]) / 1e6
        for entry in box.journal(VLLM)
        if str(entry.get("MESSAGE")).endswith("Application startup complete.")
        and entry.get("_SYSTEMD_INVOCATION_ID") == invocation
    ]
    return at


def starts(box: Sandbox) -> int:
    """How often systemd started vllm.service, the boot's start included (its journal)."""
    return sum(1 for m in box.messages(VLLM) if m.startswith("Started vllm.service"))


@pytest.fixture
def big_sandbox() -> Iterator[Sandbox]:
    """vllm.service serving a 32B model: 0.9 of the GPU fits it, 0.6 does not."""
    require()
    with Sandbox(units={VLLM: sim_unit(model=BIG_MODEL)}) as box:
        box.wait_http()
        yield box


# -- 1. plan and apply -------------------------------------------------------------------------


def test_apply_at_next_window_goes_at_once_inside_a_window(sandbox: Sandbox) -> None:
    write_config(sandbox, FLAGS)
    before = unit(sandbox)
    done = vkvagent(sandbox, "apply", "--at-next-window")
    assert done.returncode == 0, output(done)
    assert "waiting for the restart window" not in done.stdout
    assert unit(sandbox).invocation_id != before.invocation_id


def test_plan_and_apply_put_the_flags_into_the_running_vllm(sandbox: Sandbox) -> None:
    write_config(sandbox, FLAGS)
    before = unit(sandbox)

    planned = vkvagent(sandbox, "plan")
    assert planned.returncode == 0, output(planned)
    assert f"before: {shlex.join(ORIGINAL)}\n" in planned.stdout
    assert f"after:  {shlex.join(CHANGED)}\n" in planned.stdout
    assert "cache_config_info: gpu-memory-utilization, block-size, enable-prefix-caching;" in (
        planned.stdout
    )
    assert unit(sandbox).invocation_id == before.invocation_id  # a plan changes nothing
    assert dropin_text(sandbox) is None

    applied = vkvagent(sandbox, "apply", "--now")
    assert applied.returncode == 0, output(applied)
    assert re.search(r"^done: restarted with the new flags \(action 1, ", applied.stdout, re.M)
    timing = TIMING.search(applied.stdout)
    assert timing and float(timing.group(2)) < 1.0, applied.stdout  # drop-in and reload
    print(f"\napply: vLLM's start {timing.group(1)} s, vkvagent's own {timing.group(2)} s")

    text = dropin_text(sandbox)
    assert text is not None and text.startswith(HEADER + "\n")
    assert not parse_dropin(text).foreign_edit
    assert dropin_argv(text) == CHANGED
    assert f"\n[Service]\nExecStart=\nExecStart={exec_line(CHANGED)}\n" in text
    after = unit(sandbox)
    assert after.drop_in_paths == (f"/{DROPIN}",)
    assert running_argv(sandbox) == CHANGED  # D-Bus and /proc/<MainPID>/cmdline
    assert after.main_pid != before.main_pid
    assert after.invocation_id != before.invocation_id
    shown = cache_config(sandbox)
    assert (shown["gpu_memory_utilization"], shown["block_size"]) == ("0.8", "32")
    assert shown["enable_prefix_caching"] == "False"

    (action,) = actions(sandbox)
    assert (action.kind, action.outcome) == ("apply", "done")
    assert action.detail["intended"] == list(CHANGED)
    unhooked = [step for step in STEPS if step not in HOOKS]  # none configured
    assert steps(action) == [(step, state) for step in unhooked for state in ("begin", "done")]

    again = vkvagent(sandbox, "apply", "--now")
    assert again.returncode == 0, output(again)
    assert "nothing to apply" in again.stdout
    assert unit(sandbox).invocation_id == after.invocation_id
    assert len(actions(sandbox)) == 1
    assert starts(sandbox) == 2  # the boot's and the apply's


# -- 2. restart and its overhead ---------------------------------------------------------------


def test_restart_and_the_time_vkvagent_adds(sandbox: Sandbox) -> None:
    """vkvagent's share of a restart (preflight, drain, drop-in and reload: everything before
    systemd's job) stays under a second. Also measured: how late vkvagent notices vLLM is
    ready (the journal's "Application startup complete." to the ledger's ready step)."""
    write_config(sandbox, {})
    own, service, noticed = [], [], []
    for number in range(1, 4):
        before = unit(sandbox)
        done = vkvagent(sandbox, "restart", "--reason", "test")
        assert done.returncode == 0, output(done)
        assert f"done: restarted (action {number}, " in done.stdout
        timing = TIMING.search(done.stdout)
        assert timing, done.stdout
        service.append(float(timing.group(1)))
        own.append(float(timing.group(2)))
        after = unit(sandbox)
        assert after.invocation_id != before.invocation_id
        assert after.active_state == "active"
        action = actions(sandbox)[-1]
        assert (action.kind, action.reason, action.outcome) == ("restart", "test", "done")
        assert steps(action) == [
            (step, state) for step in ("preflight", "drain", "restart", "ready")
            for state in ("begin", "done")
        ]  # fmt: skip
        ready = next(s.at for s in action.steps if (s.step, s.state) == ("ready", "done"))
        noticed.append(ready - startup_complete(sandbox, after.invocation_id))
    print(
        f"\nrestart timings over {len(own)} restarts (median): vkvagent's own "
        f"{statistics.median(own):.2f} s {own}, vLLM's start as measured "
        f"{statistics.median(service):.1f} s {service}, ready noticed "
        f"{statistics.median(noticed):.2f} s after it was {[round(n, 2) for n in noticed]}"
    )
    assert statistics.median(own) < 1.0
    assert max(own) < 1.0
    assert min(noticed) >= 0 and statistics.median(noticed) < 1.0
    assert starts(sandbox) == 4


# -- 3. a change that breaks vLLM is rolled back -----------------------------------------------


@pytest.mark.parametrize("restart_setting", ["", "Restart=on-failure\nRestartSec=1"])
def test_a_change_that_breaks_vllm_is_rolled_back(restart_setting: str) -> None:
    """0.6 of the GPU leaves a 32B model no KV cache: the simulator exits 1 after loading,
    as vLLM does. vkvagent restores the previous command line and vLLM serves again. With
    Restart=on-failure systemd would try the broken line again and again (spending the start
    limit the rollback needs); vkvagent rolls back on the first failure."""
    require()
    with Sandbox(units={VLLM: sim_unit(model=BIG_MODEL, service=restart_setting)}) as box:
        box.wait_http()
        original = tuple(sim_argv(model=BIG_MODEL))
        assert running_argv(box) == original
        before = unit(box)
        default = cache_config(box)["gpu_memory_utilization"]
        write_config(box, {"gpu-memory-utilization": 0.6})

        done = vkvagent(box, "apply", "--now")
        assert done.returncode == 1, output(done)
        assert "rolled-back: " in done.stderr
        assert "previous command line restored" in done.stderr
        if restart_setting:
            assert "vllm.service exited and Restart= is starting it again" in done.stderr
        else:
            assert "vllm.service failed (failed, exit-code) after the restart" in done.stderr
        assert "Traceback" not in done.stderr

        assert running_argv(box) == original
        after = unit(box)
        assert after.invocation_id != before.invocation_id  # restarted, with the old line
        assert after.result == "success"
        assert dropin_text(box) is None
        assert after.drop_in_paths == ()
        assert cache_config(box)["gpu_memory_utilization"] == default
        (action,) = actions(box)
        assert (action.kind, action.outcome) == ("apply", "rolled-back")
        assert ("ready", "failed") in steps(action)
        assert steps(action)[-6:] == [
            ("restore", "begin"), ("restore", "done"), ("restart", "begin"),
            ("restart", "done"), ("ready", "begin"), ("ready", "done"),
        ]  # fmt: skip
        messages = box.messages(VLLM)
        assert any("No available memory for the cache blocks" in m for m in messages)
        assert starts(box) == 3  # the boot's, the broken line's, the rollback's


# -- 4. kill -9 at every step ------------------------------------------------------------------

# What the next run's recover() makes of an action killed as the step began.
RECOVERED = {
    "preflight": "aborted",  # nothing changed yet
    "pre_stop": "aborted",
    "drain": "aborted",
    "write": "rolled-back",  # the drop-in may be on disk: put back, no restart needed
    "reload": "rolled-back",
    "restart": "rolled-back",  # systemd never got the restart: the old process still runs
    "ready": "done",  # systemd had restarted it: wait, attest, never restart again
    "attest": "done",
    "post_ready": "done",
}
HOOKS = ("pre_stop", "post_ready")


@pytest.mark.parametrize("step", STEPS)
def test_kill_9_at_each_step_then_the_next_run_recovers(sandbox: Sandbox, step: str) -> None:
    # Hooks that always succeed, so that every step is taken.
    write_config(sandbox, FLAGS, restart={hook: ["/bin/true"] for hook in HOOKS})

    killed = vkvagent(sandbox, "apply", "--now", env={"VKVAGENT_KILL_AT": step})
    assert killed.returncode in (-9, 137), output(killed)
    (interrupted,) = actions(sandbox)
    assert interrupted.open and interrupted.last_step is not None
    assert (interrupted.last_step.step, interrupted.last_step.state) == (step, "begin")
    text = dropin_text(sandbox)
    if text is not None:  # never half a file, never one that reads as someone else's
        assert not parse_dropin(text).foreign_edit
        assert dropin_argv(text) == CHANGED
    assert unit(sandbox).active_state in ("active", "activating", "deactivating")

    done = vkvagent(sandbox, "apply", "--now")
    assert done.returncode == 0, output(done)
    assert re.search(rf"^recovered action 1: .* \({RECOVERED[step]}\)$", done.stdout, re.M), (
        done.stdout
    )

    # Consistent: the flags in effect everywhere (drop-in, D-Bus, the process, vLLM).
    text = dropin_text(sandbox)
    assert text is not None and not parse_dropin(text).foreign_edit
    assert dropin_argv(text) == CHANGED
    assert running_argv(sandbox) == CHANGED
    assert cache_config(sandbox)["block_size"] == "32"
    history = actions(sandbox)
    assert not any(action.open for action in history)
    assert history[0].outcome == RECOVERED[step]
    assert all(restarts_requested(action) <= 1 for action in history)
    if RECOVERED[step] == "done":
        assert len(history) == 1
        assert "nothing to apply" in done.stdout
    else:
        assert [a.outcome for a in history] == [RECOVERED[step], "done"]
    # One restart in all, whichever run made it: the killed one's, or the next one's.
    assert starts(sandbox) == 2
    assert not list((sandbox.root / DROPIN).parent.glob(".*.tmp"))


def test_kill_9_while_undoing_a_broken_change(big_sandbox: Sandbox) -> None:
    """Killed as it began to put the previous drop-in back after the change broke vLLM: the
    broken line is on disk and the unit is down. The next run finishes the undo."""
    original = tuple(sim_argv(model=BIG_MODEL))
    write_config(big_sandbox, {"gpu-memory-utilization": 0.6})
    killed = vkvagent(big_sandbox, "apply", "--now", env={"VKVAGENT_KILL_AT": "restore"})
    assert killed.returncode in (-9, 137), output(killed)
    (interrupted,) = actions(big_sandbox)
    assert interrupted.last_step is not None and interrupted.last_step.step == "restore"
    assert unit(big_sandbox).active_state == "failed"
    assert dropin_text(big_sandbox) is not None

    write_config(big_sandbox, {})  # the operator gives the change up
    done = vkvagent(big_sandbox, "apply", "--now")
    assert done.returncode == 0, output(done)
    assert re.search(r"^recovered action 1: .*\(rolled-back\)$", done.stdout, re.M), done.stdout
    assert "nothing to apply" in done.stdout
    assert running_argv(big_sandbox) == original
    assert dropin_text(big_sandbox) is None
    (action,) = actions(big_sandbox)
    assert action.outcome == "rolled-back"
    assert restarts_requested(action) == 2  # the change's, then the undo's: once each
    assert starts(big_sandbox) == 3


# -- 5. the start limit ------------------------------------------------------------------------

LIMITED = "StartLimitBurst=3\nStartLimitIntervalSec=60"


def test_restarts_stop_short_of_the_start_limit() -> None:
    """Burst 3 in 60 s: the boot's start and two restarts. A third restart would be the
    fourth start, which systemd would refuse and leave the unit failed (start-limit-hit)."""
    require()
    with Sandbox(units={VLLM: sim_unit(unit=LIMITED)}) as box:
        box.wait_http()
        write_config(box, {})
        for _ in range(2):
            done = vkvagent(box, "restart")
            assert done.returncode == 0, output(done)
        before = unit(box)
        assert (before.start_limit_burst, before.start_limit_interval_usec) == (3, 60_000_000)
        refused = vkvagent(box, "restart")
        assert refused.returncode == 1, output(refused)
        lines = refused.stderr.splitlines()
        assert len(lines) == 1 and "StartLimitBurst=3" in lines[0], lines
        assert "StartLimitIntervalSec=60" in lines[0]
        after = unit(box)
        assert (after.active_state, after.result) == ("active", "success")
        assert after.invocation_id == before.invocation_id
        assert actions(box)[-1].outcome == "aborted"
        assert starts(box) == 3


def test_a_rolled_back_change_counts_as_two_starts() -> None:
    """Burst 4: the boot, a broken change and its rollback make 3 starts; one more restart
    fits, a second would push the unit into start-limit-hit and is refused."""
    require()
    limited = "StartLimitBurst=4\nStartLimitIntervalSec=60"
    with Sandbox(units={VLLM: sim_unit(unit=limited, model=BIG_MODEL)}) as box:
        box.wait_http()
        write_config(box, {"gpu-memory-utilization": 0.6})
        broken = vkvagent(box, "apply", "--now")
        assert broken.returncode == 1 and "rolled-back" in broken.stderr, output(broken)
        assert starts(box) == 3
        write_config(box, {})
        done = vkvagent(box, "restart")
        assert done.returncode == 0, output(done)
        refused = vkvagent(box, "restart")
        assert refused.returncode == 1, output(refused)
        assert "StartLimitBurst=4" in refused.stderr
        assert (unit(box).active_state, unit(box).result) == ("active", "success")
        assert starts(box) == 4


# -- 6. permission -----------------------------------------------------------------------------


def test_an_unprivileged_user_is_told_access_is_denied(sandbox: Sandbox) -> None:
    reach_python(sandbox)
    home = "/tmp/vkv-nobody"
    config = f"{home}/config.toml"
    write_config(sandbox, FLAGS, path=config, state_dir=f"{home}/state", owner=65534)
    before = unit(sandbox)
    expected = {
        ("apply", "--now"): f"access denied: cannot write /{DROPIN} (changing vllm.service's "
        "flags needs root)",
        ("restart",): "restart vllm.service: access denied: ",  # systemd's (polkit's) refusal
    }
    for command, message in expected.items():
        done = vkvagent(sandbox, *command, config=config, user=65534)
        assert done.returncode == 1, output(done)
        lines = done.stderr.splitlines()
        assert len(lines) == 1, output(done)
        assert lines[0].startswith(f"vkvagent: aborted: {message}"), lines[0]
        assert "Traceback" not in done.stderr and "internal error" not in done.stderr
    after = unit(sandbox)
    assert after.invocation_id == before.invocation_id
    assert dropin_text(sandbox) is None
    history = actions(sandbox, f"{home}/state")
    assert [(a.kind, a.outcome) for a in history] == [("apply", "aborted"), ("restart", "aborted")]


# -- 7. a drop-in someone else edited ----------------------------------------------------------


def test_a_hand_edited_drop_in_is_not_overwritten_until_adopted(sandbox: Sandbox) -> None:
    write_config(sandbox, FLAGS)
    done = vkvagent(sandbox, "apply", "--now")
    assert done.returncode == 0, output(done)
    path = sandbox.root / DROPIN
    edited = path.read_text() + "# tuned by hand\n"
    path.write_text(edited)
    before = unit(sandbox)

    write_config(sandbox, {**FLAGS, "gpu-memory-utilization": 0.85})
    refused = vkvagent(sandbox, "apply", "--now")
    assert refused.returncode == 1, output(refused)
    assert "edited by someone else" in refused.stderr
    assert "vkvagent adopt" in refused.stderr
    assert path.read_text() == edited
    assert unit(sandbox).invocation_id == before.invocation_id
    assert actions(sandbox)[-1].outcome == "aborted"
    refused = vkvagent(sandbox, "rollback")  # nor is it rolled back over
    assert refused.returncode == 1, output(refused)
    assert "edited by someone else" in refused.stderr
    assert path.read_text() == edited

    adopted = vkvagent(sandbox, "adopt")
    assert adopted.returncode == 0, output(adopted)
    assert f"adopted vllm.service's command line: {shlex.join(CHANGED)}" in adopted.stdout
    assert not parse_dropin(path.read_text()).foreign_edit
    assert unit(sandbox).invocation_id == before.invocation_id  # adopting restarts nothing

    applied = vkvagent(sandbox, "apply", "--now")
    assert applied.returncode == 0, output(applied)
    wanted = tuple("0.85" if arg == "0.8" else arg for arg in CHANGED)
    assert running_argv(sandbox) == wanted
    assert dropin_argv(path.read_text()) == wanted
    assert cache_config(sandbox)["gpu_memory_utilization"] == "0.85"


# -- 8. rollback -------------------------------------------------------------------------------


def test_rollback_restores_the_original_command_line(sandbox: Sandbox) -> None:
    write_config(sandbox, FLAGS)
    applied = vkvagent(sandbox, "apply", "--now")
    assert applied.returncode == 0, output(applied)
    assert running_argv(sandbox) == CHANGED
    before = unit(sandbox)

    done = vkvagent(sandbox, "rollback")
    assert done.returncode == 0, output(done)
    assert "done: previous command line restored" in done.stdout
    assert running_argv(sandbox) == ORIGINAL
    assert unit(sandbox).invocation_id != before.invocation_id
    assert dropin_text(sandbox) is None
    assert cache_config(sandbox)["block_size"] == "16"
    assert [(a.kind, a.outcome) for a in actions(sandbox)] == [
        ("apply", "done"),
        ("rollback", "done"),
    ]
    again = vkvagent(sandbox, "rollback")
    assert again.returncode == 1, output(again)
    assert "nothing to roll back" in again.stderr

    # The unit file edited since: the next plan starts from it, not from the old line.
    edited = sim_argv("--max-model-len", "8192")
    sandbox.write_unit(VLLM, sim_unit("--max-model-len", "8192"))
    sandbox.run("systemctl", "daemon-reload")
    planned = vkvagent(sandbox, "plan")
    assert planned.returncode == 0, output(planned)
    assert f"after:  {shlex.join([*edited, *RENDERED])}\n" in planned.stdout


def test_a_failed_change_leaves_nothing_for_rollback_to_bring_back(big_sandbox: Sandbox) -> None:
    """The broken change was undone already: rolling back must not put it back."""
    write_config(big_sandbox, {"gpu-memory-utilization": 0.6})
    broken = vkvagent(big_sandbox, "apply", "--now")
    assert broken.returncode == 1, output(broken)
    done = vkvagent(big_sandbox, "rollback")
    assert done.returncode == 1, output(done)
    assert "nothing to roll back" in done.stderr
    assert running_argv(big_sandbox) == tuple(sim_argv(model=BIG_MODEL))


# -- one at a time -----------------------------------------------------------------------------


def test_a_second_vkvagent_waits_its_turn(sandbox: Sandbox) -> None:
    """While one vkvagent acts, another must not: its recover() would take the first one's
    open action for an interrupted one and undo it mid-way."""
    write_config(sandbox, FLAGS)
    lock = sandbox.root / STATE_DIR.lstrip("/") / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    before = unit(sandbox)
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for command in (("apply", "--now"), ("restart",), ("rollback",), ("adopt",)):
            done = vkvagent(sandbox, *command)
            assert done.returncode == 1, output(done)
            assert done.stderr == (
                f"vkvagent: another vkvagent is acting on vllm.service now (it holds "
                f"{STATE_DIR}/lock); try again when it has finished\n"
            )
    assert unit(sandbox).invocation_id == before.invocation_id
    done = vkvagent(sandbox, "apply", "--now")  # and once it is free, it goes ahead
    assert done.returncode == 0, output(done)


# -- draining ----------------------------------------------------------------------------------


def test_a_drained_restart_gives_vllm_its_shutdown_timeout_then_lets_it_drain(
    sandbox: Sandbox,
) -> None:
    """The simulator drains as vLLM 0.32 does: on SIGTERM with --shutdown-timeout it admits
    nothing more and finishes what it runs, while /metrics still answers."""
    write_config(sandbox, {}, restart={"graceful_shutdown": True, "drain_timeout": 10})
    first = vkvagent(sandbox, "restart", "--reason", "test")
    assert first.returncode == 0, output(first)
    text = dropin_text(sandbox)
    assert text is not None and not parse_dropin(text).foreign_edit
    assert dropin_argv(text) == (*ORIGINAL, "--shutdown-timeout", "10")
    assert text.endswith("\nTimeoutStopSec=40\nKillMode=mixed\n")
    assert running_argv(sandbox) == (*ORIGINAL, "--shutdown-timeout", "10")
    (action,) = actions(sandbox)
    assert (action.kind, action.outcome) == ("apply", "done")
    # The simulator's traffic never stops, and the running vLLM could not drain by itself yet.
    costs = action.detail["costs"]
    assert costs["drain_mode"] == "quiet" and costs["aborted"] == costs["in_flight"] > 0
    assert re.search(r"\n  waited for a quiet moment in [0-9.]+ s, [1-9][0-9]* of", first.stdout)

    second = vkvagent(sandbox, "restart", "--reason", "test")
    assert second.returncode == 0, output(second)
    latest = actions(sandbox)[-1]
    assert (latest.kind, latest.outcome) == ("restart", "done")  # nothing more to change
    assert [s for s, _ in steps(latest)] == ["preflight"] * 2 + ["restart"] * 2 + ["ready"] * 2
    costs = latest.detail["costs"]
    assert costs["drain_mode"] == "vllm" and costs["in_flight"] > 0 and costs["aborted"] == 0
    assert 0 < costs["drain_seconds"] < 10 < costs["down_seconds"] + 10
    said = "\n".join(sandbox.messages(VLLM))
    assert "[shutdown] EngineCore: draining in-flight requests count=" in said
    assert "[shutdown] EngineCore: request processing complete" in said


def test_a_unit_that_drains_under_the_default_killmode_gets_killmode_mixed_first() -> None:
    """The operator's unit has --shutdown-timeout but systemd's default KillMode=control-group,
    whose SIGTERM reaches vLLM's engine too: the first restart writes vkvagent's drop-in with
    the same command line and KillMode=mixed (a quiet moment's drain for that stop), and
    only the next one is vLLM's drain."""
    own = sim_unit("--shutdown-timeout", "10")
    with Sandbox(units={VLLM: own}) as box:
        box.wait_http()
        assert unit(box).kill_mode == "control-group"
        write_config(box, {}, restart={"graceful_shutdown": True, "drain_timeout": 10})
        planned = vkvagent(box, "plan")
        assert "the next restart writes KillMode=mixed first" in planned.stdout, output(planned)
        first = vkvagent(box, "restart", "--reason", "test")
        assert first.returncode == 0, output(first)
        assert "done: restarted with systemd's stop settings for the drain" in first.stdout
        text = dropin_text(box)
        assert text is not None and text.endswith("\nTimeoutStopSec=40\nKillMode=mixed\n")
        assert dropin_argv(text) == tuple(sim_argv("--shutdown-timeout", "10"))
        (action,) = actions(box)
        assert (action.kind, action.outcome, action.detail["changes"]) == ("apply", "done", {})
        assert unit(box).kill_mode == "mixed"
        assert "KillMode=mixed first" not in vkvagent(box, "plan").stdout

        second = vkvagent(box, "restart", "--reason", "test")
        assert second.returncode == 0, output(second)
        latest = actions(box)[-1]
        assert (latest.kind, latest.detail["costs"]["drain_mode"]) == ("restart", "vllm")


def test_a_stop_that_signals_the_engine_too_is_no_drain_of_vllms(tmp_path: Path) -> None:
    """KillMode=control-group with vLLM's engine in the unit's cgroup: systemd's SIGTERM
    reaches the engine, which fails what it runs, so --shutdown-timeout drains nothing."""
    from vkvagent.actuation.drain import stop_reaches_the_engine

    group = "/system.slice/vllm.service"
    for pid in (42, 43):  # the API server (MainPID) and its engine core
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(f"0::{group}\n")

    def state(kill_mode: str, main_pid: int = 42) -> UnitState:
        return UnitState(
            VLLM, "loaded", "active", "running", "success", main_pid, "ab" * 16, 0, 0, None,
            (), "/etc/systemd/system/vllm.service", (), 5, 10_000_000, control_group=group,
            kill_mode=kill_mode,
        )  # fmt: skip

    def reaches(unit_state: UnitState) -> bool:
        return stop_reaches_the_engine(unit_state, tmp_path)

    assert reaches(state("control-group"))
    assert not reaches(state("mixed"))
    (tmp_path / "43").rename(tmp_path / "44")  # the engine elsewhere: a container's scope
    (tmp_path / "44" / "cgroup").write_text("0::/machine.slice/libpod-1.scope\n")
    assert not reaches(state("control-group"))


class _Watched:
    """What a stop's watch reads: /metrics pages in turn (None: refused) and a clock that
    moves one second a look."""

    def __init__(self, *in_flight: float | None) -> None:
        self.pages = [None if n is None else metrics(num_requests_running=n) for n in in_flight]
        self.now = 100.0

    def _scrape(self) -> object:
        return self.pages.pop(0)

    def _clock(self) -> float:
        self.now += 1.0
        return self.now

    def _wall(self) -> float:
        return 1e9

    def _progress(self, line: str) -> None:
        pass


@pytest.mark.parametrize(
    ("pages", "aborted"),
    [
        ((9, 9, 4, None), 0.0),  # gone between two looks, 3 s in: it drained and exited
        ((9, 9, 4, 0, None), 0.0),  # seen with none left
        ((9, 9, 9, 9, 9, 9, None), 9.0),  # gone at its 5 s timeout: it aborted what was left
    ],
)
def test_a_vllm_that_exits_before_its_shutdown_timeout_aborted_nothing(
    pages: tuple[float | None, ...], aborted: float
) -> None:
    """vLLM exits early only once its drain is over; it aborts requests only at its
    --shutdown-timeout. A vLLM gone between two looks that saw requests in flight cut none."""
    from vkvagent.actuation.drain import Stop

    before = UnitState(
        "vllm.service", "loaded", "active", "running", "success", 42, "ab" * 16, 0, 0, None,
        (), "/etc/systemd/system/vllm.service", (), 5, 10_000_000,
    )  # fmt: skip
    watched = _Watched(*pages)
    stop = Stop(
        before, "vllm", None, shutdown=5, scrape=watched._scrape,  # type: ignore[arg-type]
        clock=watched._clock, wall=watched._wall, progress=watched._progress,
    )  # fmt: skip
    while watched.pages:
        stop.tick()
    costs = stop.costs(ready_at=watched.now + 10)
    assert (costs.in_flight, costs.aborted) == (9.0, aborted)


def test_no_drain_kills_a_vllm_that_would_drain_and_counts_what_it_cut_off(
    sandbox: Sandbox,
) -> None:
    write_config(sandbox, {}, restart={"graceful_shutdown": True, "drain_timeout": 60})
    assert vkvagent(sandbox, "restart", "--reason", "test").returncode == 0  # the flags
    before = unit(sandbox)
    done = vkvagent(sandbox, "restart", "--no-drain", "--reason", "test")
    assert done.returncode == 0, output(done)
    costs = actions(sandbox)[-1].detail["costs"]
    assert costs["drain_mode"] == "none" and costs["aborted"] == costs["in_flight"] > 0
    assert costs["drain_seconds"] is None and costs["down_seconds"] < 30  # no 60 s drain
    said = "\n".join(sandbox.messages(VLLM)[-30:])
    assert "draining in-flight requests" not in said.split("Starting vLLM API server")[-2]
    after = unit(sandbox)
    assert after.invocation_id != before.invocation_id and after.active_state == "active"


@pytest.mark.parametrize("when_busy", ["give-up", "proceed"])
def test_a_vllm_that_cannot_drain_waits_for_a_quiet_moment_then_does_as_when_busy_says(
    sandbox: Sandbox, when_busy: str
) -> None:
    """graceful_shutdown off: the simulator's traffic never leaves a quiet moment."""
    write_config(sandbox, {}, restart={"drain_max_in_flight": 0, "when_busy": when_busy})
    before = unit(sandbox)
    done = vkvagent(sandbox, "restart", "--reason", "test")
    (action,) = actions(sandbox)
    if when_busy == "give-up":
        assert done.returncode == 1, output(done)
        assert re.fullmatch(
            r"vkvagent: aborted: still [0-9]+ requests in flight after 2 s \(when_busy = "
            r"give-up; --no-drain restarts now\) \(action 1, [0-9.]+ s\)\n",
            done.stderr,
        ), done.stderr
        assert action.outcome == "aborted" and "costs" not in action.detail
        assert unit(sandbox).invocation_id == before.invocation_id
    else:
        assert done.returncode == 0, output(done)
        costs = action.detail["costs"]
        assert costs["drain_mode"] == "busy" and costs["aborted"] == costs["in_flight"] > 0
        assert costs["drain_seconds"] >= 2
        assert unit(sandbox).invocation_id != before.invocation_id
