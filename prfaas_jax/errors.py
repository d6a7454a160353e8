"""User-facing errors.

``UserError`` is the base of every error caused by what a user asked for (a bad flag, a missing
file, a malformed config). The ``prfaas`` command prints such errors as one line on stderr and
exits with status 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error the user can fix; its message says what is wrong and, where possible, how."""


class ConfigError(UserError, ValueError):
    """A model, hardware, cluster or plan config is malformed or inconsistent."""


class CheckpointError(UserError):
    """A checkpoint is unreadable, incomplete, of an unsupported kind or does not fit its config."""


class EngineError(UserError, ValueError):
    """A request or state an engine cannot take (wrong model, too long, out of range)."""


class LengthLimitError(EngineError):
    """A request that needs more positions than the engine holds (its ``max_len``): it cannot
    succeed on that engine however often it is tried, so a server answers it as final."""
