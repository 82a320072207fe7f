"""The ``vkvagent`` command line: its parser, the dispatch to each command and the commands
that fit in a screen; ``config_check``, ``actions`` (plan, apply, restart, rollback, adopt) and
``readings`` (scrape, gpu) hold the larger ones. Runs in-process in tests:
``main(argv, stdout, stderr)``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TextIO

from vkvagent import __version__
from vkvagent.adapters import controls
from vkvagent.engine.policy import MODES
from vkvagent.errors import NEEDS_OPERATOR, NeedsOperator, VkvagentError
from vkvagent.knowledge import advice, config, status, status_check, status_text
from vkvagent.tools.exitcodes import CommandError, ExitCode, UsageError


def main(
    argv: Sequence[str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        code = _dispatch(argv, out, err)
        for stream in {id(out): out, id(sys.stdout): sys.stdout}.values():
            stream.flush()  # a reader gone shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:  # quietly, as a program SIGPIPE ends
        _stdout_to_devnull()
        return ExitCode.BROKEN_PIPE


def _stdout_to_devnull() -> None:
    """After a reader went away. Python's advice (the signal module's docs): point stdout at
    /dev/null, so that the interpreter's flush at exit does not fail again."""
    # A stdout without a descriptor (tests) has nothing to flush at exit.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _later(module: str, name: str) -> Callable[[argparse.Namespace, TextIO], int]:
    """A command whose module is imported only when it runs, so that ``vkvagent run`` loads
    the daemon's code and none of the other commands'."""

    def command(args: argparse.Namespace, out: TextIO) -> int:
        run: Callable[[argparse.Namespace, TextIO], int]
        run = getattr(importlib.import_module(f"vkvagent.tools.{module}"), name)
        return run(args, out)

    return command


