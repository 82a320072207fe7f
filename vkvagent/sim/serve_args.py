"""``vllm serve`` flags as each imitated vLLM release accepts and refuses them.

``parse_serve_args(argv, flavor)`` reads what follows ``vllm serve`` (or
``python -m vllm.entrypoints.openai.api_server``) the way that release's
``FlexibleArgumentParser`` and engine-config checks do, so a flag the agent rewrites badly
fails the simulated start as it would fail the real one:

* ``--flag value`` and ``--flag=value``; underscores in the option *name* read as dashes
  (``--max_num_seqs=64``), values untouched; a repeated flag: the last one wins;
* ``--x`` / ``--no-x`` pairs where the release builds the flag with
  ``argparse.BooleanOptionalAction``, plain ``store_true`` flags where it does not (there
  ``--no-x`` is unknown, ``--x=true`` is "ignored explicit argument");
* ``vllm serve MODEL`` or ``--model MODEL``; both at once is refused as the release refuses it;
* human-readable integers (``32k`` = 32000, ``32K`` = 32768) where the release parses them;
* argparse's own wording for usage errors (``unrecognized arguments: ...``, ``invalid int
  value: 'x'``, ``invalid choice: ...``), raised as ``ServeArgsError`` with ``exit_code`` 2;
* the engine's checks that follow parsing (GPU memory fraction, ``max_num_batched_tokens >=
  max_num_seqs``, ...) as ``ServeArgsError`` with ``exit_code`` 1: real vLLM dies with a
  traceback there, not a usage message. ``ServeArgsError.render()`` gives the stderr text.

Only the flags listed in ``_build_table`` are known; any other real vLLM flag is refused as
unrecognized (the simulator is stricter than vLLM there, never looser). Argparse's
abbreviations (``--max-num-seq`` for ``--max-num-seqs``) are refused too. Where vLLM's
message is not known from its source, the message says what is wrong in the simulator's
words; those places are marked ``# sim wording``.

Sources: ``vllm/engine/arg_utils.py`` of ~0.7.0 (V0 flags; 0.6.6 lacks ``--calculate-kv-scales``
as the 0.6 cache_config_info shows), ~0.8.5 and ~0.9/0.11 copies, ``vllm/config`` of 0.8.5,
~0.10.0 and 2026 main, ``vllm/utils/argparse_utils.py`` (2026), PRs #10724 (``--no-enable-
prefix-caching``, v0.6.5), #17546 (``--api-server-count``, v0.9.0), #21739/#29402
(``--enable-log-requests``; ``--disable-log-requests`` deprecated in 0.10.1, removed in 0.12),
#36666 (``--shutdown-timeout``, v0.18.0), #36216 (``--swap-space`` removed, 2026).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

FLAVOR_VERSIONS = {"v0": "0.6.6", "v1-0.8": "0.8.5", "v1-0.10": "0.10.1", "v1-latest": "0.32.0"}
"""The vLLM release each metrics flavour imitates (what ``GET /version`` answers)."""

GIB_BYTES = 1 << 30
DEFAULT_PROG = "vllm serve"

# V1 defaults for `vllm serve` on a GPU with >= 70 GiB that is not an A100 (an 80 GiB H100):
# arg_utils `_set_default_args_v1` / `get_batch_defaults`.
V1_MAX_NUM_SEQS = 1024
V1_MAX_NUM_BATCHED_TOKENS = 8192
V0_MAX_NUM_SEQS = 256


class ServeArgsError(Exception):
    """A command line the imitated vLLM refuses.

    ``exit_code`` 2: argparse refused it (vLLM prints ``vllm serve: error: <message>``);
    ``exit_code`` 1: parsing passed but the engine config refused it with ``exc_type``
    (vLLM prints a traceback ending in ``<exc_type>: <message>``).
    """

    def __init__(self, message: str, *, exit_code: int = 2, exc_type: str = "argparse") -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.exc_type = exc_type

    def render(self, prog: str = DEFAULT_PROG) -> str:
        """The last stderr line(s) vLLM prints for this error."""
        if self.exit_code == 2:
            return main_error(self.message, prog)
        return f"{self.exc_type}: {self.message}"


def main_error(message: str, prog: str = DEFAULT_PROG) -> str:
    """argparse's error line: print it to stderr and exit with status 2."""
    return f"{prog}: error: {message}"


