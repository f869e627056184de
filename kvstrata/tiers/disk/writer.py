"""The store's writer: one thread for every write (puts, deletes, access ticks, evictions) and one
that makes them durable (``syncer``).

Puts come compressed; the writer batches small ones into one transaction and gives large ones a
transaction each (batching large values makes LMDB malloc and fault dirty overflow pages per
transaction, docs/STORAGE.md). What one transaction of puts does, evictions included, is the
``putter``'s. A full map or disk stops
admission for a while, logged once; reads go on. Access ticks are buffered in memory by reads
and flushed in batches (``ticks``: reads never write).

With a reserve (``reserve_bytes``) the store also leaves that much of its file system free
(``reserve``).

The put process. Each LMDB call releases the GIL, and beside a busy Python thread (a serving
engine's step loop) the writer thread waits up to a switch interval to get it back, several times
a put: 0.11-0.14 GB/s at Python's default 5 ms (docs/BENCHMARKS.md, "Writes framed in
processes"). Puts framed by the write processes (``encoders.py``) sit in their frame slab, shared
memory: the writer thread hands whole runs of them to one process of its own
(``put_process.py``), which runs the same transactions with the same ``Putter`` and answers once
per run with what each committed; the writer thread then has the index mirror follow those
commits, in order, as its own. Everything else (puts framed in the engine's threads, deletes,
ticks, the tools' transactions) stays on the writer thread; LMDB serialises the two writers.
When the put process fails, the writer thread puts the rest itself (the frames stay mapped).
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

import lmdb

from kvstrata.tiers import records as rec
from kvstrata.tiers.disk.children import ChildPool
from kvstrata.tiers.disk.counters import Counters
from kvstrata.tiers.disk.env import StoreEnv, StoreUnavailableError
from kvstrata.tiers.disk.index_mirror import IndexMirror
from kvstrata.tiers.disk.put_batches import PutBatches
from kvstrata.tiers.disk.putter import Putter
from kvstrata.tiers.disk.reserve import FsReserve
from kvstrata.tiers.disk.syncer import Syncer
from kvstrata.tiers.disk.ticks import AccessTicks, write_ticks
from kvstrata.tiers.disk.write_jobs import CallJob, PutJob, now_us
from kvstrata.tiers.priority import lower_this_thread, name_this_thread

log = logging.getLogger(__name__)

T = TypeVar("T")

_STOP = object()


class Writer(PutBatches):
    """The write side of one open store (see the module docstring); its puts' transactions
    are ``PutBatches``'."""

    def __init__(
        self,
        env: StoreEnv,
        counters: Counters,
        *,
        budget_bytes: int,
        evict_slack: float,
        max_age_s: float | None,
        sync_interval_s: float,
        sync_bytes: int,
        touch_flush_interval_s: float,
        full_retry_s: float,
        reserve_bytes: int = 0,
        idle: bool = False,
        clock_us: Callable[[], int] = now_us,
    ) -> None:
        self.env = env
        self._clock_us = clock_us
        self._idle = idle  # run both threads at idle CPU priority (tiers/priority.py)
        self.h = env.handles
        self.counts = counters
        self.budget_bytes = budget_bytes
        self._touch_interval = touch_flush_interval_s
        self._full_retry_s = full_retry_s
        self.admitting = True
        self._retry_at = 0.0
        self._full_logged = False
        self._stop = threading.Event()
        self.ticks = AccessTicks(lambda: self.call_soon(self.flush_touches))
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._submit_lock = threading.Lock()
        self.open = True
        # Told the store keys of records deleted (evicted, dropped as corrupt, deleted) once their
        # transaction committed; called on the writer thread, so it must not wait on the store.
        self.on_removed: Callable[[list[bytes]], None] | None = None
        # The index's keys in memory, for presence probes that never release the GIL; built on
        # the writer thread before its first job (tiers/disk/index_mirror.py).
        self.index_mirror = IndexMirror()
        # Records whose pages may be another record's (records.IN_PLACE): never read, evicted or
        # deleted by this process; `kvstrata verify --repair` rebuilds the store around them.
        self.quarantined: set[bytes] = set()
        self._quarantine_logged = False
        # What a write transaction puts and deletes (writer thread only). Retention: whenever
        # it evicts, chunks idle longer than max_age_s go first. Its reserve: the free space
        # the store leaves its file system (module docstring).
        self.putter = Putter(
            self.h, FsReserve(env.path, reserve_bytes), budget_bytes=budget_bytes, evict_slack=evict_slack,
            max_age_us=None if max_age_s is None else int(max_age_s * 1_000_000), clock_us=clock_us,
            touched=self.touched, quarantined=self.quarantined, quarantine=self.quarantine,
            on_deleted=self._forget_touches, on_recount=self._recounting, mirror=self.index_mirror)
        self._put_pool: ChildPool | None = None  # use_put_process
        self._ticks_sent_to: ChildPool | None = None  # the put process holding a copy of the ticks
        # The sync thread before the writer thread, whose commits tell it.
        self.syncer = Syncer(env, counters, interval_s=sync_interval_s, sync_bytes=sync_bytes, idle=idle,
                             stop=self._stop, spawn=_spawn)
        self._thread = _spawn(self._loop, "writer")

    # ---- jobs ---------------------------------------------------------------------------------

    def submit(self, job: PutJob | CallJob) -> bool:
        # Under the lock that queues _STOP: no job can land behind it and wait forever.
        with self._submit_lock:
            if not self.open:
                return False
            self._queue.put(job)
            return True

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the writer thread and wait for its result."""
        if threading.current_thread() is self._thread:
            return fn()
        job: CallJob = CallJob(fn, Future())
        if not self.submit(job):
            raise StoreUnavailableError(f"store at {self.env.path} is closed")
        return job.future.result()

    def use_put_process(self, pool: ChildPool | None) -> None:
        """Hand the puts whose frames are in the frame slab ``pool`` maps (``PutJob.place`` and
        ``put_pool``) to ``pool``, a put process (module docstring); None: put them here. Puts
        placed for another put process (write processes started again) are put here."""
        self._put_pool = pool

    def put_rules(self) -> dict[str, Any]:
        """What a put process needs to put as this writer does (``put_process.py``)."""
        putter = self.putter
        return {"budget_bytes": putter.budget_bytes, "evict_slack": putter.evict_slack,
                "max_age_us": putter.max_age_us, "reserve_bytes": putter.reserve.reserve_bytes,
                "idle": self._idle}

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the writer thread without waiting."""
        self.submit(CallJob(fn, Future()))

    def write(self, fn: Callable[[lmdb.Transaction[Any]], T], *, buffers: bool = False,
              tracked: bool = True) -> T:
        """``fn(txn)`` in one write transaction on the writer thread; deletions it reports
        through ``deleted`` reach ``on_removed`` once it commits. ``tracked=False``: ``fn`` may
        add index records without reporting them (the index mirror is rebuilt after it)."""
        return self.call(lambda: self._write_txn(fn, buffers=buffers, tracked=tracked))

    def _write_txn(self, fn: Callable[[lmdb.Transaction[Any]], T], *, buffers: bool = False,
                   tracked: bool = True) -> T:
        txnid = -1
        putter = self.putter

        def body(txn: lmdb.Transaction) -> T:
            nonlocal txnid
            putter.start()  # (again when the transaction is retried)
            txnid = txn.id()
            result = fn(txn)
            if tracked and not putter.added and not putter.removed:
                # LMDB commits nothing for a transaction that changed nothing, and another
                # process's next commit would then take this id: the index mirror could not tell
                # it from this one. Rewrite the session's marker so that this one commits.
                txn.put(rec.META_CLEAN, b"0", db=self.h.meta)
            return result

        try:
            result = self.env.txn(body, write=True, buffers=buffers)
        finally:
            added, removed = putter.added, putter.removed
            putter.start()
        self._committed(txnid, added, removed, tracked)
        return result

    def _committed(self, txnid: int, added: list[bytes], removed: list[bytes], tracked: bool) -> None:
        """Write transaction ``txnid`` (this thread's or the put process's) committed."""
        self._follow(txnid, added, removed, tracked)
        if removed and self.on_removed is not None:
            try:
                self.on_removed(removed)
            except Exception:
                log.exception("store at %s: on_removed callback failed", self.env.path)
        self.syncer.mark_dirty()

    @property
    def reserve(self) -> FsReserve:
        return self.putter.reserve

    def delete(self, txn: lmdb.Transaction, totals: rec.Totals, keys: Iterable[bytes]) -> tuple[int, int]:
        """Delete records in ``txn`` (writer thread); (count, stored bytes freed). A record whose
        pages may not be its own is left in place and quarantined (never read again here)."""
        return self.putter.delete(txn, totals, keys)

    def _forget_touches(self, keys: list[bytes]) -> None:
        self.ticks.forget(keys)

    def _recounting(self) -> None:
        log.warning("store at %s: the totals record is unreadable; recounting it", self.env.path)
        self.counts.bump("totals_recounted")

    def quarantine(self, key: bytes, why: str) -> None:
        self.quarantined.add(bytes(key))
        self.counts.bump("quarantined")
        if not self._quarantine_logged:
            self._quarantine_logged = True
            log.warning("store at %s: a record's pages may belong to another record (%s); it is left "
                        "out, not deleted, so that the other record survives: run `kvstrata verify "
                        "--repair %s` with the store to itself to rebuild it", self.env.path, why,
                        self.env.path)

    # ---- admission ----------------------------------------------------------------------------

    def admission_open(self) -> bool:
        if self.admitting:
            return True
        if time.monotonic() >= self._retry_at:
            self.admitting = True  # try again: eviction or the user may have freed space
            return True
        return False

    def on_write_failure(self, exc: BaseException) -> None:
        """Full map or disk: stop admitting for a while, log once, count; reads go on."""
        self.admitting = False
        self._retry_at = time.monotonic() + self._full_retry_s
        self.counts.bump("full_events")
        if not self._full_logged:
            self._full_logged = True
            hint = " (disk full)" if getattr(exc, "errno", None) == errno.ENOSPC else ""
            if isinstance(exc, rec.LMDB_DAMAGE):
                hint = (f" (the store's structure is damaged: `kvstrata verify --repair --rebuild "
                        f"{self.env.path}` rebuilds it from its records)")
            log.warning("store at %s stopped admitting new chunks for %.0fs%s: %s: %s",
                        self.env.path, self._full_retry_s, hint, type(exc).__name__, exc)

    # ---- access ticks -------------------------------------------------------------------------

    def touch(self, keys: Iterable[bytes], tick: int) -> None:
        self.ticks.touch(keys, tick)

    def touched(self) -> dict[bytes, int]:
        """Buffered access ticks not written yet."""
        return self.ticks.snapshot()

    def flush_touches(self) -> None:
        """Write the buffered last-access ticks (writer thread)."""
        pending = self.ticks.take()
        if not pending:
            return
        try:
            self._write_txn(lambda txn: write_ticks(txn, self.h, pending))
        except (lmdb.Error, OSError) as exc:
            self.on_write_failure(exc)  # ticks are advisory: losing them only blurs LRU order
            return
        self.counts.bump("tick_flushes")

    # ---- the writer thread --------------------------------------------------------------------

    def _loop(self) -> None:
        if self._idle:
            lower_this_thread()
        last_flush = time.monotonic()
        carry: Any = None
        while True:
            if self.index_mirror.rebuild_due():
                self._rebuild_mirror()
            job = carry
            carry = None
            if job is None:
                try:
                    job = self._queue.get(timeout=self._touch_interval)
                except queue.Empty:
                    job = None
            if job is _STOP:
                self._fail_queued()
                return
            if isinstance(job, PutJob):
                carry = self._run_puts(job)
            elif isinstance(job, CallJob):
                _run_call(job)
            if time.monotonic() - last_flush >= self._touch_interval:
                last_flush = time.monotonic()
                try:
                    self.flush_touches()
                except Exception:  # ticks are advisory; keep the writer alive
                    log.exception("store at %s: flushing access ticks failed", self.env.path)

    def _follow(self, txnid: int, added: list[bytes], removed: list[bytes], tracked: bool) -> None:
        """Have the index mirror follow write transaction ``txnid``, just committed. A tracked
        one always changed something (``_write_txn``), so it committed as ``txnid``: no need to
        ask LMDB (one GIL release less per put, docs/BENCHMARKS.md, "Writes framed in
        processes")."""
        if tracked:
            self.index_mirror.committed(txnid, added, removed)
            return
        # An untracked one changed the index in ways not reported: stale, if it committed at all
        # (LMDB commits nothing for a transaction that changed nothing; the last committed one
        # is then still the one before ``txnid``).
        try:
            committed = self.env.last_txnid() >= txnid
        except (lmdb.Error, StoreUnavailableError):
            committed = True
        if committed:
            self.index_mirror.invalidate()

    def _rebuild_mirror(self) -> None:
        try:
            self.env.txn(lambda txn: self.index_mirror.rebuild(txn, self.h.index))
            self.counts.bump("mirror_rebuilds")
        except (lmdb.Error, StoreUnavailableError) as exc:  # probes keep asking LMDB
            log.warning("store at %s: its index could not be mirrored in memory: %s", self.env.path, exc)
            self.index_mirror.rebuild_failed()

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, PutJob):
                job.future.set_result(False)
            elif isinstance(job, CallJob):
                job.future.set_exception(StoreUnavailableError(f"store at {self.env.path} is closed"))

    # ---- durability and stopping ----------------------------------------------------------------

    def sync(self) -> None:
        """Make everything committed so far durable (``syncer``), in this thread."""
        self.syncer.sync()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Tell the background work (the syncer, a verification) to stop; writes still run."""
        self._stop.set()
        self.syncer.wake()

    def stop(self) -> None:
        """Flush the ticks, finish what is queued (failing what comes after), stop both threads."""
        self.request_stop()
        try:
            self.call(self.flush_touches)
        except StoreUnavailableError:
            pass
        with self._submit_lock:
            self.open = False
            self._queue.put(_STOP)
        self._thread.join()
        self.syncer.join()
        try:
            self.sync()
        except lmdb.Error as exc:
            log.warning("store at %s: final env.sync failed: %s", self.env.path, exc)


def _run_call(job: CallJob) -> None:
    try:
        job.future.set_result(job.fn())
    except BaseException as exc:  # handed to the waiting caller
        job.future.set_exception(exc)


def _spawn(target: Callable[[], None], name: str) -> threading.Thread:
    def run() -> None:
        name_this_thread()
        target()

    thread = threading.Thread(target=run, name=f"kvstrata-disk-{name}", daemon=True)
    thread.start()
    return thread
