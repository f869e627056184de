"""Scheduler side, stores: which of a request's chunks each step offloads (full chunks, the
prompt's tail, the answer's tail at finish, the states the scheduler hands off at a boundary),
the host slots they go to, and the fences that keep their blocks from being reused before the
copy.

``StoreJobsMixin`` is one half of ``StrataScheduler`` (``connector/scheduler.py``), which holds
the state it reads and writes and the helpers it calls (``_prompt_tail_keys``, ``_geom``,
``_new_job``). What is storable comes from the pure ``semantics`` module.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from kvstrata import semantics
from kvstrata.connector.events import KVEvents
from kvstrata.connector.metadata import ChunkCopy, TransferJob
from kvstrata.connector.request_state import Job, RequestState
from kvstrata.connector.stats import StrataStats
from kvstrata.tiers.manager import TierManager


class StoreJobsMixin:
    """The store jobs of a step (``build_connector_meta`` sends them) and the hand-offs of
    requests that finished (``register_finished_partial_tail``)."""

    # The scheduler's state this half uses (set in StrataScheduler.__init__).
    layout: semantics.Layout
    hierarchy: TierManager
    events: KVEvents | None
    stats: StrataStats
    offload_prompt_only: bool
    _reqs: dict[str, RequestState]
    _jobs: dict[int, Job]
    _flush: set[int]
    _allocated: set[int]
    _block_jobs: dict[int, set[int]]
    _finished_hand_offs: list[TransferJob]

    if TYPE_CHECKING:  # the scheduler's helpers this half calls (defined in StrataScheduler)
        def _prompt_tail_keys(self, st: RequestState) -> dict[int, bytes] | None: ...
        def _tail_keys(self, st: RequestState, end: int) -> dict[int, bytes] | None: ...
        def _geom(self, index: int) -> semantics.GroupGeometry: ...
        def _new_job(self, st: RequestState, *, is_store: bool, keys: list[bytes]) -> int: ...

    def _prompt_tail_store_jobs(self, so: SchedulerOutput, *, refused: bool) -> list[TransferJob]:
        """Store the prompt's tail chunk in the step whose forward completes the prompt, or
        (``refused``) in a later one while decoding is still inside that chunk, when the host
        tier had no room."""
        if not self.layout.serves_prompt_tails:
            return []
        jobs: list[TransferJob] = []
        for req_id, scheduled in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            req = st.req
            if st.tail_store_refused is not refused:
                continue
            block_ids = {g: gs.block_ids for g, gs in st.groups.items()}
            if refused:
                transfers = semantics.plan_prompt_tail_store_again(
                    self.layout, num_prompt_tokens=req.num_prompt_tokens,
                    num_computed_tokens=req.num_computed_tokens, block_ids=block_ids,
                    tail_keys=self._prompt_tail_keys(st), max_offload_tokens=st.max_offload_tokens)
            elif semantics.completes_prompt(num_prompt_tokens=req.num_prompt_tokens,
                                            computed_before=req.num_computed_tokens,
                                            computed_after=req.num_computed_tokens + scheduled):
                transfers = semantics.plan_prompt_tail_store(
                    self.layout,
                    num_prompt_tokens=req.num_prompt_tokens,
                    computed_before=req.num_computed_tokens,
                    computed_after=req.num_computed_tokens + scheduled,
                    block_ids=block_ids,
                    tail_keys=self._prompt_tail_keys(st),
                    max_offload_tokens=st.max_offload_tokens,
                )
            else:
                continue  # every other step of the request: no tail to store
            tail_jobs = self._tail_store_jobs(st, transfers)
            if tail_jobs and refused:
                self.stats.late_tail_stores += 1
            st.tail_store_refused = tail_jobs is None
            jobs.extend(tail_jobs or ())
        return jobs

    def _tail_store_jobs(self, st: RequestState, transfers: list[Any]) -> list[TransferJob] | None:
        """One store job for a tail's chunk in every group when the host tier takes it (none
        when it holds them already); None when it has no room for them."""
        if not transfers:
            return []
        reserved = self._reserve(transfers)
        if reserved is None:
            return None
        chosen, slots = reserved
        return [self._store_job(st, chosen, slots)] if chosen else []

    def _answer_tail_store_jobs(self, so: SchedulerOutput) -> list[TransferJob]:
        """Store the chunk holding the end of a finished request's answer as a tail (with
        ``offload_prompt_only`` false): the next turn of the conversation starts with it."""
        if self.offload_prompt_only or not self.layout.serves_prompt_tails:
            return []
        jobs: list[TransferJob] = []
        for req_id in so.finished_req_ids or ():
            st = self._reqs.get(req_id)
            if st is None or st.req.status is RequestStatus.FINISHED_ABORTED:
                continue
            req = st.req
            end = self._offloadable(st, so)
            if end <= req.num_prompt_tokens:
                continue  # no KV past the prompt: the prompt's own tail covers it
            transfers = semantics.plan_answer_tail_store(
                self.layout, num_prompt_tokens=req.num_prompt_tokens, offloadable=end,
                block_ids={g: gs.block_ids for g, gs in st.groups.items()}, tail_keys=self._tail_keys(st, end))
            jobs.extend(self._tail_store_jobs(st, transfers) or ())
        return jobs

    def _offloadable(self, st: RequestState, so: SchedulerOutput) -> int:
        req = st.req
        return semantics.offloadable_tokens(
            num_computed=req.num_computed_tokens,
            num_scheduled=so.num_scheduled_tokens.get(req.request_id, 0),
            num_tokens=req.num_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
            finished=req.is_finished(),
            aborted=req.status is RequestStatus.FINISHED_ABORTED,
            offload_prompt_only=self.offload_prompt_only,
            max_offload_tokens=st.max_offload_tokens,
        )

    def _store_jobs(self, so: SchedulerOutput) -> list[TransferJob]:
        jobs: list[TransferJob] = []
        for req_id in chain(so.num_scheduled_tokens, so.finished_req_ids or ()):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            req = st.req
            offloadable = self._offloadable(st, so)
            next_stored_chunk = {g: gs.next_stored_chunk for g, gs in st.groups.items()}
            # Most steps of a request fill no new chunk (decode, a prefill slice short of one):
            # the full plan runs only where it could offer or advance something.
            if not semantics.store_pending(self.layout, offloadable=offloadable, finished=req.is_finished(),
                                           next_stored_chunk=next_stored_chunk):
                continue
            plan: dict[str, Any] = {
                "num_prompt_tokens": req.num_prompt_tokens,
                "next_stored_chunk": next_stored_chunk,
                "block_ids": {g: gs.block_ids for g, gs in st.groups.items()},
                "keys": {g: gs.keys for g, gs in st.groups.items()},
                "prompt_offloadable": semantics.offloadable_tokens(
                    num_computed=req.num_prompt_tokens, num_scheduled=0, num_tokens=req.num_tokens,
                    num_prompt_tokens=req.num_prompt_tokens, finished=False, aborted=False,
                    offload_prompt_only=self.offload_prompt_only, max_offload_tokens=st.max_offload_tokens,
                ),
                "shared_prefix_boundary": getattr(req, "shared_prefix_boundary", None),
            }
            candidates, next_stored = semantics.plan_store(
                self.layout, offloadable=offloadable, finished=req.is_finished(), **plan)
            if not candidates:
                self._advance(st, next_stored)
                continue
            reserved = self._reserve(candidates, count_failure=False)
            if reserved is None:
                # No room for the whole offer: store the longest start of it the room holds now
                # (a long prefill's offer could otherwise be refused at every step while the
                # write-behind holds room, and never reach the disk).
                candidates, next_stored = semantics.plan_store_within(
                    self.layout, self.hierarchy.store_room(), offloadable=offloadable, **plan)
                reserved = self._reserve(candidates, count_failure=False) if candidates else None
                if reserved is None:
                    self.stats.allocation_failures += 1
                    continue
                self.stats.stores_cut += 1
            chosen, slots = reserved
            self._advance(st, next_stored)
            if not chosen:
                continue
            job = self._store_job(st, chosen, slots)
            jobs.append(job)
        return jobs

    def _reserve(self, transfers: list[Any], *, count_failure: bool = True
                 ) -> tuple[list[Any], dict[bytes, int]] | None:
        """The transfers whose keys the host tier takes (not already stored), with their slots;
        None when it cannot allocate (an allocation failure, if ``count_failure``)."""
        slots = self.hierarchy.prepare_store([t.key for t in transfers])
        if slots is None:
            if count_failure:
                self.stats.allocation_failures += 1
            return None
        return [t for t in transfers if t.key in slots], slots

    def _advance(self, st: RequestState, next_stored: dict[int, int]) -> None:
        for g, n in next_stored.items():
            gs = st.groups[g]
            gs.next_stored_chunk = max(gs.next_stored_chunk, n)

    def _store_job(self, st: RequestState, chosen: list[Any], slots: dict[bytes, int]) -> TransferJob:
        copies = [ChunkCopy(c.group, slots[c.key], c.first_block_in_chunk, tuple(c.block_ids)) for c in chosen]
        job_id = self._new_job(st, is_store=True, keys=[c.key for c in chosen])
        self._record_stores(st, chosen)
        job = self._jobs[job_id]
        for c in chosen:
            geom = self._geom(c.group)
            # Windowed groups free blocks while the request runs: fence now. Others only when the
            # request finishes (until then the request's own reference keeps the blocks).
            if geom.kind is semantics.GroupKind.FULL:
                job.deferred_fence.extend(c.block_ids)
            else:
                job.fenced.extend(c.block_ids)
        for bid in job.fenced:
            self._block_jobs.setdefault(bid, set()).add(job_id)
        if st.req.is_finished():
            self._fence_deferred(job_id, job)
        self.stats.store_jobs += 1
        return TransferJob(job_id, st.req.request_id, True, copies)

    def _record_stores(self, st: RequestState, chosen: list[Any]) -> None:
        """KV events: snapshot the request for each complete chunk about to be stored (a
        prompt's tail or a partial tail has no complete chunk's payload and keeps the
        placeholder)."""
        if self.events is None or not self.events.self_describing:
            return
        for t in chosen:
            if st.groups[t.group].chunk_of.get(t.key) == t.chunk_index:
                self.events.record_store(st.req, t.group, t.chunk_index, t.key)

    def _fence_deferred(self, job_id: int, job: Job) -> None:
        for bid in job.deferred_fence:
            self._block_jobs.setdefault(bid, set()).add(job_id)
            if bid in self._allocated:
                self._flush.add(job_id)

    def _boundary_store_jobs(self, so: SchedulerOutput) -> list[TransferJob]:
        """States the scheduler hands off (R25): align-mode Mamba states at chunk boundaries
        (§3.8 B), and every group at a boundary inside a block (partial tails, §3.8 C)."""
        state = getattr(so, "kv_connector_block_state", None)
        offers = state.boundary_state_offloads if state else None
        if not offers:
            return []
        jobs = []
        for req_id, entries in offers.items():
            st = self._reqs.get(req_id)
            if st is not None:
                jobs.extend(self._hand_off_store_jobs(st, entries))
        return jobs

    def _hand_off_store_jobs(self, st: RequestState, entries: Sequence[tuple[int, int, int]]) -> list[TransferJob]:
        """Fenced store jobs for one request's hand-offs ``(group, block_id, boundary_tokens)``."""
        req = st.req
        jobs = []
        max_boundary = semantics.offloadable_tokens(
            num_computed=req.num_tokens, num_scheduled=0, num_tokens=req.num_tokens,
            num_prompt_tokens=req.num_prompt_tokens, finished=False, aborted=False,
            offload_prompt_only=self.offload_prompt_only, max_offload_tokens=st.max_offload_tokens,
        )
        for t in semantics.plan_boundary_stores(
            self.layout, entries, offloadable=max_boundary, block_hashes=req.block_hashes
        ):
            job = self._fenced_store_job(st, [t])
            if job is not None:
                jobs.append(job)
        tail_limit = req.num_prompt_tokens
        if st.max_offload_tokens is not None:
            tail_limit = min(tail_limit, st.max_offload_tokens)
        for transfers in semantics.plan_partial_tail_stores(
            self.layout, entries, block_ids={g: gs.block_ids for g, gs in st.groups.items()},
            block_hashes=req.block_hashes, max_boundary=tail_limit,
        ):
            job = self._fenced_store_job(st, transfers)
            if job is not None:
                jobs.append(job)
        return jobs

    def register_finished_partial_tail(
        self, request: Request, offers: Sequence[tuple[int, int, int]]
    ) -> bool:
        """A request ends at the replay boundary it was split at, before the next chunk's
        copy-on-write handed its Mamba state off: vLLM offers the state's table block now
        (producers only). The jobs go out with the next step's stores. Returns False: vLLM may
        free the blocks, since the jobs are fenced like every hand-off (a block given to another
        request is copied before that step's forward)."""
        st = self._reqs.get(request.request_id)
        if st is None or not offers:
            return False
        self._finished_hand_offs.extend(self._hand_off_store_jobs(st, offers))
        return False

    def _fenced_store_job(self, st: RequestState, transfers: list[Any]) -> TransferJob | None:
        """One store job for the transfers the store accepts, their blocks fenced at once (the
        scheduler's hand-off guarantees the bytes only until the blocks are reused)."""
        reserved = self._reserve(transfers)
        if reserved is None or not reserved[0]:
            return None
        chosen, slots = reserved
        job_id = self._new_job(st, is_store=True, keys=[t.key for t in chosen])
        self._record_stores(st, chosen)
        for t in chosen:
            self._jobs[job_id].fenced.extend(t.block_ids)
            for bid in t.block_ids:
                self._block_jobs.setdefault(bid, set()).add(job_id)
        copies = [ChunkCopy(t.group, slots[t.key], t.first_block_in_chunk, tuple(t.block_ids)) for t in chosen]
        self.stats.store_jobs += 1
        return TransferJob(job_id, st.req.request_id, True, copies)
