"""The prompt's last partial chunk: stored when the prompt is computed, served to the same prompt.

vLLM keys KV by complete blocks, so a prompt that does not end on a chunk boundary leaves up to a
chunk minus one token that every load recomputes (8176 tokens on 128-token CPU blocks: 112 tokens,
most of the first token's time). For layouts that ``serve_prompt_tails`` (full and sliding-window
attention, no drafter), kvstrata also stores the chunk holding the prompt's end under a *tail
key*: vLLM's block hash of the partial block's tokens chained to the prefix
(``hash_block_tokens``, computed by the adapter), so it names exactly this prompt. A later
request with the same prompt loads every chunk plus the tail and recomputes only the last token
(docs/SEMANTICS.md R21). A longer prompt that starts with it finds it through its own first tokens
past the chunk start (``tail_extension``, R21a).

The tail page is the whole chunk's pages; positions past the prompt's end hold whatever the
blocks held, and a load never claims them (the hit ends at the prompt's end, and the forward
writes those slots before attention reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvstrata.presence import Presence
from kvstrata.semantics.geometry import Layout, cdiv
from kvstrata.semantics.keys import make_key
from kvstrata.semantics.transfers import ChunkTransfer


def prompt_tail_start(layout: Layout, num_prompt_tokens: int) -> int | None:
    """Where the prompt's partial last chunk starts, or None: no tail, a tail not served for
    this layout, or a one-token tail (vLLM recomputes the prompt's last token after any hit, so
    serving it would save nothing, and a one-token prompt would be rewound to nothing and
    looked up again forever)."""
    if not layout.serves_prompt_tails:
        return None
    tpc = layout.groups[0].tokens_per_chunk
    start = num_prompt_tokens - num_prompt_tokens % tpc
    return None if num_prompt_tokens - start < 2 else start


def prompt_tail_end(layout: Layout, num_prompt_tokens: int) -> int:
    """Where a prompt-tail hit ends (absolute), the same cap as complete chunks (R17.2, R21).

    Full attention only: the whole prompt; vLLM rewinds to its last token and recomputes it.
    With a sliding-window group: one token short. vLLM allocates blocks for the hit *before*
    the rewind, and its window manager then nulls every block wholly below ``end - W + 1``; a
    hit of the whole prompt would leave position ``N - W``, which the recomputed last token
    attends, in a null block whenever ``N - W + 1`` falls on a block boundary.
    """
    return num_prompt_tokens - 1 if layout.windowed_groups else num_prompt_tokens


def prompt_tail_keys(
    layout: Layout,
    block_hashes: Sequence[bytes],
    num_prompt_tokens: int,
    hash_tail: Callable[[bytes | None, int], bytes],
) -> dict[int, bytes] | None:
    """Per group, the key of the prompt's partial last chunk (the connector and the warm-up
    tool name it the same way); None when the prompt has no tail served here, or while
    ``block_hashes`` do not reach the tail's start yet.

    ``hash_tail(parent, start)`` is vLLM's ``hash_block_tokens`` over the prompt's tokens from
    ``start`` to its end, chained to ``parent`` (the hash ending at ``start``, None at 0), with the
    extra keys (LoRA, multimodal, salt) a full block there would get.
    """
    start = prompt_tail_start(layout, num_prompt_tokens)
    if start is None or len(block_hashes) < start // layout.tokens_per_hash:
        return None
    parent = block_hashes[start // layout.tokens_per_hash - 1] if start else None
    digest = bytes(hash_tail(parent, start))
    return {g.index: make_key(digest, g.index) for g in layout.groups}


def prompt_tail_hit(
    layout: Layout,
    *,
    complete_hit: int | None,
    num_tokens: int,
    num_prompt_tokens: int,
    local_computed: int,
    tail_keys: Mapping[int, bytes] | None,
    probe: Callable[[Sequence[bytes]], Sequence[Presence]],
    max_new_tokens: int | None = None,
    max_load_tokens: int | None = None,
    being_loaded: Callable[[bytes], bool] | None = None,
) -> int | None:
    """Extend a complete-chunk hit that reaches the prompt's last chunk boundary to
    ``prompt_tail_end`` (the prompt's end, one token short with windowed groups), when every
    group holds its tail key. None = ask again later.

    The tail keys are probed whenever a tail could apply, also while the complete hit defers:
    their disk promotion then runs alongside the chunks' instead of after them. A tail still
    promoting defers the hit (like a chunk, R18); a missing one leaves the complete hit. Only a
    request that is still its prompt (``num_tokens == num_prompt_tokens``), whose caps allow the
    tail's end, and for which the tail saves computing at least one token (vLLM recomputes the
    prompt's last token after any hit, and the local hit may already reach into the tail's
    block at a finer hash) is extended.
    """
    start = prompt_tail_start(layout, num_prompt_tokens)
    end = prompt_tail_end(layout, num_prompt_tokens)
    if (
        tail_keys is None
        or start is None
        or num_tokens != num_prompt_tokens
        or num_prompt_tokens - 1 <= max(start, local_computed)
        or (max_new_tokens is not None and local_computed + max_new_tokens < end)
        or (max_load_tokens is not None and max_load_tokens < end - local_computed)
    ):
        return complete_hit
    if complete_hit is not None and local_computed + complete_hit < start:
        return complete_hit  # the chunks stop short of the tail: do not start its promotion
    keys = [tail_keys[g.index] for g in layout.groups]
    answers = probe(keys)
    if len(answers) != len(keys):
        raise ValueError(f"probe answered {len(answers)} keys for {len(keys)} asked")
    if complete_hit is None:
        return None
    if any(a is Presence.MISS for a in answers):
        return complete_hit
    if any(a is not Presence.HIT for a in answers):
        return None  # PENDING or RETRY: it is on its way
    if being_loaded is not None and any(being_loaded(k) for k in keys):
        return None  # R17.5: the GPU prefix cache will have it after that load
    return end - local_computed


def completes_prompt(*, num_prompt_tokens: int, computed_before: int, computed_after: int) -> bool:
    """Whether a step taking a request from ``computed_before`` to ``computed_after`` computed
    tokens completes its prompt: the one step whose forward writes the prompt's tail."""
    return computed_before < num_prompt_tokens <= computed_after


