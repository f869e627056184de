"""Scheduler side of the connector: request state, jobs, fences — the semantics decide the rest.

Mirrors the job/fence machinery of vLLM's ``OffloadingConnectorScheduler`` (docs/SEMANTICS.md §3.8-3.9),
while *what* is servable and *what* is storable comes from the pure ``semantics`` module and *where*
chunks live comes from the tier ``Hierarchy``.

``StrataScheduler`` holds all the state and runs each step: request keys, the step's metadata and
its block bookkeeping, job completions, resets and stats. Its lookup and load planning live in
``connector/lookup.py`` (``LookupMixin``), its store planning in ``connector/store_jobs.py``
(``StoreJobsMixin``), the per-request records in ``connector/request_state.py``.
"""

from __future__ import annotations

import time
from itertools import chain
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import BlockHash, generate_block_hash_extra_keys, hash_block_tokens
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvstrata import semantics
from kvstrata.connector.events import KVEvents
from kvstrata.connector.lookup import LookupMixin
from kvstrata.connector.metadata import StrataMetadata, StrataWorkerMetadata, TransferJob
from kvstrata.connector.pieces import PieceLoadsMixin
from kvstrata.connector.plan import KVPlan
from kvstrata.connector.request_state import (
    SERVED_PARAM,
    GroupState,
    Job,
    RequestState,
    request_cap,
    served_by_tier,
)
from kvstrata.connector.stats import StrataStats
from kvstrata.connector.store_jobs import StoreJobsMixin
from kvstrata.tiers.hierarchy import TIER_DISK, TIER_REMOTE
from kvstrata.tiers.manager import TierManager

# Longest an empty engine step waits for promotions from disk (see StrataScheduler._idle_wait).
IDLE_WAIT_S = 0.02
# How long a request whose candidate prompt tails no tier held waits before the tiers are asked
# again (StrataScheduler._tail_extension_candidates).
EXTENSION_RECHECK_S = 0.5