@dataclass(frozen=True)
class ServeArgs:
    """The engine and server settings a ``vllm serve`` command line gives, defaults filled in
    for the imitated release. ``None`` means "not decided by the flags": the release derives it
    from the model (``max_model_len``; V0's ``max_num_batched_tokens`` and
    ``enable_chunked_prefill``, see ``resolve_for_model``) or the release has no such setting
    (``swap_space`` on v1-latest, ``shutdown_timeout`` before it, ``prefix_caching_hash_algo``
    on V0). ``explicit`` names the fields set on the command line."""

    model: str
    served_model_names: tuple[str, ...] = ()
    host: str = "0.0.0.0"  # vLLM's None: every interface
    port: int = 8000
    api_key: str | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str | None = None
    max_num_seqs: int = V1_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # -1 on v1-latest: "auto", fit to memory
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    calculate_kv_scales: bool = False
    enforce_eager: bool = False
    swap_space: float | None = 4  # GiB; an int when defaulted, as vLLM's own default is
    cpu_offload_gb: float = 0
    preemption_mode: str | None = None
    shutdown_timeout: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    api_server_count: int = 1
    enable_chunked_prefill: bool | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    num_gpu_blocks_override: int | None = None
    seed: int | None = None
    disable_log_requests: bool = False
    enable_log_requests: bool = False
    disable_log_stats: bool = False
    explicit: frozenset[str] = field(default_factory=frozenset)

    @property
    def served_model_name(self) -> str:
        """The name in API responses and in the metrics' ``model_name`` label (the first)."""
        return self.served_model_names[0] if self.served_model_names else self.model


# --------------------------------------------------------------------------------------------
# Value converters: a ValueError reads as argparse's "invalid <name> value: '<v>'", an
# _ArgTypeError (argparse.ArgumentTypeError) as its own message.


class _ArgTypeError(Exception):
    pass


_Convert = Callable[[str], Any]

_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def _human_readable_int(value: str, *, tera: bool) -> int:
    """vLLM's ``human_readable_int``: 1k = 1000, 1K = 1024, 25.6k = 25600; 't'/'T' only in
    releases that list them (before that the regex matched them and ``int()`` refused)."""
    value = value.strip()
    match = _HUMAN.fullmatch(value)
    if match:
        decimal = {"k": 10**3, "m": 10**6, "g": 10**9}
        binary = {"K": 2**10, "M": 2**20, "G": 2**30}
        if tera:
            decimal["t"], binary["T"] = 10**12, 2**40
        number, suffix = match.groups()
        if suffix in decimal:
            return int(float(number) * decimal[suffix])
        if suffix in binary:
            try:
                return int(number) * binary[suffix]
            except ValueError as exc:
                raise _ArgTypeError(
                    f"Decimals are not allowed with binary suffixes like {suffix}. "
                    f"Did you mean to use {number}{suffix.lower()} instead?"
                ) from exc
    return int(value)


def _hri(value: str) -> int:
    return _human_readable_int(value, tera=False)


def _hri_t(value: str) -> int:
    return _human_readable_int(value, tera=True)


def _hri_or_auto(value: str) -> int:
    if value.strip() == "-1" or value.strip().lower() == "auto":
        return -1
    return _human_readable_int(value, tera=True)


def _nullable_str(value: str) -> str | None:
    return None if not value or value == "None" else value


def _optional(convert: _Convert, shown: str) -> _Convert:
    """arg_utils' ``optional_type``/``optional_int``: '' or 'None' is None."""

    def optional(value: str) -> Any:
        if value in ("", "None"):
            return None
        try:
            return convert(value)
        except ValueError as exc:
            raise _ArgTypeError(f"Value {value} cannot be converted to {shown}.") from exc

    return optional


def _store_boolean(value: str) -> bool:
    """V0's ``StoreBoolean`` action (``--enable-chunked-prefill [true|false]``)."""
    if value.lower() == "true":
        return True
    if value.lower() == "false":
        return False
    # A ValueError raised inside the action: a traceback, not a usage error.
    raise ServeArgsError(
        f"Invalid boolean value: {value}. Expected 'true' or 'false'.",
        exit_code=1,
        exc_type="ValueError",
    )


