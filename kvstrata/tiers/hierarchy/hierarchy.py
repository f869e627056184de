"""The tier hierarchy the scheduler-side connector talks to: host slots over lower tiers.

Every scheduler call is non-blocking and O(keys): it updates the host index under one lock and
hands tier work to the pipeline (``shared``): lookups (``lookup``), the host slots stores, loads
and holds pin (``pins``), write-behind (``write_behind``), promotions (``promoter``) and the
background scans after a restart (``background``). Lower tiers (``kvstrata.tiers.lower.LowerTier``: the local disk store, a
shared remote store) are asked in order; a chunk is promoted from the first that holds all its
shards.

* **lookup**: a chunk only in a lower tier gets a host slot and starts its promotion at once,
  answering PENDING (HIT under ``stream``: a streamed load waits on its ticket); MISS when the
  host tier has no room (HIT under ``queued``: promoted later, ``promote_queued``). A
  full-attention run is probed as a prefix (nothing promoted past its first missing chunk);
  chunks a request's lookup answered HIT are never evicted by its later probes.
* **events** (``events=True``): ``take_events()`` returns ``(tier, removed, chunk keys)``
  batches — tier "host" or a lower tier's name — in the order they happened: a store completed or
  a promotion landed (host, stored); an idle chunk evicted or reset (host, removed); a write-behind
  completed (tier, stored); a record evicted, expired, dropped or deleted (tier, removed).

Slot layout: shard ``r`` of a slot starts at ``r * shard_bytes``; for group ``g`` only its first
``group_shard_bytes[g]`` bytes are meaningful and only those go down, as record
``namespaces[r] + chunk_key`` (group = the key's last 4 bytes, big-endian).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, Literal

from kvstrata.presence import Presence
from kvstrata.tiers.hierarchy.background import Background
from kvstrata.tiers.hierarchy.lookup import Lookup
from kvstrata.tiers.hierarchy.pins import HostPins
from kvstrata.tiers.hierarchy.promoter import Promoter
from kvstrata.tiers.hierarchy.reuse import ReuseMeter
from kvstrata.tiers.hierarchy.shared import (
    DEFAULT_WRITE_INFLIGHT_BYTES,
    TIER_HOST,
    Pipeline,
    PromotionBudget,
    Shared,
    TierLink,
    per_tier,
    use_processes,
)
from kvstrata.tiers.hierarchy.write_behind import WriteBehind
from kvstrata.tiers.host import HostPool
from kvstrata.tiers.lower import LowerTier, ReconnectingTier, ScannableTier

logger = logging.getLogger(__name__)


class Hierarchy(HostPins):
    """Host tier index + lower tiers + the pipeline between them (see the module docstring).

    Args:
        host_pool: index over the shared slab (the pool must have its slab).
        lower: the lower tiers, nearest first (a single tier, or None for a host-only cache).
        namespaces: one store-key prefix per shard (TP rank), in shard order.
        group_shard_bytes: meaningful bytes per shard for each group.
        group_dtypes: codec dtype name per group (e.g. "bfloat16"; "int8" for Mamba pages).
        shard_bytes: shard stride inside a slot; default ``slot_bytes // len(namespaces)``.
        admit_after: write a chunk to a tier once it has been offered this many times (a
            ``prepare_store`` of it, or a host hit on it at lookup); 1 = every stored chunk. One
            value for every tier, or one per tier.
        write_backpressure: "defer" (keep the slot, write when the tier catches up, up to
            ``max_deferred_bytes`` per tier) or "drop" (hold no slot: the write is postponed,
            ``write_behind``); one value for every tier, or one per tier.
        max_write_inflight_bytes: bytes of writes in flight per tier before backpressure (one
            value, or one per tier).
        max_write_pinned_bytes: host bytes the write-behind may hold (writes in flight and
            deferred; each tier an even share); beyond, writes are postponed without holding a
            slot (``write_behind``). Default: half the host tier.
        idle_writes: write-behind threads run at idle CPU priority (``tiers.priority``).
        urgent_writes: with ``idle_writes``, writes run on normal-priority threads while the
            write-behind is behind (``write_behind``).
        write_reuse_half_life_bytes: how fast the ``write_reuse`` gauge forgets (``reuse``);
            default twice the host tier.
        retry_failed_after_s: a chunk whose promotion failed is a miss for this long (unless
            stored again), then its tiers are asked again (``shared.FailedPromotions``).
        clock: monotonic seconds for ``retry_failed_after_s`` (``time.monotonic``; tests pass
            their own to step time instead of sleeping).
    """

    def __init__(
        self,
        host_pool: HostPool,
        lower: LowerTier | Sequence[LowerTier] | None,
        *,
        namespaces: Sequence[bytes],
        group_shard_bytes: Sequence[int],
        group_dtypes: Sequence[str],
        shard_bytes: int | None = None,
        admit_after: int | Sequence[int] = 1,
        write_backpressure: Literal["defer", "drop"] | Sequence[Literal["defer", "drop"]] = "defer",
        max_write_inflight_bytes: int | Sequence[int] = DEFAULT_WRITE_INFLIGHT_BYTES,
        max_deferred_bytes: int | None = None,
        max_write_pinned_bytes: int | None = None,
        max_concurrent_reads: int = 4,
        read_threads: int = 2,
        write_threads: int = 1,
        read_processes: int = 0,
        write_processes: int = 0,
        offer_tracker_size: int = 1 << 17,
        events: bool = False,
        idle_writes: bool = True,
        urgent_writes: bool = False,
        write_reuse_half_life_bytes: int | None = None,
        retry_failed_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        tiers = [] if lower is None else list(lower) if isinstance(lower, Sequence) else [lower]
        admits = per_tier("admit_after", admit_after, len(tiers))
        pressure = per_tier("write_backpressure", write_backpressure, len(tiers))
        inflight = per_tier("max_write_inflight_bytes", max_write_inflight_bytes, len(tiers))
        for p in pressure:
            if p not in ("defer", "drop"):
                raise ValueError(f"write_backpressure must be 'defer' or 'drop', not {p!r}")
        links = [TierLink(t, i, max(1, a), defer=p == "defer", max_inflight=m)
                 for i, (t, a, p, m) in enumerate(zip(tiers, admits, pressure, inflight, strict=True))]
        s = self._s = Shared(
            host_pool, links, namespaces=namespaces, group_shard_bytes=group_shard_bytes,
            group_dtypes=group_dtypes, shard_bytes=shard_bytes, events=events,
            offer_tracker_size=offer_tracker_size, retry_failed_after_s=retry_failed_after_s,
            clock=clock)
        for link in links:
            link.reuse = ReuseMeter(write_reuse_half_life_bytes or max(1, 2 * s.slab.nbytes))
            link.slab_reads = use_processes(link.tier, "read", s.slab, read_processes)
            link.slab_writes = use_processes(link.tier, "write", s.slab, write_processes, idle=idle_writes)
            link.keep_postponed = isinstance(link.tier, ScannableTier)
        self.pool = host_pool
        self.slab = s.slab
        self.namespaces = s.namespaces
        self.shard_bytes = s.shard_bytes
        self.write_threads = write_threads  # per lower tier
        self.read_processes = read_processes  # per lower tier that reads into the slab itself
        self.write_processes = write_processes  # per lower tier that frames from the slab itself
        self._pipe = Pipeline(links, read_threads=read_threads, write_threads=write_threads,
                              max_concurrent_reads=max_concurrent_reads, idle_writes=idle_writes,
                              urgent_writes=urgent_writes)
        self._writes = WriteBehind(
            s, self._pipe,
            max_deferred_bytes=s.slab.nbytes // 4 if max_deferred_bytes is None else max_deferred_bytes,
            max_pinned_bytes=(s.slab.nbytes // 2 if max_write_pinned_bytes is None
                              else max_write_pinned_bytes))
        self._promoter = Promoter(s, self._pipe, self._writes)
        self._lookup = Lookup(s, self._writes, self._promoter)
        self._background = Background(s, self._pipe, self._promote_collecting, self.wait_promotions)
        host_pool.on_evict = self._on_evict
        for link in links:
            link.tier.on_removed = lambda keys, link=link: self._on_tier_removed(link, keys)
            if isinstance(link.tier, ReconnectingTier):
                link.tier.on_available = lambda link=link: self._on_tier_available(link)
        self._pipe.start()

    @property
    def tiers(self) -> list[LowerTier]:
        """The lower tiers, nearest first."""
        return [link.tier for link in self._s.links]

    # ---- scheduler API -----------------------------------------------------------------------

    def lookup_many(
        self,
        keys: Sequence[bytes],
        promoting: MutableMapping[bytes, str] | None = None,
        *,
        stream: bool = False,
        prefix: bool = False,
        protect: set[bytes] | None = None,
        offered: set[bytes] | None = None,
        defer_promotions: bool = False,
        wait_for_room: bool = False,
        queued: set[bytes] | None = None,
        reserve: int = 0,
        budget: PromotionBudget | None = None,
    ) -> list[Presence]:
        """HIT (in host, readable), PENDING (store or promotion in flight) or MISS, per key.

        A chunk found only in a lower tier starts its promotion now and answers PENDING.
        ``promoting`` collects the keys whose answer is a promotion, with the name of the tier
        each comes from (for per-tier hit figures).
        ``stream``: a promotion in flight answers HIT instead; load such keys with
        :meth:`prepare_streamed_load`. ``prefix``: the keys are a prefix run (only those before
        the first MISS can be used), so no promotion starts past the first key that no tier
        holds. ``protect``: keys an earlier probe of the same request's lookup answered HIT; a
        promotion never evicts them (the request is about to load them). ``offered``: the keys
        this request's earlier lookups asked for; they are not offered again (admission to the
        lower tiers counts requests, not lookups: a waiting request is looked up every step),
        and this lookup's keys are added. ``defer_promotions``: the promotions this lookup
        starts are answered for and accounted as started, but their reads are held until
        :meth:`launch_deferred_promotions` (or a wait for promotions): the scheduler-side
        connector launches them once vLLM's scheduling of the step is done, so that their
        Python work (the I/O loop, the read threads) does not take the GIL from vLLM's
        scheduler mid-step (docs/BENCHMARKS.md, "Promotions launched after the step's
        scheduling"). ``wait_for_room``: a chunk a lower tier holds that the host tier has no
        room to promote (every slot held) answers PENDING instead of MISS, so that the request
        asks again once stores, loads and writes have let go of slots, rather than computing it
        (``host_room_wait_s``); not when this lookup's promotions could never all fit.
        ``queued`` (with ``stream`` only): such a chunk, when the lookup does not wait for room,
        answers HIT instead of MISS and is added to ``queued`` (and to ``promoting``): the
        request's load brings it in a later piece, through :meth:`promote_queued`, once the
        host tier has room again (a hit larger than the host tier is loaded through it in
        pieces rather than computed). ``reserve``: host slots this lookup's promotions must
        leave free (or evictable) for others, the loads in pieces that wait for room: without
        it, the lookups of new requests, which run first in each step, take every slot those
        loads free, and the loads wait until they are given up. ``budget``: at most this many
        promotions start (spent from it); a chunk past it is answered as one without room
        (counted ``promote_held_back``): a lookup whose request may not be scheduled in this
        step promotes no more than it can hold (:meth:`hold_room`), since what it cannot hold
        is evicted by others before it loads it (``promotions_unused``).
        """
        if queued is not None and not stream:
            raise ValueError("queued promotions are loaded by streamed loads only")
        return self._lookup.lookup(keys, count_offers=True, promoting=promoting, stream=stream,
                                   prefix=prefix, protect=protect, offered=offered, defer=defer_promotions,
                                   wait_for_room=wait_for_room, queued=queued, reserve=reserve,
                                   budget=budget)

    def host_room(self) -> int:
        """Host slots a promotion could take now (free, or holding a chunk nothing pins)."""
        with self._s.lock:
            return self.pool.room

    def store_room(self) -> int:
        """Host slots a store could take now: ``host_room`` less the chunks whose write to the
        disk is postponed (a store does not evict them, ``write_behind``)."""
        with self._s.lock:
            return self.pool.room_without(self._writes.kept_from_stores())

    def promote_queued(self, keys: Sequence[bytes], promoting: MutableMapping[bytes, str] | None,
                       queued: set[bytes]) -> list[Presence]:
        """Start the promotions of chunks a lookup queued (``lookup_many``'s ``queued``), as far
        as the host tier has room: HIT for each chunk in the host tier or on its way into it
        (load it with :meth:`prepare_streamed_load`), HIT and added to ``queued`` for each that
        still has no room, MISS for each no tier holds any more. No access or offer is recorded
        again: the request's lookup did."""
        return self._lookup.lookup(keys, count_offers=False, promoting=promoting, stream=True,
                                   queued=queued)

    def launch_deferred_promotions(self) -> None:
        """Run the promotions lookups held with ``defer_promotions``."""
        if not self._promoter.deferred:  # most steps: nothing held, no lock taken
            return
        s = self._s
        with s.lock:
            if not s.closed:
                self._promoter.launch_deferred()

    def holds_many(self, keys: Sequence[bytes], *, prefix: bool = False) -> list[bool]:
        """Which chunks some tier holds: the host tier (ready, or on its way in) or a lower tier
        (every shard). Records no access, starts no promotion and counts nothing: for choosing
        among candidate keys, most never stored, before a lookup of the chosen ones.
        ``prefix``: the keys are a run and only its held start matters; the lower tiers are
        asked as a prefix lookup asks them, and keys past the first one no tier holds may
        answer False."""
        return self._lookup.holds(keys, prefix)

    def promote(self, keys: Sequence[bytes]) -> list[Presence]:
        """Start promotions for chunks only in lower tiers (a lookup without bookkeeping)."""
        return self._lookup.lookup(keys, count_offers=False)

    def _promote_collecting(self, keys: Sequence[bytes], started: dict[bytes, str]) -> list[Presence]:
        return self._lookup.lookup(keys, count_offers=False, promoting=started)

    def in_flight(self, keys: Sequence[bytes]) -> bool:
        """Whether any of ``keys`` is still on its way into the host tier (a store or a
        promotion): a lookup that was PENDING on them would be PENDING again."""
        s = self._s
        with s.lock:
            return any(k in s.promoting or k in s.storing for k in keys)

    def wait_promotions(self, keys: Sequence[bytes], timeout: float | None) -> bool:
        """Block until none of ``keys`` is being promoted, at most ``timeout`` seconds; True
        when none is. For an engine step that has nothing else to do."""
        self.launch_deferred_promotions()  # never wait for a read that is not running
        s = self._s
        with s.landed:
            return s.landed.wait_for(lambda: s.closed or s.promoting.keys().isdisjoint(keys), timeout)

    def warm_start(self, max_chunks: int) -> None:
        """Promote, in the background, the ``max_chunks`` chunks of the first lower tier used
        most recently into free host slots (see ``background``). Returns at once."""
        self._background.warm_start(max_chunks)

    def wait_warm_start(self, timeout: float | None) -> bool:
        """Block until no warm start is under way (its promotions landed), at most ``timeout``
        seconds; True when none is. For tests and tools that must not race it."""
        return self._background.warm_done.wait(timeout)

    def announce_disk(self) -> None:
        """Report, in the background, every chunk the first lower tier holds for this model as
        a tier change (see ``background``); nothing without events. Returns at once."""
        self._background.announce()

    def reset(self) -> bool:
        """Drop every idle host chunk (prefix-cache reset); lower tiers keep theirs.

        Returns True when the host tier is now empty (nothing was in flight).
        """
        s = self._s
        with s.lock:
            # What a reset drops was not promoted for nothing (``promotions_unused``).
            s.unread.intersection_update(s.promoting)
            self.pool.evict_idle()
            s.offers.clear()
            s.bad.clear()
            return len(self.pool) == 0

    def take_events(self) -> list[tuple[str, bool, list[bytes]]]:
        """Tier changes since the last call, oldest first; [] when events are off."""
        return self._s.journal.take()

    def stats(self) -> dict[str, Any]:
        """The hierarchy's counters, the host tier's figures, and each lower tier's own
        statistics under ``tiers`` (by name), with its write-behind figures."""
        s = self._s
        with s.lock:
            out: dict[str, Any] = dict(s.counts)
            out.update(self._writes.stats(), promotions_inflight=len(s.promoting),
                       stores_inflight=len(s.storing), chunks_held=len(s.held), host=self.pool.stats())
            writes = {link.name: {**{f"writes_{k}": v for k, v in link.writes.items()},
                                  "write_reuse": round(link.reuse.ratio, 3)} for link in s.links}
        tiers: dict[str, Any] = {}
        for link in s.links:  # outside the lock: a tier's statistics may read its store
            try:
                tiers[link.name] = {**link.tier.stats(), **writes[link.name]}
            except Exception as exc:  # statistics never take the engine down
                tiers[link.name] = {"error": f"{type(exc).__name__}: {exc}", **writes[link.name]}
        out["tiers"] = tiers
        return out

    def close(self, timeout: float | None = None, *, flush_unwritten: bool = True) -> bool:
        """Finish every accepted write (deferred ones too) and, with ``flush_unwritten``, write the
        chunks backpressure dropped or whose write failed that the host tier still holds (so a
        restart finds what this process held); then stop the pipeline.

        Returns True when everything was written. ``timeout`` (seconds) bounds the wait (a tier
        that stopped answering, a large host tier on a slow disk); writes still queued then are
        abandoned (logged). The pool's slab and the lower tiers are not closed: they belong to
        the caller.
        """
        s = self._s
        with s.lock:
            if s.closed:
                return True
            if flush_unwritten and (n := self._writes.flush_unwritten()):
                logger.info("kvstrata: writing %d chunk(s) the write-behind had dropped or failed to "
                            "write before closing", n)
            self._promoter.launch_deferred()  # ended as any promotion in flight at a close
            s.closed = True
            s.landed.notify_all()
        drained = True
        # Queued whether or not the loop runs yet: the I/O thread may not have reached
        # run_forever() (a close right after construction on a busy machine), and a stop that
        # was skipped then would leave the loop running forever and join() waiting on it.
        done = asyncio.run_coroutine_threadsafe(self._writes.drain(), self._pipe.loop)
        try:
            done.result(timeout)
        except TimeoutError:
            drained = False
            logger.warning("kvstrata: closing with disk write(s) unfinished after %.1fs (abandoned)", timeout)
        self._pipe.stop(drained)
        return drained

    def __enter__(self) -> Hierarchy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_evict(self, keys: list[bytes]) -> None:  # called by the pool, under our lock
        self._writes.evicted(keys)
        unread = self._s.unread
        if unread:
            before = len(unread)
            unread.difference_update(keys)
            self._s.counts["promotions_unused"] += before - len(unread)
        for link in self._s.links:
            link.resident.difference_update(keys)
            if link.unwritten:
                link.unwritten.difference_update(keys)
            if link.failed:
                link.failed.difference_update(keys)
            if link.failures:
                for key in keys:
                    link.failures.pop(key, None)
        self._s.journal.add(TIER_HOST, True, keys)

    def _on_tier_removed(self, link: TierLink, store_keys: list[bytes]) -> None:
        # On the thread that deleted the records (the tier's writer, or a tool's): it takes no
        # lock of ours, so a tier never waits on the hierarchy.
        width = len(self.namespaces[0])
        ours = set(self.namespaces)
        records = Counter(k[width:] for k in store_keys if k[:width] in ours)
        if records:
            self._writes.forget(link, list(records))
            self._s.journal.add_removed_records(link.name, records)

    def _on_tier_available(self, link: TierLink) -> None:
        # On the tier's own thread (its probe found the server again): the writes it failed or
        # postponed meanwhile start now, not after its next successful write, which an idle
        # replica may never make. The loop takes our lock, so a tier never waits on the hierarchy.
        try:
            self._pipe.call_soon(self._resume_writes, link)
        except RuntimeError:  # the pipeline stopped: closed, and its shutdown wrote what it could
            pass

    def _resume_writes(self, link: TierLink) -> None:  # on the pipeline's loop
        with self._s.lock:
            self._writes.schedule(self._writes.resume(link))
