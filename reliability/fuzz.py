"""Fuzzing with hypothesis: every input vkvagent reads from outside, and systemd's reading of
the drop-ins it writes.

Targets (``TARGETS``), each a property over generated inputs:

- ``metrics``: the exposition normaliser on arbitrary text, on real pages of every vLLM
  version mangled line by line, and on pages built from the names it reads with hostile labels
  and values. It returns ``VllmMetrics`` or raises ``ExpositionError`` (one line), within a
  time bound; a normaliser that has read other pages answers as a fresh one does.
- ``config``: the config loader on generated TOML (every section and key of the schema, values
  of every TOML type, unknown keys, conf.d drop-ins) and on raw bytes. It returns a ``Config``
  or raises ``ConfigError`` (one located line per problem); an accepted config rendered as TOML
  loads back to the same value.
- ``flags``: ``flags.validate`` on arbitrary names and values, then ``apply_flags`` on
  generated ``vllm serve`` command lines with hostile unmanaged arguments: each flag set once,
  to its value, in plain tokens; nothing else moved; applying again changes nothing.
- ``replay``: ``query_range.load_files`` and the replay itself on arbitrary JSON and on a real
  query_range history mutated point by point: a result, or ``ReplayError`` (one line).
- ``systemd``: argvs (hostile text, and the flag rewriter's output) rendered as drop-ins,
  read back by a real systemd in the sandbox: ``ExecStart`` over D-Bus equals the intended
  argv, and for a sample, the started process's own argv does too. One boot, one reload, many
  units.

Profiles: ``reliability-ci`` (a few dozen examples per target, for ``make test``) and
``reliability`` (thousands, for ``make reliability``). Every property counts the examples it
ran, reported as "bad inputs tried".
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import signal
import string
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from reliability.report import Row, need_sandbox
from tests.sandbox import Sandbox
from vkvagent.adapters.query_range import ReplayError, load_files
from vkvagent.adapters.systemd import Systemd
from vkvagent.knowledge import config, flags, toml_schema
from vkvagent.knowledge.config import Config, ConfigError
from vkvagent.knowledge.dropin import argv_hash, quote_exec_arg, render_dropin
from vkvagent.knowledge.flags import CATALOGUE, FlagError
from vkvagent.knowledge.vllm_command import VllmCommandError, apply_flags, parse_command
from vkvagent.knowledge.vllm_metrics import FLAVORS, WANTED, ExpositionError, Normaliser
from vkvagent.tools import replay

PROJECT = Path(__file__).resolve().parent.parent
METRIC_PAGES = PROJECT / "tests" / "fixtures" / "metrics"

CI = "reliability-ci"
FULL = "reliability"
_HEALTH = list(HealthCheck)
settings.register_profile(
    CI, max_examples=25, deadline=None, database=None, suppress_health_check=_HEALTH
)
settings.register_profile(
    FULL, max_examples=2500, deadline=None, database=None, suppress_health_check=_HEALTH
)
# Slower targets run a fraction of the profile's examples (a replay runs the engine).
SHARE = {"metrics": 1.0, "config": 0.6, "flags": 1.0, "replay": 0.15, "systemd": 0.6}
# No single example may take longer than this (a hang is a failure, not a stuck run).
EXAMPLE_SECONDS = 20.0

COUNTS: Counter[str] = Counter()


def profile_settings(profile: str, target: str) -> settings:
    base = settings.get_profile(profile)
    return settings(base, max_examples=max(5, int(base.max_examples * SHARE[target])))


@contextlib.contextmanager
def bounded(seconds: float = EXAMPLE_SECONDS) -> Iterator[None]:
    """Fail (TimeoutError) an example that runs longer than ``seconds``: SIGALRM, so only in
    the main thread; elsewhere it bounds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"one example ran over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def one_line(message: str) -> bool:
    return "\n" not in message and "\r" not in message and message == message.strip() != ""


# -- text that systemd, TOML, JSON and the exposition format treat specially -----------------

