"""kvstrata's tier changes as vLLM KV cache events (``--kv-events-config``).

KV-aware routers (vLLM's own router, llm-d, Dynamo) learn from these events which engine holds
which prefix. The host tier reports as medium ``CPU`` and the disk tier as ``STORAGE``. A chunk
key is vLLM's offload key (block hash + 4-byte group), so the hashes match vLLM's exactly.

Two payloads, as vLLM's OffloadingConnector sends them:

- by default a placeholder: the chunk's key hash (the hash vLLM's GPU ``BlockStored`` events
  carry for the chunk's last block), its KV cache group, no token ids; one event per tier change
  and group;
- with ``self_describing_kv_events`` (full-attention groups): each chunk's own ``BlockStored``
  with every block hash it holds, its parent hash, its token ids, block size and LoRA, and
  removals fanned out to the same hashes, so a router that hashes tokens its own way can index
  the offloaded tiers. vLLM's ``OffloadingEventsTracker`` builds them, from a snapshot of the
  request taken when the chunk is planned for a store or found by a lookup; a chunk never seen
  with its request in this process (stored before a restart and not asked for since) keeps the
  placeholder. Snapshots live while the chunk is in a tier: about the chunk's token ids each.

At start the scheduler side announces every chunk already on disk (``Hierarchy.announce_disk``):
after a restart the router learns what this engine can serve from its disk.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    get_offloading_event_group_spec,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.kv_offload.base import (
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.request import Request

from kvstrata.semantics import GroupGeometry, GroupKind
from kvstrata.tiers.hierarchy import TIER_DISK, TIER_HOST

MEDIUM_OF_TIER = {TIER_HOST: MEDIUM_CPU, TIER_DISK: MEDIUM_STORAGE}
_OFFLOAD_MEDIUM = {TIER_HOST: Medium.CPU, TIER_DISK: Medium.STORAGE}


class _TrackedGroup(NamedTuple):
    """The fields of vLLM's ``GroupOffloadConfig`` that ``OffloadingEventsTracker`` reads."""

    group_idx: int
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    kv_event_group_spec: OffloadingEventGroupSpec
    # None = full attention: the only groups with self-describing payloads
    sliding_window_size_in_chunks: int | None


def kv_cache_events(changes: Iterable[tuple[str, bool, list[bytes]]]) -> Iterator[KVCacheEvent]:
    """Placeholder payloads: one event per (tier change, group), in order."""
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


class KVEvents:
    """Translates the hierarchy's tier changes into vLLM KV cache events for one scheduler."""

    def __init__(self, groups: Sequence[GroupGeometry], kv_cache_groups: Sequence[KVCacheGroupSpec],
                 *, self_describing: bool):
        self.self_describing = self_describing
        self._tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(
            enable_kv_cache_events=True, self_describing_kv_events=self_describing))
        self._groups = {
            g.index: _TrackedGroup(
                group_idx=g.index,
                tokens_per_block=g.tokens_per_block,
                tokens_per_chunk=g.tokens_per_chunk,
                hashes_per_chunk=g.hashes_per_chunk,
                kv_event_group_spec=get_offloading_event_group_spec(kv_cache_groups[g.index]),
                sliding_window_size_in_chunks=None if g.kind is GroupKind.FULL else g.window_chunks,
            )
            for g in groups
        }

    def record_store(self, req: Request, group: int, chunk_index: int, key: bytes) -> None:
        """Chunk ``chunk_index`` of ``req`` in ``group`` is about to be stored under ``key``."""
        if self.self_describing:
            self._tracker.record_store(req, self._groups[group], chunk_index, OffloadKey(key))  # type: ignore[arg-type]

    def record_lookup(self, req: Request, group: int, chunk_index: int, key: bytes) -> None:
        """A lookup of ``req`` found chunk ``chunk_index`` in a tier: its events (a promotion
        from disk, later removals) can describe it, even if it was stored before a restart."""
        if self.self_describing:
            self._tracker.record_lookup(req, self._groups[group], chunk_index, OffloadKey(key))  # type: ignore[arg-type]

    def translate(self, changes: list[tuple[str, bool, list[bytes]]]) -> list[KVCacheEvent]:
        # Only this engine's own tiers: the shared tier's contents are every engine's, and a
        # router learns of a shared chunk from the engine that promotes it (a host store event).
        changes = [c for c in changes if c[0] in MEDIUM_OF_TIER]
        if not self.self_describing:
            return list(kv_cache_events(changes))
        # Both tiers report their removals, so every stored residency expects one.
        raw = [OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=_OFFLOAD_MEDIUM[tier],
                               removed=removed, removal_expected=not removed)
               for tier, removed, keys in changes]
        return list(self._tracker.take_events(raw))
