"""A real systemd for tests: systemd 252 booted in systemd-nspawn on a throw-away overlay of the
host's own root file system; the comments below say why each step is there.

``with Sandbox(units={"vllm.service": sim_unit()}) as box:`` boots in 0.3 s (0.8 s until the
simulator answers on its port) and gives the container's system bus (``box.bus_address``),
its files (``box.root``), commands run inside it (``box.run``), its journal and its loopback
network (``box.http_get``).

How the host is kept out of it:

- Everything runs in a private mount namespace (``unshare --mount --propagation private``):
  the tmpfs that holds the overlay's upper layer and the tmpfs over ``/run/systemd`` vanish
  with the boot process, so no mount can outlive a test. Files written inside the container
  land in that tmpfs; the host's files are never written. The project directory (and the
  Python it runs on, when that lives on another file system) is bound in read-only, at the
  same path, so the project's venv python runs inside the container unchanged.
- What vkvagent's packages install (``HIDDEN``: its config, state and program) is hidden from
  the container by whiteouts in the overlay's upper layer, so that a test installing a
  package on the host does not show through into another test's container meanwhile.
- ``--private-network``: the container has its own loopback, so ``vllm.service`` in every
  sandbox listens on the real vLLM address 127.0.0.1:8000 without clashing with the host or
  another test, and no test traffic leaves loopback. The host cannot connect to that port, so
  the test's HTTP client reaches it through a socket created inside the container's network
  namespace (``connect``: a short-lived thread ``setns``-es into it, creates the socket, and
  exits; the socket stays in the container's namespace). That keeps the client in-process and
  fast (no interpreter started per request), unlike running curl or python through ``run``.
- The boot process (which becomes systemd-nspawn) gets its own cgroup directories, removed on
  stop, and gets SIGTERM when the thread that started it ends (``PR_SET_PDEATHSIG``), so a
  killed pytest does not leave a container running: nspawn shuts it down. (Start a sandbox
  from the thread that will stop it, as pytest fixtures do.) What a killed run left behind is
  removed by the next sandbox's start.
- ``stop`` kills the container's PID 1, which ends every process in its PID namespace; nspawn
  then exits. 0.1 s, where an orderly shutdown waits 0.6 s for the simulator to notice.

Needs root, ``systemd-container`` and this host kind's hybrid cgroups (v1 controllers, with
``name=systemd`` and cgroup2 at ``/sys/fs/cgroup/unified``); ``require()`` skips the test
otherwise, except under CI=true, where it fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import pytest

PROJECT = Path(__file__).resolve().parent.parent
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
VLLM_PORT = 8000
CGROUP_ROOTS = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))
MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
PREFIX = "vkv-sandbox-"
# Units of this host image that a test container does not want: slow, noisy, or pointless.
# polkit is left alone: it is only started on demand, and masked, systemd would answer an
# unprivileged caller "org.freedesktop.systemd1.UnitMasked: Unit polkit.service is masked."
MASKED = (
    "postgresql.service",
    "cron.service",
    "ssh.service",
    "e2scrub_reap.service",
    "systemd-timesyncd.service",
    "console-getty.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
    "man-db.timer",
    "systemd-logind.service",
    "systemd-user-sessions.service",
    "systemd-update-utmp.service",
    "systemd-update-utmp-runlevel.service",
    "systemd-journal-flush.service",  # the journal stays in /run/log/journal, where it is read
    "systemd-sysusers.service",
    "dev-hugepages.mount",
    "getty.target",
    # Debian's etcd-server (tests/test_fleet.py) enables it: in a sandbox it holds up the boot.
    "etcd.service",
    # Debian's prometheus (tests/test_replay.py runs its own) enables it: in a sandbox it only
    # takes memory and CPU from the vLLM under test.
    "prometheus.service",
    # The SIEM collectors `make deps` installs (tests/test_siem.py starts its own): rsyslog
    # would read the whole journal at every boot.
    "rsyslog.service",
    "syslog-ng.service",
    "systemd-journal-upload.service",
    "systemd-journal-remote.socket",
    "systemd-journal-remote.service",
)

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000

# Runs as `unshare --mount --propagation private sh -c BOOT sh STATE NAME [nspawn args]`, so
# every mount it makes belongs to its private namespace and vanishes with it. It joins the
# cgroup directories in $CGROUPS (one a line) and ends by becoming systemd-nspawn (exec), so
# the boot process's PID is nspawn's.
BOOT = r"""
set -eu
state=$1 name=$2
shift 2
mount -t tmpfs -o mode=0755 tmpfs "$state/ovl"
mkdir "$state/ovl/upper" "$state/ovl/work"
for hidden in $HIDDEN; do
    mkdir -p "$state/ovl/upper/${hidden%/*}"
    mknod "$state/ovl/upper/$hidden" c 0 0
