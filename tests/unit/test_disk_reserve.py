"""The disk tier's file-system reserve (``reserve_bytes``, the ``disk_reserve`` option): the store
leaves that much of its file system free, holding its size and evicting once it gets there.

The filling tests run on a small tmpfs of their own (root and ``mount -t tmpfs``; skipped
otherwise), so that nothing else writing to the machine's disks moves the free space they check.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.disk.reserve import NEAR_BYTES, FsReserve

MiB = 1 << 20
FS_BYTES = 48 * MiB
VALUE = MiB  # incompressible: every stored frame is as large as the value


@pytest.fixture
def small_fs(tmpfs: Callable[[str], Path]) -> Path:
    return tmpfs(f"{FS_BYTES}")


def key(i: int) -> bytes:
    return b"R" * 16 + i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, VALUE, dtype=np.uint8).tobytes()


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def fill(store: DiskStore, mnt: Path, count: int) -> tuple[list[int], int]:
    """Put ``count`` values one at a time; (what each put stored, the least free space seen)."""
    stored, least = [], free_bytes(mnt)
    for i in range(count):
        stored.append(store.put_many([(key(i), value(i), "uint8")]))
        least = min(least, free_bytes(mnt))
    return stored, least


def test_the_store_stops_growing_at_the_reserve_and_keeps_taking_chunks(small_fs: Path) -> None:
    reserve = 16 * MiB
    with DiskStore(small_fs / "store", budget_bytes=1 << 30, reserve_bytes=reserve) as store:
        stored, least = fill(store, small_fs, 60)
        st = store.stats()
        # Every chunk was taken, by evicting the oldest once the reserve was reached; the file
        # system never came near full.
        assert stored == [1] * 60, stored
        assert st["full_events"] == 0 and st["admission_drops"] == 0 and st["reserve_drops"] == 0, st
        assert st["reserve_freezes"] >= 1 and st["evictions"] > 0, st
        assert st["reserve_cap_bytes"] is not None and st["stored_bytes"] <= st["reserve_cap_bytes"] + VALUE
        # One put may grow the file after the freeze (the pages its evictions free are used
        # again by the next transaction), plus the index's own pages.
        assert least >= reserve - 3 * VALUE, (least, reserve)
        # The newest chunks read back exactly; the oldest made room for them.
        out = bytearray(VALUE)
        for i in range(55, 60):
            assert store.get_into(key(i), out) == VALUE and bytes(out) == value(i)
        assert store.contains_many([key(0)]) == [False]


def test_without_a_reserve_the_same_puts_fill_the_file_system(small_fs: Path) -> None:
    # The control: the budget alone lets the store take the whole file system.
    with DiskStore(small_fs / "store", budget_bytes=1 << 30, full_retry_s=3600) as store:
        stored, least = fill(store, small_fs, 60)
        st = store.stats()
    assert st["full_events"] >= 1 and 0 in stored, st
    assert least < 4 * MiB, least


def test_below_the_reserve_an_empty_store_puts_nothing_and_says_so(tmp_path: Path) -> None:
    # Any file system: a reserve beyond what it has free leaves an empty store nothing to evict.
    reserve = free_bytes(tmp_path) + (1 << 40)
    with DiskStore(tmp_path / "store", budget_bytes=1 << 30, reserve_bytes=reserve) as store:
        assert [store.put_many([(key(i), value(i), "uint8")]) for i in range(3)] == [0, 0, 0]
        st = store.stats()
        assert st["reserve_drops"] == 3 and st["entries"] == 0 and st["full_events"] == 0, st
        assert st["reserve_bytes"] == reserve and st["reserve_cap_bytes"] == 0, st
        assert store.contains_many([key(0)]) == [False]


def test_the_store_grows_again_once_the_file_system_has_room(small_fs: Path) -> None:
    reserve = 12 * MiB
    filler = small_fs / "filler"
    filler.write_bytes(bytes(16 * MiB))  # someone else's data
    with DiskStore(small_fs / "store", budget_bytes=1 << 30, reserve_bytes=reserve) as store:
        fill(store, small_fs, 40)
        held = store.stats()
        assert held["reserve_cap_bytes"] is not None, held
        filler.unlink()  # they delete it: 16 MiB free again
        for i in range(40, 50):
            assert store.put_many([(key(i), value(i), "uint8")]) == 1
        grown = store.stats()
    assert grown["stored_bytes"] >= held["reserve_cap_bytes"] + 8 * MiB, (held, grown)
    assert grown["full_events"] == 0 and free_bytes(small_fs) >= reserve - 3 * VALUE


def test_far_from_the_reserve_the_file_system_is_asked_again_only_after_a_while(
        tmpfs: Callable[[str], Path]) -> None:
    """Far above the reserve the writer counts its own puts between measurements; near it, it
    measures at every transaction. Seen through what a put may store: a reserve that counted
    writes the file system never saw freezes the store."""
    mnt = tmpfs("1g")  # nothing else writes here: its free space moves only by this test
    room = free_bytes(mnt) - MiB  # above a 1 MiB reserve
    assert room > NEAR_BYTES + 64 * MiB
    written = room - NEAR_BYTES - 16 * MiB  # still far from the reserve, as counted
    big_put = NEAR_BYTES + 32 * MiB  # fits the file system, not the counted room

    slow = FsReserve(mnt, MiB, remeasure_s=3600)
    slow.begin()
    slow.wrote(written)  # counted, never written
    slow.begin()  # far, and measured a moment ago: not asked again
    assert slow.budget(1 << 40, 5, big_put) == (5, True)

    eager = FsReserve(mnt, MiB, remeasure_s=0)
    eager.begin()
    eager.wrote(written)
    eager.begin()  # measured again: the file system still has the room
    assert eager.budget(1 << 40, 5, big_put) == (1 << 40, False)


def test_near_the_reserve_the_file_system_is_asked_at_every_transaction(small_fs: Path) -> None:
    reserve = 8 * MiB  # leaves about 40 MiB of room: near (below NEAR_BYTES)
    near = FsReserve(small_fs, reserve, remeasure_s=3600)
    near.begin()
    near.wrote(39 * MiB)  # counted, never written: 1 MiB of room left, as counted
    near.begin()  # near: asked again however recently it was
    assert near.budget(1 << 40, 5, 16 * MiB) == (1 << 40, False)
