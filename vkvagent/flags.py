"""The vLLM flags vkvagent may set, their checks, and rewriting of vLLM's command line.

Three parts, all pure:

* ``CATALOGUE``: one ``Flag`` per ``vllm serve`` flag that shapes the KV cache or the
  scheduler: its type and limits, the vLLM releases where the agent may set it, the
  ``vllm:cache_config_info`` label that proves it took effect (if any), and why it matters.
* ``validate(flags, vllm_version)``: typed, range-checked values, or a ``FlagError`` listing
  every problem, one line each (``--flag: problem (allowed: ...)``).
* ``parse_command(argv)`` / ``apply_flags(argv, flags)``: read a ``vllm serve`` (or
  ``python -m vllm.entrypoints.openai.api_server``) argv the way vLLM's parser does, and set
  managed flags exactly once in canonical form, leaving every other argument where it was.

Facts are from vLLM's argument parsers and release history (the releases the simulator
imitates, ``vkvagent/sim/serve_args.py``, agree; agent code never imports it). Where a
release boundary is not pinned by a source, the comment says so.

Values can never smuggle an argument or a unit directive: every value is a number, a boolean
or one of a fixed set of words, and ``render_value`` refuses anything but ``[A-Za-z0-9._+-]``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vkvagent import apikey, container
from vkvagent.container import Container
from vkvagent.engine.samples import FlagValue
from vkvagent.errors import VkvagentError

Version = tuple[int, int, int]

GIB = 1 << 30


class FlagError(VkvagentError, ValueError):
    """One or more refused flags: ``problems`` holds one line per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = tuple(problems)


class VllmCommandError(VkvagentError, ValueError):
    """An argv that is not a vLLM server command line vkvagent can rewrite (one line)."""


# --------------------------------------------------------------------------------------------
# Versions


_VERSION = re.compile(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?![\d])")


def parse_version(text: str) -> Version:
    """``(major, minor, patch)`` of a vLLM version as ``GET /version`` reports it.

    Suffixes are ignored: ``0.11.0rc2``, ``0.10.2.dev5+g1234`` and ``0.9.0.post1+cu128`` read as
    their release number, since a release candidate or a dev build already carries the release's
    flags. Raises ``ValueError`` for text that does not start with a version number.
    """
    match = _VERSION.match(text.strip())
    if not match:
        raise ValueError(f"not a vLLM version: {text!r}")
    major, minor, patch = (int(part) if part else 0 for part in match.groups())
    return (major, minor, patch)


def _show_version(version: Version) -> str:
    return ".".join(str(part) for part in version)


# --------------------------------------------------------------------------------------------
# The catalogue


@dataclass(frozen=True)
class Flag:
    """One ``vllm serve`` flag the agent may set.

    ``kind``: ``"float"``, ``"int"``, ``"bool"`` or ``"choice"``. ``minimum``/``maximum``
    bound numbers (inclusive); ``choices`` lists allowed values. ``min_version`` is the first
    vLLM release where the agent may set it, ``max_version`` the first where it may not
    (exclusive); ``version_note`` says why. ``attest_label`` is the ``vllm:cache_config_info``
    label that shows the running value (``None``: not shown there). ``negation_since`` (bools):
    the first release with ``--no-<name>``; before it, False is written by leaving the flag out
    (its default there is False). ``store_boolean_until`` (bools): releases before it take
    ``--<name> true|false`` (V0's ``StoreBoolean``) rather than ``--no-<name>``.
    """

    name: str
    kind: str
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[FlagValue, ...] = ()
    min_version: str | None = None
    max_version: str | None = None
    version_note: str = ""
    attest_label: str | None = None
    attest_note: str = ""
    negation_since: str | None = None
    store_boolean_until: str | None = None

    @property
    def option(self) -> str:
        return "--" + self.name

    def allowed(self) -> str:
        """What values are allowed, as shown in error messages."""
        if self.kind == "bool":
            return "true or false"
        if self.choices:
            return ", ".join(str(choice) for choice in self.choices)
        if self.kind == "int":
            return f"{self.minimum:.0f} to {self.maximum:.0f}"
        return f"{self.minimum:g} to {self.maximum:g}"

    def available(self, version: Version) -> bool:
        """Whether the agent may set this flag on ``version``."""
        low = parse_version(self.min_version) if self.min_version else None
        high = parse_version(self.max_version) if self.max_version else None
        return (low is None or version >= low) and (high is None or version < high)

    def versions(self) -> str:
        """The releases where the agent may set it, e.g. ``vLLM >= 0.18``."""
        if self.min_version and self.max_version:
            return f"vLLM {self.min_version} to before {self.max_version}"
        if self.min_version:
            return f"vLLM >= {self.min_version}"
        if self.max_version:
            return f"vLLM < {self.max_version}"
        return "every vLLM release"

    def attested(self, value: FlagValue, labels: Mapping[str, str]) -> bool | None:
        """Whether ``vllm:cache_config_info``'s labels show ``value`` in effect.

        ``None`` when the flag is not shown there, or this release does not carry the label.
        """
        if self.attest_label is None:
            return None
        if self.name == "swap-space":
            if "swap_space" in labels:  # 0.8-0.10 print GiB as well as bytes
                return _same_number(labels["swap_space"], float(value))
            if "swap_space_bytes" in labels:  # V0 prints bytes only
                return _same_number(labels["swap_space_bytes"], float(value) * GIB)
            return None
        label = labels.get(self.attest_label)
        if label is None:
            return None
        if self.kind == "bool":
            return label == str(bool(value))
        if self.kind in ("int", "float") or isinstance(value, (int, float)):
            return _same_number(label, float(value))
        return label == str(value)


