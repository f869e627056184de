"""The disk tier's in-memory mirror of its index (kvstrata/tiers/disk/index_mirror.py): presence
probes answered from memory agree with LMDB after every kind of write (puts, deletes, evictions,
untracked writes, another process's writes), and fall back to LMDB whenever the mirror is behind."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import lmdb

from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.disk.index_mirror import MIN_BACKOFF_S, IndexMirror

HELPER = Path(__file__).with_name("disk_helper.py")
sys.path.insert(0, str(HELPER.parent))
from disk_helper import key, payload  # noqa: E402

MiB = 1 << 20


def _open(path: Path, **kw: object) -> DiskStore:
    kw.setdefault("budget_bytes", 1 << 30)
    # The writer's loop wakes at least this often: a stale mirror is rebuilt soon after.
    kw.setdefault("touch_flush_interval_s", 0.05)
    return DiskStore(path, **kw)  # type: ignore[arg-type]


def _wait(cond, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _truth(store: DiskStore, keys: list[bytes]) -> list[bool]:
    """What LMDB's index says, read directly."""
    return store.read(lambda txn, h: [txn.get(k, db=h.index) is not None for k in keys])


def _mirrored(store: DiskStore, keys: list[bytes]) -> list[bool]:
    """contains_many as the mirror answers it. The writer's own background commits (access
    ticks) leave it behind between their commit and its update: then LMDB answers, and the
    probe is asked again."""
    for _ in range(100):
        before = store.stats()["mirrored_lookups"]
        found = store.contains_many(keys)
        if store.stats()["mirrored_lookups"] == before + len(keys):
            return found
        time.sleep(0.001)
    raise AssertionError("LMDB answered every time, never the mirror")


def test_probes_follow_puts_deletes_and_evictions_from_memory(tmp_path: Path) -> None:
    """Random puts and deletes into a store whose budget forces evictions: after each write the
    mirror answers every probe, exactly as LMDB's index does."""
    size = 64 << 10
    store = _open(tmp_path / "s", budget_bytes=12 * size)  # evictions from the 13th entry on
    _wait(lambda: store.stats()["mirror_rebuilds"] >= 1, "the writer built the mirror")
    rng = random.Random(0)
    universe = [key(i) for i in range(40)]
    for step in range(60):
        if rng.random() < 0.75:
            i = rng.randrange(40)
            store.put_many([(key(i), payload(i, size), "float16")])
        else:
            store.delete_many([rng.choice(universe)])
        assert _mirrored(store, universe) == _truth(store, universe), step
    stats = store.stats()
    assert stats["evictions"] > 0 and stats["deletes"] > 0, stats
    assert stats["mirror_rebuilds"] == 1, stats  # followed, never rebuilt
    store.close()


def test_a_write_that_changes_no_record_still_commits_its_transaction(tmp_path: Path) -> None:
    """A tracked write transaction that changes nothing (here: flushing access ticks of keys no
    longer stored) still commits, so that no other process's commit can take its id and be
    mistaken for it by the mirror."""
    store = _open(tmp_path / "s")
    store.put_many([(key(0), payload(0, 4096), "float16")])
    _wait(lambda: store.stats()["mirror_rebuilds"] >= 1, "the writer built the mirror")
    before = store.read(lambda txn, h: txn.id())
    store.touch_many([key(7)])  # never stored: the flush finds nothing to update
    store.sync()
    assert store.read(lambda txn, h: txn.id()) == before + 1
    assert _mirrored(store, [key(0), key(7)]) == [True, False]
    store.close()


def test_a_reopened_store_mirrors_what_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with _open(path) as store:
        store.put_many([(key(i), payload(i, 4096), "float16") for i in range(10)])
    with _open(path) as store:
        _wait(lambda: store.stats()["mirror_rebuilds"] >= 1, "the writer built the mirror")
        keys = [key(i) for i in range(20)]
        assert _mirrored(store, keys) == [True] * 10 + [False] * 10


