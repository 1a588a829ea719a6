"""Chained block hashes: a full block's key is SHA-256(parent key, extra key, token ids).

The chain makes a key identify the whole prefix up to and including the block, so equal keys
mean equal KV.  SHA-256 (not Python's hash) because a collision would hand one tenant's KV to
another.  The extra key carries whatever else changes the KV content (e.g. the KV dtype).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Key of one full block given its parent block's key (None for the first block)."""
    digest = hashlib.sha256()
    digest.update(parent or b"\x00" * 32)
    digest.update(struct.pack("<I", len(extra_key)))
    digest.update(extra_key)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra_key: bytes = b""
) -> None:
    """Append to `hashes` the keys of every full block of `token_ids` not hashed yet."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(
            hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        )
