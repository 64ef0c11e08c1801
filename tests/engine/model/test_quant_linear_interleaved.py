"""The Q4_1 kernel's float32 path over weight rows interleaved 8 at a time
(engine/csrc/quant_linear_interleaved.h): the copy's layout, which calls
make and read it, the panel's row count and the one-thread limit for the
host, and that a row sums alike in 8 lanes and in a 16-lane pair. Its
outputs against the naive reference: test_quant_linear.py, whose float32
cases take this path on an AVX2 build."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import host_cpu
from engine.model import quant_linear
from tests.engine.model.quant_reference import SHAPES
from tests.native import built_or_skip


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(quant_linear.load_kernel, "CPU quantized linear kernel")


def _full_width_avx512() -> bool:
    """What halves_512 (quant_linear_interleaved.h) reads from CPUID, from
    /proc/cpuinfo: an AVX-512 CPU but AMD's family 25 (Zen 4), which runs
    512-bit operations in halves."""
    fields = host_cpu.cpu_fields()
    zen4 = fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"
    return "avx512f" in host_cpu.cpu_flags() and not zen4


def test_float32_q4_1_in_16_lanes_of_full_width_stays_on_one_thread_by_a_limit_of_its_own(kernel):
    """Where idle threads sleep, a float32 Q4_1 call on the interleaved copy
    counts its multiply-adds against the 16-lane limit on a CPU that runs
    512-bit operations full width (an AVX-512 build, but for AMD's family
    19h, Zen 4, which runs them in halves), and against the widening limit
    elsewhere. With the limits as set, on the former a decode step's qkv
    call stays on one thread at 16 rows and takes both at 24."""
    if not kernel.q4_1_interleaves():
        pytest.skip("this build has no interleaved Q4_1 path (no AVX2)")
    one_thread = kernel.interleaved_on_one_thread
    n, k = SHAPES["qkv"]
    macs = 16 * n * k
    full_width = _full_width_avx512()
    by_lanes16 = one_thread(16, n, k, 0, macs + 1) and not one_thread(16, n, k, 1 << 62, macs)
    by_widening = one_thread(16, n, k, macs + 1, 0) and not one_thread(16, n, k, macs, 1 << 62)
    assert (by_lanes16, by_widening) == (full_width, not full_width)
    if full_width:
        limits = quant_linear.SERIAL_MACS_WHEN_THREADS_SLEEP
        widening, lanes16 = limits["widening"], limits["16 lanes"]
        assert one_thread(16, n, k, widening, lanes16) and not one_thread(24, n, k, widening, lanes16)


def _interleaved_reference(qw) -> tuple[torch.Tensor, torch.Tensor]:
    """Q41Interleaved's layout (quant_linear_interleaved.h), element by element:
    byte (g, b, i, r) is row 8 g + r's block-b byte i, and (g, b, 0 or 1, r)
    its d or m."""
    n, k = qw.shape
    blocks = k // 32
    nib = torch.empty(n // 8, blocks, 16, 8, dtype=torch.uint8)
    dm = torch.empty(n // 8, blocks, 2, 8, dtype=torch.float16)
    for row in range(n):
        g, r = divmod(row, 8)
        for b in range(blocks):
            nib[g, b, :, r] = qw.q[row, b * 16:(b + 1) * 16]
            dm[g, b, :, r] = qw.dm[row, b]
    return nib, dm


def test_q4_1_reads_its_rows_interleaved_where_the_build_says_so(kernel):
    """On an AVX2 build, AVX-512 ones included, a float32 Q4_1 call reads
    the copy of the weight with its rows interleaved 8 at a time, made on
    the first call; test_quant_linear.py holds that path to the reference
    there. Here: the copy's layout, element by element, and that the kernel reads
    it (a changed copy changes the output; 3 groups of 8 rows, so on
    AVX-512 a pair of groups and a single one). Elsewhere no copy is made."""
    assert kernel.q4_1_interleaves() == ({"avx2", "f16c"} <= host_cpu.cpu_flags())
    qw = quant_linear.quantize_q4_1(torch.randn(24, 64, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    out = torch.empty(3, 24)
    assert qw.run_kernel(kernel, x, None, out)
    if not kernel.q4_1_interleaves():
        assert qw.interleaved_copy == []
        return
    nib, dm = qw.interleaved_copy
    ref_nib, ref_dm = _interleaved_reference(qw)
    assert torch.equal(nib, ref_nib) and torch.equal(dm, ref_dm)
    assert qw.nbytes == 2 * (qw.q.nbytes + qw.dm.nbytes)
    doubled_m = dm.clone()
    doubled_m[:, :, 1] *= 2
    qw.interleaved_copy = [torch.zeros_like(nib), doubled_m]  # every q 0: each weight is twice its block's m
    changed = torch.empty(3, 24)
    assert qw.run_kernel(kernel, x, None, changed)
    m = qw.dm[:, :, 1].double().repeat_interleave(32, dim=1)
    torch.testing.assert_close(changed.double(), x.double() @ (2 * m).T, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(changed, out)


def test_float32_q4_1_calls_take_the_panel_from_the_row_count_for_the_host(kernel):
    """panel_min_rows (quant_linear_interleaved.h), read from CPUID, against
    /proc/cpuinfo: 17 rows on AVX2 and on Zen 4 (AMD's family 25 with
    AVX-512), 9 on other AVX-512 hosts; none where Q4_1 rows are not
    interleaved. Which path a call takes never shows in its output
    (test_quant_linear.py's row-count test holds both to the same bits), so
    this is where the rule is checked."""
    if not kernel.q4_1_interleaves():
        assert kernel.q4_1_panel_min_rows() == 0
        return
    assert kernel.q4_1_panel_min_rows() == (9 if _full_width_avx512() else 17)


def test_a_group_of_8_weight_rows_sums_alike_in_8_lanes_and_in_a_16_lane_pair(kernel):
    """On AVX-512 the interleaved tiles take two groups of 8 weight rows in
    one 16-lane vector and a group left over in 8 lanes: rows 8-15 of a
    24-row weight run in a pair, the same rows as a weight of their own in
    8 lanes. Each lane is one chain of multiply-adds in the same order, so
    the outputs are equal bit for bit, at every pass size of token rows;
    otherwise a row would score differently with the way the weight's
    groups fall to tiles and threads. (On AVX2 both are 8-lane tiles.)"""
    gen = torch.Generator().manual_seed(7)
    qw = quant_linear.quantize_q4_1(torch.randn(24, 96, generator=gen))
    alone = replace(qw, q=qw.q[8:16].contiguous(), dm=qw.dm[8:16].contiguous())
    for rows in (1, 2, 3, 4, 5, 8, 9, 16):
        x = torch.randn(rows, 96, generator=gen)
        whole, part = torch.empty(rows, 24), torch.empty(rows, 8)
        assert qw.run_kernel(kernel, x, None, whole) and alone.run_kernel(kernel, x, None, part)
        assert torch.equal(whole[:, 8:16], part), rows
    assert (qw.interleaved_copy != []) == kernel.q4_1_interleaves()


@pytest.mark.parametrize("case", ["bfloat16", "int8_activations"])
def test_q4_1_makes_no_interleaved_copy_for_calls_that_do_not_read_it(kernel, case):
    """Only float32 activations without int8 rounding take the interleaved
    path, so the other calls leave the weight's memory as it was."""
    qw = quant_linear.quantize_q4_1(torch.randn(16, 64))
    x = torch.randn(2, 64)
    if case == "bfloat16":
        x = x.to(torch.bfloat16)
    else:
        qw = replace(qw, int8_activations=True)
    assert qw.interleaved(kernel, x) == []
    assert qw.interleaved_copy is None
