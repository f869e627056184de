"""Device staging: copy whole KV block pages between vLLM's KV tensors and host slab slots.

Runs in the worker process. vLLM hands ``register_kv_caches`` one tensor per layer, all views of
one int8 allocation (``[B, H, N, C]``, possibly strided by the layout; Mamba layers int8
``[B, 1, 1, page]``); layers of different groups alias the same bytes, so a block id is only
meaningful with its own group's layers. Pages are treated as opaque bytes.

Host shard layout for group ``g`` (DESIGN.md "Units"): ``[layer of g][block j of the chunk][page_g]``
at ``slot * slot_bytes + shard_index * shard_bytes``.

On CUDA/XPU each direction has its own stream. A job first waits on the compute stream's queued
work, gathers the pages of many blocks into a device staging buffer with one index op per layer,
then moves it with a few large copies to/from the pinned slab; completion is an event polled with
``query()``, never a synchronisation of the compute stream. On CPU the same API copies directly
between the KV views and the slab and completes synchronously.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstrata.tiers.host import HostSlab

logger = logging.getLogger(__name__)

NULL_BLOCK = 0
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


class Transfer(NamedTuple):
    """One chunk's part of a job: ``block_ids[i]`` <-> position ``first_block + i`` of the chunk
    in host slot ``slot``. Block id 0 (the null block) is skipped."""

    group: int
    slot: int
    first_block: int
    block_ids: Sequence[int]


@dataclass
class _Layer:
    """Per-block byte rows of one layer: ``rows[b]`` is block ``b``'s page.

    ``dense``: ``rows`` is an int8 ``[num_blocks, page]`` view (the page is one contiguous run of
    bytes, in physical order). Otherwise (layouts with the block dim inside a page, e.g. LHBNC)
    ``rows`` is int8 ``[num_blocks, *inner]`` and a page is its logical bytes.
    """

    rows: torch.Tensor
    page: int
    dense: bool

    @property
    def inner(self) -> tuple[int, ...]:
        return tuple(self.rows.shape[1:])


def _layer_pages(t: torch.Tensor, num_blocks: int, name: str) -> _Layer:
    if t.dim() < 2:
        raise ValueError(f"KV tensor {name} has shape {tuple(t.shape)}; expected [B, ...]")
    if t.shape[0] != num_blocks:
        if t.shape[0] % num_blocks:
            raise ValueError(
                f"KV tensor {name} has {t.shape[0]} blocks, not a multiple of {num_blocks}"
            )
        t = t.unflatten(0, (num_blocks, -1))  # kernel blocks -> manager blocks (a pure view)
    if t.stride(-1) != 1:
        raise ValueError(f"KV tensor {name}: last dim must have stride 1 (strides {t.stride()})")
    b = t.view(torch.int8)  # strides now in bytes
    page = int(np.prod(b.shape[1:]))
    dims = sorted((d for d in range(1, b.dim()) if b.shape[d] > 1), key=b.stride, reverse=True)
    expect, dense = 1, True
    for d in reversed(dims):
        if b.stride(d) != expect:
            dense = False
            break
        expect *= b.shape[d]
    if dense:
        rows = b.as_strided((num_blocks, page), (b.stride(0), 1), b.storage_offset())
        return _Layer(rows, page, True)
    return _Layer(b, page, False)


def _runs(first: int, block_ids: Sequence[int]) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Split a transfer into runs of consecutive chunk positions holding real blocks.

    Returns ``([(position of the run's first block, block ids)], [positions of null blocks])``.
    """
    runs: list[tuple[int, list[int]]] = []
    nulls: list[int] = []
    current: list[int] | None = None
    for i, bid in enumerate(block_ids):
        bid = int(bid)
        if bid == NULL_BLOCK:
            nulls.append(first + i)
            current = None
        elif current is None:
            current = [bid]
            runs.append((first + i, current))
        else:
            current.append(bid)
    return runs, nulls


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


@dataclass
class _Job:
    job_id: int
    event: Any
    ok: bool
    keep: list[torch.Tensor]  # staging and index tensors that must outlive the copies


