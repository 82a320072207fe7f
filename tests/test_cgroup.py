"""adapters.cgroup: the unit's anonymous memory from memory.stat, under a cgroup root of the
test's own; unreadable in every way gives None, never an exception."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vkvagent.adapters.cgroup import MAX_STAT_BYTES, pids_in, read_anon

UNIT = "/system.slice/vllm.service"
ANON = 6_442_450_944  # 6 GiB: heap and stacks of the API server and engine processes
FILE = 9_663_676_416  # page cache: logs, model files read at start

# A cgroup v2 memory.stat as a 6.x kernel writes it (every key, in the kernel's order), of a
# vLLM unit whose page cache (file) is larger than its anonymous memory.
MEMORY_STAT = f"""\
anon {ANON}
file {FILE}
kernel 201326592
kernel_stack 14680064
pagetables 62914560
sec_pagetables 0
percpu 24576
sock 4096
vmalloc 0
shmem 1073741824
zswap 0
zswapped 0
file_mapped 2147483648
file_dirty 409600
file_writeback 0
swapcached 0
anon_thp 2097152
file_thp 0
shmem_thp 0
inactive_anon 1610612736
active_anon 5905580032
inactive_file 4294967296
active_file 4294967296
unevictable 0
slab_reclaimable 96468992
slab_unreclaimable 25165824
slab 121634816
workingset_refault_anon 0
workingset_refault_file 1024
workingset_activate_anon 0
workingset_activate_file 512
workingset_restore_anon 0
workingset_restore_file 128
workingset_nodereclaim 0
pgscan 0
pgsteal 0
pgscan_kswapd 0
pgscan_direct 0
pgscan_khugepaged 0
pgsteal_kswapd 0
pgsteal_direct 0
pgsteal_khugepaged 0
pgfault 48219034
pgmajfault 3301
pgrefill 0
pgactivate 15632
pgdeactivate 0
pglazyfree 0
pglazyfreed 0
zswpin 0
zswpout 0
zswpwb 0
thp_fault_alloc 211
thp_collapse_alloc 4
thp_swpout 0
thp_swpout_fallback 0
"""

# The same cgroup under cgroup v1 (memory controller at /sys/fs/cgroup/memory): no anon line.
MEMORY_STAT_V1 = """\
cache 9663676416
rss 6442450944
rss_huge 2097152
shmem 1073741824
mapped_file 2147483648
dirty 409600
writeback 0
total_cache 9663676416
total_rss 6442450944
total_inactive_anon 1610612736
total_active_anon 5905580032
"""


def cgroup_root(tmp_path: Path, stat: str | bytes, unit: str = UNIT) -> Path:
    directory = tmp_path.joinpath(*unit.strip("/").split("/"))
    directory.mkdir(parents=True)
    data = stat.encode() if isinstance(stat, str) else stat
    (directory / "memory.stat").write_bytes(data)
    return tmp_path


def test_anon_is_read_from_the_units_memory_stat(tmp_path: Path) -> None:
    root = cgroup_root(tmp_path, MEMORY_STAT)
    assert read_anon(UNIT, root) == ANON
    assert read_anon(UNIT, str(root)) == ANON
    assert read_anon(UNIT + "/", root) == ANON


def test_anon_is_the_anon_line_not_another_with_anon_in_its_name(tmp_path: Path) -> None:
    """inactive_anon, active_anon, anon_thp come after it, or before it in another order."""
    lines = MEMORY_STAT.splitlines()
    reordered = "\n".join([*lines[1:], lines[0]]) + "\n"
    assert read_anon(UNIT, cgroup_root(tmp_path, reordered)) == ANON


def test_no_anon_without_a_readable_cgroup_v2_memory_stat(tmp_path: Path) -> None:
    assert read_anon(UNIT, tmp_path) is None  # no such cgroup
    assert read_anon("", tmp_path) is None  # the unit has no cgroup (not running)
    v1 = cgroup_root(tmp_path / "v1", MEMORY_STAT_V1)
    assert read_anon(UNIT, v1) is None  # cgroup v1: no anon line
    (tmp_path / "dir" / "system.slice" / "vllm.service" / "memory.stat").mkdir(parents=True)
    assert read_anon(UNIT, tmp_path / "dir") is None  # not a file
    (tmp_path / "file").write_text("")
    assert read_anon(UNIT, tmp_path / "file") is None  # the root is not a directory


@pytest.mark.parametrize(
    "stat",
    [
        "",
        "anon\n",
        "anon \n",
        "anon -4096\n",
        "anon 4096.0\n",
        "anon 0x1000\n",
        "anon 4_096\n",
        "anon +4096\n",
        "anon 4096 bytes\n",
        "anon " + "9" * 21 + "\n",  # beyond 2**64
        "anon " + "9" * 5000 + "\n",  # past Python's limit on int() of digit strings
        "anon \uff14\uff10\uff19\uff16\n",  # fullwidth digits: str.isdigit() takes them
        b"anon \xff\xfe\n",
        b"\x00" * 100,
        "file 4096\nshmem 0\n",
    ],
)
def test_garbage_is_no_anon(tmp_path: Path, stat: str | bytes) -> None:
    assert read_anon(UNIT, cgroup_root(tmp_path, stat)) is None


def test_a_file_longer_than_a_memory_stat_is_no_anon(tmp_path: Path) -> None:
    padded = MEMORY_STAT + "x" * MAX_STAT_BYTES
    assert read_anon(UNIT, cgroup_root(tmp_path / "big", padded)) is None
    exactly = MEMORY_STAT + "y" * (MAX_STAT_BYTES - len(MEMORY_STAT))
    assert read_anon(UNIT, cgroup_root(tmp_path / "at-limit", exactly)) == ANON


def test_a_control_group_that_would_leave_the_root_is_refused(tmp_path: Path) -> None:
    cgroup_root(tmp_path, MEMORY_STAT, "/outside")
    root = tmp_path / "cgroup"
    root.mkdir()
    for name in ("/../outside", "/system.slice/../../outside", "../outside", "outside", "/"):
        assert read_anon(name, root) is None, name
    assert read_anon("/system.slice//vllm.service", tmp_path) is None
    assert read_anon("/system.slice/./vllm.service", tmp_path) is None
    assert read_anon("/with\0nul", tmp_path) is None


def test_an_unreadable_memory_stat_is_no_anon(tmp_path: Path) -> None:
    """As a user who may not read it; root may read any file, so a child process drops to
    nobody first."""
    root = cgroup_root(tmp_path, MEMORY_STAT)
    (root / "system.slice" / "vllm.service" / "memory.stat").chmod(0)
    if os.geteuid() != 0:
        assert read_anon(UNIT, root) is None
        return
    pid = os.fork()
    if pid == 0:  # the child
        code = 2
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = 0 if read_anon(UNIT, root) is None else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_processes_in_a_units_cgroup_by_their_proc_entries(tmp_path: Path) -> None:
    """A /proc as podman with --cgroups=split leaves it (the container below the unit), and as
    Docker leaves it (its own docker-ID.scope): cgroup v2 and v1 (name=systemd) lines."""
    unit = "/system.slice/vllm.service"
    entries = {
        "101": f"0::{unit}\n",  # podman, the unit's MainPID
        "102": f"0::{unit}/libpod-payload-abc\n",  # vLLM in the container, split below the unit
        "103": "12:memory:/x\n1:name=systemd:/system.slice/vllm.service\n",  # cgroup v1
        "201": "0::/system.slice/docker-abc.scope\n",  # vLLM under Docker: not the unit's
        "202": "0::/system.slice/vllm.service-other\n",  # a name that only starts like it
        "self": f"0::{unit}\n",  # not a PID
    }
    for pid, text in entries.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cgroup").write_text(text)
    (tmp_path / "301").mkdir()  # gone before its cgroup could be read
    assert pids_in(unit, tmp_path) == [101, 102, 103]
    assert pids_in("", tmp_path) == []
