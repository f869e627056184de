"""The disk store's event counters (``DiskStore.stats()`` reports them)."""

from __future__ import annotations

import threading

COUNTERS = (
    "hits", "misses", "lookups", "corrupt", "corrupt_dropped", "size_mismatch", "puts",
    "put_present", "deletes", "evictions", "evicted_bytes", "admission_drops", "too_large_drops",
    "full_events", "map_resized", "tick_flushes", "sync_errors", "recovery_checked",
    "recovery_dropped", "totals_recounted", "index_unreadable", "quarantined", "forged",
    "forged_dropped", "reserve_drops", "reserve_freezes", "mirrored_lookups", "mirror_rebuilds",
    "process_framed", "process_puts",
)


class Counters:
    """The store's event counters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def bump_many(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
