"""kvstrata's store semantics: what a request offers step by step (R28, R29, D1), which
sliding-window blocks are kept (R31, retention intervals), skipped and stale blocks, and Mamba
states stored only from exact hand-offs (R25) (docs/SEMANTICS.md §3)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from semantics_helpers import (
    T4,
    E,
    MemoryStore,
    fa,
    hashes,
    keys_of,
    mamba,
    mamba_hybrid,
    run_request,
    sw,
)

from kvstrata.semantics import (
    ChunkTransfer,
    Layout,
    boundary_key,
    cdiv,
    chunk_keys,
    offloadable_tokens,
    plan_boundary_stores,
    plan_store,
    plan_store_within,
    sliding_reachable_mask,
    storable_chunks,
)


# ----------------------------------------------------------------------------- stores
def test_drafter_multichunk_prefill_stores_without_holes():
    """Chunked prefill (1000 + 24 tokens) of a drafter group: every prompt chunk stored once."""
    layout = Layout((fa(0, **T4, drafter=True),))
    store = MemoryStore()
    steps = run_request(layout, store, 1024, decode=3, prefill_step=1000, offload_prompt_only=False)
    stored = [c for step in steps for _, c in step]
    assert sorted(stored) == list(range(256))  # chunk 256 (tokens 1024-1027) is the last decode
    assert steps[0] == [(0, c) for c in range(250)] and steps[1] == [
        (0, c) for c in range(250, 256)
    ]


@pytest.mark.parametrize(
    "offloadable, prompt, finished, drafter, expected",
    [
        (12, 12, False, True, 3),  # prefill: trailing prompt chunk is stable
        (16, 12, False, True, 3),  # decoding: hold back the last chunk
        (16, 12, True, True, 4),  # finished: promoted
        (16, 12, False, False, 4),
        (3, 12, False, True, 0),
        (4, 0, False, True, 0),
    ],
)
def test_storable_chunks_r28_r29(offloadable, prompt, finished, drafter, expected):
    g = fa(0, **T4, drafter=drafter)
    kwargs = dict(num_prompt_tokens=prompt, finished=finished, allocated_blocks=100, num_keys=100)
    assert storable_chunks(g, offloadable_tokens=offloadable, **kwargs) == expected
    assert storable_chunks(g, offloadable_tokens=400, **{**kwargs, "allocated_blocks": 2}) <= 2
    assert storable_chunks(g, offloadable_tokens=400, **{**kwargs, "num_keys": 1}) <= 1


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(num_computed=10, num_scheduled=5, num_tokens=20, finished=False, aborted=False), 15),
        (dict(num_computed=10, num_scheduled=50, num_tokens=20, finished=False, aborted=False), 20),
        (dict(num_computed=20, num_scheduled=0, num_tokens=21, finished=True, aborted=False), 20),
        (dict(num_computed=5, num_scheduled=0, num_tokens=12, finished=True, aborted=False), 12),
        (dict(num_computed=7, num_scheduled=0, num_tokens=12, finished=True, aborted=True), 7),
    ],
)
def test_offloadable_tokens_d1(kwargs, expected):
    common = dict(num_prompt_tokens=12, offload_prompt_only=False, max_offload_tokens=None)
    assert offloadable_tokens(**common, **kwargs) == expected
    assert offloadable_tokens(**{**common, "max_offload_tokens": 4}, **kwargs) == min(expected, 4)
    assert offloadable_tokens(**{**common, "offload_prompt_only": True}, **kwargs) == min(
        expected, 12
    )


def _stored_blocks(
    layout: Layout, prompt: int, steps: Sequence[int], *, finish=True, aborted=False
):
    """Blocks (group -> block indices) stored for one request prefilled in ``steps`` tokens."""
    block_ids = {
        g.index: list(range(1, 1 + cdiv(prompt + 1, g.tokens_per_block))) for g in layout.groups
    }
    keys = keys_of(layout, hashes(prompt, layout.tokens_per_hash))
    next_stored = {g.index: 0 for g in layout.groups}
    stored: dict[int, set[int]] = {g.index: set() for g in layout.groups}
    computed = 0

    def offer(scheduled, finished, aborted_):
        off = offloadable_tokens(
            num_computed=computed, num_scheduled=scheduled, num_tokens=prompt + (computed >= prompt),
            num_prompt_tokens=prompt, finished=finished, aborted=aborted_,
            offload_prompt_only=True, max_offload_tokens=None,
        )  # fmt: skip
        candidates, advanced = plan_store(
            layout, offloadable=off, num_prompt_tokens=prompt, finished=finished,
            next_stored_chunk=next_stored, block_ids=block_ids, keys=keys,
        )  # fmt: skip
        for c in candidates:
            stored[c.group].update(
                c.chunk_index * layout.blocks_per_chunk + c.first_block_in_chunk + i
                for i in range(len(c.block_ids))
            )
        next_stored.update(advanced)

    for scheduled in steps:
        offer(scheduled, False, False)
        computed += scheduled
    if finish:
        offer(0, True, aborted)
    return {g: sorted(b) for g, b in stored.items()}


@pytest.mark.parametrize(
    "retention, sw_blocks",
    [(None, list(range(12))), (64, list(range(12))), (0, [8, 9, 10, 11])],
)
def test_worked_store_baseline(retention, sw_blocks):
    layout = Layout((fa(0, **E), sw(1, 64, **E)), retention_interval=retention)
    assert _stored_blocks(layout, 200, [200]) == {0: list(range(12)), 1: sw_blocks}


@pytest.mark.parametrize(
    "retention, extra, sw_blocks",
    [(None, 0, [2, 3, 6, 7]), (None, 3, [1, 2, 3, 5, 6, 7]), (0, 0, [6, 7])],
)
def test_swa_alignment_skip(retention, extra, sw_blocks):
    layout = Layout(
        (fa(0, tpb=16, bpc=1, tph=4), sw(1, 8, tpb=4, bpc=1, tph=4, extra=extra)),
        retention_interval=retention,
    )
    assert _stored_blocks(layout, 33, [33]) == {0: [0, 1], 1: sw_blocks}


@pytest.mark.parametrize("retention, sw_blocks", [(32, [6, 7, 10, 11, 14, 15]), (0, [10, 11])])
def test_retention_interval_sparsifies_sliding_stores(retention, sw_blocks):
    layout = Layout(
        (fa(0, tpb=16, bpc=1, tph=4), sw(1, 8, tpb=4, bpc=1, tph=4)), retention_interval=retention
    )
    assert _stored_blocks(layout, 64, [64])[1] == sw_blocks


@pytest.mark.parametrize("aborted, horizon", [(False, 300), (True, 250)])
def test_chunked_prefill_uses_final_sliding_store_horizon(aborted, horizon):
    layout = Layout(
        (fa(0, tpb=36, bpc=1, tph=4), sw(1, 16, tpb=4, bpc=1, tph=4)), retention_interval=None
    )
    steps = [1000] if aborted else [1000, 200]
    stored = set(_stored_blocks(layout, 1200, steps, aborted=aborted)[1])
    expected = {c for c in range(horizon) if c % 9 >= min(9, horizon - (c - c % 9)) - 4}
    assert stored == expected


def _plan(layout: Layout, prompt: int, next_stored: dict[int, int]) -> dict:
    """plan_store's arguments for a request whose ``prompt`` tokens all have blocks and keys."""
    blocks = {g.index: list(range(1, cdiv(prompt, g.tokens_per_block) + 1)) for g in layout.groups}
    return {
        "num_prompt_tokens": prompt, "next_stored_chunk": next_stored, "block_ids": blocks,
        "keys": {g: ks for g, ks in keys_of(layout, hashes(prompt, layout.tokens_per_hash)).items()},
    }  # fmt: skip


