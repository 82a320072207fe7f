"""The root of vkvagent's own errors.

Each module that can fail for a reason a person can act on raises its own subclass of
``VkvagentError`` (``ConfigError``, ``ScrapeError``, ``SystemdError``, ...), whose message is
one line per problem. ``cli.main`` catches the root: anything else that escapes is a bug.
"""


class VkvagentError(Exception):
    """An expected failure, said in one line per problem."""
