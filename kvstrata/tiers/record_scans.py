"""Walks of a store's databases, each step one short transaction the caller opens (a walk held
in one transaction would pin freed pages and grow the file): batches of keys or index records in
key order, the namespaces the index holds, and the checks ``kvstrata verify`` makes of entries a
lookup by key cannot reach (damaged key bytes). The record format is ``records``'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lmdb

from kvstrata.tiers.records import NAMESPACE_BYTES, SCAN_BATCH, Handles, IndexRecord, decode_index


def scan_batch(txn: lmdb.Transaction, db: Any, after: bytes | None, *, prefix: bytes = b"",
               values: bool = True, limit: int = SCAN_BATCH) -> list[tuple[bytes, bytes | None]]:
    """Up to ``limit`` ``(key, value copy or None)`` of ``db`` after ``after`` (or from the
    start of ``prefix``), in key order. Keys of the payload database are read without touching
    their (overflow) value pages when ``values`` is False."""
    cursor = txn.cursor(db=db)
    found = cursor.set_range(after if after is not None else prefix)
    if found and after is not None and cursor.key() == after:
        found = cursor.next()
    out: list[tuple[bytes, bytes | None]] = []
    while found and len(out) < limit:
        key = bytes(cursor.key())
        if not key.startswith(prefix):
            break
        out.append((key, bytes(cursor.value()) if values else None))
        found = cursor.next()
    return out


def index_batch(txn: lmdb.Transaction, h: Handles, after: bytes | None,
                limit: int = SCAN_BATCH) -> tuple[list[tuple[bytes, IndexRecord]], list[bytes], bytes | None]:
    """The next readable index records after ``after``, the keys of unreadable ones among them,
    and the last key seen (None at the end)."""
    rows = scan_batch(txn, h.index, after, limit=limit)
    good: list[tuple[bytes, IndexRecord]] = []
    bad: list[bytes] = []
    for key, value in rows:
        rec = decode_index(value)
        if rec is None:
            bad.append(key)
        else:
            good.append((key, rec))
    return good, bad, rows[-1][0] if len(rows) == limit else None


def key_namespaces(txn: lmdb.Transaction, h: Handles) -> list[bytes]:
    """The distinct namespaces of the indexed keys: one cursor seek per namespace."""
    cursor = txn.cursor(db=h.index)
    out: list[bytes] = []
    found = cursor.first()
    while found:
        ns = bytes(cursor.key()[:NAMESPACE_BYTES])
        out.append(ns)
        nxt = _successor(ns)
        found = nxt is not None and cursor.set_range(nxt)
    return out


def _successor(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def orphan_payloads(
    txn: lmdb.Transaction, h: Handles, keys: Sequence[bytes]
) -> tuple[list[bytes], list[bytes]]:
    """Of ``keys`` (payload keys found by an earlier scan): those whose payload this snapshot
    finds without an index record (orphans), and those it finds neither (deleted since the
    scan, or a key whose damaged bytes a lookup cannot reach: ``payloads_met``)."""
    index, payload = txn.cursor(db=h.index), txn.cursor(db=h.payload)
    orphans: list[bytes] = []
    lost: list[bytes] = []
    for k in keys:
        if index.set_key(k):
            continue
        (orphans if payload.set_key(k) else lost).append(k)
    return orphans, lost


def payloads_met(txn: lmdb.Transaction[bytes], h: Handles, keys: set[bytes]) -> list[bytes]:
    """Those of ``keys`` a walk of the payloads meets in this snapshot: present, though a lookup
    by key missed them (damaged key bytes). One a walk does not meet was deleted."""
    return [k for k in txn.cursor(db=h.payload).iternext(keys=True, values=False) if k in keys]


def reconcile(txn: lmdb.Transaction, h: Handles) -> int:
    """Delete, where a cursor walk finds them, the index entries without a payload and the
    payloads without an index entry, including entries a lookup by key cannot reach (damaged key
    bytes put them out of the B-tree's order). Returns how many entries went."""
    deleted = 0
    for db, other in ((h.index, h.payload), (h.payload, h.index)):
        cursor = txn.cursor(db=db)
        found = cursor.first()
        while found:
            key = bytes(cursor.key())
            if not key:  # deleting the last entry leaves the cursor past the end
                break
            if not (_reachable(txn, key, db) and _reachable(txn, key, other)):
                found = cursor.delete()  # moves to the next entry
                deleted += 1
            else:
                found = cursor.next()
    return deleted


def _reachable(txn: lmdb.Transaction, key: bytes, db: Any) -> bool:
    try:
        return txn.get(key, db=db) is not None
    except lmdb.Error:  # e.g. a key whose damaged bytes LMDB refuses to look up
        return False
