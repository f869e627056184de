"""CPU engines: pages move directly between the KV views and the slab, on the calling thread.

Jobs complete inside ``store``/``load`` (nothing is queued, there is no stream to order against);
a job's chunks may be spread over a few threads.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Unpack

import numpy as np
import torch

from kvstrata.tiers.device.base import DeviceStager, Direction, StagerGeometry
from kvstrata.tiers.device.layout import Transfer, block_runs
from kvstrata.tiers.host import HostSlab
from kvstrata.tiers.priority import worker_thread

logger = logging.getLogger(__name__)

_memmove = ctypes.memmove


def allow_amx_tiles() -> None:
    """Ask Linux for the AMX tile state before vLLM's CPU attention uses it (CPU engines).

    vLLM 0.32.0's CPU attention runs AMX kernels (bf16, block sizes a multiple of 32) but never
    requests the permission (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); torch's large GEMMs request
    it lazily. An engine whose first attention batch is all single-token queries therefore dies
    with SIGILL: a 1-token prompt does it without any connector, and so does a restarted engine
    whose first request a KV tier serves whole (the engine recomputes only its last token).
    Engines served in part by vLLM's fs tier (the benchmark's baseline) died of it now and then
    too. A no-op without AMX.
    """
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def _coalesce(ids: list[int], stride: int, page: int) -> list[tuple[int, int, int]]:
    """``(first index, first block, count)`` runs of consecutive block ids whose pages are also
    adjacent in memory (block stride == page), so each run is one copy."""
    if stride != page:
        return [(i, b, 1) for i, b in enumerate(ids)]
    out: list[tuple[int, int, int]] = []
    i0, b0, n = 0, ids[0], 1
    for i in range(1, len(ids)):
        if ids[i] == b0 + n:
            n += 1
        else:
            out.append((i0, b0, n))
            i0, b0, n = i, ids[i], 1
    out.append((i0, b0, n))
    return out


class CpuStager(DeviceStager):
    """``DeviceStager`` for KV tensors in host memory.

    Args (beyond ``DeviceStager``'s):
        copy_threads: threads one job's chunk copies are spread over (default: up to 4, at most
            the cores). A restored prefix is tens to hundreds of MB landing in KV pages touched
            for the first time; one core page-faults through it at 3-4 GB/s, two nearly double
            that. 1 copies on the calling thread. The threads run on every core the worker's
            threads were given, not only the OpenMP core they inherit (``priority.worker_thread``).
    """

    copies_on_host: ClassVar[bool] = True

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        group_layers: Sequence[Sequence[str]],
        host: HostSlab | torch.Tensor,
        *,
        copy_threads: int | None = None,
        **geometry: Unpack[StagerGeometry],
    ) -> None:
        super().__init__(kv_caches, group_layers, host, **geometry)
        # numpy views of the logical (non-dense) pages: see _copy_logical.
        self._np_rows = [[layer.rows.numpy() for layer in layers] for layers in self._layers]
        threads = min(4, os.cpu_count() or 1) if copy_threads is None else copy_threads
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="kvstrata-copy", initializer=worker_thread)
            if threads > 1 else None
        )

    def load_now(self, t: Transfer) -> None:
        t = Transfer(*t)
        self._check(t)
        self._load_cpu(t)

    # Jobs finish inside store/load, so there is never anything to wait for.

    def wait(self, job_ids: Iterable[int]) -> None:
        pass

    @property
    def pending(self) -> int:
        return 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def _run(
        self, direction: Direction, job_id: int, transfers: list[Transfer], after: object = None
    ) -> None:
        ok = True
        copy = self._store_cpu if direction == "store" else self._load_cpu
        try:
            if self._pool is not None and len(transfers) > 1:
                # The copies write disjoint pages (distinct blocks, distinct slots); they
                # release the GIL (libc memmove through ctypes, torch copies).
                list(self._pool.map(copy, transfers))
            else:
                for t in transfers:
                    copy(t)
        except Exception:
            logger.exception("kvstrata: %s job %d failed", direction, job_id)
            ok = False
        self._count(direction, sum(self._transfer_bytes(t) for t in transfers) if ok else 0)
        self._results.append((job_id, ok))

    # Dense pages move with one libc memmove per run of adjacent pages: 10-20% faster than
    # torch.index_select(out=) single-threaded, and immune to its OpenMP slowdown when the cores
    # are busy (it fell to 1-2 GB/s on a loaded 2-core machine); ctypes releases the GIL. Block ids
    # and slots are validated in _check before any address is formed.

    def _store_cpu(self, t: Transfer) -> None:
        self._copy_cpu(t, to_host=True)

    def _load_cpu(self, t: Transfer) -> None:
        self._copy_cpu(t, to_host=False)

    def _copy_cpu(self, t: Transfer, to_host: bool) -> None:
        g = t.group
        layers, page, bpc = self._layers[g], self.group_page_bytes[g], self.bpc
        runs, nulls = block_runs(t.first_block, t.block_ids)
        if to_host:
            self._zero_positions(g, t.slot, nulls)
        shard = self._host_ptr + t.slot * self.slot_bytes + self._shard_offset
        for j0, ids in runs:
            plans: dict[int, list[tuple[int, int, int]]] = {}
            for li, layer in enumerate(layers):
                if not layer.dense:
                    self._copy_logical(g, li, j0, ids, t.slot, to_host)
                    continue
                stride, dev = layer.rows.stride(0), layer.rows.data_ptr()
                plan = plans.get(stride)
                if plan is None:
                    plan = plans[stride] = _coalesce(ids, stride, page)
                host = shard + (li * bpc + j0) * page
                if to_host:
                    for i0, b0, n in plan:
                        _memmove(host + i0 * page, dev + b0 * stride, n * page)
                else:
                    for i0, b0, n in plan:
                        _memmove(dev + b0 * stride, host + i0 * page, n * page)

    def _copy_logical(
        self, g: int, li: int, j0: int, ids: list[int], slot: int, to_host: bool
    ) -> None:
        """Pages that are not one byte run (block dim inside the page): logical byte order."""
        layer, k = self._layers[g][li], len(ids)
        host = self._host[g][slot, li, j0 : j0 + k]
        if to_host:
            idx = torch.tensor(ids, dtype=torch.long)
            torch.index_select(layer.rows, 0, idx, out=host.view(k, *layer.inner))
        else:
            # numpy's fancy assignment runs at copy speed; torch's CPU index_copy_ is ~10x slower.
            self._np_rows[g][li][np.asarray(ids)] = host.numpy().reshape(k, *layer.inner)
