"""``kvstrata verify DIR [--repair]``: prove a store sound, or say exactly what is not.

Every indexed record is read and checked (``kvstrata.tiers.records.check``): its index record
decodes, its payload exists and has the indexed size, the frame header matches the index record,
and the payload decompresses to bytes with the recorded checksum, bound to the record's key.
Payloads without an index record, entries whose keys are damaged (a scan finds them, a lookup by
key does not), unreadable namespace entries and the store's running totals are checked too.

``--repair`` re-checks each bad record inside one write transaction (it may have been rewritten
or dropped since) and deletes only those still bad; entries a lookup cannot reach are deleted
where a scan finds them; unreadable namespace entries are removed (their records stay, shown
as unregistered); the totals, derived data, are recounted. A second ``verify`` then says sound.
Both modes are safe while servers use the store.

Exit status: 0 sound (or repaired), 1 bad records found and left in place, 2 usage error.
"""

from __future__ import annotations

import argparse
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lmdb

from kvstrata import fsmode
from kvstrata.compaction import rewrite
from kvstrata.tiers import record_scans as scans
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tools import support as ts
from kvstrata.tools.cli import CLIError

# Records decoded per read transaction: short enough that a concurrent writer's freed pages are
# not pinned for long (docs/STORAGE.md), long enough to amortise the transaction.
_CHECK_BATCH = 16
UNREACHABLE = "entry unreachable by its key (the key bytes are damaged)"
# Problems --repair fixes by reconciling the index and payload databases with cursor walks.
_RECONCILED = (UNREACHABLE, rec.ORPHAN_PAYLOAD, rec.PAYLOAD_MISSING)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    parser.add_argument("--repair", action="store_true", help="drop the bad records (and only those)")
    parser.add_argument("--rebuild", action="store_true",
                        help="with --repair: rebuild the store from its sound records even when no "
                             "damage to its structure was found (a store that stopped admitting chunks)")
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), metavar="N",
                        help="decompression threads (default: up to 4)")
    parser.add_argument("--show", type=int, default=100, metavar="N",
                        help="bad records listed in the report (default 100)")


@dataclass
class Findings:
    checked: int = 0
    bad: list[tuple[bytes, str]] = field(default_factory=list)
    totals_readable: bool = True
    totals_consistent: bool = True
    unreadable_index: int = 0
    bad_namespaces: list[bytes] = field(default_factory=list)
    # Scans that stopped at a damaged page of LMDB's own structure: what lies past it is lost.
    structure: list[str] = field(default_factory=list)

    @property
    def sound(self) -> bool:
        return not self.bad and self.totals_consistent and not self.bad_namespaces and not self.structure


def _check_batch(store: DiskStore, keys: list[bytes]) -> list[tuple[bytes, bool, str | None]]:
    return rec.check_all(lambda body: store.read(body, buffers=True), keys)


def _scan_keys(store: DiskStore, db: Literal["index", "payload"], found: Findings) -> Iterator[list[bytes]]:
    """Batches of ``db``'s keys; a damaged page ends the scan, recorded in ``found``."""
    for batch in store.scan(db, values=False, damage=found.structure):
        yield [key for key, _ in batch]


def _index_batches(store: DiskStore, found: Findings) -> Iterator[list[bytes]]:
    for keys in _scan_keys(store, "index", found):
        for i in range(0, len(keys), _CHECK_BATCH):
            yield keys[i : i + _CHECK_BATCH]


def _unreachable(store: DiskStore, keys: list[bytes]) -> list[bytes]:
    """Those of ``keys`` (found by an earlier scan, absent from a later check) that a scan still
    finds but a lookup by key does not: damaged keys. Both are judged in one read transaction,
    so a record deleted since the scan (evicted by a live server) is gone, not damaged."""
    def body(txn: lmdb.Transaction[bytes], h: rec.Handles) -> list[bytes]:
        index, payload = txn.cursor(db=h.index), txn.cursor(db=h.payload)
        lost = {k for k in keys if not index.set_key(k) and not payload.set_key(k)}
        if not lost:
            return []
        # One walk of the index in this same snapshot: a key it meets exists, so the lookup
        # that missed it was misled by damaged key bytes; one it does not meet was deleted.
        return [k for k in txn.cursor(db=h.index).iternext(keys=True, values=False) if k in lost]

    try:
        return store.read(body)
    except rec.LMDB_DAMAGE:
        return list(keys)  # the walk cannot be done: as the scan saw it, they are unreachable


