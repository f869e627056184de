"""Replacement policies of the host pool: which idle entry gives its slot up first.

``LRU`` (least recently used first) and ``ARC`` (Adaptive Replacement Cache) keep the pool's
entries (key -> ``Entry``: slot, reference count, readiness) in their own order and name victims
among the evictable ones (``evictable``: ready and unreferenced), never a ``protected`` one and
``spare`` ones only where the others do not make up the number (in the policy's order among
themselves). ``HostPool`` owns the slots and counts; a policy only orders keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterator


class Entry:
    """One chunk in the pool: its slot, reference count and whether its bytes are final."""

    __slots__ = ("slot", "refs", "ready")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.refs = 1  # the writer (store or promotion) holds the first reference
        self.ready = False


def evictable(entry: Entry) -> bool:
    """Ready and unreferenced: no transfer uses the slot, so it may be handed out again."""
    return entry.ready and entry.refs == 0


class LRU:
    """Least recently used first. ``entries`` is ordered LRU -> MRU."""

    def __init__(self, capacity: int) -> None:
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        # Bound builtins rather than methods: lookups call these once per key.
        self.get: Callable[[bytes], Entry | None] = self.entries.get
        self.touch: Callable[[bytes], None] = self.entries.move_to_end

    def insert(self, key: bytes, entry: Entry) -> None:
        self.entries[key] = entry

    def remove(self, key: bytes) -> Entry | None:
        return self.entries.pop(key, None)

    def victims(self, n: int, protected: Container[bytes], spare: Container[bytes] = ()) -> list[bytes] | None:
        out: list[bytes] = []
        if n <= 0:
            return out
        later: list[bytes] = []
        for key, entry in self.entries.items():
            if evictable(entry) and key not in protected:
                if key in spare:
                    if len(later) < n:
                        later.append(key)
                    continue
                out.append(key)
                if len(out) == n:
                    return out
        out += later[: n - len(out)]
        return out if len(out) == n else None

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[bytes, Entry]]:
        return iter(self.entries.items())


class ARC:
    """Adaptive Replacement Cache (Megiddo & Modha), with pinned entries skipped.

    T1 holds chunks touched once since insertion, T2 those touched again; B1/B2 remember keys
    recently evicted from each, and a ghost hit moves the T1 target ``p`` toward the list that
    would have kept it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[bytes, Entry] = OrderedDict()
        self.t2: OrderedDict[bytes, Entry] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> Entry | None:
        entry = self.t1.get(key)
        return entry if entry is not None else self.t2.get(key)

    def insert(self, key: bytes, entry: Entry) -> None:
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), float(self.capacity))
            del self.b1[key]
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]
        self.t1[key] = entry

    def touch(self, key: bytes) -> None:
        entry = self.t1.pop(key, None)
        if entry is not None:
            self.t2[key] = entry
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: bytes) -> Entry | None:
        entry = self.t1.pop(key, None)
        return entry if entry is not None else self.t2.pop(key, None)

    def victims(self, n: int, protected: Container[bytes], spare: Container[bytes] = ()) -> list[bytes] | None:
        out: list[bytes] = []
        if n <= 0:
            return out
        later: list[bytes] = []

        def candidates(entries: OrderedDict[bytes, Entry]) -> Iterator[bytes]:
            for k, e in entries.items():
                if evictable(e) and k not in protected:
                    if k not in spare:
                        yield k
                    elif len(later) < n:
                        later.append(k)

        t1, t2 = candidates(self.t1), candidates(self.t2)
        t1_size = len(self.t1)
        for _ in range(n):
            first, second = (t1, t2) if t1_size >= max(1, int(self.p)) else (t2, t1)
            picked = next(first, None) or next(second, None)
            if picked is None:
                break
            if picked in self.t1:
                t1_size -= 1
            out.append(picked)
        if len(out) < n:
            # Exhausted both lists: ``later`` holds the spare ones of both, T1's first.
            later.sort(key=lambda k: k not in self.t1)
            out += later[: n - len(out)]
        return out if len(out) == n else None

    def evicted(self, key: bytes, from_t1: bool) -> None:
        ghosts = self.b1 if from_t1 else self.b2
        ghosts[key] = None
        while len(self.b1) + len(self.b2) > self.capacity:
            (self.b1 if len(self.b1) > len(self.b2) else self.b2).popitem(last=False)

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[tuple[bytes, Entry]]:
        yield from self.t1.items()
        yield from self.t2.items()
