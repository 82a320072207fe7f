"""``make reliability``: every fault class at full size, then the table.

``python -m reliability [--only CLASS,...] [--quick] [--seed N] [--json FILE]``. Exits 1 when
any class has a failure or lost data. The classes (docs/RELIABILITY.md):
fuzz, kill, crash, dbus, full, clock, metrics, probe, soak. ``--quick`` runs each at the size the
tests use (tests/test_reliability_*.py). Root and a systemd sandbox are needed for kill,
crash, dbus, full and fuzz's real-systemd part (tests/sandbox.py); without them those
classes fail.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from reliability.report import Row, passed, table

PROJECT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Size:
    profile: str  # hypothesis profile (reliability/fuzz.py)
    executed: int  # drop-ins whose process is started and its argv compared
    kills: int
    metric_trials: int
    clock_jumps: int
    probe_trials: int  # per kind of server: hung, slow, dead
    soak_days: float


FULL = Size(
    "reliability", executed=200, kills=100, metric_trials=56, clock_jumps=20, probe_trials=30,
    soak_days=7.0,
)  # fmt: skip
QUICK = Size(
    "reliability-ci", executed=10, kills=4, metric_trials=14, clock_jumps=4, probe_trials=6,
    soak_days=0.25,
)  # fmt: skip
SOAK_INTERVAL = 30.0  # sample_interval, seconds
SOAK_SCALE = 2400.0  # 7 days in about 4 minutes: one tick every 12.5 ms
SOAK_RETENTION = 1.0  # days
SOAK_PEAK = 4.0  # requests/s at the ServeGen week's busiest 10 minutes


def _fault(name: str, run: Callable[[Row], None]) -> Row:
    row = Row(name)
    started = time.monotonic()
    try:
        run(row)
    except Exception as exc:
        row.fail(f"{type(exc).__name__}: {exc}")
    row.seconds = time.monotonic() - started
    return row


def classes(size: Size, seed: int) -> dict[str, Callable[[], list[Row]]]:
    """Each class, importing only its own module (the soak's process stays the daemon's)."""

    def fuzzing() -> list[Row]:
        from reliability import fuzz  # noqa: PLC0415

        return fuzz.run_all(size.profile, size.executed)

    def kills() -> list[Row]:
        from reliability import kill  # noqa: PLC0415

        return [kill.run(size.kills, seed)]

    def fault(name: str, title: str) -> Callable[[], list[Row]]:
        def run() -> list[Row]:
            from reliability import faults  # noqa: PLC0415

            runs: dict[str, Callable[[Row], None]] = {
                "crash": faults.crash_loop,
                "dbus": faults.dbus,
                "full": faults.state_full,
                "clock": lambda row: faults.clock_jumps(row, seed, size.clock_jumps),
                "metrics": lambda row: faults.metrics_endpoint(row, seed, size.metric_trials),
            }
            return [_fault(title, runs[name])]

        return run

    def probing() -> list[Row]:
        from reliability import probe  # noqa: PLC0415

        def server(run: Callable[[Row, int, int], None]) -> Callable[[Row], None]:
            return lambda row: run(row, size.probe_trials, seed)

        kinds = (("hung", probe.hung), ("slow", probe.slow), ("dead", probe.dead))
        return [_fault(f"probe: {kind} server", server(run)) for kind, run in kinds]

    def soaking() -> list[Row]:
        from reliability import soak  # noqa: PLC0415

        return [soak.run(size.soak_days, SOAK_INTERVAL, SOAK_SCALE, SOAK_RETENTION, SOAK_PEAK)]

    return {
        "fuzz": fuzzing,
        "kill": kills,
        "crash": fault("crash", "vLLM crash-looping (sandbox)"),
        "dbus": fault("dbus", "D-Bus unavailable / access denied (sandbox)"),
        "full": fault("full", "state directory full (sandbox tmpfs)"),
        "clock": fault("clock", "wall clock jumps"),
        "metrics": fault("metrics", "/metrics hangs, trickles, huge"),
        "probe": probing,
        "soak": soaking,
    }


def run_child(name: str, *, quick: bool, seed: int) -> list[Row]:
    """One class in a process of its own: the soak's memory, descriptors and threads are the
    daemon's alone, and no class inherits what another left behind."""
    with tempfile.TemporaryDirectory(prefix="vkv-reliability.") as tmp:
        out = Path(tmp) / "rows.json"
        command = [
            sys.executable, "-m", "reliability", "--in-process", "--child", "--only", name,
            "--seed", str(seed), "--json", str(out), *(["--quick"] if quick else []),
        ]  # fmt: skip
        done = subprocess.run(command, cwd=PROJECT, stdout=subprocess.DEVNULL, check=False)
        if not out.exists():
            return [Row(name, failures=[f"its process exited {done.returncode} with no rows"])]
        return [Row(**row) for row in json.loads(out.read_text())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability", description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated classes (default: all)")
    parser.add_argument("--quick", action="store_true", help="the tests' sizes")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the classes in this process, not each in one of its own",
    )
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    table_of = classes(size, args.seed)
    chosen = [c for c in args.only.split(",") if c] or list(table_of)
    unknown = [c for c in chosen if c not in table_of]
    if unknown:
        parser.error(f"unknown classes {unknown} (known: {', '.join(table_of)})")
    began = time.monotonic()
    rows: list[Row] = []
    for name in chosen:
        started = time.monotonic()
        if not args.child:
            print(f"reliability: {name} ...", file=sys.stderr, flush=True)
        if args.in_process:
            rows += table_of[name]()
        else:
            rows += run_child(name, quick=args.quick, seed=args.seed)
        if not args.child:
            print(
                f"reliability: {name} took {time.monotonic() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    took = time.monotonic() - began
    print(
        f"vkvagent reliability, seed {args.seed}, {'quick' if args.quick else 'full'} sizes, "
        f"{took / 60:.1f} min; Python {platform.python_version()}, {platform.machine()}\n"
    )
    print(table(rows), end="")
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    return 0 if passed(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