_INT_SHOWN = "<class 'int'>"


# --------------------------------------------------------------------------------------------
# The flag tables.


@dataclass(frozen=True)
class _Flag:
    dest: str
    options: tuple[str, ...]  # as argparse lists option_strings (names the flag in messages)
    kind: str = "value"  # value | true (store_true) | bool (BooleanOptionalAction)
    #                      | strbool (V0 StoreBoolean, nargs='?') | names (nargs='+')
    convert: _Convert = str
    type_name: str = "str"
    choices: tuple[object, ...] | None = None

    @property
    def display(self) -> str:
        return "/".join(self.options)


_KV_CACHE_DTYPES = {
    "v0": ("auto", "fp8", "fp8_e5m2", "fp8_e4m3"),
    "v1-0.8": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "v1-0.10": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"),
    "v1-latest": tuple(
        sorted(
            (
                "auto",
                "float16",
                "bfloat16",
                "fp8",
                "fp8_e4m3",
                "fp8_e5m2",
                "fp8_inc",
                "fp8_ds_mla",
                "nvfp4_ds_mla",
                "turboquant_k8v4",
                "turboquant_4bit_nc",
                "turboquant_k3v4_nc",
                "turboquant_3bit_nc",
                "int4_per_token_head",
                "int8_per_token_head",
                "fp8_per_token_head",
                "nvfp4",
                "nvfp4_4over6",
            )
        )
    ),
}
_OLD_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_BLOCK_SIZES: dict[str, tuple[object, ...] | None] = {
    "v0": (8, 16, 32, 64, 128),
    "v1-0.8": (1, 8, 16, 32, 64, 128),
    "v1-0.10": (1, 8, 16, 32, 64, 128),
    "v1-latest": None,  # any int > 0, checked by the CacheConfig model
}
_HASH_ALGOS: dict[str, tuple[str, ...]] = {
    "v1-0.8": ("builtin", "sha256"),
    "v1-0.10": ("builtin", "sha256", "sha256_cbor_64bit"),
    "v1-latest": ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
}


