"""Record-level access to a :class:`~kvstrata.tiers.disk.DiskStore` for the maintenance tools.

The tools need what the disk tier's public API deliberately hides: raw index values (a corrupt
one must be reported, not raised), payloads without an index record, deleting records and
rewriting the running totals in the *same* transaction as a re-check, and the namespace
registry. This module is the one place that knows DiskStore's internals (LMDB handles, meta keys,
the totals record, the lock file); ``tests/unit/test_compaction.py`` pins them, so a change in
``disk.py`` fails there rather than in a tool.

Transactions go through the store's own helpers: reads through ``_txn`` (which retries after
another process grew the map), writes on the store's writer thread (``_call``), so they are
serialised with its puts and evictions. Every scan reads in batches of short transactions: a
read transaction held across a long loop pins freed pages and grows the file (storage-facts §5).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb
import msgspec

from kvstrata.tiers import disk as _disk
from kvstrata.tiers.disk import IndexRecord

if TYPE_CHECKING:
    from kvstrata.tiers.disk import DiskStore

T = TypeVar("T")

LOCK_FILE: str = _disk._LOCK_FILE
DATA_FILE = "data.mdb"
LMDB_LOCK_FILE = "lock.mdb"
DB_NAMES: tuple[bytes, ...] = (_disk._DB_PAYLOAD, _disk._DB_INDEX, _disk._DB_META)
META_FORMAT: bytes = _disk._META_FORMAT
META_CLEAN: bytes = _disk._META_CLEAN
META_TOTALS: bytes = _disk._META_TOTALS
META_NS: bytes = _disk._META_NS
NAMESPACE_BYTES = 16
SCAN_BATCH = 1024

_INDEX_DECODER = msgspec.msgpack.Decoder(IndexRecord)


@dataclass(slots=True)
class Totals:
    """The store's running totals (``meta/totals``): what budget enforcement counts."""

    entries: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Handles:
    env: lmdb.Environment
    payload: Any  # lmdb._Database
    index: Any
    meta: Any


def handles(store: DiskStore) -> Handles:
    return Handles(store._env, store._payload, store._index, store._meta)


def read(store: DiskStore, fn: Callable[[lmdb.Transaction, Handles], T], *, buffers: bool = False) -> T:
    """Run ``fn(txn, handles)`` in one short read transaction."""
    h = handles(store)
    return store._txn(lambda txn: fn(txn, h), buffers=buffers)


def write(
    store: DiskStore, fn: Callable[[lmdb.Transaction, Handles], T], *, buffers: bool = False
) -> T:
    """Run ``fn(txn, handles)`` in one write transaction on the store's writer thread.

    An exception inside ``fn`` aborts the transaction: nothing it did is committed. With
    ``buffers`` gets return zero-copy views, valid only until the transaction's next write.
    """
    if store.readonly:
        raise ValueError(f"store at {store.path} is open read-only")
    h = handles(store)
    return store._call(lambda: store._txn(lambda txn: fn(txn, h), write=True, buffers=buffers))


def decode_index(value: Any) -> IndexRecord:
    """An index record; ``msgspec.DecodeError`` (a ValueError) when it is unreadable."""
    return _INDEX_DECODER.decode(value)


def encode_index(rec: IndexRecord) -> bytes:
    return msgspec.msgpack.encode(rec)


def group_of(key: bytes) -> int:
    return _disk._group_of(key)


# ---- totals ----------------------------------------------------------------------------------


def read_totals(txn: lmdb.Transaction, h: Handles) -> Totals:
    raw = txn.get(META_TOTALS, db=h.meta)
    if raw is None:
        return Totals()
    t = msgspec.msgpack.decode(raw, type=_disk._Totals)
    return Totals(t.entries, t.raw_bytes, t.stored_bytes)


def write_totals(txn: lmdb.Transaction, h: Handles, totals: Totals) -> None:
    value = _disk._Totals(totals.entries, totals.raw_bytes, totals.stored_bytes)
    txn.put(META_TOTALS, msgspec.msgpack.encode(value), db=h.meta)


def recount(txn: lmdb.Transaction, h: Handles) -> tuple[Totals, int]:
    """Totals recomputed from the index, and how many index records are unreadable."""
    totals = Totals()
    unreadable = 0
    for _, value in txn.cursor(db=h.index):
        try:
            rec = decode_index(value)
        except msgspec.DecodeError:
            unreadable += 1
            continue
        totals.entries += 1
        totals.raw_bytes += rec.raw_len
        totals.stored_bytes += rec.stored_len
    return totals, unreadable


