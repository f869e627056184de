"""Streamed loads from the Hierarchy: hits answered before their bytes land, the landing board's
tickets, and records found corrupt or gone after the lookup."""

from __future__ import annotations

import pytest
from hierarchy_helpers import (
    DTYPES,
    GROUP_BYTES,
    HIT,
    MISS,
    NS,
    PENDING,
    SHARD,
    GatedDisk,
    corrupt_payload,
    eventually,
    holds,
    key,
    store,
    ten_on_disk_twelve_of_sixteen_slots_held,
)

from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.host import HostPool, HostSlab

# ---- streamed loads ----------------------------------------------------------------------------


def _restarted_with(env, keys: list[bytes], corrupt: list[bytes] = ()) -> tuple[Hierarchy, GatedDisk]:
    """A hierarchy over a store holding ``keys`` (some corrupted), its reads held at a gate."""
    disk = env.disk()
    h = env.hier(disk)
    store(h, keys)
    h.close()
    disk.close()
    for k in corrupt:
        corrupt_payload(env.db_path, NS[0] + k)
    gated = GatedDisk(env.disk())
    gated.reads_open.clear()
    return env.hier(gated), gated


def _landed(h: Hierarchy, slot: int, ticket: int) -> bool:
    return int(h.slab.landed[slot]) >> 1 >= ticket


def test_streamed_lookup_answers_hit_and_the_board_says_when_bytes_landed(env):
    keys = [key(1), key(2, group=1)]
    h, gated = _restarted_with(env, keys)
    assert h.lookup_many(keys) == [PENDING, PENDING]  # not streaming: wait for the promotions
    assert h.lookup_many(keys, stream=True) == [HIT, HIT]  # streaming: answer now
    placed = h.prepare_streamed_load(keys)
    assert all(t > 0 for _, t in placed) and len({t for _, t in placed}) == 2
    assert not any(_landed(h, s, t) for s, t in placed)
    assert h.stats()["loads_streamed"] == 2
    gated.reads_open.set()
    eventually(lambda: all(_landed(h, s, t) for s, t in placed), "landing")
    for (slot, ticket), k in zip(placed, keys, strict=True):
        assert int(h.slab.landed[slot]) == ticket << 1  # landed clean
        assert holds(h.slab, slot, k)
    h.complete_load(keys)
    st = h.stats()
    assert st["host"]["referenced"] == 0 and st["host"]["not_ready"] == 0
    # Now in the host tier: a streamed load needs no ticket.
    assert h.lookup_many(keys, stream=True) == [HIT, HIT]
    assert [t for _, t in h.prepare_streamed_load(keys)] == [0, 0]
    h.complete_load(keys)


def test_streamed_load_of_a_corrupt_record_fails_on_the_board_and_frees_the_slot(env):
    good, bad = key(1), key(2)
    h, gated = _restarted_with(env, [good, bad], corrupt=[bad])
    assert h.lookup_many([good, bad], stream=True) == [HIT, HIT]
    placed = h.prepare_streamed_load([good, bad])
    gated.reads_open.set()
    eventually(lambda: all(_landed(h, s, t) for s, t in placed), "promotions")
    (s_good, t_good), (s_bad, t_bad) = placed
    assert int(h.slab.landed[s_good]) == t_good << 1
    assert int(h.slab.landed[s_bad]) == t_bad << 1 | 1  # failed: the worker must not copy
    assert h.lookup_many([bad], stream=True) == [MISS]  # a miss from now on, never retried
    # The key is stored again (a new entry, pinned by its write-behind, held at the gate) before
    # the failed load is released: releasing the old load must not unpin the new entry.
    gated.writes_open.clear()
    store(h, [bad])
    eventually(lambda: gated.put_calls == 1, "write-behind")
    assert h.pool.refs(bad) == 1
    h.complete_load([good, bad])
    assert h.pool.refs(bad) == 1 and h.pool.refs(good) == 0
    gated.writes_open.set()
    eventually(lambda: h.stats()["host"]["referenced"] == 0, "write-behind")
    assert h.stats()["promotions_failed"] == 1 and h.lookup_many([bad]) == [HIT]


def test_streamed_load_of_a_chunk_gone_since_the_lookup_fails_at_once(env):
    h, gated = _restarted_with(env, [key(1)], corrupt=[key(1)])
    assert h.lookup_many([key(1)], stream=True) == [HIT]
    gated.reads_open.set()
    eventually(lambda: h.stats()["promotions_failed"] == 1, "failed promotion")
    assert h.prepare_streamed_load([key(1)]) == [(0, -1)]
    h.complete_load([key(1)])  # balanced: releases nothing
    assert h.stats()["host"]["referenced"] == 0
    assert len(h.pool) == 0


def test_tickets_of_a_reused_slab_file_are_cleared(env, tmp_path):
    path = tmp_path / "reused.slab"
    with HostSlab(path, SHARD * len(NS), 4) as old:
        old.landed[:] = 1 << 40  # what an earlier engine left
    slab = HostSlab(path, SHARD * len(NS), 4)
    h = Hierarchy(HostPool(slab), None, namespaces=NS, group_shard_bytes=GROUP_BYTES,
                  group_dtypes=DTYPES)
    try:
        assert not slab.landed.any()
    finally:
        h.close()
        slab.close()


# ---- loads in pieces: hits larger than the host tier's room --------------------------------------


def test_a_run_larger_than_the_room_is_queued_and_promoted_as_room_frees(env):
    """16 host slots, 12 held by stores in flight, 10 chunks on disk. A streamed lookup with
    ``queued`` answers all 10 HIT: 4 promote now, 6 are queued (counted pending, none computed).
    Once the first piece is loaded and let go, ``promote_queued`` promotes the next 4 in order
    and queues the last 2 again; a chunk gone from every tier then answers MISS. Every slot
    loaded holds its chunk's bytes. Watched failing without ``queued``: 6 MISS."""
    disk, h2, keys, _ = ten_on_disk_twelve_of_sixteen_slots_held(env)
    with pytest.raises(ValueError, match="streamed"):
        h2.lookup_many(keys, queued=set())
    queued: set[bytes] = set()
    promoting: dict[bytes, str] = {}
    assert h2.lookup_many(keys, promoting, stream=True, prefix=True, queued=queued) == [HIT] * 10
    assert queued == set(keys[4:]) and set(promoting) == set(keys)
    st = h2.stats()
    assert st["promotions_started"] == 4 and st["promote_queued"] == 6 and st["promote_no_room"] == 0, st
    assert st["lookup_hits"] == 0 and st["lookup_pending"] == 10, st

    def load(piece: list[bytes]) -> None:
        placed = h2.prepare_streamed_load(piece)
        assert all(t >= 0 for _, t in placed)
        eventually(lambda: all(_landed(h2, s, t) for s, t in placed), "landing")
        assert all(holds(h2.slab, s, k) for (s, _), k in zip(placed, piece, strict=True))
        h2.complete_load(piece)

    load(keys[:4])
    still: set[bytes] = set()
    assert h2.promote_queued(keys[4:], promoting, still) == [HIT] * 6
    assert still == set(keys[8:])  # the first piece's 4 slots, taken in order
    assert h2.stats()["promotions_started"] == 8
    load(keys[4:8])
    assert disk.delete_many([ns + keys[9] for ns in NS]) == len(NS)
    still = set()
    assert h2.promote_queued(keys[8:], promoting, still) == [HIT, MISS]
    load(keys[8:9])
    assert h2.stats()["host"]["referenced"] == 12  # the stores' slots only
