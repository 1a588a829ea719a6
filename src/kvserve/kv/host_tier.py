"""The host-memory tier of the prefix cache (--kv-offloading-size): which block keys sit in
which host slot, which to drop first (kv/eviction.py: ARC by default), and the copies the
runner must make.  Pure Python.

A cached block that the device pool evicts is not lost: its K/V is copied into a host slot
(*offload*, device block -> host slot) and kept there under the same chained key.  A later
lookup that misses on the device but finds the key here gets a fresh device block filled from
the slot (*load*, host slot -> device block) instead of recomputing those tokens.  A preempted
request's full blocks take the same path: freed (still cached) on the device, offloaded when
evicted, loaded back when it resumes.

    device pool  --evict-->  offload (block, slot)  -->  host slots (eviction policy)
    lookup miss on device, hit here  -->  load (block, slot)  -->  device block, cached again

The host keeps its copy after a load (the content under a key never changes), so evicting that
block again costs no copy.  The runner makes a step's copies before its forward pass, every
offload before every load: a block evicted and reused as a load's destination in one step is
saved first.  A slot read by a load in this step is *pinned* until the step's copies are taken,
so that no offload of the same step can overwrite it first.

With a disk tier below (kv/disk_tier.py, --kv-offloading-dir) an entry the host drops is not
lost either: its slot is written to a file (*to_disk*, queued before the step's other copies,
so the slot is read before an offload or a read reuses it), and a lookup that misses here but
finds the key on disk *reads* it (`start_read`): a host slot is reserved and filled from the
file by a reader thread (*from_disk*) while the request waits in the queue; when the runner
reports the read done (`finish_read`) the key is an ordinary entry here, loaded like any host
hit.  A reserved slot is never given to another key until its read is reported, even when
the tier is cleared meanwhile or nobody waits for it any more (the thread writes into it); a
read that failed frees its slot and the disk tier forgets the key (a miss: recomputed).  An
entry dropped in the step that offloaded it has no bytes in its slot yet: its file is written
from the device block instead (*device_to_disk*, which still holds them until the step's loads
and forward pass).

A slot dropped in the step that offloaded into it loses that queued offload: the dropped
entry's file comes from the device block, and the slot's next owner (another offload, or a
disk read that a reader thread fills while the step's offloads run) must not be overwritten.

A block offloaded after reuse on the device, or loaded back from here (a host hit), counts as
reused for the host's policy too; it keeps the retention priority it had on the device.

Admission (kv/admission.py, --kv-offloading-store-threshold): once this tier is full, the
cache manager offers it only the evicted blocks seen often enough to displace an entry, and
`admit` gates the drops written to a full disk the same way (a refused drop is simply gone; a
key on disk already stays there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.config import DEFAULT_RETENTION_PRIORITY
from kvserve.kv.disk_tier import DiskTier
from kvserve.kv.eviction import PrioritizedEviction


@dataclass
class HostTierStats:
    num_offloaded_blocks: int = 0  # device -> host copies
    num_loaded_blocks: int = 0  # host -> device copies (host-tier hits)
    num_dropped_blocks: int = 0  # host entries evicted (by the policy) to make room


@dataclass
class HostTransfers:
    """One step's copies, in this order: to_disk (host slot, key) and device_to_disk (device
    block, key), from_disk (key, host slot), offloads (device block, host slot), loads (device
    block, host slot); then the files of disk_deletes go."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    to_disk: list[tuple[int, bytes]] = field(default_factory=list)
    device_to_disk: list[tuple[int, bytes]] = field(default_factory=list)
    from_disk: list[tuple[bytes, int]] = field(default_factory=list)
    disk_deletes: list[bytes] = field(default_factory=list)


