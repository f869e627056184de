"""The Hierarchy's KV cache events: chunks entering and leaving each tier, disk budget evictions,
and a restarted engine's announcement of what its disk holds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from hierarchy_helpers import (
    HIT,
    NS,
    PENDING,
    eventually,
    key,
    on_disk,
    store,
)

from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy

# ---- events (vLLM KV cache events) -----------------------------------------------------------------


def test_events_follow_chunks_into_and_out_of_each_tier(env):
    disk = env.disk()
    h = env.hier(disk, slots=2, events=True)
    k1, k2, k3 = key(1), key(2), key(3, group=1)
    store(h, [k1, k2])
    eventually(lambda: h.stats()["writes_completed"] == 2, "write-behind")
    events = h.take_events()  # each chunk is in the host tier before its write-behind starts
    assert events[:2] == [("host", False, [k1]), ("host", False, [k2])]
    assert sorted(events[2:]) == [("disk", False, [k1]), ("disk", False, [k2])]
    store(h, [k3])  # the host tier holds two chunks: the least recently used one goes
    eventually(lambda: h.stats()["writes_completed"] == 3, "write-behind")
    assert h.take_events() == [("host", True, [k1]), ("host", False, [k3]), ("disk", False, [k3])]
    disk.delete_many([NS[1] + k2])  # one rank's shard gone: the chunk is gone from disk
    assert h.take_events() == [("disk", True, [k2])]
    h.reset()  # vLLM's prefix-cache reset empties the host tier: one removal of both
    (tier, removed, keys), = h.take_events()
    assert (tier, removed, sorted(keys)) == ("host", True, sorted([k2, k3]))
    h.close()

    h2 = env.hier(disk, events=True)  # a restarted engine: k1 comes back from disk
    assert h2.lookup_many([k1]) == [PENDING]
    eventually(lambda: h2.lookup_many([k1]) == [HIT], "promotion")
    assert h2.take_events() == [("host", False, [k1])]


def test_a_chunk_whose_records_leave_in_separate_transactions_is_removed_once(env):
    # An eviction that needs one record's room, then another's, deletes a chunk's shard records
    # in two transactions: a router must see one BlockRemoved, not one per transaction.
    disk = env.disk()
    h = env.hier(disk, events=True, admit_after=2)
    k = key(1)
    store(h, [k])
    assert h.lookup_many([k]) == [HIT]  # the second offer admits it
    # Announced once the write-behind saw its transaction commit (a reader may see the record
    # on disk a moment earlier).
    stored = _announced(h, lambda got: ("disk", False, [k]) in got)
    assert stored == [("host", False, [k]), ("disk", False, [k])] and on_disk(disk, k)
    disk.delete_many([NS[0] + k])
    disk.delete_many([NS[1] + k])
    assert h.take_events() == [("disk", True, [k])]
    assert h.lookup_many([k]) == [HIT]  # still in demand: written again
    assert _announced(h, bool) == [("disk", False, [k])] and on_disk(disk, k)  # written again
    disk.delete_many([NS[1] + k])  # written since: its removal is news again
    disk.delete_many([NS[0] + k])
    assert h.take_events() == [("disk", True, [k])]
    h.close()


def test_disk_budget_evictions_are_events_once_per_chunk(env, tmp_path):
    # Room for two chunks (two records each, one per rank): a third evicts the oldest chunk.
    disk = DiskStore(tmp_path / "small", budget_bytes=40_000, codec="raw", evict_slack=0.0)
    try:
        h = env.hier(disk, events=True)
        for i in range(3):
            store(h, [key(10 + i)])
            eventually(lambda i=i: h.stats()["writes_completed"] == i + 1, "write-behind")
        # The writer reports an eviction once its transaction committed, which may be just
        # after the write that caused it was counted complete.
        got = _announced(h, lambda events: any(c[0] == "disk" and c[1] for c in events))
        removed = [c for c in got + h.take_events() if c[0] == "disk" and c[1]]
        assert removed == [("disk", True, [key(10)])]
        assert not on_disk(disk, key(10)) and on_disk(disk, key(12))
    finally:
        h.close()
        disk.close()


def test_no_events_are_kept_unless_asked_for(env):
    disk = env.disk()
    h = env.hier(disk, slots=2)
    store(h, [key(1), key(2)])
    eventually(lambda: h.stats()["writes_completed"] == 2, "write-behind")
    store(h, [key(3)])  # evicts a host chunk
    disk.delete_many([NS[0] + key(1)])
    assert h.take_events() == []


def _announced(h: Hierarchy, until: Callable[[list], bool]) -> list:
    got: list = []

    def done() -> bool:
        got.extend(h.take_events())
        return until(got)

    eventually(done, "the disk announcement")
    return got


def test_a_restarted_engine_announces_every_chunk_its_disk_holds(env):
    disk = env.disk()
    h = env.hier(disk)
    k1, k2, k3 = key(1), key(2), key(3, group=1)
    store(h, [k1, k2, k3])
    eventually(lambda: h.stats()["writes_completed"] == 3, "write-behind")
    h.close()
    disk.delete_many([NS[1] + k2])  # one rank's shard gone: k2 cannot be served
    other = b"other-model-ns!!"  # another model's record in the same store
    disk.put_many([(other + key(4), np.zeros(64, np.uint8), "uint8")])
    eventually(lambda: disk.contains_many([other + key(4)]) == [True], "the foreign record")

    h2 = env.hier(disk, events=True)
    assert h2.take_events() == []  # nothing until asked
    h2.announce_disk()
    assert _announced(h2, lambda got: bool(got)) == [("disk", False, [k1, k3])]
    assert h2.lookup_many([k1]) == [PENDING]  # and the chunks announced are served
    eventually(lambda: h2.lookup_many([k1]) == [HIT], "promotion")
    assert h2.take_events() == [("host", False, [k1])]

    quiet = env.hier(disk)  # without KV events there is nothing to announce to
    quiet.announce_disk()
    assert quiet.take_events() == []


class _DropsAfterChecks(DiskStore):
    """A store whose writer drops a record right after the announcement checked its shards."""

    victim = b""
    checks_before_drop = 0

    def contains_many(self, keys):
        found = super().contains_many(keys)
        if self.victim:
            self.checks_before_drop -= 1
            if self.checks_before_drop == 0:
                self.delete_many([ns + self.victim for ns in NS])
        return found


def test_a_chunk_dropped_during_the_announcement_is_reported_removed_after_it(env, tmp_path):
    disk = _DropsAfterChecks(tmp_path / "racy", budget_bytes=1 << 30)
    h2 = None
    try:
        h = env.hier(disk)
        k1, k2 = key(1), key(2)
        store(h, [k1, k2])
        eventually(lambda: h.stats()["writes_completed"] == 2, "write-behind")
        h.close()
        disk.victim, disk.checks_before_drop = k1, 1  # once the batch's shards were checked (one call)
        h2 = env.hier(disk, events=True)
        h2.announce_disk()
        events = _announced(h2, lambda got: ("disk", False, [k1, k2]) in got and got[-1][1])
        # Its removal happened before the announcement; the last word on k1 must be "removed".
        assert events == [("disk", True, [k1]), ("disk", False, [k1, k2]), ("disk", True, [k1])]
    finally:
        if h2 is not None:
            h2.close()
        disk.close()


def test_chunks_served_from_the_host_tier_stay_on_disk_longest(env, tmp_path):
    """The disk's LRU counts host-tier hits: the chunk served from host again and again keeps its
    records when the budget evicts, the one nobody asked for goes (written later, but idle)."""
    disk = DiskStore(tmp_path / "small", budget_bytes=40_000, codec="raw", evict_slack=0.0)
    try:
        h = env.hier(disk)
        hot, idle, new = key(20), key(21), key(22)
        for i, k in enumerate((hot, idle)):
            store(h, [k])
            eventually(lambda i=i: h.stats()["writes_completed"] == i + 1, "write-behind")
        assert h.lookup_many([hot]) == [HIT]  # served from the host tier
        store(h, [new])  # the disk holds two chunks: one must go
        eventually(lambda: h.stats()["writes_completed"] == 3, "write-behind")
        assert on_disk(disk, hot) and not on_disk(disk, idle) and on_disk(disk, new)
    finally:
        h.close()
        disk.close()