def _dispatch(argv: Sequence[str] | None, out: TextIO, err: TextIO) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["sim", "serve"]:
        # vLLM's flags follow: they are parsed as vllm serve parses them, not by this parser.
        from vkvagent.sim.cli import serve_main  # noqa: PLC0415 - the agent never loads the sim

        return serve_main(argv[2:], out, err)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its message
        return int(exc.code or 0)
    command: Callable[[argparse.Namespace, TextIO], int] = args.command
    try:
        return command(args, out)
    except VkvagentError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"vkvagent: {line}", file=err)
        return ExitCode.USAGE if isinstance(exc, UsageError) else ExitCode.FAILURE
    except KeyboardInterrupt:
        return ExitCode.FAILURE
    except BrokenPipeError:  # the reader went away: not a bug (main() ends quietly)
        raise
    except Exception as exc:  # a bug: say so in one line unless asked for the traceback
        if os.environ.get("VKVAGENT_DEBUG"):
            raise
        print(
            f"vkvagent: internal error: {type(exc).__name__}: {exc} "
            "(set VKVAGENT_DEBUG=1 for a traceback)",
            file=err,
        )
        return ExitCode.FAILURE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vkvagent",
        description="Keeps a self-hosted vLLM server fast: reads its metrics and GPUs, "
        "diagnoses degradation, restarts or re-tunes it only when that helps.",
    )
    parser.add_argument("--version", action="version", version=f"vkvagent {__version__}")
    parser.set_defaults(command=_usage(parser))
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    scrape = commands.add_parser(
        "scrape", help="read vLLM's /metrics once and print the normalised signals"
    )
    source = scrape.add_mutually_exclusive_group()
    source.add_argument("--url", help="vLLM base URL or full /metrics URL (default: config)")
    source.add_argument("--file", type=Path, help="a saved /metrics page ('-' for stdin)")
    scrape.add_argument("--model", help="read only this model_name (default: config, or all)")
    scrape.add_argument("--json", action="store_true", help="print one JSON object")
    _config_option(scrape)
    scrape.set_defaults(command=_later("readings", "scrape"))

    gpu = commands.add_parser("gpu", help="read the GPUs through NVML once")
    gpu.add_argument("--json", action="store_true", help="print one JSON object")
    gpu_source = gpu.add_mutually_exclusive_group()
    gpu_source.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="save NVML's raw values to FILE (for bug reports and tests)",
    )
    gpu_source.add_argument(
        "--replay",
        type=Path,
        metavar="FILE",
        help="read from a file made by --record instead of NVML",
    )
    _config_option(gpu)
    gpu.set_defaults(command=_later("readings", "gpu"))

    plan = commands.add_parser(
        "plan", help="show the command line [vllm.flags] would give vLLM, before and after"
    )
    plan.add_argument(
        "--suggested",
        action="store_true",
        help="the [vllm.flags] change the daemon's last diagnosis suggests (status.json): "
        "a TOML diff, a conf.d file and the command line it gives",
    )
    plan.add_argument(
        "--write",
        type=Path,
        metavar="PATH",
        help=f"with --suggested: write the conf.d file to PATH (e.g. "
        f"/etc/vkvagent/conf.d/{advice.FILE_NAME})",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    _config_option(plan)
    plan.set_defaults(command=_later("actions", "plan"))

    apply = commands.add_parser(
        "apply",
        help="apply [vllm.flags] (--now, or --at-next-window): drop-in, restart, attest; "
        "rolled back on failure",
    )
    when = apply.add_mutually_exclusive_group(required=True)
    when.add_argument("--now", action="store_true", help="apply immediately")
    when.add_argument(
        "--at-next-window",
        action="store_true",
        help="wait until a [policy] restart window is open, then apply (now, if one is)",
    )
    _action_options(apply)
    apply.set_defaults(command=_later("actions", "apply"))

    restart = commands.add_parser("restart", help="restart vLLM through the safe path")
    _action_options(restart)
    restart.set_defaults(command=_later("actions", "restart"))

    rollback = commands.add_parser(
        "rollback", help="put back the drop-in vkvagent replaced last, and restart"
    )
    rollback.add_argument(
        "--reason", default="manual rollback", help="recorded in the ledger and events"
    )
    _fleet_option(rollback)
    _config_option(rollback)
    rollback.set_defaults(command=_later("actions", "rollback"))

    adopt = commands.add_parser(
        "adopt", help="accept the unit's current command line (someone's manual edits included)"
    )
    _config_option(adopt)
    adopt.set_defaults(command=_later("actions", "adopt"))

    replayer = commands.add_parser(
        "replay",
        help="run the decision engine over Prometheus history: what it would have done, when "
        "and why",
        description="Replays vLLM's raw series (and dcgm-exporter's GPU series) from Prometheus "
        "query_range responses through the decision engine on a virtual clock. Restarts it "
        "decides are virtual; real restarts in the data start a new baseline.",
    )
    replayer.add_argument(
        "files",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="a saved /api/v1/query_range JSON response (several are merged)",
    )
    replayer.add_argument(
        "--prometheus", metavar="URL", help="fetch from this Prometheus instead of files"
    )
    replayer.add_argument(
        "--match",
        action="append",
        default=[],
        metavar="SELECTOR",
        help="series to fetch, e.g. '{__name__=~\"vllm:.*|process_start_time_seconds\"}' "
        "(repeat for DCGM_FI_* series)",
    )
    replayer.add_argument("--start", metavar="TIME", help="Unix seconds, ISO 8601, now-6h")
    replayer.add_argument("--end", metavar="TIME", help="as --start (default: now)")
    replayer.add_argument(
        "--step", metavar="DURATION", default="15s", help="query resolution (default: 15s)"
    )
    replayer.add_argument(
        "--instance", default="", help="replay the vLLM series of this instance label only"
    )
    replayer.add_argument(
        "--mode",
        choices=MODES,
        help="replay as if policy.mode were this (default: the config's)",
    )
    replayer.add_argument("--json", action="store_true", help="print one JSON object")
    replayer.add_argument(
        "--fleet-runs",
        type=Path,
        metavar="FILE",
        help="the cured runs and fresh baselines the [fleet] group shared, one host's a line "
        "(etcdctl get --prefix --print-value-only PREFIX/GROUP/runs/SERVER/), as the daemon "
        "would have read them",
    )
    replayer.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="also draw speed against baseline, windows, causes and restarts over time "
        "(needs matplotlib: pip install 'vkvagent[plot]')",
    )
    _config_option(replayer)
    replayer.set_defaults(command=_replay)

    run = commands.add_parser(
        "run", help="the daemon: sample, decide and act on a schedule (vkvagent.service runs it)"
    )
    _config_option(run)
    run.set_defaults(command=_run)

    status_cmd = commands.add_parser(
        "status",
        help="the daemon's verdict, with the figures behind it (exit 0 healthy, 1 degraded, "
        "acting or impaired, 2 escalated or critical, 3 unknown)",
    )
    status_cmd.add_argument("--json", action="store_true", help="print the status as JSON")
    status_cmd.add_argument(
        "--explain", action="store_true", help="also list the evidence behind the verdict"
    )
    status_cmd.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="show it again every SECONDS (default 2) until interrupted",
    )
    for short, name, example in (("-w", "warning", "0.8:"), ("-c", "critical", "0.6:")):
        status_cmd.add_argument(
            short,
            f"--{name}",
            metavar="RANGE",
            help=f"exit {1 if name == 'warning' else 2} when the speed ratio is outside RANGE "
            f"(monitoring-plugins range syntax: {example} alerts below {example[:-1]})",
        )
    _config_option(status_cmd)
    status_cmd.set_defaults(command=_status)

    fleet = commands.add_parser("fleet", help="the hosts of this host's [fleet] group")
    fleet.set_defaults(command=_usage(fleet))
    fleet_commands = fleet.add_subparsers(title="commands", metavar="COMMAND")
    fleet_status = fleet_commands.add_parser(
        "status",
        help="a line per host of the group, as each last published itself (exit codes as "
        "`vkvagent status`'s: the worst host's; a host gone silent is unknown)",
    )
    fleet_status.add_argument("--json", action="store_true", help="print one JSON object")
    _config_option(fleet_status)
    fleet_status.set_defaults(command=_later("fleet_status", "status"))

    pause = commands.add_parser(
        "pause",
        help="the daemon makes no restart until a time, not even an emergency's (a stall, a "
        "hung engine); `vkvagent restart` and `apply` still act",
    )
    until = pause.add_mutually_exclusive_group(required=True)
    until.add_argument("--until", metavar="TIME", help="ISO 8601 or Unix seconds")
    until.add_argument("--for", dest="duration", metavar="DURATION", help="e.g. 30m, 6h, 2d")
    _config_option(pause)
    pause.set_defaults(command=_pause)

    resume = commands.add_parser(
        "resume",
        help="end a pause, and forget earlier restarts that did not help (after an escalation)",
    )
    _config_option(resume)
    resume.set_defaults(command=_resume)

    demo = commands.add_parser(
        "demo",
        help="a simulated vLLM degrading and the real agent loop diagnosing it, on a fast "
        "clock (about 30 s; no root, GPU or systemd)",
    )
    demo.add_argument(
        "--time-scale",
        type=float,
        default=400.0,
        metavar="X",
        help="simulated seconds per real second (default: 400)",
    )
    demo.set_defaults(command=_demo)

    config_cmd = commands.add_parser("config", help="configuration")
    config_sub = config_cmd.add_subparsers(metavar="ACTION")
    check = config_sub.add_parser(
        "check", help="validate the configuration and print the effective result"
    )
    check.add_argument(
        "path",
        nargs="?",
        type=Path,
        help="a file, or a directory with config.toml and conf.d/ (default: /etc/vkvagent)",
    )
    check.set_defaults(command=_later("config_check", "check"))
    config_cmd.set_defaults(command=_usage(config_cmd))

    sim = commands.add_parser(
        "sim",
        help="a vLLM stand-in for tests and the demo: `vkvagent sim serve MODEL [vLLM flags]` "
        "(`vkvagent sim serve --help` lists its options)",
        usage="vkvagent sim serve MODEL [vLLM flags] (vkvagent sim serve --help: its options)",
    )
    sim.set_defaults(command=_usage(sim))
    return parser


