"""A stored prompt tail serves a longer prompt that starts with it (docs/SEMANTICS.md R21a).

A multi-turn chat's next prompt is the previous prompt, its answer and a new turn. vLLM keys KV by
complete blocks, so the next prompt's block holding the previous prompt's end misses as a complete
chunk and every token of it is recomputed (up to a chunk minus one: 127 tokens on CPU's 128-token
blocks). kvstrata stored that partial chunk as the previous prompt's tail (``prompt_tail``), under
vLLM's ``hash_block_tokens`` of its ``t`` tokens chained to the prefix. A longer prompt whose
complete hit ends at that chunk's start ``S`` asks for the tails of its own first ``t`` tokens
past ``S``, longest first, and is served to ``S + t``: the positions of a tail depend only on its
prefix, which the longer prompt shares token for token (and extra key for extra key: the hash
covers them). The hit ends inside a block, short of the request's last token, so vLLM computes
from ``S + t`` on, writing the rest of that block before attention reads it. Sliding-window groups
need the window before ``S + t``: it lies inside the window the complete hit already required
plus the tail block (as for the prompt's own tail), and no rewind follows a hit short of ``N``.

The adapter hashes the candidate lengths once per request and asks the tiers which of them exist
without promoting or counting anything (a probe of each would start promotions and count misses
for keys that were never stored); ``tail_extension_hit`` then probes only those, every group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvstrata.presence import Presence
from kvstrata.semantics.geometry import Layout


def tail_extension_span(
    layout: Layout,
    *,
    hit_end: int,
    num_tokens: int,
    local_computed: int,
    max_new_tokens: int | None = None,
    max_load_tokens: int | None = None,
) -> tuple[int, range] | None:
    """``(S, lengths)``: the chunk start where a stored tail could extend a hit ending at
    ``hit_end`` (the complete hit's end, or where the chunks on their way end while it defers)
    and the tail lengths worth asking for, longest first; None when none could apply.

    ``S`` is the start of the chunk ``hit_end`` lies in. A tail of ``t`` tokens ends the hit at
    ``S + t``: at least two tokens (a one-token tail is never stored, ``prompt_tail_start``),
    inside the chunk, past the hit so far, short of the request's last token (a tail of the
    whole request is its own prompt tail, ``prompt_tail_hit``) and within the caps.
    """
    if not layout.serves_prompt_tails:
        return None
    tpc = layout.groups[0].tokens_per_chunk
    start = hit_end - hit_end % tpc
    limit = num_tokens - 1
    if max_new_tokens is not None:
        limit = min(limit, local_computed + max_new_tokens)
    if max_load_tokens is not None:
        limit = min(limit, local_computed + max_load_tokens)
    longest = min(start + tpc - 1, limit) - start
    shortest = max(2, max(hit_end, local_computed) - start + 1)
    if longest < shortest:
        return None
    return start, range(longest, shortest - 1, -1)


def tail_extension_hit(
    layout: Layout,
    *,
    complete_hit: int | None,
    local_computed: int,
    start: int,
    candidates: Sequence[tuple[int, Mapping[int, bytes]]],
    probe: Callable[[Sequence[bytes]], Sequence[Presence]],
    being_loaded: Callable[[bytes], bool] | None = None,
) -> tuple[int | None, Mapping[int, bytes] | None]:
    """``(hit, tail keys)`` for a complete hit ending in the chunk at ``start``.

    ``candidates``: ``(t, keys per group)`` of the tails some tier holds, longest first (lengths
    from ``tail_extension_span``). The first whose keys every group holds extends the hit to
    ``start + t``; a candidate with a key on its way defers (None, as a chunk would, R18), as
    does one being loaded for another request (R17.5); a candidate some group misses gives way
    to the next. None found: the complete hit and no keys. While the complete hit defers (None),
    the longest candidate is probed all the same, so that its promotion from disk runs alongside
    the chunks' rather than after them, and the answer stays None.
    """
    if complete_hit is None:
        if candidates:
            probe([candidates[0][1][g.index] for g in layout.groups])
        return None, None
    for length, keys_by_group in candidates:
        keys = [keys_by_group[g.index] for g in layout.groups]
        answers = probe(keys)
        if len(answers) != len(keys):
            raise ValueError(f"probe answered {len(answers)} keys for {len(keys)} asked")
        if any(a is Presence.MISS for a in answers):
            continue
        if any(a is not Presence.HIT for a in answers):
            return None, None
        if being_loaded is not None and any(being_loaded(k) for k in keys):
            return None, None
        return start + length - local_computed, keys_by_group
    return complete_hit, None
