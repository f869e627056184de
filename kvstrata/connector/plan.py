"""From vLLM's configuration to kvstrata's geometry: groups, pages, slots, namespaces.

Both connector roles build the same ``KVPlan`` from the same configuration, so the scheduler (which
allocates host slots and names store keys) and every worker (which copies pages into those slots)
agree on byte offsets without talking to each other.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.config import ParallelConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvstrata.config import AUTO_CHUNK_TOKENS, StrataConfig
from kvstrata.config_values import ConfigError
from kvstrata.connector import keys as keymod
from kvstrata.semantics import GroupGeometry, GroupKind, Layout

if TYPE_CHECKING:
    from kvstrata.tiers.host import HostSlab


@dataclass(frozen=True)
class GroupPages:
    """Byte geometry of one offloaded group on one rank."""

    index: int
    layer_names: tuple[str, ...]
    page_bytes: int  # meaningful bytes of one block of one layer (padding excluded)
    dtype: str  # what the codec sees: the page's element type

    def shard_bytes(self, blocks_per_chunk: int) -> int:
        return len(self.layer_names) * blocks_per_chunk * self.page_bytes


@dataclass(frozen=True)
class KVPlan:
    layout: Layout
    groups: tuple[GroupPages, ...]  # offloaded groups, in vLLM group order
    blocks_per_chunk: int
    tokens_per_hash: int
    world_size: int
    rank: int
    identity: keymod.ModelIdentity
    namespaces: tuple[bytes, ...]  # one per tensor-parallel rank
    persistent: bool  # False: the hash seed is per-process, the store is session-only
    slab_path: Path
    num_slots: int
    # Every tensor-parallel rank holds the same KV (MLA's latent): one shard per slot, under one
    # namespace, written by rank 0 and read by every rank (vLLM's single writer).
    replicated: bool = False

    @property
    def shard_bytes(self) -> int:
        return max(g.shard_bytes(self.blocks_per_chunk) for g in self.groups)

    @property
    def slot_bytes(self) -> int:
        return self.shard_bytes * len(self.namespaces)

    @property
    def shard_index(self) -> int:
        """This rank's shard in a slot (0 for every rank of a replicated layout)."""
        return 0 if self.replicated else self.rank

    @property
    def writes_stores(self) -> bool:
        """Whether this rank copies store jobs (all ranks still report them done)."""
        return not self.replicated or self.rank == 0

    def group(self, index: int) -> GroupPages:
        for g in self.groups:
            if g.index == index:
                return g
        raise KeyError(index)