def test_an_untracked_write_falls_back_to_lmdb_until_the_mirror_is_rebuilt(tmp_path: Path) -> None:
    """``DiskStore.write`` (the tools' transactions) may add index records it does not report:
    the record is found at once (LMDB answers), then from a rebuilt mirror."""
    store = _open(tmp_path / "s")
    store.put_many([(key(0), payload(0, 4096), "float16")])
    _wait(lambda: store.stats()["mirror_rebuilds"] >= 1, "the writer built the mirror")
    assert _mirrored(store, [key(0), key(1)]) == [True, False]
    # Copy key 0's record under key 1, as an import would, behind the mirror's back.
    def copy(txn, h):  # type: ignore[no-untyped-def]
        frame = bytes(txn.get(key(0), db=h.payload))
        index = rec.decode_index(txn.get(key(0), db=h.index))
        assert index is not None
        txn.put(key(1), frame, db=h.payload)
        txn.put(key(1), rec.encode_index(index), db=h.index)
    store.write(copy)
    before = store.stats()["mirrored_lookups"]
    assert store.contains_many([key(0), key(1)]) == [True, True]
    assert store.stats()["mirrored_lookups"] == before  # stale: LMDB answered
    _wait(lambda: store.stats()["mirror_rebuilds"] >= 2, "the writer rebuilt the mirror")
    assert _mirrored(store, [key(0), key(1), key(2)]) == [True, True, False]
    store.close()


def test_another_process_writing_is_seen_at_once_and_mirrored_after(tmp_path: Path) -> None:
    path = tmp_path / "s"
    store = _open(path)
    store.put_many([(key(0), payload(0, 4096), "float16")])
    _wait(lambda: store.stats()["mirror_rebuilds"] >= 1, "the writer built the mirror")
    child = subprocess.run([sys.executable, str(HELPER), "writer", str(path), "100", "5", "--size", "4096"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    keys = [key(0)] + [key(i) for i in range(100, 106)]
    assert store.contains_many(keys) == [True] * 6 + [False]  # at once: from LMDB
    # Our next write commits after the child's: the mirror knows it is behind and is rebuilt.
    store.put_many([(key(1), payload(1, 4096), "float16")])
    _wait(lambda: store.stats()["mirror_rebuilds"] >= 2, "the writer rebuilt the mirror", timeout=30)
    assert _mirrored(store, keys + [key(1)]) == [True] * 6 + [False, True]
    store.close()


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _rebuild(mirror: IndexMirror, path: Path, keys: list[bytes]) -> int:
    """Rebuild ``mirror`` from a real LMDB environment holding ``keys``; its transaction id."""
    env = lmdb.open(str(path), max_dbs=1, map_size=1 << 24)
    db = env.open_db(b"index")
    with env.begin(write=True) as txn:
        txn.drop(db, delete=False)
        for k in keys:
            txn.put(k, b"", db=db)
    with env.begin() as txn:
        mirror.rebuild(txn, db)
        txnid = txn.id()
    env.close()
    return txnid


def test_the_mirror_answers_only_for_the_transaction_it_reflects(tmp_path: Path) -> None:
    mirror = IndexMirror(_Clock())
    assert mirror.answer([b"a"], 0) is None  # not built
    t = _rebuild(mirror, tmp_path, [b"a", b"b"])
    assert mirror.answer([b"a", b"c"], t) == [True, False]
    assert mirror.answer([b"a"], t + 1) is None  # a commit it has not followed yet
    mirror.committed(t + 1, added=[b"c"], removed=[b"a"])
    assert mirror.answer([b"a", b"b", b"c"], t + 1) == [False, True, True]
    mirror.committed(t + 3, added=[b"d"], removed=[])  # t + 2 was another process's
    assert not mirror.current and mirror.answer([b"d"], t + 3) is None


def test_rebuilds_back_off_while_staleness_keeps_recurring(tmp_path: Path) -> None:
    clock = _Clock()
    mirror = IndexMirror(clock)
    assert mirror.rebuild_due()  # never built
    _rebuild(mirror, tmp_path, [b"a"])
    assert not mirror.rebuild_due()  # current
    waits = []
    for _ in range(6):
        mirror.invalidate()  # stale again within a minute of its build
        start = clock.t
        while not mirror.rebuild_due():
            clock.t += 0.25
        waits.append(clock.t - start)
        _rebuild(mirror, tmp_path, [b"a"])
    assert waits[0] == MIN_BACKOFF_S and waits == sorted(waits) and waits[-1] >= 32 * MIN_BACKOFF_S, waits
    clock.t += 3600  # stale long after its last build: rebuilt at once
    mirror.invalidate()
    assert mirror.rebuild_due()
    mirror.rebuild_failed()  # a failed rebuild waits before the next try
    assert not mirror.rebuild_due()