def _build_table(flavor: str) -> dict[str, _Flag]:
    v0, v08, latest = flavor == "v0", flavor == "v1-0.8", flavor == "v1-latest"
    dataclass_bools = not (v0 or v08)  # ModelConfig/engine bools became --x/--no-x in 0.9
    flags: list[_Flag] = []

    def add(dest: str, *options: str, **kw: Any) -> None:
        if kw.get("kind") == "bool":
            options = (options[0], "--no-" + options[0][2:], *options[1:])
        flags.append(_Flag(dest, options, **kw))

    def plain_bool(dest: str, option: str) -> None:
        add(dest, option, kind="bool" if dataclass_bools else "true")

    integer: dict[str, Any] = {"convert": int, "type_name": "int"}
    real: dict[str, Any] = {"convert": float, "type_name": "float"}

    add("model", "--model")
    add("served_model_names", "--served-model-name", kind="names")
    add("host", "--host", convert=_nullable_str)
    add("port", "--port", **integer)
    add("api_key", "--api-key", convert=_nullable_str)
    add("gpu_memory_utilization", "--gpu-memory-utilization", **real)
    add("block_size", "--block-size", choices=_BLOCK_SIZES[flavor], **integer)
    add("enable_prefix_caching", "--enable-prefix-caching", kind="bool")
    if not v0:
        add("prefix_caching_hash_algo", "--prefix-caching-hash-algo", choices=_HASH_ALGOS[flavor])
    if not (v0 or latest):  # gone by 0.32 (its parser)
        add("calculate_kv_scales", "--calculate-kv-scales", kind="bool")
    add("max_num_seqs", "--max-num-seqs", **integer)
    if latest:
        add(
            "max_num_batched_tokens",
            "--max-num-batched-tokens",
            convert=_hri_t,
            type_name="human_readable_int",
        )
        add(
            "max_model_len",
            "--max-model-len",
            convert=_hri_or_auto,
            type_name="human_readable_int_or_auto",
        )
        add(
            "kv_cache_memory_bytes",
            "--kv-cache-memory-bytes",
            convert=_optional(_hri_t, "<function human_readable_int>"),
        )
    else:
        add("max_num_batched_tokens", "--max-num-batched-tokens", **integer)
        if v0:
            add("max_model_len", "--max-model-len", **integer)
        else:
            add("max_model_len", "--max-model-len", convert=_hri, type_name="human_readable_int")
    add("kv_cache_dtype", "--kv-cache-dtype", choices=_KV_CACHE_DTYPES[flavor])
    plain_bool("enforce_eager", "--enforce-eager")
    if not latest:
        add("swap_space", "--swap-space", **real)
    add("cpu_offload_gb", "--cpu-offload-gb", **real)
    if flavor == "v1-0.10":
        add(
            "preemption_mode",
            "--preemption-mode",
            convert=_optional(str, "<class 'str'>"),
            choices=("recompute", "swap", "None"),
        )
    elif not latest:
        add("preemption_mode", "--preemption-mode")  # no choices before the 0.9 dataclass
    if latest:
        add("shutdown_timeout", "--shutdown-timeout", **integer)
    add("tensor_parallel_size", "--tensor-parallel-size", "-tp", **integer)
    add("pipeline_parallel_size", "--pipeline-parallel-size", "-pp", **integer)
    if not v0:
        add("data_parallel_size", "--data-parallel-size", "-dp", **integer)
    if not (v0 or v08):
        add("api_server_count", "--api-server-count", "-asc", **integer)
    add("enable_chunked_prefill", "--enable-chunked-prefill", kind="strbool" if v0 else "bool")
    add("dtype", "--dtype", choices=_OLD_DTYPES if v0 or v08 else tuple(sorted(_OLD_DTYPES)))
    plain_bool("trust_remote_code", "--trust-remote-code")
    if v0:
        add("num_gpu_blocks_override", "--num-gpu-blocks-override", **integer)
    else:
        add(
            "num_gpu_blocks_override",
            "--num-gpu-blocks-override",
            convert=_optional(int, _INT_SHOWN),
        )
    if flavor == "v1-0.10":
        add("seed", "--seed", convert=_optional(int, _INT_SHOWN))
    else:
        add("seed", "--seed", **integer)
    if not latest:
        plain_bool("disable_log_requests", "--disable-log-requests")
    if not (v0 or v08):
        add("enable_log_requests", "--enable-log-requests", kind="bool")
    add("disable_log_stats", "--disable-log-stats", kind="true")
    return {option: flag for flag in flags for option in flag.options}


_TABLES = {flavor: _build_table(flavor) for flavor in FLAVOR_VERSIONS}


def known_options(flavor: str) -> frozenset[str]:
    """Every option string the simulator accepts for ``flavor`` (``--model`` included)."""
    return frozenset(_TABLES[_check_flavor(flavor)])


def _check_flavor(flavor: str) -> str:
    if flavor not in FLAVOR_VERSIONS:
        raise ValueError(f"unknown flavour {flavor!r}; one of {', '.join(FLAVOR_VERSIONS)}")
    return flavor


# --------------------------------------------------------------------------------------------
# Parsing.

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's _negative_number_matcher
_NAME_PART = re.compile(r"(?<=--)[^.]*")  # FlexibleArgumentParser: between -- and the first .
_MODEL_OPTION = re.compile(r"^--model(=.+|$)")
_SERVED_NAME_OPTION = re.compile(r"^--served[-_]model[-_]name(=.+|$)")


def _normalise(arg: str) -> str:
    """Underscores to dashes in an option's name, never in its value."""
    if not arg.startswith("--"):
        return arg
    key, sep, value = arg.partition("=")
    return _NAME_PART.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + sep + value


def _is_option(arg: str, table: dict[str, _Flag]) -> bool:
    """argparse's _parse_optional: does ``arg`` read as an option (known or not)?"""
    if not arg or arg[0] != "-":
        return False
    if arg in table:
        return True
    if len(arg) == 1:
        return False
    if "=" in arg and arg.split("=", 1)[0] in table:
        return True
    if _NEGATIVE_NUMBER.match(arg):
        return False
    return " " not in arg


