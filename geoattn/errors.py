"""The user-error family: problems with what a user asked for or gave, not bugs in geoattn.

Each is a ``ValueError`` (so library callers can catch the usual type); the command line prints them
in one line with exit code 2, while any other exception keeps its traceback.
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
