"""CUDA and XPU: copies on dedicated streams, completion by events, never a compute-stream sync.

Each direction has its own stream. A job first waits on the compute stream's queued work, gathers
the pages of many blocks into a device staging buffer with one index op per layer, then moves it
with a few large copies to/from the pinned slab; completion is an event polled with ``query()``.
Both accelerators expose the same stream/event API (``torch.cuda``, ``torch.xpu``), so one class
serves them through the backend module.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Unpack

import torch

from kvstrata.tiers.device.base import DeviceStager, Direction, StagerGeometry
from kvstrata.tiers.device.layout import Transfer, block_runs
from kvstrata.tiers.host import HostSlab

logger = logging.getLogger(__name__)

# (slot, first chunk position, block ids) of one run of real blocks.
_Run = tuple[int, int, list[int]]


@dataclass
class _Job:
    job_id: int
    event: Any
    ok: bool
    keep: list[torch.Tensor]  # staging and index tensors that must outlive the copies


class StreamStager(DeviceStager):
    """``DeviceStager`` for KV tensors on a CUDA or XPU device.

    Args (beyond ``DeviceStager``'s):
        backend: the device's torch module (``torch.cuda``, ``torch.xpu``): ``Stream``,
            ``Event``, ``stream()``, ``current_stream()``. Default: the one named by the KV
            tensors' device type.
        max_stage_bytes: cap on one device staging buffer (a job may use several in turn).
        pin: register a ``HostSlab`` for DMA (pageable memory halves copy throughput or worse).
    """

    copies_on_host: ClassVar[bool] = False

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        group_layers: Sequence[Sequence[str]],
        host: HostSlab | torch.Tensor,
        *,
        backend: Any = None,
        max_stage_bytes: int = 256 << 20,
        pin: bool = True,
        **geometry: Unpack[StagerGeometry],
    ) -> None:
        super().__init__(kv_caches, group_layers, host, **geometry)
        self.max_stage_bytes = max_stage_bytes
        self._mod = getattr(torch, self.device.type) if backend is None else backend
        self._streams = {
            "store": self._mod.Stream(device=self.device),
            "load": self._mod.Stream(device=self.device),
        }
        self._inflight: dict[str, deque[_Job]] = {"store": deque(), "load": deque()}
        self._events: dict[int, _Job] = {}
        if pin and isinstance(host, HostSlab) and not host.pin():
            logger.warning("host slab could not be pinned; transfers use pageable memory")

    # ---- public API --------------------------------------------------------------------------

    def poll(self) -> list[tuple[int, bool]]:
        for queue in self._inflight.values():
            # Each direction's stream runs its jobs in order: stop at the first unfinished one.
            while queue and queue[0].event.query():
                self._finish(queue.popleft())
        return super().poll()

    def wait(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            job = self._events.get(job_id)
            if job is not None:
                job.event.synchronize()

    def order_before_compute(self, job_ids: Iterable[int]) -> None:
        compute = self._mod.current_stream(self.device)
        for job_id in job_ids:
            job = self._events.get(job_id)
            if job is not None:
                compute.wait_event(job.event)

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._inflight.values())

    def close(self) -> None:
        for queue in self._inflight.values():
            for job in queue:
                job.event.synchronize()

    # ---- job plumbing ------------------------------------------------------------------------

    def _run(self, direction: Direction, job_id: int, transfers: list[Transfer]) -> None:
        stream = self._streams[direction]
        # Pages written by kernels already queued (stores) and blocks still read by them (loads:
        # the destination blocks may have just been freed) must be ordered before our copies.
        stream.wait_stream(self._mod.current_stream(self.device))
        job = _Job(job_id, self._mod.Event(), True, [])
        with self._mod.stream(stream):
            try:
                if direction == "store":
                    self._store(transfers, job.keep)
                else:
                    self._load(transfers, job.keep)
            except Exception:
                logger.exception("kvstrata: %s job %d failed", direction, job_id)
                job.ok = False
            # Record even after a failure: copies already issued must finish before the buffers
            # go back to the allocator and before the slots are reused.
            job.event.record(stream)
        self._inflight[direction].append(job)
        self._events[job_id] = job

    def _finish(self, job: _Job) -> None:
        self._events.pop(job.job_id, None)
        job.keep.clear()
        self._results.append((job.job_id, job.ok))

    # ---- gather / scatter --------------------------------------------------------------------

    def _batches(self, transfers: list[Transfer]) -> Iterator[tuple[int, list[_Run]]]:
        """Per group, runs ``(slot, first position, ids)`` batched under ``max_stage_bytes``."""
        by_group: dict[int, list[_Run]] = {}
        for t in transfers:
            runs, _ = block_runs(t.first_block, t.block_ids)
            by_group.setdefault(t.group, []).extend((t.slot, j0, ids) for j0, ids in runs)
        for g, runs in by_group.items():
            row_bytes = len(self._layers[g]) * self.group_page_bytes[g]
            batch: list[_Run] = []
            size = 0
            for run in runs:
                if batch and size + len(run[2]) * row_bytes > self.max_stage_bytes:
                    yield g, batch
                    batch, size = [], 0
                batch.append(run)
                size += len(run[2]) * row_bytes
            if batch:
                yield g, batch

    def _stage_index(
        self, g: int, runs: list[_Run], keep: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], int]:
        """Staging layout ``[run][layer][block of run][page]``: returns the device block ids, the
        staging row of (run, layer 0, block i) and the run length per block, plus each run's base
        row and the total rows. The staging row of layer l is ``base + l * k``."""
        n_layers = len(self._layers[g])
        ids: list[int] = []
        base: list[int] = []
        klen: list[int] = []
        run_base: list[int] = []
        row = 0
        for _, _, run_ids in runs:
            k = len(run_ids)
            run_base.append(row)
            ids.extend(run_ids)
            base.extend(range(row, row + k))
            klen.extend([k] * k)
            row += n_layers * k
        dev = self.device
        t_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        t_base = torch.tensor(base, dtype=torch.long).to(dev, non_blocking=True)
        t_k = torch.tensor(klen, dtype=torch.long).to(dev, non_blocking=True)
        keep.extend((t_ids, t_base, t_k))
        return t_ids, t_base, t_k, run_base, row

    def _store(self, transfers: list[Transfer], keep: list[torch.Tensor]) -> None:
        for t in transfers:
            self._zero_positions(t.group, t.slot, block_runs(t.first_block, t.block_ids)[1])
        for g, runs in self._batches(transfers):
            layers, page = self._layers[g], self.group_page_bytes[g]
            ids, base, klen, run_base, total = self._stage_index(g, runs, keep)
            stage = torch.empty((total, page), dtype=torch.int8, device=self.device)
            keep.append(stage)
            for li, layer in enumerate(layers):
                rows = layer.rows.index_select(0, ids)
                stage.index_copy_(0, base + li * klen, rows.view(-1, page))
            host = self._host[g]
            n_layers = len(layers)
            for (slot, j0, run_ids), r0 in zip(runs, run_base, strict=True):
                k = len(run_ids)
                if k == self.bpc:  # whole chunk: the shard region is one contiguous range
                    host[slot].view(-1).copy_(
                        stage[r0 : r0 + n_layers * k].view(-1), non_blocking=True
                    )
                else:
                    for li in range(n_layers):
                        host[slot, li, j0 : j0 + k].copy_(
                            stage[r0 + li * k : r0 + (li + 1) * k], non_blocking=True
                        )
                self._count("store", k * n_layers * page)

    def _load(self, transfers: list[Transfer], keep: list[torch.Tensor]) -> None:
        for g, runs in self._batches(transfers):
            layers, page = self._layers[g], self.group_page_bytes[g]
            ids, base, klen, run_base, total = self._stage_index(g, runs, keep)
            stage = torch.empty((total, page), dtype=torch.int8, device=self.device)
            keep.append(stage)
            host = self._host[g]
            n_layers = len(layers)
            for (slot, j0, run_ids), r0 in zip(runs, run_base, strict=True):
                k = len(run_ids)
                if k == self.bpc:
                    stage[r0 : r0 + n_layers * k].view(-1).copy_(
                        host[slot].view(-1), non_blocking=True
                    )
                else:
                    for li in range(n_layers):
                        stage[r0 + li * k : r0 + (li + 1) * k].copy_(
                            host[slot, li, j0 : j0 + k], non_blocking=True
                        )
                self._count("load", k * n_layers * page)
            # Scatter after every host copy of the batch is queued: one index op per layer.
            for li, layer in enumerate(layers):
                src = stage.index_select(0, base + li * klen)
                layer.rows.index_copy_(0, ids, src if layer.dense else src.view(-1, *layer.inner))