def _check_index(store: DiskStore, threads: int, found: Findings) -> None:
    """Check every indexed record on ``threads`` threads (zstd releases the GIL). A record the
    scan found and the check did not is judged at the end (``_unreachable``), in one snapshot."""
    window: deque[Future[list[tuple[bytes, bool, str | None]]]] = deque()
    vanished: list[bytes] = []

    def drain(bar: Any) -> None:
        for key, present, problem in window.popleft().result():
            found.checked += int(present)
            if not present:
                vanished.append(key)
            elif problem is not None:
                found.bad.append((key, problem))
                found.unreadable_index += problem == rec.INDEX_UNREADABLE
            bar.update(1)

    with (
        ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvstrata-verify") as pool,
        ts.progress(int(store.stats()["entries"]), "verifying") as bar,
    ):
        for keys in _index_batches(store, found):
            window.append(pool.submit(_check_batch, store, keys))
            if len(window) >= 2 * max(1, threads):
                drain(bar)
        while window:
            drain(bar)
    unreachable = _unreachable(store, vanished) if vanished else []
    found.checked += len(unreachable)
    found.bad.extend((key, UNREACHABLE) for key in unreachable)


def _check_orphans(store: DiskStore, found: Findings) -> None:
    """Payloads without an index record. Each batch the scan found is judged in one snapshot; a
    payload gone by then (a live server evicted the record) is judged at the end by one walk in
    one snapshot: met there, its key bytes are damaged; not met, it is gone, not damaged."""
    listed = {key for key, _ in found.bad}
    lost: set[bytes] = set()
    try:
        for keys in _scan_keys(store, "payload", found):
            orphans, gone = store.read(partial(scans.orphan_payloads, keys=keys))
            found.bad.extend((key, rec.ORPHAN_PAYLOAD) for key in orphans if key not in listed)
            lost.update(gone)
        if lost:
            met = store.read(lambda txn, h: scans.payloads_met(txn, h, lost))
            found.bad.extend((key, rec.ORPHAN_PAYLOAD) for key in met if key not in listed)
    except rec.LMDB_DAMAGE as exc:
        found.structure.append(f"the index cannot be searched ({exc})")


def _check_meta(store: DiskStore, found: Findings) -> None:
    def body(txn: lmdb.Transaction, h: rec.Handles) -> tuple[rec.Totals | None, rec.Totals, list[bytes]]:
        return rec.read_totals(txn, h), rec.recount(txn, h)[0], rec.namespaces(txn, h)[1]

    try:
        stored, counted, found.bad_namespaces = store.read(body)
    except rec.LMDB_DAMAGE as exc:
        found.structure.append(f"the totals cannot be recounted ({exc})")
        return
    found.totals_readable = stored is not None
    found.totals_consistent = stored == counted


def _check_pages(store: DiskStore, found: Findings) -> int:
    """The meta page's account of the file against the file and the databases' pages; returns
    the bytes of the pages not in use (free, or held for older readers)."""
    try:
        census = store.page_census()
    except rec.LMDB_DAMAGE as exc:
        found.structure.append(f"the databases' pages cannot be counted ({exc})")
        return 0
    last = census["last_pgno"]
    if last >= census["file_pages"]:
        found.structure.append(f"the meta page says the last page in use is {last}, the file has "
                               f"{census['file_pages']} pages")
    elif census["live_pages"] > last + 1:
        found.structure.append(f"the databases use {census['live_pages']} pages, the meta page says "
                               f"{last + 1} are in use")
    return max(0, last + 1 - census["live_pages"]) * census["psize"]


# The write probe allocates at most this much: every free page of a small store, the first
# ones LMDB would reuse of a large one (a damaged entry further down its free-page list shows
# only when writes reach it: `verify --repair --rebuild` then rebuilds the store anyway).
_PROBE_MAX_BYTES = 64 << 20


def _check_writable(path: Path, found: Findings, free_bytes: int) -> None:
    """Whether a write transaction can allocate pages (a damaged free-page list makes writes
    fail while every read works): one value as large as the free pages (up to a cap) makes
    LMDB reuse them. The transaction is aborted: nothing is changed."""
    try:
        # map_size only reserves address space (no writemap): lmdb.open's 10 MiB default would
        # make the probe fail with MapFullError on any store larger than that.
        env = lmdb.open(str(path), max_dbs=4, subdir=True, create=False, map_size=1 << 40)
    except lmdb.Error:
        return  # read-only file system or no write permission: not a sign of damage
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(rec.DB_META, txn=txn, create=False)
            txn.put(b"verify-probe", bytes(max(8192, min(free_bytes, _PROBE_MAX_BYTES))), db=meta)
            raise _Abort
    except _Abort:
        pass
    except lmdb.Error as exc:
        found.structure.append(f"no write can succeed: {exc}")
    finally:
        env.close()


