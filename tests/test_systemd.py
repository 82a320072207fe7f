"""vkvagent.adapters.systemd against a real systemd 252 booted in systemd-nspawn (tests/sandbox.py),
with the simulator running as vllm.service. No D-Bus mocks: every answer comes from systemd.

Tests that restart, edit or stop get a freshly booted container each (``sandbox``); tests
that only read share one per module (``shared_sandbox``)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.sandbox import (
    MODEL,
    PROJECT,
    Sandbox,
    exec_line,
    reach_python,
    require,
    sandbox_fixture,  # noqa: F401 - the `sandbox` fixture
    shared_sandbox_fixture,  # noqa: F401 - the `shared_sandbox` fixture
    sim_argv,
)
from vkvagent.actuation.restarted import wait_ready
from vkvagent.adapters.systemd import (
    ACCESS_DENIED,
    NO_SUCH_UNIT,
    TIMEOUT,
    UNAVAILABLE,
    ExecCommand,
    Systemd,
    SystemdError,
    UnitState,
)
from vkvagent.adapters.vllm import ScrapeError
from vkvagent.engine.samples import VllmMetrics
from vkvagent.knowledge.vllm_metrics import Normaliser

pytestmark = pytest.mark.systemd
VLLM = "vllm.service"


@pytest.fixture
def systemd(sandbox: Sandbox) -> Iterator[Systemd]:
    with Systemd(sandbox.bus_address, timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def shared_systemd(shared_sandbox: Sandbox) -> Iterator[Systemd]:
    with Systemd(shared_sandbox.bus_address, timeout=10) as client:
        yield client


def wait_for(systemd: Systemd, unit: str, active_state: str, timeout: float = 10) -> UnitState:
    deadline = time.monotonic() + timeout
    while True:
        state = systemd.unit(unit)
        if state.active_state == active_state or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def one_line(error: SystemdError) -> str:
    message = str(error)
    assert "\n" not in message and message == message.strip()
    return message


# -- reading -----------------------------------------------------------------------------------


def test_the_running_sim_unit_reads_back_as_systemd_runs_it(
    shared_sandbox: Sandbox, shared_systemd: Systemd
) -> None:
    state = shared_systemd.unit(VLLM)
    assert (state.load_state, state.active_state, state.sub_state) == (
        "loaded",
        "active",
        "running",
    )
    assert state.result == "success"
    assert state.exec_start == (ExecCommand(sys.executable, tuple(sim_argv()), False),)
    assert state.exec_start[0].argv[5:7] == (MODEL, "--host")
    assert state.fragment_path == "/etc/systemd/system/vllm.service"
    assert state.drop_in_paths == ()
    assert (state.start_limit_burst, state.start_limit_interval_usec) == (5, 10_000_000)
    assert state.n_restarts == 0
    assert len(state.invocation_id) == 32 and int(state.invocation_id, 16) > 0
    assert 0 < time.time() - state.exec_main_start_timestamp / 1e6 < 600
    # MainPID is the simulator's PID in the container's PID namespace, with the unit's argv.
    cmdline = (shared_sandbox.root / f"proc/{state.main_pid}/cmdline").read_bytes()
    assert cmdline.split(b"\0")[:-1] == [arg.encode() for arg in sim_argv()]
    # systemd's journal has the service's own output.
    assert any("Application startup complete." in m for m in shared_sandbox.messages(VLLM))


def test_memory_current_is_the_running_sims_memory(shared_systemd: Systemd) -> None:
    state = shared_systemd.unit(VLLM)
    assert state.memory_current is not None
    assert 5 * 2**20 < state.memory_current < 1 * 2**30  # a Python HTTP server: tens of MiB


def test_memory_max_is_the_units_limit_and_none_when_unlimited(
    shared_sandbox: Sandbox, shared_systemd: Systemd
) -> None:
    """MemoryMax, what a leak is timed against: unset is systemd's infinity, read as None."""
    assert shared_systemd.unit(VLLM).memory_max is None
    shared_sandbox.run("systemctl", "set-property", "--runtime", VLLM, "MemoryMax=3G")
    try:
        assert shared_systemd.unit(VLLM).memory_max == 3 * 2**30
    finally:
        shared_sandbox.run("systemctl", "set-property", "--runtime", VLLM, "MemoryMax=infinity")
    assert shared_systemd.unit(VLLM).memory_max is None


