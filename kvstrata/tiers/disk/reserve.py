"""The free space a store leaves its file system (option ``disk_reserve``).

Once a put would take the file system below the reserve, the store's size is frozen where it
is and new puts make room by evicting (the pages they free are used again, so the file stops
growing); an empty store puts nothing. The freeze lifts once the file system has room again.
The writer asks the file system at the start of a write transaction (:meth:`FsReserve.begin`),
then counts its own puts against what it was told. While the file system has plenty of room above
the reserve it asks at most every ``remeasure_s`` (each ``statvfs`` releases the GIL, which a busy
engine thread then holds for up to a switch interval: docs/BENCHMARKS.md, "Writes framed in
processes"); near the reserve, at every transaction.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

REMEASURE_S = 0.05
NEAR_BYTES = 256 << 20  # within this much of the reserve, measured at every transaction


class FsReserve:
    """The reserve of one store, used on its writer thread only."""

    def __init__(self, path: Path | str, reserve_bytes: int, *, remeasure_s: float = REMEASURE_S) -> None:
        self.path = path
        self.reserve_bytes = max(0, reserve_bytes)
        self.remeasure_s = remeasure_s
        # While the reserve binds, the stored bytes the store is held to, else None.
        self.cap: int | None = None
        self._room: int | None = None  # file system bytes above the reserve, this transaction
        self._measured_at = float("-inf")
        self._logged = False

    def begin(self) -> None:
        """A write transaction starts: the file system's room above the reserve (measured again
        unless it was plenty a moment ago, see the module docstring)."""
        now = time.monotonic()
        if self._room is not None and self._room > NEAR_BYTES and now - self._measured_at < self.remeasure_s:
            return  # less this process's puts since (``wrote``)
        self._room = self._fs_room()
        self._measured_at = now

    def budget(self, budget_bytes: int, stored_bytes: int, size: int) -> tuple[int, bool]:
        """The stored bytes a put of ``size`` bytes may bring the store to (the byte budget,
        or, while the file system is at its reserve, what the store held when it got there),
        and whether the store froze at this put."""
        room = self._room
        if room is None or room >= size:
            self.cap = None  # room again (or never short of it)
            return budget_bytes, False
        if self.cap is not None:
            return self.cap, False
        self.cap = min(budget_bytes, stored_bytes)
        if not self._logged:
            self._logged = True
            log.warning("store at %s: its file system is down to the %d bytes the store leaves "
                        "free (disk_reserve); the store stays at %d stored bytes and makes room "
                        "for new chunks by evicting the least recently used", self.path,
                        self.reserve_bytes, self.cap)
        return self.cap, True

    def wrote(self, size: int) -> None:
        """A put of ``size`` bytes was written. Pages this transaction freed are used again only
        by later ones: count it as growth."""
        if self._room is not None:
            self._room -= size

    def _fs_room(self) -> int | None:
        """Bytes the file system has free above the reserve (None: no reserve, or unknown)."""
        if not self.reserve_bytes:
            return None
        try:
            return shutil.disk_usage(self.path).free - self.reserve_bytes
        except OSError:
            return None
