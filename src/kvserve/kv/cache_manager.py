"""KVCacheManager: per-request block tables over one BlockPool; the only owner of blocks.

One request's tokens and blocks (block_size 4):

    tokens:  | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. .. |
    blocks:  |  b7 cached  |  b2 cached  |  b5 partial |
             [ cached prefix hit        ][ computed  ][ new ][ to allocate ]

* ``find_cached_prefix`` finds the longest run of cached full blocks at the start (never the
  whole sequence: the last token is always computed, its logits are needed).
* ``allocate_slots`` grows the table to hold ``num_computed + num_new`` tokens: all or nothing.
* ``cache_full_blocks`` hashes blocks that became full once their tokens were computed.
* ``free`` drops the request's references, tail first, so chain tails are evicted first.
* ``hashes_computed_by`` / ``next_block_pending`` let a scheduler hold back a request whose
  next block another request is computing right now, without knowing how blocks are hashed.

The scheduler uses only these methods (and ``block_table``, ``num_blocks_of``,
``take_block_copies``, ``record_prefix_query`` and the usage figures): every hashing rule,
including "the last token is never a hit", lives here.
* ``fork`` lets a sibling sequence (parallel sampling) share a request's blocks by reference;
  a block is never written while shared: ``allocate_slots`` copies it first (copy on write)
  and queues the (src, dst) copy for the runner (``take_block_copies``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.prefix_cache import extend_block_hashes
from kvserve.kv.spec import cdiv


@dataclass(frozen=True)
class CachedPrefix:
    block_ids: list[int]
    num_tokens: int


NO_PREFIX = CachedPrefix([], 0)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        extra_key: bytes = b"",
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        self._block_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _full_block_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[bytes]:
        """Keys of the request's full blocks, memoized per request (extended as it grows,
        dropped by `free`)."""
        if not self.enable_caching:
            return []
        hashes = self._block_hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, token_ids, self.block_size, self.extra_key)
        return hashes

    def _max_cached_blocks(self, num_tokens: int) -> int:
        """A prefix hit never covers the last token: its logits are needed to sample."""
        return (num_tokens - 1) // self.block_size

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> CachedPrefix:
        """Longest cached run of full blocks starting at token 0, leaving >= 1 token to compute.
        Takes no references and changes no block (it memoizes the request's hashes)."""
        if not self.enable_caching:
            return NO_PREFIX
        max_blocks = self._max_cached_blocks(len(token_ids))
        block_ids: list[int] = []
        for block_hash in self._full_block_hashes(request_id, token_ids)[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return CachedPrefix(block_ids, len(block_ids) * self.block_size)

    def hashes_computed_by(
        self, request_id: str, token_ids: Sequence[int], start_token: int
    ) -> list[bytes]:
        """Keys of the full blocks a prefill from `start_token` on will compute and cache (none
        with caching off): a scheduler uses them to spot requests about to share a prefix."""
        return self._full_block_hashes(request_id, token_ids)[start_token // self.block_size :]

    def next_block_pending(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cached: CachedPrefix,
        pending: set[bytes],
    ) -> bool:
        """True when the request's first block after `cached` could be a hit and is among
        `pending` (being computed by another request this step): waiting one step turns its
        computation into a cache hit."""
        if not pending:
            return False
        index = len(cached.block_ids)
        if index >= self._max_cached_blocks(len(token_ids)):
            return False
        return self._full_block_hashes(request_id, token_ids)[index] in pending

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids, in token order."""
        return list(self.block_tables.get(request_id, ()))

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached: CachedPrefix = NO_PREFIX,
        reserve_blocks: int = 0,
    ) -> list[int] | None:
        """Grow the request's block table to hold num_computed_tokens + num_new_tokens tokens.

        `cached` (only when the request has no table yet) is a prefix from find_cached_prefix;
        its tokens are included in num_computed_tokens.  Returns the newly allocated block ids,
        or None, changing nothing, when the pool cannot supply them while keeping
        `reserve_blocks` free afterwards."""
        table = self.block_tables.get(request_id, [])
        assert not (table and cached.block_ids), "a cached prefix only applies to a new table"
        num_needed = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(table) - len(cached.block_ids))
        shared = self._shared_block_index(table, num_computed_tokens)
        num_copies = int(shared is not None)
        available = self.pool.num_free_after_touch(cached.block_ids)
        if num_new_blocks + num_copies + reserve_blocks > available:
            return None
        if cached.block_ids:
            self.pool.touch(cached.block_ids)
        if shared is not None:
            self._copy_on_write(table, shared)
        new_block_ids = self.pool.allocate(num_new_blocks)
        if request_id not in self.block_tables:
            self.block_tables[request_id] = table
            self._num_cached_blocks[request_id] = len(cached.block_ids)
        table.extend(cached.block_ids)
        table.extend(new_block_ids)
        return new_block_ids

    def _shared_block_index(self, table: list[int], num_computed_tokens: int) -> int | None:
        """Index in `table` of the block the next token goes into, if other tables share it."""
        index = num_computed_tokens // self.block_size
        if index < len(table) and self.pool.blocks[table[index]].ref_cnt > 1:
            return index
        return None

    def _copy_on_write(self, table: list[int], index: int) -> None:
        [private] = self.pool.allocate(1)
        self._block_copies.append((table[index], private))
        self.pool.free([table[index]])
        table[index] = private

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must do before this step's forward pass."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def fork(self, src_request_id: str, dst_request_id: str, num_tokens: int) -> None:
        """Give `dst` (no table yet) references to the blocks holding src's first `num_tokens`
        tokens.  Shared partial blocks are copied when either side next writes to them."""
        assert dst_request_id not in self.block_tables
        blocks = self.block_tables[src_request_id][: cdiv(num_tokens, self.block_size)]
        self.pool.touch(blocks)
        self.block_tables[dst_request_id] = list(blocks)
        num_cached = min(self._num_cached_blocks[src_request_id], num_tokens // self.block_size)
        self._num_cached_blocks[dst_request_id] = num_cached

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_stats.queries += num_prompt_tokens
            self.prefix_stats.hits += num_hit_tokens

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Hash and register the blocks whose tokens are now all computed."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_cached_blocks[request_id]
        if num_full <= start:
            return
        hashes = self._full_block_hashes(request_id, token_ids[: num_full * self.block_size])
        table = self.block_tables[request_id]
        for i in range(start, num_full):
            if self.pool.blocks[table[i]].block_hash is None:
                self.pool.cache(table[i], hashes[i])
        self._num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first) and forget its table and hashes."""
        table = self.block_tables.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.block_tables.get(request_id, ()))

    def check_invariants(self) -> None:
        """free + used = total; each block's ref count equals the tables that hold it."""
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for table in self.block_tables.values():
            assert len(set(table)) == len(table), "a table holds a block twice"
            for block_id in table:
                refs[block_id] = refs.get(block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), f"ref count of {block.block_id}"
        assert self.pool.num_free_blocks + len(refs) == self.pool.num_blocks
