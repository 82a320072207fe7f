"""The commands that change vLLM's unit through the actuator: ``plan`` (what ``apply`` would
do, or the change the daemon's diagnosis suggests), ``apply``, ``restart``, ``rollback`` and
``adopt``; and what they share: the actuator as a command builds it, finishing an interrupted
action first, a slot of the fleet's group around a restart, the outcome's report."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TextIO

from vkvagent.actuation.actuator import Actuator, Plan
from vkvagent.actuation.outcome import Outcome
from vkvagent.adapters import fleet
from vkvagent.adapters.gpu import reader_for
from vkvagent.adapters.ledger import Ledger
from vkvagent.adapters.systemd import Systemd
from vkvagent.atomicfile import write_atomically
from vkvagent.engine.policy import PolicySettings, window_state
from vkvagent.knowledge import advice, config, status, status_text
from vkvagent.knowledge.events import Events
from vkvagent.knowledge.flags import shown as flags_shown
from vkvagent.tools.exitcodes import CommandError, ExitCode, UsageError


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
        line += f"\n  {status_text.costs_line(outcome.costs.to_json())}"
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


def plan(args: argparse.Namespace, out: TextIO) -> int:
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


def apply(args: argparse.Namespace, out: TextIO) -> int:
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


def restart(args: argparse.Namespace, out: TextIO) -> int:
    settings = config.load(args.config)
    actuator = _actuator(settings, sys.stderr)
    with actuator.exclusive():
        _recovered(actuator, out)
        drain = not args.no_drain
        return _in_slot(settings, args, lambda: actuator.restart(args.reason, drain=drain), out)


def rollback(args: argparse.Namespace, out: TextIO) -> int:
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


def adopt(args: argparse.Namespace, out: TextIO) -> int:
    actuator = _actuator(config.load(args.config), sys.stderr)
    with actuator.exclusive():
        _recovered(actuator, out)
        plan = actuator.adopt()
    print(f"adopted {plan.unit}'s command line: {shlex.join(plan.after)}", file=out)
    return ExitCode.OK
