"""The C++ RMSNorm and rotary kernels against their torch twins (HF's op
order) and a float64 reference: the rotary and the residual add bit for bit,
the norm to a rounding of its variance; each row whatever rows share the
call; and the twins taking over where the kernel does not take the tensors."""

from __future__ import annotations

import pytest
import torch

from engine.model import cpu_elementwise
from engine.model.layers import RMSNorm
from engine.model.rope import apply_rotary
from tests.native import built_or_skip

HIDDEN, HEADS, HEAD_DIM, EPS = 576, 12, 64, 1e-5  # SmolLM2-135M: 9 query + 3 KV heads rotated together
DTYPES = [torch.float32, torch.bfloat16]
# One row, a few, and past the kernel's 64 rows per thread.
ROWS = [1, 3, 8, 130]


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_elementwise.load_kernel, "CPU norm and rotary kernel")


def _norm(dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(HIDDEN, EPS, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (1 + 0.2 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    return norm


def _hidden(rows: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, HIDDEN, generator=gen)).to(dtype)


def _reference_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between a and b (same sign)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return (a.view(bits).long() - b.view(bits).long()).abs()


def _assert_twins_but_for_the_variance(got: torch.Tensor, twin: torch.Tensor) -> None:
    """Only the sum of squares runs in another order than the twin's: a
    float32 variance a rounding step or two apart moves a row's values by a
    few float32 steps; in bfloat16 that moves a value across at most one
    bfloat16 rounding boundary, and most values not at all."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, twin, atol=1e-6, rtol=1e-6)
    else:
        ulps = _ulps_apart(got, twin)
        assert ulps.max() <= 1
        assert (ulps == 0).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_norm_matches_the_twin_to_a_rounding_of_the_variance(kernel, dtype, rows):
    norm = _norm(dtype, seed=rows)
    x = _hidden(rows, dtype, seed=rows)
    got = cpu_elementwise.rms_norm(kernel, x, norm.weight, EPS)
    twin = norm.twin(x)
    assert got is not None and got.dtype == dtype
    _assert_twins_but_for_the_variance(got, twin)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.double(), _reference_norm(x, norm.weight), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_residual_add_is_the_twins_and_the_norm_follows_it(kernel, dtype, rows):
    norm = _norm(dtype, seed=rows)
    residual, x = _hidden(rows, dtype, seed=rows), _hidden(rows, dtype, seed=rows + 100, scale=0.5)
    expected_sum = residual + x
    total, normed = norm.add_forward(residual, x.clone())
    assert torch.equal(total, expected_sum)
    _assert_twins_but_for_the_variance(normed, norm.twin(expected_sum))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, dtype):
    norm = _norm(dtype, seed=7)
    x = _hidden(130, dtype, seed=7)
    together = cpu_elementwise.rms_norm(kernel, x, norm.weight, EPS)
    alone = torch.cat([cpu_elementwise.rms_norm(kernel, x[i:i + 1], norm.weight, EPS) for i in range(130)])
    assert torch.equal(together, alone)
    cos, sin = _cos_sin(130, dtype)
    qk = torch.randn(130, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(8)).to(dtype)
    together = cpu_elementwise.rotary(kernel, qk, cos, sin)
    alone = torch.cat([cpu_elementwise.rotary(kernel, qk[i:i + 1], cos[i:i + 1], sin[i:i + 1]) for i in range(130)])
    assert torch.equal(together, alone)


def _cos_sin(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(rows, dtype=torch.float32) * 37 % 4096  # far positions too
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_is_the_twins_bit_for_bit_on_the_packed_qkv(kernel, dtype, rows):
    # The model rotates q and k where they sit in the q/k/v projection's
    # output: rows strided by the whole width, v's columns beside them.
    gen = torch.Generator().manual_seed(rows)
    qkv = (4 * torch.randn(rows, (HEADS + 3) * HEAD_DIM, generator=gen)).to(dtype)
    qk = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    cos, sin = _cos_sin(rows, dtype)
    got = cpu_elementwise.rotary(kernel, qk, cos, sin)
    assert got is not None and got.is_contiguous()
    assert torch.equal(got, apply_rotary(qk, cos, sin))


def test_tensors_the_kernel_does_not_take_go_to_the_twin(kernel):
    x = _hidden(4, torch.float16, seed=1)
    norm = _norm(torch.float16, seed=1)
    assert cpu_elementwise.rms_norm(kernel, x, norm.weight, EPS) is None
    assert torch.equal(norm(x), norm.twin(x))
    residual, before = _hidden(4, torch.float16, seed=2), x.clone()
    total, _ = norm.add_forward(residual, x)
    assert torch.equal(total, residual + before) and torch.equal(x, before)  # untouched when handed back
    strided = _hidden(4, torch.float32, seed=3).t()  # last dim not contiguous
    assert cpu_elementwise.rms_norm(kernel, strided, _norm(torch.float32, 3).weight, EPS) is None
    cos, sin = _cos_sin(4, torch.float32)
    odd = torch.randn(4, 2, 48)  # head_dim not a multiple of 32
    assert cpu_elementwise.rotary(kernel, odd, cos[..., :48].contiguous(), sin[..., :48].contiguous()) is None
    assert cpu_elementwise.rotary(kernel, torch.randn(4, 2, 64).to(torch.float16), cos.half(), sin.half()) is None
