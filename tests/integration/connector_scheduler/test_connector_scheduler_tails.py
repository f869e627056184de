"""Tails under vLLM 0.32.0's real Scheduler, on CPU: partial tails (R30), the prompt's partial last
chunk, a stored tail serving a longer prompt, the answer's tail, and the blocks a recomputed token
attends after a prompt-tail hit (issue 22). Loaded pages are byte-checked by the harness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from connector_scheduler_helpers import (
    PARTIAL_TAIL,
    store_then_serve,
    token_prompt,
)
from strata_harness import G

pytestmark = pytest.mark.integration


# Partial tails (R7, R30, §3.8 C): FA16 + Mamba-align 16 hashed every 4 tokens. A 30-token prompt
# has one complete chunk (16); its replay boundary is 29 rounded down to a hash: 28. The scheduler
# splits the prefill there and hands off the Mamba state @28 when the next chunk copies it
# (copy-on-write); kvstrata then stores both groups at 28 under boundary keys.
@pytest.mark.parametrize("max_tokens", [1, 3])
def test_partial_tail_is_stored_and_served(runners, max_tokens: int) -> None:
    r = runners(PARTIAL_TAIL, prefix_match_unit=4)
    assert r.connector.scheduler.layout.supports_partial_tail
    assert store_then_serve(r, token_prompt(30), max_tokens=max_tokens) == 28


def test_partial_tail_served_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners(PARTIAL_TAIL, store=store, prefix_match_unit=4)
    first.serve(token_prompt(30), 1)
    first.close()
    second = runners(PARTIAL_TAIL, store=store, prefix_match_unit=4)
    assert second.serve(token_prompt(30), 1) == 28
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] > 0


def test_partial_tail_of_a_request_that_finishes_at_its_boundary(runners) -> None:
    """A request that ends right after the prefill chunk that stops at its replay boundary (28),
    before the next chunk's copy-on-write hands the Mamba state off, offers that state through
    ``register_finished_partial_tail``: kvstrata stores it, and the same prompt is served up to
    28 tokens. vLLM frees the request's blocks at once; with 8 blocks the next step hands them to
    new requests, and the fenced store is copied before that step's forward (a flush)."""
    from vllm.v1.request import RequestStatus

    r = runners(PARTIAL_TAIL, prefix_match_unit=4, num_blocks=8)
    offered: list[Any] = []
    hook = r.connector.register_finished_partial_tail
    r.connector.register_finished_partial_tail = lambda *a: offered.append(a[2]) or hook(*a)
    flushed: list[set[int]] = []
    worker = r.workers[0]
    handle = worker.handle_preemptions
    worker.handle_preemptions = lambda meta: flushed.append(set(meta.flush)) or handle(meta)
    req = r.add(token_prompt(30), max_tokens=3)
    steps = 0
    while req.num_computed_tokens < 28 and steps < 4:  # align mode: prefill chunks end at 16, 28
        r.step()
        steps += 1
    assert req.num_computed_tokens == 28  # the prefill split at the replay boundary
    r.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    if r.async_scheduling:
        # The next chunk is already scheduled (tokens in flight): vLLM offers no tail then, and
        # only the complete chunk is served.
        assert offered == []
        expected = 16
    else:
        assert offered and offered[0][0][2] == 28  # (group, table block, boundary)
        expected = 28
    flushed.clear()
    for seed in (2, 3, 4, 5):  # more blocks than were never used: the freed ones go too
        r.add(token_prompt(12, seed=seed), max_tokens=1)
    r.step()
    assert any(flushed) == (not r.async_scheduling)
    r.run_until_idle()
    r.drop_gpu_prefix_cache()
    assert r.serve(token_prompt(30), 1) == expected
    assert r.load_errors == []


def test_partial_tail_from_a_kernel_checkpoint(runners, tmp_path: Path) -> None:
    """A kernel that saves the checkpoint inside the forward (vLLM's Mamba2 layers) does not
    split a one-chunk prefill: the only Mamba state handed off is the one at the tail (28), none
    at the block boundary (16). vLLM's lookup, which looks for tails only above a complete hit of
    every group, serves nothing; kvstrata serves the attention prefix and the tail, also from
    disk after a restart."""
    store = tmp_path / "persist"
    groups = [G("full", 16), G("mamba", 16, checkpoint_alignment=4)]
    r = runners(groups, store=store, prefix_match_unit=4)
    assert r.scheduler.mamba_has_prefill_checkpoint_blocks
    assert store_then_serve(r, token_prompt(30), max_tokens=1) == 28
    r.close()
    again = runners(groups, store=store, prefix_match_unit=4)
    assert again.serve(token_prompt(30), 1) == 28
    assert again.load_errors == []


