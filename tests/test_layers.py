"""The package's shape: the engine is pure, and every import goes down the layers that
ARCHITECTURE.md's "Import rules" table lists (a module missing from the table fails too)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vkvagent"
# Outside-world modules the engine must never load, even indirectly: D-Bus, HTTP and sockets,
# SQLite, TOML, processes, and the adapters that hold them.
OUTSIDE = (
    "jeepney",
    "http",
    "socket",
    "ssl",
    "urllib.request",
    "sqlite3",
    "tomllib",
    "tomli",
    "subprocess",
    "prometheus_client",
    "pynvml",
)


def modules() -> dict[str, Path]:
    """Every module of the package by its name below ``vkvagent`` (the package is
    ``vkvagent``, a sub-package its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts) or "vkvagent"] = path
    return found


def imports(path: Path) -> list[tuple[str, bool]]:
    """The vkvagent modules ``path`` imports (names below ``vkvagent``), each with whether
    it is imported inside a function (lazily)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import escapes the layer check"
        if isinstance(node, ast.ImportFrom) and node.module:
            lazy = node.col_offset > 0
            if node.module == "vkvagent":  # from vkvagent import config, status
                out += [(a.name, lazy) for a in node.names if a.name != "__version__"]
            elif node.module.startswith("vkvagent."):
                out.append((node.module[len("vkvagent.") :], lazy))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vkvagent."):
                    out.append((alias.name[len("vkvagent.") :], node.col_offset > 0))
    return out


def layers() -> dict[str, int]:
    """ARCHITECTURE.md's table: the rank of each module. A row names a package and the modules
    of that package it holds (the package's own ``__init__`` is in its first row)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Import rules", 1)[1].split("\n## ", 1)[0]
    ranks: dict[str, int] = {}
    for row in re.findall(r"^\| \d+ \|.*$", section, re.M):
        rank, package, _what, names = (cell.strip() for cell in row.strip("|").split("|"))
        prefix = package.strip("`").split(".", 1)[1] if "." in package else ""
        listed = re.findall(r"`([\w.]+)`", names)
        if (prefix or "vkvagent") not in ranks:
            listed.append("")  # the package itself
        for name in listed:
            full = ".".join(p for p in (prefix, name) if p) or "vkvagent"
            assert full not in ranks, f"{full} is in two layers"
            ranks[full] = int(rank)
    return ranks


def package_of(name: str) -> str:
    """The package a module is in: ``knowledge`` for ``knowledge.flags`` and for ``knowledge``
    itself; ``vkvagent`` for a top-level module."""
    if (PACKAGE / name.replace(".", "/") / "__init__.py").exists():
        return name
    return name.rpartition(".")[0] or "vkvagent"


def test_every_package_is_one_layer() -> None:
    """The tree says what the table says: the modules of a package share one layer. The top
    level holds the leaves, and ``__main__``, the program's entry, above everything."""
    ranks = layers()
    spans: dict[str, set[int]] = {}
    for name in modules():
        if name != "__main__":
            spans.setdefault(package_of(name), set()).add(ranks[name])
    assert {package: sorted(r) for package, r in spans.items() if len(r) > 1} == {}
    assert ranks["__main__"] == max(ranks.values())


def test_every_module_has_a_layer_and_every_import_goes_down() -> None:
    ranks = layers()
    found = modules()
    assert set(found) == set(ranks), (
        f"missing from ARCHITECTURE.md's import rules: {sorted(set(found) - set(ranks))}; "
        f"listed but not in the tree: {sorted(set(ranks) - set(found))}"
    )
    upward = []
    for name, path in found.items():
        for target, lazy in imports(path):
            if ranks[target] > ranks[name]:
                upward.append(f"{name} (layer {ranks[name]}) imports {target} ({ranks[target]})")
            # The agent never loads the simulator: only `vkvagent sim serve` starts it.
            serve = (name, target, lazy) == ("tools.cli", "sim.cli", True)
            agent = not name.startswith("sim") and not serve
            if target.startswith("sim") and agent:
                upward.append(f"{name} imports the simulator's {target}")
    assert upward == []


def test_the_engine_imports_nothing_but_itself() -> None:
    found = modules()
    for name, path in found.items():
        if name == "engine" or name.startswith("engine."):
            outside = [
                t for t, _lazy in imports(path) if t != "engine" and not t.startswith("engine.")
            ]
            assert outside == [], f"{name} imports {outside}"
    for values in ("engine.samples", "engine.gpu_faults"):  # plain values and tables
        assert imports(found[values]) == [], values


def loaded_by(module: str) -> set[str]:
    """The modules ``import module`` loads in a fresh interpreter, so that what other tests
    imported does not hide anything."""
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(json.loads(done.stdout))


def outside(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded if any(m == o or m.startswith(o + ".") for o in OUTSIDE))


def test_importing_the_engine_loads_nothing_of_the_outside() -> None:
    loaded = loaded_by("vkvagent.engine")
    assert "vkvagent.engine.tick" in loaded  # the check looks at a real import
    assert outside(loaded) == []
    assert (
        sorted(m for m in loaded if m.startswith("vkvagent.") and m.split(".")[1] != "engine") == []
    )


@pytest.mark.parametrize(
    ("adapter", "world"),
    [
        ("vkvagent.knowledge.config", "tomllib" if sys.version_info >= (3, 11) else "tomli"),
        ("vkvagent.adapters.vllm", "http"),
        ("vkvagent.adapters.systemd", "jeepney"),
        ("vkvagent.adapters.ledger", "sqlite3"),
    ],
)
def test_the_purity_check_sees_an_adapters_world(adapter: str, world: str) -> None:
    """The check above can fail: an adapter does load its part of the outside."""
    assert world in outside(loaded_by(adapter))
