"""The hierarchy over more than one lower tier, and its parts on their own.

Two real ``DiskStore`` directories stand for the local disk and a tier below it (the shared
remote tier implements the same ``LowerTier`` interface): promotion asks them in order, a chunk
found only in the lower one is kept in the nearer one too, write-behind admits per tier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstrata.presence import Presence
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.hierarchy.shared import Journal, Shared, TierLink
from kvstrata.tiers.host import HostPool, HostSlab
from kvstrata.tiers.lower import LowerTier, ScannableTier, all_shards_present

HIT, PENDING, MISS = Presence.HIT, Presence.PENDING, Presence.MISS
NS = [b"rank0-namespace!", b"rank1-namespace!"]
SHARD = 4096


class FarTier(DiskStore):
    """A second store, named like the tier below the local disk."""

    tier_name = "remote"


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def pattern(k: bytes, shard: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(k[:8], "big") + 7 * shard).integers(0, 256, SHARD, dtype=np.uint8)


def eventually(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


@pytest.fixture
def make(tmp_path: Path):
    made: list = []

    def build(*, lower: list, slots: int = 8, **kw) -> Hierarchy:
        slab = HostSlab(tmp_path / f"slab{len(made)}", SHARD * len(NS), slots)
        h = Hierarchy(HostPool(slab), lower, namespaces=NS, group_shard_bytes=[SHARD],
                      group_dtypes=["uint8"], **kw)
        made.extend([slab, h])
        return h

    def store(name: str, cls: type[DiskStore] = DiskStore) -> DiskStore:
        d = cls(tmp_path / name, budget_bytes=1 << 30)
        made.append(d)
        return d

    build.store = store  # type: ignore[attr-defined]
    yield build
    for obj in reversed(made):
        obj.close()


def put(h: Hierarchy, keys: list[bytes]) -> None:
    slots = h.prepare_store(keys)
    assert slots is not None
    for k, s in slots.items():
        for r in range(len(NS)):
            h.slab.array[s, r * SHARD : (r + 1) * SHARD] = pattern(k, r)
    h.complete_store(list(slots))


def holds(tier: LowerTier, k: bytes) -> bool:
    return all_shards_present(tier, NS, [k]) == [True]


def test_disk_store_is_a_lower_tier(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "d", budget_bytes=1 << 20) as d:
        assert isinstance(d, LowerTier) and isinstance(d, ScannableTier) and d.tier_name == "disk"


def test_write_behind_fills_every_tier_that_admits(make) -> None:
    near, far = make.store("near"), make.store("far", FarTier)
    h = make(lower=[near, far], admit_after=[1, 2])
    put(h, [key(1)])
    eventually(lambda: holds(near, key(1)), "the near tier's write")
    assert not holds(far, key(1))  # one offer: the far tier admits after two
    assert h.lookup_many([key(1)]) == [HIT]  # a host hit is the second offer
    eventually(lambda: h.stats()["tiers"]["remote"]["writes_completed"] == 1, "the far tier's write")
    eventually(lambda: h.stats()["tiers"]["disk"]["writes_completed"] == 1, "the near tier's count")
    assert holds(far, key(1))


def test_promotion_asks_the_tiers_in_order_and_keeps_a_far_chunk_near(make) -> None:
    near, far = make.store("near"), make.store("far", FarTier)
    writer = make(lower=[near, far])
    put(writer, [key(1), key(2)])
    eventually(lambda: all(holds(t, k) for t in (near, far) for k in (key(1), key(2))), "write-behind")
    writer.close()
    near.delete_many([ns + key(2) for ns in NS])  # key(2) is now only in the far tier

    h = make(lower=[near, far])
    assert h.lookup_many([key(1), key(2), key(3)]) == [PENDING, PENDING, MISS]
    eventually(lambda: h.lookup_many([key(1), key(2)]) == [HIT, HIT], "promotions")
    slots = h.prepare_load([key(1), key(2)])
    for k, s in zip([key(1), key(2)], slots, strict=True):
        for r in range(len(NS)):
            assert np.array_equal(h.slab.array[s, r * SHARD : (r + 1) * SHARD], pattern(k, r))
    h.complete_load([key(1), key(2)])
    # The chunk that came from the far tier is written back into the near one.
    eventually(lambda: holds(near, key(2)), "the near copy of the far chunk")
    assert near.stats()["hits"] == 2  # key(1)'s shards were read from the near tier
    assert far.stats()["hits"] == 2  # key(2)'s from the far one, nothing else


def _near_and_far_holding(make, k: bytes) -> tuple[DiskStore, DiskStore]:
    """Two tiers, ``k`` written into the far one only."""
    near, far = make.store("near"), make.store("far", FarTier)
    writer = make(lower=[far])
    put(writer, [k])
    eventually(lambda: holds(far, k), "write-behind")
    writer.close()
    return near, far


def test_a_far_record_missing_a_shard_is_not_promoted(make) -> None:
    near, far = _near_and_far_holding(make, key(5))
    far.delete_many([NS[1] + key(5)])
    h = make(lower=[near, far])
    assert h.lookup_many([key(5)]) == [MISS]


def test_a_tier_that_fails_is_a_miss_and_the_next_tier_is_asked(make) -> None:
    near, far = _near_and_far_holding(make, key(7))
    near.close()  # a closed store answers every lookup with "not here"
    h = make(lower=[near, far])
    assert h.lookup_many([key(7)]) == [PENDING]
    eventually(lambda: h.lookup_many([key(7)]) == [HIT], "promotion from the far tier")


class FlakyTier(FarTier):
    """A far tier whose reads fail while ``down`` is set (a shared server that timed out)."""

    down = False

    def get_into(self, key, out):  # type: ignore[override]
        return None if self.down else super().get_into(key, out)


def test_a_chunk_whose_promotion_failed_is_asked_for_again_later(make) -> None:
    far = make.store("far", FlakyTier)
    writer = make(lower=[far])
    put(writer, [key(5)])
    eventually(lambda: holds(far, key(5)), "write-behind")
    writer.close()
    far.down = True
    now = [100.0]  # the hierarchy's clock: stepped here, never slept through
    h = make(lower=[far], retry_failed_after_s=10.0, clock=lambda: now[0])
    assert h.lookup_many([key(5)]) == [PENDING]
    eventually(lambda: h.stats()["promotions_failed"] == 1, "the failed promotion")
    assert h.lookup_many([key(5)]) == [MISS]  # not asked again at once
    far.down = False
    now[0] += 9.9
    assert h.lookup_many([key(5)]) == [MISS]  # nor before retry_failed_after_s
    now[0] += 0.1
    assert h.lookup_many([key(5)]) == [PENDING]  # asked again: the tier answers now
    eventually(lambda: h.lookup_many([key(5)]) == [HIT], "the second promotion")


def test_admission_thresholds_must_match_the_tiers(make) -> None:
    with pytest.raises(ValueError, match="1 values of admit_after for 2 lower tiers"):
        make(lower=[make.store("a"), make.store("b", FarTier)], admit_after=[1])


# ---- the parts ---------------------------------------------------------------------------------


def test_journal_keeps_order_and_says_nothing_when_off() -> None:
    on, off = Journal(True), Journal(False)
    for j in (on, off):
        j.add("host", False, [b"a"])
        j.add("disk", True, [b"b"])
        j.add("disk", True, [])  # nothing happened: no event
    assert on.take() == [("host", False, [b"a"]), ("disk", True, [b"b"])] and on.take() == []
    assert off.take() == [] and not off.enabled


def test_offers_are_tracked_for_a_bounded_number_of_chunks(tmp_path: Path) -> None:
    slab = HostSlab(tmp_path / "slab", 64, 2)
    try:
        s = Shared(HostPool(slab), [], namespaces=[b"n"], group_shard_bytes=[64], group_dtypes=["uint8"],
                   shard_bytes=None, events=False, offer_tracker_size=2)
        assert [s.offer(k) for k in (b"a", b"a", b"b", b"c")] == [1, 2, 1, 1]
        assert list(s.offers) == [b"b", b"c"]  # the least recently offered went
    finally:
        slab.close()


def test_write_backpressure_is_per_tier(make) -> None:
    """A tier that stops answering defers (then drops) only its own writes."""

    class Stuck(FarTier):
        gate = threading.Event()

        def put_many_then(self, entries, done):
            assert self.gate.wait(30)
            super().put_many_then(entries, done)

    near, far = make.store("near"), make.store("far", Stuck)
    # One write in flight and two deferred per tier: the fourth chunk is postponed in each.
    h = make(lower=[near, far], max_write_inflight_bytes=1, max_deferred_bytes=2 * SHARD * len(NS),
             slots=8, max_write_pinned_bytes=8 * SHARD * len(NS))
    put(h, [key(i) for i in range(4)])
    st = h.stats()["tiers"]
    assert (st["remote"]["writes_deferred"], st["remote"]["writes_dropped"]) == (2, 1)
    assert (st["disk"]["writes_deferred"], st["disk"]["writes_dropped"]) == (2, 1)
    # The near tier writes all four (the postponed one once its budget has room) while the far
    # one hangs on its first.
    eventually(lambda: h.stats()["tiers"]["disk"]["writes_completed"] == 4, "the near tier's writes")
    assert all(holds(near, key(i)) for i in range(4))
    st = h.stats()["tiers"]
    assert st["remote"]["writes_completed"] == 0 and st["disk"]["writes_resumed"] == 1
    Stuck.gate.set()
    eventually(lambda: h.stats()["tiers"]["remote"]["writes_completed"] == 4, "the far tier's writes")


def test_tier_links_name_their_tiers(tmp_path: Path) -> None:
    with FarTier(tmp_path / "f", budget_bytes=1 << 20) as far:
        assert TierLink(far, 1, 1).name == "remote"


def test_writes_run_at_idle_priority_and_reads_do_not(make) -> None:
    """Write-behind yields the cores to serving; a promotion, which a request waits on, does not
    (tiers/priority.py). Checked where Linux reports thread policies."""
    import os

    from kvstrata.tiers.priority import thread_policy

    if thread_policy() is None or not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no per-thread scheduling policies here")
    seen: dict[str, set[int | None]] = {"put": set(), "get": set()}

    class Watched(DiskStore):
        def put_many_then(self, entries, done):
            seen["put"].add(thread_policy())
            super().put_many_then(entries, done)

        def get_into(self, key, out):
            seen["get"].add(thread_policy())
            return super().get_into(key, out)

    disk = make.store("watched", Watched)
    h = make(lower=[disk])
    put(h, [key(1)])
    eventually(lambda: holds(disk, key(1)), "write-behind")
    h.close()
    h2 = make(lower=[disk])
    assert h2.lookup_many([key(1)]) == [PENDING]
    eventually(lambda: h2.lookup_many([key(1)]) == [HIT], "promotion")
    assert seen == {"put": {os.SCHED_IDLE}, "get": {os.SCHED_OTHER}}
    # The store's own writer thread too, when the engine asks for it.
    with DiskStore(disk.path.with_name("idle"), budget_bytes=1 << 20, idle_writer=True) as store:
        assert store.write(lambda txn, h: thread_policy()) == os.SCHED_IDLE
