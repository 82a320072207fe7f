"""What vkvagent adds to a restart of the real vLLM (`make bench-restart`; root, the systemd
sandbox and `make vllm-real`; about 6 minutes).

vLLM 0.32's CPU build runs as vllm.service in the systemd sandbox (tests/realvllm.py) with two
clients sending completions one after another. vkvagent restarts it ``--restarts`` times and
applies a flag change (``--max-num-seqs`` 4, then 8) ``--applies`` times, through its CLI inside
the container, as an operator would. For each action, in the same run:

- vLLM's own start: from systemd's restart job to vLLM ready (the CLI's ``service_seconds``);
- vkvagent's own share: the whole action minus that (preflight, drain, drop-in and reload);
- how late vkvagent noticed ready: the journal's "Application startup complete." of the new
  invocation to the ledger's ready step (it also waits to see tokens advance under traffic);
- what the clients saw: completions served, connections refused while vLLM was down (the
  clients retry every 0.1 s, so this counts attempts, not users), HTTP errors.

A last apply runs with no traffic: under traffic vLLM's CPU build keeps both of this
machine's cores busy, and systemd's daemon-reload (its generators) waits for them.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass

from tests.realvllm import START_TIMEOUT, Traffic, require_installed, vllm_unit, wait_until
from tests.sandbox import Sandbox, available
from tests.test_actuator import (
    TIMING,
    VLLM,
    actions,
    startup_complete,
    unit,
    vkvagent,
    write_config,
)


@dataclass(frozen=True)
class Row:
    kind: str
    service: float
    own: float
    steps: dict[str, float]  # vkvagent's own share by step (the ledger's begin to done)
    noticed: float
    clients: dict[str, int]


def measure(box: Sandbox, kind: str, flags: dict[str, object], clients: int = 2) -> Row:
    write_config(box, flags, timeout=START_TIMEOUT)
    args = ("apply", "--now") if kind.startswith("apply") else ("restart", "--reason", "bench")
    with Traffic(box, clients=clients) as traffic:
        wait_until(lambda: traffic.count("ok") >= 3 * clients, 60, "completions before it")
        done = vkvagent(box, *args, timeout=2 * START_TIMEOUT)
        served = traffic.count("ok")
        wait_until(lambda: traffic.count("ok") >= served + 3 * clients, 60, "completions after")
    timing = TIMING.search(done.stdout)
    if done.returncode != 0 or timing is None:
        raise SystemExit(f"vkvagent {' '.join(args)} failed: {done.stdout}{done.stderr}")
    number = re.search(r"\(action (\d+), ", done.stdout)
    found = [a for a in actions(box) if number and a.id == int(number.group(1))]
    if not found or found[0].kind != ("apply" if kind.startswith("apply") else "restart"):
        raise SystemExit(f"no ledger action for: {done.stdout}")
    at = {(s.step, s.state): s.at for s in found[0].steps}
    ready = at["ready", "done"]
    steps = {
        step: at[step, "done"] - at[step, "begin"]
        for step in ("preflight", "drain", "write", "reload")
        if (step, "done") in at
    }
    complete = startup_complete(box, unit(box).invocation_id)
    service, own = float(timing.group(1)), float(timing.group(2))
    return Row(kind, service, own, steps, ready - complete, dict(sorted(traffic.outcomes.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--applies", type=int, default=2)
    args = parser.parse_args()
    reason = available()
    if reason is not None:
        raise SystemExit(f"bench/restart.py: the systemd sandbox {reason}")
    require_installed()
    rows: list[Row] = []
    with Sandbox(units={VLLM: vllm_unit()}) as box:
        box.wait_http(timeout=START_TIMEOUT)
        for _ in range(args.restarts):
            rows.append(measure(box, "restart", {}))
        for number in range(args.applies):
            rows.append(measure(box, "apply", {"max-num-seqs": 4 if number % 2 == 0 else 8}))
        # systemd's reload competes with vLLM for the CPUs: once more with no traffic.
        rows.append(measure(box, "apply, idle", {"max-num-seqs": 6}, clients=0))
    print("| action | vLLM's own start (s) | vkvagent's own (s) | of which, by step (s) "
          "| ready noticed after (s) | clients: ok / refused / other |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in rows:
        other = {k: v for k, v in row.clients.items() if k not in ("ok", "refused")}
        steps = ", ".join(f"{step} {seconds:.2f}" for step, seconds in row.steps.items())
        print(
            f"| {row.kind} | {row.service:.1f} | {row.own:.2f} | {steps} | {row.noticed:.2f} | "
            f"{row.clients.get('ok', 0)} / {row.clients.get('refused', 0)} / {other or '-'} |"
        )
    for kind in ("restart", "apply", "apply, idle"):
        some = [row for row in rows if row.kind == kind]
        if some:
            print(
                f"{kind}, median of {len(some)}: vLLM's own start "
                f"{statistics.median(r.service for r in some):.1f} s, vkvagent's own "
                f"{statistics.median(r.own for r in some):.2f} s "
                f"({statistics.median(r.own / r.service for r in some):.2%} of vLLM's), "
                f"ready noticed {statistics.median(r.noticed for r in some):.2f} s late"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
