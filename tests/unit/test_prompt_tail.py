"""The prompt's partial last chunk (semantics.prompt_tail): when it is stored, when it is served."""

from __future__ import annotations

import pytest
from probe_helper import Probe

from kvstrata.presence import Presence
from kvstrata.semantics import (
    GroupGeometry,
    GroupKind,
    Layout,
    lookup_hit,
    plan_answer_tail_store,
    plan_load,
    plan_prompt_tail_store,
    plan_prompt_tail_store_again,
    prompt_tail_end,
    prompt_tail_hit,
    prompt_tail_keys,
    prompt_tail_start,
)


def _fa(index: int = 0, tpb: int = 16, bpc: int = 1, drafter: bool = False) -> GroupGeometry:
    return GroupGeometry(index, GroupKind.FULL, tpb, bpc, 16, is_drafter=drafter)


FA = Layout((_fa(0), _fa(1)))
TAILS = {0: b"tail-0", 1: b"tail-1"}


def _hit(layout: Layout = FA, *, complete: int | None = 96, n: int = 100, local: int = 0,
         answers: dict[bytes, Presence] | None = None, tails=TAILS, **kw) -> tuple[int | None, Probe]:
    probe = Probe({k: Presence.HIT for k in TAILS.values()} if answers is None else answers)
    hit = prompt_tail_hit(layout, complete_hit=complete, num_tokens=kw.pop("num_tokens", n),
                          num_prompt_tokens=n, local_computed=local, tail_keys=tails, probe=probe, **kw)
    return hit, probe


def test_which_layouts_serve_prompt_tails() -> None:
    assert FA.serves_prompt_tails
    assert Layout((_fa(0), GroupGeometry(1, GroupKind.SLIDING, 16, 1, 16, sliding_window=32))).serves_prompt_tails
    assert not Layout((GroupGeometry(0, GroupKind.CHUNKED_LOCAL, 16, 1, 16, attention_chunk_size=64),)).serves_prompt_tails
    assert not Layout((_fa(0), GroupGeometry(1, GroupKind.MAMBA, 16, 1, 16))).serves_prompt_tails
    assert not Layout((_fa(0), _fa(1, drafter=True))).serves_prompt_tails
    assert not Layout((_fa(0, tpb=16), _fa(1, tpb=32))).serves_prompt_tails  # two chunk sizes
    assert prompt_tail_start(FA, 100) == 96
    assert prompt_tail_start(FA, 96) is None  # chunk-aligned: no tail
    assert prompt_tail_start(FA, 10) == 0
    assert prompt_tail_start(Layout((_fa(0, bpc=4),)), 100) == 64


def test_tail_keys_chain_the_partial_block_to_the_hash_ending_at_its_start() -> None:
    hashes = [bytes([i]) * 8 for i in range(6)]  # one per 16 tokens: 96 tokens covered
    calls: list[tuple[bytes | None, int]] = []

    def hash_tail(parent: bytes | None, start: int) -> bytes:
        calls.append((parent, start))
        return b"digest-%d" % start

    keys = prompt_tail_keys(FA, hashes, 100, hash_tail)
    assert calls == [(hashes[5], 96)]
    assert keys == {0: b"digest-96" + (0).to_bytes(4, "big"), 1: b"digest-96" + (1).to_bytes(4, "big")}
    calls.clear()
    assert prompt_tail_keys(FA, hashes[:5], 100, hash_tail) is None  # hashes not there yet
    assert prompt_tail_keys(FA, hashes, 96, hash_tail) is None  # chunk-aligned: no tail
    assert not calls
    # A prompt shorter than a chunk: the tail starts at 0, chained to nothing.
    assert prompt_tail_keys(FA, [], 10, hash_tail) is not None and calls == [(None, 0)]
    calls.clear()
    four = Layout((_fa(0, bpc=4),))  # 64-token chunks: the tail starts at 64, after hash 3
    prompt_tail_keys(four, hashes, 100, hash_tail)
    assert calls == [(hashes[3], 64)]
    assert prompt_tail_keys(Layout((_fa(0), GroupGeometry(1, GroupKind.MAMBA, 16, 1, 16))), hashes,
                            100, hash_tail) is None  # not served for Mamba hybrids


def test_a_complete_hit_reaching_the_tail_extends_to_the_prompt_end() -> None:
    hit, probe = _hit()
    assert hit == 100
    assert probe.asked == [b"tail-0", b"tail-1"]
    assert _hit(local=32, complete=64)[0] == 68  # beyond a local GPU hit
    assert _hit(local=96, complete=0)[0] == 4  # the whole prefix is local: only the tail loads
    assert _hit(n=10, complete=0)[0] == 10  # a prompt shorter than a chunk


@pytest.mark.parametrize("missing", [b"tail-0", b"tail-1"])
def test_any_group_without_its_tail_leaves_the_complete_hit(missing: bytes) -> None:
    answers = {k: Presence.HIT for k in TAILS.values() if k != missing}
    assert _hit(answers=answers)[0] == 96