class HostTier:
    def __init__(
        self,
        num_slots: int,
        eviction: str = "arc",
        disk: DiskTier | None = None,
        admit: Callable[[bytes], bool] | None = None,
    ) -> None:
        """`admit(key)`: whether a dropped entry may be written to `disk` (None: every one)."""
        if num_slots < 0:
            raise ValueError(f"a host tier needs >= 0 slots, got {num_slots}")
        self.num_slots = num_slots
        self.disk = disk
        self._admit = admit
        # Slots filled in this step by the offload of a device block.
        self._fresh: dict[int, int] = {}
        self._reading: dict[bytes, int] = {}  # key -> slot a disk read fills (reserved)
        self._discarded: set[bytes] = set()  # of those, reads nobody keeps (cleared)
        self._promoted: set[bytes] = set()  # read from disk, not loaded to the device yet
        self._disk_changes: tuple[list[bytes], list[bytes]] = ([], [])  # (stored, deleted)
        self._slot_of: dict[bytes, int] = {}
        self._evictable = PrioritizedEviction(eviction, num_slots)  # keys not pinned
        self._priority_of: dict[bytes, int] = {}  # a pinned key's, to push it back
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._pinned: set[bytes] = set()
        self._transfers = HostTransfers()
        self.stats = HostTierStats()

    @property
    def num_used_slots(self) -> int:
        return len(self._slot_of)

    @property
    def usage(self) -> float:
        return len(self._slot_of) / self.num_slots if self.num_slots else 0.0

    @property
    def keys(self) -> list[bytes]:
        """The keys held, least recently used first."""
        return list(self._slot_of)

    @property
    def is_full(self) -> bool:
        """Whether taking a slot must drop an entry (admission gates only then)."""
        return not self._free_slots

    @property
    def num_unpinned_slots(self) -> int:
        return self.num_slots - len(self._pinned) - len(self._reading)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def lookup(self, key: bytes) -> int | None:
        """The slot holding this key's K/V, if any (a lookup is not a use)."""
        return self._slot_of.get(key)

    def offload(
        self,
        block_id: int,
        key: bytes,
        reused: bool = False,
        retention_priority: int = DEFAULT_RETENTION_PRIORITY,
    ) -> tuple[bool, list[bytes]]:
        """The device evicts `block_id`, cached under `key` (`reused` and at
        `retention_priority` there): keep its content here.

        Returns (kept, dropped): whether the key is now held here (queuing a copy unless it
        already was), and the keys evicted from the host to make room (the policy's victims,
        never a pinned slot).  kept is False when every slot is pinned or there are none."""
        if key in self._slot_of:
            if key not in self._pinned:  # held already: a use, at the device's priority
                self._evictable.remove(key)
                self._evictable.push(key, key, reused, retention_priority)
            return True, []
        slot, dropped = self._take_slot()
        if slot is None:
            return False, []
        self._slot_of[key] = slot
        self._fresh[slot] = block_id
        self._evictable.push(key, key, reused or self._evictable.note_cached(key),
                             retention_priority)  # fmt: skip
        self._transfers.offloads.append((block_id, slot))
        self.stats.num_offloaded_blocks += 1
        return True, dropped

    def _take_slot(self) -> tuple[int | None, list[bytes]]:
        """A free slot, or the policy's victim's (dropped, to disk when there is one); None
        when every slot is pinned."""
        dropped: list[bytes] = []
        if not self._free_slots:
            if not self._evictable:
                return None, []
            victim = self._evictable.pop().item
            assert isinstance(victim, bytes)
            victim_slot = self._slot_of.pop(victim)
            self._free_slots.append(victim_slot)
            self.stats.num_dropped_blocks += 1
            dropped.append(victim)
            self._demote(victim, victim_slot)
            self._cancel_offload_into(victim_slot)
        return self._free_slots.pop(), dropped

    def _cancel_offload_into(self, slot: int) -> None:
        """Drop this step's queued offload into `slot`, whose entry was just dropped (its file,
        if any, is written from the device block): the slot's next owner may be a disk read,
        which the reader thread fills while the step's offloads run, and an offload still
        queued into it would overwrite part of the read."""
        block_id = self._fresh.pop(slot, None)
        if block_id is not None:
            self._transfers.offloads.remove((block_id, slot))
            self.stats.num_offloaded_blocks -= 1

    def _demote(self, key: bytes, slot: int) -> None:
        """A dropped entry goes to the disk tier: from its slot (written before the step's
        other copies), or from the device block whose offload of this step was to fill it.
        Not when the disk is full and `admit` refuses a key it lacks."""
        if self.disk is None:
            return
        disk = self.disk
        if self._admit is not None and key not in disk and disk.is_full and not self._admit(key):
            return
        write, deleted = self.disk.store(key)
        if write:
            self._disk_changes[0].append(key)
        self._disk_changes[1].extend(deleted)
        block_id = self._fresh.get(slot)
        if write and block_id is not None:
            self._transfers.device_to_disk.append((block_id, key))
        elif write:
            self._transfers.to_disk.append((slot, key))
        self._transfers.disk_deletes.extend(deleted)

    def take_disk_changes(self) -> tuple[list[bytes], list[bytes]]:
        """The keys the disk tier gained (dropped from here) and lost (its LRU files) since
        the last call: what KV events announce with medium DISK."""
        changes, self._disk_changes = self._disk_changes, ([], [])
        return changes

    def holds(self, key: bytes) -> bool:
        """Whether this tier or the disk below has the key's content (or is reading it)."""
        return (key in self._slot_of or key in self._reading
                or (self.disk is not None and key in self.disk))  # fmt: skip

    def finds(self, key: bytes) -> bool:
        """`holds`, for a lookup: a file that another server wrote to the disk tier's folder
        counts too (DiskTier.find)."""
        return self.holds(key) or (self.disk is not None and self.disk.find(key))

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pinned

    def is_reading(self, key: bytes) -> bool:
        """Whether a disk read of `key` is under way (not reported done yet)."""
        return key in self._reading

    def came_from_disk(self, key: bytes) -> bool:
        """Whether `key` is held here because a disk read brought it, not loaded since."""
        return key in self._promoted

    def start_read(self, key: bytes) -> list[bytes] | None:
        """Reserve a host slot for `key`, found on disk only, and queue its read.  Returns
        the keys dropped from here to make room (to disk), None when every slot is pinned
        or reserved (nothing queued)."""
        assert self.disk is not None and key in self.disk
        assert key not in self._slot_of and key not in self._reading
        slot, dropped = self._take_slot()
        if slot is None:
            return None
        self._reading[key] = slot
        self._transfers.from_disk.append((key, slot))
        self.disk.read(key)
        return dropped

    def finish_read(self, key: bytes, ok: bool) -> bool:
        """The runner reports the read of `key` done (`ok`) or failed (file gone or
        corrupt): an entry here, or its slot freed (and the disk forgets a failed key).
        Returns whether the key is now held here by this read."""
        slot = self._reading.pop(key, None)
        if slot is None:
            return False
        kept = ok and key not in self._discarded and key not in self._slot_of
        self._discarded.discard(key)
        if self.disk is not None and not ok:
            self.disk.lost(key)
        if not kept:
            self._free_slots.append(slot)
            return False
        self._slot_of[key] = slot
        self._evictable.push(key, key, False, DEFAULT_RETENTION_PRIORITY)
        self._promoted.add(key)
        if self.disk is not None:
            self.disk.read_done()
        return True

    def load(self, key: bytes, block_id: int) -> None:
        """Fill device block `block_id` from the slot of `key` (found by `lookup` in this
        step, pinned by `pin`) until the step's transfers are taken."""
        assert key in self._pinned, "pin a key before loading it"
        self._promoted.discard(key)
        self._transfers.loads.append((block_id, self._slot_of[key]))
        self.stats.num_loaded_blocks += 1

    def pin(self, keys: list[bytes]) -> None:
        """Keep these keys' slots through this step (a load of them is about to be queued):
        out of the policy until `take_transfers`, which puts them back as reused (a hit)."""
        for key in keys:
            if key not in self._pinned:
                self._priority_of[key] = self._priority_in_policy(key)
                self._evictable.remove(key)
                self._pinned.add(key)

    def _priority_in_policy(self, key: bytes) -> int:
        victim = self._evictable.priority_of(key)
        return DEFAULT_RETENTION_PRIORITY if victim is None else victim

    def take_transfers(self) -> HostTransfers:
        """The copies queued since the last call; unpins every slot."""
        transfers, self._transfers = self._transfers, HostTransfers()
        for key in self._pinned:
            if key in self._slot_of:  # not cleared meanwhile
                self._evictable.push(key, key, True, self._priority_of[key])
        self._pinned.clear()
        self._priority_of.clear()
        self._fresh.clear()
        return transfers

    def clear(self) -> list[bytes]:
        """Forget every entry (a prefix cache reset); returns the keys, in eviction order.
        Copies already queued still run (their slots are simply free afterwards); the slots
        of reads under way stay reserved until each is reported, then are freed."""
        self._discarded.update(self._reading)
        self._promoted.clear()
        keys = [k for k in self._evictable if isinstance(k, bytes)]
        keys += [k for k in self._slot_of if k in self._pinned]
        self._free_slots.extend(self._slot_of[k] for k in reversed(keys))
        self._slot_of.clear()
        self._evictable.clear()
        self._pinned.clear()
        self._priority_of.clear()
        return keys

    def clear_disk(self) -> list[bytes]:
        """Forget the disk tier's entries too (their files are deleted); returns the keys."""
        if self.disk is None:
            return []
        on_disk = self.disk.clear()
        self._transfers.disk_deletes.extend(on_disk)
        return on_disk

    def check_invariants(self) -> None:
        used = set(self._slot_of.values())
        assert len(used) == len(self._slot_of), "two keys in one host slot"
        assert not used & set(self._free_slots), "a host slot both used and free"
        reading = set(self._reading.values())
        assert not reading & (used | set(self._free_slots)), "a reserved slot used or free"
        assert len(used) + len(reading) + len(self._free_slots) == self.num_slots, "slots lost"
        assert self._discarded <= set(self._reading), "a discarded read not under way"
        assert len(self._evictable) + len(self._pinned) == len(self._slot_of), "policy entries"
        assert all(k in self._slot_of for k in self._pinned), "a pinned key without a slot"
