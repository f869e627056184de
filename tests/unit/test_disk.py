"""kvstrata.tiers.disk: a real LMDB store in tmp_path, child processes for crashes and sharing."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.tiers import codec
from kvstrata.tiers.disk import (
    FORMAT_VERSION,
    DiskStore,
    IndexRecord,
    StoreFormatError,
    StoreUnavailableError,
)
from kvstrata.tiers.retention import select_lru_victims

HELPER = Path(__file__).with_name("disk_helper.py")
sys.path.insert(0, str(HELPER.parent))
from disk_helper import key, payload, writer_held  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


def rand_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def open_store(path: Path, **kw: object) -> DiskStore:
    kw.setdefault("budget_bytes", GiB)
    return DiskStore(path, **kw)  # type: ignore[arg-type]


def read(store: DiskStore, k: bytes, n: int) -> bytes | None:
    out = bytearray(n)
    got = store.get_into(k, out)
    return None if got is None else bytes(out[:got])


def helper(*args: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HELPER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,  # type: ignore[arg-type]
    )


def raw_env(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), max_dbs=4, map_size=1 << 32)


# ---- basics ---------------------------------------------------------------------------------


def test_put_get_contains_delete_iter(tmp_path: Path) -> None:
    with open_store(tmp_path / "s") as store:
        entries = [(key(i), payload(i), "float16") for i in range(6)]
        assert store.put_many(entries) == 6
        assert store.contains_many([key(0), key(5), key(99)]) == [True, True, False]
        for i in range(6):
            assert read(store, key(i), len(payload(i))) == payload(i)
        assert read(store, key(99), 16) is None
        index = dict(store.iter_index())
        rec = index[key(4)]
        assert isinstance(rec, IndexRecord)
        assert (rec.raw_len, rec.dtype, rec.group) == (len(payload(4)), "float16", 4 % 3)
        frame_info = codec.frame_info(codec.encode(payload(4), "float16", key=key(4)))
        assert rec.checksum == frame_info.checksum and rec.codec == codec.CODEC_PLANES
        assert store.delete_many([key(0), key(1), key(99)]) == 2
        assert store.contains_many([key(0), key(2)]) == [False, True]
        stats = store.stats()
        assert stats["entries"] == 4
        assert stats["raw_bytes"] == sum(len(payload(i)) for i in range(2, 6))
        assert stats["stored_bytes"] == sum(r.stored_len for _, r in store.iter_index())
        assert stats["compression_ratio"] > 1.05
        assert (stats["hits"], stats["misses"], stats["deletes"]) == (6, 1, 2)


def test_put_many_then_reports_once_on_the_writer_thread_after_the_commit(tmp_path: Path) -> None:
    """``put_many_then`` returns before the writer commits; ``done`` gets the count, stored keys
    included, once every entry is written, from the writer thread (in the caller's thread when
    nothing was left to write); a closed store reports what it did not take."""
    import threading

    store = open_store(tmp_path / "s")
    calls: list[tuple[int, str, bool]] = []
    reported = threading.Event()

    def done(n: int) -> None:
        keys = [key(i) for i in range(4)]
        calls.append((n, threading.current_thread().name, all(store.contains_many(keys)[:n])))
        reported.set()

    store.put_many([(key(0), payload(0), "float16")])
    store.put_many_then([(key(i), payload(i), "float16") for i in range(4)], done)
    assert reported.wait(30)
    # The writer runs puts in order: once a later one returns, every callback of the first ran.
    assert store.put_many([(key(8), payload(8), "float16")]) == 1
    assert len(calls) == 1
    n, thread, visible = calls[0]
    assert n == 4 and visible and thread != threading.current_thread().name
    for i in range(4):
        assert read(store, key(i), len(payload(i))) == payload(i)

    calls.clear()
    store.put_many_then([(key(1), payload(1), "float16")], done)  # already stored: reported here
    assert calls == [(1, threading.current_thread().name, True)]
    store.close()
    calls.clear()
    store.put_many_then([(key(9), payload(9), "float16")], done)
    assert [c[0] for c in calls] == [0]


_unique = itertools.count()


@pytest.fixture(scope="module", params=["auto", "raw"])
def shared_store(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DiskStore]:
    store = open_store(tmp_path_factory.mktemp("hyp") / "s", codec=request.param)
    yield store
    store.close()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(sorted(codec.DTYPES)),
    blobs=st.lists(st.binary(max_size=4096), min_size=1, max_size=4),
    structured=st.booleans(),
)
def test_round_trip_every_dtype_through_the_store(
    shared_store: DiskStore, dtype: str, blobs: list[bytes], structured: bool
) -> None:
    size = codec.itemsize(dtype)
    if structured:  # compressible planes, so "auto" takes the plane path
        blobs = [bytes(b % 4 for b in blob) + blob for blob in blobs]
    blobs = [blob[: len(blob) - len(blob) % size] for blob in blobs]
    keys = [key(10_000 + next(_unique)) for _ in blobs]
    assert shared_store.put_many(list(zip(keys, blobs, [dtype] * len(blobs), strict=True))) == len(
        blobs
    )
    for k, blob in zip(keys, blobs, strict=True):
        assert read(shared_store, k, len(blob) + 3) == blob


def test_existing_keys_are_not_rewritten(tmp_path: Path) -> None:
    with open_store(tmp_path / "s") as store:
        assert store.put_many([(key(1), payload(1), "float16")]) == 1
        assert (
            store.put_many([(key(1), payload(1), "float16"), (key(2), payload(2), "float16")]) == 2
        )
        stats = store.stats()
        assert (stats["puts"], stats["put_present"], stats["entries"]) == (2, 1, 2)


def test_iter_index_spans_many_batches(tmp_path: Path) -> None:
    with open_store(tmp_path / "s") as store:
        keys = [key(i) for i in range(2500)]
        assert store.put_many([(k, b"\x01\x02", "int8") for k in keys]) == 2500
        assert [k for k, _ in store.iter_index()] == sorted(keys)


def test_reopen_after_clean_close(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put_many([(key(i), payload(i), "float16") for i in range(3)])
        store.register_namespace(b"F" * 16, {"model": "m", "tp_rank": 0})
        before = dict(store.iter_index())[key(1)].tick
        assert read(store, key(1), len(payload(1))) == payload(1)
    with open_store(path, create=False) as store:
        assert not store.unclean_shutdown
        assert store.stats()["entries"] == 3
        assert store.namespaces() == {b"F" * 16: {"model": "m", "tp_rank": 0}}
        assert dict(store.iter_index())[key(1)].tick > before  # the read's tick was flushed
        for i in range(3):
            assert read(store, key(i), len(payload(i))) == payload(i)


def test_threads_and_asyncio_executor(tmp_path: Path) -> None:
    with open_store(tmp_path / "s") as store:

        def work(i: int) -> bool:
            store.put_many([(key(i), payload(i, 64 << 10), "float16")])
            return read(store, key(i), 64 << 10) == payload(i, 64 << 10)

        with ThreadPoolExecutor(6) as pool:
            assert all(pool.map(work, range(48)))

        async def main() -> list[bool]:
            loop = asyncio.get_running_loop()
            with ThreadPoolExecutor(4) as pool:
                found = await loop.run_in_executor(
                    pool, store.contains_many, [key(i) for i in range(50)]
                )
                got = await asyncio.gather(
                    *(loop.run_in_executor(pool, work, i) for i in range(48, 60))
                )
            return found + got

        result = asyncio.run(main())
        assert result == [True] * 48 + [False, False] + [True] * 12


# ---- budget and eviction ----------------------------------------------------------------------


def test_select_lru_victims() -> None:
    entries = [(b"a", 5, 10), (b"b", 1, 10), (b"c", 3, 10), (b"d", 1, 10)]
    assert select_lru_victims(entries, 0) == []
    assert select_lru_victims(entries, 1) == [b"b"]  # oldest tick; tie b/d broken by key
    assert select_lru_victims(entries, 11) == [b"b", b"d"]
    assert select_lru_victims(entries, 25) == [b"b", b"d", b"c"]
    assert select_lru_victims(entries, 1000) == [b"b", b"d", b"c", b"a"]


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    blobs = {i: rand_bytes(64 << 10, i) for i in range(6)}  # incompressible: stored size known
    frame_len = len(codec.encode(blobs[0], "uint8"))
    store = open_store(tmp_path / "s", budget_bytes=4 * frame_len, evict_slack=0.0)
    for i in range(4):
        assert store.put_many([(key(i), blobs[i], "uint8")]) == 1
    assert read(store, key(0), 64 << 10) == blobs[0]  # 0 is now the most recently used
    assert store.put_many([(key(4), blobs[4], "uint8")]) == 1
    assert store.contains_many([key(i) for i in range(5)]) == [True, False, True, True, True]
    assert read(store, key(2), 64 << 10) == blobs[2]
    assert store.put_many([(key(5), blobs[5], "uint8")]) == 1
    assert store.contains_many([key(i) for i in range(6)]) == [True, False, True, False, True, True]
    stats = store.stats()
    assert stats["evictions"] == 2 and stats["stored_bytes"] <= 4 * frame_len
    assert stats["entries"] == 4
    store.close()
    # The order survives a restart: last use is now 0 < 4 < 2 < 5 only if the read of 2 (after
    # 4 was put) reached the index; with put-time ticks alone, 2 would be the oldest.
    store = open_store(tmp_path / "s", budget_bytes=4 * frame_len, evict_slack=0.0)
    assert read(store, key(0), 64 << 10) == blobs[0]
    assert store.put_many([(key(1), blobs[1], "uint8")]) == 1
    assert store.contains_many([key(0), key(2), key(4), key(5)]) == [True, True, False, True]
    store.close()


def test_max_age_expires_idle_chunks_when_evicting(tmp_path: Path) -> None:
    blobs = {i: rand_bytes(64 << 10, i) for i in range(5)}
    frame_len = len(codec.encode(blobs[0], "uint8"))
    now = [1_000_000_000]  # the store's clock (µs): stepped here, never slept through
    store = open_store(tmp_path / "s", budget_bytes=4 * frame_len, evict_slack=0.0, max_age_s=0.2,
                       clock_us=lambda: now[0])
    assert store.put_many([(key(0), blobs[0], "uint8"), (key(1), blobs[1], "uint8")]) == 2
    now[0] += 300_000  # 0 and 1 are now older than max_age
    assert store.put_many([(key(2), blobs[2], "uint8"), (key(3), blobs[3], "uint8")]) == 2
    # Over budget by one entry: the budget alone would evict only 0; age evicts 1 as well.
    assert store.put_many([(key(4), blobs[4], "uint8")]) == 1
    assert store.contains_many([key(i) for i in range(5)]) == [False, False, True, True, True]
    store.close()


def test_entry_larger_than_budget_is_dropped(tmp_path: Path) -> None:
    with open_store(tmp_path / "s", budget_bytes=1000) as store:
        assert store.put_many([(key(1), rand_bytes(4096, 1), "uint8")]) == 0
        assert store.stats()["too_large_drops"] == 1
        assert store.put_many([(key(2), b"x" * 100, "uint8")]) == 1


# ---- full map / full disk ---------------------------------------------------------------------


def test_full_map_stops_admitting_and_keeps_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(tmp_path / "s", map_size=8 * MiB, full_retry_s=3600)
    blobs = [rand_bytes(MiB, i) for i in range(12)]
    admitted = [store.put_many([(key(i), blobs[i], "uint8")]) for i in range(12)]
    assert admitted[0] == 1 and 0 in admitted
    stored = [i for i, n in enumerate(admitted) if n]
    first_drop = admitted.index(0)
    assert all(n == 0 for n in admitted[first_drop:])  # stopped admitting after the first failure
    stats = store.stats()
    assert stats["full_events"] == 1 and not stats["admitting"]
    assert stats["admission_drops"] == 12 - len(stored)
    assert len([r for r in caplog.records if "stopped admitting" in r.getMessage()]) == 1
    for i in stored:  # reads go on
        assert read(store, key(i), MiB) == blobs[i]
    store.close()


def test_full_map_admits_again_after_the_retry_delay(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", map_size=8 * MiB, full_retry_s=0.0)
    for i in range(10):
        store.put_many([(key(i), rand_bytes(MiB, i), "uint8")])
    assert store.stats()["full_events"] >= 2  # it tried again, failed again, never raised
    assert store.put_many([(key(99), b"small", "uint8")]) == 1  # small entries still fit
    store.close()


def test_full_disk_efbig_in_child(tmp_path: Path) -> None:
    proc = helper("fsize", str(tmp_path / "s"), "12", str(6 * MiB))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert 0 < result["admitted"] < 12
    assert result["readable"] == result["admitted"]
    assert result["stats"]["full_events"] >= 1


# ---- damaged records ----------------------------------------------------------------------------


def damage(path: Path, k: bytes, how: str) -> None:
    env = raw_env(path)
    db = env.open_db(b"payload")
    with env.begin(write=True) as txn:
        frame = bytearray(txn.get(k, db=db))
        if how == "flip":
            frame[len(frame) // 2] ^= 0x10
        else:
            del frame[len(frame) // 3 :]
        txn.put(k, bytes(frame), db=db)
    env.close()


@pytest.mark.parametrize("how", ["flip", "torn"])
def test_corrupt_record_is_a_counted_miss_and_dropped(tmp_path: Path, how: str) -> None:
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put_many([(key(i), payload(i), "float16") for i in range(3)])
    damage(path, key(1), how)
    with open_store(path) as store:
        assert read(store, key(1), len(payload(1))) is None
        assert read(store, key(0), len(payload(0))) == payload(0)
        store.sync()  # the writer has dropped the bad record by now
        stats = store.stats()
        if how == "flip":  # its pages are its own: dropped
            assert (stats["corrupt"], stats["corrupt_dropped"], stats["entries"]) == (1, 1, 2)
        else:
            # A size that differs from the index record may be a damaged page count, whose
            # delete would free another record's pages: left in place, never read again here.
            assert (stats["corrupt"], stats["quarantined"], stats["entries"]) == (1, 1, 3)
        assert store.contains_many([key(1)]) == [False]


def test_output_buffer_too_small_is_a_miss(tmp_path: Path) -> None:
    with open_store(tmp_path / "s") as store:
        store.put_many([(key(1), payload(1), "float16")])
        assert store.get_into(key(1), bytearray(100)) is None
        assert store.stats()["size_mismatch"] == 1


# ---- crashes ------------------------------------------------------------------------------------


def test_sigkill_mid_write_then_reopen_serves_no_corrupt_record(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = helper("writer", str(path), "0", "0", "--forever")
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until it has committed a few, then kill it mid-stream
        if line.startswith("put 12 "):
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()  # type: ignore[union-attr]

    store = open_store(path, create=False)
    assert store.unclean_shutdown
    assert store.wait_recovery(timeout=30)
    index = dict(store.iter_index())
    assert len(index) >= 12
    for k, rec in index.items():
        i = int.from_bytes(k[16:48], "big")
        assert read(store, k, rec.raw_len) == payload(i)
    stats = store.stats()
    assert stats["corrupt"] == 0 and stats["recovery_checked"] == len(index)
    assert stats["entries"] == len(index)
    store.close()
    with open_store(path, create=False) as store:
        assert not store.unclean_shutdown  # the verified store was closed cleanly


def test_unclean_open_verifies_and_drops_bad_records(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put_many([(key(i), payload(i), "float16") for i in range(5)])
    damage(path, key(2), "flip")
    env = raw_env(path)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        txn.put(b"clean", b"0", db=meta)  # as if the last session had crashed
        txn.put(b"orphan", b"no index record", db=env.open_db(b"payload", txn=txn))
    env.close()
    with open_store(path) as store:
        assert store.unclean_shutdown
        assert store.wait_recovery(timeout=30)
        stats = store.stats()
        assert stats["recovery_dropped"] == 2  # the flipped record and the orphan payload
        assert stats["entries"] == 4
        assert stats["stored_bytes"] == sum(r.stored_len for _, r in store.iter_index())
        assert [k for k, _ in store.iter_index()] == [key(i) for i in (0, 1, 3, 4)]


# ---- several processes ------------------------------------------------------------------------


def test_reader_process_while_this_process_writes(tmp_path: Path) -> None:
    path = tmp_path / "s"
    store = open_store(path)
    store.put_many([(key(0), payload(0), "float16")])
    reader = helper("reader", str(path), "0", "30", "--timeout", "30")
    for i in range(1, 30):
        assert store.put_many([(key(i), payload(i), "float16")]) == 1
        time.sleep(0.005)
    out, err = reader.communicate(timeout=60)
    store.close()
    assert reader.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert (result["missing"], result["wrong"]) == (0, 0)


def test_two_writer_processes(tmp_path: Path) -> None:
    path = tmp_path / "s"
    store = open_store(path)
    child = helper("writer", str(path), "100", "20")
    for i in range(20):
        assert store.put_many([(key(i), payload(i), "float16")]) == 1
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    keys = [key(i) for i in range(20)] + [key(i) for i in range(100, 120)]
    assert store.contains_many(keys) == [True] * 40
    assert store.stats()["entries"] == 40  # totals live in the store, exact across processes
    for i in (3, 105):
        assert read(store, key(i), len(payload(i))) == payload(i)
    store.close()
    with open_store(path) as store:
        assert not store.unclean_shutdown  # the last of the two to close marked it clean


def test_totals_stay_exact_when_another_process_writes_between_this_ones_puts(tmp_path: Path) -> None:
    """The writer reuses the totals its last put wrote only while that put is the store's last
    commit: another process's puts in between are counted."""
    path = tmp_path / "s"
    store = open_store(path)
    for i in range(5):
        assert store.put_many([(key(i), payload(i), "float16")]) == 1
    child = helper("writer", str(path), "100", "10")
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert store.put_many([(key(5), payload(5), "float16")]) == 1
    stats = store.stats()
    assert stats["entries"] == 16, stats
    assert stats["stored_bytes"] == sum(r.stored_len for _, r in store.iter_index())
    store.close()