class StrataScheduler(LookupMixin, StoreJobsMixin, PieceLoadsMixin):
    def __init__(
        self, plan: KVPlan, hierarchy: TierManager, *, offload_prompt_only: bool, prefix_caching: bool,
        stream_loads: bool = False, sync_loads: bool = False, sync_loads_wait_for_disk: bool = False,
        host_room_wait_s: float = 0.0, events: KVEvents | None = None,
        shutdown_write_timeout_s: float | None = None,
    ):
        self.plan = plan
        # How long shutdown() waits for the write-behind (StrataConfig.shutdown_write_timeout_s).
        self.shutdown_write_timeout_s = shutdown_write_timeout_s
        # KV cache events (None: the engine publishes none); self-describing payloads need each
        # chunk's request, so store plans and lookup hits are recorded as they happen.
        self.events = events
        # Disk hits are answered before their chunks landed and loaded as they land (see
        # Hierarchy.prepare_streamed_load); only under kv_load_failure_policy="recompute".
        self.stream_loads = stream_loads
        # Hits wholly in the host tier are loaded before the forward of the step that computes
        # their request (StrataConfig.sync_loads; vLLM's load_kv_async False).
        self.sync_loads = sync_loads
        # ... also streamed ones whose chunks are still landing (the worker waits: CPU engines).
        self.sync_loads_wait_for_disk = sync_loads_wait_for_disk
        # How long a lookup may wait for host-tier room to promote what a lower tier holds
        # (StrataConfig.host_room_wait_s), from its first lookup.
        self.host_room_wait_s = host_room_wait_s
        self._streaming: set[int] = set()  # streamed load jobs (their keys: self._jobs)
        self.layout = plan.layout
        self.hierarchy = hierarchy
        self.offload_prompt_only = offload_prompt_only
        self.num_workers = plan.world_size
        self._reqs: dict[str, RequestState] = {}
        self._jobs: dict[int, Job] = {}
        self._next_job = 0
        self._stale_below = 0
        # Jobs in flight when the cache was reset: their completions only release host slots.
        self._stale: dict[int, Job] = {}
        self._loads: list[TransferJob] = []
        # Hand-offs of requests that finished (register_finished_partial_tail): next step's stores.
        self._finished_hand_offs: list[TransferJob] = []
        self._flush: set[int] = set()
        self._allocated: set[int] = set()
        self._block_jobs: dict[int, set[int]] = {}
        self._being_loaded: set[bytes] | None = set() if prefix_caching else None
        self._windowed = tuple(g.index for g in self.layout.groups if g.kind is not semantics.GroupKind.FULL)
        self.stats = StrataStats()
        self._tiers_at = 0.0
        self._awaiting: set[str] = set()  # requests whose lookup waits on st.awaiting
        self._pieced: dict[str, None] = {}  # requests with pieces of a load still to load
        self._step_lookups = 0  # lookups in this scheduling step so far
        self._unallocated_hits: dict[str, None] = {}
        self._block_hash_fn: Any = None  # vLLM's prefix-caching hash, for prompt-tail keys

    # ---------------------------------------------------------------- requests
    def on_new_request(self, request: Request) -> None:
        self._reqs[request.request_id] = RequestState(
            req=request,
            groups={g.index: GroupState() for g in self.layout.groups},
            max_load_tokens=request_cap(request, "max_load_tokens"),
            max_offload_tokens=request_cap(request, "max_offload_tokens"),
        )

    def _refresh_keys(self, st: RequestState) -> None:
        hashes = st.req.block_hashes
        indexed = self.events is not None and self.events.self_describing
        for geom in self.layout.groups:
            gs = st.groups[geom.index]
            start = len(gs.keys)
            gs.keys.extend(semantics.chunk_keys(hashes, geom, start=start))
            if indexed and geom.kind is semantics.GroupKind.FULL:
                gs.chunk_of.update((gs.keys[i], i) for i in range(start, len(gs.keys)))

    def _prompt_tail_keys(self, st: RequestState) -> dict[int, bytes] | None:
        """Per group, the key of the prompt's partial last chunk: vLLM's block hash of its tokens
        chained to the prefix, with the same extra keys (LoRA, multimodal, salt, embeddings) a
        full block there would get. None when the layout or the prompt has no tail."""
        if st.prompt_tail_hashed:
            return st.prompt_tail_keys
        req = st.req
        if semantics.prompt_tail_start(self.layout, req.num_prompt_tokens) is None:
            st.prompt_tail_hashed = True  # never: no tail, or not served for this layout
            return None
        keys = self._tail_keys(st, req.num_prompt_tokens)
        if keys is None:
            return None  # the prefix's block hashes are not all there yet
        st.prompt_tail_keys = keys
        st.prompt_tail_hashed = True
        return st.prompt_tail_keys

    def _tail_keys(self, st: RequestState, end: int) -> dict[int, bytes] | None:
        """Per group, the tail key of the request's tokens from the chunk start below ``end`` to
        ``end`` (``semantics.prompt_tail_keys``: what a prompt of ``end`` tokens is stored
        under); None without such a tail, or while the hash ending at its start is not there."""
        req = st.req
        return semantics.prompt_tail_keys(
            self.layout, req.block_hashes, end, lambda parent, start: self._hash_span(req, parent, start, end))

    def _tail_extension_candidates(
        self, st: RequestState, start: int, lengths: range
    ) -> list[tuple[int, dict[int, bytes]]]:
        """The stored tails a longer prompt could be served from (``semantics.tail_extension``):
        per length in ``lengths`` (longest first), the key every group would store a prompt of
        ``start + t`` tokens' tail under, kept only where some tier holds the first group's.
        The hashes are computed once per request and chunk start (a waiting request is looked
        up again every step); the tiers are asked again (a tail may have landed since), but at
        most every ``EXTENSION_RECHECK_S`` while they held none: with a shared tier each ask is
        a round trip on the scheduler's path."""
        now = time.monotonic()
        if st.extension_start != start:
            st.extension_start, st.extension_tails, st.extension_none_at = start, {}, None
        elif st.extension_none_at is not None and now - st.extension_none_at < EXTENSION_RECHECK_S:
            return []
        tails = st.extension_tails
        for t in lengths:
            if t not in tails:
                keys = self._tail_keys(st, start + t)
                if keys is None:
                    return []  # the hash ending at the chunk start is not there yet
                tails[t] = keys
        first = self.layout.groups[0].index
        held = self.hierarchy.holds_many([tails[t][first] for t in lengths])
        found = [(t, tails[t]) for t, h in zip(lengths, held, strict=True) if h]
        st.extension_none_at = None if found else now
        return found

    def _hash_span(self, req: Request, parent: bytes | None, start: int, end: int) -> bytes:
        """vLLM's ``hash_block_tokens`` of the request's tokens ``start:end`` chained to ``parent``
        (the hash ending at ``start``, None at 0), with the extra keys a full block there gets."""
        if self._block_hash_fn is None:
            self._block_hash_fn = get_hash_fn_by_name(self.plan.identity.hash_algo)
        extra, _ = generate_block_hash_extra_keys(req, start, end, 0)
        parent_hash = None if parent is None else BlockHash(parent)
        return bytes(hash_block_tokens(self._block_hash_fn, parent_hash, req.all_token_ids[start:end], extra))

    def _geom(self, index: int) -> semantics.GroupGeometry:
        for g in self.layout.groups:
            if g.index == index:
                return g
        raise KeyError(index)

    def _new_job(self, st: RequestState, *, is_store: bool, keys: list[bytes]) -> int:
        job_id = self._next_job
        self._next_job += 1
        assert is_store or not st.jobs, "a load is never concurrent with other jobs (R34)"
        st.jobs.add(job_id)
        self._jobs[job_id] = Job(st.req.request_id, is_store, keys, self.num_workers)
        return job_id

    # ------------------------------------------------------------------- steps
    def build_connector_meta(self, so: SchedulerOutput) -> StrataMetadata:
        if self._unallocated_hits:
            self.hold_unallocated_hits()
        self._update_block_ids(so)
        for req_id in so.preempted_req_ids or ():
            st = self._reqs.get(req_id)
            if st is not None:
                self._flush.update(st.jobs)
        if self._block_jobs and not self._block_jobs.keys().isdisjoint(self._allocated):
            for bid in self._allocated & self._block_jobs.keys():
                self._flush.update(self._block_jobs[bid])
        # Room freed since the last step goes to loads in pieces first: their requests wait for
        # them, while a store can take the room left (cut to it) and offer the rest later.
        if self._pieced:
            self._load_next_pieces()
        # A prompt's tail refused for want of room goes before the chunks: it can be stored only
        # while decoding is inside its chunk, a full-attention chunk until its request finishes.
        # In the step that completes the prompt the chunks go first (a tail serves only after them).
        stores = (self._finished_hand_offs + self._boundary_store_jobs(so)
                  + self._prompt_tail_store_jobs(so, refused=True) + self._store_jobs(so)
                  + self._prompt_tail_store_jobs(so, refused=False) + self._answer_tail_store_jobs(so))
        self._finished_hand_offs = []
        meta = StrataMetadata(loads=self._loads, stores=stores, flush=self._flush)
        for req_id in so.finished_req_ids or ():
            self._awaiting.discard(req_id)
            st = self._reqs.get(req_id)
            if st is None:
                continue
            st.finished_signaled = True
            if not st.jobs and st.pieces is None:
                del self._reqs[req_id]
        self._loads, self._flush, self._allocated = [], set(), set()
        self._step_lookups = 0
        # vLLM's scheduling of this step is done: the reads this step's lookups started run
        # now, beside the forward rather than inside the scheduler's critical path.
        self.hierarchy.launch_deferred_promotions()
        if ((self._awaiting or self._streaming or self._pieced) and not meta.loads
                and not so.total_num_scheduled_tokens):
            self._idle_wait()
        return meta

    def _idle_wait(self) -> None:
        """This step schedules nothing and requests wait on promotions from disk (or for
        host-tier room to start them): give them up to ``IDLE_WAIT_S`` to land rather than
        letting the engine spin through empty steps.

        Each empty step is a round trip to every worker, and on a small machine the spinning
        engine takes the cores the promotions' decompression needs. A request that arrives
        meanwhile waits at most that long; one promotion landing ends the wait.
        """
        awaited: list[bytes] = []
        for req_id in list(self._awaiting):
            st = self._reqs.get(req_id)
            if st is None or not st.awaiting:
                self._awaiting.discard(req_id)
                continue
            awaited.extend(st.awaiting)
        # Streamed loads wait on their chunks' promotions in the workers: the same wait applies.
        keys = awaited + [key for job_id in self._streaming for key in self._jobs[job_id].keys]
        if keys and self.hierarchy.in_flight(keys):
            self.hierarchy.wait_promotions(keys, IDLE_WAIT_S)
        elif awaited or any(not st.jobs for st in map(self._reqs.get, self._pieced) if st is not None):
            # Lookups waiting for host-tier room (host_room_wait_s), or loads whose next piece
            # waits for it: writes behind and the other loads free it.
            time.sleep(IDLE_WAIT_S)

    def _update_block_ids(self, so: SchedulerOutput) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        prev_len: dict[str, dict[int, int]] = {}
        for req_id, new_blocks, preempted in yield_req_data(so):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            self._refresh_keys(st)
            if preempted:
                for gs in st.groups.values():
                    gs.block_ids.clear()
            if new_blocks:
                prev_len[req_id] = {g: len(st.groups[g].block_ids) for g in self._windowed}
                for geom in self.layout.groups:
                    ids = new_blocks[geom.index]
                    st.groups[geom.index].block_ids.extend(ids)
                    self._allocated.update(b for b in ids if b != 0)
        for copy in getattr(so, "kv_cache_block_copies", None) or ():
            self._allocated.add(copy.dst_block_id)
        # Windowed groups free blocks while a request runs; a block freed and re-allocated to
        # anyone this step no longer holds this request's KV: zero its pending-store positions.
        if self._windowed and self._allocated:
            bpc = self.plan.blocks_per_chunk
            for req_id, st in self._reqs.items():
                ends = prev_len.get(req_id)
                for g in self._windowed:
                    gs = st.groups[g]
                    end = ends[g] if ends is not None else len(gs.block_ids)
                    for j in range(gs.next_stored_chunk * bpc, end):
                        if gs.block_ids[j] in self._allocated:
                            gs.block_ids[j] = 0

    # ------------------------------------------------------------- completions
    def update_connector_output(self, out: KVConnectorOutput) -> None:
        meta = out.kv_connector_worker_meta
        if not isinstance(meta, StrataWorkerMetadata):
            return
        self.stats.record_transfers(meta)
        done = dict(meta.completed)
        for job_id, n in meta.failed.items():
            done[job_id] = done.get(job_id, 0) + n
        for job_id, n in done.items():
            if job_id < self._stale_below or job_id not in self._jobs:
                self._finish_stale(job_id, n)
                continue
            job = self._jobs[job_id]
            job.pending -= n
            # A rank that failed in an earlier step than the others finished: the job failed.
            job.failed |= job_id in meta.failed
            if job.pending > 0:
                continue
            self._finish_job(job_id, job, not job.failed)

    def _finish_stale(self, job_id: int, n: int) -> None:
        """A job from before a cache reset finished on ``n`` more workers: once all are done,
        unpin its loads' slots and drop its stores (KV stored across a reset — e.g. one for new
        weights — must not be served)."""
        job = self._stale.get(job_id)
        if job is None:
            return
        job.pending -= n
        if job.pending > 0:
            return
        del self._stale[job_id]
        if job.is_store:
            self.hierarchy.complete_store(job.keys, success=False)
        else:
            self.hierarchy.complete_load(job.keys)

    def _finish_job(self, job_id: int, job: Job, ok: bool) -> None:
        st = self._reqs.get(job.req_id)
        if job.is_store:
            self.hierarchy.complete_store(job.keys, success=ok)
            if not ok:
                self.stats.store_failures += 1
        else:
            self.hierarchy.complete_load(job.keys)
            self._streaming.discard(job_id)
            if self._being_loaded:
                self._being_loaded.difference_update(job.keys)
            if job.partial:  # a piece of a longer load: counted with its last
                if not ok and st is not None and st.pieces is not None:
                    st.pieces.failed = True
            elif ok:
                tokens, lower = job.hit
                self.stats.hit_tokens += tokens
                self.stats.hit_tokens_disk += lower.get(TIER_DISK, 0)
                self.stats.hit_tokens_remote += lower.get(TIER_REMOTE, 0)
                self.stats.hit_tokens_host += tokens - sum(lower.values())
                if st is not None:
                    st.served = served_by_tier(tokens, lower)
            else:
                self.stats.load_failures += 1
                if st is not None:
                    if job.served_before is not None:  # a synchronous load said so at once
                        st.served = job.served_before
                    # vLLM recomputes what the load was to bring, after a new lookup whose hit
                    # (possibly none) sets the scan again: until then, store from the start
                    # (chunks already stored are skipped by prepare_store).
                    for gs in st.groups.values():
                        gs.next_stored_chunk = 0
        for bid in chain(job.fenced, job.deferred_fence):
            jobs = self._block_jobs.get(bid)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._block_jobs[bid]
        del self._jobs[job_id]
        if st is not None:
            st.jobs.discard(job_id)
            if st.finished_signaled and not st.jobs and st.pieces is None:
                del self._reqs[job.req_id]

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._awaiting.discard(request.request_id)
        self._unallocated_hits.pop(request.request_id, None)
        st = self._reqs.get(request.request_id)
        if st is None:
            return False, None
        st.hit_found = None
        if st.held:
            self._release_held(st)
        if st.pieces is not None:  # aborted while its load came in pieces: vLLM still waits
            st.pieces.failed = True  # for the load to end before it frees the blocks
        # The final hash may have just appeared: the next build_connector_meta stores the tail
        # (finish-time tail promotion, R29/R38).
        self._refresh_keys(st)
        for job_id in st.jobs:
            job = self._jobs[job_id]
            for bid in job.deferred_fence:
                self._block_jobs.setdefault(bid, set()).add(job_id)
        return False, ({SERVED_PARAM: dict(st.served)} if st.served else None)

    def has_pending_push_work(self) -> bool:
        return bool(self._jobs)

    def reset_cache(self) -> None:
        """``reset_prefix_cache(reset_connector=True)``: forget the host tier and in-flight jobs.

        The disk tier is a persistent store and survives (``kvstrata purge`` empties it).
        """
        self._flush.update(self._jobs)
        self._awaiting.clear()
        self._unallocated_hits.clear()
        for req_id, st in list(self._reqs.items()):
            if st.req.is_finished():
                del self._reqs[req_id]
        for st in self._reqs.values():
            st.jobs.clear()
            st.awaiting = []
            if st.held:
                self._release_held(st)
            st.partial_boundary = None
            st.queued = set()
            if st.pieces is not None:  # vLLM still waits for the load: its last job fails it
                st.pieces.failed = True
            for gs in st.groups.values():
                gs.next_stored_chunk = 0
        self._stale_below = self._next_job
        self._stale.update(self._jobs)
        self._jobs.clear()
        self._streaming.clear()
        self._block_jobs.clear()
        if self._being_loaded is not None:
            self._being_loaded.clear()
        self.hierarchy.reset()

    def take_events(self) -> list[Any]:
        """vLLM KV cache events for what entered or left kvstrata's tiers since the last call
        (empty unless the engine has KV cache events on)."""
        changes = self.hierarchy.take_events()
        return self.events.translate(changes) if changes and self.events is not None else []

    def take_stats(self) -> StrataStats | None:
        # vLLM asks every step; tier figures (which read the store) are refreshed once a second.
        now = time.monotonic()
        if now - self._tiers_at >= 1.0:
            self._tiers_at = now
            self.stats.tiers = self._tier_snapshot()
        out, self.stats = self.stats, StrataStats()
        return out

    def _tier_snapshot(self) -> dict[str, int | float]:
        """Flat per-tier figures for the stats gauges (cumulative, newest wins)."""
        h = self.hierarchy.stats()
        host = h.get("host", {})
        out: dict[str, int | float] = {
            "host_chunks": int(host.get("used", 0)),
            "host_bytes": int(host.get("used", 0)) * self.plan.slot_bytes,
            "promotions": int(h.get("promotions_completed", 0)),
            "warm_promotions": int(h.get("warm_promotions", 0)),
            "writes_behind": int(h.get("writes_completed", 0)),
            "promotions_no_room": int(h.get("promote_no_room", 0)),
            "promotion_room_waits": int(h.get("promote_room_waits", 0)),
            "promotions_queued": int(h.get("promote_queued", 0)),
            "waiting_holds": int(h.get("waiting_holds", 0)),
            "promotions_unused": int(h.get("promotions_unused", 0)),
        }
        r = h.get("tiers", {}).get(TIER_REMOTE)
        if r is not None and "error" not in r:
            out.update(
                remote_available=int(r["available"]), remote_read_bytes=int(r["get_bytes"]),
                remote_written_bytes=int(r["put_bytes"]), remote_hits=int(r["get_hits"]),
                remote_errors=int(r["errors"]) + int(r["unavailable"]),
                remote_unavailable_skips=int(r["skipped_unavailable"]),
                remote_corrupt=int(r["corrupt"]), remote_forged=int(r.get("forged", 0)),
                # Not written: the backlog was full, or the server did not take them.
                remote_writes_dropped=int(r.get("writes_dropped", 0)) + int(r.get("writes_failed", 0)),
            )
        d = h.get("tiers", {}).get(TIER_DISK)
        if d is not None and "error" not in d:
            out.update(
                disk_entries=int(d["entries"]), disk_raw_bytes=int(d["raw_bytes"]),
                disk_stored_bytes=int(d["stored_bytes"]), disk_evictions=int(d.get("evictions", 0)),
                # Chunks that never reached the disk: refused by it (full, or its file system at
                # the reserve with nothing to evict), or postponed by the write-behind and evicted
                # from the host tier before their write.
                disk_admission_drops=int(d.get("admission_drops", 0)) + int(d.get("reserve_drops", 0))
                + int(d.get("writes_lost", 0)),
                disk_errors=int(d.get("sync_errors", 0)) + int(d.get("writes_failed", 0)),
                disk_corrupt=int(d.get("corrupt", 0)) + int(h.get("promotions_failed", 0)),
                disk_forged=int(d.get("forged", 0)),
                disk_reserve_capped=int(d.get("reserve_cap_bytes") is not None),
                disk_writes_urgent=int(d.get("writes_urgent", 0)),
                disk_write_reuse=float(d.get("write_reuse", 0.0)),
            )
        return out

    def shutdown(self) -> None:
        self.hierarchy.close(self.shutdown_write_timeout_s)