def _usage(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace, TextIO], int]:
    def show(_args: argparse.Namespace, out: TextIO) -> int:
        parser.print_help(out)
        return ExitCode.USAGE

    return show


def _action_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", default="manual", help="recorded in the ledger and events")
    parser.add_argument(
        "--no-drain",
        action="store_true",
        help="cut off the requests in flight: no wait for a quiet moment, and a vLLM that "
        "would drain by itself is killed",
    )
    _fleet_option(parser)
    _config_option(parser)


def _fleet_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ignore-fleet",
        action="store_true",
        help="with [fleet]: restart without taking a slot of the group (even if all are held)",
    )


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="config file or directory (default: /etc/vkvagent)",
    )


# -- commands ----------------------------------------------------------------------------------


def _run(args: argparse.Namespace, _out: TextIO) -> int:
    from vkvagent.service.daemon import Daemon  # noqa: PLC0415 - the daemon's code only for the daemon

    try:
        daemon = Daemon(args.config)
    except NeedsOperator as exc:  # systemd would only start it again to fail the same way
        for line in str(exc).splitlines():
            print(f"vkvagent: {line}", file=sys.stderr)
        return NEEDS_OPERATOR
    # What the daemon creates from now on is for root and its group only (the unit's UMask=
    # says the same). Set here, for the daemon's own process: Daemon.run also serves the demo.
    os.umask(0o027)
    return daemon.run()


