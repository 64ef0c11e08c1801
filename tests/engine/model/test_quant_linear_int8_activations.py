"""Activation quantization int8: float32 activations rounded to int8 per
block of 32 against the blocked formats (Q4_1, Q8_0), on a host whose
kernel has the path (AVX2), against a naive float64 reference computed
from the stored bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.model import quant_linear
from tests.engine.model.quant_reference import SHAPES, naive_weight, quantized_weights
from tests.native import built_or_skip


@pytest.fixture(scope="module")
def int8_kernel():
    kernel = built_or_skip(quant_linear.load_kernel, "CPU quantized linear kernel")
    if not quant_linear.int8_activations_available(kernel, torch.float32):
        pytest.skip("the quantized kernel has no int8-activation path on this host (no AVX2)")
    return kernel


def naive_int8_activations(x: torch.Tensor, qw, bias=None) -> torch.Tensor:
    """What activation quantization int8 computes, in float64 from the stored
    bytes: each row's block of 32 rounded to int8 against its largest
    magnitude (127 / max|x| and the product in float32, then to nearest,
    ties to even, as the kernel rounds them), the integer products summed
    exactly, scaled by the weight's d and the block's max|x| / 127; Q4_1's m
    times the block's float sum."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 32, 32)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    qx = torch.round(blocks * inv).double()  # [rows, blocks, 32]
    dx = (top / 127).double()[..., 0]  # [rows, blocks]
    n = qw.shape[0]
    if isinstance(qw, quant_linear.Q80Weight):
        q, d, m = qw.q.double().reshape(n, k // 32, 32), qw.d.double(), None
    else:
        q = naive_weight(quant_linear.Q41Weight(qw.q, torch.stack(
            (torch.ones_like(qw.dm[..., 0]), torch.zeros_like(qw.dm[..., 1])), dim=-1))).reshape(n, k // 32, 32)
        d, m = qw.dm[..., 0].double(), qw.dm[..., 1].double()
    out = torch.einsum("rbi,nbi->rnb", qx, q).mul(d[None] * dx[:, None]).sum(-1)
    if m is not None:
        out += blocks.double().sum(-1) @ m.T
    return out if bias is None else out + bias.double()


def _int8_activation_weights(shape, seed):
    qws, gen = quantized_weights(shape, seed)
    return {fmt: replace(qws[fmt], int8_activations=True) for fmt in ("int4", "q8_0")}, gen


@pytest.mark.parametrize("fmt", ["int4", "q8_0"])
@pytest.mark.parametrize("shape", ["qkv", "down", "head_rows"])
def test_int8_activations_match_their_naive_reference(int8_kernel, fmt, shape):
    """Only the float32 sums of the scaled integer products differ from the
    reference; against the float weights the rounding of x shows, about a
    percent of the output here."""
    qws, gen = _int8_activation_weights(SHAPES[shape], seed=11)
    qw = qws[fmt]
    for rows in (1, 3, 4, 9, 16):
        x = torch.randn(rows, qw.shape[1], generator=gen)
        x[0, :32] = 0  # a block of zeros: max|x| = 0
        out = torch.empty(rows, qw.shape[0])
        assert qw.run_kernel(int8_kernel, x, None, out)
        expected = naive_int8_activations(x, qw)
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
        exact = x.double() @ naive_weight(qw).T
        assert (out.double() - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("fmt", ["int4", "q8_0"])
def test_int8_activations_with_bias_strided_rows_and_any_split(int8_kernel, fmt):
    """A row comes out bit for bit the same whatever rows share its call, as
    with float activations (each row is rounded on its own)."""
    qws, gen = _int8_activation_weights((100, 96), seed=12)
    qw = qws[fmt]
    x = torch.randn(13, 200, generator=gen)[:, 7:103]
    x[2, 40] = 1e4  # one outlier: its block's other values round to 0
    bias = torch.randn(100, generator=gen)
    together = torch.empty(13, 100)
    assert qw.run_kernel(int8_kernel, x, bias, together)
    torch.testing.assert_close(together.double(), naive_int8_activations(x, qw, bias), atol=1e-4, rtol=1e-4)
    for split in ((1,) * 13, (2, 3, 8), (4, 9)):
        parts = [torch.empty(len(rows), 100) for rows in x.split(split)]
        for rows, out in zip(x.split(split), parts):
            assert qw.run_kernel(int8_kernel, rows, bias, out)
        assert torch.equal(torch.cat(parts), together), split


def test_int8_activations_are_float32_only(int8_kernel):
    qw = replace(quant_linear.quantize_q4_1(torch.randn(32, 64)), int8_activations=True)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert not qw.run_kernel(int8_kernel, x, None, torch.empty(2, 32, dtype=torch.bfloat16))
    per_channel = quant_linear.quantize_int8(torch.randn(32, 64))
    quant_linear.use_int8_activations([per_channel, None, qw])
    assert not hasattr(per_channel, "int8_activations") and qw.int8_activations
