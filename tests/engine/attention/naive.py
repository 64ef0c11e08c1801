"""A slow, obvious reference for paged attention, written for clarity only.

It shares nothing with the backends: it takes plain Python lists, writes the
step's K/V one token at a time, walks each sequence's block table one
position at a time to gather its keys and values, and then, for every new
token and query head, takes softmax attention over the positions it may see,
in float64: every logit, then every weight, then the weighted sum, with no
tiling and no running maximum. The products are torch's, one head at a time
(a Python loop over positions made the attention tests a quarter of the
suite's time, and checked nothing more).
"""

from __future__ import annotations

import torch


def naive_paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], before the step
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], before the step
    block_tables: list[list[int]],  # physical block ids of each sequence, in order
    slot_mappings: list[int],  # [T] cache slot of each new token
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out [T, num_heads, head_dim] float64, k_cache after, v_cache after)."""
    block_size = k_cache.shape[1]
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    heads_per_kv = num_heads // num_kv_heads

    k_after = k_cache.clone()
    v_after = v_cache.clone()
    for t, slot in enumerate(slot_mappings):
        block, offset = slot // block_size, slot % block_size
        k_after[block, offset] = key[t].to(k_after.dtype)
        v_after[block, offset] = value[t].to(v_after.dtype)

    out = torch.zeros(query.shape, dtype=torch.float64)
    t = 0
    for seq in range(len(seq_lens)):
        if query_lens[seq] == 0:
            continue
        keys, values = [], []
        for p in range(seq_lens[seq]):
            block = block_tables[seq][p // block_size]
            keys.append(k_after[block, p % block_size].double())
            values.append(v_after[block, p % block_size].double())
        keys_t = torch.stack(keys)  # [seq_len, num_kv_heads, head_dim]
        values_t = torch.stack(values)
        first_new_pos = seq_lens[seq] - query_lens[seq]
        for i in range(query_lens[seq]):
            visible = first_new_pos + i + 1  # causal: up to and including its own position
            for h in range(num_heads):
                kv = h // heads_per_kv
                logits = keys_t[:visible, kv] @ query[t, h].double() * scale  # [visible]
                weights = torch.exp(logits - logits.max())
                out[t, h] = (weights / weights.sum()) @ values_t[:visible, kv]
            t += 1
    return out, k_after, v_after
