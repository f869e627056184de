"""The Hierarchy's holds: chunks a waiting request's lookup found stay pinned in the host tier
until the request is looked up again and loads them (``Hierarchy.hold``), at most half the
tier's slots at once."""

from __future__ import annotations

from hierarchy_helpers import (
    HIT,
    MISS,
    NS,
    PENDING,
    corrupt_payload,
    eventually,
    fill,
    holds,
    key,
    store,
)

from kvstrata.tiers.hierarchy import PromotionBudget


def _restarted_with_on_disk(env, n: int, slots: int):
    """A hierarchy of ``slots`` host slots over a disk holding chunks key(0)..key(n-1), none of
    them in its host tier."""
    disk = env.disk()
    h = env.hier(disk, slots=max(slots, n))
    keys = [key(i) for i in range(n)]
    store(h, keys)
    eventually(lambda: h.stats()["writes_completed"] == n, "write-behind")
    h.close()
    return env.hier(disk, slots=slots), keys


def test_a_waiting_lookup_s_landed_promotions_outlive_other_requests_stores(env):
    """A lookup answered PENDING for 6 promotions; before the request is looked up again, other
    requests' stores want 12 of the 16 slots. Held, the landed chunks are not evicted (the
    stores are refused for want of room) and the next lookup finds all 6; let go, the stores
    evict them. Watched failing with ``hold`` pinning nothing (the store took 2 of the 6)."""
    h, keys = _restarted_with_on_disk(env, 6, slots=16)
    assert h.lookup_many(keys, prefix=True) == [PENDING] * 6
    held = h.hold(keys)
    assert sorted(held) == sorted(keys)
    assert h.wait_promotions(keys, 30)
    others = [key(100 + i) for i in range(12)]
    assert h.prepare_store(others) is None
    assert h.stats()["chunks_held"] == 6 and h.stats()["waiting_holds"] == 6
    assert h.lookup_many(keys, prefix=True) == [HIT] * 6
    slots = h.prepare_load(keys)
    h.release_held(held)  # the load pinned them: the holds go
    assert h.prepare_store(others) is None  # the load's pins keep them
    assert all(holds(h.slab, s, k) for s, k in zip(slots, keys, strict=True))
    h.complete_load(keys)
    taken = h.prepare_store(others)
    assert taken is not None  # nothing pins them now: 2 of them evicted
    assert h.lookup_many(keys, prefix=False).count(HIT) == 4
    assert h.stats()["chunks_held"] == 0
    for k, slot in taken.items():
        fill(h.slab, slot, k)
    h.complete_store(others)


def test_at_most_half_the_host_tier_is_held(env):
    """Holds take the keys first come (a request's prefix first) up to half the slots; a key
    held already takes no more room when held again; what could not be held is counted."""
    h, keys = _restarted_with_on_disk(env, 6, slots=8)
    assert h.lookup_many(keys) == [PENDING] * 6
    assert h.wait_promotions(keys, 30)
    first = h.hold(keys)
    assert first == keys[:4]
    again = h.hold(list(reversed(keys)))  # another request: only the 4 held already
    assert sorted(again) == sorted(keys[:4])
    st = h.stats()
    assert st["chunks_held"] == 4 and st["waiting_holds"] == 8 and st["waiting_holds_capped"] == 4
    assert h.pool.refs(keys[0]) == 2 and h.pool.refs(keys[5]) == 0
    h.release_held(first)
    assert h.stats()["chunks_held"] == 4  # the other request still holds them
    h.release_held(again)
    assert h.stats()["chunks_held"] == 0 and h.stats()["host"]["referenced"] == 0


def test_the_head_of_the_queue_holds_up_to_three_quarters(env):
    """The request vLLM schedules next holds up to three quarters of the slots, the others
    half: requests behind it that filled their half leave it a quarter. Watched failing with
    ``head`` ignored (the head held nothing)."""
    h, keys = _restarted_with_on_disk(env, 8, slots=8)
    assert h.lookup_many(keys) == [PENDING] * 8
    assert h.wait_promotions(keys, 30)
    assert h.hold_room() == 4 and h.hold_room(head=True) == 6
    behind = h.hold(keys[4:])
    assert behind == keys[4:] and h.hold_room() == 0 and h.hold_room(head=True) == 2
    head = h.hold(keys[:4], head=True)
    assert head == keys[:2], head
    assert h.hold(keys[2:4]) == []  # not the head: its half is full
    assert h.stats()["chunks_held"] == 6 and h.stats()["waiting_holds_capped"] == 4
    h.release_held(behind)
    again = h.hold(keys[:4], head=True)  # looked up again: its previous holds then let go
    h.release_held(head)
    assert again == keys[:4] and h.stats()["chunks_held"] == 4
    h.release_held(again)
    assert h.stats()["chunks_held"] == 0 and h.stats()["host"]["referenced"] == 0