@pytest.mark.parametrize("state", [Presence.PENDING, Presence.RETRY])
def test_a_tail_on_its_way_defers(state: Presence) -> None:
    assert _hit(answers={b"tail-0": Presence.HIT, b"tail-1": state})[0] is None


def test_a_deferred_complete_hit_still_probes_the_tail() -> None:
    """After a restart the chunks and the tail promote from disk together, not one after the other."""
    hit, probe = _hit(complete=None)
    assert hit is None and probe.asked == [b"tail-0", b"tail-1"]


def test_no_tail_probe_when_it_cannot_apply() -> None:
    for kw in ({"complete": 64}, {"n": 96}, {"num_tokens": 101}, {"tails": None},
               {"max_new_tokens": 99}, {"max_load_tokens": 99}, {"local": 32, "complete": 0}):
        complete = kw.get("complete", 96)
        hit, probe = _hit(**kw)
        assert hit == complete, kw
        assert probe.asked == [], kw
    assert _hit(max_new_tokens=100, max_load_tokens=100)[0] == 100  # caps at the prompt's end


def test_other_layouts_are_unchanged() -> None:
    mamba = Layout((_fa(0), GroupGeometry(1, GroupKind.MAMBA, 16, 1, 16)))
    hit, probe = _hit(mamba)
    assert hit == 96 and probe.asked == []


def test_a_sliding_window_group_is_extended_with_its_tail_one_token_short() -> None:
    # R21 (docs/SEMANTICS.md): vLLM allocates a whole-prompt hit before rewinding, and its window manager would null
    # a block the recomputed token attends; windowed layouts stop at N - 1 (issue 22, defect 1).
    sw = Layout((_fa(0), GroupGeometry(1, GroupKind.SLIDING, 16, 1, 16, sliding_window=32)))
    hit, probe = _hit(sw)
    assert hit == 99 and sorted(probe.asked) == sorted(TAILS.values())
    assert prompt_tail_end(sw, 100) == 99 and prompt_tail_end(FA, 100) == 100
    # Caps are measured against that end.
    assert _hit(sw, max_new_tokens=99)[0] == 99
    assert _hit(sw, max_new_tokens=98)[0] == 96
    assert _hit(sw, max_load_tokens=99)[0] == 99
    assert _hit(sw, max_load_tokens=98)[0] == 96


@pytest.mark.parametrize(("n", "local", "expected"), [
    (1, 0, None),     # a one-token prompt: no tail at all (a hit of 1 would loop forever)
    (97, 0, None),    # a one-token tail: nothing to save
    (2, 0, 2),        # FA: the whole prompt, vLLM recomputes token 1
    (98, 0, 98),
    (100, 98, 100),   # a local hit inside the tail's block (finer hashes): one token saved
    (100, 99, None),  # the local hit already reaches the last token: nothing to save
])
def test_a_tail_is_served_only_when_it_saves_a_token(n: int, local: int, expected: int | None) -> None:
    start = prompt_tail_start(FA, n)
    if expected is None and local == 0:
        assert start is None
        return
    complete = (start or 0) - local if start is not None and local <= start else 0
    hit, _ = _hit(complete=complete, n=n, local=local)
    assert hit == (complete if expected is None else expected - local)


def test_a_tail_being_loaded_for_another_request_defers() -> None:
    assert _hit(being_loaded=lambda k: k == b"tail-1")[0] is None
    assert _hit(being_loaded=lambda k: False)[0] == 100


def test_load_plan_for_a_tail_hit_uses_the_tail_keys() -> None:
    layout = Layout((_fa(0, bpc=2), _fa(1, bpc=2)))
    keys = {g: [b"c0-%d" % g, b"c1-%d" % g, b"c2-%d" % g] for g in (0, 1)}
    stored = {k for ks in keys.values() for k in ks} | set(TAILS.values())
    probe = Probe({k: Presence.HIT for k in stored})
    complete = lookup_hit(layout, num_tokens=120, local_computed=0, keys=keys, probe=probe)
    assert complete == 96
    hit = prompt_tail_hit(layout, complete_hit=complete, num_tokens=120, num_prompt_tokens=120,
                          local_computed=0, tail_keys=TAILS, probe=probe)
    assert hit == 120
    blocks = {0: list(range(1, 9)), 1: list(range(11, 19))}
    plan = plan_load(layout, local_computed=0, hit_tokens=hit, block_ids=blocks, keys=keys, tail_keys=TAILS)
    tail = [t for t in plan if t.chunk_index == 3]
    assert [(t.group, t.key, t.block_ids) for t in tail] == [(0, b"tail-0", (7, 8)), (1, b"tail-1", (17, 18))]
    assert len(plan) == 8


