"""Write-behind: host chunks copied down into every lower tier that admits them.

A chunk whose store to host completed (or that was promoted from a lower tier, for the tiers
above the one it came from) and whose offers reach a tier's admission threshold is written to
that tier, holding a reference on its host slot meanwhile. Per tier, at most its
``max_inflight`` bytes are in flight; beyond that new writes are deferred (keeping their slot, up
to ``max_deferred_bytes``) or dropped, as the tier's link says, and counted. Callers never wait
on a tier. A write that failed (a server that did not answer in time, a full disk) is tried
again once a later write to the same tier succeeds. A clean shutdown (``Hierarchy.close``) writes
the chunks still in the host tier whose write was dropped or failed before it drains.

The host tier is never held back by its own write-behind: writes in flight and deferred pin at
most ``max_pinned_bytes`` of host slots (half the host tier by default; each tier an even share
of it). Beyond that (or beyond a "drop" tier's write budget) writes are postponed without a
slot reference: the oldest postponed chunk still in the host tier is written whenever the
budget has room again, and one the host tier evicts first is counted lost. A promotion evicts
a chunk postponed for a local tier only when no other idle chunk is left, and a store never
does (``kept_from_stores``): it is refused instead, and its request offers the chunks again
in a later step, while the postponed chunk, evicted, would be lost for good (and with it every
later chunk of its prefix, docs/BENCHMARKS.md "Stores no longer evict what the disk has not
got"). Unless the tier's writes stalled (none completed for ``WRITES_STALL_S`` while some are
in flight: a hung device): then the host tier goes on caching what is stored, as without a
disk. Where
the write threads run at idle priority, the write-behind uses the tier's normal-priority threads
(``urgent_pool``) while it is behind (postponed chunks waiting, or half its pin budget used):
idle threads alone get no CPU on an engine that keeps every core busy, and the host tier then
drops what the disk never got (docs/BENCHMARKS.md, "The write-behind held the host tier").
It does so whether or not the tier's writes have been read back yet: waiting for that evidence
lost a fifth of a multi-round workload's reusable chunks, since a session's second round comes
back only after every other session's first was stored (docs/BENCHMARKS.md, "Catching up
without waiting for reuse"); a workload that never reuses pays the catch-up instead (6-10 %
of its time on a CPU-bound engine; ``background_priority: idle`` turns it off).
Writes wait in one queue per tier, oldest first, and a thread takes the oldest: each write
queued sends one idle thread, and one normal-priority thread too while the write-behind is
behind, so the normal-priority threads run as many writes as were queued while behind (running
more costs a CPU-bound engine its cores: 1.24x its time on a workload without reuse when they
emptied the queue, docs/BENCHMARKS.md), oldest first, those queued for idle threads before it
fell behind included.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

from kvstrata.tiers.hierarchy.shared import (
    MAX_WRITE_RETRIES,
    Pipeline,
    Shared,
    TierLink,
    chunk_group,
)

logger = logging.getLogger(__name__)

# (link, chunk key, host slot, group, bytes)
Write = tuple[TierLink, bytes, int, int, int]

# Writes in flight with none completing for this long: the tier hangs, and the chunks postponed
# for it are evictable by stores again. A chunk's write takes milliseconds, a catching-up
# backlog on a busy CPU well under a second (docs/BENCHMARKS.md, "Catching up without waiting
# for reuse").
WRITES_STALL_S = 2.0


class PostponedChunks:
    """The host chunks whose write to one of ``links`` is postponed, as a container that
    follows the links (read under the hierarchy's lock)."""

    __slots__ = ("_links",)

    def __init__(self, links: Sequence[TierLink]) -> None:
        self._links = list(links)

    def __contains__(self, key: object) -> bool:
        return any(key in link.postponed for link in self._links)

    def __iter__(self) -> Iterator[bytes]:
        """Each such chunk once."""
        if len(self._links) == 1:
            return iter(self._links[0].postponed)
        return iter(dict.fromkeys(k for link in self._links for k in link.postponed))


class WriteBehind:
    def __init__(
        self,
        shared: Shared,
        pipeline: Pipeline,
        *,
        max_deferred_bytes: int,
        max_pinned_bytes: int,
    ) -> None:
        self.s = shared
        self.pipe = pipeline
        self.max_deferred = max_deferred_bytes
        self.max_pinned = max_pinned_bytes
        self._keeping = [link for link in shared.links if link.keep_postponed]
        self._none = PostponedChunks(())

    def kept_from_stores(self) -> PostponedChunks:
        """The chunks a store must not evict and a promotion evicts last (module docstring):
        those postponed for a local tier whose writes go on. Under the lock."""
        if not self._keeping:
            return self._none
        now = self.s.clock()
        return PostponedChunks([link for link in self._keeping if link.postponed and not (
            link.inflight_bytes and now - link.progress_at > WRITES_STALL_S)])

    def link_budget(self) -> int:
        """Host bytes one tier's writes may pin: the budget shared evenly, so a tier that stops
        answering holds only its own share and never postpones another tier's writes."""
        return self.max_pinned // max(1, len(self.s.links))

    def _fits(self, link: TierLink, size: int) -> bool:
        pinned = link.inflight_bytes + link.deferred_bytes
        return pinned == 0 or pinned + size <= self.link_budget()

    def _can_start(self, link: TierLink, size: int) -> bool:
        """Whether a write of ``size`` bytes may start now: within the pin budget and the
        tier's own write budget (one write always may, however large)."""
        return self._fits(link, size) and (
            link.inflight_bytes == 0 or link.inflight_bytes + size <= link.max_inflight)

    def behind(self, link: TierLink) -> bool:
        """Whether the writes of ``link`` fall behind: chunks postponed, or half its pin budget
        used. Read without the lock (a hint for which threads run the next write)."""
        return bool(link.postponed) or 2 * (link.inflight_bytes + link.deferred_bytes) >= self.link_budget()

    def catch_up(self, link: TierLink) -> bool:
        """Whether the next write of ``link`` also goes to its normal-priority threads: it is
        behind (module docstring). A hint, read without the lock."""
        return link.urgent_pool is not None and self.behind(link)

    # ---- under the lock ------------------------------------------------------------------------

    def admitted(self, key: bytes, offers: int, links: Sequence[TierLink] | None = None) -> list[Write]:
        """Queue ``key`` (ready in the host tier, offered ``offers`` times) for every tier that
        admits it now and does not hold it; returns the writes that may start at once."""
        out = []
        for link in self.s.links if links is None else links:
            if offers >= link.admit_after and (item := self._admit(link, key)) is not None:
                out.append(item)
        return out

    def _admit(self, link: TierLink, key: bytes) -> Write | None:
        if self.s.closed or key in link.resident or key in link.queued:
            return None
        size = self.s.chunk_bytes(key)
        link.reuse.admitted(size)
        if self._can_start(link, size):
            return self._claim(link, key, size)
        if self._fits(link, size) and link.defer and link.deferred_bytes + size <= self.max_deferred:
            self.s.pool.acquire(key)  # the slot must survive until the write runs
            link.queued.add(key)
            link.deferred.append(key)
            link.deferred_bytes += size
            link.writes["deferred"] += 1
            self.s.counts["writes_deferred"] += 1
            return None
        link.writes["dropped"] += 1
        self.s.counts["writes_dropped"] += 1
        link.unwritten.add(key)
        link.postponed[key] = None
        return None

    def _claim(self, link: TierLink, key: bytes, size: int, pinned: bool = False) -> Write:
        pool = self.s.pool
        entry = pool.get(key)
        slot = pool.acquire(key) if not pinned else entry[0]  # type: ignore[index]
        link.queued.add(key)
        link.unwritten.discard(key)
        link.postponed.pop(key, None)
        link.failed.discard(key)
        if not link.inflight_bytes:
            link.progress_at = self.s.clock()
        link.inflight_bytes += size
        self.s.counts["writes_started"] += 1
        return link, key, slot, chunk_group(key), size

    def flush_unwritten(self) -> int:
        """Queue, for the drain of a clean shutdown, every chunk whose write backpressure
        dropped or that failed and that is still in the host tier (most recently used first),
        beyond the deferral budget: shutting down must not lose what serving had no time (or
        no server) to write. Returns how many writes it queued."""
        pool = self.s.pool
        queued = 0
        for link in self.s.links:
            if not link.unwritten:
                continue
            order = [k for k in reversed(pool.keys()) if k in link.unwritten]
            link.unwritten.clear()
            link.postponed.clear()
            link.failed.clear()
            for key in order:
                if not pool.is_ready(key) or key in link.resident or key in link.queued:
                    continue
                pool.acquire(key)  # the slot must survive until the write runs
                link.queued.add(key)
                link.deferred.append(key)
                link.deferred_bytes += self.s.chunk_bytes(key)
                link.writes["flushed"] += 1
                queued += 1
        self.s.counts["writes_flushed"] += queued
        return queued

    def schedule(self, items: list[Write]) -> None:
        # Called under the lock: close() sets ``closed`` under it and then queues its drain,
        # which therefore runs after every write accepted before.
        if items:
            self.pipe.call_soon(self._start, items)

    def _pump(self, link: TierLink, force: bool = False) -> list[Write]:
        """Deferred writes of ``link`` that fit now, then postponed ones still in the host tier;
        ``force`` takes every deferred one (drain; the shutdown queues postponed ones itself)."""
        out = []
        while link.deferred:
            key = link.deferred[0]
            size = self.s.chunk_bytes(key)
            if not force and link.inflight_bytes and link.inflight_bytes + size > link.max_inflight:
                break
            link.deferred.popleft()
            link.deferred_bytes -= size
            out.append(self._claim(link, key, size, pinned=True))
        if force or self.s.closed:  # a shutdown writes postponed chunks only if asked to
            return out
        pool = self.s.pool
        while link.postponed:
            key = next(iter(link.postponed))
            if not pool.is_ready(key) or key in link.resident or key in link.queued:
                del link.postponed[key]
                continue
            size = self.s.chunk_bytes(key)
            if not self._can_start(link, size):
                break
            out.append(self._claim(link, key, size))
            link.writes["resumed"] += 1
            self.s.counts["writes_resumed"] += 1
        return out

    def evicted(self, keys: Sequence[bytes]) -> None:
        """The host tier evicted ``keys`` (under the lock): a postponed write of one is lost."""
        for link in self.s.links:
            postponed = link.postponed
            if not postponed:
                continue
            for key in keys:
                if postponed.pop(key, 0) is None:
                    link.writes["lost"] += 1
                    self.s.counts["writes_lost"] += 1
                    link.reuse.lost(key, self.s.chunk_bytes(key))

    def forget(self, link: TierLink, keys: Sequence[bytes]) -> None:
        """The tier removed these chunks: a resident one is written again when admitted next
        (or it would be lost at a restart). Called on the tier's thread, without our lock:
        single set operations are atomic, and a race at worst repeats one write."""
        link.resident.difference_update(keys)
        link.removed_while_queued.update(k for k in keys if k in link.queued)

    # ---- loop thread ---------------------------------------------------------------------------

    def _start(self, items: list[Write]) -> None:
        for item in items:
            self.pipe.spawn(self._write(*item))

    async def _write(self, link: TierLink, key: bytes, slot: int, group: int, size: int) -> None:
        done: asyncio.Future[bool] = self.pipe.loop.create_future()
        link.waiting_writes.append((done, key, slot, group))
        assert link.write_pool is not None
        link.write_pool.submit(self._run_oldest, link, False)
        if self.catch_up(link):
            assert link.urgent_pool is not None
            link.urgent_pool.submit(self._run_oldest, link, True)
        ok = await done
        s = self.s
        with s.lock:
            link.inflight_bytes -= size
            link.progress_at = s.clock()
            link.queued.discard(key)
            removed = key in link.removed_while_queued
            link.removed_while_queued.discard(key)
            s.pool.release(key)
            if ok and not removed:
                link.failures.pop(key, None)
                link.resident.add(key)
                link.writes["completed"] += 1
                link.writes["bytes"] += size
                s.counts["writes_completed"] += 1
                s.counts["write_bytes"] += size
                s.journal.add(link.name, False, [key])
            else:
                link.writes["failed"] += 1
                s.counts["writes_failed"] += 1
                if not removed and s.pool.is_ready(key):
                    # Tried again after the tier's next successful write or once it answers
                    # again after an outage (once), by its next offer (admission above 1), or
                    # by a clean shutdown.
                    link.unwritten.add(key)
                    link.failures[key] = n = link.failures.get(key, 0) + 1
                    if n <= MAX_WRITE_RETRIES:
                        link.failed.add(key)
            more = self._pump(link)
            if ok and link.failed:
                more += self._retry_failed(link)
            if ok and removed and s.pool.is_ready(key):
                # The tier dropped it while this write was queued, and offers meanwhile found it
                # queued: write it again now if it is still admitted.
                more += self.admitted(key, s.offers.get(key, 0), links=[link])
        self._start(more)

    def resume(self, link: TierLink) -> list[Write]:
        """``link`` answers again after an outage: its postponed writes that fit now and its
        failed ones start, as after a successful write. Under the lock."""
        if self.s.closed:
            return []
        return self._pump(link) + self._retry_failed(link)

    def _retry_failed(self, link: TierLink) -> list[Write]:
        """A write to ``link`` just succeeded: start again the failed writes of chunks the host
        tier still holds, as far as the tier's write budget allows now (the rest wait for the
        next success). Under the lock."""
        pool = self.s.pool
        out = []
        while link.failed:
            key = link.failed.pop()
            if not pool.is_ready(key) or key in link.resident or key in link.queued:
                continue
            size = self.s.chunk_bytes(key)
            if not self._can_start(link, size):
                link.failed.add(key)
                break
            out.append(self._claim(link, key, size))
            link.writes["retried"] += 1
            self.s.counts["writes_retried"] += 1
        return out

    def _run_oldest(self, link: TierLink, urgent: bool) -> None:
        """On a write thread: run the oldest waiting write of ``link``, unless the other lane
        took it already (every write sends one task to the idle threads, and one to the
        normal-priority threads if the tier is behind: whichever comes first runs the oldest).
        Its outcome reaches the loop from the thread that commits it: an idle-priority thread
        may not run again for a while after handing its write over (docs/BENCHMARKS.md, "A
        write is reported when it commits")."""
        try:
            done, key, slot, group = link.waiting_writes.popleft()
        except IndexError:
            return
        s = self.s
        if urgent:
            with s.lock:
                link.writes["urgent"] += 1
                s.counts["writes_urgent"] += 1
        dtype = s.group_dtypes[group]
        shard = s.group_shard_bytes[group]
        loop = self.pipe.loop

        def stored(n: int) -> None:
            try:
                loop.call_soon_threadsafe(_resolve, done, n == len(s.namespaces))
            except RuntimeError:  # the loop is closed: nobody waits for the outcome any more
                pass

        try:
            if link.slab_writes and not urgent:  # (an urgent write is framed in its own thread at once)
                items = [(ns + key, slot, r * s.shard_bytes, shard, dtype) for r, ns in enumerate(s.namespaces)]
                link.tier.put_many_from_slab_then(s.slab, items, stored)  # type: ignore[attr-defined]  # a disk tier
            else:
                entries = [(ns + key, view, dtype)
                           for ns, view in zip(s.namespaces, s.shard_views(slot, group), strict=True)]
                link.tier.put_many_then(entries, stored)
        except Exception:
            logger.exception("kvstrata: %s write of %s failed", link.name, key.hex())
            stored(0)

    async def drain(self) -> None:
        """Every accepted write, deferred ones too (close)."""
        while True:
            with self.s.lock:
                more = [item for link in self.s.links for item in self._pump(link, force=True)]
            self._start(more)
            pending = self.pipe.pending()
            if not pending and not more:
                return
            await asyncio.wait(pending)

    def stats(self) -> dict[str, int]:
        """Backlog figures over all tiers (under the lock)."""
        links = self.s.links
        return {
            "write_inflight_bytes": sum(link.inflight_bytes for link in links),
            "write_deferred": sum(len(link.deferred) for link in links),
            "write_deferred_bytes": sum(link.deferred_bytes for link in links),
            # Writes started but waiting for a write thread (idle threads that get no CPU).
            "write_waiting": sum(len(link.waiting_writes) for link in links),
        }


def _resolve(done: asyncio.Future[bool], ok: bool) -> None:
    if not done.done():
        done.set_result(ok)
