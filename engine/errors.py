"""Typed errors raised by the engine.

The gateway maps these to HTTP statuses in exactly one place; inside the
engine they stay plain exceptions with the facts a caller needs.
"""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class ValidationError(EngineError, ValueError):
    """A request or parameter is invalid. `param` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class ModelLoadError(EngineError):
    """A model checkpoint is missing, unsupported or unsafe to load."""


class EngineDeadError(EngineError):
    """The step loop failed; every in-flight request is ended with this."""
