"""The Hierarchy's life cycle over a real LMDB DiskStore: store, lookup and load, restart, shards
and group bytes, eviction under pressure, and reset."""

from __future__ import annotations

import pytest
from hierarchy_helpers import (
    GROUP_BYTES,
    HIT,
    MISS,
    NS,
    PENDING,
    SHARD,
    GatedDisk,
    eventually,
    fill,
    holds,
    key,
    on_disk,
    store,
)

from kvstrata.tiers.hierarchy import chunk_group

# ---- basic life cycle --------------------------------------------------------------------------


def test_store_lookup_load(env):
    disk = env.disk()
    h = env.hier(disk)
    keys = [key(1), key(2, group=1)]
    assert h.lookup_many(keys) == [MISS, MISS]
    slots = h.prepare_store(keys + keys[:1])  # duplicates collapse
    assert set(slots) == set(keys)
    assert h.lookup_many(keys) == [PENDING, PENDING]
    assert h.prepare_store(keys) == {}  # already present: nothing to store
    for k, s in slots.items():
        fill(h.slab, s, k)
    h.complete_store(keys)
    assert h.lookup_many(keys) == [HIT, HIT]
    loaded = h.prepare_load(keys)
    assert all(holds(h.slab, s, k) for s, k in zip(loaded, keys, strict=True))
    h.complete_load(keys)
    with pytest.raises(KeyError):
        h.prepare_load([key(3)])
    eventually(lambda: h.stats()["writes_completed"] == 2, "write-behind")
    assert all(on_disk(disk, k) for k in keys)
    assert h.stats()["write_bytes"] == (8192 + 3000) * 2


def test_failed_store_is_dropped(env):
    h = env.hier(env.disk())
    slots = h.prepare_store([key(1)])
    h.complete_store([key(1)], success=False)
    assert h.lookup_many([key(1)]) == [MISS]
    assert h.pool.free_slots == h.pool.num_slots
    assert h.stats()["stores_failed"] == 1 and slots


def test_host_only_hierarchy(env):
    h = env.hier(None, slots=2)
    store(h, [key(1), key(2)])
    store(h, [key(3)])  # evicts the least recently used chunk, nothing to write it to
    assert h.lookup_many([key(1), key(2), key(3)]) == [MISS, HIT, HIT]


# ---- restart, shards, group bytes -----------------------------------------------------------------


def test_restart_finds_chunks_on_disk(env):
    disk = env.disk()
    h = env.hier(disk)
    keys = [key(i, group=i % 2) for i in range(6)]
    slots = store(h, keys)
    for k, s in slots.items():
        if chunk_group(k) == 1:
            h.slab.array[s, SHARD - 10 : SHARD] = 0xEE  # past group 1's bytes: not stored
    h.close()  # drains write-behind
    assert all(on_disk(disk, k) for k in keys)

    h2 = env.hier(disk)  # a new process view: fresh slab, empty index, same store
    assert h2.lookup_many(keys) == [PENDING] * 6
    eventually(lambda: h2.lookup_many(keys) == [HIT] * 6, "promotion")
    loaded = h2.prepare_load(keys)
    for s, k in zip(loaded, keys, strict=True):
        assert holds(h2.slab, s, k)
        if chunk_group(k) == 1:
            assert not h2.slab.array[s, GROUP_BYTES[1] : SHARD].any()
    h2.complete_load(keys)
    st = h2.stats()
    assert st["promotions_completed"] == 6 and st["writes_started"] == 0  # promoted: not rewritten


def test_chunk_is_on_disk_only_when_every_shard_is(env):
    disk = env.disk()
    h = env.hier(disk)
    store(h, [key(1), key(2)])
    h.close()
    disk.delete_many([NS[1] + key(2)])  # rank 1's shard of chunk 2 is gone
    h2 = env.hier(disk)
    assert h2.lookup_many([key(1), key(2)]) == [PENDING, MISS]


def test_holds_many_answers_presence_in_any_tier_and_changes_nothing(env):
    """Choosing among candidate keys (tails of every length, most never stored) asks every tier
    but starts no promotion and counts no lookup."""
    disk = env.disk()
    h = env.hier(disk)
    store(h, [key(1), key(2)])
    h.close()  # on disk only from here
    disk.delete_many([NS[1] + key(2)])  # one shard missing: not held
    h2 = env.hier(disk)
    store(h2, [key(3)])  # in the host tier only
    slots = h2.prepare_store([key(4)])  # on its way into the host tier
    counted = ("lookups", "lookup_hits", "lookup_pending", "promotions_started")
    before = {c: h2.stats()[c] for c in counted}
    assert h2.holds_many([key(1), key(2), key(3), key(4), key(5)]) == [True, False, True, True, False]
    assert {c: h2.stats()[c] for c in counted} == before
    assert not h2.in_flight([key(1)])  # no promotion started
    assert h2.lookup_many([key(1)]) == [PENDING]  # which a lookup does
    h2.complete_store(list(slots), success=False)
    h2.close()
    assert h2.holds_many([key(3)]) == [False]  # closed: holds nothing


# ---- eviction under pressure ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_eviction_never_touches_chunks_in_flight(env, policy):
    disk = env.disk()
    gated = GatedDisk(disk)
    h = env.hier(gated, slots=4, policy=policy)
    a, b, c, d = (key(i) for i in range(4))
    store(h, [a, b])
    eventually(lambda: h.stats()["writes_completed"] == 2, "writes")
    gated.writes_open.clear()
    store(h, [c])  # its disk write is stuck: c is pinned by write-behind
    loading = h.prepare_load([a])  # a is pinned by a device load
    pending = h.prepare_store([d])  # d: device -> host copy in flight
    assert pending is not None
    # Only b is idle: one new chunk fits, two do not.
    assert h.prepare_store([key(10), key(11)]) is None
    slots = store(h, [key(10)])
    assert b not in h.pool and all(k in h.pool for k in (a, c, d))
    assert slots[key(10)] not in (h.pool.get(a)[0], h.pool.get(c)[0], pending[d])
    assert holds(h.slab, loading[0], a) and holds(h.slab, h.pool.get(c)[0], c)
    h.complete_load([a])
    gated.writes_open.set()
    h.complete_store([d])
    eventually(lambda: h.stats()["write_inflight_bytes"] == 0, "writes")
    # Everything is idle again: a full batch of new chunks fits.
    assert h.prepare_store([key(20 + i) for i in range(4)]) is not None


def test_reset_drops_idle_host_chunks(env):
    disk = env.disk()
    h = env.hier(disk)
    store(h, [key(1), key(2)])
    h.prepare_store([key(3)])  # in flight: survives the reset
    eventually(lambda: h.stats()["write_inflight_bytes"] == 0, "writes")
    assert h.reset() is False
    assert h.lookup_many([key(3)]) == [PENDING]
    assert h.pool.lookup_many([key(1), key(2)]) == [0, 0]
    # Still on disk: a lookup promotes them back.
    assert h.lookup_many([key(1)]) == [PENDING]
