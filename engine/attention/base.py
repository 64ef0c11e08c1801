"""The attention backend contract and the per-step metadata it reads.

A step's batch is flattened: T new tokens from B sequences, sequence after
sequence. Each sequence's new tokens are the last `query_len` positions of
its context of `seq_len` tokens; the earlier ones are already in the paged
KV cache, addressed through the sequence's block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: prefix sums of query_lens
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_host: list[int]  # the same facts on the host, for loops and shapes
    seq_lens_host: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)


class AttentionBackend(ABC):
    """Paged causal attention over a KV cache laid out as
    `[num_blocks, block_size, num_kv_heads, head_dim]` (one K and one V tensor
    per layer).

    Contract of `forward`: first write this step's `key`/`value` into the
    caches at `meta.slot_mapping`, then attend each new token to every
    earlier-or-equal position of its own sequence (grouped-query attention:
    query head h reads KV head h // (num_heads // num_kv_heads)). The write
    must happen for the whole batch before any read, because a sequence may
    read blocks another sequence of the same step is filling (a prefix-cache
    hit on a block computed in this very step).

    `prepare` is called once per step before the layers run, so a backend can
    build index tensors once instead of thirty times.
    """

    name: str = "abstract"

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Build per-step state from `meta`; the default needs none."""

    @abstractmethod
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
        ...