def test_store_within_takes_the_longest_start_the_room_holds():
    """A 10-chunk offer and room for 3: chunks 0-2 now, the scan at 3, the rest offered from there."""
    layout = Layout((fa(0, **T4),))
    plan = _plan(layout, 40, {0: 0})
    whole, _ = plan_store(layout, offloadable=40, finished=False, **plan)
    assert len(whole) == 10
    part, advanced = plan_store_within(layout, 3, offloadable=40, **plan)
    assert [t.chunk_index for t in part] == [0, 1, 2] and advanced == {0: 3}
    rest, advanced = plan_store_within(layout, 3, offloadable=40, **{**plan, "next_stored_chunk": {0: 3}})
    assert [t.chunk_index for t in rest] == [3, 4, 5] and advanced == {0: 6}
    assert part == whole[:3] and rest == whole[3:6]


def test_store_within_stores_the_window_first_then_a_full_attention_start():
    """Full attention and a sliding window kept only at the replay boundary (retention 0): six
    full-attention chunks and the window's tail, chunks 4-5. The window's blocks leave the
    table as the request decodes, the full-attention ones stay: with room for two or more the
    window's tail is stored whole, and the full-attention group takes the start the rest holds."""
    layout = Layout((fa(0, **E), sw(1, 64, **E)), retention_interval=0)
    plan = _plan(layout, 200, {0: 0, 1: 0})
    whole, _ = plan_store(layout, offloadable=200, finished=False, **plan)
    assert [(t.group, t.chunk_index) for t in whole] == [(0, c) for c in range(6)] + [(1, 4), (1, 5)]
    for room in range(2, len(whole) + 1):
        part, advanced = plan_store_within(layout, room, offloadable=200, **plan)
        assert part == whole[: room - 2] + whole[6:]  # group-major, as the whole offer
        assert advanced == ({0: room - 2, 1: 6} if room > 2 else {1: 6})
    # Room for one: the window's tail does not fit, so both groups take one cut (32 tokens).
    part, advanced = plan_store_within(layout, 1, offloadable=200, **plan)
    assert part == whole[:1] and advanced == {0: 1, 1: 1}


