"""vLLM's server command line, read the way vLLM's own parser reads it, and rewritten.

``parse_command(argv)`` reads a ``vllm serve`` (or ``python -m
vllm.entrypoints.openai.api_server``) argv, in a container too, into a ``VllmCommand``: its
launcher, every option where it stands, the model; ``apply_flags(argv, flags)`` sets managed
flags (``flags.CATALOGUE``) exactly once in canonical form (``flags.render_flag``), leaving every
other argument where it was. Pure: what vLLM's parser does with each option comes from the
parser facts of each release (``data/vllm-options-<release>.json``).

Apart from ``flags`` because it is another thing: the flags are what may be set and how each
is written; this is the command line they are written into.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vkvagent import apikey, container
from vkvagent.container import Container
from vkvagent.engine.samples import FlagValue
from vkvagent.errors import VkvagentError
from vkvagent.knowledge.flags import (
    CATALOGUE,
    NEGATIVE_NUMBER,
    Flag,
    Version,
    canonical_name,
    parse_version,
    render_flag,
)


class VllmCommandError(VkvagentError, ValueError):
    """An argv that is not a vLLM server command line vkvagent can rewrite (one line)."""


_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
_API_SERVER = "vllm.entrypoints.openai.api_server"
_CLI_MODULES = ("vllm.entrypoints.cli.main", "vllm")
_SHELLS = ("sh", "bash", "dash", "zsh")
# Python options that take a separate argument (python -W ignore -X dev -m ...).
_PYTHON_VALUE_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")

# What vLLM's own argument parser says of every option, per release (tools/vllm_flag_facts.py
# writes a file from an installed vLLM; a new release is a new file). The reader needs two
# things from it: which options take no value (else the token after them reads as their value
# and a positional model after them goes unseen) and which take several. Options outside every
# file that are followed by a plain word are read as taking that word; that only affects which
# positional is reported as the model, never which tokens apply_flags touches.
FACTS_DIR = Path(__file__).parent / "data"
FACTS_PREFIX = "vllm-options-"


def parser_facts() -> dict[Version, Mapping[str, Any]]:
    """Each release's parser facts (``{"options": {name: facts}}``), by release number."""
    out: dict[Version, Mapping[str, Any]] = {}
    for path in sorted(FACTS_DIR.glob(f"{FACTS_PREFIX}*.json")):
        out[parse_version(path.stem[len(FACTS_PREFIX) :])] = json.loads(path.read_text())
    return out


def _option_shapes() -> dict[str, str]:
    """How the newest release that has each option parses it: ``none`` (no value), ``many``
    (nargs +) or ``one``."""
    shapes: dict[str, str] = {}
    for _release, facts in sorted(parser_facts().items()):  # a newer release overwrites
        for name, option in facts["options"].items():
            many = option["nargs"] in ("+", "*")
            shapes[name] = "none" if not option["takes_value"] else "many" if many else "one"
    return shapes


_SHAPES = _option_shapes()
# Options of releases before the first facts file that take no value, and several values.
_OLDER_NO_VALUE = frozenset(
    {
        "disable-log-requests",
        "disable-frontend-multiprocessing",
        "disable-async-output-proc",
        "enable-reasoning",
        "calculate-kv-scales",
    }
)
_OLDER_MANY_VALUES = frozenset({"prompt-adapters"})
_NO_VALUE = frozenset(n for n, shape in _SHAPES.items() if shape == "none") | (
    _OLDER_NO_VALUE - _SHAPES.keys()
)
_MANY_VALUES = frozenset(n for n, shape in _SHAPES.items() if shape == "many") | (
    _OLDER_MANY_VALUES - _SHAPES.keys()
)
# vLLM's multi-letter short options (argparse aliases); any other "-Xyz" is "-X" with "yz".
_SHORT_WITH_VALUE = frozenset({"-tp", "-pp", "-dp", "-dpn", "-dpr", "-dpa", "-dpl", "-asc", "-dcp"})


