"""One agent of a simulated fleet, as its own process (tests/test_fleet.py starts several).

It wants to restart from ``--start-at`` (a CLOCK_MONOTONIC time, shared by every process of
the machine) on: it asks the daemon's gate (``adapters.fleet.Gate``, as ``Restarter.restart``
does) every ``--retry`` seconds until it is let in, then "restarts": it appends
``start NAME T`` to ``--log``, sleeps ``--hold`` seconds, appends ``end NAME T`` and gives the
slot back. Its events go to stdout, one JSON object a line. Exit 0 once restarted; 1 when
``--give-up`` seconds pass first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from vkvagent.adapters.fleet import Gate
from vkvagent.knowledge.config import FleetConfig


def log(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write with O_APPEND: lines never mix
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--group", default="default")
    parser.add_argument("--max", type=int, default=1)
    parser.add_argument("--ttl", type=int, default=60)
    parser.add_argument("--log", required=True)
    parser.add_argument("--hold", type=float, default=0.5)
    parser.add_argument("--retry", type=float, default=0.1)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--give-up", type=float, default=40.0)
    args = parser.parse_args()

    def emit(name: str, message: str, **fields: Any) -> None:
        print(json.dumps({"event": name, "message": message, "agent": args.name, **fields}))
        sys.stdout.flush()

    cfg = FleetConfig(
        endpoints=(args.endpoint,),
        group=args.group,
        max_concurrent=args.max,
        lease_ttl=args.ttl,
        name=args.name,
        timeout=1.0,
    )
    gate = Gate(cfg, emit)
    time.sleep(max(0.0, args.start_at - time.monotonic()))
    deadline = time.monotonic() + args.give_up
    while time.monotonic() < deadline:
        with gate.slot(cause="uptime_decline", reason="test restart", emergency=False) as turn:
            if turn.allowed and turn.admission.slot is not None:
                log(args.log, f"start {args.name} {time.monotonic():.6f}")
                time.sleep(args.hold)
                log(args.log, f"end {args.name} {time.monotonic():.6f}")
                turn.result = "done"
                return 0
        time.sleep(args.retry)
    return 1


if __name__ == "__main__":
    sys.exit(main())
