"""The store's record layer: what an LMDB store holds, and the operations inside one transaction.

One LMDB environment per store directory, three named databases:

* ``payload``: store key -> codec frame (``kvstrata.tiers.codec``), bound to its key;
* ``index``: store key -> :class:`IndexRecord` (msgpack, ~40 B), scanned without touching the
  payload pages;
* ``meta``: format version, clean-shutdown marker, running totals, namespace registry.

A store key is a 16-byte namespace (``NAMESPACE_BYTES``: a fingerprint of the model, dtypes, KV
layout and rank) followed by a chunk key whose last 4 bytes are the KV cache group.

Every function here runs in a transaction the caller opened (``DiskStore.read`` /
``DiskStore.write``, or the store's own writer), so what it checks and what it changes are one
atomic step. Nothing here raises because of what the store *contains*: an unreadable index
record, totals record or namespace entry is reported (None, a problem string, a list of bad
keys) so that the serving path can count a miss and the tools can report and repair it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lmdb
import msgspec

from kvstrata.tiers import codec

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvstrata.auth import ValueAuth

FORMAT_VERSION = 1

DB_PAYLOAD = b"payload"
DB_INDEX = b"index"
DB_META = b"meta"
DB_NAMES = (DB_PAYLOAD, DB_INDEX, DB_META)
META_FORMAT = b"format_version"
META_CLEAN = b"clean"
META_TOTALS = b"totals"
META_NS = b"ns:"
LOCK_FILE = "kvstrata.lock"  # flock'ed by every writable opener (see DiskStore)
DATA_FILE = "data.mdb"
LMDB_LOCK_FILE = "lock.mdb"
NAMESPACE_BYTES = 16
SCAN_BATCH = 1024  # entries per short read transaction of a scan

# Problems with a record, as reported to the user and counted on the serving path.
INDEX_UNREADABLE = "index record unreadable"
PAYLOAD_MISSING = "payload missing"
ORPHAN_PAYLOAD = "payload without index record"
SIZE_MISMATCH = "payload size differs from the index record"
FRAME_UNREADABLE = "payload frame header unreadable"
FRAME_MISMATCH = "payload frame does not match the index record"
GROUP_MISMATCH = "index record group differs from the key"
CHECKSUM = "checksum mismatch (payload corrupt)"
PAGE_DAMAGED = "store page unreadable (LMDB structure damaged)"
FORGED = "authentication tag missing or wrong (not written with this store's auth key)"

# Problems whose record can be deleted where it is: its payload, if any, is its own (a frame
# whose header matches its index record and whose bytes rotted; a payload a crashed put left).
# Any other problem may mean the record's page numbers point into another record's pages (a
# damaged leaf): deleting it would free those pages and lose that record too, so such a record
# is only left out (a miss), and ``kvstrata verify --repair`` rebuilds the store around it.
IN_PLACE = frozenset({CHECKSUM, INDEX_UNREADABLE, PAYLOAD_MISSING, ORPHAN_PAYLOAD, FORGED})


def deletable_in_place(problem: str) -> bool:
    return problem in IN_PLACE


# LMDB's own structure found damaged while reading one record: treated like a bad record.
# (BadTxnError: the read transaction is dead after such an error.)
LMDB_DAMAGE: tuple[type[Exception], ...] = (lmdb.CorruptedError, lmdb.PageNotFoundError,
                                             lmdb.BadValsizeError, lmdb.BadTxnError)


class IndexRecord(msgspec.Struct, array_like=True, frozen=True):
    """Per-key metadata kept apart from the payload so scans never touch payload pages."""

    raw_len: int
    stored_len: int
    codec: int
    checksum: int  # the frame's (key-bound) checksum
    tick: int  # last access, microseconds since the epoch (comparable across processes)
    group: int  # KV-cache group index: the last 4 bytes of the chunk key, big-endian
    dtype: str
    # The value MAC (kvstrata.auth) over the key and the payload frame, written by a store with
    # an auth key (auth_key_file); empty otherwise, and in records written before it existed.
    mac: bytes = b""


class Totals(msgspec.Struct, array_like=True):
    """The store's running totals (``meta/totals``): what budget enforcement counts. Derived
    data: recounted from the index whenever they cannot be read."""

    entries: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0

    def add(self, rec: IndexRecord, sign: int = 1) -> None:
        self.entries += sign
        self.raw_bytes += sign * rec.raw_len
        self.stored_bytes += sign * rec.stored_len


@dataclass(frozen=True, slots=True)
class Handles:
    """The store's databases (open handles of one environment): the three named ones and the
    main database that holds their names."""

    payload: Any  # lmdb._Database
    index: Any
    meta: Any
    main: Any

    @classmethod
    def open(cls, env: lmdb.Environment, txn: lmdb.Transaction | None = None, *,
             create: bool = True) -> Handles:
        """Open the three named databases and the main one. Without ``txn`` py-lmdb opens each
        handle in a committed read transaction (a handle opened inside an open read transaction
        is invalid outside it); with a write ``txn`` they are created when missing."""
        if txn is None:
            payload, index, meta = (env.open_db(name, create=create) for name in DB_NAMES)
            return cls(payload, index, meta, env.open_db(None))
        payload, index, meta = (env.open_db(name, txn=txn, create=create) for name in DB_NAMES)
        return cls(payload, index, meta, env.open_db(txn=txn))


def begin(env: lmdb.Environment, *, write: bool = False, buffers: bool = False) -> lmdb.Transaction[Any]:
    """``env.begin`` with ``buffers`` known only at run time (py-lmdb's stubs type a transaction
    that returns memoryviews apart from one that returns bytes)."""
    if buffers:
        return env.begin(write=write, buffers=True)
    return env.begin(write=write)


def live_bytes(txn: lmdb.Transaction, h: Handles) -> int:
    """Bytes of the pages every database uses: what a compacting copy of the file writes."""
    pages = 2  # the two meta pages
    psize = 0
    for db in (h.payload, h.index, h.meta, h.main):
        st = txn.stat(db)
        psize = st["psize"]
        pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
    return pages * psize


_INDEX_DECODER = msgspec.msgpack.Decoder(IndexRecord)
_TOTALS_DECODER = msgspec.msgpack.Decoder(Totals)


def group_of(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big") if len(key) >= 20 else 0


def decode_index(value: Buffer | None) -> IndexRecord | None:
    """An index record, or None when it is absent or unreadable."""
    if value is None:
        return None
    try:
        return _INDEX_DECODER.decode(value)
    except (msgspec.DecodeError, ValueError):
        return None


def encode_index(rec: IndexRecord) -> bytes:
    return msgspec.msgpack.encode(rec)


def index_record(key: bytes, info: codec.FrameInfo, stored_len: int, tick: int,
                 mac: bytes = b"") -> IndexRecord:
    """The index record of a frame stored under ``key`` (``mac``: its value MAC, if any)."""
    return IndexRecord(raw_len=info.raw_len, stored_len=stored_len, codec=info.codec,
                       checksum=info.checksum, tick=tick, group=group_of(key), dtype=info.dtype,
                       mac=mac)


# ---- totals ----------------------------------------------------------------------------------


def read_totals(txn: lmdb.Transaction, h: Handles) -> Totals | None:
    """The stored totals; None when the record is unreadable (recount them)."""
    raw = txn.get(META_TOTALS, db=h.meta)
    if raw is None:
        return Totals()
    try:
        return _TOTALS_DECODER.decode(raw)
    except (msgspec.DecodeError, ValueError):
        return None


def current_totals(txn: lmdb.Transaction, h: Handles) -> Totals:
    """The stored totals, or a recount from the index when they are unreadable."""
    totals = read_totals(txn, h)
    return recount(txn, h)[0] if totals is None else totals


def write_totals(txn: lmdb.Transaction, h: Handles, totals: Totals) -> None:
    txn.put(META_TOTALS, msgspec.msgpack.encode(totals), db=h.meta)


def recount(txn: lmdb.Transaction, h: Handles) -> tuple[Totals, list[bytes]]:
    """Totals recomputed from the index, and the keys whose index records are unreadable."""
    totals = Totals()
    unreadable: list[bytes] = []
    for key, value in txn.cursor(db=h.index):
        rec = decode_index(value)
        if rec is None:
            unreadable.append(bytes(key))
        else:
            totals.add(rec)
    return totals, unreadable


# ---- one record --------------------------------------------------------------------------------


def put(txn: lmdb.Transaction, h: Handles, key: bytes, frame: Buffer, rec: IndexRecord,
        totals: Totals) -> None:
    """Store ``frame`` under ``key`` with its index record, counted in ``totals``."""
    txn.put(key, frame, db=h.payload)
    txn.put(key, encode_index(rec), db=h.index)
    totals.add(rec)


def index_only(txn: lmdb.Transaction, h: Handles, key: bytes, rec: IndexRecord,
               totals: Totals) -> None:
    """Index ``key`` whose payload is already in place (a two-pass import), counted."""
    txn.put(key, encode_index(rec), db=h.index)
    totals.add(rec)


class StructuralDamage(Exception):
    """A record's pages may not be its own (see ``IN_PLACE``): deleting it could free another
    record's pages. Left where it is; ``kvstrata verify --repair`` rebuilds the store."""


