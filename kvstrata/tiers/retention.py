"""The retention policy: which chunks a store gives up when it is over budget or too old.

One implementation serves both callers: the disk tier online (``DiskStore`` over its byte budget
while admitting a chunk) and ``kvstrata compact`` offline. The rule is least recently used by
access tick (wall-clock microseconds, comparable across processes), ties broken by key so that the
choice is deterministic, plus an optional maximum age: a chunk not accessed for ``max_age_s`` goes
whatever the budget says.

Selection streams over the index once and holds only the victims (a bounded max-heap), not every
entry: a 10-million-chunk store evicting 1/64 of its budget keeps ~1/64 of its keys in memory.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Entry", "RetentionPolicy", "select_lru_victims", "select_victims"]

# (store key, last-access tick in microseconds since the epoch, stored bytes)
Entry = tuple[bytes, int, int]


class _Newest:
    """Heap item ordered newest first, so the heap top is the victim to give back first."""

    __slots__ = ("key", "size", "tick")

    def __init__(self, tick: int, key: bytes, size: int) -> None:
        self.tick = tick
        self.key = key
        self.size = size

    def __lt__(self, other: _Newest) -> bool:
        return (self.tick, self.key) > (other.tick, other.key)


def select_victims(
    entries: Iterable[Entry], *, need_bytes: int = 0, expire_before_us: int | None = None
) -> list[bytes]:
    """Keys to delete, oldest first: every entry last accessed before ``expire_before_us``, and
    the least recently used entries until their sizes add up to at least ``need_bytes``.

    Expired entries count toward ``need_bytes``. When all entries together do not reach
    ``need_bytes``, every key is returned. Both rules pick a prefix of the same (tick, key) order,
    so the result is that order's shortest prefix satisfying both.
    """
    expired: list[tuple[int, bytes]] = []
    expired_bytes = 0
    heap: list[_Newest] = []
    held = 0
    for key, tick, size in entries:
        if expire_before_us is not None and tick < expire_before_us:
            expired.append((tick, key))
            expired_bytes += size
            continue
        if need_bytes <= 0:
            continue
        if held >= need_bytes and heap and (tick, key) > (heap[0].tick, heap[0].key):
            continue  # newer than every victim so far, and they already free enough
        heapq.heappush(heap, _Newest(tick, key, size))
        held += size
        # Give back the newest victims while the rest still free enough.
        while heap and held - heap[0].size >= need_bytes:
            held -= heapq.heappop(heap).size
    # Expired bytes free part of the need: give back more of the newest LRU victims.
    rest = need_bytes - expired_bytes
    while heap and (rest <= 0 or held - heap[0].size >= rest):
        held -= heapq.heappop(heap).size
    victims = [key for _, key in sorted(expired)]
    victims.extend(item.key for item in sorted(heap, key=lambda i: (i.tick, i.key)))
    return victims


def select_lru_victims(entries: Iterable[Entry], need_bytes: int) -> list[bytes]:
    """The least recently used keys whose sizes add up to at least ``need_bytes``, oldest first.

    ``entries`` yields ``(key, tick, size)``. Every key when they do not add up to ``need_bytes``;
    none when ``need_bytes <= 0``. This is the disk tier's online eviction choice.
    """
    return select_victims(entries, need_bytes=need_bytes)


@dataclass(frozen=True)
class RetentionPolicy:
    """A byte budget over stored (compressed) bytes and an optional maximum idle age."""

    budget_bytes: int | None = None
    max_age_s: float | None = None

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must not be negative, got {self.budget_bytes}")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, got {self.max_age_s}")

    def expire_before_us(self, now_us: int) -> int | None:
        """The tick before which a chunk is too old, or None without a maximum age."""
        if self.max_age_s is None:
            return None
        return now_us - int(self.max_age_s * 1_000_000)

    def need_bytes(self, stored_bytes: int, *, incoming_bytes: int = 0, slack_bytes: int = 0) -> int:
        """Bytes to free so that ``stored_bytes + incoming_bytes`` fits the budget (plus slack)."""
        if self.budget_bytes is None:
            return 0
        over = stored_bytes + incoming_bytes - self.budget_bytes
        return over + slack_bytes if over > 0 else 0

    def victims(
        self,
        entries: Iterable[Entry],
        *,
        stored_bytes: int,
        now_us: int,
        incoming_bytes: int = 0,
        slack_bytes: int = 0,
    ) -> list[bytes]:
        """Keys to delete, oldest first, for a store holding ``stored_bytes`` now."""
        return select_victims(
            entries,
            need_bytes=self.need_bytes(
                stored_bytes, incoming_bytes=incoming_bytes, slack_bytes=slack_bytes
            ),
            expire_before_us=self.expire_before_us(now_us),
        )