def _same_number(label: str, expected: float) -> bool:
    try:
        return math.isclose(float(label), expected, rel_tol=1e-9, abs_tol=1e-12)
    except ValueError:
        return False


_LARGE = float(1 << 24)  # 16 Mi tokens: above any context length in use

_FLAGS = (
    Flag(
        "gpu-memory-utilization",
        "float",
        "Fraction of GPU memory vLLM may use (weights, activations, then KV cache from the "
        "rest): the main knob for KV capacity. vLLM accepts 0 < x <= 1; the agent keeps "
        "0.1-0.98: the top leaves the driver room, the bottom admits servers that share a GPU "
        "(and vLLM's CPU build, where it is the share of host memory).",
        minimum=0.1,
        maximum=0.98,
        attest_label="gpu_memory_utilization",
    ),
    Flag(
        "block-size",
        "choice",
        "Tokens per KV block. Bigger blocks lower prefix-cache hit rates and overstate usage "
        "for short prompts. vLLM's help says CUDA supports only up to 32.",
        choices=(8, 16, 32, 64, 128),
        attest_label="block_size",
        attest_note="hybrid (Mamba) models and some platforms override the block size",
    ),
    Flag(
        "enable-prefix-caching",
        "bool",
        "Reuse KV blocks of shared prompt prefixes. Default off in V0, on in V1.",
        attest_label="enable_prefix_caching",
        negation_since="0.6.5",  # PR #10724 made it --x/--no-x
    ),
    Flag(
        "max-num-seqs",
        "int",
        "Most sequences scheduled in one step; lowering it relieves KV pressure and "
        "preemption storms. Not shown in cache_config_info.",
        minimum=1,
        maximum=4096,
    ),
    Flag(
        "max-num-batched-tokens",
        "int",
        "Token budget of one scheduler step (the prefill chunk size with chunked prefill); "
        "must be >= max-num-seqs. Not shown in cache_config_info.",
        minimum=1,
        maximum=_LARGE,
    ),
    Flag(
        "max-model-len",
        "int",
        "Context length limit; derived from the model when unset. Shown in GET /v1/models, "
        "not in cache_config_info.",
        minimum=1,
        maximum=_LARGE,
    ),
    Flag(
        "kv-cache-dtype",
        "choice",
        "Data type of the KV cache; fp8 roughly doubles the tokens that fit. Only the "
        "choices every release since 0.6 accepts.",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        attest_label="cache_dtype",
    ),
    Flag(
        "enforce-eager",
        "bool",
        "Skip torch.compile and CUDA graph capture: faster restarts and more memory for KV, "
        "slower decoding. Not shown in cache_config_info.",
        negation_since="0.9",  # engine bools became --x/--no-x with the 0.9 config classes
    ),
    Flag(
        "enable-chunked-prefill",
        "bool",
        "Split long prefills into chunks of max-num-batched-tokens. V1 (>= 0.8) chunks by "
        "default. Not shown in cache_config_info.",
        negation_since="0.8",
        store_boolean_until="0.8",  # V0's `--enable-chunked-prefill [true|false]`
    ),
    Flag(
        "swap-space",
        "float",
        "GiB of CPU memory per GPU for swapped-out KV blocks (V0 swap preemption).",
        minimum=0,
        maximum=1024,
        max_version="0.11",
        version_note=(
            "the V1 engine ignores it (num_cpu_blocks is 0, vLLM #27984) and V0 is gone "
            "from 0.11; it was deprecated in 0.18 and later removed"
        ),
        attest_label="swap_space_bytes",
    ),
    Flag(
        "preemption-mode",
        "choice",
        "How V0 preempts when KV blocks run out: recompute or swap (needs swap-space).",
        choices=("recompute", "swap"),
        max_version="0.8",
        version_note=(
            "from 0.8 (V1 by default) any value makes vLLM fall back to the V0 engine "
            "(vLLM #18115), V1 always recomputes, and the flag is gone from 0.11"
        ),
    ),
    Flag(
        "shutdown-timeout",
        "int",
        "Seconds vLLM drains in-flight requests after SIGTERM (0 aborts them); keep "
        "TimeoutStopSec= above it.",
        minimum=0,
        maximum=3600,
        min_version="0.18",
        version_note="the flag was added in 0.18 (PR #36666)",
    ),
    Flag(
        "cpu-offload-gb",
        "float",
        "GiB of model weights per GPU kept in CPU memory: frees GPU memory for KV blocks at "
        "the cost of speed.",
        minimum=0,
        maximum=1024,
        attest_label="cpu_offload_gb",
    ),
)

