"""kvstrata's load plans (R22, R35): the blocks of each chunk a hit loads, for full-attention,
sliding-window and Mamba groups and mixed block sizes (docs/SEMANTICS.md §3)."""

from __future__ import annotations

import pytest
from semantics_helpers import (
    E1,
    E3,
    T4,
    fa,
    hashes,
    keys_of,
    mamba,
    serve,
    sw,
)

from kvstrata.semantics import (
    ChunkTransfer,
    Layout,
    chunks_covered,
    plan_load,
)


# ----------------------------------------------------------------------------- loads
def test_load_plan_full_and_sliding_r22():
    """tpb 4, window 8, prompt 13: FA loads blocks 0-2, SW blocks 1-2 (block 0 is skipped)."""
    layout = Layout((fa(0, **T4), sw(1, 8, **T4)), retention_interval=None)
    keys = keys_of(layout, hashes(13, 4))
    assert serve(layout, 13) == 12
    plan = plan_load(
        layout,
        local_computed=0,
        hit_tokens=12,
        block_ids={0: [5, 6, 7, 8], 1: [0, 9, 10, 11]},
        keys=keys,
    )
    assert [(t.group, t.chunk_index, t.block_ids) for t in plan] == [
        (0, 0, (5,)), (0, 1, (6,)), (0, 2, (7,)), (1, 1, (9,)), (1, 2, (10,)),
    ]  # fmt: skip
    assert [t.key for t in plan] == [keys[0][0], keys[0][1], keys[0][2], keys[1][1], keys[1][2]]


def test_load_plan_baseline_r35():
    """Prompt 210, hit 192: FA loads 12 blocks from index 0, SW 4 blocks from index 8."""
    keys = keys_of(E3, hashes(210, 16))
    assert serve(E3, 210) == 192
    sw_blocks = [0] * 8 + list(range(50, 55))  # positions before the window are null blocks
    plan = plan_load(
        E3,
        local_computed=0,
        hit_tokens=192,
        block_ids={0: list(range(1, 15)), 1: sw_blocks},
        keys=keys,
    )
    fa_blocks = [b for t in plan if t.group == 0 for b in t.block_ids]
    sw_loaded = [t for t in plan if t.group == 1]
    assert fa_blocks == list(range(1, 13))
    assert [(t.chunk_index, t.block_ids, t.first_block_in_chunk) for t in sw_loaded] == [
        (4, (50, 51), 0),
        (5, (52, 53), 0),
    ]


def test_load_plan_enters_a_half_local_chunk_at_an_offset():
    keys = keys_of(E1, hashes(100, 16))
    plan = plan_load(
        E1, local_computed=48, hit_tokens=48, block_ids={0: [1, 2, 3, 4, 5, 6]}, keys=keys
    )
    assert plan == [
        ChunkTransfer(0, 1, keys[0][1], (4,), 1),
        ChunkTransfer(0, 2, keys[0][2], (5, 6), 0),
    ]
    assert chunks_covered(E1, 96) == {0: 3}


def test_load_plan_different_block_sizes():
    layout = Layout((fa(0, tpb=12, bpc=1, tph=4), fa(1, tpb=16, bpc=1, tph=4)))
    keys = keys_of(layout, hashes(85, 4))
    plan = plan_load(
        layout, local_computed=48, hit_tokens=32,
        block_ids={0: [1, 2, 3, 4, 5, 6, 7], 1: [11, 12, 13, 14, 15]}, keys=keys,
    )  # fmt: skip
    assert [(t.group, t.chunk_index) for t in plan] == [(0, 4), (0, 5), (0, 6), (1, 3), (1, 4)]


def test_load_plan_mamba_state_block_and_errors():
    layout = Layout((fa(0, tpb=4, bpc=2, tph=4), mamba(1, 16, bpc=2, tph=4)))
    keys = keys_of(layout, hashes(40, 4))
    plan = plan_load(
        layout,
        local_computed=0,
        hit_tokens=32,
        block_ids={0: list(range(1, 9)), 1: [0, 77]},
        keys=keys,
    )
    assert plan[-1] == ChunkTransfer(1, 0, keys[1][0], (77,), 1)
    with pytest.raises(ValueError, match="blocks allocated"):
        plan_load(
            layout, local_computed=0, hit_tokens=32, block_ids={0: [1], 1: [0, 77]}, keys=keys
        )
    with pytest.raises(ValueError, match="null block"):
        plan_load(
            layout,
            local_computed=0,
            hit_tokens=32,
            block_ids={0: [1, 0, 3, 4, 5, 6, 7, 8], 1: [0, 77]},
            keys=keys,
        )