def test_the_units_control_group_and_its_anon_memory_in_the_containers_cgroup_fs(
    shared_sandbox: Sandbox, shared_systemd: Systemd
) -> None:
    """ControlGroup is the cgroup vLLM's process runs in, and its memory.stat is read through
    the container's own /sys/fs/cgroup. The sandbox's hosts have hybrid cgroups: memory is
    accounted by the v1 controller, so there is no cgroup v2 memory.stat, anon is None and
    growth falls back to MemoryCurrent; the v1 memory.stat is there, without an anon line."""
    from vkvagent.adapters.cgroup import read_anon
    from vkvagent.adapters.sampler import unit_facts

    state = shared_systemd.unit(VLLM)
    assert state.control_group == "/system.slice/vllm.service"
    found = shared_sandbox.run("cat", f"/proc/{state.main_pid}/cgroup").stdout.splitlines()
    assert f"0::{state.control_group}" in found  # the unified hierarchy, as the kernel says
    root = shared_sandbox.root / "sys/fs/cgroup"
    parts = state.control_group.strip("/").split("/")
    anon = read_anon(state.control_group, root)
    facts = unit_facts(state, root)
    if root.joinpath(*parts, "memory.stat").is_file():  # cgroup v2 with its memory controller
        assert state.memory_current is not None and anon is not None
        assert 2**20 < anon <= state.memory_current
        assert (facts.growth_bytes, facts.growth_source) == (anon, "anon")
    else:
        assert anon is None
        v1 = root / "memory"
        assert "total_rss " in v1.joinpath(*parts, "memory.stat").read_text()
        assert read_anon(state.control_group, v1) is None
        assert (facts.growth_bytes, facts.growth_source) == (state.memory_current, "MemoryCurrent")


def test_a_unit_that_never_ran_reads_as_inactive(shared_systemd: Systemd) -> None:
    state = shared_systemd.unit("systemd-timesyncd.service")  # masked in the sandbox
    assert (state.load_state, state.active_state) == ("masked", "inactive")
    assert (state.main_pid, state.invocation_id, state.memory_current) == (0, "", None)
    assert (state.exec_main_start_timestamp, state.control_group) == (0, "")
    state = shared_systemd.unit("systemd-tmpfiles-clean.service")  # loaded, run by a timer
    assert (state.load_state, state.active_state) == ("loaded", "inactive")
    assert state.exec_start and state.exec_start[0].path.endswith("systemd-tmpfiles")


# Read inside the container, where the unit's EnvironmentFile= is.
KEYS = """
import json, sys
from vkvagent.adapters.systemd import Systemd
with Systemd() as bus:
    states = [bus.unit(name) for name in sys.argv[1:]]
print(json.dumps([[s.exec_start[0].argv, s.api_key and [s.api_key.value, s.api_key.source],
                   repr(s)] for s in states]))
"""


def test_vllms_api_key_is_read_from_the_unit_and_masked_in_its_command_line(
    shared_sandbox: Sandbox,
) -> None:
    """Each place a unit gives vLLM its key, as systemd 252 reports it over D-Bus (never
    started: LoadUnit reads the file)."""
    (shared_sandbox.root / "etc/vllm.env").write_text("# vLLM\nVLLM_API_KEY='sk-from-file'\n")
    units = {
        "keyed-argv.service": "ExecStart=/bin/sleep --api-key sk-on-argv 1\n",
        "keyed-env.service": 'ExecStart=/bin/sleep 1\nEnvironment="VLLM_API_KEY=sk-in-env"\n',
        "keyed-file.service": "ExecStart=/bin/sleep 1\nEnvironmentFile=-/etc/vllm.env\n",
        "unkeyed.service": "ExecStart=/bin/sleep 1\nEnvironmentFile=-/etc/none.env\n",
    }
    for name, service in units.items():
        shared_sandbox.write_unit(name, f"[Service]\n{service}")
    shared_sandbox.run("systemctl", "daemon-reload")
    done = shared_sandbox.run(sys.executable, "-c", KEYS, *units, timeout=60)
    argv, keys, shown = zip(*json.loads(done.stdout))
    # argparse's nargs="+" takes the "1" as a second key: masked too.
    assert argv[0] == ["/bin/sleep", "--api-key", "<redacted>", "<redacted>"]
    assert argv[1] == ["/bin/sleep", "1"]
    assert list(keys) == [
        ["sk-on-argv", "the unit's --api-key"],
        ["sk-in-env", "the unit's Environment=VLLM_API_KEY"],
        ["sk-from-file", "VLLM_API_KEY in EnvironmentFile=/etc/vllm.env"],
        None,
    ]
    assert not any("sk-" in text for text in shown)


