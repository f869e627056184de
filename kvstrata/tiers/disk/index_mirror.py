"""Which keys the store's index holds, mirrored in this process's memory, so that presence probes
on the scheduler's path are set lookups instead of LMDB cursor seeks.

Every py-lmdb call releases the GIL around the LMDB call. The engine core probes the disk tier
from vLLM's scheduler thread while kvstrata's own threads (compression, the writer, disk reads)
wait for the GIL: each release can hand it to one of them, and the scheduler waits until that
thread lets go. Probing 62 candidate keys one seek at a time lost the GIL 30-40 times and took
2.4-3.9 ms in the slowest lookups (docs/BENCHMARKS.md, "The scheduler's side at GPU scale").

The mirror answers only while it is exact: built from one read transaction, it then follows every
write transaction this process's writer commits (what each added and deleted), and a probe uses it
only when the environment's last committed transaction is the one it has caught up with. Another
process's write (a tool importing into a live store, a second engine on the same store), or a write
whose changes were not reported (``DiskStore.write`` for the tools), leaves it stale: probes go to
LMDB as before until the writer thread rebuilds it (at once the first time, then backing off while
staleness keeps recurring, so that a store another process writes all the time is not rescanned
over and over). It costs about 70 bytes of memory per stored chunk (a set of 64-bit key hashes: a
collision could only answer "present" for an absent key, which a read then counts as a miss).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lmdb

# While staleness recurs within this long of the last rebuild, wait twice as long before the
# next, up to MAX_BACKOFF_S.
RECUR_WINDOW_S = 60.0
MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 300.0


class IndexMirror:
    """The set of index keys as of a committed transaction (see the module docstring). Only the
    writer thread builds and updates it; any thread asks it, without a lock (the writer thread
    runs at idle priority: a reader waiting on a lock it holds would wait for the whole
    machine's other work)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # (the last committed transaction the set reflects, the set of key hashes), replaced as
        # one reference; None: not built, or stale.
        self._state: tuple[int, set[int]] | None = None
        self._clock = clock
        self._built_at: float | None = None
        self._backoff = 0.0

    def answer(self, keys: Sequence[bytes], last_txnid: int) -> list[bool] | None:
        """Whether each key is in the index, if the mirror reflects transaction ``last_txnid``
        (the environment's last committed one); None when the caller must ask LMDB.

        An answer racing the writer's update for the next transaction may mix the two states:
        each key's answer is then true of one of them, as a read transaction racing a commit."""
        state = self._state
        if state is None or state[0] != last_txnid:
            return None
        mirrored = state[1]
        return [hash(k) in mirrored for k in keys]

    def rebuild(self, txn: lmdb.Transaction[Any], index_db: Any) -> None:
        """Rebuild from ``txn`` (a read transaction without buffers, writer thread: no write of
        this process can commit meanwhile)."""
        keys = {hash(k) for k in txn.cursor(db=index_db).iternext(keys=True, values=False)}
        self._state = (txn.id(), keys)
        self._built_at = self._clock()

    def committed(self, txnid: int, added: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """The writer committed transaction ``txnid``, which added and deleted these keys (and
        nothing else in the index). Followed only if it is the next transaction after the one
        the mirror reflects; otherwise another process wrote in between: stale."""
        state = self._state
        if state is None:
            return
        synced, keys = state
        if txnid != synced + 1:
            self._go_stale()
            return
        for k in added:
            keys.add(hash(k))
        for k in removed:
            keys.discard(hash(k))
        self._state = (txnid, keys)

    def invalidate(self) -> None:
        """A committed write whose index changes are not known (``DiskStore.write``)."""
        if self._state is not None:
            self._go_stale()

    def rebuild_due(self) -> bool:
        """Whether the writer should rebuild now: never built, or stale and backed off enough."""
        if self._state is not None:
            return False
        return self._built_at is None or self._clock() - self._built_at >= self._backoff

    def rebuild_failed(self) -> None:
        """A rebuild could not read the index: try again after the back-off."""
        self._state = None
        self._built_at = self._clock()
        self._backoff = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff))

    @property
    def current(self) -> bool:
        return self._state is not None

    def _go_stale(self) -> None:
        self._state = None
        assert self._built_at is not None
        if self._clock() - self._built_at < RECUR_WINDOW_S:
            self._backoff = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff))
        else:
            self._backoff = 0.0