CATALOGUE: Mapping[str, Flag] = MappingProxyType({flag.name: flag for flag in _FLAGS})
"""Every flag the agent may set, by name (``--`` and dashes, as vLLM documents them)."""


FOREIGN: Mapping[str, str] = MappingProxyType(
    {
        "model": "it picks the model itself; the operator chooses what is served",
        "served-model-name": "clients and dashboards address the model by this name",
        "tokenizer": "it changes what the model reads; the operator chooses it with the model",
        "revision": "it picks the model's weights; the operator chooses what is served",
        "host": "it changes where vLLM listens, and the agent scrapes that address",
        "port": "it changes where vLLM listens, and clients and the agent use that address",
        "uds": "it changes where vLLM listens, and clients and the agent use that address",
        "api-key": "it is a secret for clients; the agent never writes secrets into a unit",
        "ssl-keyfile": "TLS settings are the operator's; clients depend on them",
        "ssl-certfile": "TLS settings are the operator's; clients depend on them",
        "allowed-origins": "CORS settings are a security decision for the operator",
        "trust-remote-code": (
            "it lets the model repository run arbitrary Python on this host: a security decision "
            "for the operator, never a tuning step"
        ),
        "tensor-parallel-size": (
            "it changes how many GPUs serve the model and must match the host's GPU layout: "
            "capacity planning, not KV tuning"
        ),
        "pipeline-parallel-size": (
            "it changes how many GPUs serve the model and must match the host's GPU layout: "
            "capacity planning, not KV tuning"
        ),
        "data-parallel-size": (
            "it changes how many GPUs serve the model and must match the host's GPU layout: "
            "capacity planning, not KV tuning"
        ),
        "dtype": "it changes the model's numerics and output quality",
        "quantization": "it changes the model's weights and output quality",
        "seed": "it changes sampling results that clients may rely on",
        "num-gpu-blocks-override": (
            "a testing aid that overrides the profiled KV block count: a wrong value runs out of "
            "GPU memory; tune gpu-memory-utilization instead"
        ),
        "config": (
            "the YAML file is the operator's; the agent only writes command-line flags, which "
            "take precedence over it"
        ),
        "download-dir": "it moves the model cache; the operator chooses where weights live",
        "load-format": "it changes how weights are loaded; the operator chooses it with the model",
        "chat-template": "it changes prompts the model sees; the operator chooses it",
        "enable-lora": "adapters are part of what is served; the operator chooses them",
        "lora-modules": "adapters are part of what is served; the operator chooses them",
    }
)
"""vLLM flags the agent refuses to set, with the reason given to the operator."""


def canonical_name(name: str) -> str:
    """A flag name as the catalogue spells it: no leading dashes, underscores read as dashes
    (vLLM rewrites them the same way in the part before the first dot)."""
    name = name.strip()
    if name.startswith("--"):
        name = name[2:]
    head, dot, tail = name.partition(".")
    return head.replace("_", "-") + dot + tail


# --------------------------------------------------------------------------------------------
# Validation

