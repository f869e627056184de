"""A store never serves another key's bytes and never stops serving because of one bad byte.

Each test damages a real store the way a tester found it could break — a record read under
another key, a damaged totals record, index record or namespace entry, damaged key bytes, an
empty data file — and checks that reads stay safe (a counted miss, never wrong bytes, never an
exception), that the operator's tools report it, and that ``verify --repair`` then ``verify``
says sound. Damage is done with raw ``lmdb`` or on the file's bytes, as bit rot would.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from kvstrata.tiers import codec
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore, StoreFormatError
from kvstrata.tools.cli import main

NS = bytes.fromhex("c3" * 16)
CHUNK = 16 << 10


def _key(i: int, group: int = 0) -> bytes:
    return NS + i.to_bytes(32, "big") + group.to_bytes(4, "big")


def _kv(seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal(CHUNK // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _make(path: Path, n: int = 8, **kw: Any) -> dict[bytes, bytes]:
    records = {_key(i): _kv(i) for i in range(n)}
    with DiskStore(path, budget_bytes=1 << 30, **kw) as store:
        store.register_namespace(NS, {"model": "/models/m"})
        assert store.put_many([(k, v, "bfloat16") for k, v in records.items()]) == n
    return records


def _raw(path: Path, fn: Any) -> None:
    """Change the store with raw LMDB (a damaged store, as the tools must meet it)."""
    with lmdb.open(str(path), max_dbs=4) as env, env.begin(write=True) as txn:
        h = rec.Handles.open(env, txn)
        fn(txn, h)


def _read(store: DiskStore, key: bytes) -> bytes | None:
    out = bytearray(CHUNK)
    n = store.get_into(key, out)
    return None if n is None else bytes(out[:n])


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    cmd, *rest = argv
    rc = main([cmd, "--json", *rest])
    out, _ = capsys.readouterr()
    return rc, json.loads(out) if out.strip() else {}


def _repaired_then_sound(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, Any]:
    rc, first = _cli(capsys, "verify", str(path))
    assert rc == 1, first
    rc, fixed = _cli(capsys, "verify", str(path), "--repair")
    assert rc == 0 and fixed["status"] == "repaired", fixed
    rc, again = _cli(capsys, "verify", str(path))
    assert rc == 0 and again["status"] == "sound", again
    return first


# ---- 1. a record is bound to its key ----------------------------------------------------------


@pytest.mark.parametrize("codec_mode", ["raw", "auto"])
@pytest.mark.parametrize("what", ["payload", "payload+index"])
def test_a_read_that_lands_on_another_keys_record_is_a_miss(tmp_path: Path, codec_mode: str, what: str) -> None:
    """What a damaged page number in the B-tree does: the lookup of A finds B's frame (and, when
    the index leaf is redirected too, B's index record). Same-length frames (raw codec) used to
    be served as A's KV: well formed, checksum valid, wrong."""
    path = tmp_path / "s"
    records = _make(path, codec=codec_mode)
    a, b = _key(1), _key(2)

    def redirect(txn: lmdb.Transaction, h: rec.Handles) -> None:
        txn.put(a, txn.get(b, db=h.payload), db=h.payload)
        if what == "payload+index":
            txn.put(a, txn.get(b, db=h.index), db=h.index)

    _raw(path, redirect)
    with DiskStore(path, budget_bytes=1 << 30) as store:
        assert _read(store, a) is None
        assert _read(store, b) == records[b]
        assert store.stats()["corrupt"] == 1


def test_a_frame_decodes_only_under_its_own_key() -> None:
    data = _kv(7)
    frame = codec.encode(data, "bfloat16", key=_key(1))
    assert codec.decode(frame, key=_key(1)) == data
    with pytest.raises(codec.CorruptRecord):
        codec.decode(frame, key=_key(2))


def test_frames_of_version_1_still_read(tmp_path: Path) -> None:
    """A store written before frames were bound to keys: an unseeded (version 1) frame whose
    index record matches it is served."""
    path = tmp_path / "s"
    records = _make(path, n=2)
    k = _key(0)
    v1 = bytearray(codec.encode(records[k], "bfloat16"))  # unbound: seed 0
    v1[4] = 1  # the version byte
    info = codec.frame_info(bytes(v1))

    def downgrade(txn: lmdb.Transaction, h: rec.Handles) -> None:
        old = rec.decode_index(txn.get(k, db=h.index))
        assert old is not None
        txn.put(k, bytes(v1), db=h.payload)
        txn.put(k, rec.encode_index(rec.index_record(k, info, len(v1), old.tick)), db=h.index)

    _raw(path, downgrade)
    with DiskStore(path, budget_bytes=1 << 30) as store:
        assert _read(store, k) == records[k]


