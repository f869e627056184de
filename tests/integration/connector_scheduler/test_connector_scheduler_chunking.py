"""``blocks_per_chunk: "auto"`` (the default) under vLLM 0.32.0's real Scheduler: chunks of at
least 64 tokens where every offloaded group is plain full attention (a GPU's 16-token blocks: 4
per chunk), one block where windows, Mamba states or drafters count in chunks; and what the
larger chunks serve (loaded pages byte-checked by the harness)."""

from __future__ import annotations

import pytest
from connector_scheduler_helpers import store_then_serve, token_prompt
from strata_harness import G

pytestmark = pytest.mark.integration

AUTO = {"blocks_per_chunk": "auto"}

# (groups, speculative decoding, blocks per chunk "auto" chooses)
CHOICES = [
    ("fa16", [G("full", 16)], False, 4),
    ("fa32", [G("full", 32)], False, 2),
    ("fa128-cpu-blocks", [G("full", 128)], False, 1),
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], False, 1),
    ("fa-mamba", [G("full", 16), G("mamba", 16)], False, 1),
    ("fa+eagle", [G("full", 16), G("full", 16, eagle=True)], True, 1),
]


@pytest.mark.parametrize(("name", "groups", "spec", "bpc"), CHOICES, ids=[c[0] for c in CHOICES])
def test_auto_chunks_by_layout(runners, name, groups, spec, bpc) -> None:
    r = runners(groups, spec_decode=spec, extra=AUTO)
    assert r.connector.scheduler.plan.blocks_per_chunk == bpc
    assert all(w.worker.plan.blocks_per_chunk == bpc for w in r.workers)


def test_auto_chunks_serve_whole_prompts_and_their_extensions(runners) -> None:
    """16-token blocks, 64-token chunks: a 200-token prompt is 3 chunks and an 8-token tail, all
    served; a longer prompt starting with 130 stored tokens gets 2 chunks and the 2-token tail
    (R21a)."""
    r = runners([G("full", 16)], extra=AUTO)
    assert store_then_serve(r, token_prompt(200)) == 200
    base = token_prompt(300, seed=2)
    assert store_then_serve(r, base[:130], again=base) == 130


def test_auto_chunks_share_a_prefix_to_the_last_whole_chunk(runners) -> None:
    """Two prompts that agree on 100 tokens: the second is served the one 64-token chunk they
    share (one block per chunk would serve 96), never a token past the common prefix."""
    r = runners([G("full", 16)], extra=AUTO)
    first = token_prompt(200)
    other = first[:100] + token_prompt(100, seed=3)
    assert store_then_serve(r, first, again=other) == 64