NASTY = " \t\n\r\"'\\%$;=#{}[]()*?!&|<>`~,:@é€\u00a0\u0085\u2028😀\x01\x1b\x7f"
TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", exclude_characters="\0"), st.sampled_from(NASTY)
    ),
    max_size=24,
)


# -- metrics ----------------------------------------------------------------------------------


def _pages() -> list[list[str]]:
    pages = []
    for path in sorted(METRIC_PAGES.glob("*.prom")):
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        pages.append([line for line in lines if not line.startswith("# ---")])
    return pages


PAGES = _pages()
NAMES = [*sorted(WANTED), "vllm:other_total", "process_cpu_seconds_total", "up"]
LABEL_NAMES = ["model_name", "engine", "le", "pid", "block_size", "x"]
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(2**80), 2**80).map(str),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "-0", "0x10", "", " ", "1_000", "\uff11"]),
    st.text(max_size=6),
)


@st.composite
def _label_value(draw: st.DrawFn) -> str:
    raw = draw(TEXT)
    if draw(st.booleans()):  # escaped as the format wants
        return raw.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return raw  # or not


@st.composite
def built_pages(draw: st.DrawFn) -> str:
    """Pages made of the series the normaliser reads, with hostile labels and values."""
    lines = []
    for _ in range(draw(st.integers(1, 12))):
        name = draw(st.sampled_from(NAMES))
        if draw(st.integers(0, 4)) == 0:
            lines.append(f"# {draw(st.sampled_from(['TYPE', 'HELP']))} {name} {draw(TEXT)}")
        labels = draw(st.dictionaries(st.sampled_from(LABEL_NAMES), _label_value(), max_size=3))
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        braces = draw(st.booleans())
        series = f"{name}{{{body}}}" if labels or braces else name
        stamp = f" {draw(st.integers(-(2**40), 2**64))}" if draw(st.integers(0, 5)) == 0 else ""
        lines.append(f"{series} {draw(VALUES)}{stamp}")
    text = "\n".join(lines)
    return text + ("\n" if draw(st.integers(0, 9)) else "")


@st.composite
def mangled_pages(draw: st.DrawFn) -> str:
    """A real page of some vLLM version with a few lines cut, dropped, repeated, garbled or
    given a hostile value."""
    lines = list(draw(st.sampled_from(PAGES)))
    for _ in range(draw(st.integers(1, 6))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["cut", "drop", "dup", "garble", "value", "label"]))
        line = lines[i]
        if action == "cut":
            lines[i] = line[: draw(st.integers(0, len(line)))]
        elif action == "drop":
            del lines[i]
        elif action == "dup":
            lines.insert(i, line)
        elif action == "garble":
            at = draw(st.integers(0, len(line)))
            lines[i] = line[:at] + draw(TEXT) + line[at:]
        elif action == "value" and " " in line and not line.startswith("#"):
            lines[i] = line.rsplit(" ", 1)[0] + " " + draw(VALUES) + "\n"
        elif action == "label" and "{" in line:
            lines[i] = line.replace("{", "{" + f'x="{draw(_label_value())}",', 1)
    return "".join(lines)


PAGE_TEXT = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=400), built_pages(), mangled_pages()
)
_shared = Normaliser(cache_limit=200)  # a long-lived one, as the daemon keeps per server


def check_page(text: str) -> None:
    COUNTS["metrics"] += 1
    with bounded():
        try:
            fresh = Normaliser().normalise(text)
        except ExpositionError as exc:
            assert one_line(str(exc)), repr(str(exc))
            fresh = None
        try:
            warm = _shared.normalise(text)
        except ExpositionError:
            warm = None
    assert warm == fresh, "a normaliser that read other pages answers differently"
    if fresh is None:
        return
    assert fresh.flavor in FLAVORS and fresh.engines >= 1
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "generation_tokens_total",
        "prompt_tokens_total",
        "num_preemptions_total",
        "request_success_total",
    ):
        value = getattr(fresh, name)
        assert value is None or (not math.isnan(value) and value >= 0), (name, value)
    for value in (fresh.kv_cache_usage, fresh.kv_cache_usage_max):
        assert value is None or 0 <= value <= 1 + 1e-6, value
    json.dumps(fresh.to_json())  # what `vkvagent scrape --json` prints


