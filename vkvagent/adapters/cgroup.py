"""The vLLM unit's cgroup: its anonymous memory, from ``memory.stat`` (cgroup v2), and the
processes in it (a container's too, when its engine keeps them in the unit's cgroup); a
container's own cgroup when its engine keeps it elsewhere (Docker's ``docker-ID.scope``).

systemd's ``MemoryCurrent`` is the cgroup's whole charge, page cache included: the log lines
vLLM writes per request, or a file-backed KV-offload store, fill the cache as the server
serves and look like a leak. ``anon`` counts only anonymous memory, which is what a leak
holds. A plain file read, no D-Bus; the cgroup root is an argument, so tests point it at a
directory of their own.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"  # where cgroup v2 is mounted
MAX_STAT_BYTES = 64 * 1024  # a memory.stat is a few KB; anything longer is not one
_MAX_DIGITS = 20  # 2**64 - 1; also keeps int() clear of Python's limit on long digit strings


def read_anon(control_group: str, root: str | Path = CGROUP_ROOT) -> int | None:
    """Bytes of anonymous memory charged to ``control_group`` (systemd's ControlGroup, e.g.
    ``/system.slice/vllm.service``) and the cgroups below it: the ``anon`` line of
    ``ROOT/CONTROL_GROUP/memory.stat``.

    ``anon`` is memory in private anonymous mappings: heaps (brk, malloc), the processes' and
    threads' stacks, ``mmap(MAP_PRIVATE | MAP_ANONYMOUS)``. It leaves out the page cache
    (``file``: files read or written, logs among them), shared memory and tmpfs (``shmem``,
    counted under ``file``), kernel memory (``kernel_stack``, ``pagetables``, ``slab``,
    ``sock``) and anonymous pages swapped out.

    None when it cannot be read: no control group, cgroup v1 (no such file, or no ``anon``
    line), the memory controller off for the unit, no permission, a file longer than
    ``MAX_STAT_BYTES`` or a value that is not a whole number. Never raises."""
    data = _read(control_group, "memory.stat", root)
    for line in (data or b"").split(b"\n"):
        key, _, value = line.partition(b" ")
        if key == b"anon":
            return _number(value)
    return None


def read_memory(
    control_group: str, root: str | Path = CGROUP_ROOT
) -> tuple[int | None, int | None]:
    """``memory.current`` and ``memory.max`` of ``control_group``: what systemd reports as a
    unit's MemoryCurrent and MemoryMax, read for a cgroup that is no unit's (a container's
    scope); None where unreadable, and for a limit of ``max``. Never raises."""
    current, limit = (_read(control_group, name, root) for name in ("memory.current", "memory.max"))
    return _number(current or b""), _number(limit or b"")


def _read(control_group: str, name: str, root: str | Path) -> bytes | None:
    """The first MAX_STAT_BYTES of ``ROOT/CONTROL_GROUP/NAME``; None when unreadable, longer,
    or when ``control_group`` is not one (""), or would leave the cgroup tree."""
    parts = control_group.strip("/").split("/")
    if not control_group.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return None
    try:
        with open(Path(root).joinpath(*parts, name), "rb") as file:
            data = file.read(MAX_STAT_BYTES + 1)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    return data if len(data) <= MAX_STAT_BYTES else None


def _number(value: bytes) -> int | None:
    digits = value.strip()
    return int(digits) if digits.isdigit() and len(digits) <= _MAX_DIGITS else None


def systemd_paths(text: str) -> list[str]:
    """The cgroup paths a ``/proc/PID/cgroup`` text gives systemd's hierarchy: the cgroup v2
    line (``0::/system.slice/vllm.service``) or cgroup v1's ``name=systemd`` one."""
    paths = []
    for line in text.splitlines():
        _id, _colon, rest = line.partition(":")
        controllers, colon, path = rest.partition(":")
        if colon and controllers in ("", "name=systemd"):
            paths.append(path)
    return paths


def below(path: str, root: str) -> bool:
    """Whether cgroup ``path`` is ``root`` or inside it."""
    root = root.rstrip("/")
    return path == root or path.startswith(root + "/")


def pids_in(control_group: str, proc: Path = Path("/proc")) -> list[int]:
    """The processes in ``control_group`` or below it, oldest PID first, by each process's
    ``/proc/PID/cgroup`` (which cgroup v1 and v2 both have); [] without a control group."""
    if not control_group.startswith("/"):
        return []
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cgroup").read_text("utf-8", "replace")
        except OSError:
            continue  # gone, or not ours to read
        if any(below(path, control_group) for path in systemd_paths(text)):
            found.append(int(entry.name))
    return sorted(found)
