"""Drafter groups in kvstrata's lookup and stores (R27: widening and popping; E7) and the three
defects of vLLM issue 52735 (docs/SEMANTICS.md §3)."""

from __future__ import annotations

import pytest
from semantics_helpers import (
    HIT,
    T4,
    E,
    MemoryStore,
    fa,
    hashes,
    keys_of,
    mamba,
    mamba_hybrid,
    run_request,
    serve,
    served_after,
    sw,
)

from kvstrata.semantics import (
    Layout,
    lookup_hit,
    resolve_drafter_flags,
)


# ----------------------------------------------------------------------------- drafters (R27)
def _fa_pair(drafter_second=True):
    return Layout((fa(0, **E), fa(1, **E, drafter=drafter_second)))


@pytest.mark.parametrize(
    "layout, num_tokens, stored, expected",
    [
        (_fa_pair(), 200, None, 160),  # drafter cannot widen past its 6th key: 6 hits -> pop -> 5
        (_fa_pair(), 200, {0: range(3), 1: range(6)}, 96),  # widened to 4, 4 hits, pop -> 3
        (_fa_pair(), 200, {0: range(3), 1: range(3)}, 64),
        (_fa_pair(), 40, None, 0),
        (_fa_pair(False), 200, None, 192),  # spec decode on, nothing annotated: no pop
        (Layout((fa(0, **E), sw(1, 64, **E, drafter=True)), retention_interval=None), 200,
         {0: range(6), 1: range(6)}, 160),
        (Layout((fa(0, **E), sw(1, 64, **E, drafter=True)), retention_interval=None), 200,
         {0: range(6), 1: [3, 4, 5]}, 160),
        (Layout((fa(0, **E), sw(1, 64, **E, drafter=True)), retention_interval=None), 200,
         {0: range(6), 1: [4, 5]}, 0),  # needs W + 1 = 3 consecutive chunks
        (Layout((fa(0, **E), sw(1, 64, **E, drafter=True)), retention_interval=None), 200,
         {0: range(6), 1: [2, 3, 4]}, 128),
    ],
)  # fmt: skip
def test_drafter_worked_lookups_r27(layout, num_tokens, stored, expected):
    assert serve(layout, num_tokens, stored) == expected


@pytest.mark.parametrize(
    "groups, num_tokens, stored, expected",
    [
        ([fa(0, **T4, drafter=True)], 12, {0: [0, 1, 2]}, 8),
        ([fa(0, **T4, drafter=True)], 12, {0: [0]}, 0),
        ([fa(0, **T4, drafter=True)], 12, {}, 0),
        ([sw(0, 8, **T4, drafter=True)], 13, {0: [0, 1, 2, 3]}, 8),  # 3 keys: cannot widen
        ([sw(0, 8, **T4, drafter=True)], 9, {0: [0, 1]}, 4),  # prefix fallback, then pop
        ([sw(0, 8, **T4, drafter=True)], 13, {0: [0, 1, 2]}, 8),
        ([fa(0, **T4), fa(1, **T4, drafter=True)], 12, None, 8),  # no double pop
        ([fa(0, **T4), fa(1, **T4, drafter=True)], 12, {0: [0], 1: [0, 1, 2]}, 4),
    ],
)
def test_drafter_unit_cases_r27(groups, num_tokens, stored, expected):
    assert serve(Layout(tuple(groups), retention_interval=None), num_tokens, stored) == expected


def test_drafter_sliding_window_widens_into_a_fourth_key():
    """SW drafter, W=2, 13 tokens with keys for 4 chunks: 4 keys queried, run of 3, pop -> 12."""
    layout = Layout((sw(0, 8, **T4, drafter=True),), retention_interval=None)
    assert serve(layout, 13, {0: [0, 1, 2, 3]}, hashed_tokens=16) == 12


