"""``vkvagent config check``: the configuration validated and printed as it takes effect,
with warnings on what the files alone cannot show: vLLM's unit as systemd has it (one an exit 0
would leave down, a drain its engine's stop would cut short), how vkvagent reaches vLLM (TLS,
the probe's API key), the [slo] targets against vLLM's histogram buckets, and what the
hardened unit's sandbox would refuse."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import TextIO

from vkvagent import apikey
from vkvagent.actuation.drain import engine_stop_too_short
from vkvagent.adapters.history import History, HistoryError
from vkvagent.adapters.systemd import Systemd, SystemdError, UnitState
from vkvagent.engine.samples import utc_text
from vkvagent.engine.slo import ITL_BOUNDS, TTFT_BOUNDS, bracket
from vkvagent.knowledge import config, hardening, status_text, toml_schema
from vkvagent.tools.exitcodes import ExitCode


def check(args: argparse.Namespace, out: TextIO) -> int:
    notes: list[str] = []
    loaded = config.load(args.path, notes=notes)
    files = config.config_files(args.path)
    warnings = [note for note in notes if note.endswith((config.SKIPPED, config.UNDECLARED))]
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
    out.write(toml_schema.render(loaded))
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
    wants (``status_text.unit_warning``)."""
    if unit is None:
        return ""
    if unit.load_state not in ("loaded", "masked"):
        return (
            f"systemd cannot load {unit.name} (LoadState={unit.load_state}): neither systemd "
            f"nor vkvagent can start it (systemctl status {unit.name} says why)"
        )
    file_state = "masked" if unit.load_state == "masked" else unit.unit_file_state
    return status_text.unit_warning(unit.name, unit.restart_policy, unit.wanted, mode, file_state)


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
