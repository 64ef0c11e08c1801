"""The quantized kernels' row limits (quant_limits.py): what each is timed
on, by which real paths, up to how many rows, and what overrides them. The
limit a process keeps for the host: test_calibration_cache.py."""

from __future__ import annotations

import pytest
import torch

from engine.model import cpu_linear, quant_limits, quant_linear
from tests.engine.model.quant_reference import HIDDEN, quantized_weights
from tests.native import built_or_skip


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(quant_linear.load_kernel, "CPU quantized linear kernel")


@pytest.fixture(autouse=True)
def limits_cleared(kernel_rows):
    """Clears the limits cached in this process on the way in and out (the
    fixture sets LORAGW_CPU_LINEAR_MAX_ROWS too; each test takes it off or
    sets its own)."""
    kernel_rows("1024")


def test_the_head_limit_is_measured_on_the_head_once_a_process(kernel, kernel_rows, monkeypatch):
    """Timed on the head's own shape (not the layers' calibration shape),
    one streamed copy, at most 256 rows, by the real paths; cached by
    format, shape, dtype and threads; the environment's limit wins."""
    monkeypatch.delenv(cpu_linear.ROWS_ENV)
    monkeypatch.setattr(quant_limits, "_head_limits", {})
    qws, gen = quantized_weights((300, HIDDEN), seed=9)
    head, float_head = qws["q8_0"], qws["q8_0"].dequantize(torch.float32)
    seen = []
    real = cpu_linear.calibrated_limit

    def calibrated(what, dtype, threads, run_kernel, run_torch, **kw):
        seen.append(kw)
        x, out = torch.randn(3, HIDDEN, generator=gen), torch.empty(3, kw["shape"][0])
        run_kernel(x, out, 0)
        torch.testing.assert_close(out, run_torch(x, 0), atol=1e-4, rtol=1e-4)
        return real(what, dtype, threads, run_kernel, run_torch, **kw)

    monkeypatch.setattr(cpu_linear, "calibrated_limit", calibrated)
    limit = quant_limits.head_row_limit(kernel, head, float_head)
    assert limit in (0, *quant_limits.HEAD_CALIBRATION_ROWS) and max(quant_limits.HEAD_CALIBRATION_ROWS) == 256
    assert len(seen) == 1 and seen[0]["shape"] == (300, HIDDEN)
    assert seen[0]["rows"] == quant_limits.HEAD_CALIBRATION_ROWS
    assert seen[0]["copies"](1) == seen[0]["copies"](256) == 1
    assert quant_limits.head_row_limit(kernel, head, float_head) == limit and len(seen) == 1
    other = quantized_weights((200, HIDDEN), seed=10)[0]["q8_0"]
    quant_limits.head_row_limit(kernel, other, other.dequantize(torch.float32))
    assert len(seen) == 2 and seen[1]["shape"] == (200, HIDDEN)
    kernel_rows("7")
    assert quant_limits.head_row_limit(kernel, head, float_head) == 7 and len(seen) == 2
    assert quant_limits.head_row_limit(None, head, float_head) == 0


@pytest.mark.parametrize("fmt", ["int4", "q8_0"])
def test_a_layer_limit_beside_float_weights_is_measured_up_to_128_rows(kernel, fmt, monkeypatch):
    """Past 128 rows a layer's call is prompt work, left to the float GEMM
    (LAYER_CALIBRATION_ROWS says why); the measurement never tries more, by
    the real paths on the calibration shape."""
    monkeypatch.delenv(cpu_linear.ROWS_ENV)
    seen = []
    real = cpu_linear.calibrated_limit

    def calibrated(what, dtype, threads, run_kernel, run_torch, **kw):
        if "beside float weights" not in what:  # the float path's own kernel limit
            return real(what, dtype, threads, run_kernel, run_torch, **kw)
        seen.append(kw)
        x = torch.randn(3, HIDDEN)
        out = torch.empty(3, cpu_linear.CALIBRATION_SHAPE[0])
        run_kernel(x, out, 0)
        ref = run_torch(x, 0)  # the float weights the quantized ones round
        assert ((out - ref).norm() / ref.norm()).item() < 0.1
        return real(what, dtype, threads, run_kernel, run_torch, rows=(1,))

    monkeypatch.setattr(cpu_linear, "calibrated_limit", calibrated)
    limit = quant_limits.row_limit.__wrapped__(torch.float32, torch.get_num_threads(), beside_float=fmt)
    assert limit in (0, 1)
    assert len(seen) == 1 and seen[0]["rows"] == quant_limits.LAYER_CALIBRATION_ROWS
    assert max(quant_limits.LAYER_CALIBRATION_ROWS) == 128 and 1 in quant_limits.LAYER_CALIBRATION_ROWS


@pytest.mark.parametrize("beside_float", [False, True])
def test_without_a_kernel_no_limit_is_measured(beside_float, monkeypatch):
    """A GPU model, or LORAGW_CPU_LINEAR_KERNEL=0: every call takes the float
    path, so nothing is timed, and the CPU kernel is not built for it."""
    monkeypatch.setattr(quant_linear, "load_kernel", lambda: pytest.fail("the CPU kernel was asked for"))
    weight = quantized_weights((64, HIDDEN), seed=3)[0]["int4"]
    assert quant_limits.weight_row_limit(None, weight, torch.float32, beside_float=beside_float) == 0
    assert quant_limits.row_limit.cache_info().currsize == 0