# -- restarting --------------------------------------------------------------------------------


def test_restart_waits_for_the_job_and_a_new_sim_process_serves_metrics(
    sandbox: Sandbox, systemd: Systemd
) -> None:
    before = systemd.unit(VLLM)
    assert systemd.restart(VLLM, timeout=30) == "done"
    after = systemd.unit(VLLM)
    assert after.active_state == "active"
    assert after.invocation_id != before.invocation_id
    assert after.main_pid not in (0, before.main_pid)
    assert after.exec_main_start_timestamp > before.exec_main_start_timestamp
    assert after.n_restarts == 0  # NRestarts counts Restart= restarts only, not ours
    # "done" means forked (Type=simple), not loaded: the port opens after the cold start.
    sandbox.wait_http(path="/health", timeout=15)
    status, page = sandbox.http_get(8000, "/metrics")
    assert status == 200 and b"vllm:num_requests_running" in page
    status, body = sandbox.http_get(8000, "/v1/models")
    assert json.loads(body)["data"][0]["id"] == MODEL
    started = [m for m in sandbox.messages(VLLM) if m.startswith("Started vllm.service")]
    assert len(started) == 2


def test_a_sim_that_rejects_its_flags_fails_after_a_done_job(
    sandbox: Sandbox, systemd: Systemd
) -> None:
    """Type=simple (as vLLM units are): the job ends "done" once the process is forked; the
    bad flag fails the unit a moment later, like vLLM's own argparse exit."""
    sandbox.write_unit(
        "vllm.service.d/50-flags.conf",
        f"[Service]\nExecStart=\nExecStart={exec_line(sim_argv('--no-such-flag'))}\n",
    )
    systemd.reload()
    assert systemd.restart(VLLM, timeout=30) == "done"
    state = wait_for(systemd, VLLM, "failed")
    assert (state.active_state, state.sub_state, state.result) == ("failed", "failed", "exit-code")
    assert state.main_pid == 0
    messages = sandbox.messages(VLLM)
    assert "vllm serve: error: unrecognized arguments: --no-such-flag" in messages
    assert "vllm.service: Main process exited, code=exited, status=2/INVALIDARGUMENT" in messages


def test_a_start_that_cannot_exec_ends_the_job_failed(sandbox: Sandbox, systemd: Systemd) -> None:
    """Type=exec waits for the exec: a missing executable fails the job itself."""
    sandbox.write_unit(
        "vllm.service.d/50-exec.conf",
        "[Service]\nType=exec\nExecStart=\nExecStart=/nonexistent/bin/vllm serve x\n",
    )
    systemd.reload()
    assert systemd.restart(VLLM, timeout=30) == "failed"
    state = systemd.unit(VLLM)
    assert (state.active_state, state.result) == ("failed", "exit-code")
    assert "vllm.service: Main process exited, code=exited, status=203/EXEC" in sandbox.messages(
        VLLM
    )