def _convert(flag: _Flag, raw: str) -> Any:
    try:
        value = flag.convert(raw)
    except _ArgTypeError as exc:
        raise ServeArgsError(f"argument {flag.display}: {exc}") from None
    except ValueError:
        raise ServeArgsError(
            f"argument {flag.display}: invalid {flag.type_name} value: {raw!r}"
        ) from None
    if flag.choices is not None and value not in flag.choices:
        listed = ", ".join(repr(c) for c in flag.choices)
        raise ServeArgsError(
            f"argument {flag.display}: invalid choice: {value!r} (choose from {listed})"
        )
    return value


@dataclass
class _Parsed:
    values: dict[str, Any]
    positionals: list[tuple[int, str]]
    extras: list[tuple[int, str]]


def _scan(args: list[str], table: dict[str, _Flag]) -> _Parsed:
    """One left-to-right pass, as argparse consumes options and their arguments."""
    out = _Parsed({}, [], [])
    i, n, rest_positional = 0, len(args), False

    def takes(j: int) -> bool:  # can args[j] be an option's argument?
        return j < n and args[j] != "--" and not _is_option(args[j], table)

    while i < n:
        arg = args[i]
        if arg == "--" and not rest_positional:
            rest_positional = True
            i += 1
            continue
        if rest_positional or not _is_option(arg, table):
            out.positionals.append((i, arg))
            i += 1
            continue
        name, explicit = arg, None
        if arg not in table and "=" in arg:
            name, explicit = arg.split("=", 1)
        flag = table.get(name)
        if flag is None:
            out.extras.append((i, arg))
            i += 1
            continue
        i += 1
        if flag.kind in ("true", "bool"):
            if explicit is not None:
                raise ServeArgsError(
                    f"argument {flag.display}: ignored explicit argument {explicit!r}"
                )
            out.values[flag.dest] = flag.kind == "true" or not name.startswith("--no-")
        elif flag.kind == "strbool":
            if explicit is None and takes(i):
                explicit, i = args[i], i + 1
            out.values[flag.dest] = _store_boolean("True" if explicit is None else explicit)
        elif flag.kind == "names":
            names = [explicit] if explicit is not None else []
            while explicit is None and takes(i):
                names.append(args[i])
                i += 1
            if not names:
                raise ServeArgsError(f"argument {flag.display}: expected at least one argument")
            out.values[flag.dest] = tuple(names)
        else:
            if explicit is None:
                if not takes(i):
                    raise ServeArgsError(f"argument {flag.display}: expected one argument")
                explicit, i = args[i], i + 1
            out.values[flag.dest] = _convert(flag, explicit)
    return out


def parse_serve_args(argv: Sequence[str], flavor: str, *, entrypoint: str = "auto") -> ServeArgs:
    """Read a ``vllm serve`` command line (without ``vllm serve``) as ``flavor``'s release.

    ``entrypoint``: ``"serve"`` reads it exactly as ``vllm serve`` (a positional model;
    ``--model`` moved to the front with a warning from 0.8 on, refused by 0.6);
    ``"api_server"`` as ``python -m vllm.entrypoints.openai.api_server`` (``--model`` only);
    ``"auto"`` (default) takes either, and refuses both at once as ``vllm serve`` does.
    A missing model is refused everywhere, although vLLM's ``api_server`` (and ``vllm serve``
    since the model became optional) would load its default model: in a test that means a
    broken rewrite. Raises ``ServeArgsError``.
    """
    _check_flavor(flavor)
    if entrypoint not in ("auto", "serve", "api_server"):
        raise ValueError(f"unknown entrypoint {entrypoint!r}")
    table = _TABLES[flavor]
    args = [str(a) for a in argv]
    if any(a == "--config" or a.startswith("--config=") for a in args):
        raise ServeArgsError(
            "--config is not supported by the simulator (vLLM would read a YAML "
            "file of flags): pass the flags on the command line"
        )
    if (
        entrypoint == "serve"
        and flavor == "v1-latest"
        and not any(_MODEL_OPTION.match(a) for a in args)
        and args
        and args[0].startswith("-")
        and any(_SERVED_NAME_OPTION.match(a) for a in args)
    ):
        raise ServeArgsError(
            "`model` should be provided as the first positional argument when using "
            "`vllm serve`. i.e. `vllm serve <model> --<arg> <value>`.",
            exit_code=1,
            exc_type="ValueError",
        )
    parsed = _scan([_normalise(a) for a in args], table)
    model = _choose_model(parsed, flavor, entrypoint)
    args_out = _with_defaults(model, parsed.values, flavor)
    _validate(args_out, flavor)
    return args_out


