"""The skinny C++ linear kernel against a float64 reference, and the ways
`cpu_linear.linear` hands work back to torch's F.linear (its twin)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_linear
from tests.native import built_or_skip, recording, torch_threads

HIDDEN, INTERMEDIATE, QKV = 576, 1536, 960  # SmolLM2-135M


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_linear.load_kernel, "CPU linear kernel")


def _case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    return x, w, b, expected


@pytest.fixture(autouse=True)
def row_limit(kernel_rows):
    """LORAGW_CPU_LINEAR_MAX_ROWS=1024 unless the test sets another, so that
    the kernel's tests reach it on a host whose calibration gives it no rows."""
    kernel_rows("1024")
    return kernel_rows


# Rows: single tokens, 4-row tiles and their remainders, up to the fixed
# limit, and past it (prefill chunks, where a host's calibration allows).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 32, 37, 130])
@pytest.mark.parametrize("shape", [(QKV, HIDDEN), (HIDDEN, INTERMEDIATE), (2 * INTERMEDIATE, HIDDEN)],
                         ids=["qkv", "down", "gate_up"])
def test_smollm2_shapes_match_the_reference(kernel, row_limit, rows, shape):
    row_limit("1024")
    x, w, _, expected = _case(rows, *shape, torch.float32, seed=rows)
    rec = recording(kernel, "skinny_linear")
    got = cpu_linear.linear(rec, x, w)
    assert rec.handled == [True]
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_widths_off_the_vector_grid_with_bias(kernel, dtype, tol):
    """Neither K nor N a multiple of 16 (scalar tails, a partial weight-row tile), plus a bias."""
    x, w, b, expected = _case(6, 37, 100, dtype, seed=3, bias=True)
    rec = recording(kernel, "skinny_linear")
    got = cpu_linear.linear(rec, x, w, b)
    assert rec.handled == [True] and got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_many_weight_rows_split_across_threads(kernel, threads):
    """A weight taller than one thread's share (an LM head's shape, shortened)."""
    with torch_threads(threads):
        x, w, _, expected = _case(2, 4099, HIDDEN, torch.float32, seed=4)
        got = cpu_linear.linear(kernel, x, w)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["too_many_rows", "x_rows_strided", "float16", "weight_transposed"])
def test_other_inputs_go_to_torch(kernel, row_limit, case):
    row_limit("8")  # the environment's limit holds below the calibration's floor too
    rows = 9 if case == "too_many_rows" else 4
    dtype = torch.float16 if case == "float16" else torch.float32
    x, w, _, _ = _case(rows, 64, 48, dtype, seed=5)
    if case == "x_rows_strided":
        x = torch.randn(rows, 96)[:, ::2]
    if case == "weight_transposed":
        w = w.T.contiguous().T
    rec = recording(kernel, "skinny_linear")
    got = cpu_linear.linear(rec, x, w)
    assert rec.handled in ([], [False])
    assert torch.equal(got, F.linear(x, w))


def test_a_shape_mismatch_raises(kernel):
    x, w, _, _ = _case(2, 64, 48, torch.float32, seed=6)
    with pytest.raises(RuntimeError, match="skinny_linear"):
        kernel.skinny_linear(x, w, None, torch.empty(2, 63))


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    assert cpu_linear.load_kernel() is None


def test_a_failed_build_leaves_torch(no_compiler, caplog):
    assert cpu_linear._KERNEL.build() is None
    assert "CPU linear kernel unavailable" in caplog.text
    x, w, _, _ = _case(2, 64, 48, torch.float32, seed=7)
    assert torch.equal(cpu_linear.linear(None, x, w), F.linear(x, w))


def test_the_row_limit_is_the_last_point_before_torch_wins():
    kernel_faster = {64: (1.0, 2.0), 128: (2.0, 3.0)}
    assert cpu_linear.crossover(kernel_faster) == 128
    assert cpu_linear.crossover({**kernel_faster, 256: (5.0, 4.0), 512: (1.0, 9.0)}) == 128
    assert cpu_linear.crossover({1: (2.0, 1.0), 4: (1.0, 2.0)}) == 0  # torch wins from the first row


def test_calibration_times_both_paths_until_torch_wins(kernel):
    weights = cpu_linear.calibration_weights(torch.float32)
    assert len(weights) == cpu_linear.CALIBRATION_COPIES
    assert len({w.data_ptr() for w in weights}) == len(weights) and not torch.equal(weights[0], weights[1])
    calls = []

    def run_kernel(x, out, i):
        calls.append(("kernel", x.shape[0], i))
        return kernel.skinny_linear(x, weights[i], None, out)

    def run_torch(x, i):
        calls.append(("torch", x.shape[0], i))
        return F.linear(x, weights[i])

    timings = cpu_linear.measure(run_kernel, run_torch, torch.float32)
    measured = sorted(timings)
    assert measured == list(cpu_linear.CALIBRATION_ROWS[:len(measured)])
    assert all(0 < k_s < 1 and 0 < t_s < 1 for k_s, t_s in timings.values())
    # It stops at the first point torch wins, or runs to the last.
    assert all(k_s < t_s for rows, (k_s, t_s) in timings.items() if rows != measured[-1])
    assert len(measured) == len(cpu_linear.CALIBRATION_ROWS) or timings[measured[-1]][0] >= timings[measured[-1]][1]
    # Interleaved, every repeat; each run streams the copies, all of them at a few rows.
    expected = [(path, rows, i) for rows in measured
                for _ in range(cpu_linear.CALIBRATION_REPEATS) for path in ("kernel", "torch")
                for i in range(cpu_linear.copies_for(rows))]
    assert calls == expected
    assert cpu_linear.copies_for(1) == cpu_linear.CALIBRATION_COPIES and cpu_linear.copies_for(1024) == 1
    assert cpu_linear.crossover(timings) in (0, *cpu_linear.CALIBRATION_ROWS)


@pytest.mark.parametrize("value", ["many", "-1"])
def test_a_bad_row_limit_in_the_environment_is_named(row_limit, value):
    row_limit(value)
    with pytest.raises(ValueError, match=cpu_linear.ROWS_ENV):
        cpu_linear.row_limit(torch.float32, torch.get_num_threads())


def test_without_the_kernel_no_rows_go_to_it(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    monkeypatch.delenv(cpu_linear.ROWS_ENV, raising=False)
    cpu_linear.row_limit.cache_clear()
    try:
        assert cpu_linear.row_limit(torch.float32, torch.get_num_threads()) == 0
    finally:
        cpu_linear.row_limit.cache_clear()
