"""Paged decode attention on the CPU: a small C++ kernel, compiled on first use.

Decode rows (query_len 1) dominate attention time in a busy CPU engine: each
reads its whole context's K and V, and in plain torch that means gathering
the blocks into padded buckets, then running SDPA with a query of one row,
where GEMM-shaped kernels run at a few GB/s. This kernel reads the blocks in
place, through the block table, once per step and layer
(engine/csrc/cpu_decode.cpp):

  scores  [n, num_heads, width]  scale * q . k for every context position,
          -inf past the sequence's length (C++, one thread per sequence);
  probs   softmax over the last dim (torch's vectorized softmax);
  out     sum_j probs[j] * v_j, written to the query's token rows (C++).

Numerics: float32 accumulation throughout (bfloat16 K/V are widened on
load); results match SDPA to float32 rounding, not bit for bit.

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
# positions than this stays on one thread: on 2 cores under
# OMP_WAIT_POLICY=PASSIVE, 4 sequences of 450 positions took 138 us on one
# thread and 271 us on two, 16 took 591 and 692, 48 took 4.7 ms and 2.4 ms.
PARALLEL_POSITIONS_WHEN_THREADS_SLEEP = 8192
SOURCE = Path(__file__).parents[1] / "csrc" / "cpu_decode.cpp"


_KERNEL = native.Kernel("loragw_cpu_decode", SOURCE, "CPU decode attention kernel", ENV_SWITCH)
load_kernel = _KERNEL.load


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (it is built lazily on the first True)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and k_cache.dtype == query.dtype
        and head_dim % 16 == 0
        and head_dim <= 256
        and num_heads % k_cache.shape[2] == 0
        and num_heads // k_cache.shape[2] <= 16
    )


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
    width: int,  # >= the longest seq_len among the n sequences
    scale: float,
    parallel_positions: int,  # native.serial_below(PARALLEL_POSITIONS_WHEN_THREADS_SLEEP)
) -> None:
    """Attention of each decode row over its whole context, into `out`.
    Sequences of fewer than `parallel_positions` positions in all are done
    on the calling thread."""
    assert query.dtype == k_cache.dtype == v_cache.dtype == out.dtype and query.dtype in _DTYPES
    assert query.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert rows.dtype == seq_ids.dtype == torch.int64 and rows.shape == seq_ids.shape
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert supports(query, k_cache)
    n = rows.shape[0]
    scores = torch.empty(n, query.shape[1], width, dtype=torch.float32)
    kernel.decode_scores(scores, query, k_cache, rows, seq_ids, block_tables, seq_lens, scale, parallel_positions)
    probs = torch.softmax(scores, dim=-1)
    kernel.decode_values(out, probs, v_cache, rows, seq_ids, block_tables, seq_lens, parallel_positions)
