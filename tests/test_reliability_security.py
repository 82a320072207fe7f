"""Security checks of ``make reliability`` (docs/RELIABILITY.md): what SECURITY.md promises,
checked on the running code. Config files others could write are refused (more cases in
tests/test_config.py); no flag value or argument can add an argument or a unit directive, as
a real systemd reads the drop-in; the state is readable by its owner and group only, however
the agent was started; the metrics endpoint is on loopback by default; nothing runs through a
shell."""

from __future__ import annotations

import ast
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sandbox import PROJECT, Sandbox, require
from vkvagent.adapters.exporter import AgentMetrics, Exporter
from vkvagent.adapters.ledger import Ledger
from vkvagent.adapters.systemd import Systemd
from vkvagent.knowledge import config, flags
from vkvagent.knowledge.config import Config, ConfigError
from vkvagent.knowledge.dropin import argv_hash, render_dropin
from vkvagent.knowledge.flags import CATALOGUE, FlagError
from vkvagent.knowledge.vllm_command import VllmCommandError, apply_flags
from vkvagent.processes import stop_process

PACKAGE = PROJECT / "vkvagent"
INJECTIONS = [
    "16\nExecStartPre=/bin/sh -c id",
    '16" --api-key "x',
    "16' --x '",
    "16;id",
    "16 ; id",
    "%n%i%u",
    "$HOME",
    "${PATH}",
    "$(id)",
    "`id`",
    "16\\",
    "16\\\nUser=root",
    "ok\n[Service]\nUser=root",
    "16\x00x",
    "-1",
    "--x",
]


def write(path: Path, text: str, mode: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


# -- config files others could write ---------------------------------------------------------


@pytest.mark.root
@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: d.chmod(0o777), "writable by group or others (mode 0777)"),
        (lambda d: d.chmod(0o775), "writable by group or others (mode 0775)"),
        (lambda d: os.chown(d, 1000, 0), "owned by uid 1000, not root"),
    ],
)
def test_a_conf_d_directory_others_could_write_is_refused(
    tmp_path: Path, change: object, reason: str
) -> None:
    """tests/test_config.py covers the main file, its directory and a drop-in file; the
    drop-in directory matters as much: whoever can write it can add a file."""
    assert os.geteuid() == 0, "CI runs these as root; they must not skip there"
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    write(etc / "config.toml", "[vllm]\nmodel = 'x'\n", 0o644)
    dropin = write(etc / "conf.d" / "10.toml", "[gpu]\nenabled = false\n", 0o644)
    (etc / "conf.d").chmod(0o755)
    config.load(etc, as_root=True)
    assert callable(change)
    change(etc / "conf.d")
    with pytest.raises(ConfigError) as raised:
        config.load(etc, as_root=True)
    assert raised.value.problems == (
        f"{dropin.parent}: refused: {reason}; it controls a root service",
    )


# -- no flag value or argument adds an argument or a directive -------------------------------


@pytest.mark.parametrize("value", INJECTIONS)
def test_no_flag_takes_an_injection_as_its_value(value: str) -> None:
    for name in CATALOGUE:
        try:
            typed = flags.validate({name: value}, "0.6.6" if name == "preemption-mode" else None,
                                   check_versions=False)  # fmt: skip
        except FlagError as exc:
            assert all("\n" not in p for p in exc.problems)
            continue
        for token in flags.render_flag(name, typed[name]):  # read as a number: plain again
            assert all(c.isalnum() or c in "._+-" for c in token), (name, value, token)


def test_a_shell_command_line_is_not_rewritten() -> None:
    with pytest.raises(VllmCommandError, match="shell"):
        apply_flags(["/bin/sh", "-c", "vllm serve m"], {"max-num-seqs": 64})


def test_refusing_a_command_line_takes_one_line_whatever_it_holds() -> None:
    with pytest.raises(VllmCommandError) as raised:
        apply_flags(["/bin/true", "a\nExecStartPre=/bin/id", "\x1b[2J"], {})
    assert "\n" not in str(raised.value) and "\x1b" not in str(raised.value)
    assert "a\\nExecStartPre=/bin/id" in str(raised.value)


VLLM_BIN = "/usr/bin/vllm"  # never started: systemd loads a unit whatever its program


@pytest.mark.systemd
def test_hostile_arguments_stay_arguments_as_systemd_reads_them() -> None:
    """The unit's own command line (the operator's) holds every injection as an argument;
    vkvagent rewrites it with flags and writes the drop-in; systemd shows exactly that argv,
    one ExecStart, and no directive the text tried to add."""
    require()
    units: dict[str, list[str]] = {}
    for number, hostile in enumerate(i for i in INJECTIONS if "\0" not in i):
        base = [VLLM_BIN, "serve", "m", "--served-model-name", hostile, hostile]
        units[f"inject{number}.service"] = apply_flags(base, {"max-num-seqs": 64})
    with Sandbox(units={}, enable=[]) as box:
        system = box.root / "etc/systemd/system"
        for name, argv in units.items():
            (system / name).write_text(f"[Service]\nExecStart={VLLM_BIN} serve m\n")
            (system / f"{name}.d").mkdir()
            (system / f"{name}.d" / "90-vkvagent.conf").write_text(
                render_dropin(name, argv, source_hash=argv_hash(argv))
            )
        with Systemd(box.bus_address, timeout=30) as bus:
            bus.reload()
            for name, argv in units.items():
                state = bus.unit(name)
                assert [list(c.argv) for c in state.exec_start] == [
                    [a.replace("$", "$$") for a in argv]
                ], name
                shown = box.run(
                    "systemctl", "show", name, "-p", "User", "-p", "ExecStartPre",
                    "-p", "ExecStartPost", "-p", "Environment", "--value",
                ).stdout  # fmt: skip
                assert shown.strip() == "", (name, shown)


