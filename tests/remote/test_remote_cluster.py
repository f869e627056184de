"""``RemoteStore`` on a real 3-master Redis cluster (``redis+cluster://``): batches that span
slots and nodes, two engines sharing chunks through it, and one master killed and brought back.

What a dead master does today (observed, and asserted as such): the tier has one breaker for the
whole cluster, and the probe's PING goes to every node, so while any master is down the whole
shared tier is skipped (every chunk a MISS, at once, no exception), not only that master's slots.
With Redis' default ``cluster-require-full-coverage yes`` the surviving masters refuse every key
(CLUSTERDOWN) anyway once they mark the node failed (``cluster-node-timeout``, 2 s here). When the
master is back (empty: no persistence, no replica), the breaker closes, the other masters' values
are served again and the dead master's are misses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from redis_server import PATIENT_TIMEOUTS, RedisCluster

from kvstrata.presence import Presence
from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.host import HostPool, HostSlab
from kvstrata.tiers.remote import RemoteStore, remote_key

HIT, PENDING, MISS = Presence.HIT, Presence.PENDING, Presence.MISS
NS = [b"rank0-namespace!", b"rank1-namespace!"]
SIZE = 2048
DEADLINE_S = 20.0


def skey(i: int, ns: bytes = NS[0]) -> bytes:
    return ns + i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def value(k: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(k[16:48], "big") + k[4]).integers(0, 256, SIZE, dtype=np.uint8)


def eventually(cond: Callable[[], object], what: str, deadline_s: float = DEADLINE_S) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < deadline_s, f"timed out waiting for {what}"
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture
def cluster(redis_cluster: RedisCluster) -> Iterator[RedisCluster]:
    """The module's cluster, empty and healthy for each test."""
    for s in redis_cluster.servers:
        if s.proc is None:
            s.start()
    redis_cluster._wait_ok()
    for s in redis_cluster.servers:
        s.client().flushall()
    yield redis_cluster


def node_keys(cluster: RedisCluster) -> list[set[bytes]]:
    """The keys each master holds (SCAN on a node lists its own keys only)."""
    return [set(s.client().scan_iter(match=b"kvstrata:*", count=1000)) for s in cluster.servers]


def store_on(cluster: RedisCluster, **kw) -> RemoteStore:
    opts: dict = dict(PATIENT_TIMEOUTS, probe_interval_s=0.2)
    opts.update(kw)
    return RemoteStore(cluster.url, **opts)


def test_batches_span_slots_and_nodes(cluster: RedisCluster) -> None:
    store = store_on(cluster)
    try:
        keys = [skey(i, NS[i % 2]) for i in range(300)]
        data = [value(k) for k in keys]
        assert store.put_many([(k, d, "uint8") for k, d in zip(keys, data, strict=True)]) == 300
        held = node_keys(cluster)
        assert all(len(h) > 50 for h in held), [len(h) for h in held]  # every master got its share
        assert set().union(*held) == {remote_key(k) for k in keys}
        assert store.contains_many(keys + [skey(999)]) == [True] * 300 + [False]
        outs = [np.zeros(SIZE, np.uint8) for _ in keys]
        assert store.get_many_into(list(zip(keys, outs, strict=True))) == [SIZE] * 300
        assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))
        # A damaged value on one node: a miss, deleted through the cluster client.
        node = next(s for s, h in zip(cluster.servers, held, strict=True) if remote_key(keys[7]) in h)
        node.client().set(remote_key(keys[7]), b"KVSF garbage")
        assert store.get_into(keys[7], np.zeros(SIZE, np.uint8)) is None
        eventually(lambda: node.client().exists(remote_key(keys[7])) == 0, "the damaged value's deletion")
        assert store.delete_many(keys[:100]) == 99  # keys[7] is gone already
        assert store.contains_many(keys[:100]) == [False] * 100
        assert sum(len(h) for h in node_keys(cluster)) == 200
        st = store.stats()
        assert (st["corrupt"], st["errors"], st["unavailable"], st["skipped_unavailable"]) == (1, 0, 0, 0)
    finally:
        store.close()


