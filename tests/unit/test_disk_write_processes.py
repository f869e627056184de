"""Disk writes framed in processes of their own (``write_processes``, ``tiers/disk/encoders.py``):
child processes frame chunks of a real host slab into a frame slab and the store's put process
(or its writer thread) puts them from there. What is stored reads back as the slab's bytes, under
the store's MAC key; a frame that does not fit its frame slot, a child that dies, a pool that
stops: the calling thread frames the rest; frame slots come back once their puts committed;
closing leaves no process and no file. The put process: the index mirror follows its commits,
it evicts by last access and reports it (the reads of earlier runs and those a replaced put
process had been sent included), a full map, a kill (also mid-transaction), a start that
fails, a replaced put process: the writer thread puts the rest, and the index stays exact."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hierarchy_helpers import DEADLINE_S, NS, disk_children, eventually, holds, key, on_disk, store

from kvstrata.auth import ValueAuth
from kvstrata.tiers import codec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.disk.children import ProcessesUnavailable
from kvstrata.tiers.disk.encoders import FRAME_SLOTS_PER_PROCESS, DiskEncoders
from kvstrata.tiers.host import HostSlab

SLOT = 1 << 16
A = ValueAuth(b"disk-secret-a-0123456789abcdef")
B = ValueAuth(b"disk-secret-b-0123456789abcdef")


def value(i: int) -> np.ndarray:
    """A slot's worth of bf16-like bytes: the low bytes random, the high ones few (compressible)."""
    rng = np.random.default_rng(i)
    v = np.empty(SLOT, dtype=np.uint8)
    v[0::2] = rng.integers(0, 256, SLOT // 2, dtype=np.uint8)
    v[1::2] = rng.integers(60, 64, SLOT // 2, dtype=np.uint8)
    return v


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


@pytest.fixture
def slab(tmp_path: Path):
    s = HostSlab(tmp_path / "slab", SLOT, 8)
    for i in range(8):
        s.slot(i)[:] = value(i)
    yield s
    s.close()


def put_from_slab(s: DiskStore, slab_: HostSlab, items: list[tuple[bytes, int, int, int, str]]) -> int:
    done = threading.Event()
    got: list[int] = []

    def stored(n: int) -> None:
        got.append(n)
        done.set()

    s.put_many_from_slab_then(slab_, items, stored)
    assert done.wait(DEADLINE_S), "the puts never committed"
    return got[0]


def read(s: DiskStore, key_: bytes, n: int) -> bytes | None:
    out = bytearray(n)
    return bytes(out) if s.get_into(key_, out) == n else None


def test_processes_frame_what_the_store_reads_back_as_the_slabs_bytes(tmp_path: Path, slab) -> None:
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        s.use_write_processes(slab, 2)
        assert s.write_processes is not None and len(disk_children("encode_process")) == 2
        # Whole slots, a shard at an offset inside a slot, bf16 and uint8 alike.
        items = [(k(0), 0, 0, SLOT, "bfloat16"), (k(1), 1, 4096, SLOT - 4096, "uint8")]
        assert put_from_slab(s, slab, items) == 2
        assert s.stats()["process_framed"] == 2
        assert read(s, k(0), SLOT) == value(0).tobytes()
        assert read(s, k(1), SLOT - 4096) == value(1)[4096:].tobytes()
        # The same frames the store's own threads write: its codec, level and mode.
        assert s.stats()["stored_bytes"] == sum(
            len(codec.encode(bytes(slab.view(slot, off, n)), dt, key=key_))
            for key_, slot, off, n, dt in items)
        # Stored already: counted as stored, framed by nobody.
        assert put_from_slab(s, slab, items) == 2 and s.stats()["process_framed"] == 2


def test_the_processes_tag_values_with_the_stores_key(tmp_path: Path, slab) -> None:
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30, auth=A) as s:
        s.use_write_processes(slab, 1)
        assert put_from_slab(s, slab, [(k(i), i, 0, SLOT, "bfloat16") for i in range(3)]) == 3
        assert s.stats()["process_framed"] == 3
        assert read(s, k(2), SLOT) == value(2).tobytes()
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30, auth=B) as s:  # another key: forged
        assert read(s, k(0), SLOT) is None and s.stats()["forged"] == 1


