"""The daemon keeps vLLM's flags as [vllm.flags] says (vkvagent/knowledge/reconcile.py), in a real
systemd 252 (tests/sandbox.py) with the simulator as vllm.service: a change waits for its
window, rides on a diagnosed restart, is judged by the fresh speed of the run it starts and
rolled back when slower; `manual` applies nothing. Each test boots its own container."""

from __future__ import annotations

import json
import shutil
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from tests.sandbox import PROJECT, Sandbox, sim_unit
from tests.test_actuator import actions, running_argv
from tests.test_daemon_systemd import (
    AGENT,
    CONFIG,
    CONFIG_DIR,
    boot,
    events,
    log,
    wait_event,
    write_config,
)

pytestmark = pytest.mark.systemd

# Demand the simulator's default batch serves with no queue (17 running on average), and a
# --max-num-seqs that makes it queue at the same load: waiting grows by tens of requests in
# seconds while generated tokens/s stays in the same load bucket (25.5k against 26.5k).
RATE = ("--rate", "4")
SLOW_SEQS = 20
# Baselines learned in seconds: 10 s windows, one value a second, known after 3.
FAST_BASELINE = """\
[baseline]
window = 10
warmup = 0
learn_for = 60
value_interval = 1
min_values = 3
"""


# The container's own etcd, off its default ports (the host's etcd.service may use them).
ETCD, PEER = "http://127.0.0.1:2479", "http://127.0.0.1:2480"


def fleet(name: str) -> str:
    """[fleet]: the container's etcd, one group, this host's ``name``."""
    return f'[fleet]\nendpoints = ["{ETCD}"]\ngroup = "replicas"\nname = "{name}"\n'


def config(policy: str = "", vllm: str = "", flags: str = "", baseline: str = "") -> str:
    """The daemon's test config (CONFIG's [policy] last) with extra keys per table."""
    text = CONFIG.format(read_timeout=5.0).replace("min_interval = 3600\n", "")
    text = text.replace("read_timeout = 5.0\n", f"read_timeout = 5.0\n{vllm}", 1)
    text = text + policy
    if flags:
        text += f"[vllm.flags]\n{flags}"
    return text + baseline


def status(box: Sandbox) -> dict[str, Any]:
    done = box.run(
        sys.executable, "-m", "vkvagent", "status", "--json", "--config", CONFIG_DIR,
        check=False,
    )  # fmt: skip
    shown: dict[str, Any] = json.loads(done.stdout)
    return shown


