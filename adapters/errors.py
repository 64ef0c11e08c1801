"""Typed errors of the adapters package.

`AdapterError` is bad input: a bad upload, a bad reference, or a LoRA
setting this package cannot serve. Like the engine's `ValidationError` it is
a `ValueError` whose `param` names the offending field: "name" for adapter
names, "adapter" for the files' content, "model" for a reference in a
request (`model: "name@3"`). `AdapterNotFound` is an unknown adapter. The
gateway maps both to HTTP in its one error mapping (gateway/errors.py);
this package imports nothing of the engine's, so it has its own root.
"""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter, its name, a reference to it or a LoRA setting is invalid."""

    def __init__(self, message: str, *, param: str = "adapter"):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class AdapterNotFound(AdapterError):
    """No stored adapter (or version) matches the reference."""

    def __init__(self, message: str, *, param: str = "model"):
        super().__init__(message, param=param)


def shown(value: object, limit: int = 80) -> str:
    """repr for an error message, cut short: the value came from a tenant."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