def test_a_key_twice_in_one_batch_is_stored_once(tmp_path: Path) -> None:
    """Small puts share a transaction; the second of one key finds the first (not the index as
    it was before the transaction). The writer is held in a transaction of its own until both
    puts are queued, so that they share the next one."""
    with open_store(tmp_path / "s") as store:
        assert store.put_many([(key(1), payload(1), "float16")]) == 1  # the index mirror is built
        small = payload(2)[:4096]
        done: list[int] = []
        finished = threading.Event()
        with writer_held(store):  # both puts are queued: the writer takes them in one transaction
            store.put_many_then([(key(2), small, "float16"), (key(2), small, "float16")],
                                lambda n: (done.append(n), finished.set()))
        assert finished.wait(30) and done == [2]
        stats = store.stats()
        assert stats["entries"] == 2, stats
        assert stats["stored_bytes"] == sum(r.stored_len for _, r in store.iter_index())


def test_a_key_evicted_in_a_batch_and_put_again_in_it_is_stored(tmp_path: Path) -> None:
    """The writer asks its index mirror (the index as the last commit left it) whether a key is
    stored, unless the running transaction changed that key. Here X was stored by the previous
    transaction, and the next one evicts it to make room for Y, then puts X again (queued while X
    was not stored yet): X must be written, not taken for stored."""
    small, big = 1024, 64 << 10  # codec "raw": a frame is its value plus a fixed header
    with open_store(tmp_path / "probe", codec="raw") as probe:
        probe.put_many([(key(0), rand_bytes(small, 0), "uint8")])
        header = probe.stats()["stored_bytes"] - small
    fillers = [(key(100 + i), rand_bytes(small, 100 + i), "uint8") for i in range(63)]
    filler_bytes = 63 * (small + header)
    # Room for the fillers, X and Y less half the fillers: Y's put evicts the oldest (the first
    # key and X, enough for it), X's put again the oldest fillers (not Y).
    budget = 2 * (big + header) + filler_bytes // 2
    x, y = (key(1), rand_bytes(big, 1), "uint8"), (key(2), rand_bytes(big, 2), "uint8")
    with open_store(tmp_path / "s", codec="raw", budget_bytes=budget) as store:
        assert store.put_many([(key(0), rand_bytes(small, 0), "uint8")]) == 1  # the mirror is built
        reports: list[int] = []
        finished = threading.Event()
        with writer_held(store):
            # One transaction of 64 small puts (the writer's batch limit): X and the fillers;
            # the next one Y, then X again.
            store.put_many_then([x, *fillers], reports.append)
            store.put_many_then([y, x], lambda n: (reports.append(n), finished.set()))
        assert finished.wait(30) and reports == [64, 2], reports
        stats = store.stats()
        assert stats["evictions"] >= 2, stats
        assert read(store, x[0], big) == x[1]
        assert read(store, y[0], big) == y[1]
        assert stats["stored_bytes"] == sum(r.stored_len for _, r in store.iter_index())