def test_a_held_chunk_whose_promotion_fails_is_let_go_cleanly(env):
    """A chunk held while its promotion runs, whose record turns out corrupt: it is dropped
    (a miss), and letting go of the hold touches no other chunk's pins; a store in flight is
    not held (its slot may be dropped when it fails)."""
    disk = env.disk()
    h = env.hier(disk)
    store(h, [key(1), key(2)])
    eventually(lambda: h.stats()["writes_completed"] == 2, "write-behind")
    h.close()
    disk.close()
    corrupt_payload(env.db_path, NS[1] + key(2))
    h2 = env.hier(env.disk())
    assert h2.lookup_many([key(1), key(2)]) == [PENDING, PENDING]
    in_flight = h2.prepare_store([key(3)])
    assert in_flight is not None
    held = h2.hold([key(1), key(2), key(3)])
    assert sorted(held) == [key(1), key(2)]
    assert h2.wait_promotions([key(1), key(2)], 30)
    assert h2.lookup_many([key(1), key(2)]) == [HIT, MISS]
    h2.release_held(held)
    assert h2.pool.refs(key(1)) == 0 and h2.stats()["chunks_held"] == 0
    fill(h2.slab, in_flight[key(3)], key(3))
    h2.complete_store([key(3)])
    eventually(lambda: h2.stats()["host"]["referenced"] == 0, "the store's write-behind")
    h2.close()
    assert h2.hold([key(1)]) == []  # closed: nothing held


def test_promotions_evicted_before_a_load_used_them_are_counted_unused(env):
    """Six chunks promoted for a lookup: two loaded (their promotions were used), one held,
    then other requests' stores take the room. The three evicted unloaded count as
    ``promotions_unused``; the loaded ones, evicted later, and the held one do not; a reset
    drops the rest without counting them."""
    h, keys = _restarted_with_on_disk(env, 6, slots=8)
    assert h.lookup_many(keys) == [PENDING] * 6
    assert h.wait_promotions(keys, 30)
    h.prepare_load(keys[:2])
    h.complete_load(keys[:2])
    held = h.hold(keys[2:3])
    assert h.stats()["promotions_unused"] == 0
    store(h, [key(100 + i) for i in range(7)])  # 7 of the 8 slots: every idle chunk goes
    st = h.stats()
    assert st["promotions_unused"] == 3, st
    assert h.lookup_many(keys[2:3]) == [HIT]
    h.release_held(held)
    eventually(lambda: h.stats()["host"]["referenced"] == 0, "the stores' write-behind")
    assert h.lookup_many(keys[3:4]) == [PENDING]  # promoted again
    assert h.wait_promotions(keys[3:4], 30)
    assert h.reset()
    assert h.stats()["promotions_unused"] == 3


def test_a_lookup_with_a_budget_promotes_no_more_than_it_can_hold(env):
    """A lookup behind another in its step gets ``hold_room()`` as its budget: past it, chunks
    are answered as if the host tier had no room (PENDING while the request may wait for room,
    queued hits for a streamed load), counted ``promote_held_back``; without a way to wait or
    queue, the budget does not apply (a chunk held back would be computed). Watched failing
    with the budget ignored (all 6 promoted)."""
    h, keys = _restarted_with_on_disk(env, 6, slots=8)
    assert h.hold_room() == 4
    held = h.hold([])  # nothing to hold: the room stays
    assert held == [] and h.hold_room() == 4
    budget = PromotionBudget(2)
    assert h.lookup_many(keys, prefix=True, wait_for_room=True, budget=budget) == [PENDING] * 6
    st = h.stats()
    assert budget.left == 0 and st["promotions_started"] == 2, st
    assert st["promote_held_back"] == 4 and st["promote_room_waits"] == 4, st
    assert h.wait_promotions(keys[:2], 30)
    held = h.hold(keys)
    assert held == keys[:2] and h.hold_room() == 2
    queued: set[bytes] = set()
    answers = h.lookup_many(keys, stream=True, prefix=True, queued=queued, budget=PromotionBudget(1))
    assert answers == [HIT] * 6 and queued == set(keys[3:]), (answers, queued)
    assert h.stats()["promotions_started"] == 3
    assert h.lookup_many(keys[4:], budget=PromotionBudget(0)) == [PENDING] * 2  # not applied
    assert h.stats()["promotions_started"] == 5
    assert h.wait_promotions(keys, 30)
    h.release_held(held)
