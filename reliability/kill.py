"""``kill -9`` of the agent at randomised points of the restart procedure, against a real
systemd (tests/sandbox.py) with the simulator as vllm.service.

Each trial picks a restart or a flag change (new random flags each time), and a way to die:
``VKVAGENT_KILL_AT=<step>`` (the actuator SIGKILLs itself as that step begins; every step of
``steps.STEPS`` that the action takes), or a SIGKILL from outside after a random delay,
which lands anywhere: while Python starts, mid-write of the drop-in, between ``RestartUnit``
and its ledger record, while waiting for vLLM. Then the next ``vkvagent apply --now`` (the
same config) runs ``recover()`` and finishes the job. Checked after every trial:

- the drop-in right after the kill is absent, the old one or the new one, never a part or a
  file that reads as someone else's; no temporary file is left once recovered;
- the ledger: no action lost or changed, none left open, the killed one recovered as
  ``recover()`` promises for that step;
- restarts: systemd started vllm.service exactly as often as the ledger has actions that
  restarted it ("done"), and a flag change restarts it exactly once, whichever run did it;
- vllm.service active, running the command line of the drop-in (the new flags for a change).

Trials share one booted container (its start limit off, ``StartLimitIntervalSec=0``, as
trials restart vLLM every few seconds); a trial that leaves it broken gets a fresh one.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from reliability.report import Row, need_sandbox
from tests.sandbox import Sandbox, sim_argv, sim_unit
from tests.test_actuator import (
    DROPIN,
    actions,
    dropin_argv,
    dropin_text,
    restarts_requested,
    running_argv,
    starts,
    unit,
    vkvagent,
    write_config,
)
from vkvagent.actuation.steps import STEPS
from vkvagent.adapters.ledger import FILE_NAME, Action
from vkvagent.knowledge.dropin import parse_dropin

VLLM = "vllm.service"
# Not /etc/vkvagent and /var/lib/vkvagent: the sandbox's root is an overlay on the host's, where
# tests/test_packaging.py installs the .deb for a while (another run's state would show here).
CONFIG = "/etc/vkvagent-reliability/config.toml"
STATE_DIR = "/var/lib/vkvagent-reliability"
RESTART_STEPS = ("preflight", "pre_stop", "drain", "restart", "ready", "post_ready")
HOOKS = {"pre_stop": ["/bin/true"], "post_ready": ["/bin/true"]}  # so that every step is taken
# What recover() makes of an action killed as the step began (tests/test_actuator.py RECOVERED,
# and for a plain restart: nothing changed before systemd had it, it was waited for after).
RECOVERED = {
    "apply": {
        "preflight": "aborted", "pre_stop": "aborted", "drain": "aborted",
        "write": "rolled-back", "reload": "rolled-back", "restart": "rolled-back",
        "ready": "done", "attest": "done", "post_ready": "done",
    },
    "restart": {
        "preflight": "aborted", "pre_stop": "aborted", "drain": "aborted", "restart": "aborted",
        "ready": "done", "post_ready": "done",
    },
}  # fmt: skip
MAX_DELAY = 2.0  # seconds, until a run that finished says how long one takes


def random_flags(rng: random.Random, current: Mapping[str, object]) -> dict[str, object]:
    """Flags the simulator accepts, different from ``current``."""
    while True:
        wanted: dict[str, object] = {
            "max-num-seqs": rng.randrange(8, 257),
            "block-size": rng.choice([16, 32]),
            "gpu-memory-utilization": rng.choice([0.8, 0.85, 0.9]),
        }
        if rng.random() < 0.5:
            wanted["enable-prefix-caching"] = rng.random() < 0.5
        if wanted != dict(current):
            return wanted


def run_killed_after(box: Sandbox, delay: float, *args: str) -> tuple[int, float]:
    """``vkvagent ARGS`` in the container, SIGKILLed from outside ``delay`` seconds after it
    was started (if it still runs). Returns its exit status (negative: the signal) and how long
    it ran."""
    began = time.monotonic()
    process = subprocess.Popen(
        [
            "nsenter",
            "-t",
            str(box.leader),
            "-a",
            sys.executable,
            "-m",
            "vkvagent",
            *args,
            "--config",
            CONFIG,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "VKVAGENT_KILL_AT": ""},
    )
    deadline = time.monotonic() + delay
    agent = 0
    while time.monotonic() < deadline and process.poll() is None:
        agent = agent or _child(process.pid)
        time.sleep(0.005)
    agent = agent or _child(process.pid)
    if process.poll() is None and agent:
        with contextlib.suppress(ProcessLookupError):  # it finished just now
            os.kill(agent, signal.SIGKILL)
    try:
        status = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        status = process.wait()
    return status, time.monotonic() - began


def _child(pid: int) -> int:
    """nsenter forks to enter the PID namespace: the agent is its child."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0
    return int(children[0]) if children else 0


