"""The runner's user errors: a mistake in what was asked (a config value, a file, a run folder), not a bug.

The command line prints such an error as one line and exits with status 2 (``--debug`` or
``TORCHCAL_DEBUG=1`` shows the traceback); every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["UserError", "ConfigError", "DatasetError", "CheckpointError", "RunError"]


class UserError(Exception):
    """Base of every error caused by what the user asked; its message says what to change."""


class ConfigError(UserError, ValueError):
    """A configuration file or override that does not fit the schema."""


class DatasetError(UserError, FileNotFoundError):
    """A dataset file that is missing or malformed; the message says what to put where."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is corrupt or does not belong to this run."""


class RunError(UserError, RuntimeError):
    """A run folder that does not hold what the command needs (missing, unfinished, damaged files, or a
    folder that already holds another run)."""