# ---- the prompt's partial last chunk (semantics.prompt_tail) -------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_prompt_tail_is_stored_and_served(runners, max_tokens: int) -> None:
    """100 tokens on 16-token blocks: 6 chunks and a 4-token tail; the tail's positions are
    checked one by one (decode steps after the prompt must not leak into the stored tail)."""
    r = runners([G("full", 16), G("full", 16)])
    assert store_then_serve(r, token_prompt(100), max_tokens=max_tokens) == 100


@pytest.mark.parametrize("groups", [[G("full", 16)], [G("full", 16), G("sw", 16, window=32)]],
                         ids=["fa", "fa-sw"])
@pytest.mark.parametrize("max_tokens", [6, 1], ids=["decoding", "finished"])
def test_a_prompt_tail_the_host_tier_had_no_room_for_is_stored_while_decoding(runners, groups, max_tokens: int) -> None:
    """100 tokens on 16-token blocks, every host slot but six per group held when the prompt
    completes: its six chunks are stored and its 4-token tail is refused. Slots free up while it decodes:
    the tail is stored then (decoding writes only past the prompt), and the same prompt is
    served whole, every loaded position byte-checked. A request that finished with the prompt
    has no later step: served the six chunks. Watched failing with no second attempt (96)."""
    import os

    r = runners(groups)
    hierarchy = r.connector.scheduler.hierarchy
    pinned = [os.urandom(28) + bytes(4) for _ in range(r.connector.scheduler.plan.num_slots - 6 * len(groups))]
    assert hierarchy.prepare_store(pinned) is not None
    prompt = token_prompt(100)
    req = r.add(prompt, max_tokens)
    while req.num_computed_tokens < 100:
        r.step()
    assert hierarchy.stats()["store_no_room"] == 1  # the tail, refused
    hierarchy.complete_store(pinned, success=False)  # the slots' holders let go
    r.run_until_idle()
    r.drop_gpu_prefix_cache()
    assert hierarchy.stats()["stores_completed"] >= 6 * len(groups)
    whole = 100 if len(groups) == 1 else 99  # windowed layouts stop one token short (R21)
    assert r.serve(prompt, 1) == (whole if max_tokens > 1 else 96)
    assert r.load_errors == [], r.load_errors
    assert r.stats.data["late_tail_stores"] == (1 if max_tokens > 1 else 0)


def test_prompt_tail_names_its_exact_tokens(runners) -> None:
    """Same chunks, another last token: the tail is not served (to that prompt, nor to one that
    extends it); a prompt that starts with the stored tokens is (R21a)."""
    r = runners([G("full", 16)])
    base = token_prompt(100)
    other = [*base[:99], base[99] + 1]
    assert store_then_serve(r, base, again=other) == 96
    r.drop_gpu_prefix_cache()
    assert r.serve([*other, *token_prompt(20, seed=2)], 1) == 100  # other's own tail, stored just now
    r.drop_gpu_prefix_cache()
    assert r.serve([*base[:98], base[98] + 1, *token_prompt(20, seed=3)], 1) == 96  # no stored tail fits
    r.drop_gpu_prefix_cache()
    assert r.serve(token_prompt(120), 1) == 100
    assert r.load_errors == []


def test_prompt_tail_on_top_of_a_gpu_prefix_hit(runners) -> None:
    """vLLM's own prefix cache holds the 6 complete blocks: kvstrata loads just the tail."""
    r = runners([G("full", 16)])
    prompt = token_prompt(100)
    assert r.serve(prompt, 1) == 0
    assert r.serve(prompt, 1) == 4
    assert r.load_errors == []


def test_prompt_tail_in_a_chunk_of_several_blocks(runners) -> None:
    """Chunks of 2 blocks: a 120-token prompt has 3 complete chunks and a tail chunk of a full
    block and a partial one."""
    r = runners([G("full", 16)], extra={"blocks_per_chunk": 2})
    assert store_then_serve(r, token_prompt(120)) == 120


def test_prompt_tail_served_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(token_prompt(100), 1)
    first.close()
    second = runners([G("full", 16)], store=store)
    assert second.serve(token_prompt(100), 1) == 100
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] == 7  # 6 chunks + the tail


# ---- a stored tail serves a longer prompt that starts with it (semantics.tail_extension) ----------
# A multi-turn follow-up is its previous prompt, the answer and a new turn: the previous prompt's
# tail (stored with it) serves the block it ended in. The hit ends short of the request's last
# token, so no rewind follows, with or without a sliding window (R21a).
EXTENSION_SCENARIOS = [
    ("fa", [G("full", 16)], {}),
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], {}),
    ("fa-tp2", [G("full", 16)], {"tp": 2}),
]