def test_a_frame_that_does_not_fit_its_frame_slot_is_framed_by_the_caller(tmp_path: Path, slab) -> None:
    """One put_many call's frames share one frame slot, a slab slot and some: two whole slots of
    raw (incompressible) data do not fit, and the second is framed in the calling thread."""
    for i in (2, 3):
        slab.slot(i)[:] = np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        s.use_write_processes(slab, 1)
        assert put_from_slab(s, slab, [(k(2), 2, 0, SLOT, "uint8"), (k(3), 3, 0, SLOT, "uint8")]) == 2
        assert s.stats()["process_framed"] == 1
        for i in (2, 3):
            assert read(s, k(i), SLOT) == bytes(slab.view(i, 0, SLOT))


def test_frame_slots_come_back_once_their_puts_committed(tmp_path: Path, slab) -> None:
    """More put calls than frame slots, one after the other: each waits for a free slot, which
    only a committed (or refused) put gives back; none may hang."""
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        s.use_write_processes(slab, 1)
        calls = 3 * FRAME_SLOTS_PER_PROCESS
        for c in range(calls):
            assert put_from_slab(s, slab, [(k(100 + c), c % 8, 0, SLOT, "bfloat16")]) == 1
        assert s.stats()["process_framed"] == calls
        encoders = s.write_processes
        assert encoders is not None
        taken: list[int] = []  # every frame slot is free again: each of these gets one at once
        t = threading.Thread(target=lambda: taken.extend(
            encoders.frame_many([(k(1), 1, 0, SLOT, "uint8")]).slot for _ in range(FRAME_SLOTS_PER_PROCESS)))
        t.start()
        t.join(DEADLINE_S)
        assert sorted(taken) == list(range(FRAME_SLOTS_PER_PROCESS)), taken


def test_a_process_that_dies_leaves_its_framing_to_the_calling_thread(tmp_path: Path, slab) -> None:
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        s.use_write_processes(slab, 1)
        encoders = s.write_processes
        assert encoders is not None
        (child,) = disk_children("encode_process")
        os.kill(child, signal.SIGKILL)
        assert put_from_slab(s, slab, [(k(i), i, 0, SLOT, "bfloat16") for i in range(3)]) == 3
        assert not encoders.available and s.stats()["process_framed"] == 0
        for i in range(3):
            assert read(s, k(i), SLOT) == value(i).tobytes()
        with pytest.raises(ProcessesUnavailable):
            encoders.frame_many([(k(0), 0, 0, SLOT, "uint8")])


def test_closing_the_store_stops_its_processes_and_leaves_no_frame_slab(tmp_path: Path, slab) -> None:
    s = DiskStore(tmp_path / "db", budget_bytes=1 << 30)
    s.use_write_processes(slab, 2)
    assert len(disk_children("encode_process")) == 2
    encoders = s.write_processes
    assert encoders is not None and encoders.frames is not None
    assert not os.path.exists(encoders.frames.path)  # unlinked once every process mapped it
    put_from_slab(s, slab, [(k(0), 0, 0, SLOT, "bfloat16")])
    s.close()
    assert disk_children("encode_process") == []


def test_processes_that_cannot_open_the_slab_are_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "frames").mkdir()
    with pytest.raises(ProcessesUnavailable, match="could not start.*slab"):
        DiskEncoders(tmp_path / "no-slab", SLOT, 8, processes=1, frame_slot_bytes=SLOT,
                     frames_dir=tmp_path / "frames")
    assert disk_children("encode_process") == []
    assert list((tmp_path / "frames").iterdir()) == []  # the frame slab is gone too


def test_a_hierarchy_writes_behind_through_its_write_processes(env) -> None:
    disk = env.disk()
    keys = [key(i) for i in range(6)] + [key(i, group=1) for i in range(2)]
    h = env.hier(disk, slots=16, write_processes=2, idle_writes=False)
    assert [link.slab_writes for link in h._s.links] == [True]  # noqa: SLF001
    store(h, keys)
    assert h.close()  # every write behind done
    assert all(on_disk(disk, x) for x in keys)
    assert disk.stats()["process_framed"] == len(keys) * len(NS)
    h = env.hier(disk, slots=16)  # a fresh host tier over the same disk: the bytes come back
    h.promote(keys)
    assert h.wait_promotions(keys, DEADLINE_S)
    slots = h.prepare_load(keys)
    assert all(holds(h.slab, slot, x) for x, slot in zip(keys, slots, strict=True))
    h.complete_load(keys)


