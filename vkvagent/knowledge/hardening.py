"""What the hardened vkvagent.service lets the daemon touch, and what a configuration asks of it.

The unit is the one source: its sandbox (``ProtectSystem=``, ``ProtectHome=``, ``PrivateTmp=``,
``ReadWritePaths=``, ``StateDirectory=``, ...) is read from the unit file and its drop-ins as
installed, so a drop-in the operator added counts, and nothing here repeats the unit's list.
``refusals()`` names each setting whose path the sandbox refuses (another ``[vllm] unit``, a
``state_dir``, a ``[metrics] textfile`` directory, a hook's program and the paths it is given),
and ``dropin()`` writes the drop-in that allows them. Root needs no polkit rule to manage any
unit over D-Bus, so a unit's drop-in directory is all another unit name needs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vkvagent.knowledge.config import Config

UNIT = "vkvagent.service"
# Where systemd looks for a unit file, first match wins (systemd.unit(5), the system manager).
UNIT_PATH = ("etc/systemd/system", "run/systemd/system", "usr/lib/systemd/system",
             "lib/systemd/system")  # fmt: skip
# Where the agent writes vLLM's drop-in, and where the operator's drop-ins for this unit go.
SYSTEMD_DIR = "/etc/systemd/system"
# Quadlet's directories, and the administrator's, where a `.container` file's drop-ins go.
QUADLET_DIRS = ("/etc/containers/systemd", "/run/containers/systemd",
                "/usr/share/containers/systemd")  # fmt: skip
QUADLET_DIR = QUADLET_DIRS[0]
ROOT = Path("/")  # below which the installed unit is looked for
DROPIN = f"{SYSTEMD_DIR}/{UNIT}.d/50-paths.conf"

WRITE, READ, HIDDEN, PRIVATE = "writable", "read-only", "hidden", "private"
# The directories each *Directory= setting's names are below.
_DIRECTORIES = {"StateDirectory": "/var/lib", "CacheDirectory": "/var/cache",
                "LogsDirectory": "/var/log", "RuntimeDirectory": "/run",
                "ConfigurationDirectory": "/etc"}  # fmt: skip
_PROTECT_SYSTEM = {"strict": ("/",), "full": ("/usr", "/boot", "/efi", "/etc"),
                   "yes": ("/usr", "/boot", "/efi")}  # fmt: skip
_HOME = ("/home", "/root", "/run/user")
_TMP = ("/tmp", "/var/tmp")
# Programs and libraries: a hook reads them; a drop-in never opens them for writing.
_PROGRAMS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/boot", "/efi")
_TRUE = ("1", "yes", "y", "true", "t", "on")


@dataclass(frozen=True)
class Sandbox:
    """The file-system view of a unit's [Service] section."""

    files: tuple[Path, ...]  # the unit file, then its drop-ins, as read
    protect_system: str = "no"
    protect_home: str = "no"
    private_tmp: bool = False
    read_write: tuple[str, ...] = ()  # ReadWritePaths= and the *Directory= settings
    read_only: tuple[str, ...] = ()
    inaccessible: tuple[str, ...] = ()

    @classmethod
    def parse(cls, files: Sequence[Path]) -> Sandbox:
        """The sandbox of a unit file followed by its drop-ins (later settings win; an empty
        list assignment resets the list, as systemd reads them)."""
        single: dict[str, str] = {}
        lists: dict[str, list[str]] = {}
        for file in files:
            for key, value in _service_settings(file.read_text(encoding="utf-8")):
                if key in ("ProtectSystem", "ProtectHome", "PrivateTmp"):
                    single[key] = "yes" if value.lower() in _TRUE else value.lower()
                elif key in ("ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", *_DIRECTORIES):
                    words = lists.setdefault(key, [])
                    words[:] = [*words, *_paths(value)] if value else []
        owned = [
            f"{_DIRECTORIES[key]}/{name}" for key in _DIRECTORIES for name in lists.get(key, ())
        ]
        return cls(
            files=tuple(files),
            protect_system=single.get("ProtectSystem", "no"),
            protect_home=single.get("ProtectHome", "no"),
            private_tmp=single.get("PrivateTmp", "no") == "yes",
            read_write=(*lists.get("ReadWritePaths", ()), *owned),
            read_only=tuple(lists.get("ReadOnlyPaths", ())),
            inaccessible=tuple(lists.get("InaccessiblePaths", ())),
        )

    @classmethod
    def installed(cls, root: Path | None = None) -> Sandbox | None:
        """The sandbox of vkvagent.service as systemd would load it below ``root``: the first
        unit file on its search path and every ``vkvagent.service.d/*.conf`` (by name, the
        earlier directory winning a name). None when the unit is not installed or cannot be
        read."""
        root = ROOT if root is None else root
        unit = next((root / d / UNIT for d in UNIT_PATH if (root / d / UNIT).is_file()), None)
        if unit is None:
            return None
        dropins: dict[str, Path] = {}
        for directory in reversed(UNIT_PATH):
            folder = root / directory / f"{UNIT}.d"
            if folder.is_dir():
                dropins.update((p.name, p) for p in folder.glob("*.conf") if p.is_file())
        try:
            return cls.parse([unit, *(dropins[name] for name in sorted(dropins))])
        except (OSError, UnicodeDecodeError):  # not root's to read: the check is skipped
            return None

    def access(self, path: str) -> str:
        """What the daemon may do at ``path`` (absolute): WRITE, READ, HIDDEN (it sees an
        empty or no directory) or PRIVATE (its own /tmp, which no other process sees). The
        most specific rule wins, as systemd's mounts nest."""
        rules: list[tuple[str, int, str]] = [("/", 0, WRITE)]
        rules += [(p, 1, READ) for p in _PROTECT_SYSTEM.get(self.protect_system, ())]
        if self.protect_home in ("yes", "tmpfs", "read-only"):
            kind = READ if self.protect_home == "read-only" else HIDDEN
            rules += [(p, 1, kind) for p in _HOME]
        if self.private_tmp:
            rules += [(p, 1, PRIVATE) for p in _TMP]
        rules += [(p, 2, WRITE) for p in self.read_write]
        rules += [(p, 3, READ) for p in self.read_only]
        rules += [(p, 4, HIDDEN) for p in self.inaccessible]
        normal = os.path.normpath(os.path.join("/", path))
        found = [
            (len(prefix), rank, kind)
            for prefix, rank, kind in ((os.path.normpath(p), r, k) for p, r, k in rules)
            if _below(normal, prefix)
        ]
        return max(found)[2]

    def why(self, path: str) -> str:
        """The setting that gives ``path`` its access, for people."""
        kind = self.access(path)
        normal = os.path.normpath(os.path.join("/", path))
        if kind == HIDDEN and any(_below(normal, p) for p in self.inaccessible):
            return "InaccessiblePaths="
        if kind == HIDDEN:
            return f"ProtectHome={self.protect_home}"
        if kind == PRIVATE:
            return "PrivateTmp=yes"
        if any(_below(normal, p) for p in self.read_only):
            return "ReadOnlyPaths="
        return f"ProtectSystem={self.protect_system}"