_NAME = re.compile(r"[a-z0-9][a-z0-9.-]*")
_INT_TEXT = re.compile(r"[+-]?\d+")
_FLOAT_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def validate(
    flags: Mapping[str, object], vllm_version: str | None, *, check_versions: bool = True
) -> dict[str, FlagValue]:
    """Check the flags the agent is asked to set on vLLM ``vllm_version``.

    Keys are flag names (``max-num-seqs``, ``max_num_seqs`` and ``--max-num-seqs`` all work);
    values are typed (from TOML or the planner) or text (from the command line), read
    strictly. Returns ``{canonical name: typed value}`` in catalogue order. Raises
    ``FlagError`` listing every problem: unknown flags, flags that are not the agent's to set,
    wrong types, values out of range, flags the target release lacks (or where setting them
    does harm), and combinations vLLM refuses at startup. ``vllm_version`` None (unknown)
    refuses every flag limited to some releases, unless ``check_versions`` is False (the
    config loader checks names, types and ranges; versions are checked when a plan is made).
    """
    problems: list[str] = []
    version: Version | None = None
    if vllm_version is not None:
        try:
            version = parse_version(vllm_version)
        except ValueError:
            problems.append(
                f"vLLM version {vllm_version!r}: not a version number (allowed: e.g. 0.10.1)"
            )
    values: dict[str, FlagValue] = {}
    seen: dict[str, str] = {}
    for key, raw in flags.items():
        name = canonical_name(key)
        shown = "--" + name if _NAME.fullmatch(name) else repr(key)
        if name in seen:
            problems.append(f"{shown}: given twice (as {seen[name]!r} and {key!r})")
            continue
        seen[name] = key
        spec = CATALOGUE.get(name)
        if spec is None:
            allowed = f"(allowed: {', '.join(CATALOGUE)})"
            if name in FOREIGN:
                problems.append(f"{shown}: not a flag vkvagent sets: {FOREIGN[name]} {allowed}")
            elif name.startswith("no-") and name[3:] in CATALOGUE:
                problems.append(f"{shown}: set --{name[3:]} to false instead")
            else:
                problems.append(f"{shown}: unknown flag {allowed}")
            continue
        value, problem = _typed(spec, raw)
        if problem is None and check_versions:
            problem = _version_problem(spec, version, vllm_version)
        if problem is not None:
            problems.append(f"{shown}: {problem}")
            continue
        assert value is not None
        values[name] = value
    problems += _combination_problems(values)
    if problems:
        raise FlagError(problems)
    return {name: values[name] for name in CATALOGUE if name in values}


def _typed(spec: Flag, raw: object) -> tuple[FlagValue | None, str | None]:
    """The value as the flag's type, or why it cannot be."""
    allowed = f"(allowed: {spec.allowed()})"
    value: FlagValue | None = None
    if spec.kind == "bool":
        if isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
            value = raw.strip().lower() == "true"
        else:
            return None, f"expected true or false, got {_show(raw)} {allowed}"
        return value, None
    wanted_int = spec.kind == "int" or (
        spec.kind == "choice" and all(isinstance(c, int) for c in spec.choices)
    )
    if spec.kind == "choice" and not wanted_int:
        if not isinstance(raw, str) or raw not in spec.choices:
            return None, f"{_show(raw)} is not allowed {allowed}"
        return raw, None
    if isinstance(raw, bool):
        pass
    elif isinstance(raw, int) or (isinstance(raw, float) and not wanted_int):
        value = raw
    elif isinstance(raw, str) and wanted_int and _INT_TEXT.fullmatch(raw.strip()):
        value = int(raw.strip())
    elif isinstance(raw, str) and not wanted_int and _FLOAT_TEXT.fullmatch(raw.strip()):
        value = float(raw.strip())
    if value is None:
        kind = "an integer" if wanted_int else "a number"
        return None, f"expected {kind}, got {_show(raw)} {allowed}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return None, f"must be finite, got {value} {allowed}"
        if spec.kind == "float":
            value = float(value)
    if spec.choices:
        if value not in spec.choices:
            return None, f"{_show(raw)} is not allowed {allowed}"
        return value, None
    assert spec.minimum is not None and spec.maximum is not None
    assert isinstance(value, (int, float))
    if not spec.minimum <= value <= spec.maximum:
        return None, f"{value} is out of range {allowed}"
    if spec.kind == "float":
        return float(value), None
    return value, None


def _version_problem(spec: Flag, version: Version | None, text: str | None) -> str | None:
    if spec.min_version is None and spec.max_version is None:
        return None
    why = f": {spec.version_note}" if spec.version_note else ""
    if version is None:
        if text is not None:
            return None  # the version itself is reported as a problem
        return (
            f"the vLLM version is unknown and this flag is only set on {spec.versions()}"
            f"{why}; set [vllm] version or let GET /version answer"
        )
    if spec.available(version):
        return None
    return f"not settable on vLLM {_show_version(version)}{why} (allowed: {spec.versions()})"