class _NoSharedMemory(DiskStore):
    """A real store on a host whose shared memory cannot hold a frame slab."""

    def use_write_processes(self, slab: HostSlab, processes: int, *, idle: bool = False) -> None:
        raise MemoryError("cannot reserve the frame slab (no shared memory left)")


def test_a_hierarchy_whose_write_processes_cannot_start_frames_in_its_threads(env, tmp_path: Path) -> None:
    disk = _NoSharedMemory(tmp_path / "db-no-shm", budget_bytes=1 << 30)
    try:
        keys = [key(i) for i in range(4)]
        h = env.hier(disk, slots=16, write_processes=2)
        assert [link.slab_writes for link in h._s.links] == [False]  # noqa: SLF001
        store(h, keys)
        assert h.close()
        assert all(on_disk(disk, x) for x in keys) and disk.stats()["process_framed"] == 0
    finally:
        disk.close()


# ---- the put process (tiers/disk/writer.py, "The put process") ------------------------------


def test_the_put_process_puts_what_the_processes_framed(tmp_path: Path, slab) -> None:
    """Put calls framed by the write processes are put by the put process; the writer's index
    mirror follows its commits (presence answered from memory), and the bytes read back."""
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        s.use_write_processes(slab, 2)
        assert len(disk_children("put_process")) == 1
        for i in range(8):
            assert put_from_slab(s, slab, [(k(i), i, 0, SLOT, "bfloat16")]) == 1
        stats = s.stats()
        assert stats["process_framed"] == 8 and stats["process_puts"] == 8 and stats["puts"] == 8, stats
        assert s.contains_many([k(i) for i in range(9)]) == [True] * 8 + [False]
        assert s.stats()["mirrored_lookups"] == 9  # the mirror followed the put process's commits
        for i in range(8):
            assert read(s, k(i), SLOT) == value(i).tobytes()
        assert stats["stored_bytes"] == sum(r.stored_len for _, r in s.iter_index())


def test_the_put_process_evicts_by_last_access_and_reports_what_it_evicted(tmp_path: Path, slab) -> None:
    """It evicts the least recently used, a read not yet written to the index included (the
    writer sends it the buffered ticks), and the store hears of every chunk it evicted."""
    with DiskStore(tmp_path / "probe", budget_bytes=1 << 30) as probe:  # each value's frame size
        probe.put_many([(k(i), value(i), "bfloat16") for i in range(6)])
        size = {key_: r.stored_len for key_, r in probe.iter_index()}
    budget = sum(size[k(i)] for i in range(4)) + size[k(4)] // 2  # four fit, not five
    evicted: list[bytes] = []
    with DiskStore(tmp_path / "db", budget_bytes=budget, touch_flush_interval_s=3600) as s:
        s.on_removed = evicted.extend
        s.use_write_processes(slab, 1)
        for i in range(4):
            assert put_from_slab(s, slab, [(k(i), i, 0, SLOT, "bfloat16")]) == 1
        assert read(s, k(0), SLOT) == value(0).tobytes()  # k(0) is now the most recently used
        for i in (4, 5):
            assert put_from_slab(s, slab, [(k(i), i, 0, SLOT, "bfloat16")]) == 1
        stats = s.stats()
        assert stats["process_puts"] == 6 and stats["evictions"] == len(evicted) >= 2, (stats, evicted)
        present = s.contains_many([k(i) for i in range(6)])
        assert present[0] and not present[1] and present[4] and present[5], present
        assert sorted(evicted) == [k(i) for i in range(6) if not present[i]]
        assert stats["stored_bytes"] <= budget


def _frame_sizes(tmp_path: Path) -> dict[bytes, int]:
    with DiskStore(tmp_path / "probe", budget_bytes=1 << 30) as probe:
        probe.put_many([(k(i), value(i), "bfloat16") for i in range(6)])
        return {key_: r.stored_len for key_, r in probe.iter_index()}