class DeviceStager:
    """Moves block pages between device KV tensors and host slab slots.

    Args:
        kv_caches: ``register_kv_caches``'s dict, layer name -> tensor.
        group_layers: per group, its layer names in config order (the host shard order).
        host: the slab (or a ``[num_slots, slot_bytes]`` uint8/int8 CPU tensor).
        num_blocks: manager blocks (``kv_cache_config.num_blocks``); kernel-split views are
            regrouped to it.
        blocks_per_chunk: blocks per chunk (``bpc``).
        shard_bytes: bytes of one rank's shard in a slot; this rank's shard starts at
            ``shard_index * shard_bytes``.
        group_page_bytes: optional unpadded page size per group, checked against the tensors.
        max_stage_bytes: cap on one device staging buffer (accelerators only).
        pin: register a ``HostSlab`` for DMA when the device is an accelerator.
        copy_threads: CPU devices only: threads one job's chunk copies are spread over
            (default: up to 4, at most the cores). A restored prefix is tens to hundreds of MB
            landing in KV pages touched for the first time; one core page-faults through it at
            3-4 GB/s, two nearly double that. 1 copies on the calling thread.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        group_layers: Sequence[Sequence[str]],
        host: HostSlab | torch.Tensor,
        *,
        num_blocks: int,
        blocks_per_chunk: int,
        shard_bytes: int,
        shard_index: int = 0,
        group_page_bytes: Sequence[int] | None = None,
        max_stage_bytes: int = 256 << 20,
        pin: bool = True,
        copy_threads: int | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors")
        self.device = next(iter(kv_caches.values())).device
        self.num_blocks = num_blocks
        self.bpc = blocks_per_chunk
        self.max_stage_bytes = max_stage_bytes

        host_t = host.tensor if isinstance(host, HostSlab) else host
        if host_t.dim() != 2 or host_t.element_size() != 1 or host_t.device.type != "cpu":
            raise ValueError("host must be a CPU [num_slots, slot_bytes] byte tensor or a HostSlab")
        self.num_slots, self.slot_bytes = int(host_t.shape[0]), int(host_t.shape[1])
        self._host_flat = host_t.reshape(-1).view(torch.int8)
        self._host_ptr = self._host_flat.data_ptr()
        self._shard_offset = shard_index * shard_bytes
        if (shard_index + 1) * shard_bytes > self.slot_bytes:
            raise ValueError(
                f"shard {shard_index} of {shard_bytes} bytes does not fit a {self.slot_bytes}-byte slot"
            )

        self._layers: list[list[_Layer]] = []
        self._host: list[torch.Tensor] = []
        self.group_page_bytes: list[int] = []
        self.group_shard_bytes: list[int] = []
        # Groups this stager cannot serve (no layers, mixed page sizes, too big for a shard) ->
        # why. vLLM hands every group; jobs touching one of these fail instead of the engine.
        self.group_errors: dict[int, str] = {}
        for g, names in enumerate(group_layers):
            try:
                layers, page = self._group_pages(g, names, kv_caches, num_blocks, group_page_bytes)
                gsb = len(layers) * blocks_per_chunk * page
                if gsb > shard_bytes:
                    raise ValueError(
                        f"group {g} needs {gsb} bytes per shard, shard has {shard_bytes}"
                    )
            except ValueError as exc:
                self.group_errors[g] = str(exc)
                logger.warning("kvstrata: KV group %d cannot be staged: %s", g, exc)
                layers, page, gsb = [], 0, 0
            self._layers.append(layers)
            self.group_page_bytes.append(page)
            self.group_shard_bytes.append(gsb)
            # [slot, layer, block in chunk, page byte] view of this rank's shard for group g.
            self._host.append(
                self._host_flat.as_strided(
                    (self.num_slots, len(layers), blocks_per_chunk, page),
                    (self.slot_bytes, blocks_per_chunk * page, page, 1),
                    shard_index * shard_bytes,
                )
            )
        if len(self.group_errors) == len(group_layers):
            raise ValueError(f"no KV cache group can be staged: {self.group_errors}")

        self._accel = self.device.type in ("cuda", "xpu")
        self._results: list[tuple[int, bool]] = []
        self._inflight: dict[str, deque[_Job]] = {"store": deque(), "load": deque()}
        self._events: dict[int, _Job] = {}
        self.bytes_stored = 0
        self.bytes_loaded = 0
        if self._accel:
            self._mod = getattr(torch, self.device.type)
            self._streams = {
                "store": self._mod.Stream(device=self.device),
                "load": self._mod.Stream(device=self.device),
            }
            if pin and isinstance(host, HostSlab) and not host.pin():
                logger.warning("host slab could not be pinned; transfers use pageable memory")
        else:
            self._np_rows = [[layer.rows.numpy() for layer in layers] for layers in self._layers]
        threads = min(4, os.cpu_count() or 1) if copy_threads is None else copy_threads
        self._cpu_pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="kvstrata-copy")
            if not self._accel and threads > 1
            else None
        )

    @staticmethod
    def _group_pages(
        g: int,
        names: Sequence[str],
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        group_page_bytes: Sequence[int] | None,
    ) -> tuple[list[_Layer], int]:
        if not names:
            raise ValueError(f"group {g} has no layers")
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ValueError(f"group {g}: no KV tensor for layers {missing}")
        layers = [_layer_pages(kv_caches[n], num_blocks, n) for n in names]
        pages = {layer.page for layer in layers}
        if len(pages) != 1:
            raise ValueError(f"group {g} mixes page sizes {sorted(pages)}")
        page = pages.pop()
        if group_page_bytes is not None and group_page_bytes[g] != page:
            raise ValueError(
                f"group {g}: KV tensors hold {page}-byte pages, expected {group_page_bytes[g]}"
            )
        return layers, page

    # ---- public API --------------------------------------------------------------------------

    def store(self, job_id: int, transfers: Iterable[Transfer]) -> None:
        """Copy device pages into host slots (device -> host)."""
        self._submit("store", job_id, [Transfer(*t) for t in transfers])

    def load(
        self, job_id: int, transfers: Iterable[Transfer], *, before_compute: bool = False
    ) -> None:
        """Copy host slots into device pages (host -> device).

        ``before_compute``: the next forward reads these blocks; order it after the load.
        """
        self._submit("load", job_id, [Transfer(*t) for t in transfers])
        if before_compute:
            self.order_before_compute([job_id])

    @property
    def copies_on_host(self) -> bool:
        """True on CPU devices: copies run on the calling thread, no stream is involved."""
        return not self._accel

    def load_now(self, t: Transfer) -> None:
        """CPU devices: copy one host slot into its device pages on the calling thread (a
        streamed load's chunk that just landed). Raises IndexError for a bad transfer."""
        if self._accel:
            raise RuntimeError("load_now is for CPU devices; accelerators use load()")
        t = Transfer(*t)
        self._check(t)
        self._load_cpu(t)

    def poll(self) -> list[tuple[int, bool]]:
        """Jobs finished since the last poll, as ``(job_id, ok)``; never blocks."""
        for queue in self._inflight.values():
            # Each direction's stream runs its jobs in order: stop at the first unfinished one.
            while queue and queue[0].event.query():
                self._finish(queue.popleft())
        out, self._results = self._results, []
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until these jobs have finished (fences block reuse); ``poll`` still reports them."""
        for job_id in job_ids:
            job = self._events.get(job_id)
            if job is not None:
                job.event.synchronize()

    def order_before_compute(self, job_ids: Iterable[int]) -> None:
        """Make the compute stream wait for these loads (no host synchronisation)."""
        if not self._accel:
            return
        compute = self._mod.current_stream(self.device)
        for job_id in job_ids:
            job = self._events.get(job_id)
            if job is not None:
                compute.wait_event(job.event)

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._inflight.values())

    def close(self) -> None:
        """Wait for in-flight copies (their buffers must outlive them)."""
        for queue in self._inflight.values():
            for job in queue:
                job.event.synchronize()
        if self._cpu_pool is not None:
            self._cpu_pool.shutdown()

    # ---- job plumbing ------------------------------------------------------------------------

    def _check(self, t: Transfer) -> None:
        if not 0 <= t.group < len(self._layers):
            raise IndexError(f"group {t.group} out of range")
        if t.group in self.group_errors:
            raise IndexError(f"group {t.group} cannot be staged: {self.group_errors[t.group]}")
        if not 0 <= t.slot < self.num_slots:
            raise IndexError(f"slot {t.slot} out of range")
        if t.first_block < 0 or t.first_block + len(t.block_ids) > self.bpc:
            raise IndexError(
                f"blocks {t.first_block}+{len(t.block_ids)} exceed a {self.bpc}-block chunk"
            )
        for bid in t.block_ids:
            if not 0 <= int(bid) < self.num_blocks:
                raise IndexError(f"block id {bid} out of range")

    def _submit(self, direction: str, job_id: int, transfers: list[Transfer]) -> None:
        try:
            for t in transfers:
                self._check(t)
        except IndexError as exc:
            logger.error("kvstrata: bad %s job %d: %s", direction, job_id, exc)
            self._results.append((job_id, False))
            return
        if not self._accel:
            ok = True
            copy = self._store_cpu if direction == "store" else self._load_cpu
            try:
                if self._cpu_pool is not None and len(transfers) > 1:
                    # The copies write disjoint pages (distinct blocks, distinct slots); they
                    # release the GIL (libc memmove through ctypes, torch copies).
                    list(self._cpu_pool.map(copy, transfers))
                else:
                    for t in transfers:
                        copy(t)
            except Exception:
                logger.exception("kvstrata: %s job %d failed", direction, job_id)
                ok = False
            moved = sum(self._transfer_bytes(t) for t in transfers) if ok else 0
            if direction == "store":
                self.bytes_stored += moved
            else:
                self.bytes_loaded += moved
            self._results.append((job_id, ok))
            return

        stream = self._streams[direction]
        # Pages written by kernels already queued (stores) and blocks still read by them (loads:
        # the destination blocks may have just been freed) must be ordered before our copies.
        stream.wait_stream(self._mod.current_stream(self.device))
        job = _Job(job_id, self._mod.Event(), True, [])
        with self._mod.stream(stream):
            try:
                if direction == "store":
                    self._store_accel(transfers, job.keep)
                else:
                    self._load_accel(transfers, job.keep)
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

    # ---- CPU -----------------------------------------------------------------------------------

    # Dense pages move with one libc memmove per run of adjacent pages: 10-20% faster than
    # torch.index_select(out=) single-threaded, and immune to its OpenMP slowdown when the cores
    # are busy (it fell to 1-2 GB/s on a loaded 2-core machine); ctypes releases the GIL. Block ids
    # and slots are validated in _check before any address is formed.

    def _store_cpu(self, t: Transfer) -> None:
        self._copy_cpu(t, to_host=True)

    def _load_cpu(self, t: Transfer) -> None:
        self._copy_cpu(t, to_host=False)

    def _transfer_bytes(self, t: Transfer) -> int:
        real = sum(1 for b in t.block_ids if int(b) != NULL_BLOCK)
        return real * len(self._layers[t.group]) * self.group_page_bytes[t.group]

    def _copy_cpu(self, t: Transfer, to_host: bool) -> None:
        g = t.group
        layers, page, bpc = self._layers[g], self.group_page_bytes[g], self.bpc
        runs, nulls = _runs(t.first_block, t.block_ids)
        if to_host:
            for j in nulls:
                self._host[g][t.slot][:, j].zero_()  # deterministic bytes for dropped blocks
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

    # ---- accelerators --------------------------------------------------------------------------

    def _batches(self, transfers: list[Transfer]):
        """Per group, runs ``(slot, first position, ids)`` batched under ``max_stage_bytes``."""
        by_group: dict[int, list[tuple[int, int, list[int]]]] = {}
        for t in transfers:
            runs, _ = _runs(t.first_block, t.block_ids)
            by_group.setdefault(t.group, []).extend((t.slot, j0, ids) for j0, ids in runs)
        for g, runs in by_group.items():
            row_bytes = len(self._layers[g]) * self.group_page_bytes[g]
            batch: list[tuple[int, int, list[int]]] = []
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
        self, g: int, runs: list[tuple[int, int, list[int]]], keep: list[torch.Tensor]
    ):
        """Staging layout ``[run][layer][block of run][page]``: returns the device block ids, the
        staging row of (run, layer 0, block i) and the run length per block, plus each run's base
        row. The staging row of layer l is ``base + l * k``."""
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

    def _store_accel(self, transfers: list[Transfer], keep: list[torch.Tensor]) -> None:
        for t in transfers:
            for j in _runs(t.first_block, t.block_ids)[1]:
                self._host[t.group][t.slot][:, j].zero_()
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
                self.bytes_stored += k * n_layers * page

    def _load_accel(self, transfers: list[Transfer], keep: list[torch.Tensor]) -> None:
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
                self.bytes_loaded += k * n_layers * page
            for li, layer in enumerate(layers):
                src = stage.index_select(0, base + li * klen)
                layer.rows.index_copy_(0, ids, src if layer.dense else src.view(-1, *layer.inner))