def test_map_grown_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "s"
    store = open_store(path, map_size=16 * MiB)
    store.put_many([(key(0), payload(0), "float16")])
    # the child's 24 MiB outgrow our 16 MiB map: our next transaction sees MDB_MAP_RESIZED
    child = helper("writer", str(path), "1", "24", "--map-size", str(64 * MiB), "--size", str(MiB))
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert read(store, key(20), MiB) == payload(20, MiB)
    assert store.put_many([(key(9), payload(9), "float16")]) == 1
    assert store.stats()["map_resized"] >= 1
    store.close()


# ---- bad input ----------------------------------------------------------------------------------


def test_other_format_version(tmp_path: Path) -> None:
    path = tmp_path / "s"
    open_store(path).close()
    env = raw_env(path)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreFormatError) as err:
        open_store(path)
    assert (
        str(path) in str(err.value)
        and "99" in str(err.value)
        and str(FORMAT_VERSION) in str(err.value)
    )
    with pytest.raises(StoreFormatError):
        open_store(path, readonly=True)


def test_not_a_kvstrata_store(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign))
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    with pytest.raises(StoreFormatError, match="not a kvstrata store"):
        open_store(foreign)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "data.mdb").write_bytes(rand_bytes(64 << 10, 0))
    with pytest.raises(StoreFormatError, match="LMDB"):
        open_store(garbage)