def metrics_target(profile: str) -> Callable[[], None]:
    @profile_settings(profile, "metrics")
    @given(PAGE_TEXT)
    @example('vllm:num_requests_running{a="}"} 1\n')
    @example('vllm:num_requests_running{model_name="m"} 1\n' * 2)
    def metrics(text: str) -> None:
        check_page(text)

    return metrics


# -- config -----------------------------------------------------------------------------------

SECTIONS: dict[str, list[dataclasses.Field[Any]]] = {
    spec.name: list(dataclasses.fields(spec.metadata["section"]))
    for spec in dataclasses.fields(Config)
}


def _toml_string(text: str) -> str:
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return "".join(out) + '"'


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def _near(spec: dataclasses.Field[Any]) -> st.SearchStrategy[Any]:
    """Values around what the key allows: its type within and just past its limits, its
    choices, and its default (or example)."""
    meta, default = spec.metadata, spec.default
    if default is None:  # unset by default ([slo]'s targets): typed as its example
        default = meta["example"]
    low, high = meta.get("min"), meta.get("max")
    options: list[st.SearchStrategy[Any]] = [st.just(default)]
    if isinstance(default, bool):
        options.append(st.booleans())
    elif isinstance(default, int):
        options.append(st.integers(int(low or 0) - 2, int(high or 10**6) + 2))
    elif isinstance(default, float):
        options.append(st.floats((low or 0) - 1, (high or 1e6) + 1))
    elif isinstance(default, str):
        options.append(st.sampled_from(list(meta.get("choices") or ["", "x"])))
    elif isinstance(default, tuple):
        options.append(st.lists(st.integers(-1, 300) | TEXT, max_size=4))
    return st.one_of(*options)


ANY_VALUE: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.booleans(),
        TEXT,
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=2),
    max_leaves=6,
)


@st.composite
def config_documents(draw: st.DrawFn) -> str:
    """A TOML document: some sections of the schema (and unknown ones), each with some of its
    keys (and unknown ones), typed near their limits or anything at all."""
    out = []
    for name in draw(st.lists(st.sampled_from([*SECTIONS, "bogus"]), max_size=4, unique=True)):
        out.append(f"[{name}]")
        fields = SECTIONS.get(name, [])
        for _ in range(draw(st.integers(0, 5))):
            known = draw(st.integers(0, 5)) > 0
            if fields and known:
                spec = draw(st.sampled_from(fields))
                if "table" in spec.metadata:  # [vllm.flags]: names from the catalogue
                    key = draw(st.sampled_from([*CATALOGUE, "no-enable-prefix-caching", "x"]))
                    out.append(f"flags.{_toml_string(key)} = {_toml(draw(ANY_VALUE))}")
                    continue
                value = draw(ANY_VALUE) if draw(st.integers(0, 3)) == 0 else draw(_near(spec))
                out.append(f"{spec.name} = {_toml(value)}")
            else:
                out.append(f"{_toml_string(draw(TEXT))} = {_toml(draw(ANY_VALUE))}")
    return "\n".join(out) + "\n"