def test_an_archive_record_spliced_under_another_key_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstrata.compaction.archive import ArchiveWriter

    path = tmp_path / "s"
    records = _make(path, n=2)
    archive = tmp_path / "a.kvs"
    with open(archive, "wb") as out:
        writer = ArchiveWriter(out, {"format": "kvstrata-archive", "namespaces": {}})
        # Well-formed archive digests, but key 1 carries key 0's frame.
        writer.add(_key(1), 1, codec.encode(records[_key(0)], "bfloat16", key=_key(0)), CHUNK)
        writer.finish()
    rc, report = _cli(capsys, "import", str(archive), str(tmp_path / "target"))
    assert rc != 0 and not (tmp_path / "target" / rec.DATA_FILE).exists()


# ---- 2. one bad byte does not take the store down ----------------------------------------------


def test_a_damaged_totals_record_is_recounted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s"
    records = _make(path)
    _raw(path, lambda txn, h: txn.put(rec.META_TOTALS, b"\xc1\xff\x00garbage!", db=h.meta))
    with DiskStore(path, budget_bytes=1 << 30) as store:
        stats = store.stats()  # the scheduler asks every second: it must not raise
        assert stats["entries"] == len(records)
        assert store.put_many([(_key(100), _kv(100), "bfloat16")]) == 1
        assert _read(store, _key(100)) == _kv(100)
    rc, report = _cli(capsys, "inspect", str(path))
    assert rc == 0 and report["chunks"] == len(records) + 1
    # The put rewrote the totals from a recount: nothing left to repair.
    rc, report = _cli(capsys, "verify", str(path))
    assert rc == 0 and report["status"] == "sound", report
    _raw(path, lambda txn, h: txn.put(rec.META_TOTALS, b"\xc1", db=h.meta))
    first = _repaired_then_sound(capsys, path)
    assert not first["totals_readable"]


def test_an_undecodable_index_record_is_skipped_and_dropped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s"
    records = _make(path)
    bad = _key(3)
    _raw(path, lambda txn, h: txn.put(bad, b"\xc1not msgpack", db=h.index))
    # A budget that forces evictions on the next puts: they must not be dropped because of it.
    with DiskStore(path, budget_bytes=6 * CHUNK) as store:
        assert {k for k, _ in store.iter_index()} == set(records) - {bad}
        assert _read(store, bad) is None
        assert store.put_many([(_key(100 + i), _kv(100 + i), "bfloat16") for i in range(4)]) == 4
        assert store.stats()["index_unreadable"] >= 1
    first = _repaired_then_sound(capsys, path) if _has_bad(path, bad) else None
    if first is not None:
        assert any(b["problem"] == rec.INDEX_UNREADABLE for b in first["bad"])


def _has_bad(path: Path, key: bytes) -> bool:
    with lmdb.open(str(path), max_dbs=4, readonly=True, lock=False) as env, env.begin() as txn:
        return txn.get(key, db=env.open_db(rec.DB_INDEX, txn=txn, create=False)) is not None


def test_the_background_check_drops_an_undecodable_index_record(tmp_path: Path) -> None:
    path = tmp_path / "s"
    records = _make(path, n=6)
    bad = _key(2)

    def damage(txn: lmdb.Transaction, h: rec.Handles) -> None:
        txn.put(bad, b"\xc1", db=h.index)
        txn.put(rec.META_CLEAN, b"0", db=h.meta)  # as after an unclean shutdown

    _raw(path, damage)
    with DiskStore(path, budget_bytes=1 << 30) as store:
        assert store.unclean_shutdown and store.wait_recovery(30)
        assert store.stats()["recovery_checked"] == len(records)
    assert not _has_bad(path, bad)
    with DiskStore(path, budget_bytes=1 << 30) as store:
        assert not store.unclean_shutdown  # the check ran to the end: marked clean
        assert store.stats()["entries"] == len(records) - 1


