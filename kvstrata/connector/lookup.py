"""Scheduler side, lookup and load: what a request's prefix hits in kvstrata's tiers, which tier
each hit came from (vLLM's per-source hit figures), and the load job that brings it to the device.

``LookupMixin`` is one half of ``StrataScheduler`` (``connector/scheduler.py``), which holds the
state it reads and writes and the helpers it calls (``_refresh_keys``, ``_prompt_tail_keys``,
``_geom``, ``_new_job``). What is servable comes from the pure ``semantics`` module; where chunks
live, from the tier ``Hierarchy``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from itertools import compress, repeat
from operator import is_, is_not
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request

from kvstrata import semantics
from kvstrata.connector.events import KVEvents
from kvstrata.connector.metadata import ChunkCopy, TransferJob
from kvstrata.connector.request_state import Job, PieceLoad, RequestState, served_by_tier
from kvstrata.connector.stats import StrataStats
from kvstrata.presence import Presence
from kvstrata.tiers.hierarchy import TIER_DISK, TIER_REMOTE, PromotionBudget, chunk_group
from kvstrata.tiers.manager import TierManager

# Where vLLM's per-source hit figures put each lower tier; the farther tier wins a token range
# loaded from chunks of several tiers. vLLM has no "remote" source: a remote store is
# EXTERNAL_UNSPECIFIED in its enum (vllm/v1/metrics/cache_hit_source.py).
_HIT_SOURCE = {TIER_DISK: CacheHitSource.DISK, TIER_REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}
_TIER_RANK = {TIER_DISK: 1, TIER_REMOTE: 2}


class LookupMixin:
    """Lookups (``get_num_new_matched_tokens``) and the load plan after vLLM allocated the hit's
    blocks (``update_state_after_alloc``)."""

    # The scheduler's state this half uses (set in StrataScheduler.__init__).
    layout: semantics.Layout
    hierarchy: TierManager
    events: KVEvents | None
    stats: StrataStats
    stream_loads: bool
    sync_loads: bool
    sync_loads_wait_for_disk: bool
    host_room_wait_s: float
    _reqs: dict[str, RequestState]
    _jobs: dict[int, Job]
    _loads: list[TransferJob]
    _streaming: set[int]
    _allocated: set[int]
    _being_loaded: set[bytes] | None
    _awaiting: set[str]
    _pieced: dict[str, None]
    _step_lookups: int  # lookups in this scheduling step so far
    _unallocated_hits: dict[str, None]  # requests answered a hit in this step, not allocated yet

    if TYPE_CHECKING:  # the scheduler's helpers this half calls (defined in StrataScheduler)
        def _refresh_keys(self, st: RequestState) -> None: ...
        def _prompt_tail_keys(self, st: RequestState) -> dict[int, bytes] | None: ...
        def _tail_extension_candidates(
            self, st: RequestState, start: int, lengths: range) -> list[tuple[int, dict[int, bytes]]]: ...
        def _new_job(self, st: RequestState, *, is_store: bool, keys: list[bytes]) -> int: ...
        def _start_piece(self, st: RequestState, transfers: list[semantics.ChunkTransfer],
                         copies: list[ChunkCopy] | None = None) -> None: ...
        def _room_for_pieces(self) -> int: ...

    # ------------------------------------------------------------------ lookup
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        if self._unallocated_hits:  # vLLM went on past a hit it did not allocate (rare)
            self.hold_unallocated_hits()
        st = self._reqs[request.request_id]
        for gs in st.groups.values():
            gs.block_ids.clear()
        if st.jobs:  # R15: a preempted request's stores are still in flight
            return None, False
        self._refresh_keys(st)
        st.num_local = num_computed_tokens
        if request.skip_reading_prefix_cache:
            return 0, False
        # vLLM looks its waiting requests up in its queue's order each step and schedules them in
        # that order: the first lookup of a step promotes what it needs, as far as room goes
        # (even while it waits for promotions in flight); later ones (requests behind it, which
        # wait anyway while it waits) no more than they can hold, or others' promotions and
        # stores evict what they promoted before they load it (docs/BENCHMARKS.md, "Promotions
        # a waiting request can hold").
        behind = self._step_lookups > 0
        self._step_lookups += 1
        st.head_of_queue = not behind
        now = time.monotonic()
        if st.lookup_started is None:
            st.lookup_started = now
        # Chunks a lower tier holds but the host tier has no room to promote answer PENDING
        # (this lookup defers; the write-behind frees room) until the request waited this long.
        wait_for_room = now - st.lookup_started < self.host_room_wait_s
        if st.awaiting and self.hierarchy.in_flight(st.awaiting):
            self.stats.lookup_deferrals += 1
            return None, False
        pending: list[bytes] = []
        found: list[bytes] = []  # answered HIT or PENDING, in probe order: held if it waits
        # Chunks this lookup answered HIT so far: a later probe of the same lookup (another
        # group, a tail) must not evict them to make room for a promotion.
        answered: set[bytes] = set()
        # Streamed loads: chunks a lower tier holds that the host tier has no room for are hits
        # too, loaded in pieces as room frees (connector/pieces.py), unless this lookup waits
        # for room instead (host_room_wait_s).
        queued: set[bytes] | None = set() if self.stream_loads and not st.no_pieces else None
        # Loads in pieces began before this request was looked up: the room they wait for is
        # theirs first (a new request's chunks wait, or are queued behind them).
        reserve = self._room_for_pieces() if self._pieced else 0
        budget = PromotionBudget(self.hierarchy.hold_room()) if behind else None

        def probe(keys: Iterable[bytes], prefix: bool = False) -> list[Presence]:
            keys = list(keys)
            # Promotions launch at the end of the step's scheduling (``build_connector_meta``).
            answers = list(self.hierarchy.lookup_many(
                keys, st.promoted, stream=self.stream_loads, prefix=prefix, protect=answered,
                offered=st.offered, defer_promotions=True, wait_for_room=wait_for_room, queued=queued,
                reserve=reserve, budget=budget))
            # With C-level iteration: a long prompt's probe is hundreds of keys, every step.
            answered.update(compress(keys, map(is_, answers, repeat(Presence.HIT))))
            found.extend(compress(keys, map(is_not, answers, repeat(Presence.MISS))))
            if Presence.PENDING in answers:
                pending.extend(compress(keys, map(is_, answers, repeat(Presence.PENDING))))
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
        st.extension_keys = None
        if hit == complete:  # neither the prompt's own tail nor waiting for it
            hit, st.extension_keys = self._tail_extension_hit(
                st, request, complete, num_computed_tokens, max_num_new_tokens, probe)
        self.stats.lookups += 1
        st.queued = queued or set()
        if hit is None:
            self.stats.lookup_deferrals += 1
            st.awaiting = pending
            self._awaiting.add(request.request_id)
            self._hold(st, found)
            return None, False
        if hit:
            # vLLM may find no room for the hit's blocks in this step (its KV cache is full):
            # the request then waits and is looked up again at a later step, and the chunks
            # promoted for it would meanwhile be idle host slots that other requests' stores
            # evict and its next lookup promotes again. Held at the end of the step's
            # scheduling if vLLM has not allocated it by then (``hold_unallocated_hits``):
            # most hits are allocated at once (update_state_after_alloc, whose load pins what
            # it needs), and vLLM looks no further request up in a step after one it could not
            # allocate (or if it does, that lookup holds them first), so nothing evicts them
            # before that.
            st.hit_found = found
            self._unallocated_hits[request.request_id] = None
        else:
            self._release_held(st)
        st.awaiting = []
        self._awaiting.discard(request.request_id)
        self.stats.observe_lookup_delay(time.monotonic() - st.lookup_started)
        st.lookup_started = None
        # Load the hit before this step's forward and compute the request in the same step
        # (sync_loads): when every chunk is in the host tier, or, on CPU engines, also when a
        # streamed lookup answered HIT for chunks still landing from disk (the worker waits for
        # them; the forward would share the cores with their decompression anyway). Not a hit
        # of the whole request: vLLM then has no token to compute in that step (an
        # asynchronous load has it recompute the last one).
        st.sync_load = (self.sync_loads and hit > 0 and not pending and not queued
                        and num_computed_tokens + hit < request.num_tokens
                        and (self.sync_loads_wait_for_disk or not self.stream_loads
                             or not self.hierarchy.in_flight(list(answered))))
        return hit, hit > 0 and not st.sync_load

    def hold_unallocated_hits(self) -> None:
        """Hold what the lookups of this step found for hits vLLM did not allocate blocks for
        (see ``get_num_new_matched_tokens``); called once the step is scheduled, before its
        stores and pieces take host room, or by the step's next lookup."""
        for req_id in self._unallocated_hits:
            st = self._reqs.get(req_id)
            if st is not None and st.hit_found is not None:
                self._hold(st, st.hit_found)
                st.hit_found = None
        self._unallocated_hits.clear()

    def _hold(self, st: RequestState, keys: list[bytes]) -> None:
        """Pin what the request's deferred lookup found until it is looked up again and loads
        it (``Hierarchy.hold``); the pins of its previous deferral are let go."""
        held, st.held = st.held, self.hierarchy.hold(keys, head=st.head_of_queue)
        self.hierarchy.release_held(held)

    def _release_held(self, st: RequestState) -> None:
        held, st.held = st.held, []
        self.hierarchy.release_held(held)

    def _tail_extension_hit(
        self, st: RequestState, request: Request, complete: int | None, local: int,
        max_new_tokens: int | None, probe: Callable[[Iterable[bytes]], list[Presence]],
    ) -> tuple[int | None, Mapping[int, bytes] | None]:
        """The complete hit extended by a stored tail this longer prompt starts with
        (``semantics.tail_extension``), or left as it is. While the complete hit defers, the
        chunks some tier holds say where it will end, and that chunk's tail starts promoting."""
        if not self.layout.serves_prompt_tails:
            return complete, None
        hit_end = local + complete if complete is not None else self._held_chunks_end(st, local)
        span = semantics.tail_extension_span(
            self.layout, hit_end=hit_end, num_tokens=request.num_tokens, local_computed=local,
            max_new_tokens=max_new_tokens, max_load_tokens=st.max_load_tokens)
        if span is None:
            return complete, None
        start, lengths = span
        candidates = self._tail_extension_candidates(st, start, lengths)
        if not candidates:
            return complete, None
        return semantics.tail_extension_hit(
            self.layout, complete_hit=complete, local_computed=local, start=start,
            candidates=candidates, probe=probe,
            being_loaded=None if self._being_loaded is None else self._being_loaded.__contains__)

    def _held_chunks_end(self, st: RequestState, local: int) -> int:
        """Where the first group's chunks that some tier holds (or is getting) end, from the
        chunk holding ``local`` on: what a deferred lookup's hit will reach once they landed."""
        geom = self.layout.groups[0]
        first = local // geom.tokens_per_chunk
        keys = st.groups[geom.index].keys[first:]
        held = self.hierarchy.holds_many(keys, prefix=True)
        run = next((i for i, h in enumerate(held) if not h), len(held))
        return max(local, (first + run) * geom.tokens_per_chunk)

    def _record_lookup_hits(self, st: RequestState, keys: list[bytes], answers: list[Presence]) -> None:
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

    def _attribute_hit(self, st: RequestState, num_external: int) -> dict[str, int]:
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
        if request.request_id in self._unallocated_hits:
            del self._unallocated_hits[request.request_id]
            self._reqs[request.request_id].hit_found = None
        if num_external == 0:
            waited = self._reqs.get(request.request_id)
            if waited is not None and waited.held:  # its lookup found nothing to load after all
                self._release_held(waited)
            return
        st = self._reqs[request.request_id]
        cached = st.num_local + num_external
        sync, st.sync_load = st.sync_load, False
        block_ids: dict[int, list[int]] = {}
        load_start: dict[int, int] = {}
        for geom in self.layout.groups:
            group_blocks = blocks.blocks[geom.index]
            ids = [b.block_id for b in group_blocks]
            self._allocated.update(ids)
            self._allocated.discard(0)  # the null block
            n_gpu = -(-cached // geom.tokens_per_block)
            first_fresh = -(-st.num_local // geom.tokens_per_block)
            # Scan from the local boundary: sparse groups (Mamba, SW) legitimately hold non-null
            # unhashed blocks below it; nulls are skipped positions (R35). vLLM has hashed a
            # synchronous load's blocks already (it caches them at allocation).
            start = n_gpu
            for i in range(first_fresh, n_gpu):
                b = group_blocks[i]
                if not b.is_null and (sync or b.block_hash is None):
                    start = i
                    break
            load_start[geom.index] = start
            block_ids[geom.index] = ids[:n_gpu]
        tail_keys: Mapping[int, bytes] | None = None
        boundary, st.partial_boundary = st.partial_boundary, None
        tail_start = semantics.prompt_tail_start(self.layout, request.num_prompt_tokens)
        if st.prompt_tail_hit and tail_start is not None and cached > tail_start:
            tail_keys = st.prompt_tail_keys
        elif st.extension_keys is not None:
            tail_keys, st.extension_keys = st.extension_keys, None
            self.stats.tail_extensions += 1
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
        # Chunks the lookup found no host room for: loaded in later pieces (connector/pieces.py).
        queued, st.queued = st.queued, set()
        later = [t for t in transfers if t.key in queued] if queued else []
        first = [t for t in transfers if t.key not in queued] if later else transfers
        try:
            if self.stream_loads:
                # A synchronous load gets tickets too: on CPU engines its worker waits for
                # chunks still landing before the forward; elsewhere its chunks were all in the
                # host tier at the lookup (ticket 0), and one gone since (-1) fails it.
                placed = self.hierarchy.prepare_streamed_load([t.key for t in first])
            else:
                placed = [(slot, 0) for slot in self.hierarchy.prepare_load(keys)]
        finally:
            self._release_held(st)  # the load pinned what it needs
        copies = [
            ChunkCopy(t.group, slot, t.first_block_in_chunk, tuple(t.block_ids), ticket)
            for t, (slot, ticket) in zip(first, placed, strict=True)
        ]
        tpc_of = {g.index: g.tokens_per_chunk for g in self.layout.groups}
        st.load_keys = [
            (t.chunk_index * tpc, min(cached, (t.chunk_index + 1) * tpc), t.key)
            for t in transfers
            for tpc in (tpc_of[t.group],)
        ]
        lower_tokens = self._attribute_hit(st, num_external)
        # Chunks now covered by the load are not offered again (CHUNK_LEVEL policy, R32). A hit
        # ending in a tail (the prompt's, or a partial one) loaded that chunk under its tail key:
        # its full key is still to be stored once decoding completes it.
        for geom in self.layout.groups:
            tpc = geom.tokens_per_chunk
            covered = cached // tpc if tail_keys is not None else -(-cached // tpc)
            st.groups[geom.index].next_stored_chunk = covered
        self.stats.load_jobs += 1
        # vLLM caches a synchronous load's blocks at once (its prefix cache serves them from
        # this step on); an asynchronous one's only once it arrived.
        if self._being_loaded is not None and not sync:
            self._being_loaded.update(keys)
        if later:
            st.pieces = PieceLoad(later, (num_external, lower_tokens))
            self._pieced[request.request_id] = None
            self.stats.pieced_loads += 1
            self.stats.streamed_loads += 1
            if first:
                self._start_piece(st, first, copies)
            return
        job_id = self._new_job(st, is_store=False, keys=keys)
        self._jobs[job_id].hit = (num_external, lower_tokens)
        self._loads.append(TransferJob(job_id, request.request_id, False, copies, sync=sync))
        if any(c.ticket > 0 for c in copies):
            self.stats.streamed_loads += 1
            if not sync:  # a synchronous one is over when its step's forward starts
                self._streaming.add(job_id)
        if sync:
            self.stats.sync_loads += 1
            # The request may finish in this step, before vLLM hands over the load's result
            # (it frees finished requests first): say now what it was served. A failed load
            # never lets the request finish in this step, and takes it back (_finish_job).
            self._jobs[job_id].served_before = st.served
            st.served = served_by_tier(num_external, lower_tokens)
