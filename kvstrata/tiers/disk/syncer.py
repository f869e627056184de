"""Making a store's writes durable: the store's environment is opened with ``sync=False``
(docs/STORAGE.md), so a thread of its own calls ``env.sync()`` every ``interval_s`` while
something was written, and early once ``sync_bytes`` were; flushing then overlaps the writer's
next puts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import lmdb

from kvstrata.tiers.disk.counters import Counters
from kvstrata.tiers.disk.env import StoreEnv
from kvstrata.tiers.priority import lower_this_thread

log = logging.getLogger(__name__)


class Syncer:
    """The sync thread of one store (see the module docstring); ``idle``: at idle CPU priority.
    It ends once ``stop`` is set and it is woken (:meth:`wake`)."""

    def __init__(self, env: StoreEnv, counts: Counters, *, interval_s: float, sync_bytes: int,
                 idle: bool, stop: threading.Event,
                 spawn: Callable[[Callable[[], None], str], threading.Thread]) -> None:
        self.env = env
        self.counts = counts
        self._interval = interval_s
        self._sync_bytes = sync_bytes
        self._idle = idle
        self._stop = stop
        self._dirty = threading.Event()
        self._dirty_bytes = 0
        self._wake = threading.Event()
        self._thread = spawn(self._loop, "sync")

    def wrote(self, nbytes: int) -> None:
        """A commit wrote about ``nbytes`` (approximate: it only paces the thread)."""
        self._dirty_bytes += nbytes

    def mark_dirty(self) -> None:
        """Something was committed: sync it at the next turn (early past ``sync_bytes``)."""
        self._dirty.set()
        if self._dirty_bytes >= self._sync_bytes:
            self._wake.set()

    def sync(self) -> None:
        """Make everything committed so far durable, now, in this thread."""
        self._dirty.clear()
        self._dirty_bytes = 0
        self.env.sync()

    def wake(self) -> None:
        self._wake.set()

    def join(self) -> None:
        self._thread.join()

    def _loop(self) -> None:
        if self._idle:
            lower_this_thread()
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            if self._dirty.is_set():
                try:
                    self.sync()
                except lmdb.Error as exc:
                    self.counts.bump("sync_errors")
                    log.warning("store at %s: env.sync failed: %s", self.env.path, exc)
