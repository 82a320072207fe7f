"""The vLLM flags vkvagent may set, their checks, and how they are written.

Three parts, all pure:

* ``CATALOGUE``: one ``Flag`` per ``vllm serve`` flag that shapes the KV cache or the
  scheduler: its type and limits, the vLLM releases where the agent may set it, the
  ``vllm:cache_config_info`` label that proves it took effect (if any), and why it matters.
* ``validate(flags, vllm_version)``: typed, range-checked values, or a ``FlagError`` listing
  every problem, one line each (``--flag: problem (allowed: ...)``).
* ``render_flag(name, value)``: the tokens that set a flag, in canonical form, for the
  command line (``vllm_command.apply_flags`` writes them) and for people (``rendered``).

Facts are from vLLM's argument parsers and release history (the releases the simulator
imitates, ``vkvagent/sim/serve_args.py``, agree; agent code never imports it). Where a
release boundary is not pinned by a source, the comment says so.

Values can never smuggle an argument or a unit directive: every value is a number, a boolean
or one of a fixed set of words, and ``render_value`` refuses anything but ``[A-Za-z0-9._+-]``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from vkvagent.engine.samples import FlagValue
from vkvagent.errors import VkvagentError

Version = tuple[int, int, int]

GIB = 1 << 30


class FlagError(VkvagentError, ValueError):
    """One or more refused flags: ``problems`` holds one line per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = tuple(problems)


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
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse reads these as values, not options


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
    if not _SAFE_VALUE.fullmatch(text) or (
        text.startswith("-") and not NEGATIVE_NUMBER.match(text)
    ):
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
