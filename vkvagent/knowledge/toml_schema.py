"""Typed TOML settings: a schema of frozen dataclasses, and files read, checked and shown by it.

A key is a dataclass field declared with ``setting`` (its default, doc and limits), a table of
free keys with ``table``, a sub-table with ``section``. ``read`` merges TOML files in order
(later files win key by key) into the schema's dataclasses, checking every value and naming
each problem ``file:line: key: problem (allowed: ...)``; all problems are collected, so one
run shows everything to fix. ``render`` writes a configuration back as TOML, with its docs.
The schema itself (vkvagent's sections) lives in ``config``; this is the machinery, which
knows no key of its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the Python 3.9 CI run
    import tomli as tomllib


def setting(
    default: Any,
    doc: str,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: Sequence[str] | None = None,
    item: type | None = None,
    check: Callable[[Any], str | None] | None = None,
    complete: Callable[[Any], Any] | None = None,
    example: Any = None,
) -> Any:
    """A config key: its default (whose type is the key's type), its doc and its limits.
    ``check(value)`` (of each item, for a list) says what else is wrong with it, or None.
    ``complete(value)`` is the value meant by a shorthand (checked after completion).
    ``example``: a key that is unset by default (None: what it declares is off) takes the
    example's type, and the rendered file shows it commented out."""
    meta = {
        "doc": doc, "min": min, "max": max, "choices": choices, "item": item, "check": check,
        "complete": complete, "example": example,
    }  # fmt: skip
    return dataclasses.field(default=default, metadata=meta)


def table(doc: str, check: Callable[[str, Any], str | None]) -> Any:
    """A config table of free keys (e.g. vLLM flags); ``check(key, value)`` says what is
    wrong with one entry, or None."""
    return dataclasses.field(
        default_factory=lambda: MappingProxyType({}), metadata={"doc": doc, "table": check}
    )


def section(cls: type, doc: str) -> Any:
    """A config table whose keys are the fields of ``cls``."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "section": cls})


# -- reading files ----------------------------------------------------------------------------


def insecure_reason(path: Path) -> str | None:
    """Why a root daemon must not trust ``path``: it controls a root service's command line."""
    st = path.stat()
    if st.st_uid != 0:
        return f"owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def read(
    schema: type, files: Sequence[Path], *, as_root: bool, notes: list[str]
) -> tuple[Any, dict[tuple[str, ...], str], list[str]]:
    """``files`` merged in order into ``schema``: the values built of the valid keys (so
    that keys contradicting each other show too), where each key was set (``file:line`` by
    its path), and every problem. ``as_root`` refuses files and directories that someone
    other than root could have written. ``notes`` receives a line for each value read
    otherwise than written (a completed shorthand)."""
    problems: list[str] = []
    if as_root:
        for checked in _with_parents(files):
            reason = insecure_reason(checked)
            if reason:
                problems.append(f"{checked}: refused: {reason}; it controls a root service")
    merged: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    for file in files:
        problems += _merge_file(schema, file, merged, origins, notes)
    return _build(schema, merged), origins, problems


def _with_parents(files: Sequence[Path]) -> Iterator[Path]:
    seen: set[Path] = set()
    for file in files:
        for candidate in (file, file.parent):
            if candidate not in seen:
                seen.add(candidate)
                yield candidate


def _merge_file(
    schema: type,
    file: Path,
    merged: dict[str, Any],
    origins: dict[tuple[str, ...], str],
    notes: list[str],
) -> list[str]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{file}: cannot read: {exc}"]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return [_syntax_problem(file, str(exc))]
    locate = _Locator(text)
    problems: list[str] = []

    def where(key: tuple[str, ...]) -> str:
        return f"{file}:{locate(key)}"

    _merge_table(schema, data, merged, (), where, problems, origins, notes)
    return problems


def _syntax_problem(file: Path, message: str) -> str:
    found = re.search(r"\(at line (\d+), column \d+\)", message)
    line = found.group(1) if found else "1"
    return f"{file}:{line}: syntax error: {re.sub(r' *[(]at line.*', '', message)}"


