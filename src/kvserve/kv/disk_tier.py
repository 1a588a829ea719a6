"""The disk tier below the host tier (--kv-offloading-dir): which block keys have a file,
in LRU order, within a capacity in blocks.  Pure Python: the files are written and read by
runner/disk_tier.py, the host tier (kv/host_tier.py) queues the copies.

    host slots --drop (LRU)--> write (host slot -> file, by a writer thread)
    lookup miss on device and host, hit here --> read (file -> host slot, by a reader
        thread, while the request waits in the queue), then the host's load

The folder may be shared by several servers of one model, each evicting by its own LRU: a
file that vanished (another server deleted it) or is corrupt when read is a miss, not an
error: `lost` forgets the key and the request recomputes those tokens.  A lost key is not
found again through the folder (its file may be there, corrupt, or another rank's missing)
until this server stores it: a bounded memory of the last lost keys, so that a lookup does
not read the same broken file step after step.

A key's content never changes, so a key already on disk is not written again, and a block
promoted from disk keeps its file (dropped from the host again, it costs no write).  The
capacity evicts whole files, LRU first; the keys present at start-up (listed, not read) come
first in that order, so a restarted server finds the blocks an earlier one wrote.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAX_REMEMBERED_LOST = 4096  # keys, ~200 KB


@dataclass
class DiskTierStats:
    num_written_blocks: int = 0  # host -> disk
    num_read_blocks: int = 0  # disk -> host (disk-tier hits)
    num_deleted_blocks: int = 0  # files evicted (LRU) to stay within the capacity
    num_lost_blocks: int = 0  # files gone or corrupt when read (another server's eviction)
    num_found_blocks: int = 0  # files another server wrote, found by a lookup (`find`)


class DiskTier:
    def __init__(
        self,
        num_blocks: int,
        present: Iterable[bytes] = (),
        probe: Callable[[bytes], bool] | None = None,
    ) -> None:
        """`num_blocks`: the capacity; `present`: keys whose files exist already, oldest
        first (beyond the capacity, the oldest are deleted at the first store); `probe(key)`:
        whether the folder has the key's file now (one written by another server since)."""
        if num_blocks <= 0:
            raise ValueError(f"a disk tier needs > 0 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._probe = probe
        self._keys: OrderedDict[bytes, None] = OrderedDict.fromkeys(present)
        self._lost: OrderedDict[bytes, None] = OrderedDict()  # not to be found again
        self.stats = DiskTierStats()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> list[bytes]:
        """The keys with a file, least recently used first."""
        return list(self._keys)

    @property
    def is_full(self) -> bool:
        """Whether storing a new key must delete a file (admission gates only then)."""
        return len(self._keys) >= self.num_blocks

    @property
    def usage(self) -> float:
        return min(1.0, len(self._keys) / self.num_blocks)

    def store(self, key: bytes) -> tuple[bool, list[bytes]]:
        """The host drops `key`: (whether a file must be written, the keys whose files go to
        make room, LRU first)."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return False, []
        self._keys[key] = None
        self._lost.pop(key, None)
        deleted = []
        while len(self._keys) > self.num_blocks:
            deleted.append(self._keys.popitem(last=False)[0])
        self.stats.num_written_blocks += 1
        self.stats.num_deleted_blocks += len(deleted)
        return True, deleted

    def find(self, key: bytes) -> bool:
        """A lookup's question: whether the key has a file, known here or, through the
        probe, one that another server on the folder wrote since this one listed it (then
        known from now on, most recently used)."""
        if key in self._keys:
            return True
        if self._probe is None or key in self._lost or not self._probe(key):
            return False
        self._keys[key] = None
        self.stats.num_found_blocks += 1
        return True

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark these keys used now, the first one last (most recent): the files that a
        prefix's reads are about to need go after every other when the reads' drops make
        room, and its later blocks before its earlier ones."""
        for key in reversed(list(keys)):
            if key in self._keys:
                self._keys.move_to_end(key)

    def read(self, key: bytes) -> None:
        """A hit: the key's file is being read into a host slot (the key stays here, now
        MRU; counted once the read lands, `read_done`)."""
        self._keys.move_to_end(key)

    def read_done(self) -> None:
        self.stats.num_read_blocks += 1

    def lost(self, key: bytes) -> bool:
        """The key's file could not be read (gone or corrupt): forget it.  False when it was
        forgotten already (a reset, or the capacity deleted it meanwhile)."""
        if key not in self._keys:
            return False
        del self._keys[key]
        self._lost[key] = None
        if len(self._lost) > MAX_REMEMBERED_LOST:
            self._lost.popitem(last=False)
        self.stats.num_lost_blocks += 1
        return True

    def clear(self) -> list[bytes]:
        """Forget every key (a prefix cache reset): their files are deleted."""
        keys = list(self._keys)
        self._keys.clear()
        return keys
