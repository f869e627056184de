"""A store's last-access ticks, buffered in memory: reads never write; the writer writes them into
the index records in batches (``writer.flush_touches``), and eviction orders by the newer of the
stored tick and the buffered one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import lmdb
import msgspec

from kvstrata.tiers import records as rec

FLUSH_AT = 4096  # buffered ticks that call for an early flush


class AccessTicks:
    """The buffered ticks of one store; ``many()`` is called (outside the lock) once
    ``FLUSH_AT`` are buffered. Thread-safe.

    A copy kept elsewhere (the put process's, ``writer.py``) follows with ``changes()``: each
    ``take()`` starts a new epoch, since what it took is written by the time the copy is next
    used, and within an epoch only what was touched since the last call is sent.
    """

    def __init__(self, many: Callable[[], None]) -> None:
        self._many = many
        self._lock = threading.Lock()
        self._ticks: dict[bytes, int] = {}
        self._epoch = 0
        self._unsent: dict[bytes, int] | None = None  # tracked once changes() was called

    def touch(self, keys: Iterable[bytes], tick: int) -> None:
        with self._lock:
            ticks, unsent = self._ticks, self._unsent
            for key in keys:
                ticks[key] = tick
                if unsent is not None:
                    unsent[key] = tick
            many = len(ticks) >= FLUSH_AT
        if many:
            self._many()

    def snapshot(self) -> dict[bytes, int]:
        """The ticks not written yet."""
        with self._lock:
            return dict(self._ticks)

    def changes(self, *, full: bool) -> tuple[int, dict[bytes, int]]:
        """``(epoch, ticks)`` for a copy kept elsewhere: a copy drops what it holds from another
        epoch (written since), then adds ``ticks``, which are those touched since the last call
        in this epoch, or with ``full`` (a new copy) every tick buffered."""
        with self._lock:
            changed = dict(self._ticks) if full or self._unsent is None else self._unsent
            self._unsent = {}
            return self._epoch, changed

    def forget(self, keys: Iterable[bytes]) -> None:
        """These records are gone: their ticks with them (a copy may keep them: a tick older
        than the record's own never reorders it)."""
        with self._lock:
            for key in keys:
                self._ticks.pop(key, None)
                if self._unsent is not None:
                    self._unsent.pop(key, None)

    def take(self) -> dict[bytes, int]:
        """The ticks not written yet, no longer buffered (the caller writes them); a new epoch."""
        with self._lock:
            taken, self._ticks = self._ticks, {}
            self._epoch += 1
            if self._unsent is not None:
                self._unsent = {}
        return taken


def write_ticks(txn: lmdb.Transaction, h: rec.Handles, ticks: dict[bytes, int]) -> None:
    """Write ``ticks`` into the index records they are newer than (write transaction ``txn``)."""
    for key, tick in ticks.items():
        found = rec.decode_index(txn.get(key, db=h.index))
        if found is not None and tick > found.tick:
            txn.put(key, rec.encode_index(msgspec.structs.replace(found, tick=tick)), db=h.index)
