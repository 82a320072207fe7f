"""Drop-in rendering and reading, checked against a re-implementation of systemd's ExecStart
parser and, where the binaries exist, against systemd 252 itself (``systemd-analyze verify``
and the unit dump of ``systemd --test``)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vkvagent.knowledge.dropin import (
    HASH_KEY,
    HEADER,
    ExecCommand,
    ExecSyntaxError,
    Verbatim,
    argv_hash,
    exec_prefix,
    expand_exec_env,
    is_foreign_edit,
    other_settings,
    parse_dropin,
    quote_exec_arg,
    render_container_dropin,
    render_dropin,
    render_exec_start,
    split_exec_start,
)

PROGRAM = "/usr/bin/vllm"
SOURCE = "0" * 64
NASTY = " \t\n\r\"'\\%$;=#{}[]()*?!&|<>`~é€\u00a0\u0085\u2028😀\x01\x1b\x7f"

# Printable Unicode plus the characters systemd treats specially, and control characters.
# Never NUL (no argv can hold one) and never lone surrogates (not Unicode text).
ARG_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", exclude_characters="\0"),
        st.sampled_from(NASTY),
    ),
    max_size=24,
)


def unit_form(argv: Sequence[str]) -> list[str]:
    """What systemd stores for a process argv rendered with every '$' escaped."""
    return [arg.replace("$", "$$") for arg in argv]


def read_back(value: str, environ: dict[str, str] | None = None) -> list[str]:
    """The argv a process gets from ExecStart=value: systemd's parse, then exec-time env."""
    commands = split_exec_start(value)
    assert len(commands) == 1
    command = commands[0]
    return [command.path, *expand_exec_env(command.argv[1:], environ or {})]


# --------------------------------------------------------------------------------------------
# Quoting


@pytest.mark.parametrize(
    ("arg", "written"),
    [
        ("--max-num-seqs", "--max-num-seqs"),
        ("0.88", "0.88"),
        ("org/model@main", "org/model@main"),
        ("", '""'),
        ("a b", '"a b"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
        ("100%", '"100%%"'),
        ("$HOME", '"$$HOME"'),
        (";", '";"'),
        ("line\nbreak", '"line\\x0abreak"'),
        ("tab\there", '"tab\\x09here"'),
        ("it's", '"it\'s"'),
        ("é", '"é"'),
        ("\u2028", '"\\u2028"'),
        ("\x85", '"\\u0085"'),
    ],
)
def test_quote_exec_arg(arg: str, written: str) -> None:
    assert quote_exec_arg(arg) == written


def test_quote_keeps_dollar_in_unit_form() -> None:
    assert quote_exec_arg("${API_KEY}", escape_dollar=False) == '"${API_KEY}"'
    assert quote_exec_arg("$$", escape_dollar=False) == '"$$"'


@pytest.mark.parametrize("bad", ["a\0b", "\ud800"])
def test_quote_refuses_what_no_argv_can_hold(bad: str) -> None:
    with pytest.raises(ValueError):
        quote_exec_arg(bad)


def test_verbatim_is_written_unchanged() -> None:
    line = render_exec_start([PROGRAM, "serve", Verbatim("%i"), Verbatim('"${A} b"')])
    assert line == '/usr/bin/vllm serve %i "${A} b"'
    with pytest.raises(ValueError):
        Verbatim("two\nlines")


# --------------------------------------------------------------------------------------------
# The round trip through systemd's rules


@settings(max_examples=300)
@given(
    args=st.lists(ARG_TEXT, max_size=8),
    environ=st.dictionaries(
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True), ARG_TEXT, max_size=3
    ),
)
@example(args=["$HOME", "${HOME}", "$$", "$", "%%", "%n", "\\;", ";", "a;"], environ={"HOME": "x"})
@example(args=["", "  ", '"', "'", "\\", "\\x41", "#c", "a=b", "--flag=$X"], environ={"X": "y"})
def test_render_then_systemd_reads_the_same_argv(args: list[str], environ: dict[str, str]) -> None:
    argv = [PROGRAM, *args]
    value = render_exec_start(argv)
    assert "\n" not in value and "\r" not in value and "\0" not in value
    assert read_back(value, environ) == argv


