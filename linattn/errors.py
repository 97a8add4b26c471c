"""Errors for bad user input, shared by every part except the analytic module.

An exception that carries ``user_error = True`` is printed by the ``linattn`` router as
``error: <message>`` with exit status 2. ``linattn_theory`` has its own ``ParameterError`` with
the same marker, because the analytic module imports nothing of ours.
"""


class UserError(ValueError):
    """A problem with what the user asked for; the message names the key or file and the fix."""

    user_error = True


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or an impossible value."""


class DataError(UserError):
    """A data file is missing or corrupt; the message names the file and the fixing command."""
