"""Drive vLLM 0.32.0's own ``OffloadingConnectorScheduler`` from a kvstrata ``Layout``.

Scheduler-logic only (docs/SEMANTICS.md §5.1, pure scheduler-logic tests): a ``SimpleNamespace`` offloading
spec, a real ``CPUOffloadingManager`` and ``MagicMock`` requests; no engine, no worker. Imports vLLM
(and torch): import it only from tests that skip without vLLM.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.request import RequestStatus

from kvstrata.semantics import GroupGeometry, GroupKind, Layout

_SEED_CONTEXT = ReqContext(req_id="seed")


def vllm_kv_spec(geom: GroupGeometry) -> KVCacheSpec:
    common: dict[str, Any] = dict(
        block_size=geom.tokens_per_block, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    if geom.kind is GroupKind.SLIDING:
        return SlidingWindowSpec(
            **common,
            sliding_window=geom.sliding_window,
            extra_retained_tokens=geom.extra_retained_tokens,
        )
    if geom.kind is GroupKind.CHUNKED_LOCAL:
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=geom.attention_chunk_size)
    if geom.kind is GroupKind.MAMBA:
        return MambaSpec(
            block_size=geom.tokens_per_block,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align" if geom.mamba_align else "none",
        )
    return FullAttentionSpec(**common)


class ScriptedManager(CPUOffloadingManager):
    """A real ``CPUOffloadingManager`` whose ``lookup`` can answer RETRY for chosen keys, and which
    records the keys of its last ``prepare_load``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retry_keys: set[bytes] = set()
        self.last_load_keys: list[bytes] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self.retry_keys:
            return LookupResult.RETRY
        return super().lookup(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        self.last_load_keys = list(keys)
        return super().prepare_load(keys, req_context)

    def seed(self, ready: Iterable[bytes], pending: Iterable[bytes] = ()) -> None:
        """Store ``ready`` keys (HIT) and start stores of ``pending`` keys (HIT_PENDING)."""
        ready = list(dict.fromkeys(ready))
        if ready:
            out = self.prepare_store(ready, _SEED_CONTEXT)
            assert out is not None
            self.complete_store(out.keys_to_store, _SEED_CONTEXT)
        pending = [k for k in dict.fromkeys(pending) if k not in set(ready)]
        if pending:
            assert self.prepare_store(pending, _SEED_CONTEXT) is not None


class StoreScript:
    """A manager for store differentials: records offers and answers as scripted.

    ``answers`` is consumed one per ``prepare_store``: "all" (store every offered key), "none"
    (allocation failure -> None), "empty" (everything already stored), or a set of keys to accept.
    """

    def __init__(self) -> None:
        self.offers: list[list[bytes]] = []
        self.answers: list[Any] = []

    def prepare_store(self, keys: Sequence[bytes], req_context: ReqContext) -> Any:
        keys = list(keys)
        self.offers.append(keys)
        answer = self.answers.pop(0) if self.answers else "all"
        if answer == "none":
            return None
        accepted = [] if answer == "empty" else [k for k in keys if answer == "all" or k in answer]
        return PrepareStoreOutput(keys_to_store=accepted, store_spec=None, evicted_keys=[])

    def __getattr__(self, name: str) -> Any:
        # Everything else a scheduler may call on its manager: inert.
        return MagicMock(name=name)


def build_scheduler(
    layout: Layout,
    manager: Any,
    *,
    num_kv_groups: int | None = None,
    speculative: bool = False,
    offload_prompt_only: bool = False,
    prefix_caching: bool = True,
) -> OffloadingConnectorScheduler:
    """vLLM's scheduler for ``layout``; group indices without a geometry become non-offloaded
    full-attention groups (so group index != position among offloaded groups is exercised)."""
    by_index = {g.index: g for g in layout.groups}
    count = num_kv_groups or max(by_index) + 1
    kv_groups = []
    for i in range(count):
        geom = by_index.get(i)
        spec = (
            vllm_kv_spec(geom)
            if geom is not None
            else FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
        )
        kv_groups.append(
            KVCacheGroupSpec(
                [f"layer{i}"], spec, is_eagle_group=bool(geom is not None and geom.is_drafter)
            )
        )
    spec = SimpleNamespace(
        config=SimpleNamespace(
            groups=tuple(
                SimpleNamespace(group_id=g.index, tokens_per_block=g.tokens_per_block)
                for g in layout.groups
            )
        ),
        tokens_per_block=tuple(g.tokens_per_block for g in layout.groups),
        tokens_per_hash=layout.tokens_per_hash,
        blocks_per_chunk=layout.blocks_per_chunk,
        offload_prompt_only=offload_prompt_only,
        kv_events_config=OffloadingKVEventsConfig(
            enable_kv_cache_events=False, self_describing_kv_events=False
        ),
        get_manager=lambda: manager,
    )
    speculative_config = SimpleNamespace(use_eagle_block_drop=lambda: True) if speculative else None
    vllm_config = SimpleNamespace(
        speculative_config=speculative_config,
        cache_config=SimpleNamespace(
            enable_prefix_caching=prefix_caching,
            prefix_cache_retention_interval=layout.retention_interval,
        ),
        parallel_config=SimpleNamespace(world_size=1, decode_context_parallel_size=1),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=1 << 16, kv_cache_tensors=[], kv_cache_groups=kv_groups
    )
    return OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)


def make_request(
    request_id: str,
    *,
    num_tokens: int,
    num_prompt_tokens: int,
    block_hashes: list[bytes],
    kv_transfer_params: dict[str, Any] | None = None,
) -> MagicMock:
    request = MagicMock()
    request.request_id = request_id
    request.num_tokens = num_tokens
    request.num_prompt_tokens = num_prompt_tokens
    request.num_computed_tokens = 0
    request.block_hashes = block_hashes
    request.kv_transfer_params = kv_transfer_params
    request.kv_hints = None
    request.skip_reading_prefix_cache = False
    request.shared_prefix_boundary = None
    request.status = RequestStatus.RUNNING
    request.is_finished.return_value = False
    return request


def fake_block(block_id: int, *, hashed: bool) -> SimpleNamespace:
    return SimpleNamespace(
        block_id=block_id, is_null=block_id == 0, block_hash=b"h" if hashed else None
    )