@given(args=st.lists(ARG_TEXT, max_size=6))
def test_unit_form_survives_unchanged(args: list[str]) -> None:
    """An argv read from D-Bus (unit form) is written back so systemd stores it unchanged."""
    argv = [PROGRAM, *args]
    (command,) = split_exec_start(render_exec_start(argv, escape_dollar=False))
    assert list(command.argv) == argv


def test_unit_form_keeps_deliberate_environment_references() -> None:
    argv = [PROGRAM, "serve", "m", "--api-key", "${VLLM_KEY}", "$EXTRA", "cost$$"]
    value = render_exec_start(argv, escape_dollar=False)
    env = {"VLLM_KEY": "s3cret", "EXTRA": "--enforce-eager --seed 1"}
    assert read_back(value, env) == [
        PROGRAM,
        "serve",
        "m",
        "--api-key",
        "s3cret",
        "--enforce-eager",
        "--seed",
        "1",
        "cost$",
    ]


def test_program_path_and_prefixes() -> None:
    value = render_exec_start(["vllm-argv0", "serve"], path="/opt/v/bin/vllm", prefix="-")
    assert value == "@-/opt/v/bin/vllm vllm-argv0 serve"
    assert split_exec_start(value) == [
        ExecCommand("@-", "/opt/v/bin/vllm", ("vllm-argv0", "serve"))
    ]
    plus = render_exec_start([PROGRAM, "$X"], prefix="+:")
    assert plus == '+:/usr/bin/vllm "$X"'  # ':' turns expansion off, so '$' stays single
    assert split_exec_start(plus)[0].prefix == "+:"
    spaced = render_exec_start(["/opt/my models/vllm", "serve"])
    assert spaced == '"/opt/my models/vllm" serve'
    assert read_back(spaced) == ["/opt/my models/vllm", "serve"]


@pytest.mark.parametrize(
    ("program", "prefix"),
    [
        ("rel/vllm", ""),
        ("/bin/a\\b", ""),
        ('/bin/"q"', ""),
        ("/bin/x\n", ""),
        ("/opt/$V/vllm", ""),
        ("/bin/", ""),
        ("-vllm", ""),
        (PROGRAM, "x"),
        (PROGRAM, "--"),
        (PROGRAM, "!!!"),
    ],
)
def test_render_refuses_programs_systemd_would_misread(program: str, prefix: str) -> None:
    with pytest.raises(ValueError):
        render_exec_start([program, "serve"], prefix=prefix)


def test_exec_prefix_from_dbus_flags() -> None:
    assert exec_prefix([]) == ""
    assert exec_prefix(["no-env-expand", "ignore-failure"]) == "-:"
    assert exec_prefix(["ambient"]) == "!!"
    with pytest.raises(ValueError):
        exec_prefix(["sudo"])


# --------------------------------------------------------------------------------------------
# The parser itself, on cases whose outcome systemd.service(5) states


