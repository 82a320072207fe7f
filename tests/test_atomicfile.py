"""A write that fails on a full file system keeps the old version and leaves no temporary."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from vkvagent.atomicfile import write_atomically


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 64 KiB tmpfs, the size of a state directory that filled up."""
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("mounting a tmpfs needs root")
    assert os.geteuid() == 0, "CI runs these as root; they must not skip there"
    mount = tmp_path / "state"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.root
def test_a_write_that_fills_the_disk_leaves_the_old_file_and_no_temporary(full_disk: Path) -> None:
    status = full_disk / "status.json"
    write_atomically(status, '{"ok": true}\n', 0o644)

    with pytest.raises(OSError) as failed:
        write_atomically(status, "x" * (256 * 1024), 0o644)

    assert failed.value.errno == errno.ENOSPC
    assert status.read_text() == '{"ok": true}\n'
    assert sorted(p.name for p in full_disk.iterdir()) == ["status.json"]