def test_the_start_limit_fails_the_sixth_start_until_reset_failed(
    sandbox: Sandbox, systemd: Systemd
) -> None:
    """Starts requested over D-Bus count against StartLimitBurst=5 per 10 s, boot's included:
    the 6th start's job ends "failed" and the unit "start-limit-hit", however it was asked.
    (Six restarts of the simulator take about 3.5 s. A reload would reset the counter, so the
    default interval is kept rather than widened.)"""
    results = [systemd.restart(VLLM, timeout=30) for _ in range(6)]
    assert results == ["done"] * 4 + ["failed"] * 2  # the boot's start was the 1st
    state = systemd.unit(VLLM)
    assert (state.active_state, state.result) == ("failed", "start-limit-hit")
    assert "vllm.service: Failed with result 'start-limit-hit'." in sandbox.messages(VLLM)
    systemd.reset_failed(VLLM)
    state = systemd.unit(VLLM)
    assert (state.active_state, state.sub_state, state.result) == ("inactive", "dead", "success")
    assert systemd.restart(VLLM, timeout=30) == "done"  # the counter went with the failure
    assert systemd.unit(VLLM).active_state == "active"


def test_a_restart_asked_for_while_restart_waits_keeps_nrestarts_and_the_new_run_is_ready(
    sandbox: Sandbox, systemd: Systemd
) -> None:
    """systemd clears NRestarts at a start only when the unit went down for good: a restart
    asked for while Restart= waits to start the unit again (a rollback after a broken flag)
    brings up a run that still counts 1. wait_ready counts from the new run's first reading,
    so that run, which serves, is ready, not "exited and Restart= is starting it again"."""
    script = f"test -e /run/fixed || {{ sleep 0.5; exit 1; }}; exec {exec_line(sim_argv())}"
    sandbox.write_unit(
        "vllm.service.d/50-broken.conf",
        "[Service]\nRestart=on-failure\nRestartSec=5\nExecStart=\n"
        f"ExecStart={exec_line(['/bin/sh', '-c', script])}\n",
    )
    systemd.reload()
    assert systemd.restart(VLLM, timeout=30) == "done"
    deadline = time.monotonic() + 20
    state = systemd.unit(VLLM)
    # The second failure: NRestarts and Result come from one read of the service's
    # properties (the unit's own, such as SubState, from another, a moment apart).
    while not (
        state.sub_state == "auto-restart" and (state.n_restarts, state.result) == (1, "exit-code")
    ):
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
        state = systemd.unit(VLLM)
    sandbox.run("touch", "/run/fixed")
    assert systemd.restart(VLLM, timeout=30) == "done"
    after = systemd.unit(VLLM)
    assert (after.active_state, after.result, after.n_restarts) == ("active", "success", 1)

    def scrape() -> VllmMetrics:
        try:
            return Normaliser().normalise(sandbox.http_get(8000, "/metrics")[1].decode())
        except OSError as exc:
            raise ScrapeError(str(exc)) from None

    metrics = wait_ready(
        VLLM, state.invocation_id, read_unit=lambda: systemd.unit(VLLM), scrape=scrape,
        timeout=20, poll_interval=0.2, clock=time.monotonic, sleep=time.sleep,
        progress=lambda _line: None,
    )  # fmt: skip
    assert metrics.models == (MODEL,)
    assert systemd.unit(VLLM).invocation_id == after.invocation_id


def test_no_start_limit_with_start_limit_interval_zero(sandbox: Sandbox, systemd: Systemd) -> None:
    sandbox.write_unit("vllm.service.d/50-limit.conf", "[Unit]\nStartLimitIntervalSec=0\n")
    systemd.reload()
    assert systemd.unit(VLLM).start_limit_interval_usec == 0
    assert [systemd.restart(VLLM, timeout=30) for _ in range(8)] == ["done"] * 8
    assert systemd.unit(VLLM).active_state == "active"