def _choose_model(parsed: _Parsed, flavor: str, entrypoint: str) -> str:
    option = parsed.values.pop("model", None)
    positionals, extras = parsed.positionals, parsed.extras
    v0_conflict = False
    if entrypoint == "api_server":
        model, extras = option, extras + positionals
    elif option is not None and positionals:
        if flavor == "v0":  # argparse is content; serve's cmd() refuses it afterwards
            model, extras, v0_conflict = positionals[0][1], extras + positionals[1:], True
        else:  # --model is moved to the front: the positional model becomes an extra
            model, extras = option, extras + positionals
    elif option is not None:
        model = None if (entrypoint == "serve" and flavor == "v0") else option
    else:
        model = positionals[0][1] if positionals else None
        extras = extras + positionals[1:]
    if not model:
        missing = "--model" if entrypoint == "api_server" else "model_tag"
        raise ServeArgsError(f"the following arguments are required: {missing}")
    if extras:
        raise ServeArgsError("unrecognized arguments: " + " ".join(a for _, a in sorted(extras)))
    if v0_conflict:
        raise ServeArgsError(
            "With `vllm serve`, you should provide the model as a positional argument "
            "instead of via the `--model` option.",
            exit_code=1,
            exc_type="ValueError",
        )
    return str(model)


def _with_defaults(model: str, values: dict[str, Any], flavor: str) -> ServeArgs:
    v0, latest = flavor == "v0", flavor == "v1-latest"
    settings: dict[str, Any] = {
        "gpu_memory_utilization": 0.92 if latest else 0.9,
        "enable_prefix_caching": not v0,
        "prefix_caching_hash_algo": None if v0 else _HASH_ALGOS[flavor][0],
        "max_num_seqs": V0_MAX_NUM_SEQS if v0 else V1_MAX_NUM_SEQS,
        "max_num_batched_tokens": None if v0 else V1_MAX_NUM_BATCHED_TOKENS,
        "swap_space": None if latest else 4,
        "cpu_offload_gb": 0,
        "shutdown_timeout": 0 if latest else None,
        "enable_chunked_prefill": None if v0 else True,
        "seed": 0 if v0 or latest else None,
    }
    settings.update(values)
    if settings.get("host") is None:
        settings["host"] = "0.0.0.0"
    if flavor in ("v1-0.8", "v1-0.10"):
        settings["enable_chunked_prefill"] = True  # V1 always chunks; the flag is ignored
    names = settings.pop("served_model_names", None)
    return ServeArgs(
        model=model,
        served_model_names=tuple(names) if names else (model,),
        explicit=frozenset(values),
        **settings,
    )


def _pydantic_error(
    config: str, name: str, message: str, kind: str, value: object
) -> ServeArgsError:
    return ServeArgsError(
        f"1 validation error for {config}\n{name}\n  {message} "
        f"[type={kind}, input_value={value!r}, input_type={type(value).__name__}]",
        exit_code=1,
        exc_type="pydantic_core._pydantic_core.ValidationError",
    )


def _value_error(message: str) -> ServeArgsError:
    return ServeArgsError(message, exit_code=1, exc_type="ValueError")


_NO_KV_MEMORY = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
    "when initializing the engine."
)


