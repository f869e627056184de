"""Disk reads in processes of their own (``disk/children.py``): a record's LMDB read, MAC check,
decode and checksum, straight into a slot of the host slab, off the engine-core process's GIL.

LMDB lets several processes read one store, and the host slab is shared memory, so only the
chunk's key and its place in the slab cross the pipe, and one word per chunk comes back. Each
child has its own read-only view of the store and the slab (``read_process.py``). ``read_many``
reports each outcome as it arrives, in order (a streamed load copies a chunk as soon as it
landed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.tiers.disk.children import ChildPool

if TYPE_CHECKING:
    from kvstrata.auth import ValueAuth

# One chunk shard to read: (store key, slab slot, offset in the slot, bytes).
Item = tuple[bytes, int, int, int]
# What a read gave: ("ok", bytes written | None for no such record | the record's problem),
# ("size", why the slot is too small), ("error", a store-level failure, e.g. LMDB's).
Outcome = tuple[str, Any]


class DiskReaders(ChildPool):
    """Child processes reading a store's records into a host slab (see the module docstring)."""

    def __init__(self, store_path: str | Path, slab_path: str | Path, slot_bytes: int, num_slots: int, *,
                 processes: int, auth: ValueAuth | None = None, map_size: int = 1 << 40) -> None:
        setup = {"store_path": str(store_path), "slab_path": str(slab_path), "slot_bytes": slot_bytes,
                 "num_slots": num_slots, "map_size": map_size, "auth": auth}
        super().__init__("kvstrata.tiers.disk.read_process", setup, processes=processes, what="read")

    def read_many(self, items: Sequence[Item], answer: Callable[[int, Outcome], None]) -> None:
        """Read every item into the slab, calling ``answer(i, outcome)`` for each in order as it
        lands (:meth:`ChildPool.run`: raises ProcessesUnavailable when the pool cannot read)."""
        self.run(list(items), len(items), answer)
