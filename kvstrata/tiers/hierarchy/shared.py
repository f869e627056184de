"""What every part of the hierarchy works on: one lock over the host index and the chunk states,
the lower tiers' links, the counters, the tier-event journal, and the I/O pipeline (an asyncio
loop on its own thread, with thread pools for the blocking reads and writes).

Scheduler calls take the lock for O(keys) work only; anything that touches a lower tier runs on
the pipeline (or, for presence checks, outside the lock).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from kvstrata.tiers.hierarchy.reuse import ReuseMeter
from kvstrata.tiers.host import HostPool, HostSlab
from kvstrata.tiers.lower import LowerTier
from kvstrata.tiers.priority import background_thread, name_this_thread

logger = logging.getLogger(__name__)

TIER_HOST = "host"
DEFAULT_WRITE_INFLIGHT_BYTES = 128 << 20  # per lower tier, before its backpressure applies
# A failed write is retried after the tier's next successful one (or once a tier that was
# unavailable answers again) at most this often: one retry covers an outage; a chunk a tier
# keeps refusing must not be sent again after every success.
MAX_WRITE_RETRIES = 1

COUNTERS = (
    "lookups", "lookup_hits", "lookup_pending", "stores_prepared", "stores_completed",
    "stores_failed", "store_no_room", "store_unknown", "loads_prepared", "loads_streamed",
    "promotions_started", "promotions_completed", "promotions_failed", "promote_no_room",
    "promote_room_waits", "promote_queued", "waiting_holds", "waiting_holds_capped",
    "warm_promotions", "read_bytes", "writes_started", "writes_completed", "writes_failed",
    "writes_deferred", "writes_dropped", "write_bytes", "writes_flushed", "writes_retried",
    "writes_resumed", "writes_lost", "writes_urgent", "promotions_unused", "promote_held_back",
)


@dataclass(eq=False)
class PromotionBudget:
    """How many more promotions a lookup may start (``Hierarchy.lookup_many``'s ``budget``),
    spent as its probes start them: one lookup's probes (groups, tails) share it."""

    left: int


def chunk_group(key: bytes) -> int:
    """The KV cache group a chunk key belongs to (its last 4 bytes, big-endian)."""
    return int.from_bytes(key[-4:], "big")


@dataclass(eq=False)
class TierLink:
    """One lower tier as the hierarchy sees it: its admission threshold, which resident host
    chunks it is known to hold, and its write-behind backlog."""

    tier: LowerTier
    position: int  # 0 = the first tier below the host tier
    admit_after: int  # offers (stores, host hits) before a chunk is written to this tier
    # Backpressure: beyond max_inflight bytes of writes, defer (keep the slot) or, with
    # defer False, postpone at once (hold no slot; ``postponed`` below).
    defer: bool = True
    max_inflight: int = DEFAULT_WRITE_INFLIGHT_BYTES
    resident: set[bytes] = field(default_factory=set)  # host chunks known to be in this tier
    # Promotions read straight into the slab by the tier's own processes (get_many_into_slab).
    slab_reads: bool = False
    # The tier frames writes from the host slab in processes of its own (DiskStore.use_write_processes).
    slab_writes: bool = False
    queued: set[bytes] = field(default_factory=set)  # being written, or deferred
    # Queued chunks the tier reported removed meanwhile: a write that committed just before the
    # removal must not mark them resident afterwards.
    removed_while_queued: set[bytes] = field(default_factory=set)
    deferred: deque[bytes] = field(default_factory=deque)
    deferred_bytes: int = 0
    # Host chunks admitted to this tier but not written (backpressure dropped the write, or it
    # failed: a server that did not answer in time), while they stay in the host tier: a clean
    # shutdown writes them (``WriteBehind.flush_unwritten``), so a restart still finds them.
    unwritten: set[bytes] = field(default_factory=set)
    # Those of them whose write backpressure dropped, oldest first: written while serving once
    # the tier's budget has room again (``WriteBehind``), unless the host tier evicts them
    # first (counted lost). They hold no slot, so a slow tier still never holds host memory.
    postponed: dict[bytes, None] = field(default_factory=dict)
    # Whether a store may evict a chunk whose write to this tier is postponed: not for a local
    # store (its writes always go on, so its postponed chunks are written soon), where such a
    # loss would leave a hole in a prefix whose later chunks the tier holds (unservable past
    # it), while a refused store is offered again as its request runs on
    # (``WriteBehind.kept_from_stores``). A remote tier's postponed chunks stay evictable: a
    # server that stops answering must not hold the host tier; nor do a local tier's once its
    # writes stalled (``progress_at``).
    keep_postponed: bool = False
    # When a write to this tier last completed, or started with none in flight (the clock of
    # ``Shared``): writes in flight with no progress for WRITES_STALL_S mean the tier hangs.
    progress_at: float = 0.0
    # Those of them whose write failed: written again once a write to this tier succeeds (the
    # disk has room again) or the tier says it answers again (a shared server's breaker
    # closed: ``ReconnectingTier``), as far as the write budget allows; a chunk whose writes
    # failed more than MAX_WRITE_RETRIES times waits for the shutdown (or, with an admission
    # threshold above 1, its next offer). ``failures``: failed writes per host chunk,
    # until one succeeds or the chunk leaves the host tier.
    failed: set[bytes] = field(default_factory=set)
    failures: dict[bytes, int] = field(default_factory=dict)
    inflight_bytes: int = 0
    writes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("completed", "failed", "dropped", "deferred", "bytes", "flushed", "retried", "resumed",
         "lost", "urgent"), 0))
    # Threads of this tier's own (see Pipeline): a tier that stops answering holds up only
    # its own reads and writes.
    read_pool: ThreadPoolExecutor | None = None
    write_pool: ThreadPoolExecutor | None = None
    # Normal-priority write threads for when the idle ones fall behind (Pipeline), or None.
    urgent_pool: ThreadPoolExecutor | None = None
    # Writes waiting for a thread, oldest first, each (future, key, slot, group): whichever
    # lane's thread comes first runs the oldest (``WriteBehind``). A deque: threads pop, the
    # loop appends, no lock needed.
    waiting_writes: deque[tuple[Any, bytes, int, int]] = field(default_factory=deque)
    # Whether this tier's writes are read back: the ``write_reuse`` gauge (``reuse``; the
    # hierarchy sizes its half-life by the host tier).
    reuse: ReuseMeter = field(default_factory=lambda: ReuseMeter(1 << 30))

    @property
    def name(self) -> str:
        return self.tier.tier_name