@dataclass(frozen=True)
class Occurrence:
    """One option on the command line: ``argv[start:stop]`` spells it.

    ``name`` is canonical (dashes, no ``--``, no ``no-``); ``negated`` for ``--no-<name>``;
    ``value`` the text given to it (``--x=v`` or ``--x v``), None when it has none.
    """

    name: str
    start: int
    stop: int
    value: str | None
    negated: bool = False
    managed: bool = False


@dataclass(frozen=True)
class VllmCommand:
    """A vLLM server command line, read as vLLM's parser reads it.

    ``argv[:launcher_start]`` is whatever runs before vLLM (``/usr/bin/env VAR=x``, ``nice``,
    ``uv run``), kept verbatim; ``argv[launcher_start:args_start]`` starts vLLM
    (``vllm serve`` or ``python3 -m vllm.entrypoints.openai.api_server``); the rest are vLLM's
    arguments; ``entrypoint`` is ``"serve"``, ``"api_server"`` or ``"sim"`` (vkvagent's
    simulator). ``options`` lists every option in order; ``config_file`` is the ``--config``
    YAML if any: flags set only there are overridden by the command line, and the agent cannot
    see them (it reads no YAML).
    """

    argv: tuple[str, ...]
    entrypoint: str
    launcher_start: int
    args_start: int
    model: str | None
    config_file: str | None
    options: tuple[Occurrence, ...]
    positionals: tuple[int, ...] = field(default=())
    end_of_options: int | None = None
    container: Container | None = None  # the engine's part, when vLLM runs in a container

    @property
    def wrapper(self) -> tuple[str, ...]:
        return self.argv[: self.launcher_start]

    @property
    def launcher(self) -> tuple[str, ...]:
        return self.argv[self.launcher_start : self.args_start]

    def occurrences(self, name: str) -> tuple[Occurrence, ...]:
        """Every occurrence of flag ``name`` (any spelling), in order."""
        wanted = canonical_name(name)
        return tuple(option for option in self.options if option.name == wanted)

    def raw(self, name: str) -> str | None:
        """The text of the last occurrence's value (argparse keeps the last one)."""
        found = self.occurrences(name)
        return found[-1].value if found else None

    def value(self, name: str) -> FlagValue | None:
        """A managed flag's effective value on this command line, typed; None when absent.

        Booleans: ``--x`` True, ``--no-x`` False, V0's ``--x false`` False. A value that does
        not read as the flag's type comes back as its text (vLLM would refuse it).
        """
        spec = CATALOGUE.get(canonical_name(name))
        found = self.occurrences(name)
        if spec is None or not found:
            return None
        last = found[-1]
        if spec.kind == "bool":
            if last.negated:
                return False
            return last.value is None or last.value.lower() != "false"
        if last.value is None:
            return None
        return _read_value(spec, last.value)

    def values(self) -> dict[str, FlagValue]:
        """Every catalogue flag present on the command line, with its effective value."""
        out: dict[str, FlagValue] = {}
        for name in CATALOGUE:
            value = self.value(name)
            if value is not None:
                out[name] = value
        return out


def _read_value(spec: Flag, text: str) -> FlagValue:
    wanted_int = spec.kind == "int" or (
        spec.kind == "choice" and all(isinstance(c, int) for c in spec.choices)
    )
    try:
        if wanted_int:
            return _human_readable_int(text)
        if spec.kind == "float":
            return float(text)
    except ValueError:
        return text
    return text


_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _human_readable_int(text: str) -> int:
    """vLLM's ``human_readable_int`` (newer releases): 32k = 32000, 32K = 32768."""
    match = _HUMAN.fullmatch(text.strip())
    if not match:
        return int(text)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * _DECIMAL[suffix])
    return int(number) * _BINARY[suffix]


def _is_option(token: str) -> bool:
    """argparse's test: does ``token`` read as an option rather than a value?"""
    if len(token) < 2 or token[0] != "-" or NEGATIVE_NUMBER.match(token):
        return False
    return " " not in token or "=" in token.split(" ", 1)[0]


