"""The checks before a restart or flag change touches vLLM: each says why the action must not
begin (a one-line refusal, "" when it may), so that nothing is drained, written or stopped
for an action that would fail, or leave the unit worse off.

The unit must be loaded and running one command (``unit_refusal``); a flag change needs write
access to the drop-in (``write_refusal``); a GPU fault is not what a restart fixes
(``gpu_fault_refusal``); someone's edit is not overwritten (``foreign_refusal``); and the starts
must stay within the unit's start limit (``start_limit_refusal``).

Apart from the actuator because each is a judgement of its own on what systemd, NVML and the
ledger say; the actuator decides when they run and turns a refusal into its error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vkvagent.actuation import unit_command
from vkvagent.adapters.gpu import GpuReader
from vkvagent.adapters.ledger import Ledger
from vkvagent.adapters.systemd import UnitState
from vkvagent.engine.gpu_faults import describe_xid
from vkvagent.knowledge.dropin import argv_hash, is_foreign_edit


def unit_refusal(unit: str, state: UnitState, down: bool) -> str:
    """Why ``unit`` cannot be acted on as it is: not loaded, not running (unless ``down``: a
    unit that is inactive or failed is then started), or not one ExecStart= command."""
    if state.load_state != "loaded":
        return f"{unit} is {state.load_state}"
    if down and state.active_state in ("inactive", "failed"):
        pass  # started: the point of the action
    elif state.active_state != "active":
        return (
            f"{unit} is {state.active_state} ({state.sub_state}); "
            "systemd's Restart= handles a unit that is down"
        )
    if len(state.exec_start) != 1:
        return (
            f"{unit} has {len(state.exec_start)} ExecStart= commands; vkvagent manages "
            "units that run one"
        )
    return ""


def write_refusal(path: Path, unit: str) -> str:
    """Before anything is drained or written: can this process write the drop-in ``path``?"""
    directory = path.parent
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    targets = [directory] + ([path] if path.exists() else [])
    for target in targets:
        if not os.access(target, os.W_OK):
            return f"access denied: cannot write {path} (changing {unit}'s flags needs root)"
    return ""


def gpu_fault_refusal(gpus: GpuReader) -> str:
    """A GPU with uncorrectable memory errors or a hardware or driver XID within the
    reader's fault window needs a reset or a person; a restart would only bring vLLM back
    onto the faulty device. An application XID is what a restart fixes: no refusal. The
    XIDs come from the reader's log, so the sampler still sees them (and vice versa)."""
    readings, _problem = gpus.read(consume_xids=False)
    found: dict[int, list[str]] = {}
    for event in gpus.faults():
        found.setdefault(event.index, []).append(describe_xid(event.xid))
    for gpu in readings:
        if (gpu.ecc_uncorrected_volatile or 0) > 0:
            found.setdefault(gpu.index, []).append(
                f"{gpu.ecc_uncorrected_volatile} uncorrectable ECC errors"
            )
    if not found:
        return ""
    index = min(found, key=lambda i: (i < 0, i))
    uuid = next((gpu.uuid for gpu in readings if gpu.index == index), "")
    name = f"GPU {index}" if index >= 0 else "a GPU that NVML did not name"
    return (
        f"{name}{f' ({uuid})' if uuid else ''} reports "
        f"{', '.join(dict.fromkeys(found[index]))}: a restart cannot fix a GPU fault; "
        "it needs a GPU reset or a person"
    )


def foreign_edit(path: Path) -> str:
    """The refusal for a drop-in ``path`` that someone else edited."""
    return (
        f"{path} was edited by someone else; vkvagent will not overwrite it "
        "(run `vkvagent adopt` to take it over)"
    )


def foreign_refusal(
    state: UnitState,
    text: str | None,
    path: Path,
    base: dict[str, Any] | None,
    quadlet: bool,
) -> str:
    """Why vkvagent's drop-in ``path`` (its ``text``, None when absent) is no longer its to
    rewrite: someone edited it, or the unit's own command line (the ``.container`` file's,
    when ``quadlet``) changed since vkvagent derived its ``base`` from it."""
    if text is not None and is_foreign_edit(text):
        return foreign_edit(path)
    if base is not None and text is not None:
        own = unit_command.own(state)
        if own is not None and argv_hash(own) != base["own_hash"]:
            return (
                f"{state.source_path if quadlet else state.fragment_path} changed "
                "since vkvagent derived its command line (run `vkvagent adopt`)"
            )
    return ""


def start_limit_refusal(
    unit: str, state: UnitState, need: int, ledger: Ledger, now: float, job_timeout: float
) -> str:
    """Why ``need`` more starts (two for a flag change: its own and a rollback's) could exceed
    the unit's start limit, which would leave it failed (start-limit-hit); "" when they cannot.

    systemd does not publish its count, so it is estimated: every restart vkvagent began
    within StartLimitIntervalSec, the start of the process the first of them replaced, and
    the running process's start when it is not one of vkvagent's. Other starts by others
    (systemctl, Restart=) before the running one are not seen. A restart step not yet ended
    is taken to have lasted ``job_timeout``."""
    if state.start_limit_burst <= 0 or state.start_limit_interval_usec <= 0:
        return ""
    window = state.start_limit_interval_usec / 1e6
    since = now - window
    ours: list[tuple[float, float]] = []  # (begun, ended) of each restart step
    for action in ledger.since(since):
        if action.outcome == "aborted":  # nothing reached systemd (a refused job included)
            continue
        begun: float | None = None
        for step in action.steps:
            if step.step != "restart":
                continue
            if step.state == "begin":
                begun = step.at
                if begun >= since:
                    ours.append((begun, begun + job_timeout))
            elif begun is not None and begun >= since:
                ours[-1] = (begun, step.at)
    running = state.exec_main_start_timestamp / 1e6
    own_start = any(begun - 1 <= running <= ended + 1 for begun, ended in ours)
    others = (1 if ours else 0) + (1 if running >= since and not own_start else 0)
    starts = len(ours) + others
    if starts + need <= state.start_limit_burst:
        return ""
    return (
        f"{unit} was started about {starts} times in the last {window:g} s; "
        f"{need} more (a {'flag change and its rollback' if need > 1 else 'restart'}) "
        f"could exceed its StartLimitBurst={state.start_limit_burst} "
        f"(StartLimitIntervalSec={window:g}) and leave it failed: try again later"
    )
