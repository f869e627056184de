"""The host pool: the scheduler-side index over a host slab's slots.

``HostPool`` maps key -> slot, with reference counts and an eviction policy (``policy.LRU`` or
``policy.ARC``). It never allocates buffers: slots are preallocated in the slab, a store only
picks one.

The pool is not thread-safe on its own; ``Hierarchy`` serialises access with its lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterable, Sequence
from itertools import compress
from operator import attrgetter
from typing import TYPE_CHECKING, Literal

from kvstrata.tiers.host.policy import ARC, LRU, Entry, evictable

if TYPE_CHECKING:
    from kvstrata.tiers.host.slab import HostSlab

_is_ready = attrgetter("ready")


class HostPool:
    """Index over a slab's slots: key -> slot, with reference counts and LRU/ARC eviction.

    Life of an entry: ``allocate`` (not ready, one reference held by the writer) -> ``mark_ready``
    + ``release`` (the data is in the slot) -> ``acquire``/``release`` around every reader
    (device load, disk write-behind) -> eviction once ready and unreferenced. An entry with
    references, or not ready, is never evicted, so its slot is never handed out again while a
    transfer uses it. ``discard`` drops an entry whose write failed.
    """

    # lookup_many states
    ABSENT = 0
    READY = 1
    NOT_READY = 2

    def __init__(
        self,
        slab: HostSlab | None = None,
        policy: Literal["lru", "arc"] = "lru",
        *,
        num_slots: int | None = None,
        on_evict: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        if num_slots is None:
            if slab is None:
                raise ValueError("HostPool needs a slab or num_slots")
            num_slots = slab.num_slots
        if policy not in ("lru", "arc"):
            raise ValueError(f"unknown eviction policy {policy!r} (expected 'lru' or 'arc')")
        self.slab = slab
        self.num_slots = num_slots
        self.policy_name = policy
        self._policy: LRU | ARC = LRU(num_slots) if policy == "lru" else ARC(num_slots)
        # Stack of free slots, lowest first out: a fresh pool fills the slab front to back.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.on_evict = on_evict
        self.evictions = 0
        self._referenced = 0  # entries with refs > 0 (kept incrementally for stats())
        self._not_ready = 0

    @staticmethod
    def slots_for_budget(budget_bytes: int, slot_bytes: int) -> int:
        """How many whole slots fit in a byte budget (at least one)."""
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be > 0")
        return max(1, int(budget_bytes) // int(slot_bytes))

    # ---- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._policy)

    def __contains__(self, key: bytes) -> bool:
        return self._policy.get(key) is not None

    def lookup_many(self, keys: Sequence[bytes], touch: bool = True) -> list[int]:
        """ABSENT / READY / NOT_READY per key; ``touch`` records an access on READY ones."""
        # With C-level iteration where it can: a long prompt asks for hundreds of keys, every
        # step its request waits, and most often all of them are ready.
        entries = list(map(self._policy.get, keys))
        if None not in entries and all(map(_is_ready, entries)):
            out = [1] * len(entries)
            ready: Iterable[bytes] = keys
        else:
            out = [0 if e is None else 1 if e.ready else 2 for e in entries]
            ready = compress(keys, map((1).__eq__, out))
        if touch:
            deque(map(self._policy.touch, ready), maxlen=0)
        return out

    def get(self, key: bytes) -> tuple[int, bool] | None:
        """``(slot, ready)`` or None; does not count as an access."""
        entry = self._policy.get(key)
        return None if entry is None else (entry.slot, entry.ready)

    def is_ready(self, key: bytes) -> bool:
        entry = self._policy.get(key)
        return entry is not None and entry.ready

    def refs(self, key: bytes) -> int:
        entry = self._policy.get(key)
        return 0 if entry is None else entry.refs

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def room(self) -> int:
        """Slots an allocation could take now: free, or holding a chunk nothing references."""
        return self.num_slots - self._referenced

    def room_without(self, kept: Iterable[bytes]) -> int:
        """``room`` less the slots of the ``kept`` chunks (distinct keys) that an allocation
        could otherwise evict: the room of one that must not evict them."""
        get = self._policy.get
        return self.room - sum(1 for key in kept if (e := get(key)) is not None and evictable(e))

    def keys(self) -> list[bytes]:
        return [key for key, _ in self._policy]

    # ---- updates -------------------------------------------------------------------------------

    def touch(self, key: bytes) -> None:
        """Record an access (a lookup hit or a load)."""
        if self._policy.get(key) is not None:
            self._policy.touch(key)

    def allocate(
        self, keys: Sequence[bytes], protected: Container[bytes] = frozenset(),
        spare: Container[bytes] = frozenset(),
    ) -> list[int] | None:
        """Slots for absent ``keys``, all or none; evicts idle chunks not in ``protected``,
        those in ``spare`` only where the others are too few.

        The new entries are not ready and hold one reference each (the writer's).
        """
        for key in keys:
            if self._policy.get(key) is not None:
                raise KeyError(f"chunk {key.hex()} is already in the host pool")
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys in one allocation")
        need = len(keys) - len(self._free)
        if need > 0:
            victims = self._policy.victims(need, protected, spare)
            if victims is None:
                return None
            self._evict(victims)
        slots = []
        for key in keys:
            entry = Entry(self._free.pop())
            self._policy.insert(key, entry)
            slots.append(entry.slot)
        self._referenced += len(keys)
        self._not_ready += len(keys)
        return slots

    def mark_ready(self, key: bytes) -> None:
        entry = self._entry(key)
        if not entry.ready:
            entry.ready = True
            self._not_ready -= 1

    def acquire(self, key: bytes) -> int:
        """Take a reference; returns the slot."""
        entry = self._entry(key)
        if entry.refs == 0:
            self._referenced += 1
        entry.refs += 1
        return entry.slot

    def release(self, key: bytes) -> None:
        entry = self._entry(key)
        if entry.refs <= 0:
            raise RuntimeError(f"chunk {key.hex()} released more often than acquired")
        entry.refs -= 1
        if entry.refs == 0:
            self._referenced -= 1

    def discard(self, key: bytes) -> bool:
        """Drop an entry whatever its state (a failed write); its slot becomes free."""
        entry = self._policy.remove(key)
        if entry is None:
            return False
        self._referenced -= entry.refs > 0
        self._not_ready -= not entry.ready
        self._free.append(entry.slot)
        return True

    def evict_idle(self) -> int:
        """Evict every ready, unreferenced entry (prefix-cache reset). Returns how many."""
        victims = [key for key, entry in self._policy if evictable(entry)]
        if victims:
            self._evict(victims)
        return len(victims)

    def _evict(self, keys: list[bytes]) -> None:
        """Evict these idle entries; ``on_evict`` hears of them in one call (a long prompt's
        promotion evicts hundreds of chunks in one allocation, on the scheduler's path)."""
        policy = self._policy
        free = self._free
        if isinstance(policy, ARC):
            for key in keys:
                from_t1 = key in policy.t1
                entry = policy.remove(key)
                assert entry is not None and evictable(entry)
                policy.evicted(key, from_t1)
                free.append(entry.slot)
        else:
            remove = policy.remove
            for key in keys:
                entry = remove(key)
                assert entry is not None and evictable(entry)
                free.append(entry.slot)
        self.evictions += len(keys)
        if self.on_evict is not None:
            self.on_evict(keys)

    def _entry(self, key: bytes) -> Entry:
        entry = self._policy.get(key)
        if entry is None:
            raise KeyError(f"chunk {key.hex()} is not in the host pool")
        return entry

    def stats(self) -> dict[str, int | str]:
        """O(1): the connector may ask every step."""
        return {
            "policy": self.policy_name,
            "slots": self.num_slots,
            "used": len(self._policy),
            "free": len(self._free),
            "referenced": self._referenced,
            "not_ready": self._not_ready,
            "evictions": self.evictions,
        }
