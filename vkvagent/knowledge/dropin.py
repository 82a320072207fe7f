"""The systemd drop-in that carries vLLM's rewritten command line: rendering and reading.

Pure text in, text out: no files, no systemd calls (the writer and the D-Bus adapter use this).

A drop-in looks like::

    # Managed by vkvagent. Do not edit: vkvagent adopt takes over manual changes.
    # vkvagent-unit: vllm.service
    # vkvagent-source-sha256: <hash of the unit's own ExecStart argv, see argv_hash>
    # vkvagent-sha256: <sha256 of this file without this line>
    [Service]
    ExecStart=
    ExecStart=/usr/bin/vllm serve "/models/My Model" --max-num-seqs 128

The empty ``ExecStart=`` clears the unit's command so the next one replaces it. For a unit
Quadlet generates from a ``.container`` file, the drop-in is that file's
(``vllm.container.d/90-vkvagent.conf``), and ``[Container] Exec=`` with vLLM's arguments after
the image takes the place of ``[Service] ExecStart=``. The hash covers every other byte of
the file, so any edit by someone else (``is_foreign_edit``) is detected.

Quoting follows systemd.service(5) "COMMAND LINES" as ``config_parse_exec()`` implements it
(src/core/load-fragment.c): each word is read by ``extract_first_word(EXTRACT_UNQUOTE |
EXTRACT_CUNESCAPE)`` (src/basic/extract-word.c), then its specifiers are resolved (``%%`` is
``%``); at exec time ``$$`` becomes ``$`` and ``${VAR}`` / a lone ``$VAR`` word are expanded
(``replace_env_argv``). ``split_exec_start`` and ``expand_exec_env`` re-implement those steps,
so tests can read back what ``render_exec_start`` wrote.

Two forms of argv exist. The *process* form is what vLLM receives: every ``$`` is literal and is
written as ``$$``. The *unit* form is what systemd stores and reports on D-Bus (the
``ExecStart`` property): specifiers resolved, but ``$VAR``, ``${VAR}`` and ``$$`` still waiting
for exec time. An argv read from D-Bus is in unit form: render it with ``escape_dollar=False``
so an operator's deliberate ``$VAR`` keeps working. ``Verbatim`` keeps one argument's original
ExecStart text byte for byte.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from vkvagent.atomicfile import fsync_dir, write_atomically
from vkvagent.errors import VkvagentError

HEADER = "# Managed by vkvagent. Do not edit: vkvagent adopt takes over manual changes."
UNIT_KEY = "# vkvagent-unit: "
SOURCE_KEY = "# vkvagent-source-sha256: "
HASH_KEY = "# vkvagent-sha256: "

_WHITESPACE = " \t\n\r"  # systemd's WHITESPACE
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-+=:,./@")
_PREFIX_CHARS = "-@:+!"
_SHA256 = re.compile(r"[0-9a-f]{64}")
# How systemd stops a vLLM that drains, in the drop-in beside its ExecStart= (actuator.py).
STOP_KEYS = ("TimeoutStopSec", "KillMode")
_STOP_VALUE = re.compile(r"[0-9a-z]+")
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]+\.[a-z]+")


class ExecSyntaxError(VkvagentError, ValueError):
    """An ExecStart= value systemd would refuse or read differently than intended."""


@dataclass(frozen=True)
class Verbatim:
    """One argument already in ExecStart syntax (quoted, escaped), written unchanged.

    Use it to keep an unchanged argument's original text, e.g. one with specifiers (``%i``)
    or environment references whose spelling should survive a rewrite.
    """

    text: str

    def __post_init__(self) -> None:
        if not self.text or any(c in self.text for c in "\n\r\0"):
            raise ValueError(f"not one ExecStart word: {self.text!r}")


Arg = Union[str, Verbatim]


@dataclass(frozen=True)
class ExecCommand:
    """One command of an ExecStart= line as systemd stores it (unit form).

    ``prefix``: the special executable prefixes (``-``, ``@``, ``:``, ``+``, ``!``, ``!!``)
    in the order written; ``path``: the program run; ``argv``: its arguments, ``argv[0]``
    included (equal to ``path`` unless ``@`` is in ``prefix``).
    """

    prefix: str
    path: str
    argv: tuple[str, ...]


# --------------------------------------------------------------------------------------------
# Writing


def quote_exec_arg(arg: Arg, *, escape_dollar: bool = True) -> str:
    """One argv element as an ExecStart= word that systemd reads back as exactly ``arg``.

    Plain words (letters, digits, ``_-+=:,./@``) stay bare; anything else is put in double
    quotes with ``\\`` and ``"`` backslash-escaped and characters that are not printable
    (newline, tab, other controls, Unicode separators) C-escaped (``\\n``, ``\\x01``,
    ``\\u2028``). ``%`` is always written ``%%`` (specifiers). ``$`` is written ``$$`` unless
    ``escape_dollar`` is False, for an argument in unit form (read from D-Bus) whose ``$VAR``
    must still expand. A ``Verbatim`` is returned as it is. Raises ``ValueError`` for NUL or
    text that is not valid Unicode.
    """
    if isinstance(arg, Verbatim):
        return arg.text
    if "\0" in arg:
        raise ValueError(f"an argument cannot contain NUL: {arg!r}")
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"an argument must be valid Unicode: {arg!r}") from exc
    if arg and all(c in _SAFE for c in arg):
        return arg
    out = ['"']
    for char in arg:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char == "%":
            out.append("%%")
        elif char == "$" and escape_dollar:
            out.append("$$")
        elif not char.isprintable() and char != " ":
            out.append(_c_escape(char))
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _c_escape(char: str) -> str:
    code = ord(char)
    if code < 0x80:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def render_exec_start(
    argv: Sequence[Arg],
    *,
    path: str | None = None,
    prefix: str = "",
    escape_dollar: bool = True,
) -> str:
    """The value of an ``ExecStart=`` line that runs ``argv``.

    ``argv[0]`` is the program (an absolute path, or a bare name systemd looks up in its
    PATH). ``path``: the program when it differs from ``argv[0]`` (D-Bus ``ExecStart``'s first
    field); then ``@`` is added and ``argv[0]`` is written as a separate word. ``prefix``: other
    executable prefixes to keep (``-``, ``:``, ``+``, ``!``, ``!!``; see ``exec_prefix`` for
    D-Bus ``ExecStartEx`` flags). ``escape_dollar``: see ``quote_exec_arg``; it is off anyway
    after a ``:`` prefix, which turns expansion off. Raises ``ValueError``.
    """
    if not argv:
        raise ValueError("an ExecStart= command needs at least the program")
    prefix = _check_prefix(prefix.replace("@", ""))
    if ":" in prefix:
        escape_dollar = False
    program = path if path is not None else argv[0]
    if isinstance(program, Verbatim):
        first = program.text if not prefix else prefix + program.text
        if path is not None and path != argv[0]:
            raise ValueError("a Verbatim program needs path=None")
        words = [first]
    else:
        _check_program(program, escape_dollar)
        separate = path is not None and path != argv[0]
        words = [quote_exec_arg(("@" if separate else "") + prefix + program, escape_dollar=False)]
        if separate:
            words.append(quote_exec_arg(argv[0], escape_dollar=escape_dollar))
    words += [quote_exec_arg(arg, escape_dollar=escape_dollar) for arg in argv[1:]]
    return " ".join(words)


def _check_prefix(prefix: str) -> str:
    """Refuses prefixes systemd would not read back as written (a repeat or a bad mix)."""
    if any(c not in _PREFIX_CHARS for c in prefix):
        raise ValueError(f"ExecStart prefix {prefix!r}: allowed characters are - @ : + !")
    if _read_prefix(prefix + "/x")[0] != prefix:
        raise ValueError(f"ExecStart prefix {prefix!r} is not a valid combination")
    return prefix


def _check_program(program: str, escape_dollar: bool) -> None:
    # config_parse_exec(): string_is_safe() on the path, absolute or a bare file name.
    if not program or program.endswith("/"):
        raise ValueError(f"not a program path: {program!r}")
    if any(ord(c) < 32 or ord(c) == 127 or c in "\\\"'" for c in program):
        raise ValueError(f"systemd refuses quotes, backslashes and controls here: {program!r}")
    if program[0] != "/" and ("/" in program or program[0] in _PREFIX_CHARS):
        raise ValueError(f"the program must be an absolute path or a bare name: {program!r}")
    if "$" in program and escape_dollar:
        # The path is not expanded at exec time: "$$" would stay "$$" there.
        raise ValueError(f"a program path with '$' cannot be written literally: {program!r}")


def exec_prefix(flags: Iterable[str]) -> str:
    """The ExecStart= prefix for D-Bus ``ExecStartEx`` flags (``ignore-failure``,
    ``privileged``, ``no-setuid``, ``ambient``, ``no-env-expand``)."""
    table = {
        "ignore-failure": "-",
        "no-env-expand": ":",
        "privileged": "+",
        "no-setuid": "!",
        "ambient": "!!",
    }
    chosen = list(flags)
    unknown = [flag for flag in chosen if flag not in table]
    if unknown:
        raise ValueError(f"unknown ExecStartEx flags: {', '.join(unknown)}")
    return "".join(table[flag] for flag in table if flag in chosen)


def argv_hash(argv: Sequence[str]) -> str:
    """A stable SHA-256 of an argv (NUL-separated UTF-8), e.g. the unit's own ExecStart, to
    record as a drop-in's ``source_hash`` and notice later that the unit itself changed."""
    digest = hashlib.sha256()
    for arg in argv:
        digest.update(arg.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def render_dropin(
    unit: str,
    argv: Sequence[Arg],
    *,
    source_hash: str,
    path: str | None = None,
    prefix: str = "",
    escape_dollar: bool = True,
    stop: Mapping[str, str] | None = None,
) -> str:
    """The whole drop-in file that replaces ``unit``'s ExecStart with ``argv``.

    ``source_hash``: 64 hex digits identifying what the drop-in was derived from (``argv_hash``
    of the unit's own command line). ``path``, ``prefix``, ``escape_dollar``: as
    ``render_exec_start``. ``stop``: how systemd stops it (``STOP_KEYS``: ``TimeoutStopSec``,
    ``KillMode``), for a vLLM that drains. The file ends in a newline and carries its own hash.
    """
    exec_start = render_exec_start(argv, path=path, prefix=prefix, escape_dollar=escape_dollar)
    return _signed(unit, source_hash, f"[Service]\nExecStart=\nExecStart={exec_start}\n", stop)


def render_container_dropin(
    unit: str,
    args: Sequence[Arg],
    *,
    source_hash: str,
    escape_dollar: bool = True,
    stop: Mapping[str, str] | None = None,
) -> str:
    """The drop-in of a Quadlet ``.container`` file (``NAME.container.d/``) that gives the
    image ``args`` (vLLM's arguments): ``[Container] Exec=``, the last of which the generator
    uses, and the ``stop`` settings, which it copies into the service's ``[Service]``. The
    generator unquotes Exec='s words and quotes them again for ExecStart=, where ``%``, ``$``
    and escapes mean what they do here; an empty word it drops and a lone ``;`` it leaves bare,
    a command separator there: both are refused (ValueError)."""
    for arg in args:
        if isinstance(arg, str) and arg in ("", ";"):
            raise ValueError(f"Quadlet cannot pass the argument {arg!r} through Exec=")
    words = " ".join(quote_exec_arg(arg, escape_dollar=escape_dollar) for arg in args)
    return _signed(unit, source_hash, f"[Container]\nExec={words}\n", stop)


def _signed(unit: str, source_hash: str, body: str, stop: Mapping[str, str] | None) -> str:
    """vkvagent's header, ``body``, the ``[Service]`` stop settings, and the hash of it all."""
    if not _UNIT_NAME.fullmatch(unit):
        raise ValueError(f"not a unit name: {unit!r}")
    if not _SHA256.fullmatch(source_hash):
        raise ValueError(f"source_hash must be 64 lowercase hex digits, got {source_hash!r}")
    stop = stop or {}
    if set(stop) - set(STOP_KEYS) or any(not _STOP_VALUE.fullmatch(v) for v in stop.values()):
        raise ValueError(f"not stop settings vkvagent writes: {dict(stop)!r}")
    if stop and not body.startswith("[Service]"):
        body += "[Service]\n"
    body += "".join(f"{key}={stop[key]}\n" for key in STOP_KEYS if key in stop)
    head = f"{HEADER}\n{UNIT_KEY}{unit}\n{SOURCE_KEY}{source_hash}\n"
    digest = hashlib.sha256((head + body).encode("utf-8")).hexdigest()
    return f"{head}{HASH_KEY}{digest}\n{body}"


# --------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class ParsedDropin:
    """What a drop-in says.

    ``exec_start``: the value of the last non-empty ``ExecStart=`` in ``[Service]`` (None if
    there is none); ``resets``: whether an empty ``ExecStart=`` comes before it.
    ``recorded_hash``: the ``# vkvagent-sha256:`` value (None: not a vkvagent file);
    ``actual_hash``: the hash of the text as it is now. ``unit``, ``source_hash``: vkvagent's
    other header fields.
    """

    exec_start: str | None
    recorded_hash: str | None
    actual_hash: str
    unit: str | None = None
    source_hash: str | None = None
    resets: bool = False

    @property
    def foreign_edit(self) -> bool:
        return self.recorded_hash != self.actual_hash


def parse_dropin(text: str) -> ParsedDropin:
    """Read a drop-in as systemd's config parser reads it (comments, ``\\`` continuations,
    sections), plus vkvagent's header fields."""
    lines = text.split("\n")
    recorded = unit = source = None
    kept: list[str] = []
    for line in lines:
        if recorded is None and line.startswith(HASH_KEY):
            recorded = line[len(HASH_KEY) :].strip()
            continue
        kept.append(line)
        if line.startswith(UNIT_KEY) and unit is None:
            unit = line[len(UNIT_KEY) :].strip()
        elif line.startswith(SOURCE_KEY) and source is None:
            source = line[len(SOURCE_KEY) :].strip()
    actual = hashlib.sha256("\n".join(kept).encode("utf-8", "surrogateescape")).hexdigest()
    exec_start: str | None = None
    resets = False
    for section, key, value in _assignments(text):
        if section == "Service" and key == "ExecStart":
            if value.strip(_WHITESPACE):
                exec_start = value
            else:
                exec_start, resets = None, True
    return ParsedDropin(exec_start, recorded, actual, unit, source, resets)


def is_foreign_edit(text: str) -> bool:
    """Whether the drop-in is not exactly as vkvagent wrote it (edited, or never vkvagent's)."""
    return parse_dropin(text).foreign_edit


def other_settings(text: str) -> list[str]:
    """The ``Section.Key`` of every assignment besides ``[Service] ExecStart=`` (a Quadlet
    drop-in's ``[Container] Exec=``) and the stop settings vkvagent writes itself (what a
    re-rendered vkvagent drop-in would drop)."""
    ours = {("Service", "ExecStart"), ("Container", "Exec")}
    ours |= {("Service", key) for key in STOP_KEYS}
    return [f"{section}.{key}" for section, key, _value in _assignments(text)
            if (section, key) not in ours]  # fmt: skip


def _assignments(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every assignment, as src/shared/conf-parser.c reads lines."""
    out: list[tuple[str, str, str]] = []
    section = ""
    pending: str | None = None
    for raw in re.split(r"\r\n|\n|\r", text):
        line = raw.strip(_WHITESPACE)
        if pending is None and (not line or line[0] in "#;"):
            continue
        if pending is not None:
            if line and line[0] in "#;":
                continue  # comments inside a continuation are dropped
            line = pending + line
            pending = None
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:  # an odd backslash at the end continues the line with a space
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, eq, value = line.partition("=")
        if eq:
            out.append((section, key.strip(_WHITESPACE), value.strip(_WHITESPACE)))
    if pending is not None:
        key, eq, value = pending.partition("=")
        if eq:
            out.append((section, key.strip(_WHITESPACE), value.strip(_WHITESPACE)))
    return out


# --------------------------------------------------------------------------------------------
# systemd's reading of an ExecStart= value, re-implemented


def split_exec_start(
    value: str, *, specifiers: Mapping[str, str] | None = None, strict: bool = True
) -> list[ExecCommand]:
    """The commands systemd reads from an ``ExecStart=`` value, in unit form.

    Follows ``config_parse_exec()``: words by ``extract_first_word(EXTRACT_UNQUOTE |
    EXTRACT_CUNESCAPE)``, executable prefixes, a bare ``;`` between commands and ``\\;`` for a
    literal ``;`` argument, then specifiers per word (``%%`` is ``%``; others from
    ``specifiers``, e.g. ``{"n": "vllm.service"}``). ``strict``: refuse unknown escapes
    (systemd warns and keeps them); unbalanced quotes are always refused. Raises
    ``ExecSyntaxError``.
    """
    data = value.encode("utf-8")
    table = dict(specifiers or {})
    pos = _skip(data, 0)
    commands: list[ExecCommand] = []
    while pos < len(data):
        first, pos = _extract(data, pos, strict=strict)
        if first is None:
            break
        prefix, rest = _read_prefix(_decode(first))
        path = _specifiers(rest, table)
        if not path:
            raise ExecSyntaxError(f"empty program in {value!r}")
        _check_program_read(path)
        argv: list[str] = [] if "@" in prefix else [path]
        more = False
        while pos < len(data):
            if data[pos : pos + 1] == b";" and (pos + 1 == len(data) or _is_ws(data, pos + 1)):
                pos, more = _skip(data, pos + 1), True
                break
            if data[pos : pos + 2] == b"\\;" and (pos + 2 == len(data) or _is_ws(data, pos + 2)):
                argv.append(";")
                pos = _skip(data, pos + 2)
                continue
            word, pos = _extract(data, pos, strict=strict)
            if word is None:
                break
            argv.append(_specifiers(_decode(word), table))
        if not argv:
            raise ExecSyntaxError(f"no argv[0] after '@' in {value!r}")
        commands.append(ExecCommand(prefix, path, tuple(argv)))
        if not more:
            break
    return commands


def _read_prefix(word: str) -> tuple[str, str]:
    """The prefix characters config_parse_exec() consumes, and the rest of the word."""
    ignore = argv0 = no_env = False
    privilege = ""  # "", "+", "!", "!!"
    i = 0
    while i < len(word):
        c = word[i]
        if c == "-" and not ignore:
            ignore = True
        elif c == "@" and not argv0:
            argv0 = True
        elif c == ":" and not no_env:
            no_env = True
        elif c == "+" and not privilege:
            privilege = "+"
        elif c == "!" and privilege in ("", "!"):
            privilege += "!"
        else:
            break
        i += 1
    return word[:i], word[i:]


def _check_program_read(path: str) -> None:
    if any(ord(c) < 32 or ord(c) == 127 or c in "\\\"'" for c in path):
        raise ExecSyntaxError(f"executable name contains special characters: {path!r}")
    if path.endswith("/"):
        raise ExecSyntaxError(f"executable path specifies a directory: {path!r}")
    if path[0] != "/" and "/" in path:
        raise ExecSyntaxError(f"neither a valid executable name nor an absolute path: {path!r}")


def _is_ws(data: bytes, pos: int) -> bool:
    return chr(data[pos]) in _WHITESPACE


def _skip(data: bytes, pos: int) -> int:
    while pos < len(data) and _is_ws(data, pos):
        pos += 1
    return pos


def _decode(word: bytes) -> str:
    try:
        return word.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ExecSyntaxError(f"escapes produce invalid UTF-8: {word!r}") from exc


def _extract(
    data: bytes, pos: int, *, strict: bool, unescape: bool = True, relax: bool = False
) -> tuple[bytes | None, int]:
    """extract_first_word() with EXTRACT_UNQUOTE and (``unescape``) EXTRACT_CUNESCAPE, or
    (``relax``) EXTRACT_RELAX; separators are whitespace. Returns (word, position after the
    separators that follow it) or (None, end)."""
    n = len(data)
    pos = _skip(data, pos)
    if pos >= n:
        return None, n
    out = bytearray()
    quote = 0
    while pos < n:
        c = data[pos]
        if c == 0x5C:  # backslash
            if pos + 1 >= n:
                # EXTRACT_RELAX drops it; systemd's retry with EXTRACT_UNESCAPE_RELAX keeps an
                # unquoted one (and warns); in quotes it is unbalanced quoting.
                if relax:
                    return bytes(out), n
                if strict or quote:
                    raise ExecSyntaxError("trailing backslash")
                out.append(c)
                return bytes(out), n
            if not unescape:
                out.append(data[pos + 1])
                pos += 2
                continue
            decoded, used = _cunescape_one(data, pos + 1)
            if decoded is None:
                if strict:
                    raise ExecSyntaxError(f"unknown escape \\{chr(data[pos + 1])}")
                out += data[pos : pos + 2]
                pos += 2
                continue
            out += decoded
            pos += 1 + used
            continue
        if quote:
            if c == quote:
                quote = 0
            else:
                out.append(c)
            pos += 1
            continue
        if c in (0x22, 0x27):  # " '
            quote = c
            pos += 1
            continue
        if chr(c) in _WHITESPACE:
            return bytes(out), _skip(data, pos)
        out.append(c)
        pos += 1
    if quote and not relax:
        raise ExecSyntaxError("unbalanced quoting")
    return bytes(out), n


_SIMPLE_ESCAPES = {
    ord("a"): b"\a",
    ord("b"): b"\b",
    ord("f"): b"\f",
    ord("n"): b"\n",
    ord("r"): b"\r",
    ord("t"): b"\t",
    ord("v"): b"\v",
    ord("\\"): b"\\",
    ord('"'): b'"',
    ord("'"): b"'",
    ord("s"): b" ",
}
_HEX = frozenset(b"0123456789abcdefABCDEF")


def _cunescape_one(data: bytes, pos: int) -> tuple[bytes | None, int]:
    """src/basic/escape.c cunescape_one(): the bytes one escape stands for and its length
    (after the backslash), or (None, 0) for an invalid one. NUL is never produced."""
    c = data[pos]
    if c in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[c], 1
    digits = {ord("x"): 2, ord("u"): 4, ord("U"): 8}.get(c)
    if digits is not None:
        text = data[pos + 1 : pos + 1 + digits]
        if len(text) < digits or any(d not in _HEX for d in text):
            return None, 0
        code = int(text, 16)
        if code == 0:
            return None, 0
        if c == ord("x"):
            return bytes([code]), 3
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            return None, 0
        return chr(code).encode("utf-8"), digits + 1
    if ord("0") <= c <= ord("7"):
        text = data[pos : pos + 3]
        if len(text) < 3 or any(not ord("0") <= d <= ord("7") for d in text):
            return None, 0
        code = int(text, 8)
        if code == 0 or code > 255:
            return None, 0
        return bytes([code]), 3
    return None, 0


def _specifiers(word: str, table: Mapping[str, str]) -> str:
    """Unit specifiers resolved: ``%%`` is ``%``, ``%x`` from ``table``, other letters refused
    (systemd: "Invalid slot" for unknown ones; the ones it knows need a ``table``)."""
    if "%" not in word:
        return word
    out: list[str] = []
    i = 0
    while i < len(word):
        c = word[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(word):
            out.append("%")  # a stray '%' at the end is kept (specifier_printf)
            break
        spec = word[i + 1]
        if spec == "%":
            out.append("%")
        elif spec in table:
            out.append(table[spec])
        else:
            raise ExecSyntaxError(f"unknown specifier %{spec} in {word!r}")
        i += 2
    return "".join(out)


# --------------------------------------------------------------------------------------------
# Exec-time environment expansion, re-implemented

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_exec_env(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The argv the process receives from a unit-form argv (src/basic/env-util.c
    ``replace_env_argv``): a word that is exactly ``$NAME`` becomes the variable's value split
    at whitespace (quotes honoured; unset: no word at all); inside words ``${NAME}`` is replaced
    (unset: empty) and ``$$`` is ``$``; any other ``$`` stays as it is."""
    out: list[str] = []
    for word in argv:
        if word.startswith("$") and word[1:2] not in ("{", "$"):
            name = word[1:]
            if _ENV_NAME.fullmatch(name) and name in environ:
                out += _split_value(environ[name])
            continue
        out.append(_replace_env(word, environ))
    return out


def _split_value(value: str) -> list[str]:
    data = value.encode("utf-8")
    words: list[str] = []
    pos = 0
    while True:
        word, pos = _extract(data, pos, strict=False, unescape=False, relax=True)
        if word is None:
            return words
        words.append(word.decode("utf-8", "surrogateescape"))


def _replace_env(word: str, environ: Mapping[str, str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(word):
        if word[i] != "$":
            out.append(word[i])
            i += 1
            continue
        nxt = word[i + 1 : i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            end = next((j for j in range(i + 2, len(word)) if word[j] in "}:"), len(word))
            if end == len(word) or word[end] == ":":
                # Unterminated, or ${NAME:-...} (not supported for ExecStart): kept as written,
                # and reading goes on after the colon.
                out.append(word[i : end + 1])
                i = end + 1
                continue
            close = end
            name = word[i + 2 : close]
            if _ENV_NAME.fullmatch(name):
                out.append(environ.get(name, ""))
            i = close + 1
        else:
            out.append("$")
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------------------------
# The file on disk

DROPIN_NAME = "90-vkvagent.conf"
KEEP = 20  # earlier versions kept for rollback
_ABSENT = "absent"  # a kept entry that records "there was no drop-in"


class DropinFile:
    """vkvagent's drop-in for one unit, written so that no reader ever sees half of it.

    A new version goes to a temporary file in the same directory (a name systemd does not
    load), is fsynced, renamed over the old one, and the directory is fsynced. What it replaces
    (a version, or the absence of one) is pushed on a stack in ``keep_dir`` (not in the ``.d``
    directory, where systemd would load it); ``previous()`` is its top and ``restore()`` pops
    it, so an undo or a rollback goes back exactly one change, and never to a version that was
    itself undone."""

    def __init__(self, unit: str, unit_dir: Path, keep_dir: Path) -> None:
        self.path = unit_dir / f"{unit}.d" / DROPIN_NAME
        self.keep_dir = keep_dir

    def read(self) -> str | None:
        try:
            return self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except UnicodeDecodeError:  # not vkvagent's writing: report it as a foreign edit
            return self.path.read_bytes().decode("utf-8", "replace")

    def write(self, text: str, *, keep: bool = True) -> None:
        """Put ``text`` in place; with ``keep``, push what it replaces."""
        if keep:
            self._keep(self.read())
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomically(self.path, text, 0o644)

    def remove(self, *, keep: bool = True) -> None:
        current = self.read()
        if current is not None:
            if keep:
                self._keep(current)
            self.path.unlink()
            fsync_dir(self.path.parent)

    def has_previous(self) -> bool:
        """Whether a change of vkvagent's can be undone (``previous()`` is meaningful)."""
        return bool(self._kept())

    def previous(self) -> str | None:
        """The version the current one replaced; None when there was none."""
        kept = self._kept()
        return _entry(kept[-1]) if kept else None

    def restore(self, text: str | None) -> None:
        """Undo: put ``text`` back (None: no drop-in) without pushing what it replaces, and pop
        the kept entry it came from. Doing it again after an interruption is harmless."""
        if text is None:
            self.remove(keep=False)
        else:
            self.write(text, keep=False)
        kept = self._kept()
        if kept and _entry(kept[-1]) == text:
            kept[-1].unlink()

    def _keep(self, text: str | None) -> None:
        self.keep_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        kept = self._kept()
        number = int(kept[-1].name.split("-", 1)[0]) + 1 if kept else 1
        tag = _ABSENT if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
        write_atomically(self.keep_dir / f"{number:06d}-{tag}.conf", text or "", 0o640)
        for old in self._kept()[:-KEEP]:
            old.unlink()

    def _kept(self) -> list[Path]:
        if not self.keep_dir.is_dir():
            return []
        return sorted(self.keep_dir.glob("[0-9]*-*.conf"))


def _entry(path: Path) -> str | None:
    if path.name.endswith(f"-{_ABSENT}.conf"):
        return None
    return path.read_text(encoding="utf-8")
