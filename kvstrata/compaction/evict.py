"""Apply the retention policy to an open store: pick victims from its index, delete them.

Safe while servers use the same store: the index is read in short transactions, deletions go
through ``DiskStore.delete_many`` (batched write transactions that keep the totals exact), and a
victim touched meanwhile is at worst evicted slightly early, which a cache tolerates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.tiers.retention import Entry, RetentionPolicy

if TYPE_CHECKING:
    from kvstrata.tiers.disk import DiskStore

_DELETE_BATCH = 256


@dataclass(frozen=True)
class EvictionResult:
    evicted: int
    stored_bytes_before: int
    stored_bytes_after: int

    @property
    def freed_bytes(self) -> int:
        return self.stored_bytes_before - self.stored_bytes_after


def now_us() -> int:
    return time.time_ns() // 1000


def _entries(store: DiskStore) -> Iterator[Entry]:
    for key, rec in store.iter_index():
        yield key, rec.tick, rec.stored_len


def evict(
    store: DiskStore,
    policy: RetentionPolicy,
    *,
    now: int | None = None,
    on_deleted: Callable[[int], None] | None = None,
) -> EvictionResult:
    """Delete what ``policy`` gives up from ``store``; ``on_deleted(n)`` reports progress."""
    before = int(store.stats()["stored_bytes"])
    victims = policy.victims(
        _entries(store), stored_bytes=before, now_us=now if now is not None else now_us()
    )
    evicted = 0
    for start in range(0, len(victims), _DELETE_BATCH):
        batch = victims[start : start + _DELETE_BATCH]
        evicted += store.delete_many(batch)
        if on_deleted is not None:
            on_deleted(len(batch))
    return EvictionResult(evicted, before, int(store.stats()["stored_bytes"]))
