"""Shell completion for ``vkvagent``, generated from its argument parser, so that a new
command or option completes without anyone writing it twice::

    python3 tools/completion.py bash > vkvagent        # /usr/share/bash-completion/completions/
    python3 tools/completion.py zsh > _vkvagent        # zsh's vendor-completions or site-functions

packaging/build.sh runs it for the packages. Both scripts find the command path typed so far
(``config check``), then offer its sub-commands, its options, an option's choices, or file
names where an option or argument is a path.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vkvagent.tools.cli import _parser


@dataclass
class Command:
    path: str  # "config check"; "" for vkvagent itself
    help: str
    commands: dict[str, str] = field(default_factory=dict)  # name -> help
    options: dict[str, str] = field(default_factory=dict)  # --name -> help
    valued: dict[str, str] = field(default_factory=dict)  # --name -> "files", or its choices
    files: bool = False  # takes file names as arguments


def commands(parser: argparse.ArgumentParser, path: str = "", text: str = "") -> Iterator[Command]:
    """Each command of ``parser`` (itself first), from argparse's own record of it."""
    command = Command(path, text)
    below: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {entry.dest: entry.help or "" for entry in action._choices_actions}
            for name, sub in action.choices.items():
                command.commands[name] = helps.get(name, "")
                below.append((name, sub, helps.get(name, "")))
        elif not action.option_strings:
            command.files = command.files or action.type is Path
        else:
            for option in action.option_strings:
                command.options[option] = action.help or ""
                if action.nargs != 0:
                    kind = "files" if action.type is Path else " ".join(action.choices or ())
                    command.valued[option] = kind
    yield command
    for name, sub, said in below:
        yield from commands(sub, f"{path} {name}".strip(), said)


def bash(parser: argparse.ArgumentParser) -> str:
    found = list(commands(parser))
    cases = []
    for c in found:
        valued = " ".join(c.valued)
        cases.append(
            f'        "{c.path}") subs="{" ".join(c.commands)}"; opts="{" ".join(c.options)}"; '
            f'valued="{valued}"; files={int(c.files)} ;;'
        )
    return BASH.format(cases="\n".join(cases), kinds=_kinds(found))


def _kinds(found: Sequence[Command]) -> str:
    """The case arms that name what each option's value is (both shells read the same)."""
    return "\n".join(
        f'        "{c.path}|{option}") kind="{kind}" ;;'
        for c in found
        for option, kind in c.valued.items()
    )


BASH = """\
# bash completion for vkvagent; generated from its argument parser by tools/completion.py.
_vkvagent_spec() {{
    case $1 in
{cases}
        *) subs=""; opts=""; valued=""; files=0 ;;
    esac
}}

_vkvagent_kind() {{
    case $1 in
{kinds}
        *) kind="" ;;
    esac
}}

_vkvagent() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} cmdpath="" word i subs opts valued files kind
    # The command path typed so far; an option's value is skipped.
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${{COMP_WORDS[i]}}
        _vkvagent_spec "$cmdpath"
        if [[ " $subs " == *" $word "* ]]; then
            cmdpath="${{cmdpath:+$cmdpath }}$word"
        elif [[ " $valued " == *" $word "* && $((i + 1)) -lt $COMP_CWORD ]]; then
            [[ ${{COMP_WORDS[i + 1]}} == -* ]] || ((i++))
        fi
    done
    _vkvagent_spec "$cmdpath"
    local prev=${{COMP_WORDS[COMP_CWORD - 1]}}
    if [[ $cur == -* ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$opts" -- "$cur")
    elif ((COMP_CWORD > 1)) && [[ " $valued " == *" $prev "* ]]; then
        _vkvagent_kind "$cmdpath|$prev"
        if [[ $kind == files ]]; then
            mapfile -t COMPREPLY < <(compgen -f -- "$cur")
        elif [[ -n $kind ]]; then
            mapfile -t COMPREPLY < <(compgen -W "$kind" -- "$cur")
        fi
        # (a value of the option's, nothing else; free text: nothing to offer)
    else
        mapfile -t COMPREPLY < <(compgen -W "$subs" -- "$cur")
        ((files)) && mapfile -t -O "${{#COMPREPLY[@]}}" COMPREPLY < <(compgen -f -- "$cur")
    fi
    return 0
}}

complete -o filenames -F _vkvagent vkvagent
"""


def zsh(parser: argparse.ArgumentParser) -> str:
    found = list(commands(parser))
    cases = []
    for c in found:
        subs = " ".join(_zsh_word(f"{name}:{text}") for name, text in c.commands.items())
        opts = " ".join(_zsh_word(f"{name}:{text}") for name, text in c.options.items())
        valued = " ".join(c.valued)
        cases.append(
            f'        "{c.path}") subs=({subs}); opts=({opts}); valued=({valued}); '
            f"files={int(c.files)} ;;"
        )
    return ZSH.format(cases="\n".join(cases), kinds=_kinds(found))


def _zsh_word(text: str) -> str:
    """One word of a zsh array, quoted; ``_describe`` reads ``name:description``, so a colon
    in the description is escaped."""
    name, _colon, description = text.partition(":")
    description = " ".join(description.split()).replace(":", "\\:")
    return "'" + f"{name}:{description}".replace("'", "'\\''") + "'"


ZSH = """\
#compdef vkvagent
# zsh completion for vkvagent; generated from its argument parser by tools/completion.py.
_vkvagent_spec() {{
    case $1 in
{cases}
        *) subs=(); opts=(); valued=(); files=0 ;;
    esac
}}

_vkvagent_kind() {{
    case $1 in
{kinds}
        *) kind="" ;;
    esac
}}

_vkvagent() {{
    local cmdpath="" word i kind files
    local -a subs opts valued
    # The command path typed so far; an option's value is skipped.
    for ((i = 2; i < CURRENT; i++)); do
        word=${{words[i]}}
        _vkvagent_spec "$cmdpath"
        if (( ${{subs[(I)${{(b)word}}:*]}} )); then
            cmdpath="${{cmdpath:+$cmdpath }}$word"
        elif (( ${{valued[(Ie)$word]}} )) && (( i + 1 < CURRENT )); then
            [[ ${{words[i + 1]}} == -* ]] || (( i++ ))
        fi
    done
    _vkvagent_spec "$cmdpath"
    local prev=${{words[CURRENT - 1]}}
    if [[ $PREFIX == -* ]]; then
        _describe -t options option opts
    elif (( CURRENT > 2 && ${{valued[(Ie)$prev]}} )); then
        _vkvagent_kind "$cmdpath|$prev"
        if [[ $kind == files ]]; then
            _files
        elif [[ -n $kind ]]; then
            compadd -- ${{=kind}}
        fi
        # (a value of the option's, nothing else; free text: nothing to offer)
    else
        _describe -t commands command subs
        if (( files )); then _files; fi
    fi
}}

_vkvagent "$@"
"""


def main(argv: list[str]) -> int:
    shells = {"bash": bash, "zsh": zsh}
    if len(argv) != 1 or argv[0] not in shells:
        print("usage: completion.py bash|zsh", file=sys.stderr)
        return 2
    sys.stdout.write(shells[argv[0]](_parser()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
