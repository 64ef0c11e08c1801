"""Helpers for the tests of the C++ CPU kernels (native/__init__.py builds them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def built_or_skip(load_kernel, what: str):
    """The built kernel module; skips the test where it cannot be built."""
    kernel = load_kernel()
    if kernel is None:
        pytest.skip(f"the {what} cannot be built here (no C++ compiler, or switched off)")
    return kernel


def recording(kernel, method: str) -> SimpleNamespace:
    """`kernel` with its `method` wrapped: `.handled` lists what each call
    returned (True: the kernel did the work; False: it handed it back)."""
    handled: list[bool] = []

    def call(*args):
        handled.append(getattr(kernel, method)(*args))
        return handled[-1]

    return SimpleNamespace(**{method: call, "handled": handled})