def test_restart_returns_systemds_job_timeout_and_raises_on_its_own(sandbox: Sandbox) -> None:
    """Two different timeouts: systemd's (the job ends "timeout", JobTimeoutSec=) is a result;
    ours (no JobRemoved within ``timeout``) raises, and the job goes on."""
    sandbox.write_unit(
        "job-timeout.service",
        "[Unit]\nJobTimeoutSec=0.3\n[Service]\nType=oneshot\nExecStart=/bin/sleep 30\n",
    )
    sandbox.write_unit("slow.service", "[Service]\nType=oneshot\nExecStart=/bin/sleep 30\n")
    with Systemd(sandbox.bus_address) as systemd:
        systemd.reload()
        assert systemd.restart("job-timeout.service", timeout=10) == "timeout"
        started = time.monotonic()
        with pytest.raises(SystemdError) as raised:
            systemd.restart("slow.service", timeout=0.3)
        assert 0.3 <= time.monotonic() - started < 2
        assert raised.value.reason == TIMEOUT
        assert one_line(raised.value).startswith(
            "restart slow.service: timed out: job /org/freedesktop/systemd1/job/"
        )
        assert systemd.unit("slow.service").active_state == "activating"
        assert systemd.unit(VLLM).active_state == "active"  # the connection is still usable


# -- drop-ins ----------------------------------------------------------------------------------


def test_a_drop_in_and_reload_change_execstart_argv_exactly(
    sandbox: Sandbox, systemd: Systemd
) -> None:
    """An argument with a space, double quotes and a percent sign survives unit-file quoting
    ("..." with \\" and %%), systemd's parser, D-Bus, and the process's own argv."""
    name = 'llama 8b "fast" 100%'
    path = sandbox.write_unit(
        "vllm.service.d/50-flags.conf",
        "[Service]\nExecStart=\n"
        f"ExecStart={sys.executable} -m vkvagent sim serve {MODEL} --host 127.0.0.1 --port 8000 "
        '--cold-start 2 --time-scale 30 --served-model-name "llama 8b \\"fast\\" 100%%"\n',
    )
    assert systemd.unit(VLLM).exec_start[0].argv == tuple(sim_argv())  # not before a reload
    started = time.monotonic()
    systemd.reload()
    assert time.monotonic() - started < 5
    state = systemd.unit(VLLM)
    assert state.drop_in_paths == ("/etc/systemd/system/vllm.service.d/50-flags.conf",)
    assert state.exec_start[0].argv == (*sim_argv(), "--served-model-name", name)
    assert state.exec_start[0].argv == tuple(sim_argv("--served-model-name", name))
    assert path.read_text().count(exec_line(["--served-model-name", name])) == 1
    assert systemd.restart(VLLM, timeout=30) == "done"
    _status, body = sandbox.wait_http(path="/v1/models")
    assert json.loads(body)["data"][0]["id"] == name


def test_exec_line_quoting_round_trips_through_systemd() -> None:
    """What a drop-in writer must escape, checked against systemd and the process's argv.
    Over D-Bus, ExecStart shows "%" specifiers resolved but "$" references not yet: "$$"
    reads back as "$$" and becomes "$" only when systemd starts the process."""
    require()
    args = [
        "plain", "with space", 'double "quotes"', "single 'quotes'", "100%", "%n", "$HOME",
        "${X}", "back\\slash", "semi;colon", ";", "", "new\nline", "tab\tx", "ünïcødé",
    ]  # fmt: skip
    show = "import json, sys; print(json.dumps(sys.argv[1:]))"
    argv = [sys.executable, "-c", show, *args]
    unit = f"[Service]\nType=oneshot\nExecStart={exec_line(argv)}\n"
    with Sandbox(units={"argv.service": unit}, enable=[]) as box, Systemd(box.bus_address) as bus:
        over_dbus = bus.unit("argv.service").exec_start[0].argv
        assert over_dbus == tuple(arg.replace("$", "$$") for arg in argv)
        assert bus.restart("argv.service", timeout=30) == "done"
        printed = [m for m in box.messages("argv.service") if m.startswith("[")]
        assert json.loads(printed[-1]) == args


# -- errors ------------------------------------------------------------------------------------


