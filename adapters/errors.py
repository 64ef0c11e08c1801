"""Typed errors of the adapters package.

`AdapterError` is bad input: a bad upload, a bad reference, or a LoRA
setting this package cannot serve. Like the engine's `ValidationError` it is
a `ValueError` whose `param` names the offending field: "name" for adapter
names, "model" for a reference in a request (`model: "name@3"`), and for an
upload the file at fault, CONFIG_FILE or WEIGHTS_FILE (a tensor that does
not fit the config blames the weights, whose check found it). "adapter",
the default, is left for what no one file is at fault for: a stored
adapter's content, an import path that is not a directory.
`AdapterNotFound` is an unknown adapter. The gateway maps both to HTTP in
its one error mapping (gateway/errors.py); this package imports nothing of
the engine's, so it has its own root.
"""

from __future__ import annotations

# The files of an adapter as peft's save_pretrained writes them, and the
# multipart fields of an upload.
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_MESSAGE = (
    "pickle-format weights (adapter_model.bin) are not accepted: unpickling can run arbitrary "
    f"code; re-save the adapter with safe_serialization=True ({WEIGHTS_FILE})"
)


class AdapterError(ValueError):
    """An adapter, its name, a reference to it or a LoRA setting is invalid."""

    def __init__(self, message: str, *, param: str = "adapter"):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def blaming(self, param: str) -> AdapterError:
        """The same error about `param`, where this one was raised with the
        default param, by a check that does not know which input it reads
        (kept as it is otherwise)."""
        return AdapterError(self.message, param=param) if self.param == "adapter" else self


class AdapterNotFound(AdapterError):
    """No stored adapter (or version) matches the reference."""

    def __init__(self, message: str, *, param: str = "model"):
        super().__init__(message, param=param)


def shown(value: object, limit: int = 80) -> str:
    """repr for an error message, cut short: the value came from a tenant."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