def parse_command(argv: Sequence[str]) -> VllmCommand:
    """Read a vLLM server command line (``ExecStart``'s argv).

    Recognises ``[wrapper...] vllm serve [MODEL] ...`` (any path to ``vllm``) and
    ``[wrapper...] PYTHON [python options] -m vllm.entrypoints.openai.api_server ...`` (also
    ``-m vllm.entrypoints.cli.main serve``), where PYTHON is ``python``, ``python3``,
    ``python3.11`` or a path to one (a venv's). Also ``vkvagent sim serve`` / ``python -m
    vkvagent sim serve``, the simulator that stands in for ``vllm serve`` in demos and tests
    (entrypoint ``"sim"``). Options: ``--x v``, ``--x=v``, underscores in names, ``--no-x``,
    repeats (the last wins), ``--`` ending options. In a container (``podman run ... IMAGE
    ...``, vkvagent.container) vLLM's part starts after the image: the image's entrypoint,
    ``vllm serve``, takes the arguments, unless they start with one of the forms above.
    Raises ``VllmCommandError``.
    """
    args = tuple(str(a) for a in argv)
    try:
        engine = container.find(args)
    except container.ContainerError as exc:
        raise VllmCommandError(str(exc)) from None
    found = _find_launcher(args, engine.image + 1 if engine is not None else 0)
    if found is None and engine is not None:  # the image's entrypoint is `vllm serve`
        found = engine.image + 1, engine.image + 1, "serve"
    if found is None:
        raise VllmCommandError(_not_vllm(args))
    launcher_start, args_start, entrypoint = found
    options: list[Occurrence] = []
    positionals: list[int] = []
    end_of_options: int | None = None
    i = args_start
    while i < len(args):
        token = args[i]
        if end_of_options is not None:
            positionals.append(i)
            i += 1
            continue
        if token == "--":
            end_of_options = i
            i += 1
            continue
        if not _is_option(token):
            positionals.append(i)
            i += 1
            continue
        occurrence = _read_option(args, i)
        options.append(occurrence)
        i = occurrence.stop
    model = None
    for option in options:
        if option.name == "model" and option.value is not None:
            model = option.value
    if model is None and entrypoint in ("serve", "sim") and positionals:
        model = args[positionals[0]]
    config = [o.value for o in options if o.name == "config" and o.value is not None]
    return VllmCommand(
        argv=args,
        entrypoint=entrypoint,
        launcher_start=launcher_start,
        args_start=args_start,
        model=model,
        config_file=config[-1] if config else None,
        options=tuple(options),
        positionals=tuple(positionals),
        end_of_options=end_of_options,
        container=engine,
    )


def _read_option(args: tuple[str, ...], i: int) -> Occurrence:
    token = args[i]
    if token.startswith("--"):
        head, eq, explicit = token.partition("=")
        name = canonical_name(head)
    else:  # a short option (-tp 2, -O3, -q awq): never a managed flag
        head, eq, explicit = token.partition("=")
        name = head[1:]
        if not eq and len(token) > 2 and token not in _SHORT_WITH_VALUE:
            return Occurrence(name=token[1:2], start=i, stop=i + 1, value=token[2:])
    value: str | None = explicit if eq else None

    def takes(j: int) -> bool:
        return j < len(args) and args[j] != "--" and not _is_option(args[j])

    negated = False
    spec = CATALOGUE.get(name)
    if spec is None and name.startswith("no-") and CATALOGUE.get(name[3:], None) is not None:
        spec = CATALOGUE[name[3:]]
        if spec.kind == "bool":
            name, negated = name[3:], True
        else:
            spec = None
    stop = i + 1
    if spec is not None:
        if spec.kind == "bool":
            # V0's StoreBoolean takes an optional true/false; --no-x and the others take none.
            if (
                not eq
                and not negated
                and spec.store_boolean_until
                and takes(stop)
                and args[stop].lower() in ("true", "false")
            ):
                value, stop = args[stop], stop + 1
        elif not eq and takes(stop):
            value, stop = args[stop], stop + 1
        return Occurrence(name, i, stop, value, negated, managed=True)
    if eq or name.startswith("no-") or name in _NO_VALUE:
        return Occurrence(name, i, stop, value)
    if name in _MANY_VALUES:
        values = []
        while takes(stop):
            values.append(args[stop])
            stop += 1
        return Occurrence(name, i, stop, " ".join(values) if values else None)
    if takes(stop):
        value, stop = args[stop], stop + 1
    return Occurrence(name, i, stop, value)