def test_store_within_cuts_every_group_at_one_token_boundary_when_the_window_does_not_fit():
    """A window kept in every chunk (retention None, six chunks) is more than the room (up to
    five): every group takes the plan of the first ``cut`` tokens, the largest whose candidates
    the room holds."""
    layout = Layout((fa(0, **E), sw(1, 16, **E)), retention_interval=None)
    plan = _plan(layout, 200, {0: 0, 1: 0})
    whole, _ = plan_store(layout, offloadable=200, finished=False, **plan)
    assert len(whole) == 12
    for room in range(2, 6):
        part, advanced = plan_store_within(layout, room, offloadable=200, **plan)
        chunks = room // 2
        assert advanced == {0: chunks, 1: chunks}
        assert part == plan_store(layout, offloadable=32 * chunks, finished=False, **plan)[0]
        assert [(t.group, t.chunk_index) for t in part] == [(g, c) for g in (0, 1) for c in range(chunks)]


@pytest.mark.parametrize("room", [0, 1])
def test_store_within_offers_nothing_when_the_first_cut_does_not_fit(room):
    """Two groups whose first chunk is each a candidate: room for one is no start at all."""
    layout = Layout((fa(0, **E), sw(1, 16, **E)), retention_interval=None)
    plan = _plan(layout, 96, {0: 0, 1: 0})
    assert plan_store_within(layout, room, offloadable=96, **plan) == ([], {})


def test_store_within_plans_a_finished_request_as_a_running_one():
    """A finished drafter's held-back last chunk is promoted only by the whole offer (R29)."""
    layout = Layout((fa(0, **T4, drafter=True),))
    plan = _plan(layout, 16, {0: 0})
    plan["block_ids"] = {0: [1, 2, 3, 4, 5]}
    plan["keys"] = keys_of(layout, hashes(20, 4))
    whole, _ = plan_store(layout, offloadable=20, finished=True, **plan)
    assert [t.chunk_index for t in whole] == [0, 1, 2, 3, 4]
    part, advanced = plan_store_within(layout, 4, offloadable=20, **plan)
    assert [t.chunk_index for t in part] == [0, 1, 2, 3] and advanced == {0: 4}


