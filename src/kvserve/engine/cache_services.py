"""What the prefix cache does beyond the engine's own steps: KV events on a ZMQ socket
(engine/kv_events.py) and the store on disk (engine/prefix_store.py).

The engine calls `before_schedule` once per step (reads back the stored blocks that the head
of the waiting queue would hit), `after_step` once per step (drains the cache manager's events
into the publisher's queue; saves new blocks every PREFIX_CACHE_SAVE_INTERVAL_S), `reset` for
POST /reset_prefix_cache and `close` on a clean shutdown, all on its own thread.  With neither
feature on, `after_step` is two attribute checks.  The store never fails a request, a reset or
the start-up: its errors turn it off and are counted (`num_store_errors`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.config import PREFIX_CACHE_SAVE_INTERVAL_S, CacheConfig
from kvserve.engine.public_prefixes import public_prefix_token_ids
from kvserve.engine.sizing import KVCacheSizing
from kvserve.kv.cache_manager import HashedRequest, KVCacheManager
from kvserve.kv.event_index import CacheIndex
from kvserve.kv.spec import KVCacheSpec

if TYPE_CHECKING:
    from kvserve.engine.prefix_store import LayerKVTensors
    from kvserve.executor.abstract import Executor


def store_shape(num_layers: int, num_kv_heads: int, head_dim: int, spec: KVCacheSpec) -> str:
    """The model shape in a store's fingerprint; with windows, the KV cache groups too (a
    stored block holds one group's slots)."""
    shape = f"{num_layers}x{num_kv_heads}x{head_dim}"
    if len(spec.groups) > 1 or any(group.window for group in spec.groups):
        shape += "".join(f"; {group.describe()}" for group in spec.groups)
    return shape


def disk_tier_dir(cache: CacheConfig, sizing: KVCacheSizing, print_: dict[str, str]) -> Path | None:
    """DIR/<fingerprint digest> of --kv-offloading-dir (the host tier's dtype is part of it: a
    compressed tier's files are int8), None without a disk tier."""
    if cache.kv_offloading_dir is None or not sizing.num_disk_blocks:
        return None
    from kvserve.engine.prefix_store import digest  # torch: only where a store is used

    return Path(cache.kv_offloading_dir) / digest({**print_, "host_dtype": sizing.host_spec.dtype})


