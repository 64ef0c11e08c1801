"""API key secrets: generated with a recognizable prefix, stored only as a hash.

A secret looks like `lgw-<43 url-safe chars>` (256 random bits). The store
keeps `hash_secret(secret)` (sha256 hex) and the first characters as a
display `prefix`; the secret itself is shown once and never stored. Lookups
go by hash, and the found hash is compared again with `hmac.compare_digest`,
so no comparison on the auth path is a short-circuiting string compare.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_PREFIX = "lgw-"
PREFIX_CHARS = 12  # "lgw-" + 8 random chars: enough to tell keys apart in a list
_RANDOM_BYTES = 32


@dataclass(frozen=True)
class NewSecret:
    secret: str  # hand to the client once
    key_hash: str  # store this
    prefix: str  # and this, for display


def generate_secret() -> NewSecret:
    secret = KEY_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)
    return NewSecret(secret=secret, key_hash=hash_secret(secret), prefix=secret[:PREFIX_CHARS])


def hash_secret(secret: str) -> str:
    """sha256 hex of the secret. Keys carry 256 random bits, so a plain
    (unsalted, fast) hash is safe: there is no dictionary to attack."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def hashes_match(stored_hash: str, presented_hash: str) -> bool:
    """Constant-time comparison of two hex digests."""
    return hmac.compare_digest(stored_hash.encode("ascii"), presented_hash.encode("ascii"))
