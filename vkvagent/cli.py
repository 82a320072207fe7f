"""The ``vkvagent`` command line. Runs in-process in tests: ``main(argv, stdout, stderr)``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from enum import IntEnum
from pathlib import Path
from typing import Callable, TextIO

from vkvagent import __version__, advice, apikey, config, controls, fleet, hardening, replay, status
from vkvagent.actuator import Actuator, Plan
from vkvagent.atomicfile import write_atomically
from vkvagent.drain import engine_stop_too_short
from vkvagent.engine.gpu_faults import describe_xid
from vkvagent.engine.policy import MODES, PolicySettings, window_state
from vkvagent.engine.samples import GpuReading, VllmMetrics, utc_text
from vkvagent.engine.slo import ITL_BOUNDS, TTFT_BOUNDS, bracket
from vkvagent.errors import NEEDS_OPERATOR, NeedsOperator, VkvagentError
from vkvagent.events import Events
from vkvagent.flags import shown as flags_shown
from vkvagent.gpu import GpuReader, NvmlBackend, RecordedBackend, reader_for, record
from vkvagent.history import History, HistoryError
from vkvagent.ledger import Ledger
from vkvagent.outcome import Outcome
from vkvagent.systemd import Systemd, SystemdError, UnitState
from vkvagent.vllm import VllmClient
from vkvagent.vllm_metrics import Normaliser


class ExitCode(IntEnum):
    """Documented exit codes (docs/commands.md, "Exit codes")."""

    OK = 0
    FAILURE = 1  # what was asked could not be done: unreadable vLLM, bad page, bad config
    USAGE = 2  # the command line itself is wrong
    # The reader of stdout went away (`vkvagent replay ... | head -3`): stopped quietly, with
    # the status a shell gives a writer SIGPIPE ended (128 + 13), as in any other pipeline.
    BROKEN_PIPE = 141


class CommandError(VkvagentError):
    """A one-line reason the command failed; printed as ``vkvagent: <reason>``."""


class UsageError(CommandError):
    """The command line is wrong in a way argparse cannot tell (exit 2)."""


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
    scrape.set_defaults(command=_scrape)

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
    gpu.set_defaults(command=_gpu)

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
    plan.set_defaults(command=_plan)

    apply = commands.add_parser(
        "apply", help="apply [vllm.flags] now: drop-in, restart, attest; rolled back on failure"
    )
    when = apply.add_mutually_exclusive_group(required=True)
    when.add_argument("--now", action="store_true", help="apply immediately")
    when.add_argument(
        "--at-next-window",
        action="store_true",
        help="wait until a [policy] restart window is open, then apply (now, if one is)",
    )
    _action_options(apply)
    apply.set_defaults(command=_apply)

    restart = commands.add_parser("restart", help="restart vLLM through the safe path")
    _action_options(restart)
    restart.set_defaults(command=_restart)

    rollback = commands.add_parser(
        "rollback", help="put back the drop-in vkvagent replaced last, and restart"
    )
    rollback.add_argument(
        "--reason", default="manual rollback", help="recorded in the ledger and events"
    )
    _fleet_option(rollback)
    _config_option(rollback)
    rollback.set_defaults(command=_rollback)

    adopt = commands.add_parser(
        "adopt", help="accept the unit's current command line (someone's manual edits included)"
    )
    _config_option(adopt)
    adopt.set_defaults(command=_adopt)

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
        help="the daemon's verdict, with the figures behind it (exit 0 healthy, 1 degraded or "
        "acting, 2 escalated or critical, 3 unknown)",
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
        "clock (about a minute; no root, GPU or systemd)",
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
    check.set_defaults(command=_config_check)
    config_cmd.set_defaults(command=_usage(config_cmd))

    sim = commands.add_parser(
        "sim",
        help="a vLLM stand-in for tests and the demo: `vkvagent sim serve MODEL [vLLM flags]` "
        "(`vkvagent sim serve --help` lists its options)",
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


def _config_check(args: argparse.Namespace, out: TextIO) -> int:
    notes: list[str] = []
    loaded = config.load(args.path, notes=notes)
    files = config.config_files(args.path)
    warnings = [note for note in notes if note.endswith(config.SKIPPED)]
    sandbox = hardening.Sandbox.installed()
    refused = hardening.refusals(loaded, sandbox) if sandbox is not None else []
    warnings += [f"{r.key}: {r.message}" for r in refused]
    buckets, beyond = _slo_buckets(loaded)
    notes += buckets
    warnings += beyond
    state, seen = _unit_state(loaded.vllm.unit)
    unit = _unit_warning(state, loaded.policy.mode)
    warnings += [unit] if unit else []
    notes += [seen] if seen else []
    access_warnings, access_notes = _vllm_access(loaded.vllm, state)
    warnings += access_warnings
    if state is not None and loaded.restart.graceful_shutdown:
        cut = engine_stop_too_short(state, math.ceil(loaded.restart.drain_timeout))
        warnings += [f"{loaded.vllm.unit}: {cut}"] if cut else []
    notes += access_notes
    read = ", ".join(map(str, files)) or "no file, defaults only"
    said = f"valid, with {len(warnings)} warning(s) on stderr" if warnings else "OK"
    print(f"# configuration {said}; read: {read}", file=out)
    for note in notes:
        if note not in warnings:
            print(f"# {note}", file=out)
    if sandbox is None:
        print(f"# {hardening.UNIT} is not installed here: its sandbox was not checked", file=out)
    out.write(config.render(loaded))
    out.flush()
    for warning in warnings:
        print(f"vkvagent: warning: {warning}", file=sys.stderr)
    text = hardening.dropin(refused)
    if text is not None:  # the lines to paste, as they are
        print(
            f"vkvagent: the hardened {hardening.UNIT} allows them with this drop-in, "
            f"{hardening.DROPIN} (then: systemctl daemon-reload; systemctl restart vkvagent):",
            file=sys.stderr,
        )
        sys.stderr.write(text)
    return ExitCode.OK


def _unit_state(name: str) -> tuple[UnitState | None, str]:
    """vLLM's unit as systemd has it, or a note when systemd cannot be asked or has no such
    unit (no warning then: the check is of the files, and may run before vLLM's unit is
    written)."""
    try:
        with Systemd(timeout=5) as bus:
            return bus.unit(name), ""
    except SystemdError as exc:
        return None, f"{name} not checked: {exc}"


def _unit_warning(unit: UnitState | None, mode: str) -> str:
    """A warning for a vLLM unit that an exit 0 of vLLM would leave down, or that nothing
    wants (``status.unit_warning``)."""
    if unit is None:
        return ""
    if unit.load_state not in ("loaded", "masked"):
        return (
            f"systemd cannot load {unit.name} (LoadState={unit.load_state}): neither systemd "
            f"nor vkvagent can start it (systemctl status {unit.name} says why)"
        )
    file_state = "masked" if unit.load_state == "masked" else unit.unit_file_state
    return status.unit_warning(unit.name, unit.restart_policy, unit.wanted, mode, file_state)


def _vllm_access(cfg: config.VllmConfig, unit: UnitState | None) -> tuple[list[str], list[str]]:
    """(warnings, notes) on how vkvagent reaches vLLM: a URL that does not speak the unit's
    TLS, and where the probe's API key comes from. KeyFileError: ``api_key_file`` is unusable."""
    warnings, notes = [], []
    key = apikey.read_key_file(cfg.api_key_file) if cfg.api_key_file else None
    argv = unit.exec_start[-1].argv if unit is not None and unit.exec_start else ()
    key = key or (unit.api_key if unit is not None else None)
    if key is not None:
        notes.append(f"the probe sends vLLM's API key from {key.source}")
    tls = any(a.split("=", 1)[0] in ("--ssl-certfile", "--ssl_certfile") for a in argv)
    if tls and not cfg.url.startswith("https://"):
        warnings.append(
            f"{cfg.unit} serves https (--ssl-certfile) but [vllm] url is {cfg.url}: set "
            'url = "https://..." and, for a certificate of your own CA, ca_file'
        )
    return warnings, notes


