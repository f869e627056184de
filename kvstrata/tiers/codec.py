"""Framed, checksummed compression of KV pages (byte planes + zstd).

Float KV compresses only through its exponent bytes: on bf16 the high byte (sign + 7 exponent bits)
carries ~3 bits of entropy while the low byte (mantissa) is random (docs/STORAGE.md §3.2). So each
element is split into byte planes, plane j holding byte j of every element (little-endian), and
only the planes that pay are zstd-coded; the others are stored raw. 1-byte dtypes (fp8, int8) are
one plane. When no plane pays, the frame is a plain copy (codec RAW).

Frame layout (little-endian)::

    magic "KVSF" | version u8 | codec u8 | dtype u8 | nplanes u8 | raw_len u64 | checksum u64
    nplanes x (method u8, stored_len u64)
    plane payloads, in plane order

The checksum is xxh3-64 of the raw bytes seeded with xxh3-64 of the frame's *key* (the store key
it is written under; version 2): a frame is bound to its key, so a read that lands on another
key's frame (a damaged page number in the store's B-tree, a spliced archive) fails its check
instead of serving well-formed, wrong KV. Version 1 frames (unseeded) still read. Every decode
ends by checking the checksum of the bytes it wrote, so a torn, flipped, mislabelled or
misplaced frame raises :class:`CorruptRecord` and is never served as data.

zstd "level 1" here is level 1 with its match finder detuned for float planes (tiny hash table,
minimum match 7): float planes have few long matches, and level 1's default search spends most
of its time finding short matches that cost more bits than the Huffman-coded literals they
replace. Measured on realistic bf16 KV: 2-3x faster to compress, ~2x faster to decompress, and
a smaller result (high plane 2.82x instead of 2.65x). The output is standard zstd either way.
"""

from __future__ import annotations

import struct
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import xxhash
import zstandard as zstd

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "CODEC_RAW",
    "CODEC_PLANES",
    "DTYPES",
    "CorruptRecord",
    "FrameInfo",
    "decode",
    "decode_into",
    "encode",
    "frame_info",
    "itemsize",
    "key_seed",
]

MAGIC = b"KVSF"
VERSION = 2  # 2: checksum seeded with the key's digest; 1: unseeded (still read)
_VERSIONS = (1, 2)

CODEC_RAW = 0  # one plane, the raw bytes
CODEC_PLANES = 1  # nplanes byte planes, each raw or zstd

PLANE_RAW = 0
PLANE_ZSTD = 1

# dtype name (torch name without "torch.") -> (code stored in frames, bytes per element).
# Codes are part of the on-disk format: never renumber, only append.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 1),
    "int8": (2, 1),
    "float8_e4m3fn": (3, 1),
    "float8_e5m2": (4, 1),
    "bfloat16": (5, 2),
    "float16": (6, 2),
    "int16": (7, 2),
    "uint16": (8, 2),
    "float32": (9, 4),
    "int32": (10, 4),
    "uint32": (11, 4),
    "float64": (12, 8),
    "int64": (13, 8),
    "float8_e4m3fnuz": (14, 1),
    "float8_e5m2fnuz": (15, 1),
}
_DTYPE_BY_CODE: dict[int, tuple[str, int]] = {
    code: (name, size) for name, (code, size) in DTYPES.items()
}

_HEADER = struct.Struct("<4sBBBBQQ")
_PLANE = struct.Struct("<BQ")
HEADER_SIZE = _HEADER.size

# A plane is zstd-coded only when it saves at least this fraction of its size: a 1% saving
# is not worth a decompression pass on every load.
_MIN_SAVING = 1.0 / 64
# Planes whose sampled order-0 entropy is above this (bits/byte) are stored raw without trying
# zstd: bf16/fp16 mantissa bytes sit at 7.96-8.0 bits, and trying costs ~0.5 ms per MiB.
_RAW_ENTROPY_BITS = 7.9
_SAMPLE = 16384  # bytes sampled per plane for that estimate
_SMALL_PLANE = 4096  # below this, just try zstd (the sample would be the whole plane anyway)

Mode = Literal["auto", "raw"]


