"""Properties of kvstrata's semantics over random layouts (hypothesis): lookup bounds and
monotonicity, store-plan invariants, and store-then-serve round trips, with the known gaps kept
for parity with vLLM 0.32.0 pinned (docs/SEMANTICS.md §3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from semantics_helpers import (
    HIT,
    MISS,
    E,
    MemoryStore,
    fa,
    hashes,
    keys_of,
    mamba,
    run_request,
    served_after,
    sw,
)

from kvstrata.semantics import (
    GroupGeometry,
    GroupKind,
    Layout,
    cdiv,
    initial_cap,
    lookup_hit,
    plan_load,
    plan_store,
    round_down,
    storable_chunks,
    store_pending,
)

# ----------------------------------------------------------------------------- properties
_ROUNDTRIP_SETTINGS = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def layouts(draw):
    tph = draw(st.sampled_from([2, 4]))
    bpc = draw(st.integers(1, 3))
    tpb = lambda: tph * draw(st.integers(1, 3))  # noqa: E731
    groups: list[GroupGeometry] = []
    if draw(st.booleans()):
        groups.append(
            GroupGeometry(0, GroupKind.FULL, tpb(), bpc, tph, is_drafter=draw(st.booleans()))
        )
    for _ in range(draw(st.integers(0 if groups else 1, 2))):
        b = tpb()
        groups.append(
            GroupGeometry(
                len(groups), GroupKind.SLIDING, b, bpc, tph,
                sliding_window=draw(st.integers(1, 3 * b * bpc)),
                extra_retained_tokens=draw(st.sampled_from([0, 1, 3])),
                is_drafter=draw(st.booleans()),
            )
        )  # fmt: skip
    if draw(st.booleans()):
        base = groups[0].tokens_per_block
        groups.append(
            GroupGeometry(
                len(groups), GroupKind.MAMBA, base * draw(st.sampled_from([1, 2, 4])), bpc, tph
            )
        )
    return Layout(tuple(groups), retention_interval=None)


@st.composite
def lookup_scenarios(draw):
    layout = draw(layouts())
    max_tpc = max(g.tokens_per_chunk for g in layout.groups)
    num_tokens = draw(st.integers(1, 6 * max_tpc))
    keys = keys_of(layout, hashes(num_tokens, layout.tokens_per_hash))
    stored = {k for ks in keys.values() for k in ks if draw(st.floats(0, 1)) < 0.8}
    block = layout.scheduler_block_tokens
    local = block * draw(st.integers(0, max(0, (num_tokens - 1) // block)))
    return layout, num_tokens, keys, stored, local


def _lookup(layout, num_tokens, keys, stored, local, **kwargs):
    return lookup_hit(
        layout, num_tokens=num_tokens, local_computed=local, keys=keys,
        probe=lambda b: [HIT if k in stored else MISS for k in b], **kwargs,
    )  # fmt: skip


def _sliding_allocation(layout, local, end):
    """Block ids as vLLM's managers allocate them for a hit ending at ``end``."""
    out = {}
    for g in layout.groups:
        n = cdiv(end, g.tokens_per_block)
        first = cdiv(local, g.tokens_per_block)
        if g.kind is GroupKind.SLIDING:
            first = max(
                first,
                max(0, end - g.sliding_window + 1 - g.extra_retained_tokens) // g.tokens_per_block,
            )
        elif g.kind is GroupKind.MAMBA:
            first = max(first, n - 1)
        out[g.index] = [0] * first + list(range(100, 100 + n - first))
    return out


@settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(lookup_scenarios())
def test_property_hit_bounds_alignment_and_stored_only(scenario):
    layout, num_tokens, keys, stored, local = scenario
    hit = _lookup(layout, num_tokens, keys, stored, local)
    assert hit is not None  # no PENDING / RETRY here
    if not hit:
        return
    end = local + hit
    assert end <= num_tokens
    if layout.windowed_groups:
        assert end <= num_tokens - 1
    # a hit ends on a chunk boundary of some group, or at the cap (R21)
    cap = initial_cap(
        layout,
        num_tokens=num_tokens,
        local_computed=local,
        max_new_tokens=None,
        max_load_tokens=None,
    )
    assert end == cap or any(end % g.tokens_per_chunk == 0 for g in layout.groups)
    if layout.mamba_tokens_per_chunk:
        assert end % layout.mamba_tokens_per_chunk == 0  # kvstrata's R26 guard
    # every chunk the load plan reads was stored
    plan = plan_load(
        layout,
        local_computed=local,
        hit_tokens=hit,
        block_ids=_sliding_allocation(layout, local, end),
        keys=keys,
    )
    assert all(t.key in stored for t in plan)
    # at least one chunk of every group beyond the local blocks... is planned when the group has
    # fresh blocks; full attention always covers [local, end)
    for g in layout.groups:
        if g.kind is GroupKind.FULL:
            got = [t.chunk_index for t in plan if t.group == g.index]
            assert got == list(range(local // g.tokens_per_chunk, cdiv(end, g.tokens_per_chunk)))


@settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(lookup_scenarios(), st.data())
def test_property_monotone_in_stored_set(scenario, data):
    """Storing more never serves less."""
    layout, num_tokens, keys, stored, local = scenario
    extra = data.draw(st.sets(st.sampled_from([k for ks in keys.values() for k in ks] or [b""])))
    before = _lookup(layout, num_tokens, keys, stored, local)
    after = _lookup(layout, num_tokens, keys, stored | extra, local)
    assert after >= before


@settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(lookup_scenarios())
def test_property_all_stored_serves_up_to_the_cap(scenario):
    layout, num_tokens, keys, _, local = scenario
    everything = {k for ks in keys.values() for k in ks}
    hit = _lookup(layout, num_tokens, keys, everything, local)
    drafters = any(g.is_drafter for g in layout.groups)
    cap = initial_cap(
        layout,
        num_tokens=num_tokens,
        local_computed=local,
        max_new_tokens=None,
        max_load_tokens=None,
    )
    if not drafters:
        # limited only by complete chunks of each group
        bound = min([cap] + [len(keys[g.index]) * g.tokens_per_chunk for g in layout.groups])
        if layout.mamba_tokens_per_chunk:
            bound = round_down(bound, layout.mamba_tokens_per_chunk)
        if all(bound - local >= g.tokens_per_chunk for g in layout.groups):
            assert local + hit == bound


def _draw_store_step(layout, data):
    """A request's step to plan stores for: its prompt, tokens, whether it finished, how many
    tokens are offloadable after the step, and its chunk keys per group."""
    prompt = data.draw(st.integers(1, 200))
    num_tokens = prompt + data.draw(st.integers(0, 50))
    finished = data.draw(st.booleans())
    offloadable = data.draw(st.integers(0, num_tokens))
    return prompt, num_tokens, finished, offloadable, keys_of(layout, hashes(num_tokens, layout.tokens_per_hash))


@settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(layouts(), st.data())
def test_property_store_plan_invariants(layout, data):
    prompt, num_tokens, finished, offloadable, keys = _draw_store_step(layout, data)
    blocks = {
        g.index: list(range(1, 1 + cdiv(offloadable, g.tokens_per_block))) for g in layout.groups
    }
    next_stored = {g.index: data.draw(st.integers(0, 5)) for g in layout.groups}
    candidates, advanced = plan_store(
        layout, offloadable=offloadable, num_prompt_tokens=prompt, finished=finished,
        next_stored_chunk=next_stored, block_ids=blocks, keys=keys,
    )  # fmt: skip
    for g in layout.groups:
        n = storable_chunks(
            g, offloadable_tokens=offloadable, num_prompt_tokens=prompt, finished=finished,
            allocated_blocks=len(blocks[g.index]), num_keys=len(keys[g.index]),
        )  # fmt: skip
        assert advanced[g.index] == max(next_stored[g.index], n)
        mine = [c.chunk_index for c in candidates if c.group == g.index]
        assert mine == sorted(set(mine)) and all(c < n for c in mine)
        if g.is_align_mamba:
            assert not mine
        if g.kind is GroupKind.FULL:
            assert mine == list(range(next_stored[g.index], n))
    for c in candidates:
        assert c.key == keys[c.group][c.chunk_index]


@settings(
    max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(layouts(), st.sampled_from([None, 0, 1]), st.data())
def test_property_a_step_store_pending_skips_changes_no_plan(layout, retention, data):
    """Where ``store_pending`` says a request's step stores nothing (the adapter then skips
    ``plan_store``), ``plan_store`` offers nothing and moves no scan position: for any layout,
    retention interval (dense, replay boundary only, per interval), block table (with null
    blocks), scan positions and boundaries."""
    if retention == 1:
        windowed = [g.tokens_per_chunk for g in layout.groups if g.is_windowed] or [1]
        retention = math.lcm(*windowed) * data.draw(st.integers(1, 3))
    layout = Layout(layout.groups, retention_interval=retention)
    prompt, num_tokens, finished, offloadable, keys = _draw_store_step(layout, data)
    blocks = {
        g.index: [0 if data.draw(st.floats(0, 1)) < 0.2 else 1 + i
                  for i in range(cdiv(offloadable, g.tokens_per_block))]
        for g in layout.groups
    }  # fmt: skip
    next_stored = {g.index: data.draw(st.integers(0, 8)) for g in layout.groups}
    candidates, advanced = plan_store(
        layout, offloadable=offloadable, num_prompt_tokens=prompt, finished=finished,
        next_stored_chunk=next_stored, block_ids=blocks, keys=keys,
        prompt_offloadable=data.draw(st.integers(0, prompt)),
        shared_prefix_boundary=data.draw(st.none() | st.integers(1, num_tokens)),
    )  # fmt: skip
    if not store_pending(
        layout, offloadable=offloadable, finished=finished, next_stored_chunk=next_stored
    ):
        assert candidates == []
        assert advanced == next_stored


def test_store_pending_is_false_for_decode_and_unfilled_prefill_steps():
    """The steps the adapter skips, and the ones it must not."""
    layout = Layout((fa(0, tpb=4, bpc=2, tph=4),), retention_interval=None)  # 8-token chunks
    due = lambda off, nxt, fin=False: store_pending(  # noqa: E731
        layout, offloadable=off, finished=fin, next_stored_chunk={0: nxt}
    )
    assert due(8, 0)  # the first chunk filled
    assert not due(15, 1)  # a prefill step short of the next chunk
    assert due(16, 1)
    assert not due(16, 2)  # decode past the stored chunks: offload_prompt_only caps offloadable
    assert due(16, 2, fin=True)  # a finish always plans (finish-time promotion)
    assert not due(0, 0)


def _lookup_window_exceeds_stored_tail(g: GroupGeometry) -> bool:
    if g.kind is not GroupKind.SLIDING:
        return False
    assert g.sliding_window is not None
    return g.window_chunks != cdiv(
        g.sliding_window - 1 + g.extra_retained_tokens, g.tokens_per_chunk
    )


@_ROUNDTRIP_SETTINGS
@given(layouts(), st.integers(1, 300), st.sampled_from([None, 0, 1]), st.data())
def test_property_store_then_serve_roundtrip(layout, prompt, retention, data):
    """What a request stores serves the same prompt as well as if everything were stored.

    Every chunk a later lookup of that prompt needs at an alignment boundary is storable and
    reachable (R31), for any retention interval (dense, replay boundary only, or per interval).

    Left out, as in vLLM 0.32.0 (kvstrata keeps parity; the xfail tests below pin both):
    a window ``W`` with ``W - 1 + extra`` a multiple of the chunk (the lookup asks for
    ``cdiv(W, tpc)`` chunks (R3), the store keeps the ``cdiv(W - 1 + extra, tpb)`` blocks a hit
    needs (R31), one chunk fewer; a 1-token window stores nothing); and under a sparse retention
    interval, drafter groups (their pop moves a replay below the replay boundary) and Mamba +
    sliding-window hybrids (the replay boundary is aligned to the attention chunk, the hit to the
    coarser Mamba chunk, whose window tail is not kept).
    """
    assume(not any(_lookup_window_exceeds_stored_tail(g) for g in layout.groups))
    # Alignment boundaries are what reachability keeps; they must be chunk boundaries of every
    # group (a coarser group could not serve them at all).
    align = layout.alignment_tokens
    assume(align is None or all(align % g.tokens_per_chunk == 0 for g in layout.groups))
    sliding = any(g.kind is GroupKind.SLIDING for g in layout.groups)
    assume(retention is None or not any(g.is_drafter for g in layout.groups))
    assume(retention is None or not (sliding and layout.mamba_tokens_per_chunk))
    if retention == 1:
        windowed = [g.tokens_per_chunk for g in layout.groups if g.is_windowed] or [1]
        retention = math.lcm(*windowed) * data.draw(st.integers(1, 3))
    layout = Layout(layout.groups, retention_interval=retention)
    step = data.draw(st.sampled_from([None, 7, 64]))
    store = MemoryStore()
    run_request(layout, store, prompt, prefill_step=step)
    keys = keys_of(layout, hashes(prompt, layout.tokens_per_hash))
    everything = {k for ks in keys.values() for k in ks}
    full = _lookup(layout, prompt, keys, everything, 0)
    served = served_after(layout, store, prompt)
    if layout.alignment_tokens is None:
        assert served == full  # no reachability mask: everything was stored
    else:
        # Sparse window tails are kept only where hits at alignment boundaries need them; a hit
        # that ends elsewhere (at the cap, after a drafter pop) falls back to the boundary below.
        assert round_down(full, layout.alignment_tokens) <= served <= full


@_ROUNDTRIP_SETTINGS
@given(layouts(), st.integers(1, 300), st.sampled_from([None, 0, 1]), st.integers(1, 5), st.data())
def test_property_stores_cut_to_the_room_store_what_whole_offers_store(layout, prompt, retention,
                                                                       room, data):
    """A host tier with room for only ``room`` chunks a step (``plan_store_within``'s start of
    each offer, §3.8 D5) stores, by the request's finish, exactly the chunks the whole offers
    store: the cut never skips a chunk, stores one no whole offer would, or leaves a group's
    scan past what it stored."""
    if retention == 1:
        windowed = [g.tokens_per_chunk for g in layout.groups if g.is_windowed] or [1]
        retention = math.lcm(*windowed) * data.draw(st.integers(1, 3))
    layout = Layout(layout.groups, retention_interval=retention)
    step = data.draw(st.sampled_from([None, 1, 7, 64]))
    decode = data.draw(st.integers(0, 6))
    whole, cut = MemoryStore(), MemoryStore()
    run_request(layout, whole, prompt, prefill_step=step, decode=decode)
    run_request(layout, cut, prompt, prefill_step=step, decode=decode, room=room)  # asserts the room
    assert cut.keys == whole.keys


def test_exact_replay_with_drafter_under_sparse_retention():
    """vLLM 0.32.0 gap that kvstrata closes: with a retention interval (vLLM's default 0) a regular
    sliding-window group keeps its tail only at the replay boundary (199 -> 192), but a
    full-attention drafter's pop puts every later hit one drafter chunk lower (160), where vLLM
    kept no window: neither the same prompt nor a follow-up turn is served anything. kvstrata
    also keeps the tail ending at 160 (``keep_served_tails``)."""
    layout = Layout((fa(0, **E, drafter=True), sw(1, 64, **E)), retention_interval=0)
    store = MemoryStore()
    run_request(layout, store, 200)
    assert served_after(layout, store, 200) == 160
    assert served_after(layout, store, 230) == 160
    vllm_like = MemoryStore()
    run_request(layout, vllm_like, 200, keep_served_tails=False)
    assert served_after(layout, vllm_like, 200) == 0  # the gap, as in vLLM 0.32.0


@pytest.mark.xfail(strict=True, reason="vLLM 0.32.0 semantics, kept for parity: see docstring")
def test_exact_replay_with_window_one_past_a_chunk_multiple():
    """Known gap (same in vLLM 0.32.0): window 13 with 6-token chunks. The lookup wants
    cdiv(13, 6) = 3 chunks, the store keeps only the cdiv(12, 6) = 2 a hit needs, so under
    retention 0 an exact replay of a 19-token prompt finds no window and is served 0."""
    layout = Layout((sw(0, 13, tpb=6, bpc=1, tph=2),), retention_interval=0)
    store = MemoryStore()
    run_request(layout, store, 19)
    assert served_after(layout, store, 19) == 18


def test_exact_replay_of_mamba_sliding_hybrid_under_sparse_retention():
    """vLLM 0.32.0 gap that kvstrata closes: FA16 + SW32 + Mamba64, retention 0, prompt 180. vLLM
    keeps the window tail at the replay boundary 176 (179 aligned to the 16-token attention chunk),
    but the hit is rounded to the Mamba chunk, 128, where vLLM stored no window tail: 0 served.
    kvstrata also keeps the tail ending at 128."""
    layout = Layout(
        (fa(0, tpb=16, bpc=1), sw(1, 32, tpb=16, bpc=1), mamba(2, 64, bpc=1)), retention_interval=0
    )
    store = MemoryStore()
    run_request(layout, store, 180)
    assert served_after(layout, store, 180) == 128
    vllm_like = MemoryStore()
    run_request(layout, vllm_like, 180, keep_served_tails=False)
    assert served_after(layout, vllm_like, 180) == 0  # the gap, as in vLLM 0.32.0
