"""Partial tails (R7, R30, R35, §3.8 C): lookups, load plans and stores of hits that end inside a
block, on vLLM's FA16 + Mamba-align 16 layout hashed every 4 tokens (docs/SEMANTICS.md §3)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest
from semantics_helpers import (
    HIT,
    MISS,
    PENDING,
    fa,
    hashes,
    keys_of,
    mamba,
)

from kvstrata.presence import Presence
from kvstrata.semantics import (
    Layout,
    boundary_key,
    lookup_hit,
    partial_tail_hit,
    plan_load,
    plan_partial_tail_stores,
)

# ----------------------------------------------------------------------------- partial tails (R30)
# vLLM's _make_partial_tail_scheduler: FA16 + Mamba-align 16 hashed every 4 tokens, prompt 30.
TAIL = Layout((fa(0, 16, 1, 4), mamba(1, 16, 1, 4)))
TAIL_HASHES = hashes(30, 4)


def serve_tail(
    stored_boundaries: Mapping[int, Iterable[int]],
    *,
    local: int = 0,
    pending: Mapping[int, Iterable[int]] = {},  # noqa: B006
    num_tokens: int = 30,
    calls: list | None = None,
    beyond: bool = False,
    **caps,
) -> tuple[int | None, int | None]:
    """(hit, boundary) when group g holds its boundary keys at ``stored_boundaries[g]`` (chunk
    keys are boundary keys at block ends) and ``pending[g]`` are on their way."""
    answers: dict[bytes, Presence] = {}
    for g in TAIL.groups:
        for b in stored_boundaries.get(g.index, ()):
            answers[boundary_key(TAIL_HASHES, b, g)] = HIT
        for b in pending.get(g.index, ()):
            answers[boundary_key(TAIL_HASHES, b, g)] = PENDING

    def probe(batch):
        if calls is not None:
            calls.append(list(batch))
        return [answers.get(k, MISS) for k in batch]

    complete = lookup_hit(
        TAIL, num_tokens=num_tokens, local_computed=local, keys=keys_of(TAIL, TAIL_HASHES),
        probe=probe, **caps,
    )
    return partial_tail_hit(
        TAIL, complete_hit=complete, num_prompt_tokens=num_tokens, local_computed=local,
        block_hashes=TAIL_HASHES, probe=probe, keys=keys_of(TAIL, TAIL_HASHES) if beyond else None,
        **caps,
    )


BOTH_AT = {0: [16, 28], 1: [16, 28]}  # chunk 0 of both groups and the replay boundary 28


@pytest.mark.parametrize(
    ("stored", "local", "caps", "expected"),
    [
        (BOTH_AT, 0, {}, (28, 28)),  # vLLM test 8: all HIT -> 28
        ({0: [16, 20, 28], 1: [16, 20, 28]}, 0, {"max_new_tokens": 20}, (20, 20)),  # test 9
        (BOTH_AT, 0, {"max_load_tokens": 0}, (0, None)),  # test 10
        ({0: [16, 24], 1: [16, 24]}, 16, {"max_load_tokens": 8}, (8, 24)),  # test 11
        (BOTH_AT, 0, {"max_load_tokens": 20}, (16, None)),  # test 12: no key @20
        ({0: [16, 28], 1: [16]}, 0, {}, (16, None)),  # test 20: Mamba boundary key missing
        ({0: [28], 1: [28]}, 0, {}, (0, None)),  # only within the block after the complete hit
        ({0: [12], 1: [12]}, 0, {}, (12, 12)),  # no complete chunk: a tail in the first block
        ({0: [16, 20, 24], 1: [16, 20]}, 0, {}, (20, 20)),  # the highest boundary all groups hold
    ],
)
def test_partial_tail_lookup_r30(stored, local, caps, expected):
    assert serve_tail(stored, local=local, **caps) == expected


def test_partial_tail_waits_only_for_a_whole_boundary():
    # Every group holds @28, the Mamba state is still promoting: kvstrata waits (vLLM would serve
    # the complete 16 and recompute the tail).
    assert serve_tail({0: [16, 28], 1: [16]}, pending={1: [28]}) == (None, None)
    # A boundary some group misses is not worth waiting for.
    assert serve_tail({0: [16], 1: [16]}, pending={0: [28]}) == (16, None)
    # No complete hit: any key on its way defers (as vLLM).
    assert serve_tail({}, pending={0: [12]}) == (None, None)
    assert serve_tail({}) == (0, None)


def test_partial_tail_probes_group_by_group():
    calls: list = []
    serve_tail({0: [16], 1: [16]}, calls=calls)
    tail = [c for c in calls if len(c) == 1 and c[0].endswith((0).to_bytes(4, "big"))]
    # Boundaries 28, 24, 20 are tried top down; each stops at the FA miss, so no Mamba key of a
    # boundary is probed (a probe can start a disk promotion).
    assert [c[0] for c in tail][-3:] == [boundary_key(TAIL_HASHES, b, TAIL.groups[0]) for b in (28, 24, 20)]
    mamba_tail_probes = [
        c for c in calls if len(c) == 1 and c[0] in {boundary_key(TAIL_HASHES, b, TAIL.groups[1]) for b in (20, 24, 28)}
    ]
    assert mamba_tail_probes == []


def test_partial_tail_only_for_r7_layouts():
    layout = Layout((fa(0, 16, 1, 16), mamba(1, 16, 1, 16)))
    assert partial_tail_hit(
        layout, complete_hit=16, num_prompt_tokens=30, local_computed=0,
        block_hashes=hashes(30, 16), probe=lambda b: [HIT] * len(b),
    ) == (16, None)


def test_partial_tail_load_plan_r35():
    # vLLM test 8's load: FA blocks [31, 32] from index 0, the Mamba state block 41 at index 1.
    tail = {g.index: boundary_key(TAIL_HASHES, 28, g) for g in TAIL.groups}
    transfers = plan_load(
        TAIL, local_computed=0, hit_tokens=28, block_ids={0: [31, 32], 1: [0, 41]},
        keys=keys_of(TAIL, TAIL_HASHES), tail_keys=tail,
    )
    keys = keys_of(TAIL, TAIL_HASHES)
    assert [(t.group, t.chunk_index, t.key, t.block_ids) for t in transfers] == [
        (0, 0, keys[0][0], (31,)),
        (0, 1, tail[0], (32,)),
        (1, 1, tail[1], (41,)),
    ]
    with pytest.raises(ValueError, match="chunk boundary"):
        plan_load(TAIL, local_computed=0, hit_tokens=16, block_ids={0: [31], 1: [41]},
                  keys=keys_of(TAIL, TAIL_HASHES), tail_keys=tail)


def test_partial_tail_stores_c():
    blocks = {0: [7, 8], 1: [0, 9]}

    def plan(offers, max_boundary=30):
        return plan_partial_tail_stores(
            TAIL, offers, block_ids=blocks, block_hashes=TAIL_HASHES, max_boundary=max_boundary
        )

    # vLLM test 3: hand-off (group 1, CoW block 99, boundary 28): the FA block at index 1 + CoW 99.
    [job] = plan([(1, 99, 28)])
    assert [(t.group, t.chunk_index, t.key, t.block_ids) for t in job] == [
        (0, 1, boundary_key(TAIL_HASHES, 28, TAIL.groups[0]), (8,)),
        (1, 1, boundary_key(TAIL_HASHES, 28, TAIL.groups[1]), (99,)),
    ]
    # vLLM test 4: the block-aligned offer is the ordinary boundary store's, not a partial tail.
    assert len(plan([(1, 98, 16), (1, 99, 28)])) == 1
    assert plan([(1, 98, 16)]) == []
    assert plan([(1, 99, 28)], max_boundary=27) == []  # past the prompt / max_offload_tokens
    assert plan([(1, 99, 26)]) == []  # not on the hash grid
    assert plan([(1, 0, 28)]) == []  # null CoW block
    assert plan_partial_tail_stores(  # the FA block holding the boundary is not allocated yet
        TAIL, [(1, 99, 28)], block_ids={0: [7], 1: [0]}, block_hashes=TAIL_HASHES, max_boundary=30
    ) == []
    assert plan_partial_tail_stores(  # not an R7 layout
        Layout((fa(0, 16, 1, 16), mamba(1, 16, 1, 16))), [(1, 99, 28)], block_ids=blocks,
        block_hashes=hashes(30, 16), max_boundary=30,
    ) == []


def test_partial_tail_beyond_a_missing_mamba_chunk_state():
    # A kernel that saves the checkpoint inside the forward hands off the state @28 only, none
    # @16: vLLM (keys=None) serves nothing; with the chunk keys the tail follows the FA prefix.
    only_tail = {0: [16, 28], 1: [28]}
    assert serve_tail(only_tail) == (0, None)
    assert serve_tail(only_tail, beyond=True) == (28, 28)
    # The attention prefix must reach the tail's block...
    assert serve_tail({0: [28], 1: [28]}, beyond=True) == (0, None)
    # ...and be stored: an FA chunk still promoting is waited for, as the tail keys are.
    assert serve_tail({0: [28], 1: [28]}, pending={0: [16]}, beyond=True) == (None, None)
    assert serve_tail({0: [16], 1: [28]}, pending={0: [28]}, beyond=True) == (None, None)
    # A boundary some group misses is not waited for past vLLM's block.
    assert serve_tail({0: [16]}, pending={0: [28]}, beyond=True) == (0, None)


def test_partial_tail_beyond_probes_mamba_states_in_one_batch():
    # A 400-token prompt whose FA chunks are all stored but whose only Mamba state is at 100
    # (an earlier, shorter prompt's tail): the search past vLLM's block asks for the Mamba states
    # at once, then looks group by group only at the boundaries that have one.
    hashes_400 = hashes(400, 4)
    keys = keys_of(TAIL, hashes_400)
    fa_g, mamba_g = TAIL.groups
    stored = set(keys[0]) | {boundary_key(hashes_400, 100, g) for g in (fa_g, mamba_g)}
    calls: list = []

    def probe(batch):
        calls.append(list(batch))
        return [HIT if k in stored else MISS for k in batch]

    complete = lookup_hit(TAIL, num_tokens=400, local_computed=0, keys=keys, probe=probe)
    assert complete == 0  # no Mamba state at a block boundary
    calls.clear()
    assert partial_tail_hit(
        TAIL, complete_hit=complete, num_prompt_tokens=400, local_computed=0,
        block_hashes=hashes_400, probe=probe, keys=keys,
    ) == (100, 100)
    # The FA prefix, the Mamba states past the first block, then both keys @100: not one probe
    # per boundary from 396 down (74 of them).
    assert len(calls) == 4, calls