done
mount -t overlay overlay \
    -o "lowerdir=/,upperdir=$state/ovl/upper,workdir=$state/ovl/work" "$state/root"
mkdir -p /run/systemd
mount -t tmpfs -o mode=0755 tmpfs /run/systemd
cp -a "$state/etc/." "$state/root/etc/"
printf '%s\n' "$CGROUPS" | while IFS= read -r dir; do echo $$ > "$dir/cgroup.procs"; done
exec systemd-nspawn -D "$state/root" -M "$name" --register=no --keep-unit \
    --private-network --console=read-only "$@" /bin/sh -c "$INIT"
"""
# What the packages install, hidden from every container by a whiteout in its upper layer: a
# test that installs them on the host (tests/test_packaging.py) must not put its state, config
# or program under a sandbox of another test running meanwhile (a ledger it planted once made
# a sandbox's `vkvagent restart` fail: "file is not a database").
HIDDEN = ("etc/vkvagent", "var/lib/vkvagent", "usr/lib/vkvagent", "usr/bin/vkvagent")
# The container's PID 1 until it execs systemd. On a host with cgroup v1 controllers, nspawn
# mounts the memory hierarchy read-only (rooted at the sandbox's own memory cgroup), so
# systemd could not account memory and MemoryCurrent would stay unset; a writable mount lets
# it. This is why the container is not started with `-b`, which cannot wrap init.
INIT = """
if mountpoint -q /sys/fs/cgroup/memory; then
    mount -o remount,bind,rw /sys/fs/cgroup/memory || echo "memory cgroup stays read-only" >&2
fi
exec /lib/systemd/systemd
"""


class SandboxError(Exception):
    """The sandbox could not boot, or a command inside it failed."""


def available() -> str | None:
    """Why a sandbox cannot boot here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("systemd-nspawn", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install systemd-container)"
    if not all(root.is_dir() for root in CGROUP_ROOTS):
        return "needs the name=systemd and unified cgroup hierarchies"
    return None


def require() -> None:
    """Skip the calling test when no sandbox can boot, except under CI=true, where it fails."""
    reason = available()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"systemd sandbox: {reason} (CI=true: not skipped)")
        pytest.skip(f"systemd sandbox: {reason}")


# -- units -------------------------------------------------------------------------------------


def exec_arg(arg: str) -> str:
    """One argument written for an ``ExecStart=`` line: quoted when needed, with systemd's
    specifier (``%``) and variable (``$``) characters escaped, so systemd reads back ``arg``."""
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    escaped = escaped.replace("%", "%%").replace("$", "$$")
    if escaped and not re.search(r"[\s\"'\\;]", arg):
        return escaped
    return f'"{escaped}"'


def exec_line(argv: Sequence[str]) -> str:
    return " ".join(exec_arg(arg) for arg in argv)


def sim_argv(*flags: str, port: int = VLLM_PORT, model: str = MODEL) -> list[str]:
    """The command line of the simulator serving ``model`` like ``vllm serve`` would."""
    return [
        sys.executable, "-m", "vkvagent", "sim", "serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--cold-start", "2", "--time-scale", "30",
        *flags,
    ]  # fmt: skip


