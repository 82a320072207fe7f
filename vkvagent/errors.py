"""The root of vkvagent's own errors.

Each module that can fail for a reason a person can act on raises its own subclass of
``VkvagentError`` (``ConfigError``, ``ScrapeError``, ``SystemdError``, ...), whose message is
one line per problem. ``cli.main`` catches the root: anything else that escapes is a bug.
"""


class VkvagentError(Exception):
    """An expected failure, said in one line per problem."""


class NeedsOperator(VkvagentError):
    """A failure that restarting the daemon cannot cure, only a person: an invalid config, or
    state written by a newer vkvagent (after a downgrade). ``vkvagent run`` exits
    ``NEEDS_OPERATOR`` on one, which the unit's ``RestartPreventExitStatus=`` does not retry."""


NEEDS_OPERATOR = 78  # sysexits.h's EX_CONFIG