def _status(args: argparse.Namespace, out: TextIO) -> int:
    now = time.time()
    try:
        warning, critical = (
            None if text is None else status_check.Range.parse(text)
            for text in (args.warning, args.critical)
        )
        settings = config.load(args.config)
    except VkvagentError as exc:
        # A monitoring plugin's first line goes to stdout in every state, UNKNOWN included.
        lines = str(exc).splitlines() or [type(exc).__name__]
        if args.json:
            json.dump(status.shown_json(None, now, "", reason="; ".join(lines)), out, indent=1)
            out.write("\n")
        else:
            out.write(status_check.headline(None, now, reason=lines[0]) + "\n")
            out.writelines(f"  {line}\n" for line in lines[1:])
        return status.StatusCode.UNKNOWN
    state_dir = Path(settings.agent.state_dir)
    code = status.StatusCode.UNKNOWN
    try:
        while True:
            now, problem = time.time(), f"{status.NO_STATUS} ({status.path(state_dir)})"
            try:
                report = status.read(state_dir)
            except status.StatusError as exc:
                report, problem = None, str(exc)
            code, _why = status_check.checked(report, now, warning, critical)
            if args.json:
                shown = status.shown_json(
                    report, now, settings.vllm.unit, code=code, reason=problem
                )
                json.dump(shown, out, indent=1)
                out.write("\n")
            else:
                if args.watch and out.isatty():
                    out.write("\033[H\033[2J")  # clear the terminal between views
                out.write(
                    status_text.render(
                        report, now, explain=args.explain, warning=warning, critical=critical,
                        reason=problem,
                    )
                )  # fmt: skip
            out.flush()
            if not args.watch:
                return int(code)
            time.sleep(max(0.2, args.watch))
    except (BrokenPipeError, KeyboardInterrupt) as exc:
        if not args.watch:
            raise
        # Watching ends when its reader goes (`| head -3`) or on Ctrl-C: no error, the last
        # state's code.
        if isinstance(exc, BrokenPipeError):
            _stdout_to_devnull()
        return int(code)


