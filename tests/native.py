"""Helpers for the tests of the C++ CPU kernels (native/__init__.py builds them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch


def built_or_skip(load_kernel, what: str):
    """The built kernel module; skips the test where it cannot be built."""
    kernel = load_kernel()
    if kernel is None:
        pytest.skip(f"the {what} cannot be built here (no C++ compiler, or switched off)")
    return kernel


class _Recording(SimpleNamespace):
    def __getattr__(self, name: str):  # only for what the namespace lacks: the kernel's other bindings
        return getattr(self.kernel, name)


def recording(kernel, method: str) -> SimpleNamespace:
    """`kernel` with its `method` wrapped: `.handled` lists what each call
    returned (True: the kernel did the work; False: it handed it back). Its
    other bindings are the kernel's own."""
    handled: list[bool] = []

    def call(*args):
        handled.append(getattr(kernel, method)(*args))
        return handled[-1]

    return _Recording(**{method: call, "handled": handled, "kernel": kernel})


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block, restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
