"""Helpers of the Hierarchy tests over a real LMDB DiskStore (tests/unit/test_hierarchy_*.py): a
two-shard geometry, chunk keys and their byte patterns, ``store`` (chunks stored through the host
tier), ``eventually``, ``GatedDisk``, corrupted records, and the disk tier's child processes
(``disk_children``).

Disk lag is produced deterministically with ``GatedDisk`` (a DiskStore whose reads or writes wait
on an event), never with sleeps; waits poll with a generous deadline and assert nothing about time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

from kvstrata.presence import Presence
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy, chunk_group
from kvstrata.tiers.host import HostSlab

HIT, PENDING, MISS = Presence.HIT, Presence.PENDING, Presence.MISS
NS = [b"rank0-namespace!", b"rank1-namespace!"]  # two shards (TP 2)
SHARD = 8192
GROUP_BYTES = [8192, 3000]  # group 1 uses only part of the shard (e.g. smaller Mamba pages)
DTYPES = ["bfloat16", "int8"]
CHUNK_BYTES = GROUP_BYTES[0] * len(NS)
DEADLINE_S = 30.0


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def pattern(k: bytes, shard: int) -> np.ndarray:
    n = GROUP_BYTES[chunk_group(k)]
    seed = int.from_bytes(k[:8], "big") * 7 + shard * 1000003 + chunk_group(k)
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def fill(slab: HostSlab, slot: int, k: bytes) -> None:
    for r in range(len(NS)):
        p = pattern(k, r)
        slab.array[slot, r * SHARD : r * SHARD + p.size] = p


def holds(slab: HostSlab, slot: int, k: bytes) -> bool:
    return all(
        np.array_equal(
            slab.array[slot, r * SHARD : r * SHARD + GROUP_BYTES[chunk_group(k)]], pattern(k, r)
        )
        for r in range(len(NS))
    )


def eventually(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class GatedDisk:
    """A real DiskStore whose reads and/or writes block until their gate opens."""

    tier_name = "disk"

    def __init__(self, disk: DiskStore) -> None:
        self.disk = disk
        self.reads_open = threading.Event()
        self.writes_open = threading.Event()
        self.reads_open.set()
        self.writes_open.set()
        self.get_calls: list[bytes] = []
        self.put_calls = 0
        self.active_reads = 0
        self.max_active_reads = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):  # the rest of the tier interface: the real store's
        return getattr(self.disk, name)

    def contains_many(self, keys):
        return self.disk.contains_many(keys)

    def touch_many(self, keys):
        return self.disk.touch_many(keys)

    def get_into(self, k, out):
        with self._lock:
            self.get_calls.append(k)
            self.active_reads += 1
            self.max_active_reads = max(self.max_active_reads, self.active_reads)
        try:
            assert self.reads_open.wait(DEADLINE_S)
            return self.disk.get_into(k, out)
        finally:
            with self._lock:
                self.active_reads -= 1

    def put_many_then(self, entries, done):
        with self._lock:
            self.put_calls += 1
        assert self.writes_open.wait(DEADLINE_S)
        self.disk.put_many_then(entries, done)


def store(h: Hierarchy, keys: list[bytes]) -> dict[bytes, int]:
    slots = h.prepare_store(keys)
    assert slots is not None
    for k, s in slots.items():
        fill(h.slab, s, k)
    h.complete_store(list(slots))
    return slots


def ten_on_disk_twelve_of_sixteen_slots_held(env) -> tuple[DiskStore, Hierarchy, list[bytes], dict[bytes, int]]:
    """(disk, hierarchy, the 10 keys on disk, the slots of the 12 stores in flight): a restarted
    hierarchy of 16 host slots, 12 of them held by stores, over a disk holding 10 chunks."""
    disk = env.disk()
    h = env.hier(disk, slots=16)
    keys = [key(i) for i in range(10)]
    store(h, keys)
    eventually(lambda: h.stats()["writes_completed"] == 10, "write-behind")
    h.close()
    h2 = env.hier(disk, slots=16)
    held = h2.prepare_store([key(100 + i) for i in range(12)])
    assert held is not None
    return disk, h2, keys, held


def on_disk(disk: DiskStore, k: bytes) -> bool:
    return all(disk.contains_many([ns + k for ns in NS]))


def corrupt_payload(db_path, k: bytes) -> None:
    with lmdb.open(str(db_path), max_dbs=4) as raw:
        payload = raw.open_db(b"payload")
        with raw.begin(write=True) as txn:
            frame = bytearray(txn.get(k, db=payload))
            frame[len(frame) // 2] ^= 0xFF
            txn.put(k, bytes(frame), db=payload)


def disk_children(module: str) -> list[int]:
    """This process's children running ``python -m kvstrata.tiers.disk.<module>`` (its other
    children, e.g. engines or servers other tests started, do not count)."""
    me, wanted = os.getpid(), f"kvstrata.tiers.disk.{module}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == me and wanted in cmdline.split(b"\0"):
                out.append(int(entry))
    return out
