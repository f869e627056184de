"""kvstrata's semantics geometry: chunk and boundary keys, window sizes, layout order, alignment,
validation and partial-tail support (docs/SEMANTICS.md §3: R3-R5, R7, R8, R13, R20)."""

from __future__ import annotations

import pytest
from semantics_helpers import (
    fa,
    hashes,
    mamba,
    sw,
)

from kvstrata.semantics import (
    GroupGeometry,
    GroupKind,
    Layout,
    boundary_key,
    chunk_keys,
    make_key,
)


def test_chunk_geometry_and_key_format():
    g = fa(3, tpb=16, bpc=2, tph=8)
    assert (g.tokens_per_chunk, g.hashes_per_chunk) == (32, 4)
    hs = hashes(100, 8)  # 12 hashes -> 3 complete chunks
    assert chunk_keys(hs, g) == [hs[3] + b"\0\0\0\3", hs[7] + b"\0\0\0\3", hs[11] + b"\0\0\0\3"]
    assert chunk_keys(hs, g, start=2) == [hs[11] + b"\0\0\0\3"]
    assert chunk_keys(hs[:3], g) == []
    assert make_key(b"ab", 258) == b"ab\0\0\1\2"
    # R13: a chunk-aligned boundary key is the chunk key; a finer boundary ends at its hash.
    assert boundary_key(hs, 64, g) == chunk_keys(hs, g)[1]
    assert boundary_key(hs, 40, g) == hs[4] + b"\0\0\0\3"
    with pytest.raises(ValueError):
        boundary_key(hs, 42, g)


@pytest.mark.parametrize(
    "geom, window",
    [
        (fa(), None),
        (sw(0, 64), 2),  # E3
        (sw(0, 8, tpb=4, bpc=1, tph=4, extra=3), 3),  # E3: window 8 + extra 3, tpc 4
        (sw(0, 65), 3),
        (sw(0, 1), 1),
        (GroupGeometry(0, GroupKind.CHUNKED_LOCAL, 1024, 1, 16, attention_chunk_size=8192), 8),
        (GroupGeometry(0, GroupKind.CHUNKED_LOCAL, 1000, 3, 8, attention_chunk_size=8192), 3),
        (mamba(0, 256), 1),
    ],
)
def test_window_chunks_r3(geom, window):
    assert geom.window_chunks == window


@pytest.mark.parametrize(
    "window, extra, num_tokens, expected",
    [
        (64, 0, 192, 2),
        (64, 0, 191, 2),
        (64, 0, 170, 3),
        (64, 0, 161, 3),
        (64, 0, 160, 2),
        (8, 3, 13, 4),
        (8, 3, 12, 3),
        (32, 0, 33, 2),
    ],
)
def test_load_window_widens_for_unaligned_boundaries_r20(window, extra, num_tokens, expected):
    tpb, bpc = (4, 1) if window == 8 else (16, 2)
    assert (
        sw(0, window, tpb=tpb, bpc=bpc, tph=tpb, extra=extra).load_window_chunks(num_tokens)
        == expected
    )


def test_layout_order_alignment_and_mamba_size():
    layout = Layout(
        (sw(0, 32), fa(1), mamba(2, 32, bpc=2), sw(3, 128), fa(4)), retention_interval=None
    )
    assert [g.index for g in layout.lookup_order] == [1, 4, 3, 0, 2]  # R3: FA, then windows desc
    assert layout.alignment_tokens == 32  # R4
    assert layout.mamba_tokens_per_chunk == 64  # R5
    assert Layout((fa(0, tpb=12, tph=4), fa(1, tpb=16, tph=4))).alignment_tokens is None
    assert Layout((sw(0, 64), mamba(1, 32, bpc=2)), retention_interval=None).alignment_tokens == 64
    assert Layout((fa(),)).mamba_tokens_per_chunk is None


def test_layout_validation():
    with pytest.raises(ValueError, match="multiple"):
        Layout((fa(), sw(1, 64)), retention_interval=48)  # R8: multiple of every windowed tpc
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        Layout((fa(0, bpc=1), fa(1, bpc=2)))
    with pytest.raises(ValueError, match="duplicate"):
        Layout((fa(0), fa(0)))
    with pytest.raises(ValueError, match="Mamba"):
        Layout((mamba(0, 16), mamba(1, 32)))
    with pytest.raises(ValueError, match="hash block"):
        fa(0, tpb=12, tph=8)
    with pytest.raises(ValueError):
        GroupGeometry(0, GroupKind.SLIDING, 16, 1, 16)
    Layout((fa(), sw(1, 64)), retention_interval=64)


def test_partial_tail_support_r7():
    assert Layout((fa(0, 16, 1, 4), mamba(1, 16, 1, 4))).supports_partial_tail
    assert not Layout((fa(0, 16, 1, 16), mamba(1, 16, 1, 16))).supports_partial_tail
    assert not Layout((fa(0, 16, 2, 4), mamba(1, 16, 2, 4))).supports_partial_tail
    assert not Layout((fa(0, 16, 1, 4, drafter=True), mamba(1, 16, 1, 4))).supports_partial_tail
