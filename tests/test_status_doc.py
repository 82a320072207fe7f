"""docs/status.md against the schema it documents: every key of status.json (``StatusReport``
and its parts, their fields read off the dataclasses), with its type, is in the document's
table, and the table names nothing else; the same for what `status --json` adds."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tests.test_status import NOW, report
from vkvagent.knowledge import status

DOC = Path(__file__).resolve().parent.parent / "docs/status.md"
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+?) \| (.+) \|$")
SCALARS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
           "dict[str, Any]": "object"}  # fmt: skip


def kind(annotation: str) -> str:
    """A field's annotation as the document writes its type."""
    kinds = [k.strip() for k in annotation.split("|")]
    words = []
    for k in kinds:
        if k == "None":
            continue
        if k in SCALARS:
            words.append(SCALARS[k])
        elif k == "tuple[TrendPoint, ...]":
            words.append("array of arrays")  # written as [at, tokens_per_s, ratio]
        elif k.startswith("tuple["):
            item = k[len("tuple[") : -len(", ...]")]
            words.append("array of strings" if item == "str" else "array of objects")
        else:
            words.append("object")
    return " or ".join(words) + (" or null" if "None" in kinds else "")


def schema(part: type, prefix: str = "") -> dict[str, str]:
    """Every key of ``part``'s document, dotted (``[]`` for a list's items), with its type."""
    keys = {}
    for f in dataclasses.fields(part):
        key, annotation = prefix + f.name, str(f.type)
        keys[key] = kind(annotation)
        for k in (k.strip() for k in annotation.split("|")):
            item = k[len("tuple[") : -len(", ...]")] if k.startswith("tuple[") else k
            inner = getattr(status, item, None)
            if dataclasses.is_dataclass(inner):
                keys.update(schema(inner, key + ("[]." if item != k else ".")))  # type: ignore[arg-type]
    return keys


def documented(heading: str) -> dict[str, str]:
    """The key table under ``heading``: key -> type."""
    section = DOC.read_text(encoding="utf-8").split(f"\n## {heading}\n", 1)[1].split("\n## ")[0]
    rows = [ROW.match(line) for line in section.splitlines() if line.startswith("| `")]
    assert all(rows), [line for line in section.splitlines() if line.startswith("| `")]
    return {row[1]: row[2] for row in rows if row}


def test_every_key_of_status_json_is_documented_with_its_type_and_nothing_else() -> None:
    written = {"version": "integer", **schema(status.StatusReport)}
    in_doc = documented("Keys")
    assert sorted(written.keys() - in_doc.keys()) == [], "undocumented in docs/status.md"
    assert sorted(in_doc.keys() - written.keys()) == [], "documented, not in the schema"
    wrong = {k: (in_doc[k], t) for k, t in written.items() if in_doc[k] != t}
    assert wrong == {}, "key: (documented, schema)"
    assert list(in_doc) == list(written), "the document lists the keys in the schema's order"


def test_the_documented_version_and_json_extras_are_the_codes() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert f"**status.json version {status.VERSION}**" in text
    blank = status.shown_json(None, 0.0, "vllm.service")
    extras = {key: value for key, value in blank.items() if key not in schema(status.StatusReport)}
    extras.pop("version")
    assert set(extras) == set(documented("What `vkvagent status --json` adds"))
    states = documented("Verdict states and exit codes")
    assert list(states) == list(status.STATES)
    for state, code in states.items():
        assert int(code) == status.exit_code(report(state), NOW + 5), state
