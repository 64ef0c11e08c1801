"""Paged prefill attention on the CPU: a small C++ kernel, compiled on
first use, in float32 (over a float32 or float16 cache) on x86 hosts with
AVX2 or AVX-512 and in bfloat16 on hosts with AVX512-BF16.

At high concurrency most of a CPU step is prompt work, and its attention
ran in torch's SDPA: on two Zen 5 cores its flash kernel takes bfloat16 at
about float32's speed (65 to 110 GFLOP/s), on two Zen 3 cores its float32
causal path reached 7 to 59 GFLOP/s (float32 GEMM gets ~120-160 there),
and a chunk after a sequence's first also needs its K/V gathered out of the
blocks and a mask that makes SDPA compute the whole rectangle of queries by
keys. This kernel reads the blocks in place and skips the keys a query
cannot see (engine/csrc/cpu_prefill.cpp): items of 16 query positions
(in bfloat16, a chunk of fewer than 16 rows packs its rows under each KV
head's query heads into an item's 16 lanes), scores and values as
register-tiled products.

Numerics: float32 sums and softmax. In bfloat16, the products are of
bfloat16 pairs (vdpbf16ps) and the weights are rounded to bfloat16 before
their product with V, as torch's own bfloat16 attention rounds them; in
float32, a float16 cache's K/V are widened as they are read. Results match
SDPA to rounding, not bit for bit.

The torch twin is `TorchAttentionBackend`'s per-chunk SDPA, which serves
where this kernel is not built (no compiler), does not cover the tensors
(bfloat16 without AVX512-BF16) or is turned off
(LORAGW_CPU_PREFILL_KERNEL=0). How it is built and cached:
native/__init__.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

import native

ENV_SWITCH = "LORAGW_CPU_PREFILL_KERNEL"
HEAD_DIMS = (32, 64, 96, 128, 256)  # the builds of with_head_dim (engine/csrc/cpu_prefill_items.h)
TILE = 16  # key positions per tile: a block size must be a multiple of it
# Where idle threads sleep (native/__init__.py), a call over fewer key tiles
# (16 queries by 16 keys of one head) than this stays on one thread. On 2
# Zen 5 cores under OMP_WAIT_POLICY=PASSIVE, 30 layers of SmolLM2 shapes: a
# 32-token chunk (27 tiles) took 1.0 ms on one thread and 1.3 on two, 64
# tokens (81 tiles) 1.9 on either, 128 (297 tiles) 4.7 and 3.5-5.1, 256
# (1,161) 16.4 and 10.2.
PARALLEL_TILES_WHEN_THREADS_SLEEP = 128
SOURCE = Path(__file__).parents[1] / "csrc" / "cpu_prefill.cpp"

_KERNEL = native.Kernel("loragw_cpu_prefill", SOURCE, "CPU prefill attention kernel", ENV_SWITCH)


def load_kernel():
    """The built kernel, or None where it cannot be had."""
    return _KERNEL.load()


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel covers these tensors: float32 queries over a
    float32 or float16 cache, or bfloat16 over bfloat16 where the build has
    AVX512-BF16 (which loads the kernel to ask)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    if not (
        query.device.type == "cpu"
        and head_dim in HEAD_DIMS
        and k_cache.shape[1] % TILE == 0
        and num_heads % k_cache.shape[2] == 0
    ):
        return False
    if query.dtype == torch.float32:
        return k_cache.dtype in (torch.float32, torch.float16)
    if query.dtype == k_cache.dtype == torch.bfloat16:
        kernel = load_kernel()
        return kernel is not None and kernel.has_bfloat16()
    return False


def paged_prefill_attention(
    kernel,
    out: torch.Tensor,  # [T, num_heads, head_dim]: the chunks' rows are written
    query: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous, this step's K in it
    v_cache: torch.Tensor,  # same
    starts: torch.Tensor,  # [n] int64: each chunk's first token row
    lens: torch.Tensor,  # [n] int64: its query length
    seq_ids: torch.Tensor,  # [n] int64: its row in block_tables and seq_lens
    block_tables: torch.Tensor,  # [B, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor,  # [B] int32, context length including the chunk
    scale: float,
    parallel_tiles: int,  # native.serial_below(PARALLEL_TILES_WHEN_THREADS_SLEEP)
) -> None:
    """Causal attention of each chunk's queries (the last `len` positions of
    its sequence) over its context, into `out`."""
    assert query.dtype == out.dtype and k_cache.dtype == v_cache.dtype
    assert query.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert starts.dtype == lens.dtype == seq_ids.dtype == torch.int64
    assert starts.shape == lens.shape == seq_ids.shape
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert supports(query, k_cache)
    kernel.prefill_attention(out, query, k_cache, v_cache, starts, lens, seq_ids, block_tables, seq_lens, scale,
                             parallel_tiles)
