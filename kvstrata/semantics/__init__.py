"""kvstrata's group-granular store/lookup semantics: pure Python, no torch, no vLLM.

The rules are those of vLLM 0.32.0's ``OffloadingConnectorScheduler`` (numbered R1-R42 in
docs/SEMANTICS.md §3), ported as small functions, with the defects of vLLM issue 52735 absent
and one deliberate difference (R26, below). The vLLM adapter (``connector/scheduler.py``) owns
per-request state, jobs and fences, and calls:

Geometry (``geometry``)
    ``GroupKind`` FULL | SLIDING | CHUNKED_LOCAL | MAMBA.
    ``GroupGeometry(index, kind, tokens_per_block, blocks_per_chunk, tokens_per_hash,
    sliding_window=None, extra_retained_tokens=0, attention_chunk_size=None, is_drafter=False,
    mamba_align=True)``, derived ``tokens_per_chunk``, ``hashes_per_chunk``, ``is_windowed``,
    ``is_align_mamba``, ``window_chunks`` (R3), ``load_window_chunks(num_tokens)`` (R20).
    ``Layout(groups, retention_interval=0)``, derived ``lookup_order`` (R3), ``windowed_groups``,
    ``alignment_tokens`` (R4), ``mamba_tokens_per_chunk`` (R5), ``supports_partial_tail`` (R7),
    ``group(index)``.
    ``resolve_drafter_flags(annotated, speculative=...)``: exactly the annotated groups (R6) —
    never vLLM's former all-groups fallback (52735 defect 1).

Keys (``keys``)
    ``chunk_keys(block_hashes, geom, start=0) -> list[bytes]``: hash ending each complete chunk +
    ``index.to_bytes(4, "big")`` (R12). ``boundary_key(block_hashes, boundary_tokens, geom)`` (R13).

Lookup (``lookup``)
    ``lookup_hit(layout, *, num_tokens, local_computed, keys, probe, max_new_tokens=None,
    max_load_tokens=None, being_loaded=None, align_final_to_mamba=True) -> int | None``:
    tokens loadable beyond ``local_computed`` (0 = nothing) or None = defer (R17-R21, R23, R24,
    R27). ``probe(keys) -> [Presence]`` is called once per full-attention group query and in small
    right-to-left batches for windowed groups. Drafter groups (FA, SW, chunked, Mamba alike) query one
    chunk more and drop it (R27; widening only SW groups was 52735 defect 2).
    **Difference from vLLM (R26, E7):** vLLM rounds the hit to the align-mode Mamba chunk only in
    its initial cap, so a finer group stopping short of a Mamba boundary yields a hit whose Mamba
    state lies beyond it. kvstrata re-runs the lookup with the cap rounded down to the Mamba chunk
    until the hit ends on a Mamba boundary (``align_final_to_mamba=False`` reproduces vLLM).
    ``probe_prefix`` (optional) answers full-attention runs and may stop at their first MISS
    (a tier then starts no disk promotion that the run could not use).
    ``worthwhile_hit(hit, *, num_tokens, local_computed)``: 0 for a hit that would save nothing
    (a whole-request hit not past ``local + 1``; a one-token prompt's would loop, R21).
    ``prefix_run`` (R18) and ``window_run`` (R19) are exposed for tests.
    ``partial_tail_hit(layout, *, complete_hit, num_prompt_tokens, local_computed, block_hashes,
    probe, max_new_tokens=None, max_load_tokens=None, keys=None, being_loaded=None) -> (hit |
    None, boundary | None)``: for ``supports_partial_tail`` layouts, extends a complete hit into
    the next block at hash granularity where every group holds the boundary key (R7, R30).
    **Difference from vLLM (``keys`` given; None reproduces vLLM):** the tail may lie in the block
    after the full-attention prefix even when the Mamba group has no state at a block boundary
    below it (a Mamba group needs only the state at the hit's end). Kernels that save the
    checkpoint inside the forward (vLLM's Mamba2 layers) hand off only the tail's state for a
    one-chunk prefill; vLLM's lookup serves such prompts nothing.

Loads and boundary stores (``transfers``)
    ``ChunkTransfer(group, chunk_index, key, block_ids, first_block_in_chunk)``.
    ``plan_load(layout, *, local_computed, hit_tokens, block_ids, keys, load_start_block=None,
    tail_keys=None) -> list[ChunkTransfer]`` (R22, R35; ``tail_keys``: the boundary keys of a
    partial-tail hit); ``chunks_covered(layout, tokens)`` (the adapter's ``next_stored_chunk``
    after a load). ``plan_boundary_stores(layout, offers, *, offloadable, block_hashes) ->
    list[ChunkTransfer]``: Mamba states only from the scheduler's exact hand-offs (§3.8 B, R25).
    ``plan_partial_tail_stores(layout, offers, *, block_ids, block_hashes, max_boundary) ->
    list[list[ChunkTransfer]]``: every group at a hand-off boundary inside a block (§3.8 C).

Prompt tails (``prompt_tail``; kvstrata only, vLLM 0.32.0 recomputes them)
    ``Layout.serves_prompt_tails``: full or sliding-window groups, one chunk size, no drafter.
    ``prompt_tail_start(layout, num_prompt_tokens)``: start of the prompt's partial last chunk
    (None for a one-token tail, which would save nothing). ``prompt_tail_end``: where a tail hit
    ends — the prompt's end, one token short with windowed groups (R21: vLLM allocates before
    it rewinds, and its window manager would null a block the recomputed token attends).
    ``prompt_tail_hit(layout, *, complete_hit, num_tokens, num_prompt_tokens, local_computed,
    tail_keys, probe, ...) -> int | None``: a complete hit reaching that chunk extends to that
    end when every group holds its tail key and the tail saves at least one token. ``prompt_tail_keys(layout, block_hashes,
    num_prompt_tokens, hash_tail)``: those keys (the adapter's ``hash_tail`` hashes the partial
    block with vLLM's ``hash_block_tokens``). ``plan_prompt_tail_store(layout, *, num_prompt_tokens,
    computed_before, computed_after, block_ids, tail_keys, max_offload_tokens=None)``: the tail
    chunk of every group, in the step that completes the prompt (``completes_prompt``);
    ``plan_prompt_tail_store_again(layout, *, num_prompt_tokens, num_computed_tokens, block_ids,
    tail_keys, max_offload_tokens=None)``: the same in a later step, while decoding is still
    inside the tail's chunk, when the host tier had no room for it. Loads reuse ``plan_load``'s
    ``tail_keys``.
    ``tail_extension_span(layout, *, hit_end, num_tokens, local_computed, ...) -> (S, lengths)
    | None`` and ``tail_extension_hit(layout, *, complete_hit, local_computed, start,
    candidates, probe, being_loaded=None) -> (hit | None, tail keys | None)``: a stored tail of
    ``t`` tokens serves a longer prompt that starts with it, to ``S + t`` (R21a; multi-turn
    follow-ups). ``plan_answer_tail_store(layout, *, num_prompt_tokens, offloadable, block_ids,
    tail_keys)``: at a finish with the answer offloaded, the chunk holding the end of its KV as
    a tail (what the next turn starts with).
Stores (``store``)
    ``offloadable_tokens(*, num_computed, num_scheduled, num_tokens, num_prompt_tokens, finished,
    aborted, offload_prompt_only, max_offload_tokens) -> int`` (§3.8 D1-D2).
    ``storable_chunks(geom, *, offloadable_tokens, num_prompt_tokens, finished, allocated_blocks,
    num_keys) -> int`` (R28; finish-time promotion of the drafter tail R29, 52735 defect 3).
    ``plan_store(layout, *, offloadable, num_prompt_tokens, finished, next_stored_chunk, block_ids,
    keys, prompt_offloadable=None, shared_prefix_boundary=None) -> (candidates, next_stored)``
    (§3.8 D3-D6, R31 reachability for retention None / 0 / > 0, drafter +1, final-segment horizons).
    ``plan_store_within(layout, room, *, offloadable, ...) -> (candidates, next_stored)``: when
    the whole offer found no room, what ``room`` candidates hold of it: the windowed groups'
    plan, then the full-attention groups' longest start (plans of an earlier step of the
    running request; kvstrata only, vLLM retries the whole offer).
    ``store_pending(layout, *, offloadable, finished, next_stored_chunk) -> bool``: False only
    where ``plan_store`` would offer nothing and advance nothing (the adapter's per-step skip).
    ``sliding_reachable_mask``, ``mamba_reachable_mask`` (R31 ports). ``keep_served_tails`` (default True; False = vLLM) also keeps the window tails where drafter-popped and Mamba-rounded replays end (``served_boundaries``): vLLM 0.32.0 serves those replays nothing.

Other deliberate differences: a full-attention group's query range is probed in one batch, so
keys past its first MISS are probed too (vLLM stops there); a store candidate whose chunk has a
null block after a real one (a stale, re-allocated sliding-window block) is refused, where vLLM
would copy the remaining blocks to the wrong offsets.

Known gaps kept for parity with vLLM 0.32.0 (pinned by xfail tests in tests/unit/test_semantics_properties.py;
all need a sparse ``retention_interval`` — vLLM's default 0 — and a sliding-window group):
a full-attention drafter's pop puts every hit one drafter chunk below the replay boundary, where
the window tail was not kept (served 0); a window with ``W - 1 + extra`` a multiple of the chunk is
looked up with one chunk more than is stored; a Mamba hybrid's hit is rounded below the
attention-aligned replay boundary, where no window tail was kept.

Partial tails (R7, R30, §3.8 C) follow vLLM 0.32.0, with three differences: the tail past a
missing Mamba block state (above); a tail every group holds but some still promote from disk is
waited for (vLLM serves the complete hit alone); a request's ``max_offload_tokens`` of 0 stores
no partial tail (vLLM reads 0 as "no cap" there).
"""

