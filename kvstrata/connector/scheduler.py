"""Scheduler side of the connector: request state, jobs, fences — the semantics decide the rest.

Mirrors the job/fence machinery of vLLM's ``OffloadingConnectorScheduler`` (docs/SEMANTICS.md §3.8-3.9),
while *what* is servable and *what* is storable comes from the pure ``semantics`` module and *where*
chunks live comes from the tier ``Hierarchy``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvstrata import semantics
from kvstrata.connector.events import KVEvents
from kvstrata.connector.metadata import (
    ChunkCopy,
    StrataMetadata,
    StrataWorkerMetadata,
    TransferJob,
)
from kvstrata.connector.plan import KVPlan
from kvstrata.connector.stats import StrataStats
from kvstrata.presence import Presence
from kvstrata.tiers.hierarchy import TIER_DISK, TIER_REMOTE, chunk_group
from kvstrata.tiers.manager import TierManager

logger = logging.getLogger(__name__)


@dataclass
class _GroupState:
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_stored_chunk: int = 0
    # key -> chunk index, kept only for self-describing KV events
    chunk_of: dict[bytes, int] = field(default_factory=dict)


@dataclass
class _RequestState:
    req: Request
    groups: dict[int, _GroupState]
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    num_local: int = 0
    jobs: set[int] = field(default_factory=set)
    finished_signaled: bool = False
    # keys a lookup of this request found only in a lower tier (promoted), with that tier's
    # name: for per-tier hit attribution
    promoted: dict[bytes, str] = field(default_factory=dict)
    load_keys: list[tuple[int, int, bytes]] = field(default_factory=list)  # (start, end, key)
    lookup_started: float | None = None
    hit_sources: dict[CacheHitSource, int] = field(default_factory=dict)
    # Chunks the last (deferred) lookup found still on their way into the host tier: until one
    # of them lands, the same lookup would defer again, so it is not re-run.
    awaiting: list[bytes] = field(default_factory=list)
    # Where the last lookup's hit ends inside a block (a partial tail, R30), for the load plan.
    partial_boundary: int | None = None
    # The prompt's tail keys per group (semantics.prompt_tail), hashed once on first use; and
    # whether the last lookup's hit includes the tail.
    prompt_tail_keys: dict[int, bytes] | None = None
    prompt_tail_hashed: bool = False
    prompt_tail_hit: bool = False


@dataclass
class _Job:
    req_id: str
    is_store: bool
    keys: list[bytes]
    pending: int
    fenced: list[int] = field(default_factory=list)
    deferred_fence: list[int] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.monotonic)
    # loads: (tokens, of which promoted from each lower tier), counted on success
    hit: tuple[int, dict[str, int]] = field(default_factory=lambda: (0, {}))
    failed: bool = False  # some worker reported it failed (the others may report later)


# Longest an empty engine step waits for promotions from disk (see StrataScheduler._idle_wait).
IDLE_WAIT_S = 0.02

# Where vLLM's per-source hit figures put each lower tier; the farther tier wins a token range
# loaded from chunks of several tiers. vLLM has no "remote" source: a remote store is
# EXTERNAL_UNSPECIFIED in its enum (vllm/v1/metrics/cache_hit_source.py).
_HIT_SOURCE = {TIER_DISK: CacheHitSource.DISK, TIER_REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}
_TIER_RANK = {TIER_DISK: 1, TIER_REMOTE: 2}


def _request_cap(req: Request, name: str) -> int | None:
    params = req.kv_transfer_params
    raw = params.get(name) if params else None
    if raw is None:
        return None
    if type(raw) is int and raw >= 0:
        return raw
    logger.warning("kvstrata: kv_transfer_params[%r] must be a non-negative int, got %r; ignoring", name, raw)
    return None


class StrataScheduler:
    def __init__(
        self, plan: KVPlan, hierarchy: TierManager, *, offload_prompt_only: bool, prefix_caching: bool,
        stream_loads: bool = False, events: KVEvents | None = None,
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
        self._streaming: set[int] = set()  # streamed load jobs (their keys: self._jobs)
        self.layout = plan.layout
        self.hierarchy = hierarchy
        self.offload_prompt_only = offload_prompt_only
        self.num_workers = plan.world_size
        self._reqs: dict[str, _RequestState] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_job = 0
        self._stale_below = 0
        # Jobs in flight when the cache was reset: their completions only release host slots.
        self._stale: dict[int, _Job] = {}
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
        self._block_hash_fn: Any = None  # vLLM's prefix-caching hash, for prompt-tail keys

    # ---------------------------------------------------------------- requests
    def on_new_request(self, request: Request) -> None:
        self._reqs[request.request_id] = _RequestState(
            req=request,
            groups={g.index: _GroupState() for g in self.layout.groups},
            max_load_tokens=_request_cap(request, "max_load_tokens"),
            max_offload_tokens=_request_cap(request, "max_offload_tokens"),
        )

    def _refresh_keys(self, st: _RequestState) -> None:
        hashes = st.req.block_hashes
        indexed = self.events is not None and self.events.self_describing
        for geom in self.layout.groups:
            gs = st.groups[geom.index]
            start = len(gs.keys)
            gs.keys.extend(semantics.chunk_keys(hashes, geom, start=start))
            if indexed and geom.kind is semantics.GroupKind.FULL:
                gs.chunk_of.update((gs.keys[i], i) for i in range(start, len(gs.keys)))

    # ------------------------------------------------------------------ lookup
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        st = self._reqs[request.request_id]
        for gs in st.groups.values():
            gs.block_ids.clear()
        if st.jobs:  # R15: a preempted request's stores are still in flight
            return None, False
        self._refresh_keys(st)
        st.num_local = num_computed_tokens
        if request.skip_reading_prefix_cache:
            return 0, False
        if st.lookup_started is None:
            st.lookup_started = time.monotonic()
        if st.awaiting and self.hierarchy.in_flight(st.awaiting):
            self.stats.lookup_deferrals += 1
            return None, False
        pending: list[bytes] = []
        # Chunks this lookup answered HIT so far: a later probe of the same lookup (another
        # group, a tail) must not evict them to make room for a promotion.
        answered: set[bytes] = set()

        def probe(keys: Iterable[bytes], prefix: bool = False) -> list[Presence]:
            keys = list(keys)
            answers = list(self.hierarchy.lookup_many(
                keys, st.promoted, stream=self.stream_loads, prefix=prefix, protect=answered))
            answered.update(k for k, a in zip(keys, answers, strict=True) if a is Presence.HIT)
            pending.extend(k for k, a in zip(keys, answers, strict=True) if a is Presence.PENDING)
            if self.events is not None and self.events.self_describing:
                self._record_lookup_hits(st, keys, answers)
            return answers

        def probe_prefix(keys: Iterable[bytes]) -> list[Presence]:
            return probe(keys, prefix=True)

        hit = semantics.lookup_hit(
            self.layout,
            num_tokens=request.num_tokens,
            local_computed=num_computed_tokens,
            keys={g: gs.keys for g, gs in st.groups.items()},
            probe=probe,
            max_new_tokens=max_num_new_tokens,
            max_load_tokens=st.max_load_tokens,
            being_loaded=None if self._being_loaded is None else self._being_loaded.__contains__,
            probe_prefix=probe_prefix,
        )
        hit, st.partial_boundary = semantics.partial_tail_hit(
            self.layout,
            complete_hit=hit,
            num_prompt_tokens=request.num_prompt_tokens,
            local_computed=num_computed_tokens,
            block_hashes=request.block_hashes,
            probe=probe,
            max_new_tokens=max_num_new_tokens,
            max_load_tokens=st.max_load_tokens,
            keys={g: gs.keys for g, gs in st.groups.items()},
            being_loaded=None if self._being_loaded is None else self._being_loaded.__contains__,
            probe_prefix=probe_prefix,
        )
        complete = hit
        hit = semantics.prompt_tail_hit(
            self.layout,
            complete_hit=complete,
            num_tokens=request.num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            local_computed=num_computed_tokens,
            tail_keys=self._prompt_tail_keys(st),
            probe=probe,
            max_new_tokens=max_num_new_tokens,
            max_load_tokens=st.max_load_tokens,
            being_loaded=None if self._being_loaded is None else self._being_loaded.__contains__,
        )
        st.prompt_tail_hit = hit is not None and complete is not None and hit > complete
        self.stats.lookups += 1
        if hit is None:
            self.stats.lookup_deferrals += 1
            st.awaiting = pending
            self._awaiting.add(request.request_id)
            return None, False
        st.awaiting = []
        self._awaiting.discard(request.request_id)
        self.stats.observe_lookup_delay(time.monotonic() - st.lookup_started)
        st.lookup_started = None
        return hit, hit > 0

    def _record_lookup_hits(self, st: _RequestState, keys: list[bytes], answers: list[Presence]) -> None:
        """Snapshot the request for every chunk of a full-attention group a lookup found, so its
        promotion and later removals are published with their tokens (KV events)."""
        assert self.events is not None
        for key, answer in zip(keys, answers, strict=True):
            if answer is Presence.HIT or answer is Presence.PENDING:
                group = chunk_group(key)  # probed keys are always of the layout's groups
                index = st.groups[group].chunk_of.get(key)
                if index is not None:
                    self.events.record_lookup(st.req, group, index, key)

    def get_external_cache_hit_sources(self, request: Request, num_external: int) -> dict[CacheHitSource, int]:
        st = self._reqs.get(request.request_id)
        return dict(st.hit_sources) if st is not None and num_external else {}

    def _attribute_hit(self, st: _RequestState, num_external: int) -> dict[str, int]:
        """Tokens per tier: a token range loaded from chunks promoted for this request counts
        for the farthest tier one of them came from, anything else for the host tier. Sets
        vLLM's per-source figures; returns the lower tiers' tokens by tier name (counted in our
        stats once the load succeeded: a streamed load may still fail)."""
        start, end = st.num_local, st.num_local + num_external
        source: dict[tuple[int, int], str] = {}
        for lo, hi, key in st.load_keys:
            lo, hi = max(lo, start), min(hi, end)
            tier = st.promoted.get(key)
            if lo < hi and tier is not None:
                known = source.get((lo, hi))
                if known is None or _TIER_RANK.get(tier, 0) > _TIER_RANK.get(known, 0):
                    source[(lo, hi)] = tier
        lower: dict[str, int] = {}
        budget = num_external
        for (lo, hi), tier in source.items():
            n = min(hi - lo, budget)
            budget -= n
            if n:
                lower[tier] = lower.get(tier, 0) + n
        st.hit_sources = {}
        for tier, n in lower.items():
            src = _HIT_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            st.hit_sources[src] = st.hit_sources.get(src, 0) + n
        if budget:
            st.hit_sources[CacheHitSource.HOST] = budget
        return lower

    # -------------------------------------------------------------------- load
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        if num_external == 0:
            return
        st = self._reqs[request.request_id]
        cached = st.num_local + num_external
        block_ids: dict[int, list[int]] = {}
        load_start: dict[int, int] = {}
        for geom in self.layout.groups:
            group_blocks = blocks.blocks[geom.index]
            self._allocated.update(b.block_id for b in group_blocks if b.block_id != 0)
            n_gpu = -(-cached // geom.tokens_per_block)
            first_fresh = -(-st.num_local // geom.tokens_per_block)
            # Scan from the local boundary: sparse groups (Mamba, SW) legitimately hold non-null
            # unhashed blocks below it; nulls are skipped positions (R35).
            start = n_gpu
            for i in range(first_fresh, n_gpu):
                b = group_blocks[i]
                if not b.is_null and b.block_hash is None:
                    start = i
                    break
            load_start[geom.index] = start
            block_ids[geom.index] = [b.block_id for b in group_blocks[:n_gpu]]
        tail_keys = None
        boundary, st.partial_boundary = st.partial_boundary, None
        tail_start = semantics.prompt_tail_start(self.layout, request.num_prompt_tokens)
        if st.prompt_tail_hit and tail_start is not None and cached > tail_start:
            tail_keys = st.prompt_tail_keys
        elif boundary is not None:
            if boundary != cached:
                raise RuntimeError(
                    f"request {request.request_id}: vLLM allocated {cached} cached tokens for a "
                    f"hit ending at the partial-tail boundary {boundary}")
            tail_keys = {
                g.index: semantics.boundary_key(request.block_hashes, boundary, g) for g in self.layout.groups
            }
        transfers = semantics.plan_load(
            self.layout,
            local_computed=st.num_local,
            hit_tokens=num_external,
            block_ids=block_ids,
            load_start_block=load_start,
            keys={g: gs.keys for g, gs in st.groups.items()},
            tail_keys=tail_keys,
        )
        keys = [t.key for t in transfers]
        if self.stream_loads:
            placed = self.hierarchy.prepare_streamed_load(keys)
        else:
            placed = [(slot, 0) for slot in self.hierarchy.prepare_load(keys)]
        copies = [
            ChunkCopy(t.group, slot, t.first_block_in_chunk, tuple(t.block_ids), ticket)
            for t, (slot, ticket) in zip(transfers, placed, strict=True)
        ]
        st.load_keys = [
            (t.chunk_index * g.tokens_per_chunk, min(cached, (t.chunk_index + 1) * g.tokens_per_chunk), t.key)
            for t in transfers
            for g in (self._geom(t.group),)
        ]
        lower_tokens = self._attribute_hit(st, num_external)
        # Chunks now covered by the load are not offered again (CHUNK_LEVEL policy, R32). A hit
        # ending in a tail (the prompt's, or a partial one) loaded that chunk under its tail key:
        # its full key is still to be stored once decoding completes it.
        for geom in self.layout.groups:
            tpc = geom.tokens_per_chunk
            covered = cached // tpc if tail_keys is not None else -(-cached // tpc)
            st.groups[geom.index].next_stored_chunk = covered
        job_id = self._new_job(st, is_store=False, keys=keys)
        self._jobs[job_id].hit = (num_external, lower_tokens)
        self._loads.append(TransferJob(job_id, request.request_id, False, copies))
        if any(c.ticket > 0 for c in copies):
            self._streaming.add(job_id)
            self.stats.streamed_loads += 1
        if self._being_loaded is not None:
            self._being_loaded.update(keys)
        self.stats.load_jobs += 1

    def _prompt_tail_keys(self, st: _RequestState) -> dict[int, bytes] | None:
        """Per group, the key of the prompt's partial last chunk: vLLM's block hash of its tokens
        chained to the prefix, with the same extra keys (LoRA, multimodal, salt, embeddings) a
        full block there would get. None when the layout or the prompt has no tail."""
        if st.prompt_tail_hashed:
            return st.prompt_tail_keys
        req = st.req
        if semantics.prompt_tail_start(self.layout, req.num_prompt_tokens) is None:
            st.prompt_tail_hashed = True  # never: no tail, or not served for this layout
            return None
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

        if self._block_hash_fn is None:
            self._block_hash_fn = get_hash_fn_by_name(self.plan.identity.hash_algo)
        hash_fn, end = self._block_hash_fn, req.num_prompt_tokens

        def hash_tail(parent: bytes | None, start: int) -> bytes:
            extra, _ = generate_block_hash_extra_keys(req, start, end, 0)
            return hash_block_tokens(hash_fn, parent, req.all_token_ids[start:end], extra)

        keys = semantics.prompt_tail_keys(self.layout, req.block_hashes, end, hash_tail)
        if keys is None:
            return None  # the prefix's block hashes are not all there yet
        st.prompt_tail_keys = keys
        st.prompt_tail_hashed = True
        return st.prompt_tail_keys

    def _prompt_tail_store_jobs(self, so: SchedulerOutput) -> list[TransferJob]:
        """Store the prompt's tail chunk in the step whose forward completes the prompt."""
        if not self.layout.serves_prompt_tails:
            return []
        jobs: list[TransferJob] = []
        for req_id, scheduled in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            req = st.req
            transfers = semantics.plan_prompt_tail_store(
                self.layout,
                num_prompt_tokens=req.num_prompt_tokens,
                computed_before=req.num_computed_tokens,
                computed_after=req.num_computed_tokens + scheduled,
                block_ids={g: gs.block_ids for g, gs in st.groups.items()},
                tail_keys=self._prompt_tail_keys(st),
                max_offload_tokens=st.max_offload_tokens,
            )
            if not transfers:
                continue
            reserved = self._reserve(transfers)
            if reserved is not None and reserved[0]:
                jobs.append(self._store_job(st, *reserved))
        return jobs

    def _geom(self, index: int) -> semantics.GroupGeometry:
        for g in self.layout.groups:
            if g.index == index:
                return g
        raise KeyError(index)

    def _new_job(self, st: _RequestState, *, is_store: bool, keys: list[bytes]) -> int:
        job_id = self._next_job
        self._next_job += 1
        assert is_store or not st.jobs, "a load is never concurrent with other jobs (R34)"
        st.jobs.add(job_id)
        self._jobs[job_id] = _Job(st.req.request_id, is_store, keys, self.num_workers)
        return job_id

    # ------------------------------------------------------------------- steps
    def build_connector_meta(self, so: SchedulerOutput) -> StrataMetadata:
        self._update_block_ids(so)
        for req_id in so.preempted_req_ids or ():
            st = self._reqs.get(req_id)
            if st is not None:
                self._flush.update(st.jobs)
        if self._block_jobs and not self._block_jobs.keys().isdisjoint(self._allocated):
            for bid in self._allocated & self._block_jobs.keys():
                self._flush.update(self._block_jobs[bid])
        stores = self._finished_hand_offs + self._boundary_store_jobs(so) + self._store_jobs(so) + self._prompt_tail_store_jobs(so)
        self._finished_hand_offs = []
        meta = StrataMetadata(loads=self._loads, stores=stores, flush=self._flush)
        for req_id in so.finished_req_ids or ():
            self._awaiting.discard(req_id)
            st = self._reqs.get(req_id)
            if st is None:
                continue
            st.finished_signaled = True
            if not st.jobs:
                del self._reqs[req_id]
        self._loads, self._flush, self._allocated = [], set(), set()
        if (self._awaiting or self._streaming) and not meta.loads and not so.total_num_scheduled_tokens:
            self._idle_wait()
        return meta

    def _idle_wait(self) -> None:
        """This step schedules nothing and requests wait on promotions from disk: give them up
        to ``IDLE_WAIT_S`` to land rather than letting the engine spin through empty steps.

        Each empty step is a round trip to every worker, and on a small machine the spinning
        engine takes the cores the promotions' decompression needs. A request that arrives
        meanwhile waits at most that long; one promotion landing ends the wait.
        """
        keys: list[bytes] = []
        for req_id in list(self._awaiting):
            st = self._reqs.get(req_id)
            if st is None or not st.awaiting:
                self._awaiting.discard(req_id)
                continue
            keys.extend(st.awaiting)
        # Streamed loads wait on their chunks' promotions in the workers: the same wait applies.
        for job_id in self._streaming:
            keys.extend(self._jobs[job_id].keys)
        if keys:
            self.hierarchy.wait_promotions(keys, IDLE_WAIT_S)

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

    def _offloadable(self, st: _RequestState, so: SchedulerOutput) -> int:
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
            candidates, next_stored = semantics.plan_store(
                self.layout,
                offloadable=offloadable,
                num_prompt_tokens=req.num_prompt_tokens,
                finished=req.is_finished(),
                next_stored_chunk={g: gs.next_stored_chunk for g, gs in st.groups.items()},
                block_ids={g: gs.block_ids for g, gs in st.groups.items()},
                keys={g: gs.keys for g, gs in st.groups.items()},
                prompt_offloadable=semantics.offloadable_tokens(
                    num_computed=req.num_prompt_tokens, num_scheduled=0, num_tokens=req.num_tokens,
                    num_prompt_tokens=req.num_prompt_tokens, finished=False, aborted=False,
                    offload_prompt_only=self.offload_prompt_only, max_offload_tokens=st.max_offload_tokens,
                ),
                shared_prefix_boundary=getattr(req, "shared_prefix_boundary", None),
            )
            if not candidates:
                self._advance(st, next_stored)
                continue
            reserved = self._reserve(candidates)
            if reserved is None:
                continue
            chosen, slots = reserved
            self._advance(st, next_stored)
            if not chosen:
                continue
            job = self._store_job(st, chosen, slots)
            jobs.append(job)
        return jobs

    def _reserve(self, transfers: list[Any]) -> tuple[list[Any], dict[bytes, int]] | None:
        """The transfers whose keys the host tier takes (not already stored), with their slots;
        None when it cannot allocate."""
        slots = self.hierarchy.prepare_store([t.key for t in transfers])
        if slots is None:
            self.stats.allocation_failures += 1
            return None
        return [t for t in transfers if t.key in slots], slots

    def _advance(self, st: _RequestState, next_stored: dict[int, int]) -> None:
        for g, n in next_stored.items():
            gs = st.groups[g]
            gs.next_stored_chunk = max(gs.next_stored_chunk, n)

    def _store_job(self, st: _RequestState, chosen: list[Any], slots: dict[bytes, int]) -> TransferJob:
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

    def _record_stores(self, st: _RequestState, chosen: list[Any]) -> None:
        """KV events: snapshot the request for each complete chunk about to be stored (a
        prompt's tail or a partial tail has no complete chunk's payload and keeps the
        placeholder)."""
        if self.events is None or not self.events.self_describing:
            return
        for t in chosen:
            if st.groups[t.group].chunk_of.get(t.key) == t.chunk_index:
                self.events.record_store(st.req, t.group, t.chunk_index, t.key)

    def _fence_deferred(self, job_id: int, job: _Job) -> None:
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

    def _hand_off_store_jobs(self, st: _RequestState, entries: Sequence[tuple[int, int, int]]) -> list[TransferJob]:
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

    def _fenced_store_job(self, st: _RequestState, transfers: list[Any]) -> TransferJob | None:
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

    def _finish_job(self, job_id: int, job: _Job, ok: bool) -> None:
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
            if ok:
                tokens, lower = job.hit
                self.stats.hit_tokens += tokens
                self.stats.hit_tokens_disk += lower.get(TIER_DISK, 0)
                self.stats.hit_tokens_remote += lower.get(TIER_REMOTE, 0)
                self.stats.hit_tokens_host += tokens - sum(lower.values())
            else:
                self.stats.load_failures += 1
                if st is not None:
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
            if st.finished_signaled and not st.jobs:
                del self._reqs[job.req_id]

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._awaiting.discard(request.request_id)
        st = self._reqs.get(request.request_id)
        if st is None:
            return False, None
        # The final hash may have just appeared: the next build_connector_meta stores the tail
        # (finish-time tail promotion, R29/R38).
        self._refresh_keys(st)
        for job_id in st.jobs:
            job = self._jobs[job_id]
            for bid in job.deferred_fence:
                self._block_jobs.setdefault(bid, set()).add(job_id)
        return False, None

    def has_pending_push_work(self) -> bool:
        return bool(self._jobs)

    def reset_cache(self) -> None:
        """``reset_prefix_cache(reset_connector=True)``: forget the host tier and in-flight jobs.

        The disk tier is a persistent store and survives (``kvstrata purge`` empties it).
        """
        self._flush.update(self._jobs)
        self._awaiting.clear()
        for req_id, st in list(self._reqs.items()):
            if st.req.is_finished():
                del self._reqs[req_id]
        for st in self._reqs.values():
            st.jobs.clear()
            st.awaiting = []
            st.partial_boundary = None
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

    def _tier_snapshot(self) -> dict[str, int]:
        """Flat per-tier figures for the stats gauges (cumulative, newest wins)."""
        h = self.hierarchy.stats()
        host = h.get("host", {})
        out = {
            "host_chunks": int(host.get("used", 0)),
            "host_bytes": int(host.get("used", 0)) * self.plan.slot_bytes,
            "promotions": int(h.get("promotions_completed", 0)),
            "warm_promotions": int(h.get("warm_promotions", 0)),
            "writes_behind": int(h.get("writes_completed", 0)),
        }
        r = h.get("tiers", {}).get(TIER_REMOTE)
        if r is not None and "error" not in r:
            out.update(
                remote_available=int(r["available"]), remote_read_bytes=int(r["get_bytes"]),
                remote_written_bytes=int(r["put_bytes"]), remote_hits=int(r["get_hits"]),
                remote_errors=int(r["errors"]) + int(r["unavailable"]),
                remote_unavailable_skips=int(r["skipped_unavailable"]),
                remote_corrupt=int(r["corrupt"]),
                # Not written: the backlog was full, or the server did not take them.
                remote_writes_dropped=int(r.get("writes_dropped", 0)) + int(r.get("writes_failed", 0)),
            )
        d = h.get("tiers", {}).get(TIER_DISK)
        if d is not None and "error" not in d:
            out.update(
                disk_entries=int(d["entries"]), disk_raw_bytes=int(d["raw_bytes"]),
                disk_stored_bytes=int(d["stored_bytes"]), disk_evictions=int(d.get("evictions", 0)),
                disk_admission_drops=int(d.get("admission_drops", 0)) + int(d.get("writes_dropped", 0)),
                disk_errors=int(d.get("sync_errors", 0)) + int(d.get("writes_failed", 0)),
                disk_corrupt=int(d.get("corrupt", 0)) + int(h.get("promotions_failed", 0)),
            )
        return out

    def shutdown(self) -> None:
        self.hierarchy.close(self.shutdown_write_timeout_s)
