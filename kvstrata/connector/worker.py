"""Worker side of the connector: copies pages between vLLM's KV tensors and host slots.

The worker holds no cache state. It executes the scheduler's jobs through the device stager
``make_stager`` picks (``StreamStager``: DMA on dedicated copy streams on CUDA/XPU; ``CpuStager``:
plain copies on CPU) and reports which jobs finished. On accelerators it follows vLLM's own
offloading worker (docs/DESIGN.md "tiers/device/"): loads complete by their event and are
reported in ``finished_recving`` (the compute stream never waits on them); a step's stores are
issued at the next step's start, after that step's sampling, ordered after their forward by an
event recorded in ``wait_for_save``.

Synchronous loads (``TransferJob.sync``, StrataConfig ``sync_loads``) are copied in
``start_load_kv``, which vLLM calls before the forward of the step that computes their request,
and waited for there. vLLM runs that request at once, so they never appear in
``finished_recving``; a failed one reports its blocks (``take_invalid_block_ids``) and fails the
request's stores of that step, whose KV attended blocks that were not loaded.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvstrata.connector.metadata import StrataMetadata, StrataWorkerMetadata, TransferJob
from kvstrata.connector.plan import KVPlan, open_host_slab
from kvstrata.tiers.device import DeviceStager, Transfer, allow_amx_tiles, make_stager
from kvstrata.tiers.host import HostSlab
from kvstrata.tiers.landing import LandingWaiter

logger = logging.getLogger(__name__)


class StrataWorker:
    def __init__(self, plan: KVPlan, kv_cache_config: KVCacheConfig):
        self.plan = plan
        self.kv_cache_config = kv_cache_config
        self.slab: HostSlab | None = None
        self.stager: DeviceStager | None = None
        self.landing: LandingWaiter | None = None
        self._submitted: dict[int, TransferJob] = {}
        # Stores of the last forward, with its compute mark: issued at the next step's start.
        self._deferred: list[tuple[TransferJob, Any]] = []
        self._acked: list[int] = []  # stores another rank writes (replicated KV): done at once
        self._started: dict[int, float] = {}
        self._meta = StrataWorkerMetadata()
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        # Results taken early (synchronous loads are checked before the forward); reported
        # with the others by get_finished, their time measured to when they were taken (a
        # synchronous load's seconds are what the forward waited, not the forward as well).
        self._early: list[tuple[int, bool]] = []
        self._ended: dict[int, float] = {}
        self._invalid_blocks: set[int] = set()
        # Requests whose synchronous load failed this step: their stores must not run.
        self._failed_sync: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        plan = self.plan
        if any(t.device.type == "cpu" for t in kv_caches.values()):
            allow_amx_tiles()
        self.slab = open_host_slab(plan)
        # The stager indexes groups by position: give it every group of the engine (a chunk
        # copy names its vLLM group index); only offloaded groups ever appear in jobs.
        groups = self.kv_cache_config.kv_cache_groups
        self.stager = make_stager(
            kv_caches,
            [[n for n in g.layer_names if n in kv_caches] for g in groups],
            self.slab,
            num_blocks=self.kv_cache_config.num_blocks,
            blocks_per_chunk=plan.blocks_per_chunk,
            shard_bytes=plan.shard_bytes,
            shard_index=plan.shard_index,
            group_page_bytes=[_page_bytes_or(plan, i, kv_caches, g.layer_names) for i, g in enumerate(groups)],
        )
        broken = {g.index: self.stager.group_errors[g.index] for g in plan.groups if g.index in self.stager.group_errors}
        if broken:
            raise ValueError(f"kvstrata cannot stage these KV cache groups: {broken}")
        # Loads whose chunks are still landing from disk (streamed loads): on CPU each chunk is
        # copied by the waiter as it lands; accelerators get whole jobs back (get_finished).
        self.landing = LandingWaiter(
            self.slab.landed, self.stager.load_now if self.stager.copies_on_host else None
        )

    # A store job read in a later step could copy a block that was re-allocated meanwhile; the
    # scheduler lists such jobs in ``flush`` and we finish them before this step's forward.
    # Called at every step's start, before the forward is launched: the previous step's stores
    # are issued here (their copies then queue behind that step's sampling, not ahead of it).
    def handle_preemptions(self, meta: StrataMetadata) -> None:
        if self.stager is not None:
            # The step's inputs and forward are launched next: the copy threads start no job
            # until it is (start_load_kv or wait_for_save), as building one holds the GIL the
            # launches need (tiers/device/stream.py). Held before the deferred stores are
            # handed over, so none of them starts first.
            self.stager.hold_copies()
        self._submit_deferred()
        if not meta.flush:
            return
        if self.landing is not None:
            # A streamed load still waiting must not copy into blocks that change hands now.
            self.landing.cancel(list(meta.flush))
        for job in meta.stores:
            if job.job_id in meta.flush and job.job_id not in self._submitted:
                self._submit(job)
        waiting = [j for j in meta.flush if j in self._submitted]
        if waiting:
            assert self.stager is not None
            self.stager.wait(waiting)  # releases the hold: the forward still comes
            self.stager.hold_copies()

    def start_load_kv(self, meta: StrataMetadata) -> None:
        # vLLM calls this before the forward when the step has synchronous loads (they feed
        # it), otherwise once the forward is launched (kv_connector_model_runner_mixin.py).
        before_forward = any(job.sync for job in meta.loads)
        if self.stager is not None and not before_forward:
            self.stager.release_copies()
        self._start_loads(meta)
        if self.stager is not None and before_forward:
            self.stager.hold_copies()  # waiting for the synchronous loads released it

    def _start_loads(self, meta: StrataMetadata) -> None:
        self._submit_deferred()  # a runner that skipped handle_preemptions still issues them
        sync: list[int] = []
        landing: list[int] = []
        for job in meta.loads:
            self._submit(job)
            if job.sync:
                (landing if any(c.ticket for c in job.copies) else sync).append(job.job_id)
        if not sync and not landing:
            return
        assert self.stager is not None and self.landing is not None
        if landing:
            # Streamed synchronous loads (CPU engines): chunks still on their way from disk.
            # This step's forward needs them; on CPU each is copied as it lands.
            self.landing.wait(landing)
            for job_id, transfers in self.landing.take_ready():  # accelerators: whole jobs
                self.stager.load(job_id, transfers)
                if job_id in landing:
                    sync.append(job_id)
            self._take_early(self.landing.poll())
        # CPU: the copies ran inside _submit. Accelerators: the forward is launched after this.
        self.stager.wait(sync)
        self._take_early(self.stager.poll())
        self._failed_sync.update(
            self._submitted[job_id].req_id for job_id, ok in self._early
            if not ok and job_id in self._submitted and self._submitted[job_id].sync)

    def wait_for_save(self, meta: StrataMetadata) -> None:
        # Called after this step's forward was launched (CPU: after it ran).
        assert self.stager is not None, "register_kv_caches was not called"
        self.stager.release_copies()
        deferred = {job.job_id for job, _ in self._deferred}
        stores = [j for j in meta.stores if j.job_id not in self._submitted and j.job_id not in deferred]
        if not stores:
            return
        if self.stager.copies_on_host:
            for job in stores:
                self._submit_store(job)
            return
        mark = self.stager.mark_compute()
        self._deferred.extend((job, mark) for job in stores)

    def _submit_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for job, mark in deferred:
            self._submit_store(job, after=mark)
        # The stores that ran in a failed synchronous load's step are handled by now.
        self._failed_sync.clear()

    def _take_early(self, results: list[tuple[int, bool]]) -> None:
        now = time.perf_counter()
        self._ended.update((job_id, now) for job_id, _ in results)
        self._early.extend(results)

    def _submit_store(self, job: TransferJob, after: Any = None) -> None:
        if job.req_id in self._failed_sync:
            self._fail(job)
        else:
            self._submit(job, after=after)

    def _fail(self, job: TransferJob) -> None:
        """Report a job failed without copying anything."""
        self._submitted[job.job_id] = job
        self._started[job.job_id] = time.perf_counter()
        self._take_early([(job.job_id, False)])

    def _submit(self, job: TransferJob, after: Any = None) -> None:
        assert self.stager is not None, "register_kv_caches was not called"
        self._submitted[job.job_id] = job
        self._started[job.job_id] = time.perf_counter()
        copies = [Transfer(c.group, c.slot, c.first_block, c.block_ids) for c in job.copies]
        if job.is_store:
            if self.plan.writes_stores:
                self.stager.store(job.job_id, copies, after=after)
            else:
                self._acked.append(job.job_id)
        elif any(c.ticket for c in job.copies):
            assert self.landing is not None
            self.landing.submit(job.job_id, copies, [c.ticket for c in job.copies])
        else:
            # The request runs once this load is reported finished (get_finished).
            self.stager.load(job.job_id, copies)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for vLLM."""
        if self.stager is None:
            return set(), set(), set()
        assert self.landing is not None
        for job_id, transfers in self.landing.take_ready():
            self.stager.load(job_id, transfers)
        acked, self._acked = [(j, True) for j in self._acked], []
        early, self._early = self._early, []
        for job_id, ok in acked + early + self.stager.poll() + self.landing.poll():
            job = self._submitted.pop(job_id)
            elapsed = self._ended.pop(job_id, time.perf_counter()) - self._started.pop(job_id)
            # A rank that only acknowledged a replicated store moved no bytes.
            nbytes = self._job_bytes(job) if self.plan.writes_stores or not job.is_store else 0
            target = self._meta.completed if ok else self._meta.failed
            target[job_id] = target.get(job_id, 0) + 1
            if job.is_store:
                self._meta.bytes_stored += nbytes if ok else 0
                self._meta.store_seconds += elapsed
            elif job.sync:
                self._meta.bytes_loaded += nbytes if ok else 0
                self._meta.load_seconds += elapsed
                if not ok:
                    logger.warning("kvstrata: load job %d for request %s failed; vLLM recomputes "
                                   "or fails it (kv_load_failure_policy)", job_id, job.req_id)
                    self._invalid_blocks.update(b for b in job.block_ids if b != 0)
            else:
                self._meta.bytes_loaded += nbytes if ok else 0
                self._meta.load_seconds += elapsed
                if job.partial:  # a piece of a load: the request is reported with its last
                    continue
                self._finished_loads.add(job.req_id)
                if not ok:
                    logger.warning("kvstrata: load job %d for request %s failed; recomputing", job_id, job.req_id)
                    self._failed_loads.add(job.req_id)
        recving, failed = self._finished_loads, self._failed_loads
        self._finished_loads, self._failed_loads = set(), set()
        return set(), recving, failed

    def take_invalid_block_ids(self) -> set[int]:
        """Blocks of synchronous loads that failed since the last call (vLLM's
        ``get_block_ids_with_load_errors``)."""
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def _job_bytes(self, job: TransferJob) -> int:
        return sum(len(c.block_ids) * len(self.plan.group(c.group).layer_names) * self.plan.group(c.group).page_bytes for c in job.copies)

    def build_worker_meta(self) -> StrataWorkerMetadata:
        # Always an object (possibly empty): vLLM aggregates one per worker.
        meta, self._meta = self._meta, StrataWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        if self.landing is not None:
            self.landing.close()
        if self.stager is not None:
            self._submit_deferred()
            self.stager.wait(list(self._submitted))
            self.stager.close()
        if self.slab is not None:
            self.slab.close()


def _page_bytes_or(plan: KVPlan, index: int, kv_caches: dict[str, torch.Tensor], layers: list[str]) -> int:
    """The plan's page size for offloaded groups (checked against the tensors by the stager)."""
    for g in plan.groups:
        if g.index == index:
            return g.page_bytes
    t = kv_caches[layers[0]]
    return t[0].numel() * t.element_size()