def _pause(args: argparse.Namespace, out: TextIO) -> int:
    from vkvagent.adapters.query_range import parse_duration, parse_time  # noqa: PLC0415

    now = time.time()
    try:
        # A pause of "6" is most likely meant in hours, not seconds: no unit is a mistake.
        if args.duration and args.duration.strip()[-1:].isdigit():
            raise ValueError(f"{args.duration!r} has no unit (e.g. 30m, 6h, 2d)")
        until = (
            now + parse_duration(args.duration) if args.duration else parse_time(args.until, now)
        )
    except ValueError as exc:
        raise UsageError(f"pause: {exc}") from None
    if until <= now:
        raise UsageError("pause: the time is in the past")
    controls.write(Path(config.load(args.config).agent.state_dir), paused_until=until)
    print(
        f"paused: no restarts until {datetime.fromtimestamp(until, timezone.utc).isoformat()}",
        file=out,
    )
    return ExitCode.OK


def _resume(args: argparse.Namespace, out: TextIO) -> int:
    controls.write(Path(config.load(args.config).agent.state_dir), resumed_at=time.time())
    print("resumed: restarts allowed again; earlier restarts no longer count as failed", file=out)
    return ExitCode.OK


def _demo(args: argparse.Namespace, out: TextIO) -> int:
    from vkvagent.tools import demo  # noqa: PLC0415 - the agent never loads the simulator's driver

    if not (0 < args.time_scale < float("inf")):
        raise UsageError(f"demo: --time-scale must be a number above 0, not {args.time_scale:g}")
    try:
        return demo.run(out, scale=args.time_scale)
    except demo.DemoError as exc:
        raise CommandError(f"demo: {exc}") from None


def _replay(args: argparse.Namespace, out: TextIO) -> int:
    from vkvagent.adapters import fleet_runs, query_range  # noqa: PLC0415 - the daemon needs neither
    from vkvagent.tools import replay  # noqa: PLC0415

    if args.plot:
        from vkvagent.tools import plot  # noqa: PLC0415 - matplotlib only when a picture is asked for

        plot.require()  # a PlotError without matplotlib, before the replay's work
    loaded = config.load(args.config)
    settings = loaded.engine_settings(args.mode)
    step: float | None = None
    if args.prometheus:
        if args.files:
            raise UsageError("replay: give FILEs or --prometheus, not both")
        if not args.match or not args.start:
            raise UsageError("replay: --prometheus needs --match SELECTOR and --start TIME")
        now = time.time()
        try:
            start = query_range.parse_time(args.start, now)
            end = query_range.parse_time(args.end or "now", now)
            step = query_range.parse_duration(args.step)
        except ValueError as exc:
            raise UsageError(f"replay: {exc}") from None
        if not (step > 0 and end > start):
            raise UsageError("replay: need --end after --start and a --step above 0")
        replay.check_step(settings, step)
        store = query_range.fetch(args.prometheus, args.match, start, end, step)
    elif args.files:
        if args.match or args.start or args.end:
            raise UsageError("replay: --match, --start and --end go with --prometheus")
        store = query_range.load_files(args.files)
    else:
        raise UsageError("replay: give query_range FILEs, or --prometheus URL --match ...")
    peers = None if args.fleet_runs is None else fleet_runs.load(args.fleet_runs)
    result = replay.run(
        settings,
        store,
        peers=peers,
        step=step,
        model=loaded.vllm.model,
        instance=args.instance,
        trace=bool(args.plot),
        margin=loaded.vllm.rollback_margin,
    )
    if args.plot:
        plot.draw(result, args.plot)
    if args.json:
        json.dump(result.to_json(), out, indent=1, allow_nan=False)
        out.write("\n")
    else:
        out.write(replay.describe(result))
    return ExitCode.OK
