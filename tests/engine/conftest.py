"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest

from engine.model import cpu_linear, quant_limits


@pytest.fixture
def kernel_rows(monkeypatch):
    """Sets LORAGW_CPU_LINEAR_MAX_ROWS, the most rows the CPU linear and
    quantized kernels take, for one test: `kernel_rows("1024")`. The limits
    are cached per process, so both caches are cleared on the way in and out."""
    def set_rows(value: str):
        monkeypatch.setenv(cpu_linear.ROWS_ENV, value)
        cpu_linear.row_limit.cache_clear()
        quant_limits.row_limit.cache_clear()

    yield set_rows
    cpu_linear.row_limit.cache_clear()
    quant_limits.row_limit.cache_clear()
