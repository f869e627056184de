"""``kvstrata verify DIR [--repair]``: prove a store sound, or say exactly what is not.

Every indexed record is read and checked: its index record decodes, its payload exists and has
the indexed size, the frame header matches the index record, and the payload decompresses to
bytes with the recorded xxh3-64 checksum. Payloads without an index record are found too, and the
store's running totals are compared with a recount of the index.

``--repair`` re-checks each bad record inside one write transaction (it may have been rewritten
or dropped since) and deletes only those still bad; the totals are recounted when they were off.
Nothing else changes. Both modes are safe while servers use the store.

Exit status: 0 sound (or repaired), 1 bad records found and left in place, 2 usage error.
"""

from __future__ import annotations

import argparse
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from kvstrata.compaction import checks
from kvstrata.compaction import storeaccess as sa
from kvstrata.compaction import toolsupport as ts
from kvstrata.tiers.disk import DiskStore

# Records decoded per read transaction: short enough that a concurrent writer's freed pages are
# not pinned for long (storage-facts §5), long enough to amortise the transaction.
_CHECK_BATCH = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    parser.add_argument("--repair", action="store_true", help="drop the bad records (and only those)")
    parser.add_argument(
        "--threads",
        type=int,
        default=min(4, os.cpu_count() or 1),
        metavar="N",
        help="decompression threads (default: up to 4)",
    )
    parser.add_argument(
        "--show", type=int, default=100, metavar="N", help="bad records listed in the report (default 100)"
    )


@dataclass
class Findings:
    checked: int = 0
    bad: list[tuple[bytes, str]] = field(default_factory=list)
    totals_consistent: bool = True
    unreadable_index: int = 0


def _check_batch(store: DiskStore, keys: list[bytes]) -> list[tuple[bytes, bool, str | None]]:
    def body(txn: lmdb.Transaction, h: sa.Handles) -> list[tuple[bytes, bool, str | None]]:
        return [(key, *checks.check_key(txn, h, key)) for key in keys]

    return sa.read(store, body, buffers=True)


def _index_batches(store: DiskStore) -> Iterator[list[bytes]]:
    for batch in sa.scan(store, db="index", values=False):
        keys = [key for key, _ in batch]
        for i in range(0, len(keys), _CHECK_BATCH):
            yield keys[i : i + _CHECK_BATCH]


def _check_index(store: DiskStore, threads: int, found: Findings) -> None:
    """Check every indexed record on ``threads`` threads (zstd releases the GIL)."""
    window: deque[Future[list[tuple[bytes, bool, str | None]]]] = deque()

    def drain(bar: Any) -> None:
        for key, present, problem in window.popleft().result():
            found.checked += int(present)
            if problem is not None:
                found.bad.append((key, problem))
            bar.update(1)

    with (
        ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvstrata-verify") as pool,
        ts.progress(int(store.stats()["entries"]), "verifying") as bar,
    ):
        for keys in _index_batches(store):
            window.append(pool.submit(_check_batch, store, keys))
            if len(window) >= 2 * max(1, threads):
                drain(bar)
        while window:
            drain(bar)


def _check_orphans(store: DiskStore, found: Findings) -> None:
    for batch in sa.scan(store, db="payload", values=False):
        keys = [key for key, _ in batch]

        def body(txn: lmdb.Transaction, h: sa.Handles, keys: list[bytes] = keys) -> list[bytes]:
            index, payload = txn.cursor(db=h.index), txn.cursor(db=h.payload)
            # Re-read both in one transaction: a put writes payload and index together.
            return [k for k in keys if payload.set_key(k) and not index.set_key(k)]

        found.bad.extend((key, checks.ORPHAN_PAYLOAD) for key in sa.read(store, body))


def _check_totals(store: DiskStore, found: Findings) -> None:
    def body(txn: lmdb.Transaction, h: sa.Handles) -> tuple[sa.Totals, sa.Totals, int]:
        counted, unreadable = sa.recount(txn, h)
        return sa.read_totals(txn, h), counted, unreadable

    stored, counted, found.unreadable_index = sa.read(store, body)
    found.totals_consistent = stored == counted


def find_problems(path: Path, threads: int) -> Findings:
    store = ts.open_store(path, readonly=True)
    try:
        found = Findings()
        _check_index(store, threads, found)
        _check_orphans(store, found)
        _check_totals(store, found)
        return found
    finally:
        store.close()


def repair(path: Path, found: Findings) -> dict[str, Any]:
    """Drop the records of ``found`` that are still bad; recount totals if they were off."""
    keys = [key for key, _ in found.bad]
    recount_needed = not found.totals_consistent or found.unreadable_index > 0
    store = ts.open_store(path, readonly=False)
    try:
        # An unclean store verifies itself in the background on open; let it finish first so
        # both passes never race over the same records.
        store.wait_recovery()

        def body(txn: lmdb.Transaction, h: sa.Handles) -> tuple[int, int]:
            totals = sa.read_totals(txn, h)
            dropped = gone = 0
            for key in keys:
                present, problem = checks.check_key(txn, h, key)
                if not present:
                    gone += 1
                elif problem is not None:
                    sa.delete_record(txn, h, key, totals)
                    dropped += 1
            if recount_needed:
                totals, _ = sa.recount(txn, h)
            sa.write_totals(txn, h, totals)
            return dropped, gone

        dropped, gone = sa.write(store, body)
        store.sync()
    finally:
        store.close()
    return {"dropped": dropped, "already_gone": gone, "totals_recounted": recount_needed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    found = find_problems(args.dir, args.threads)
    report: dict[str, Any] = {
        "path": str(args.dir),
        "checked": found.checked,
        "ok": found.checked - sum(1 for _, p in found.bad if p != checks.ORPHAN_PAYLOAD),
        "bad_count": len(found.bad),
        "bad": [
            {
                "key": key.hex(),
                "namespace": key[: sa.NAMESPACE_BYTES].hex(),
                "group": sa.group_of(key),
                "problem": problem,
            }
            for key, problem in found.bad[: max(0, args.show)]
        ],
        "totals_consistent": found.totals_consistent,
    }
    healthy = not found.bad and found.totals_consistent
    if healthy:
        report["status"] = "sound"
    elif args.repair:
        report["repaired"] = repair(args.dir, found)
        report["status"] = "repaired"
    else:
        report["status"] = "bad records found; run with --repair to drop them"
        report["_exit_code"] = 1
    return report
