"""A disk store with an auth key (``auth_key_file``: a store on shared storage others can write):
every record carries a MAC over its key and payload, and a record without one, or with another
key's, is a counted miss (``forged``) and is dropped; the tools keep the MACs (docs/SECURITY.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstrata.auth import ValueAuth
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tools.cli import main

A = ValueAuth(b"disk-secret-a-0123456789abcdef")
B = ValueAuth(b"disk-secret-b-0123456789abcdef")
N = 8192


def key(i: int) -> bytes:
    return b"S" * 16 + i.to_bytes(32, "big") + bytes(4)


def kv(i: int) -> np.ndarray:
    return (np.random.default_rng(i).standard_normal(N) * 0.05).astype(np.float32)


def read(store: DiskStore, i: int) -> np.ndarray | None:
    out = np.zeros(N, np.float32)
    return out if store.get_into(key(i), out) is not None else None


def eventually(cond: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def open_store(path: Path, auth: ValueAuth | None) -> DiskStore:
    return DiskStore(path, budget_bytes=1 << 30, auth=auth)


def test_records_are_served_only_under_the_key_that_wrote_them(tmp_path: Path) -> None:
    with open_store(tmp_path, A) as store:
        assert store.put_many([(key(i), kv(i), "float32") for i in range(3)]) == 3
    with open_store(tmp_path, A) as store:
        got = read(store, 0)
        assert got is not None and np.array_equal(got, kv(0))
    with open_store(tmp_path, None) as store:  # no key configured: the MAC is not checked
        assert read(store, 1) is not None
    with open_store(tmp_path, B) as store:
        assert read(store, 2) is None
        assert store.stats()["forged"] == 1 and store.stats()["corrupt"] == 0
        eventually(lambda: store.contains_many([key(2)]) == [False], "the forged record's drop")
        assert store.contains_many([key(0), key(1)]) == [True, True]  # only what was read goes


def test_records_without_a_mac_are_not_served_when_a_key_is_configured(tmp_path: Path) -> None:
    """A store written before keys existed, or a writer without the key that made a record of
    other content look right (a valid frame and index record under the key)."""
    with open_store(tmp_path, None) as store:
        assert store.put_many([(key(5), kv(99), "float32")]) == 1
    with open_store(tmp_path, A) as store:
        assert read(store, 5) is None and store.stats()["forged"] == 1
        eventually(lambda: store.contains_many([key(5)]) == [False], "the drop")
        # The writer with the key stores it again, and now it is served.
        assert store.put_many([(key(5), kv(5), "float32")]) == 1
        got = read(store, 5)
        assert got is not None and np.array_equal(got, kv(5))


def test_a_mac_is_bound_to_its_record_key(tmp_path: Path) -> None:
    with open_store(tmp_path, A) as store:
        assert store.put_many([(key(1), kv(1), "float32")]) == 1

        def move(txn, h) -> None:  # an authentic record copied under another key
            txn.put(key(2), bytes(txn.get(key(1), db=h.payload)), db=h.payload)
            txn.put(key(2), bytes(txn.get(key(1), db=h.index)), db=h.index)

        store.write(move)
        assert read(store, 2) is None and store.stats()["forged"] == 1
        assert read(store, 1) is not None


def test_verify_and_a_rebuild_keep_the_macs(tmp_path: Path, capsys) -> None:
    with open_store(tmp_path, A) as store:
        assert store.put_many([(key(i), kv(i), "float32") for i in range(4)]) == 4
    assert main(["verify", str(tmp_path)]) == 0
    assert main(["verify", str(tmp_path), "--repair", "--rebuild"]) == 0
    assert main(["compact", str(tmp_path), "--budget", "1GiB"]) == 0
    capsys.readouterr()
    with open_store(tmp_path, A) as store:
        for i in range(4):
            got = read(store, i)
            assert got is not None and np.array_equal(got, kv(i))
        assert store.stats()["forged"] == 0
        macs = store.read(lambda txn, h: [rec.decode_index(txn.get(key(i), db=h.index)).mac for i in range(4)])
        assert all(len(m) == 32 for m in macs)
