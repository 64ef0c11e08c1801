"""Paged decode attention on the CPU: a small C++ kernel, compiled on first use.

Decode rows (query_len 1) dominate attention time in a busy CPU engine: each
reads its whole context's K and V, and in plain torch that means gathering
the blocks into padded buckets, then running SDPA with a query of one row,
where GEMM-shaped kernels run at a few GB/s. This kernel reads the blocks in
place, through the block table, once per step and layer, in one pass per
sequence (engine/csrc/cpu_decode.cpp): the scores of 16 positions at a time,
an online softmax (a running max and sum per head, as in flash-decoding),
and the weighted V rows, so no score matrix is written. A sequence past 512
positions is split into spans that run on both cores and are merged. The
same module writes each layer's new K/V into the caches (`write_kv`): one
call where the twin makes two `index_copy_` calls and two casts, whose
dispatch cost more than the copying at a decode step's few rows.

Numerics: float32 accumulation throughout. A float32 model's float16 cache
(`kv_cache_dtype`, engine/config.py) is widened to float32 as it is read
(F16C), so its products are float32's. bfloat16 K/V are multiplied in
bfloat16 pairs where the CPU has AVX512-BF16 (exact products, float32 sums),
and the softmax weights are rounded to bfloat16 before their product with V,
as torch's own bfloat16 attention does; float32 runs in float32. Results
match SDPA to rounding, not bit for bit.

The torch twin is `TorchAttentionBackend`'s bucketed SDPA path, which the
backend falls back to where this kernel cannot be built (no C++ compiler) or
is turned off (LORAGW_CPU_DECODE_KERNEL=0). How it is built and cached:
native/__init__.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

import native

ENV_SWITCH = "LORAGW_CPU_DECODE_KERNEL"
_DTYPES = (torch.float32, torch.bfloat16)
# Where idle threads sleep (native/__init__.py), a call over fewer context
# positions than this stays on one thread. On 2 cores of an AMD EPYC under
# OMP_WAIT_POLICY=PASSIVE, per layer, K/V in DRAM: 2 bfloat16 sequences of
# 500 positions took 76 us on one thread and 86 us on two, 4 of 300 took 99
# on either, 4 of 500 took 172 and 145; float32 gains on two from ~1,000.
PARALLEL_POSITIONS_WHEN_THREADS_SLEEP = 1024
SOURCE = Path(__file__).parents[1] / "csrc" / "cpu_decode.cpp"


_KERNEL = native.Kernel("loragw_cpu_decode", SOURCE, "CPU decode attention kernel", ENV_SWITCH)
load_kernel = _KERNEL.load


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (it is built lazily on the first True)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and cache_pairs_with(query.dtype, k_cache.dtype)
        and head_dim % 16 == 0
        and head_dim <= 256
        and num_heads % k_cache.shape[2] == 0
        and num_heads // k_cache.shape[2] <= 16
    )


def cache_pairs_with(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel reads a cache of `cache_dtype` under queries of `query_dtype`."""
    return cache_dtype == query_dtype or (query_dtype, cache_dtype) == (torch.float32, torch.float16)


def paged_decode_attention(
    kernel,
    out: torch.Tensor,  # [T, num_heads, head_dim]: rows `rows` are written
    query: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # same
    rows: torch.Tensor,  # [n] int64: the token row of each decode sequence
    seq_ids: torch.Tensor,  # [n] int64: its row in block_tables and seq_lens
    block_tables: torch.Tensor,  # [B, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor,  # [B] int32, context length including the new token
    scale: float,
    parallel_positions: int,  # native.serial_below(PARALLEL_POSITIONS_WHEN_THREADS_SLEEP)
) -> None:
    """Attention of each decode row over its whole context, into `out`.
    Sequences of fewer than `parallel_positions` positions in all are done
    on the calling thread."""
    assert query.dtype == out.dtype and k_cache.dtype == v_cache.dtype
    assert query.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert rows.dtype == seq_ids.dtype == torch.int64 and rows.shape == seq_ids.shape
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert supports(query, k_cache)
    kernel.decode_attention(out, query, k_cache, v_cache, rows, seq_ids, block_tables, seq_lens, scale,
                            parallel_positions)


def write_kv(
    kernel,
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], a row's heads side by side
    value: torch.Tensor,  # same
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # same
    slots: torch.Tensor,  # [T] int64: each row's flat slot (block * block_size + offset)
) -> bool:
    """Writes the step's new K and V into the caches at `slots`, as the
    twin's `index_copy_` (after a cast to the cache's dtype) writes them, in
    one call; False, with nothing written, where the kernel does not take
    the tensors (the caller runs the twin)."""
    return kernel.write_kv(key, value, k_cache, v_cache, slots)
