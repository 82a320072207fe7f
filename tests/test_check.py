"""`vkvagent status` as a monitoring plugin: run as a check by a real Nagios (Debian's
nagios4-core), which reads the exit code, the first line and the performance data; and the
conventions around it: the first line on stdout whatever fails, `--watch` in a pipe."""

from __future__ import annotations

import grp
import io
import json
import os
import pwd
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_daemon import write_config
from tests.test_status import GONE, SLO, full_report
from vkvagent.knowledge import status
from vkvagent.knowledge.status import SloStatus, SourceFailure, StatusReport, Verdict
from vkvagent.tools.cli import main

NAGIOS = "/usr/sbin/nagios4"
CHECK = f"{sys.executable} -m vkvagent status --config {{config}} -w 0.8: -c 0.6:"


def nagios() -> str:
    if not os.access(NAGIOS, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail("nagios4 is not installed (apt-get install nagios4-core; make deps does)")
        pytest.skip("needs nagios4 (Debian's nagios4-core package)")
    return NAGIOS


def written(report: StatusReport, state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    status.path(state_dir).write_text(json.dumps(report.to_json()))


# The operator's objectives, none burning: a healthy check stays OK, with their perfdata.
QUIET_OBJECTIVES = [{**o, "burning": None} for o in SLO["objectives"]]


def current(**changes: object) -> StatusReport:
    """A status written just now by a daemon that runs (this process)."""
    healthy = replace(
        full_report(),
        updated=time.time(),
        pid=os.getpid(),
        pid_namespace=status.pid_namespace(),
        verdict=Verdict(state="healthy", action="none", reason="healthy: speed 0.98", ratio=0.98),
        failing=(),
        stale_after=None,
        progress=None,
        slo=SloStatus.from_json({**SLO, "objectives": QUIET_OBJECTIVES}),
    )
    return replace(healthy, **changes)  # type: ignore[arg-type]


def services() -> dict[str, StatusReport | None]:
    """One service per state a check can be in: its status (None: none written)."""
    slow = Verdict(state="healthy", action="none", reason="healthy: speed 0.70", ratio=0.70)
    down = Verdict(state="critical", action="none", reason="/metrics unreachable",
                   cause="engine_down")  # fmt: skip
    blind = Verdict(state="impaired", action="none", reason="healthy: speed 0.98", ratio=0.98)
    cut_off = SourceFailure("systemd", "read vllm.service: bus unavailable", time.time() - 300)
    return {
        "none": None,
        "healthy": current(),
        "slow": current(verdict=slow),
        "impaired": current(verdict=blind, failing=(cut_off,)),
        "down": current(verdict=down),
        "stale": current(pid=GONE),
    }


NAGIOS_CFG = """\
log_file={d}/nagios.log
cfg_file={d}/objects.cfg
status_file={d}/status.dat
status_update_interval=1
check_result_path={d}/checkresults
lock_file={d}/nagios.lock
temp_file={d}/nagios.tmp
temp_path={d}
object_cache_file={d}/objects.cache
precached_object_file={d}/objects.precache
state_retention_file={d}/retention.dat
retain_state_information=0
nagios_user={user}
nagios_group={group}
check_external_commands=0
enable_notifications=0
interval_length=1
service_inter_check_delay_method=n
host_inter_check_delay_method=n
illegal_macro_output_chars=`~$&|'"<>
"""
OBJECTS = """\
define timeperiod {{
  timeperiod_name always
  alias always
{days}
}}
define command {{
  command_name ok
  command_line /bin/true
}}
define contact {{
  contact_name nobody
  host_notifications_enabled 0
  service_notifications_enabled 0
  host_notification_period always
  service_notification_period always
  host_notification_options n
  service_notification_options n
  host_notification_commands ok
  service_notification_commands ok
}}
define host {{
  host_name gpu1
  address 127.0.0.1
  check_command ok
  max_check_attempts 1
  check_period always
  contacts nobody
  notification_period always
}}
"""
SERVICE = """\
define command {{
  command_name check_{name}
  command_line {command}
}}
define service {{
  host_name gpu1
  service_description {name}
  check_command check_{name}
  max_check_attempts 1
  check_interval 60
  retry_interval 60
  check_period always
  contacts nobody
  notification_period always
}}
"""
DAYS = ("sunday", "monday", "tuesday", "wednesday", "thursday", "friday", "saturday")


def service_status(status_dat: Path) -> dict[str, dict[str, str]]:
    """Each checked service's fields in Nagios' status.dat."""
    found = {}
    text = status_dat.read_text(errors="replace") if status_dat.exists() else ""
    for block in re.findall(r"servicestatus \{\n(.*?)\n\s*\}", text, re.S):
        fields = dict(line.strip().split("=", 1) for line in block.splitlines() if "=" in line)
        if fields.get("has_been_checked") == "1":
            found[fields["service_description"]] = fields
    return found


def test_nagios_runs_it_as_a_check_in_every_state(tmp_path: Path) -> None:
    binary = nagios()
    work = tmp_path / "nagios"
    (work / "checkresults").mkdir(parents=True)
    objects = OBJECTS.format(days="\n".join(f"  {day} 00:00-24:00" for day in DAYS))
    for name, report in services().items():
        (tmp_path / name).mkdir()
        config = write_config(tmp_path / name, "http://127.0.0.1:9")
        if report is not None:
            written(report, tmp_path / name / "state")
        objects += SERVICE.format(name=name, command=CHECK.format(config=config))
    broken = tmp_path / "broken.toml"
    broken.write_text("[agent]\nsample_interval = -1\n")
    broken.chmod(0o644)
    objects += SERVICE.format(name="broken", command=CHECK.format(config=broken))
    (work / "objects.cfg").write_text(objects)
    user = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    (work / "nagios.cfg").write_text(NAGIOS_CFG.format(d=work, user=user, group=group))

    process = subprocess.Popen(
        [binary, str(work / "nagios.cfg")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline, checked = time.monotonic() + 30, {}
        while len(checked) < 7 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
            checked = service_status(work / "status.dat")  # removed when nagios stops
    finally:
        process.terminate()
        output = process.communicate(timeout=10)[0]
    assert len(checked) == 7, f"{output}\n{(work / 'nagios.log').read_text()}"

    def seen(name: str) -> tuple[int, str, str]:
        fields = checked[name]
        return int(fields["current_state"]), fields["plugin_output"], fields["performance_data"]

    perf = (
        "kv_usage=40.0%;;;0;100 throughput=5000.0;;;0 restarts_left=2;;;0 "
        "slo_availability=99.855%;;;0;100 slo_availability_budget=-45.0%;;;;100 "
        "slo_ttft=96.000%;;;0;100 slo_ttft_budget=20.0%;;;;100"
    )
    assert seen("healthy") == (
        0, "vkvagent 0.1.0: HEALTHY", f"speed_ratio=0.980;0.8:;0.6:;0 {perf}",
    )  # fmt: skip
    long_output = checked["healthy"]["long_plugin_output"]  # the lines after the first
    assert long_output.startswith(r"  verdict     none: healthy: speed 0.98\n  unit ")
    assert seen("slow") == (
        1,
        "vkvagent 0.1.0: WARNING - speed ratio 0.70 outside the warning range 0.8: (verdict "
        "HEALTHY)",
        f"speed_ratio=0.700;0.8:;0.6:;0 {perf}",
    )
    assert seen("impaired")[:2] == (1, "vkvagent 0.1.0: IMPAIRED (systemd failing)")
    assert seen("down")[:2] == (2, "vkvagent 0.1.0: CRITICAL")
    # UNKNOWN says why on its first line too (NRPE shows "no output" for an empty stdout).
    # ... and which file it read, where a wrong state_dir would show.
    state, line, perf = seen("none")
    assert (state, perf) == (3, "") and line.startswith(
        "vkvagent 0.1.0: UNKNOWN - no status yet: the daemon has not run (or cannot write its "
        "state) (/"
    )
    assert line.endswith("/none/state/status.json)")
    state, line, _perf = seen("stale")
    assert state == 3 and re.fullmatch(
        r"vkvagent 0\.1\.0: UNKNOWN \(stale: last update \d+ s ago, daemon not running\)", line
    )
    state, line, _perf = seen("broken")
    assert state == 3 and line.startswith("vkvagent 0.1.0: UNKNOWN - ")
    assert "sample_interval" in line + checked["broken"]["long_plugin_output"]


def test_the_first_line_goes_to_stdout_whatever_fails(tmp_path: Path) -> None:
    """A monitoring plugin's output is stdout: errors there too, exit 3."""
    config = write_config(tmp_path, "http://127.0.0.1:9")
    state = tmp_path / "state"
    state.mkdir()
    damaged = dict(current().to_json(), verdict={"state": 7})  # a status of another kind
    status.path(state).write_text(json.dumps(damaged))
    for argv, problem in (
        (["--config", str(config)], f"{status.path(state)}: verdict.state: expected text"),
        (["--config", str(tmp_path / "none.toml")], "none.toml"),
        (["--config", str(config), "-w", "0.8"], "threshold '0.8': a bare number"),
    ):
        out, err = io.StringIO(), io.StringIO()
        assert main(["status", *argv], out, err) == 3, argv
        first = out.getvalue().splitlines()[0]
        assert first.startswith("vkvagent 0.1.0: UNKNOWN - ") and problem in out.getvalue()
        assert err.getvalue() == ""
        out = io.StringIO()
        assert main(["status", "--json", *argv], out, err) == 3
        shown = json.loads(out.getvalue())
        assert shown["verdict"]["state"] == "unknown" and problem in shown["verdict"]["reason"]


def test_watch_in_a_pipe_ends_cleanly_when_the_reader_goes(tmp_path: Path) -> None:
    """`status --watch 1 | head -3`: no clear-screen escapes in the pipe, no error when head
    exits, and the status's own exit code."""
    config = write_config(tmp_path, "http://127.0.0.1:9")
    written(current(), tmp_path / "state")
    command = (
        f"{sys.executable} -m vkvagent status --watch 0.2 --config {config} 2>{tmp_path}/err "
        "| head -3; exit ${PIPESTATUS[0]}"
    )
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=30, check=False
    )
    assert (tmp_path / "err").read_text() == ""
    assert done.returncode == 0  # HEALTHY, as the status says
    assert "\033" not in done.stdout
    assert done.stdout.startswith("vkvagent 0.1.0: HEALTHY | ")
