"""What a stored prompt serves under vLLM 0.32.0's real Scheduler (docs/SEMANTICS.md §5), on CPU:
layouts with windows, Mamba groups and drafters, prefixes, restarts, another model's layout, kept
window tails, and vLLM issue 52735's regressions.

Every scenario stores through a real request, finishes it, drops vLLM's GPU prefix cache, and checks
the next request is served the number of tokens the rules give (worked out in each test) — with the
loaded pages checked byte-for-byte by the harness. R<n> are the rules of docs/SEMANTICS.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from connector_scheduler_helpers import (
    store_then_serve,
    token_prompt,
)
from strata_harness import G, Runner

pytestmark = pytest.mark.integration


# (groups, spec_decode, prompt length, expected served tokens). Block sizes 16, one block per chunk.
#  - FA only, 100 tokens: 6 complete chunks and the prompt's tail (4 tokens) -> 100 (FA-only hits
#    may reach the whole prompt; vLLM recomputes its last token).
#  - FA + SW(32): 6 complete chunks (the SW window, 2 chunks, ends at 96) and the prompt's tail
#    in both groups, one token short as every windowed hit (R21) -> 99 (vLLM alone rounds the
#    99-token cap down to its last complete chunk: 96).
#  - FA + Mamba align: cap 99, rounded down to the Mamba chunk (16) -> 96; state@96 handed off.
#  - annotated eagle FA group: widening cannot pass the 6th key -> 6 hits, pop one -> 80.
#  - spec decode on, no group annotated: behaves as without speculation (52735 defect 1) — except
#    that under EAGLE block dropping vLLM's scheduler hands off the Mamba state one block earlier
#    (state@80, not @96), so a Mamba hybrid serves 80.
SCENARIOS = [
    ("fa", [G("full", 16)], False, 100, 100),
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], False, 100, 99),
    ("fa-mamba", [G("full", 16), G("mamba", 16)], False, 100, 96),
    ("fa+eagle", [G("full", 16), G("full", 16, eagle=True)], True, 100, 80),
    ("fa-sw+eagle-sw", [G("full", 16), G("sw", 16, window=32, eagle=True)], True, 100, 80),
    ("fa-mamba+eagle", [G("full", 16, eagle=True), G("mamba", 16)], True, 100, 80),
    ("fa-spec-unannotated", [G("full", 16)], True, 100, 100),
    ("fa-sw-spec-unannotated", [G("full", 16), G("sw", 16, window=32)], True, 100, 99),
    ("fa-mamba-spec-unannotated", [G("full", 16), G("mamba", 16)], True, 100, 80),
]


@pytest.mark.parametrize(("name", "groups", "spec", "n", "expected"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_store_finish_drop_serve(runners, name, groups, spec, n, expected) -> None:
    r = runners(groups, spec_decode=spec)
    assert store_then_serve(r, token_prompt(n)) == expected


def test_prefix_of_a_longer_prompt_is_served(runners) -> None:
    """8 complete chunks and the 2-token tail the shorter prompt stored (R21a)."""
    r = runners([G("full", 16)])
    base = token_prompt(200)
    assert store_then_serve(r, base[:130], again=base) == 130


def test_served_chunks_come_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners([G("full", 16), G("sw", 16, window=32)], store=store)
    first.serve(token_prompt(100), 1)
    first.close()  # clean shutdown drains write-behind
    second = runners([G("full", 16), G("sw", 16, window=32)], store=store)
    assert second.serve(token_prompt(100), 1) == 99  # the prompt tail too, in both groups (R21 cap)
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] > 0


def test_other_model_layout_gets_zero_hits(runners, tmp_path: Path) -> None:
    store = tmp_path / "shared"
    a = runners([G("full", 16)], store=store)
    a.serve(token_prompt(100), 1)
    a.close()
    # Same tokens, same block hashes, but the KV has another layout (more layers): never served.
    b = runners([G("full", 16, layers=3)], store=store)
    assert b.serve(token_prompt(100), 1) == 0


# ---------------------------------------------------------------- vLLM issue 52735 regressions
def _decode_then_extend(r: Runner, prompt_len: int, decode: int, lookup_len: int) -> int:
    """Run a request that decodes (so the scheduler hands off Mamba states past the prompt), drop
    the GPU cache, then serve a request whose prompt is the first ``lookup_len`` tokens of it."""
    prompt = token_prompt(prompt_len)
    req = r.add(prompt, max_tokens=decode)
    r.run_until_idle()
    seq = prompt + list(req.output_token_ids)
    r.drop_gpu_prefix_cache()
    served = r.serve(seq[:lookup_len], 1)
    assert r.load_errors == []
    return served


def test_52735_no_all_groups_fallback(runners) -> None:
    """Spec decode on, nothing annotated. Lookup prompt 160 tokens: cap 159 -> 128 (Mamba chunk 64).
    FA hits 8 chunks, the Mamba state @128 serves: 128. Treating every group as a drafter (vLLM's
    former fallback) pops the FA chunk and makes the Mamba group need two consecutive states and pop
    one: 64."""
    r = runners([G("full", 16), G("mamba", 64)], spec_decode=True, extra={"offload_prompt_only": False})
    assert _decode_then_extend(r, 150, 20, 160) == 128


def test_52735_full_attention_drafter_is_widened(runners) -> None:
    """FA16 drafter + Mamba64, lookup prompt 160: cap 128. Widened, the drafter queries 144 tokens
    (9 chunks), pops to 128 and the Mamba state @128 serves: 128. Without widening for
    full-attention drafters it pops to 112, below the Mamba boundary, and only the state @64 can
    serve: 64 (0 in vLLM issue 52735's configuration, where no earlier state existed)."""
    r = runners([G("full", 16, eagle=True), G("mamba", 64)], spec_decode=True, extra={"offload_prompt_only": False})
    assert _decode_then_extend(r, 150, 20, 160) == 128


def test_52735_drafter_tail_is_stored_at_finish(runners) -> None:
    """A decoding drafter group holds back its last chunk; at finish it must be stored.

    Prompt 40 + 30 decoded tokens: the sequence has 70 tokens, the KV of 69 exists at finish ->
    4 complete chunks in both groups, the drafter's 4th only thanks to finish-time promotion.
    The next request extends those 70 tokens to 90 (5 keys): FA hits 4 chunks; the drafter group,
    widened to 5, hits 4 and pops one -> 3 chunks = 48 tokens. Without the promotion the drafter
    holds 3 chunks, pops to 2 -> 32.
    """
    r = runners([G("full", 16), G("full", 16, eagle=True)], spec_decode=True, extra={"offload_prompt_only": False})
    prompt = token_prompt(40)
    req = r.add(prompt, max_tokens=30)
    r.run_until_idle()
    seq = prompt + list(req.output_token_ids)
    assert len(seq) == 70
    r.drop_gpu_prefix_cache()
    assert r.serve(seq + token_prompt(20, seed=9), 1) == 48
    assert r.load_errors == []


# ---- kept window tails (semantics.plan_store keep_served_tails) under vLLM's default retention 0 --
# vLLM keeps a sliding window's tail only where a replay's search starts (the replay boundary);
# a drafter's pop or a Mamba rounding ends the hit lower, where kvstrata keeps the tail too.
# The harness checks every position the first computed token attends.
KEPT_TAIL_CASES = [
    ("sw-eagle", [G("full", 16), G("sw", 16, window=32, eagle=True)], True, 100, 80),
    ("sw-mamba", [G("full", 16), G("sw", 16, window=32), G("mamba", 64)], False, 100, 64),
    ("sw-mamba-eagle", [G("full", 16, eagle=True), G("sw", 16, window=32), G("mamba", 32)], True, 140, 96),
]


@pytest.mark.parametrize(("name", "groups", "spec", "n", "expected"), KEPT_TAIL_CASES,
                         ids=[c[0] for c in KEPT_TAIL_CASES])
def test_kept_window_tails_serve_the_replay_with_every_attended_block(
        runners, name, groups, spec, n: int, expected: int) -> None:
    r = runners(groups, spec_decode=spec, retention=0)
    assert store_then_serve(r, token_prompt(n)) == expected
