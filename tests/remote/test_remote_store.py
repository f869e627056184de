"""``RemoteStore`` against a real Redis server (tests/redis_server.py): round trips per codec and
dtype, values bound to their keys, damaged values answered as misses and deleted, batched
presence checks, TTLs, and the server's own eviction."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
from redis_server import PATIENT_TIMEOUTS, RedisServer

from kvstrata.tiers.lower import LowerTier, all_shards_present
from kvstrata.tiers.remote import KEY_PREFIX, RemoteStore, remote_key

NS = [b"rank0-namespace!", b"rank1-namespace!"]  # 16 bytes each, as connector.keys makes them
ELEMS = 16 << 10  # elements per value
DEADLINE_S = 20.0


def skey(i: int, ns: bytes = NS[0], group: int = 0) -> bytes:
    """A store key: namespace + chunk key (32-byte hash + 4-byte group)."""
    return ns + i.to_bytes(32, "big") + group.to_bytes(4, "big")


def eventually(cond: Callable[[], object], what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def tensor(dtype: str, seed: int, n: int = ELEMS) -> np.ndarray:
    """KV-like contents of ``dtype`` (bfloat16 as its uint16 bit patterns)."""
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        f = (rng.standard_normal(n) * 0.05).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    if dtype == "float32":
        return (rng.standard_normal(n) * 0.05).astype(np.float32)
    if dtype == "int8":
        return rng.integers(-128, 128, n, dtype=np.int8)
    return rng.integers(0, 256, n, dtype=np.uint8)


def make_store(server: RedisServer, **kw) -> RemoteStore:
    # Timeouts generous for a loaded CI machine; failures are what test_remote_failures is about.
    opts: dict = dict(PATIENT_TIMEOUTS, probe_interval_s=0.2)
    opts.update(kw)
    return RemoteStore(server.url, **opts)


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RemoteStore]:
    s = make_store(redis_server)
    yield s
    s.close()


@pytest.fixture
def plain(redis_server: RedisServer) -> redis.Redis:
    """A plain redis-py client on the same server, for what another party does to it."""
    return redis_server.client()


def quiet(stats: dict) -> bool:
    """No failure of any kind was counted."""
    return stats["errors"] == 0 and stats["unavailable"] == 0 and stats["skipped_unavailable"] == 0


def test_a_remote_store_is_a_lower_tier(store: RemoteStore) -> None:
    assert isinstance(store, LowerTier) and store.tier_name == "remote"
    assert store.available and store.stats()["available"] == 1


@pytest.mark.parametrize("codec", ["auto", "raw"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "uint8"])
def test_round_trip(redis_server: RedisServer, plain: redis.Redis, codec: str, dtype: str) -> None:
    store = make_store(redis_server, codec=codec)
    try:
        data = [tensor(dtype, seed) for seed in range(3)]
        keys = [skey(i, ns) for i, ns in zip(range(3), [NS[0], NS[1], NS[0]], strict=True)]
        assert store.put_many([(k, d, dtype) for k, d in zip(keys, data, strict=True)]) == 3
        # Stored as the codec's self-describing frame under kvstrata:<ns hex>:<chunk hex>.
        frame = plain.get(remote_key(keys[1]))
        assert frame is not None and frame.startswith(b"KVSF")
        assert remote_key(keys[1]) == KEY_PREFIX + NS[1].hex().encode() + b":" + keys[1][16:].hex().encode()
        # One by one, and all at once.
        for k, d in zip(keys, data, strict=True):
            out = np.zeros_like(d)
            assert store.get_into(k, out) == d.nbytes
            assert out.tobytes() == d.tobytes()
        outs = [np.zeros_like(d) for d in data]
        assert store.get_many_into(list(zip(keys, outs, strict=True))) == [d.nbytes for d in data]
        assert all(o.tobytes() == d.tobytes() for o, d in zip(outs, data, strict=True))
        st = store.stats()
        raw = sum(d.nbytes for d in data)
        assert (st["puts"], st["put_raw_bytes"], st["put_failed"]) == (3, raw, 0)
        assert (st["gets"], st["get_hits"], st["get_raw_bytes"], st["corrupt"]) == (6, 6, 2 * raw, 0)
        assert quiet(st)
        if codec == "raw":
            assert st["put_bytes"] > raw  # frames: the bytes plus their headers
        elif dtype == "bfloat16":
            assert st["put_bytes"] < raw * 0.9  # the exponent plane compresses
    finally:
        store.close()


def test_several_records_at_once_some_missing(store: RemoteStore) -> None:
    d = tensor("bfloat16", 1)
    assert store.put_many([(skey(1), d, "bfloat16"), (skey(3), d, "bfloat16")]) == 2
    outs = [np.zeros_like(d) for _ in range(3)]
    got = store.get_many_into([(skey(i), o) for i, o in zip((1, 2, 3), outs, strict=True)])
    assert got == [d.nbytes, None, d.nbytes]
    assert outs[0].tobytes() == outs[2].tobytes() == d.tobytes()
    st = store.stats()
    assert (st["get_hits"], st["get_gone"], st["corrupt"], st["deleted"]) == (2, 1, 0, 0)


def test_a_missing_key_is_none(store: RemoteStore) -> None:
    assert store.get_into(skey(404), bytearray(16)) is None
    assert store.get_many_into([]) == [] and store.contains_many([]) == []
    assert store.contains_many([skey(404)]) == [False]
    st = store.stats()
    assert (st["gets"], st["get_gone"], st["get_hits"], st["corrupt"]) == (1, 1, 0, 0) and quiet(st)


def test_a_value_is_served_only_under_its_own_key(store: RemoteStore, plain: redis.Redis) -> None:
    """Another key's value copied under a key (a misplaced write, a key collision, a tool gone
    wrong) is a miss: the frame's checksum is seeded with the key it was written for. The bad
    copy is deleted from the server and the hierarchy is told."""
    removed: list[list[bytes]] = []
    store.on_removed = removed.append
    d = tensor("bfloat16", 7)
    assert store.put_many([(skey(1), d, "bfloat16")]) == 1
    frame = plain.get(remote_key(skey(1)))
    # Under another chunk key, and under the same chunk's other shard.
    for wrong in (skey(2), skey(1, NS[1])):
        plain.set(remote_key(wrong), frame)
        out = np.zeros_like(d)
        assert store.get_into(wrong, out) is None
        eventually(lambda wrong=wrong: plain.exists(remote_key(wrong)) == 0, "the bad copy's deletion")
        assert removed[-1] == [wrong]
    out = np.zeros_like(d)
    assert store.get_into(skey(1), out) == d.nbytes and out.tobytes() == d.tobytes()  # untouched
    st = store.stats()
    assert (st["corrupt"], st["deleted"], st["get_hits"]) == (2, 2, 1) and quiet(st)


def _flip(frame: bytes, at: int) -> bytes:
    b = bytearray(frame)
    b[at] ^= 0x5A
    return bytes(b)


DAMAGE = {
    "flip a payload byte": lambda f: _flip(f, len(f) - 100),
    "flip a byte mid-frame": lambda f: _flip(f, len(f) // 2),
    "flip the dtype": lambda f: _flip(f, 6),
    "flip the raw length": lambda f: _flip(f, 9),
    "flip the checksum": lambda f: _flip(f, 17),
    "bad magic": lambda f: b"XXXX" + f[4:],
    "truncated": lambda f: f[: len(f) // 2],
    "header only": lambda f: f[:24],
    "one byte longer": lambda f: f + b"\0",
    "garbage": lambda f: np.random.default_rng(3).integers(0, 256, len(f), dtype=np.uint8).tobytes(),
    "empty": lambda f: b"",
    "text": lambda f: b"hello",
}


@pytest.mark.parametrize("codec", ["auto", "raw"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_value_is_a_miss_and_is_deleted(redis_server: RedisServer, plain: redis.Redis,
                                                  codec: str, damage: str) -> None:
    store = make_store(redis_server, codec=codec)
    try:
        removed: list[list[bytes]] = []
        store.on_removed = removed.append
        d = tensor("bfloat16", 11)
        good = tensor("bfloat16", 12)
        assert store.put_many([(skey(1), d, "bfloat16"), (skey(2), good, "bfloat16")]) == 2
        frame = plain.get(remote_key(skey(1)))
        plain.set(remote_key(skey(1)), DAMAGE[damage](frame))
        outs = [np.zeros_like(d), np.zeros_like(good)]
        # In one batch with an intact record: only the damaged one is a miss.
        assert store.get_many_into([(skey(1), outs[0]), (skey(2), outs[1])]) == [None, good.nbytes]
        assert outs[1].tobytes() == good.tobytes()
        eventually(lambda: plain.exists(remote_key(skey(1))) == 0, "the damaged value's deletion")
        assert removed == [[skey(1)]]
        assert store.contains_many([skey(1), skey(2)]) == [False, True]
        st = store.stats()
        assert (st["corrupt"], st["deleted"], st["get_hits"]) == (1, 1, 1) and quiet(st)
        assert store.available
    finally:
        store.close()


def test_a_value_of_another_type_is_a_miss_not_an_outage(store: RemoteStore, plain: redis.Redis) -> None:
    """A key holding a list (someone else's data under our prefix): the server refuses GET on it
    (WRONGTYPE). The read is a miss, counted as an error; the tier stays available."""
    plain.rpush(remote_key(skey(5)), b"x")
    assert store.contains_many([skey(5)]) == [True]
    assert store.get_into(skey(5), bytearray(64)) is None
    st = store.stats()
    assert st["errors"] == 1 and st["unavailable"] == 0 and store.available
    d = tensor("int8", 1)
    assert store.put_many([(skey(6), d, "int8")]) == 1  # the tier still works
    assert store.get_into(skey(6), np.zeros_like(d)) == d.nbytes


def test_a_buffer_too_small_for_the_value_is_a_miss(store: RemoteStore, plain: redis.Redis) -> None:
    """A value longer than the slot it is read into is not this layout's: a miss, and deleted
    (the store cannot tell it from a damaged length)."""
    d = tensor("uint8", 1, 4096)
    assert store.put_many([(skey(1), d, "uint8")]) == 1
    assert store.get_into(skey(1), bytearray(1024)) is None
    eventually(lambda: plain.exists(remote_key(skey(1))) == 0, "the deletion")
    assert store.stats()["corrupt"] == 1 and quiet(store.stats())


def test_presence_of_many_keys_is_one_round_trip(store: RemoteStore, plain: redis.Redis) -> None:
    """contains_many pipelines its EXISTS commands: the server reads them in one read event
    (INFO stats total_reads_processed counts the reads the server made on client sockets; one
    EXISTS per round trip would take one read each)."""
    n = 100
    keys = [skey(i, NS[i % 2]) for i in range(n)]
    d = tensor("uint8", 0, 256)
    assert store.put_many([(k, d, "uint8") for k in keys[::3]]) == len(keys[::3])
    assert store.contains_many(keys[:1]) == [True]  # connected: no handshake in what is counted

    def reads() -> int:
        return int(plain.info("stats")["total_reads_processed"])

    first = reads()
    baseline = reads() - first  # what asking costs by itself (the INFO command's own read)
    before = reads()
    found = store.contains_many(keys)
    used = reads() - before - baseline
    assert found == [i % 3 == 0 for i in range(n)]
    assert used <= 2, f"{used} server reads for one batch of {n} presence checks"
    # The same holds for the hierarchy's per-chunk check over every shard.
    chunks = [k[16:] for k in keys[:50]]
    before = reads()
    present = all_shards_present(store, NS, chunks)
    assert reads() - before - baseline <= 2
    assert present == [False] * 50  # each chunk has one shard stored at most here
    st = store.stats()
    assert st["lookup_keys"] == 1 + n + 100 and st["lookup_found"] == 1 + len(keys[::3]) + 17
    assert quiet(st)


def test_ttl_sets_an_expiry_and_expired_values_are_misses(redis_server: RedisServer, plain: redis.Redis) -> None:
    forever = make_store(redis_server)
    day = make_store(redis_server, ttl_s=86400)
    brief = make_store(redis_server, ttl_s=0.3)
    try:
        d = tensor("bfloat16", 2)
        for i, s in enumerate((forever, day, brief)):
            assert s.put_many([(skey(i), d, "bfloat16")]) == 1
        assert plain.pttl(remote_key(skey(0))) == -1  # no TTL: only eviction removes it
        assert 86_000_000 < plain.pttl(remote_key(skey(1))) <= 86_400_000
        # 0.3 s: left (0 < ms <= 300) or already expired (-2) on a slow machine; never none (-1)
        # nor longer.
        assert plain.pttl(remote_key(skey(2))) in (*range(1, 301), -2)
        eventually(lambda: brief.get_into(skey(2), np.zeros_like(d)) is None, "the expiry", 10)
        st = brief.stats()
        assert st["get_gone"] >= 1 and st["corrupt"] == 0 and quiet(st)
        assert forever.get_into(skey(0), np.zeros_like(d)) == d.nbytes
    finally:
        for s in (forever, day, brief):
            s.close()


def test_touches_reach_the_server(store: RemoteStore, plain: redis.Redis) -> None:
    d = tensor("uint8", 0, 256)
    assert store.put_many([(skey(i), d, "uint8") for i in range(4)]) == 4

    def touched() -> int:
        return int(plain.info("commandstats").get("cmdstat_touch", {}).get("calls", 0))

    store.touch_many([skey(i) for i in range(4)])  # returns at once: the TOUCH runs behind it
    eventually(lambda: touched() == 4, "the TOUCH commands")
    store.touch_many([])
    assert store.stats()["touches"] == 4 and quiet(store.stats())


def test_delete_many(store: RemoteStore, plain: redis.Redis) -> None:
    removed: list[list[bytes]] = []
    store.on_removed = removed.append
    d = tensor("uint8", 0, 256)
    assert store.put_many([(skey(i), d, "uint8") for i in range(3)]) == 3
    assert store.delete_many([skey(0), skey(1), skey(9)]) == 2
    assert store.contains_many([skey(i) for i in range(3)]) == [False, False, True]
    assert plain.exists(remote_key(skey(0)), remote_key(skey(2))) == 1
    assert removed == [[skey(0), skey(1), skey(9)]]


def test_server_eviction_makes_old_values_misses(redis_server: RedisServer, plain: redis.Redis) -> None:
    """More values than the server's 64 MiB maxmemory holds: allkeys-lru evicts; a value gone
    is a miss (counted as gone), never an error, and what is left reads back intact.

    Redis' LRU clock ticks once a second, so the early values are given an older clock
    reading (polled, not slept) before the rest are written."""
    store = make_store(redis_server, codec="raw", timeout_s=5.0)
    try:
        size = 1 << 20
        block = np.random.default_rng(5).integers(0, 256, size + 4096, dtype=np.uint8)
        n, early = 96, 16
        keys = [skey(i) for i in range(n)]

        def value(i: int) -> np.ndarray:
            return block[i * 37 : i * 37 + size]

        def write(lo: int, hi: int) -> None:
            for b in range(lo, hi, 4):
                batch = range(b, min(b + 4, hi))
                assert store.put_many([(keys[i], value(i), "uint8") for i in batch]) == len(batch)

        def clock() -> int:
            return int(plain.info("server")["lru_clock"])

        write(0, early)
        t0 = clock()
        eventually(lambda: clock() >= t0 + 2, "Redis' LRU clock to move on", 10)
        write(early, n)
        assert int(plain.info("stats")["evicted_keys"]) > 0
        present = store.contains_many(keys)
        got = []
        out = np.zeros(size, np.uint8)
        for i, k in enumerate(keys):
            out[:] = 0
            nbytes = store.get_into(k, out)
            got.append(nbytes is not None)
            if nbytes is not None:
                assert nbytes == size and np.array_equal(out, value(i))
        assert got == present  # nothing else removed them meanwhile
        gone = n - sum(got)
        assert gone >= n - 64, f"only {gone} of {n} MiB-values gone from a 64 MiB server"
        assert sum(got[:early]) <= 4, f"{sum(got[:early])} of the {early} oldest values survived"
        assert got[-1]  # the newest value is there
        st = store.stats()
        assert (st["get_gone"], st["get_hits"], st["puts"]) == (gone, n - gone, n)
        assert (st["corrupt"], st["deleted"], st["put_failed"]) == (0, 0, 0) and quiet(st)
    finally:
        store.close()


def test_a_server_refusing_writes_fails_them_and_stays_available(store: RemoteStore, plain: redis.Redis) -> None:
    """A full server under ``noeviction`` answers OOM to every SET: the writes fail (counted),
    reads go on, and the breaker stays closed (the server is up, it only refuses)."""
    d = tensor("uint8", 0, 4096)
    assert store.put_many([(skey(1), d, "uint8")]) == 1
    plain.config_set("maxmemory-policy", "noeviction")
    plain.config_set("maxmemory", 1)  # below what the server uses already
    try:
        assert store.put_many([(skey(2), d, "uint8"), (skey(3), d, "uint8")]) == 0
        assert store.get_into(skey(1), np.zeros_like(d)) == d.nbytes
        st = store.stats()
        assert st["put_failed"] == 2 and st["errors"] == 1 and st["unavailable"] == 0
        assert store.available
    finally:
        plain.config_set("maxmemory", 64 << 20)
        plain.config_set("maxmemory-policy", "allkeys-lru")
    assert store.put_many([(skey(2), d, "uint8")]) == 1


def test_a_write_outlasts_a_stall_that_fails_a_lookup(redis_server: RedisServer, plain: redis.Redis) -> None:
    """A server that stalls longer than a lookup may wait (its own fork for a snapshot, a large
    value on a slow link, a loaded host): a write, behind serving, has a deadline of its own and
    lands, with the breaker closed; a lookup in the same stall fails fast and opens it."""
    s = make_store(redis_server, connect_timeout_s=0.2, timeout_s=0.25, write_timeout_s=10.0)
    d = tensor("uint8", 0, 4096)
    try:
        assert s.put_many([(skey(1), d, "uint8")]) == 1  # the connections are open
        redis_server.pause()
        threading.Timer(1.0, redis_server.resume).start()  # 4x a lookup's deadline
        assert s.put_many([(skey(2), d, "uint8")]) == 1
        assert s.available and quiet(s.stats())
        assert plain.exists(remote_key(skey(2)))
        redis_server.pause()
        try:
            assert s.contains_many([skey(1), skey(2)]) == [False, False]
            assert not s.available and s.stats()["unavailable"] == 1
        finally:
            redis_server.resume()
        eventually(lambda: s.available, "the probe to find the server")
        assert s.contains_many([skey(1), skey(2)]) == [True, True]
    finally:
        redis_server.resume()
        s.close()


def test_the_store_says_once_when_it_answers_again(redis_server: RedisServer) -> None:
    """A store whose breaker opened calls ``on_available`` once, when its probe finds the server
    again (the hierarchy then starts the writes that failed meanwhile); not while the server
    stays unavailable, nor while it stays available."""
    s = make_store(redis_server, connect_timeout_s=0.2, timeout_s=0.25, probe_interval_s=0.1)
    told: list[bool] = []
    s.on_available = lambda: told.append(s.available)
    try:
        assert s.contains_many([skey(1)]) == [False] and told == []
        redis_server.pause()
        try:
            assert s.contains_many([skey(1)]) == [False]
            assert not s.available
            time.sleep(0.5)  # several probes fail meanwhile
            assert told == []
        finally:
            redis_server.resume()
        eventually(lambda: told, "the store to say it answers again")
        assert told == [True]  # the breaker closed before the call
        assert s.contains_many([skey(1)]) == [False]
        time.sleep(0.3)  # a second call would come from a probe still running
        assert told == [True]
    finally:
        redis_server.resume()
        s.close()


def test_put_many_then_reports_from_the_loop_once_the_server_took_the_values(redis_server: RedisServer,
                                                                            plain: redis.Redis) -> None:
    """The write-behind's put: it returns once the values are encoded and handed to the tier's
    loop, and the outcome is reported from there when the server answers. An idle-priority
    write thread thus neither waits out the round trip nor holds up the report (a busy CPU may
    not run it again for a second: docs/BENCHMARKS.md, "A write is reported when it commits")."""
    s = make_store(redis_server, write_timeout_s=10.0)
    d = tensor("uint8", 0, 4096)
    reports: list[tuple[int, str]] = []

    def report(n: int) -> None:
        reports.append((n, threading.current_thread().name))

    try:
        assert s.put_many([(skey(1), d, "uint8")]) == 1  # the connections are open
        redis_server.pause()
        resume = threading.Timer(2.0, redis_server.resume)
        resume.start()
        s.put_many_then([(skey(2), d, "uint8"), (skey(3), d, "uint8")], report)
        assert reports == []  # returned with the server still stalled
        resume.join()
        eventually(lambda: reports, "the report")
        assert reports == [(2, "kvstrata-remote")]
        assert plain.exists(remote_key(skey(2)), remote_key(skey(3))) == 2
        st = s.stats()
        assert (st["puts"], st["put_failed"], st["put_raw_bytes"]) == (3, 0, 3 * d.nbytes) and quiet(st)
        s.put_many_then([], report)  # nothing to send: reported at once, in the caller
        assert reports[1:] == [(0, threading.current_thread().name)]
    finally:
        redis_server.resume()
        s.close()
    s.put_many_then([(skey(4), d, "uint8")], report)  # closed: not stored, reported at once
    assert reports[2:] == [(0, threading.current_thread().name)]
    assert not plain.exists(remote_key(skey(4)))


def test_a_write_in_flight_when_the_store_closes_is_reported_not_stored(redis_server: RedisServer) -> None:
    """close() while a write waits for a stalled server: its caller hears "not stored" once,
    and nothing is left pending on the stopped loop."""
    s = make_store(redis_server, write_timeout_s=30.0)
    d = tensor("uint8", 0, 4096)
    reports: list[int] = []
    try:
        assert s.put_many([(skey(1), d, "uint8")]) == 1
        redis_server.pause()
        s.put_many_then([(skey(2), d, "uint8")], reports.append)
        assert reports == []
        s.close()
        assert reports == [0]
        assert s.stats()["put_failed"] == 1
    finally:
        redis_server.resume()
        s.close()
    assert reports == [0]  # the loop's thread is gone: no second report


def test_password_and_database_from_the_url(tmp_path) -> None:
    """A server with a password (``requirepass``) and an ACL user, reached through the URL's
    credentials; ``/db`` selects the database the values land in."""
    class AuthServer(RedisServer):
        def client(self) -> redis.Redis:  # the fixture's own checks log in too
            return redis.Redis(host="127.0.0.1", port=self.port, password="s3cret", socket_timeout=5)

    server = AuthServer(tmp_path / "auth", "--requirepass", "s3cret",
                        "--user", "alice", "on", ">wonder", "~kvstrata:*", "+@all")
    try:
        d = tensor("bfloat16", 3)
        port = server.port
        for url, db in ((f"redis://:s3cret@127.0.0.1:{port}/3", 3),
                        (f"redis://alice:wonder@127.0.0.1:{port}/5", 5)):
            s = RemoteStore(url, **PATIENT_TIMEOUTS)
            try:
                assert s.put_many([(skey(db), d, "bfloat16")]) == 1
                assert s.get_into(skey(db), np.zeros_like(d)) == d.nbytes
                assert "s3cret" not in s.url and "wonder" not in s.url
            finally:
                s.close()
            c = redis.Redis(host="127.0.0.1", port=port, db=db, password="s3cret", socket_timeout=5)
            assert c.exists(remote_key(skey(db))) == 1 and c.dbsize() == 1
        # A wrong password: the tier is unavailable (misses), and says why.
        s = RemoteStore(f"redis://:wrong@127.0.0.1:{port}", probe_interval_s=0.2, **PATIENT_TIMEOUTS)
        try:
            assert s.contains_many([skey(3)]) == [False]
            assert not s.available and s.stats()["unavailable"] == 1
            assert "wrong" not in s.url
        finally:
            s.close()
    finally:
        server.stop()


def test_a_delete_the_server_never_got_is_not_reported(redis_server: RedisServer) -> None:
    """delete_many on a dead server deletes nothing: it must not count deletions nor tell the
    hierarchy the records are gone (that would be a false "removed" KV event)."""
    s = make_store(redis_server)
    try:
        removed: list[list[bytes]] = []
        s.on_removed = removed.append
        d = tensor("uint8", 0, 256)
        assert s.put_many([(skey(1), d, "uint8")]) == 1
        redis_server.kill()
        assert s.delete_many([skey(1)]) == 0  # the call that finds the server gone
        assert s.delete_many([skey(1)]) == 0  # skipped: the breaker is open
        assert removed == [] and s.stats()["deleted"] == 0
        st = s.stats()
        assert st["unavailable"] == 1 and st["skipped_unavailable"] == 1
    finally:
        s.close()


def test_close_ends_what_runs_behind_the_callers(redis_server: RedisServer, plain: redis.Redis,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Touches and deletions of damaged values run behind the callers, and the probe behind an
    open breaker: close() right after them ends them, instead of leaving tasks that the garbage
    collector destroys mid-command later ("Task was destroyed but it is pending", and redis-py
    raising "no running event loop" from a finalizer)."""
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    d = tensor("uint8", 0, 256)
    for i in range(5):
        s = make_store(redis_server)
        assert s.put_many([(skey(i), d, "uint8")]) == 1
        plain.set(remote_key(skey(100 + i)), b"damaged")
        assert s.get_into(skey(100 + i), np.zeros_like(d)) is None  # its DEL is sent behind
        s.touch_many([skey(i)] * 50)
        s.close()
    redis_server.pause()
    try:
        s = make_store(redis_server, connect_timeout_s=0.2, timeout_s=0.25)
        assert s.contains_many([skey(0)]) == [False]  # opens the breaker: the probe runs
        assert not s.available
        s.close()
    finally:
        redis_server.resume()
    del s
    gc.collect()
    assert unraisable == []
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


def test_a_closed_store_answers_misses(redis_server: RedisServer) -> None:
    s = make_store(redis_server)
    d = tensor("uint8", 0, 256)
    assert s.put_many([(skey(1), d, "uint8")]) == 1
    s.close()
    s.close()  # twice is fine
    assert s.contains_many([skey(1)]) == [False]
    assert s.get_into(skey(1), np.zeros_like(d)) is None
    assert s.put_many([(skey(2), d, "uint8")]) == 0
    assert s.delete_many([skey(1)]) == 0
    s.touch_many([skey(1)])
    assert s.server_info() is None