def delete(txn: lmdb.Transaction, h: Handles, key: bytes, totals: Totals) -> int | None:
    """Delete ``key``'s index record and payload; the stored bytes freed, None when neither
    existed. Raises :class:`StructuralDamage`, deleting nothing, when the payload's frame header
    does not belong to the record (checked without decompressing). An unreadable index record
    was never counted reliably: callers that drop one recount the totals."""
    problem = check(txn, h, key, decode=False)[1]
    if problem is not None and not deletable_in_place(problem):
        raise StructuralDamage(f"{key.hex()}: {problem}")
    value = txn.pop(key, db=h.index)
    had_payload = txn.delete(key, db=h.payload)
    if value is None:
        return 0 if had_payload else None
    rec = decode_index(value)
    if rec is None:
        return 0
    totals.add(rec, -1)
    return rec.stored_len


def check_frame(rec: IndexRecord, key: bytes, payload: Buffer, *, decode: bool = True,
                auth: ValueAuth | None = None) -> str | None:
    """The problem with ``payload`` as the frame indexed by ``rec`` under ``key``, or None.

    ``decode`` runs the full decompression and the key-bound checksum; without it only sizes,
    the frame header and the index record are compared. With ``auth``, a record whose MAC is
    missing or wrong is ``FORGED``.
    """
    if len(memoryview(payload)) != rec.stored_len:
        return SIZE_MISMATCH
    try:
        info = codec.frame_info(payload)
    except (codec.CorruptRecord, ValueError):
        return FRAME_UNREADABLE
    if (info.raw_len, info.checksum, info.codec, info.dtype) != (
            rec.raw_len, rec.checksum, rec.codec, rec.dtype):
        return FRAME_MISMATCH
    if rec.group != group_of(key):
        return GROUP_MISMATCH
    if auth is not None and not auth.verify(key, payload, rec.mac):
        return FORGED
    if decode:
        try:
            codec.decode_into(payload, codec.scratch(rec.raw_len), key=key, info=info)
        except (codec.CorruptRecord, ValueError):
            return CHECKSUM
    return None