def _validate(args: ServeArgs, flavor: str) -> None:
    """The engine-config checks, in the order vLLM builds its configs (cache, then scheduler)."""
    latest = flavor == "v1-latest"
    util = args.gpu_memory_utilization
    if latest and not util > 0:
        raise _pydantic_error(
            "CacheConfig",
            "gpu_memory_utilization",
            "Input should be greater than 0",
            "greater_than",
            util,
        )
    if latest and util > 1:
        raise _pydantic_error(
            "CacheConfig",
            "gpu_memory_utilization",
            "Input should be less than or equal to 1",
            "less_than_equal",
            util,
        )
    if util > 1.0:
        raise _value_error(f"GPU memory utilization must be less than 1.0. Got {util}.")
    if latest and args.block_size <= 0:
        raise _pydantic_error(
            "CacheConfig",
            "block_size",
            "Input should be greater than 0",
            "greater_than",
            args.block_size,
        )
    if args.cpu_offload_gb < 0:
        if latest:
            raise _pydantic_error(
                "OffloadConfig",
                "cpu_offload_gb",
                "Input should be greater than or equal to 0",
                "greater_than_equal",
                args.cpu_offload_gb,
            )
        raise _value_error(f"CPU offload space must be non-negative, but got {args.cpu_offload_gb}")
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            if latest:
                raise _pydantic_error(
                    "SchedulerConfig",
                    name,
                    "Input should be greater than or equal to 1",
                    "greater_than_equal",
                    value,
                )
            raise _value_error(f"{name} must be at least 1, got {value}")  # sim wording
    _check_batch(args)
    max_len = args.max_model_len
    if max_len is not None and max_len <= 0 and not (latest and max_len == -1):
        raise _value_error(f"max_model_len must be positive, got {max_len}")  # sim wording
    for name in (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "api_server_count",
    ):
        if getattr(args, name) < 1:
            value = getattr(args, name)
            raise _value_error(f"{name} must be at least 1, got {value}")  # sim wording
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        timeout = args.shutdown_timeout
        raise _value_error(f"shutdown_timeout must be >= 0, got {timeout}")  # sim wording
    if not 0 <= args.port <= 65535:
        raise ServeArgsError("bind(): port must be 0-65535.", exit_code=1, exc_type="OverflowError")
    # Startup failures after profiling: no memory left for a single KV block.
    if not util > 0 or (
        args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override <= 0
    ):
        raise _value_error(_NO_KV_MEMORY)


def _check_batch(args: ServeArgs, max_model_len: int | None = None) -> None:
    """SchedulerConfig's checks (``verify_max_model_len``)."""
    tokens = args.max_num_batched_tokens
    if tokens is None:
        return
    if max_model_len is not None and tokens < max_model_len and not args.enable_chunked_prefill:
        raise _value_error(
            f"max_num_batched_tokens ({tokens}) is smaller than max_model_len "
            f"({max_model_len}). This effectively limits the maximum sequence length to "
            "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
            "max_num_batched_tokens or decrease max_model_len."
        )
    if tokens < args.max_num_seqs:
        raise _value_error(
            f"max_num_batched_tokens ({tokens}) must be greater than or equal to "
            f"max_num_seqs ({args.max_num_seqs})."
        )