CONFIG_BYTES = st.one_of(
    config_documents().map(lambda text: text.encode("utf-8")),
    st.binary(max_size=200),
    config_documents().map(lambda text: text.encode("utf-8")[: len(text) // 2]),
)


def check_config(main: bytes | None, dropins: Sequence[bytes]) -> None:
    COUNTS["config"] += 1
    with tempfile.TemporaryDirectory(prefix="vkv-fuzz-config.") as tmp:
        directory = Path(tmp)
        files = []
        if main is not None:
            (directory / "config.toml").write_bytes(main)
            files.append(directory / "config.toml")
        for number, data in enumerate(dropins):
            (directory / "conf.d").mkdir(exist_ok=True)
            (directory / "conf.d" / f"{number:02d}.toml").write_bytes(data)
        with bounded():
            try:
                loaded = config.load(directory, as_root=False)
            except ConfigError as exc:
                assert exc.problems
                for problem in exc.problems:
                    assert one_line(problem), repr(problem)
                    assert problem.startswith(str(directory)), problem
                return
        again = directory / "rendered.toml"
        again.write_text(toml_schema.render(loaded), encoding="utf-8")
        assert config.load(again, as_root=False) == loaded, "render() does not load back"


def config_target(profile: str) -> Callable[[], None]:
    @profile_settings(profile, "config")
    @given(st.none() | CONFIG_BYTES, st.lists(CONFIG_BYTES, max_size=2))
    @example(b'[vllm]\nmodel = "\\ud83d"\n', [])
    @example('[vllm]\nmodel = "😀"\n'.encode(), [])
    @example(b"[agent]\nsample_interval = 1e400\n", [b"[agent]\nsample_interval = nan\n"])
    def config_files(main: bytes | None, dropins: list[bytes]) -> None:
        check_config(main, dropins)

    return config_files


# -- flags ------------------------------------------------------------------------------------

VERSIONS = st.one_of(
    st.none(),
    st.sampled_from(["0.6.6", "0.8.5", "0.10.1", "0.11.0rc2", "0.30.0", "1.0", "v0.9.0.post1"]),
    TEXT,
)


def _spelled(name: str) -> st.SearchStrategy[str]:
    return st.sampled_from([name, "--" + name, name.replace("-", "_"), name.upper(), " " + name])


FLAG_NAMES = st.one_of(st.sampled_from(list(CATALOGUE)).flatmap(_spelled), TEXT)


def valid_value(name: str) -> st.SearchStrategy[Any]:
    """Values the catalogue accepts for flag ``name`` (tests/test_flags.py draws from it too)."""
    spec = CATALOGUE[name]
    if spec.kind == "bool":
        return st.booleans()
    if spec.choices:
        return st.sampled_from(spec.choices)
    assert spec.minimum is not None and spec.maximum is not None
    if spec.kind == "int":
        return st.integers(int(spec.minimum), int(spec.maximum))
    return st.floats(spec.minimum, spec.maximum)


# Flag sets validate() accepts on some release: what reaches the rewriter and systemd.
VALID_FLAGS = st.sets(st.sampled_from(list(CATALOGUE)), max_size=6).flatmap(
    lambda names: st.fixed_dictionaries({n: valid_value(n) for n in sorted(names)})
)
FLAG_VALUES = st.one_of(
    ANY_VALUE,
    st.sampled_from(["16", "0.9", "auto", "fp8", "swap", "true", " 16 ", "16;x", "1e3", "32k"]),
    TEXT.map(lambda text: "16" + text),
)
LAUNCHERS = [
    ["/usr/bin/vllm", "serve", "org/m"],
    ["/opt/venv/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
    ["/usr/bin/env", "A=1", "/usr/bin/vllm", "serve", "m"],
    ["/opt/x/python", "-m", "vkvagent", "sim", "serve", "m"],
    ["/opt/x/run-model"],  # not vLLM: refused, in one line whatever follows
]
PIECES = [
    ["--dtype", "half"], ["--served-model-name", "a b"], ["-tp", "2"], ["--seed=3"], ["--"],
    ["--chat-template", "{% x %}\n"],
]  # fmt: skip
UNMANAGED = st.one_of(
    st.sampled_from(PIECES),
    st.lists(TEXT, min_size=1, max_size=2),
    st.tuples(st.sampled_from(["--api-key", "--served-model-name", "--x"]), TEXT).map(list),
)
SAFE_TOKEN = set(string.ascii_letters + string.digits + "._+-")

# Rewritten command lines the flags target produced, checked by real systemd afterwards.
REWRITTEN: list[list[str]] = []


def check_flags(wanted: dict[str, Any], version: str | None, argv: list[str]) -> None:
    COUNTS["flags"] += 1
    try:
        typed = flags.validate(wanted, version)
    except FlagError as exc:
        assert exc.problems and all(one_line(p) for p in exc.problems), exc.problems
        return
    try:
        out = apply_flags(argv, typed, vllm_version=version)
    except (VllmCommandError, ValueError) as exc:
        assert isinstance(exc, VllmCommandError), repr(exc)  # validated values always render
        assert one_line(str(exc)), repr(str(exc))
        return
    after = parse_command(out)
    before = parse_command(argv)
    added = [t for t in out if t not in argv]
    for token in added:  # no value can add an argument or a unit directive
        assert set(token) <= SAFE_TOKEN, token
    for name, value in typed.items():
        if flags.render_flag(name, value, version):  # False may be "leave it out" on old vLLM
            assert after.value(name) == value, (name, value, after.value(name))
            assert len(after.occurrences(name)) == 1, name
    for name in CATALOGUE:
        if name not in typed:
            assert after.value(name) == before.value(name), name
    assert (after.model, after.launcher) == (before.model, before.launcher)
    assert apply_flags(out, typed, vllm_version=version) == out, "not idempotent"
    if len(REWRITTEN) < 400:
        REWRITTEN.append(out)


def flags_target(profile: str) -> Callable[[], None]:
    @profile_settings(profile, "flags")
    @given(
        st.dictionaries(FLAG_NAMES, FLAG_VALUES, max_size=5) | VALID_FLAGS,
        VERSIONS,
        st.tuples(st.sampled_from(LAUNCHERS), st.lists(UNMANAGED, max_size=5)).map(
            lambda parts: parts[0] + [t for piece in parts[1] for t in piece]
        ),
    )
    @example({"max-num-seqs": "16\n--x"}, None, LAUNCHERS[0])
    @example({"kv-cache-dtype": "fp8;rm -rf /"}, "0.30.0", LAUNCHERS[0])
    def flag_sets(wanted: dict[str, Any], version: str | None, argv: list[str]) -> None:
        check_flags(wanted, version, argv)

    return flag_sets


# -- replay input -----------------------------------------------------------------------------


def _history() -> dict[str, Any]:
    """A quarter of an hour of a simulated vLLM as Prometheus' query_range would answer it
    (tests/test_replay.py makes it; imported by name, being a test module, not a library)."""
    history = importlib.import_module("tests.test_replay").history
    loaded: dict[str, Any] = json.loads(history("healthy", 0.25, gpus=1))
    return loaded


_BASE: list[dict[str, Any]] = []
POINT_VALUES = st.one_of(
    st.sampled_from(["NaN", "+Inf", "-Inf", "-1", "1e308", "", "0x1", "1e400"]),
    st.floats().map(repr),
    TEXT,
    ANY_VALUE,
)
POINT_TIMES = st.one_of(
    st.floats(),
    st.integers(-(2**64), 2**64),
    st.sampled_from([0, 1.5e9, 253402300799, 253402300800, -1]),
    ANY_VALUE,
)


@st.composite
def replay_documents(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 5)) == 0:
        return json.dumps(draw(ANY_VALUE)).encode()
    if not _BASE:
        _BASE.append(_history())
    doc = json.loads(json.dumps(_BASE[0]))
    result = doc["data"]["result"]
    for _ in range(draw(st.integers(1, 5))):
        entry = draw(st.sampled_from(result))
        values = entry["values"]
        action = draw(
            st.sampled_from(
                [
                    "value",
                    "time",
                    "shuffle",
                    "dup",
                    "label",
                    "name",
                    "drop",
                    "instance",
                    "top",
                    "cut",
                ]
            )
        )
        if action == "value" and values:
            values[draw(st.integers(0, len(values) - 1))][1] = draw(POINT_VALUES)
        elif action == "time" and values:
            values[draw(st.integers(0, len(values) - 1))][0] = draw(POINT_TIMES)
        elif action == "shuffle":
            draw(st.randoms(use_true_random=False)).shuffle(values)
        elif action == "dup" and values:
            values.append(list(draw(st.sampled_from(values))))
        elif action == "label":
            entry["metric"][draw(st.sampled_from(["model_name", "engine", "le", "x"]))] = draw(
                st.one_of(TEXT, ANY_VALUE)
            )
        elif action == "name":
            entry["metric"]["__name__"] = draw(st.sampled_from([*sorted(WANTED), "", "x"]))
        elif action == "drop":
            entry["metric"].pop("__name__", None)
        elif action == "instance":
            copy = json.loads(json.dumps(entry))
            copy["metric"]["instance"] = draw(TEXT)
            result.append(copy)
        elif action == "top":
            key = draw(st.sampled_from(["status", "data", "resultType"]))
            (doc if key != "resultType" else doc["data"])[key] = draw(ANY_VALUE)
            break
        elif action == "cut" and values:
            del values[draw(st.integers(0, len(values) - 1)) :]
    data = json.dumps(doc).encode()
    if draw(st.integers(0, 9)) == 0:
        data = data[: draw(st.integers(0, len(data)))]
    return data


def check_replay(data: bytes, step: float | None) -> None:
    COUNTS["replay"] += 1
    with tempfile.TemporaryDirectory(prefix="vkv-fuzz-replay.") as tmp:
        path = Path(tmp) / "range.json"
        path.write_bytes(data)
        with bounded():
            try:
                store = load_files([path])
                result = replay.run(Config().engine_settings(), store, step=step)
            except ReplayError as exc:
                assert one_line(str(exc)), repr(str(exc))
                return
    assert result.evaluations >= 1
    json.dumps(result.to_json(), allow_nan=False)  # what `vkvagent replay --json` prints


def query_range(values: list[list[object]]) -> str:
    """A Prometheus query_range answer: one series of running requests with these points."""
    series = {"metric": {"__name__": "vllm:num_requests_running"}, "values": values}
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [series]}})