def build_plan(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: StrataConfig) -> KVPlan:
    _refuse_unsupported_parallelism(vllm_config.parallel_config)
    offloaded = kv_cache_config.prefix_cacheable_group_ids
    if not offloaded:
        raise ValueError("kvstrata: the model has no prefix-cacheable KV cache group to offload")
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    drafters = _drafter_groups(vllm_config, kv_cache_config)
    bpc = blocks_per_chunk(cfg, kv_cache_config, offloaded, drafters, tokens_per_hash)
    geoms: list[GroupGeometry] = []
    pages: list[GroupPages] = []
    for gid in offloaded:
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        if spec.block_size % tokens_per_hash:
            raise ValueError(
                f"kvstrata: group {gid} block size {spec.block_size} is not a multiple of the "
                f"hash block size {tokens_per_hash}"
            )
        geoms.append(_geometry(gid, spec, bpc, tokens_per_hash, gid in drafters))
        pages.append(
            GroupPages(
                index=gid,
                layer_names=tuple(group.layer_names),
                page_bytes=_layer_page_bytes(spec, len(group.layer_names)),
                dtype=_codec_dtype(spec),
            )
        )
    retention = vllm_config.cache_config.prefix_cache_retention_interval
    layout = Layout(groups=tuple(geoms), retention_interval=retention)

    parallel = vllm_config.parallel_config
    world = parallel.tensor_parallel_size
    hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
    identity = _identity(vllm_config, kv_cache_config, pages, tokens_per_hash, bpc, hash_algo)
    persistent = keymod.hash_seed_is_reproducible(hash_algo)
    replicated = replicated_kv(vllm_config, kv_cache_config)
    # A replicated layout keeps rank 0's namespace: what TP ranks stored before is still found.
    namespaces = tuple(keymod.rank_namespace(identity, r) for r in range(1 if replicated else world))
    shard = max(g.shard_bytes(bpc) for g in pages)
    num_slots = max(2, cfg.host_bytes // (shard * len(namespaces)))
    engine_id = vllm_config.kv_transfer_config.engine_id if vllm_config.kv_transfer_config else None
    slab_dir = cfg.host_shm_dir or _default_shm_dir()
    slab_path = slab_dir / f"kvstrata-{engine_id or os.getpid()}-pp{parallel.rank // max(world, 1)}.slab"
    return KVPlan(
        layout=layout,
        groups=tuple(pages),
        blocks_per_chunk=bpc,
        tokens_per_hash=tokens_per_hash,
        world_size=world,
        rank=parallel.rank % max(world, 1),
        identity=identity,
        namespaces=namespaces,
        persistent=persistent,
        slab_path=slab_path,
        num_slots=num_slots,
        replicated=replicated,
    )


def blocks_per_chunk(cfg: StrataConfig, kv_cache_config: KVCacheConfig, offloaded: Sequence[int],
                     drafters: set[int], tokens_per_hash: int) -> int:
    """The option ``blocks_per_chunk``, "auto" resolved: chunks of at least
    ``AUTO_CHUNK_TOKENS`` tokens where every offloaded group is plain full attention and none is
    a drafter's, else one block (windows, Mamba states and drafter widening are counted in
    chunks: a larger chunk would serve less of each prompt there, and partial tails need one
    block per chunk, docs/SEMANTICS.md R7)."""
    if cfg.blocks_per_chunk != "auto":
        return int(cfg.blocks_per_chunk)
    specs = [kv_cache_config.kv_cache_groups[g].kv_cache_spec for g in offloaded]
    plain = not drafters and all(
        _geometry(g, spec, 1, tokens_per_hash, False).kind is GroupKind.FULL
        for g, spec in zip(offloaded, specs, strict=True))
    block = max(spec.block_size for spec in specs)
    return max(1, -(-AUTO_CHUNK_TOKENS // block)) if plain else 1


def replicated_kv(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether every tensor-parallel rank holds identical KV: MLA replicates its latent on each
    rank (``kv_tp_replicas`` ranks hold one copy). vLLM's offloading connector makes rank 0 the
    only writer under the same condition (``offloading/config.py``, ``replicated_layout``)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    return (
        tp > 1
        and bool(getattr(vllm_config.model_config, "use_mla", False))
        and getattr(kv_cache_config, "kv_tp_replicas", 1) == tp
    )


# Parallelism kvstrata does not lay out: each stage or context-parallel rank holds other layers or
# other tokens of a block than one tensor-parallel shard, which the slot layout (one shard per TP
# rank, every layer of the group) and the store keys do not describe. Served, they would load
# wrong KV or copies the scheduler never waits for; refused, the user knows at start-up.
_UNSUPPORTED_PARALLELISM = (
    ("pipeline_parallel_size", "pipeline parallelism"),
    ("prefill_context_parallel_size", "prefill context parallelism"),
    ("decode_context_parallel_size", "decode context parallelism"),
)


def _refuse_unsupported_parallelism(parallel: ParallelConfig) -> None:
    for name, what in _UNSUPPORTED_PARALLELISM:
        size = getattr(parallel, name, 1) or 1
        if size > 1:
            raise ValueError(
                f"kvstrata does not support {what} ({name}={size}); tensor parallelism "
                "(tensor_parallel_size) and data parallelism are supported"
            )


def open_host_slab(plan: KVPlan) -> HostSlab:
    """The host tier's slab at ``plan.slab_path``; a :class:`ConfigError` saying what to change
    when its file system cannot hold it (a container's /dev/shm is 64 MiB by default)."""
    from kvstrata.tiers.host import HostSlab

    try:
        return HostSlab(plan.slab_path, plan.slot_bytes, plan.num_slots, create=True)
    except MemoryError as exc:
        where = plan.slab_path.parent
        try:
            free = f", which has {shutil.disk_usage(where).free / 2**20:.0f} MiB free"
        except OSError:
            free = ""
        need = plan.slot_bytes * plan.num_slots / 2**20
        raise ConfigError(
            f"kvstrata's host tier needs {need:.0f} MiB in {where}{free}: give it more room (a "
            f"container's /dev/shm is 64 MiB unless it runs with --shm-size or --ipc=host), point "
            f"the option 'host_shm_dir' at a larger tmpfs, or lower 'host_bytes' ({exc})") from None


def _default_shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _drafter_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> set[int]:
    """Groups holding EAGLE/MTP drafter layers (docs/SEMANTICS.md R6).

    Only groups vLLM annotated ``is_eagle_group``. With speculative decoding on and no annotated
    group (shared-group MTP models) no group is a drafter group: treating all groups as drafters is
    the first defect of vLLM issue 52735 (it zeroes every hit whose window is one chunk).
    """
    spec_cfg = vllm_config.speculative_config
    if spec_cfg is None or not spec_cfg.use_eagle_block_drop():
        return set()
    return {i for i, g in enumerate(kv_cache_config.kv_cache_groups) if g.is_eagle_group}


def _geometry(gid: int, spec: KVCacheSpec, bpc: int, tph: int, drafter: bool) -> GroupGeometry:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    geometry = partial(
        GroupGeometry,
        index=gid,
        tokens_per_block=spec.block_size,
        blocks_per_chunk=bpc,
        tokens_per_hash=tph,
        is_drafter=drafter,
    )
    if isinstance(spec, SlidingWindowSpec):
        return geometry(
            kind=GroupKind.SLIDING,
            sliding_window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens,
        )
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return geometry(kind=GroupKind.CHUNKED_LOCAL, attention_chunk_size=spec.attention_chunk_size)
    if isinstance(spec, MambaSpec):
        return geometry(kind=GroupKind.MAMBA, mamba_align=spec.mamba_cache_mode == "align")
    return geometry(kind=GroupKind.FULL)


def _layer_page_bytes(spec: KVCacheSpec, num_layers: int) -> int:
    """Meaningful bytes per block per layer: pages padded to a common size (Mamba states padded to
    the attention page) carry only this much data; the padding is never copied or stored."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        sizes = {_unpadded(s) for s in spec.kv_cache_specs.values()}
        if len(sizes) != 1:
            raise ValueError("kvstrata: layers of one group with different page sizes are not supported")
        return sizes.pop()
    return _unpadded(spec)


def _unpadded(spec: KVCacheSpec) -> int:
    for attr in ("real_page_size_bytes", "unpadded_page_size_bytes"):
        value = getattr(spec, attr, None)
        if isinstance(value, int):
            return value
    return spec.page_size_bytes


def _codec_dtype(spec: KVCacheSpec) -> str:
    """The element type the codec shuffles by. Mamba pages mix conv and SSM states."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    if isinstance(spec, MambaSpec):
        sizes = {d.itemsize for d in spec.dtypes}
        if sizes == {4}:
            return "float32"
        if sizes == {2}:
            return "bfloat16"
        return "uint8"
    dtype = getattr(spec, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "uint8"


def _identity(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    pages: list[GroupPages],
    tokens_per_hash: int,
    bpc: int,
    hash_algo: str,
) -> keymod.ModelIdentity:
    model_cfg = vllm_config.model_config
    hf = getattr(model_cfg, "hf_config", None)
    groups = tuple(
        keymod.GroupIdentity(
            index=p.index,
            spec=keymod.spec_repr(kv_cache_config.kv_cache_groups[p.index].kv_cache_spec),
            layer_names=p.layer_names,
            page_bytes=p.page_bytes,
        )
        for p in pages
    )
    parallel = vllm_config.parallel_config
    return keymod.ModelIdentity(
        model=str(model_cfg.model),
        revision=model_cfg.revision,
        architectures=tuple(getattr(hf, "architectures", None) or ()),
        weights_digest=keymod.weights_digest(str(model_cfg.model)),
        dtype=str(model_cfg.dtype).removeprefix("torch."),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        kv_cache_layout=getattr(vllm_config.cache_config, "kv_cache_layout", None),
        block_size=vllm_config.cache_config.block_size,
        tokens_per_hash=tokens_per_hash,
        blocks_per_chunk=bpc,
        hash_algo=hash_algo,
        groups=groups,
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        pp_rank=parallel.rank // max(parallel.tensor_parallel_size, 1),
    )