def _combination_problems(values: Mapping[str, FlagValue]) -> list[str]:
    """Combinations vLLM refuses at startup (SchedulerConfig checks)."""
    problems = []
    tokens, seqs = values.get("max-num-batched-tokens"), values.get("max-num-seqs")
    if isinstance(tokens, int) and isinstance(seqs, int) and tokens < seqs:
        problems.append(
            f"--max-num-batched-tokens: {tokens} is below --max-num-seqs {seqs}; vLLM refuses "
            f"to start (allowed: >= {seqs})"
        )
    length = values.get("max-model-len")
    if (
        values.get("enable-chunked-prefill") is False
        and isinstance(tokens, int)
        and isinstance(length, int)
        and tokens < length
    ):
        problems.append(
            f"--max-num-batched-tokens: {tokens} is below --max-model-len {length} with "
            f"chunked prefill off; vLLM refuses to start (allowed: >= {length})"
        )
    if values.get("preemption-mode") == "swap" and values.get("swap-space") == 0:
        problems.append(
            "--preemption-mode: swap needs CPU swap space, but --swap-space is 0 "
            "(allowed: recompute, or swap-space > 0)"
        )
    return problems


def _show(value: object) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string"}
    shown = repr(value) if isinstance(value, str) else str(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{kind.get(type(value), type(value).__name__)} {shown}"


# --------------------------------------------------------------------------------------------
# Rendering values

_SAFE_VALUE = re.compile(r"[A-Za-z0-9._+-]+")


def render_value(value: FlagValue) -> str:
    """A non-boolean value as its command-line token: ``0.88``, ``16``, ``fp8``.

    Floats print their shortest exact form (``repr``) without a trailing ``.0``. Raises
    ``ValueError`` for anything that is not a plain token: a value can never add an argument.
    """
    if isinstance(value, bool):
        raise ValueError("booleans are rendered as --flag / --no-flag, not as a value")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"not a finite number: {value!r}")
        text = str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    elif isinstance(value, int):
        text = str(value)
    else:
        text = str(value)
    if not _SAFE_VALUE.fullmatch(text) or (text.startswith("-") and not _NEGATIVE.match(text)):
        raise ValueError(f"unsafe flag value {text!r}: only [A-Za-z0-9._+-] is written")
    return text


def rendered(flags: Mapping[str, object]) -> list[str]:
    """Each flag as today's command line has it (``--max-num-seqs 64``,
    ``--no-enable-prefix-caching``), for people; a value the catalogue refuses, as given."""
    out = []
    for name, value in flags.items():
        try:
            out.append(" ".join(render_flag(name, value)))  # type: ignore[arg-type]
        except ValueError:
            out.append(f"--{name} {value}")
    return out


def shown(flags: Mapping[str, object]) -> str:
    """``--max-num-seqs 4 --block-size 16``: flags on one line, ``(none)`` for none."""
    return " ".join(rendered(flags)) or "(none)"


def render_flag(name: str, value: FlagValue, vllm_version: str | None = None) -> list[str]:
    """The argv tokens that set flag ``name`` to ``value`` on ``vllm_version``.

    Booleans are ``--flag`` / ``--no-flag``; on releases before ``--no-flag`` existed, False is
    no tokens at all (the default there), and V0's ``--enable-chunked-prefill false``. An
    unknown version takes the current spelling. Raises ``ValueError`` for a name outside the
    catalogue or a value of the wrong type.
    """
    spec = CATALOGUE.get(canonical_name(name))
    if spec is None:
        raise ValueError(f"--{canonical_name(name)} is not in the catalogue")
    version = parse_version(vllm_version) if vllm_version else None
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{spec.option} takes a boolean, got {value!r}")
        if value:
            return [spec.option]
        if (
            spec.store_boolean_until
            and version is not None
            and version < parse_version(spec.store_boolean_until)
        ):
            return [spec.option, "false"]
        if (
            spec.negation_since
            and version is not None
            and version < parse_version(spec.negation_since)
        ):
            return []
        return ["--no-" + spec.name]
    if isinstance(value, bool) or (spec.kind in ("int", "float") and isinstance(value, str)):
        raise ValueError(f"{spec.option} takes a {spec.kind}, got {value!r}")
    if spec.kind == "int" and not isinstance(value, int):
        raise ValueError(f"{spec.option} takes an integer, got {value!r}")
    return [spec.option, render_value(value)]


# --------------------------------------------------------------------------------------------
# The command line

_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse reads these as values, not options
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
    if len(token) < 2 or token[0] != "-" or _NEGATIVE.match(token):
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
