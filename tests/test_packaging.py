"""The .deb and the .rpm, built by ``packaging/build.sh`` (``make package``) and installed for
real: on this host (root: apt-get and rpm, purged or erased at the end whatever happens) and
inside a booted systemd (tests/sandbox.py), where vkvagent.service starts from the package and
runs under its own sandbox.

Host installs refuse to run where a vkvagent package is already installed (they would remove
it). rpm keeps its database in a temporary directory (``--dbpath``), not the host's. Upgrades
(from the first release, tests/fixtures/packages/) and downgrades run in the booted systemd,
with the service running."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox import Sandbox, SandboxError, require, sandbox_fixture  # noqa: F401 - the `sandbox` fixture
from vkvagent import __version__
from vkvagent.adapters.history import History
from vkvagent.knowledge import config, hardening
from vkvagent.tools.cli import main

# The packages run on the system Python whichever Python runs pytest (their 3.9 and 3.13 runs
# are a test of their own): `make test-pythons` leaves this module out.
pytestmark = pytest.mark.package

PROJECT = Path(__file__).resolve().parent.parent
DIST = PROJECT / "dist"
BIN = Path(sys.executable).parent
CI = os.environ.get("CI") == "true"
UNIT = "vkvagent.service"
MAX_EXPOSURE = 2.5
PAGE = PROJECT / "tests/fixtures/metrics/v1-0.10.prom"
NEWER = f"{__version__}.post1"  # the upgrade tests' second build
# The release the upgrade tests start from: the first packaged build, its own code, so an
# upgrade migrates state that code wrote (history schema 2 -> 3) and replaces a shipped
# config.toml whose defaults differ from this one's.
OLD_VERSION = "0.1.0"
OLD_PACKAGES = PROJECT / "tests/fixtures/packages"
# Every file a package puts outside its own directories, and those directories.
OWN_DIRS = ("/usr/lib/vkvagent", "/usr/share/vkvagent", "/usr/share/doc/vkvagent", "/etc/vkvagent")
COMMON_FILES = (
    "/usr/bin/vkvagent",
    "/etc/vkvagent/config.toml",
    "/usr/share/man/man8/vkvagent.8.gz",
    "/usr/share/doc/vkvagent/README.md",
    "/usr/share/doc/vkvagent/SECURITY.md",
    "/usr/share/doc/vkvagent/docs/configuration.md",  # and the rest of the README's reference
    "/usr/share/doc/vkvagent/changelog.gz",
    "/usr/share/vkvagent/prometheus/vllm-rules.yml",
    "/usr/share/vkvagent/prometheus/vkvagent-rules.yml",
    "/usr/share/vkvagent/grafana/vkvagent.json",
    "/usr/share/vkvagent/siem/rsyslog-vkvagent.conf",
    "/usr/share/bash-completion/completions/vkvagent",
    "/usr/lib/vkvagent/vkvagent/tools/cli.py",
    "/usr/lib/vkvagent/jeepney/__init__.py",
    "/usr/lib/vkvagent/prometheus_client/__init__.py",
    "/usr/lib/vkvagent/pynvml.py",
    "/usr/lib/vkvagent/tomli/__init__.py",  # for Python 3.9 and 3.10
)


def need(*tools: str) -> None:
    """Skip when a tool is missing, except under CI=true (.ci/run installs them), where fail."""
    missing = [tool for tool in tools if shutil.which(tool) is None and not Path(tool).exists()]
    if missing:
        message = f"needs {', '.join(missing)} (.ci/run installs them)"
        if CI:
            pytest.fail(f"{message}; CI=true: not skipped")
        pytest.skip(message)


def need_root() -> None:
    if os.geteuid() != 0:
        if CI:
            pytest.fail("needs root; CI=true: not skipped")
        pytest.skip("needs root")


def run(
    *cmd: str | Path, check: bool = True, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(part) for part in cmd], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})}, check=False, cwd=PROJECT,
    )  # fmt: skip
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {done.returncode}\n"
            f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
        )
    return done


def build(version: str | None = None) -> tuple[Path, Path, float]:
    """``make package``'s build, with this interpreter's venv tools: (deb, rpm, seconds)."""
    need(str(BIN / "uv"), str(BIN / "nfpm"))
    env = {"PYTHON": sys.executable, "UV": str(BIN / "uv"), "NFPM": str(BIN / "nfpm")}
    if version is not None:
        env["VKVAGENT_VERSION"] = version
    began = time.monotonic()
    run("bash", "packaging/build.sh", env=env, timeout=300)
    seconds = time.monotonic() - began
    version = version or __version__
    deb, rpm = DIST / f"vkvagent_{version}_all.deb", DIST / f"vkvagent-{version}-1.noarch.rpm"
    assert deb.is_file() and rpm.is_file()
    return deb, rpm, seconds


@pytest.fixture(scope="module")
def one_at_a_time() -> Iterator[None]:
    """Held from the first build to the module's end: two test runs on one machine (say,
    `make test` and `make test-pythons`, or two people's) would otherwise rebuild dist/ under
    each other and install over each other's packages."""
    with open(Path(tempfile.gettempdir()) / "vkvagent-packaging-tests.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def packages(one_at_a_time: None) -> tuple[Path, Path]:
    deb, rpm, seconds = build()
    print(
        f"\nbuilt in {seconds:.1f} s: {deb.name} {deb.stat().st_size / 1e6:.2f} MB, "
        f"{rpm.name} {rpm.stat().st_size / 1e6:.2f} MB"
    )
    assert seconds < 120, f"the build took {seconds:.0f} s"
    return deb, rpm


@pytest.fixture(scope="module")
def newer_packages(packages: tuple[Path, Path]) -> Iterator[tuple[Path, Path]]:
    deb, rpm, _seconds = build(NEWER)
    try:
        yield deb, rpm
    finally:
        deb.unlink(missing_ok=True)
        rpm.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def old_packages() -> tuple[Path, Path]:
    """OLD_VERSION's .deb and .rpm, as operators have them installed (tests/fixtures/packages/
    says how they were built): kept in the tree, so the upgrade tests need no git history
    and no rebuild of an old tree with today's dependencies."""
    return OLD_PACKAGES / f"vkvagent_{OLD_VERSION}_all.deb", OLD_PACKAGES / (
        f"vkvagent-{OLD_VERSION}-1.noarch.rpm"
    )


@pytest.fixture(scope="module")
def rpm_home() -> Iterator[dict[str, str]]:
    """The environment for rpm and rpmlint. Debian's rpm keeps its database in ~/.rpmdb, so
    HOME is a temporary directory. rpmlint unpacks a package with `rpm2cpio | cpio -id`, and
    nfpm's payload has absolute paths, which GNU cpio would write into / itself: a `cpio`
    first on PATH adds --no-absolute-filenames."""
    with tempfile.TemporaryDirectory(prefix="vkvagent-rpm-home-") as home:
        shim = Path(home) / "bin"
        shim.mkdir()
        cpio = shutil.which("cpio") or "/usr/bin/cpio"
        (shim / "cpio").write_text(f'#!/bin/sh\nexec {cpio} --no-absolute-filenames "$@"\n')
        (shim / "cpio").chmod(0o755)
        yield {"HOME": home, "PATH": f"{shim}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


# -- what the packages hold -----------------------------------------------------------------


def deb_files(deb: Path) -> dict[str, str]:
    """Path -> mode string (``-rw-r--r--``) of every entry of a .deb."""
    listing = run("dpkg-deb", "--contents", deb).stdout
    entries = {}
    for line in listing.splitlines():
        fields = line.split(maxsplit=5)
        entries[fields[5].split(" -> ")[0].lstrip(".").rstrip("/") or "/"] = fields[0]
    return entries


def test_the_deb_holds_the_program_unit_config_docs_and_rules(packages: tuple[Path, Path]) -> None:
    need("dpkg-deb")
    deb, _rpm = packages
    files = deb_files(deb)
    for path in (*COMMON_FILES, "/lib/systemd/system/vkvagent.service",
                 "/usr/share/doc/vkvagent/copyright", "/usr/share/doc/vkvagent/changelog.Debian.gz",
                 "/etc/vkvagent/conf.d",
                 "/usr/share/zsh/vendor-completions/_vkvagent"):  # fmt: skip
        assert path in files, path
    assert files["/usr/bin/vkvagent"] == "-rwxr-xr-x"
    assert not any(p.startswith("/usr/lib/systemd/") for p in files)
    assert not any("__pycache__" in p or p.endswith((".so", ".pyc")) for p in files)
    assert not any(p.startswith("/var/") for p in files)  # postinst makes the state directory
    info = run("dpkg-deb", "--info", deb).stdout
    assert f"Version: {__version__}-1\n" in info
    assert "Architecture: all\n" in info
    assert "Depends: python3 (>= 3.9)\n" in info
    control = Path(tempfile.mkdtemp(prefix="vkvagent-deb-"))
    try:
        run("dpkg-deb", "--control", deb, control)
        assert (control / "conffiles").read_text().split() == ["/etc/vkvagent/config.toml"]
        for script in ("postinst", "prerm", "postrm"):
            assert os.access(control / script, os.X_OK), script
    finally:
        shutil.rmtree(control)


def test_the_rpm_lists_the_expected_files_and_conffiles(
    packages: tuple[Path, Path], rpm_home: dict[str, str]
) -> None:
    need("rpm")
    _deb, rpm = packages
    files = set(run("rpm", "-qpl", rpm, env=rpm_home).stdout.split())
    rpm_only = ("/usr/lib/systemd/system/vkvagent.service", "/var/lib/vkvagent",
                "/usr/share/licenses/vkvagent/LICENSE", "/etc/vkvagent/conf.d",
                "/usr/share/zsh/site-functions/_vkvagent")  # fmt: skip
    for path in (*COMMON_FILES, *OWN_DIRS, *rpm_only):
        assert path in files, path
    assert not any(p.startswith("/lib/") for p in files)
    assert run("rpm", "-qpc", rpm, env=rpm_home).stdout.split() == ["/etc/vkvagent/config.toml"]
    docs = set(run("rpm", "-qpd", rpm, env=rpm_home).stdout.split())
    assert {"/usr/share/man/man8/vkvagent.8.gz", "/usr/share/doc/vkvagent/README.md"} <= docs
    query = "%{NAME} %{VERSION} %{RELEASE} %{ARCH}\n"
    assert (
        run("rpm", "-qp", "--qf", query, rpm, env=rpm_home).stdout
        == f"vkvagent {__version__} 1 noarch\n"
    )
    assert "python3 >= 3.9" in run("rpm", "-qpR", rpm, env=rpm_home).stdout.splitlines()
    listing = run("rpm", "-qplv", rpm, env=rpm_home).stdout
    assert re.search(r"^drwxr-x---\s.*\s/var/lib/vkvagent$", listing, re.M), listing


def test_the_shipped_config_is_the_built_in_defaults_with_mode_observe(
    packages: tuple[Path, Path],
) -> None:
    """The conffile shows every key commented out at its default, except the policy mode."""
    text = (PROJECT / "build/package/config.toml").read_text(encoding="utf-8")
    live = [line for line in text.splitlines() if line and not line.startswith(("#", "["))]
    assert live == ['mode = "observe"']
    assert config.load(PROJECT / "build/package/config.toml", as_root=False) == config.Config()


def test_the_vendored_tree_is_pure_python_and_licensed(packages: tuple[Path, Path]) -> None:
    tree = PROJECT / "build/package/lib"
    assert not [p for p in tree.rglob("*") if p.suffix in (".so", ".pyd", ".pyc")]
    copyright_text = (PROJECT / "packaging/copyright").read_text(encoding="utf-8")
    top = {p.name for p in tree.iterdir() if not p.name.endswith(".dist-info")}
    top.discard("vkvagent")
    for name in sorted(top):  # every vendored package has a stanza in the copyright file
        assert f"usr/lib/vkvagent/{name}" in copyright_text, f"packaging/copyright lacks {name}"


def test_lintian_finds_no_error(packages: tuple[Path, Path]) -> None:
    need("lintian")
    deb, _rpm = packages
    done = run("lintian", "--fail-on", "error", "--tag-display-limit", "0", deb, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not re.search(r"^E: ", done.stdout, re.M), done.stdout


def test_rpmlint_finds_no_error(packages: tuple[Path, Path], rpm_home: dict[str, str]) -> None:
    """rpmlint, with the two findings packaging/rpmlint.toml accepts (and says why)."""
    need("rpmlint")
    _deb, rpm = packages
    before = os.path.lexists("/usr/bin/vkvagent")
    done = run("rpmlint", "-c", "packaging/rpmlint.toml", rpm, check=False, env=rpm_home)
    assert os.path.lexists("/usr/bin/vkvagent") == before, "rpmlint unpacked the rpm into /"
    assert " 0 errors," in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_launcher_answers_in_one_line_while_its_tree_is_half_replaced(tmp_path: Path) -> None:
    """dpkg and rpm replace /usr/lib/vkvagent file by file: a command started meanwhile may
    find a cli.py of one version importing a name another version's module lacks. It says so
    in one line, no traceback; `status` exits 3 (unknown) as a check expects."""
    lib = tmp_path / "lib"
    for package in ("vkvagent", "vkvagent/knowledge", "vkvagent/tools"):
        (lib / package).mkdir(parents=True)
        (lib / package / "__init__.py").write_text("")
    (lib / "vkvagent/knowledge/flags.py").write_text("")  # the older module, without `shown`
    (lib / "vkvagent/tools/cli.py").write_text("from vkvagent.knowledge.flags import shown\n")
    launcher = tmp_path / "vkvagent"
    launcher.write_text(
        (PROJECT / "packaging/vkvagent").read_text().replace("/usr/lib/vkvagent", str(lib))
    )
    for args, code in ((["status"], 3), (["scrape", "--json"], 1)):
        done = run(sys.executable, "-sE", launcher, *args, check=False)
        assert done.returncode == code, done.stderr
        said = done.stderr.splitlines()
        assert len(said) == 1 and said[0].startswith(f"vkvagent: cannot load {lib} (ImportError: ")
        assert "try again once it has finished" in said[0]


def test_the_man_page_renders_without_warnings_and_covers_every_command() -> None:
    need("man")
    page = PROJECT / "packaging/vkvagent.8"
    done = run("man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", page,
               env={"MANROFFSEQ": "", "MANWIDTH": "80", "LC_ALL": "C.UTF-8"})  # fmt: skip
    assert done.stderr == ""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # argparse prints its help to sys.stdout
        main(["--help"], out)
    commands = set(re.findall(r"^    (\w+) ", out.getvalue(), re.M))
    assert {"run", "scrape", "apply", "config", "sim"} <= commands
    # Each command is a .TP item: `.B name` or `.BR name ...` or `.BR "name sub" ...`.
    documented = re.findall(r'^\.TP\n\.BR? "?(\w+)', page.read_text(encoding="utf-8"), re.M)
    assert commands <= set(documented), f"vkvagent.8 lacks {sorted(commands - set(documented))}"


def test_the_units_exposure_is_at_most_2_5() -> None:
    """The unit as written (the installed one is checked again below, with verify)."""
    need("systemd-analyze")
    unit = PROJECT / "systemd/vkvagent.service"
    security = run("systemd-analyze", "security", "--offline=true", unit, check=False)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", security.stdout)
    assert found, security.stdout + security.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, security.stdout
    text = unit.read_text(encoding="utf-8")
    for line in ("Type=notify", "NotifyAccess=main", "ExecStart=/usr/bin/vkvagent run",
                 "ExecReload=/bin/kill -HUP $MAINPID", "Restart=on-failure",
                 "RestartPreventExitStatus=78",
                 "CapabilityBoundingSet=CAP_SYS_PTRACE", "ProtectSystem=strict"):  # fmt: skip
        assert f"\n{line}\n" in text, line
    assert re.search(r"^WatchdogSec=\d+$", text, re.M)


# -- installed on this host ------------------------------------------------------------------


def unit_checks(unit_file: Path) -> float:
    """systemd-analyze verify is silent on the installed unit; returns its exposure."""
    verify = run("systemd-analyze", "verify", unit_file, check=False)
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, ""), verify.stderr
    security = run("systemd-analyze", "security", "--offline=true", unit_file, check=False)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", security.stdout)
    assert found, security.stdout + security.stderr
    return float(found.group(1))


def run_on(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    prefix = run("pyenv", "prefix", python, check=False).stdout.strip()
    interpreter = Path(prefix) / "bin/python3"
    if not prefix or not interpreter.exists():
        need(f"Python {python} (pyenv install {python})")
    return run(interpreter, "-sE", "/usr/bin/vkvagent", *args)


# Set while the module's own install (the installed_deb fixture) is in place.
INSTALLED_HERE: list[bool] = []


def no_vkvagent_installed() -> None:
    """Remove this module's own install; refuse to touch anyone else's."""
    if INSTALLED_HERE:
        purge_deb()
        INSTALLED_HERE.clear()
    installed = run("dpkg-query", "-W", "-f", "${Status}", "vkvagent", check=False).stdout
    if "installed" in installed.split() or Path("/usr/bin/vkvagent").exists():
        message = "a vkvagent is installed on this host; the install tests would remove it"
        if CI:
            pytest.fail(message)
        pytest.skip(message)


def apt_get(*args: str | Path) -> None:
    run("apt-get", "-y", "-q", "-o", "Dpkg::Options::=--force-confdef",
        "-o", "Dpkg::Options::=--force-confold", *args,
        env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=300)  # fmt: skip


def purge_deb() -> None:
    if run("dpkg-query", "-W", "vkvagent", check=False).returncode == 0:
        apt_get("purge", "vkvagent")
    forget_man_page()


def forget_man_page() -> None:
    """The formatted page man-db caches when `systemd-analyze verify` checks the unit's
    Documentation=man:vkvagent(8) (no package removes man-db's cache; it expires on its own)."""
    for cached in Path("/var/cache/man").glob("**/vkvagent.8*"):
        cached.unlink(missing_ok=True)


def leftovers(paths: Sequence[str], root: Path = Path("/")) -> list[str]:
    """What is still there of a package's paths, its directories and its systemd state, on
    this host or under ``root`` (a container's)."""

    def there(path: str) -> str:
        return str(root / path.lstrip("/"))

    left = [
        p for p in paths
        if os.path.lexists(there(p)) and not (os.path.isdir(there(p)) and p in SHARED)
    ]  # fmt: skip
    left += [d for d in (*OWN_DIRS, "/var/lib/vkvagent") if os.path.lexists(there(d))]
    for place in ("/etc/systemd/system", "/var/lib/systemd/deb-systemd-helper-enabled",
                  "/var/lib/systemd/deb-systemd-helper-masked"):  # fmt: skip
        with contextlib.suppress(OSError):
            left += ["/" + str(p.relative_to(root)) for p in Path(there(place)).rglob("*vkvagent*")]
    # vLLM's drop-in stays: vLLM's command line depends on it (a purge says so).
    return sorted(set(left) - {"/" + DROPIN})


# Directories packages share with the system; they stay.
SHARED = {
    "/", "/etc", "/lib", "/lib/systemd", "/lib/systemd/system", "/usr", "/usr/bin", "/usr/lib",
    "/usr/lib/systemd", "/usr/lib/systemd/system", "/usr/share", "/usr/share/doc",
    "/usr/share/man", "/usr/share/man/man8", "/usr/share/licenses", "/var", "/var/lib",
    "/usr/share/bash-completion", "/usr/share/bash-completion/completions", "/usr/share/zsh",
    "/usr/share/zsh/vendor-completions", "/usr/share/zsh/site-functions",
}  # fmt: skip


@pytest.fixture(scope="module")
def installed_deb(packages: tuple[Path, Path]) -> Iterator[Path]:
    """The .deb installed on this host with apt-get; purged at the end, whatever happens."""
    need_root()
    need("apt-get", "dpkg-query", "systemd-analyze")
    no_vkvagent_installed()
    deb, _rpm = packages
    try:
        INSTALLED_HERE.append(True)
        apt_get("install", f"./{deb.relative_to(PROJECT)}")
        yield deb
    finally:
        if INSTALLED_HERE:
            purge_deb()
            INSTALLED_HERE.clear()


@pytest.mark.root
def test_the_installed_deb_runs_and_its_unit_is_clean_and_hardened(installed_deb: Path) -> None:
    assert run("/usr/bin/vkvagent", "--version").stdout == f"vkvagent {__version__}\n"
    checked = run("/usr/bin/vkvagent", "config", "check")  # as root: ownership checked too
    assert checked.stdout.startswith("# configuration OK; read: /etc/vkvagent/config.toml\n")
    assert '\nmode = "observe"\n' in checked.stdout
    exposure = unit_checks(Path("/lib/systemd/system/vkvagent.service"))
    print(f"\nsystemd-analyze security: exposure {exposure}")
    assert exposure <= MAX_EXPOSURE
    assert Path("/var/lib/vkvagent").stat().st_mode & 0o777 == 0o750
    status = run("dpkg-query", "-W", "-f", "${Status} ${Version}", "vkvagent").stdout
    assert status == f"install ok installed {__version__}-1"


@pytest.mark.root
@pytest.mark.parametrize("python", ["3.9.18", "3.13.0"])
def test_the_installed_tree_runs_on_the_oldest_and_newest_python(
    installed_deb: Path, python: str
) -> None:
    done = run_on(python, "scrape", "--file", str(PAGE), "--json")
    out = io.StringIO()
    assert main(["scrape", "--file", str(PAGE), "--json"], out) == 0
    assert json.loads(done.stdout) == json.loads(out.getvalue())
    version = run_on(python, "--version")
    assert version.stdout == f"vkvagent {__version__}\n"
    # No byte-code left behind by another Python (the launcher writes none).
    tag = "cpython-" + "".join(python.split(".")[:2])
    assert not list(Path("/usr/lib/vkvagent").rglob(f"*.{tag}.pyc"))


@pytest.mark.root
def test_the_rpm_installs_and_erases(packages: tuple[Path, Path]) -> None:
    """On this host, without systemd's help (upgrades: in a booted systemd, below)."""
    need_root()
    need("rpm", "systemd-analyze")
    no_vkvagent_installed()
    _deb, package = packages
    conffile, state = Path("/etc/vkvagent/config.toml"), Path("/var/lib/vkvagent")
    # Parents rpm creates that Debian lacks (/usr/share/licenses): removed again at the end.
    parents = [Path(p) for p in ("/usr/share/licenses", "/usr/share/zsh/site-functions",
               "/usr/share/zsh", "/usr/share/bash-completion/completions",
               "/usr/share/bash-completion") if not Path(p).exists()]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vkvagent-rpmdb-") as dbpath:
        rpm = ("rpm", "--dbpath", dbpath)
        try:
            run(*rpm, "-i", "--nodeps", package)
            assert run(*rpm, "-q", "vkvagent").stdout.strip() == f"vkvagent-{__version__}-1.noarch"
            assert run("/usr/bin/vkvagent", "--version").stdout == f"vkvagent {__version__}\n"
            assert unit_checks(Path("/usr/lib/systemd/system/vkvagent.service")) <= MAX_EXPOSURE
            assert state.stat().st_mode & 0o777 == 0o750
            edited = conffile.read_text() + "# edited\n"
            conffile.write_text(edited)
            (state / "ledger.sqlite3").write_bytes(b"the ledger")
            files = run(*rpm, "-ql", "vkvagent").stdout.split()

            run(*rpm, "-e", "vkvagent")
            assert run(*rpm, "-q", "vkvagent", check=False).returncode != 0
            # rpm's way: an edited config is kept as .rpmsave, and the state stays.
            assert Path("/etc/vkvagent/config.toml.rpmsave").read_text() == edited
            assert (state / "ledger.sqlite3").exists()
            shutil.rmtree("/etc/vkvagent")
            shutil.rmtree(state)
            assert leftovers(files) == []
        finally:
            if run(*rpm, "-q", "vkvagent", check=False).returncode == 0:
                run(*rpm, "-e", "--nodeps", "vkvagent", check=False)
            for path in ("/etc/vkvagent", "/var/lib/vkvagent"):
                shutil.rmtree(path, ignore_errors=True)
            for parent in parents:
                with contextlib.suppress(OSError):
                    parent.rmdir()
            forget_man_page()


# -- installed in a booted systemd -------------------------------------------------------------

# Runs under vkvagent.service's own sandbox (its ExecStart replaced by a drop-in), as root
# with what the unit grants. Writes what it found to the state directory as JSON.
PROBE = r"""
import ctypes, errno, json, os, sys
vllm = int(sys.argv[1])
found = {}
def attempt(name, action):
    try:
        action()
        found[name] = "ok"
    except OSError as exc:
        found[name] = errno.errorcode.get(exc.errno, str(exc.errno))
def write(path):
    with open(path, "w") as handle:
        handle.write("x")
    os.unlink(path)
attempt("read environ", lambda: open(f"/proc/{vllm}/environ", "rb").read())
attempt("read cmdline", lambda: open(f"/proc/{vllm}/cmdline", "rb").read())
attempt("write mem", lambda: open(f"/proc/{vllm}/mem", "wb").close())
attempt("write drop-in dir", lambda: write("/etc/systemd/system/vllm.service.d/probe.conf"))
attempt("write Quadlet drop-in dir",
        lambda: write("/etc/containers/systemd/vllm.container.d/probe.conf"))
attempt("write Quadlet dir", lambda: write("/etc/containers/systemd/probe.container"))
attempt("write state", lambda: write("/var/lib/vkvagent/probe"))
attempt("write /etc/vkvagent", lambda: write("/etc/vkvagent/probe.toml"))
attempt("write other drop-in", lambda: write("/etc/systemd/system/probe.conf"))
attempt("write /usr", lambda: write("/usr/lib/vkvagent/probe"))
attempt("setuid", lambda: os.setuid(65534))
libc = ctypes.CDLL(None, use_errno=True)
def ptrace():
    if libc.ptrace(16, vllm, None, None) != 0:  # PTRACE_ATTACH
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
attempt("ptrace", ptrace)
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines()
              if ":\t" in line)
found.update(CapBnd=status["CapBnd"].strip(), CapEff=status["CapEff"].strip(),
             NoNewPrivs=status["NoNewPrivs"].strip(), Seccomp=status["Seccomp"].strip())
with open("/var/lib/vkvagent/probe.json", "w") as handle:
    json.dump(found, handle)
"""
CAP_SYS_PTRACE = f"{1 << 19:016x}"


def install_in(box: Sandbox, deb: Path) -> None:
    box.run("dpkg", "-i", str(deb), timeout=120)
    assert (box.root / "var/lib/vkvagent").is_dir()
    assert box.run("systemctl", "is-enabled", UNIT, check=False).stdout.strip() == "disabled"


def journal(box: Sandbox) -> str:
    return "\n".join(box.messages(UNIT))[-4000:]


def start(box: Sandbox) -> subprocess.CompletedProcess[str]:
    """``systemctl start vkvagent``: for Type=notify it returns once READY=1 arrived."""
    return box.run("systemctl", "start", UNIT, check=False, timeout=90)


def show(box: Sandbox, *names: str) -> dict[str, str]:
    done = box.run("systemctl", "show", UNIT, *(f"--property={n}" for n in names))
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


@pytest.mark.systemd
def test_vkvagent_service_from_the_deb_starts_until_ready(
    sandbox: Sandbox, packages: tuple[Path, Path]
) -> None:
    """The package's unit runs `vkvagent run` under its hardening; `systemctl start` returns
    only after the daemon's READY=1, and it stays up, watched by its watchdog."""
    require()
    install_in(sandbox, packages[0])
    began = time.monotonic()
    started = start(sandbox)
    seconds = time.monotonic() - began
    assert started.returncode == 0, f"{started.stderr}\njournal:\n{journal(sandbox)}"
    print(f"\nvkvagent.service: READY=1 after {seconds:.2f} s")
    state = show(sandbox, "ActiveState", "SubState", "MainPID", "NRestarts", "StatusText",
                 "WatchdogUSec", "Type")  # fmt: skip
    assert (state["ActiveState"], state["SubState"]) == ("active", "running")
    assert state["Type"] == "notify"
    pid = int(state["MainPID"])
    argv = (sandbox.root / f"proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    assert argv[-2:] == [b"/usr/bin/vkvagent", b"run"]
    status = (sandbox.root / f"proc/{pid}/status").read_text()
    assert re.search(rf"^CapBnd:\t{CAP_SYS_PTRACE}$", status, re.M), status
    assert re.search(r"^NoNewPrivs:\t1$", status, re.M)
    assert re.search(r"^Seccomp:\t2$", status, re.M)
    # Its own metrics endpoint serves the series packaging/prometheus/ alerts on.
    wanted = {"vkvagent_info", "vkvagent_verdict", "vkvagent_decisions_total",
              "vkvagent_scrape_errors_total", "vkvagent_window_open", "vkvagent_escalated",
              "vkvagent_restart_budget_remaining", "vkvagent_source_failed",
              "vkvagent_last_evaluation_timestamp_seconds"}  # fmt: skip
    deadline, names = time.monotonic() + 15, set[str]()
    while not wanted <= names and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            _status, body = sandbox.http_get(9849, "/metrics")
            names = set(re.findall(r"^(vkvagent_\w+?)(?:\{| )", body.decode(), re.M))
        time.sleep(0.2)
    assert wanted <= names, f"missing {sorted(wanted - names)}; journal:\n{journal(sandbox)}"
    time.sleep(1)  # still running a moment later: samples taken, no watchdog kill
    again = show(sandbox, "ActiveState", "MainPID", "NRestarts")
    assert (again["ActiveState"], again["MainPID"], again["NRestarts"]) == (
        "active", str(pid), "0"
    ), journal(sandbox)  # fmt: skip
    reloaded = sandbox.run("systemctl", "reload", UNIT, check=False, timeout=30)
    assert reloaded.returncode == 0, reloaded.stderr
    time.sleep(0.5)
    assert show(sandbox, "ActiveState", "MainPID") == {"ActiveState": "active", "MainPID": str(pid)}
    sandbox.run("systemctl", "stop", UNIT, timeout=60)
    assert show(sandbox, "Result")["Result"] == "success", journal(sandbox)


@pytest.mark.systemd
def test_an_invalid_config_fails_the_service_once_instead_of_every_5_s(
    sandbox: Sandbox, packages: tuple[Path, Path]
) -> None:
    """`vkvagent run` exits 78 on what only a person can fix; the unit does not restart it
    (RestartPreventExitStatus=78), where Restart=on-failure alone would try every RestartSec=
    (5 s) forever, the start limit (5 in 10 s) never reached."""
    require()
    install_in(sandbox, packages[0])
    local = sandbox.root / "etc/vkvagent/conf.d/50-broken.toml"
    local.write_text('[policy]\nmode = "sometimes"\n')
    local.chmod(0o644)
    started = start(sandbox)
    assert started.returncode != 0
    time.sleep(6.5)  # past RestartSec=5: a restart would have come by now
    state = show(sandbox, "ActiveState", "Result", "ExecMainStatus", "NRestarts")
    assert state == {
        "ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "78", "NRestarts": "0"
    }, journal(sandbox)  # fmt: skip
    said = [m for m in sandbox.messages(UNIT) if m.startswith("vkvagent: ")]
    assert len(said) == 1 and "sometimes" in said[0], said


@pytest.mark.systemd
def test_the_units_sandbox_grants_what_the_agent_needs_and_nothing_more(
    sandbox: Sandbox, packages: tuple[Path, Path]
) -> None:
    require()
    install_in(sandbox, packages[0])
    (sandbox.root / "usr/local/lib/vkvagent-probe.py").write_text(PROBE)
    vllm = int(sandbox.run("systemctl", "show", "-P", "MainPID", "vllm.service").stdout)
    sandbox.write_unit(
        f"{UNIT}.d/50-probe.conf",
        "[Service]\nType=oneshot\nWatchdogSec=0\nRestart=no\nExecStart=\n"
        f"ExecStart=/usr/bin/python3 -sE /usr/local/lib/vkvagent-probe.py {vllm}\n",
    )
    (sandbox.root / "etc/containers/systemd").mkdir(parents=True)  # podman's, with Quadlet
    sandbox.run("systemctl", "daemon-reload")
    started = start(sandbox)
    assert started.returncode == 0, f"{started.stderr}\njournal:\n{journal(sandbox)}"
    found = json.loads((sandbox.root / "var/lib/vkvagent/probe.json").read_text())
    assert found == {
        "read environ": "ok",  # CAP_SYS_PTRACE: vLLM runs as root with every capability
        "read cmdline": "ok",
        "write mem": "EROFS",  # ReadOnlyPaths=/proc
        "write drop-in dir": "ok",  # created by ExecStartPre=+mkdir on this fresh host
        "write Quadlet drop-in dir": "ok",  # vllm.container.d/, made there too
        "write Quadlet dir": "EROFS",
        "write state": "ok",
        "write /etc/vkvagent": "EROFS",
        "write other drop-in": "EROFS",
        "write /usr": "EROFS",
        "setuid": "EPERM",
        "ptrace": "EPERM",  # the system call filter
        "CapBnd": CAP_SYS_PTRACE,
        "CapEff": CAP_SYS_PTRACE,
        "NoNewPrivs": "1",
        "Seccomp": "2",
    }
    # `config check`'s reading of the installed unit (hardening.py) agrees with what systemd
    # enforced, path by path.
    model = hardening.Sandbox.installed(sandbox.root)
    assert model is not None
    for name, path in (("write drop-in dir", "/etc/systemd/system/vllm.service.d"),
                       ("write Quadlet drop-in dir", "/etc/containers/systemd/vllm.container.d"),
                       ("write Quadlet dir", "/etc/containers/systemd"),
                       ("write state", "/var/lib/vkvagent"),
                       ("write /etc/vkvagent", "/etc/vkvagent"),
                       ("write other drop-in", "/etc/systemd/system"),
                       ("write /usr", "/usr/lib/vkvagent")):  # fmt: skip
        assert (model.access(path) == hardening.WRITE) == (found[name] == "ok"), name


@pytest.mark.systemd
def test_apply_works_under_the_units_sandbox(sandbox: Sandbox, packages: tuple[Path, Path]) -> None:
    """`vkvagent apply`, run with exactly vkvagent.service's privileges, rewrites vLLM's
    command line, restarts it through D-Bus and attests the result."""
    require()
    install_in(sandbox, packages[0])
    local = sandbox.root / "etc/vkvagent/conf.d/50-test.toml"
    local.write_text(
        "[restart]\nready_timeout = 30\njob_timeout = 30\n[gpu]\nenabled = false\n"
        "[vllm.flags]\nmax-num-seqs = 64\n"
    )
    local.chmod(0o644)
    before = sandbox.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout
    sandbox.write_unit(
        f"{UNIT}.d/50-apply.conf",
        "[Service]\nType=oneshot\nWatchdogSec=0\nRestart=no\nExecStart=\n"
        "ExecStart=/usr/bin/vkvagent apply --now --no-drain --reason packaging-test\n",
    )
    sandbox.run("systemctl", "daemon-reload")
    started = start(sandbox)
    assert started.returncode == 0, f"{started.stderr}\njournal:\n{journal(sandbox)}"
    assert re.search(r"^done: restarted with the new flags", journal(sandbox), re.M), journal(
        sandbox
    )
    after = sandbox.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout
    assert after != before
    pid = int(sandbox.run("systemctl", "show", "-P", "MainPID", "vllm.service").stdout)
    argv = (sandbox.root / f"proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    # The flag asked for, and by default the drain's (vLLM 0.32 has --shutdown-timeout).
    assert argv[-4:] == [b"--max-num-seqs", b"64", b"--shutdown-timeout", b"120"]
    dropin = sandbox.root / "etc/systemd/system/vllm.service.d/90-vkvagent.conf"
    assert "--max-num-seqs 64" in dropin.read_text()
    assert dropin.read_text().endswith("\nTimeoutStopSec=150\nKillMode=mixed\n")
    assert (sandbox.root / "var/lib/vkvagent/ledger.sqlite3").exists()


# -- upgrades in a booted systemd, with the service running ------------------------------------

STATE = "var/lib/vkvagent"
DROPIN = "etc/systemd/system/vllm.service.d/90-vkvagent.conf"
# What tells one run of the service from the next, and systemd's own restarts from others.
UNIT_FACTS = ("ActiveState", "SubState", "MainPID", "InvocationID", "NRestarts")
# Where the service's restarts show in its journal (systemd 252's words).
STOPPING, STARTED = f"Stopping {UNIT} - ", f"Started {UNIT} - "
# How the older release's daemon refuses the history this one migrated (tests/test_history.py
# tests the same refusal in this code).
NEWER_HISTORY = re.compile(r"history database schema (\d+) is newer than this vkvagent supports")


def apt(box: Sandbox, *args: str) -> subprocess.CompletedProcess[str]:
    """apt-get as an admin runs it unattended: an edited conffile is kept (--force-confold;
    --force-confdef does the same here, as keeping is dpkg's default answer, and without
    either dpkg asks, and fails the upgrade at the end of its input)."""
    return box.run(
        "apt-get", "-y", "-q", "-o", "Dpkg::Options::=--force-confold", *args,
        env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=180,
    )  # fmt: skip


def as_on_a_host(box: Sandbox) -> None:
    """This host image has a policy-rc.d that forbids starting services (as container images
    do), so deb-systemd-invoke would skip the restart an upgrade asks for: remove it from the
    container's overlay, as a real host has none."""
    (box.root / "usr/sbin/policy-rc.d").unlink(missing_ok=True)


# Reads a database inside the container (SQLite cannot open one through /proc/PID/root: it
# resolves that link to the host's /), read-only: argv is the file and one query; prints the
# column names and the rows as JSON.
QUERY = """
import json, sqlite3, sys
db = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
cursor = db.execute(sys.argv[2])
rows = cursor.fetchall()
print(json.dumps([[c[0] for c in cursor.description or ()], rows]))
"""


def query(box: Sandbox, database: str, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    done = box.run("python3", "-c", QUERY, f"/{STATE}/{database}", sql)
    columns, found = json.loads(done.stdout)
    return columns, [tuple(row) for row in found]


def user_version(box: Sandbox, database: str) -> int:
    return int(query(box, database, "PRAGMA user_version")[1][0][0])


# Every table whose rows an upgrade must keep: the history's and the ledger's.
KEPT_TABLES = (("history.sqlite3", "samples"), ("history.sqlite3", "cache_configs"),
               ("ledger.sqlite3", "actions"), ("ledger.sqlite3", "steps"))  # fmt: skip


def kept_rows(box: Sandbox) -> dict[str, tuple[list[str], list[tuple[Any, ...]]]]:
    return {
        f"{db}:{table}": query(box, db, f"SELECT rowid, * FROM {table} ORDER BY rowid")
        for db, table in KEPT_TABLES
    }


def still_there(box: Sandbox, before: dict[str, tuple[list[str], list[tuple[Any, ...]]]]) -> None:
    """Every row from ``before`` is still there, unchanged in every column it had."""
    for key, (columns, old) in before.items():
        db, table = key.split(":")
        _columns, now = query(box, db, f"SELECT {', '.join(columns)} FROM {table} ORDER BY rowid")
        assert len(now) >= len(old), key
        missing = set(old) - set(now)
        assert not missing, (
            f"{key}: {len(missing)} rows lost or changed, e.g. {next(iter(missing))}"
        )


def samples(box: Sandbox) -> int:
    """How many samples the history holds; 0 before the daemon has made it."""
    try:
        return int(query(box, "history.sqlite3", "SELECT count(*) FROM samples")[1][0][0])
    except SandboxError:  # no file, or no table yet
        return 0


def wait_for(what: str, check: Callable[[], bool], timeout: float, box: Sandbox) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s; journal:\n{journal(box)}")
        time.sleep(0.2)


def status_pid(box: Sandbox) -> str:
    """The PID of the daemon that wrote status.json last, or ""."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        return str(json.loads((box.root / STATE / "status.json").read_text())["pid"])
    return ""


# A call that imported the program while the package manager was replacing its files one by
# one: a mix of two versions' modules (dpkg and rpm rename each file into place; neither
# swaps the tree at once). A launcher with no guard for it (the first release's) ends such a
# call with an import's traceback; a mix that loads may fail later, anywhere, and this tree's
# CLI says so in its one line (once in CI: "TypeError: 'StatusReport' object is not
# iterable"). Both are let through while the package manager runs, nowhere else.
TORN = re.compile(
    r"^(Traceback .*\n(ModuleNotFoundError|ImportError): .*|vkvagent: internal error: [^\n]*)"
    r"\n\Z",
    re.S,
)


class StatusCalls:
    """`vkvagent status --json` called in a loop, in the container, for as long as it runs:
    every call must end with a documented exit code and say something readable."""

    def __init__(self, box: Sandbox) -> None:
        self.box = box
        self.calls: list[tuple[float, subprocess.CompletedProcess[str]]] = []
        self.done = 0.0  # when the package operation ended
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="status-calls")

    def __enter__(self) -> StatusCalls:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            done = self.box.run("vkvagent", "status", "--json", check=False, timeout=30)
            self.calls.append((began, done))
            self._stop.wait(0.1)  # a monitoring check's pace, not a busy loop beside apt

    def check(self) -> int:
        """Every call answered cleanly, except those that started while the package manager
        was replacing the files and failed on the mix (TORN); returns how many did."""
        assert self.done and self.calls, "no status call was made"
        torn = 0
        for began, call in self.calls:
            say = f"exit {call.returncode}\nstdout: {call.stdout[-500:]}\nstderr: {call.stderr}"
            if began < self.done and call.returncode == 1 and TORN.match(call.stderr):
                torn += 1
                continue
            assert call.returncode in (0, 1, 2, 3), say  # status.StatusCode
            assert "Traceback" not in call.stderr and "internal error" not in call.stderr, say
            if call.stdout:
                assert isinstance(json.loads(call.stdout), dict), say
            else:  # no status to show (yet): one line that says why
                assert call.returncode == 3 and len(call.stderr.splitlines()) == 1, say
                assert call.stderr.startswith("vkvagent: "), say
        assert torn < len(self.calls), "every status call failed"
        return torn


def serve_with_old(box: Sandbox, install: Callable[[], object]) -> None:
    """The scene an upgrade meets: OLD_VERSION installed, config.toml edited, a local file in
    conf.d, vLLM's drop-in written by `vkvagent apply`, and the service running long enough
    to have kept samples."""
    as_on_a_host(box)
    install()
    local = box.root / "etc/vkvagent/conf.d/50-test.toml"
    local.write_text(
        "[restart]\nready_timeout = 30\njob_timeout = 30\n[gpu]\nenabled = false\n"
        "[vllm.flags]\nmax-num-seqs = 64\n"
    )
    local.chmod(0o644)
    conffile = box.root / "etc/vkvagent/config.toml"
    shipped = conffile.read_text()
    edited = shipped.replace("# sample_interval = 10.0", "sample_interval = 1.0")
    assert edited != shipped
    conffile.write_text(edited)
    applied = box.run("vkvagent", "apply", "--now", "--no-drain", "--reason", "upgrade-test",
                      check=False, timeout=120)  # fmt: skip
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "--max-num-seqs 64" in (box.root / DROPIN).read_text()
    enabled = box.run("systemctl", "enable", "--now", UNIT, check=False, timeout=90)
    assert enabled.returncode == 0, f"{enabled.stderr}\njournal:\n{journal(box)}"
    wait_for("3 samples kept", lambda: samples(box) >= 3, 30, box)
    pid = show(box, "MainPID")["MainPID"]
    wait_for("a status written", lambda: status_pid(box) == pid, 30, box)


def upgrade_while_running(box: Sandbox, upgrade: Callable[[], object]) -> dict[str, float]:
    """Run ``upgrade`` with the service running and `vkvagent status` called throughout, and
    check what an upgrade must keep and restart. Returns timings."""
    root = box.root
    with tempfile.TemporaryDirectory(prefix="vkvagent-schema-") as fresh:
        with History(fresh):  # the schema this code writes
            pass
        with contextlib.closing(sqlite3.connect(Path(fresh) / "history.sqlite3")) as db:
            new_schema = int(db.execute("PRAGMA user_version").fetchone()[0])
    old_schema = user_version(box, "history.sqlite3")
    assert old_schema < new_schema, "the upgrade would migrate nothing"
    dropin = (root / DROPIN).read_bytes()
    vllm_before = box.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout
    unit_before = show(box, *UNIT_FACTS)
    assert (unit_before["ActiveState"], unit_before["SubState"]) == ("active", "running")
    logged = len(box.messages(UNIT))
    before = kept_rows(box)
    taken = len(before["history.sqlite3:samples"][1])
    assert taken >= 3 and before["ledger.sqlite3:actions"][1], "nothing to keep"

    began = time.monotonic()
    with StatusCalls(box) as during:
        upgrade()
        during.done = time.monotonic()
        upgraded = during.done - began
        # The new daemon has migrated the history, kept a sample in it and written its status.
        pid = show(box, "MainPID")["MainPID"]
        wait_for("the new daemon's status", lambda: status_pid(box) == pid, 30, box)
        wait_for("a sample from the new daemon", lambda: samples(box) > taken, 30, box)
    torn = during.check()

    assert user_version(box, "history.sqlite3") == new_schema
    still_there(box, before)
    unit_after = show(box, *UNIT_FACTS)
    assert (unit_after["ActiveState"], unit_after["SubState"]) == ("active", "running")
    assert unit_after["InvocationID"] != unit_before["InvocationID"]
    assert unit_after["MainPID"] != unit_before["MainPID"]
    assert unit_after["NRestarts"] == unit_before["NRestarts"]  # restarted by the upgrade only
    said = box.messages(UNIT)[logged:]
    stops = [m for m in said if m.startswith(STOPPING)]
    starts = [m for m in said if m.startswith(STARTED)]
    assert (len(stops), len(starts)) == (1, 1), "\n".join(said)
    assert (root / DROPIN).read_bytes() == dropin
    vllm_after = box.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout
    assert vllm_after == vllm_before, "the upgrade restarted vLLM"
    after = box.run("vkvagent", "status", "--json", check=False)
    assert after.returncode in (0, 1, 2, 3), after.stderr
    assert json.loads(after.stdout)["unit_name"] == "vllm.service"
    return {"upgrade": upgraded, "status calls": len(during.calls), "torn": torn}


def downgrade_refused(box: Sandbox, downgrade: Callable[[], object]) -> None:
    """Back to OLD_VERSION over this version's state: the package goes in, but the older
    daemon refuses the newer history in one line, before writing a byte (OLD_VERSION exits 1,
    which Restart=on-failure retries; later versions exit 78, which the unit does not); vLLM
    and its drop-in stay as they are, and `vkvagent status` still answers cleanly."""
    schema = user_version(box, "history.sqlite3")
    before = kept_rows(box)
    dropin = (box.root / DROPIN).read_bytes()
    vllm = box.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout
    logged = len(box.messages(UNIT))
    with StatusCalls(box) as during:
        downgrade()
        during.done = time.monotonic()
        wait_for("the older daemon's refusal",
                 lambda: any(NEWER_HISTORY.search(m) for m in box.messages(UNIT)[logged:]),
                 30, box)  # fmt: skip
    during.check()
    said = box.messages(UNIT)[logged:]
    refusals = [m for m in said if NEWER_HISTORY.search(m)]
    assert refusals[0].startswith("vkvagent: ") and "\n" not in refusals[0], refusals
    assert NEWER_HISTORY.search(refusals[0]).group(1) == str(schema)  # type: ignore[union-attr]
    assert show(box, "ActiveState")["ActiveState"] != "active"
    assert user_version(box, "history.sqlite3") == schema  # not migrated back, nor damaged
    still_there(box, before)
    assert (box.root / DROPIN).read_bytes() == dropin
    assert box.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout == vllm


@pytest.mark.systemd
def test_a_deb_upgrade_from_the_first_release_keeps_config_state_and_vllm_and_restarts_once(
    sandbox: Sandbox, old_packages: tuple[Path, Path], newer_packages: tuple[Path, Path]
) -> None:
    """apt-get from OLD_VERSION (its own code) to this one, the service running; then a
    downgrade, a removal and a purge."""
    require()
    began = time.monotonic()
    old, new = sandbox.put(old_packages[0]), sandbox.put(newer_packages[0])
    serve_with_old(sandbox, lambda: install_in(sandbox, Path(old)))
    conffile = sandbox.root / "etc/vkvagent/config.toml"
    edited = conffile.read_text()
    timings = upgrade_while_running(sandbox, lambda: apt(sandbox, "install", new))
    status = sandbox.run("dpkg-query", "-W", "-f", "${Status} ${Version}", "vkvagent").stdout
    assert status == f"install ok installed {NEWER}-1"
    # An edited conffile whose shipped default changed: --force-confold keeps the edit, and the
    # new default is left beside it.
    assert conffile.read_text() == edited
    dist = conffile.with_name("config.toml.dpkg-dist")
    assert dist.read_text().startswith("# vkvagent's configuration.")
    assert dist.read_text() != edited
    assert (sandbox.root / "etc/vkvagent/conf.d/50-test.toml").exists()
    downgrade_refused(sandbox, lambda: apt(sandbox, "--allow-downgrades", "install", old))
    apt(sandbox, "install", new)  # back: the newer reads its state again
    wait_for("the service back", lambda: show(sandbox, "ActiveState")["ActiveState"] == "active",
             30, sandbox)  # fmt: skip

    vllm = sandbox.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout
    dropin = (sandbox.root / DROPIN).read_bytes()
    apt(sandbox, "remove", "vkvagent")  # keeps configuration and state
    assert show(sandbox, "ActiveState")["ActiveState"] == "inactive"
    assert conffile.read_text() == edited
    assert (sandbox.root / STATE / "ledger.sqlite3").exists()
    assert not (sandbox.root / "usr/bin/vkvagent").exists()
    assert not (sandbox.root / "usr/lib/vkvagent").exists()  # the byte-code went too
    apt(sandbox, "install", new)
    listed = sandbox.run("dpkg", "-L", "vkvagent").stdout.split()
    purged = apt(sandbox, "purge", "vkvagent")
    assert "90-vkvagent.conf is kept" in purged.stdout + purged.stderr, purged
    assert sandbox.run("dpkg-query", "-W", "vkvagent", check=False).returncode != 0
    assert leftovers(listed, sandbox.root) == []
    # vLLM's command line depends on its drop-in: no removal touches it, or vLLM.
    assert (sandbox.root / DROPIN).read_bytes() == dropin
    assert sandbox.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout == vllm
    print(
        f"\ndeb: upgrade {timings['upgrade']:.1f} s ({timings['status calls']:.0f} status "
        f"calls, {timings['torn']:.0f} torn), all of it {time.monotonic() - began:.1f} s"
    )


@pytest.mark.systemd
def test_an_rpm_upgrade_from_the_first_release_keeps_config_state_and_vllm_and_restarts_once(
    sandbox: Sandbox, old_packages: tuple[Path, Path], newer_packages: tuple[Path, Path]
) -> None:
    """The same with rpm -U (this host's rpm, its database in the container, --nodeps: the
    container is Debian), so the scriptlets run with systemd up; then a downgrade
    (--oldpackage) and an erase."""
    require()
    need("rpm")
    began = time.monotonic()
    old, new = sandbox.put(old_packages[1]), sandbox.put(newer_packages[1])
    rpm = ("rpm", "--dbpath", "/root/rpmdb")
    sandbox.run("mkdir", "/root/rpmdb")

    def install() -> None:
        sandbox.run(*rpm, "-i", "--nodeps", old, timeout=120)
        assert (sandbox.root / STATE).is_dir()

    serve_with_old(sandbox, install)
    conffile = sandbox.root / "etc/vkvagent/config.toml"
    edited = conffile.read_text()
    # The restart comes from the %postun of the package being replaced (rpm runs the old
    # package's scriptlets last, after the new one's files are in place).
    timings = upgrade_while_running(
        sandbox, lambda: sandbox.run(*rpm, "-U", "--nodeps", new, timeout=120)
    )
    query = sandbox.run(*rpm, "-q", "vkvagent").stdout.strip()
    assert query == f"vkvagent-{NEWER}-1.noarch"
    assert conffile.read_text() == edited  # %config(noreplace), the new default beside it
    rpmnew = conffile.with_name("config.toml.rpmnew")
    assert rpmnew.read_text().startswith("# vkvagent's configuration.")
    assert rpmnew.read_text() != edited

    downgrade_refused(
        sandbox, lambda: sandbox.run(*rpm, "-U", "--nodeps", "--oldpackage", old, timeout=120)
    )
    sandbox.run(*rpm, "-U", "--nodeps", new, timeout=120)
    wait_for("the service back", lambda: show(sandbox, "ActiveState")["ActiveState"] == "active",
             30, sandbox)  # fmt: skip

    vllm = sandbox.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout
    dropin = (sandbox.root / DROPIN).read_bytes()
    files = sandbox.run(*rpm, "-ql", "vkvagent").stdout.split()
    sandbox.run(*rpm, "-e", "--nodeps", "vkvagent", timeout=120)
    assert show(sandbox, "ActiveState")["ActiveState"] == "inactive"
    assert sandbox.run("systemctl", "is-enabled", UNIT, check=False).stdout.strip() != "enabled"
    # rpm's way: an edited config is kept as .rpmsave, and the state stays.
    assert conffile.with_name("config.toml.rpmsave").read_text() == edited
    assert (sandbox.root / STATE / "ledger.sqlite3").exists()
    sandbox.run("rm", "-rf", "/etc/vkvagent", f"/{STATE}")
    assert leftovers(files, sandbox.root) == []
    assert (sandbox.root / DROPIN).read_bytes() == dropin
    assert sandbox.run("systemctl", "show", "-P", "InvocationID", "vllm.service").stdout == vllm
    print(
        f"\nrpm: upgrade {timings['upgrade']:.1f} s ({timings['status calls']:.0f} status "
        f"calls, {timings['torn']:.0f} torn), all of it {time.monotonic() - began:.1f} s"
    )
