"""What the unit itself said: its journal since a moment, and the line of it that says why vLLM
would not start.

vLLM prints its reason for refusing to start somewhere in a traceback of a hundred lines, often
in another process than the one that exits: a worker's ``ValueError`` comes first, then the
engine core's and the API server's wrappers around it (``Engine core initialization failed.
See root cause above.``). The root cause is the first error line that is not such a wrapper.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Iterable, Sequence

from vkvagent import apikey

MAX_LINE = 500  # an error line cut to this many characters: it goes into events and the ledger

# vLLM's logger prefix: "(EngineCore pid=12) ERROR 12-01 15:51:12 [core.py:1510] ".
_PREFIX = re.compile(r"^(?:\([\w.-]+ pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^]]+\] )?")
_ERROR = re.compile(
    r"^\s*(?:Value error, .+"  # pydantic's line under "1 validation error for ModelConfig"
    r"|[\w.]*(?:Error|Exception): .+"  # an exception's last line
    r"|\S+: error: .+)"  # argparse: "api_server.py: error: unrecognized arguments: --x"
)
_WRAPPERS = ("See root cause above", "See stack trace for root cause", "validation error for")
_LOCAL_ONLY = 1  # SD_JOURNAL_LOCAL_ONLY: this machine's journal, not others' merged in


def error_line(lines: Iterable[str]) -> str | None:
    """The first line that says why the process failed, without vLLM's log prefix; None when
    no line does."""
    for raw in lines:
        line = _PREFIX.sub("", raw.rstrip())
        if _ERROR.match(line) and not any(wrapper in line for wrapper in _WRAPPERS):
            line = line.strip()
            return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."
    return None


class _Journal:
    """sd-journal, journald's own reader, through libsystemd (present wherever systemd runs;
    its soname has been libsystemd.so.0 since 2014). No process is started: the hardened unit
    and the agent's rule against running programs both stay whole."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libsystemd.so.0", use_errno=True)
        pointer, size = ctypes.c_void_p, ctypes.c_size_t
        for name, args in (
            ("sd_journal_open", [ctypes.POINTER(pointer), ctypes.c_int]),
            ("sd_journal_add_match", [pointer, ctypes.c_char_p, size]),
            ("sd_journal_seek_realtime_usec", [pointer, ctypes.c_uint64]),
            ("sd_journal_next", [pointer]),
            ("sd_journal_get_data",
             [pointer, ctypes.c_char_p, ctypes.POINTER(pointer), ctypes.POINTER(size)]),
        ):  # fmt: skip
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        lib.sd_journal_close.argtypes, lib.sd_journal_close.restype = [pointer], None
        self.lib = lib

    def entries(
        self, matches: Sequence[str], since: float, limit: int, names: Sequence[str]
    ) -> list[dict[str, str]]:
        """The entries matching every one of ``matches`` since ``since``, oldest first, each
        with the fields ``names`` that it has."""
        lib, handle = self.lib, ctypes.c_void_p()
        if lib.sd_journal_open(ctypes.byref(handle), _LOCAL_ONLY) < 0:
            return []
        try:
            for text in matches:
                match = text.encode()
                if lib.sd_journal_add_match(handle, match, len(match)) < 0:
                    return []
            if lib.sd_journal_seek_realtime_usec(handle, max(0, int(since * 1e6))) < 0:
                return []
            out: list[dict[str, str]] = []
            data, length = ctypes.c_void_p(), ctypes.c_size_t()

            def field(name: bytes) -> str | None:
                found = lib.sd_journal_get_data(
                    handle, name, ctypes.byref(data), ctypes.byref(length)
                )
                if found < 0 or data.value is None:
                    return None
                raw = ctypes.string_at(data.value, length.value)
                return raw.partition(b"=")[2].decode("utf-8", "replace")

            while len(out) < limit and lib.sd_journal_next(handle) > 0:
                found = {name: field(name.encode()) for name in names}
                out.append({name: value for name, value in found.items() if value is not None})
            return out
        finally:
            lib.sd_journal_close(handle)


def read(unit: str, since: float, *, skip: str = "", limit: int = 5000) -> list[str]:
    """The unit's own output in the journal since ``since`` (Unix seconds), oldest first, at
    most ``limit`` lines, without those of invocation ``skip`` (the process a restart
    replaced, whose shutdown may log errors of its own); empty when the journal cannot be
    read (no libsystemd, no permission): the caller loses a detail, nothing more. vLLM logs
    its arguments when it starts, API key and all: each line comes without it."""
    found = _entries([f"_SYSTEMD_UNIT={unit}"], since, limit, ("MESSAGE", "_SYSTEMD_INVOCATION_ID"))
    return [
        apikey.redact(e["MESSAGE"])
        for e in found
        if "MESSAGE" in e and not (skip and e.get("_SYSTEMD_INVOCATION_ID") == skip)
    ]


def _entries(
    matches: Sequence[str], since: float, limit: int, names: Sequence[str]
) -> list[dict[str, str]]:
    try:
        return _Journal().entries(matches, since, limit, names)
    except (OSError, AttributeError, ValueError, OverflowError):  # no library, a bad time
        return []


def stopped_on_purpose(unit: str, since: float) -> str:
    """systemd's own line for a stop someone asked of ``unit`` since ``since`` (Unix seconds):
    a stop job (``systemctl stop``, ``disable --now``, ``mask --now``, a unit that requires it
    stopping) or a kill on a client's request (``systemctl kill``), with its time; "" when
    there was none (vLLM exited by itself), or the journal cannot be read."""
    found = _entries(
        ["_PID=1", f"UNIT={unit}"],
        since,
        1000,
        ("MESSAGE", "JOB_TYPE", "_SOURCE_REALTIME_TIMESTAMP"),
    )
    for entry in reversed(found):
        message = entry.get("MESSAGE", "")
        if entry.get("JOB_TYPE") == "stop" or message.endswith("on client request."):
            stamp = entry.get("_SOURCE_REALTIME_TIMESTAMP", "")
            if stamp.isdigit():
                message += time.strftime(" (%Y-%m-%dT%H:%M:%SZ)", time.gmtime(int(stamp) / 1e6))
            return f"systemd: {message}"
    return ""


def why_it_failed(unit: str, since: float, replaced: str = "") -> str | None:
    """vLLM's own reason for failing to start, from the unit's journal since ``since``, past
    the invocation ``replaced``."""
    return error_line(read(unit, since, skip=replaced))