@pytest.mark.parametrize(
    ("value", "commands"),
    [
        ("/bin/x a  b", [("", "/bin/x", ("/bin/x", "a", "b"))]),
        ("/bin/x \"a b\" 'c d' e\\x20f", [("", "/bin/x", ("/bin/x", "a b", "c d", "e f"))]),
        ('/bin/x a"b c"d', [("", "/bin/x", ("/bin/x", "ab cd"))]),
        ("/bin/x 'it\\'s'", [("", "/bin/x", ("/bin/x", "it's"))]),
        ('/bin/x \\; ";"', [("", "/bin/x", ("/bin/x", ";", ";"))]),
        ("/bin/x a ; /bin/y b", [("", "/bin/x", ("/bin/x", "a")), ("", "/bin/y", ("/bin/y", "b"))]),
        ("/bin/x a;", [("", "/bin/x", ("/bin/x", "a;"))]),
        ("-/bin/x", [("-", "/bin/x", ("/bin/x",))]),
        ("@/bin/x zero one", [("@", "/bin/x", ("zero", "one"))]),
        ("!!/bin/x", [("!!", "/bin/x", ("/bin/x",))]),
        ("/bin/x %% 100%% 5%", [("", "/bin/x", ("/bin/x", "%", "100%", "5%"))]),
        ("/bin/x \\s \\t \\101 \\u00e9", [("", "/bin/x", ("/bin/x", " ", "\t", "A", "é"))]),
        ('/bin/x ""', [("", "/bin/x", ("/bin/x", ""))]),
        ("vllm serve", [("", "vllm", ("vllm", "serve"))]),
    ],
)
def test_split_exec_start(value: str, commands: list[tuple[str, str, tuple[str, ...]]]) -> None:
    assert split_exec_start(value) == [ExecCommand(*c) for c in commands]


def test_split_resolves_given_specifiers() -> None:
    (command,) = split_exec_start("/bin/x %n %%n", specifiers={"n": "vllm.service"})
    assert command.argv == ("/bin/x", "vllm.service", "%n")


@pytest.mark.parametrize(
    "value",
    [
        '/bin/x "open',
        "/bin/x 'open",
        "/bin/x \\q",  # unknown escape: systemd only warns, the strict reader refuses
        "/bin/x \\x00",
        "/bin/x %Z",  # unknown to systemd too ("Invalid slot")
        "/bin/x %n",  # known to systemd, but no table given
        '/bin/x "trailing\\',
        "/bin/a\\x5cb",
        "rel/x",
        "/bin/dir/",
        "@/bin/x",
    ],
)
def test_split_refuses(value: str) -> None:
    with pytest.raises(ExecSyntaxError):
        split_exec_start(value)


def test_split_relaxed_keeps_unknown_escapes_like_systemd() -> None:
    (command,) = split_exec_start("/bin/x \\q a\\", strict=False)
    assert command.argv == ("/bin/x", "\\q", "a\\")


def test_env_expansion_rules() -> None:
    env = {"A": "one two", "Q": "'x y' z", "E": ""}
    assert expand_exec_env(["$A", "${A}", "x${A}y", "$$A", "$B", "${B}", "a$b"], env) == [
        "one",
        "two",
        "one two",
        "xone twoy",
        "$A",
        "",
        "a$b",
    ]
    assert expand_exec_env(["$Q", "$E", "$", "${A:-d}", "${open"], env) == [
        "x y",
        "z",
        "${A:-d}",
        "${open",
    ]


def test_rewrite_pipeline_from_a_dbus_argv() -> None:
    """How the actuator uses both modules: D-Bus ExecStart (unit form) in, drop-in out."""
    from vkvagent.knowledge.flags import validate
    from vkvagent.knowledge.vllm_command import apply_flags, parse_command

    dbus_argv = [PROGRAM, "serve", "/models/m 7b", "--api-key", "${KEY}", "--max_num_seqs=256"]
    flags = validate({"max-num-seqs": 64, "gpu-memory-utilization": 0.85}, "0.10.1")
    new_argv = apply_flags(dbus_argv, flags, vllm_version="0.10.1")
    text = render_dropin(
        "vllm.service", new_argv, source_hash=argv_hash(dbus_argv), escape_dollar=False
    )
    parsed = parse_dropin(text)
    assert not parsed.foreign_edit and parsed.source_hash == argv_hash(dbus_argv)
    assert parsed.exec_start is not None
    (command,) = split_exec_start(parsed.exec_start)
    assert list(command.argv) == new_argv  # what D-Bus will report after the reload
    assert parse_command(command.argv).values() == flags
    assert expand_exec_env(command.argv, {"KEY": "k"})[4] == "k"


# --------------------------------------------------------------------------------------------
# The drop-in file