@dataclass(frozen=True)
class Refusal:
    """A setting whose path the sandbox refuses, and the ReadWritePaths= entry that would
    allow it (None where no drop-in should: move the file instead)."""

    key: str  # e.g. metrics.textfile
    message: str  # one line
    grant: str | None = None
    mkdir: bool = False  # the directory may not exist yet: the drop-in makes it first
    maybe: bool = False  # only if the hook writes there: vkvagent cannot tell


def refusals(cfg: Config, sandbox: Sandbox) -> list[Refusal]:
    """Each setting of ``cfg`` that ``sandbox`` refuses, in the configuration's order."""
    unit_dir = f"{SYSTEMD_DIR}/{cfg.vllm.unit}.d"
    found = _writable(
        sandbox, "vllm.unit", cfg.vllm.unit, unit_dir, f"its drop-in directory {unit_dir}"
    )
    name = cfg.vllm.unit.rsplit(".", 1)[0] + ".container"
    if any(os.path.exists(os.path.join(d, name)) for d in QUADLET_DIRS):  # vLLM runs by Quadlet
        found += _writable(
            sandbox, "vllm.unit", cfg.vllm.unit, f"{QUADLET_DIR}/{name}.d",
            f"the drop-in directory {QUADLET_DIR}/{name}.d of its Quadlet file",
        )  # fmt: skip
    found = [dataclasses.replace(r, mkdir=True) for r in found]  # made on a fresh host too
    found += _writable(sandbox, "agent.state_dir", cfg.agent.state_dir, cfg.agent.state_dir, "it")
    if cfg.metrics.textfile:
        folder = os.path.dirname(os.path.join("/", cfg.metrics.textfile))
        found += _writable(
            sandbox, "metrics.textfile", cfg.metrics.textfile, folder, "its directory"
        )
    readable = [("gpu.recording", cfg.gpu.recording if cfg.gpu.enabled else "")]
    readable += [(f"fleet.{key}", getattr(cfg.fleet, key))
                 for key in ("ca_file", "cert_file", "key_file", "password_file")]  # fmt: skip
    for hook in ("pre_stop", "post_ready"):
        argv = getattr(cfg.restart, hook)
        if argv:
            readable.append((f"restart.{hook}", argv[0]))
            for path in _path_arguments(argv[1:]):
                place = path if os.path.isdir(path) else os.path.dirname(path)
                what = "it" if place == path else "its directory"
                found += _writable(sandbox, f"restart.{hook}", path, place, what, maybe=True)
    for key, path in readable:
        if path and sandbox.access(path) in (HIDDEN, PRIVATE):
            found.append(Refusal(key, _unseen(sandbox, path)))
    return found