def parse_mode(name: str) -> Mode:
    """A store's ``codec`` option as the encoder's mode; ValueError naming any other value."""
    if name == "auto":
        return "auto"
    if name == "raw":
        return "raw"
    raise ValueError(f"codec must be 'auto' or 'raw', not {name!r}")


class CorruptRecord(Exception):
    """A frame failed validation: bad magic/version/header, torn payload or checksum mismatch."""


@dataclass(frozen=True, slots=True)
class FrameInfo:
    version: int
    codec: int
    dtype: str
    raw_len: int
    checksum: int
    planes: tuple[tuple[int, int], ...]  # (method, stored_len) per plane
    payload_offset: int


def _dtype(dtype: str) -> tuple[int, int]:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {sorted(DTYPES)}") from None


def itemsize(dtype: str) -> int:
    """Bytes per element of a supported dtype name; ValueError for an unknown one."""
    return _dtype(dtype)[1]


# ---------------------------------------------------------------------------------------------
# Per-thread zstd contexts and scratch buffers: zstandard contexts are not thread-safe (sharing
# one between threads segfaults), and creating them per call costs more than small frames do.


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[int, zstd.ZstdCompressor] = {}
        self.decompressor = zstd.ZstdDecompressor()
        self.scratch = np.empty(0, dtype=np.uint8)  # encode side (buffer())
        self.sink = bytearray()  # decodes that only verify a frame (scratch())

    def compressor(self, level: int) -> zstd.ZstdCompressor:
        comp = self.compressors.get(level)
        if comp is None:
            comp = zstd.ZstdCompressor(compression_params=_params_for(level))
            self.compressors[level] = comp
        return comp

    def buffer(self, nbytes: int) -> np.ndarray:
        # Reused between calls: fresh allocations page-fault at 1-3 GB/s, touched memory
        # copies at ~10 GB/s (docs/STORAGE.md §2).
        if self.scratch.size < nbytes:
            self.scratch = np.empty(nbytes, dtype=np.uint8)
        return self.scratch[:nbytes]


_tls = _ThreadState()
# The word-shift plane split assumes byte 0 is the least significant byte of a word.
_LITTLE = sys.byteorder == "little"


def _params_for(level: int) -> zstd.ZstdCompressionParameters:
    if level == 1:
        # See the module docstring: fast strategy, 128 KiB window, tiny tables, minimum match 7.
        # target_length must stay 0: with strategy "fast" a positive value disables
        # Huffman coding of literals, which is where all the gain on float planes comes from.
        return zstd.ZstdCompressionParameters(
            strategy=1,
            window_log=17,
            hash_log=6,
            chain_log=6,
            search_log=1,
            min_match=7,
            target_length=0,
            write_content_size=True,
            write_checksum=False,
        )
    return zstd.ZstdCompressionParameters.from_level(level, write_content_size=True)


# ---------------------------------------------------------------------------------------------
# Encoding


def _split_planes(src: np.ndarray, size: int, planes: np.ndarray) -> None:
    """Write byte plane j of ``src`` (n elements of ``size`` bytes) into ``planes[j]``."""
    if size == 2 and _LITTLE:
        # Shifting as uint16 then narrowing runs ~2x faster than strided byte copies.
        words = src.view(np.uint16)
        np.copyto(planes[0], words, casting="unsafe")
        np.right_shift(words, 8, out=planes[1], casting="unsafe")
    elif size == 4 and _LITTLE:
        words = src.view(np.uint32)
        np.copyto(planes[0], words, casting="unsafe")
        for j in range(1, 4):
            np.right_shift(words, 8 * j, out=planes[j], casting="unsafe")
    else:
        np.copyto(planes, src.reshape(-1, size).T)