# Each latency objective's target key, and the VllmMetrics histogram it is measured on.
_SLO_HISTOGRAMS = {"ttft_seconds": "time_to_first_token", "itl_seconds": "inter_token_latency"}
_Layout = dict[str, tuple[float, ...]]  # histogram -> its bucket bounds


def _slo_buckets(loaded: config.Config) -> tuple[list[str], list[str]]:
    """A note for each declared latency objective: the bounds of vLLM's bucket its target
    falls in, since attainment is interpolated within it; a warning for a target beyond the
    last finite bound, which +Inf's bucket cannot tell."""
    targets = {key: getattr(loaded.slo, key) for key in _SLO_HISTOGRAMS}
    declared = {key: target for key, target in targets.items() if target is not None}
    if not declared:
        return [], []
    layouts, source = _histogram_layouts(
        loaded.agent.state_dir, [_SLO_HISTOGRAMS[key] for key in declared]
    )
    notes: list[str] = []
    warnings: list[str] = []
    for key, target in declared.items():
        said: dict[str, list[str]] = {}  # what the target's bucket is -> whose layouts say so
        for whose, layout in layouts.items():
            said.setdefault(_bucket_words(target, layout[_SLO_HISTOGRAMS[key]]), []).append(whose)
        for words, names in said.items():
            every = len(said) == 1 and len(layouts) > 1
            shown = "every vLLM version" if every else "; ".join(names)
            line = f"slo: {key} {target:g} {words} (buckets of {shown}{source})"
            (warnings if words.startswith("is beyond") else notes).append(line)
    return notes, warnings