class PrefixCacheServices:
    def __init__(self, config: CacheConfig) -> None:
        """Opens the event sockets now (a bad endpoint fails at start-up)."""
        self.config = config
        self.publisher = None
        self.store = None
        self._num_closed_store_errors = 0  # the store's errors, once it is closed
        self._store_dir = config.prefix_cache_dir
        self._store_max_bytes = config.prefix_cache_dir_max_size
        self._run_tier_copies: Callable[[], object] = lambda: None
        # What the events describe: the cache manager's log updates it, snapshots read it.
        self.event_index: CacheIndex | None = None
        events = config.kv_events
        if events is not None:
            from kvserve.engine.kv_events import ZmqEventPublisher

            self.event_index = CacheIndex(config.block_size, threading.Lock())
            self.publisher = ZmqEventPublisher(events, self.event_index)
            self.publisher.start()
        self._num_dropped_event_batches = 0  # of a closed publisher

    @property
    def wants_events(self) -> bool:
        return self.publisher is not None

    @property
    def num_dropped_event_batches(self) -> int:
        """KV event batches never sent since start (kvserve:kv_events_dropped_batches)."""
        if self.publisher is None:
            return self._num_dropped_event_batches
        return self.publisher.num_dropped

    @property
    def wants_new_blocks(self) -> bool:
        return self._store_dir is not None

    @property
    def num_store_errors(self) -> int:
        """Errors that turned the store off since start (kvserve:prefix_store_errors)."""
        store = self.store
        return self._num_closed_store_errors if store is None else store.num_errors

    def open_store(
        self,
        fingerprint: dict[str, str],
        kv_caches: list[LayerKVTensors],
        cache_manager: KVCacheManager,
        run_tier_copies: Callable[[], object],
    ) -> None:
        """With --prefix-cache-dir: index the matching blocks, read when a request needs them
        (never raises: a directory the store cannot use leaves it off or read-only).
        `run_tier_copies` runs a step of tier copies only (PrefixStore.fetch)."""
        if self._store_dir is None:
            return
        from kvserve.engine.prefix_store import PrefixStore

        # One cache per slot of a block: layers of KV cache groups share theirs
        # (attention/kv_cache.py), and a stored block is one group's, every slot of it.
        slots = list({id(cache): cache for cache in kv_caches}.values())
        self.store = PrefixStore(Path(self._store_dir), fingerprint, self._store_max_bytes, slots)
        self.store.index(cache_manager)
        self._run_tier_copies = run_tier_copies

    def before_schedule(
        self, waiting: Sequence[HashedRequest], cache_manager: KVCacheManager
    ) -> None:
        """Read back from the store what the first `waiting` requests would hit there."""
        if self.store is not None:
            self.store.fetch(list(waiting), cache_manager, self._run_tier_copies)

    def after_step(self, cache_manager: KVCacheManager) -> None:
        if self.publisher is not None:
            events = cache_manager.take_events()
            if events:
                self.publisher.publish(events)
        if self.store is not None:
            self.store.maybe_save(cache_manager, PREFIX_CACHE_SAVE_INTERVAL_S)

    def reset(self, cache_manager: KVCacheManager, include_pinned: bool = False) -> int:
        """Drop every cached block no request holds (pinned ones too with `include_pinned`),
        in memory and on disk (the files are deleted by the store's writer: this never waits
        for it)."""
        num_dropped = cache_manager.reset_prefix_cache(include_pinned)
        if self.store is not None:
            self.store.clear()
        self.after_step(cache_manager)  # publish the events now
        return num_dropped

    def close(self, cache_manager: KVCacheManager) -> None:
        """Write the blocks not yet on disk; send the last events."""
        if self.store is not None:
            self.store.close(cache_manager)
            self._num_closed_store_errors = self.store.num_errors
            self.store = None
        if self.publisher is not None:
            events = cache_manager.take_events()
            if events:
                self.publisher.publish(events)
            self.publisher.shutdown()
            self._num_dropped_event_batches = self.publisher.num_dropped
            self.publisher = None

    def make_cache_manager(
        self,
        sizing: KVCacheSizing,
        tokenizer: object,
        executor: Executor | None = None,
        disk_dir: Path | None = None,
    ) -> KVCacheManager:
        """The KV cache manager over the device blocks that every rank allocated, with the
        events and new-block tracking these services need; the disk tier's index starts with
        the blocks its folder `disk_dir` holds (listed by the `executor`, which also finds the
        files that other servers write there later)."""
        cache = self.config
        on_disk = executor is not None and disk_dir is not None
        return KVCacheManager(
            sizing.num_blocks,
            sizing.spec.block_size,
            enable_caching=cache.enable_prefix_caching,
            extra_key=sizing.spec.dtype.encode(),
            public_prefixes=(
                public_prefix_token_ids(cache.public_prefixes, tokenizer)
                if cache.public_prefixes else ()
            ),
            enable_events=self.wants_events,
            event_index=self.event_index,
            track_new_blocks=self.wants_new_blocks,
            num_host_blocks=sizing.num_host_blocks,
            report_cross_salt_misses=cache.enable_cross_salt_miss_reason,
            groups=sizing.spec.groups,
            eviction=cache.prefix_cache_eviction,
            max_pinned_blocks=int(cache.max_pinned_prefix_fraction * sizing.num_blocks),
            num_disk_blocks=sizing.num_disk_blocks,
            disk_keys=executor.disk_tier_keys(disk_dir) if on_disk else (),
            disk_probe=executor.disk_tier_probe(disk_dir) if on_disk else None,
            store_threshold=cache.kv_offloading_store_threshold,
        )  # fmt: skip
