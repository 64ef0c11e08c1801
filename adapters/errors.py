"""Typed errors of the adapter registry.

They subclass the engine's `ValidationError`, so the gateway's one error
mapping turns them into 4xx answers: `AdapterError` is a bad upload or a bad
reference (400), `AdapterNotFound` an unknown adapter (404). `param` names the
offending field: "name" for adapter names, "adapter" for the files' content,
"model" for a reference in a request (`model: "name@3"`).
"""

from __future__ import annotations

from engine.errors import ValidationError


class AdapterError(ValidationError):
    """An adapter, its name or a reference to it is invalid."""

    def __init__(self, message: str, *, param: str = "adapter"):
        super().__init__(param, message)


class AdapterNotFound(AdapterError):
    """No stored adapter (or version) matches the reference."""

    def __init__(self, message: str, *, param: str = "model"):
        super().__init__(message, param=param)


def shown(value: object, limit: int = 80) -> str:
    """repr for an error message, cut short: the value came from a tenant."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
