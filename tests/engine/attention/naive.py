"""A slow, obvious reference for paged attention, written for clarity only.

It shares nothing with the backends: it takes plain Python lists, writes the
step's K/V one token at a time, then for every new token walks the block
table one position at a time to rebuild that token's keys and values, and
runs softmax attention per query head in float64.
"""

from __future__ import annotations

import math

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
        first_new_pos = seq_lens[seq] - query_lens[seq]
        for i in range(query_lens[seq]):
            pos = first_new_pos + i
            keys, values = [], []
            for p in range(pos + 1):
                block = block_tables[seq][p // block_size]
                keys.append(k_after[block, p % block_size].double())
                values.append(v_after[block, p % block_size].double())
            keys_t = torch.stack(keys)  # [pos + 1, num_kv_heads, head_dim]
            values_t = torch.stack(values)
            for h in range(num_heads):
                kv = h // heads_per_kv
                q = query[t, h].double()
                logits = [float(q @ keys_t[p, kv]) * scale for p in range(pos + 1)]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                probs = torch.tensor(weights, dtype=torch.float64) / sum(weights)
                out[t, h] = probs @ values_t[:, kv]
            t += 1
    return out, k_after, v_after