class FailedPromotions:
    """Chunks whose promotion failed: a miss from every tier until stored again, or until
    ``retry_after_s`` passed. A chunk that failed for a passing reason (a shared server that
    timed out) is then served again; one that was damaged is gone from its tier by then (a tier
    drops what fails its check), so a retry finds nothing to promote. Called under the lock."""

    PRUNE_AT = 4096  # entries before the expired ones are swept

    def __init__(self, retry_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after_s = retry_after_s
        self._clock = clock  # seconds, monotonic (tests drive it)
        self._at: dict[bytes, float] = {}

    def add(self, key: bytes) -> None:
        now = self._clock()
        if len(self._at) >= self.PRUNE_AT:
            self._at = {k: t for k, t in self._at.items() if now - t < self.retry_after_s}
        self._at[key] = now

    def discard(self, key: bytes) -> None:
        self._at.pop(key, None)

    def clear(self) -> None:
        self._at.clear()

    def __bool__(self) -> bool:
        return bool(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        at = self._at.get(key)  # type: ignore[call-overload]
        if at is None:
            return False
        if self._clock() - at >= self.retry_after_s:
            self._at.pop(key, None)  # type: ignore[call-overload]
            return False
        return True


class Journal:
    """Tier changes for KV cache events: ``(tier, removed, keys)`` batches in the order they
    happened, or nothing at all when nobody listens.

    A lower tier holds one record per chunk and shard, and may delete a chunk's records in
    separate transactions (an eviction that needs one record's room, then another's): the chunk
    is reported removed once, when its first record goes (it can no longer be served), not once
    per transaction."""

    def __init__(self, enabled: bool, shards: int = 1) -> None:
        self._events: deque[tuple[str, bool, list[bytes]]] | None = deque() if enabled else None
        self._shards = shards
        # Per lower tier: chunks reported removed of which some records remain -> records gone.
        # An entry ends when the last record goes or the chunk is written again.
        self._partly_gone: dict[str, dict[bytes, int]] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._events is not None

    def add(self, tier: str, removed: bool, keys: list[bytes]) -> None:
        # Single deque appends are atomic: tiers' own threads add without our lock.
        if self._events is None or not keys:
            return
        if not removed and self._partly_gone.get(tier):
            with self._lock:
                gone = self._partly_gone[tier]
                for key in keys:
                    gone.pop(key, None)
                self._events.append((tier, removed, keys))
            return
        self._events.append((tier, removed, keys))

    def add_removed_records(self, tier: str, records: dict[bytes, int]) -> None:
        """A lower tier deleted ``records[chunk]`` shard records of each chunk: report the
        chunks not reported removed since they were last written."""
        if self._events is None or not records:
            return
        with self._lock:
            gone = self._partly_gone.setdefault(tier, {})
            first = []
            for key, n in records.items():
                before = gone.pop(key, 0)
                if before == 0:
                    first.append(key)
                if before + n < self._shards:
                    gone[key] = before + n
            if first:
                self._events.append((tier, True, first))

    def take(self) -> list[tuple[str, bool, list[bytes]]]:
        events = self._events
        out = []
        while events:
            out.append(events.popleft())
        return out


class Shared:
    """The hierarchy's shared state (see the module docstring)."""

    def __init__(
        self,
        pool: HostPool,
        links: Sequence[TierLink],
        *,
        namespaces: Sequence[bytes],
        group_shard_bytes: Sequence[int],
        group_dtypes: Sequence[str],
        shard_bytes: int | None,
        events: bool,
        offer_tracker_size: int,
        retry_failed_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        slab = pool.slab
        if slab is None:
            raise ValueError("the host pool needs its slab")
        if not namespaces:
            raise ValueError("at least one namespace (shard) is required")
        if len(group_shard_bytes) != len(group_dtypes):
            raise ValueError("group_shard_bytes and group_dtypes must have one entry per group")
        self.pool = pool
        self.slab = slab
        self.links = list(links)
        self.namespaces = [bytes(ns) for ns in namespaces]
        self.shard_bytes = shard_bytes or slab.slot_bytes // len(self.namespaces)
        if self.shard_bytes * len(self.namespaces) > slab.slot_bytes:
            raise ValueError(f"{len(self.namespaces)} shards of {self.shard_bytes} bytes exceed the slot")
        if max(group_shard_bytes) > self.shard_bytes:
            raise ValueError(f"a group needs {max(group_shard_bytes)} bytes, shards hold {self.shard_bytes}")
        self.group_shard_bytes = list(group_shard_bytes)
        self.group_dtypes = list(group_dtypes)
        self.lock = threading.Lock()
        # Notified whenever a promotion lands (or fails): lets an idle engine wait for one
        # instead of spinning through empty steps.
        self.landed = threading.Condition(self.lock)
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.closed = False
        self.storing: set[bytes] = set()  # prepare_store'd, not completed
        self.promoting: dict[bytes, str] = {}  # lower tier -> host in flight: key -> tier name
        # Chunks pinned for requests whose lookup waits (``Hierarchy.hold``): key -> pins.
        self.held: dict[bytes, int] = {}
        # Chunks promoted that no load has pinned yet: evicted so, the promotion was read for
        # nothing (``promotions_unused``, a host tier too small for what requests wait on).
        self.unread: set[bytes] = set()
        self.bad = FailedPromotions(retry_failed_after_s, clock)
        self.clock = clock  # monotonic seconds (tests drive it)
        self.journal = Journal(events, shards=len(self.namespaces))
        # Offers of each chunk (stores, host hits), for the tiers' admission thresholds.
        self.offers: OrderedDict[bytes, int] = OrderedDict()
        self._offer_tracker_size = offer_tracker_size

    def offer(self, key: bytes) -> int:
        """Count one more offer of ``key`` (under the lock); its count."""
        offers = self.offers
        n = offers.get(key, 0) + 1
        offers[key] = n
        offers.move_to_end(key)
        if len(offers) > self._offer_tracker_size:
            offers.popitem(last=False)
        return n

    def chunk_bytes(self, key: bytes) -> int:
        return self.group_shard_bytes[chunk_group(key)] * len(self.namespaces)

    def shard_views(self, slot: int, group: int) -> list[memoryview]:
        """Slot ``slot``'s meaningful bytes of ``group``, one view per shard."""
        n = self.group_shard_bytes[group]
        row = self.slab.array[slot]
        return [memoryview(row[r * self.shard_bytes : r * self.shard_bytes + n])
                for r in range(len(self.namespaces))]


class Pipeline:
    """The asyncio loop on its own thread, and per lower tier a read pool and a write pool: a
    backlog of writes never delays a promotion the next step waits for, and a tier that stops
    answering never holds up another tier's reads or writes."""

    def __init__(self, links: Sequence[TierLink], *, read_threads: int, write_threads: int,
                 max_concurrent_reads: int, idle_writes: bool = True,
                 urgent_writes: bool = False) -> None:
        self.links = list(links)
        # Writes yield to serving (tiers/priority.py); reads keep normal priority: a request
        # waits on them. With ``urgent_writes`` each tier also gets write threads at normal
        # priority, which the write-behind uses while the idle ones are behind.
        for link in self.links:
            link.read_pool = ThreadPoolExecutor(read_threads, thread_name_prefix=f"kvstrata-read-{link.name}",
                                                initializer=name_this_thread)
            link.write_pool = ThreadPoolExecutor(write_threads, thread_name_prefix=f"kvstrata-write-{link.name}",
                                                 initializer=partial(background_thread, idle_writes))
            if urgent_writes and idle_writes:
                link.urgent_pool = ThreadPoolExecutor(
                    write_threads, thread_name_prefix=f"kvstrata-urgent-{link.name}",
                    initializer=name_this_thread)
        self.loop = asyncio.new_event_loop()
        self.read_sem = asyncio.Semaphore(max_concurrent_reads)
        self.max_concurrent_reads = max_concurrent_reads
        self.tasks: set[asyncio.Task[None]] = set()
        self.thread = threading.Thread(target=self.run, name="kvstrata-io", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        name_this_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def spawn(self, coro: Any) -> None:
        """On the loop thread: run ``coro`` as a task kept until it ends."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def call_soon(self, fn: Any, *args: Any) -> None:
        """From any thread: run ``fn(*args)`` on the loop thread."""
        self.loop.call_soon_threadsafe(fn, *args)

    def pending(self) -> list[asyncio.Task[None]]:
        return [t for t in self.tasks if not t.done()]

    def stop(self, drained: bool) -> None:
        """Stop the loop and the pools (waiting for their work only if ``drained``)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        if drained:
            self.loop.close()
        for link in self.links:
            for pool in (link.read_pool, link.write_pool, link.urgent_pool):
                if pool is not None:
                    pool.shutdown(wait=drained)


def per_tier(name: str, value: Any, n: int) -> list[Any]:
    """One value per lower tier: ``value`` repeated, or the sequence given (its length checked)."""
    if isinstance(value, (int, str)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{len(values)} values of {name} for {n} lower tiers")
    return values


def use_processes(tier: LowerTier, what: Literal["read", "write"], slab: HostSlab, processes: int,
                   **kw: Any) -> bool:
    """Have ``tier`` read promotions into ``slab`` (``what`` "read") or frame writes from it
    ("write") in ``processes`` processes of its own (a disk tier: ``DiskStore.use_read_processes``
    and ``use_write_processes``); False when it does that in the pipeline's threads (no processes
    asked for, a tier that has none, or they could not start: logged)."""
    use = getattr(tier, f"use_{what}_processes", None)
    if processes <= 0 or use is None:
        return False
    try:
        use(slab, processes, **kw)
    except (RuntimeError, OSError, MemoryError) as exc:  # ProcessesUnavailable is a RuntimeError;
        # MemoryError: no shared memory for the write processes' frame slab
        logger.warning("kvstrata: the disk %s processes did not start (%s); working in the "
                       "engine's threads", what, exc)
        return False
    return True
