"""Files written whole or not at all: the drop-in, the state, the status and the controls.

A reader (systemd, ``vkvagent status``, the next daemon) sees the old version or the new one,
never a part, whatever kills the writer.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomically(path: Path, text: str, mode: int) -> None:
    """Write ``path`` through a fsynced temporary file renamed over it: a crash leaves the old
    version or the new one, never a part (the temporary's name is one systemd does not load)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:  # a full disk, say: the old version stays, and no temporary
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    fsync_dir(path.parent)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a killed writer
        with contextlib.suppress(OSError):
            stale.unlink()


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
