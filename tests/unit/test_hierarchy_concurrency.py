"""The Hierarchy under concurrent callers: a scheduler thread, the I/O thread and a prober at
once, and calls from an asyncio event loop."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from hierarchy_helpers import (
    CHUNK_BYTES,
    DEADLINE_S,
    HIT,
    MISS,
    PENDING,
    GatedDisk,
    fill,
    holds,
    key,
    store,
)

# ---- concurrency ----------------------------------------------------------------------------------


def test_concurrent_store_lookup_load(env):
    """The scheduler thread stores, looks up and loads while the I/O thread completes writes and
    promotions and a third thread probes the index and reads stats (lock contention)."""
    disk = env.disk()
    # Normal-priority writes: at idle priority (the default) the busy scheduler thread here can
    # keep them from landing before it ends, and then nothing evicted is on disk to promote.
    h = env.hier(disk, slots=12, max_write_inflight_bytes=3 * CHUNK_BYTES, idle_writes=False)
    errors: list[BaseException] = []
    stop = threading.Event()

    def scheduler() -> None:
        rng = np.random.default_rng(7)
        try:
            for _ in range(600):
                batch = [key(int(i), group=int(i) % 2) for i in rng.integers(0, 40, 3)]
                states = h.lookup_many(batch)
                # As vLLM does: a request's load is prepared right after its lookup.
                hits = [k for k, s in zip(batch, states, strict=True) if s == HIT]
                if hits:
                    slots = h.prepare_load(hits)
                    for s, k in zip(slots, hits, strict=True):
                        assert holds(h.slab, s, k), "a loaded slot holds another chunk's bytes"
                    h.complete_load(hits)
                misses = [k for k, s in zip(batch, states, strict=True) if s == MISS]
                if misses:
                    slots = h.prepare_store(misses)
                    if slots:
                        for k, s in slots.items():
                            fill(h.slab, s, k)
                        h.complete_store(list(slots), success=bool(rng.integers(0, 8)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    def prober() -> None:
        try:
            while not stop.is_set():
                assert h.lookup_many([key(10_000 + i) for i in range(8)]) == [MISS] * 8
                h.stats()
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=scheduler), threading.Thread(target=prober)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    h.close()
    st = h.stats()
    assert st["host"]["referenced"] == 0 and st["host"]["not_ready"] == 0
    assert st["writes_completed"] > 0 and st["promotions_completed"] > 0
    assert st["writes_started"] == st["writes_completed"] + st["writes_failed"]
    assert st["promotions_failed"] == 0


async def test_scheduler_calls_from_an_event_loop(env):
    """A caller living in its own asyncio loop: calls return at once, prefetch lands later."""
    disk = env.disk()
    h = env.hier(disk)
    store(h, [key(1)])
    h.close()
    gated = GatedDisk(disk)
    gated.reads_open.clear()
    h2 = env.hier(gated)
    assert h2.lookup_many([key(1)]) == [PENDING]  # returns with the read still blocked
    gated.reads_open.set()
    for _ in range(int(DEADLINE_S / 0.005)):
        if h2.lookup_many([key(1)]) == [HIT]:
            break
        await asyncio.sleep(0.005)
    assert h2.lookup_many([key(1)]) == [HIT]
