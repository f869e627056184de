"""The retention policy, online budget enforcement, eviction, the compacting rewrite, the archive.

Stores are real ``DiskStore`` directories; nothing is mocked. No timing assertions: waits only
ever prove that something did *not* happen while it must not.
"""

from __future__ import annotations

import io
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.compaction import archive, rewrite
from kvstrata.compaction.evict import evict
from kvstrata.tiers import codec, retention
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.retention import RetentionPolicy, select_lru_victims, select_victims

NS = bytes(range(16))


def _key(i: int, group: int = 0, ns: bytes = NS) -> bytes:
    return ns + i.to_bytes(32, "big") + group.to_bytes(4, "big")


def _noise(n: int, seed: int) -> bytes:
    """Incompressible bytes: stored size ~= raw size, so budgets are easy to reason about."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _fill(store: DiskStore, count: int, size: int, *, start: int = 0) -> list[bytes]:
    keys = [_key(start + i) for i in range(count)]
    assert store.put_many([(k, _noise(size, start + i), "uint8") for i, k in enumerate(keys)]) == count
    return keys


# ---- policy ----------------------------------------------------------------------------------


def _reference(entries: list[retention.Entry], need: int, cutoff: int | None) -> list[bytes]:
    """The definition: sort by (tick, key); take the expired ones and the prefix reaching need."""
    ordered = sorted(entries, key=lambda e: (e[1], e[0]))
    out: list[bytes] = []
    freed = 0
    for key, tick, size in ordered:
        if (cutoff is not None and tick < cutoff) or freed < need:
            out.append(key)
            freed += size
    return out


def test_lru_victims_oldest_first_with_deterministic_ties() -> None:
    entries = [(b"b", 5, 10), (b"a", 5, 10), (b"c", 1, 10), (b"d", 9, 10)]
    assert select_lru_victims(entries, 15) == [b"c", b"a"]
    assert select_lru_victims(entries, 0) == []
    assert select_lru_victims(entries, -3) == []
    assert select_lru_victims(entries, 10_000) == [b"c", b"a", b"b", b"d"]


def test_expired_entries_go_and_count_toward_the_need() -> None:
    entries = [(b"old1", 1, 30), (b"old2", 2, 30), (b"new", 100, 30), (b"newer", 200, 30)]
    assert select_victims(entries, expire_before_us=50) == [b"old1", b"old2"]
    # Expired bytes (60) already cover a need of 50: nothing recent goes.
    assert select_victims(entries, need_bytes=50, expire_before_us=50) == [b"old1", b"old2"]
    assert select_victims(entries, need_bytes=70, expire_before_us=50) == [b"old1", b"old2", b"new"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 100)), max_size=60),
    st.integers(-10, 3000),
    st.one_of(st.none(), st.integers(0, 50)),
)
def test_selection_matches_the_definition(
    raw: list[tuple[int, int]], need: int, cutoff: int | None
) -> None:
    entries = [(i.to_bytes(2, "big"), tick, size) for i, (tick, size) in enumerate(raw)]
    random.Random(need).shuffle(entries)
    assert select_victims(entries, need_bytes=need, expire_before_us=cutoff) == _reference(
        entries, need, cutoff
    )


def test_policy_needs_and_validation() -> None:
    p = RetentionPolicy(budget_bytes=100, max_age_s=60)
    assert p.need_bytes(90) == 0
    assert p.need_bytes(90, incoming_bytes=20) == 10
    assert p.need_bytes(120, slack_bytes=5) == 25
    assert p.expire_before_us(100_000_000) == 40_000_000
    assert RetentionPolicy().need_bytes(10**12) == 0
    with pytest.raises(ValueError):
        RetentionPolicy(budget_bytes=-1)
    with pytest.raises(ValueError):
        RetentionPolicy(max_age_s=0)


def test_disk_tier_uses_the_policy_as_its_eviction_choice() -> None:
    # One implementation: the disk tier's puts evict by the retention module's rule.
    from kvstrata.tiers.disk import putter

    assert putter.select_victims is retention.select_victims


# ---- the public store API the tools rely on ----------------------------------------------------


def test_store_api_the_tools_rely_on(tmp_path: Path) -> None:
    with DiskStore(tmp_path, budget_bytes=1 << 30) as store:
        keys = _fill(store, 5, 4096)
        store.register_namespace(NS, {"model": "m"})
        totals = store.read(rec.read_totals)
        stats = store.stats()
        assert totals is not None and (totals.entries, totals.raw_bytes, totals.stored_bytes) == (
            stats["entries"], stats["raw_bytes"], stats["stored_bytes"])
        assert store.read(rec.recount) == (totals, [])
        assert [k for b in store.scan("index", values=False) for k, _ in b] == keys
        assert [k for b in store.scan("payload", values=False) for k, _ in b] == keys
        assert store.key_namespaces() == [NS]
        assert store.read(lambda txn, h: txn.get(rec.META_FORMAT, db=h.meta)) == str(rec.FORMAT_VERSION).encode()
        assert store.write(lambda txn, h: rec.unregister_namespace(txn, h, NS))
        assert store.namespaces() == {}
        # The lock file is the one an open store holds.
        assert rewrite.is_busy(tmp_path)
    assert not rewrite.is_busy(tmp_path)
    assert (tmp_path / rec.LOCK_FILE).exists() and (tmp_path / rec.DATA_FILE).exists()


def test_scan_batches_and_namespace_jumps(tmp_path: Path) -> None:
    other = b"\xff" * 16
    with DiskStore(tmp_path, budget_bytes=1 << 30) as store:
        n = rec.SCAN_BATCH + 7
        store.put_many([(_key(i), b"x" * 8, "uint8") for i in range(n)])
        store.put_many([(_key(i, ns=other), b"y" * 8, "uint8") for i in range(3)])
        batches = list(store.scan("index", prefix=NS))
        assert [len(b) for b in batches] == [rec.SCAN_BATCH, 7]
        assert store.key_namespaces() == [NS, other]
        assert sum(len(b) for b in store.scan("index", prefix=other)) == 3


# ---- online budget ---------------------------------------------------------------------------


def test_sustained_traffic_keeps_the_store_within_its_budget(tmp_path: Path) -> None:
    """A store that only grows is a defect: 20x the budget written, the file stays bounded."""
    budget, size = 2 << 20, 64 << 10
    sizes = []
    with DiskStore(tmp_path, budget_bytes=budget) as store:
        for round_ in range(20):
            _fill(store, budget // size, size, start=round_ * 1000)
            store.sync()
            assert store.stats()["stored_bytes"] <= budget
            sizes.append((tmp_path / "data.mdb").stat().st_size)
        assert store.stats()["evictions"] > 0
    # LMDB reuses freed pages: after warm-up the file stops growing (a few budgets at most).
    assert sizes[-1] <= 4 * budget, sizes
    assert sizes[-1] <= sizes[len(sizes) // 2] + budget, sizes


# ---- eviction --------------------------------------------------------------------------------


def test_evict_keeps_the_most_recently_used(tmp_path: Path) -> None:
    size = 16 << 10
    with DiskStore(tmp_path, budget_bytes=1 << 30, touch_flush_interval_s=0.05) as store:
        keys = _fill(store, 10, size)
        out = bytearray(size)
        for key in keys[:3]:  # used again: now the most recent
            assert store.get_into(key, out) == size
        store.sync()
        frame = len(codec.encode(_noise(size, 0), "uint8"))
        result = evict(store, RetentionPolicy(budget_bytes=3 * frame))
        assert result.evicted == 7
        assert store.contains_many(keys) == [True] * 3 + [False] * 7
        assert result.stored_bytes_after <= 3 * frame


def test_evict_by_age(tmp_path: Path) -> None:
    with DiskStore(tmp_path, budget_bytes=1 << 30) as store:
        keys = _fill(store, 4, 1024)
        newest = max(rec.tick for _, rec in store.iter_index())
        # An hour later, a maximum age of a minute expires everything; of a day, nothing.
        later = newest + 3600 * 1_000_000
        assert evict(store, RetentionPolicy(max_age_s=86400), now=later).evicted == 0
        assert evict(store, RetentionPolicy(max_age_s=60), now=later).evicted == 4
        assert store.contains_many(keys) == [False] * 4
        assert store.stats()["entries"] == 0


# ---- compacting rewrite ----------------------------------------------------------------------


def test_rewrite_gives_the_space_back_and_keeps_every_record(tmp_path: Path) -> None:
    size = 32 << 10
    with DiskStore(tmp_path, budget_bytes=1 << 30) as store:
        keys = _fill(store, 120, size)
        store.delete_many(keys[:100])
    before = (tmp_path / "data.mdb").stat().st_size
    (tmp_path / ".compact-stale").mkdir()  # left by an interrupted run
    with rewrite.exclusive(tmp_path):
        result = rewrite.rewrite_locked(tmp_path)
    assert result.file_bytes_before == before
    assert result.file_bytes_after < before / 4
    assert not list(tmp_path.glob(".compact-*"))
    with DiskStore(tmp_path, budget_bytes=1 << 30) as store:
        assert store.stats()["entries"] == 20
        assert not store.unclean_shutdown
        out = bytearray(size)
        for i, key in enumerate(keys[100:], start=100):
            assert store.get_into(key, out) == size and bytes(out) == _noise(size, i)
        _fill(store, 5, size, start=1000)  # and it takes new writes
        assert store.stats()["entries"] == 25


def test_rewrite_refuses_while_the_store_is_open_elsewhere(tmp_path: Path) -> None:
    with DiskStore(tmp_path, budget_bytes=1 << 30) as store:
        _fill(store, 3, 1024)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from kvstrata.tiers.disk import DiskStore\n"
         f"s = DiskStore({str(tmp_path)!r}, budget_bytes=1 << 30)\n"
         "print('open', flush=True); sys.stdin.read(); s.close()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        before = (tmp_path / "data.mdb").read_bytes()
        with pytest.raises(rewrite.StoreBusyError, match="open by another process"):
            with rewrite.exclusive(tmp_path):
                pytest.fail("the lock must not be granted")
        assert (tmp_path / "data.mdb").read_bytes() == before
    finally:
        child.communicate("", timeout=60)
    assert child.returncode == 0
    assert not rewrite.is_busy(tmp_path)


def test_a_store_opened_during_the_rewrite_waits_for_it(tmp_path: Path) -> None:
    with DiskStore(tmp_path, budget_bytes=1 << 30) as store:
        keys = _fill(store, 3, 1024)
    opened = threading.Event()
    seen: list[int] = []

    def server() -> None:
        with DiskStore(tmp_path, budget_bytes=1 << 30) as s:
            opened.set()
            seen.append(sum(s.contains_many(keys)))

    with rewrite.exclusive(tmp_path):
        t = threading.Thread(target=server)
        t.start()
        # While the lock is held the opener is blocked: it cannot have opened, however long we wait.
        assert not opened.wait(0.3)
        rewrite.rewrite_locked(tmp_path)
    t.join(60)
    assert opened.is_set() and seen == [3]


# ---- archive format --------------------------------------------------------------------------


def _archive(records: int = 3) -> bytes:
    buf = io.BytesIO()
    w = archive.ArchiveWriter(buf, {"created_us": 1, "namespaces": {NS.hex(): {"model": "m"}}})
    for i in range(records):
        frame = codec.encode(_noise(1000 + i, i), "uint8")
        w.add(_key(i), 100 + i, frame, 1000 + i)
    w.finish()
    return buf.getvalue()


def test_archive_round_trip() -> None:
    data = _archive()
    reader = archive.ArchiveReader(io.BytesIO(data))
    recs = list(reader.records())
    assert [r.key for r in recs] == [_key(i) for i in range(3)]
    assert [r.tick for r in recs] == [100, 101, 102]
    assert [codec.decode(r.frame) for r in recs if r.frame] == [_noise(1000 + i, i) for i in range(3)]
    assert reader.summary == archive.ArchiveSummary(3, 3003, sum(r.frame_len for r in recs))
    assert reader.manifest["namespaces"] == {NS.hex(): {"model": "m"}}
    assert archive.peek_summary(io.BytesIO(data)) == reader.summary
    keys_only = archive.ArchiveReader(io.BytesIO(data))
    assert [r.frame for r in keys_only.records(frames=False)] == [None] * 3


def _consume(data: bytes) -> None:
    for _ in archive.ArchiveReader(io.BytesIO(data)).records():
        pass


@pytest.mark.parametrize("seed", range(4))
def test_any_flipped_byte_is_detected(seed: int) -> None:
    data = _archive()
    rng = random.Random(seed)
    for pos in sorted(rng.sample(range(len(data)), 60)) + [0, len(data) - 1, len(data) - 30]:
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(archive.ArchiveError):
            _consume(bytes(bad))


def test_truncation_and_trailing_data_are_detected() -> None:
    data = _archive()
    for cut in range(0, len(data), max(1, len(data) // 97)):
        with pytest.raises(archive.ArchiveError, match="truncated|trailer"):
            _consume(data[:cut])
    with pytest.raises(archive.ArchiveError, match="after the end"):
        _consume(data + b"\0")
    with pytest.raises(archive.ArchiveError, match="not a kvstrata archive"):
        _consume(b"PK\x03\x04" + data)


def test_dropping_or_reordering_whole_records_is_detected() -> None:
    data = _archive(3)
    reader = archive.ArchiveReader(io.BytesIO(data))
    bounds = [reader.offset]
    for _ in reader.records():
        bounds.append(reader.offset)
    # bounds: end of header, then end of each record (the last entry is the end of the trailer)
    head, r0, r1, r2 = (data[a:b] for a, b in zip([0, *bounds[:3]], bounds[:4], strict=True))
    tail = data[bounds[3]:]
    assert head + r0 + r1 + r2 + tail == data
    with pytest.raises(archive.ArchiveError, match="missing or were spliced"):
        _consume(head + r0 + r2 + tail)
    with pytest.raises(archive.ArchiveError, match="whole-archive checksum"):
        _consume(head + r1 + r0 + r2 + tail)
