"""Paged attention as one Triton kernel, for decode and chunked prefill alike.

Design. One program owns a tile of BLOCK_Q consecutive new tokens of one
sequence and one KV head, and computes every query head of that KV head's
group at once: the tile's rows are (token, head-in-group) pairs, so a K/V
tile loaded from the cache feeds the whole GQA group. The grid is

    (cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads)

and programs whose tile starts past their sequence's query_len exit at once
(a decode in a mixed batch costs one live program per KV head).

Each program walks its sequence's keys in tiles of BLOCK_N positions. A key
position is turned into a cache slot through the block table one key at a
time, so BLOCK_N is independent of the cache block size (a block size of 4
still feeds tl.dot tiles of 16+). The walk stops at the last key the tile's
last token may see; the causal mask is by absolute position: key position
<= query position, with query position = seq_len - query_len + i. The
softmax is online (running max and sum, fp32 accumulator), in base 2 with the
scale folded into log2(e).

Writing this step's K/V into the cache is plain torch (`index_copy_` on the
flattened cache) and happens for the whole batch before the kernel reads.

On a machine without a GPU the kernel runs only under the Triton interpreter,
which reads TRITON_INTERPRET=1 when this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.base import AttentionBackend, AttentionMetadata

_LOG2_E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    q_ptr,  # [T, num_heads, head_dim], last dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    qk_scale,  # softmax scale * log2(e)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_seq,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_N: tl.constexpr,  # key positions per inner step
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 caches (no tf32), None otherwise
    DOT_IN_FP32: tl.constexpr,  # upcast bf16 dot operands: the interpreter's tl.dot cannot do bf16
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_start = q_tile * BLOCK_Q
    if tile_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # keys already cached before this step

    # Rows of the tile: row r is token tile_start + r // GROUP_PAD of the
    # sequence's new tokens, query head kv_head * GROUP + r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_ok = (tok < query_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = context_len + tok  # absolute position of the row's token
    dims = tl.arange(0, HEAD_DIM)

    q_rows = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # The tile's last token sees keys up to its own position and no further.
    kv_end = context_len + tl.minimum(tile_start + BLOCK_Q, query_len)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for kv_start in range(0, kv_end, BLOCK_N):
        k_pos = kv_start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_end
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot_off = (
            block.to(tl.int64) * stride_kv_block
            + (k_pos % BLOCK_SIZE) * stride_kv_slot
            + kv_head * stride_kv_head
        )
        # K is loaded transposed, [HEAD_DIM, BLOCK_N], ready for q @ k.
        k = tl.load(k_cache_ptr + slot_off[None, :] + dims[:, None], mask=k_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + slot_off[:, None] + dims[None, :], mask=k_ok[:, None], other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        # Key 0 is visible to every row, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P is rounded to the cache dtype for the second dot, as on a GPU.
        p = p.to(v_cache_ptr.dtype.element_ty).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(
        out_ptr + o_rows[:, None] + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def _tile_sizes(max_query_len: int, group_pad: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N). A tile has BLOCK_Q * group_pad rows: 16 when the
    batch's longest query fits (decode), so little of the tile is padding,
    else 64 (prefill). 16 is also the smallest tl.dot on a GPU."""
    rows = 16 if max_query_len * group_pad <= 16 else 64
    rows = max(rows, group_pad)
    return rows // group_pad, 64


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], already holding this step's K
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], already holding this step's V
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim], query's dtype
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert query.dtype in _DTYPES, query.dtype
    assert k_cache.dtype == v_cache.dtype == query.dtype, (query.dtype, k_cache.dtype, v_cache.dtype)
    assert k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert query.stride(-1) == 1
    assert cache_head_dim == head_dim
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim}: power of two >= 16"
    assert block_size == meta.block_size and block_size & (block_size - 1) == 0
    assert num_heads % num_kv_heads == 0
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.is_contiguous()
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert sum(meta.query_lens_host) == num_tokens
    interpreted = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
    if query.device.type == "cpu":
        assert interpreted, "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)"

    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q, block_n = _tile_sizes(meta.max_query_len, group_pad)
    grid = (triton.cdiv(meta.max_query_len, block_q), meta.num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale * _LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        DOT_IN_FP32=interpreted and query.dtype == torch.bfloat16,
    )
    return out


class TritonAttentionBackend(AttentionBackend):
    """Writes K/V with torch, attends with `_paged_attention_kernel`."""

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        assert meta.slot_mapping.dtype == torch.int64
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))
        if query.stride(-1) != 1:
            query = query.contiguous()
        return paged_attention(query, k_cache, v_cache, meta, scale)