def plan_prompt_tail_store(
    layout: Layout,
    *,
    num_prompt_tokens: int,
    computed_before: int,
    computed_after: int,
    block_ids: Mapping[int, Sequence[int]],
    tail_keys: Mapping[int, bytes] | None,
    max_offload_tokens: int | None = None,
) -> list[ChunkTransfer]:
    """The tail chunk of every group, in the step whose forward completes the prompt.

    ``computed_before``/``computed_after``: the request's computed tokens before and after this
    step. Nothing when the prompt is not completed by this step, when a request cap forbids
    offloading the whole prompt, or when a tail block is not allocated (the null block).
    """
    tail = _storable_tail(layout, num_prompt_tokens, tail_keys, max_offload_tokens)
    if tail is None or not completes_prompt(num_prompt_tokens=num_prompt_tokens, computed_before=computed_before,
                                            computed_after=computed_after):
        return []
    start, keys = tail
    return _tail_transfers(layout, start, num_prompt_tokens, block_ids, keys)


def plan_prompt_tail_store_again(
    layout: Layout,
    *,
    num_prompt_tokens: int,
    num_computed_tokens: int,
    block_ids: Mapping[int, Sequence[int]],
    tail_keys: Mapping[int, bytes] | None,
    max_offload_tokens: int | None = None,
) -> list[ChunkTransfer]:
    """The tail chunk of every group again, in a later step of a request whose prompt-completing
    step could not store it (the host tier had no room): decoding writes only positions past the
    prompt, so the tail's own positions still hold what the prompt's forward wrote, and a hit
    never serves the positions past them (the request it is loaded into computes those first).

    ``num_computed_tokens``: the request's computed tokens before this step. Nothing once
    decoding has left the tail's chunk (a windowed group may have freed its blocks since; this
    is the bound that keeps them the request's latest ones), nor when a block is no longer
    allocated (the adapter nulls a windowed block given to another request).
    """
    tail = _storable_tail(layout, num_prompt_tokens, tail_keys, max_offload_tokens)
    if tail is None or not num_prompt_tokens <= num_computed_tokens < tail[0] + layout.groups[0].tokens_per_chunk:
        return []
    start, keys = tail
    return _tail_transfers(layout, start, num_prompt_tokens, block_ids, keys)


def _storable_tail(layout: Layout, num_prompt_tokens: int, tail_keys: Mapping[int, bytes] | None,
                   max_offload_tokens: int | None) -> tuple[int, Mapping[int, bytes]] | None:
    """Where the prompt's tail chunk starts, and its keys, if the prompt has a tail and no
    request cap forbids offloading the whole prompt; else None."""
    start = prompt_tail_start(layout, num_prompt_tokens)
    if tail_keys is None or start is None or (max_offload_tokens is not None and max_offload_tokens < num_prompt_tokens):
        return None
    return start, tail_keys


def plan_answer_tail_store(
    layout: Layout,
    *,
    num_prompt_tokens: int,
    offloadable: int,
    block_ids: Mapping[int, Sequence[int]],
    tail_keys: Mapping[int, bytes] | None,
) -> list[ChunkTransfer]:
    """When a request finished with its answer offloaded (``offload_prompt_only`` false): the
    chunk holding the end of the KV it wrote, every group, as a tail of those tokens.

    ``offloadable``: ``offloadable_tokens`` of the finished request (the final sampled token's
    slot is never written). Its complete chunks are stored as they fill; the partial one past
    them would otherwise be lost, and a multi-turn follow-up (the prompt, this answer, a new
    turn) starts with exactly these tokens (R21a serves it). Nothing when the answer adds no KV
    past the prompt (the prompt's own tail covers it), for a one-token tail, or when a block is
    not allocated. ``tail_keys``: per group, the tail key of tokens ``prompt_tail_start(layout,
    offloadable)`` to ``offloadable``.
    """
    start = prompt_tail_start(layout, offloadable)
    if tail_keys is None or start is None or offloadable <= num_prompt_tokens:
        return []
    return _tail_transfers(layout, start, offloadable, block_ids, tail_keys)


def _tail_transfers(layout: Layout, start: int, end: int, block_ids: Mapping[int, Sequence[int]],
                    tail_keys: Mapping[int, bytes]) -> list[ChunkTransfer]:
    """Every group's blocks of the partial chunk ``start..end`` under its tail key; nothing when
    one of them is not allocated (the null block)."""
    out: list[ChunkTransfer] = []
    for geom in layout.groups:
        first = start // geom.tokens_per_block
        ids = tuple(block_ids[geom.index][first : cdiv(end, geom.tokens_per_block)])
        if len(ids) != cdiv(end, geom.tokens_per_block) - first or 0 in ids:
            return []
        out.append(ChunkTransfer(geom.index, start // geom.tokens_per_chunk, tail_keys[geom.index], ids, 0))
    return out