def test_an_undecodable_namespace_entry_is_reported_and_removed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s"
    _make(path)
    other = bytes.fromhex("d4" * 16)
    _raw(path, lambda txn, h: txn.put(rec.META_NS + other, b"{not json", db=h.meta))
    rc, report = _cli(capsys, "inspect", str(path))
    assert rc == 0 and report["unreadable_namespace_entries"] == [other.hex()]
    rc, report = _cli(capsys, "export", str(path), str(tmp_path / "a.kvs"))
    assert rc == 0 and report["records"] == 8
    first = _repaired_then_sound(capsys, path)
    assert first["unreadable_namespace_entries"] == [other.hex()]
    with DiskStore(path, budget_bytes=1 << 30, readonly=True, create=False) as store:
        assert set(store.namespaces()) == {NS}


def test_damaged_key_bytes_are_repaired_in_one_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A byte of one payload's stored key flipped in the file (the index keeps the right key):
    reads never serve wrong bytes, and one --repair leaves a store a second verify calls sound
    (the orphan with the damaged key used to survive the repair)."""
    path = tmp_path / "s"
    records = _make(path)
    victim = _key(5)
    flipped = 0
    with open(path / rec.DATA_FILE, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(victim)
        while at >= 0:
            # An index entry's key is followed by its msgpack record (a 7-element array, 0x97);
            # a payload entry's (a value on overflow pages) by a page number.
            if mm[at + len(victim)] != 0x97:
                mm[at + 20] ^= 0x5A
                flipped += 1
            at = mm.find(victim, at + 1)
        mm.flush()
    assert flipped
    with DiskStore(path, budget_bytes=1 << 30) as store:
        for k, v in records.items():
            assert _read(store, k) in (v, None)
    _repaired_then_sound(capsys, path)
    with DiskStore(path, budget_bytes=1 << 30) as store:
        served = {k: _read(store, k) for k in records}
    assert all(v in (records[k], None) for k, v in served.items())
    # The damaged key also puts its neighbours out of the B-tree's order: they are lost too.
    assert sum(v is not None for v in served.values()) >= len(records) // 2


def test_an_empty_data_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s"
    path.mkdir()
    (path / rec.DATA_FILE).write_bytes(b"")
    with pytest.raises(StoreFormatError, match="empty"):
        DiskStore(path, budget_bytes=1 << 30, create=False)
    for cmd in ("inspect", "verify"):
        rc = main([cmd, str(path)])
        err = capsys.readouterr().err
        assert rc == 2 and "empty" in err and "Bad file descriptor" not in err


def test_inspect_beside_a_live_writer_finds_the_totals_consistent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """inspect compares the running totals with the index in one transaction: a server writing
    meanwhile cannot make them look inconsistent (it used to send the operator to verify)."""
    path = tmp_path / "s"
    _make(path)
    stop = tmp_path / "stop"
    script = (
        "import sys, numpy as np\n"
        "from pathlib import Path\n"
        "from kvstrata.tiers.disk import DiskStore\n"
        f"ns = bytes.fromhex({NS.hex()!r})\n"
        "with DiskStore(sys.argv[1], budget_bytes=1 << 30) as s:\n"
        "    i = 1000\n"
        "    while not Path(sys.argv[2]).exists():\n"
        "        k = ns + i.to_bytes(32, 'big') + (0).to_bytes(4, 'big')\n"
        "        s.put_many([(k, np.full(8192, i % 251, np.uint16).tobytes(), 'bfloat16')])\n"
        "        i += 1\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", script, str(path), str(stop)])
    try:
        for _ in range(5):
            rc, report = _cli(capsys, "inspect", str(path))
            assert rc == 0 and report["totals_consistent"], report
    finally:
        stop.touch()
        assert writer.wait(60) == 0


def test_repair_rebuild_keeps_every_sound_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``verify --repair --rebuild``: a store that stopped admitting chunks (its free-page list
    damaged where verify cannot see it) is rebuilt from its records; nothing sound is lost."""
    path = tmp_path / "s"
    records = _make(path)
    rc, report = _cli(capsys, "verify", str(path), "--repair", "--rebuild")
    assert rc == 0 and report["status"] == "rebuilt" and report["rebuilt"] == {"kept": 8, "left_out": 0}
    rc, report = _cli(capsys, "verify", str(path))
    assert rc == 0 and report["status"] == "sound"
    with DiskStore(path, budget_bytes=1 << 30) as store:
        assert {k: _read(store, k) for k in records} == records
        assert store.namespaces() == {NS: {"model": "/models/m"}}