def replay_target(profile: str) -> Callable[[], None]:
    @profile_settings(profile, "replay")
    @given(replay_documents(), st.none() | st.sampled_from([15.0, 1e-9, 7.5, 60.0]))
    # What fuzzing found (tests/test_reliability_fuzz.py): one point far from the others, and
    # times beyond what a datetime holds.
    @example(query_range([[1, "1"], [2, "1"], [1e11, "1"]]).encode(), None)
    @example(query_range([[1e15, "1"], [1e15 + 15, "1"]]).encode(), None)
    def replay_input(data: bytes, step: float | None) -> None:
        check_replay(data, step)

    return replay_input


# -- systemd's reading of the drop-ins --------------------------------------------------------


def argv_target(profile: str, collected: list[list[str]]) -> Callable[[], None]:
    """Collects hostile argvs (generation only: they are checked in one sandbox boot)."""

    @settings(profile_settings(profile, "systemd"), phases=[Phase.explicit, Phase.generate])
    @given(st.lists(TEXT, max_size=8))
    @example(["$HOME", "${HOME}", "$$", "$", "%%", "%n", "\\;", ";", "a;", "--x=$(id)"])
    @example(["", "  ", '"', "'", "\\", "\\x41", "#c", "a=b", "\nExecStartPre=/bin/sh -c id"])
    @example(["ok\n[Service]\nUser=root", "x\\", "\\\n", "%i %u %h", "`id`", "a\u2028b"])
    def argvs(args: list[str]) -> None:
        try:
            for arg in args:
                quote_exec_arg(arg)
        except ValueError:  # NUL or not Unicode: refused before anything is written
            return
        collected.append(args)

    return argvs


