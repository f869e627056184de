"""The store tools through the real CLI (``kvstrata.tools.cli.main``) on real stores.

Each command is exercised on a store built with ``DiskStore``; bad input must give a one-line
error, a non-zero exit status, and lose nothing.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tools.cli import main

NS_A = bytes.fromhex("a1" * 16)
NS_B = bytes.fromhex("b2" * 16)
CHUNK = 16 << 10  # raw bytes per chunk
PER_GROUP = 12


def _kv(seed: int, n: int = CHUNK) -> bytes:
    """bf16-like KV: compressible exponent bytes, random mantissas (like real KV)."""
    x = np.random.default_rng(seed).standard_normal(n // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _key(ns: bytes, i: int, group: int) -> bytes:
    return ns + i.to_bytes(32, "big") + group.to_bytes(4, "big")


def _expected() -> dict[bytes, bytes]:
    """Two namespaces x two groups x PER_GROUP chunks: key -> raw bytes."""
    return {
        _key(ns, i, g): _kv(ns[0] * 1000 + g * 100 + i)
        for ns in (NS_A, NS_B)
        for g in (0, 1)
        for i in range(PER_GROUP)
    }


@pytest.fixture
def records() -> dict[bytes, bytes]:
    return _expected()


@pytest.fixture
def store_dir(tmp_path: Path, records: dict[bytes, bytes]) -> Path:
    path = tmp_path / "store"
    with DiskStore(path, budget_bytes=1 << 30) as store:
        store.register_namespace(NS_A, {"model": "/models/a", "dtype": "bfloat16", "tp_rank": 0, "tp_size": 1})
        store.register_namespace(NS_B, {"model": "/models/b", "dtype": "bfloat16", "tp_rank": 0, "tp_size": 1})
        assert store.put_many([(k, v, "bfloat16") for k, v in records.items()]) == len(records)
    return path


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    """Run ``kvstrata --json ...``; returns (exit status, parsed stdout or {}, stderr)."""
    cmd, *rest = argv
    rc = main([cmd, "--json", *rest])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip() else {}), err


def _served(path: Path) -> dict[bytes, bytes]:
    """Every record the store serves, read through DiskStore.get_into."""
    out: dict[bytes, bytes] = {}
    with DiskStore(path, budget_bytes=1 << 30, create=False) as store:
        keys = [k for b in store.scan("index", values=False) for k, _ in b]
        for key in keys:
            buf = bytearray(CHUNK)
            n = store.get_into(key, buf)
            assert n == CHUNK, key.hex()
            out[key] = bytes(buf)
    return out


def _flip_payload_byte(path: Path, key: bytes) -> None:
    """Flip one bit of ``key``'s payload where it lies in data.mdb (bit rot, not an API write)."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        frame = txn.get(key, db=env.open_db(b"payload", txn=txn, create=False))
    env.close()
    needle = frame[len(frame) // 2 : len(frame) // 2 + 48]
    data = path / "data.mdb"
    blob = bytearray(data.read_bytes())
    pos = blob.find(needle)
    assert pos >= 0, "the payload is not in data.mdb"
    # A freed page may still hold an older copy of it (LMDB copies pages on write; one CI run
    # found two): flip the bit in every copy, so the live one is hit whichever it is.
    while pos >= 0:
        blob[pos + 7] ^= 0x10
        pos = blob.find(needle, pos + 1)
    data.write_bytes(bytes(blob))


# ---- inspect ---------------------------------------------------------------------------------


def test_inspect_reports_namespaces_groups_bytes_and_budget(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, r, _ = _cli(capsys, "inspect", str(store_dir), "--budget", "1MiB")
    assert rc == 0
    assert r["format_version"] == 1 and r["clean_shutdown"] is True
    assert r["chunks"] == 4 * PER_GROUP and r["raw_bytes"] == 4 * PER_GROUP * CHUNK
    assert 1.2 < r["compression_ratio"] < 2.0  # byte planes + zstd on bf16-like data
    assert r["budget_bytes"] == 1 << 20 and r["budget_use"] == pytest.approx(r["stored_bytes"] / (1 << 20), rel=1e-3)
    assert r["totals_consistent"] and r["unreadable_index_records"] == 0
    by_ns = {ns["fingerprint"]: ns for ns in r["namespaces"]}
    assert set(by_ns) == {NS_A.hex(), NS_B.hex()}
    assert by_ns[NS_A.hex()]["model"] == "/models/a" and by_ns[NS_A.hex()]["tp_rank"] == 0
    assert by_ns[NS_B.hex()]["chunks_per_group"] == {"0": PER_GROUP, "1": PER_GROUP}
    assert r["age_histogram"][0]["chunks"] == 4 * PER_GROUP  # all used within the last minute
    assert r["age_histogram"][-1]["cumulative_stored_bytes"] == r["stored_bytes"]
    # The human report names the same things.
    assert main(["inspect", str(store_dir)]) == 0
    text = capsys.readouterr().out
    assert NS_A.hex() in text and "/models/b" in text and "group 1: 12" in text


# What the ``kvstrata`` console script runs.
KVSTRATA = [sys.executable, "-c", "import sys; from kvstrata.tools.cli import main; sys.exit(main())"]


def test_cli_as_a_subprocess(store_dir: Path) -> None:
    proc = subprocess.run(
        [*KVSTRATA, "verify", "--json", str(store_dir)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "sound"
    missing = subprocess.run(
        [*KVSTRATA, "inspect", str(store_dir / "nope")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "does not exist" in missing.stderr


# ---- verify ----------------------------------------------------------------------------------


def test_corrupt_byte_is_found_and_repair_drops_only_it(
    store_dir: Path, records: dict[bytes, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    victim = _key(NS_A, 5, 1)
    _flip_payload_byte(store_dir, victim)

    rc, r, _ = _cli(capsys, "verify", str(store_dir))
    assert rc == 1
    assert r["bad_count"] == 1 and r["checked"] == len(records)
    assert r["bad"][0]["key"] == victim.hex() and "checksum" in r["bad"][0]["problem"]
    assert r["bad"][0]["namespace"] == NS_A.hex() and r["bad"][0]["group"] == 1

    rc, r, _ = _cli(capsys, "verify", str(store_dir), "--repair")
    assert rc == 0 and r["repaired"]["dropped"] == 1

    served = _served(store_dir)
    assert set(served) == set(records) - {victim}
    assert all(served[k] == records[k] for k in served)
    rc, r, _ = _cli(capsys, "verify", str(store_dir))
    assert rc == 0 and r["status"] == "sound" and r["checked"] == len(records) - 1


def test_verify_finds_a_store_larger_than_lmdbs_default_map_sound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The write probe opens the store itself: with lmdb.open's 10 MiB default map it failed with
    MapFullError on every store past 10 MiB and reported a sound store as unwritable."""
    path = tmp_path / "big"
    rng = np.random.default_rng(7)
    with DiskStore(path, budget_bytes=1 << 30) as store:
        store.put_many([(_key(NS_A, i, 0), rng.bytes(1 << 20), "uint8") for i in range(14)])
    assert (path / "data.mdb").stat().st_size > 12 << 20
    rc, report, err = _cli(capsys, "verify", str(path))
    assert rc == 0 and report["status"] == "sound", (report, err)


def test_verify_finds_orphans_missing_payloads_and_bad_totals(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan, hollow = _key(NS_B, 99, 0), _key(NS_A, 0, 0)
    with DiskStore(store_dir, budget_bytes=1 << 30, create=False) as store:

        def damage(txn: Any, h: rec.Handles) -> None:
            txn.put(orphan, b"stray payload", db=h.payload)
            txn.delete(hollow, db=h.payload)
            totals = rec.read_totals(txn, h)
            assert totals is not None
            totals.stored_bytes += 12345
            rec.write_totals(txn, h, totals)

        store.write(damage)
    rc, r, _ = _cli(capsys, "verify", str(store_dir))
    assert rc == 1 and not r["totals_consistent"]
    assert {(b["key"], b["problem"]) for b in r["bad"]} == {
        (orphan.hex(), "payload without index record"),
        (hollow.hex(), "payload missing"),
    }
    rc, r, _ = _cli(capsys, "verify", str(store_dir), "--repair")
    assert rc == 0 and r["repaired"] == {"dropped": 2, "already_gone": 0, "namespace_entries_removed": 0,
                                         "totals_recounted": True}
    rc, r, _ = _cli(capsys, "verify", str(store_dir))
    assert rc == 0 and r["totals_consistent"] and r["checked"] == 4 * PER_GROUP - 1


# ---- compact ---------------------------------------------------------------------------------


def test_compact_evicts_lru_to_the_budget_and_the_file_shrinks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "big"
    raw = {_key(NS_A, i, 0): _kv(i, 64 << 10) for i in range(96)}
    with DiskStore(path, budget_bytes=1 << 30, touch_flush_interval_s=0.05) as store:
        store.put_many([(k, v, "bfloat16") for k, v in raw.items()])
        recent = list(raw)[:8]
        for key in recent:  # the oldest stores, used again: they must survive
            assert store.get_into(key, bytearray(64 << 10)) == 64 << 10
        store.sync()
        per_chunk = store.stats()["stored_bytes"] / len(raw)
    before = (path / "data.mdb").stat().st_size
    budget = int(per_chunk * 20)
    rc, r, _ = _cli(capsys, "compact", str(path), "--budget", str(budget))
    assert rc == 0 and r["rewritten"]
    assert r["stored_bytes"] <= budget and r["evicted"] == len(raw) - r["chunks"]
    after = (path / "data.mdb").stat().st_size
    assert r["file_bytes_before"] == before and r["file_bytes_after"] == after
    assert after < before / 3, (before, after)
    served = {}
    with DiskStore(path, budget_bytes=1 << 30, create=False) as store:
        assert store.contains_many(recent) == [True] * len(recent)
        for key in raw:
            buf = bytearray(64 << 10)
            if store.get_into(key, buf) is not None:
                served[key] = bytes(buf)
    assert len(served) == r["chunks"] and all(raw[k] == v for k, v in served.items())


@contextlib.contextmanager
def _open_in_another_process(path: Path) -> Iterator[None]:
    """A 'server': another process holding the store open until the block ends."""
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from kvstrata.tiers.disk import DiskStore\n"
         f"s = DiskStore({str(path)!r}, budget_bytes=1 << 30, create=False)\n"
         "print('open', flush=True); sys.stdin.read(); s.close()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        yield
    finally:
        child.communicate("", timeout=60)
    assert child.returncode == 0


def test_compact_refuses_while_the_store_is_open_and_changes_nothing(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _open_in_another_process(store_dir):
        before = (store_dir / "data.mdb").read_bytes()
        rc, _, err = _cli(capsys, "compact", str(store_dir), "--budget", "1KiB")
        assert rc == 2 and "open by another process" in err and "--no-rewrite" in err
        assert (store_dir / "data.mdb").read_bytes() == before
        # Eviction alone is safe alongside it.
        rc, r, _ = _cli(capsys, "compact", str(store_dir), "--max-age", "1d", "--no-rewrite")
        assert rc == 0 and r["evicted"] == 0 and not r["rewritten"]
    assert len(_served(store_dir)) == 4 * PER_GROUP


# ---- purge -----------------------------------------------------------------------------------


def test_purge_removes_one_namespace_only(
    store_dir: Path, records: dict[bytes, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, r, _ = _cli(capsys, "purge", str(store_dir), "--fingerprint", NS_A.hex()[:4])
    assert rc == 0 and r["fingerprint"] == NS_A.hex() and r["chunks_removed"] == 2 * PER_GROUP
    assert r["model"] == "/models/a" and r["unregistered"]
    served = _served(store_dir)
    assert set(served) == {k for k in records if k.startswith(NS_B)}
    assert all(served[k] == records[k] for k in served)
    with DiskStore(store_dir, budget_bytes=1 << 30, create=False) as store:
        assert set(store.namespaces()) == {NS_B}
    rc, r, _ = _cli(capsys, "verify", str(store_dir))
    assert rc == 0


@pytest.mark.parametrize(
    ("fingerprint", "message"),
    [("zz", "not hexadecimal"), ("c3", "no namespace starts with c3"), ("", "not hexadecimal")],
)
def test_purge_bad_fingerprint_is_an_error_that_removes_nothing(
    store_dir: Path, capsys: pytest.CaptureFixture[str], fingerprint: str, message: str
) -> None:
    rc, _, err = _cli(capsys, "purge", str(store_dir), "--fingerprint", fingerprint)
    assert rc == 2 and message in err
    assert len(_served(store_dir)) == 4 * PER_GROUP


def test_ambiguous_fingerprint_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s"
    with DiskStore(path, budget_bytes=1 << 30) as store:
        store.put_many([(_key(bytes.fromhex("ab" + "00" * 15), 1, 0), _kv(1), "bfloat16"),
                        (_key(bytes.fromhex("ab" + "11" * 15), 1, 0), _kv(2), "bfloat16")])
    rc, _, err = _cli(capsys, "purge", str(path), "--fingerprint", "ab")
    assert rc == 2 and "ambiguous" in err
    rc, r, _ = _cli(capsys, "purge", str(path), "--fingerprint", "ab11")
    assert rc == 0 and r["chunks_removed"] == 1 and not r["unregistered"]


# ---- export / import -------------------------------------------------------------------------


def test_export_import_round_trip_serves_the_same_records(
    store_dir: Path, records: dict[bytes, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arc = tmp_path / "cache.kva"
    rc, r, _ = _cli(capsys, "export", str(store_dir), str(arc))
    assert rc == 0 and r["records"] == len(records) and r["skipped_corrupt"] == 0
    assert not list(tmp_path.glob(".cache.kva.partial-*"))

    other = tmp_path / "elsewhere" / "store"
    rc, r, _ = _cli(capsys, "import", str(arc), str(other))
    assert rc == 0 and r["created_store"] and r["imported"] == len(records)
    assert _served(other) == records
    with DiskStore(other, budget_bytes=1 << 30, create=False) as store:
        assert set(store.namespaces()) == {NS_A, NS_B}
        assert store.namespaces()[NS_A]["model"] == "/models/a"
    rc, r, _ = _cli(capsys, "verify", str(other))
    assert rc == 0 and r["checked"] == len(records)

    # Importing again changes nothing; exporting over an existing file needs --force.
    rc, r, _ = _cli(capsys, "import", str(arc), str(other))
    assert rc == 0 and r["imported"] == 0 and r["already_present"] == len(records)
    rc, _, err = _cli(capsys, "export", str(store_dir), str(arc))
    assert rc == 2 and "--force" in err


def test_export_one_namespace(
    store_dir: Path, records: dict[bytes, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arc = tmp_path / "b.kva"
    rc, r, _ = _cli(capsys, "export", str(store_dir), str(arc), "--fingerprint", NS_B.hex()[:6])
    assert rc == 0 and r["records"] == 2 * PER_GROUP and r["namespaces"] == [NS_B.hex()]
    rc, r, _ = _cli(capsys, "import", str(arc), str(tmp_path / "only-b"))
    assert rc == 0
    assert _served(tmp_path / "only-b") == {k: v for k, v in records.items() if k.startswith(NS_B)}


def test_import_into_a_store_with_a_small_budget_evicts_by_the_policy(
    store_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arc = tmp_path / "a.kva"
    assert _cli(capsys, "export", str(store_dir), str(arc))[0] == 0
    rc, r, _ = _cli(capsys, "import", str(arc), str(tmp_path / "small"), "--budget", "64KiB")
    assert rc == 2  # the archive alone is larger than the budget: refused, nothing created
    assert not (tmp_path / "small").exists()
    target = tmp_path / "half"
    _build_single(target, 4)
    # One byte short of holding both: at least one record must go, the least recently used.
    budget = _stored(store_dir) + _stored(target) - 1
    rc, r, _ = _cli(capsys, "import", str(arc), str(target), "--budget", str(budget))
    assert rc == 0 and r["evicted_for_budget"] >= 1 and r["stored_bytes"] <= r["budget_bytes"]
    assert _cli(capsys, "verify", str(target))[0] == 0


def _stored(path: Path) -> int:
    with DiskStore(path, budget_bytes=1 << 30, create=False) as store:
        return int(store.stats()["stored_bytes"])


def _build_single(path: Path, n: int) -> None:
    with DiskStore(path, budget_bytes=1 << 30) as store:
        store.put_many([(_key(b"\x07" * 16, i, 0), _kv(1000 + i), "bfloat16") for i in range(n)])


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_bad_archive_is_rejected_and_nothing_is_imported(
    store_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    arc = tmp_path / "a.kva"
    assert _cli(capsys, "export", str(store_dir), str(arc))[0] == 0
    data = bytearray(arc.read_bytes())
    if damage == "flip":
        data[len(data) * 2 // 3] ^= 0x01
    elif damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data[:] = b"this is not an archive" * 10
    arc.write_bytes(bytes(data))

    target = tmp_path / "target"
    _build_single(target, 3)
    before = _served(target)
    rc, _, err = _cli(capsys, "import", str(arc), str(target))
    assert rc == 2 and "nothing was imported" in err and err.count("\n") == 1
    expected = {"flip": "checksum", "truncate": "truncated", "garbage": "not a kvstrata archive"}
    assert expected[damage] in err
    assert _served(target) == before
    rc, r, _ = _cli(capsys, "verify", str(target))  # no stray payloads either
    assert rc == 0 and r["bad_count"] == 0
    rc, _, _ = _cli(capsys, "import", str(arc), str(tmp_path / "new"))
    assert rc == 2 and not (tmp_path / "new").exists()


def test_failed_commit_rolls_back_the_payloads(
    store_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.tools import archive_import

    arc = tmp_path / "a.kva"
    assert _cli(capsys, "export", str(store_dir), str(arc))[0] == 0
    target = tmp_path / "target"
    _build_single(target, 3)
    before = _served(target)

    def boom(*_: Any, **__: Any) -> int:
        raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL")

    monkeypatch.setattr(archive_import, "_evict_over_budget", boom)
    rc, _, err = _cli(capsys, "import", str(arc), str(target))
    assert rc == 2 and "nothing was imported" in err
    assert _served(target) == before
    rc, r, _ = _cli(capsys, "verify", str(target))
    assert rc == 0 and r["bad_count"] == 0  # the unindexed payloads were removed again


# ---- bad directories -------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "verify", "compact", "export", "purge"])
def test_missing_or_foreign_directory_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    extra = {"export": [str(tmp_path / "x.kva")], "purge": ["--fingerprint", "ab"]}.get(command, [])
    rc, _, err = _cli(capsys, command, str(tmp_path / "missing"), *extra)
    assert rc == 2 and "does not exist" in err
    assert not (tmp_path / "missing").exists()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    rc, _, err = _cli(capsys, command, str(foreign), *extra)
    assert rc == 2 and "not a kvstrata store" in err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]

    other_lmdb = tmp_path / "other-lmdb"
    env = lmdb.open(str(other_lmdb))
    with env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data")
    env.close()
    snapshot = (other_lmdb / "data.mdb").read_bytes()
    rc, _, err = _cli(capsys, command, str(other_lmdb), *extra)
    assert rc == 2 and "not a kvstrata store" in err, err
    assert (other_lmdb / "data.mdb").read_bytes() == snapshot
    assert sorted(p.name for p in other_lmdb.iterdir()) == ["data.mdb", "lock.mdb"]  # no litter
    assert not (tmp_path / "x.kva").exists()


def test_import_refuses_a_foreign_directory(
    store_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arc = tmp_path / "a.kva"
    assert _cli(capsys, "export", str(store_dir), str(arc))[0] == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    rc, _, err = _cli(capsys, "import", str(arc), str(foreign))
    assert rc == 2 and "not a kvstrata store" in err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    rc, _, err = _cli(capsys, "import", str(tmp_path / "nope.kva"), str(foreign))
    assert rc == 2 and "no archive" in err
    other_lmdb = tmp_path / "other-lmdb"
    env = lmdb.open(str(other_lmdb))
    with env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data")
    env.close()
    rc, _, err = _cli(capsys, "import", str(arc), str(other_lmdb))
    assert rc == 2 and "not a kvstrata store" in err
    assert sorted(p.name for p in other_lmdb.iterdir()) == ["data.mdb", "lock.mdb"]


def test_bad_size_argument_is_a_usage_error(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compact", str(store_dir), "--budget", "4 furlongs"])
    assert exc.value.code == 2
    assert "invalid size value" in capsys.readouterr().err


# ---- warmup: everything checked before any engine starts -------------------------------------


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        ('{"prompt": "a", "prompt_token_ids": [1]}', "exactly one of"),
        ('{"text": "a"}', "exactly one of"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"prompt_token_ids": [1, -2]}', "token ids"),
        ('{"prompt_token_ids": [1, true]}', "token ids"),
        ('{"prompt_token_ids": []}', "token ids"),
    ],
)
def test_warmup_names_the_bad_corpus_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, problem: str
) -> None:
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text('{"prompt": "hello"}\n\n{"prompt_token_ids": [5, 6, 7]}\n' + line + "\n")
    store = tmp_path / "store"
    rc, _, err = _cli(capsys, "warmup", "--model", str(tmp_path), "--prompts", str(corpus),
                      "--store", str(store))
    assert rc == 2 and f"{corpus}:4:" in err and problem in err, err
    assert not store.exists()


def test_warmup_reads_the_corpus_in_order() -> None:
    from kvstrata.tools.warmup_corpus import parse_line

    assert parse_line(Path("p"), 1, "   \n") is None
    p = parse_line(Path("p"), 2, '{"prompt": "hi", "id": 3}')
    assert p is not None and (p.line, p.text, p.token_ids) == (2, "hi", None)
    q = parse_line(Path("p"), 3, '{"prompt_token_ids": [0, 9]}')
    assert q is not None and q.token_ids == [0, 9]


def test_warmup_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text('{"prompt": "hello"}\n')
    base = ["warmup", "--prompts", str(corpus)]
    rc, _, err = _cli(capsys, *base, "--model", str(tmp_path / "nope"), "--store", str(tmp_path / "s"))
    assert rc == 2 and "no model at" in err
    rc, _, err = _cli(capsys, "warmup", "--prompts", str(tmp_path / "none.jsonl"), "--model",
                      str(tmp_path), "--store", str(tmp_path / "s"))
    assert rc == 2 and "no prompts file" in err
    (tmp_path / "empty.jsonl").write_text("\n\n")
    rc, _, err = _cli(capsys, "warmup", "--prompts", str(tmp_path / "empty.jsonl"), "--model",
                      str(tmp_path), "--store", str(tmp_path / "s"))
    assert rc == 2 and "holds no prompts" in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    rc, _, err = _cli(capsys, *base, "--model", str(tmp_path), "--store", str(foreign))
    assert rc == 2 and "not a kvstrata store" in err
    assert not (tmp_path / "s").exists()
