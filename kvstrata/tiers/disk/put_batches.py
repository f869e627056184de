"""The writer's put transactions (one half of ``writer.Writer``, which holds the state they use):
small puts batched into one transaction, large ones one each, and runs of transactions handed
to the put process (``put_process.py``) for puts whose frames are in its frame slab. The
reasons are in ``writer.py``'s module docstring."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb

from kvstrata.tiers import records as rec
from kvstrata.tiers.disk.children import ChildPool, ProcessesUnavailable
from kvstrata.tiers.disk.putter import PutOutcome, Putter
from kvstrata.tiers.disk.write_jobs import PutJob

if TYPE_CHECKING:
    from kvstrata.tiers.disk.counters import Counters
    from kvstrata.tiers.disk.env import StoreEnv
    from kvstrata.tiers.disk.syncer import Syncer
    from kvstrata.tiers.disk.ticks import AccessTicks

log = logging.getLogger(__name__)

T = TypeVar("T")

# Values at least this large get a transaction of their own (writer.py's module docstring).
_LARGE_VALUE = 256 << 10
_SMALL_BATCH_BYTES = 1 << 20
_SMALL_BATCH_COUNT = 64
# One run of transactions for the put process: at most this many, or this many frame bytes.
_PROCESS_RUN_TXNS = 32
_PROCESS_RUN_BYTES = 256 << 20


class PutBatches:
    """Runs the put jobs the writer thread takes from its queue (``_run_puts``)."""

    # The writer's state this half uses (set in Writer.__init__).
    env: StoreEnv
    counts: Counters
    putter: Putter
    syncer: Syncer
    ticks: AccessTicks
    quarantined: set[bytes]
    _queue: queue.SimpleQueue[Any]
    _put_pool: ChildPool | None
    _ticks_sent_to: ChildPool | None

    if TYPE_CHECKING:  # the writer's methods this half calls (defined in Writer)
        def _write_txn(self, fn: Callable[[lmdb.Transaction[Any]], T], *, buffers: bool = False,
                       tracked: bool = True) -> T: ...
        def _committed(self, txnid: int, added: list[bytes], removed: list[bytes], tracked: bool) -> None: ...
        def _forget_touches(self, keys: list[bytes]) -> None: ...
        def on_write_failure(self, exc: BaseException) -> None: ...
        def quarantine(self, key: bytes, why: str) -> None: ...

    def _run_puts(self, first: PutJob) -> Any:
        """Write ``first`` (plus following small puts in the same transaction); returns a job
        taken from the queue that did not fit the batch, for the loop to run next."""
        pool = self._put_pool
        if first.place is not None and pool is not None and first.put_pool is pool and pool.available:
            return self._run_puts_in_process(first, pool)
        jobs, carry = self._take_batch(first, None)
        self._finish(jobs, partial(self._write_batch, jobs))
        return carry

    def _take_batch(self, first: PutJob, pool: ChildPool | None) -> tuple[list[PutJob], Any]:
        """``first`` and the puts that share its transaction (small ones, taken from the queue;
        with ``pool``, only puts placed for that put process), and a job taken that did not fit,
        or None."""
        jobs = [first]
        if len(first.frame) < _LARGE_VALUE:
            size = len(first.frame)
            while len(jobs) < _SMALL_BATCH_COUNT and size < _SMALL_BATCH_BYTES:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, PutJob) or len(nxt.frame) >= _LARGE_VALUE or not _for(nxt, pool):
                    return jobs, nxt
                jobs.append(nxt)
                size += len(nxt.frame)
        return jobs, None

    def _run_puts_in_process(self, first: PutJob, pool: ChildPool) -> Any:
        """A run of transactions of puts in the frame slab, from ``first`` on, in the put
        process (writer.py's module docstring); the job after the run, or None."""
        txns: list[list[PutJob]] = []
        nxt: Any = first
        size = 0
        while True:
            jobs, carry = self._take_batch(nxt, pool)
            txns.append(jobs)
            size += sum(len(job.frame) for job in jobs)
            if carry is None:
                try:
                    carry = self._queue.get_nowait()
                except queue.Empty:
                    break
            if not isinstance(carry, PutJob) or not _for(carry, pool):
                break
            if len(txns) >= _PROCESS_RUN_TXNS or size >= _PROCESS_RUN_BYTES:
                break
            nxt, carry = carry, None
        # The put process keeps a copy of the buffered ticks: a new process gets them all, one
        # that has them only what changed (at most FLUSH_AT a run, pickled with the GIL held).
        epoch, ticks = self.ticks.changes(full=pool is not self._ticks_sent_to)
        self._ticks_sent_to = pool
        run = (epoch, ticks, self.quarantined.copy(),
               [[(job.key, *job.place, job.tick, job.mac) for job in jobs if job.place is not None] for jobs in txns])
        answers: list[Any] = []
        try:
            pool.run(run, 1, lambda _i, got: answers.extend(got))
        except ProcessesUnavailable:
            answers = []  # put here what it did not answer: a put it committed is found stored
        for i, jobs in enumerate(txns):
            if i < len(answers):
                self._finish(jobs, partial(self._took_from_process, jobs, answers[i]))
            else:
                self._finish(jobs, partial(self._write_batch, jobs))
        return carry

    def _took_from_process(self, jobs: list[PutJob], answer: tuple[Any, ...]) -> list[PutOutcome]:
        """Account one transaction the put process ran for ``jobs`` (``put_process.py``)."""
        self.counts.bump("process_puts", len(jobs))
        if answer[0] == "failed":
            self.on_write_failure(answer[1])
            self.counts.bump("admission_drops", len(jobs))
            return [PutOutcome() for _ in jobs]
        _, txnid, outcomes, added, removed, quarantined, reserve_cap = answer
        for key, why in quarantined:
            self.quarantine(key, why)
        self._forget_touches(removed)
        self.putter.reserve.cap = reserve_cap
        self._committed(txnid, added, removed, tracked=True)
        result = [PutOutcome(*outcome) for outcome in outcomes]
        self._count_written(jobs, result)
        return result

    def _finish(self, jobs: list[PutJob], write: Callable[[], list[PutOutcome]]) -> None:
        """Resolve the futures of ``jobs`` with what ``write()`` did to them."""
        try:
            outcomes = write()
        except Exception:  # a bug must not kill the writer and leave callers waiting forever
            log.exception("store at %s: writing %d entries failed", self.env.path, len(jobs))
            self.counts.bump("admission_drops", len(jobs))
            outcomes = [PutOutcome() for _ in jobs]
        for job, outcome in zip(jobs, outcomes, strict=True):
            job.future.set_result(outcome.written)

    def _write_batch(self, jobs: list[PutJob]) -> list[PutOutcome]:
        written: tuple[int, rec.Totals] | None = None

        def body(txn: lmdb.Transaction) -> list[PutOutcome]:
            nonlocal written
            outcomes, totals = self.putter.batch(txn, jobs)
            written = (txn.id(), totals)
            return outcomes

        try:
            outcomes = self._write_txn(body)
        except (lmdb.Error, OSError) as exc:  # MapFullError, DiskError (ENOSPC), EFBIG, EIO...
            self.on_write_failure(exc)
            self.counts.bump("admission_drops", len(jobs))
            return [PutOutcome() for _ in jobs]
        self.putter.committed_totals = written
        self._count_written(jobs, outcomes)
        return outcomes

    def _count_written(self, jobs: list[PutJob], outcomes: list[PutOutcome]) -> None:
        self.syncer.wrote(sum(len(job.frame) for job in jobs))
        for outcome in outcomes:
            self.counts.bump_many(evictions=outcome.evicted, evicted_bytes=outcome.evicted_bytes,
                                  reserve_freezes=int(outcome.froze))
            if outcome.written:
                self.counts.bump("puts")
            elif outcome.reason:
                self.counts.bump(outcome.reason)


def _for(job: PutJob, pool: ChildPool | None) -> bool:
    """Whether ``job`` may share a transaction run by ``pool`` (None: the writer thread's)."""
    return pool is None or (job.place is not None and job.put_pool is pool)