def dropin(found: Iterable[Refusal]) -> str | None:
    """The drop-in that allows what ``found`` names (None: nothing a drop-in can allow)."""
    lines = ["[Service]"]
    for refusal in found:
        if refusal.grant is None:
            continue
        if refusal.maybe:
            lines.append(f"# {refusal.key}: only if it writes there")
        if refusal.mkdir:  # with full privileges ("+"), before the sandbox is set up
            lines.append(f"ExecStartPre=+/bin/mkdir -p {_quoted(refusal.grant)}")
        # "-": a directory that does not exist is skipped rather than failing the start.
        entry = f"ReadWritePaths=-{_quoted(refusal.grant)}"
        if entry not in lines:
            lines.append(entry)
    return "\n".join(lines) + "\n" if len(lines) > 1 else None


def _writable(
    sandbox: Sandbox, key: str, value: str, place: str, what: str, *, maybe: bool = False
) -> list[Refusal]:
    """The refusal when ``key`` = ``value`` needs to write ``place`` (``what``, for people);
    ``maybe``: only if a hook writes there, which vkvagent cannot know."""
    kind = sandbox.access(place)
    if kind == WRITE:
        return []
    if kind in (HIDDEN, PRIVATE):
        return [Refusal(key, _unseen(sandbox, place), maybe=maybe)]
    said = f"{value}: {UNIT} cannot write {what} ({sandbox.why(place)})"
    if maybe:
        said = f"{value}: if the hook writes there, {UNIT} refuses it ({sandbox.why(place)})"
    return [Refusal(key, said, grant=place, maybe=maybe)]


def _unseen(sandbox: Sandbox, path: str) -> str:
    return f"{path}: {UNIT} cannot see it ({sandbox.why(path)}): move it elsewhere"


def _path_arguments(argv: Sequence[str]) -> list[str]:
    """Absolute paths among a hook's arguments, alone or as ``--option=PATH``, that it may
    write: not programs (a script given to its interpreter) nor the system's own trees."""
    found = []
    for word in argv:
        value = word.split("=", 1)[1] if word.startswith("-") and "=" in word else word
        if not value.startswith("/") or "\n" in value:
            continue
        path = os.path.normpath(value)
        if any(_below(path, top) for top in _PROGRAMS):
            continue
        if os.path.isfile(path) and os.access(path, os.X_OK):
            continue
        found.append(path)
    return found


def _below(path: str, prefix: str) -> bool:
    return prefix in ("/", path) or path.startswith(prefix + "/")


def _quoted(path: str) -> str:
    """A path as a unit file reads it back: "%" is a specifier, whitespace splits words."""
    path = path.replace("%", "%%")
    if re.search(r'[\s"\'\\]', path):
        return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return path


def _service_settings(text: str) -> Iterable[tuple[str, str]]:
    """(key, value) of each assignment in a unit file's [Service] sections, continuation
    lines joined, comments skipped."""
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service" and "=" in line:
            key, _eq, value = line.partition("=")
            yield key.strip(), value.strip()


def _words(value: str) -> list[str]:
    return [w.replace("%%", "%") for w in re.findall(r'"(?:[^"\\]|\\.)*"|\S+', value)]


def _paths(value: str) -> list[str]:
    """ReadWritePaths= words: "-" (ignore a missing path) and "+" (below RootDirectory=)
    prefixes dropped, quotes removed."""
    return [w.lstrip("-+").strip('"') for w in _words(value)]
