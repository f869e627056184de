"""A stored prompt tail serves a longer prompt that starts with it (semantics.tail_extension, R21a)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from probe_helper import Probe

from kvstrata.presence import Presence
from kvstrata.semantics import (
    GroupGeometry,
    GroupKind,
    Layout,
    lookup_hit,
    plan_load,
    tail_extension_hit,
    tail_extension_span,
)


def _fa(index: int = 0, tpb: int = 16, bpc: int = 1) -> GroupGeometry:
    return GroupGeometry(index, GroupKind.FULL, tpb, bpc, 16)


FA = Layout((_fa(0), _fa(1)))
SW = Layout((_fa(0), GroupGeometry(1, GroupKind.SLIDING, 16, 1, 16, sliding_window=32)))


def _keys(t: int) -> dict[int, bytes]:
    return {0: b"t%d-0" % t, 1: b"t%d-1" % t}


def _span(layout: Layout = FA, *, hit_end: int = 96, n: int = 120, local: int = 0, **kw) -> tuple[int, list[int]] | None:
    span = tail_extension_span(layout, hit_end=hit_end, num_tokens=n, local_computed=local, **kw)
    return None if span is None else (span[0], list(span[1]))


def test_the_lengths_asked_for_lie_inside_the_chunk_past_the_hit_and_short_of_the_last_token() -> None:
    assert _span() == (96, list(range(15, 1, -1)))  # 2..15 tokens of the chunk at 96, longest first
    assert _span(n=100) == (96, [3, 2])  # tokens 96..98: the request's last token is computed
    assert _span(n=99) == (96, [2])
    assert _span(n=98) is None  # a 1-token tail is never stored; a 2-token one would be the prompt's own
    assert _span(hit_end=0, n=40) == (0, list(range(15, 1, -1)))  # a prompt's first chunk: no parent
    # Chunks of 4 blocks (64 tokens): the tail may end anywhere before the next chunk boundary.
    four = Layout((_fa(0, bpc=4),))
    assert _span(four, hit_end=64, n=500) == (64, list(range(63, 1, -1)))


def test_a_local_hit_inside_the_chunk_leaves_only_longer_tails() -> None:
    # vLLM's own prefix cache holds 7 blocks (112 tokens) of a 4-block chunk starting at 64: a tail
    # must reach past 112 to save anything.
    four = Layout((_fa(0, bpc=4),))
    assert _span(four, hit_end=112, local=112, n=500) == (64, list(range(63, 48, -1)))
    assert _span(four, hit_end=112, local=112, n=114) == (64, [49])


def test_caps_bound_the_lengths() -> None:
    assert _span(max_new_tokens=100) == (96, [4, 3, 2])
    assert _span(max_load_tokens=98, local=0) == (96, [2])
    assert _span(max_load_tokens=97) is None
    assert _span(local=32, hit_end=96, max_new_tokens=70) == (96, [6, 5, 4, 3, 2])


def test_layouts_without_prompt_tails_never_extend() -> None:
    mamba = Layout((_fa(0), GroupGeometry(1, GroupKind.MAMBA, 16, 1, 16)))
    drafter = Layout((_fa(0), GroupGeometry(1, GroupKind.FULL, 16, 1, 16, is_drafter=True)))
    assert _span(mamba) is None and _span(drafter) is None
    assert _span(SW) == _span(FA)  # sliding windows: the hit is short of N, no rewind follows


def _hit(candidates: Sequence[int], answers: dict[bytes, Presence], *, complete: int | None = 96,
         local: int = 0, layout: Layout = FA, **kw) -> tuple[int | None, object, Probe]:
    probe = Probe(answers)
    hit, keys = tail_extension_hit(layout, complete_hit=complete, local_computed=local, start=96,
                                   candidates=[(t, _keys(t)) for t in candidates], probe=probe, **kw)
    return hit, keys, probe


def _all(*lengths: int, state: Presence = Presence.HIT) -> dict[bytes, Presence]:
    return {k: state for t in lengths for k in _keys(t).values()}


def test_the_longest_tail_every_group_holds_extends_the_hit() -> None:
    hit, keys, probe = _hit([10, 4], _all(10, 4))
    assert (hit, keys) == (106, _keys(10))
    assert probe.asked == [b"t10-0", b"t10-1"]  # the shorter one is not asked for
    assert _hit([10], _all(10), local=96, complete=0)[:2] == (10, _keys(10))  # past a local hit


def test_a_tail_one_group_misses_gives_way_to_the_next() -> None:
    answers = {**_all(4), b"t10-0": Presence.HIT}
    hit, keys, probe = _hit([10, 4], answers)
    assert (hit, keys) == (100, _keys(4))
    assert probe.asked == [b"t10-0", b"t10-1", b"t4-0", b"t4-1"]
    assert _hit([10, 4], {b"t10-0": Presence.HIT})[:2] == (96, None)  # none whole: the complete hit


@pytest.mark.parametrize("state", [Presence.PENDING, Presence.RETRY])
def test_a_tail_on_its_way_defers(state: Presence) -> None:
    assert _hit([10, 4], {**_all(4), b"t10-0": Presence.HIT, b"t10-1": state})[:2] == (None, None)


def test_a_tail_being_loaded_for_another_request_defers() -> None:
    assert _hit([4], _all(4), being_loaded=lambda k: k == b"t4-1")[:2] == (None, None)
    assert _hit([4], _all(4), being_loaded=lambda k: False)[:2] == (100, _keys(4))


def test_a_deferred_complete_hit_probes_the_longest_tail_and_defers() -> None:
    """After a restart the chunks and the tail promote from disk together, not one after the other."""
    hit, keys, probe = _hit([10, 4], _all(10, 4), complete=None)
    assert (hit, keys) == (None, None) and probe.asked == [b"t10-0", b"t10-1"]
    assert _hit([], {}, complete=None)[2].asked == []


def test_no_candidates_leave_the_complete_hit() -> None:
    hit, keys, probe = _hit([], {})
    assert (hit, keys, probe.asked) == (96, None, [])


def test_the_load_plan_puts_the_tail_in_the_chunk_the_hit_ends_in() -> None:
    """A 2-block chunk layout: 3 complete chunks (96 tokens) and a stored 20-token tail of the
    next chunk serve a 150-token prompt to 116; the tail's two blocks load under its keys."""
    layout = Layout((_fa(0, bpc=2), _fa(1, bpc=2)))
    keys = {g: [b"c0-%d" % g, b"c1-%d" % g, b"c2-%d" % g, b"c3-%d" % g] for g in (0, 1)}
    stored = {k for g in (0, 1) for k in keys[g][:3]} | set(_keys(20).values())
    probe = Probe(dict.fromkeys(stored, Presence.HIT))
    complete = lookup_hit(layout, num_tokens=150, local_computed=0, keys=keys, probe=probe)
    assert complete == 96
    span = tail_extension_span(layout, hit_end=complete, num_tokens=150, local_computed=0)
    assert span is not None and span[0] == 96 and list(span[1]) == list(range(31, 1, -1))
    held = [(t, _keys(t)) for t in span[1] if t == 20]
    hit, tail = tail_extension_hit(layout, complete_hit=complete, local_computed=0, start=96,
                                   candidates=held, probe=probe)
    assert hit == 116 and tail == _keys(20)
    blocks = {0: list(range(1, 9)), 1: list(range(11, 19))}
    plan = plan_load(layout, local_computed=0, hit_tokens=hit, block_ids=blocks, keys=keys, tail_keys=tail)
    last = [(t.group, t.key, t.block_ids) for t in plan if t.chunk_index == 3]
    assert last == [(0, b"t20-0", (7, 8)), (1, b"t20-1", (17, 18))]
