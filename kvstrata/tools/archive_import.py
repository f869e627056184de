"""``kvstrata import ARCHIVE DIR``: verify an archive, then merge it into a store, all or nothing.

Three streaming passes over the archive (never more than one record in memory):

1. **verify**: every header, record and payload checksum, the frames' headers, the trailer's
   counts and the whole-archive digest. A bad archive is rejected here, before the store is
   opened (or created).
2. **payloads**: frames of records the store lacks are written as they are (no recompression) in
   short write transactions, checksums re-checked on the way. They have no index record yet, so
   no lookup can see them: the store's contents are unchanged as far as any reader knows.
3. **commit**: one write transaction indexes every new record (sizes and checksums taken from the
   frame just written), registers the archive's namespaces, updates the totals and evicts by the
   retention policy if the budget is exceeded. Committed whole or not at all.

If pass 2 or 3 fails, the unindexed payloads written by pass 2 are deleted again (and a store
created for the import is removed). A crash in between leaves only such unindexed payloads,
which no lookup sees and ``kvstrata verify --repair`` (or the store's own recovery after an
unclean shutdown) drops.

Access ticks keep their age relative to the export: a chunk used an hour before the export
counts as used an hour before the import.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from pathlib import Path
from typing import IO, Any

import lmdb

from kvstrata.compaction.archive import ArchiveError, ArchiveReader, ArchiveRecord, peek_summary
from kvstrata.config import DEFAULT_DISK_BYTES
from kvstrata.tiers import codec
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore, StoreUnavailableError
from kvstrata.tiers.retention import RetentionPolicy
from kvstrata.tools import support as ts
from kvstrata.tools.cli import CLIError

# Payload write transactions: one per large frame, small ones batched (docs/STORAGE.md).
_LARGE = 256 << 10
_BATCH_RECORDS = 64


class _Vanished(Exception):
    """A payload written by pass 2 is gone at commit time (another process dropped it)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archive", type=Path, metavar="ARCHIVE", help="archive file written by `kvstrata export`")
    parser.add_argument("dir", type=Path, metavar="DIR", help="store directory (created when missing or empty)")
    parser.add_argument(
        "--budget",
        type=ts.size_arg,
        default=None,
        metavar="BYTES",
        help="the store's disk budget, e.g. 64GiB: the least recently used chunks are evicted "
        f"beyond it (default: the connector's default, {DEFAULT_DISK_BYTES >> 30} GiB)",
    )


# ---- pass 1 ----------------------------------------------------------------------------------


def _verify(f: IO[bytes], bar: Any) -> ArchiveReader:
    """Every record's frame decodes under its own key (frames are bound to their store key: a
    record spliced under another key fails here), and the archive's digests check out."""
    reader = ArchiveReader(f)
    for record in reader.records():
        assert record.frame is not None
        try:
            codec.decode_into(record.frame, codec.scratch(codec.frame_info(record.frame).raw_len),
                              key=record.key)
        except codec.CorruptRecord as exc:
            raise ArchiveError(f"record {record.number}: its payload does not decode under its key "
                               f"({exc})") from None
        bar.update(record.frame_len)
    return reader


# ---- pass 2 ----------------------------------------------------------------------------------


def _put_payloads(store: DiskStore, batch: list[ArchiveRecord]) -> int:
    def body(txn: lmdb.Transaction, h: rec.Handles) -> int:
        written = 0
        for record in batch:
            assert record.frame is not None  # pass 2 reads every frame
            # Checked inside the write transaction: a record stored meanwhile by a server keeps
            # its own payload, which its index record describes.
            if txn.get(record.key, db=h.index) is None:
                txn.put(record.key, record.frame, db=h.payload)
                written += 1
        return written

    return store.write(body)


def _write_payloads(store: DiskStore, f: IO[bytes], bar: Any) -> int:
    reader = ArchiveReader(f)
    written = 0
    batch: list[ArchiveRecord] = []
    size = 0
    for record in reader.records():
        batch.append(record)
        size += record.frame_len
        if size >= _LARGE or len(batch) >= _BATCH_RECORDS:
            written += _put_payloads(store, batch)
            bar.update(size)
            batch, size = [], 0
    # The loop ends only after the trailer and the whole-archive digest checked out.
    if batch:
        written += _put_payloads(store, batch)
        bar.update(size)
    return written


# ---- pass 3 ----------------------------------------------------------------------------------


def _evict_over_budget(
    txn: lmdb.Transaction, h: rec.Handles, totals: rec.Totals, budget: int, now_us: int
) -> int:
    if totals.stored_bytes <= budget:
        return 0
    entries = []
    for key, value in txn.cursor(db=h.index):
        found = rec.decode_index(value)
        if found is not None:
            entries.append((bytes(key), found.tick, found.stored_len))
    victims = RetentionPolicy(budget_bytes=budget).victims(
        entries, stored_bytes=totals.stored_bytes, now_us=now_us
    )
    evicted = 0
    for key in victims:
        try:
            evicted += rec.delete(txn, h, key, totals) is not None
        except rec.StructuralDamage:
            continue  # never free pages that may be another record's; verify --repair rebuilds
    return evicted