def wait_status(box: Sandbox, test: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    shown: dict[str, Any] = {}
    while time.monotonic() < deadline:
        shown = status(box)
        if test(shown):
            return shown
        time.sleep(0.5)
    raise AssertionError(f"status never matched: {json.dumps(shown)[:1500]}\n{log(box)}")


def next_minute(at_least: float) -> tuple[datetime, str]:
    """The start of the first UTC minute at least ``at_least`` seconds away, and a window of
    ten minutes from it."""
    start = (datetime.now(timezone.utc) + timedelta(seconds=at_least + 60)).replace(
        second=0, microsecond=0
    )
    end = start + timedelta(minutes=10)
    return start, f"daily {start:%H:%M}-{end:%H:%M}"


def max_num_seqs(box: Sandbox) -> str | None:
    argv = running_argv(box)
    return argv[argv.index("--max-num-seqs") + 1] if "--max-num-seqs" in argv else None


def test_manual_applies_nothing_and_next_window_waits_for_the_window() -> None:
    with boot({"vllm.service": sim_unit(*RATE)}) as box:
        # manual: pending, shown, never applied, however open the window.
        write_config(
            box,
            config(
                policy='windows = ["daily 00:00-24:00"]\ncooldown = 0\nmin_interval = 0\n',
                vllm='apply_flags = "manual"\n',
                flags="max-num-seqs = 64\n",
            ),
        )
        box.run("systemctl", "start", AGENT)
        pending = wait_event(box, "flags.pending", timeout=30)
        assert pending["VKV_APPLY"] == "manual" and pending["VKV_KIND"] == "apply"
        shown = wait_status(box, lambda s: s.get("flags") and s["flags"]["pending"], 30)
        assert shown["flags"]["pending"] == {"max-num-seqs": 64}
        assert shown["flags"]["running"] == {"max-num-seqs": None}
        assert shown["flags"]["waiting_for"].startswith("`vkvagent apply`")
        time.sleep(10)  # ten ticks in an open window
        assert not events(box, "restart.started"), log(box)
        assert max_num_seqs(box) is None

        # observe: says it would, now, and does not.
        write_config(
            box,
            config(
                policy='mode = "observe"\nwindows = ["daily 00:00-24:00"]\n',
                flags="max-num-seqs = 64\n",
            ).replace('mode = "enforce"\n', ""),
        )
        box.run("systemctl", "reload", AGENT)
        wait_event(box, "agent.reloaded", timeout=15)
        shown = wait_status(box, lambda s: s["verdict"]["cause"] == "flags", 15)
        assert shown["verdict"]["reason"] == (
            "observe mode: would restart now (in window); flags: apply --max-num-seqs 64"
        )
        time.sleep(5)
        assert not events(box, "restart.started"), log(box)

        # next-window, with the window a minute or so away: nothing until it opens.
        opens, window = next_minute(at_least=20)
        write_config(
            box,
            config(
                policy=f'windows = ["{window}"]\ncooldown = 0\nmin_interval = 0\n',
                flags="max-num-seqs = 64\n",
            ),
        )
        box.run("systemctl", "reload", AGENT)
        wait_event(box, "agent.reloaded", timeout=15)
        shown = wait_status(box, lambda s: s["policy"]["mode"] == "enforce", 15)
        assert shown["flags"]["waiting_for"].startswith("outside window (next "), shown["flags"]
        assert shown["verdict"]["state"] == "healthy"  # a pending change is not degradation
        started = wait_event(box, "restart.started", timeout=150)
        at = datetime.fromtimestamp(int(started["__REALTIME_TIMESTAMP"]) / 1e6, timezone.utc)
        assert at >= opens, (at, opens)
        assert started["VKV_CAUSE"] == "flags"
        assert started["VKV_FLAGS"] == "apply --max-num-seqs 64"
        completed = wait_event(box, "restart.completed", timeout=60)
        assert completed["VKV_RESULT"] == "done" and completed["VKV_CAUSE"] == "flags"
        assert max_num_seqs(box) == "64"
        shown = wait_status(box, lambda s: not s["flags"]["pending"], 15)
        assert shown["flags"]["running"] == {"max-num-seqs": 64}
        assert shown["flags"]["last_change"]["flags"] == {"max-num-seqs": 64}
        box.run("systemctl", "stop", AGENT)
        found = actions(box)
        assert [(a.kind, a.outcome) for a in found] == [("apply", "done")]
        assert found[0].reason.startswith("flags: restart: in window; flags: apply")


def test_a_set_this_vllm_refuses_is_refused_once_and_never_tried() -> None:
    # --swap-space: gone from vLLM 0.11; the simulator says it is 0.32.
    with boot({"vllm.service": sim_unit(*RATE)}) as box:
        write_config(
            box,
            config(
                policy='windows = ["daily 00:00-24:00"]\ncooldown = 0\nmin_interval = 0\n',
                flags="swap-space = 4\n",
            ),
        )
        box.run("systemctl", "start", AGENT)
        refused = wait_event(box, "flags.refused", timeout=30)
        assert "--swap-space: not settable on vLLM 0.32.0" in refused["MESSAGE"]
        assert refused["PRIORITY"] == "3" and refused["VKV_FLAGS"] == "--swap-space 4"
        time.sleep(6)
        assert len(events(box, "flags.refused")) == 1 and not events(box, "restart.started")
        shown = status(box)["flags"]
        assert shown["problem"].startswith("invalid: --swap-space") and shown["due"] is None


def test_a_diagnosed_restart_carries_the_pending_flags_in_one_restart() -> None:
    # A stall, made a cause for the window (no emergency: an emergency's restart carries no
    # flags), with flags pending only "with the next restart".
    vllm = sim_unit("--scenario", "stall", "--scenario-onset", "600", *RATE)
    with boot({"vllm.service": vllm}) as box:
        write_config(
            box,
            config(
                policy='windows = ["daily 00:00-24:00"]\nemergency = []\n',
                vllm='apply_flags = "with-next-restart"\n',
                flags="max-num-seqs = 64\n",
            ),
        )
        box.run("systemctl", "start", AGENT)
        completed = wait_event(box, "restart.completed", timeout=90)
        assert completed["VKV_CAUSE"] == "stall"
        started = events(box, "restart.started")
        assert len(started) == 1 and started[0]["VKV_FLAGS"] == "apply --max-num-seqs 64"
        assert max_num_seqs(box) == "64"
        time.sleep(3)
        box.run("systemctl", "stop", AGENT)
        (action,) = actions(box)
        assert (action.kind, action.outcome) == ("apply", "done")
        assert action.reason.startswith("stall: restart: in window")
        assert action.reason.endswith("; flags: apply --max-num-seqs 64")
        assert action.detail["changes"] == {"max-num-seqs": 64}


def test_flags_that_make_vllm_slower_are_rolled_back_rejected_and_held_back_on_a_peer() -> None:
    """Host gpu-a tries a slower set, rolls it back and rejects it; gpu-b, another daemon
    of its fleet group (the same vLLM: the same server), holds the set back from its first
    tick. The real etcd runs in the container."""
    policy = 'windows = ["daily 00:00-24:00"]\ncooldown = 0\nmin_interval = 0\nmax_per_day = 10\n'
    with boot({"vllm.service": sim_unit(*RATE)}) as box:
        box.run(
            "systemd-run", "--unit=test-etcd", shutil.which("etcd") or "etcd", "--data-dir",
            "/var/lib/etcd-test", "--listen-client-urls", ETCD, "--advertise-client-urls", ETCD,
            "--listen-peer-urls", PEER, "--initial-advertise-peer-urls", PEER,
            "--initial-cluster", f"default={PEER}", "--log-level", "warn",
        )  # fmt: skip
        write_config(box, config(policy=policy, baseline=FAST_BASELINE) + fleet("gpu-a"))
        box.run("systemctl", "start", AGENT)
        # The first run learns its fresh speed, then the operator asks for a smaller batch.
        wait_status(box, lambda s: s["verdict"]["ratio"] is not None, 60)
        slow = config(policy=policy, flags=f"max-num-seqs = {SLOW_SEQS}\n", baseline=FAST_BASELINE)
        write_config(box, slow + fleet("gpu-a"))
        box.run("systemctl", "reload", AGENT)
        applied = wait_event(box, "restart.completed", timeout=60)
        assert applied["VKV_CAUSE"] == "flags"
        judged = wait_event(box, "flags.judged", timeout=90)
        assert judged["VKV_VERDICT"] == "worse", judged["MESSAGE"]
        assert float(judged["VKV_RATIO"]) < 0.9
        assert float(judged["VKV_SPEED_AFTER"]) < float(judged["VKV_SPEED_BEFORE"])
        assert judged["VKV_LOADS"]
        # The previous command line goes back at the next restart the policy allows.
        shown = wait_status(
            box, lambda s: (s["flags"]["last_change"] or {}).get("rollback") is not None, 90
        )
        change = shown["flags"]["last_change"]
        assert change["verdict"] == "worse" and change["rollback"].startswith("done"), change
        assert shown["flags"]["pending"] == {"max-num-seqs": SLOW_SEQS}
        assert shown["flags"]["problem"].startswith("rejected: slower: ")
        assert max_num_seqs(box) is None
        text = box.run(
            sys.executable, "-m", "vkvagent", "status", "--config", CONFIG_DIR, check=False
        ).stdout
        print(text)
        assert "  flags       rejected: slower: " in text
        assert f"  last change action 1 --max-num-seqs {SLOW_SEQS}: worse: 0." in text
        assert "; rolled back: done (action 2)" in text
        rollback = events(box, "restart.started")[-1]
        assert rollback["VKV_CAUSE"] == "flags" and rollback["VKV_FLAGS"].startswith("roll back")
        time.sleep(8)  # rejected: not applied again
        assert len(events(box, "restart.started")) == 2, log(box)
        # The loop's memory survives the agent's own restart: still rejected, not re-applied.
        box.run("systemctl", "restart", AGENT)
        time.sleep(6)
        assert len(events(box, "restart.started")) == 2, log(box)
        again = status(box)["flags"]
        assert again["last_change"] == change and again["problem"] == shown["flags"]["problem"]
        box.run("systemctl", "stop", AGENT)
        found = actions(box)
        assert [(a.kind, a.outcome) for a in found] == [("apply", "done"), ("apply", "done")]
        assert found[1].reason.startswith("flags: restart: in window; flags: roll back")

        # gpu-b, the same config: the set waits for the group, and vLLM is not restarted.
        box.run("systemctl", "start", AGENT)
        other = box.root / "etc/vkvagent-b/config.toml"  # its --config: /etc/vkvagent-b
        other.parent.mkdir(mode=0o755, parents=True)
        other.write_text(
            slow.replace("[agent]\n", '[agent]\nstate_dir = "/var/lib/vkvagent-b"\n', 1)
            + fleet("gpu-b") + '[metrics]\nlisten = "127.0.0.1:9850"\n'
        )  # fmt: skip
        other.chmod(0o644)
        box.run(
            "systemd-run", "--unit=vkvagent-b", f"--setenv=PYTHONPATH={PROJECT}",
            sys.executable, "-m", "vkvagent", "run", "--config", "/etc/vkvagent-b",
        )  # fmt: skip
        held = wait_event(box, "flags.held", timeout=60)
        assert (held["VKV_PEER"], held["VKV_TRIAL"]) == ("gpu-a", "rejected"), held
        assert held["MESSAGE"].startswith("[vllm.flags] held back: gpu-a rejected it: slower: ")
        shown_b = box.run(
            sys.executable, "-m", "vkvagent", "status", "--json", "--config", "/etc/vkvagent-b",
            check=False,
        )  # fmt: skip
        flags_b = json.loads(shown_b.stdout)["flags"]
        assert flags_b["pending"] == {"max-num-seqs": SLOW_SEQS} and flags_b["due"] is None
        assert flags_b["problem"].startswith("held back: gpu-a rejected it: slower: "), flags_b
        time.sleep(5)
        assert len(events(box, "restart.started")) == 2, "\n".join(
            box.messages("vkvagent-b.service")
        )
        assert len(events(box, "flags.held")) == 1  # once
