"""The tier hierarchy the scheduler-side connector talks to: host slots over a disk store.

Every scheduler call is non-blocking and O(keys): it updates the host index under one lock and
hands disk work to an asyncio event loop on a background thread. That loop owns the I/O pipeline:

* **write-behind**: a chunk whose store to host completed (and that the admission policy lets
  through) is compressed and written to disk, holding a reference on its slot meanwhile. At most
  ``max_write_inflight_bytes`` are in flight; beyond that new writes are deferred (holding their
  slot, up to ``max_deferred_bytes``) or dropped, and counted. Callers never wait on the disk.
* **prefetch**: a lookup that finds a chunk only on disk allocates a slot and starts a
  promotion (LMDB get -> decompress straight into the slot) at once, answering PENDING; at most
  ``max_concurrent_reads`` run at a time and a chunk is fetched once however often it is asked
  for. A failed or corrupt read makes the chunk a MISS (counted), never an exception.
* **streamed loads** (``lookup_many(stream=True)`` + ``prepare_streamed_load``): a chunk whose
  promotion is in flight answers HIT and may be handed to a worker before its bytes landed. Each
  promotion gets a ticket; when it ends, the slab's landing board gets ``ticket << 1 | failed``
  for its slot, and the worker copies the slot only after reading its own ticket there. A failed
  promotion thus reaches the worker as a failed load (vLLM recomputes the request under
  ``kv_load_failure_policy="recompute"``), never as wrong bytes.

* **warm start** (:meth:`Hierarchy.warm_start`): after a restart, the chunks used most recently
  (the disk's access ticks) are promoted in the background into free host slots, one batch of
  ``max_concurrent_reads`` at a time so that a request's own promotion queues behind at most
  one batch; the first requests after a restart are then served at host-tier speed.

The blocking work (LMDB, zstd, checksums) runs in thread pools via ``run_in_executor``, one whole
operation per call (storage-facts.md, implication 8); it releases the GIL. Reads and writes have
separate pools so a backlog of writes never delays a prefetch the next step waits for.

**Events** (``events=True``): what enters or leaves each tier, for vLLM's KV cache events (KV-aware
routers learn from them which server holds a prefix): ``take_events()`` returns
``(tier, removed, chunk keys)`` batches, tier "host" or "disk", in the order they happened. Host:
a store completed, a promotion landed (stored); an idle chunk evicted or reset (removed). Disk:
a write-behind completed (stored); a record evicted, expired, dropped as corrupt or deleted
(removed; a chunk whose shard of any rank went is gone). :meth:`Hierarchy.announce_disk` adds,
once, every chunk already on disk (stored), so a restarted engine reports what it can serve.

Slot layout: shard ``r`` of a slot starts at ``r * shard_bytes``; for group ``g`` only its first
``group_shard_bytes[g]`` bytes are meaningful and only those go to disk, as record
``namespaces[r] + chunk_key`` (group = the key's last 4 bytes, big-endian).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from kvstrata.presence import Presence
from kvstrata.tiers.host import HostPool, board_fence

if TYPE_CHECKING:
    from kvstrata.tiers.disk import DiskStore, IndexRecord

logger = logging.getLogger(__name__)

_ABSENT, _READY, _NOT_READY = HostPool.ABSENT, HostPool.READY, HostPool.NOT_READY
_HIT, _PENDING, _MISS = Presence.HIT, Presence.PENDING, Presence.MISS
# Indexed by HostPool.lookup_many's states (ABSENT=0, READY=1, NOT_READY=2).
_BY_HOST_STATE = (_MISS, _HIT, _PENDING)


TIER_HOST, TIER_DISK = "host", "disk"


def chunk_group(key: bytes) -> int:
    """The KV cache group a chunk key belongs to (its last 4 bytes, big-endian)."""
    return int.from_bytes(key[-4:], "big")


class Hierarchy:
    """Host tier index + disk tier + the asyncio pipeline between them (see module docstring).

    Args:
        host_pool: index over the shared slab (the pool must have its slab).
        disk: the disk store, or None for a host-only cache.
        namespaces: one store-key prefix per shard (TP rank), in shard order.
        group_shard_bytes: meaningful bytes per shard for each group.
        group_dtypes: codec dtype name per group (e.g. "bfloat16"; "int8" for Mamba pages).
        shard_bytes: shard stride inside a slot; default ``slot_bytes // len(namespaces)``.
        admit_after: write a chunk to disk once it has been offered this many times (a
            ``prepare_store`` of it, or a host hit on it at lookup); 1 = every stored chunk.
        write_backpressure: "defer" (keep the slot, write when the disk catches up, up to
            ``max_deferred_bytes``) or "drop".
    """

    def __init__(
        self,
        host_pool: HostPool,
        disk: DiskStore | None,
        *,
        namespaces: Sequence[bytes],
        group_shard_bytes: Sequence[int],
        group_dtypes: Sequence[str],
        shard_bytes: int | None = None,
        admit_after: int = 1,
        write_backpressure: Literal["defer", "drop"] = "defer",
        max_write_inflight_bytes: int = 128 << 20,
        max_deferred_bytes: int | None = None,
        max_concurrent_reads: int = 4,
        read_threads: int = 2,
        write_threads: int = 1,
        offer_tracker_size: int = 1 << 17,
        events: bool = False,
    ) -> None:
        slab = host_pool.slab
        if slab is None:
            raise ValueError("the host pool needs its slab")
        if not namespaces:
            raise ValueError("at least one namespace (shard) is required")
        if len(group_shard_bytes) != len(group_dtypes):
            raise ValueError("group_shard_bytes and group_dtypes must have one entry per group")
        if write_backpressure not in ("defer", "drop"):
            raise ValueError(
                f"write_backpressure must be 'defer' or 'drop', not {write_backpressure!r}"
            )
        self.pool = host_pool
        self.slab = slab
        self.disk = disk
        self.namespaces = [bytes(ns) for ns in namespaces]
        self.shard_bytes = shard_bytes or slab.slot_bytes // len(self.namespaces)
        if self.shard_bytes * len(self.namespaces) > slab.slot_bytes:
            raise ValueError(
                f"{len(self.namespaces)} shards of {self.shard_bytes} bytes exceed the slot"
            )
        if max(group_shard_bytes) > self.shard_bytes:
            raise ValueError(
                f"a group needs {max(group_shard_bytes)} bytes, shards hold {self.shard_bytes}"
            )
        self.group_shard_bytes = list(group_shard_bytes)
        self.group_dtypes = list(group_dtypes)
        self.admit_after = max(1, admit_after)
        self.defer = write_backpressure == "defer"
        self.max_write_inflight_bytes = max_write_inflight_bytes
        self.max_deferred_bytes = (
            slab.nbytes // 4 if max_deferred_bytes is None else max_deferred_bytes
        )
        self._offer_tracker_size = offer_tracker_size

        self._lock = threading.Lock()
        # Notified whenever a promotion lands (or fails): lets an idle engine wait for one
        # instead of spinning through empty steps.
        self._promoted = threading.Condition(self._lock)
        self._storing: set[bytes] = set()  # prepare_store'd, not completed
        self._promoting: set[bytes] = set()  # disk -> host in flight
        self._on_disk: set[bytes] = set()  # resident chunks known to be on disk
        self._queued: set[bytes] = set()  # resident chunks being written or deferred
        self._deferred: deque[bytes] = deque()
        self._deferred_bytes = 0
        self._inflight_bytes = 0
        self._bad: set[bytes] = set()  # disk records that failed to read
        # Streamed loads: the ticket of each promotion in flight, and load pins whose entry a
        # failed promotion dropped (complete_load must not release them on a successor entry).
        self._tickets: dict[bytes, int] = {}
        self._next_ticket = 1
        self._dead_pins: dict[bytes, int] = {}
        slab.landed[:] = 0  # tickets of an earlier engine on a reused slab file mean nothing
        self._offers: OrderedDict[bytes, int] = OrderedDict()
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        host_pool.on_evict = self._on_evict
        # (tier, removed, keys) batches for KV cache events; None when nobody listens.
        self._events: deque[tuple[str, bool, list[bytes]]] | None = deque() if events else None
        if disk is not None:
            disk.on_removed = self._on_disk_removed

        self._read_pool = ThreadPoolExecutor(read_threads, thread_name_prefix="kvstrata-read")
        self._write_pool = ThreadPoolExecutor(write_threads, thread_name_prefix="kvstrata-write")
        self._loop = asyncio.new_event_loop()
        self._read_sem = asyncio.Semaphore(max_concurrent_reads)
        self._max_concurrent_reads = max_concurrent_reads
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run_loop, name="kvstrata-io", daemon=True)
        self._thread.start()

    # ---- scheduler API -----------------------------------------------------------------------

    def lookup_many(
        self,
        keys: Sequence[bytes],
        promoting: set[bytes] | None = None,
        *,
        stream: bool = False,
        prefix: bool = False,
        protect: set[bytes] | None = None,
    ) -> list[Presence]:
        """HIT (in host, readable), PENDING (store or promotion in flight) or MISS, per key.

        A chunk found only on disk starts its promotion now and answers PENDING. ``promoting``
        collects the keys whose answer is a promotion from disk (for per-tier hit figures).
        ``stream``: a promotion in flight answers HIT instead; load such keys with
        :meth:`prepare_streamed_load`.

        ``prefix``: the keys are a prefix run (only those before the first MISS can be used), so
        no promotion starts past the first key that is neither in the host tier nor on disk: it
        would take a slot (evicting a useful chunk) for nothing, and the request would wait for
        it. ``protect``: keys an earlier probe of the same request's lookup answered HIT; a
        promotion never evicts them (the request is about to load them).
        """
        return self._lookup(
            keys, count_offers=True, promoting=promoting, stream=stream, prefix=prefix,
            protect=protect,
        )

    def promote(self, keys: Sequence[bytes]) -> list[Presence]:
        """Start disk -> host promotions for disk-only chunks (a lookup without bookkeeping)."""
        return self._lookup(keys, count_offers=False)

    def in_flight(self, keys: Sequence[bytes]) -> bool:
        """Whether any of ``keys`` is still on its way into the host tier (a store or a
        promotion): a lookup that was PENDING on them would be PENDING again."""
        with self._lock:
            promoting, storing = self._promoting, self._storing
            return any(k in promoting or k in storing for k in keys)

    def wait_promotions(self, keys: Sequence[bytes], timeout: float) -> bool:
        """Block until none of ``keys`` is being promoted from disk, at most ``timeout``
        seconds; True when none is. For an engine step that has nothing else to do."""
        with self._promoted:
            return self._promoted.wait_for(
                lambda: self._closed or self._promoting.isdisjoint(keys), timeout
            )

    def warm_start(self, max_chunks: int) -> None:
        """Promote, in the background, the ``max_chunks`` chunks of this store's first shard
        used most recently (most recent first) into free host slots; it evicts nothing. Returns
        at once; close() stops it. Chunks a request asks for meanwhile are promoted as usual."""
        if self.disk is None or max_chunks <= 0:
            return
        with self._lock:
            if not self._closed:
                self._loop.call_soon_threadsafe(self._spawn, self._warm(max_chunks))

    def announce_disk(self) -> None:
        """Report, in the background, every chunk the disk holds for this model (all shards) as
        a disk-tier change in :meth:`take_events`: after a restart a KV-aware router learns what
        this engine can serve from its disk before anything is asked for. Nothing happens
        without events or a disk tier; close() stops it."""
        if self.disk is None or self._events is None:
            return
        with self._lock:
            if not self._closed:
                self._loop.call_soon_threadsafe(self._spawn, self._announce())

    def prepare_store(self, keys: Sequence[bytes]) -> dict[bytes, int] | None:
        """Host slots for the keys not present yet (they become PENDING), or None if the host
        tier cannot make room for all of them (nothing is allocated then)."""
        with self._lock:
            if self._closed:
                return None
            new = list(dict.fromkeys(k for k in keys if k not in self.pool))
            protected = set(keys)
            slots = self.pool.allocate(new, protected) if new else []
            if slots is None:
                self._counts["store_no_room"] += 1
                return None
            self._storing.update(new)
            if self.admit_after > 1:
                for key in new:
                    self._offer(key)
            self._counts["stores_prepared"] += len(new)
            return dict(zip(new, slots, strict=True))

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """The device -> host copies of ``keys`` finished: HIT (and queued for write-behind if
        admitted), or dropped when ``success`` is False."""
        start: list[tuple[bytes, int, int, int]] = []
        with self._lock:
            for key in keys:
                if key not in self._storing:
                    self._counts["store_unknown"] += 1
                    continue
                self._storing.discard(key)
                if not success:
                    self.pool.discard(key)
                    self._counts["stores_failed"] += 1
                    continue
                self.pool.mark_ready(key)
                self.pool.release(key)
                self._bad.discard(key)
                self._counts["stores_completed"] += 1
                if self._events is not None:
                    self._events.append((TIER_HOST, False, [key]))
                if self.admit_after <= 1 or self._offers.get(key, 0) >= self.admit_after:
                    item = self._admit(key)
                    if item is not None:
                        start.append(item)
            self._schedule_writes(start)

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the (HIT) keys' slots for a host -> device load; returns their slots.

        Raises KeyError (pinning nothing) if a key is not readable in the host tier.
        """
        with self._lock:
            missing = [k for k in keys if not self.pool.is_ready(k)]
            if missing:
                raise KeyError(
                    f"{len(missing)} chunk(s) not in the host tier, e.g. {missing[0].hex()}"
                )
            slots = [self.pool.acquire(k) for k in keys]
            for key in keys:
                self.pool.touch(key)
            self._counts["loads_prepared"] += len(keys)
            return slots

    def prepare_streamed_load(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """Pin the keys' slots for a host -> device load that may start before a promotion
        landed; returns ``(slot, ticket)`` per key.

        Ticket 0: the chunk is in the host tier now. A positive ticket: wait until the slab's
        landing board shows it for the slot (``landed[slot] >> 1 >= ticket``; the chunk is
        there when the value is exactly ``ticket << 1``, anything else means it failed). Ticket
        -1: the chunk is gone already (its promotion failed since the lookup); the load fails.
        Release every key with :meth:`complete_load` as usual.
        """
        out: list[tuple[int, int]] = []
        with self._lock:
            for key in keys:
                entry = self.pool.get(key)
                ticket = self._tickets.get(key, 0)
                if entry is None or not (entry[1] or ticket):
                    # Not there, or a store still in flight (never answered HIT): unloadable.
                    self._dead_pins[key] = self._dead_pins.get(key, 0) + 1
                    out.append((0, -1))
                    continue
                out.append((self.pool.acquire(key), ticket))
                self.pool.touch(key)
            self._counts["loads_prepared"] += len(keys)
            self._counts["loads_streamed"] += sum(1 for _, t in out if t > 0)
        return out

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpin slots taken by ``prepare_load`` or ``prepare_streamed_load`` (once per key
        per call)."""
        with self._lock:
            dead = self._dead_pins
            for key in keys:
                n = dead.get(key)
                if n:
                    if n == 1:
                        del dead[key]
                    else:
                        dead[key] = n - 1
                    continue
                self.pool.release(key)

    def reset(self) -> bool:
        """Drop every idle host chunk (prefix-cache reset); disk records stay.

        Returns True when the host tier is now empty (nothing was in flight).
        """
        with self._lock:
            self.pool.evict_idle()
            self._offers.clear()
            self._bad.clear()
            return len(self.pool) == 0

    def take_events(self) -> list[tuple[str, bool, list[bytes]]]:
        """Tier changes since the last call, oldest first (see module docstring); [] when
        events are off."""
        events = self._events
        if not events:
            return []
        out = []
        while events:
            out.append(events.popleft())
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out.update(
                write_inflight_bytes=self._inflight_bytes,
                write_deferred=len(self._deferred),
                write_deferred_bytes=self._deferred_bytes,
                promotions_inflight=len(self._promoting),
                stores_inflight=len(self._storing),
                host=self.pool.stats(),
            )
        return out

    def close(self, timeout: float | None = None) -> bool:
        """Finish every accepted disk write (deferred ones too), then stop the I/O thread.

        Returns True when everything was written. ``timeout`` (seconds) bounds the wait for a
        disk that stopped answering; writes still queued then are abandoned (logged). Neither
        the pool's slab nor the disk store is closed: they belong to the caller.
        """
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            self._promoted.notify_all()
        drained = True
        # Queued whether or not the loop runs yet: the I/O thread may not have reached
        # run_forever() (a close right after construction on a busy machine), and a stop that
        # was skipped then would leave the loop running forever and join() waiting on it.
        done = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)
        try:
            done.result(timeout)
        except TimeoutError:
            drained = False
            logger.warning(
                "kvstrata: closing with %d disk write(s) unfinished after %.1fs",
                len(self._queued),
                timeout,
            )
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        if drained:
            self._loop.close()
        self._read_pool.shutdown(wait=drained)
        self._write_pool.shutdown(wait=drained)
        return drained

    def __enter__(self) -> Hierarchy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- lookup internals ----------------------------------------------------------------------

    def _lookup(
        self,
        keys: Sequence[bytes],
        count_offers: bool,
        promoting: set[bytes] | None = None,
        stream: bool = False,
        prefix: bool = False,
        protect: set[bytes] | None = None,
    ) -> list[Presence]:
        # Kept to list comprehensions over the keys: this runs on the scheduler's critical path.
        with self._lock:
            if self._closed:
                return [_MISS] * len(keys)
            host = self.pool.lookup_many(keys)
            states = [_BY_HOST_STATE[s] for s in host]
            # Host hits whose chunk is also on disk: tell the disk they were used, or its LRU
            # (and max_age_s) would evict first the records of the chunks served most often
            # from the host tier, losing exactly those at the next restart.
            # Without a disk tier _on_disk stays empty and the scan is skipped.
            on_disk = self._on_disk
            used = (
                [k for k, s in zip(keys, host, strict=True) if s == _READY and k in on_disk]
                if on_disk
                else []
            )
            streamed = 0  # HIT answers that are promotions in flight (counted as pending)
            if self._promoting and (promoting is not None or stream):
                landing = [
                    i for i, s in enumerate(host) if s == _NOT_READY and keys[i] in self._promoting
                ]
                if promoting is not None:
                    promoting.update(keys[i] for i in landing)
                if stream:
                    for i in landing:
                        states[i] = _HIT
                    streamed += len(landing)
            if count_offers and self.admit_after > 1:
                admitted = []
                for k in (k for k, s in zip(keys, host, strict=True) if s == _READY):
                    self._offer(k)
                    if self._offers[k] >= self.admit_after and (item := self._admit(k)):
                        admitted.append(item)
                self._schedule_writes(admitted)
            candidates: list[int] = []
            if self.disk is not None:
                bad = self._bad
                candidates = [
                    i
                    for i, s in enumerate(host)
                    if s == _ABSENT and (not bad or keys[i] not in bad)
                ]
            if not candidates:
                self._count_lookup(states, streamed)
        if used and self.disk is not None:
            self.disk.touch_many([ns + k for k in used for ns in self.namespaces])
        if not candidates:
            return states

        # Presence on disk is checked outside the lock (one short LMDB read transaction).
        nss = self.namespaces
        n = len(nss)
        assert self.disk is not None
        try:
            if n == 1:
                ns = nss[0]
                found = self.disk.contains_many([ns + keys[i] for i in candidates])
            else:
                probe = self.disk.contains_many([ns + keys[i] for i in candidates for ns in nss])
                # A chunk is on disk only when every shard is.
                found = [all(probe[c * n : (c + 1) * n]) for c in range(len(candidates))]
        except Exception:
            logger.exception("kvstrata: disk lookup failed; treating as misses")
            found = [False] * len(candidates)
        on_disk = [i for i, f in zip(candidates, found, strict=True) if f]
        if prefix:
            # Nothing past the first key the host tier lacks and the disk does not hold.
            absent = {i for i, f in zip(candidates, found, strict=True) if not f}
            first_miss = next(
                (i for i, s in enumerate(host) if s == _ABSENT and (i in absent or keys[i] in self._bad)),
                len(keys),
            )
            on_disk = [i for i in on_disk if i < first_miss]
        promote: list[tuple[bytes, int, int]] = []
        with self._lock:
            protected: set[bytes] | None = None
            room = not self._closed
            for i in on_disk:
                key = keys[i]
                st = self.pool.lookup_many((key,), touch=False)[0]
                if st != _ABSENT:  # appeared meanwhile (a store, or a duplicate key)
                    if st == _READY:
                        states[i] = _HIT
                    elif stream and key in self._promoting:
                        states[i] = _HIT
                        streamed += 1
                    else:
                        states[i] = _PENDING
                    continue
                if not room:
                    self._counts["promote_no_room"] += 1
                    continue
                if protected is None:
                    protected = {k for k, s in zip(keys, states, strict=True) if s == _HIT}
                    if protect:
                        protected |= protect
                slots = self.pool.allocate((key,), protected)
                if slots is None:
                    # The host tier is full of pinned chunks: answer MISS rather than PENDING
                    # so that the request does not wait on a promotion that never starts.
                    room = False
                    self._counts["promote_no_room"] += 1
                    continue
                self._promoting.add(key)
                self._tickets[key] = self._next_ticket
                self._next_ticket += 1
                self._on_disk.add(key)
                promote.append((key, slots[0], chunk_group(key)))
                states[i] = _HIT if stream else _PENDING
                streamed += stream
                if promoting is not None:
                    promoting.add(key)
            if promote:
                self._counts["promotions_started"] += len(promote)
                # Scheduled under the lock so that close() cannot slip in between.
                self._loop.call_soon_threadsafe(self._start_promotions, promote)
            self._count_lookup(states, streamed)
        return states

    def _count_lookup(self, states: list[Presence], streamed: int = 0) -> None:
        c = self._counts
        c["lookups"] += len(states)
        c["lookup_hits"] += states.count(_HIT) - streamed
        c["lookup_pending"] += states.count(_PENDING) + streamed

    def _offer(self, key: bytes) -> None:
        offers = self._offers
        offers[key] = offers.get(key, 0) + 1
        offers.move_to_end(key)
        if len(offers) > self._offer_tracker_size:
            offers.popitem(last=False)

    def _on_evict(self, key: bytes) -> None:  # called by the pool, under our lock
        self._on_disk.discard(key)
        if self._events is not None:
            self._events.append((TIER_HOST, True, [key]))

    def _on_disk_removed(self, store_keys: list[bytes]) -> None:
        # On the thread that deleted the records (the store's writer, or a tool's): it takes no
        # lock of ours, so the store never waits on the hierarchy. Single set and deque calls
        # are atomic; a lookup racing with this one at worst skips or repeats one write-behind.
        width = len(self.namespaces[0])
        ours = set(self.namespaces)
        keys = list(dict.fromkeys(k[width:] for k in store_keys if k[:width] in ours))
        if not keys:
            return
        # A resident chunk whose records the disk evicted must be written again when it is
        # admitted next (admission > 1 re-offers resident chunks), or it is lost at restart.
        self._on_disk.difference_update(keys)
        if self._events is not None:
            self._events.append((TIER_DISK, True, keys))

    # ---- write-behind ----------------------------------------------------------------------------

    def _chunk_bytes(self, key: bytes) -> int:
        return self.group_shard_bytes[chunk_group(key)] * len(self.namespaces)

    def _admit(self, key: bytes) -> tuple[bytes, int, int, int] | None:
        """Queue ``key`` for write-behind (under the lock); returns it when it may start now."""
        if self.disk is None or self._closed or key in self._on_disk or key in self._queued:
            return None
        size = self._chunk_bytes(key)
        if (
            self._inflight_bytes == 0
            or self._inflight_bytes + size <= self.max_write_inflight_bytes
        ):
            return self._claim_write(key, size)
        if self.defer and self._deferred_bytes + size <= self.max_deferred_bytes:
            self.pool.acquire(key)  # the slot must survive until the write runs
            self._queued.add(key)
            self._deferred.append(key)
            self._deferred_bytes += size
            self._counts["writes_deferred"] += 1
            return None
        self._counts["writes_dropped"] += 1
        return None

    def _claim_write(
        self, key: bytes, size: int, pinned: bool = False
    ) -> tuple[bytes, int, int, int]:
        slot = self.pool.acquire(key) if not pinned else self.pool.get(key)[0]  # type: ignore[index]
        self._queued.add(key)
        self._inflight_bytes += size
        self._counts["writes_started"] += 1
        return key, slot, chunk_group(key), size

    def _schedule_writes(self, items: list[tuple[bytes, int, int, int]]) -> None:
        # Called under the lock: close() sets _closed under it and then queues its drain, which
        # therefore runs after every write accepted before.
        if items:
            self._loop.call_soon_threadsafe(self._start_writes, items)

    def _pump_deferred(self, force: bool = False) -> list[tuple[bytes, int, int, int]]:
        """Deferred writes that fit now (under the lock); ``force`` takes them all (drain)."""
        out = []
        while self._deferred:
            key = self._deferred[0]
            size = self._chunk_bytes(key)
            if (
                not force
                and self._inflight_bytes
                and self._inflight_bytes + size > self.max_write_inflight_bytes
            ):
                break
            self._deferred.popleft()
            self._deferred_bytes -= size
            out.append(self._claim_write(key, size, pinned=True))
        return out

    # ---- loop thread -----------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_writes(self, items: list[tuple[bytes, int, int, int]]) -> None:
        for item in items:
            self._spawn(self._write(*item))

    def _start_promotions(self, items: list[tuple[bytes, int, int]]) -> None:
        for item in items:
            self._spawn(self._promote(*item))

    async def _write(self, key: bytes, slot: int, group: int, size: int) -> None:
        ok = await self._loop.run_in_executor(self._write_pool, self._write_chunk, key, slot, group)
        with self._lock:
            self._inflight_bytes -= size
            self._queued.discard(key)
            self.pool.release(key)
            if ok:
                self._on_disk.add(key)
                self._counts["writes_completed"] += 1
                self._counts["write_bytes"] += size
                if self._events is not None:
                    self._events.append((TIER_DISK, False, [key]))
            else:
                self._counts["writes_failed"] += 1
            more = self._pump_deferred()
        self._start_writes(more)

    async def _promote(self, key: bytes, slot: int, group: int) -> None:
        async with self._read_sem:
            ok = await self._loop.run_in_executor(
                self._read_pool, self._read_chunk, key, slot, group
            )
        with self._lock:
            self._promoting.discard(key)
            ticket = self._tickets.pop(key)
            # The board is written before a failed slot can be handed out again (under the lock),
            # and after the slot's bytes (the read thread's writes) are visible everywhere.
            board_fence()
            self.slab.landed[slot] = ticket << 1 | (not ok)
            if ok:
                self.pool.mark_ready(key)
                self.pool.release(key)
                self._counts["promotions_completed"] += 1
                self._counts["read_bytes"] += self._chunk_bytes(key)
                if self._events is not None:
                    self._events.append((TIER_HOST, False, [key]))
            else:
                self._on_disk.discard(key)
                # Streamed loads pinned this entry: their complete_load must not release
                # whatever entry the key gets next.
                pins = self.pool.refs(key) - 1
                if pins > 0:
                    self._dead_pins[key] = self._dead_pins.get(key, 0) + pins
                self.pool.discard(key)
                self._bad.add(key)
                self._counts["promotions_failed"] += 1
            self._promoted.notify_all()

    async def _warm(self, max_chunks: int) -> None:
        loop = self._loop
        try:
            keys = await loop.run_in_executor(None, self._recent_chunks, max_chunks)
        except Exception:
            logger.exception("kvstrata: warm start could not list the store; skipped")
            return
        step = self._max_concurrent_reads
        for i in range(0, len(keys), step):
            if self._closed:
                return
            # Off the loop thread: the lookup reads the disk index, and the batch is waited for.
            if not await loop.run_in_executor(None, self._warm_batch, keys[i : i + step]):
                return

    def _warm_batch(self, keys: list[bytes]) -> bool:
        """Promote what fits in the free host slots and wait until it landed (one batch at a
        time: a request's promotions go between batches); False once the free slots are all
        taken. A guess about what will be asked for never evicts what a request stored."""
        with self._lock:
            free = self.pool.free_slots
        started: set[bytes] = set()
        if free:
            self._lookup(keys[:free], count_offers=False, promoting=started)
        with self._lock:
            self._counts["warm_promotions"] += len(started)
        self.wait_promotions(started, None)  # returns at once when close() began
        return free > len(keys)

    async def _announce(self) -> None:
        try:
            await self._loop.run_in_executor(None, self._announce_stored)
        except Exception:
            logger.exception("kvstrata: could not list the store for KV events; skipped")

    def _announce_stored(self) -> None:
        events = self._events
        assert events is not None
        for batch in self._stored_chunks():
            if self._closed:
                return
            events.append((TIER_DISK, False, batch))
            # The store's writer may have dropped one of them after the batch was read, its
            # removal then preceding this announcement: report those removed again, after it.
            present = self._all_shards_on_disk(batch)
            gone = [key for key, here in zip(batch, present, strict=True) if not here]
            if gone:
                events.append((TIER_DISK, True, gone))

    def _stored_chunks(self) -> Iterator[list[bytes]]:
        """Chunk keys with every shard on disk, in batches of at most ``_ANNOUNCE_BATCH``."""
        batch: list[bytes] = []
        for key, _rec in self._own_records():
            batch.append(key)
            if len(batch) == _ANNOUNCE_BATCH:
                yield self._with_all_shards(batch)
                batch = []
        if batch and not self._closed:
            yield self._with_all_shards(batch)

    def _with_all_shards(self, keys: list[bytes]) -> list[bytes]:
        if len(self.namespaces) == 1:
            return keys
        return [k for k, here in zip(keys, self._all_shards_on_disk(keys), strict=True) if here]

    def _all_shards_on_disk(self, keys: list[bytes]) -> list[bool]:
        disk = self.disk
        assert disk is not None
        present = [True] * len(keys)
        for ns in self.namespaces:
            found = disk.contains_many([ns + k for k in keys])
            present = [a and b for a, b in zip(present, found, strict=True)]
        return present

    def _recent_chunks(self, max_chunks: int) -> list[bytes]:
        """Chunk keys of the first shard's records, most recently used first (index scan)."""
        records = ((rec.tick, key) for key, rec in self._own_records())
        return [key for _, key in heapq.nlargest(max_chunks, records)]

    def _own_records(self) -> Iterator[tuple[bytes, IndexRecord]]:
        """(chunk key, index record) of every first-shard record of this model, in index order;
        stops when close() begins (a large store takes a while: do not hold up close())."""
        disk = self.disk
        assert disk is not None
        ns = self.namespaces[0]
        n = len(ns)
        for key, rec in disk.iter_index():
            if self._closed:
                return
            if key[:n] == ns:
                yield key[n:], rec

    async def _drain(self) -> None:
        while True:
            with self._lock:
                more = self._pump_deferred(force=True)
            self._start_writes(more)
            pending = [t for t in self._tasks if not t.done()]
            if not pending and not more:
                return
            await asyncio.wait(pending)

    # ---- executor threads ------------------------------------------------------------------------

    def _shard_views(self, slot: int, group: int) -> list[memoryview]:
        n = self.group_shard_bytes[group]
        row = self.slab.array[slot]
        return [
            memoryview(row[r * self.shard_bytes : r * self.shard_bytes + n])
            for r in range(len(self.namespaces))
        ]

    def _write_chunk(self, key: bytes, slot: int, group: int) -> bool:
        assert self.disk is not None
        dtype = self.group_dtypes[group]
        entries = [
            (ns + key, view, dtype)
            for ns, view in zip(self.namespaces, self._shard_views(slot, group), strict=True)
        ]
        try:
            return self.disk.put_many(entries) == len(entries)
        except Exception:
            logger.exception("kvstrata: disk write of %s failed", key.hex())
            return False

    def _read_chunk(self, key: bytes, slot: int, group: int) -> bool:
        assert self.disk is not None
        views = self._shard_views(slot, group)
        try:
            for ns, view in zip(self.namespaces, views, strict=True):
                if self.disk.get_into(ns + key, view) != view.nbytes:
                    return False
        except Exception:
            logger.exception("kvstrata: disk read of %s failed", key.hex())
            return False
        return True


_ANNOUNCE_BATCH = 1024  # chunk keys per announced disk-tier change (one KV event per group)

_COUNTERS = (
    "lookups",
    "lookup_hits",
    "lookup_pending",
    "stores_prepared",
    "stores_completed",
    "stores_failed",
    "store_no_room",
    "store_unknown",
    "loads_prepared",
    "loads_streamed",
    "promotions_started",
    "promotions_completed",
    "promotions_failed",
    "promote_no_room",
    "warm_promotions",
    "read_bytes",
    "writes_started",
    "writes_completed",
    "writes_failed",
    "writes_deferred",
    "writes_dropped",
    "write_bytes",
)
