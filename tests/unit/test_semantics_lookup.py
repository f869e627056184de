"""kvstrata's lookup semantics: prefix and window runs (R18, R19), the worked lookups of
docs/SEMANTICS.md §3 (R17, examples E1 and E3) with caps and deferrals, and Mamba alignment
(R24-R26)."""

from __future__ import annotations

import pytest
from semantics_helpers import (
    E1,
    E3,
    HIT,
    MISS,
    PENDING,
    RETRY,
    E,
    fa,
    hashes,
    idx_keys,
    keys_of,
    mamba,
    probe_of,
    serve,
    sw,
)

from kvstrata.semantics import (
    Layout,
    initial_cap,
    lookup_hit,
    prefix_run,
    window_run,
    worthwhile_hit,
)


# ----------------------------------------------------------------------------- R18 / R19
@pytest.mark.parametrize(
    "answers, expected",
    [
        ([HIT, HIT], 2),
        ([], 0),
        ([MISS, MISS], 0),
        ([HIT, HIT, MISS], 2),
        ([MISS, HIT], 0),
        ([HIT], 1),
        ([RETRY], None),
        ([PENDING], None),
        ([RETRY, HIT], None),
        ([HIT, RETRY], None),
        ([PENDING, HIT], None),
        ([PENDING, MISS, HIT], None),
        ([RETRY, MISS, HIT], None),
        ([HIT, MISS, RETRY], 1),  # answers past the first miss do not matter
    ],
)
def test_prefix_run_r18(answers, expected):
    calls: list = []
    assert prefix_run(idx_keys(len(answers)), probe_of(answers, calls)) == expected
    assert len(calls) == (1 if answers else 0)  # one batch per group query


@pytest.mark.parametrize(
    "answers, window, initial, expected",
    [
        ([HIT, HIT], 2, None, 2),
        ([MISS, MISS, MISS], 1, None, 0),
        ([MISS, HIT, HIT], 2, None, 3),
        ([MISS, HIT, HIT, MISS], 2, None, 3),  # hits at [2,3] of [1,2,3,4]
        ([HIT, HIT, MISS], 3, None, 2),  # prefix fallback
        ([MISS, HIT, HIT], 1, None, 3),
        ([MISS, HIT, HIT, MISS, HIT], 2, None, 3),  # gap resets the streak
        ([HIT, HIT, MISS, HIT, HIT], 2, None, 5),  # rightmost window wins
        ([HIT, MISS, HIT, HIT, HIT], 4, None, 1),  # prefix fallback behind a gap
        ([], 1, None, 0),
        ([HIT, RETRY], 2, None, None),
        ([HIT, HIT, RETRY, HIT], 2, None, None),  # a window found after a RETRY still defers
        ([HIT, PENDING], 2, None, None),
        ([HIT, PENDING, HIT], 3, None, None),
        ([HIT, HIT, MISS, PENDING], 2, None, 2),  # a pending chunk behind a gap cannot help
        # the first run needs the (wider) initial window; after a gap the plain window
        ([HIT, HIT, HIT], 2, 3, 3),
        ([MISS, HIT, HIT], 2, 3, 1 - 1),  # neither 3 in a row nor a leading hit
        ([HIT, MISS, HIT, HIT, MISS, HIT, HIT], 2, 3, 4),
        ([HIT, HIT, MISS, HIT, HIT], 2, 3, 2),
    ],
)
def test_window_run_r19(answers, window, initial, expected):
    assert window_run(idx_keys(len(answers)), window, probe_of(answers), initial) == expected


def test_window_run_probes_only_what_can_complete_the_run():
    calls: list = []
    answers = [HIT] * 10
    assert window_run(idx_keys(10), 2, probe_of(answers, calls)) == 10
    assert calls == [[b"8", b"9"]]  # keys left of the winning run are never probed
    calls.clear()
    answers = [HIT] * 6 + [MISS] * 4
    assert window_run(idx_keys(10), 2, probe_of(answers, calls)) == 6
    assert sorted(k for c in calls for k in c) == sorted(idx_keys(10)[4:])


def test_probe_must_answer_every_key():
    with pytest.raises(ValueError):
        prefix_run(idx_keys(2), lambda batch: [HIT])