def test_no_such_unit(shared_systemd: Systemd) -> None:
    cases: dict[Callable[[], object], str] = {
        lambda: shared_systemd.unit("no-such.service"):
            "read no-such.service: no such unit: Unit no-such.service not found.",
        lambda: shared_systemd.restart("no-such.service", timeout=5):
            "restart no-such.service: no such unit: Unit no-such.service not found.",
        lambda: shared_systemd.reset_failed("no-such.service"):
            "reset-failed no-such.service: no such unit: Unit no-such.service not loaded.",
    }  # fmt: skip
    for call, message in cases.items():
        with pytest.raises(SystemdError) as raised:
            call()
        assert one_line(raised.value) == message
        assert raised.value.reason == NO_SUCH_UNIT
        assert raised.value.unit == "no-such.service"
    with pytest.raises(SystemdError) as raised:
        shared_systemd.unit("bad name")
    assert one_line(raised.value) == (
        "read bad name: org.freedesktop.DBus.Error.InvalidArgs: Unit name bad name is not valid."
    )


def test_bus_unavailable(tmp_path: Path) -> None:
    require()  # no sandbox needed, but the marker's contract: run where the others run
    refusing = tmp_path / "bus"
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(refusing))  # a socket file nobody accepts on: ECONNREFUSED
    cases = {
        "unix:path=/nonexistent/system_bus_socket": "[Errno 2] No such file or directory",
        f"unix:path={refusing}": "[Errno 111] Connection refused",
        "tcp:host=127.0.0.1,port=1": "not supported",
    }
    for address, detail in cases.items():
        systemd = Systemd(address)
        with pytest.raises(SystemdError) as raised:
            systemd.restart(VLLM)
        message = one_line(raised.value)
        assert message.startswith(f"restart vllm.service: bus unavailable: {address}: ")
        assert detail in message
        assert raised.value.reason == UNAVAILABLE
        with pytest.raises(SystemdError, match=r"^connect: bus unavailable: "):
            systemd.connect()


def test_the_bus_going_away_mid_session(sandbox: Sandbox, systemd: Systemd) -> None:
    assert systemd.unit(VLLM).active_state == "active"
    address = sandbox.bus_address
    sandbox.stop()
    with pytest.raises(SystemdError) as raised:
        systemd.unit(VLLM)
    assert raised.value.reason == UNAVAILABLE
    assert one_line(raised.value).startswith(
        "read vllm.service: bus unavailable: connection lost: "
    )
    with pytest.raises(SystemdError) as raised:  # then it tries to connect again
        systemd.unit(VLLM)
    assert one_line(raised.value) == (
        f"read vllm.service: bus unavailable: {address}: [Errno 2] No such file or directory"
    )


UNPRIVILEGED = """
from vkvagent.adapters.systemd import Systemd, SystemdError
systemd = Systemd()  # the container's own system bus, as the agent would use it
print(systemd.unit("vllm.service").active_state)
for call in (lambda: systemd.restart("vllm.service"), systemd.reload,
             lambda: systemd.reset_failed("vllm.service")):
    try:
        call()
        print("allowed")
    except SystemdError as error:
        print(error.reason, error.dbus_error, error, sep="|")
"""
POLKIT = "/usr/share/dbus-1/system-services/org.freedesktop.PolicyKit1.service"


def test_access_denied_to_an_unprivileged_caller(sandbox: Sandbox, systemd: Systemd) -> None:
    """As uid 65534 inside the container: reading is allowed, acting is not. systemd asks
    polkit when it is installed (no agent can ask for a password: "interactive authorization
    required"), and refuses outright when it is not (AccessDenied). Both are "access denied"."""
    reach_python(sandbox)

    def as_nobody() -> list[list[str]]:
        done = sandbox.run(sys.executable, "-c", UNPRIVILEGED, user=65534, check=False)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "active"
        return [line.split("|") for line in lines[1:]]

    operations = ("restart vllm.service", "reload", "reset-failed vllm.service")
    with_polkit = "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired"
    if (sandbox.root / POLKIT.lstrip("/")).exists():
        for (reason, name, message), operation in zip(as_nobody(), operations):
            assert (reason, name) == (ACCESS_DENIED, with_polkit)
            assert message == f"{operation}: access denied: Interactive authentication required."
        sandbox.run("systemctl", "stop", "polkit.service")
        sandbox.run("rm", POLKIT)
        sandbox.run("busctl", "call", "org.freedesktop.DBus", "/org/freedesktop/DBus",
                    "org.freedesktop.DBus", "ReloadConfig")  # fmt: skip
    for (reason, name, message), operation in zip(as_nobody(), operations):
        assert (reason, name) == (ACCESS_DENIED, "org.freedesktop.DBus.Error.AccessDenied")
        assert message == f"{operation}: access denied: Permission denied"
    state = systemd.unit(VLLM)  # nothing happened to the unit
    assert (state.active_state, state.n_restarts) == ("active", 0)
    assert os.geteuid() == 0  # and root, on the same bus, may
    assert systemd.restart(VLLM, timeout=30) == "done"


