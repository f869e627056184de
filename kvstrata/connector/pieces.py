"""Scheduler side, loads brought in pieces: a hit larger than the host tier's room.

A streamed lookup answers HIT for chunks a lower tier holds even when the host tier has no room
to promote them (``Hierarchy.lookup_many``'s ``queued``), so that vLLM allocates the whole hit's
blocks and the request waits for its remote KVs. Its load then runs as a chain of jobs, one in
flight at a time: each piece is promoted into the host tier, copied to the device and unpinned
when the workers report it, which frees the room the next piece is promoted into. Only the last
piece reports the request to vLLM (``TransferJob.partial``); if a piece fails, a chunk left every
tier, the request finished or the cache was reset, the last job is one that fails (one copy with
ticket -1 on every worker), so that vLLM recomputes the request (or frees the blocks of one that
finished) exactly as after any failed load.

``PieceLoadsMixin`` is a part of ``StrataScheduler`` (``connector/scheduler.py``), which holds the
state it reads and writes.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvstrata import semantics
from kvstrata.connector.metadata import ChunkCopy, TransferJob
from kvstrata.connector.request_state import Job, PieceLoad, RequestState
from kvstrata.connector.stats import StrataStats
from kvstrata.presence import Presence
from kvstrata.tiers.manager import TierManager

logger = logging.getLogger(__name__)


class PieceLoadsMixin:
    """The pieces after the first of loads larger than the host tier's room."""

    # The scheduler's state this part uses (set in StrataScheduler.__init__).
    layout: semantics.Layout
    hierarchy: TierManager
    stats: StrataStats
    host_room_wait_s: float
    _reqs: dict[str, RequestState]
    _jobs: dict[int, Job]
    _loads: list[TransferJob]
    _streaming: set[int]
    _being_loaded: set[bytes] | None
    # Requests with pieces still to load, in the order their loads began (a dict as an
    # ordered set: the oldest load gets the room first).
    _pieced: dict[str, None]

    if TYPE_CHECKING:  # the scheduler's helper this part calls (defined in StrataScheduler)
        def _new_job(self, st: RequestState, *, is_store: bool, keys: list[bytes]) -> int: ...

    def _load_next_pieces(self) -> None:
        """Each step, before the step's loads are handed to the workers: the next piece of each
        load whose previous piece is done, as far as the host tier has room (the lower tiers are
        asked about as many chunks as it has room for: a load may be thousands of chunks, and
        one waiting for room is looked at every step)."""
        room = self.hierarchy.host_room()
        # Whether some load is in flight (a piece, the last one included, or a load not in
        # pieces): its slots come back when it ends, so waiting for room is then not timed
        # (``_wait_for_room``).
        moving = any(not job.is_store for job in self._jobs.values())
        for req_id in list(self._pieced):
            st = self._reqs.get(req_id)
            pieces = None if st is None else st.pieces
            if st is None or pieces is None:
                del self._pieced[req_id]
                continue
            if st.jobs:  # its previous piece is still loading
                continue
            if pieces.failed:
                self._fail_pieces(st)
                continue
            if room <= 0:  # none yet: asked again next step (ending failed loads goes on)
                self._wait_for_room(st, pieces, timed=not moving)
                continue
            ahead = pieces.transfers[:room]
            still: set[bytes] = set()
            answers = self.hierarchy.promote_queued([t.key for t in ahead], st.promoted, still)
            if Presence.MISS in answers:  # a chunk no tier holds any more: the load fails
                self._fail_pieces(st)
                continue
            # HIT: in the host tier or on its way into it, unless queued again (no room yet);
            # PENDING: another request's store of it is in flight, asked again next step.
            ready = {i for i, (t, a) in enumerate(zip(ahead, answers, strict=True))
                     if a is Presence.HIT and t.key not in still}
            if ready:
                pieces.transfers = [t for i, t in enumerate(pieces.transfers) if i not in ready]
                pieces.waiting_since = None
                self._start_piece(st, [ahead[i] for i in sorted(ready)])
                self.stats.load_pieces += 1
                room = self.hierarchy.host_room()
                moving = True
            else:
                self._wait_for_room(st, pieces, timed=not moving)

    def _room_for_pieces(self) -> int:
        """Host slots the loads in pieces still need: other requests' lookups leave them (the
        lookups run first in a step, and would otherwise take every slot these loads free, so
        that the loads wait, each holding vLLM's blocks, until they are given up)."""
        need = 0
        for req_id in self._pieced:
            st = self._reqs.get(req_id)
            if st is not None and st.pieces is not None:
                need += len(st.pieces.transfers)
        return need

    def _wait_for_room(self, st: RequestState, pieces: PieceLoad, timed: bool) -> None:
        """The next piece found no room. A load in flight gives its slots back when it ends
        (not ``timed``); otherwise room comes back only as stores, writes behind and waiting
        requests let go of slots, which a saturated CPU (background threads) or vLLM's
        scheduling (a waiting request's held chunks) may hold up: a load that waited so for
        ``host_room_wait_s`` (at least one step) is ended failed, and its request computes what
        does not fit from then on (``RequestState.no_pieces``), as it did before loads came in
        pieces, rather than wait on."""
        if not timed:
            pieces.waiting_since = None
            return
        now = time.monotonic()
        if pieces.waiting_since is None:
            pieces.waiting_since = now
        elif now - pieces.waiting_since >= self.host_room_wait_s:
            st.no_pieces = True
            self.stats.pieced_loads_given_up += 1
            self._log_given_up(st, pieces, now - pieces.waiting_since)
            self._fail_pieces(st)

    def _log_given_up(self, st: RequestState, pieces: PieceLoad, waited: float) -> None:
        """Say what held the host tier: a sign ``host_bytes`` is small for the loads (a warning:
        vLLM's logging shows no INFO of other packages)."""
        h = self.hierarchy.stats()
        host = h.get("host", {})
        logger.warning(
            "kvstrata: request %s: %d chunks left to load waited %.1f s for host room with no "
            "load in flight; computing them (a larger host_bytes would fit such loads). Host "
            "slots %s, referenced %s: held for waiting requests %s, stores in flight %s, "
            "promotions %s, write-behind %s bytes in flight and %s deferred",
            st.req.request_id, len(pieces.transfers), waited, host.get("slots"), host.get("referenced"),
            h.get("chunks_held"), h.get("stores_inflight"), h.get("promotions_inflight"),
            h.get("write_inflight_bytes"), h.get("write_deferred_bytes"))

    def _start_piece(self, st: RequestState, transfers: list[semantics.ChunkTransfer],
                     copies: list[ChunkCopy] | None = None) -> None:
        """One piece's load job (``copies``: its chunk copies, when already prepared): the last
        one when no transfer is left after it, which counts the whole load's hit."""
        pieces = st.pieces
        assert pieces is not None
        keys = [t.key for t in transfers]
        if copies is None:
            placed = self.hierarchy.prepare_streamed_load(keys)
            copies = [ChunkCopy(t.group, slot, t.first_block_in_chunk, tuple(t.block_ids), ticket)
                      for t, (slot, ticket) in zip(transfers, placed, strict=True)]
        last = not pieces.transfers
        job_id = self._new_job(st, is_store=False, keys=keys)
        job = self._jobs[job_id]
        if last:
            job.hit = pieces.hit
            st.pieces = None
            self._pieced.pop(st.req.request_id, None)
        else:
            job.partial = True
        self._loads.append(TransferJob(job_id, st.req.request_id, False, copies, partial=not last))
        self._streaming.add(job_id)

    def _fail_pieces(self, st: RequestState) -> None:
        """End a load brought in pieces with a job that fails on every worker."""
        pieces = st.pieces
        assert pieces is not None
        if self._being_loaded:
            self._being_loaded.difference_update(t.key for t in pieces.transfers)
        st.pieces = None
        self._pieced.pop(st.req.request_id, None)
        job_id = self._new_job(st, is_store=False, keys=[])
        failing = ChunkCopy(self.layout.groups[0].index, 0, 0, (), -1)
        self._loads.append(TransferJob(job_id, st.req.request_id, False, [failing]))
