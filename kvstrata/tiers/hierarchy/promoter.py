"""Promotions: a chunk found only in a lower tier is read into a host slot in the background.

At most ``max_concurrent_reads`` read jobs run at a time, each reading up to
``MAX_CHUNKS_PER_READ`` chunks of one tier in turn and landing each as soon as it is read, and a
chunk is fetched once however often it is asked for. Each promotion gets a ticket; when it ends,
the slab's landing board gets ``ticket << 1 | failed`` for its slot, so a streamed load (a worker
copying the slot before the promotion was known to have landed) copies only after reading its own
ticket there. A failed or corrupt read makes the chunk a MISS (counted), never an exception, and
its pins are recorded so that their release does not touch the key's next entry. A chunk promoted
from one tier is written back into the tiers above it (a chunk found only remotely is kept on the
local disk).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstrata.tiers.hierarchy.shared import TIER_HOST, Pipeline, Shared, TierLink, chunk_group
from kvstrata.tiers.hierarchy.write_behind import WriteBehind
from kvstrata.tiers.host import board_fence

logger = logging.getLogger(__name__)

MAX_CHUNKS_PER_READ = 16  # chunks per read job (``Promoter._start``)


class Promoter:
    def __init__(self, shared: Shared, pipeline: Pipeline, writes: WriteBehind) -> None:
        self.s = shared
        self.pipe = pipeline
        self.writes = writes
        # Streamed loads: the ticket of each promotion in flight, and load pins whose entry a
        # failed promotion dropped (complete_load must not release them on a successor entry).
        self.tickets: dict[bytes, int] = {}
        self._next_ticket = 1
        self.dead_pins: dict[bytes, int] = {}
        self._deferred: list[tuple[bytes, int, TierLink]] = []  # started, not yet launched
        shared.slab.landed[:] = 0  # tickets of an earlier engine on a reused slab file mean nothing

    def start(self, key: bytes, slot: int, link: TierLink) -> tuple[bytes, int, TierLink]:
        """Under the lock: ``key`` now has a host slot and is on its way from ``link``'s tier;
        returns the promotion to hand to :meth:`launch` (still under the lock)."""
        item = (key, slot, link)
        self.start_many([item])
        return item

    def start_many(self, items: list[tuple[bytes, int, TierLink]]) -> None:
        """:meth:`start` for each ``(key, slot, link)`` of ``items`` (a long prompt's run, in
        one pass), each then handed to :meth:`launch` as it is."""
        n = self._next_ticket
        self.s.promoting.update((key, link.name) for key, _, link in items)
        self.tickets.update(zip((key for key, _, _ in items), range(n, n + len(items)), strict=True))
        self._next_ticket = n + len(items)
        self.s.unread.update(key for key, _, _ in items)
        for key, _, link in items:
            link.resident.add(key)

    def launch(self, items: list[tuple[bytes, int, TierLink]], defer: bool = False) -> None:
        """Under the lock (so that close() cannot slip in between): run these promotions, or
        with ``defer`` hold them until :meth:`launch_deferred`."""
        if items:
            self.s.counts["promotions_started"] += len(items)
            if defer:
                self._deferred.extend(items)
            else:
                self.pipe.call_soon(self._start, items)

    @property
    def deferred(self) -> bool:
        """Whether ``launch(defer=True)`` holds promotions. Read without the lock: only the
        scheduler's thread defers them, so a stale False there means none of its own."""
        return bool(self._deferred)

    def launch_deferred(self) -> None:
        """Under the lock: run the promotions held by ``launch(defer=True)``."""
        if self._deferred:
            items, self._deferred = self._deferred, []
            self.pipe.call_soon(self._start, items)

    def _start(self, items: list[tuple[bytes, int, TierLink]]) -> None:
        """On the loop thread: the promotions as read jobs of up to ``MAX_CHUNKS_PER_READ``
        chunks of one tier, spread over ``max_concurrent_reads`` (a long prompt's run is a few
        tasks and executor round trips, not one per chunk: the loop's Python work takes the GIL
        from vLLM's scheduler)."""
        runs: dict[str, list[tuple[bytes, int, TierLink]]] = {}
        for item in items:
            runs.setdefault(item[2].name, []).append(item)
        for run in runs.values():
            size = max(1, min(MAX_CHUNKS_PER_READ, -(-len(run) // self.pipe.max_concurrent_reads)))
            for i in range(0, len(run), size):
                self.pipe.spawn(self._promote(run[i:i + size]))

    async def _promote(self, batch: list[tuple[bytes, int, TierLink]]) -> None:
        async with self.pipe.read_sem:
            await self.pipe.loop.run_in_executor(batch[0][2].read_pool, self._read_batch, batch)

    def _read_batch(self, batch: list[tuple[bytes, int, TierLink]]) -> None:
        """On a read thread: each chunk in turn, handed to the loop thread as soon as it is
        read (a streamed load copies it then), in order, before the job ends."""
        if batch[0][2].slab_reads:
            self._read_batch_into_slab(batch)
            return
        for key, slot, link in batch:
            ok = self._read(key, slot, link)
            self.pipe.call_soon(self._land, key, slot, link, ok)

    def _read_batch_into_slab(self, batch: list[tuple[bytes, int, TierLink]]) -> None:
        """``_read_batch`` by a tier that reads into the slab itself (its read processes:
        ``TierLink.slab_reads``), the whole job in one request; each chunk lands once its last
        shard did."""
        s = self.s
        shards = len(s.namespaces)
        items = [(ns + key, slot, r * s.shard_bytes, s.group_shard_bytes[chunk_group(key)])
                 for key, slot, _ in batch for r, ns in enumerate(s.namespaces)]
        whole = [True] * len(batch)
        landed = 0  # chunks handed to the loop thread

        def read(i: int, n: int | None) -> None:
            nonlocal landed
            chunk = i // shards
            whole[chunk] &= n == items[i][3]
            if i % shards == shards - 1:
                key, slot, link = batch[chunk]
                self.pipe.call_soon(self._land, key, slot, link, whole[chunk])
                landed = chunk + 1

        link = batch[0][2]
        try:
            link.tier.get_many_into_slab(self.s.slab, items, read)  # type: ignore[attr-defined]  # a disk tier: slab_reads
        except Exception:
            logger.exception("kvstrata: %s read of %d chunk(s) failed", link.name, len(batch) - landed)
        for key, slot, link in batch[landed:]:  # not read: failed
            self.pipe.call_soon(self._land, key, slot, link, False)

    def _land(self, key: bytes, slot: int, link: TierLink, ok: bool) -> None:
        """On the loop thread: a chunk read (``ok``) or failed."""
        s = self.s
        writes = []
        with s.lock:
            s.promoting.pop(key, None)
            ticket = self.tickets.pop(key)
            # The board is written before a failed slot can be handed out again (under the
            # lock), and after the slot's bytes (the read thread's writes) are visible everywhere.
            board_fence()
            s.slab.landed[slot] = ticket << 1 | (not ok)
            if ok:
                s.pool.mark_ready(key)
                s.pool.release(key)
                s.counts["promotions_completed"] += 1
                s.counts["read_bytes"] += s.chunk_bytes(key)
                s.journal.add(TIER_HOST, False, [key])
                # Keep it in the tiers above the one it came from (a remote hit on local disk).
                above = s.links[: link.position]
                if above:
                    writes = self.writes.admitted(key, offers=max(x.admit_after for x in above), links=above)
                    self.writes.schedule(writes)
            else:
                link.resident.discard(key)
                s.unread.discard(key)
                pins = s.pool.refs(key) - 1
                if pins > 0:
                    self.dead_pins[key] = self.dead_pins.get(key, 0) + pins
                s.pool.discard(key)
                s.bad.add(key)
                s.counts["promotions_failed"] += 1
            s.landed.notify_all()

    def _read(self, key: bytes, slot: int, link: TierLink) -> bool:
        views = self.s.shard_views(slot, chunk_group(key))
        try:
            get_many = getattr(link.tier, "get_many_into", None)
            if get_many is not None:  # every shard in one round trip (a remote tier)
                got = get_many([(ns + key, view) for ns, view in zip(self.s.namespaces, views, strict=True)])
                return all(n == view.nbytes for n, view in zip(got, views, strict=True))
            for ns, view in zip(self.s.namespaces, views, strict=True):
                if link.tier.get_into(ns + key, view) != view.nbytes:
                    return False
        except Exception:
            logger.exception("kvstrata: %s read of %s failed", link.name, key.hex())
            return False
        return True

    # ---- loads (under the lock) ------------------------------------------------------------------

    def streamed(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """``(slot, ticket)`` per key, pinned (see ``Hierarchy.prepare_streamed_load``)."""
        out: list[tuple[int, int]] = []
        pool = self.s.pool
        for key in keys:
            entry = pool.get(key)
            ticket = self.tickets.get(key, 0)
            if entry is None or not (entry[1] or ticket):
                # Not there, or a store still in flight (never answered HIT): unloadable.
                self.dead_pins[key] = self.dead_pins.get(key, 0) + 1
                out.append((0, -1))
                continue
            out.append((pool.acquire(key), ticket))
            pool.touch(key)
        if self.s.unread:
            self.s.unread.difference_update(keys)
        return out

    def release(self, keys: Sequence[bytes]) -> None:
        """Unpin load slots (once per key per call), skipping pins a failed promotion dropped."""
        dead = self.dead_pins
        for key in keys:
            n = dead.get(key)
            if n:
                if n == 1:
                    del dead[key]
                else:
                    dead[key] = n - 1
                continue
            self.s.pool.release(key)
