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

A block offloaded after reuse on the device, or loaded back from here (a host hit), counts as
reused for the host's policy too; it keeps the retention priority it had on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import DEFAULT_RETENTION_PRIORITY
from kvserve.kv.eviction import PrioritizedEviction


@dataclass
class HostTierStats:
    num_offloaded_blocks: int = 0  # device -> host copies
    num_loaded_blocks: int = 0  # host -> device copies (host-tier hits)
    num_dropped_blocks: int = 0  # host entries evicted (by the policy) to make room


@dataclass
class HostTransfers:
    """One step's copies, each (device block, host slot): offloads first, then loads."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)


class HostTier:
    def __init__(self, num_slots: int, eviction: str = "arc") -> None:
        if num_slots < 0:
            raise ValueError(f"a host tier needs >= 0 slots, got {num_slots}")
        self.num_slots = num_slots
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
        dropped: list[bytes] = []
        if not self._free_slots:
            if not self._evictable:
                return False, []
            victim = self._evictable.pop().item
            assert isinstance(victim, bytes)
            self._free_slots.append(self._slot_of.pop(victim))
            self.stats.num_dropped_blocks += 1
            dropped.append(victim)
        slot = self._free_slots.pop()
        self._slot_of[key] = slot
        self._evictable.push(key, key, reused or self._evictable.note_cached(key),
                             retention_priority)  # fmt: skip
        self._transfers.offloads.append((block_id, slot))
        self.stats.num_offloaded_blocks += 1
        return True, dropped

    def load(self, key: bytes, block_id: int) -> None:
        """Fill device block `block_id` from the slot of `key` (found by `lookup` in this
        step, pinned by `pin`) until the step's transfers are taken."""
        assert key in self._pinned, "pin a key before loading it"
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
        return transfers

    def clear(self) -> list[bytes]:
        """Forget every entry (a prefix cache reset); returns the keys, in eviction order.
        Copies already queued still run (their slots are simply free afterwards)."""
        keys = [k for k in self._evictable if isinstance(k, bytes)]
        keys += [k for k in self._slot_of if k in self._pinned]
        self._free_slots.extend(self._slot_of[k] for k in reversed(keys))
        self._slot_of.clear()
        self._evictable.clear()
        self._pinned.clear()
        self._priority_of.clear()
        return keys

    def check_invariants(self) -> None:
        used = set(self._slot_of.values())
        assert len(used) == len(self._slot_of), "two keys in one host slot"
        assert not used & set(self._free_slots), "a host slot both used and free"
        assert len(used) + len(self._free_slots) == self.num_slots, "host slots lost"
        assert len(self._evictable) + len(self._pinned) == len(self._slot_of), "policy entries"
        assert all(k in self._slot_of for k in self._pinned), "a pinned key without a slot"