def _bucket_words(target: float, bounds: Sequence[float]) -> str:
    found = bracket(bounds, target)
    if found is None:
        last = max(b for b in bounds if math.isfinite(b))
        return (
            f"is beyond vLLM's last finite bucket bound, {last:g} s: only what that bound "
            "holds counts as within the target"
        )
    lower, upper = found
    if target == upper:
        return f"is one of vLLM's bucket bounds ({upper:g} s): attainment is counted exactly"
    return (
        f"falls between vLLM's buckets {lower:g} and {upper:g} s: attainment is interpolated "
        "within that bucket, as histogram_quantile does"
    )


def _histogram_layouts(state_dir: str, needed: Sequence[str]) -> tuple[dict[str, _Layout], str]:
    """The bucket bounds of the histograms ``needed``, by whose they are, and a note on
    where they come from: the running vLLM's own, in the newest sample of the daemon's
    history that has them (its last hour); else V0's and V1's (``engine.slo``), as config
    check reaches no vLLM itself."""
    try:
        with History(state_dir, readonly=True, busy_timeout=1.0) as history:
            latest = history.latest()
            recent = history.samples(since=latest.time - 3600.0) if latest else []
        for sample in reversed(recent):
            metrics = sample.vllm
            found = {name: getattr(metrics, name, None) for name in needed}
            if metrics is not None and all(found.values()):
                whose = f"vLLM {metrics.version or f'(flavour {metrics.flavor})'}"
                layout = {name: h.bounds for name, h in found.items() if h is not None}
                return {whose: layout}, f", its sample of {utc_text(sample.time)} in {history.path}"
        why = f"{history.path}: no sample of them in its last hour"
    except HistoryError as exc:
        why = str(exc)
    layouts = {
        f"vLLM {engine}": {"time_to_first_token": TTFT_BOUNDS[engine],
                           "inter_token_latency": ITL_BOUNDS[engine]}
        for engine in TTFT_BOUNDS
    }  # fmt: skip
    return layouts, f"; the running vLLM's are unknown: {why}"


