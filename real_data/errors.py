"""Errors raised for bad user input (configs, files, data); the CLI turns them into exit 2."""


class UserError(ValueError):
    """A problem with what the user asked for; the message names the key or file and the fix."""

    user_error = True


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or an impossible value."""


class DataError(UserError):
    """A data file is missing or corrupt; the message names the file and the fixing command."""