def check(txn: lmdb.Transaction, h: Handles, key: bytes, *, decode: bool = True,
          auth: ValueAuth | None = None) -> tuple[bool, str | None]:
    """``(present, problem)`` for ``key`` in a transaction opened with ``buffers=True``.

    ``present`` is False when neither an index record nor a payload exists (deleted meanwhile).
    """
    try:
        value = txn.get(key, db=h.index)
        payload = txn.get(key, db=h.payload)
    except LMDB_DAMAGE:
        return True, PAGE_DAMAGED
    if value is None:
        return (payload is not None, None if payload is None else ORPHAN_PAYLOAD)
    rec = decode_index(value)
    if rec is None:
        return True, INDEX_UNREADABLE
    if payload is None:
        return True, PAYLOAD_MISSING
    try:
        return True, check_frame(rec, key, payload, decode=decode, auth=auth)
    except LMDB_DAMAGE:
        return True, PAGE_DAMAGED


def check_all(read: Callable[[Callable[[lmdb.Transaction[Any], Handles], Any]], Any], keys: Sequence[bytes],
              *, decode: bool = True) -> list[tuple[bytes, bool, str | None]]:
    """``(key, present, problem)`` for every key, checked in as few read transactions (``read``
    runs a function in one) as the store's damage allows: an LMDB error leaves its transaction
    unusable, so the keys after a damaged one are checked in a new one."""
    out: list[tuple[bytes, bool, str | None]] = []
    while len(out) < len(keys):

        def body(txn: lmdb.Transaction, h: Handles, start: int = len(out)) -> list[tuple[bytes, bool, str | None]]:
            done = []
            for key in keys[start:]:
                present, problem = check(txn, h, key, decode=decode)
                done.append((key, present, problem))
                if problem == PAGE_DAMAGED:
                    break  # this transaction is dead now
            return done

        try:
            out += read(body)
        except LMDB_DAMAGE:
            out.append((keys[len(out)], True, PAGE_DAMAGED))
    return out


