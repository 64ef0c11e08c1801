"""The GPU's norm, rotary and SiLU kernels against their torch twins.

Without a GPU they run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton); with one, on CUDA. The
rotary and the residual add must equal the twins bit for bit; the norm may
differ by a rounding of its float32 reduction, and the SiLU by one of its
exp, carried into its product, which rounds again. The interpreter
truncates float32 to bfloat16 where a GPU rounds to nearest, so there
bfloat16 results may sit one more rounding off, and nothing in bfloat16 can
be bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import triton_elementwise
from engine.model.layers import RMSNorm
from engine.model.rope import apply_rotary
from tests.triton_env import KERNEL_DEVICE as DEVICE
from tests.triton_env import assert_runs_without_triton

pytest.importorskip("triton")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                                 ids=["fp32", "bf16", "fp16"])
# One rounding of the dtype, relative, on values of order 1 (two for
# bfloat16 under the interpreter, which truncates).
ROUNDING = {torch.float32: 2e-6, torch.bfloat16: 2**-7 if DEVICE.type == "cuda" else 2**-6, torch.float16: 2**-10}


def assert_bit_identical(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16 and DEVICE.type != "cuda":
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-6)
    else:
        assert torch.equal(out, ref)


def _rand(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _norm(hidden: int, dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5, dtype, torch.device("cpu"))
    norm.weight.data = _rand(hidden, dtype=dtype, seed=9).abs() + 0.5
    return norm


@DTYPES
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (5, 100)], ids=["decode", "batch", "odd-width"])
def test_rms_norm_matches_the_twin(dtype, rows, hidden):
    norm = _norm(hidden, dtype)
    x = _rand(rows, hidden, dtype=dtype, scale=3.0)
    out = triton_elementwise.rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(out.float(), norm.twin(x).float(), rtol=ROUNDING[dtype], atol=1e-6)


@DTYPES
def test_residual_add_is_exact_and_written_into_x(dtype):
    norm = _norm(576, dtype)
    x, residual = _rand(6, 576, dtype=dtype, seed=1), _rand(6, 576, dtype=dtype, seed=2)
    total = residual + x
    out = triton_elementwise.rms_norm(x, norm.weight, norm.eps, residual)
    assert_bit_identical(x, total)  # the sum, written into x
    # The norm of the sum the kernel wrote (the same as `total` on a GPU).
    torch.testing.assert_close(out.float(), norm.twin(x).float(), rtol=ROUNDING[dtype], atol=1e-6)


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 32, 80])  # 80: a block wider than the head
def test_rotary_is_bit_identical_on_a_view_of_qkv(dtype, head_dim):
    tokens, heads, kv_heads = 5, 9, 3
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    assert not qk.is_contiguous()
    angles = _rand(tokens, 1, head_dim // 2, dtype=torch.float32, seed=4, scale=5.0)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = triton_elementwise.rotary(qk, cos, sin)
    assert out.is_contiguous()
    assert_bit_identical(out, apply_rotary(qk, cos, sin))


@DTYPES
@pytest.mark.parametrize("rows,width", [(1, 1536), (4, 1536), (3, 40)])
def test_silu_mul_matches_the_twin(dtype, rows, width):
    x = _rand(rows, 2 * width, dtype=dtype, seed=5, scale=4.0)
    gate, up = x.split(width, dim=-1)
    out = triton_elementwise.silu_mul(x)
    # Both round the SiLU to the dtype, then its product with `up`. Where
    # their float32 exps straddle a rounding of the first, the SiLUs differ
    # by one rounding, carried into the product, which adds its own: two in
    # all (seen in float16 on an H100, 2 of 6,144 values).
    torch.testing.assert_close(out.float(), (F.silu(gate) * up).float(), rtol=2 * ROUNDING[dtype], atol=1e-6)


def test_an_empty_batch_launches_nothing():
    w = _rand(576, dtype=torch.float32)
    assert triton_elementwise.rms_norm(_rand(0, 576, dtype=torch.float32), w, 1e-5).shape == (0, 576)
    assert triton_elementwise.silu_mul(_rand(0, 64, dtype=torch.float32)).shape == (0, 32)
    cos = _rand(0, 1, 64, dtype=torch.float32)
    assert triton_elementwise.rotary(_rand(0, 4, 64, dtype=torch.float32), cos, cos).shape == (0, 4, 64)


def test_what_the_kernels_do_not_take_falls_back():
    """None (the caller then runs the twin) for shapes the kernels do not handle."""
    x = _rand(4, 576, dtype=torch.float32)
    w = _rand(576, dtype=torch.float32)
    assert triton_elementwise.rms_norm(x.t(), w, 1e-5) is None  # columns not contiguous
    assert triton_elementwise.rms_norm(x, w.to(torch.bfloat16), 1e-5) is None  # mixed dtypes
    assert triton_elementwise.rms_norm(x, w[:500], 1e-5) is None  # a weight of another width
    assert triton_elementwise.rms_norm(x, w, 1e-5, residual=x[:3]) is None  # a residual of another shape
    assert triton_elementwise.silu_mul(_rand(2, 5, dtype=torch.float32)) is None  # odd width
    assert triton_elementwise.rotary(x.view(4, 9, 64), x[:, :64].view(4, 1, 64)[:3], x[:, :64].view(4, 1, 64)) is None


def test_importing_the_model_does_not_import_triton():
    assert_runs_without_triton(
        "import engine.model, engine.model.llama, engine.model.triton_elementwise as t\n"
        "assert 'triton.language' not in sys.modules\n"
        "assert not t.available()\n"
    )
