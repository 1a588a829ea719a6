"""KVCacheManager: per-request block tables over one BlockPool; the only owner of blocks.

One request's tokens and blocks (block_size 4):

    tokens:  | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. .. |
    blocks:  |  b7 cached  |  b2 cached  |  b5 partial |
             [ cached prefix hit        ][ computed  ][ new ][ to allocate ]

* ``find_cached_prefix`` finds the longest run of cached full blocks at the start (never the
  whole sequence: the last token is always computed, its logits are needed).
* ``allocate_slots`` grows the table to hold ``num_computed + num_new`` tokens: all or nothing.
* ``cache_full_blocks`` caches blocks that became full once their tokens were computed.
* ``free`` drops the request's references, tail first, so chain tails are evicted first.
* ``blocks_computed_in_step`` / ``extend_with_in_flight`` let a request admitted in a step read
  the prefix blocks another request computes in that same step, without the scheduler
  knowing how blocks are hashed.

The scheduler uses only these methods (and ``block_table``, ``num_blocks_of``,
``take_block_copies``, ``record_prefix_query`` and the usage figures): every hashing rule,
including "the last token is never a hit", the cache salt and the public prefixes
(kv/block_hasher.py), lives here or in ``block_hasher``.  The methods that read block hashes
take the request itself (``HashedRequest``), whose hashes ``block_hasher`` made with its cache
salt when it entered the scheduler: none takes a salt, so no call site can forget one.

The prefix cache as a store (the engine's side): ``record_prefix_query`` classifies every
missed token (kv/miss_reasons.py); ``reset_prefix_cache`` drops every cached block no request
holds; ``take_events`` drains what was stored and removed (when events are on) and
``take_new_blocks`` the blocks cached since the last call (when persistence is on), both kept
by kv/cache_log.py; ``load_cold_blocks`` registers blocks read back from disk as
free-but-cached.
* With a host tier (``num_host_blocks``, --kv-offloading-size; kv/host_tier.py) an evicted
  cached block is copied to host memory instead of being lost, and ``find_cached_prefix``
  continues the device run with blocks found there: ``allocate_slots`` gives each a fresh
  device block, caches it again under its key and queues the host -> device copy
  (``take_host_transfers``, drained by the scheduler into the step's output).  Blocks on the
  disk tier below the host are read into host slots first (``fetch_disk_hits``, reported
  by ``finish_disk_reads``) while the request waits in the queue.
* KV cache groups (kv/groups.py): with layers of several attention kinds (sliding windows
  and full attention) a request has one table per group, all from the one pool; a window
  group frees the blocks that leave its window as the request grows, and a cached prefix
  counts only when every group has what it needs.  ``block_table`` is group 0's table,
  ``group_block_tables`` the others'.  The host tier and the block log (events, the store)
  serve a cache of one full-attention group (the engine refuses them otherwise).
* Eviction (kv/eviction.py, ``eviction``): ARC by default in the pool and the host tier, so
  that blocks reused since they were cached outlive one-off ones; ``free`` gives a request's
  blocks its retention priority (lower ones are evicted first).
* Admission (kv/admission.py, ``store_threshold``): an evicted block takes a full host
  tier's slot, and a host drop a full disk's, only once requests computed or hit it that many
  times (into free room it always goes).
* Pins (kv/pins.py): ``try_pin_prefix`` holds the full blocks of a cached prefix for good
  (up to ``max_pinned_blocks``); ``reset_prefix_cache`` keeps them unless ``include_pinned``.
* ``fork`` lets a sibling sequence (parallel sampling) share a request's blocks by reference;
  a block is never written while shared: ``allocate_slots`` copies it first (copy on write)
  and queues the (src, dst) copy for the runner (``take_block_copies``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.config import DEFAULT_RETENTION_PRIORITY
from kvserve.kv.admission import MAX_COUNTED_KEYS, ReuseAdmission
from kvserve.kv.block_hasher import BlockHasher, BlockHashes
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.cache_log import CacheLog, NewBlock
from kvserve.kv.disk_tier import DiskTier
from kvserve.kv.event_index import CacheIndex
from kvserve.kv.events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, KVEvent
from kvserve.kv.groups import (
    HOST_HIT,
    NULL_BLOCK,
    first_kept_block,
    group_key,
    hit_length,
    prefix_tables,
)
from kvserve.kv.host_tier import HostTier, HostTransfers
from kvserve.kv.miss_reasons import (
    EVICTED_TIERS,
    MISS_REASONS,
    TIER_DEVICE,
    TIER_DISK,
    TIER_HOST,
    MissClassifier,
)
from kvserve.kv.pins import Pin, PrefixPins
from kvserve.kv.spec import KVCacheGroup, blocks_kept, cdiv


class HashedRequest(Protocol):
    """What the cache manager reads of a request (kvserve.request.Request is one): its id,
    its tokens, and its block hashes, made by the manager's `block_hasher` (with the request's
    cache salt) and kept current with its tokens by the request's owner."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> BlockHashes | None: ...