def test_the_tail_is_stored_in_the_step_that_completes_the_prompt() -> None:
    blocks = {0: [1, 2, 3, 4, 5, 6, 7], 1: [11, 12, 13, 14, 15, 16, 17]}

    def plan(before: int, after: int, **kw):
        return plan_prompt_tail_store(FA, num_prompt_tokens=100, computed_before=before, computed_after=after,
                                      block_ids=kw.pop("block_ids", blocks), tail_keys=TAILS, **kw)

    done = plan(64, 100)
    assert [(t.group, t.chunk_index, t.key, t.block_ids, t.first_block_in_chunk) for t in done] == [
        (0, 6, b"tail-0", (7,), 0), (1, 6, b"tail-1", (17,), 0)]
    assert plan(0, 64) == []  # the prompt is not complete yet
    assert plan(100, 101) == []  # decoding: stored already
    assert plan(99, 101) != []  # the step that ends the prompt (and samples past it)
    assert plan(64, 100, max_offload_tokens=99) == []
    assert plan(64, 100, max_offload_tokens=100) != []
    assert plan(64, 100, block_ids={0: blocks[0], 1: [11, 12, 13, 14, 15, 16, 0]}) == []
    assert plan_prompt_tail_store(FA, num_prompt_tokens=96, computed_before=0, computed_after=96,
                                  block_ids=blocks, tail_keys=TAILS) == []  # no tail
    bpc4 = Layout((_fa(0, bpc=4),))
    [t] = plan_prompt_tail_store(bpc4, num_prompt_tokens=100, computed_before=0, computed_after=100,
                                 block_ids={0: blocks[0]}, tail_keys=TAILS)
    assert (t.chunk_index, t.block_ids) == (1, (5, 6, 7))


def test_a_refused_tail_is_stored_again_while_decoding_is_inside_its_chunk() -> None:
    """The host tier had no room in the step that completed the prompt (100 tokens, the tail
    96..100 in block 7): the same transfers in every later step whose computed tokens are
    still inside the tail's chunk (100..111), never before the prompt is computed or past the
    chunk, nor for a null block or under a cap."""
    blocks = {0: [1, 2, 3, 4, 5, 6, 7], 1: [11, 12, 13, 14, 15, 16, 17]}
    first = plan_prompt_tail_store(FA, num_prompt_tokens=100, computed_before=64, computed_after=100,
                                   block_ids=blocks, tail_keys=TAILS)

    def again(computed: int, **kw):
        return plan_prompt_tail_store_again(FA, num_prompt_tokens=kw.pop("n", 100), num_computed_tokens=computed,
                                            block_ids=kw.pop("block_ids", blocks),
                                            tail_keys=kw.pop("tails", TAILS), **kw)

    for computed in range(100, 112):
        assert again(computed) == first, computed
    for computed in (0, 64, 99, 112, 113, 200):
        assert again(computed) == [], computed
    assert again(105, block_ids={0: blocks[0], 1: [11, 12, 13, 14, 15, 16, 0]}) == []
    assert again(105, max_offload_tokens=99) == [] and again(105, max_offload_tokens=100) == first
    assert again(105, tails=None) == []
    assert again(100, n=96) == []  # no tail
    assert again(100, n=97) == []  # a one-token tail saves nothing
    bpc4 = Layout((_fa(0, bpc=4),))  # 64-token chunks: decoding stays in the tail's to 128
    [t] = plan_prompt_tail_store_again(bpc4, num_prompt_tokens=100, num_computed_tokens=127,
                                       block_ids={0: [*blocks[0], 8]}, tail_keys=TAILS)
    assert (t.chunk_index, t.block_ids) == (1, (5, 6, 7))
    assert plan_prompt_tail_store_again(bpc4, num_prompt_tokens=100, num_computed_tokens=128,
                                        block_ids={0: [*blocks[0], 8, 9]}, tail_keys=TAILS) == []


def test_the_answer_tail_is_the_chunk_holding_the_end_of_the_written_kv() -> None:
    """At a finish with the answer offloaded: 100 prompt tokens and 19 written past them (119)
    leave complete chunks to 112 and a 7-token tail in block 7; one block per chunk."""
    blocks = {0: list(range(1, 9)), 1: list(range(11, 19))}

    def plan(offloadable: int, **kw):
        return plan_answer_tail_store(FA, num_prompt_tokens=kw.pop("n", 100), offloadable=offloadable,
                                      block_ids=kw.pop("block_ids", blocks), tail_keys=kw.pop("tails", TAILS))

    assert [(t.group, t.chunk_index, t.key, t.block_ids) for t in plan(119)] == [
        (0, 7, b"tail-0", (8,)), (1, 7, b"tail-1", (18,))]
    assert [t.block_ids for t in plan(107)] == [(7,), (17,)]  # inside the prompt's own last chunk
    assert plan(100) == []  # no KV past the prompt: the prompt's tail covers it
    assert plan(113) == []  # a one-token tail saves nothing
    assert plan(112) == []  # chunk-aligned: the complete chunk is stored as it fills
    assert plan(119, tails=None) == []
    assert plan(119, block_ids={0: blocks[0], 1: [*blocks[1][:7], 0]}) == []  # a null block
    bpc4 = Layout((_fa(0, bpc=4),))
    [t] = plan_answer_tail_store(bpc4, num_prompt_tokens=60, offloadable=100, block_ids={0: blocks[0]},
                                 tail_keys=TAILS)
    assert (t.chunk_index, t.block_ids) == (1, (5, 6, 7))
