"""Worker side of streamed loads: copy host slots into the device as their chunks land.

A streamed load (``Hierarchy.prepare_streamed_load``) names, per chunk copy, a ticket: 0 when the
chunk was already in the host tier, else the ticket of the promotion still decompressing it into
its slot. The scheduler process writes ``ticket << 1 | failed`` to the slab's landing board
(``HostSlab.landed``) when that promotion ends. One thread here watches the board:

* a copy whose ticket shows up clean is ready; on CPU devices it is copied at once, on this
  thread, so the copies of a restored prefix overlap the reading and decompressing of the rest;
  on accelerators the job is handed back whole once every chunk landed, and the worker submits
  it to its copy stream from the engine's thread (streams and events stay on one thread);
* a failed ticket, or a newer one (the slot was handed on after a failure), fails the job
  without reading the slot: vLLM recomputes the request.

The slot cannot be reused under a waiting job: the scheduler pinned it until the job is reported
finished.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvstrata.tiers.host import board_fence
from kvstrata.tiers.priority import name_this_thread, widen_this_thread

if TYPE_CHECKING:
    from kvstrata.tiers.device import Transfer

logger = logging.getLogger(__name__)

POLL_S = 0.001  # board scan interval while a job waits: about one chunk copy
DEFAULT_TIMEOUT_S = 120.0  # a promotion that never ends (scheduler gone) fails its load then


@dataclass
class _Waiting:
    job_id: int
    transfers: list[Transfer]
    slots: np.ndarray
    tickets: np.ndarray
    started: float
    cancelled: bool = False
    done: np.ndarray = field(init=False)  # copied (CPU) or landed (accelerators)

    def __post_init__(self) -> None:
        self.done = np.zeros(len(self.tickets), dtype=bool)


class LandingWaiter:
    """Waits on the landing board for streamed load jobs (see module docstring).

    Args:
        board: the slab's ``landed`` array (shared with the scheduler process).
        copy: copies one landed transfer into the device now (CPU devices); None hands whole
            jobs back through :meth:`take_ready` instead (accelerators).
        timeout_s: fail a job whose chunks have not all landed after this long.
    """

    def __init__(
        self,
        board: np.ndarray,
        copy: Callable[[Transfer], None] | None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._board = board
        self._copy = copy
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._jobs: list[_Waiting] = []
        self._results: list[tuple[int, bool]] = []
        self._ready: list[tuple[int, list[Transfer]]] = []
        self._closed = False
        # Held by the thread while it copies for a job: cancel() waits on it, so no copy of a
        # cancelled job runs after cancel() returned.
        self._copy_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvstrata-landing", daemon=True)
        self._thread.start()

    def submit(self, job_id: int, transfers: Sequence[Transfer], tickets: Sequence[int]) -> None:
        """Watch one load job. A ticket of -1 fails it at once; 0 needs no wait."""
        transfers = list(transfers)
        t = np.asarray(tickets, dtype=np.int64)
        if (t < 0).any():
            with self._cond:
                self._results.append((job_id, False))
            return
        slots = np.asarray([tr[1] for tr in transfers], dtype=np.int64)
        job = _Waiting(job_id, transfers, slots, t, time.monotonic())
        with self._cond:
            if self._closed:
                self._results.append((job_id, False))
                return
            self._jobs.append(job)
            self._cond.notify_all()

    def poll(self) -> list[tuple[int, bool]]:
        """Jobs finished (copied, on CPU) or failed since the last poll, as ``(job_id, ok)``."""
        with self._cond:
            out, self._results = self._results, []
        return out

    def wait(self, job_ids: Sequence[int], timeout: float | None = None) -> bool:
        """Block until none of these jobs is still waiting (copied or failed on CPU, landed on
        accelerators), at most ``timeout`` seconds; True when none is."""
        wanted = set(job_ids)
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or not any(j.job_id in wanted for j in self._jobs), timeout)

    def take_ready(self) -> list[tuple[int, list[Transfer]]]:
        """Accelerators: jobs whose every chunk landed, to be submitted to the copy stream."""
        with self._cond:
            out, self._ready = self._ready, []
        return out

    def cancel(self, job_ids: Sequence[int]) -> list[int]:
        """Stop jobs whose destination blocks are about to change hands (the scheduler flushes
        them): they fail, and none of their copies runs after this returns. Returns the ids
        that were still waiting."""
        wanted = set(job_ids)
        with self._cond:
            hit = [j for j in self._jobs if j.job_id in wanted]
            for job in hit:
                job.cancelled = True
                self._jobs.remove(job)
                self._results.append((job.job_id, False))
            self._cond.notify_all()
        if hit:
            with self._copy_lock:
                pass
        return [j.job_id for j in hit]

    def close(self) -> None:
        """Stop watching; jobs still waiting fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    # ---- the watching thread ------------------------------------------------------------------

    def _run(self) -> None:
        name_this_thread()
        if self._copy is not None:
            # It copies on the host: off the single OpenMP core a CPU worker's threads inherit.
            widen_this_thread()
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._results.extend((j.job_id, False) for j in self._jobs)
                    self._jobs.clear()
                    return
                jobs = list(self._jobs)
            progressed = False
            for job in jobs:
                with self._copy_lock:
                    outcome = None if job.cancelled else self._advance(job)
                if outcome is None:
                    continue
                progressed = True
                with self._cond:
                    if job.cancelled:
                        continue
                    self._jobs.remove(job)
                    if outcome and self._copy is None:
                        self._ready.append((job.job_id, job.transfers))
                    else:
                        self._results.append((job.job_id, outcome))
                    self._cond.notify_all()  # wait()'s callers
            if not progressed:
                time.sleep(POLL_S)

    def _advance(self, job: _Waiting) -> bool | None:
        """Copy what landed; True when the job is complete, False when it failed, else None."""
        open_ = np.flatnonzero(~job.done)
        seen = self._board[job.slots[open_]]
        board_fence()  # no read of a slot below may see bytes older than its board entry
        tickets = job.tickets[open_]
        ended = (tickets == 0) | ((seen >> 1) >= tickets)
        if (ended & (tickets > 0) & (seen != tickets << 1)).any():
            logger.warning("kvstrata: load job %d: a chunk's promotion from a lower tier failed", job.job_id)
            return False
        for i in open_[ended]:
            if self._copy is not None:
                try:
                    self._copy(job.transfers[i])
                except Exception:
                    logger.exception("kvstrata: load job %d failed", job.job_id)
                    return False
            job.done[i] = True
        if job.done.all():
            return True
        if time.monotonic() - job.started > self._timeout_s:
            logger.warning("kvstrata: load job %d: chunks still not landed after %.0fs",
                           job.job_id, self._timeout_s)
            return False
        return None
