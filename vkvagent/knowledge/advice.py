"""The daemon's flag suggestion as a change to review: a TOML diff and a conf.d file.

The daemon's last diagnosis (``status.json``) may carry a suggestion: the vLLM flags the engine
would change against KV pressure (``engine.kv.kv_advice``). This module turns it into a
change of the ``[vllm.flags]`` table: each suggested flag merged into the effective table
(spelled as the operator's files spell it, so no flag is given twice), the ones this vLLM
release lacks left out with the reason, a unified diff of the table, and the ``conf.d`` file
that makes the change (later files win key by key, so it needs only the changed keys).

Pure: values in, text out. ``vkvagent plan --suggested`` reads the status and the configuration,
plans the command line and writes the file.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vkvagent.engine.samples import FlagValue, utc_text
from vkvagent.errors import VkvagentError
from vkvagent.knowledge import flags, status
from vkvagent.knowledge.config import DROPIN_DIR

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the Python 3.9 CI run
    import tomli as tomllib

FILE_NAME = "60-suggested.toml"  # after the operator's own early files, before late overrides
TABLE = "[vllm.flags]"
# The argument for each flag's direction when the status carries no reason of its own.
WHY = {
    "gpu-memory-utilization": "more of the GPU for KV blocks (docs/tuning.md, memory share)",
    "max-num-seqs": "no more requests at once than the KV cache held cleanly (docs/tuning.md)",
    "max-num-batched-tokens": "a smaller prefill chunk preempts less (docs/tuning.md)",
    "enable-prefix-caching": "shared prompt prefixes prefilled and held once (docs/tuning.md)",
    "block-size": "prefix-cache hits are counted in whole blocks (docs/tuning.md)",
}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class AdviceError(VkvagentError):
    """An earlier suggested file cannot be read; one line naming it."""


@dataclass(frozen=True)
class Suggested:
    """The ``[vllm.flags]`` change a status suggests, against the effective configuration.

    ``changes``: each flag to set (catalogue name) and its value; ``current``/``after``: the
    table before and with them (the operator's keys and spelling); ``already``: suggested
    values the table asks for already; ``left_out``: suggested flags this vLLM refuses, why."""

    report: status.StatusReport
    current: dict[str, Any]
    after: dict[str, Any]
    changes: dict[str, FlagValue]
    reasons: dict[str, str]
    already: dict[str, FlagValue] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "diagnosis": diagnosis_json(self.report, now),
            "suggestion": dict(self.report.verdict.suggestion),
            "changes": dict(self.changes),
            "reasons": dict(self.reasons),
            "already": dict(self.already),
            "left_out": dict(self.left_out),
            "flags_before": dict(self.current),
            "flags_after": dict(self.after),
        }


def nothing_to_suggest(report: status.StatusReport | None) -> str | None:
    """Why the status holds no suggestion (one line), or None when it holds one."""
    if report is None:
        return f"nothing to suggest: {status.NO_STATUS}"
    if report.verdict.suggestion:
        return None
    cause = report.verdict.cause or report.verdict.state
    return (
        f"nothing to suggest: the last diagnosis ({utc_text(report.updated)}) is {cause}: "
        f"{report.verdict.reason}; flags are suggested only for kv_pressure"
    )


def suggest(
    report: status.StatusReport,
    current: Mapping[str, Any],
    vllm_version: str | None,
    set_later: Mapping[str, str] | None = None,
) -> Suggested:
    """Merge ``report``'s suggestion into ``current`` (the effective ``[vllm.flags]``), keeping
    only what ``vllm_version`` accepts (None: unknown, which refuses version-limited flags)
    and what vLLM starts with alongside the rest of the table. ``set_later``: flag -> the
    file that sets it after the suggested file, which would win over it."""
    spelled = {_canonical(key): key for key in current}
    later = set_later or {}
    reasons_in = report.verdict.reasons  # empty in a status an older daemon wrote
    after = dict(current)
    changes: dict[str, FlagValue] = {}
    already: dict[str, FlagValue] = {}
    left_out: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for raw_name, raw_value in report.verdict.suggestion.items():
        name = _canonical(raw_name)
        try:
            value = flags.validate({name: raw_value}, vllm_version)[name]
        except flags.FlagError as exc:
            left_out[name] = "; ".join(exc.problems)
            continue
        if name in later:
            left_out[name] = (
                f"--{name}: set by {later[name]}, read after the suggested file: change it there"
            )
            continue
        key = spelled.get(name, name)
        if key in current and _same(name, current[key], value):
            already[name] = value
            continue
        after[key] = value
        changes[name] = value
        reasons[name] = str(reasons_in.get(raw_name) or WHY.get(name, "see docs/tuning.md"))
    # A flag valid alone may break a combination (a prefill chunk below --max-model-len):
    # leave it out, with vLLM's reason, rather than suggest a table vLLM would not start with.
    while changes:
        try:
            flags.validate(after, vllm_version, check_versions=False)
            break
        except flags.FlagError as exc:
            broken = {n: p for p in exc.problems for n in changes if p.startswith(f"--{n}:")}
            if not broken:
                break
            for name, problem in broken.items():
                left_out[name] = problem
                key = spelled.get(name, name)
                if key in current:
                    after[key] = current[key]
                else:
                    del after[key]
                del changes[name], reasons[name]
    return Suggested(report, dict(current), after, changes, reasons, already, left_out)


def flags_in(path: Path) -> dict[str, Any]:
    """The ``[vllm.flags]`` table of a configuration file ({} when it does not exist)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AdviceError(f"{path}: cannot read: {exc}") from None
    table = data.get("vllm", {}).get("flags", {})
    return dict(table) if isinstance(table, dict) else {}


def set_after(files: Sequence[Path], target: Path) -> dict[str, str]:
    """Flag -> a conf.d file of ``files`` (the configuration's, in reading order) read after
    ``target`` that sets it, and so wins over it."""
    later = [
        f for f in files
        if f.parent == target.parent and f.parent.name == DROPIN_DIR and f.name > target.name
    ]  # fmt: skip
    return {_canonical(name): str(f) for f in later for name in flags_in(f)}


def toml_diff(suggested: Suggested, source: str) -> str:
    """A unified diff of the ``[vllm.flags]`` table, effective (``source``) against suggested."""
    before = _table_lines(suggested.current)
    after = _table_lines(suggested.after)
    lines = difflib.unified_diff(
        before,
        after,
        fromfile=f"{TABLE} effective ({source})",
        tofile=f"{TABLE} suggested",
        n=max(len(before), len(after)),
        lineterm="",
    )
    return "\n".join(lines) + "\n"


def conf_d_text(suggested: Suggested, earlier: Mapping[str, Any] | None = None) -> str:
    """The conf.d file that makes the change: the changed keys, each with its reason, after
    what an ``earlier`` suggested file at the same place held (kept: replacing the file
    must not undo a change already accepted)."""
    report = suggested.report
    out = [
        "# Written by `vkvagent plan --suggested`: the [vllm.flags] change the daemon's last",
        f"# diagnosis suggested ({utc_text(report.updated)}, "
        f"{report.verdict.cause or report.verdict.state}).",
        "# Review each flag (docs/tuning.md argues them), then `vkvagent plan` and apply.",
        "# Later conf.d files win, key by key.",
        TABLE,
    ]
    for key, value in (earlier or {}).items():
        if _canonical(key) not in suggested.changes:
            out.append(f"{_toml_key(key)} = {_toml_value(value)}  # from an earlier suggestion")
    for name, value in suggested.changes.items():
        key = next((k for k in suggested.after if _canonical(k) == name), name)
        out.append(f"# {suggested.reasons[name]}")
        out.append(f"{_toml_key(key)} = {_toml_value(value)}")
    return "\n".join(out) + "\n"


def diagnosis_line(report: status.StatusReport, now: float) -> str:
    """The diagnosis the suggestion comes from, in one line."""
    stale = (
        " (stale: the daemon stopped or went silent since)" if status.is_stale(report, now) else ""
    )
    cause = report.verdict.cause or report.verdict.state
    return f"diagnosis: {cause} at {utc_text(report.updated)}{stale}: {report.verdict.reason}"


# -- helpers -----------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    return flags.canonical_name(name)


def _same(name: str, configured: object, value: FlagValue) -> bool:
    """Whether the table's value (as the operator wrote it) is the suggested one."""
    try:
        return flags.validate({name: configured}, None, check_versions=False)[name] == value
    except flags.FlagError:
        return False


def _table_lines(table: Mapping[str, Any]) -> list[str]:
    return [TABLE, *(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items())]


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)


def diagnosis_json(report: status.StatusReport, now: float) -> dict[str, Any]:
    """The diagnosis the suggestion comes from, for --json."""
    return {
        "updated": report.updated,
        "state": report.verdict.state,
        "cause": report.verdict.cause,
        "reason": report.verdict.reason,
        "stale": status.is_stale(report, now),
    }
