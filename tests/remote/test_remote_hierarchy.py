"""The hierarchy over a real Redis server: host slots -> local disk (or none) -> ``RemoteStore``.

Two hierarchies with their own slabs and disk stores and one server stand for two engines of a
deployment: what one stores reaches the server by write-behind, and the other promotes it from
there (and keeps it on its own disk). Tensor-parallel layouts of 1, 2 and 4 shards: a chunk is on
the server only when every shard's value is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
from redis_server import PATIENT_TIMEOUTS, RedisServer

from kvstrata.presence import Presence
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.host import HostPool, HostSlab
from kvstrata.tiers.lower import all_shards_present
from kvstrata.tiers.remote import RemoteStore, remote_key

HIT, PENDING, MISS = Presence.HIT, Presence.PENDING, Presence.MISS
SHARD = 4096
DEADLINE_S = 20.0


def namespaces(ranks: int) -> list[bytes]:
    return [f"rank{r}-namespace!".encode() for r in range(ranks)]  # 16 bytes, as connector.keys


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def pattern(k: bytes, shard: int) -> np.ndarray:
    seed = int.from_bytes(k[:32], "big") * 7 + shard
    return np.random.default_rng(seed).integers(0, 256, SHARD, dtype=np.uint8)


def eventually(cond: Callable[[], object], what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class Engine:
    """One engine's tier stack: slab + host pool, its own disk store (optional), the server."""

    def __init__(self, h: Hierarchy, disk: DiskStore | None, remote: RemoteStore, ns: list[bytes]) -> None:
        self.h, self.disk, self.remote, self.ns = h, disk, remote, ns

    def put(self, keys: list[bytes]) -> None:
        slots = self.h.prepare_store(keys)
        assert slots is not None
        for k, s in slots.items():
            for r in range(len(self.ns)):
                self.h.slab.array[s, r * SHARD : (r + 1) * SHARD] = pattern(k, r)
        self.h.complete_store(list(slots))

    def check_bytes(self, keys: list[bytes]) -> None:
        slots = self.h.prepare_load(keys)
        try:
            for k, s in zip(keys, slots, strict=True):
                for r in range(len(self.ns)):
                    assert np.array_equal(self.h.slab.array[s, r * SHARD : (r + 1) * SHARD], pattern(k, r))
        finally:
            self.h.complete_load(keys)

    def on_disk(self, k: bytes) -> bool:
        assert self.disk is not None
        return all_shards_present(self.disk, self.ns, [k]) == [True]

    def tier(self, name: str) -> dict:
        return self.h.stats()["tiers"][name]