ARGV = [PROGRAM, "serve", "/models/My Model", "--max-num-seqs", "128", "--api-key", "p%s$w"]


def test_render_dropin_layout() -> None:
    text = render_dropin("vllm.service", ARGV, source_hash=argv_hash(ARGV))
    lines = text.split("\n")
    assert lines[0] == HEADER
    assert lines[1] == "# vkvagent-unit: vllm.service"
    assert lines[2] == f"# vkvagent-source-sha256: {argv_hash(ARGV)}"
    assert lines[3].startswith(HASH_KEY)
    assert lines[4:] == [
        "[Service]",
        "ExecStart=",
        'ExecStart=/usr/bin/vllm serve "/models/My Model" --max-num-seqs 128 --api-key "p%%s$$w"',
        "",
    ]


def test_a_drop_in_for_a_vllm_that_drains_says_how_systemd_stops_it() -> None:
    stop = {"KillMode": "mixed", "TimeoutStopSec": "150"}
    text = render_dropin("vllm.service", ARGV, source_hash=SOURCE, stop=stop)
    assert text.endswith("\nTimeoutStopSec=150\nKillMode=mixed\n")  # in STOP_KEYS' order
    assert not is_foreign_edit(text)
    assert other_settings(text) == []  # vkvagent's own: adopt keeps them
    assert other_settings(text + "Environment=A=1\n") == ["Service.Environment"]
    for bad in ({"User": "root"}, {"KillMode": "none\nExecStartPre=/bin/evil"}):
        with pytest.raises(ValueError, match="not stop settings vkvagent writes"):
            render_dropin("vllm.service", ARGV, source_hash=SOURCE, stop=bad)


def test_parse_dropin_round_trip() -> None:
    text = render_dropin("vllm.service", ARGV, source_hash=SOURCE)
    parsed = parse_dropin(text)
    assert parsed.recorded_hash == parsed.actual_hash
    assert not parsed.foreign_edit and not is_foreign_edit(text)
    assert parsed.unit == "vllm.service" and parsed.source_hash == SOURCE and parsed.resets
    assert parsed.exec_start is not None
    assert read_back(parsed.exec_start) == ARGV
    without = text.replace(text.split("\n")[3] + "\n", "")
    assert parsed.actual_hash == hashlib.sha256(without.encode()).hexdigest()


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.replace("128", "256"),
        lambda t: t + "Environment=A=1\n",
        lambda t: t.rstrip("\n"),
        lambda t: t.replace("vllm.service", "other.service"),
        lambda t: t.replace("\n", "\r\n"),
        lambda t: "\n".join(line for line in t.split("\n") if not line.startswith(HASH_KEY)),
        lambda t: t.replace(HASH_KEY + "", HASH_KEY + "0"),
    ],
)
def test_any_edit_is_foreign(edit: object) -> None:
    text = render_dropin("vllm.service", ARGV, source_hash=SOURCE)
    assert callable(edit)
    assert is_foreign_edit(edit(text))


def test_a_hand_written_dropin() -> None:
    text = (
        "# someone's override\n"
        "[Unit]\n"
        "Description=x\n"
        "[Service]\n"
        "ExecStart=\n"
        "ExecStart=/usr/bin/vllm serve m \\\n"
        "  # a comment inside a continuation is dropped\n"
        "  --max-num-seqs 8\n"
        "; another comment\n"
    )
    parsed = parse_dropin(text)
    assert parsed.foreign_edit and parsed.recorded_hash is None and parsed.unit is None
    assert parsed.resets
    assert parsed.exec_start == "/usr/bin/vllm serve m  --max-num-seqs 8"
    assert parse_dropin("[Service]\nExecStart=/bin/x\nExecStart=\n").exec_start is None


@pytest.mark.parametrize(
    ("unit", "source"),
    [("vllm service", SOURCE), ("vllm.service\n[Service]", SOURCE), ("vllm.service", "abc")],
)
def test_render_dropin_refuses_bad_header_fields(unit: str, source: str) -> None:
    with pytest.raises(ValueError):
        render_dropin(unit, ARGV, source_hash=source)