@dataclass(frozen=True)
class CachedPrefix:
    """The longest cached prefix: device blocks first, then the keys of blocks that follow
    them in the host tier (loaded into fresh device blocks by allocate_slots), with their
    content hashes (for the miss classifier)."""

    block_ids: list[int]  # group 0's
    num_tokens: int  # of both tiers
    host_keys: tuple[bytes, ...] = ()
    host_contents: tuple[int, ...] = ()
    # The other groups' tables of the prefix (NULL_BLOCK before a window): one per group 1..
    other_groups: tuple[list[int], ...] = ()
    # With several groups or a window: the hits held by the host tier, (group, block index,
    # key), their table entries HOST_HIT until allocate_slots loads them.
    host_entries: tuple[tuple[int, int, bytes], ...] = ()
    num_disk_blocks: int = 0  # of host_keys, those the disk tier below the host supplies

    def tables(self, num_groups: int) -> list[list[int]]:
        """Every group's table of the prefix (empty ones without a hit)."""
        tables = [list(self.block_ids), *(list(t) for t in self.other_groups)]
        return tables + [[] for _ in range(num_groups - len(tables))]

    def held_block_ids(self) -> list[int]:
        """The device blocks the prefix holds, every group's."""
        return [b for t in (self.block_ids, *self.other_groups) for b in t if b >= 0]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + len(self.host_keys)

    @property
    def num_host_tokens(self) -> int:
        """Tokens of the prefix that the host tier supplies (group 0's count)."""
        if self.host_entries:
            num_host = sum(1 for group, _, _ in self.host_entries if group == 0)
            return self.num_tokens * num_host // len(self.block_ids)
        return self.num_tokens * len(self.host_keys) // self.num_blocks if self.host_keys else 0

    @property
    def num_disk_tokens(self) -> int:
        """Tokens of the prefix that the disk tier supplies (part of num_host_tokens)."""
        return (
            self.num_tokens * self.num_disk_blocks // self.num_blocks if self.num_disk_blocks else 0
        )


