"""docs/events.md names every event of the catalogue, with its MESSAGE_ID and priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkvagent.knowledge.events import _PRIORITY_NAMES, CATALOGUE

DOC = Path(__file__).resolve().parent.parent / "docs" / "events.md"


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_every_event_is_in_the_catalogue_table(name: str) -> None:
    kind = CATALOGUE[name]
    priority = f"{kind.priority} {_PRIORITY_NAMES[kind.priority]}"
    row = f"| `{name}` | `{kind.message_id(name)}` | {priority} |"
    assert row in DOC.read_text(encoding="utf-8")


def test_every_event_is_described() -> None:
    text = DOC.read_text(encoding="utf-8")
    missing = [name for name in CATALOGUE if f"**`{name}`**" not in text]
    assert not missing, f"docs/events.md does not describe {missing}"


def test_the_table_lists_no_event_the_code_lacks() -> None:
    rows = [
        line.split("`")[1]
        for line in DOC.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `") and line.count("`") >= 4 and len(line.split("`")[3]) == 32
    ]
    assert sorted(rows) == sorted(CATALOGUE)
