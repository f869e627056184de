"""kvstrata.tiers.codec: round trips, plane selection, and detection of damaged frames."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard as zstd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.tiers import codec
from kvstrata.tiers.codec import CorruptRecord

DTYPES = sorted(codec.DTYPES)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bf16_kv(n_elems: int, seed: int = 0) -> bytes:
    """bf16 bit patterns with per-channel scales, like real KV (high byte compressible)."""
    rng = np.random.default_rng(seed)
    channels = 256
    scale = rng.lognormal(0.0, 0.6, channels).astype(np.float32)
    x = rng.standard_normal((n_elems // channels, channels), dtype=np.float32) * scale
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@st.composite
def typed_bytes(draw: st.DrawFn) -> tuple[bytes, str]:
    dtype = draw(st.sampled_from(DTYPES))
    size = codec.itemsize(dtype)
    kind = draw(st.sampled_from(["random", "structured", "repeat"]))
    n = draw(st.integers(0, 3000)) * size
    if kind == "random":
        data = draw(st.binary(min_size=n, max_size=n))
    elif kind == "repeat":  # compressible in every plane
        data = (draw(st.binary(min_size=size, max_size=4 * size)) * (n // size + 1))[:n]
    else:  # small-magnitude numbers: low-entropy high bytes, random low bytes
        seed = draw(st.integers(0, 2**32 - 1))
        data = np.random.default_rng(seed).integers(0, 1 << (4 * size), n // size, dtype=np.uint64)
        data = data.astype(f"<u{size}").tobytes()[:n]
    return data, dtype


@SETTINGS
@given(typed_bytes(), st.sampled_from(["auto", "raw"]), st.sampled_from([1, 3]))
def test_round_trip_every_dtype_and_mode(sample: tuple[bytes, str], mode: str, level: int) -> None:
    data, dtype = sample
    frame = codec.encode(data, dtype, level=level, mode=mode)  # type: ignore[arg-type]
    info = codec.frame_info(frame)
    assert info.raw_len == len(data)
    assert info.dtype == dtype
    if mode == "raw":
        assert info.codec == codec.CODEC_RAW
    assert codec.decode(frame) == data
    # decode_into writes exactly raw_len bytes into a larger buffer and leaves the rest alone
    out = bytearray(b"\xaa" * (len(data) + 7))
    assert codec.decode_into(frame, out) == len(data)
    assert bytes(out[: len(data)]) == data
    assert bytes(out[len(data) :]) == b"\xaa" * 7


def test_bf16_compresses_high_plane_only() -> None:
    data = bf16_kv(1 << 19)
    frame = codec.encode(data, "bfloat16")
    info = codec.frame_info(frame)
    assert info.codec == codec.CODEC_PLANES
    # plane 0 = low (mantissa) bytes: random, stored raw; plane 1 = sign+exponent: zstd
    assert [method for method, _ in info.planes] == [codec.PLANE_RAW, codec.PLANE_ZSTD]
    assert len(data) / len(frame) > 1.35
    assert codec.decode(frame) == data


def test_float32_planes_and_one_byte_dtypes() -> None:
    x = np.random.default_rng(1).standard_normal(1 << 16).astype(np.float32)
    info = codec.frame_info(codec.encode(x.tobytes(), "float32"))
    assert info.codec == codec.CODEC_PLANES and len(info.planes) == 4
    assert info.planes[3][0] == codec.PLANE_ZSTD  # sign + exponent
    assert info.planes[0][0] == codec.PLANE_RAW  # low mantissa bits
    small = (np.arange(1 << 16) % 5).astype(np.uint8).tobytes()
    frame = codec.encode(small, "float8_e4m3fn")
    assert len(codec.frame_info(frame).planes) == 1 and len(frame) < len(small) // 10
    assert codec.decode(frame) == small


def test_incompressible_data_falls_back_to_raw() -> None:
    data = np.random.default_rng(2).integers(0, 256, 1 << 18, dtype=np.uint8).tobytes()
    for dtype in ("bfloat16", "float32", "uint8"):
        frame = codec.encode(data, dtype)
        assert codec.frame_info(frame).codec == codec.CODEC_RAW
        assert len(frame) == codec.HEADER_SIZE + 9 + len(data)


def test_raw_mode_never_compresses() -> None:
    data = bytes(1 << 16)
    frame = codec.encode(data, "bfloat16", mode="raw")
    assert codec.frame_info(frame).codec == codec.CODEC_RAW
    assert codec.decode(frame) == data
    assert len(codec.encode(data, "bfloat16")) < 1000  # ...while auto does


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "uint8"])
def test_every_truncation_is_detected(dtype: str) -> None:
    frame = codec.encode(bf16_kv(4096, seed=3), dtype)
    out = bytearray(codec.frame_info(frame).raw_len)
    for cut in range(len(frame)):
        with pytest.raises(CorruptRecord):
            codec.decode_into(frame[:cut], out)
    with pytest.raises(CorruptRecord):
        codec.decode_into(frame + b"\x00", out)  # trailing garbage too


@pytest.mark.parametrize("mode", ["auto", "raw"])
def test_bit_flips_never_yield_wrong_data(mode: str) -> None:
    data = bf16_kv(2048, seed=4)
    frame = bytearray(codec.encode(data, "bfloat16", mode=mode))  # type: ignore[arg-type]
    out = bytearray(len(data))
    rng = np.random.default_rng(5)
    detected = 0
    for pos in range(len(frame)):
        bit = 1 << int(rng.integers(0, 8))
        frame[pos] ^= bit
        try:
            n = codec.decode_into(bytes(frame), out)
        except CorruptRecord:
            detected += 1
        else:  # a flip the format ignores must still give the original bytes
            assert n == len(data) and bytes(out) == data, f"wrong data after flipping byte {pos}"
        frame[pos] ^= bit
    assert detected >= len(frame) - 8  # at most a few don't-care bits in zstd headers
    assert codec.decode(bytes(frame)) == data


def test_header_checks() -> None:
    data = bf16_kv(2048)
    frame = bytearray(codec.encode(data, "bfloat16"))
    for offset, value, message in [
        (0, ord("X"), "magic"),
        (4, codec.VERSION + 1, "version"),
        (5, 9, "codec"),
        (6, 250, "dtype"),
        (7, 3, "planes"),
    ]:
        bad = bytearray(frame)
        bad[offset] = value
        with pytest.raises(CorruptRecord, match=message):
            codec.decode(bytes(bad))
    with pytest.raises(CorruptRecord, match="shorter than its header"):
        codec.decode(b"KVSF")


def test_zstd_plane_declaring_another_size_is_rejected_before_allocating() -> None:
    n = 1024
    bogus = zstd.ZstdCompressor().compress(bytes(1 << 20))  # declares 1 MiB, plane holds 512 B
    header = struct.pack("<4sBBBBQQ", b"KVSF", codec.VERSION, codec.CODEC_PLANES, 5, 2, n, 0)
    table = struct.pack("<BQ", codec.PLANE_RAW, n // 2) + struct.pack(
        "<BQ", codec.PLANE_ZSTD, len(bogus)
    )
    frame = header + table + bytes(n // 2) + bogus
    with pytest.raises(CorruptRecord, match="declares"):
        codec.decode_into(frame, bytearray(n))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        codec.encode(b"ab", "complex64")
    with pytest.raises(ValueError, match="whole number"):
        codec.encode(b"abc", "bfloat16")
    with pytest.raises(ValueError, match="mode"):
        codec.encode(b"ab", "bfloat16", mode="fast")  # type: ignore[arg-type]
    frame = codec.encode(bytes(64), "bfloat16")
    with pytest.raises(ValueError, match="output buffer"):
        codec.decode_into(frame, bytearray(63))
    with pytest.raises(ValueError, match="writable"):
        codec.decode_into(frame, bytes(64))


def test_threads_share_nothing() -> None:
    # zstandard contexts shared between threads crash; the codec keeps them per thread.
    blobs = [bf16_kv(1 << 16, seed=s) for s in range(16)]

    def round_trip(blob: bytes) -> bool:
        out = bytearray(len(blob))
        for _ in range(4):
            codec.decode_into(codec.encode(blob, "bfloat16"), out)
        return bytes(out) == blob

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trip, blobs))