# ---- records ---------------------------------------------------------------------------------


def delete_record(txn: lmdb.Transaction, h: Handles, key: bytes, totals: Totals) -> int | None:
    """Delete ``key``'s index record and payload; the stored bytes it freed, None if absent.

    ``totals`` is adjusted for a readable index record; an unreadable one was never counted
    consistently, so callers that drop one recount instead.
    """
    value = txn.pop(key, db=h.index)
    had_payload = txn.delete(key, db=h.payload)
    if value is None:
        return 0 if had_payload else None
    try:
        rec = decode_index(value)
    except msgspec.DecodeError:
        return 0
    totals.entries -= 1
    totals.raw_bytes -= rec.raw_len
    totals.stored_bytes -= rec.stored_len
    return rec.stored_len


def put_record(
    txn: lmdb.Transaction, h: Handles, key: bytes, rec: IndexRecord, totals: Totals
) -> None:
    """Index ``key`` (its payload must already be in place) and count it in ``totals``."""
    txn.put(key, encode_index(rec), db=h.index)
    totals.entries += 1
    totals.raw_bytes += rec.raw_len
    totals.stored_bytes += rec.stored_len


# ---- scans -----------------------------------------------------------------------------------


def _batch(
    txn: lmdb.Transaction, db: Any, after: bytes | None, prefix: bytes, values: bool
) -> list[tuple[bytes, bytes | None]]:
    cursor = txn.cursor(db=db)
    found = cursor.set_range(after if after is not None else prefix)
    if found and after is not None and cursor.key() == after:
        found = cursor.next()
    out: list[tuple[bytes, bytes | None]] = []
    while found and len(out) < SCAN_BATCH:
        key = cursor.key()
        if not key.startswith(prefix):
            break
        out.append((key, cursor.value() if values else None))
        found = cursor.next()
    return out


def scan(
    store: DiskStore, *, db: str = "index", prefix: bytes = b"", values: bool = True
) -> Iterator[list[tuple[bytes, bytes | None]]]:
    """Batches of ``(key, raw value or None)`` of one database, in key order, under ``prefix``.

    Each batch is its own short read transaction; values are copies (safe after it ends).
    Keys of the payload database are read without touching their (overflow) value pages.
    """
    after: bytes | None = None
    while True:

        def body(txn: lmdb.Transaction, h: Handles, a: bytes | None = after) -> list[Any]:
            return _batch(txn, getattr(h, db), a, prefix, values)

        batch = read(store, body)
        if batch:
            yield batch
        if len(batch) < SCAN_BATCH:
            return
        after = batch[-1][0]


def _successor(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def key_namespaces(store: DiskStore) -> list[bytes]:
    """The distinct 16-byte namespaces of the indexed keys: one cursor seek per namespace."""

    def body(txn: lmdb.Transaction, h: Handles) -> list[bytes]:
        cursor = txn.cursor(db=h.index)
        out: list[bytes] = []
        found = cursor.first()
        while found:
            ns = cursor.key()[:NAMESPACE_BYTES]
            out.append(ns)
            nxt = _successor(ns)
            found = nxt is not None and cursor.set_range(nxt)
        return out

    return read(store, body)


# ---- meta ------------------------------------------------------------------------------------


def meta_get(store: DiskStore, key: bytes) -> bytes | None:
    return read(store, lambda txn, h: txn.get(key, db=h.meta))


def namespace_info(txn: lmdb.Transaction, h: Handles, ns: bytes) -> dict[str, Any] | None:
    raw = txn.get(META_NS + ns, db=h.meta)
    return None if raw is None else msgspec.json.decode(raw)


def register_namespace(txn: lmdb.Transaction, h: Handles, ns: bytes, info: dict[str, Any]) -> bool:
    """Record ``ns`` unless it is already registered; True when it was added."""
    return bool(txn.put(META_NS + ns, msgspec.json.encode(info), db=h.meta, overwrite=False))


def unregister_namespace(txn: lmdb.Transaction, h: Handles, ns: bytes) -> bool:
    return bool(txn.delete(META_NS + ns, db=h.meta))