def _run(args: argparse.Namespace, _out: TextIO) -> int:
    from vkvagent.daemon import Daemon  # noqa: PLC0415 - apscheduler only for the daemon

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
            None if text is None else status.Range.parse(text)
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
            out.write(status.headline(None, now, reason=lines[0]) + "\n")
            out.writelines(f"  {line}\n" for line in lines[1:])
        return status.StatusCode.UNKNOWN
    state_dir = Path(settings.agent.state_dir)
    code = status.StatusCode.UNKNOWN
    try:
        while True:
            now, problem = time.time(), status.NO_STATUS
            try:
                report = status.read(state_dir)
            except status.StatusError as exc:
                report, problem = None, str(exc)
            code, _why = status.checked(report, now, warning, critical)
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
                    status.render(
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
    now = time.time()
    try:
        until = (
            now + replay.parse_duration(args.duration)
            if args.duration
            else replay.parse_time(args.until, now)
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
    from vkvagent import demo  # noqa: PLC0415 - the agent never loads the simulator's driver

    if not (0 < args.time_scale < float("inf")):
        raise UsageError(f"demo: --time-scale must be a number above 0, not {args.time_scale:g}")
    try:
        return demo.run(out, scale=args.time_scale)
    except demo.DemoError as exc:
        raise CommandError(f"demo: {exc}") from None


def _replay(args: argparse.Namespace, out: TextIO) -> int:
    if args.plot:
        from vkvagent import plot  # noqa: PLC0415 - matplotlib only when a picture is asked for

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
            start = replay.parse_time(args.start, now)
            end = replay.parse_time(args.end or "now", now)
            step = replay.parse_duration(args.step)
        except ValueError as exc:
            raise UsageError(f"replay: {exc}") from None
        if not (step > 0 and end > start):
            raise UsageError("replay: need --end after --start and a --step above 0")
        replay.check_step(settings, step)
        store = replay.fetch(args.prometheus, args.match, start, end, step)
    elif args.files:
        if args.match or args.start or args.end:
            raise UsageError("replay: --match, --start and --end go with --prometheus")
        store = replay.load_files(args.files)
    else:
        raise UsageError("replay: give query_range FILEs, or --prometheus URL --match ...")
    result = replay.run(
        settings,
        store,
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


def _scrape(args: argparse.Namespace, out: TextIO) -> int:
    settings = config.load(args.config).vllm
    settings = dataclasses.replace(
        settings,
        url=args.url or settings.url,
        model=settings.model if args.model is None else args.model,
    )
    if args.file is not None:
        metrics = Normaliser(settings.model).normalise(
            _read_page(args.file, settings.max_page_bytes), settings.version or None
        )
    else:
        client = VllmClient.from_config(settings)
        metrics = client.scrape(client.version() or settings.version or None)
    if args.json:
        json.dump(metrics.to_json(), out, indent=2, sort_keys=False)
        out.write("\n")
    else:
        out.write(describe_metrics(metrics))
    return ExitCode.OK


def _read_page(path: Path, limit: int) -> str:
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with path.open("rb") as handle:
                data = handle.read(limit + 1)
    except OSError as exc:
        raise CommandError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise CommandError(f"{path}: page exceeds the {limit}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CommandError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    # `$(curl ...)` and many editors drop the final newline. Over HTTP a page without one was
    # cut off (and is refused); a file is read as the whole page, with a word of caution.
    if text.strip() and not text.endswith("\n"):
        print(
            f"vkvagent: warning: {path}: the last line has no final newline; "
            "read as complete (a page cut off mid-line would be misread)",
            file=sys.stderr,
        )
        text += "\n"
    return text


def _gpu(args: argparse.Namespace, out: TextIO) -> int:
    if args.record:
        try:
            backend = NvmlBackend()
            try:
                recording = record(backend)
            finally:
                backend.close()
        except Exception as exc:  # NvmlUnavailable, or an NVML error mid-way
            raise CommandError(f"cannot record: {exc}") from None
        args.record.write_text(json.dumps(recording, indent=1) + "\n", encoding="utf-8")
        print(f"recorded {len(recording['devices'])} GPU(s) to {args.record}", file=out)
        return ExitCode.OK
    if args.replay:
        try:
            replayed = RecordedBackend.load(str(args.replay))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CommandError(f"{args.replay}: not a GPU recording: {exc}") from None
        reader = GpuReader(open=lambda: replayed)
    else:
        settings = config.load(args.config).gpu
        reader = reader_for(settings.devices, settings.recording)
    readings, problem = reader.read()
    if args.json:
        json.dump({"gpus": [r.to_json() for r in readings], "error": problem}, out, indent=2)
        out.write("\n")
    elif readings:
        out.write(describe_gpus(readings))
    if problem is None:
        return ExitCode.OK
    # Some GPUs read: what is missing is a warning. None: the command failed.
    print(f"vkvagent: {'warning: ' if readings else ''}{problem}", file=sys.stderr)
    return ExitCode.OK if readings else ExitCode.FAILURE


def _actuator(settings: config.Config, err: TextIO) -> Actuator:
    state_dir = Path(settings.agent.state_dir)

    def progress(message: str) -> None:
        # One line that updates on a terminal (the drain, the start); nothing in a log.
        if err.isatty():
            print(f"\r\033[Kvkvagent: {message}", end="", file=err, flush=True)

    return Actuator.for_config(
        settings,
        systemd=Systemd(),
        ledger=Ledger(state_dir),
        gpus=reader_for(
            settings.gpu.devices, settings.gpu.recording, settings.diagnosis.fault_memory
        )
        if settings.gpu.enabled
        else None,
        progress=progress,
    )


def _recovered(actuator: Actuator, out: TextIO) -> None:
    """Finish or undo what an interrupted vkvagent left, before anything new."""
    outcome = actuator.recover()
    if outcome is not None:
        print(
            f"recovered action {outcome.action_id}: {outcome.message} ({outcome.result})", file=out
        )


def _report(unit: str, outcome: Outcome, out: TextIO) -> int:
    events = Events.for_command()
    if events is not None:
        for name, message, fields in outcome.events(unit, "manual"):
            events.emit(name, message, **fields)
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)  # the progress line, done
    for hook in outcome.hooks:
        if not hook.ok:
            print(f"vkvagent: {hook.name} {hook.problem}:\n{hook.output}", file=sys.stderr)
    timing = f"{outcome.seconds:.1f} s"
    if outcome.service_seconds is not None:
        overhead = outcome.seconds - outcome.service_seconds
        timing += f"; vLLM's own start {outcome.service_seconds:.1f} s, vkvagent's {overhead:.2f} s"
    line = f"{outcome.result}: {outcome.message} (action {outcome.action_id}, {timing})"
    if outcome.costs is not None:
        line += f"\n  {status.costs_line(outcome.costs.to_json())}"
    if outcome.result == "done":
        print(line, file=out)
        return ExitCode.OK
    print(f"vkvagent: {line}", file=sys.stderr)  # a failure, reported as every other one is
    return ExitCode.FAILURE


def _plan_for(
    actuator: Actuator, settings: config.Config, wanted: Mapping[str, object] | None = None
) -> Plan:
    """The change [vllm.flags] (or ``wanted``, a table in its place) makes on the unit."""
    flags = settings.vllm.flags if wanted is None else wanted
    return actuator.plan(flags, actuator.vllm_version())


def _plan(args: argparse.Namespace, out: TextIO) -> int:
    if args.write is not None and not args.suggested:
        raise UsageError("--write needs --suggested")
    settings = config.load(args.config)
    if args.suggested:
        return _plan_suggested(args, settings, out)
    actuator = _actuator(settings, sys.stderr)
    plan = _plan_for(actuator, settings)
    if args.json:
        drains = actuator.drain_flags(actuator.vllm_version())
        json.dump({**_plan_json(plan), "drain_flags": drains}, out, indent=1)
        out.write("\n")
        return ExitCode.OK
    print(f"unit:   {plan.unit}", file=out)
    print(f"before: {shlex.join(plan.before)}", file=out)
    print(f"after:  {shlex.join(plan.after)}", file=out)
    if not plan.changed:
        said = "already runs with these flags" if settings.vllm.flags else "needs no change"
        print(f"the unit {said}", file=out)
    version = actuator.vllm_version()
    drains = actuator.drain_flags(version)
    if drains:
        shown = " ".join(f"--{name} {value}" for name, value in drains.items())
        print(f"{shown}: vLLM drains when stopped ([restart] graceful_shutdown)", file=out)
        drain = actuator.drain_plan(version)
        if drain is not None and not drain.changes:
            print(
                "the next restart writes KillMode=mixed first: under the unit's KillMode="
                "control-group systemd's stop reaches vLLM's engine too, failing what it runs",
                file=out,
            )
    elif cut := actuator.drain_cut_short(version):
        print(f"no --shutdown-timeout: {cut}", file=out)
    attestable = ", ".join(plan.attestable) or "none"
    unproven = ", ".join(f for f in plan.flags if f not in plan.attestable) or "none"
    print(
        f"proven after the restart by cache_config_info: {attestable}; "
        f"by the process's command line only: {unproven}",
        file=out,
    )
    return ExitCode.OK


def _plan_json(plan: Plan) -> dict[str, object]:
    return {
        "unit": plan.unit,
        "before": list(plan.before),
        "after": list(plan.after),
        "changed": plan.changed,
        "flags": plan.flags,
        "attestable": list(plan.attestable),
    }


def _plan_suggested(args: argparse.Namespace, settings: config.Config, out: TextIO) -> int:
    """The daemon's last suggestion as a [vllm.flags] change: diff, conf.d file, command
    line. No status is a failure (nothing to read); a status without a suggestion is not."""
    now = time.time()
    report = status.read(Path(settings.agent.state_dir))
    nothing = advice.nothing_to_suggest(report)
    if report is None:
        raise CommandError(f"{nothing} ({status.path(Path(settings.agent.state_dir))})")
    if nothing is not None:
        if args.json:
            said = {"nothing": nothing, "diagnosis": advice.diagnosis_json(report, now)}
            json.dump(said, out, indent=1)
            out.write("\n")
        else:
            print(nothing, file=out)
        return ExitCode.OK
    actuator = _actuator(settings, sys.stderr)
    version = actuator.vllm_version()
    target = args.write or _suggested_path(args.config)
    # A file read after the target would win over it; the target's own earlier suggestion
    # stays in it (the plan starts from the effective table, which holds it).
    later = advice.set_after(config.config_files(args.config), target) if target else {}
    suggested = advice.suggest(report, settings.vllm.flags, version, later)
    text = advice.conf_d_text(suggested, advice.flags_in(target) if target else None)
    plan = _plan_for(actuator, settings, suggested.after) if suggested.changes else None
    written = args.write is not None and plan is not None
    if written:
        try:  # root's, readable by all: the loader refuses files others could have written
            args.write.parent.mkdir(mode=0o755, exist_ok=True)  # conf.d, on a first use
            write_atomically(args.write, text, 0o644)
        except OSError as exc:
            raise CommandError(f"{args.write}: {exc.strerror or exc}") from None
    if args.json:
        shown = {
            **suggested.to_json(now),
            "diff": advice.toml_diff(suggested, _config_source(args.config)),
            "conf_d": {"path": str(target) if target else None, "text": text},
            "written": str(args.write) if written else None,
            "plan": _plan_json(plan) if plan is not None else None,
        }
        json.dump(shown, out, indent=1)
        out.write("\n")
        return ExitCode.OK
    print(advice.diagnosis_line(report, now), file=out)
    for problem in suggested.left_out.values():
        print(f"left out: {problem}", file=out)
    for name, value in suggested.already.items():
        print(f"already in [vllm.flags]: {flags_shown({name: value})}", file=out)
    if plan is None:
        unwritten = f" ({args.write} not written)" if args.write is not None else ""
        print(f"nothing to suggest: [vllm.flags] already has every flag it can take{unwritten}",
              file=out)  # fmt: skip
        return ExitCode.OK
    out.write(advice.toml_diff(suggested, _config_source(args.config)))
    if args.write is not None:
        print(f"written: {args.write}", file=out)
    elif target is not None:
        print(f"as a conf.d file ({target}):", file=out)
    else:
        print("--config is a file, which reads no conf.d: add these lines to it", file=out)
    out.write(text)
    print(f"unit:   {plan.unit}", file=out)
    print(f"before: {shlex.join(plan.before)}", file=out)
    print(f"after:  {shlex.join(plan.after)}", file=out)
    return ExitCode.OK


def _config_source(path: Path | None) -> str:
    return str(path if path is not None else config.DEFAULT_DIR)


def _suggested_path(path: Path | None) -> Path | None:
    """Where the conf.d file goes: the configuration directory's conf.d (None: --config
    names a file, which reads no conf.d)."""
    directory = path if path is not None else config.DEFAULT_DIR
    if path is not None and not path.is_dir():
        return None
    return directory / config.DROPIN_DIR / advice.FILE_NAME


def _apply(args: argparse.Namespace, out: TextIO) -> int:
    settings = config.load(args.config)
    actuator = _actuator(settings, sys.stderr)
    if args.at_next_window:
        wait_for_window(settings.policy.settings(settings.restart), out)
    with actuator.exclusive():
        _recovered(actuator, out)
        plan = _plan_for(actuator, settings)
        if not plan.changed:
            print("nothing to apply: the unit already runs with these flags", file=out)
            return ExitCode.OK
        drain = not args.no_drain
        return _in_slot(
            settings, args, lambda: actuator.restart(args.reason, plan=plan, drain=drain), out
        )


def wait_for_window(
    settings: PolicySettings,
    out: TextIO,
    now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once one of the policy's restart windows is open (at once if one is)."""
    told = None
    while True:
        is_open, upcoming = window_state(settings, now())
        if is_open:
            return
        if upcoming is None:
            raise CommandError("no restart window in [policy] windows: use --now")
        if upcoming != told:
            print(f"waiting for the restart window at {upcoming.isoformat()}", file=out, flush=True)
            told = upcoming
        # Wake at the window, or every 5 minutes meanwhile (a suspended host, a clock step).
        sleep(min(300.0, max(0.5, (upcoming - now()).total_seconds())))


def _restart(args: argparse.Namespace, out: TextIO) -> int:
    settings = config.load(args.config)
    actuator = _actuator(settings, sys.stderr)
    with actuator.exclusive():
        _recovered(actuator, out)
        drain = not args.no_drain
        return _in_slot(settings, args, lambda: actuator.restart(args.reason, drain=drain), out)


def _rollback(args: argparse.Namespace, out: TextIO) -> int:
    settings = config.load(args.config)
    actuator = _actuator(settings, sys.stderr)
    with actuator.exclusive():
        _recovered(actuator, out)
        actuator.check_rollback()  # nothing to undo: say so before asking the fleet for a slot
        return _in_slot(settings, args, lambda: actuator.rollback(args.reason), out)


def _in_slot(
    settings: config.Config, args: argparse.Namespace, act: Callable[[], Outcome], out: TextIO
) -> int:
    """Run ``act`` (a restart) holding a slot of the fleet's group, as the daemon's restarts
    do, so that no more than max_concurrent hosts are down at once; the slot is given back
    however it ends. Refused (FleetError) while every slot is held or etcd does not answer,
    unless --ignore-fleet."""
    if not settings.fleet.endpoints or args.ignore_fleet:
        return _report(settings.vllm.unit, act(), out)

    def say(_event: str, message: str, **_fields: object) -> None:
        print(f"vkvagent: {message}", file=sys.stderr, flush=True)

    gate = fleet.Gate(settings.fleet, say)
    with gate.slot(cause="manual", reason=f"manual: {args.reason}", emergency=False) as turn:
        if not turn.allowed:
            raise fleet.FleetError(f"{turn.admission.why}; --ignore-fleet restarts anyway")
        outcome = act()
        turn.result = outcome.result
    return _report(settings.vllm.unit, outcome, out)


def _adopt(args: argparse.Namespace, out: TextIO) -> int:
    actuator = _actuator(config.load(args.config), sys.stderr)
    with actuator.exclusive():
        _recovered(actuator, out)
        plan = actuator.adopt()
    print(f"adopted {plan.unit}'s command line: {shlex.join(plan.after)}", file=out)
    return ExitCode.OK


# -- human-readable output ---------------------------------------------------------------------


def describe_metrics(m: VllmMetrics) -> str:
    def num(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:,.0f}{unit}"

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value * 100:.1f} %"

    lines = [
        f"vLLM {m.version or 'version unknown'}, metrics flavour {m.flavor}, "
        f"model {', '.join(m.models) or '-'}, {m.engines} engine(s)",
        f"  requests      running {num(m.num_requests_running)}, "
        f"waiting {num(m.num_requests_waiting)}",
        f"  KV cache      usage {pct(m.kv_cache_usage)} "
        f"(fullest engine {pct(m.kv_cache_usage_max)})",
        f"  preemptions   {num(m.num_preemptions_total)} since start",
        f"  tokens        prompt {num(m.prompt_tokens_total)}, "
        f"generated {num(m.generation_tokens_total)}, "
        f"requests finished {num(m.request_success_total)}",
    ]
    if m.prefix_cache_queries_total is not None:
        ratio = (
            (m.prefix_cache_hits_total or 0) / m.prefix_cache_queries_total
            if m.prefix_cache_queries_total
            else None
        )
        lines.append(
            f"  prefix cache  {num(m.prefix_cache_hits_total)} hits of "
            f"{num(m.prefix_cache_queries_total)} {m.prefix_cache_unit} queried "
            f"({pct(ratio)})"
        )
    elif m.prefix_cache_hit_rate is not None:
        lines.append(f"  prefix cache  hit rate {pct(m.prefix_cache_hit_rate)}")
    for label, hist in (("TTFT", m.time_to_first_token), ("ITL", m.inter_token_latency)):
        if hist is not None and hist.count:
            lines.append(
                f"  {label:<13} mean {hist.sum / hist.count * 1000:.1f} ms over "
                f"{hist.count:,.0f} since start"
            )
    if m.cache_config:
        shown = (
            "block_size",
            "gpu_memory_utilization",
            "enable_prefix_caching",
            "cache_dtype",
            "num_gpu_blocks",
        )
        lines.append(
            "  cache config  "
            + ", ".join(f"{k}={m.cache_config[k]}" for k in shown if k in m.cache_config)
        )
    return "\n".join(lines) + "\n"


def describe_gpus(readings: Sequence[GpuReading]) -> str:
    lines = []
    for r in readings:

        def show(value: float | None, unit: str) -> str:
            return "-" if value is None else f"{value:.0f}{unit}"

        memory = (
            "-"
            if r.memory_used_bytes is None or not r.memory_total_bytes
            else f"{r.memory_used_bytes / 2**30:.1f}/{r.memory_total_bytes / 2**30:.1f} GiB"
        )
        lines.append(
            f"GPU {r.index} {r.name}: {show(r.utilization_percent, ' %')} busy, mem {memory}, "
            f"{show(r.temperature_c, ' C')}, {show(r.power_w, ' W')}/"
            f"{show(r.power_limit_w, ' W')}, SM {show(r.sm_clock_mhz, '')}/"
            f"{show(r.sm_clock_max_mhz, ' MHz')}, "
            f"throttled: {', '.join(r.throttled_by) or 'no'}"
            + "".join(f", {describe_xid(xid)}" for xid in r.xid_errors)
            + (
                f", uncorrected ECC {r.ecc_uncorrected_volatile}"
                if r.ecc_uncorrected_volatile
                else ""
            )
        )
    return "\n".join(lines) + "\n"