NO_PREFIX = CachedPrefix([], 0)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached (in either tier)
    host_hits: int = 0  # of the hits, those loaded from the host tier (or the disk below it)
    disk_hits: int = 0  # of the host tier's, those read from the disk tier
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    # misses["evicted"] by the tier the blocks last fell out of (device, host, disk)
    evicted_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTED_TIERS, 0))


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        extra_key: bytes = b"",
        public_prefixes: Sequence[Sequence[int]] = (),
        enable_events: bool = False,
        track_new_blocks: bool = False,
        num_host_blocks: int = 0,
        report_cross_salt_misses: bool = False,
        groups: Sequence[KVCacheGroup] = (),
        num_disk_blocks: int = 0,
        disk_keys: Sequence[bytes] = (),
        disk_probe: Callable[[bytes], bool] | None = None,
        event_index: CacheIndex | None = None,
        eviction: str = "arc",
        max_pinned_blocks: int = 0,
        store_threshold: int = 1,
    ) -> None:
        """`extra_key` is the namespace of every block key (the KV dtype); `public_prefixes`
        token-id prefixes whose blocks are shared across cache salts (both go to
        `block_hasher`, which makes every request's block hashes); `num_host_blocks` the
        slots of the host tier (0: none); `report_cross_salt_misses` counts a miss of tokens
        cached under another salt as `isolated` (kv/miss_reasons.py: off, tenants learn
        nothing of each other); `groups` the KV cache groups (kv/spec.py; none: one group of
        full attention); `event_index` the index that events update (with events on; None: a
        new one, `event_index` of this manager), which a subscriber's snapshot reads;
        `eviction` the policy of both tiers (kv/eviction.py); `max_pinned_blocks` the cap of
        pinned blocks (kv/pins.py); `num_disk_blocks` the disk tier's capacity below the
        host tier (--kv-offloading-dir; 0: none), `disk_keys` the keys its folder holds
        and `disk_probe` whether it holds one now;
        `store_threshold` the times a block must be computed or hit before it is stored in
        the tier below (kv/admission.py; 1: every evicted block)."""
        self.block_size = block_size
        self.windows = tuple(g.window for g in groups) or (0,)
        # One full-attention group: the prefix search as it always was, with the host tier.
        self._one_full_group = self.windows == (0,)
        self.enable_caching = enable_caching
        self.block_hasher = BlockHasher(block_size, extra_key, public_prefixes, enable_caching)
        self.pool = BlockPool(num_blocks, on_evict=self._on_evict, eviction=eviction)
        self.pins = PrefixPins(self.pool, max_pinned_blocks)
        self._tables: dict[str, list[list[int]]] = {}  # request id -> a table per group
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        self._block_copies: list[tuple[int, int]] = []
        self._misses = MissClassifier(num_blocks, report_cross_salt_misses)
        self._log = CacheLog(block_size, enable_events, track_new_blocks, event_index)
        self.event_index = self._log.index
        disk = (
            DiskTier(num_disk_blocks, disk_keys, disk_probe)
            if num_disk_blocks and num_host_blocks else None
        )  # fmt: skip
        self.admission = ReuseAdmission(
            store_threshold, min(MAX_COUNTED_KEYS, 4 * (num_blocks + num_host_blocks) + 1024)
        )
        self.host = (
            HostTier(num_host_blocks, eviction, disk, self.admission.admits)
            if num_host_blocks and enable_caching else None
        )  # fmt: skip

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Each request's group-0 table (read-only view for tests and statistics)."""
        return {request_id: tables[0] for request_id, tables in self._tables.items()}

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _hashes(self, request: HashedRequest) -> BlockHashes:
        """The request's block hashes (with caching on): made by this manager's block_hasher
        and covering every full block of its tokens.  A request without them is a bug of the
        caller (AssertionError), never a request keyed without its salt."""
        hashes = request.block_hashes
        assert hashes is not None and hashes.hasher is self.block_hasher, (
            f"request {request.request_id!r} has no block hashes of this cache manager "
            "(request.hash_blocks_with(cache_manager.block_hasher))"
        )
        assert len(hashes.keys) == len(request.all_token_ids) // self.block_size
        return hashes

    def _full_block_keys(self, request: HashedRequest) -> list[bytes]:
        """Keys of the request's full blocks (none with caching off)."""
        if not self.enable_caching:
            return []
        return self._hashes(request).keys

    def _max_cached_blocks(self, num_tokens: int) -> int:
        """A prefix hit never covers the last token: its logits are needed to sample."""
        return (num_tokens - 1) // self.block_size

    def find_cached_prefix(self, request: HashedRequest) -> CachedPrefix:
        """Longest cached run of full blocks starting at token 0, leaving >= 1 token to compute.
        Takes no references and changes no block."""
        if not self.enable_caching:
            return NO_PREFIX
        hashes = self._hashes(request)
        max_blocks = self._max_cached_blocks(len(request.all_token_ids))
        keys = hashes.keys[:max_blocks]
        if not self._one_full_group:
            return self._prefix_of_groups(keys, {})
        block_ids: list[int] = []
        for block_hash in keys:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        num_device = len(block_ids)
        host_keys = self._host_run(keys[num_device:])
        host_contents = tuple(hashes.contents[num_device : num_device + len(host_keys)])
        num_tokens = (num_device + len(host_keys)) * self.block_size
        num_disk = sum(1 for key in host_keys if self._from_disk(key)) if host_keys else 0
        return CachedPrefix(block_ids, num_tokens, host_keys, host_contents,
                            num_disk_blocks=num_disk)  # fmt: skip

    def _from_disk(self, key: bytes) -> bool:
        """Whether a host-tier hit of `key` is the disk tier's: on disk only, being read, or
        read and not loaded since (counted as a disk hit when the request is admitted)."""
        assert self.host is not None
        return key not in self.host or self.host.came_from_disk(key)

    def fetch_disk_hits(self, cached: CachedPrefix) -> CachedPrefix | None:
        """Start the reads of `cached`'s blocks that are on disk only (into reserved host
        slots, by the runner's reader thread).  None while any of its blocks is still on its
        way: the request waits in the queue (others run) until `finish_disk_reads` reports
        them.  Else the prefix, all in the host tier (cut before a block whose read found
        no free slot: those tokens are computed)."""
        host = self.host
        if host is None or host.disk is None or not cached.host_keys:
            return cached
        host.pin([key for key in cached.host_keys if key in host])  # not dropped by the reads
        host.disk.touch(key for key in cached.host_keys if key not in host)
        pending = False
        for index, key in enumerate(cached.host_keys):
            if key in host or host.is_reading(key):
                pending = pending or key not in host
                continue
            # a read's drop to a full disk may have deleted this file: the rest is computed
            if key not in host.disk or not self._start_read(key):
                return None if pending else self._cut_prefix(cached, index)
            pending = True
        return None if pending else cached

    def _start_read(self, key: bytes) -> bool:
        """Queue the disk read of `key` (False: no host slot for it), with its events and
        the misses of what it pushes out of the host tier."""
        assert self.host is not None
        dropped = self.host.start_read(key)
        if dropped is None:
            return False
        self._log_disk_changes()
        self._log.removed(dropped, MEDIUM_CPU)
        self._record_host_drops(dropped)
        return True

    def _cut_prefix(self, cached: CachedPrefix, num_host: int) -> CachedPrefix:
        """`cached` with only its first `num_host` host-tier blocks."""
        keys = cached.host_keys[:num_host]
        num_disk = sum(1 for key in keys if self._from_disk(key))
        return CachedPrefix(cached.block_ids, (len(cached.block_ids) + num_host) * self.block_size,
                            keys, cached.host_contents[:num_host],
                            num_disk_blocks=num_disk)  # fmt: skip

    def finish_disk_reads(self, done: Sequence[bytes], failed: Sequence[bytes]) -> None:
        """The runner's report of the disk reads that landed in their host slots (`done`)
        and those that found their file gone or corrupt (`failed`: the disk tier forgets
        them; a request waiting for one computes those tokens)."""
        host = self.host
        if host is None:
            return
        for key in done:
            if host.finish_read(key, True):
                self._log.copied([key], MEDIUM_DISK, MEDIUM_CPU)
        for key in failed:
            held = host.disk is not None and key in host.disk
            host.finish_read(key, False)
            if held:
                self._log.removed([key], MEDIUM_DISK)
            if self.pool.lookup(key) is None and not host.holds(key):
                self._misses.record_removed(key, TIER_DISK)

    def _prefix_of_groups(self, keys: Sequence[bytes], in_flight: dict[bytes, int]) -> CachedPrefix:
        """The longest prefix of `keys` that every group holds, in the pool or among the
        blocks computed in this step (`in_flight`), with each group's table of it."""

        host = self.host

        def lookup(group: int, index: int) -> int | None:
            key = group_key(keys[index], group)
            block_id = self.pool.lookup(key)
            if block_id is None:
                block_id = in_flight.get(key)
            if block_id is None and host is not None and key in host:
                return HOST_HIT
            return block_id

        num_blocks = hit_length(self.windows, len(keys), self.block_size, lookup)
        if not num_blocks:
            return NO_PREFIX
        tables = prefix_tables(self.windows, num_blocks, self.block_size, lookup)
        host_entries = tuple(
            (group, index, group_key(keys[index], group))
            for group, table in enumerate(tables)
            for index, block_id in enumerate(table)
            if block_id == HOST_HIT
        )
        return CachedPrefix(tables[0], num_blocks * self.block_size,
                            other_groups=tuple(tables[1:]), host_entries=host_entries)  # fmt: skip

    def _host_run(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """The leading keys held by the host tier or the disk below it (and not on the device:
        a block after a host hit may still be cached on the device, but the run goes on
        through the host), at most as many as the host has unpinned slots: each is pinned
        while it is loaded, a disk hit read into a slot of its own (a key pinned or being
        read holds its slot already)."""
        host = self.host
        if host is None:
            return ()
        run = []
        num_slots = host.num_unpinned_slots
        for key in keys:
            if self.pool.lookup(key) is not None or not host.finds(key):
                break
            if not host.is_pinned(key) and not host.is_reading(key):
                if num_slots == 0:
                    break
                num_slots -= 1
            run.append(key)
        return tuple(run)

    def blocks_computed_in_step(
        self, request: HashedRequest, start_token: int, num_tokens: int
    ) -> dict[bytes, int]:
        """Key -> block id of the full blocks that computing tokens [start_token, start_token +
        num_tokens) of an allocated request completes (none with caching off): another request
        admitted in the same step may read them (extend_with_in_flight)."""
        keys = self._full_block_keys(request)
        first, end = start_token // self.block_size, (start_token + num_tokens) // self.block_size
        computed = {}
        for group, table in enumerate(self._tables[request.request_id]):
            for i in range(first, min(end, len(keys))):
                computed[group_key(keys[i], group)] = table[i]
        return computed

    def extend_with_in_flight(
        self, request: HashedRequest, cached: CachedPrefix, in_flight: dict[bytes, int]
    ) -> CachedPrefix:
        """`cached` continued by the blocks that other requests compute in this very step
        (blocks_computed_in_step): the request then computes only what follows them.  This is
        sound because every layer writes all of a step's K/V before any of its attention reads,
        so the prefix is in place by the time the request's own tokens attend to it (many
        requests with one system prompt arriving together share it from the first step)."""
        if not in_flight or cached.host_keys:
            return cached
        keys = self._full_block_keys(request)
        limit = self._max_cached_blocks(len(request.all_token_ids))
        if not self._one_full_group:
            extended = self._prefix_of_groups(keys[:limit], in_flight)
            return extended if extended.num_tokens > cached.num_tokens else cached
        extra: list[int] = []
        for key in keys[len(cached.block_ids) : limit]:
            if key not in in_flight:
                break
            extra.append(in_flight[key])
        if not extra:
            return cached
        block_ids = cached.block_ids + extra
        return CachedPrefix(block_ids, len(block_ids) * self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids (group 0's), in token order."""
        tables = self._tables.get(request_id)
        return list(tables[0]) if tables else []

    def group_block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """Copies of the request's tables of groups 1.. (NULL_BLOCK for a block a window
        freed); empty with one group."""
        tables = self._tables.get(request_id)
        return tuple(list(t) for t in tables[1:]) if tables else ()

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds at most, every group's."""
        return sum(blocks_kept(w, num_tokens, self.block_size) for w in self.windows)

    def chunk_limit(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """`num_new_tokens`, or fewer where computing that many at once would hold more blocks
        than the pool has: a window group holds every block of a chunk until the next step
        frees those that left its window, so a long chunk can need more than the whole
        sequence does (without this a request could wait forever)."""
        while num_new_tokens > self.block_size and (
            self._peak_blocks(num_computed_tokens, num_new_tokens) > self.pool.num_blocks
        ):
            num_new_tokens //= 2
        return num_new_tokens

    def _peak_blocks(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        end = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        return sum(
            end - first_kept_block(w, num_computed_tokens, self.block_size) for w in self.windows
        )

    def tokens_held(self, request_id: str, num_computed_tokens: int) -> int:
        """Computed tokens the request's blocks hold, summed over groups (a window group's
        freed blocks hold none): the numerator of the KV waste figure."""
        tables = self._tables.get(request_id, ())
        freed = sum(t.count(NULL_BLOCK) for t in tables)
        return max(0, num_computed_tokens * len(tables) - freed * self.block_size)

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
        its tokens are included in num_computed_tokens.  Returns the newly allocated block ids
        (every group's), or None when the pool cannot supply them while keeping
        `reserve_blocks` free afterwards: then nothing changed but the release of blocks that
        left a window group's window (never read again)."""
        tables = self._tables.get(request_id)
        assert tables is None or not cached.num_blocks, "a cached prefix applies to a new table"
        if tables is not None:
            self._free_out_of_window(tables, num_computed_tokens)
        grown = tables if tables is not None else cached.tables(self.num_groups)
        num_needed = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        # One full group's host hits follow its table; the groups' are in their tables already.
        num_host = len(cached.host_keys) + len(cached.host_entries)
        num_new_blocks = [max(0, num_needed - len(t) - (len(cached.host_keys) if g == 0 else 0))
                          for g, t in enumerate(grown)]  # fmt: skip
        shared = [self._shared_block_index(t, num_computed_tokens) for t in grown]
        num_copies = sum(index is not None for index in shared)
        held = cached.held_block_ids()
        available = self.pool.num_free_after_touch(held)
        if num_host + sum(num_new_blocks) + num_copies + reserve_blocks > available:
            return None
        if held:
            self.pool.touch(held)
        for table, index in zip(grown, shared, strict=True):
            if index is not None:
                self._copy_on_write(table, index)
        loaded = self._load_from_host(cached)
        grown[0].extend(loaded)
        new_block_ids = loaded + self._load_group_hits(cached, grown)
        for table, num in zip(grown, num_new_blocks, strict=True):
            allocated = self.pool.allocate(num)
            table.extend(allocated)
            new_block_ids.extend(allocated)
        if tables is None:
            self._tables[request_id] = grown
            self._num_cached_blocks[request_id] = cached.num_blocks
        return new_block_ids

    def _free_out_of_window(self, tables: list[list[int]], num_computed_tokens: int) -> None:
        """Free each window group's blocks that no token from `num_computed_tokens` on reads
        (always safe: the request never reads them again), newest first."""
        for window, table in zip(self.windows, tables, strict=True):
            index = min(first_kept_block(window, num_computed_tokens, self.block_size),
                        len(table)) - 1  # fmt: skip
            freed = []
            while index >= 0 and table[index] != NULL_BLOCK:
                freed.append(table[index])
                table[index] = NULL_BLOCK
                index -= 1
            if freed:
                self.pool.free(freed)

    def _load_from_host(self, cached: CachedPrefix) -> list[int]:
        """Fresh device blocks for the host-tier hits of `cached`, cached again under their
        keys, each with its host -> device copy queued.  The slots are pinned first: the
        allocation may evict device blocks, whose offloads must not take these slots."""
        keys = list(cached.host_keys)
        if not keys:
            return []
        assert self.host is not None
        assert all(key in self.host for key in keys), "fetch_disk_hits first"
        self.host.pin(keys)
        block_ids = self.pool.allocate(len(keys))
        for key, block_id in zip(keys, block_ids, strict=True):
            stored = self.pool.cache(block_id, key)
            assert stored, "a host-tier hit was cached on the device meanwhile"
            self.host.load(key, block_id)
        self._log.copied(keys, MEDIUM_CPU, MEDIUM_GPU)
        self._misses.record_cached(cached.host_contents, keys)
        return block_ids

    def _load_group_hits(self, cached: CachedPrefix, tables: list[list[int]]) -> list[int]:
        """_load_from_host for the groups' hits: each HOST_HIT entry of `tables` becomes a
        fresh device block, cached again under its key, its copy queued."""
        entries = cached.host_entries
        if not entries:
            return []
        assert self.host is not None
        self.host.pin([key for _, _, key in entries])
        block_ids = self.pool.allocate(len(entries))
        for (group, index, key), block_id in zip(entries, block_ids, strict=True):
            stored = self.pool.cache(block_id, key)
            assert stored, "a host-tier hit was cached on the device meanwhile"
            self.host.load(key, block_id)
            tables[group][index] = block_id
        return block_ids

    def _shared_block_index(self, table: list[int], num_computed_tokens: int) -> int | None:
        """Index in `table` of the block the next token goes into, if other tables share it."""
        index = num_computed_tokens // self.block_size
        if index < len(table) and table[index] >= 0 and self.pool.blocks[table[index]].ref_cnt > 1:
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

    def take_host_transfers(self) -> HostTransfers:
        """The host tier's (device block, host slot) copies for this step: offloads, then
        loads, both before the CoW copies and the forward pass (none without a host tier)."""
        return self.host.take_transfers() if self.host is not None else HostTransfers()

    def fork(self, src_request_id: str, dst_request_id: str, num_tokens: int) -> None:
        """Give `dst` (no table yet) references to the blocks holding src's first `num_tokens`
        tokens.  Shared partial blocks are copied when either side next writes to them."""
        assert dst_request_id not in self._tables
        num_blocks = cdiv(num_tokens, self.block_size)
        tables = [list(t[:num_blocks]) for t in self._tables[src_request_id]]
        self.pool.touch(b for t in tables for b in t if b != NULL_BLOCK)
        self._tables[dst_request_id] = tables
        num_cached = min(self._num_cached_blocks[src_request_id], num_tokens // self.block_size)
        self._num_cached_blocks[dst_request_id] = num_cached

    def record_prefix_query(
        self,
        request: HashedRequest,
        num_hit_tokens: int,
        num_host_hit_tokens: int = 0,
        num_disk_hit_tokens: int = 0,
    ) -> None:
        """Count one lookup of all the request's tokens (`find_cached_prefix`), the hits of
        each tier (`num_hit_tokens` counts all, `num_host_hit_tokens` the host tier's with the
        disk's, `num_disk_hit_tokens` the disk tier's) and the reason of every token it
        missed."""
        if not self.enable_caching:
            return
        num_tokens = len(request.all_token_ids)
        stats = self.prefix_stats
        stats.queries += num_tokens
        stats.hits += num_hit_tokens
        stats.host_hits += num_host_hit_tokens
        stats.disk_hits += num_disk_hit_tokens
        hashes = self._hashes(request)
        self.admission.see(hashes.keys[: num_hit_tokens // self.block_size])
        misses = self._misses.classify(
            hashes.contents, hashes.keys, num_tokens, num_hit_tokens, self.block_size,
            _EitherTier(self.pool.cached_keys, self.host),
        )  # fmt: skip
        for reason, num in misses.by_reason.items():
            stats.misses[reason] += num
        for tier, num in misses.evicted_by_tier.items():
            stats.evicted_by_tier[tier] += num

    def cache_full_blocks(self, request: HashedRequest, num_computed_tokens: int) -> None:
        """Register under their keys the blocks whose tokens are now all computed."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_full = num_computed_tokens // self.block_size
        start = self._num_cached_blocks[request_id]
        if num_full <= start:
            return
        hashes = self._hashes(request)
        tables = self._tables[request_id]
        table = tables[0]
        self.admission.see(hashes.keys[start:num_full])
        stored: list[int] = []  # indices of group 0's blocks this call cached
        for i in range(start, num_full):
            if self._cache_block(table[i], hashes.keys[i]):
                stored.append(i)
        for group, other in enumerate(tables[1:], start=1):
            self._cache_group_blocks(request, group, other, start, num_full)
        self._num_cached_blocks[request_id] = num_full
        if stored:
            self._misses.record_cached(
                [hashes.contents[i] for i in stored], [hashes.keys[i] for i in stored]
            )
        if stored and self._log.active:
            self._log.stored(
                stored, hashes.keys, hashes.contents, request.all_token_ids, table,
                hashes.num_unsalted,
            )  # fmt: skip

    def _cache_group_blocks(
        self, request: HashedRequest, group: int, table: list[int], start: int, end: int
    ) -> None:
        """cache_full_blocks for a group after the first: its own keys, and the blocks to
        persist (no events, no miss statistics: those follow group 0)."""
        hashes = self._hashes(request)
        first = max(0, start - 1)  # a block's parent is logged with it
        keys = [b""] * first + [group_key(key, group) for key in hashes.keys[first:end]]
        stored = [i for i in range(start, end) if self._cache_block(table[i], keys[i])]
        if stored and self._log.active:
            self._log.stored_in_group(stored, keys, hashes.contents, request.all_token_ids, table)

    def _cache_block(self, block_id: int, key: bytes) -> bool:
        """Register a computed block under its key (False: freed already, hashed already, or
        its content cached in another block)."""
        if block_id == NULL_BLOCK or self.pool.blocks[block_id].block_hash is not None:
            return False
        return self.pool.cache(block_id, key)

    def _on_evict(self, block_id: int, key: bytes, reused: bool, priority: int) -> None:
        """The pool evicted a cached block to make room: its content moves to the host tier
        when there is one with a slot to spare and admission lets it (a free slot, a key
        seen often enough to displace another, or one held there already), else it is gone
        (an `evicted` miss of the device later)."""
        host = self.host
        held = host is not None and key in host
        kept, dropped = False, []
        if host is not None and (held or not host.is_full or self.admission.admits(key)):
            kept, dropped = host.offload(block_id, key, reused, priority)
        self._log_disk_changes()
        self._log.removed(dropped, MEDIUM_CPU)
        if kept and not held:
            self._log.copied([key], MEDIUM_GPU, MEDIUM_CPU)  # announced there, then gone here
        self._log.evicted(key)
        if not kept and (host is None or not host.holds(key)):
            self._misses.record_removed(key, TIER_DEVICE)
        self._record_host_drops(dropped)

    def _record_host_drops(self, dropped: Sequence[bytes]) -> None:
        """Keys the host tier dropped: gone (an `evicted` miss of the host later) unless the
        device caches them or the disk took them."""
        host = self.host
        for old in dropped:
            assert host is not None
            if self.pool.lookup(old) is None and not host.holds(old):
                self._misses.record_removed(old, TIER_HOST)

    def _log_disk_changes(self) -> None:
        """KV events of the disk tier: blocks the host dropped there (announced as the host
        held them), files its capacity deleted."""
        if self.host is None or self.host.disk is None:
            return
        stored, deleted = self.host.take_disk_changes()
        self._log.copied(stored, MEDIUM_CPU, MEDIUM_DISK)
        self._log.removed(deleted, MEDIUM_DISK)
        for key in deleted:  # its file is gone: a miss of the disk unless a tier above has it
            if self.pool.lookup(key) is None and key not in self.host:
                self._misses.record_removed(key, TIER_DISK)

    def reset_prefix_cache(self, include_pinned: bool = False) -> int:
        """Drop every cached block that no request holds (blocks in use stay cached, pinned
        ones too unless `include_pinned`, which unpins them first); returns how many were
        dropped.  Later lookups of their content count as `evicted` misses."""
        if include_pinned:
            self.pins.unpin_all()
        dropped = self.pool.drop_free_cached()
        host_keys = self.host.clear() if self.host is not None else []
        disk_keys = self.host.clear_disk() if self.host is not None else []
        # each key's miss is the lowest tier's that held it: recorded top down, the last wins
        for keys, tier in ((dropped, TIER_DEVICE), (host_keys, TIER_HOST), (disk_keys, TIER_DISK)):
            for key in keys:
                if self.pool.lookup(key) is None:
                    self._misses.record_removed(key, tier)
        if self.pool.num_cached_blocks == 0 and (dropped or host_keys or disk_keys):
            self._log.cleared()  # the host tier is emptied whole: no tier holds a block
        else:
            self._log.removed(dropped, MEDIUM_GPU)
            self._log.removed(host_keys, MEDIUM_CPU)
            self._log.removed(disk_keys, MEDIUM_DISK)
        return len(dropped)

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call (always empty when events are off)."""
        return self._log.take_events()

    def take_new_blocks(self) -> list[NewBlock]:
        """Blocks cached since the last call that still hold that content (with
        track_new_blocks; else always empty)."""
        blocks = self.pool.blocks
        return [b for b in self._log.take_new_blocks() if blocks[b.block_id].block_hash == b.key]

    def load_cold_blocks(self, keys: Sequence[bytes], contents: Sequence[int]) -> list[int]:
        """Register blocks read back from a store as cached but free (the next to evict are
        the first given).  Returns a block id per key, -1 for a key already cached; the caller
        copies the K/V into those blocks before the next step.  Never evicts: stops when no
        uncached free block is left (the remaining keys get -1)."""
        block_ids = []
        pool = self.pool
        for key, content in zip(keys, contents, strict=True):
            if pool.lookup(key) is not None or not pool.can_allocate_without_evicting(1):
                block_ids.append(-1)
                continue
            [block_id] = pool.allocate(1)
            pool.cache(block_id, key)
            pool.free([block_id])
            self._misses.record_cached([content], [key])
            block_ids.append(block_id)
        return block_ids

    def stored_prefix_keys(
        self, request: HashedRequest, stored: Container[bytes]
    ) -> list[tuple[int, bytes]]:
        """(block index, key) of each block of `request`'s prefix that no tier holds but
        `stored` (the prefix store's index) does, in order: what reading them back would add
        to its cached prefix.  The walk stops at the first block of the first group that
        neither holds; a later group's block missing too is only not read."""
        if not self.enable_caching:
            return []
        hashes = self._hashes(request)
        keys = hashes.keys[: self._max_cached_blocks(len(request.all_token_ids))]
        host, found = self.host, []
        for index, key in enumerate(keys):
            for group in range(self.num_groups):
                block_key = group_key(key, group)
                if self.pool.lookup(block_key) is not None or (
                    host is not None and host.holds(block_key)
                ):
                    continue
                if block_key in stored:
                    found.append((index, block_key))
                elif group == 0:
                    return found
        return found

    def cache_stored_blocks(
        self, request: HashedRequest, found: Sequence[tuple[int, bytes]], contents: Sequence[int]
    ) -> list[int]:
        """Give blocks read back from the store (`found`: stored_prefix_keys's, with their
        content hashes) a device block each, cached under its key and free, so that
        `request`'s lookup finds them: the least valuable free blocks are evicted for them,
        never one of `request`'s own cached blocks.  Returns their block ids (fewer when the
        free blocks run out: the first ones get blocks); the caller copies their K/V in
        before the next step, after the tier copies that the evictions queued."""
        if not found:
            return []
        hashes = self._hashes(request)
        # The request's own free cached blocks, in prefix order (freed back tail first, so
        # its later blocks stay the first of them to evict).
        own = (
            self.pool.lookup(group_key(k, g)) for k in hashes.keys for g in range(self.num_groups)
        )
        held = [b for b in own if b is not None and self.pool.blocks[b].ref_cnt == 0]
        self.pool.touch(held)  # out of the free queue while the others are allocated
        try:
            block_ids = self.pool.allocate(min(len(found), self.pool.num_free_blocks))
        finally:
            self.pool.free(reversed(held))
        for (_, key), block_id in zip(found, block_ids, strict=False):
            self.pool.cache(block_id, key)
        self.pool.free(reversed(block_ids))
        loaded = found[: len(block_ids)]
        self._misses.record_cached(contents[: len(block_ids)], [key for _, key in loaded])
        if self._log.active:  # group 0's blocks, as if computed now (kv events)
            pairs = zip(loaded, block_ids, strict=True)
            table = {i: b for (i, k), b in pairs if k == hashes.keys[i]}
            if table:
                ids = [table.get(i, -1) for i in range(max(table) + 1)]
                self._log.stored(sorted(table), hashes.keys, hashes.contents,
                                 request.all_token_ids, ids, hashes.num_unsalted)  # fmt: skip
        return block_ids

    def note_isolated(self, contents: Sequence[int], keys: Sequence[bytes]) -> None:
        """Tell the miss classifier that these contents were cached under these keys (another
        KV dtype's store), so that missing them counts as `isolated`."""
        self._misses.record_foreign(contents, keys)

    def free(self, request_id: str, retention_priority: int = DEFAULT_RETENTION_PRIORITY) -> None:
        """Release the request's blocks (tail first, at its `retention_priority`: lower ones
        are evicted first) and forget its table."""
        tables = self._tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        for table in tables or ():
            self.pool.free((b for b in reversed(table) if b != NULL_BLOCK), retention_priority)

    def pinnable_keys(self, hashes: BlockHashes) -> list[bytes]:
        """The keys of the full blocks that `hashes` (block_hasher.for_request, extended with
        a prefix's tokens) cover: what a request with those tokens would look up.  ValueError
        with caching off or several groups."""
        if not self.enable_caching or not self._one_full_group:
            raise ValueError("pinning needs prefix caching and one full-attention KV group")
        return list(hashes.keys)

    def try_pin_prefix(self, pin_id: str, hashes: BlockHashes) -> Pin | None:
        """Pin the cached full blocks that `hashes` cover (kv/pins.py); None when some are
        not cached on the device (compute the prefix, then try again).  PinLimitError past
        the cap, ValueError for an id in use or a cache that cannot pin."""
        return self.pins.try_pin(pin_id, self.pinnable_keys(hashes), self.block_size)

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds, every group's."""
        tables = self._tables.get(request_id, ())
        return sum(len(t) - t.count(NULL_BLOCK) for t in tables)

    def check_invariants(self) -> None:
        """free + used = total; each block's ref count equals the tables that hold it."""
        self.pool.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
        refs: dict[int, int] = dict(self.pins.references())
        for tables in self._tables.values():
            held = [b for t in tables for b in t if b != NULL_BLOCK]
            assert len(set(held)) == len(held), "a request holds a block twice"
            for block_id in held:
                refs[block_id] = refs.get(block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), f"ref count of {block.block_id}"
        assert self.pool.num_free_blocks + len(refs) == self.pool.num_blocks
        assert self.pins.num_pinned_blocks <= max(self.pins.max_blocks, 0)


class _EitherTier:
    """`key in tiers`: cached on the device or held by the host tier (a miss classifier's
    view of what is cached)."""

    def __init__(self, device: Container[bytes], host: HostTier | None) -> None:
        self._device = device
        self._host = host

    def __contains__(self, key: object) -> bool:
        return key in self._device or (self._host is not None and self._host.holds(key))