def test_full_attention_runs_go_through_the_prefix_probe_and_windows_do_not():
    """``probe_prefix`` (a tier may stop at a run's first MISS) answers full-attention runs;
    windows are scanned right to left and need every answer, so they use ``probe``."""
    keys = keys_of(E3, hashes(200, 16))
    by_prefix: list[bytes] = []
    by_plain: list[bytes] = []

    def plain(batch):
        by_plain.extend(batch)
        return [HIT] * len(batch)

    def prefix(batch):
        by_prefix.extend(batch)
        return [HIT] * len(batch)

    hit = lookup_hit(E3, num_tokens=200, local_computed=0, keys=keys, probe=plain, probe_prefix=prefix)
    assert hit == 192
    assert set(by_prefix) == set(keys[0]) and set(by_plain) <= set(keys[1]) and by_plain


@pytest.mark.parametrize(("hit", "num_tokens", "local", "expected"), [
    (1, 1, 0, 0),     # a one-token prompt's hit would rewind to 0 and be looked up forever
    (2, 2, 0, 2),     # the whole of a 2-token prompt: token 0 is saved
    (16, 32, 16, 16),
    (1, 17, 16, 0),   # the whole prompt, one token past the local hit: nothing saved
    (1, 18, 16, 1),   # not the whole prompt: a token saved
])
def test_a_hit_that_saves_nothing_is_no_hit(hit, num_tokens, local, expected):
    assert worthwhile_hit(hit, num_tokens=num_tokens, local_computed=local) == expected


def test_a_one_token_block_layout_never_serves_a_one_token_prompt():
    tiny = Layout((fa(0, tpb=1, bpc=1, tph=1),))
    assert serve(tiny, 1) == 0
    assert serve(tiny, 2) == 2


# ----------------------------------------------------------------------------- R17 worked lookups
@pytest.mark.parametrize(
    "layout, num_tokens, stored, local, expected",
    [
        (E1, 100, {0: [0, 1, 2]}, 0, 96),
        (E1, 100, {0: [0, 1, 2]}, 32, 64),  # lookup starts at chunk 1
        (E1, 100, {0: [0, 1, 2]}, 48, 48),  # chunk 1 half local: looked up again
        (E1, 96, None, 0, 96),  # the whole prompt (the scheduler recomputes the last token)
        (E1, 200, {0: [0, 1, 3, 4]}, 0, 64),
        (E1, 31, None, 0, 0),  # not one complete chunk
        (E1, 100, {0: [0, 1, 2]}, 80, 0),  # less than a chunk beyond the local hit
        (E3, 200, None, 0, 192),  # cap 199, FA 6 chunks, SW window = chunks 4-5
        (E3, 200, {0: range(6), 1: [0, 1, 2, 3, 4]}, 0, 160),
        (E3, 200, {0: range(6), 1: [4, 5]}, 0, 192),  # SW needs only the last window
        (E3, 200, {0: range(6), 1: [1, 2, 5]}, 0, 96),
        (E3, 200, {0: [0, 1], 1: range(6)}, 0, 64),
        (E3, 193, None, 0, 192),
        (E3, 192, None, 0, 191),  # cap 191 falls inside chunk 5: loaded whole
        (E3, 200, {0: range(6), 1: [5]}, 0, 0),  # SW has no full window and no prefix
    ],
)
def test_worked_lookups_r17(layout, num_tokens, stored, local, expected):
    assert serve(layout, num_tokens, stored, local=local) == expected


def test_caps_max_new_and_max_load_tokens():
    assert serve(E1, 200, None, max_new_tokens=100) == 100  # a cap may end inside a chunk (R21)
    assert serve(E1, 200, None, max_load_tokens=100) == 96  # a load cap rounds to chunks
    assert serve(E1, 200, None, local=32, max_load_tokens=40) == 32
    assert serve(E1, 200, None, max_load_tokens=0) == 0
    assert serve(E1, 200, None, max_new_tokens=20) == 0
    assert (
        initial_cap(E3, num_tokens=200, local_computed=0, max_new_tokens=None, max_load_tokens=None)
        == 199
    )


