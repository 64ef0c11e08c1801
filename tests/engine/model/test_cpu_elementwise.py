"""The C++ RMSNorm, rotary and SiLU-and-product kernels against their torch
twins (HF's op order) and a float64 reference: the rotary, the residual add
and the SiLU-and-product bit for bit, the norm to a rounding of its
variance; each row whatever rows share the call; and the twins taking over
where the kernel does not take the tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_elementwise
from engine.model.layers import RMSNorm
from engine.model.rope import apply_rotary
from tests.native import built_or_skip

HIDDEN, HEADS, HEAD_DIM, EPS = 576, 12, 64, 1e-5  # SmolLM2-135M: 9 query + 3 KV heads rotated together
INTERMEDIATE = 1536
DTYPES = [torch.float32, torch.bfloat16]
# One row, a few, and past the kernel's 64 rows per thread.
ROWS = [1, 3, 8, 130]


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_elementwise.load_kernel, "CPU norm, rotary and SiLU kernel")


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


def _gate_up(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The gate/up projection's output, with the values where an exp
    overflows or underflows, signed zeros, infinities and a NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = 8 * torch.randn(rows, 2 * width, generator=gen)
    specials = torch.tensor([0.0, -0.0, 88.8, -88.8, 104.0, -104.0, float("inf"), float("-inf"), float("nan")])
    x[0, : len(specials)] = specials
    x[-1, width : width + len(specials)] = specials  # in `up` too
    return x.to(dtype)


def _silu_mul_twin(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where both are numbers, NaN where either is."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
# 40 and 100: rows that end past torch's last whole pair of vectors (32 or
# 64 values), where torch and the kernel switch to std::exp.
@pytest.mark.parametrize("width", [INTERMEDIATE, 40, 100])
def test_silu_mul_is_the_twins_bit_for_bit(kernel, dtype, rows, width):
    x = _gate_up(rows, width, dtype, seed=rows + width)
    got = cpu_elementwise.silu_mul(kernel, x)
    assert got is not None and got.dtype == dtype and got.shape == (rows, width)
    assert _same(got, _silu_mul_twin(x))
    finite = ~x[:, :width].isinf() & ~x.isnan().any(-1, keepdim=True) & ~x[:, width:].isinf()
    reference = (x[:, :width].double() * torch.sigmoid(x[:, :width].double()) * x[:, width:].double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double()[finite], reference[finite], atol=tol, rtol=tol)


def test_the_bfloat16_silu_table_holds_torchs_silu_of_every_bit_pattern(kernel):
    table = cpu_elementwise.bfloat16_silu_table()
    assert table.dtype == torch.int16 and table.shape == (65537,)
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert _same(table[:-1].view(torch.bfloat16), F.silu(patterns.float()).to(torch.bfloat16))


def test_silu_mul_of_a_row_does_not_depend_on_the_rows_beside_it(kernel):
    x = _gate_up(130, INTERMEDIATE, torch.bfloat16, seed=9)
    together = cpu_elementwise.silu_mul(kernel, x)
    alone = torch.cat([cpu_elementwise.silu_mul(kernel, x[i:i + 1]) for i in range(130)])
    assert _same(together, alone)


def test_silu_mul_takes_the_projection_output_as_it_is_and_refuses_the_rest(kernel):
    wide = _gate_up(6, INTERMEDIATE + 8, torch.float32, seed=3)
    strided = wide[:, : 2 * INTERMEDIATE]  # rows further apart than their width
    assert _same(cpu_elementwise.silu_mul(kernel, strided), _silu_mul_twin(strided))
    assert cpu_elementwise.silu_mul(kernel, wide.half()) is None
    assert cpu_elementwise.silu_mul(kernel, wide.t()) is None  # columns not contiguous
    assert cpu_elementwise.silu_mul(kernel, wide[:, :-1]) is None  # no even split into gate and up