def _merge_table(
    schema: type,
    data: dict[str, Any],
    merged: dict[str, Any],
    prefix: tuple[str, ...],
    where: Any,
    problems: list[str],
    origins: dict[tuple[str, ...], str],
    notes: list[str],
) -> None:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in data.items():
        path = (*prefix, key)
        dotted = ".".join(map(_key_text, path))
        spec = fields.get(key)
        if spec is None:
            kind = "section" if isinstance(value, dict) else "key"
            problems.append(
                f"{where(path)}: {dotted}: unknown {kind} (allowed: {', '.join(sorted(fields))})"
            )
        elif "table" in spec.metadata:
            if not isinstance(value, dict):
                problems.append(f"{where(path)}: {dotted}: expected a table [{dotted}]")
                continue
            entries = merged.setdefault(key, {})
            for entry, entry_value in value.items():
                problem = spec.metadata["table"](entry, entry_value)
                if problem:
                    problems.append(
                        f"{where((*path, entry))}: {dotted}.{_key_text(entry)}: {problem}"
                    )
                else:
                    entries[entry] = entry_value
        elif "section" in spec.metadata:
            if not isinstance(value, dict):
                problems.append(f"{where(path)}: {dotted}: expected a table [{dotted}]")
                continue
            sub = merged.setdefault(key, {})
            _merge_table(
                spec.metadata["section"], value, sub, path, where, problems, origins, notes
            )
        else:
            problem = _check_value(value, spec)
            if problem:
                problems.append(f"{where(path)}: {dotted}: {problem}")
            else:
                merged[key] = _coerce(value, spec)
                origins[path] = where(path)
                if spec.metadata["complete"] is not None and merged[key] != value:
                    notes.append(
                        f"{where(path)}: {dotted}: {json.dumps(value)} read as "
                        f"{json.dumps(merged[key])}"
                    )


def _key_text(key: str) -> str:
    """A key as TOML writes it: bare, or quoted with escapes (a problem stays one line)."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _kind(spec: dataclasses.Field[Any]) -> type:
    """A key's type: its default's, or its example's where it is unset by default."""
    return type(spec.default if spec.default is not None else spec.metadata["example"])


def allowed(spec: dataclasses.Field[Any]) -> str:
    meta = spec.metadata
    if meta["choices"]:
        return ", ".join(meta["choices"])
    low, high = meta["min"], meta["max"]
    if low is not None and high is not None:
        shown = "{:d}" if _kind(spec) is int or meta["item"] is int else "{:.15g}"
        return f"{shown.format(low)} to {shown.format(high)}"
    return _type_name(_kind(spec), meta["item"])


def _type_name(kind: type, item: type | None) -> str:
    if kind is tuple:
        plural = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(item, 'values') if item else 'values'}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]


def _check_value(value: Any, spec: dataclasses.Field[Any]) -> str | None:
    kind, meta = _kind(spec), spec.metadata
    if kind is tuple:
        if not isinstance(value, list):
            return f"expected {_type_name(kind, meta['item'])}, got {show(value)}"
        for element in value:
            problem = _check_scalar(element, meta["item"], spec)
            if problem:
                return f"list item {show(element)}: {problem}"
        return None
    return _check_scalar(value, kind, spec)


def _check_scalar(value: Any, wanted: type, spec: dataclasses.Field[Any]) -> str | None:
    meta = spec.metadata
    ok = (
        isinstance(value, bool)
        if wanted is bool
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if wanted is float
        else isinstance(value, wanted) and not isinstance(value, bool)
    )
    if not ok:
        return f"expected {_type_name(wanted, None)}, got {show(value)} (allowed: {allowed(spec)})"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be finite, got {value} (allowed: {allowed(spec)})"
    if meta["choices"] and value not in meta["choices"]:
        return f"{show(value)} is not allowed (allowed: {allowed(spec)})"
    if wanted in (int, float) and (
        (meta["min"] is not None and value < meta["min"])
        or (meta["max"] is not None and value > meta["max"])
    ):
        return f"{value} is out of range (allowed: {allowed(spec)})"
    if meta["check"] is not None:
        if meta["complete"] is not None:
            value = meta["complete"](value)
        return meta["check"](value)  # type: ignore[no-any-return]
    return None


