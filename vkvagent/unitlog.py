"""What the unit itself said: its journal since a moment, and the line of it that says why vLLM
would not start.

vLLM prints its reason for refusing to start somewhere in a traceback of a hundred lines, often
in another process than the one that exits: a worker's ``ValueError`` comes first, then the
engine core's and the API server's wrappers around it (``Engine core initialization failed.
See root cause above.``). The root cause is the first error line that is not such a wrapper.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable

MAX_LINE = 500  # an error line cut to this many characters: it goes into events and the ledger

# vLLM's logger prefix: "(EngineCore pid=12) ERROR 12-01 15:51:12 [core.py:1510] ".
_PREFIX = re.compile(r"^(?:\([\w.-]+ pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^]]+\] )?")
_ERROR = re.compile(
    r"^\s*(?:Value error, .+"  # pydantic's line under "1 validation error for ModelConfig"
    r"|[\w.]*(?:Error|Exception): .+"  # an exception's last line
    r"|\S+: error: .+)"  # argparse: "api_server.py: error: unrecognized arguments: --x"
)
_WRAPPERS = ("See root cause above", "See stack trace for root cause", "validation error for")


def error_line(lines: Iterable[str]) -> str | None:
    """The first line that says why the process failed, without vLLM's log prefix; None when
    no line does."""
    for raw in lines:
        line = _PREFIX.sub("", raw.rstrip())
        if _ERROR.match(line) and not any(wrapper in line for wrapper in _WRAPPERS):
            line = line.strip()
            return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."
    return None


def read(unit: str, since: float, *, timeout: float = 10.0) -> list[str]:
    """The unit's journal messages since ``since`` (Unix seconds), oldest first; empty when the
    journal cannot be read (no journalctl, no permission): the caller loses a detail only."""
    try:
        done = subprocess.run(
            ["journalctl", "--unit", unit, "--since", f"@{int(since)}", "--output", "cat",
             "--no-pager", "--quiet"],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return done.stdout.splitlines() if done.returncode == 0 else []


def why_it_failed(unit: str, since: float) -> str | None:
    """vLLM's own reason for failing, from the unit's journal since ``since``."""
    return error_line(read(unit, since))