def test_argv_hash_tells_argvs_apart() -> None:
    assert argv_hash(["a", "b"]) != argv_hash(["ab"])
    assert argv_hash(["a b"]) != argv_hash(["a", "b"])
    assert len(argv_hash([])) == 64


# --------------------------------------------------------------------------------------------
# Real systemd: verify, and its own reading of the drop-ins


NASTY_ARGVS = [
    ["serve", "/models/My Model", "--api-key", "a\"b'c\\d", "--x", "100%", "$HOME"],
    ["serve", "m", "--chat-template", "{% if x %}\n{{ y }}\n{% endif %}", ";", "\\;", "a;"],
    ["serve", "m", "", " ", "\t", "#not-a-comment", "--k=v w", "é€😀", "\u00a0\u2028\x85"],
    ["serve", "m", "trailing\\", "\\", "${NOT_EXPANDED}", "$$", "\x01\x1b\x7f"],
]


def _random_argvs(count: int) -> list[list[str]]:
    rng = random.Random(20260716)
    alphabet = NASTY + "abcXYZ09-_./:@+,"
    return [
        ["serve"]
        + [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 10)))
            for _ in range(rng.randrange(0, 7))
        ]
        for _ in range(count)
    ]


@pytest.fixture
def unit_dir() -> Iterator[Path]:
    # Readable by everyone: `systemd --test` refuses to run as root and drops to nobody here.
    path = Path(tempfile.mkdtemp(prefix="vkvagent-units-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _write_units(directory: Path, argvs: Sequence[Sequence[str]], program: str) -> list[str]:
    names = []
    for number, args in enumerate(argvs):
        name = f"vkvtest{number}.service"
        names.append(name)
        (directory / name).write_text(
            f"[Unit]\nDescription=vkvagent test {number}\n\n"
            f"[Service]\nType=simple\nExecStart={program} original\n",
            encoding="utf-8",
        )
        dropins = directory / f"{name}.d"
        dropins.mkdir()
        text = render_dropin(name, [program, *args], source_hash=SOURCE)
        (dropins / "50-vkvagent.conf").write_text(text, encoding="utf-8")
    (directory / "vkvtest.target").write_text(
        "[Unit]\nDescription=all\nWants=" + " ".join(names) + "\n", encoding="utf-8"
    )
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return names


def _program() -> str:
    program = shutil.which("true") or "/bin/true"
    return os.path.realpath(program)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_verify_accepts_the_dropins(unit_dir: Path) -> None:
    names = _write_units(unit_dir, NASTY_ARGVS + _random_argvs(20), _program())
    result = subprocess.run(
        ["systemd-analyze", "verify", *(str(unit_dir / name) for name in names)],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:", "SYSTEMD_LOG_COLOR": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # verify exits 0 on warnings (unknown keys, unknown escapes): any output is a failure.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_systemd_analyze_verify_catches_a_bad_dropin(unit_dir: Path) -> None:
    """The check above can fail: an unknown specifier makes verify complain."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("needs systemd-analyze")
    (name,) = _write_units(unit_dir, [["serve"]], _program())
    conf = unit_dir / f"{name}.d" / "50-vkvagent.conf"
    conf.write_text(conf.read_text().replace("serve", "serve %Z"))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit_dir / name)],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout + result.stderr != ""


def _systemd_test_command() -> list[str] | None:
    binary = next(
        (p for p in ("/lib/systemd/systemd", "/usr/lib/systemd/systemd") if os.path.exists(p)),
        None,
    )
    if binary is None:
        return None
    if os.geteuid() != 0:
        return [binary]
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    # "Don't run test mode as root."
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", binary]


def _dump_argvs(dump: str) -> dict[str, list[str]]:
    """unit -> ExecStart argv from `systemd --test`'s dump (quote_command_line() output)."""
    found: dict[str, list[str]] = {}
    unit = None
    in_exec_start = False
    for line in dump.split("\n"):
        stripped = line.strip()
        if stripped.startswith("-> Unit ") and stripped.endswith(":"):
            unit, in_exec_start = stripped[len("-> Unit ") : -1], False
        elif stripped.startswith("-> "):
            in_exec_start = stripped == "-> ExecStart:"
        elif in_exec_start and unit and stripped.startswith("Command Line: "):
            found[unit] = _shell_words(line.split("Command Line: ", 1)[1])
            in_exec_start = False
    return found


def _shell_words(text: str) -> list[str]:
    """Reads systemd's shell_maybe_quote() words: bare, or "..." with \\-escapes of \\ " ` $
    and C escapes (octal for other controls)."""
    data = text.encode("utf-8")
    words, pos = [], 0
    simple = {ord(k): v for k, v in zip("abfnrtv", "\a\b\f\n\r\t\v")}
    while pos < len(data):
        if data[pos] != ord('"'):
            end = data.find(b" ", pos)
            end = len(data) if end == -1 else end
            words.append(data[pos:end].decode())
            pos = end + 1
            continue
        out = bytearray()
        pos += 1
        while data[pos] != ord('"'):
            if data[pos] == ord("\\"):
                nxt = data[pos + 1]
                if nxt in simple:
                    out += simple[nxt].encode()
                    pos += 2
                elif ord("0") <= nxt <= ord("7"):
                    out.append(int(data[pos + 1 : pos + 4], 8))
                    pos += 4
                else:
                    out.append(nxt)
                    pos += 2
            else:
                out.append(data[pos])
                pos += 1
        words.append(out.decode())
        pos += 2  # closing quote and the separating space
    return words


def test_systemd_itself_reads_back_the_argvs(unit_dir: Path) -> None:
    command = _systemd_test_command()
    if command is None:
        pytest.skip("needs the systemd binary (and setpriv when root)")
    argvs = NASTY_ARGVS + _random_argvs(150)
    program = _program()
    names = _write_units(unit_dir, argvs, program)
    result = subprocess.run(
        [*command, "--test", "--system", "--unit=vkvtest.target", "--no-pager"],
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "SYSTEMD_UNIT_PATH": str(unit_dir),
            "SYSTEMD_LOG_LEVEL": "warning",
            "SYSTEMD_LOG_COLOR": "0",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    dumped = _dump_argvs(result.stdout)
    if not dumped:
        pytest.skip(f"systemd --test gave no dump here: {result.stderr.strip()[-300:]}")
    assert "vkvtest" not in result.stderr, result.stderr  # no warning about our files
    for name, args in zip(names, argvs):
        argv = [program, *args]
        assert dumped[name] == unit_form(argv), name
        # and the re-implementation agrees with systemd on the same text
        (parsed,) = split_exec_start(
            parse_dropin(render_dropin(name, argv, source_hash=SOURCE)).exec_start or ""
        )
        assert list(parsed.argv) == dumped[name]


def test_a_container_drop_in_refuses_what_quadlet_cannot_pass_through_exec() -> None:
    """Quadlet unquotes Exec= and quotes the words again: "" vanishes and ";" comes out bare,
    a command separator in ExecStart=. Anything else passes (tests/test_container.py runs
    Quadlet itself on spaces and %)."""
    good = render_container_dropin(
        "vllm.service",
        ["/m", "--x", "a b", "50%"],
        source_hash="0" * 64,
        stop={"TimeoutStopSec": "60"},
    )
    assert '[Container]\nExec=/m --x "a b" "50%%"\n[Service]\nTimeoutStopSec=60\n' in good
    assert not is_foreign_edit(good)
    for bad in ("", ";"):
        with pytest.raises(ValueError, match="Quadlet cannot pass the argument"):
            render_container_dropin("vllm.service", ["/m", bad], source_hash="0" * 64)