@pytest.mark.parametrize("flush_between", [False, True], ids=["one-epoch", "ticks-flushed-between"])
def test_the_put_process_keeps_the_reads_of_earlier_runs(tmp_path: Path, slab, flush_between) -> None:
    """The writer sends the put process only the ticks read since its last run (and a new epoch
    once it wrote the buffered ticks): a read sent with an earlier run that evicted nothing still
    orders a later eviction. Watched failing with the process replacing its copy by each run's
    ticks (k(0) evicted)."""
    size = _frame_sizes(tmp_path)
    budget = sum(size[k(i)] for i in range(4)) + size[k(4)] // 2  # four fit, not five
    with DiskStore(tmp_path / "db", budget_bytes=budget, touch_flush_interval_s=3600) as s:
        s.use_write_processes(slab, 1)
        for i in range(3):
            assert put_from_slab(s, slab, [(k(i), i, 0, SLOT, "bfloat16")]) == 1
        s.touch_many([k(0)])  # k(0) after k(1), k(2)
        assert put_from_slab(s, slab, [(k(3), 3, 0, SLOT, "bfloat16")]) == 1  # evicts nothing
        if flush_between:
            s.sync()
        s.touch_many([k(1)])
        assert put_from_slab(s, slab, [(k(4), 4, 0, SLOT, "bfloat16")]) == 1
        stats = s.stats()
        assert stats["process_puts"] == 5 and stats["evictions"] == 1, stats
        assert s.contains_many([k(i) for i in range(5)]) == [True, True, False, True, True]
        assert stats["tick_flushes"] == int(flush_between), stats


def test_a_new_put_process_gets_every_buffered_tick(tmp_path: Path, slab) -> None:
    """A read already sent to the put process it replaced still orders the new one's eviction.
    Watched failing with only the changes sent to the new process (k(0) evicted)."""
    size = _frame_sizes(tmp_path)
    budget = sum(size[k(i)] for i in range(4)) + size[k(4)] // 2
    other = HostSlab(tmp_path / "other-slab", SLOT, 8)
    try:
        other.slot(0)[:] = value(4)
        with DiskStore(tmp_path / "db", budget_bytes=budget, touch_flush_interval_s=3600) as s:
            s.use_write_processes(slab, 1)
            for i in range(3):
                assert put_from_slab(s, slab, [(k(i), i, 0, SLOT, "bfloat16")]) == 1
            s.touch_many([k(0)])
            assert put_from_slab(s, slab, [(k(3), 3, 0, SLOT, "bfloat16")]) == 1  # sends k(0)'s read
            s.use_write_processes(other, 1)  # another put process
            assert put_from_slab(s, other, [(k(4), 0, 0, SLOT, "bfloat16")]) == 1
            stats = s.stats()
            assert stats["process_puts"] == 5 and stats["evictions"] == 1, stats
            # k(1) is the least recently used: k(0) was read after it.
            assert s.contains_many([k(i) for i in range(5)]) == [True, False, True, True, True]
            assert read(s, k(4), SLOT) == value(4).tobytes()
    finally:
        other.close()


def test_a_put_process_that_dies_leaves_the_puts_to_the_writer_thread(tmp_path: Path, slab) -> None:
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
        s.use_write_processes(slab, 1)
        assert put_from_slab(s, slab, [(k(0), 0, 0, SLOT, "bfloat16")]) == 1
        (child,) = disk_children("put_process")
        os.kill(child, signal.SIGKILL)
        for i in range(1, 4):
            assert put_from_slab(s, slab, [(k(i), i, 0, SLOT, "bfloat16")]) == 1
        stats = s.stats()
        assert stats["process_puts"] == 1 and stats["process_framed"] == 4 and stats["puts"] == 4, stats
        for i in range(4):
            assert read(s, k(i), SLOT) == value(i).tobytes()


def test_a_full_map_in_the_put_process_stops_admission(tmp_path: Path, slab) -> None:
    """As in the writer thread: counted, logged, admission closed for a while; never raised."""
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30, map_size=1 << 20, full_retry_s=3600) as s:
        s.use_write_processes(slab, 1)
        stored = [put_from_slab(s, slab, [(k(i), i % 8, 0, SLOT, "uint8")]) for i in range(40)]
        stats = s.stats()
        assert 0 in stored and stats["full_events"] == 1 and not stats["admitting"], (stored, stats)
        assert stats["process_puts"] == stored.index(0) + 1  # the one that did not fit was the process's
        assert all(read(s, k(i), SLOT) == value(i % 8).tobytes() for i in range(stored.index(0)))