@pytest.fixture
def plain(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client()


@pytest.fixture
def engines(tmp_path: Path, redis_server: RedisServer):
    """``make(name, ranks=, disk=, slots=, remote=, **hierarchy options)``: an engine on the test's
    server; everything made is closed at the end (hierarchies first)."""
    made: list = []

    def make(name: str, *, ranks: int = 2, disk: bool | DiskStore = True, slots: int = 16,
             remote: RemoteStore | None = None, remote_cls: type[RemoteStore] = RemoteStore,
             remote_opts: dict | None = None, **kw) -> Engine:
        ns = namespaces(ranks)
        slab = HostSlab(tmp_path / f"slab-{name}-{len(made)}", SHARD * ranks, slots)
        made.append(slab)
        store = None
        if disk is True:
            store = DiskStore(tmp_path / f"disk-{name}", budget_bytes=1 << 30)
            made.append(store)
        elif isinstance(disk, DiskStore):
            store = disk
        if remote is None:
            opts: dict = dict(PATIENT_TIMEOUTS, probe_interval_s=0.2)
            opts.update(remote_opts or {})
            remote = remote_cls(redis_server.url, **opts)
            made.append(remote)
        lower = [store, remote] if store is not None else [remote]
        # The connector's stack: the disk defers what it cannot take yet, the server drops.
        kw.setdefault("write_backpressure", ["defer", "drop"][-len(lower):])
        # Normal priority: idle-priority writers starve while anything else keeps the cores busy.
        kw.setdefault("idle_writes", False)
        h = Hierarchy(HostPool(slab), lower, namespaces=ns, group_shard_bytes=[SHARD],
                      group_dtypes=["bfloat16"], **kw)
        made.append(h)
        return Engine(h, store, remote, ns)

    yield make
    for obj in reversed(made):
        obj.close()


def on_server(plain: redis.Redis, ns: list[bytes], k: bytes) -> bool:
    return plain.exists(*[remote_key(n + k) for n in ns]) == len(ns)


@pytest.mark.parametrize("disk", [True, False], ids=["host+disk+remote", "host+remote"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_chunk_one_engine_stores_is_served_to_another(engines, plain: redis.Redis, ranks: int,
                                                        disk: bool) -> None:
    keys = [key(i) for i in range(4)]
    a = engines("a", ranks=ranks, disk=disk)
    a.put(keys)
    eventually(lambda: all(on_server(plain, a.ns, k) for k in keys), "A's write-behind to the server")
    assert plain.dbsize() == 4 * ranks  # one value per chunk and shard, nothing else
    eventually(lambda: a.tier("remote")["writes_completed"] == 4, "A's write count")
    if disk:
        eventually(lambda: all(a.on_disk(k) for k in keys), "A's write-behind to disk")

    b = engines("b", ranks=ranks, disk=disk)
    promoting: dict[bytes, str] = {}
    assert b.h.lookup_many(keys + [key(99)], promoting) == [PENDING] * 4 + [MISS]
    assert promoting == dict.fromkeys(keys, "remote")
    eventually(lambda: b.h.lookup_many(keys) == [HIT] * 4, "B's promotions from the server")
    b.check_bytes(keys)
    again: dict[bytes, str] = {}
    assert b.h.lookup_many(keys, again) == [HIT] * 4 and again == {}
    st = b.h.stats()
    assert (st["promotions_completed"], st["promotions_failed"]) == (4, 0)
    rs = b.tier("remote")
    assert (rs["get_hits"], rs["gets"], rs["corrupt"], rs["errors"], rs["unavailable"]) == (4 * ranks, 4 * ranks, 0, 0, 0)
    assert rs["writes_completed"] == rs["puts"] == 0  # promoted from the server: not written back
    if disk:
        # A remote hit is kept on the local disk: the next restart finds it there.
        eventually(lambda: all(b.on_disk(k) for k in keys), "B's copy on its own disk")
        eventually(lambda: b.tier("disk")["writes_completed"] == 4, "B's disk write count")
        # A new hierarchy on B's disk and the same server finds the chunks on disk first.
        b2 = engines("b2", ranks=ranks, disk=b.disk, remote=b.remote)
        first: dict[bytes, str] = {}
        assert b2.h.lookup_many(keys, first) == [PENDING] * 4
        assert first == dict.fromkeys(keys, "disk")
        eventually(lambda: b2.h.lookup_many(keys) == [HIT] * 4, "promotions from disk")
        b2.check_bytes(keys)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_chunk_missing_one_shard_on_the_server_is_a_miss(engines, plain: redis.Redis, ranks: int) -> None:
    keys = [key(i) for i in range(3)]
    a = engines("a", ranks=ranks, disk=False)
    a.put(keys)
    eventually(lambda: all(on_server(plain, a.ns, k) for k in keys), "write-behind")
    assert plain.delete(remote_key(a.ns[-1] + keys[1])) == 1  # the last rank's shard of chunk 1
    b = engines("b", ranks=ranks, disk=False)
    promoting: dict[bytes, str] = {}
    assert b.h.lookup_many(keys, promoting) == [PENDING, MISS, PENDING]
    assert set(promoting) == {keys[0], keys[2]}
    eventually(lambda: b.h.lookup_many(keys) == [HIT, MISS, HIT], "promotions")
    b.check_bytes([keys[0], keys[2]])


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_prefix_run_stops_at_the_first_chunk_the_server_lost(engines, plain: redis.Redis, ranks: int) -> None:
    """The server evicted chunk 2 of a prefix run: chunks 3.. cannot be used (the run ends at
    2), so none of them is promoted; a plain probe promotes whatever is there."""
    keys = [key(i) for i in range(6)]
    a = engines("a", ranks=ranks, disk=False)
    a.put(keys)
    eventually(lambda: all(on_server(plain, a.ns, k) for k in keys), "write-behind")
    plain.delete(remote_key(a.ns[0] + keys[2]))
    b = engines("b", ranks=ranks, disk=False)
    promoting: dict[bytes, str] = {}
    assert b.h.lookup_many(keys, promoting, prefix=True) == [PENDING, PENDING, MISS, MISS, MISS, MISS]
    assert set(promoting) == set(keys[:2])
    assert b.h.stats()["promotions_started"] == 2
    eventually(lambda: b.h.lookup_many(keys, prefix=True)[:2] == [HIT, HIT], "promotions")
    assert b.h.lookup_many(keys, prefix=True) == [HIT, HIT, MISS, MISS, MISS, MISS]
    assert b.h.stats()["promotions_started"] == 2
    c = engines("c", ranks=ranks, disk=False)
    assert c.h.lookup_many(keys) == [PENDING, PENDING, MISS, PENDING, PENDING, PENDING]


class GatedRemote(RemoteStore):
    """The real store, whose reads wait until the test opens the gate (the server is real)."""

    gate: threading.Event

    def get_many_into(self, items):
        assert self.gate.wait(DEADLINE_S)
        return super().get_many_into(items)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_value_evicted_between_lookup_and_read_fails_only_that_chunk(engines, plain: redis.Redis,
                                                                        ranks: int) -> None:
    """The server evicts a value after the lookup found it and before the promotion reads it:
    the promotion fails, the chunk is a MISS from then on (never an exception, never wrong
    bytes), its host slot is free again, and the other chunks of the batch are served."""
    keys = [key(i) for i in range(3)]
    a = engines("a", ranks=ranks, disk=False)
    a.put(keys)
    eventually(lambda: all(on_server(plain, a.ns, k) for k in keys), "write-behind")
    GatedRemote.gate = threading.Event()
    b = engines("b", ranks=ranks, disk=False, slots=4, remote_cls=GatedRemote)
    assert b.h.lookup_many(keys, prefix=True) == [PENDING] * 3
    plain.delete(remote_key(a.ns[-1] + keys[1]))  # evicted meanwhile
    GatedRemote.gate.set()
    eventually(lambda: not b.h.in_flight(keys), "the promotions")
    assert b.h.lookup_many(keys) == [HIT, MISS, HIT]
    assert b.h.lookup_many(keys, prefix=True) == [HIT, MISS, HIT]  # the host copy is there
    b.check_bytes([keys[0], keys[2]])
    st = b.h.stats()
    # A failed chunk is not asked for again (until it is stored anew).
    assert (st["promotions_started"], st["promotions_completed"], st["promotions_failed"]) == (3, 2, 1)
    assert b.h.pool.free_slots == 2
    rs = b.tier("remote")
    assert rs["get_gone"] == 1 and rs["corrupt"] == 0 and rs["errors"] == 0


def test_remote_admission_waits_for_the_second_offer(engines, plain: redis.Redis) -> None:
    """admit_after per tier: the disk takes every stored chunk, the server a chunk offered
    twice (stored, then a host hit)."""
    a = engines("a", admit_after=[1, 2])
    a.put([key(1), key(2)])
    eventually(lambda: a.on_disk(key(1)) and a.on_disk(key(2)), "the disk writes")
    assert plain.dbsize() == 0
    assert a.h.lookup_many([key(1)]) == [HIT]  # the second offer of chunk 1
    eventually(lambda: on_server(plain, a.ns, key(1)), "chunk 1 on the server")
    assert not on_server(plain, a.ns, key(2))
    eventually(lambda: a.tier("remote")["writes_completed"] == 1, "the write's bookkeeping")


def test_host_hits_on_chunks_the_server_holds_touch_them(engines, plain: redis.Redis) -> None:
    """A chunk served from the host tier is touched on the server, or its LRU would evict
    first the chunks used most."""
    a = engines("a", ranks=2, disk=False)
    a.put([key(1)])
    eventually(lambda: a.tier("remote")["writes_completed"] == 1, "write-behind")

    def touches() -> int:
        return int(plain.info("commandstats").get("cmdstat_touch", {}).get("calls", 0))

    assert touches() == 0
    assert a.h.lookup_many([key(1), key(2)]) == [HIT, MISS]
    eventually(lambda: touches() == 2, "one TOUCH per shard")


def test_writes_the_server_cannot_take_are_dropped_and_hold_no_slot(engines, redis_server: RedisServer,
                                                                     plain: redis.Redis) -> None:
    """The shared tier's backpressure is "drop": with one write in flight (to a hung server),
    further writes are dropped and counted at once, and their host slots are free to evict:
    evicted, they are lost, while the chunk whose write failed in the outage, still held, is
    written once the server answers again."""
    a = engines("a", disk=False, slots=8, max_write_inflight_bytes=1,
                remote_opts=dict(connect_timeout_s=0.2, timeout_s=0.25, write_timeout_s=2.0))
    keys = [key(i) for i in range(5)]
    redis_server.pause()
    try:
        a.put(keys)  # chunk 0's write starts and hangs; 1..4 find it in flight
        rs = a.tier("remote")
        assert (rs["writes_dropped"], rs["writes_deferred"]) == (4, 0)
        assert a.h.stats()["writes_dropped"] == 4
        assert all(a.h.pool.refs(k) == 0 for k in keys[1:])  # dropped: nothing kept for them
        # The host tier can evict them at once: 7 new chunks fit beside the one being written.
        more = [key(i) for i in range(20, 27)]
        assert a.h.prepare_store(more) is not None
        a.h.complete_store(more, success=False)
        eventually(lambda: a.tier("remote")["writes_failed"] >= 1, "the hung write's timeout")
        eventually(lambda: a.h.pool.refs(keys[0]) == 0, "the hung write's slot")
        assert not a.remote.available and a.tier("remote")["unavailable"] >= 1
    finally:
        redis_server.resume()
    eventually(lambda: a.remote.available, "the breaker to close after the resume", 10)
    eventually(lambda: on_server(plain, a.ns, keys[0]), "the failed write, started again")
    eventually(lambda: a.h.stats()["write_inflight_bytes"] == 0, "the retried write's report")
    # Dropped, not deferred: the host tier evicted them meanwhile, so they never reach the server.
    assert not any(on_server(plain, a.ns, k) for k in keys[1:])
    assert a.h.stats()["writes_lost"] == 4 and plain.dbsize() == len(a.ns)
    a.put([key(10)])
    eventually(lambda: on_server(plain, a.ns, key(10)), "a new chunk on the server")


def test_a_write_is_reported_when_the_server_takes_it_while_its_write_thread_is_not_running(
        engines, plain: redis.Redis) -> None:
    """A write thread runs at idle priority: a busy CPU may not run it again for a second after
    it handed its write over (docs/BENCHMARKS.md). The write completes when the server takes
    it: counted, its slot released and its event out, while the thread that encoded it stays
    held."""
    handed_over, release = threading.Event(), threading.Event()

    class HeldAfterward(RemoteStore):  # held once the write is handed over, whichever put it is
        def put_many(self, entries):
            n = super().put_many(entries)
            handed_over.set()
            assert release.wait(DEADLINE_S)
            return n

        def put_many_then(self, entries, done):
            super().put_many_then(entries, done)
            handed_over.set()
            assert release.wait(DEADLINE_S)

    a = engines("a", disk=False, remote_cls=HeldAfterward, events=True)
    k = key(1)
    try:
        a.put([k])
        assert handed_over.wait(DEADLINE_S)
        eventually(lambda: a.tier("remote")["writes_completed"] == 1, "the write's report")
        assert on_server(plain, a.ns, k) and a.h.pool.refs(k) == 0
        assert ("remote", False, [k]) in a.h.take_events()
    finally:
        release.set()


def _writes_failed_while_hung(engines, redis_server: RedisServer) -> tuple[Engine, list[bytes]]:
    """An engine (host + server) that stored four chunks while the server hung: their writes
    failed and the breaker opened; the server is answering again (the probe has not necessarily
    found it yet)."""
    a = engines("a", disk=False, slots=16,
                remote_opts=dict(connect_timeout_s=0.2, timeout_s=0.25, write_timeout_s=0.25))
    keys = [key(i) for i in range(4)]
    redis_server.pause()
    try:
        a.put(keys)
        eventually(lambda: a.tier("remote")["writes_failed"] == 4, "the writes to fail")
        assert not a.remote.available
    finally:
        redis_server.resume()
    return a, keys


def test_writes_that_failed_while_the_server_hung_are_written_when_it_answers_again(
        engines, redis_server: RedisServer, plain: redis.Redis) -> None:
    """After an outage the shared tier heals by itself: once the probe finds the server again,
    the writes that failed meanwhile start again, though the engine stores nothing new (an idle
    replica would otherwise keep them unwritten until it shut down)."""
    a, keys = _writes_failed_while_hung(engines, redis_server)
    eventually(lambda: all(on_server(plain, a.ns, k) for k in keys), "the writes retried", 10)
    # A value is on the server a moment before its write counts as completed.
    eventually(lambda: a.tier("remote")["writes_completed"] == 4, "the retried writes to complete")
    rs = a.tier("remote")
    assert (rs["writes_retried"], rs["writes_completed"], rs["writes_failed"]) == (4, 4, 4)
    assert plain.dbsize() == 4 * len(a.ns)
    assert a.h.close() and a.h.stats()["writes_flushed"] == 0  # nothing left for the shutdown


def _writes_refused(engines, plain: redis.Redis, slots: int) -> tuple[Engine, list[bytes]]:
    """An engine (host + server) that stored four chunks while the server refused every write
    (full, under ``noeviction``): their writes failed while the server stayed available, so no
    probe starts them again. The server takes writes again, and holds none of them."""
    a = engines("a", disk=False, slots=slots)
    keys = [key(i) for i in range(4)]
    before = {name: plain.config_get(name)[name] for name in ("maxmemory", "maxmemory-policy")}
    plain.config_set("maxmemory-policy", "noeviction")
    plain.config_set("maxmemory", 1)  # below what the server uses already
    try:
        a.put(keys)
        eventually(lambda: a.tier("remote")["writes_failed"] == 4, "the refused writes")
        assert a.remote.available and a.remote.stats()["errors"] >= 1
    finally:
        plain.config_set("maxmemory", before["maxmemory"])
        plain.config_set("maxmemory-policy", before["maxmemory-policy"])
    assert plain.dbsize() == 0
    return a, keys


def test_writes_the_server_refused_are_written_at_a_clean_shutdown(engines, plain: redis.Redis) -> None:
    """Writes a server refused that the host tier still holds when the engine shuts down cleanly
    (the server taking writes again) reach the server then: the next engine finds them."""
    a, keys = _writes_refused(engines, plain, slots=8)
    assert a.h.close()
    st = a.h.stats()
    assert (st["writes_failed"], st["writes_flushed"], st["writes_completed"]) == (4, 4, 4)
    assert all(on_server(plain, a.ns, k) for k in keys)
    b = engines("b", disk=False)
    assert b.h.lookup_many(keys) == [PENDING] * 4
    eventually(lambda: b.h.lookup_many(keys) == [HIT] * 4, "B's promotions from the server")
    b.check_bytes(keys)


def test_writes_the_server_refused_follow_the_first_write_it_takes(engines, plain: redis.Redis) -> None:
    """Once the server takes writes again, the first write that succeeds starts again the writes
    it refused meanwhile."""
    a, keys = _writes_refused(engines, plain, slots=16)
    a.put([key(10)])
    eventually(lambda: all(on_server(plain, a.ns, k) for k in [*keys, key(10)]), "the writes retried")
    eventually(lambda: a.tier("remote")["writes_completed"] >= 5, "the retried writes to complete")
    rs = a.tier("remote")
    assert (rs["writes_retried"], rs["writes_completed"], rs["writes_failed"]) == (4, 5, 4)
    assert a.h.close() and a.h.stats()["writes_flushed"] == 0  # nothing left for the shutdown