def _commit(
    store: DiskStore, f: IO[bytes], budget: int, now_us: int
) -> tuple[int, int, int, list[str]]:
    reader = ArchiveReader(f)
    created_us = reader.manifest.get("created_us")
    shift = max(0, now_us - created_us) if isinstance(created_us, int) else 0
    namespaces = reader.manifest.get("namespaces") or {}

    def body(txn: lmdb.Transaction, h: rec.Handles) -> tuple[int, int, int]:
        totals = rec.current_totals(txn, h)
        added = present = 0
        for record in reader.records(frames=False):
            if txn.get(record.key, db=h.index) is not None:
                present += 1
                continue
            frame = txn.get(record.key, db=h.payload)
            if frame is None or len(frame) != record.frame_len:
                raise _Vanished(f"record {record.number}'s payload vanished before the commit")
            index = rec.index_record(record.key, codec.frame_info(frame), record.frame_len,
                                     min(now_us, record.tick + shift))
            rec.index_only(txn, h, record.key, index, totals)
            added += 1
        for ns_hex, info_dict in namespaces.items():
            rec.register_namespace(txn, h, bytes.fromhex(ns_hex), info_dict, overwrite=False)
        evicted = _evict_over_budget(txn, h, totals, budget, now_us)
        rec.write_totals(txn, h, totals)
        return added, present, evicted

    added, present, evicted = store.write(body, buffers=True)
    return added, present, evicted, sorted(namespaces)


# ---- rollback --------------------------------------------------------------------------------


def _rollback(store: DiskStore, f: IO[bytes]) -> None:
    """Delete the unindexed payloads pass 2 wrote (best effort: verify --repair finishes it)."""
    try:
        f.seek(0)
        reader = ArchiveReader(f)
        keys: list[bytes] = []

        def body(txn: lmdb.Transaction, h: rec.Handles) -> None:
            for key in keys:
                if txn.get(key, db=h.index) is None:
                    txn.delete(key, db=h.payload)

        with contextlib.suppress(ArchiveError):  # a corrupt tail was never written
            for record in reader.records(frames=False):
                keys.append(record.key)
                if len(keys) >= 1024:
                    store.write(body)
                    keys.clear()
        if keys:
            store.write(body)
    except Exception as exc:  # the import already failed; say what is left behind
        ts.warn("import", f"could not remove the partial payloads ({exc}); "
                f"`kvstrata verify --repair {store.path}` drops them")


# ---- command ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    archive: Path = args.archive
    target: Path = args.dir
    budget = args.budget if args.budget is not None else DEFAULT_DISK_BYTES
    if not archive.is_file():
        raise CLIError(f"no archive at {archive}" if not archive.exists() else f"{archive} is not a file")
    try:
        f = open(archive, "rb")  # closed in the finally below, after three passes
    except OSError as exc:
        raise CLIError(f"cannot read {archive}: {exc.strerror or exc}") from None
    try:
        try:
            with ts.progress(peek_total(f), "verifying archive", unit_bytes=True) as bar:
                summary = _verify(f, bar).summary
        except ArchiveError as exc:
            raise CLIError(f"{archive}: {exc}; nothing was imported") from None
        assert summary is not None
        if summary.stored_bytes > budget:
            raise CLIError(
                f"the archive holds {summary.stored_bytes} stored bytes, more than the budget "
                f"of {budget}; pass a larger --budget. Nothing was imported"
            )
        return _import(f, archive, target, budget, summary.records)
    finally:
        f.close()


def _import(f: IO[bytes], archive: Path, target: Path, budget: int, records: int) -> dict[str, Any]:
    existed = target.exists()
    store, created = ts.create_or_open_store(target, budget_bytes=budget)
    ok = False
    try:
        try:
            f.seek(0)
            with ts.progress(peek_total(f), "importing", unit_bytes=True) as bar:
                written = _write_payloads(store, f, bar)
            f.seek(0)
            added, present, evicted, namespaces = _commit(store, f, budget, time.time_ns() // 1000)
            ok = True
        except (ArchiveError, _Vanished, codec.CorruptRecord) as exc:
            raise CLIError(f"{archive}: {exc}; nothing was imported") from None
        except (lmdb.Error, OSError, StoreUnavailableError) as exc:
            raise CLIError(f"import into {target} failed: {exc}; nothing was imported") from None
        finally:
            if not ok and not created:
                _rollback(store, f)
        store.sync()
        stats = store.stats()
    finally:
        store.close()
        if created and not ok:
            _remove_new_store(target, existed)
    return {
        "archive": str(archive),
        "path": str(target),
        "created_store": created,
        "records": records,
        "imported": added,
        "already_present": present,
        "payloads_written": written,
        "evicted_for_budget": evicted,
        "namespaces": namespaces,
        "chunks": int(stats["entries"]),
        "stored_bytes": int(stats["stored_bytes"]),
        "budget_bytes": budget,
    }


def _remove_new_store(target: Path, existed: bool) -> None:
    """Undo a store created for a failed import; an empty directory the user gave stays."""
    if not existed:
        shutil.rmtree(target, ignore_errors=True)
        return
    for child in target.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def peek_total(f: IO[bytes]) -> int | None:
    peek = peek_summary(f)
    return peek.stored_bytes if peek else None