from kvstrata.semantics.geometry import (
    GroupGeometry,
    GroupKind,
    Layout,
    cdiv,
    resolve_drafter_flags,
    round_down,
)
from kvstrata.semantics.keys import boundary_key, chunk_keys, make_key
from kvstrata.semantics.lookup import (
    Probe,
    initial_cap,
    lookup_hit,
    partial_tail_hit,
    prefix_run,
    window_run,
    worthwhile_hit,
)
from kvstrata.semantics.prompt_tail import (
    completes_prompt,
    plan_answer_tail_store,
    plan_prompt_tail_store,
    plan_prompt_tail_store_again,
    prompt_tail_end,
    prompt_tail_hit,
    prompt_tail_keys,
    prompt_tail_start,
)
from kvstrata.semantics.store import (
    mamba_reachable_mask,
    offloadable_tokens,
    plan_store,
    plan_store_within,
    sliding_reachable_mask,
    storable_chunks,
    store_pending,
)
from kvstrata.semantics.tail_extension import tail_extension_hit, tail_extension_span
from kvstrata.semantics.transfers import (
    ChunkTransfer,
    chunks_covered,
    first_fresh_block,
    plan_boundary_stores,
    plan_load,
    plan_partial_tail_stores,
)

__all__ = [
    "ChunkTransfer",
    "GroupGeometry",
    "GroupKind",
    "Layout",
    "Probe",
    "boundary_key",
    "cdiv",
    "chunk_keys",
    "chunks_covered",
    "completes_prompt",
    "first_fresh_block",
    "initial_cap",
    "lookup_hit",
    "make_key",
    "mamba_reachable_mask",
    "offloadable_tokens",
    "partial_tail_hit",
    "plan_answer_tail_store",
    "plan_boundary_stores",
    "plan_load",
    "plan_partial_tail_stores",
    "plan_prompt_tail_store",
    "plan_prompt_tail_store_again",
    "plan_store",
    "plan_store_within",
    "prefix_run",
    "prompt_tail_end",
    "prompt_tail_hit",
    "prompt_tail_keys",
    "prompt_tail_start",
    "resolve_drafter_flags",
    "round_down",
    "sliding_reachable_mask",
    "storable_chunks",
    "store_pending",
    "tail_extension_hit",
    "tail_extension_span",
    "window_run",
    "worthwhile_hit",
]
