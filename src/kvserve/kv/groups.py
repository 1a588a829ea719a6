"""What one KV cache group keeps of a sequence, and how a cached prefix is found across groups.

A sequence has one block table per group (kv/spec.py `KVCacheGroup`), all indexed by the same
logical block number.  A full-attention group keeps every block.  A sliding-window group of W
tokens frees the blocks that fell out of the window of the next token to compute: their table
entries become NULL_BLOCK, and attention never reads them (attention/base.py).

    tokens:          | 0..15 | 16..31 | 32..47 | 48..63 | 64.. (next: 70)
    full group:      |  b3   |  b8    |  b1    |  b9    |  b4
    window W = 20:   |  --   |  --    |  --    |  b12   |  b5   (70 - 20 + 1 = 51: block 3 on)

A cached prefix of n blocks serves a request only when every group has what computing token
n x block_size needs: a full group its first n blocks, a window group the blocks of that
token's window.  Full groups' hits are prefix-closed (a shorter prefix of a hit is a hit), a
window group's are not (a window hit at n says nothing of n - 1), so the search is vLLM's
hybrid one: the full groups' common run first, then each window group searched from the right
below it, repeated until every group agrees on one n.

Groups never share a block: group 0 keys its blocks with the request's block hashes, group g
with a key derived from them and g (`group_key`), so a single-group cache keys exactly as
before, and one hash map serves every group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

NULL_BLOCK = -1  # a window group's entry for a block freed out of the window
HOST_HIT = -2  # a cached prefix's entry for a block the host tier holds (loaded on allocation)

# (group, logical block index) -> the block id holding it, or None
BlockLookup = Callable[[int, int], int | None]


def group_key(key: bytes, group: int) -> bytes:
    """The key of a block of `group` whose tokens hash to `key`."""
    if group == 0:
        return key
    return hashlib.blake2b(key + group.to_bytes(2, "little"), digest_size=len(key)).digest()


def first_kept_block(window: int, num_computed: int, block_size: int) -> int:
    """The first block that computing token `num_computed` (or any later one) still reads in
    a group of this window (0 for full attention): every block before it can be freed."""
    if not window:
        return 0
    return max(0, num_computed - window + 1) // block_size


def hit_length(
    windows: Sequence[int], max_blocks: int, block_size: int, lookup: BlockLookup
) -> int:
    """The most blocks n <= max_blocks such that every group holds what computing token
    n x block_size reads (see the module docstring)."""
    n = max_blocks
    for group, window in enumerate(windows):
        if not window:
            run = 0
            while run < n and lookup(group, run) is not None:
                run += 1
            n = run
    while True:
        lowered = False
        for group, window in enumerate(windows):
            if window and n:
                found = _window_hit(group, window, n, block_size, lookup)
                lowered |= found < n
                n = found
        if not lowered:
            return n


def _window_hit(
    group: int, window: int, max_blocks: int, block_size: int, lookup: BlockLookup
) -> int:
    """The largest n <= max_blocks whose window blocks are all cached in this group (0 when
    none): searched from the right, over the runs of cached blocks."""
    runs = [0] * (max_blocks + 1)  # runs[i]: cached blocks ending just before block i
    for i in range(max_blocks):
        runs[i + 1] = runs[i] + 1 if lookup(group, i) is not None else 0
    for n in range(max_blocks, 0, -1):
        if runs[n] >= n - first_kept_block(window, n * block_size, block_size):
            return n
    return 0


def prefix_tables(
    windows: Sequence[int], num_blocks: int, block_size: int, lookup: BlockLookup
) -> list[list[int]]:
    """Each group's table for a cached prefix of `num_blocks` blocks (hit_length's): a full
    group's every block, a window group's blocks of the window (NULL_BLOCK before it)."""
    tables = []
    for group, window in enumerate(windows):
        first = first_kept_block(window, num_blocks * block_size, block_size)
        table = [NULL_BLOCK] * first
        for i in range(first, num_blocks):
            block_id = lookup(group, i)
            assert block_id is not None, "prefix_tables past hit_length"
            table.append(block_id)
        tables.append(table)
    return tables