def test_two_engines_share_chunks_through_the_cluster(tmp_path: Path, cluster: RedisCluster) -> None:
    shard = 4096
    made: list = []

    def engine(name: str) -> Hierarchy:
        slab = HostSlab(tmp_path / f"slab-{name}", shard * len(NS), 32)
        remote = store_on(cluster)
        h = Hierarchy(HostPool(slab), [remote], namespaces=NS, group_shard_bytes=[shard],
                      group_dtypes=["bfloat16"], write_backpressure="drop", idle_writes=False)
        made.extend([slab, remote, h])
        return h

    def fill(k: bytes, r: int) -> np.ndarray:
        return np.random.default_rng(int.from_bytes(k[:32], "big") * 5 + r).integers(0, 256, shard, dtype=np.uint8)

    try:
        keys = [i.to_bytes(32, "big") + (0).to_bytes(4, "big") for i in range(24)]
        a = engine("a")
        slots = a.prepare_store(keys)
        assert slots is not None
        for k, s in slots.items():
            for r in range(len(NS)):
                a.slab.array[s, r * shard : (r + 1) * shard] = fill(k, r)
        a.complete_store(keys)
        eventually(lambda: a.stats()["tiers"]["remote"]["writes_completed"] == 24, "write-behind")
        assert sum(len(h) for h in node_keys(cluster)) == 48 and all(node_keys(cluster))
        b = engine("b")
        promoting: dict[bytes, str] = {}
        assert b.lookup_many(keys, promoting) == [PENDING] * 24
        assert promoting == dict.fromkeys(keys, "remote")
        eventually(lambda: b.lookup_many(keys) == [HIT] * 24, "promotions from the cluster")
        loaded = b.prepare_load(keys)
        for k, s in zip(keys, loaded, strict=True):
            for r in range(len(NS)):
                assert np.array_equal(b.slab.array[s, r * shard : (r + 1) * shard], fill(k, r))
        b.complete_load(keys)
    finally:
        for obj in reversed(made):
            obj.close()


def test_one_master_killed_and_back(cluster: RedisCluster) -> None:
    store = store_on(cluster)
    try:
        keys = [skey(i, NS[i % 2]) for i in range(300)]
        assert store.put_many([(k, value(k), "uint8") for k in keys]) == 300
        held = node_keys(cluster)
        victim = cluster.servers[1]
        lost = [remote_key(k) in held[1] for k in keys]
        assert 50 < sum(lost) < 250
        victim.kill()
        # The first call that meets the dead master opens the breaker (no exception).
        eventually(lambda: store.contains_many(keys) is not None and not store.available, "the breaker to open")
        skipped = store.stats()["skipped_unavailable"]
        # While it is down: every call is answered by the breaker, without a round trip (at
        # once) and never an exception; every chunk is a miss, no write is made.
        for _ in range(5):
            assert store.contains_many(keys) == [False] * 300
            outs = [np.zeros(SIZE, np.uint8) for _ in keys[:30]]
            assert store.get_many_into(list(zip(keys[:30], outs, strict=True))) == [None] * 30
            assert store.put_many([(skey(5000), value(skey(5000)), "uint8")]) == 0
        assert store.stats()["skipped_unavailable"] == skipped + 15
        st = store.stats()
        assert st["unavailable"] >= 1 and not store.available  # observed: the whole tier is skipped
        assert st["errors"] == 0 and st["corrupt"] == 0
        # Back (empty): the breaker closes; the other masters' values were never lost.
        victim.start()
        cluster._wait_ok()
        eventually(lambda: store.available, "the breaker to close", 10)
        found = store.contains_many(keys)
        assert found == [not gone for gone in lost]
        outs = [np.zeros(SIZE, np.uint8) for _ in keys]
        got = store.get_many_into(list(zip(keys, outs, strict=True)))
        assert got == [None if gone else SIZE for gone in lost]
        assert store.put_many([(k, value(k), "uint8") for k, gone in zip(keys, lost, strict=True) if gone]) == sum(lost)
        assert store.contains_many(keys) == [True] * 300
    finally:
        store.close()
        if cluster.servers[1].proc is None:
            cluster.servers[1].start()


