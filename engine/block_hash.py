"""Chained block hashes for prefix caching.

The hash of a full block covers its parent block's hash, its own token ids
and the request's extra key `(adapter_key, cache_salt)`. Chaining makes one
hash stand for the whole prefix up to and including the block, so two blocks
with equal hashes hold equal KV. The extra key goes into every block, not
only the first, so no block is ever shared across adapters (or adapter
versions) or across tenants' cache salts, wherever the chain starts.

sha256 rather than Python's `hash()`: prompts come from tenants, and a short
non-cryptographic hash would let one tenant craft a prompt whose block
collides with another tenant's and read KV it never computed.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Hashable, Sequence

BlockHash = bytes

_DIGEST_SIZE = hashlib.sha256().digest_size
# The first byte tells a chain's first block from a child, so no parent
# digest can ever encode the same bytes as "no parent".
_ROOT_TAG = b"\x00"
_CHILD_TAG = b"\x01"
# Plain values have a repr that is the same in every process and never
# embeds a memory address; anything else could make two different keys
# encode alike after the first object is garbage collected.
_PLAIN_TYPES = (type(None), bool, int, float, str, bytes)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int],
               extra_key: Hashable) -> BlockHash:
    """The chained hash of one block.

    The encoding is canonical and unambiguous: tag, parent digest, token
    count, tokens as little-endian int64, length of the key's repr, the repr.
    Every variable-length field is length-prefixed, so no two different
    inputs produce the same bytes.
    """
    h = hashlib.sha256()
    if parent is None:
        h.update(_ROOT_TAG)
    else:
        assert len(parent) == _DIGEST_SIZE, "parent must be a block hash"
        h.update(_CHILD_TAG)
        h.update(parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    key = _encode_extra_key(extra_key)
    h.update(struct.pack("<I", len(key)))
    h.update(key)
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_key: Hashable) -> list[BlockHash]:
    """Append to `hashes` the hashes of the full blocks of `token_ids` it
    does not have yet, and return the appended ones.

    `hashes` must be the chain of the first `len(hashes)` blocks of these
    same tokens: callers keep one list per request and extend it as the
    sequence grows, so a decode step hashes one block, not the whole sequence.
    """
    num_full = len(token_ids) // block_size
    start = len(hashes)
    parent = hashes[-1] if hashes else None
    for i in range(start, num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key)
        hashes.append(parent)
    return hashes[start:]


def hash_full_blocks(token_ids: Sequence[int], block_size: int,
                     extra_key: Hashable) -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids` (a trailing
    partial block has none: its KV is still growing)."""
    return extend_block_hashes([], token_ids, block_size, extra_key)


def _encode_extra_key(extra_key: Hashable) -> bytes:
    _check_plain(extra_key)
    return repr(extra_key).encode()


def _check_plain(value: object) -> None:
    if isinstance(value, tuple):
        for item in value:
            _check_plain(item)
    elif not isinstance(value, _PLAIN_TYPES):
        raise TypeError(
            f"prefix-cache keys must be built from None, bool, int, float, str, bytes "
            f"and tuples of them; got {type(value).__name__}")