def read_into(txn: lmdb.Transaction, h: Handles, key: bytes, out: Buffer,
              auth: ValueAuth | None = None) -> int | str | None:
    """Decode ``key``'s frame into ``out`` (the serving read): the bytes written, None for a
    miss, or the problem with the record (never wrong bytes: the frame must match its index
    record, carry a MAC ``auth`` accepts when given, and decode under its own key). ValueError
    when ``out`` is too small."""
    try:
        value = txn.get(key, db=h.index)
        if value is None:
            return None
        rec = decode_index(value)
        if rec is None:
            return INDEX_UNREADABLE
        payload = txn.get(key, db=h.payload)
        if payload is None:
            return PAYLOAD_MISSING
        if len(payload) != rec.stored_len:
            return SIZE_MISMATCH
        try:
            info = codec.frame_info(payload)
        except codec.CorruptRecord:
            return FRAME_UNREADABLE
        if (info.raw_len, info.checksum) != (rec.raw_len, rec.checksum):
            return FRAME_MISMATCH
        if auth is not None and not auth.verify(key, payload, rec.mac):
            return FORGED
        try:
            return codec.decode_into(payload, out, key=key, info=info)
        except codec.CorruptRecord:
            return CHECKSUM
    except LMDB_DAMAGE:
        return PAGE_DAMAGED


# ---- namespaces --------------------------------------------------------------------------------


def namespaces(txn: lmdb.Transaction, h: Handles) -> tuple[dict[bytes, dict[str, Any]], list[bytes]]:
    """The registered namespaces (fingerprint -> description), and the fingerprints whose
    entries cannot be read."""
    cursor = txn.cursor(db=h.meta)
    out: dict[bytes, dict[str, Any]] = {}
    bad: list[bytes] = []
    found = cursor.set_range(META_NS)
    while found and bytes(cursor.key()).startswith(META_NS):
        ns = bytes(cursor.key())[len(META_NS):]
        try:
            info = msgspec.json.decode(cursor.value())
        except (msgspec.DecodeError, ValueError):
            info = None
        if isinstance(info, dict):
            out[ns] = info
        else:
            bad.append(ns)
        found = cursor.next()
    return out, bad


def namespace_info(txn: lmdb.Transaction, h: Handles, ns: bytes) -> dict[str, Any] | None:
    raw = txn.get(META_NS + ns, db=h.meta)
    if raw is None:
        return None
    try:
        info = msgspec.json.decode(raw)
    except (msgspec.DecodeError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def register_namespace(txn: lmdb.Transaction, h: Handles, ns: bytes, info: dict[str, Any],
                       *, overwrite: bool = True) -> bool:
    """Record ``ns`` and what it describes; True when written."""
    return bool(txn.put(META_NS + ns, msgspec.json.encode(info), db=h.meta, overwrite=overwrite))


def unregister_namespace(txn: lmdb.Transaction, h: Handles, ns: bytes) -> bool:
    return bool(txn.delete(META_NS + ns, db=h.meta))