def test_deferrals():
    # Anything pending in the hit range: ask again next step (R18, R19, R17.4).
    assert serve(E3, 200, None, pending={0: [2]}) is None
    assert serve(E3, 200, None, pending={1: [5]}) is None
    # ... but not a pending chunk the hit can no longer reach.
    assert serve(E3, 200, {0: [0, 1, 2], 1: range(6)}, pending={0: [4]}) == 96


def test_being_loaded_defers_r17_5():
    hs = hashes(200, 16)
    keys = keys_of(E3, hs)

    def run(loading):
        return lookup_hit(
            E3, num_tokens=200, local_computed=0, keys=keys, probe=lambda b: [HIT] * len(b),
            being_loaded=loading.__contains__,
        )  # fmt: skip

    assert run(set()) == 192
    assert run({keys[0][0]}) is None
    assert run({keys[1][5]}) is None
    assert run({keys[1][0]}) == 192  # outside the SW load window: not a reason to wait


def test_multiple_sliding_windows_recheck_r23():
    layout = Layout((fa(0, **E), sw(1, 64, **E), sw(2, 32, **E)), retention_interval=None)
    assert serve(layout, 200) == 192
    # the smaller window tightens to chunk 4: the larger window must still end there
    assert serve(layout, 200, {0: range(6), 1: range(6), 2: [0, 1, 2, 3]}) == 128
    assert serve(layout, 200, {0: range(6), 1: [4, 5], 2: [0, 1, 2, 3]}) == 0


def test_two_groups_different_block_sizes():
    layout = Layout((fa(0, tpb=12, bpc=1, tph=4), fa(1, tpb=16, bpc=1, tph=4)))
    assert serve(layout, 48) == 48
    assert serve(layout, 85, local=48) == 32  # FA16 stops at 80


# ----------------------------------------------------------------------------- Mamba (R24-R26)
FA16_M256 = Layout((fa(0, tpb=16, bpc=1, tph=16), mamba(1, 256, bpc=1, tph=16)))


@pytest.mark.parametrize(
    "num_tokens, states, fa_chunks, local, kwargs, expected",
    [
        (600, [0, 1], 37, 0, {}, 512),
        (600, [0], 37, 0, {}, 256),
        (600, [1], 37, 0, {}, 512),  # window = 1 chunk
        (513, [0, 1], 37, 0, {}, 512),
        (512, [0, 1], 37, 0, {}, 256),  # R24: the state at the prompt end includes the last token
        (600, [], 37, 0, {}, 0),
        (600, [0, 1], 37, 256, {}, 256),
        (600, [0, 1], 37, 0, {"max_new_tokens": 300}, 256),
        (600, [0, 1], 37, 256, {"max_new_tokens": 300}, 256),
    ],
)
def test_mamba_worked_lookups_r24_r25(num_tokens, states, fa_chunks, local, kwargs, expected):
    stored = {0: range(fa_chunks), 1: states}
    assert serve(FA16_M256, num_tokens, stored, local=local, **kwargs) == expected


@pytest.mark.parametrize("fa_chunks, vllm_hit", [(31, 496), (20, 320)])
def test_mamba_final_hit_is_realigned_r26(fa_chunks, vllm_hit):
    """vLLM 0.32.0 serves 496 (or 320) tokens with the Mamba state @512; kvstrata rounds down."""
    stored = {0: range(fa_chunks), 1: [0, 1]}
    assert serve(FA16_M256, 600, stored, align_final_to_mamba=False) == vllm_hit
    assert serve(FA16_M256, 600, stored) == 256
    # no usable state at or below the finer group's end: nothing
    assert serve(FA16_M256, 600, {0: range(fa_chunks), 1: [1]}) == 0


def test_mamba_realignment_rechecks_every_group():
    """After rounding down, the sliding window must end at the new boundary too."""
    layout = Layout(
        (fa(0, tpb=16, bpc=1), sw(1, 32, tpb=16, bpc=1), mamba(2, 64, bpc=1)),
        retention_interval=None,
    )
    full = {0: range(12), 1: range(12), 2: range(3)}
    assert serve(layout, 200, full) == 192
    # FA stops at 176 -> round to 128; SW must hold the window ending at 128 (chunks 6-7)
    assert serve(layout, 200, {**full, 0: range(11)}) == 128
    assert serve(layout, 200, {**full, 0: range(11), 1: [9, 10, 11]}) == 0
