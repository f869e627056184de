"""The shared tier failing under load: the Redis server killed, hung (SIGSTOP), restarted empty,
or flushed, while an engine keeps looking up and storing chunks.

What must hold throughout: every lookup returns, whatever the server does, having asked it at
most once (that one call is cut off after connect + reply timeouts, 0.75 s here), and once the
breaker is open not at all (``CountingRemote`` records, per thread, which of a lookup's calls
reached the server); chunks in the host tier answer HIT
and chunks on the local disk are promoted from it; chunks only on the server answer MISS; nothing
raises; the remote tier counts what it skipped. After the server comes back, a probe closes the
breaker and new stores reach the server again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
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
NS = [b"rank0-namespace!", b"rank1-namespace!"]
SHARD = 4096
PROBE_S = 0.2
# The engine's remote tier: connect + reply timeouts a little above the connector's defaults
# (0.2 + 0.25 s), so that a loaded test machine does not time out calls to a healthy server.
REMOTE_OPTS = dict(connect_timeout_s=0.25, timeout_s=0.5, probe_interval_s=PROBE_S)
# Engines that only prepare the server's contents: nothing to learn from their timeouts.
WRITER_OPTS = dict(PATIENT_TIMEOUTS, probe_interval_s=PROBE_S)
# Write-behind threads at normal priority: at idle priority (the default) they get next to no
# CPU while anything else keeps the machine's cores busy, and the waits for their writes here
# (and close(), which drains them) would measure the other load.
IDLE_WRITES = False
DEADLINE_S = 20.0


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def keys(lo: int, n: int) -> list[bytes]:
    return [key(i) for i in range(lo, lo + n)]


def pattern(k: bytes, shard: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(k[:32], "big") * 3 + shard).integers(0, 256, SHARD, dtype=np.uint8)


def eventually(cond: Callable[[], object], what: str, deadline_s: float = DEADLINE_S) -> float:
    """Poll ``cond`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < deadline_s, f"timed out waiting for {what}"
        time.sleep(0.005)
    return time.monotonic() - t0


def put(h: Hierarchy, ks: Sequence[bytes]) -> None:
    slots = h.prepare_store(list(ks))
    assert slots is not None
    for k, s in slots.items():
        for r in range(len(NS)):
            h.slab.array[s, r * SHARD : (r + 1) * SHARD] = pattern(k, r)
    h.complete_store(list(slots))


def check_bytes(h: Hierarchy, ks: list[bytes]) -> None:
    slots = h.prepare_load(ks)
    try:
        for k, s in zip(ks, slots, strict=True):
            for r in range(len(NS)):
                assert np.array_equal(h.slab.array[s, r * SHARD : (r + 1) * SHARD], pattern(k, r))
    finally:
        h.complete_load(ks)


def on_server(plain: redis.Redis, k: bytes) -> bool:
    return plain.exists(*[remote_key(ns + k) for ns in NS]) == len(NS)


class CountingRemote(RemoteStore):
    """The real store, recording for each of the calling thread's presence queries whether the
    breaker let it reach the server (``asked``) or answered it at once."""

    _local = threading.local()

    @classmethod
    def asked(cls) -> list[bool]:
        if not hasattr(cls._local, "asked"):
            cls._local.asked = []
        return cls._local.asked

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        reached = self.available  # open breaker: answered without a round trip
        try:
            return super().contains_many(keys)
        finally:
            self.asked().append(reached)


def lookup(h: Hierarchy, ks: list[bytes], promoting: dict | None = None, *,
           breaker_open: bool = False) -> list[Presence]:
    """A scheduler's lookup: it returns having asked the server at most once (one call, cut off
    by its timeouts), and not at all with the breaker open."""
    asked = CountingRemote.asked()
    asked.clear()
    got = h.lookup_many(ks, promoting)
    reached = sum(asked)
    assert reached <= (0 if breaker_open else 1), f"a lookup asked the server {reached} times"
    return got


class Load(threading.Thread):
    """An engine's steady traffic: every few milliseconds a lookup of its host chunks (always HIT)
    and of a chunk nobody has (MISS: asks the server each time), and, up to ``max_new`` times, a
    store of a new chunk (write-behind to disk and server). Records the slowest lookup and
    anything that went wrong instead of raising."""

    def __init__(self, h: Hierarchy, host_keys: list[bytes], first_new: int, max_new: int = 40) -> None:
        super().__init__(daemon=True)
        self.h, self.host_keys = h, host_keys
        self.next_new, self.last_new = first_new, first_new + max_new
        self.stored: list[bytes] = []
        self.most_asked = 0  # the most server calls one lookup made
        self.lookups = 0
        self.problems: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        nowhere = 10**6
        while not self.halt.is_set():
            try:
                nowhere += 1
                asked = CountingRemote.asked()
                asked.clear()
                got = self.h.lookup_many([*self.host_keys, key(nowhere)])
                self.most_asked = max(self.most_asked, sum(asked))
                self.lookups += 1
                if got != [HIT] * len(self.host_keys) + [MISS]:
                    self.problems.append(f"host chunks and a missing one answered {got}")
                if self.next_new < self.last_new:
                    k = key(self.next_new)
                    self.next_new += 1
                    put(self.h, [k])
                    self.stored.append(k)
            except Exception as exc:  # the point: nothing may raise
                self.problems.append(f"{type(exc).__name__}: {exc}")
            self.halt.wait(0.01)  # paces the traffic (a step loop), not a wait for a condition

    def finish(self) -> None:
        self.halt.set()
        self.join(DEADLINE_S)
        assert not self.is_alive(), "the load thread hung"
        assert self.problems == []
        assert self.lookups > 0 and self.most_asked <= 1, f"a lookup asked the server {self.most_asked} times"


class Setup:
    """A server holding chunks of three kinds for the engine under test:

    * ``host``: stored by the engine itself (host tier, its disk, the server);
    * ``disk``: on the engine's disk and the server, not in its host tier (an earlier run);
    * ``remote``/``remote2``: only on the server (another engine stored them).
    """

    def __init__(self, tmp_path: Path, server: RedisServer, **remote_opts: float) -> None:
        self.server = server
        self.remote_opts = {**REMOTE_OPTS, **remote_opts}
        self.plain = server.client()
        self.made: list = []
        self.disk_store = DiskStore(tmp_path / "disk", budget_bytes=1 << 30)
        self.made.append(self.disk_store)
        self.host, self.disk = keys(0, 4), keys(100, 4)
        self.remote, self.remote2 = keys(200, 4), keys(300, 4)
        # Another engine (remote only) and an earlier run of this one leave their chunks.
        other = self.hierarchy(tmp_path / "slab-other", disk=False, opts=WRITER_OPTS)
        put(other, self.remote + self.remote2)
        earlier = self.hierarchy(tmp_path / "slab-earlier", disk=True, opts=WRITER_OPTS)
        put(earlier, self.disk)
        eventually(lambda: all(on_server(self.plain, k) for k in self.remote + self.remote2 + self.disk),
                   "the other engines' writes")
        other.close()
        earlier.close()  # drains its disk writes
        assert all_shards_present(self.disk_store, NS, self.disk) == [True] * 4
        self.h = self.hierarchy(tmp_path / "slab", disk=True)
        self.remote_tier = self.h.tiers[-1]
        put(self.h, self.host)
        eventually(lambda: all(on_server(self.plain, k) for k in self.host), "the engine's own writes")
        assert lookup(self.h, self.host) == [HIT] * 4

    def hierarchy(self, slab_path: Path, *, disk: bool, opts: dict | None = None) -> Hierarchy:
        slab = HostSlab(slab_path, SHARD * len(NS), 64)
        remote = CountingRemote(self.server.url, **(opts or self.remote_opts))
        lower = [self.disk_store, remote] if disk else [remote]
        h = Hierarchy(HostPool(slab), lower, namespaces=NS, group_shard_bytes=[SHARD],
                      group_dtypes=["bfloat16"], write_backpressure=["defer", "drop"][-len(lower):],
                      idle_writes=IDLE_WRITES)
        self.made += [slab, remote, h]
        return h

    def remote_stats(self) -> dict:
        return self.h.stats()["tiers"]["remote"]

    def serve_from_disk(self) -> None:
        """The disk chunks: promoted from the local disk, whatever the server does."""
        promoting: dict[bytes, str] = {}
        assert lookup(self.h, self.disk, promoting) == [PENDING] * 4
        assert promoting == dict.fromkeys(self.disk, "disk")
        eventually(lambda: lookup(self.h, self.disk) == [HIT] * 4, "promotions from disk")
        check_bytes(self.h, self.disk)

    def remote_only_misses(self, ks: list[bytes], *, breaker_open: bool = False) -> None:
        """Chunks only on an unreachable (or emptied) server: MISS, every time."""
        for _ in range(3):
            promoting: dict[bytes, str] = {}
            assert lookup(self.h, ks, promoting, breaker_open=breaker_open) == [MISS] * len(ks)
            assert promoting == {}

    def serve_from_remote(self, ks: list[bytes]) -> None:
        promoting: dict[bytes, str] = {}
        assert lookup(self.h, ks, promoting) == [PENDING] * len(ks)
        assert promoting == dict.fromkeys(ks, "remote")
        eventually(lambda: lookup(self.h, ks) == [HIT] * len(ks), "promotions from the server")
        check_bytes(self.h, ks)

    def recovers(self) -> None:
        """The server is back: a probe finds it and closes the breaker, and the tier's gauge says
        so (waited for, not timed: on a loaded machine a call can time out again meanwhile)."""
        eventually(lambda: self.remote_tier.available and self.remote_stats()["available"] == 1,
                   "the breaker to close")

    def new_stores_reach_the_server(self, first: int) -> None:
        """Three new chunks reach the server. On a loaded 2-core machine a call to the healthy
        server can still time out (0.5 s here) and open the breaker until the next probe; a write
        skipped or failed meanwhile is written again when the probe closes the breaker."""
        ks = keys(first, 3)
        put(self.h, ks)
        eventually(lambda: all(on_server(self.plain, k) for k in ks), "new chunks on the server")

    def close(self) -> None:
        for obj in reversed(self.made):
            obj.close()


@pytest.fixture
def setup(tmp_path: Path, redis_server: RedisServer):
    s = Setup(tmp_path, redis_server)
    yield s
    s.close()


def test_server_killed_mid_load(setup: Setup) -> None:
    load = Load(setup.h, setup.host, first_new=1000)
    load.start()
    eventually(lambda: len(load.stored) >= 3, "some load before the failure")
    setup.server.kill()
    try:
        setup.remote_only_misses(setup.remote)
        assert not setup.remote_tier.available
        setup.serve_from_disk()
        stored_before = len(load.stored)
        eventually(lambda: len(load.stored) >= stored_before + 5, "stores while the server is down")
        # Their disk copies are written as usual; the server's are skipped (and counted).
        eventually(lambda: setup.h.stats()["tiers"]["disk"]["writes_completed"] >= len(setup.host) + stored_before + 5,
                   "disk write-behind during the outage")
        st = setup.remote_stats()
        assert st["unavailable"] >= 1 and st["skipped_unavailable"] >= 1 and st["put_failed"] >= 1
        # Why: refused or reset (or a timeout, when a loaded machine was slow just before).
        assert st["available"] == 0 and st["last_error"]
    finally:
        setup.server.start()  # the same port, empty
    setup.recovers()
    load.finish()
    setup.remote_only_misses(setup.remote2)  # the server lost everything
    setup.new_stores_reach_the_server(2000)


def test_server_hung_mid_load(setup: Setup) -> None:
    """SIGSTOP: connections stay open and nothing answers. One call per outage waits for the
    timeouts; the breaker then answers at once until a probe finds the server again."""
    load = Load(setup.h, setup.host, first_new=1000)
    load.start()
    eventually(lambda: len(load.stored) >= 3, "some load before the failure")
    setup.server.pause()
    try:
        setup.remote_only_misses(setup.remote)
        setup.serve_from_disk()
        eventually(lambda: not setup.remote_tier.available, "the breaker to open")
        skipped = setup.remote_stats()["skipped_unavailable"]
        # The breaker is open: these lookups do not ask the hung server at all (no waiting).
        setup.remote_only_misses(setup.remote2, breaker_open=True)
        st = setup.remote_stats()
        assert st["skipped_unavailable"] >= skipped + 3
        assert st["unavailable"] >= 1 and st["skipped_unavailable"] >= 1
        assert "imeout" in (st["last_error"] or "")
        changes = st["state_changes"]
    finally:
        setup.server.resume()
    setup.recovers()
    load.finish()
    assert setup.remote_stats()["state_changes"] >= changes + 1
    # Nothing was lost: the server's chunks are served again, those asked for during the hang too.
    setup.serve_from_remote(setup.remote2)
    setup.serve_from_remote(setup.remote)
    setup.new_stores_reach_the_server(2000)


def test_server_restarted_mid_load(setup: Setup) -> None:
    """Killed and started again at once (a crash under a supervisor): every pooled connection
    is dead and the server is empty."""
    load = Load(setup.h, setup.host, first_new=1000)
    load.start()
    eventually(lambda: len(load.stored) >= 3, "some load before the failure")
    setup.server.restart()
    setup.remote_only_misses(setup.remote)  # a dead connection or an empty server: MISS either way
    setup.serve_from_disk()
    load.finish()
    setup.recovers()
    st = setup.remote_stats()
    assert st["state_changes"] % 2 == 0 and st["available"] == 1  # each opening was closed again
    assert st["corrupt"] == 0
    setup.remote_only_misses(setup.remote2)
    setup.new_stores_reach_the_server(2000)


def test_server_flushed_mid_load(tmp_path: Path, redis_server: RedisServer) -> None:
    """FLUSHALL: the server answers, with nothing in it. Misses, not an outage. (Generous
    timeouts: a slow answer on a loaded machine would be an outage of another kind.)"""
    setup = Setup(tmp_path, redis_server, **PATIENT_TIMEOUTS)
    try:
        _flushed(setup)
    finally:
        setup.close()


def _flushed(setup: Setup) -> None:
    load = Load(setup.h, setup.host, first_new=1000)
    load.start()
    eventually(lambda: len(load.stored) >= 3, "some load before the failure")
    setup.plain.flushall()
    setup.remote_only_misses(setup.remote + setup.remote2)
    setup.serve_from_disk()
    load.finish()
    st = setup.remote_stats()
    assert (st["available"], st["unavailable"], st["skipped_unavailable"], st["errors"]) == (1, 0, 0, 0)
    assert st["state_changes"] == 0
    setup.new_stores_reach_the_server(2000)


class GatedRemote(RemoteStore):
    """The real store, whose reads wait until the test opens the gate."""

    gate: threading.Event

    def get_many_into(self, items):
        assert self.gate.wait(DEADLINE_S)
        return super().get_many_into(items)


def test_a_promotion_caught_by_a_hang_fails_within_the_bound(tmp_path: Path, redis_server: RedisServer) -> None:
    """A promotion whose read reaches the server after it hung: the read gives up after the
    timeouts, the chunk answers MISS (not PENDING forever) and its slot is free again."""
    plain = redis_server.client()
    slab = HostSlab(tmp_path / "slab-w", SHARD * len(NS), 8)
    writer_remote = RemoteStore(redis_server.url, **WRITER_OPTS)
    writer = Hierarchy(HostPool(slab), [writer_remote], namespaces=NS, group_shard_bytes=[SHARD],
                       group_dtypes=["bfloat16"], idle_writes=IDLE_WRITES)
    GatedRemote.gate = threading.Event()
    slab2 = HostSlab(tmp_path / "slab", SHARD * len(NS), 8)
    remote = GatedRemote(redis_server.url, **REMOTE_OPTS)
    h = Hierarchy(HostPool(slab2), [remote], namespaces=NS, group_shard_bytes=[SHARD],
                  group_dtypes=["bfloat16"], idle_writes=IDLE_WRITES)
    try:
        ks = keys(0, 2)
        put(writer, ks)
        eventually(lambda: all(on_server(plain, k) for k in ks), "write-behind")
        assert lookup(h, ks) == [PENDING, PENDING]
        redis_server.pause()
        try:
            GatedRemote.gate.set()
            # The server stays hung until after these checks: the promotion can end only by
            # its read giving up (the timeouts), not by an answer.
            assert h.wait_promotions(ks, DEADLINE_S)
            assert remote.stats()["unavailable"] >= 1 and "imeout" in (remote.stats()["last_error"] or "")
            assert lookup(h, ks) == [MISS, MISS]
            assert h.pool.free_slots == 8
            assert h.stats()["promotions_failed"] == 2
        finally:
            redis_server.resume()
        eventually(lambda: remote.available, "the breaker to close")
    finally:
        for obj in (h, writer, remote, writer_remote, slab2, slab):
            obj.close()
