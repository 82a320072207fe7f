"""The end of a CI run's log: each phase's time (tools/timed appends them to the file
``VKVAGENT_PHASES`` names) and the slowest tests of every pytest run (their JUnit XML files
beside it, ``PHASES-<venv>.xml``)::

    python3 tools/ci_summary.py PHASES [SLOWEST]

Standard library only: it runs on the system Python, before or without a venv.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def phases(file: Path) -> list[tuple[float, str, int]]:
    """(seconds, phase, exit status) in the order they ran."""
    rows = []
    for line in file.read_text(encoding="utf-8").splitlines():
        seconds, phase, status = line.split("\t")
        rows.append((float(seconds), phase, int(status)))
    return rows


def slowest(phases_file: Path, count: int) -> list[tuple[float, str, str]]:
    """The ``count`` slowest tests over every report beside ``phases_file``: (seconds with
    set-up and tear-down, run, test id)."""
    tests = []
    for report in sorted(phases_file.parent.glob(f"{phases_file.name}-*.xml")):
        run = report.name[len(phases_file.name) + 1 : -len(".xml")]  # 3.9.18, 3.11.7-vllm
        for case in ET.parse(report).iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            tests.append((float(case.get("time") or 0.0), run, name))
    return sorted(tests, reverse=True)[:count]


def main(argv: list[str]) -> int:
    file = Path(argv[1])
    count = int(argv[2]) if len(argv) > 2 else 25
    rows = phases(file) if file.exists() else []
    print("\nCI phases (seconds):")
    for seconds, phase, status in rows:
        print(f"{seconds:8.1f}  {phase}{'' if status == 0 else f'  (exit {status})'}")
    print(f"{sum(seconds for seconds, _, _ in rows):8.1f}  in all")
    tests = slowest(file, count)
    if tests:
        print(f"\nThe {count} slowest tests (seconds, set-up and tear-down included):")
        for seconds, run, name in tests:
            print(f"{seconds:8.1f}  {run:12} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