def test_one_master_hung_costs_one_timeout(cluster: RedisCluster) -> None:
    """A master SIGSTOPped: the call that meets it waits for the timeouts; every later call is
    answered at once while it hangs. The probe must PING every master for that: redis-py sends a
    cluster PING to one node (its default), which answers, and the breaker used to close each
    probe interval only for the next batch to wait on the hung master again."""
    keys = [skey(i, NS[i % 2]) for i in range(300)]
    writer = store_on(cluster)
    try:
        assert writer.put_many([(k, value(k), "uint8") for k in keys]) == 300
    finally:
        writer.close()
    store = store_on(cluster, connect_timeout_s=0.2, timeout_s=0.25)  # the connector's defaults
    try:
        # Connected (a loaded machine may time out once on the way: the breaker then recovers).
        eventually(lambda: store.available and store.contains_many(keys[:1]) == [True], "a first answer")
        changes = store.stats()["state_changes"]
        default = store._client.get_default_node()  # where a plain cluster PING goes
        victim = next(s for s in cluster.servers if s.port != default.port)
        victim.pause()
        try:
            asked = store.stats()
            # Calls a step loop makes over several probe intervals (0.2 s): only the first meets
            # the hung master and waits for the timeouts; the breaker answers all the others.
            for _ in range(20):
                assert not any(store.contains_many(keys))
                time.sleep(0.05)  # a step loop's pace, over 5 probe intervals; decides nothing
            st = store.stats()
            assert st["unavailable"] == asked["unavailable"] + 1, "calls that waited on the hung master"
            assert st["skipped_unavailable"] == asked["skipped_unavailable"] + 19
            assert st["state_changes"] == changes + 1 and not store.available
        finally:
            victim.resume()
        eventually(lambda: store.available, "the breaker to close", 10)
        # Nothing lost. The master just resumed may still miss one call's 0.25 s on a loaded
        # machine (a counted miss, as any timeout): every key is answered again after.
        eventually(lambda: store.contains_many(keys) == [True] * 300, "every key answered again")
    finally:
        store.close()


def test_writes_beyond_the_connection_pool_wait_for_a_connection(cluster: RedisCluster) -> None:
    """The write-behind hands writes over without waiting for them (``put_many_then``), so more
    can be in flight than the write pool has connections. A cluster client refuses a command
    beyond its pool (``MaxConnectionsError``, an outage to the breaker): the tier holds such
    writes until a connection is free, and every one lands with the breaker closed."""
    store = store_on(cluster, max_connections=2, write_timeout_s=5.0)
    keys = [skey(i, NS[i % 2]) for i in range(24)]
    reports: list[int] = []
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            reports.append(n)

    try:
        for i in range(0, len(keys), 2):  # 12 writes of two values, handed over at once
            store.put_many_then([(k, value(k), "uint8") for k in keys[i:i + 2]], report)
        eventually(lambda: len(reports) == 12, "every write's report")
        assert reports == [2] * 12
        st = store.stats()
        assert (st["puts"], st["put_failed"], st["unavailable"], st["errors"]) == (24, 0, 0, 0)
        assert store.available and store.contains_many(keys) == [True] * 24
    finally:
        store.close()


def test_a_url_of_one_seed_finds_the_whole_cluster(cluster: RedisCluster) -> None:
    """Any node is enough as a seed: the client discovers the others."""
    seed = cluster.servers[2]
    store = RemoteStore(f"redis+cluster://127.0.0.1:{seed.port}", **PATIENT_TIMEOUTS)
    try:
        keys = [skey(i) for i in range(60)]
        assert store.put_many([(k, value(k), "uint8") for k in keys]) == 60
        assert all(node_keys(cluster))
        assert store.contains_many(keys) == [True] * 60
    finally:
        store.close()


def test_a_plain_url_on_a_cluster_node_fails_softly(cluster: RedisCluster) -> None:
    """``redis://`` pointed at a cluster node (a configuration mistake): keys of other nodes'
    slots come back MOVED. Counted as errors and answered as misses; nothing raises."""
    node = cluster.servers[0]
    store = RemoteStore(f"redis://127.0.0.1:{node.port}", **PATIENT_TIMEOUTS)
    try:
        keys = [skey(i) for i in range(30)]
        assert store.put_many([(k, value(k), "uint8") for k in keys]) == 0
        plain = node.client()
        # A key of another node's slots is MOVED: a miss; one of this node's is served exactly
        # when the failed batch still wrote it there.
        foreign = next(k for k in keys if _moved(plain, remote_key(k)))
        own = next(k for k in keys if not _moved(plain, remote_key(k)))
        assert store.get_into(foreign, np.zeros(SIZE, np.uint8)) is None
        assert store.get_into(own, np.zeros(SIZE, np.uint8)) == (SIZE if plain.exists(remote_key(own)) else None)
        st = store.stats()
        assert st["errors"] >= 1 and st["put_failed"] == 30
        assert st["unavailable"] == 0 and store.available  # the node answers: not an outage
    finally:
        store.close()


def _moved(plain: redis.Redis, rkey: bytes) -> bool:
    """Whether a plain client's command on ``rkey`` is redirected (another node's slot)."""
    try:
        plain.exists(rkey)
    except redis.exceptions.MovedError:
        return True
    return False