SHOW_ARGV = "import json,sys;print('ARGV'+json.dumps(sys.argv[1:]))"


def systemd_round_trip(argvs: Sequence[Sequence[str]], executed: int, row: Row) -> None:
    """Render each argv as vkvagent's drop-in of its own unit, let systemd (booted in the
    sandbox) read them all in one reload, and compare ExecStart over D-Bus; start the first
    ``executed`` of them and compare the argv the process itself received."""
    need_sandbox()
    program = os.path.realpath("/bin/true")
    python = sys.executable
    with Sandbox(units={}, enable=[]) as box:
        system = box.root / "etc/systemd/system"
        plans: list[tuple[str, list[str], bool]] = []
        for number, args in enumerate(argvs):
            run = number < executed
            argv = [python, "-I", "-S", "-c", SHOW_ARGV, *args] if run else [program, *args]
            name = f"vkvfuzz{number}.service"
            (system / name).write_text(
                f"[Service]\nType=oneshot\nExecStart={program} original\n", encoding="utf-8"
            )
            (system / f"{name}.d").mkdir()
            text = render_dropin(name, argv, source_hash=argv_hash(argv))
            (system / f"{name}.d" / "90-vkvagent.conf").write_text(text, encoding="utf-8")
            plans.append((name, argv, run))
        with Systemd(box.bus_address, timeout=30) as bus:
            bus.reload(timeout=120)
            for name, argv, run in plans:
                row.inputs = (row.inputs or 0) + 1
                state = bus.unit(name)
                got = [list(c.argv) for c in state.exec_start]
                want = [[arg.replace("$", "$$") for arg in argv]]  # unit form: $ waits for exec
                if not row.check(got == want, f"{name}: D-Bus ExecStart {got!r} != {want!r}"):
                    continue
                if run:
                    result = bus.restart(name, timeout=60)
                    row.check(result == "done", f"{name}: start job {result}")
        for name, argv, run in plans:
            if not run:
                continue
            printed = [m[4:] for m in box.messages(name) if m.startswith("ARGV")]
            received = json.loads(printed[-1]) if printed else None
            row.check(
                received == list(argv[5:]),
                f"{name}: the process got {received!r}, not {argv[5:]!r}",
            )
    row.trials = len(plans)


