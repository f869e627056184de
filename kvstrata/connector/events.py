"""kvstrata's tier changes as vLLM KV cache events (``--kv-events-config``).

KV-aware routers (vLLM's own router, llm-d, Dynamo) learn from these events which engine holds
which prefix. The host tier reports as medium ``CPU`` and the disk tier as ``STORAGE``, with the
payload vLLM's OffloadingConnector sends by default: the chunk's block hash (the hash vLLM's GPU
``BlockStored`` events carry for the same block), its KV cache group, no token ids. A chunk key
is vLLM's offload key (block hash + 4-byte group), so the hashes match vLLM's exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import OffloadKey, get_offload_block_hash, get_offload_group_idx

from kvstrata.tiers.hierarchy import TIER_DISK, TIER_HOST

MEDIUM_OF_TIER = {TIER_HOST: MEDIUM_CPU, TIER_DISK: MEDIUM_STORAGE}


def kv_cache_events(changes: Iterable[tuple[str, bool, list[bytes]]]) -> Iterator[KVCacheEvent]:
    """One event per (tier change, group), in order: ``BlockStored`` or ``BlockRemoved``."""
    for tier, removed, keys in changes:
        medium = MEDIUM_OF_TIER[tier]
        by_group: dict[int, list] = {}
        for key in keys:
            offload_key = OffloadKey(key)
            by_group.setdefault(get_offload_group_idx(offload_key), []).append(
                maybe_convert_block_hash(BlockHash(get_offload_block_hash(offload_key))))
        for group, hashes in by_group.items():
            if removed:
                yield BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)
            else:
                yield BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                  block_size=0, lora_id=None, medium=medium, lora_name=None,
                                  group_idx=group)