def test_drafter_sliding_store_needs_one_more_block():
    layout = Layout(
        (fa(0, tpb=16, bpc=1, tph=4), sw(1, 8, tpb=4, bpc=1, tph=4, drafter=True)),
        retention_interval=None,
    )
    # need = 2 + 1 blocks, the run ending one block past each 16-token boundary
    assert _stored_blocks(layout, 33, [33])[1] == [2, 3, 4, 6, 7]  # 8 is beyond the 8 chunks


def test_sliding_reachable_mask_edge_cases():
    g = sw(0, 8, tpb=4, bpc=1, tph=4)
    kwargs = dict(start_block=0, end_block=8, reachable_boundaries=(32,))
    assert (
        sliding_reachable_mask(g, alignment_tokens=None, retention_interval=None, **kwargs) is None
    )
    assert sliding_reachable_mask(g, alignment_tokens=6, retention_interval=None, **kwargs) is None
    assert sliding_reachable_mask(g, alignment_tokens=8, retention_interval=None, **kwargs) is None
    mask = sliding_reachable_mask(g, alignment_tokens=16, retention_interval=0, **kwargs)
    assert [i for i, m in enumerate(mask) if m] == [6, 7]


def test_store_skips_null_and_stale_blocks():
    layout = Layout(
        (fa(0, tpb=4, bpc=2, tph=4), sw(1, 8, tpb=4, bpc=2, tph=4)), retention_interval=None
    )
    keys = keys_of(layout, hashes(16, 4))
    candidates, advanced = plan_store(
        layout, offloadable=16, num_prompt_tokens=16, finished=False,
        next_stored_chunk={0: 1, 1: 0}, block_ids={0: [1, 2, 3, 4], 1: [0, 0, 0, 7]}, keys=keys,
    )  # fmt: skip
    # SW chunk 0 ends on a null block (skipped): not stored; chunk 1 is entered at its block 1
    assert [(c.group, c.chunk_index) for c in candidates] == [(0, 1), (1, 1)]
    sw_chunk = candidates[-1]
    assert (sw_chunk.block_ids, sw_chunk.first_block_in_chunk) == ((7,), 1)
    assert advanced == {0: 2, 1: 2}
    # a null after a real block (a stale, re-allocated block) cannot be placed: refused
    layout3 = Layout((fa(0, tpb=4, bpc=3, tph=4),))
    keys3 = keys_of(layout3, hashes(12, 4))
    got, _ = plan_store(
        layout3, offloadable=12, num_prompt_tokens=12, finished=False,
        next_stored_chunk={}, block_ids={0: [5, 0, 6]}, keys=keys3,
    )  # fmt: skip
    assert got == []


def test_align_mamba_never_stored_from_block_table_r25():
    layout = mamba_hybrid()
    keys = keys_of(layout, hashes(32, 4))
    candidates, advanced = plan_store(
        layout, offloadable=32, num_prompt_tokens=32, finished=False,
        next_stored_chunk={}, block_ids={0: list(range(1, 9)), 1: [11, 12]}, keys=keys,
    )  # fmt: skip
    assert {c.group for c in candidates} == {0}
    assert advanced == {0: 8, 1: 2}


def test_boundary_stores_only_from_exact_handoffs():
    layout = Layout((fa(0, tpb=4, bpc=2, tph=4), mamba(3, 16, bpc=2, tph=4)))
    hs = hashes(100, 4)
    offers = [
        (3, 99, 32),  # the state after 32 tokens: chunk 0 of the Mamba group
        (3, 98, 64),
        (3, 0, 32),  # null block
        (3, 97, 48),  # not on a Mamba chunk boundary
        (3, 96, 96),  # beyond what may be offloaded
        (7, 95, 32),  # not an offloaded group
    ]
    got = plan_boundary_stores(layout, offers, offloadable=80, block_hashes=hs)
    assert got == [
        ChunkTransfer(3, 0, boundary_key(hs, 32, layout.group(3)), (99,), 1),
        ChunkTransfer(3, 1, boundary_key(hs, 64, layout.group(3)), (98,), 1),
    ]
    assert got[0].key == chunk_keys(hs, layout.group(3))[0]
