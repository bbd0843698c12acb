"""The user-error family: problems with what a user asked for or gave, not bugs in geoattn.

Each is a ``ValueError`` (so library callers can catch the usual type); the command line prints them
in one line with exit code 2, while any other exception keeps its traceback. `NativeBuildError`, a
problem of the machine rather than of a request, stands beside them: the command line prints it
(the compiler's output) with exit code 1.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's request or inputs; printed as one line by the command line."""


class ConfigError(UserError):
    """An unknown, missing or out-of-range setting (flag, ``--set`` key, TOML key, config field)."""


class DataError(UserError):
    """Data that is missing, malformed or cannot be fetched (text files, simulator files, downloads)."""


class CheckpointError(UserError):
    """A run directory or checkpoint that is missing, corrupt, or does not match its model."""


class NativeBuildError(RuntimeError):
    """The native CPU kernels (`geoattn.native`) could not be built or loaded. The message
    carries the compiler's output; ``reason`` is the one line of it that says what failed."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message