def test_closing_the_store_stops_its_put_process_and_marks_the_store_clean(tmp_path: Path, slab) -> None:
    s = DiskStore(tmp_path / "db", budget_bytes=1 << 30)
    s.use_write_processes(slab, 1)
    assert put_from_slab(s, slab, [(k(0), 0, 0, SLOT, "bfloat16")]) == 1
    s.close()
    assert disk_children("put_process") == []
    with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as again:
        assert not again.unclean_shutdown  # the put process held no session of its own
        assert read(again, k(0), SLOT) == value(0).tobytes()


def test_the_put_process_and_the_writer_thread_interleave_and_the_index_stays_exact(tmp_path: Path, slab) -> None:
    """Puts framed in processes (the put process) and in the callers' threads (the writer
    thread) from several threads at once, in a store small enough to evict all the time: the
    totals, the index mirror's answers and what each evicted chunk's report says all match the
    store as LMDB has it, and every chunk still stored reads back as written."""
    frame = 40 << 10  # about one compressed value
    evicted: list[bytes] = []
    with DiskStore(tmp_path / "db", budget_bytes=12 * frame) as s:
        s.on_removed = evicted.extend
        s.use_write_processes(slab, 2)

        def writer(t: int) -> None:
            for i in range(12):
                n = 1000 * t + i
                if (t + i) % 2:
                    assert put_from_slab(s, slab, [(k(n), n % 8, 0, SLOT, "bfloat16")]) == 1
                else:
                    assert s.put_many([(k(n), value(n % 8), "bfloat16")]) == 1

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        stats = s.stats()
        assert stats["process_puts"] > 0 and stats["puts"] > stats["process_puts"], stats
        keys = [k(1000 * t + i) for t in range(4) for i in range(12)]
        stored = dict(s.iter_index())
        assert stats["entries"] == len(stored) and stats["stored_bytes"] == sum(r.stored_len for r in stored.values())
        assert stats["stored_bytes"] <= 12 * frame and stats["evictions"] == len(evicted) > 0, stats
        assert s.contains_many(keys) == [key_ in stored for key_ in keys]
        assert s.stats()["mirrored_lookups"] == len(keys)  # the mirror followed both writers
        assert set(evicted) == set(keys) - set(stored)
        for key_ in stored:
            assert read(s, key_, SLOT) == value(int.from_bytes(key_, "big") % 8).tobytes()


def test_a_put_process_that_cannot_start_leaves_the_encoders_working(tmp_path: Path, slab, caplog) -> None:
    """Its store is not there: said in the log, and the frames are put by the writer thread."""
    import logging

    rules = {"budget_bytes": 1 << 30, "evict_slack": 0.0, "max_age_us": None, "reserve_bytes": 0, "idle": False,
             "store_path": str(tmp_path / "no-store"), "map_size": 1 << 30}
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        encoders = DiskEncoders(slab.path, SLOT, 8, processes=1, frame_slot_bytes=SLOT + (64 << 10),
                                put_setup=rules)
    try:
        assert encoders.put_pool is None and encoders.available
        assert "the disk put process could not start" in caplog.text and "no-store" in caplog.text
        assert disk_children("put_process") == [] and len(disk_children("encode_process")) == 1
        batch = encoders.frame_many([(k(0), 0, 0, SLOT, "bfloat16")])
        assert batch.framed[0] is not None and batch.places[0] is not None
        batch.release_after([])
    finally:
        encoders.close()
    assert disk_children("encode_process") == []


def test_a_put_from_another_slab_than_the_processes_map_is_framed_from_that_slab(tmp_path: Path, slab) -> None:
    """Two host tiers over one store: the write processes map the first one's slab; a put from
    the second is framed in the calling thread from the second's bytes."""
    other = HostSlab(tmp_path / "other-slab", SLOT, 8)
    try:
        other.slot(0)[:] = value(7)
        with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
            s.use_write_processes(slab, 1)
            assert put_from_slab(s, other, [(k(0), 0, 0, SLOT, "bfloat16")]) == 1
            assert put_from_slab(s, slab, [(k(1), 0, 0, SLOT, "bfloat16")]) == 1
            assert s.stats()["process_framed"] == 1  # only the put from its own slab
            assert read(s, k(0), SLOT) == value(7).tobytes()
            assert read(s, k(1), SLOT) == value(0).tobytes()
    finally:
        other.close()


