"""``StrataConnector``: the class vLLM loads through ``kv_connector_module_path``.

A thin adapter: it validates options, builds the shared ``KVPlan``, and forwards every call to the
scheduler-side (``StrataScheduler``) or worker-side (``StrataWorker``) half for its role.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvstrata import auth, fsmode
from kvstrata.config import StrataConfig
from kvstrata.connector.keys import namespace_info
from kvstrata.connector.metadata import StrataMetadata, StrataWorkerMetadata
from kvstrata.connector.plan import KVPlan, build_plan, open_host_slab
from kvstrata.connector.stats import StrataPromMetrics, StrataStats
from kvstrata.remote_address import parse_remote_url

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvstrata.connector.scheduler import StrataScheduler
    from kvstrata.connector.worker import StrataWorker

logger = logging.getLogger("kvstrata")


def build_hierarchy(
    plan: KVPlan, cfg: StrataConfig, *, events: bool = False, device_type: str = "cpu"
) -> tuple[Any, list[Any], Path | None]:
    """The scheduler's tier stack: host slab + pool, then the LMDB disk store and the shared
    Redis/Valkey tier where configured, and the I/O pipeline. ``events``: record tier changes for
    vLLM's KV cache events; ``device_type``: the engine's (vLLM's ``device_config``), which
    decides what ``background_priority: auto`` and ``write_threads: auto`` mean.

    Returns the hierarchy, what to close after it (lower tiers, slab), and for a session-only
    store the temporary directory to remove.
    """
    from kvstrata.tiers.disk import DiskStore
    from kvstrata.tiers.hierarchy import DEFAULT_WRITE_INFLIGHT_BYTES, Hierarchy
    from kvstrata.tiers.host import HostPool, sweep_stale_slabs

    disk_auth, remote_auth, remote_password = auth.read_secrets(cfg)  # before anything is opened
    priority = cfg.resolve_background_priority(device_type)
    # Engines killed without a clean shutdown leave their host tier behind in shared memory.
    stale = sweep_stale_slabs(os.path.dirname(plan.slab_path))
    if stale:
        logger.info("kvstrata: removed %d host slab(s) of engines that are gone, freeing %.1f GiB",
                    len(stale), sum(n for _, n in stale) / 2**30)
    slab = open_host_slab(plan)
    pool = HostPool(slab, policy=cfg.eviction)
    disk = None
    session_dir: Path | None = None
    if cfg.disk:
        store_path = cfg.store_path
        if not plan.persistent:
            # Block hashes differ in every process (xxhash without PYTHONHASHSEED): a persistent
            # store would never hit after a restart and only fill the disk. Say so, stay useful.
            session_dir = Path(tempfile.mkdtemp(prefix="kvstrata-session-"))
            store_path = session_dir
            logger.warning(
                "kvstrata: prefix_caching_hash_algo=%r with no PYTHONHASHSEED gives block hashes "
                "that differ in every process, so KV stored now can never be found after a restart. "
                "The store is session-only (%s). Use sha256 or sha256_cbor, or set PYTHONHASHSEED, "
                "for a persistent store.",
                plan.identity.hash_algo, store_path,
            )
        disk = DiskStore(
            store_path, budget_bytes=cfg.disk_bytes, level=cfg.zstd_level, codec=cfg.codec,
            max_age_s=cfg.max_age_s, reserve_bytes=cfg.resolve_disk_reserve(Path(store_path)),
            # In "auto" the store's LMDB writer and sync threads keep normal priority: the
            # urgent writes that catch up must not queue behind an idle thread (their CPU is
            # small beside compression, which the write-behind's own threads do).
            idle_writer=priority == "idle",
            mode=cfg.store_mode, auth=disk_auth,
        )
        fsmode.warn_if_readable(Path(store_path), logger)
        for rank, ns in enumerate(plan.namespaces):
            disk.register_namespace(ns, namespace_info(plan.identity, rank))
    remote = None
    if cfg.remote_url is not None:
        from kvstrata.tiers.remote import RemoteStore

        if not plan.persistent:
            # Block hashes of this process are its own: another engine could never find them.
            logger.warning("kvstrata: the shared tier (%s) is off: prefix_caching_hash_algo=%r "
                           "without PYTHONHASHSEED gives block hashes no other engine shares",
                           parse_remote_url(cfg.remote_url).redacted(), plan.identity.hash_algo)
        else:
            remote = RemoteStore(
                cfg.remote_url, connect_timeout_s=cfg.remote_connect_timeout_s,
                timeout_s=cfg.remote_timeout_s, write_timeout_s=cfg.remote_write_timeout_s,
                max_connections=cfg.remote_max_connections,
                probe_interval_s=cfg.remote_probe_interval_s, ttl_s=cfg.remote_ttl_s,
                codec=cfg.codec, level=cfg.zstd_level, auth=remote_auth, password=remote_password,
                tls_ca_file=None if cfg.remote_tls_ca_file is None else str(cfg.remote_tls_ca_file))
    # (tier, admission, backpressure, write bytes in flight): the disk defers writes it cannot
    # take yet (up to its backlog); the shared tier postpones them without a slot, so a slow
    # server never holds host slots.
    links: list[tuple[Any, int, str, int]] = []
    if disk is not None:
        links.append((disk, cfg.admission, "defer", DEFAULT_WRITE_INFLIGHT_BYTES))
    if remote is not None:
        links.append((remote, cfg.remote_admission, "drop", cfg.remote_write_backlog_bytes))
    # Per vLLM group index (the last 4 bytes of a chunk key); groups not offloaded never occur.
    n = max(g.index for g in plan.groups) + 1
    shard = [0] * n
    dtypes = ["uint8"] * n
    for g in plan.groups:
        shard[g.index] = g.shard_bytes(plan.blocks_per_chunk)
        dtypes[g.index] = g.dtype
    hierarchy = Hierarchy(
        pool,
        [t for t, _, _, _ in links],
        namespaces=list(plan.namespaces),
        group_shard_bytes=shard,
        group_dtypes=dtypes,
        shard_bytes=plan.shard_bytes,
        admit_after=[a for _, a, _, _ in links],
        write_backpressure=[p for _, _, p, _ in links],  # type: ignore[misc]
        max_write_inflight_bytes=[b for _, _, _, b in links],
        max_deferred_bytes=cfg.max_disk_write_backlog_bytes,
        max_concurrent_reads=cfg.prefetch_concurrency,
        read_threads=cfg.resolve_io_threads(),
        write_threads=cfg.resolve_write_threads(device_type),
        read_processes=cfg.resolve_read_processes(device_type),
        write_processes=cfg.resolve_write_processes(device_type),
        events=events,
        idle_writes=priority in ("auto", "idle"),
        urgent_writes=priority == "auto",
    )
    return hierarchy, [c for c in (remote, disk, slab) if c is not None], session_dir


def _lower_switch_interval(seconds: float | None) -> None:
    """Lower this process's GIL switch interval to ``seconds`` (see StrataConfig)."""
    if seconds is not None and sys.getswitchinterval() > seconds:
        logger.info("kvstrata: Python switch interval %.4fs -> %.4fs (disk read threads)",
                    sys.getswitchinterval(), seconds)
        sys.setswitchinterval(seconds)


class StrataConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstrata as a vLLM 0.32 KV connector (``kv_role="kv_both"``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.cfg = StrataConfig.from_extra_config(extra)
        self.plan = build_plan(vllm_config, kv_cache_config, self.cfg)
        self._scheduler: StrataScheduler | None = None
        self._worker: StrataWorker | None = None
        self._session_dir: Path | None = None
        self._owned: list[Any] = []
        if role == KVConnectorRole.SCHEDULER:
            from kvstrata.connector.scheduler import StrataScheduler

            # Checked before the store is opened: a refused option leaves nothing to close.
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
            stream_loads = self.cfg.resolve_stream_loads(policy)
            num_groups = len(kv_cache_config.kv_cache_groups)
            device = getattr(vllm_config.device_config, "device_type", None) or "cpu"
            sync_loads = self.cfg.resolve_sync_loads(device, num_groups)
            if self.cfg.sync_loads is True and not sync_loads:
                logger.warning("kvstrata: sync_loads is off for this engine: it has %d KV cache "
                               "groups, and vLLM recovers from a failed synchronous load only "
                               "with one (docs/SEMANTICS.md §1.6)", num_groups)
            events = vllm_config.kv_events_config is not None and bool(
                vllm_config.kv_events_config.enable_kv_cache_events)
            hierarchy, self._owned, self._session_dir = build_hierarchy(
                self.plan, self.cfg, events=events, device_type=device)
            _lower_switch_interval(self.cfg.python_switch_interval_s)
            hierarchy.warm_start(self.cfg.warm_start_bytes // self.plan.slot_bytes)
            hierarchy.announce_disk()  # KV events only: what a restarted engine holds on disk
            kv_events = None
            if events:
                from kvstrata.connector.events import KVEvents

                kv_events = KVEvents(self.plan.layout.groups, kv_cache_config.kv_cache_groups,
                                     self_describing=self.cfg.self_describing_kv_events)
            self._scheduler = StrataScheduler(
                self.plan,
                hierarchy,
                offload_prompt_only=self.cfg.offload_prompt_only,
                prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                stream_loads=stream_loads,
                sync_loads=sync_loads,
                sync_loads_wait_for_disk=sync_loads and device == "cpu",
                host_room_wait_s=self.cfg.resolve_host_room_wait_s(device),
                events=kv_events,
                shutdown_write_timeout_s=self.cfg.shutdown_write_timeout_s,
            )
            logger.info(
                "kvstrata: store %s, host tier %d slots x %d bytes, groups %s",
                self.cfg.store_path if self.cfg.disk else "(disk tier off)",
                self.plan.num_slots, self.plan.slot_bytes,
                [(g.index, g.kind.name, g.tokens_per_chunk, g.is_drafter) for g in self.plan.layout.groups],
            )
        else:
            from kvstrata.connector.worker import StrataWorker

            self._worker = StrataWorker(self.plan, kv_cache_config)

    # vLLM: a best-effort cache runs as kv_both but must not hold finished requests' blocks.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @property
    def scheduler(self) -> StrataScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker-side connector"
        return self._scheduler

    @property
    def worker(self) -> StrataWorker:
        assert self._worker is not None, "worker-side call on a scheduler-side connector"
        return self._worker

    # ------------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, StrataMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StrataMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StrataMetadata)
        self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.worker.get_finished()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Synchronous loads only (sync_loads, one KV cache group): asynchronous ones fail
        # through failed_recving.
        return self.worker.take_invalid_block_ids() if self._worker is not None else set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Failed loads go through failed_recving (also listed in finished_recving): the only
        # failure path that works with several KV cache groups (docs/SEMANTICS.md §1.6).
        sending, recving, failed = self.worker.get_finished()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def build_connector_worker_meta(self) -> StrataWorkerMetadata | None:
        return self.worker.build_worker_meta() if self._worker is not None else None

    # --------------------------------------------------------------- scheduler
    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens, self._max_loadable_tokens(request, num_computed_tokens)
        )

    def _max_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Bound from prefix-cacheable groups kvstrata does not offload (none normally)."""
        offloaded = {g.index for g in self.plan.groups}
        bounding = [
            i for i, g in enumerate(self._kv_cache_config.kv_cache_groups)
            if g.kv_cache_spec.prefix_cacheable and i not in offloaded
        ]
        if not bounding or self._kv_cache_manager is None:
            return None
        coordinator = self._kv_cache_manager.coordinator
        # A group kvstrata does not offload beside one it does: two or more groups, which vLLM
        # coordinates as a hybrid (the one coordinator with per-group hits).
        if not isinstance(coordinator, HybridKVCacheCoordinator):
            return None
        _, per_group = coordinator.find_longest_cache_hit_per_group(request.block_hashes, request.num_tokens - 1)
        return max(0, min(per_group[g] for g in bounding) - num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        return self.scheduler.register_finished_partial_tail(request, partial_tail_offloads)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    def take_events(self) -> Iterable[Any]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        self.scheduler.reset_cache()
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Pages are opaque bytes, any layout works; ask for the one vLLM's CPU backend supports
        # so the same store serves CPU and GPU engines of one model only when bytes agree (the
        # layout is part of the namespace).
        return "LBHNC"

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is None:
            return None
        stats = self._scheduler.take_stats()
        return None if stats is None or stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return StrataStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
    ) -> StrataPromMetrics:
        return StrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()  # drains write-behind first
            self._scheduler = None
        for resource in self._owned:  # disk store, then the host slab
            resource.close()
        if self._owned:
            self._owned[-1].unlink()  # the scheduler created the slab; mappings stay valid
            self._owned = []
        if self._session_dir is not None:
            shutil.rmtree(self._session_dir, ignore_errors=True)