def resolve_for_model(args: ServeArgs, flavor: str, derived_max_model_len: int) -> ServeArgs:
    """Fill in what the release derives from the model (its ``max_position_embeddings``):
    ``max_model_len``; on V0 also chunked prefill (on by default above 32K tokens) and
    ``max_num_batched_tokens`` (512 with chunked prefill, else max(max_model_len, 2048)); then
    run the scheduler checks that need them. Raises ``ServeArgsError`` (exit code 1)."""
    _check_flavor(flavor)
    max_len = args.max_model_len
    if max_len is None or max_len == -1:
        max_len = derived_max_model_len
    elif max_len > derived_max_model_len:
        raise _value_error(
            f"User-specified max_model_len ({max_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={derived_max_model_len} or "
            "model_max_length=None in model's config.json). To allow overriding this "
            "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    chunked = args.enable_chunked_prefill
    if chunked is None:
        chunked = max_len > 32768
    tokens = args.max_num_batched_tokens
    if tokens is None:
        tokens = 512 if chunked else max(max_len, 2048)
    resolved = replace(
        args, max_model_len=max_len, enable_chunked_prefill=chunked, max_num_batched_tokens=tokens
    )
    _check_batch(resolved, max_len)
    return resolved


# --------------------------------------------------------------------------------------------
# vllm:cache_config_info


def cache_config_labels(
    args: ServeArgs,
    flavor: str,
    num_gpu_blocks: int,
    *,
    max_model_len: int | None = None,
    num_cpu_blocks: int | None = None,
    sliding_window: int | None = None,
) -> dict[str, str]:
    """The label set of ``vllm:cache_config_info`` (without ``engine``) as ``flavor`` prints
    it: ``str()`` of each CacheConfig attribute. V0 (0.6) and 0.8 keep vLLM's int defaults
    (``swap_space_bytes="4294967296"``, but ``"8589934592.0"`` for ``--swap-space 8``); 0.10 and
    later coerce floats (``"4.0"``, ``"0.0"``) as their pydantic configs do.

    ``num_cpu_blocks``: V0's swap blocks (``swap_space_bytes // bytes per block``); V1 prints
    None. ``max_model_len`` (default ``args.max_model_len``) gives v1-latest's
    ``kv_cache_max_concurrency``; it reads "None" when neither is known.
    """
    _check_flavor(flavor)
    swap = args.swap_space if args.swap_space is not None else 0
    common = {
        "block_size": str(args.block_size),
        "gpu_memory_utilization": str(args.gpu_memory_utilization),
    }
    if flavor == "v0":
        return {
            **common,
            "swap_space_bytes": str(swap * GIB_BYTES),
            "cache_dtype": args.kv_cache_dtype,
            "is_attention_free": "False",
            "num_gpu_blocks_override": str(args.num_gpu_blocks_override),
            "sliding_window": str(sliding_window),
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "cpu_offload_gb": str(args.cpu_offload_gb),
            "num_gpu_blocks": str(num_gpu_blocks),
            "num_cpu_blocks": str(num_cpu_blocks),
        }
    if flavor in ("v1-0.8", "v1-0.10"):
        coerce = flavor == "v1-0.10"
        swap_value: float = float(swap) if coerce else swap
        labels = {
            **common,
            "swap_space": str(swap_value),
            "cache_dtype": args.kv_cache_dtype,
            "is_attention_free": "False",
            "num_gpu_blocks_override": str(args.num_gpu_blocks_override),
            "sliding_window": str(sliding_window),
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "prefix_caching_hash_algo": str(args.prefix_caching_hash_algo),
            "cpu_offload_gb": str(float(args.cpu_offload_gb) if coerce else args.cpu_offload_gb),
            "calculate_kv_scales": str(args.calculate_kv_scales),
        }
        if coerce:
            labels.update(
                cpu_kvcache_space_bytes="None",
                mamba_page_size_padded="None",
                mamba_cache_dtype="auto",
                mamba_ssm_cache_dtype="auto",
                kv_sharing_fast_prefill="False",
            )
        labels.update(
            num_gpu_blocks=str(num_gpu_blocks),
            num_cpu_blocks=str(num_cpu_blocks),
            swap_space_bytes=str(swap_value * GIB_BYTES),
        )
        return labels
    context = max_model_len if max_model_len is not None else args.max_model_len
    tokens = num_gpu_blocks * args.block_size
    concurrency = str(tokens / context) if context is not None and context > 0 else "None"
    memory_bytes = args.kv_cache_memory_bytes
    return {
        "block_size": str(args.block_size),
        "user_specified_block_size": str("block_size" in args.explicit),
        "user_specified_mamba_block_size": "False",
        "prefix_match_unit": "None",
        "gpu_memory_utilization": str(float(args.gpu_memory_utilization)),
        "cache_dtype": args.kv_cache_dtype,
        "is_attention_free": "False",
        "num_gpu_blocks_override": str(args.num_gpu_blocks_override),
        "sliding_window": str(sliding_window),
        "enable_prefix_caching": str(args.enable_prefix_caching),
        "prefix_caching_hash_algo": str(args.prefix_caching_hash_algo),
        "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None",
        "skip_page_size_padded": "None",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "calculate_kv_scales": str(args.calculate_kv_scales),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_cpu_blocks": str(num_cpu_blocks),
        "kv_cache_size_tokens": str(tokens),
        "kv_cache_max_concurrency": concurrency,
        "kv_sharing_fast_prefill": "False",
        "kv_cache_memory_bytes": str(memory_bytes),
        "kv_offloading_size": "None",
        "kv_offloading_backend": "native",
        "_block_size_resolved": "True",
    }
