"""The puts of one write transaction, and the deletes they evict: what the writer thread runs in
its transactions (``writer.py``), and the put process in its own (``put_process.py``).

A put is skipped when its key is stored already (a chunk key names its content). When it would
take the store past its byte budget, or the file system below its reserve (``reserve.py``), the
least recently used records (``tiers.retention``) are evicted in the same transaction, by their
last access: the tick stored in the index or a newer one not written yet (``touched``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import lmdb

from kvstrata.tiers import codec
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk.index_mirror import IndexMirror
from kvstrata.tiers.disk.reserve import FsReserve
from kvstrata.tiers.retention import select_victims


class Put(Protocol):
    """What a put transaction needs of one put (``write_jobs.PutJob``)."""

    key: bytes
    frame: bytes | memoryview
    info: codec.FrameInfo
    tick: int
    mac: bytes


@dataclass(slots=True)
class PutOutcome:
    written: bool = False  # stored now (or found stored)
    evicted: int = 0
    evicted_bytes: int = 0
    reason: str = ""  # the counter of a put not written
    froze: bool = False  # the store froze its size at the file system's reserve at this put


class Putter:
    """Puts and deletes in write transactions of one store (see the module docstring), and which
    keys the running transaction added and deleted (``start`` clears them).

    ``touched()``: access ticks not written yet; ``quarantined``: records never deleted here;
    ``quarantine(key, why)``: a record a delete found damaged in a way that deleting it could
    destroy another's pages; ``on_deleted(keys)``: records deleted by the running transaction;
    ``on_recount()``: the totals record was unreadable (recounted, and rewritten by the put).
    ``mirror``: answers "is it stored" without LMDB while it reflects the transaction this one
    started from."""

    def __init__(self, h: rec.Handles, reserve: FsReserve, *, budget_bytes: int, evict_slack: float,
                 max_age_us: int | None, clock_us: Callable[[], int], touched: Callable[[], dict[bytes, int]],
                 quarantined: set[bytes], quarantine: Callable[[bytes, str], None],
                 on_deleted: Callable[[list[bytes]], None] = lambda keys: None,
                 on_recount: Callable[[], None] = lambda: None, mirror: IndexMirror | None = None) -> None:
        self.h = h
        self.reserve = reserve
        self.budget_bytes = budget_bytes
        self.evict_slack = max(0.0, evict_slack)
        self.max_age_us = max_age_us
        self.clock_us = clock_us
        self.touched = touched
        self.quarantined = quarantined
        self.quarantine = quarantine
        self.on_deleted = on_deleted
        self.on_recount = on_recount
        self.mirror = mirror
        self.added: list[bytes] = []  # put by the write transaction running now
        self.removed: list[bytes] = []  # deleted by it
        # (the put transaction that committed last, the totals it wrote): see ``totals``.
        self.committed_totals: tuple[int, rec.Totals] | None = None

    def start(self) -> None:
        """A write transaction starts (again, when retried): nothing added or deleted yet."""
        self.added, self.removed = [], []

    def batch(self, txn: lmdb.Transaction, jobs: Iterable[Put]) -> tuple[list[PutOutcome], rec.Totals]:
        """Put ``jobs`` in write transaction ``txn``: their outcomes and the totals written."""
        self.reserve.begin()
        totals = self.totals(txn)
        outcomes = [self.put(txn, totals, job) for job in jobs]
        rec.write_totals(txn, self.h, totals)
        return outcomes, rec.Totals(totals.entries, totals.raw_bytes, totals.stored_bytes)

    def totals(self, txn: lmdb.Transaction) -> rec.Totals:
        """The store's totals in ``txn``. What the last put transaction wrote, if it is the last
        committed one (no other write, of any process, since): not read again (a GIL release
        less per put)."""
        last = self.committed_totals
        if last is not None and last[0] == txn.id() - 1:
            t = last[1]
            return rec.Totals(t.entries, t.raw_bytes, t.stored_bytes)
        totals = rec.read_totals(txn, self.h)
        if totals is None:  # derived data: recount (and the put rewrites them)
            self.on_recount()
            totals = rec.recount(txn, self.h)[0]
        return totals

    def put(self, txn: lmdb.Transaction, totals: rec.Totals, job: Put) -> PutOutcome:
        outcome = PutOutcome()
        if self.stored(txn, job.key):
            outcome.written = True  # stored meanwhile (same key, same content)
            return outcome
        stored = len(job.frame)
        if stored > self.budget_bytes:
            outcome.reason = "too_large_drops"
            return outcome
        budget, outcome.froze = self.reserve.budget(self.budget_bytes, totals.stored_bytes, stored)
        if budget < stored:
            outcome.reason = "reserve_drops"  # below the reserve with too little to evict
            return outcome
        over = totals.stored_bytes + stored - budget
        if over > 0:
            need = over + int(self.evict_slack * budget)
            expire = None if self.max_age_us is None else self.clock_us() - self.max_age_us
            victims = select_victims(self.eviction_candidates(txn), need_bytes=need, expire_before_us=expire)
            outcome.evicted, outcome.evicted_bytes = self.delete(txn, totals, victims)
        rec.put(txn, self.h, job.key, job.frame, rec.index_record(job.key, job.info, stored, job.tick, job.mac), totals)
        self.added.append(job.key)
        self.reserve.wrote(stored)
        outcome.written = True
        return outcome

    def stored(self, txn: lmdb.Transaction, key: bytes) -> bool:
        """Whether the index holds ``key`` in write transaction ``txn``: from the index mirror
        when it reflects the transaction this one started from (no GIL release) and ``txn``
        did not put or delete the key itself, else from LMDB."""
        mirrored = None if self.mirror is None else self.mirror.answer([key], txn.id() - 1)
        if mirrored is not None and key not in self.added and key not in self.removed:
            return mirrored[0]
        return txn.get(key, db=self.h.index) is not None

    def delete(self, txn: lmdb.Transaction, totals: rec.Totals, keys: Iterable[bytes]) -> tuple[int, int]:
        """Delete records in ``txn``; (count, stored bytes freed). A record whose pages may not
        be its own is left in place and quarantined (never read again here)."""
        count = freed = 0
        gone: list[bytes] = []
        for key in keys:
            try:
                n = rec.delete(txn, self.h, key, totals)
            except rec.StructuralDamage as exc:
                self.quarantine(bytes(key), str(exc))
                continue
            if n is None:
                continue
            gone.append(bytes(key))
            count += 1
            freed += n
        self.removed.extend(gone)
        self.on_deleted(gone)
        return count, freed

    def eviction_candidates(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, int, int]]:
        touched = self.touched()
        quarantined = self.quarantined
        for key, value in txn.cursor(db=self.h.index):
            found = rec.decode_index(value)
            if found is None or (quarantined and bytes(key) in quarantined):
                continue  # unreadable (left to verification) or quarantined
            yield bytes(key), max(found.tick, touched.get(bytes(key), 0)), found.stored_len
