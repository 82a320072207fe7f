"""vLLM's API key: found where the operator already keeps it, and kept out of all vkvagent writes.

vLLM 0.32 started with ``--api-key KEY...`` (or, without it, ``VLLM_API_KEY`` in its
environment) answers 401 to any request under /v1, /v2, /inference and /cohere that lacks
``Authorization: Bearer KEY``; /metrics, /health and /version stay open. Of vkvagent's requests
only the probe, a completion, needs the key. It is read, first found wins, from:

1. ``[vllm] api_key_file``: a file only its owner (root or vkvagent's user) may read;
2. the unit's command line: ``--api-key`` (any spelling argparse takes);
3. the unit's ``Environment=VLLM_API_KEY=``;
4. the unit's ``EnvironmentFile=`` files, in order, as systemd reads them.

The key never leaves the process: ``mask_argv`` blanks it out of every command line vkvagent
reads (systemd's ExecStart, /proc), and ``redact`` out of any text (journal lines, events).
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vkvagent.errors import NeedsOperator

MASK = "<redacted>"
ENV = "VLLM_API_KEY"
_OPTION = re.compile(r"--api[-_]key(?:=(.*))?", re.DOTALL)
_REFERENCE = re.compile(r"\$\{(\w+)\}|\$(\w+)")  # systemd expands it from the environment
# VLLM_API_KEY=K as a word of the command line: `env VLLM_API_KEY=K vllm serve`, or a
# container engine's `-e VLLM_API_KEY=K`, `-eVLLM_API_KEY=K`, `--env=VLLM_API_KEY=K`.
_ASSIGNMENT = re.compile(r"(?:--env=|-e)?VLLM_API_KEY=(.+)", re.DOTALL)
# Why vkvagent changes no flags of a unit that has the key on its command line.
ON_COMMAND_LINE = (
    "the command line spells out vLLM's API key (--api-key or VLLM_API_KEY=), which vkvagent "
    "would have to copy into its drop-in; put VLLM_API_KEY=... in the unit's Environment= or "
    "EnvironmentFile= instead, and write --api-key ${VLLM_API_KEY} or nothing (vLLM reads "
    "VLLM_API_KEY; a container needs -e VLLM_API_KEY, without a value)"
)

# The same for a unit Quadlet generates: there the key comes from the .container file.
ON_QUADLET_LINE = (
    "the command line Quadlet generates spells out vLLM's API key: Environment=VLLM_API_KEY= "
    "in the .container becomes podman's --env VLLM_API_KEY=..., which any user can read in "
    "ps; give it by EnvironmentFile= or Secret=NAME,type=env,target=VLLM_API_KEY instead"
)


class KeyFileError(NeedsOperator):
    """``[vllm] api_key_file`` cannot be used (one line; the key is never in it)."""


@dataclass(frozen=True)
class ApiKey:
    """vLLM's key and where it was read (``source``: words for status, never the key)."""

    value: str = field(repr=False)
    source: str