@pytest.mark.parametrize(("name", "groups", "kw"), EXTENSION_SCENARIOS, ids=[s[0] for s in EXTENSION_SCENARIOS])
def test_a_longer_prompt_is_served_the_tail_it_starts_with(runners, name, groups, kw) -> None:
    r = runners(groups, **kw)
    assert store_then_serve(r, token_prompt(100), max_tokens=3, again=token_prompt(120)) == 100
    assert r.stats.data["tail_extensions"] == 1
    # Its own chunk at 96 (a full one now) and its tail are stored: served whole next time.
    r.drop_gpu_prefix_cache()
    assert r.serve(token_prompt(120), 1) == (120 if name != "fa-sw" else 119)
    assert r.load_errors == []


def test_the_longest_stored_tail_that_fits_is_served(runners) -> None:
    r = runners([G("full", 16)])
    # Tails of 4 and 10 tokens after the same 6 chunks; the second prompt is served the first's
    # tail already, past vLLM's own 6 blocks.
    assert [r.serve(token_prompt(n), 1) for n in (100, 106)] == [0, 4]
    r.drop_gpu_prefix_cache()
    assert r.serve([*token_prompt(104), *token_prompt(20, seed=2)], 1) == 100  # diverges inside the 10-token tail
    r.drop_gpu_prefix_cache()
    assert r.serve(token_prompt(140), 1) == 106
    r.drop_gpu_prefix_cache()
    assert r.serve(token_prompt(101), 1) == 100  # the 4-token tail; the 10-token one is past its last token
    assert r.load_errors == []


def test_a_stored_tail_serves_a_longer_prompt_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(token_prompt(100), 1)
    first.close()
    second = runners([G("full", 16)], store=store)
    req = second.add(token_prompt(120), 1)
    second.run_until_idle()
    assert second.served[req.request_id] == {"disk": 100}
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] == 7  # 6 chunks + the tail


def test_a_stored_tail_past_a_gpu_prefix_hit_inside_its_chunk(runners) -> None:
    """Chunks of 2 blocks: the 120-token prompt stores 3 chunks and a 24-token tail. vLLM's own
    prefix cache keeps 7 blocks (112 tokens) of it, mid-chunk: kvstrata loads the tail's block
    past them."""
    r = runners([G("full", 16)], extra={"blocks_per_chunk": 2})
    assert r.serve(token_prompt(120), 1) == 0
    assert r.serve(token_prompt(150), 1) == 8
    assert r.load_errors == []


def test_tiers_that_held_no_candidate_tail_are_asked_again_only_after_a_while(runners, monkeypatch) -> None:
    """A waiting request is looked up every step: its candidate tails are hashed once, and tiers
    that held none of them (a round trip each with a shared tier) are asked at most every
    EXTENSION_RECHECK_S."""
    from kvstrata.connector import scheduler as sched_mod

    r = runners([G("full", 16)])
    sched = r.connector.scheduler
    asked: list[int] = []
    holds = sched.hierarchy.holds_many
    monkeypatch.setattr(sched.hierarchy, "holds_many", lambda keys, **kw: asked.append(len(keys)) or holds(keys, **kw))
    st = sched._reqs[r.add(token_prompt(120), 1).request_id]
    lengths = range(15, 1, -1)
    monkeypatch.setattr(sched_mod, "EXTENSION_RECHECK_S", 3600.0)  # no wall-clock in the test
    assert sched._tail_extension_candidates(st, 96, lengths) == [] and asked == [14]
    assert sched._tail_extension_candidates(st, 96, lengths) == [] and asked == [14]
    monkeypatch.setattr(sched_mod, "EXTENSION_RECHECK_S", 0.0)
    assert sched._tail_extension_candidates(st, 96, lengths) == [] and asked == [14, 14]
    r.run_until_idle()  # token_prompt(120) is stored, its tail at 112 included
    assert len(st.extension_tails) == 14  # hashed once


# With ``offload_prompt_only`` false the answer's KV is stored too: its complete chunks as they
# fill, and at finish the chunk holding the end of the KV it wrote (the final sampled token's slot
# is never written) as a tail. The next turn (prompt, answer, a new turn) is served to there.
ANSWER_SCENARIOS = [
    ("fa-in-the-prompt-chunk", [G("full", 16)], 8, {}),  # 100 + 7 written: a tail of 11 at 96
    ("fa-past-a-chunk", [G("full", 16)], 20, {}),  # 119 written: chunk 96..112 and a tail of 7
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], 20, {}),
    ("fa-2-block-chunks", [G("full", 16)], 20, {"blocks_per_chunk": 2}),
]


@pytest.mark.parametrize(("name", "groups", "answer", "extra"), ANSWER_SCENARIOS,
                         ids=[s[0] for s in ANSWER_SCENARIOS])
