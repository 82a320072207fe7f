"""The fault classes of ``make reliability`` (reliability/kill.py, reliability/faults.py), a
few trials each: kill -9 during restarts and flag changes, vLLM crash-looping, access denied,
the state directory full (all against a real systemd), wall-clock jumps and a /metrics that
hangs, trickles or is huge (in this process)."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from reliability import faults, kill, probe
from reliability.report import Row
from tests.sandbox import require
from vkvagent.actuation.actuator import Actuator, ActuatorError
from vkvagent.adapters.ledger import Ledger
from vkvagent.adapters.systemd import ExecCommand, Systemd, UnitState
from vkvagent.adapters.vllm import VllmClient
from vkvagent.knowledge.dropin import DropinFile
from vkvagent.tools.cli import main


def clean(row: Row) -> None:
    assert not row.failures, "\n".join(row.failures)
    assert row.lost == 0


@pytest.mark.systemd
def test_kill_9_at_random_points_never_loses_or_doubles_anything() -> None:
    require()
    row = kill.run(4, seed=int(time.time()))
    clean(row)
    assert row.trials == 4


@pytest.mark.systemd
def test_a_crash_looping_vllm_gets_no_restart_from_vkvagent() -> None:
    require()
    row = Row("crash loop")
    faults.crash_loop(row, seconds=60)  # a bound: it goes on once vLLM crashed 5 times
    clean(row)
    assert (row.faults or 0) >= 3


@pytest.mark.systemd
def test_access_denied_is_refused_cleanly_and_not_counted_as_starts() -> None:
    require()
    row = Row("access denied")
    faults.access_denied(row)
    clean(row)


@pytest.mark.systemd
def test_a_full_state_directory_is_survived_and_recovered_from() -> None:
    require()
    row = Row("state full")
    faults.state_full(row)
    clean(row)
    assert row.trials == 2


def test_wall_clock_jumps_cause_no_restart() -> None:
    row = Row("clock")
    faults.clock_jumps(row, seed=int(time.time()), jumps=4)
    clean(row)
    assert row.trials == 4


def test_metrics_that_hang_trickle_or_swell_fail_within_their_limits() -> None:
    row = Row("metrics")
    faults.metrics_endpoint(row, seed=int(time.time()), trials=len(faults.KINDS))
    clean(row)


@pytest.mark.parametrize("kind", ["hung", "slow", "dead"])
def test_the_probe_against_a_hung_slow_or_dead_server_ends_in_time(kind: str) -> None:
    row = Row(f"probe: {kind} server")
    getattr(probe, kind)(row, trials=3, seed=int(time.time()))
    clean(row)
    assert row.trials >= 3


def test_refused_restart_jobs_do_not_count_against_the_start_limit(tmp_path: Path) -> None:
    """A restart systemd refused (access denied) ends "aborted" and never started vLLM: the
    start-limit estimate counted it all the same, so after StartLimitBurst refusals the agent
    blamed the start limit instead of the real problem."""
    unused_bus = Systemd("unix:path=/nonexistent")  # never called here
    now = 1_800_000_000.0
    with Ledger(tmp_path) as ledger:
        for second in range(6):  # six refused attempts in the last 10 s
            action = ledger.begin("restart", "stall: test", now - 9 + second, {})
            ledger.step(action, "restart", "begin", now - 9 + second)
            ledger.step(action, "restart", "failed", now - 9 + second, "access denied")
            ledger.end(action, "aborted", now - 9 + second)
        actuator = Actuator(
            unit="vllm.service", systemd=unused_bus, ledger=ledger,
            dropin=DropinFile("vllm.service", tmp_path / "units", tmp_path / "kept"),
            probe=VllmClient("http://127.0.0.1:9"), state_dir=tmp_path, wall=lambda: now,
        )  # fmt: skip
        state = UnitState(
            name="vllm.service", load_state="loaded", active_state="active",
            sub_state="running", result="success", main_pid=1, invocation_id="ab" * 16,
            exec_main_start_timestamp=int((now - 3600) * 1e6), n_restarts=0,
            memory_current=None, exec_start=(ExecCommand("/bin/true", ("/bin/true",), False),),
            fragment_path="", drop_in_paths=(), start_limit_burst=5,
            start_limit_interval_usec=10_000_000,
        )  # fmt: skip
        actuator._check_start_limit(state, 1)  # no ActuatorError: nothing was started
        done = ledger.begin("restart", "stall: test", now - 2, {})
        ledger.step(done, "restart", "begin", now - 2)
        ledger.step(done, "restart", "done", now - 1)
        ledger.end(done, "done", now - 1)
        actuator._check_start_limit(state, 1)  # one real start and the next: 2 of 5
        for second in range(3):
            at = now - 1 + second / 10
            real = ledger.begin("restart", "stall: test", at, {})
            ledger.step(real, "restart", "begin", at)
            ledger.step(real, "restart", "done", at)
            ledger.end(real, "done", at)
        with pytest.raises(ActuatorError, match="StartLimitBurst=5"):
            actuator._check_start_limit(state, 1)  # real ones still count


def test_a_state_directory_the_daemon_cannot_use_is_named_not_an_internal_error(
    tmp_path: Path,
) -> None:
    """On a full disk (or a damaged history) `vkvagent run` stops at once; it said
    "internal error: HistoryError: ..." as for a bug, and systemd's Restart= starts it again."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "history.sqlite3").write_text("not a database\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[agent]\nstate_dir = "{state}"\n[gpu]\nenabled = false\n[metrics]\nlisten = ""\n'
    )
    cfg.chmod(0o600)
    out, err = io.StringIO(), io.StringIO()
    assert main(["run", "--config", str(cfg)], out, err) == 1
    assert err.getvalue() == (
        f"vkvagent: {state / 'history.sqlite3'}: cannot open: file is not a database\n"
    )