def _coerce(value: Any, spec: dataclasses.Field[Any]) -> Any:
    if spec.metadata["complete"] is not None:
        return spec.metadata["complete"](value)
    if _kind(spec) in (tuple, float):
        return _kind(spec)(value)
    return value


def show(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}
    return f"{kind.get(type(value), type(value).__name__)} {json.dumps(value, default=str)}"


def _build(schema: type, merged: dict[str, Any]) -> Any:
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(schema):
        if spec.name in merged:
            sub = spec.metadata.get("section")
            if sub:
                values[spec.name] = _build(sub, merged[spec.name])
            elif "table" in spec.metadata:
                values[spec.name] = MappingProxyType(dict(merged[spec.name]))
            else:
                values[spec.name] = merged[spec.name]
    return schema(**values)


class _Locator:
    """Finds the line that sets a dotted key, since TOML parsers do not report positions."""

    _HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
    _KEY = re.compile(r"^\s*([A-Za-z0-9_\-.\"' ]+?)\s*=")

    def __init__(self, text: str) -> None:
        self._lines: dict[tuple[str, ...], int] = {}
        table: tuple[str, ...] = ()
        for number, line in enumerate(text.splitlines(), start=1):
            header = self._HEADER.match(line)
            if header:
                table = _split_key(header.group(1))
                self._lines.setdefault(table, number)
                continue
            key = self._KEY.match(line)
            if key:
                self._lines.setdefault((*table, *_split_key(key.group(1))), number)

    def __call__(self, path: tuple[str, ...]) -> int:
        for length in range(len(path), 0, -1):
            if path[:length] in self._lines:
                return self._lines[path[:length]]
        return 1


def _split_key(key: str) -> tuple[str, ...]:
    return tuple(part.strip().strip("\"'") for part in key.split("."))


# -- showing it --------------------------------------------------------------------------------


def render(config: Any, *, with_docs: bool = False) -> str:
    """A configuration (an instance of a schema of sections) as TOML; with docs, the
    commented reference file. A key unset by default shows its example commented out, and
    so does a table none of whose such keys is set ([slo] declaring nothing): uncommented, it
    would declare what the example does."""
    out: list[str] = []
    for spec in dataclasses.fields(config):
        values = getattr(config, spec.name)
        keys = [key for key in dataclasses.fields(values) if "table" not in key.metadata]
        optional = [key.name for key in keys if key.metadata["example"] is not None]
        off = "# " if optional and all(getattr(values, k) is None for k in optional) else ""
        if with_docs:
            out.append(f"# {spec.metadata['doc']}")
        out.append(f"{off}[{spec.name}]")
        tables = [key for key in dataclasses.fields(values) if "table" in key.metadata]
        for key in keys:
            if with_docs:
                out.append(f"# {key.metadata['doc']} Allowed: {allowed(key)}.")
            value = getattr(values, key.name)
            mark = "# " if off or value is None else ""
            shown = key.metadata["example"] if value is None else value
            out.append(f"{mark}{key.name} = {toml_value(shown)}")
        out.append("")
        for key in tables:
            if with_docs:
                out.append(f"# {key.metadata['doc']}")
            out.append(f"[{spec.name}.{key.name}]")
            for entry, entry_value in getattr(values, key.name).items():
                out.append(f"{json.dumps(entry)} = {toml_value(entry_value)}")
            out.append("")
    return "\n".join(out)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        # JSON's escapes are TOML's, except that JSON writes characters beyond U+FFFF as a
        # surrogate pair, which TOML refuses: keep them as they are; TOML wants DEL escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)