def test_missing_or_unusable_directory(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        open_store(tmp_path / "missing", create=False)
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        open_store(tmp_path / "missing", readonly=True)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreUnavailableError, match="data.mdb is missing"):
        open_store(tmp_path / "empty", create=False)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StoreUnavailableError, match="not a directory"):
        open_store(tmp_path / "file")
    with pytest.raises(StoreUnavailableError, match="cannot create"):
        open_store(tmp_path / "file" / "store")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_directory(tmp_path: Path) -> None:
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o500)
    try:
        with pytest.raises(StoreUnavailableError, match="not writable"):
            open_store(path)
    finally:
        path.chmod(0o700)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="budget"):
        open_store(tmp_path / "a", budget_bytes=0)
    with pytest.raises(ValueError, match="codec"):
        open_store(tmp_path / "b", codec="lz4")
    with open_store(tmp_path / "s") as store:
        for bad in [b"", "text", b"k" * 600]:
            with pytest.raises(ValueError, match="keys"):
                store.put_many([(bad, b"xx", "uint8")])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="dtype"):
            store.put_many([(key(1), b"xx", "complex64")])
        with pytest.raises(ValueError, match="whole number"):
            store.put_many([(key(1), b"xxx", "bfloat16")])
        assert store.stats()["entries"] == 0


def test_read_only_store(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put_many([(key(1), payload(1), "float16")])
    with open_store(path, readonly=True) as store:
        assert read(store, key(1), len(payload(1))) == payload(1)
        assert store.put_many([(key(2), payload(2), "float16")]) == 0
        assert store.stats()["admission_drops"] == 1
        with pytest.raises(StoreUnavailableError, match="read-only"):
            store.delete_many([key(1)])


def test_closed_store_answers_without_crashing(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s")
    store.put_many([(key(1), payload(1), "float16")])
    store.close()
    store.close()
    assert store.get_into(key(1), bytearray(len(payload(1)))) is None
    assert store.contains_many([key(1)]) == [False]
    assert store.put_many([(key(2), payload(2), "float16")]) == 0
    with pytest.raises(StoreUnavailableError):
        store.delete_many([key(1)])


def test_index_record_is_small() -> None:
    rec = IndexRecord(
        raw_len=2 << 20,
        stored_len=1 << 20,
        codec=1,
        checksum=2**64 - 1,
        tick=2**52,
        group=3,
        dtype="bfloat16",
    )
    assert len(msgspec.msgpack.encode(rec)) < 48