def test_samples_carry_the_units_state_from_the_real_systemd(shared_systemd: Systemd) -> None:
    """What the daemon records each tick: InvocationID (restart detection) and the unit's
    memory, read over D-Bus with the sample."""
    from vkvagent.adapters.sampler import Sampler
    from vkvagent.adapters.vllm import VllmClient

    sampler = Sampler(VllmClient("http://127.0.0.1:9"), unit=lambda: shared_systemd.unit(VLLM))
    sample = sampler.take()
    assert sample.unit is not None and sample.unit_error is None
    assert sample.unit.active_state == "active" and len(sample.unit.invocation_id) == 32
    assert sample.unit.memory_bytes is not None and sample.unit.memory_bytes > 5 * 2**20
    assert sample.unit.main_pid == shared_systemd.unit(VLLM).main_pid


def test_the_units_own_output_is_read_back_from_the_real_journal(sandbox: Sandbox) -> None:
    """vkvagent.adapters.unitlog reads journald through libsystemd inside the container: only the
    unit's own lines, only those since the moment asked for and not of the invocation it is
    told to skip, in order."""
    script = "echo before; sleep 1.2; echo one; echo 'ValueError: two'; echo three"
    sandbox.write_unit(
        "talker.service", f"[Service]\nType=oneshot\nExecStart=/bin/sh -c {json.dumps(script)}\n"
    )
    sandbox.run("systemctl", "daemon-reload")
    for _run in range(2):
        sandbox.run("systemctl", "start", "talker.service", timeout=30)
    befores = [e for e in sandbox.journal("talker.service") if e.get("MESSAGE") == "before"]
    first, second = (entry["_SYSTEMD_INVOCATION_ID"] for entry in befores)
    since = int(befores[0]["__REALTIME_TIMESTAMP"]) / 1e6 + 0.6  # after the first "before"
    read = (
        "import sys, json; from vkvagent.adapters import unitlog; since = float(sys.argv[1]); "
        "print(json.dumps([unitlog.read('talker.service', since), "
        "unitlog.read('talker.service', since, skip=sys.argv[2]), "
        "unitlog.why_it_failed('talker.service', since, sys.argv[2]), "
        "unitlog.read('vllm.service', since)]))"
    )
    done = sandbox.run(
        sys.executable, "-c", read, str(since), first, env={"PYTHONPATH": str(PROJECT)}
    )
    every, past_first, reason, other = json.loads(done.stdout)
    lines = ["one", "ValueError: two", "three"]
    assert every == [*lines, "before", *lines]
    assert past_first == ["before", *lines] and first != second
    assert reason == "ValueError: two"
    assert all(line not in other for line in lines)  # another unit's lines are not its


def test_a_reload_waits_for_systemd_longer_than_other_calls(sandbox: Sandbox) -> None:
    """A reload runs every generator and re-reads every unit; systemctl waits 180 s for it.
    With a generator that takes 2 s, a client whose calls wait 1 s still sees it through; and
    a call that waits no longer than its own bound still times out."""
    generator = sandbox.root / "etc/systemd/system-generators/slow-generator"
    generator.parent.mkdir(parents=True, exist_ok=True)
    generator.write_text("#!/bin/sh\nsleep 2\n")
    generator.chmod(0o755)
    with Systemd(sandbox.bus_address, timeout=1) as impatient:
        began = time.monotonic()
        impatient.reload()
        assert time.monotonic() - began >= 2
        with pytest.raises(SystemdError) as raised:
            impatient.reload(timeout=0.5)
        assert raised.value.reason == TIMEOUT