# -- running the targets ----------------------------------------------------------------------

TARGETS: Mapping[str, Callable[[str], Callable[[], None]]] = {
    "metrics": metrics_target,
    "config": config_target,
    "flags": flags_target,
    "replay": replay_target,
}
TITLES = {
    "metrics": "fuzz: /metrics normaliser",
    "config": "fuzz: config loader",
    "flags": "fuzz: flag rewriter",
    "replay": "fuzz: replay input",
    "systemd": "fuzz: drop-in quoting, real systemd",
}


def run_target(name: str, profile: str) -> Row:
    row = Row(TITLES[name])
    started = time.monotonic()
    before = COUNTS[name]
    try:
        TARGETS[name](profile)()
    except Exception as exc:  # hypothesis re-raises the shrunk failure
        notes = " ".join(getattr(exc, "__notes__", []))
        row.fail(f"{type(exc).__name__}: {exc} {notes}")
    row.inputs = COUNTS[name] - before
    row.trials = row.inputs
    row.seconds = time.monotonic() - started
    return row


def run_systemd(profile: str, executed: int) -> Row:
    """Hostile argvs and the flag rewriter's output (run ``flags`` first to have some)."""
    row = Row(TITLES["systemd"])
    started = time.monotonic()
    collected: list[list[str]] = []
    try:
        argv_target(profile, collected)()
    except Exception as exc:
        row.fail(f"generating argvs: {type(exc).__name__}: {exc}")
    argvs = [*collected, *(out[1:] for out in REWRITTEN)]
    try:
        systemd_round_trip(argvs, executed, row)
    except Exception as exc:
        row.fail(f"{type(exc).__name__}: {exc}")
    row.notes.append(
        f"{len(collected)} hostile argvs and {len(REWRITTEN)} rewritten vllm command lines read "
        f"back over D-Bus from one reload; {min(executed, len(argvs))} also started and their "
        "process argv compared"
    )
    row.seconds = time.monotonic() - started
    return row


def run_all(profile: str, executed: int) -> list[Row]:
    rows = [run_target(name, profile) for name in TARGETS]
    rows.append(run_systemd(profile, executed))
    return rows
