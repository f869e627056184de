"""vLLM's own disk tier on a CPU engine: the baseline kvstrata is compared against.

Used by ``benchmarks/bench_vs_vllm.py`` and ``benchmarks/profile_disk_ttft.py`` (issue 7); not
part of the installed package.

vLLM 0.32.0 ships a disk tier: ``OffloadingConnector`` with ``TieringOffloadingSpec`` and
``secondary_tiers=[{"type": "fs", "root_dir": ...}]``. Its CPU (primary) tier lives in a shared
mmap region; secondary tiers such as ``fs`` move bytes between that region and disk on their own
threads. Only the device <-> region copies need the worker, and the stock one
(``CPUOffloadingWorker``) refuses non-CUDA/XPU platforms because it issues
``swap_blocks_batch`` on device streams, an op the CPU build does not have.

:class:`CPUCopyTieringSpec` is ``TieringOffloadingSpec`` with one change: ``get_worker`` returns
:class:`CPUCopyWorker`, which performs the very copies the stock worker describes (one descriptor
per (block, layer): source pointer, destination pointer, size; same sub-block arithmetic for
offloaded blocks larger than engine blocks) with a plain ``memmove`` each. Manager, region, tiers
and file format are vLLM's, untouched. Load it with::

    kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CPUCopyTieringSpec",
            "spec_module_path": "benchmarks.vllm_fs_baseline",
            "cpu_bytes_to_use": N,
            "secondary_tiers": [{"type": "fs", "root_dir": DIR}],
        },
    }

(:func:`fs_transfer_config` builds it, and puts the repository root on ``PYTHONPATH`` so that
the engine processes vLLM starts can import this module by that name.) Copies run synchronously inside ``submit_*``: on a CPU
engine there is no copy engine to overlap with, the forward pass cannot start before a load has
landed anyway, and a store reads blocks whose forward already finished. ``get_finished`` then
reports each job in the same engine step, so no step is spent polling. The extra key
``copy_threads`` (default 1) splits each job's copies over that many threads. Like kvstrata's
worker, it asks for the AMX tile state vLLM's CPU attention needs (``allow_amx_tiles``): neither
speed nor numerics change, but a restarted engine no longer dies of SIGILL at its first request.
"""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from typing_extensions import override
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from benchmarks._env import export_repo_root
from kvstrata.tiers.device import allow_amx_tiles

SPEC_NAME = "CPUCopyTieringSpec"
SPEC_MODULE = "benchmarks.vllm_fs_baseline"

_memmove = ctypes.memmove


