"""Authenticated shared-tier values against a real Redis server: with an auth key every value
carries a MAC over its store key and frame, checked before a byte is served; a value without one,
with another secret's, or moved to another key is a counted miss (``forged``) and is deleted;
a replica without a key leaves authenticated values alone (docs/SECURITY.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
from redis_server import PATIENT_TIMEOUTS, RedisServer

from kvstrata.auth import ValueAuth
from kvstrata.tiers import codec
from kvstrata.tiers.remote import RemoteStore, remote_key

NS = b"rank0-namespace!"
ELEMS = 16 << 10
SECRET_A = b"replica-group-a-secret-0123456789"
SECRET_B = b"replica-group-b-secret-9876543210"


def skey(i: int) -> bytes:
    return NS + i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def kv(i: int) -> np.ndarray:
    return (np.random.default_rng(i).standard_normal(ELEMS) * 0.05).astype(np.float32)


def eventually(cond: Callable[[], object], what: str, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def stores(redis_server: RedisServer) -> Iterator[Callable[..., RemoteStore]]:
    made: list[RemoteStore] = []

    def make(secret: bytes | None) -> RemoteStore:
        store = RemoteStore(redis_server.url, **PATIENT_TIMEOUTS,
                            probe_interval_s=0.2, auth=None if secret is None else ValueAuth(secret))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def read(store: RemoteStore, i: int) -> np.ndarray | None:
    out = np.zeros(ELEMS, np.float32)
    n = store.get_into(skey(i), out)
    return None if n is None else out


def test_a_value_is_served_only_to_replicas_holding_its_secret(stores, redis_server: RedisServer) -> None:
    writer, same, other = stores(SECRET_A), stores(SECRET_A), stores(SECRET_B)
    assert writer.put_many([(skey(1), kv(1), "float32"), (skey(2), kv(2), "float32")]) == 2
    plain = redis_server.client()
    assert plain.get(remote_key(skey(1))).startswith(ValueAuth.MAGIC)
    got = read(same, 1)
    assert got is not None and np.array_equal(got, kv(1))
    assert read(other, 1) is None
    assert other.stats()["forged"] == 1 and other.stats()["get_hits"] == 0
    eventually(lambda: not plain.exists(remote_key(skey(1))), "the forged value's deletion")
    got = read(same, 2)  # the other key is untouched
    assert got is not None and np.array_equal(got, kv(2))


def test_values_without_a_mac_are_not_served_when_a_key_is_configured(stores, redis_server: RedisServer) -> None:
    """A store written before keys existed, or a writer without the secret making valid frames
    (the namespace is public facts: another checkpoint made to look like the same model)."""
    old, keyed = stores(None), stores(SECRET_A)
    assert old.put_many([(skey(3), kv(3), "float32")]) == 1
    plain = redis_server.client()
    forged = codec.encode(kv(99), "float32", key=skey(4))  # a well-formed frame, other content
    plain.set(remote_key(skey(4)), forged)
    plain.set(remote_key(skey(5)), ValueAuth.MAGIC + bytes(32) + forged)  # a guessed tag
    assert read(keyed, 3) is None and read(keyed, 4) is None and read(keyed, 5) is None
    assert keyed.stats()["forged"] == 3 and keyed.stats()["get_hits"] == 0
    eventually(lambda: plain.exists(*[remote_key(skey(i)) for i in (3, 4, 5)]) == 0, "deletions")


def test_a_mac_is_bound_to_its_key(stores, redis_server: RedisServer) -> None:
    keyed = stores(SECRET_A)
    assert keyed.put_many([(skey(6), kv(6), "float32")]) == 1
    plain = redis_server.client()
    plain.set(remote_key(skey(7)), plain.get(remote_key(skey(6))))  # an authentic value, moved
    assert read(keyed, 7) is None and keyed.stats()["forged"] == 1
    got = read(keyed, 6)
    assert got is not None and np.array_equal(got, kv(6))


def test_a_flipped_byte_anywhere_in_a_sealed_value_is_refused(stores, redis_server: RedisServer) -> None:
    keyed = stores(SECRET_A)
    assert keyed.put_many([(skey(8), kv(8), "float32")]) == 1
    plain = redis_server.client()
    value = bytearray(plain.get(remote_key(skey(8))))
    for pos in (4, ValueAuth.HEADER + 3, len(value) - 1):  # tag, frame header, payload
        flipped = bytearray(value)
        flipped[pos] ^= 0x01
        plain.set(remote_key(skey(8)), bytes(flipped))
        assert read(keyed, 8) is None, pos
        eventually(lambda: not plain.exists(remote_key(skey(8))), "the deletion")
    assert keyed.stats()["forged"] == 3 and keyed.stats()["corrupt"] == 0


def test_a_replica_without_a_key_skips_authenticated_values_and_leaves_them(stores, redis_server: RedisServer) -> None:
    keyed, unkeyed = stores(SECRET_A), stores(None)
    assert keyed.put_many([(skey(9), kv(9), "float32")]) == 1
    assert read(unkeyed, 9) is None
    assert unkeyed.stats()["sealed_skipped"] == 1 and unkeyed.stats()["deleted"] == 0
    plain: redis.Redis = redis_server.client()
    assert plain.exists(remote_key(skey(9)))
    got = read(keyed, 9)
    assert got is not None and np.array_equal(got, kv(9))
