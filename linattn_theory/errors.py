"""Errors for bad inputs to the analytic module; the CLI turns them into exit status 2."""


class ParameterError(ValueError):
    """A parameter is outside its allowed range or has the wrong shape.

    The message names the parameter, the value received and the allowed range.
    """

    user_error = True


def require(condition: bool, name: str, value, allowed: str) -> None:
    """Raise :class:`ParameterError` naming ``name`` unless ``condition`` holds."""
    if not condition:
        raise ParameterError(f"{name}={value!r} is not allowed; {name} must be {allowed}")