def mask_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` with every key ``--api-key`` spells out replaced by MASK: ``--api-key=K`` and
    ``--api-key K1 K2`` (argparse takes one or more values, up to the next option). A
    reference to the unit's environment (``${KEY}``, ``$KEY``) is no secret, and stays."""
    out, taking = [], False
    for token in argv:
        found = _OPTION.fullmatch(token)
        assigned = _ASSIGNMENT.fullmatch(token)
        if assigned and not _REFERENCE.fullmatch(assigned.group(1)):
            out.append(token[: assigned.start(1)] + MASK)
        elif found:
            taking = found.group(1) is None
            value = found.group(1) or ""
            out.append(
                token
                if taking or _REFERENCE.fullmatch(value)
                else f"{token[: found.start(1)]}{MASK}"
            )
        elif taking and not token.startswith("-"):
            out.append(token if _REFERENCE.fullmatch(token) else MASK)
        else:
            taking = False
            out.append(token)
    return tuple(out)


def argv_key(argv: Sequence[str]) -> str | None:
    """The first key ``--api-key`` gives on ``argv`` (vLLM accepts each; one is enough), else
    a ``VLLM_API_KEY=`` word's, as written: perhaps a reference to the environment."""
    return _option_key(argv) or next(
        (found.group(1) for found in map(_ASSIGNMENT.fullmatch, argv) if found), None
    )


def _option_key(argv: Sequence[str]) -> str | None:
    for i, token in enumerate(argv):
        found = _OPTION.fullmatch(token)
        if found and found.group(1) is not None:
            return found.group(1) or None
        if found and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return None


def spelled_out(argv: Sequence[str]) -> bool:
    """Whether ``argv`` carries a key itself (masked or not), not a reference to one."""
    key = argv_key(argv)
    return key is not None and not _REFERENCE.fullmatch(key)


def env_file_values(text: str) -> dict[str, str]:
    """The assignments of a systemd ``EnvironmentFile=``: ``KEY=VALUE`` lines, ``#`` and ``;``
    comments, a value in single or double quotes taken without them."""
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def from_unit(
    argv: Sequence[str], environment: Iterable[str], environment_files: Iterable[str]
) -> ApiKey | None:
    """The key a unit gives vLLM, from its raw ExecStart, its ``Environment=`` assignments and
    its ``EnvironmentFile=`` paths (one that cannot be read is passed over): ``--api-key``'s
    value, or the variable it refers to, else ``VLLM_API_KEY``. As systemd does, a file's
    assignment wins over ``Environment=``, and a later file's over an earlier one's."""
    key, name = argv_key(argv), ENV
    if key:
        reference = _REFERENCE.fullmatch(key)
        if reference is None:
            where = "--api-key" if _option_key(argv) else "VLLM_API_KEY= on its command line"
            # systemd passes "$$" on as "$"
            return remember(ApiKey(key.replace("$$", "$"), f"the unit's {where}"))
        name = reference.group(1) or reference.group(2)
    found: tuple[str, str] | None = None
    for assignment in environment:
        variable, _, value = assignment.partition("=")
        if variable == name:
            found = value, f"the unit's Environment={name}"
    for path in environment_files:
        try:
            with open(path, encoding="utf-8", errors="replace") as file:
                assigned = env_file_values(file.read(64 * 1024))
        except OSError:
            continue  # missing (allowed with systemd's "-"), or not ours to read
        if name in assigned:
            found = assigned[name], f"{name} in EnvironmentFile={path}"
    if found is None or not found[0]:
        return None
    value, source = found
    return remember(ApiKey(value, f"{key} on the unit's command line, {source}" if key else source))


def read_key_file(path: str) -> ApiKey:
    """The key in ``path`` (its first line), checked as SSH checks a private key: a regular
    file that only its owner, root or this process's user, may read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise KeyFileError(f"[vllm] api_key_file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"[vllm] api_key_file {path}: not a regular file")
        if info.st_uid not in (0, os.geteuid()):
            raise KeyFileError(
                f"[vllm] api_key_file {path}: owned by uid {info.st_uid}; it must be root's"
            )
        if info.st_mode & 0o077:
            raise KeyFileError(
                f"[vllm] api_key_file {path}: group or others may read it "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
            )
        lines = file.read(64 * 1024).decode("utf-8", "replace").strip().splitlines()
    if not lines or not lines[0].strip():
        raise KeyFileError(f"[vllm] api_key_file {path}: empty")
    return remember(ApiKey(lines[0].strip(), f"[vllm] api_key_file {path}"))


_known: set[str] = set()  # every key this process has read, to blank out of its words
_lock = threading.Lock()


def remember(key: ApiKey) -> ApiKey:
    with _lock:
        _known.add(key.value)
    return key


def redact(text: str) -> str:
    """``text`` without any key this process has read (vLLM logs its arguments, key and all,
    when it starts)."""
    for value in _known:
        if value in text:
            text = text.replace(value, MASK)
    return text