# -- the state: owner and group only -----------------------------------------------------------


def _loose(directory: Path) -> list[str]:
    """Files or directories in ``directory`` that others can read, or its group can write."""
    found = []
    for path in [directory, *directory.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o027:
            found.append(f"{path.name} {mode:04o}")
    return found


def test_vkvagent_run_started_with_a_loose_umask_keeps_its_state_private(tmp_path: Path) -> None:
    """Outside systemd (no UMask=0077), e.g. from a shell with umask 022: the history and the
    ledger were created 0644 before the daemon set its own umask."""
    state = tmp_path / "state"
    cfg = write(
        tmp_path / "c.toml",
        f'[agent]\nstate_dir = "{state}"\nsample_interval = 1\n[vllm]\n'
        'url = "http://127.0.0.1:9"\n[gpu]\nenabled = false\n[metrics]\nlisten = ""\n',
        0o600,
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "vkvagent", "run", "--config", str(cfg)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.umask(0o022),  # noqa: PLW1509 - one async-signal-safe call
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (state / "status.json").exists():
            time.sleep(0.1)
        time.sleep(1.5)
    finally:
        assert stop_process(agent, 20) == 0  # SIGTERM ends the daemon cleanly
    names = {p.name for p in state.iterdir()}
    assert {"history.sqlite3", "ledger.sqlite3", "status.json", "engine.json"} <= names
    assert _loose(state) == []


def test_the_ledger_an_operator_command_creates_is_private(tmp_path: Path) -> None:
    """`sudo vkvagent restart` before the daemon ever ran creates the ledger with the
    operator's umask."""
    previous = os.umask(0o022)
    try:
        with Ledger(tmp_path / "state"):
            pass
    finally:
        os.umask(previous)
    assert _loose(tmp_path / "state") == []


def test_the_unit_keeps_the_state_private() -> None:
    unit = (PROJECT / "systemd" / "vkvagent.service").read_text()
    assert "\nUMask=0077\n" in unit
    assert "\nStateDirectoryMode=0750\n" in unit


# -- the metrics endpoint -----------------------------------------------------------------------


def test_the_metrics_endpoint_is_on_loopback_by_default() -> None:
    assert Config().metrics.listen == "127.0.0.1:9849"
    example = config.load(PROJECT / "config.example.toml", as_root=False)
    assert example.metrics.listen == "127.0.0.1:9849"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exporter = Exporter(AgentMetrics(), f"127.0.0.1:{port}", "")
    try:
        listening = [
            line.split()[1]
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
            if line.split()[3] == "0A" and line.split()[1].endswith(f":{port:04X}")
        ]
        assert listening == [f"0100007F:{port:04X}"]  # 127.0.0.1 only, not 0.0.0.0
    finally:
        exporter.close()


# -- no shell ------------------------------------------------------------------------------------

# What starts processes by design: the simulator and the demo, which starts the simulator,
# never part of the agent; and the operator's [restart] hooks, argv lists run without a shell
# (the shell= check below still covers them). processes.py starts nothing: it stops what the
# demo, benchmarks and tests started, and needs subprocess at run time for TimeoutExpired.
# container.py runs `ENGINE inspect`, the engine being the program of the unit's own
# ExecStart= (whoever writes that runs code as root already), with an argv, never a shell.
STARTS_PROCESSES = (
    "vkvagent/sim/", "vkvagent/tools/demo.py", "vkvagent/hooks.py", "vkvagent/processes.py",
    "vkvagent/container.py",
)  # fmt: skip
FORBIDDEN_CALLS = {
    ("os", name) for name in ("system", "popen", "execl", "execle", "execlp", "execv", "execve",
                              "execvp", "execvpe", "spawnl", "spawnv", "spawnvp", "posix_spawn",
                              "posix_spawnp", "forkpty")
}  # fmt: skip


def test_nothing_is_ever_passed_through_a_shell() -> None:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PROJECT))
        tree = ast.parse(path.read_text(), filename=where)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                for name in names:
                    if name.split(".")[0] in ("subprocess", "pty", "commands") and not (
                        where.startswith(STARTS_PROCESSES)
                    ):
                        problems.append(f"{where}:{node.lineno}: imports {name}")
            if isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg == "shell" and not (
                        isinstance(keyword.value, ast.Constant) and keyword.value.value is False
                    ):
                        problems.append(f"{where}:{node.lineno}: shell=")
                func = node.func
                if (
                    isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name)
                    and (func.value.id, func.attr) in FORBIDDEN_CALLS
                ):
                    problems.append(f"{where}:{node.lineno}: {func.value.id}.{func.attr}()")
    assert problems == []


def test_the_check_above_would_see_a_shell() -> None:
    tree = ast.parse("import subprocess\nsubprocess.run('id', shell=True)\nos.system('id')\n")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert any(k.arg == "shell" for c in calls for k in c.keywords)
    assert any(
        isinstance(c.func, ast.Attribute) and (getattr(c.func.value, "id", ""), c.func.attr)
        in FORBIDDEN_CALLS for c in calls
    )  # fmt: skip