def ledger_ok(box: Sandbox) -> str | None:
    """SQLite's own integrity check of the ledger (a copy, as test_actuator reads it)."""
    source = box.root / STATE_DIR.lstrip("/")
    with tempfile.TemporaryDirectory(prefix="vkv-ledger.") as copy:
        for name in (FILE_NAME, f"{FILE_NAME}-wal"):
            if (source / name).exists():
                shutil.copyfile(source / name, Path(copy) / name)
        db = sqlite3.connect(str(Path(copy) / FILE_NAME))
        try:
            answer = str(db.execute("PRAGMA integrity_check").fetchone()[0])
        finally:
            db.close()
    return None if answer == "ok" else answer


def _same(before: Action, after: Action) -> bool:
    return (before.id, before.kind, before.outcome, before.steps) == (
        after.id,
        after.kind,
        after.outcome,
        after.steps,
    )


class Trials:
    """State carried from trial to trial: the container and the flags now in effect."""

    def __init__(self, row: Row, rng: random.Random) -> None:
        self.row, self.rng = row, rng
        self.box: Sandbox | None = None
        self.flags: dict[str, object] = {}
        self.modes: dict[str, int] = {}
        self.took = {"apply": MAX_DELAY, "restart": MAX_DELAY}  # the last run that finished
        # When the steps that change something ran in that run (seconds after its launch):
        # half the delayed kills aim there, where a kill does the most harm.
        self.critical: dict[str, tuple[float, float]] = {}

    def boot(self) -> Sandbox:
        if self.box is not None:
            self.box.stop()
        self.box = Sandbox(units={VLLM: sim_unit(unit="StartLimitIntervalSec=0")})
        self.box.start()
        self.box.wait_http()
        self.flags = {}
        return self.box

    def close(self) -> None:
        if self.box is not None:
            self.box.stop()
            self.box = None

    def _learn(self, kind: str, launched: float, box: Sandbox) -> None:
        """Where the critical steps ran in the run that just finished (the ledger's times)."""
        found = actions(box, STATE_DIR)
        if not found:
            return
        first = "write" if kind == "apply" else "restart"
        begun = [s.at for s in found[-1].steps if s.step == first and s.state == "begin"]
        ended = [s.at for s in found[-1].steps if s.step == "restart" and s.state == "done"]
        if begun and ended:
            self.critical[kind] = (begun[0] - launched, ended[-1] - launched)

    def trial(self, number: int) -> None:
        row, rng = self.row, self.rng
        box = self.box or self.boot()
        kind = rng.choice(["apply", "restart"])
        wanted = random_flags(rng, self.flags) if kind == "apply" else {}
        if kind == "restart":
            wanted = dict(self.flags)  # nothing to change: `apply --now` then only recovers
        write_config(box, wanted, path=CONFIG, state_dir=STATE_DIR, restart=HOOKS)
        before = {a.id: a for a in actions(box, STATE_DIR)}
        started = starts(box)
        old_text = dropin_text(box)
        old_argv = dropin_argv(old_text) if old_text else tuple(sim_argv())
        intended = None
        where = f"trial {number} ({kind})"

        if rng.random() < 0.5:
            step = rng.choice(STEPS if kind == "apply" else RESTART_STEPS)
            how = f"KILL_AT={step}"
            args = ("apply", "--now") if kind == "apply" else ("restart", "--reason", "trial")
            done = vkvagent(box, *args, config=CONFIG, env={"VKVAGENT_KILL_AT": step})
            status = done.returncode
        else:
            step = None
            # Anywhere from the start to about when it would have finished on its own, or
            # within the steps that change something (drop-in, reload, restart job).
            window = self.critical.get(kind)
            if window is not None and rng.random() < 0.5:
                delay = rng.uniform(window[0] - 0.01, window[1] + 0.01)
            else:
                delay = rng.uniform(0.0, self.took[kind])
            how = f"SIGKILL after {delay:.3f} s"
            args = ("apply", "--now") if kind == "apply" else ("restart", "--reason", "trial")
            launched = time.time()
            status, ran = run_killed_after(box, delay, *args)
            if status == 0:
                self.took[kind] = ran
                self._learn(kind, launched, box)
        where += f", {how}"
        killed = status in (-9, 137)
        if killed:
            row.faults = (row.faults or 0) + 1
        else:
            row.check(status == 0, f"{where}: exited {status} without being killed")

        # Right after the kill: the drop-in is whole, the old one or the new one.
        text = dropin_text(box)
        if text is not None:
            parsed = parse_dropin(text)
            if not row.check(not parsed.foreign_edit, f"{where}: the drop-in reads as foreign"):
                row.lost += 1
            else:
                argv = dropin_argv(text)
                if kind == "apply" and argv != old_argv:
                    intended = argv
                row.check(
                    argv == old_argv or kind == "apply",
                    f"{where}: a restart changed the drop-in",
                )
        after_kill = {a.id: a for a in actions(box, STATE_DIR)}
        row.lost += sum(1 for i, a in before.items() if i not in after_kill)
        opened = [a for a in after_kill.values() if a.open]
        row.check(len(opened) <= 1, f"{where}: {len(opened)} open actions")
        if step is not None:
            mode = f"KILL_AT={step}"
        elif not killed:
            mode = "delay: finished first"
        elif opened and opened[0].last_step is not None:
            last = opened[0].last_step
            mode = f"delay: in {last.step} ({last.state})"
        else:
            mode = "delay: before its action began"
        self.modes[mode] = self.modes.get(mode, 0) + 1
        if step is not None and killed:
            row.check(
                len(opened) == 1
                and opened[0].last_step is not None
                and (opened[0].last_step.step, opened[0].last_step.state) == (step, "begin"),
                f"{where}: the ledger does not show the step it died in",
            )

        # The next run recovers.
        done = vkvagent(box, "apply", "--now", config=CONFIG)
        if not row.check(
            done.returncode == 0,
            f"{where}: the next run exited {done.returncode}: {done.stderr.strip()[-300:]}",
        ):
            self.close()
            return
        history = actions(box, STATE_DIR)
        by_id = {a.id: a for a in history}
        for i, old in before.items():
            if i not in by_id or not _same(old, by_id[i]):
                row.lost += 1
                row.fail(f"{where}: action {i} lost or changed by the trial")
        new = [a for a in history if a.id not in before]
        row.check(not any(a.open for a in history), f"{where}: an action is still open")
        problem = ledger_ok(box)
        if problem is not None:
            row.lost += 1
            row.fail(f"{where}: ledger integrity: {problem}")
        if step is not None and killed and opened:
            first = by_id.get(opened[0].id)
            expected = RECOVERED[kind][step]
            row.check(
                first is not None and first.outcome == expected,
                f"{where}: recovered as {first.outcome if first else None}, not {expected}",
            )
        for action in new:
            row.check(
                restarts_requested(action) <= 1,
                f"{where}: action {action.id} requested {restarts_requested(action)} restarts",
            )
        done_actions = sum(1 for a in new if a.outcome == "done")
        made = starts(box) - started
        row.check(
            made == done_actions,
            f"{where}: systemd started vLLM {made} times for {done_actions} completed actions "
            f"({[(a.kind, a.outcome) for a in new]})",
        )
        if kind == "apply":
            row.check(made == 1, f"{where}: a flag change restarted vLLM {made} times")

        # The end state: active, running what the drop-in says; nothing left half-written.
        try:
            running = running_argv(box)
        except AssertionError as exc:
            row.fail(f"{where}: vllm.service not running after recovery: {exc}")
            self.close()
            return
        text = dropin_text(box)
        in_file = dropin_argv(text) if text else tuple(sim_argv())
        row.check(running == in_file, f"{where}: running {running} != drop-in {in_file}")
        if intended is not None:
            row.check(running == intended, f"{where}: the new flags are not in effect")
        leftovers = list((box.root / DROPIN).parent.glob(".*.tmp"))
        row.check(not leftovers, f"{where}: temporary files left: {leftovers}")
        if kind == "apply":
            self.flags = wanted
        state = unit(box)
        row.check(state.active_state == "active", f"{where}: vllm.service {state.active_state}")


def run(count: int, seed: int) -> Row:
    row = Row("kill -9 during restart/apply (sandbox)", faults=0)
    started = time.monotonic()
    need_sandbox()
    trials = Trials(row, random.Random(seed))
    try:
        for number in range(count):
            row.trials += 1
            try:
                trials.trial(number)
            except Exception as exc:  # a trial that could not even be checked
                row.fail(f"trial {number}: {type(exc).__name__}: {exc}")
                trials.close()
    finally:
        trials.close()
    row.seconds = time.monotonic() - started
    row.notes.append(
        f"seed {seed}; by mode: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(trials.modes.items()))
        + f"; {row.seconds:.0f} s"
    )
    return row