def test_the_next_turn_is_served_the_answer(runners, name, groups, answer, extra) -> None:
    r = runners(groups, extra={"offload_prompt_only": False, **extra})
    first = r.add(token_prompt(100), answer)
    r.run_until_idle()
    written = len(first.all_token_ids) - 1
    assert written == 100 + answer - 1
    r.drop_gpu_prefix_cache()
    assert r.serve([*first.all_token_ids, *token_prompt(10, seed=5)], 1) == written
    assert r.load_errors == []


def test_the_answer_tail_is_stored_only_with_the_answer(runners) -> None:
    """``offload_prompt_only`` (vLLM's default): the next turn gets the prompt, its tail included."""
    r = runners([G("full", 16)])
    first = r.add(token_prompt(100), 8)
    r.run_until_idle()
    r.drop_gpu_prefix_cache()
    assert r.serve([*first.all_token_ids, *token_prompt(10, seed=5)], 1) == 100
    assert r.load_errors == []


def test_the_answer_tail_comes_back_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store, extra={"offload_prompt_only": False})
    req = first.add(token_prompt(100), 8)
    first.run_until_idle()
    turn = [*req.all_token_ids, *token_prompt(10, seed=5)]
    first.close()
    second = runners([G("full", 16)], store=store, extra={"offload_prompt_only": False})
    follow_up = second.add(turn, 1)
    second.run_until_idle()
    assert second.served[follow_up.request_id] == {"disk": 107}
    assert second.load_errors == []


# ---- prompt tails never change what the recomputed token attends (issue 22) -----------------------
# A hit of the whole prompt N makes vLLM allocate for N computed tokens, then rewind to N - 1: its
# sliding-window manager has by then nulled every block wholly below N - W + 1, so the recomputed
# token (which attends N - W .. N - 1) would read position N - W from the null block whenever
# N - W + 1 is a block boundary. The harness checks every attended position at every step.
WINDOW_TAIL_CASES = [
    # (block, window, prompt length)
    (16, 32, 111), (16, 32, 127), (16, 64, 127), (32, 48, 111),
    (16, 40, 103), (16, 40, 119), (16, 40, 135),
    (16, 32, 110), (16, 32, 112), (16, 32, 100),
]


@pytest.mark.parametrize(("block", "window", "n"), WINDOW_TAIL_CASES,
                         ids=[f"b{b}-w{w}-n{n}" for b, w, n in WINDOW_TAIL_CASES])
def test_window_prompt_tail_keeps_every_attended_block(runners, block: int, window: int, n: int) -> None:
    r = runners([G("full", block), G("sw", block, window=window)])
    served = store_then_serve(r, token_prompt(n))
    assert served == n - 1  # windowed layouts stop one token short of the prompt (R21)


@pytest.mark.parametrize("groups", [[G("full", 16)], [G("full", 16), G("sw", 16, window=32)]],
                         ids=["fa", "fa-sw"])
@pytest.mark.parametrize("n", [1, 2])
def test_one_and_two_token_prompts_repeated_run_and_serve_nothing_useless(runners, groups, n: int) -> None:
    """A stored 1-token prompt answered with a hit of 1 would rewind to 0 computed tokens and be
    looked up again forever. A tail that saves no computation is neither stored nor served; a
    2-token prompt's tail saves its first token (full attention: a hit of the whole prompt,
    rewound by vLLM; with a window: one token short)."""
    r = runners(groups)
    prompt = token_prompt(n)
    assert r.serve(prompt, 2) == 0
    r.drop_gpu_prefix_cache()
    served = r.serve(prompt, 2)
    assert r.load_errors == [], r.load_errors
    expected = 0 if n == 1 else (n if len(groups) == 1 else n - 1)
    assert served == expected
    assert r.connector.scheduler.hierarchy.stats()["host"]["used"] == (0 if n == 1 else len(groups))


def test_after_a_prompt_tail_load_the_tail_chunk_is_stored_once_decoding_completes_it(runners) -> None:
    """The tail chunk was loaded under its tail key; with ``offload_prompt_only`` false its full
    key is stored when the decode fills it, and a prompt ending there is served whole."""
    r = runners([G("full", 16)], extra={"offload_prompt_only": False})
    prompt = token_prompt(100)
    assert store_then_serve(r, prompt) == 100  # 6 chunks + the tail; max_tokens 1 fills nothing
    r.drop_gpu_prefix_cache()
    req = r.add(prompt, 20)  # the tail hit again, then 20 decoded tokens fill chunk 6 (to 112)
    r.run_until_idle()
    assert r.loaded_tokens[req.request_id] == 100
    r.drop_gpu_prefix_cache()
    assert r.serve(list(req.all_token_ids[:112]), 1) == 112
    assert r.load_errors == []