def test_drafter_query_is_widened_by_one_chunk():
    layout = Layout((sw(0, 8, **T4, drafter=True),), retention_interval=None)
    keys = keys_of(layout, hashes(16, 4))
    asked: list[bytes] = []

    def probe(batch):
        asked.extend(batch)
        return [HIT] * len(batch)

    assert lookup_hit(layout, num_tokens=13, local_computed=0, keys=keys, probe=probe) == 12
    # the cap 12 covers 3 chunks; the widened query reaches the 4th, and the run of W + 1 = 3
    # found at its right end is all that is probed
    assert sorted(asked) == sorted(keys[0][1:])


def test_regular_group_tightening_makes_drafter_pop_again():
    """A drafter verified at one boundary must drop its tail again at a tighter one (R27)."""
    layout = Layout((sw(0, 4, **T4, drafter=True), sw(1, 4, **T4)), retention_interval=None)
    stored = {0: [0, 1, 2, 3, 6, 7], 1: [0, 1, 2, 3, 4]}
    # drafter: run 6-7 -> pop -> 28; the other group tightens to 20; the drafter, queried again
    # with one more chunk, finds chunk 5 missing: its last stored chunk (3) is volatile -> 12.
    assert serve(layout, 33, stored) == 12


def test_drafter_pop_then_mamba_realignment_e7():
    layout = Layout((fa(0, tpb=16, bpc=1, drafter=True), mamba(1, 256, bpc=1)))
    assert serve(layout, 600, {0: range(37), 1: [0, 1]}) == 512  # widened to 33 chunks, pop -> 32
    assert serve(layout, 600, {0: range(32), 1: [0, 1]}, align_final_to_mamba=False) == 496
    assert serve(layout, 600, {0: range(32), 1: [0, 1]}) == 256


# ----------------------------------------------------------------------------- issue 52735
def test_52735_defect1_no_all_groups_drafter_fallback():
    # Speculative decoding on, nothing annotated (shared-group MTP): no drafter group.
    assert resolve_drafter_flags([False, False], speculative=True) == (False, False)
    assert resolve_drafter_flags([False, True], speculative=True) == (False, True)
    assert resolve_drafter_flags([True, True], speculative=False) == (False, False)
    flags = resolve_drafter_flags([False, False], speculative=True)
    layout = Layout(
        (fa(0, tpb=4, bpc=1, tph=4, drafter=flags[0]), mamba(1, 16, bpc=1, tph=4, drafter=flags[1]))
    )
    store = MemoryStore()
    run_request(layout, store, 28)
    assert served_after(layout, store, 28) == 16  # store -> finish -> the same prompt is served
    # What the fallback did: every group a drafter; the Mamba group's single-chunk window pops to 0.
    assert served_after(mamba_hybrid(fa_drafter=True, mamba_drafter=True), store, 28) == 0


def test_52735_defect2_full_attention_drafter_is_widened():
    layout = mamba_hybrid(fa_drafter=True)
    store = MemoryStore()
    run_request(layout, store, 28)
    # Without widening the FA pop lands at 12, under the Mamba chunk (16): the whole hit was 0.
    assert served_after(layout, store, 28) == 16
    assert serve(_fa_pair(), 200, {0: range(3), 1: range(6)}) == 96


def test_52735_defect3_final_drafter_chunk_is_stored_on_finish():
    layout = Layout((fa(0, **T4), fa(1, **T4, drafter=True)))
    store = MemoryStore()
    steps = run_request(layout, store, 12, decode=4, offload_prompt_only=False)
    assert steps[0] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]  # prefill: all stable (R28)
    decode_stored = [s for step in steps[1:-1] for s in step]
    assert (0, 3) in decode_stored and (1, 3) not in decode_stored  # volatile while decoding
    assert steps[-1] == [(1, 3)]  # finish-time tail promotion (R29)
    # A follow-up turn extending the sequence: the drafter drops its last stored chunk (R27), so
    # it serves chunks 0-2 (12 tokens); without the promoted chunk 3 it would serve only 0-1.
    assert served_after(layout, store, 24) == 12
    store.keys.discard(keys_of(layout, hashes(16, 4))[1][3])
    assert served_after(layout, store, 24) == 8
