"""Whether one stored record is sound: its index record, its payload frame and its checksum.

Used by ``kvstrata verify`` (report, then re-check before dropping) and ``kvstrata export`` (only
sound records leave the store). The check reads the index record and the payload in the caller's
transaction, so a concurrent writer can never make a record look half-written.
"""

from __future__ import annotations

from typing import Any

import lmdb
import msgspec

from kvstrata.compaction import storeaccess as sa
from kvstrata.tiers import codec

# Problems, as reported to the user.
INDEX_UNREADABLE = "index record unreadable"
PAYLOAD_MISSING = "payload missing"
ORPHAN_PAYLOAD = "payload without index record"
SIZE_MISMATCH = "payload size differs from the index record"
FRAME_UNREADABLE = "payload frame header unreadable"
FRAME_MISMATCH = "payload frame does not match the index record"
GROUP_MISMATCH = "index record group differs from the key"
CHECKSUM = "checksum mismatch (payload corrupt)"

def check_frame(rec: sa.IndexRecord, key: bytes, payload: Any, *, decode: bool = True) -> str | None:
    """The problem with ``payload`` as the frame indexed by ``rec``, or None when it is sound.

    ``decode`` runs the full decompression and checksum; without it only sizes and the frame
    header are compared with the index record.
    """
    if len(payload) != rec.stored_len:
        return SIZE_MISMATCH
    try:
        info = codec.frame_info(payload)
    except (codec.CorruptRecord, ValueError):
        return FRAME_UNREADABLE
    if (info.raw_len, info.checksum, info.codec, info.dtype) != (
        rec.raw_len,
        rec.checksum,
        rec.codec,
        rec.dtype,
    ):
        return FRAME_MISMATCH
    if rec.group != sa.group_of(key):
        return GROUP_MISMATCH
    if decode:
        try:
            codec.decode_into(payload, codec.scratch(rec.raw_len))
        except (codec.CorruptRecord, ValueError):
            return CHECKSUM
    return None


def check_key(txn: lmdb.Transaction, h: sa.Handles, key: bytes) -> tuple[bool, str | None]:
    """``(present, problem)`` for ``key`` in a transaction opened with ``buffers=True``.

    ``present`` is False when neither an index record nor a payload exists (deleted meanwhile).
    """
    value = txn.get(key, db=h.index)
    payload = txn.get(key, db=h.payload)
    if value is None:
        return (payload is not None, None if payload is None else ORPHAN_PAYLOAD)
    try:
        rec = sa.decode_index(value)
    except msgspec.DecodeError:
        return True, INDEX_UNREADABLE
    if payload is None:
        return True, PAYLOAD_MISSING
    return True, check_frame(rec, key, payload)
