"""Helpers for the tests of the C++ CPU kernels (engine/native.py)."""

from __future__ import annotations

import pytest


def built_or_skip(load_kernel, what: str):
    """The built kernel module; skips the test where it cannot be built."""
    kernel = load_kernel()
    if kernel is None:
        pytest.skip(f"the {what} cannot be built here (no C++ compiler, or switched off)")
    return kernel
