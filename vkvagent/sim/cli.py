"""``vkvagent sim serve MODEL [vLLM flags] [simulator options]``.

The simulator's own options are taken out first; everything else is parsed, and refused, as
``vllm serve`` would. ``--seed`` is vLLM's and also seeds the simulated traffic."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TextIO

from vkvagent.knowledge.vllm_metrics import FLAVORS
from vkvagent.sim.capacity import SCENARIOS
from vkvagent.sim.serve_args import (
    FLAVOR_VERSIONS,
    ServeArgsError,
    parse_serve_args,
    resolve_for_model,
)
from vkvagent.sim.server import MODEL_MAX_LEN, SimOptions, serve

USAGE = "vkvagent sim serve MODEL [vLLM flags] [simulator options]"


def _options_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vkvagent sim serve",
        usage=USAGE,
        description="A vLLM stand-in: vLLM's flags, endpoints and metrics, a capacity model "
        "and the degradations seen in the field. Every other flag is read as vllm serve "
        "reads it, and refused as vllm serve refuses it.",
        allow_abbrev=False,
    )
    default = SimOptions()
    add = parser.add_argument
    add("--metrics-flavor", choices=FLAVORS, default=default.flavor,
        help="which vLLM version's /metrics format to serve")  # fmt: skip
    add(
        "--scenario",
        choices=list(SCENARIOS),
        default=default.scenario,
        # argparse formats help with %: the scenarios' "10 %" must be written "10 %%"
        help="; ".join(f"{name}: {what}" for name, (_onset, what) in SCENARIOS.items()).replace(
            "%", "%%"
        ),
    )
    add(
        "--scenario-onset",
        type=float,
        default=None,
        metavar="SECONDS",
        help="uptime at which the scenario begins (default: the scenario's own)",
    )
    add(
        "--time-scale",
        type=float,
        default=default.time_scale,
        metavar="X",
        help="simulated time runs X times faster than real time",
    )
    add(
        "--cold-start",
        type=float,
        default=default.cold_start,
        metavar="SECONDS",
        help="simulated seconds of model loading before the port opens",
    )
    add(
        "--workload",
        choices=("constant", "servegen"),
        default=default.workload,
        help="arrivals at a constant rate, or following a real week (ServeGen) scaled to --rate",
    )
    add(
        "--rate",
        type=float,
        default=default.rate,
        metavar="RPS",
        help="requests per second (constant), or the week's peak (servegen)",
    )
    add(
        "--gpu-recording",
        default="",
        metavar="FILE",
        help="keep GPU readings in FILE, for vkvagent's [gpu] recording mode",
    )
    add(
        "--leak-per-request",
        type=int,
        default=default.leak_per_request,
        metavar="BYTES",
        help="host memory held per request served in the memory-growth scenario",
    )
    add("--leak-cap", type=int, default=default.leak_cap, metavar="BYTES")
    add(
        "--render-interval",
        type=float,
        default=default.render_interval,
        metavar="SECONDS",
        help="real seconds /metrics serves the same page before rendering a new one; at a "
        "high --time-scale a page is that many times staler in simulated time (0: a new page "
        "for every scrape, as a soak on a fast clock needs)",
    )
    add(
        "--world-epoch",
        type=float,
        default=None,
        metavar="UNIX_TIME",
        help="when the simulated world began: thermal throttling and load surges follow it, "
        "not this process's uptime, so a restart does not end them (default: now)",
    )
    return parser


def serve_main(argv: Sequence[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    parser = _options_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help(out)
        return 0
    try:
        known, rest = parser.parse_known_args(list(argv))
    except SystemExit as exc:  # argparse has printed its message
        return int(exc.code or 0)
    if not (math.isfinite(known.time_scale) and known.time_scale > 0):
        print(f"{parser.prog}: error: --time-scale must be a positive number", file=err)
        return 2
    if not (math.isfinite(known.render_interval) and known.render_interval >= 0):
        print(f"{parser.prog}: error: --render-interval must be 0 or more", file=err)
        return 2
    options = SimOptions(
        flavor=known.metrics_flavor,
        scenario=known.scenario,
        scenario_onset=known.scenario_onset,
        time_scale=known.time_scale,
        cold_start=known.cold_start,
        workload=known.workload,
        rate=known.rate,
        gpu_recording=known.gpu_recording,
        leak_per_request=known.leak_per_request,
        leak_cap=known.leak_cap,
        world_epoch=known.world_epoch,
        render_interval=known.render_interval,
    )
    try:
        args = parse_serve_args(rest, options.flavor)
        args = resolve_for_model(args, options.flavor, MODEL_MAX_LEN)
        if args.data_parallel_size > 1 and options.flavor in ("v0", "v1-0.8"):
            raise ServeArgsError(
                f"the {options.flavor} metrics flavour has no engine label, so it cannot show "
                "data-parallel engines: use --metrics-flavor v1-0.10 or v1-latest",
                exit_code=1,
                exc_type="ValueError",
            )
    except ServeArgsError as exc:  # a usage error exits 2, a config error 1, as vLLM's do
        print(exc.render(), file=err)
        return exc.exit_code
    # vLLM's own --seed seeds the simulated traffic too, so one flag makes a run repeatable.
    options = replace(options, seed=args.seed or 0)
    return serve(args, options, FLAVOR_VERSIONS[options.flavor])