def _find_launcher(args: tuple[str, ...], start: int = 0) -> tuple[int, int, str] | None:
    """(where vLLM's launcher starts, where its arguments start, entrypoint), or None."""
    for i in range(start, len(args)):
        token = args[i]
        base = os.path.basename(token)
        if base == "vllm" and args[i + 1 : i + 2] == ("serve",):
            return i, i + 2, "serve"
        if base == "vkvagent" and args[i + 1 : i + 3] == ("sim", "serve"):
            return i, i + 3, "sim"
        if _PYTHON.fullmatch(base):
            j = i + 1
            while j < len(args) and args[j].startswith("-") and args[j] != "-m":
                if args[j].startswith("-m"):  # -mvllm.entrypoints...
                    break
                j += 2 if args[j] in _PYTHON_VALUE_OPTIONS else 1
            module, after = "", j
            if j + 1 < len(args) and args[j] == "-m":
                module, after = args[j + 1], j + 2
            elif j < len(args) and args[j].startswith("-m") and len(args[j]) > 2:
                module, after = args[j][2:], j + 1
            if module == _API_SERVER:
                return i, after, "api_server"
            if module in _CLI_MODULES and args[after : after + 1] == ("serve",):
                return i, after + 1, "serve"
            if module == "vkvagent" and args[after : after + 2] == ("sim", "serve"):
                return i, after + 2, "sim"
    return None


def _not_vllm(args: tuple[str, ...]) -> str:
    # Escaped where not printable: an argument may hold a newline, the message is one line.
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(args))
    if len(shown) > 120:
        shown = shown[:117] + "..."
    for i, token in enumerate(args):
        if os.path.basename(token) in _SHELLS and i + 1 < len(args) and args[i + 1] == "-c":
            return (
                f"ExecStart runs a shell script ({token} -c ...): vkvagent cannot rewrite flags "
                f"inside it; start vllm directly in ExecStart= (got: {shown})"
            )
    return (
        "not a vLLM server command line: expected `vllm serve [MODEL] ...` or "
        f"`python -m {_API_SERVER} ...` (got: {shown})"
    )


def apply_flags(
    argv: Sequence[str], flags: Mapping[str, FlagValue], *, vllm_version: str | None = None
) -> list[str]:
    """``argv`` with each flag in ``flags`` set exactly once, in canonical form.

    Every earlier spelling of those flags (``--x v``, ``--x=v``, ``--x_y``, ``--no-x``, V0's
    ``--x false``, repeats) is removed, and the canonical tokens (``render_flag``) are added
    after the last option, before a ``--`` if there is one, in catalogue order: the last
    occurrence wins in argparse, and the command line wins over a ``--config`` YAML. Everything
    else keeps its place. ``flags`` should come from ``validate``; names outside the catalogue
    and unsafe values raise ``ValueError`` all the same (``VllmCommandError`` for an argv that is
    not vLLM's).
    """
    command = parse_command(argv)
    if apikey.spelled_out(argv):
        raise VllmCommandError(apikey.ON_COMMAND_LINE)
    wanted: dict[str, FlagValue] = {}
    for key, value in flags.items():
        name = canonical_name(key)
        if name not in CATALOGUE:
            raise ValueError(f"--{name} is not a flag vkvagent sets")
        wanted[name] = value
    drop: set[int] = set()
    for option in command.options:
        if option.managed and option.name in wanted:
            drop.update(range(option.start, option.stop))
    added: list[str] = []
    for name in CATALOGUE:
        if name in wanted:
            added += render_flag(name, wanted[name], vllm_version)
    insert_at = command.end_of_options if command.end_of_options is not None else len(command.argv)
    out = [token for i, token in enumerate(command.argv[:insert_at]) if i not in drop]
    return out + added + list(command.argv[insert_at:])
