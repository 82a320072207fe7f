"""What the ``vkvagent`` command tells its caller: the documented exit codes, and the errors a
command raises to end with one (``cli.main`` prints them as ``vkvagent: <reason>``)."""

from __future__ import annotations

from enum import IntEnum

from vkvagent.errors import VkvagentError


class ExitCode(IntEnum):
    """Documented exit codes (docs/commands.md, "Exit codes")."""

    OK = 0
    FAILURE = 1  # what was asked could not be done: unreadable vLLM, bad page, bad config
    USAGE = 2  # the command line itself is wrong
    # The reader of stdout went away (`vkvagent replay ... | head -3`): stopped quietly, with
    # the status a shell gives a writer SIGPIPE ended (128 + 13), as in any other pipeline.
    BROKEN_PIPE = 141


class CommandError(VkvagentError):
    """A one-line reason the command failed; printed as ``vkvagent: <reason>``."""


class UsageError(CommandError):
    """The command line is wrong in a way argparse cannot tell (exit 2)."""
