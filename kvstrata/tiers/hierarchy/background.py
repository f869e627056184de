"""Background scans of the first lower tier after a restart: the warm start and the disk
announcement.

* **warm start**: the chunks used most recently (the tier's access ticks) are promoted into free
  host slots, one batch of ``max_concurrent_reads`` at a time so that a request's own promotion
  queues behind at most one batch; it never evicts what a request stored.
* **announcement**: every chunk of this model with all its shards in the tier is reported as a
  tier change (batches of ``ANNOUNCE_BATCH`` keys), so a KV-aware router learns after a restart
  what this engine can serve; a record dropped after its batch was checked is reported removed
  again after the batch, so the last word on it is "removed".
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstrata.tiers.hierarchy.shared import Pipeline, Shared, TierLink
from kvstrata.tiers.lower import ScannableTier, all_shards_present

logger = logging.getLogger(__name__)

ANNOUNCE_BATCH = 1024  # chunk keys per announced change (one KV event per group)


class Background:
    def __init__(self, shared: Shared, pipeline: Pipeline,
                 promote: Callable[[Sequence[bytes], dict[bytes, str]], Any],
                 wait_promotions: Callable[[Sequence[bytes], float | None], bool]) -> None:
        self.s = shared
        self.pipe = pipeline
        self._promote = promote  # a lookup without bookkeeping, collecting promoted keys
        self._wait = wait_promotions
        first = shared.links[0] if shared.links else None
        self.link: TierLink | None = first if first is not None and isinstance(first.tier, ScannableTier) else None
        # Set while no warm start is under way (none asked for, or it ended: done, stopped at
        # full host slots, or skipped).
        self.warm_done = threading.Event()
        self.warm_done.set()

    def warm_start(self, max_chunks: int) -> None:
        if self.link is None or max_chunks <= 0:
            return
        with self.s.lock:
            if not self.s.closed:
                self.warm_done.clear()
                self.pipe.call_soon(self.pipe.spawn, self._warm(max_chunks))

    def announce(self) -> None:
        if self.link is None or not self.s.journal.enabled:
            return
        with self.s.lock:
            if not self.s.closed:
                self.pipe.call_soon(self.pipe.spawn, self._announce())

    # ---- warm start ----------------------------------------------------------------------------

    async def _warm(self, max_chunks: int) -> None:
        try:
            await self._warm_all(max_chunks)
        finally:
            self.warm_done.set()

    async def _warm_all(self, max_chunks: int) -> None:
        loop = self.pipe.loop
        try:
            keys = await loop.run_in_executor(None, self._recent_chunks, max_chunks)
        except Exception:
            logger.exception("kvstrata: warm start could not list the store; skipped")
            return
        step = self.pipe.max_concurrent_reads
        for i in range(0, len(keys), step):
            if self.s.closed:
                return
            # Off the loop thread: the lookup reads the tier's index, and the batch is waited for.
            if not await loop.run_in_executor(None, self._warm_batch, keys[i : i + step]):
                return

    def _warm_batch(self, keys: list[bytes]) -> bool:
        """Promote what fits in the free host slots and wait until it landed; False once the
        free slots are all taken."""
        with self.s.lock:
            free = self.s.pool.free_slots
        started: dict[bytes, str] = {}
        if free:
            self._promote(keys[:free], started)
        with self.s.lock:
            self.s.counts["warm_promotions"] += len(started)
        self._wait(list(started), None)  # returns at once when close() began
        return free > len(keys)

    def _recent_chunks(self, max_chunks: int) -> list[bytes]:
        """Chunk keys of the first shard's records, most recently used first (index scan)."""
        records = ((rec.tick, key) for key, rec in self._own_records())
        return [key for _, key in heapq.nlargest(max_chunks, records)]

    # ---- announcement --------------------------------------------------------------------------

    async def _announce(self) -> None:
        try:
            await self.pipe.loop.run_in_executor(None, self._announce_stored)
        except Exception:
            logger.exception("kvstrata: could not list the store for KV events; skipped")

    def _announce_stored(self) -> None:
        assert self.link is not None
        name, journal = self.link.name, self.s.journal
        for batch in self._stored_chunks():
            if self.s.closed:
                return
            journal.add(name, False, batch)
            # The tier may have dropped one of them after the batch was read, its removal then
            # preceding this announcement: report those removed again, after it.
            present = all_shards_present(self.link.tier, self.s.namespaces, batch)
            journal.add(name, True, [k for k, here in zip(batch, present, strict=True) if not here])

    def _stored_chunks(self) -> Iterator[list[bytes]]:
        """Chunk keys with every shard in the tier, in batches of at most ``ANNOUNCE_BATCH``."""
        batch: list[bytes] = []
        for key, _rec in self._own_records():
            batch.append(key)
            if len(batch) == ANNOUNCE_BATCH:
                yield self._with_all_shards(batch)
                batch = []
        if batch and not self.s.closed:
            yield self._with_all_shards(batch)

    def _with_all_shards(self, keys: list[bytes]) -> list[bytes]:
        assert self.link is not None
        if len(self.s.namespaces) == 1:
            return keys
        present = all_shards_present(self.link.tier, self.s.namespaces, keys)
        return [k for k, here in zip(keys, present, strict=True) if here]

    def _own_records(self) -> Iterator[tuple[bytes, Any]]:
        """(chunk key, record) of every first-shard record of this model, in index order; stops
        when close() begins (a large store takes a while: do not hold up close())."""
        assert self.link is not None
        tier = self.link.tier
        assert isinstance(tier, ScannableTier)
        ns = self.s.namespaces[0]
        n = len(ns)
        for key, rec in tier.iter_index():
            if self.s.closed:
                return
            if key[:n] == ns:
                yield key[n:], rec
