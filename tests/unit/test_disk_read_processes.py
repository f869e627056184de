"""Disk reads in processes of their own (``read_processes``, ``tiers/disk/readers.py``): a real
LMDB store read by child processes straight into a real host slab. The bytes are the stored
ones; misses, damaged and forged records are counted and dropped by the parent as its own reads
are; a child that dies leaves its reads to the calling thread; closing leaves no process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from hierarchy_helpers import (
    DEADLINE_S,
    NS,
    corrupt_payload,
    disk_children,
    eventually,
    holds,
    key,
    on_disk,
    store,
)

from kvstrata.auth import ValueAuth
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.disk.children import ProcessesUnavailable
from kvstrata.tiers.disk.readers import DiskReaders
from kvstrata.tiers.host import HostSlab

SLOT = 1 << 16
A = ValueAuth(b"disk-secret-a-0123456789abcdef")
B = ValueAuth(b"disk-secret-b-0123456789abcdef")


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def put(store_: DiskStore, n: int) -> None:
    assert store_.put_many([(k(i), value(i), "uint8") for i in range(n)]) == n


def read_all(store_: DiskStore, slab_: HostSlab, items: list[tuple[bytes, int, int, int]]) -> list[tuple[int, int | None]]:
    got: list[tuple[int, int | None]] = []
    store_.get_many_into_slab(slab_, items, lambda i, n: got.append((i, n)))
    return got


@pytest.fixture
def slab(tmp_path: Path):
    s = HostSlab(tmp_path / "slab", SLOT, 8)
    yield s
    s.close()


def test_processes_read_the_stored_bytes_into_the_slab_and_count_as_reads(tmp_path: Path, slab) -> None:
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        put(s, 4)
        s.use_read_processes(slab, 2)
        readers = s.read_processes
        assert readers is not None and readers.available and len(disk_children("read_process")) == 2
        # Every chunk into another slot, one at an offset inside its slot, and one never stored.
        items = [(k(i), 3 - i, 0, SLOT) for i in range(4)] + [(k(9), 4, 0, SLOT)]
        items[1] = (k(1), 2, 4096, SLOT - 4096)  # too small a place: counted, not a crash
        got = read_all(s, slab, items)
        assert [i for i, _ in got] == list(range(5))  # in order
        assert [n for _, n in got] == [SLOT, None, SLOT, SLOT, None]
        for i in (0, 2, 3):
            assert np.array_equal(slab.slot(3 - i), value(i)), i
        stats = s.stats()
        assert stats["hits"] == 3 and stats["misses"] == 2 and stats["size_mismatch"] == 1


def test_damaged_and_forged_records_are_misses_and_dropped_as_in_process(tmp_path: Path, slab) -> None:
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        put(s, 2)
    with DiskStore(tmp_path / "other", budget_bytes=1 << 30, auth=B) as s:
        put(s, 1)
    corrupt_payload(tmp_path / "db", k(1))
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        s.use_read_processes(slab, 1)
        assert [n for _, n in read_all(s, slab, [(k(0), 0, 0, SLOT), (k(1), 1, 0, SLOT)])] == [SLOT, None]
        assert s.stats()["corrupt"] == 1
        eventually(lambda: s.contains_many([k(1)]) == [False], "the damaged record's drop")
        assert s.contains_many([k(0)]) == [True]
    # The read processes check the MAC with the store's key (sent over their pipe).
    with DiskStore(tmp_path / "other", budget_bytes=1 << 30, auth=A) as s:
        s.use_read_processes(slab, 1)
        assert read_all(s, slab, [(k(0), 0, 0, SLOT)]) == [(0, None)]
        assert s.stats()["forged"] == 1


def test_a_process_that_dies_leaves_its_reads_to_the_calling_thread(tmp_path: Path, slab) -> None:
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        put(s, 3)
        s.use_read_processes(slab, 1)
        readers = s.read_processes
        assert readers is not None
        (child,) = disk_children("read_process")
        os.kill(child, signal.SIGKILL)
        got = read_all(s, slab, [(k(i), i, 0, SLOT) for i in range(3)])
        assert got == [(0, SLOT), (1, SLOT), (2, SLOT)] and not readers.available
        for i in range(3):
            assert np.array_equal(slab.slot(i), value(i))
        with pytest.raises(ProcessesUnavailable):
            readers.read_many([(k(0), 0, 0, SLOT)], lambda i, o: None)


def test_closing_the_store_stops_its_processes(tmp_path: Path, slab) -> None:
    s = DiskStore(tmp_path / "db", budget_bytes=1 << 30)
    put(s, 1)
    s.use_read_processes(slab, 2)
    assert len(disk_children("read_process")) == 2
    s.close()
    assert disk_children("read_process") == []


def test_processes_that_cannot_open_the_slab_are_refused_with_the_reason(tmp_path: Path, slab) -> None:
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        put(s, 1)
        with pytest.raises(ProcessesUnavailable, match="could not start.*slab"):
            DiskReaders(tmp_path / "db", tmp_path / "no-slab", SLOT, 8, processes=1)
    assert disk_children("read_process") == []


def test_a_hierarchy_promotes_through_its_read_processes(env) -> None:
    disk = env.disk()
    keys = [key(i) for i in range(6)] + [key(i, group=1) for i in range(2)]
    h = env.hier(disk, slots=16)
    store(h, keys)
    assert h.close()
    h = env.hier(disk, slots=16, read_processes=2)  # a fresh host tier over the same disk
    assert [link.slab_reads for link in h._s.links] == [True]  # noqa: SLF001
    assert all(on_disk(disk, x) for x in keys)
    h.promote(keys)
    assert h.wait_promotions(keys, DEADLINE_S)
    slots = h.prepare_load(keys)
    assert all(holds(h.slab, slot, x) for x, slot in zip(keys, slots, strict=True))
    h.complete_load(keys)
    assert disk.stats()["hits"] == len(keys) * len(NS)


def test_callers_waiting_for_a_process_are_let_go_when_the_pool_stops(tmp_path: Path, slab) -> None:
    import threading

    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        put(s, 2)
    readers = DiskReaders(tmp_path / "db", slab.path, SLOT, 8, processes=1)
    gate, holding = threading.Event(), threading.Event()
    raised: list[str] = []

    def hold(i: int, outcome: tuple) -> None:
        holding.set()
        assert gate.wait(DEADLINE_S)

    def call(items: list, answer) -> None:
        try:
            readers.read_many(items, answer)
        except ProcessesUnavailable:
            raised.append(threading.current_thread().name)

    first = threading.Thread(target=call, args=([(k(0), 0, 0, SLOT), (k(1), 1, 0, SLOT)], hold), name="first")
    first.start()
    assert holding.wait(DEADLINE_S)  # the only process is the first caller's
    second = threading.Thread(target=call, args=([(k(1), 1, 0, SLOT)], lambda i, o: None), name="second")
    second.start()
    readers.close()
    gate.set()
    for t in (first, second):
        t.join(DEADLINE_S)
        assert not t.is_alive(), t.name
    assert sorted(raised) == ["first", "second"]
    assert disk_children("read_process") == []


def test_an_answer_that_raises_is_raised_once_the_process_read_every_item(tmp_path: Path, slab) -> None:
    """The caller may hand the slots of the items left out again once ``read_many`` raised: by
    then the process must have written them all."""
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        put(s, 4)
    readers = DiskReaders(tmp_path / "db", slab.path, SLOT, 8, processes=1)
    try:
        answered: list[int] = []

        def answer(i: int, outcome: tuple) -> None:
            answered.append(i)
            raise KeyError("the caller's own failure")

        with pytest.raises(KeyError, match="the caller's own failure"):
            readers.read_many([(k(i), i, 0, SLOT) for i in range(4)], answer)
        assert answered == [0]  # not answered for the rest
        assert all(np.array_equal(slab.slot(i), value(i)) for i in range(4))  # yet all written
        got: list[tuple[int, tuple]] = []
        readers.read_many([(k(3), 5, 0, SLOT)], lambda i, o: got.append((i, o)))  # still serves
        assert got == [(0, ("ok", SLOT))] and np.array_equal(slab.slot(5), value(3))
    finally:
        readers.close()


def test_a_later_hierarchy_over_the_same_store_gets_processes_for_its_own_slab(env) -> None:
    """Read processes started for one host slab read into that one: a hierarchy with another
    slab over the same store has them started again for its slab."""
    disk = env.disk()
    keys = [key(i) for i in range(4)]
    h = env.hier(disk, slots=16, read_processes=1)
    store(h, keys)
    assert h.close()
    h = env.hier(disk, slots=16, read_processes=1)  # another slab
    h.promote(keys)
    assert h.wait_promotions(keys, DEADLINE_S)
    slots = h.prepare_load(keys)
    assert all(holds(h.slab, slot, x) for x, slot in zip(keys, slots, strict=True))
    h.complete_load(keys)
    assert len(disk_children("read_process")) == 1


def test_a_read_into_another_slab_than_the_processes_map_lands_in_that_slab(tmp_path: Path, slab) -> None:
    """Two host tiers over one store: the read processes map the first one's slab; a read into
    the second reads in the calling thread, into the second, and leaves the first alone."""
    other = HostSlab(tmp_path / "other-slab", SLOT, 8)
    try:
        with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
            put(s, 2)
            s.use_read_processes(slab, 1)
            before = [bytes(slab.slot(i)) for i in range(2)]
            assert read_all(s, other, [(k(0), 1, 0, SLOT), (k(1), 0, 0, SLOT)]) == [(0, SLOT), (1, SLOT)]
            assert np.array_equal(other.slot(1), value(0)) and np.array_equal(other.slot(0), value(1))
            assert [bytes(slab.slot(i)) for i in range(2)] == before
            assert read_all(s, slab, [(k(1), 0, 0, SLOT)]) == [(0, SLOT)]  # its own slab: the processes
            assert np.array_equal(slab.slot(0), value(1))
    finally:
        other.close()
