"""The README and docs/: the overview fits on one screen, the links lead somewhere, and every
default they state is the configuration schema's (``knowledge/config.py``), either generated
from it (docs/configuration.md's table, by tools/settings_table.py) or checked here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import settings_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# What the README's overview holds; the first other section is the reference's start.
OVERVIEW = ("What it never does", "Install", "The first hour")
SECTIONS = (
    "agent", "metrics", "vllm", "probe", "gpu", "history", "restart", "baseline", "diagnosis",
    "policy", "fleet",
)  # fmt: skip
_KEY = r"`(?:\[(?P<section>[a-z_.]+)\] )?(?P<key>[a-z_]+)`(?: seconds)?"
# `key` (default VALUE ...), `key`, default VALUE, `key` defaults to VALUE
_STATED = re.compile(_KEY + r"(?: \(|, | )(?:default:? |defaults to )(?=(?P<tail>.{1,60}))")
# `key` seconds (VALUE by default)
_BY_DEFAULT = re.compile(_KEY + r" \((?P<tail>[^()`]{1,20}?) by default\)")
# `key = VALUE` (default)
_ASSIGNED = re.compile(r"`(?P<key>[a-z_]+) = (?P<tail>[^`]+)` \(default\)")
_VALUE = re.compile(
    r'`[^`]*`|"[^"]*"|\[[^\]]*\]|true\b|false\b|-?[0-9][0-9,]*(?:\.[0-9]+)?(?:\s*(?:%|s|min|h|d|days)\b|\s*%)?'
)


def _text(page: Path) -> str:
    """A page with its whitespace runs made one space, so a statement may span lines."""
    return re.sub(r"\s+", " ", page.read_text())


def _section_before(text: str, at: int) -> str | None:
    """The last ``[section]`` a page names before ``at``: what a bare, ambiguous key is in."""
    found = None
    for match in re.finditer(r"\[(" + "|".join(SECTIONS) + r")\]", text[:at]):
        found = match.group(1)
    return found


def stated_defaults(page: Path) -> list[tuple[str, str, int]]:
    """Every default a page states about a configuration key: (key, value as written, at)."""
    text = _text(page)
    found = []
    for pattern in (_STATED, _BY_DEFAULT, _ASSIGNED):
        for match in pattern.finditer(text):
            key = match.group("key")
            section = match.groupdict().get("section")
            if not any(spec.name == key for _, spec in settings_table.settings()):
                continue  # an option or a flag, not a configuration key
            if section is None:
                sections = {s for s, spec in settings_table.settings() if spec.name == key}
                if len(sections) > 1:
                    section = _section_before(text, match.start())
            name = f"{section}.{key}" if section else key
            value = _VALUE.match(match.group("tail").strip())
            found.append((name, value.group(0) if value else match.group("tail"), match.start()))
    return found


def test_the_settings_table_is_generated_from_the_schema() -> None:
    text = settings_table.DOC.read_text()
    assert settings_table.rewritten(text) == text, "run python3 tools/settings_table.py"


def test_the_settings_table_names_every_key_with_its_default() -> None:
    table = settings_table.table()
    for section, spec in settings_table.settings():
        assert f"| `{spec.name}` | {settings_table.default_text(spec)} |" in table, section


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_default_stated_is_the_schemas(page: Path) -> None:
    wrong = []
    for name, written, _ in stated_defaults(page):
        default = settings_table.default_of(name)
        if not settings_table.same(settings_table.parse_default(written), default):
            wrong.append(f"{name}: the page says {written!r}, the schema {default!r}")
    assert wrong == [], f"{page.name}: {wrong}"


def test_the_check_sees_the_defaults_the_readme_promises() -> None:
    """The safety rails of "What it never does" are stated, hence checked, not left out."""
    stated = {name.split(".")[-1] for name, _, _ in stated_defaults(README)}
    assert {"mode", "windows", "min_interval", "max_per_day", "cooldown", "emergency"} <= stated
    every = [s for page in PAGES for s in stated_defaults(page)]
    assert len(every) >= 50


def test_a_drifted_default_fails_the_check(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("- **Budgets.** `cooldown` (default 4 h) after a restart;\n  `[policy]\n")
    ((name, written, _),) = stated_defaults(page)
    assert name == "cooldown"
    assert not settings_table.same(settings_table.parse_default(written), 21600.0)
    page.write_text("`[probe]`: `timeout` (default 2 s)")
    ((name, written, _),) = stated_defaults(page)
    assert (name, settings_table.parse_default(written)) == ("probe.timeout", 2.0)


@pytest.mark.parametrize(
    ("written", "value"),
    [
        ("6 h", 21600.0), ("120 s", 120.0), ("10 %", 0.1), ("0.75", 0.75), ("true", True),
        ('`"observe"`', "observe"), ('`["stall", "unresponsive"]`', ("stall", "unresponsive")),
        ("3600", 3600.0), ("15 min", 900.0),
    ],
)  # fmt: skip
def test_defaults_are_read_as_written(written: str, value: object) -> None:
    assert settings_table.parse_default(written) == value


def test_no_default_is_stated_beside_a_key_in_another_form() -> None:
    """A default next to a configuration key in a form the check does not read would go
    unchecked: each "default" within a few words after a key must be one it reads."""
    keys = {spec.name for _, spec in settings_table.settings()}
    loose = []
    for page in PAGES:
        text = _text(page)
        read = {at for _, _, at in stated_defaults(page)}
        for match in re.finditer(r"`(?:\[[a-z_.]+\] )?([a-z_]+)`[^`|]{0,12}?\bdefault", text):
            if match.group(1) in keys and match.start() not in read:
                loose.append(f"{page.name}: {text[match.start() : match.end() + 30]!r}")
    assert loose == []


def test_the_readme_overview_fits_on_one_screen() -> None:
    lines = README.read_text().splitlines()
    headings = [(n, line[3:]) for n, line in enumerate(lines, 1) if line.startswith("## ")]
    assert [title for _, title in headings[: len(OVERVIEW)]] == list(OVERVIEW)
    first_reference = headings[len(OVERVIEW)][0]
    assert first_reference <= 61, f"the overview takes {first_reference - 1} lines"


def test_the_readme_names_the_demo_and_the_test_command() -> None:
    text = README.read_text()
    assert "make demo" in text
    assert "make test" in text
    overview = text.split("## Documentation")[0]
    assert "make test" not in overview, "make test (root, apt, half an hour) is development's"


def test_ci_figures_are_kept() -> None:
    development = (ROOT / "docs" / "development.md").read_text()
    assert "| phase | seconds |" in development
    assert "docs/development.md" in README.read_text()


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings."""
    anchors = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_lead_somewhere(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        missing = not linked.exists()
        if missing or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert broken == []