def _worth_trying(plane: np.ndarray) -> bool:
    """False when a sample of the plane looks like random bytes (order-0 entropy near 8 bits)."""
    if plane.size <= _SMALL_PLANE:
        return True
    step = max(1, plane.size // _SAMPLE)
    counts = np.bincount(plane[::step], minlength=256)
    p = counts[counts > 0] / counts.sum()
    bits = float(-(p * np.log2(p)).sum())
    return bits < _RAW_ENTROPY_BITS


def key_seed(key: bytes) -> int:
    """The checksum seed that binds a frame to ``key`` (0 for an unbound frame)."""
    return xxhash.xxh3_64_intdigest(key) if key else 0


def _raw_frame(view: memoryview, code: int, checksum: int) -> bytes:
    n = len(view)
    header = _HEADER.pack(MAGIC, VERSION, CODEC_RAW, code, 1, n, checksum)
    return b"".join((header, _PLANE.pack(PLANE_RAW, n), view))


def encode(data: Buffer, dtype: str, *, key: bytes = b"", level: int = 1,
           mode: Mode = "auto") -> bytes:
    """Frame ``data`` (raw bytes of ``dtype`` elements) for ``key``; see the module docstring.

    ``key``: the store key the frame will live under; decoding must name the same key.
    ``mode="raw"`` stores the bytes as they are (checksummed and framed); ``"auto"`` splits
    byte planes and zstd-codes the planes that pay, falling back to raw when none does.
    """
    if mode not in ("auto", "raw"):
        raise ValueError(f"mode must be 'auto' or 'raw', not {mode!r}")
    code, size = _dtype(dtype)
    view = memoryview(data).cast("B")
    n = len(view)
    if n % size:
        raise ValueError(f"{n} bytes is not a whole number of {dtype} elements")
    checksum = xxhash.xxh3_64_intdigest(view, seed=key_seed(key))
    if mode == "raw" or n == 0:
        return _raw_frame(view, code, checksum)

    src = np.frombuffer(view, dtype=np.uint8)
    if size == 1:
        plane_arrays = [src]
    else:
        planes = _tls.buffer(n).reshape(size, n // size)
        _split_planes(src, size, planes)
        plane_arrays = list(planes)

    comp = _tls.compressor(level)
    table: list[bytes] = []
    payloads: list[Buffer] = []
    coded = False
    for plane in plane_arrays:
        payload: Buffer = plane.data  # a row of a C-ordered array: contiguous
        method = PLANE_RAW
        if _worth_trying(plane):
            packed = comp.compress(plane.data)
            if len(packed) <= plane.size * (1.0 - _MIN_SAVING):
                payload, method, coded = packed, PLANE_ZSTD, True
        table.append(_PLANE.pack(method, memoryview(payload).nbytes))
        payloads.append(payload)
    if not coded:
        return _raw_frame(view, code, checksum)
    header = _HEADER.pack(MAGIC, VERSION, CODEC_PLANES, code, size, n, checksum)
    return b"".join([header, *table, *payloads])


# ---------------------------------------------------------------------------------------------
# Decoding


def frame_info(frame: Buffer) -> FrameInfo:
    """Parse and sanity-check a frame header (not the payload); raises CorruptRecord."""
    view = memoryview(frame).cast("B")
    if len(view) < HEADER_SIZE:
        raise CorruptRecord(f"frame of {len(view)} bytes is shorter than its header")
    magic, version, codec, code, nplanes, raw_len, checksum = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptRecord(f"bad magic {bytes(magic)!r}")
    if version not in _VERSIONS:
        raise CorruptRecord(f"frame version {version}, this build reads {_VERSIONS}")
    if code not in _DTYPE_BY_CODE:
        raise CorruptRecord(f"unknown dtype code {code}")
    name, size = _DTYPE_BY_CODE[code]
    if codec == CODEC_RAW:
        if nplanes != 1:
            raise CorruptRecord(f"raw frame with {nplanes} planes")
    elif codec == CODEC_PLANES:
        if nplanes != size:
            raise CorruptRecord(f"{nplanes} planes for {name} ({size}-byte) elements")
    else:
        raise CorruptRecord(f"unknown codec {codec}")
    if raw_len % size:
        raise CorruptRecord(f"raw length {raw_len} is not a whole number of {name} elements")
    offset = HEADER_SIZE + nplanes * _PLANE.size
    if len(view) < offset:
        raise CorruptRecord("frame torn inside its plane table")
    planes = tuple(_PLANE.unpack_from(view, HEADER_SIZE + j * _PLANE.size) for j in range(nplanes))
    plane_raw = raw_len // nplanes
    for method, stored in planes:
        if method == PLANE_RAW and stored != plane_raw:
            raise CorruptRecord(f"raw plane of {stored} bytes, expected {plane_raw}")
        if method not in (PLANE_RAW, PLANE_ZSTD):
            raise CorruptRecord(f"unknown plane method {method}")
    total = offset + sum(stored for _, stored in planes)
    if total != len(view):
        raise CorruptRecord(f"frame is {len(view)} bytes, its header says {total} (torn record?)")
    return FrameInfo(version, codec, name, raw_len, checksum, planes, offset)


def _decompress_plane(payload: memoryview, plane_raw: int) -> bytes:
    # Check the declared size first: a flipped bit in the zstd header must not turn into a
    # multi-GiB allocation.
    try:
        declared = zstd.frame_content_size(payload)
    except zstd.ZstdError as exc:
        raise CorruptRecord(f"bad zstd plane header: {exc}") from None
    if declared != plane_raw:
        raise CorruptRecord(f"zstd plane declares {declared} bytes, expected {plane_raw}")
    try:
        out = _tls.decompressor.decompress(payload)
    except zstd.ZstdError as exc:
        raise CorruptRecord(f"zstd plane does not decompress: {exc}") from None
    if len(out) != plane_raw:
        raise CorruptRecord(f"zstd plane gave {len(out)} bytes, expected {plane_raw}")
    return out


def _join_planes(planes: list[np.ndarray], size: int, dst: np.ndarray) -> None:
    """Inverse of :func:`_split_planes`, writing straight into the caller's buffer."""
    if size == 2 and _LITTLE:
        words = dst.view(np.uint16)
        np.left_shift(planes[1], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, planes[0], out=words, dtype=np.uint16)
    else:
        grid = dst.reshape(-1, size)
        for j, plane in enumerate(planes):
            grid[:, j] = plane


def scratch(nbytes: int) -> bytearray:
    """A reusable per-thread buffer of at least ``nbytes``, for decodes done only to verify a
    frame (the bytes are thrown away; the next call in the same thread overwrites them)."""
    if len(_tls.sink) < nbytes:
        _tls.sink = bytearray(nbytes)
    return _tls.sink


def decode_into(frame: Buffer, out: Buffer, *, key: bytes = b"",
                info: FrameInfo | None = None) -> int:
    """Decode ``frame``, read under ``key``, into the writable buffer ``out``; returns the bytes
    written.

    Raises CorruptRecord on any mismatch — including a version-2 frame written for another key
    (``out`` may then hold garbage: do not use it) — and ValueError when ``out`` is too small
    for the frame's raw length. ``info``: the frame's header, when the caller parsed it already.
    """
    if info is None:
        info = frame_info(frame)
    view = memoryview(frame).cast("B")
    dst_view = memoryview(out).cast("B")
    if dst_view.readonly:
        raise ValueError("decode_into needs a writable buffer")
    if len(dst_view) < info.raw_len:
        raise ValueError(f"output buffer of {len(dst_view)} bytes, frame holds {info.raw_len}")
    n = info.raw_len
    dst = np.frombuffer(dst_view, dtype=np.uint8, count=n)
    pos = info.payload_offset
    if info.codec == CODEC_RAW:
        dst[:] = np.frombuffer(view, dtype=np.uint8, count=n, offset=pos)
    else:
        size = len(info.planes)
        plane_raw = n // size
        planes: list[np.ndarray] = []
        for method, stored in info.planes:
            payload = view[pos : pos + stored]
            pos += stored
            if method == PLANE_ZSTD:
                planes.append(np.frombuffer(_decompress_plane(payload, plane_raw), dtype=np.uint8))
            else:
                planes.append(np.frombuffer(payload, dtype=np.uint8))
        if size == 1:
            dst[:] = planes[0]
        else:
            _join_planes(planes, size, dst)
    seed = key_seed(key) if info.version >= 2 else 0
    if xxhash.xxh3_64_intdigest(dst_view[:n], seed=seed) != info.checksum:
        raise CorruptRecord("checksum mismatch" if info.version < 2 else
                            "checksum mismatch (corrupt, or another key's frame)")
    return n


def decode(frame: Buffer, *, key: bytes = b"") -> bytes:
    """Decode ``frame`` read under ``key`` into new bytes (tiers use :func:`decode_into`)."""
    info = frame_info(frame)
    out = bytearray(info.raw_len)
    decode_into(frame, out, key=key, info=info)
    return bytes(out)
