"""What KV cache events say about each block, for comparing kvstrata's events with vLLM's."""

from __future__ import annotations

from typing import Any


def described_blocks(events: list[Any], group: int | None = None) -> dict[Any, tuple[Any, list[int], int]]:
    """Block hash -> (parent hash, token ids, block size) from ``BlockStored`` events that describe
    their blocks (vLLM's GPU events; kvstrata's with ``self_describing_kv_events``), optionally
    of one KV cache group. An event without its blocks' tokens fails the comparison loudly."""
    out = {}
    for e in events:
        if group is not None and e.group_idx != group:
            continue
        size = e.block_size
        assert size > 0 and len(e.token_ids) == size * len(e.block_hashes), e
        for i, h in enumerate(e.block_hashes):
            parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
            out[h] = (parent, list(e.token_ids[i * size:(i + 1) * size]), size)
    return out
