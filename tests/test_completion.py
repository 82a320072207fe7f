"""Shell completion, generated from the parser by tools/completion.py: every command and
option is offered, in bash and zsh, and the scripts complete what a person types."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tools import completion
from vkvagent.tools.cli import _parser

SHELLS = {"bash": completion.bash, "zsh": completion.zsh}


def walked(parser: argparse.ArgumentParser, path: str = "") -> dict[str, set[str]]:
    """Command path -> its sub-commands and option strings, read from the parser here (not
    through the generator's own walk)."""
    found: dict[str, set[str]] = {path: set()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[path].add(name)
                found.update(walked(sub, f"{path} {name}".strip()))
        found[path].update(action.option_strings)
    return found


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_every_command_and_option_of_the_parser_is_in_the_script(shell: str) -> None:
    script = SHELLS[shell](_parser())
    tree = walked(_parser())
    assert {"config check", "replay", "status"} <= set(tree)
    for path, words in tree.items():
        line = next(line for line in script.splitlines() if line.strip().startswith(f'"{path}")'))
        for word in words:
            assert (
                f" {word}" in line
                or f"({word}" in line
                or f"'{word}:" in line
                or (f'"{word}' in line)
            ), f"{shell}: {path!r} lacks {word}"


def bash_complete(script: Path, *words: str) -> list[str]:
    run = (
        f"source {script}; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
        'COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _vkvagent; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(["bash", "--norc", "-c", run], capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if line]


def test_bash_completes_commands_options_choices_and_files(tmp_path: Path) -> None:
    script = tmp_path / "vkvagent"
    script.write_text(completion.bash(_parser()), encoding="utf-8")
    (tmp_path / "conf.toml").write_text("")
    assert bash_complete(script, "vkvagent", "st") == ["status"]
    assert bash_complete(script, "vkvagent", "config", "") == ["check"]
    assert bash_complete(script, "vkvagent", "replay", "--mode", "") == [
        "off",
        "observe",
        "enforce",
    ]
    assert "--json" in bash_complete(script, "vkvagent", "status", "--watch", "--")
    assert bash_complete(script, "vkvagent", "status", "--config", f"{tmp_path}/con") == [
        f"{tmp_path}/conf.toml"
    ]
    assert bash_complete(script, "vkvagent", "scrape", "--url", "") == []  # free text


def zsh_complete(script: Path, *words: str) -> str:
    """What the zsh function offers, with zsh's completion builtins stubbed to print it."""
    stubs = (
        '_describe() { local name=${@[-1]}; local -a arr; arr=("${(@P)name}"); '
        'print -r -- "${(j: :)${arr[@]%%:*}}"; }; _files() { print -r -- FILES; }; '
        "compadd() { shift; print -r -- $*; }"
    )
    quoted = " ".join(repr(w) for w in words)
    run = (
        f'{stubs}; words=(vkvagent ""); CURRENT=2; PREFIX=""; source {script} >/dev/null; '
        f"words=({quoted}); CURRENT=${{#words}}; PREFIX=${{words[-1]}}; _vkvagent"
    )
    done = subprocess.run(["zsh", "-f", "-c", run], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_zsh_completes_commands_options_choices_and_files(tmp_path: Path) -> None:
    if shutil.which("zsh") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("zsh is not installed (make deps installs it; CI=true: not skipped)")
        pytest.skip("zsh is not installed")
    script = tmp_path / "_vkvagent"
    script.write_text(completion.zsh(_parser()), encoding="utf-8")
    subprocess.run(["zsh", "-n", str(script)], check=True)
    assert zsh_complete(script, "vkvagent", "config", "") == "check"
    assert zsh_complete(script, "vkvagent", "replay", "--mode", "") == "off observe enforce"
    assert "--explain" in zsh_complete(script, "vkvagent", "status", "--watch", "--")
    assert zsh_complete(script, "vkvagent", "status", "--config", "") == "FILES"
    assert zsh_complete(script, "vkvagent", "config", "check", "").splitlines()[-1] == "FILES"