def sim_unit(
    *flags: str, service: str = "", unit: str = "", port: int = VLLM_PORT, model: str = MODEL
) -> str:
    """A ``vllm.service`` that runs the simulator with vLLM's ``flags``, as a real vLLM unit
    would run ``vllm serve`` (Type=simple: systemd cannot know when the model has loaded).
    ``service`` and ``unit`` are extra lines for the [Service] and [Unit] sections."""
    return (
        "[Unit]\n"
        "Description=vLLM (simulated by vkvagent sim)\n"
        f"{unit}\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={exec_line(sim_argv(*flags, port=port, model=model))}\n"
        "Environment=PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1\n"
        # The simulator exits within 0.2 s of SIGTERM. Once, in CI, a restart job stayed
        # unfinished for over 60 s (the stop, under systemd's default 90 s): bound it well
        # inside the tests' 30 s job timeout.
        "TimeoutStopSec=10\n"
        f"{service}\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


# -- the sandbox -------------------------------------------------------------------------------

_names = itertools.count()


class Sandbox:
    """A booted systemd in systemd-nspawn; a context manager (``__exit__`` always stops it).

    ``units``: unit files (name -> text) installed before boot; ``enable`` names those to
    start at boot (default: every ``.service`` among them), through multi-user.target.wants.
    A name may hold a directory (``vllm.service.d/10-flags.conf``) to install a drop-in."""

    def __init__(
        self,
        units: Mapping[str, str] | None = None,
        *,
        enable: Sequence[str] | None = None,
        masked: Sequence[str] = MASKED,
        boot_timeout: float = 30.0,
    ) -> None:
        self.units = dict(units or {})
        services = [name for name in self.units if name.endswith(".service")]
        self.enable = services if enable is None else list(enable)
        self.masked = masked
        self.boot_timeout = boot_timeout
        self.name = f"{PREFIX}{os.getpid()}-{next(_names)}"
        self.state: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.leader = 0
        self.boot_seconds = 0.0
        self.system_state = ""
        self.cgroups: list[Path] = []
        self.log: BinaryIO | None = None

    # -- life cycle --------------------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        started = time.monotonic()
        _remove_stale()
        self.state = Path(tempfile.mkdtemp(prefix=self.name + "."))
        for made in ("ovl", "root", "etc/systemd/system/multi-user.target.wants"):
            (self.state / made).mkdir(parents=True, exist_ok=True)
        etc = self.state / "etc"
        # A fresh machine ID: nspawn refuses to link the container's journal to the host's.
        (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")
        system = etc / "systemd" / "system"
        for name in self.masked:
            (system / name).symlink_to("/dev/null")
        for name, text in self.units.items():
            (system / name).parent.mkdir(parents=True, exist_ok=True)
            (system / name).write_text(text)
        for name in self.enable:
            (system / "multi-user.target.wants" / name).symlink_to(f"/etc/systemd/system/{name}")
        self.cgroups = _cgroup_dirs(self.name)
        for directory in self.cgroups:
            directory.mkdir()
        self.log = open(self.state / "nspawn.log", "wb")  # noqa: SIM115 - closed in stop()
        environment = {
            **os.environ,
            "CGROUPS": "\n".join(str(directory) for directory in self.cgroups),
            "INIT": INIT,
            "HIDDEN": " ".join(HIDDEN),
        }
        self.process = subprocess.Popen(
            [
                "unshare", "--mount", "--propagation", "private", "sh", "-c", BOOT, "sh",
                str(self.state), self.name, *_binds(),
            ],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=environment,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only async-signal-safe calls
        )  # fmt: skip
        deadline = started + self.boot_timeout
        self.leader = self._wait_leader(deadline)
        left = max(deadline - time.monotonic(), 1.0)
        done = self.run("systemctl", "is-system-running", "--wait", check=False, timeout=left)
        self.system_state = done.stdout.strip()
        if self.system_state not in ("running", "degraded"):
            raise SandboxError(f"boot ended {self.system_state!r}: {self.boot_log()}")
        self.boot_seconds = time.monotonic() - started

    def _wait_leader(self, deadline: float) -> int:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SandboxError(f"nspawn exited {self.process.returncode}: {self.boot_log()}")
            leader = _child(self.process.pid, "systemd")
            if leader and os.path.exists(f"/proc/{leader}/root/run/dbus/system_bus_socket"):
                return leader
            time.sleep(0.01)
        raise SandboxError(f"no system bus in the container: {self.boot_log()}")

    def stop(self) -> None:
        """End the container and remove everything the sandbox made. Idempotent.

        The container is killed, not shut down: killing its PID 1 ends every process in its
        PID namespace at once, and nothing in it needs to outlive the test."""
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                leader = _child(process.pid, "systemd")
                if leader:
                    os.kill(leader, signal.SIGKILL)
                else:  # not booted yet: nspawn (or the boot script) ends it all on SIGTERM
                    process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self.log is not None:
            self.log.close()
            self.log = None
        self.leader = 0
        for directory in self.cgroups:
            _remove_cgroup(directory)
        self.cgroups = []
        if self.state is not None:
            # The mounts were in the boot process's namespace and went with it.
            shutil.rmtree(self.state, ignore_errors=True)
            self.state = None

    def boot_log(self) -> str:
        """What systemd-nspawn and the container's console printed."""
        if self.state is None or not (self.state / "nspawn.log").exists():
            return ""
        return (self.state / "nspawn.log").read_text(errors="replace")[-4000:]

    # -- reaching into it --------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The container's root directory, as seen from the host."""
        return Path(f"/proc/{self._leader()}/root")

    @property
    def bus_address(self) -> str:
        """The container's system bus, for DBUS_SYSTEM_BUS_ADDRESS or ``Systemd(address)``."""
        return f"unix:path={self.root}/run/dbus/system_bus_socket"

    def run(
        self,
        *cmd: str,
        user: int | None = None,
        check: bool = True,
        timeout: float = 60.0,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the container (all its namespaces), as root or as ``user``
        (a uid; its group is the same number, no supplementary groups), with this process's
        environment plus ``env``."""
        who = ["--setuid", str(user), "--setgid", str(user)] if user is not None else []
        done = subprocess.run(
            ["nsenter", "-t", str(self._leader()), "-a", *who, *cmd],
            input=input, capture_output=True, text=True, timeout=timeout, check=False,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
        if check and done.returncode != 0:
            raise SandboxError(
                f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}"
            )
        return done

    def put(self, file: Path) -> str:
        """Copy a host file into the container's /root (its /tmp is its own, and it sees only
        the host's root file system); its path there."""
        shutil.copy(file, self.root / "root" / file.name)
        return f"/root/{file.name}"

    def write_unit(self, name: str, text: str) -> Path:
        """Write ``/etc/systemd/system/NAME`` in the container (``vllm.service.d/x.conf`` for a
        drop-in). systemd reads it on the next reload."""
        path = self.root / "etc/systemd/system" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def journal(self, unit: str) -> list[dict[str, Any]]:
        """The unit's journal entries, oldest first, each with every field (MESSAGE, ...)."""
        done = self.run("journalctl", "-u", unit, "-o", "json", "--no-pager")
        # One entry per "\n": not splitlines(), which also breaks at U+2028 and U+0085, and
        # systemd's _CMDLINE field holds those unescaped when the argv does.
        return [json.loads(line) for line in done.stdout.split("\n") if line.strip()]

    def messages(self, unit: str) -> list[str]:
        """The MESSAGE of each of the unit's journal entries."""
        return [str(entry.get("MESSAGE", "")) for entry in self.journal(unit)]

    def connect(self, port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> socket.socket:
        """A TCP connection to ``host:port`` made inside the container's network namespace."""
        return self._socket_inside(lambda: socket.create_connection((host, port), timeout=timeout))

    def listen(self, port: int, host: str = "127.0.0.1") -> socket.socket:
        """A TCP socket listening on ``host:port`` inside the container's network namespace,
        for a stand-in server that the container's services connect to (``accept`` works
        from any thread of this process)."""
        return self._socket_inside(lambda: socket.create_server((host, port)))

    def _socket_inside(self, make: Callable[[], socket.socket]) -> socket.socket:
        """``make()`` run on a short-lived thread that has entered the container's network
        namespace: the socket stays in that namespace, the thread ends right after."""
        made: list[socket.socket] = []
        failed: list[BaseException] = []
        netns = f"/proc/{self._leader()}/ns/net"

        def inside() -> None:
            try:
                fd = os.open(netns, os.O_RDONLY)
                try:
                    if _libc.setns(fd, _CLONE_NEWNET) != 0:
                        code = ctypes.get_errno()
                        raise OSError(code, f"setns {netns}: {os.strerror(code)}")
                finally:
                    os.close(fd)
                made.append(make())
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=inside, name="sandbox-netns")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return made[0]

    def http_get(self, port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """GET ``http://127.0.0.1:PORT/PATH`` inside the container: (status, body). Raises
        OSError when nothing listens there (yet)."""
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        connection.sock = self.connect(port, timeout=timeout)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def wait_http(
        self, port: int = VLLM_PORT, path: str = "/health", timeout: float = 20.0
    ) -> tuple[int, bytes]:
        """Poll until ``path`` answers 200 (a simulated vLLM that has loaded its model)."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                status, body = self.http_get(port, path, timeout=1.0)
                if status == 200:
                    return status, body
                last = status
            except OSError as exc:
                last = exc
            time.sleep(0.02)
        raise SandboxError(f"GET {path} on port {port} never answered 200; last: {last}")

    def _leader(self) -> int:
        if not self.leader:
            raise SandboxError("the sandbox is not running")
        return self.leader


# -- pytest fixtures ---------------------------------------------------------------------------
# A test module imports them (`from tests.sandbox import sandbox_fixture`, marked noqa F401),
# and its tests ask for `sandbox` or `shared_sandbox`.


@pytest.fixture(name="sandbox")
def sandbox_fixture() -> Iterator[Sandbox]:
    """A freshly booted container whose vllm.service (the simulator, ``sim_unit()``) answers on
    127.0.0.1:8000. One boot per test (about 1 s with the simulator ready, 0.15 s to remove):
    restarts, start-limit counters, drop-ins and journals never leak from one test to another.
    """
    require()
    with Sandbox(units={"vllm.service": sim_unit()}) as box:
        box.wait_http()
        yield box


@pytest.fixture(name="shared_sandbox", scope="module")
def shared_sandbox_fixture() -> Iterator[Sandbox]:
    """The same, booted once per test module, for tests that only read (no restarts, no unit
    edits, no stopping)."""
    require()
    with Sandbox(units={"vllm.service": sim_unit()}) as box:
        box.wait_http()
        yield box


# -- helpers -----------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies, so a killed pytest
    does not leave a container running (nspawn shuts the container down on SIGTERM)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _binds() -> list[str]:
    """nspawn arguments binding the project read-only, and the Python it runs on when that is
    not on the root file system (which the overlay already shows)."""
    binds = [f"--bind-ro={PROJECT}"]
    root_device = os.stat("/").st_dev
    for path in {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}:
        inside_project = path == PROJECT or PROJECT in path.parents
        if not inside_project and os.stat(path).st_dev != root_device:
            binds.append(f"--bind-ro={path}")
    return binds


def _child(parent: int, comm: str) -> int:
    """The PID of ``parent``'s child process named ``comm``, or 0."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return 0
    for pid in children:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                return int(pid)
    return 0


def _remove_cgroup(path: Path) -> None:
    """rmdir a cgroup directory tree, deepest first (cgroupfs has no other way)."""
    if not path.is_dir():
        return
    for directory, _subdirs, _files in os.walk(path, topdown=False):
        for _attempt in range(50):
            try:
                os.rmdir(directory)
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:  # EBUSY: processes are still leaving it
                    break
                time.sleep(0.01)


def _cgroup_dirs(name: str) -> list[Path]:
    """The sandbox's own cgroups: ``name`` under the roots of the name=systemd and unified
    hierarchies (as the recipe has it), and under this process's memory cgroup, so memory
    the container uses is still charged where this process's is."""
    dirs = [root / name for root in CGROUP_ROOTS]
    memory = _memory_cgroup()
    if memory is not None:
        dirs.append(memory / name)
    return dirs


def _memory_cgroup() -> Path | None:
    """This process's cgroup in the v1 memory hierarchy, or None without one."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _number, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                directory = MEMORY_ROOT / path.lstrip("/")
                return directory if directory.is_dir() else None
    return None


def _remove_stale() -> None:
    """Remove what sandboxes of dead test processes (killed mid-test) left: their cgroups,
    then, once no process is left in those, their state directories (empty by then: the
    mounts went with the boot process's namespace)."""
    memory = _memory_cgroup()
    parents = [*CGROUP_ROOTS, *([memory] if memory is not None else [])]
    temporary = Path(tempfile.gettempdir())
    names: set[str] = set()
    for parent in (*parents, temporary):
        with contextlib.suppress(OSError):
            for entry in parent.glob(f"{PREFIX}*"):
                name = entry.name.split(".", 1)[0]
                owner = name[len(PREFIX) :].split("-", 1)[0]
                if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                    names.add(name)
    for name in names:
        for parent in parents:
            _remove_cgroup(parent / name)
        if not any((parent / name).exists() for parent in parents):
            for state in temporary.glob(f"{name}.*"):
                shutil.rmtree(state, ignore_errors=True)


def reach_python(box: Sandbox) -> None:
    """Let any user inside the container run this Python: o+x on every directory above it
    (in the container's overlay only; the host is never written)."""
    for parent in reversed(Path(sys.executable).resolve().parents):  # the real interpreter
        if str(parent) != "/":
            box.run("chmod", "o+x", str(parent))