def test_puts_placed_for_a_put_process_since_replaced_are_put_from_their_own_frames(tmp_path: Path, slab) -> None:
    """Frames queued in the first write processes' frame slab when the processes start again for
    another slab (and another frame slab, and another put process): the writer thread puts them
    from their own frames, never the new put process from its frame slab at the same places. The
    writer thread is held in an ``on_removed`` report (after a commit: LMDB's lock is free, so
    the new put process can open the store)."""
    other = HostSlab(tmp_path / "other-slab", SLOT, 8)
    try:
        other.slot(0)[:], other.slot(1)[:] = value(6), value(0)
        with DiskStore(tmp_path / "db", budget_bytes=1 << 30) as s:
            s.use_write_processes(slab, 1)
            assert put_from_slab(s, slab, [(k(9), 1, 0, SLOT, "bfloat16")]) == 1
            holding, release = threading.Event(), threading.Event()

            def hold(_removed: list[bytes]) -> None:
                holding.set()
                assert release.wait(DEADLINE_S)

            s.on_removed = hold
            deleter = threading.Thread(target=s.delete_many, args=([k(9)],))
            deleter.start()
            assert holding.wait(DEADLINE_S)
            done: list[int] = []
            s.put_many_from_slab_then(slab, [(k(0), 0, 0, SLOT, "bfloat16")], done.append)  # framed, queued
            s.use_write_processes(other, 1)  # new encoders, frame slab and put process
            # Two puts from the new slab: both frame slots of the new frame slab hold frames, the
            # second at the place the first put's frame has in the old one, and as long (the
            # same bytes under another key).
            s.put_many_from_slab_then(other, [(k(1), 0, 0, SLOT, "bfloat16")], done.append)
            s.put_many_from_slab_then(other, [(k(2), 1, 0, SLOT, "bfloat16")], done.append)
            release.set()
            deleter.join(DEADLINE_S)
            eventually(lambda: len(done) == 3, "the puts committed")
            assert done == [1, 1, 1]
            assert read(s, k(0), SLOT) == value(0).tobytes()
            assert read(s, k(1), SLOT) == value(6).tobytes()
            assert read(s, k(2), SLOT) == value(0).tobytes()
            stats = s.stats()
            assert stats["process_framed"] == 4 and stats["corrupt"] == 0, stats
            # The first put's, and (unless they shared the writer thread's transaction with the
            # put placed for the old process) the new process's.
            assert 1 <= stats["process_puts"] <= 3, stats
    finally:
        other.close()


def test_put_processes_killed_mid_transaction_leave_the_store_exact(tmp_path: Path, slab) -> None:
    """SIGKILL the put process while puts stream through it (often inside its write transaction:
    LMDB's robust write lock passes to the next writer), five times, a new put process each time:
    every put call still completes, the index and totals agree, every stored chunk reads back
    as written, and the store closes cleanly."""
    rng = np.random.default_rng(5)
    with DiskStore(tmp_path / "db", budget_bytes=24 * SLOT) as s:  # evicts as it goes
        expected: dict[bytes, bytes] = {}
        for round_ in range(5):
            s.use_write_processes(slab, 0)
            s.use_write_processes(slab, 1)  # a new put process
            (child,) = disk_children("put_process")
            stop = threading.Event()
            done: list[int] = []

            def putter(round_: int, stop: threading.Event, done: list[int]) -> None:
                i = 0
                while not stop.is_set():
                    n = 1000 * round_ + i
                    done.append(put_from_slab(s, slab, [(k(n), n % 8, 0, SLOT, "bfloat16")]))
                    expected[k(n)] = value(n % 8).tobytes()
                    i += 1

            thread = threading.Thread(target=putter, args=(round_, stop, done))
            thread.start()
            time.sleep(float(rng.uniform(0.02, 0.2)))
            os.kill(child, signal.SIGKILL)
            time.sleep(0.05)
            stop.set()
            thread.join(DEADLINE_S)
            assert not thread.is_alive() and done and set(done) == {1}, done
        stats = s.stats()
        assert stats["process_puts"] > 0, stats
        stored = dict(s.iter_index())
        assert stats["entries"] == len(stored) and stats["stored_bytes"] == sum(r.stored_len for r in stored.values())
        assert stored and set(stored) <= set(expected)
        for key_ in stored:
            assert read(s, key_, SLOT) == expected[key_]
        assert s.contains_many(list(expected)) == [key_ in stored for key_ in expected]
    with DiskStore(tmp_path / "db", budget_bytes=24 * SLOT) as again:
        assert not again.unclean_shutdown
        assert again.stats()["entries"] == len(stored)
