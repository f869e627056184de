"""The Hierarchy's promotions from disk to the host tier: prefetch on lookup (bounded,
deduplicated, never evicting a hit), awaiting promotions, the warm start, and corrupt or
wrong-size records."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hierarchy_helpers import (
    DEADLINE_S,
    GROUP_BYTES,
    HIT,
    MISS,
    NS,
    PENDING,
    GatedDisk,
    corrupt_payload,
    eventually,
    fill,
    holds,
    key,
    on_disk,
    store,
    ten_on_disk_twelve_of_sixteen_slots_held,
)

from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy

# ---- prefetch -------------------------------------------------------------------------------------


def test_a_promotion_never_evicts_a_chunk_the_same_lookup_answered_hit(env):
    """One request's lookup probes in several batches (groups, windows, tails): a chunk an
    earlier batch answered HIT is about to be loaded, so a later batch's promotion must not
    evict it (prepare_load would then fail inside vLLM's scheduler)."""
    disk = env.disk()
    h = env.hier(disk, slots=4)
    store(h, [key(i) for i in range(4)])
    eventually(lambda: all(on_disk(disk, key(i)) for i in range(4)), "write-behind")
    h.close()
    h2 = env.hier(disk, slots=2)
    store(h2, [key(10)])  # an unrelated chunk, the least recently used
    store(h2, [key(0)])
    eventually(lambda: h2.stats()["writes_completed"] == 2, "write-behind")  # slots idle again
    answered: set[bytes] = set()
    assert h2.lookup_many([key(0)], protect=answered) == [HIT]
    answered.add(key(0))
    # The next batch needs two slots: key(10) may go, key(0) may not.
    assert h2.lookup_many([key(1), key(2)], protect=answered) == [PENDING, MISS]
    assert h2.prepare_load([key(0)])  # still there
    h2.complete_load([key(0)])
    eventually(lambda: h2.lookup_many([key(1)]) == [HIT], "promotion")
    # Without the protection the same batch evicts it (what a lookup did before).
    h3 = env.hier(disk, slots=1)
    store(h3, [key(0)])
    eventually(lambda: h3.stats()["writes_completed"] == 1, "write-behind")
    assert h3.lookup_many([key(0)]) == [HIT]
    assert h3.lookup_many([key(1)]) == [PENDING]
    with pytest.raises(KeyError):
        h3.prepare_load([key(0)])


def test_a_prefix_probe_starts_no_promotion_past_its_first_miss(env):
    """A full-attention run ends at its first chunk that is nowhere: chunks after it on disk are
    not promoted (they would take host slots, and the lookup would wait for them)."""
    disk = env.disk()
    h = env.hier(disk)
    store(h, [key(i) for i in (0, 1, 3, 4)])
    h.close()
    h2 = env.hier(disk)
    keys = [key(i) for i in range(5)]
    assert h2.lookup_many(keys, prefix=True) == [PENDING, PENDING, MISS, MISS, MISS]
    assert h2.stats()["promotions_started"] == 2
    # Host chunks past the miss still answer HIT (the run ignores them); nothing is promoted.
    store(h2, [key(4)])
    assert h2.lookup_many(keys, prefix=True)[2:] == [MISS, MISS, HIT]
    assert h2.stats()["promotions_started"] == 2
    # A plain probe (a window, or no run) promotes everything it finds.
    eventually(lambda: h2.lookup_many(keys[:2]) == [HIT, HIT], "promotions")
    assert h2.lookup_many(keys) == [HIT, HIT, MISS, PENDING, HIT]
    assert h2.stats()["promotions_started"] == 3


def _restart_with_stuck_reads(env, keys: list[bytes], **kw) -> tuple[GatedDisk, Hierarchy]:
    """Store ``keys`` to disk, then a new hierarchy on the same store whose disk reads block
    until ``gated.reads_open`` is set."""
    disk = env.disk()
    h = env.hier(disk, slots=16)
    store(h, keys)
    h.close()
    gated = GatedDisk(disk)
    gated.reads_open.clear()
    return gated, env.hier(gated, **kw)


def test_prefetch_is_deduplicated_and_bounded(env):
    keys = [key(i) for i in range(6)]
    gated, h2 = _restart_with_stuck_reads(env, keys, max_concurrent_reads=2, read_threads=4)
    for _ in range(5):  # a scheduler asking again every step while the reads are stuck
        assert h2.lookup_many(keys) == [PENDING] * 6
        assert h2.promote(keys) == [PENDING] * 6
    eventually(lambda: gated.active_reads == 2, "two reads in flight")
    assert h2.stats()["promotions_started"] == 6
    gated.reads_open.set()
    eventually(lambda: h2.lookup_many(keys) == [HIT] * 6, "promotions")
    assert sorted(gated.get_calls) == sorted(ns + k for k in keys for ns in NS)  # once each
    assert gated.max_active_reads <= 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_lookup_naming_a_chunk_twice_promotes_it_once(env, stream):
    keys = [key(i) for i in range(4)]
    gated, h2 = _restart_with_stuck_reads(env, keys)
    asked = [*keys, keys[2], keys[0]]
    promoting: dict[bytes, str] = {}
    answer = HIT if stream else PENDING  # a streamed lookup answers HIT for a chunk landing
    assert h2.lookup_many(asked, promoting, stream=stream) == [answer] * 6
    assert promoting == dict.fromkeys(keys, "disk")
    assert h2.stats()["promotions_started"] == 4
    gated.reads_open.set()
    eventually(lambda: h2.lookup_many(asked) == [HIT] * 6, "promotions")
    assert sorted(gated.get_calls) == sorted(ns + k for k in keys for ns in NS)  # once each


class _OneStuckRead(GatedDisk):
    """Reads of every shard of ``stuck`` block until ``release`` is set; others run."""

    def __init__(self, disk: DiskStore, stuck: bytes) -> None:
        super().__init__(disk)
        self.stuck = stuck
        self.release = threading.Event()

    def get_into(self, k, out):
        if k.endswith(self.stuck):
            assert self.release.wait(DEADLINE_S)
        return super().get_into(k, out)


def test_a_long_run_lands_chunk_by_chunk_within_bounded_reads(env):
    """A 40-chunk promotion runs as a few read jobs (``Promoter._start``); each chunk still lands
    as soon as it is read (a streamed load copies it then), the reads in flight stay within
    ``max_concurrent_reads``, and each chunk is read once."""
    keys = [key(i) for i in range(40)]
    disk = env.disk()
    h = env.hier(disk, slots=64)
    store(h, keys)
    h.close()
    stuck = _OneStuckRead(disk, keys[5])
    h2 = env.hier(stuck, slots=64, max_concurrent_reads=2, read_threads=2)
    assert h2.lookup_many(keys) == [PENDING] * 40
    eventually(lambda: h2.lookup_many(keys[:5]) == [HIT] * 5, "the chunks read before the stuck one")
    assert h2.lookup_many(keys[5:6]) == [PENDING]
    stuck.release.set()
    eventually(lambda: h2.lookup_many(keys) == [HIT] * 40, "promotions")
    assert stuck.max_active_reads <= 2
    assert sorted(stuck.get_calls) == sorted(ns + k for k in keys for ns in NS)  # once each


def test_promotions_in_flight_can_be_awaited(env):
    keys = [key(i) for i in range(4)]
    gated, h2 = _restart_with_stuck_reads(env, keys)
    assert not h2.in_flight(keys)
    assert h2.wait_promotions(keys, 0.0)  # nothing to wait for
    promoting: dict[bytes, str] = {}
    assert h2.lookup_many(keys, promoting) == [PENDING] * 4
    assert promoting == dict.fromkeys(keys, "disk")
    again: dict[bytes, str] = {}
    assert h2.lookup_many(keys + [key(99)], again) == [PENDING] * 4 + [MISS]
    assert again == dict.fromkeys(keys, "disk")  # still promoting: reported on every lookup
    assert h2.in_flight(keys[:1]) and not h2.in_flight([key(99)])
    assert not h2.wait_promotions(keys, 0.05)  # reads are stuck: times out
    threading.Timer(0.05, gated.reads_open.set).start()
    assert h2.wait_promotions(keys, DEADLINE_S)  # woken by the landing promotions
    assert not h2.in_flight(keys) and h2.lookup_many(keys) == [HIT] * 4


def test_close_wakes_promotion_waiters(env):
    gated, h2 = _restart_with_stuck_reads(env, [key(1)])
    assert h2.lookup_many([key(1)]) == [PENDING]
    # The reads stay stuck until the waiter has returned: only the close can wake it (without
    # that, the wait runs out its deadline and answers False).
    closer = threading.Timer(0.05, h2.close, kwargs={"timeout": 0.1})
    closer.start()
    try:
        assert h2.wait_promotions([key(1)], DEADLINE_S)
    finally:
        gated.reads_open.set()
        closer.join()


@pytest.mark.parametrize("then", ["launch", "wait", "close"])
def test_deferred_promotions_read_only_once_launched(env, then):
    """A lookup with ``defer_promotions`` answers and accounts its promotions at once but reads
    nothing until they are launched: explicitly (the connector, once vLLM scheduled the step),
    by a wait for them (never a wait on a read that is not running), or by a close."""
    keys = [key(i) for i in range(4)]
    gated, h2 = _restart_with_stuck_reads(env, keys)
    gated.reads_open.set()  # a launched read completes at once
    promoting: dict[bytes, str] = {}
    assert h2.lookup_many(keys, promoting, defer_promotions=True) == [PENDING] * 4
    assert promoting == dict.fromkeys(keys, "disk") and h2.in_flight(keys)
    assert h2.lookup_many(keys, defer_promotions=True) == [PENDING] * 4  # held, not started twice
    assert h2.stats()["promotions_started"] == 4
    time.sleep(0.1)
    assert gated.get_calls == []
    if then == "launch":
        h2.launch_deferred_promotions()
        eventually(lambda: h2.lookup_many(keys) == [HIT] * 4, "promotions")
    elif then == "wait":
        assert h2.wait_promotions(keys, DEADLINE_S) and h2.lookup_many(keys) == [HIT] * 4
    else:
        assert h2.close(timeout=DEADLINE_S)  # the held reads run as any in flight at a close
    assert sorted(gated.get_calls) == sorted(ns + k for k in keys for ns in NS)  # once each


def _stored_one_by_one(env, keys: list[bytes]) -> DiskStore:
    """``keys`` written to a store in this order, each with a later access tick."""
    disk = env.disk()
    h = env.hier(disk)
    for k in keys:
        store(h, [k])
        eventually(lambda k=k: on_disk(disk, k), "write-behind")
        time.sleep(0.002)  # ticks are microseconds of the wall clock
    h.close()
    return disk


def test_warm_start_promotes_the_most_recently_used_chunks(env):
    keys = [key(i, group=i % 2) for i in range(6)]
    disk = _stored_one_by_one(env, keys)
    disk.touch_many([ns + keys[0] for ns in NS])  # served again since: the most recent now
    h2 = env.hier(disk, max_concurrent_reads=2)
    warmed = [keys[0], keys[5], keys[4]]
    h2.warm_start(3)
    assert h2.wait_warm_start(DEADLINE_S)  # the warm start ended: what it promoted has landed
    assert h2.stats()["warm_promotions"] == 3 and not h2.in_flight(warmed)
    assert h2.lookup_many(warmed) == [HIT] * 3  # no disk read on the request's path
    assert h2.stats()["promotions_completed"] == 3
    loaded = h2.prepare_load(warmed)
    assert all(holds(h2.slab, s, k) for s, k in zip(loaded, warmed, strict=True))
    h2.complete_load(warmed)
    assert h2.lookup_many([keys[3]]) == [PENDING]  # not warmed: promoted when asked for


def test_warm_start_fills_free_slots_only_and_stops_on_close(env):
    keys = [key(i) for i in range(6)]
    disk = _stored_one_by_one(env, keys)
    h2 = env.hier(disk, slots=2)
    h2.warm_start(6)  # more than the host tier holds: the two most recent, evicting nothing
    eventually(lambda: h2.stats()["promotions_completed"] == 2, "warm")
    assert h2.lookup_many(keys[-2:]) == [HIT, HIT]
    assert h2.stats()["warm_promotions"] == h2.stats()["promotions_started"] == 2
    # A warm start stuck on a slow disk: close() ends it after the read in flight, and reads
    # nothing more.
    gated = GatedDisk(disk)
    gated.reads_open.clear()
    gated.iter_index = disk.iter_index  # type: ignore[attr-defined]
    h3 = env.hier(gated, slots=16, max_concurrent_reads=1)
    h3.warm_start(6)
    eventually(lambda: gated.active_reads == 1, "first warm read")
    stuck = gated.get_calls[0][len(NS[0]) :]
    closer = threading.Thread(target=h3.close, daemon=True)
    closer.start()
    eventually(lambda: h3.wait_promotions([stuck], 0.0), "close() began")  # True once closed
    gated.reads_open.set()
    closer.join(DEADLINE_S)
    assert not closer.is_alive(), "close() waited for the rest of the warm start"
    assert sorted(gated.get_calls) == sorted(ns + stuck for ns in NS)  # that chunk only


def test_hits_are_protected_from_promotion_eviction(env):
    disk = env.disk()
    h = env.hier(disk, slots=4)
    store(h, [key(i) for i in range(4)])
    h.close()
    h2 = env.hier(disk, slots=2)
    store(h2, [key(10), key(11)])
    eventually(lambda: h2.stats()["write_inflight_bytes"] == 0, "write-behind")  # unpins them
    # key(10), key(11) are HIT in this batch: promoting key(0) must not evict them.
    assert h2.lookup_many([key(10), key(11), key(0)]) == [HIT, HIT, MISS]
    assert h2.stats()["promote_no_room"] == 1
    assert h2.lookup_many([key(10), key(0)]) == [HIT, PENDING]  # key(11) may go now
    eventually(lambda: h2.lookup_many([key(0)]) == [HIT], "promotion")


def test_corrupt_record_is_a_miss_not_an_error(env):
    disk = env.disk()
    h = env.hier(disk)
    store(h, [key(1), key(2)])
    h.close()
    disk.close()
    corrupt_payload(env.db_path, NS[1] + key(2))
    disk = env.disk()
    h2 = env.hier(disk)
    assert h2.lookup_many([key(1), key(2)]) == [PENDING, PENDING]
    eventually(lambda: PENDING not in h2.lookup_many([key(1), key(2)]), "promotions")
    assert h2.lookup_many([key(1), key(2)]) == [HIT, MISS]
    st = h2.stats()
    assert st["promotions_failed"] == 1 and st["promotions_started"] == 2  # not retried
    assert h2.pool.free_slots == h2.pool.num_slots - 1  # the failed slot went back
    # The chunk can be stored again and then reads back fine.
    store(h2, [key(2)])
    assert h2.lookup_many([key(2)]) == [HIT]


def test_wrong_size_record_is_a_miss_and_not_refetched(env):
    """A record of another geometry (e.g. written by an older layout) is never retried."""
    disk = env.disk()
    k = key(5, group=1)
    short = np.zeros(GROUP_BYTES[1] - 8, dtype=np.uint8)
    assert disk.put_many([(ns + k, short, "int8") for ns in NS]) == 2
    h = env.hier(disk)
    assert h.lookup_many([k]) == [PENDING]
    eventually(lambda: h.lookup_many([k]) == [MISS], "failed promotion")
    for _ in range(3):
        assert h.lookup_many([k]) == [MISS]
    assert h.stats()["promotions_started"] == 1 and h.stats()["promotions_failed"] == 1


class _CountingDisk(GatedDisk):
    """A real DiskStore that counts the records its index is asked about."""

    def __init__(self, disk) -> None:
        super().__init__(disk)
        self.probed = 0

    def contains_many(self, keys):
        self.probed += len(keys)
        return self.disk.contains_many(keys)


def _disk_holding_first_chunks(env, held: int) -> _CountingDisk:
    """A disk tier holding chunks 0..held-1 (written by an engine since closed), counting the
    keys it is asked about."""
    disk = env.disk()
    h = env.hier(disk, slots=64)
    store(h, [key(i) for i in range(held)])
    eventually(lambda: h.stats()["writes_completed"] == held, "write-behind")
    h.close()
    return _CountingDisk(disk)


def test_a_long_prefix_run_asks_the_disk_about_a_few_chunks_past_its_first_miss(env):
    """A long prompt whose store holds only its first chunks (a shared system prompt): the disk
    is asked about batches growing from PREFIX_BATCH and no further than the batch holding the
    first miss, not about every chunk of the run each time the request is looked up again."""
    from kvstrata.tiers.hierarchy.lookup import PREFIX_BATCH

    held = PREFIX_BATCH + 3  # the first miss falls in the second batch
    counting = _disk_holding_first_chunks(env, held)
    h2 = env.hier(counting, slots=256)
    keys = [key(i) for i in range(1000)]
    states = h2.lookup_many(keys, prefix=True)
    assert states == [PENDING] * held + [MISS] * (1000 - held)
    assert h2.stats()["promotions_started"] == held
    # Two shards per chunk: the first batch, then a batch four times as large; not all 1000.
    assert counting.probed == len(NS) * (PREFIX_BATCH + 4 * PREFIX_BATCH), counting.probed
    # Every chunk the tiers hold is found, in one batch or several.
    eventually(lambda: h2.lookup_many(keys[:held]) == [HIT] * held, "promotions")
    counting.probed = 0
    assert h2.lookup_many(keys, prefix=True) == [HIT] * held + [MISS] * (1000 - held)
    assert counting.probed == len(NS) * PREFIX_BATCH  # the first chunk not in the host tier misses


def test_promotions_that_do_not_all_fit_take_the_slots_there_are_in_order(env):
    """One allocation for a whole run when the host tier has room; when it has not, the run's
    first chunks get the slots there are and the rest answer MISS (never a PENDING that waits
    on a promotion that cannot start)."""
    _, h2, keys, _ = ten_on_disk_twelve_of_sixteen_slots_held(env)
    assert h2.lookup_many(keys, prefix=True) == [PENDING] * 4 + [MISS] * 6
    assert h2.stats()["promotions_started"] == 4
    assert h2.stats()["promote_no_room"] >= 1
    eventually(lambda: h2.lookup_many(keys[:4]) == [HIT] * 4, "promotions")
    slots = h2.prepare_load(keys[:4])
    assert all(holds(h2.slab, s, k) for s, k in zip(slots, keys[:4], strict=True))
    h2.complete_load(keys[:4])


def test_a_lookup_that_may_wait_for_room_asks_again_instead_of_missing(env):
    """With ``wait_for_room`` (``host_room_wait_s``) the chunks of a run the host tier has no
    slot for answer PENDING: the request asks again, and once the slots' holders let go (stores
    completed and written behind) the same lookup promotes them all; none is counted as
    computed. A run longer than the whole tier could never fit, and misses as before. Watched
    failing with the lookup ignoring ``wait_for_room`` (6 MISS)."""
    disk, h2, keys, slots = ten_on_disk_twelve_of_sixteen_slots_held(env)
    pinned = list(slots)
    assert h2.lookup_many(keys, prefix=True, wait_for_room=True) == [PENDING] * 10
    stats = h2.stats()
    assert stats["promotions_started"] == 4 and stats["promote_room_waits"] == 6, stats
    assert stats["promote_no_room"] == 0
    for k, slot in slots.items():
        fill(h2.slab, slot, k)
    h2.complete_store(pinned)
    eventually(lambda: h2.stats()["writes_completed"] == 12, "the stores' write-behind")
    eventually(lambda: h2.lookup_many(keys, prefix=True, wait_for_room=True) == [HIT] * 10,
               "promotions once there is room")
    assert h2.stats()["promote_no_room"] == 0
    loaded = h2.prepare_load(keys)
    assert all(holds(h2.slab, s, k) for s, k in zip(loaded, keys, strict=True))
    h2.complete_load(keys)
    h2.close()
    h3 = env.hier(disk, slots=4)  # the run (10 chunks) never fits: no wait
    assert h3.lookup_many(keys, prefix=True, wait_for_room=True) == [PENDING] * 4 + [MISS] * 6
    assert h3.stats()["promote_room_waits"] == 0 and h3.stats()["promote_no_room"] >= 1


def test_holds_many_of_a_run_asks_the_disk_only_up_to_its_first_miss(env):
    """Where a deferred lookup's hit will end (the held start of its run) is asked as a prefix
    lookup asks: not one LMDB probe per chunk of a long prompt at every step it waits."""
    from kvstrata.tiers.hierarchy.lookup import PREFIX_BATCH

    held = PREFIX_BATCH + 3
    counting = _disk_holding_first_chunks(env, held)
    h2 = env.hier(counting, slots=64)
    keys = [key(i) for i in range(1000)]
    found = h2.holds_many(keys, prefix=True)
    assert found[:held] == [True] * held and not found[held]
    assert counting.probed == len(NS) * (PREFIX_BATCH + 4 * PREFIX_BATCH), counting.probed
    counting.probed = 0
    assert h2.holds_many(keys) == [True] * held + [False] * (1000 - held)  # every key asked
    assert counting.probed == len(NS) * 1000
    assert h2.stats()["promotions_started"] == 0