class _Abort(Exception):
    pass


def find_problems(path: Path, threads: int) -> Findings:
    store = ts.open_store(path, readonly=True)
    try:
        found = Findings()
        free_bytes = _check_pages(store, found)
        _check_index(store, threads, found)
        _check_orphans(store, found)
        _check_meta(store, found)
    finally:
        store.close()
    _check_writable(path, found, free_bytes)
    return found


def repair(path: Path, found: Findings) -> dict[str, Any]:
    """Drop the records of ``found`` that are still bad, reconcile the two databases where
    entries went missing or unreachable, remove the unreadable namespace entries, and rewrite
    the totals from a recount."""
    bad = [key for key, problem in found.bad if problem not in _RECONCILED]
    reconcile = any(problem in _RECONCILED for _, problem in found.bad)
    store = ts.open_store(path, readonly=False)
    try:
        # An unclean store verifies itself in the background on open; let it finish first so
        # both passes never race over the same records.
        store.wait_recovery()

        def body(txn: lmdb.Transaction, h: rec.Handles) -> dict[str, int]:
            totals = rec.Totals()  # recounted below: only counts change in between
            dropped = gone = 0
            for key in bad:
                present, problem = rec.check(txn, h, key)
                if not present:
                    gone += 1
                elif problem is not None:
                    rec.delete(txn, h, key, totals)
                    dropped += 1
            if reconcile:
                dropped += scans.reconcile(txn, h)
            namespaces = sum(rec.unregister_namespace(txn, h, ns) for ns in found.bad_namespaces)
            rec.write_totals(txn, h, rec.recount(txn, h)[0])
            return {"dropped": dropped, "already_gone": gone, "namespace_entries_removed": namespaces}

        try:
            result = store.write(body, buffers=True)
        except lmdb.Error as exc:
            raise CLIError(
                f"the structure of {path} is damaged beyond what --repair can mend ({exc}); "
                f"nothing was changed. `kvstrata export {path} ARCHIVE` saves every sound record "
                "for `kvstrata import` into a new store") from None
        store.sync()
    finally:
        store.close()
    return {**result, "totals_recounted": True}


def rebuild(path: Path) -> dict[str, Any]:
    """Structural damage (a record whose pages may be another record's): deleting records in
    place could free a sound record's pages, so the store is rebuilt from its sound records
    (``compaction.rewrite.rebuild_locked``). That needs the store to itself."""
    try:
        with rewrite.exclusive(path):
            result = rewrite.rebuild_locked(path)
    except rewrite.StoreBusyError:
        raise CLIError(
            f"{path} has records whose pages may belong to other records; repairing them means "
            "rebuilding the store, which needs it to itself. Stop the servers and tools using it "
            "and run `kvstrata verify --repair` again; nothing was changed") from None
    except rewrite.RewriteError as exc:
        raise CLIError(str(exc)) from None
    return {"kept": result.kept, "left_out": result.left_out}


def _exposed(path: Path) -> list[str]:
    lines = fsmode.exposed(path)
    for line in lines:
        ts.warn("verify", f"{line}: the store holds every cached prompt's KV; chmod it (0700 / 0600)")
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    found = find_problems(args.dir, args.threads)
    report: dict[str, Any] = {
        "path": str(args.dir),
        "checked": found.checked,
        "ok": found.checked - sum(1 for _, p in found.bad if p != rec.ORPHAN_PAYLOAD),
        "bad_count": len(found.bad),
        "bad": [
            {"key": key.hex(), "namespace": key[: rec.NAMESPACE_BYTES].hex(),
             "group": rec.group_of(key), "problem": problem}
            for key, problem in found.bad[: max(0, args.show)]
        ],
        "totals_readable": found.totals_readable,
        "totals_consistent": found.totals_consistent,
        "unreadable_namespace_entries": [ns.hex() for ns in found.bad_namespaces],
        "structure_damage": found.structure,
        # Not damage (the exit status stays), but every cached prompt is readable to others.
        "readable_by_others": _exposed(args.dir),
    }
    if args.repair and args.rebuild:
        report["rebuilt"] = rebuild(args.dir)
        report["status"] = "rebuilt"
    elif found.sound:
        report["status"] = "sound"
    elif args.repair and (found.structure or any(not rec.deletable_in_place(p) for _, p in found.bad)):
        report["rebuilt"] = rebuild(args.dir)
        report["status"] = "repaired"
    elif args.repair:
        report["repaired"] = repair(args.dir, found)
        report["status"] = "repaired"
    else:
        report["status"] = "problems found; run with --repair to drop the bad records"
        report["_exit_code"] = 1
    return report
