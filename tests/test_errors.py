"""One error family: every error the agent raises on purpose is a VkvagentError, the one
type `cli.main` turns into a `vkvagent: ...` line."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import vkvagent
from vkvagent.errors import VkvagentError


def agent_errors() -> list[type[BaseException]]:
    """Every exception class the agent's modules define (the simulator is vLLM's stand-in,
    with vLLM's own errors, and not part of the agent)."""
    found = []
    for info in pkgutil.walk_packages(vkvagent.__path__, "vkvagent."):
        if info.name.startswith("vkvagent.sim") or info.name == "vkvagent.__main__":
            continue
        module = importlib.import_module(info.name)
        for _name, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == info.name:
                found.append(value)
    return found


def test_every_agent_error_is_a_vkvagent_error() -> None:
    errors = agent_errors()
    assert len(errors) >= 15  # the walk found the modules' errors
    assert [e.__qualname__ for e in errors if not issubclass(e, VkvagentError)] == []


def test_one_error_name_per_meaning() -> None:
    names = [e.__name__ for e in agent_errors()]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
