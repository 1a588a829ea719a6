"""BlockPool: the physical KV blocks, their reference counts, free queues and the hash map.

Pure Python.  A block is *free* when no request references it (ref_cnt == 0).  Free blocks
live in one of two queues:

    free_uncached: blocks holding nothing reusable (never used, or freed without a hash)
    free_cached:   blocks whose full content is hashed, in a kv/eviction.py policy (ARC by
                   default: blocks reused since they were cached outlive one-off ones; LRU
                   with --prefix-cache-eviction lru), lowest retention priority first

Allocation takes uncached blocks first and only then evicts the policy's victim (dropping its
hash), so the prefix cache keeps as much as memory allows.  A block is *reused* once a hit
takes a reference to it (`touch`), or when its content is cached again soon after an
eviction (an ARC ghost hit); `free` gives it the retention priority of its last holder.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from kvserve.config import DEFAULT_RETENTION_PRIORITY
from kvserve.kv.eviction import PrioritizedEviction


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    reused: bool = False  # a hit took a reference since it was cached


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        on_evict: Callable[[int, bytes, bool, int], None] | None = None,
        eviction: str = "arc",
    ) -> None:
        """`on_evict(block_id, block_hash, reused, retention_priority)` is called for every
        cached block evicted to make room, before the block is handed out (its content is
        still intact); `eviction` names the policy (kv/eviction.py)."""
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached = PrioritizedEviction(eviction, num_blocks)
        self._hash_to_block: dict[bytes, int] = {}
        self.num_evictions = 0
        self._on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_holding_blocks(self) -> int:
        """Blocks holding K/V worth keeping: used by a request, or free but cached."""
        return self.num_blocks - len(self._free_uncached)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by requests (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this content, if cached."""
        return self._hash_to_block.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref_cnt becomes 1).  Raises if there are too few."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"need {num_blocks} blocks, have {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block_id, _ = self._free_uncached.popitem(last=False)
            else:
                block_id, priority = self._free_cached.pop()
                self._evict(block_id, priority)
            self.blocks[block_id].ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def _evict(self, block_id: int, retention_priority: int) -> None:
        block = self.blocks[block_id]
        block_hash = block.block_hash
        assert block_hash is not None
        del self._hash_to_block[block_hash]
        block.block_hash = None
        reused, block.reused = block.reused, False
        self.num_evictions += 1
        if self._on_evict is not None:
            self._on_evict(block_id, block_hash, reused, retention_priority)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit: a cached block becomes
        reused); revives free ones."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._free_cached.remove(block_id)
                self._free_uncached.pop(block_id, None)
            if block.block_hash is not None:
                block.reused = True
            block.ref_cnt += 1

    def free(
        self, block_ids: Iterable[int], retention_priority: int = DEFAULT_RETENTION_PRIORITY
    ) -> None:
        """Drop one reference on each block, in the given order.  Blocks reaching zero join the
        tail of their free queue (so callers free a chain tail-first to have tails evicted
        first), cached ones at `retention_priority`.  Raises on a double free."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self._free_uncached[block_id] = None
            else:
                self._free_cached.push(block_id, block.block_hash, block.reused, retention_priority)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, referenced block under its content hash.  Returns False (and leaves
        the block unhashed) when another block already holds that content."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.block_hash is None
        if block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        block.reused = self._free_cached.note_cached(block_hash)
        self._hash_to_block[block_hash] = block_id
        return True

    def drop_free_cached(self) -> list[bytes]:
        """Forget the content of every cached block no request holds (a prefix cache reset);
        blocks in use keep theirs.  Returns the dropped hashes, least recently used first."""
        dropped = []
        for block_id in self._free_cached:
            block = self.blocks[block_id]
            assert block.block_hash is not None
            del self._hash_to_block[block.block_hash]
            dropped.append(block.block_hash)
            block.block_hash = None
            block.reused = False
            self._free_uncached[block_id] = None
        self._free_cached.clear()
        return dropped

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    @property
    def cached_keys(self) -> Container[bytes]:
        """The hashes cached now (a read-only view: `key in pool.cached_keys`)."""
        return self._hash_to_block.keys()

    def can_allocate_without_evicting(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks that hold no cached content are free."""
        return len(self._free_uncached) >= num_blocks

    def num_free_after_touch(self, block_ids: Iterable[int]) -> int:
        """Free blocks left once `block_ids` are touched (free cached hits stop being free)."""
        return self.num_free_blocks - sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    def check_invariants(self) -> None:
        free = set(self._free_uncached) | set(self._free_cached)
        assert len(free) == len(self._free_uncached) + len(self._free_cached), "block in 2 queues"
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in free), f"block {block.block_id}"
            if block.block_id in self._free_cached:
                assert block.block_hash is not None
            if block.block_hash is not None:
                assert self._hash_to_block[block.block_hash] == block.block_id
            else:
                assert not block.reused, f"uncached block {block.block_id} marked reused"
        assert len(self._hash_to_block) == sum(b.block_hash is not None for b in self.blocks)