def fs_transfer_config(root_dir: str, *, cpu_bytes: int, **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` running vLLM's CPU + fs tiers with :class:`CPUCopyTieringSpec`.

    vLLM imports the spec by module name in the engine processes: those started from here on find
    ``benchmarks`` whatever their working directory."""
    export_repo_root()
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        # As kvstrata's (kvstrata/tools/engine.py): the same engine settings for both contenders.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": SPEC_NAME,
            "spec_module_path": SPEC_MODULE,
            "cpu_bytes_to_use": int(cpu_bytes),
            "secondary_tiers": [{"type": "fs", "root_dir": str(root_dir)}],
            **extra,
        },
    }


def _copy_all(src: list[int], dst: list[int], sizes: list[int]) -> None:
    for s, d, n in zip(src, dst, sizes, strict=True):
        _memmove(d, s, n)


@dataclass
class _TensorPair:
    """One canonical KV tensor: the engine's block tensor and its slot in the offload region."""

    device_base: int  # address of engine block 0
    device_stride: int  # bytes between engine blocks
    host_base: int  # address of offload chunk 0 for this tensor
    host_stride: int  # bytes between offload chunks (a whole region row: every tensor)
    page: int  # bytes of one engine block's page in this tensor (sub-block pitch in a chunk)


class CPUCopyWorker(OffloadingWorker):
    """Copies blocks between the CPU engine's KV tensors and vLLM's offload region.

    Descriptors are computed with numpy exactly as the stock worker's ``_fill_direct_ops``
    computes them (block ``b`` of a tensor at ``base + b * stride``; sub-block ``j`` of offload
    chunk ``c`` at ``base + c * row_stride + j * page``), then each is one ``memmove``.
    Descriptors that continue the previous one on both sides are merged first (adjacent engine
    blocks landing in adjacent sub-blocks of one chunk): fewer calls, the same bytes.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion, copy_threads: int = 1) -> None:
        # As kvstrata's worker does: without it a restarted engine can die of SIGILL at its first
        # request, in vLLM's AMX attention (tiers.device.allow_amx_tiles).
        allow_amx_tiles()
        self._region = region
        # ctypes releases the GIL around memmove, so threads copy in parallel. The default is one
        # thread: the reference figures of issue 7 come from a single-threaded memcpy per block.
        self._pool = ThreadPoolExecutor(copy_threads, thread_name_prefix="fs-baseline-copy") \
            if copy_threads > 1 else None
        self._threads = max(1, copy_threads)
        self._bpc = blocks_per_chunk
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._tensors: list[_TensorPair] = []
        # Keep the region views alive: the pointers below are into them.
        self._views: list[torch.Tensor] = []
        for entry in kv_caches.tensors:
            page = entry.page_size_bytes
            device = entry.tensor.view(torch.int8).view((-1, page))
            assert device.device.type == "cpu" and device.stride(1) == 1
            host = region.create_next_worker_view(page * blocks_per_chunk)
            self._views += [device, host]
            self._tensors.append(_TensorPair(
                device_base=device.data_ptr(), device_stride=device.stride(0),
                host_base=host.data_ptr(), host_stride=host.stride(0), page=page))
        self._finished: list[TransferResult] = []

    # -- descriptors -------------------------------------------------------------------------

    def _descriptors(self, device_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(device pointers, host pointers, sizes): one row per (block, layer ref)."""
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        device_blocks = device_spec.block_ids.astype(np.uint64)
        host_chunks = host_spec.block_ids.astype(np.uint64)
        assert len(device_spec.group_sizes) == len(self._refs)
        dev_parts: list[np.ndarray] = []
        host_parts: list[np.ndarray] = []
        size_parts: list[np.ndarray] = []
        dev_off = host_off = 0
        for refs, n, first_index in zip(self._refs, device_spec.group_sizes,
                                        device_spec.block_indices, strict=True):
            if n == 0:
                continue
            # The first offloaded chunk of a group may start mid-chunk (engine block
            # ``first_index`` of the request sits at sub-block ``first_index % bpc``).
            skip = int(first_index) % self._bpc
            n_chunks = cdiv(n + skip, self._bpc)
            blocks = device_blocks[dev_off:dev_off + n]
            chunks = host_chunks[host_off:host_off + n_chunks]
            dev_off += n
            host_off += n_chunks
            # Chunk and sub-block of each engine block, in request order.
            pos = np.arange(skip, skip + n, dtype=np.uint64)
            chunk_of = chunks[pos // np.uint64(self._bpc)]
            sub_of = pos % np.uint64(self._bpc)
            for ref in refs:
                t = self._tensors[ref.tensor_idx]
                dev_parts.append(np.uint64(t.device_base) + blocks * np.uint64(t.device_stride))
                host_parts.append(np.uint64(t.host_base) + chunk_of * np.uint64(t.host_stride)
                                  + sub_of * np.uint64(t.page))
                size_parts.append(np.full(n, ref.page_size_bytes, dtype=np.uint64))
        assert dev_off == len(device_blocks) and host_off == len(host_chunks)
        if not dev_parts:
            empty = np.empty(0, dtype=np.uint64)
            return empty, empty, empty
        return np.concatenate(dev_parts), np.concatenate(host_parts), np.concatenate(size_parts)

    @staticmethod
    def _merge(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
               ) -> tuple[list[int], list[int], list[int]]:
        """Coalesce descriptors that continue the previous one on both sides."""
        if len(sizes) > 1:
            ends_src = src[:-1] + sizes[:-1]
            ends_dst = dst[:-1] + sizes[:-1]
            starts = np.flatnonzero(np.concatenate((
                [True], (src[1:] != ends_src) | (dst[1:] != ends_dst))))
            sizes = np.add.reduceat(sizes, starts)
            src, dst = src[starts], dst[starts]
        return src.tolist(), dst.tolist(), sizes.tolist()

    def _copy(self, job_id: int, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> bool:
        t0 = time.perf_counter()
        total = int(sizes.sum()) if len(sizes) else 0
        s_list, d_list, n_list = self._merge(src, dst, sizes)
        if self._pool is None or len(n_list) < 2 * self._threads:
            _copy_all(s_list, d_list, n_list)
        else:
            k = self._threads
            list(self._pool.map(_copy_all, *(
                [part[i::k] for i in range(k)] for part in (s_list, d_list, n_list))))
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=total,
                                             transfer_time=time.perf_counter() - t0))
        return True

    # -- OffloadingWorker --------------------------------------------------------------------

    @override
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        device, host, sizes = self._descriptors(src_spec, dst_spec)
        return self._copy(job_id, device, host, sizes)

    @override
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        device, host, sizes = self._descriptors(dst_spec, src_spec)
        return self._copy(job_id, host, device, sizes)

    @override
    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    @override
    def wait(self, job_ids: set[int]) -> None:
        # Every job completed inside its submit call.
        return

    @override
    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._views.clear()
        self._region.cleanup()


class CPUCopyTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker copies with :class:`CPUCopyWorker` (CPU engines)."""

    _cpu_worker: CPUCopyWorker | None = None

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._cpu_worker is None:
            if self.config.canonical_layout:
                raise NotImplementedError(
                    f"{SPEC_NAME} copies whole pages; remove canonical_layout from "
                    "kv_connector_extra_config")
            # The same region slot TieringOffloadingSpec.create_worker maps for this rank.
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id, num_chunks=self.num_chunks, rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._cpu_worker = CPUCopyWorker(
                    kv_caches, self.blocks_per_chunk, region,
                    copy_threads=int(self.extra_config.get("copy_threads", 1)))
            except Exception:
                region.cleanup()
                raise
        return self._cpu_worker
