"""The portable store archive: a streamed, checksummed sequence of stored records.

A record is carried as the store's own codec frame (self-describing and checksummed over its raw
bytes), so exporting never recompresses and importing can write the frame as it is. Layout, all
integers little-endian::

    header   "KVSTRARC" | version u16 | flags u16 | manifest_len u32 | manifest (JSON)
             | xxh3-64(header + manifest) u64
    record   tag "R" u8 | key_len u16 | frame_len u64 | tick u64 | key | xxh3-64(fields + key) u64
             | frame | xxh3-64(frame) u64
    ...
    trailer  tag "E" u8 | records u64 | raw_bytes u64 | stored_bytes u64
             | xxh3-128(every byte before this digest) 16 bytes | "KVSTREND"

The record header is checked before its lengths are trusted (a flipped length never turns into
a huge read), the frame has its own digest (a bad record is named by number), and the trailer's
whole-archive digest plus counts catch truncation, reordering and splicing. The manifest names
the namespaces the archive holds, with their descriptions, and when it was written.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import xxhash

from kvstrata.tiers import codec

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAGIC = b"KVSTRARC"
END_MAGIC = b"KVSTREND"
VERSION = 1
_HEADER = struct.Struct("<8sHHI")
_U64 = struct.Struct("<Q")
_RECORD = struct.Struct("<BHQQ")
_TRAILER = struct.Struct("<BQQQ")
_TAG_RECORD = 0x52  # "R"
_TAG_END = 0x45  # "E"
TRAILER_BYTES = _TRAILER.size + 16 + len(END_MAGIC)
MAX_MANIFEST = 64 << 20
MAX_KEY = 511  # LMDB's default maximum key size
MAX_FRAME = 1 << 34  # far above any chunk; bounds what a reader will allocate


class ArchiveError(Exception):
    """The archive is not a kvstrata archive, is corrupt, or is truncated; the message says where."""


@dataclass(frozen=True)
class ArchiveRecord:
    number: int  # 1-based, as reported in errors
    key: bytes
    tick: int
    frame_len: int
    frame: bytes | None  # None when read with frames=False


@dataclass(frozen=True)
class ArchiveSummary:
    records: int
    raw_bytes: int
    stored_bytes: int


# ---- writing ---------------------------------------------------------------------------------


class ArchiveWriter:
    """Writes an archive to a binary file object, one record at a time."""

    def __init__(self, out: IO[bytes], manifest: dict[str, Any]) -> None:
        self._out = out
        self._whole = xxhash.xxh3_128()
        self.records = 0
        self.raw_bytes = 0
        self.stored_bytes = 0
        body = json.dumps(manifest, sort_keys=True).encode()
        head = _HEADER.pack(MAGIC, VERSION, 0, len(body)) + body
        self._emit(head + _U64.pack(xxhash.xxh3_64_intdigest(head)))

    def _emit(self, data: Buffer) -> None:
        self._whole.update(data)
        self._out.write(data)

    def add(self, key: bytes, tick: int, frame: Buffer, raw_len: int) -> None:
        """Append one record. ``frame`` is a codec frame (written as it is, never copied)."""
        view = memoryview(frame).cast("B")
        if not 0 < len(key) <= MAX_KEY:
            raise ValueError(f"archive keys must be 1..{MAX_KEY} bytes, got {len(key)}")
        head = _RECORD.pack(_TAG_RECORD, len(key), len(view), tick) + key
        self._emit(head + _U64.pack(xxhash.xxh3_64_intdigest(head)))
        self._emit(view)
        self._emit(_U64.pack(xxhash.xxh3_64_intdigest(view)))
        self.records += 1
        self.raw_bytes += raw_len
        self.stored_bytes += len(view)

    def finish(self) -> ArchiveSummary:
        self._emit(_TRAILER.pack(_TAG_END, self.records, self.raw_bytes, self.stored_bytes))
        self._out.write(self._whole.digest() + END_MAGIC)
        return ArchiveSummary(self.records, self.raw_bytes, self.stored_bytes)


# ---- reading ---------------------------------------------------------------------------------


class ArchiveReader:
    """Reads and checks an archive from a binary file object.

    Iterate :meth:`records`; the trailer is checked when the iteration ends (an exception then
    means the whole archive must be rejected, whatever was yielded before). With ``frames=False``
    frames are skipped by seeking (record headers are still checked, the whole-archive digest
    cannot be), for a pass that only needs keys.
    """

    def __init__(self, src: IO[bytes]) -> None:
        self._src = src
        self._whole = xxhash.xxh3_128()
        self.offset = 0
        head = self._read(_HEADER.size, "the archive header")
        magic, version, _flags, length = _HEADER.unpack(head)
        if magic != MAGIC:
            raise ArchiveError("not a kvstrata archive (bad magic at the start)")
        if version != VERSION:
            raise ArchiveError(f"archive format version {version}; this build reads version {VERSION}")
        if length > MAX_MANIFEST:
            raise ArchiveError(f"corrupt header: manifest length {length}")
        body = self._read(length, "the manifest")
        digest = _U64.unpack(self._read(_U64.size, "the manifest checksum"))[0]
        if digest != xxhash.xxh3_64_intdigest(head + body):
            raise ArchiveError("corrupt header: manifest checksum mismatch")
        try:
            self.manifest: dict[str, Any] = json.loads(body)
        except ValueError as exc:
            raise ArchiveError(f"corrupt header: manifest is not JSON ({exc})") from None
        self.summary: ArchiveSummary | None = None

    def _read(self, n: int, what: str, *, hashed: bool = True) -> bytes:
        data = self._src.read(n)
        if len(data) != n:
            raise ArchiveError(
                f"archive is truncated: it ends inside {what} (byte offset {self.offset + len(data)})"
            )
        self.offset += n
        if hashed:
            self._whole.update(data)
        return data

    def records(self, *, frames: bool = True) -> Iterator[ArchiveRecord]:
        number = 0
        raw = stored = 0
        while True:
            number += 1
            tag = self._read(1, f"record {number}")[0]
            if tag == _TAG_END:
                break
            if tag != _TAG_RECORD:
                raise ArchiveError(f"record {number}: bad record tag {tag:#x} at byte {self.offset - 1}")
            fields = self._read(_RECORD.size - 1, f"record {number}'s header")
            _, key_len, frame_len, tick = _RECORD.unpack(bytes([tag]) + fields)
            if not 0 < key_len <= MAX_KEY:
                raise ArchiveError(f"record {number}: corrupt header (key length {key_len})")
            key = self._read(key_len, f"record {number}'s key")
            digest = _U64.unpack(self._read(_U64.size, f"record {number}'s header checksum"))[0]
            if digest != xxhash.xxh3_64_intdigest(bytes([tag]) + fields + key):
                raise ArchiveError(f"record {number}: header checksum mismatch")
            if frame_len > MAX_FRAME:
                raise ArchiveError(f"record {number}: corrupt header (frame length {frame_len})")
            frame: bytes | None = None
            if frames:
                frame = self._read(frame_len, f"record {number}'s payload")
                want = _U64.unpack(self._read(_U64.size, f"record {number}'s checksum"))[0]
                if want != xxhash.xxh3_64_intdigest(frame):
                    raise ArchiveError(f"record {number}: payload checksum mismatch")
                try:
                    raw += codec.frame_info(frame).raw_len
                except codec.CorruptRecord as exc:
                    raise ArchiveError(f"record {number}: unreadable payload frame ({exc})") from None
            else:
                self._skip(frame_len + _U64.size, f"record {number}'s payload")
            stored += frame_len
            yield ArchiveRecord(number, key, tick, frame_len, frame)
        self._finish(number - 1, raw if frames else None, stored, check_digest=frames)

    def _skip(self, n: int, what: str) -> None:
        end = self._src.seek(n, io.SEEK_CUR)
        size = self._src.seek(0, io.SEEK_END)
        if end > size:
            raise ArchiveError(f"archive is truncated: it ends inside {what} (byte offset {size})")
        self._src.seek(end)
        self.offset += n

    def _finish(self, count: int, raw: int | None, stored: int, *, check_digest: bool) -> None:
        fields = self._read(_TRAILER.size - 1, "the trailer")
        _, records, raw_bytes, stored_bytes = _TRAILER.unpack(bytes([_TAG_END]) + fields)
        digest = self._read(16, "the trailer", hashed=False)
        end = self._read(len(END_MAGIC), "the trailer", hashed=False)
        if end != END_MAGIC:
            raise ArchiveError("corrupt trailer (bad end marker)")
        if self._src.read(1):
            raise ArchiveError(f"unexpected data after the end of the archive (byte offset {self.offset})")
        if records != count or stored_bytes != stored or (raw is not None and raw != raw_bytes):
            raise ArchiveError(
                f"archive trailer says {records} records / {stored_bytes} bytes, "
                f"found {count} / {stored}: records are missing or were spliced"
            )
        if check_digest and digest != self._whole.digest():
            raise ArchiveError("whole-archive checksum mismatch")
        self.summary = ArchiveSummary(records, raw_bytes, stored_bytes)


def peek_summary(src: IO[bytes]) -> ArchiveSummary | None:
    """The trailer's counts without reading the archive (for a progress bar), if it has one."""
    try:
        pos = src.tell()
        size = src.seek(0, io.SEEK_END)
        if size < TRAILER_BYTES:
            return None
        src.seek(size - TRAILER_BYTES)
        data = src.read(TRAILER_BYTES)
        src.seek(pos)
    except (OSError, ValueError):
        return None
    tag, records, raw, stored = _TRAILER.unpack_from(data)
    if tag != _TAG_END or not data.endswith(END_MAGIC):
        return None
    return ArchiveSummary(records, raw, stored)
