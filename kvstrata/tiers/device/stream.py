"""CUDA and XPU: DMA copies between KV block pages and pinned slab slots, on dedicated streams.

The contract is vLLM 0.32's own offloading worker's (``vllm/v1/kv_offload/cpu/gpu_worker.py``,
``.../kv_connector/v1/offloading/worker.py``; docs/DESIGN.md "tiers/device/"):

* every byte moves with the copy engines, straight between a KV page and its place in a slot,
  through vLLM's ``swap_blocks_batch``: no gather/scatter kernel takes SMs, and kvstrata holds
  no device memory at all;
* the call's pointer descriptors live in pinned host buffers from a pool; a buffer goes back to
  the pool only when its job's event has completed;
* a load's stream waits on the compute stream's queued work (the destination blocks may still be
  written or read there); the compute stream never waits on a load: a load completes by its event
  and is reported by ``poll`` (vLLM's ``finished_recving``);
* a store's stream waits on the event ``mark_compute`` recorded after the forward that wrote its
  blocks (the connector issues stores at the next step's start, after that step's sampling);
* the engine thread only records that dependency and hands the job to its direction's copy
  thread, which builds the descriptors and calls the op (the op releases the GIL). The driver
  holds a lock while the op enqueues copies, and the engine thread's kernel launches wait for it,
  so a job goes out in calls of ``DESCRIPTORS_PER_CALL`` descriptors with at most
  ``PACE_DEPTH`` of them queued ahead of the copy engine (see below); and while the engine
  thread launches a forward (``hold_copies`` .. ``release_copies``, at most ``LAUNCH_HOLD_S``)
  no job starts (its descriptors are built in Python, under the GIL the launches need too).
  With an unpinned slab a copy also blocks its caller until the stream reaches it.

Each direction has one stream, so its jobs complete in submission order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Unpack

import numpy as np
import torch

from kvstrata.tiers.device.accel import CopyDevice, TorchCopyDevice
from kvstrata.tiers.device.base import DeviceStager, Direction, StagerGeometry
from kvstrata.tiers.device.layout import NULL_BLOCK, LayerPages, Transfer, block_runs
from kvstrata.tiers.host import HostSlab
from kvstrata.tiers.priority import name_this_thread

logger = logging.getLogger(__name__)


# Measured on an H200 (docs/BENCHMARKS.md "GPU"): a 6.9-7.2 ms synthetic forward took 21 ms
# while a 1 GiB job of 16,320 descriptors was issued on the engine thread, 20-24 ms issued from
# a copy thread in one call, 17-18 ms in calls of 256, and 9.5-10.8 ms in calls of 128 kept at
# most 4 ahead of the copy engine (the copy thread sleeps on an event in between, so the lock is
# free most of the time the copies take); the copies ran at 0.82-0.85x of one pinned copy.
# Swept later (descriptors on the copy thread): calls of 32 stalled it 1.37x (copies 0.68-0.74x),
# 64 1.10x (0.74-0.77x), 256 1.21x, a whole job 2.53x; 128 at depth 2, 3, 4 or 8 alike.
DESCRIPTORS_PER_CALL = 128
PACE_DEPTH = 4
# With the descriptors built on the copy threads and calls paced, a 7 ms forward of 40 launches
# still took 1.10-1.15x as long with a job (64 MiB to 1 GiB) submitted at its start (1.0-1.06x
# as one CUDA graph). Holding the copy calls until the forward was launched changed nothing;
# holding the job's start, descriptors included (Python, under the GIL), made it 1.06-1.07x, the
# job done about 1 ms later (docs/BENCHMARKS.md "GPU"). The connector holds new jobs from its
# step's start to the forward's launch (``DeviceStager.hold_copies``/``release_copies``); past
# this long a hold lapses, so jobs never wait on an engine thread that did not release them.
LAUNCH_HOLD_S = 0.02


@dataclass
class _Job:
    job_id: int
    direction: Direction
    event: Any
    ok: bool = True
    nbytes: int = 0
    buffers: list[torch.Tensor] = field(default_factory=list)  # pooled descriptors in use
    future: Future[None] | None = None  # the copy thread's issue of the job


@dataclass(frozen=True)
class LayersPlan:
    """Layers of one group whose pages split into the same fragments: block ``b``'s fragment
    ``i`` of layer ``k`` is ``size`` bytes at ``base[k] + b * stride[k] + dev[i]`` on the device
    and at ``host[i]`` in that layer's page in the slot, the ``index[k]``-th of the group's.

    One plan covers a whole group in the usual case, so a job's descriptors are one numpy
    broadcast per group, not a Python loop over layers and chunks (on an H200 that loop was
    about a third of a 1 GiB job's 32 ms, on the engine thread: docs/BENCHMARKS.md "GPU")."""

    index: np.ndarray
    base: np.ndarray
    stride: np.ndarray
    dev: np.ndarray
    host: np.ndarray
    size: int


def plan_layers(layers: Sequence[LayerPages]) -> list[LayersPlan]:
    """The group's layers bucketed by fragment shape, in order of first appearance."""
    buckets: dict[tuple[bytes, bytes, int], list[tuple[int, LayerPages]]] = {}
    frags: dict[tuple[bytes, bytes, int], tuple[np.ndarray, np.ndarray, int]] = {}
    for k, lp in enumerate(layers):
        dev, host, size = page_fragments(lp)
        key = (dev.tobytes(), host.tobytes(), size)
        buckets.setdefault(key, []).append((k, lp))
        frags.setdefault(key, (dev, host, size))
    return [
        LayersPlan(
            np.array([k for k, _ in members], np.int64),
            np.array([lp.rows.data_ptr() for _, lp in members], np.int64),
            np.array([lp.rows.stride(0) for _, lp in members], np.int64),
            *frags[key],
        )
        for key, members in buckets.items()
    ]


def page_fragments(layer: LayerPages) -> tuple[np.ndarray, np.ndarray, int]:
    """``(device offsets, page offsets, bytes)`` of a page's contiguous pieces, in the page's
    logical byte order (what the slab holds): one piece for a dense page; for layouts with the
    block dim inside a page (LHBNC) one per run of its innermost contiguous dims."""
    if layer.dense:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), layer.page
    shape, strides = layer.rows.shape[1:], layer.rows.stride()[1:]
    size, k = 1, len(shape)
    while k and (shape[k - 1] == 1 or strides[k - 1] == size):
        size *= shape[k - 1]
        k -= 1
    if k == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), layer.page
    idx = np.indices(shape[:k]).reshape(k, -1)  # C order: the logical order of the pieces
    dev = (idx * np.asarray(strides[:k], np.int64)[:, None]).sum(0)
    return dev.astype(np.int64), np.arange(idx.shape[1], dtype=np.int64) * size, size


def merge_adjacent(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold copies that continue the previous one on both sides into it (adjacent blocks of a
    run whose pages are adjacent in memory become one descriptor)."""
    if len(sizes) < 2:
        return src, dst, sizes
    cont = (src[1:] == src[:-1] + sizes[:-1]) & (dst[1:] == dst[:-1] + sizes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)


class StreamStager(DeviceStager):
    """``DeviceStager`` for KV tensors on a CUDA or XPU device.

    Args (beyond ``DeviceStager``'s):
        backend: the ``CopyDevice`` (default: ``TorchCopyDevice`` for the KV tensors' device,
            which raises ValueError naming a missing primitive).
        pin: register a ``HostSlab`` for DMA when it is not yet.
        host_pinned: whether the host memory is pinned (default: the slab's state after ``pin``;
            a plain tensor's ``is_pinned()``).
        max_stage_bytes: accepted for callers of earlier versions; there is no staging buffer.
        descriptors_per_call: the most descriptors one copy-op call takes (0: a job in one call).
        pace_depth: calls a copy thread keeps queued ahead of the copy engine (0: no pacing).
        launch_hold_s: the longest ``hold_copies`` keeps the copy threads from starting a job
            (0: jobs are never held).
    """

    copies_on_host: ClassVar[bool] = False

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        group_layers: Sequence[Sequence[str]],
        host: HostSlab | torch.Tensor,
        *,
        backend: CopyDevice | None = None,
        pin: bool = True,
        host_pinned: bool | None = None,
        max_stage_bytes: int | None = None,
        descriptors_per_call: int = DESCRIPTORS_PER_CALL,
        pace_depth: int = PACE_DEPTH,
        launch_hold_s: float = LAUNCH_HOLD_S,
        **geometry: Unpack[StagerGeometry],
    ) -> None:
        super().__init__(kv_caches, group_layers, host, **geometry)
        del max_stage_bytes
        self._dev: CopyDevice = TorchCopyDevice(self.device) if backend is None else backend
        if host_pinned is None:
            host_pinned = _pinned(host, pin)
        self.host_pinned = host_pinned
        self._streams = {"store": self._dev.new_stream(), "load": self._dev.new_stream()}
        self._inflight: dict[str, deque[_Job]] = {"store": deque(), "load": deque()}
        self._jobs: dict[int, _Job] = {}
        self._pool: list[torch.Tensor] = []  # free pinned descriptor buffers
        self._pool_lock = threading.Lock()  # taken by the copy threads, returned by poll
        if not host_pinned:
            logger.warning(
                "kvstrata: the host slab is not pinned (registration failed or is unavailable): "
                "KV copies run from pageable memory, slower, issued from copy threads so the "
                "engine thread never waits for them"
            )
        # One thread per direction keeps each stream's jobs in submission order.
        self._threads = {
            d: ThreadPoolExecutor(1, thread_name_prefix=f"kvstrata-{d}", initializer=name_this_thread)
            for d in ("store", "load")
        }
        self._plans = [plan_layers(layers) for layers in self._layers]
        self.descriptors_per_call = descriptors_per_call
        self.pace_depth = pace_depth
        # Pacing events, each list touched only by its direction's copy thread.
        self._pace_events: dict[str, list[Any]] = {"store": [], "load": []}
        self.launch_hold_s = launch_hold_s
        self._released = threading.Event()  # clear while the engine thread launches a forward
        self._released.set()
        self._hold_ends = 0.0  # time.monotonic() when the current hold lapses

    # ---- public API --------------------------------------------------------------------------

    def mark_compute(self) -> Any:
        event = self._dev.new_event()
        event.record(self._dev.current_stream())
        return event

    def hold_copies(self) -> None:
        if self.launch_hold_s > 0:
            self._hold_ends = time.monotonic() + self.launch_hold_s
            self._released.clear()

    def release_copies(self) -> None:
        self._released.set()

    @property
    def copies_held(self) -> bool:
        return not self._released.is_set() and time.monotonic() < self._hold_ends

    def poll(self) -> list[tuple[int, bool]]:
        for queue in self._inflight.values():
            # One stream per direction runs its jobs in order: stop at the first unfinished one.
            while queue and self._done(queue[0]):
                self._finish(queue.popleft())
        return super().poll()

    def wait(self, job_ids: Iterable[int]) -> None:
        self.release_copies()  # an engine thread waiting for copies launches nothing meanwhile
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                self._sync(job)

    def wait_issued(self) -> None:
        """Block until every submitted job's copies are queued on its stream (they may still
        be running): for tests and measurements that drive the streams themselves."""
        for queue in self._inflight.values():
            for job in list(queue):
                if job.future is not None:
                    job.future.result()  # _issue never raises

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._inflight.values())

    @property
    def descriptor_buffers(self) -> int:
        """Pinned descriptor buffers held (in use and pooled): bounded by the jobs in flight."""
        with self._pool_lock:
            return len(self._pool) + sum(len(j.buffers) for j in self._jobs.values())

    def close(self) -> None:
        self.release_copies()
        for queue in self._inflight.values():
            for job in queue:
                self._sync(job)
        for pool in self._threads.values():
            pool.shutdown()
        self.poll()
        with self._pool_lock:
            self._pool.clear()

    # ---- job plumbing ------------------------------------------------------------------------

    def _run(
        self, direction: Direction, job_id: int, transfers: list[Transfer], after: Any = None
    ) -> None:
        job = _Job(job_id, direction, self._dev.new_event())
        # The dependency is taken now, on the engine thread: a store waits for the forward that
        # wrote its blocks (``after``), a load for what the compute stream has queued so far.
        # Everything else (descriptors, the copy calls) happens on the direction's copy thread.
        dep = after if after is not None else self.mark_compute()
        job.future = self._threads[direction].submit(self._issue, direction, job, dep, transfers)
        self._inflight[direction].append(job)
        self._jobs[job_id] = job

    def _issue(self, direction: Direction, job: _Job, dep: Any, transfers: list[Transfer]) -> None:
        # Building the descriptors is Python and numpy under the GIL, which the engine thread's
        # launches need as well: a job starts after the forward's launch. A job already under
        # way goes on meanwhile: its paced calls cost the launches nothing measurable (holding
        # them did not change the stall; docs/BENCHMARKS.md "GPU") and keep the copy engine fed.
        self._wait_for_release()
        try:
            if direction == "store":
                for t in transfers:
                    self._zero_positions(t.group, t.slot, block_runs(t.first_block, t.block_ids)[1])
            src, dst, sizes = self._descriptors(direction, transfers)
            job.nbytes = int(sizes.sum())
            descs = self._upload(job, src, dst, sizes)
        except Exception:
            logger.exception("kvstrata: %s job %d failed before any copy", direction, job.job_id)
            with self._pool_lock:
                self._pool.extend(job.buffers)  # never read by the device
            job.ok, job.buffers, job.event = False, [], None
            return
        stream = self._streams[direction]
        try:
            stream.wait_event(dep)
            with self._dev.use_stream(stream):
                try:
                    # Host sources (loads) are never written by a device stream: the copy
                    # engine may read them out of stream order, as vLLM's worker lets it.
                    calls, ahead = self._calls(descs), deque[Any]()
                    # This thread's own events, re-recorded job after job (creating and
                    # destroying one per call would take the driver's lock as well).
                    spare = self._pace_events[direction]
                    for i, part in enumerate(calls):
                        if self.pace_depth and len(ahead) >= self.pace_depth:
                            ahead[0].synchronize()  # sleeps, holding no lock
                            spare.append(ahead.popleft())
                        self._dev.copy_batch(*part, src_order_any=direction == "load")
                        if self.pace_depth and i + 1 < len(calls):
                            ahead.append(spare.pop() if spare else self._dev.new_event(blocking=True))
                            ahead[-1].record(stream)
                    spare.extend(ahead)  # still pending is fine: a record replaces the last
                except Exception:
                    logger.exception("kvstrata: %s job %d failed", direction, job.job_id)
                    job.ok = False
                # Recorded even after a failure: copies already queued must finish before the
                # descriptors go back to the pool and before the slots or blocks are reused.
                job.event.record(stream)
        except Exception:
            self._lost(job, "its stream or event failed")

    def _wait_for_release(self) -> None:
        """Copy threads: no job starts while the engine thread launches a forward (building its
        descriptors holds the GIL, which each kernel launch takes too), until the hold lapses."""
        if not self._released.is_set():
            self._released.wait(max(0.0, self._hold_ends - time.monotonic()))

    def _calls(self, descs: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """The job's descriptors in slices of at most ``descriptors_per_call``."""
        if not descs:
            return []
        n, step = len(descs[0]), self.descriptors_per_call or len(descs[0])
        return [tuple(d[i : i + step] for d in descs) for i in range(0, n, step)]

    def _lost(self, job: _Job, why: str) -> None:
        """A device error: nothing tells when the job's queued copies end. It fails, and its
        descriptors (possibly still read) are dropped rather than pooled."""
        logger.exception("kvstrata: %s job %d: %s", job.direction, job.job_id, why)
        job.ok, job.buffers, job.event = False, [], None

    def _done(self, job: _Job) -> bool:
        if job.future is not None and not job.future.done():
            return False
        if job.event is None:
            return True
        try:
            return bool(job.event.query())
        except Exception:
            self._lost(job, "its completion event failed")
            return True

    def _sync(self, job: _Job) -> None:
        if job.future is not None:
            job.future.result()  # _issue never raises
        if job.event is not None:
            try:
                job.event.synchronize()
            except Exception:
                self._lost(job, "waiting for it failed")

    def _finish(self, job: _Job) -> None:
        self._jobs.pop(job.job_id, None)
        with self._pool_lock:
            self._pool.extend(job.buffers)
        job.buffers = []
        if job.ok:
            self._count(job.direction, job.nbytes)
        self._results.append((job.job_id, job.ok))

    # ---- descriptors -------------------------------------------------------------------------

    def _descriptors(
        self, direction: Direction, transfers: list[Transfer]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Raw-pointer copies of a validated job, merged where both sides are adjacent."""
        by_group: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for t in transfers:
            ids = np.asarray(t.block_ids, np.int64)
            real = np.flatnonzero(ids != NULL_BLOCK)
            if len(real):
                # Host address of each real block's page in the slot's first layer.
                first_page = (self._host_ptr + t.slot * self.slot_bytes + self._shard_offset
                              + (t.first_block + real) * self.group_page_bytes[t.group])
                by_group.setdefault(t.group, []).append((ids[real], first_page))
        srcs: list[np.ndarray] = []
        dsts: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        for g, parts in by_group.items():
            blocks = np.concatenate([b for b, _ in parts])
            first_page = np.concatenate([h for _, h in parts])
            layer_bytes = self.bpc * self.group_page_bytes[g]
            for plan in self._plans[g]:
                # [layer, block, fragment] -> flat, so a block's fragments and a run of
                # adjacent blocks of one layer stay neighbours for merge_adjacent.
                dev = ((plan.base[:, None] + blocks[None, :] * plan.stride[:, None])[:, :, None]
                       + plan.dev[None, None, :])
                host = ((plan.index[:, None] * layer_bytes + first_page[None, :])[:, :, None]
                        + plan.host[None, None, :])
                dev, host = dev.reshape(-1), host.reshape(-1)
                srcs.append(dev if direction == "store" else host)
                dsts.append(host if direction == "store" else dev)
                sizes.append(np.full(len(dev), plan.size, np.int64))
        if not sizes:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        return merge_adjacent(np.concatenate(srcs), np.concatenate(dsts), np.concatenate(sizes))

    def _upload(
        self, job: _Job, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
    ) -> tuple[Any, ...]:
        """Write the descriptors into three pooled pinned buffers the job holds until its event
        completes (the copy op may read them until then)."""
        n = len(sizes)
        if n == 0:
            return ()
        views = []
        for values in (src, dst, sizes):
            buf = self._take_buffer(n)
            job.buffers.append(buf)
            view = buf[:n]
            view.numpy()[:] = values.astype(view.numpy().dtype, copy=False)
            views.append(view)
        return tuple(views)

    def _take_buffer(self, n: int) -> torch.Tensor:
        with self._pool_lock:
            for i, buf in enumerate(self._pool):
                if buf.numel() >= n:
                    return self._pool.pop(i)
            if self._pool:
                self._pool.pop(0)  # too small for this job: let a bigger one replace it
        # Rounded up so buffers are reused across jobs of similar size.
        return self._dev.descriptor_buffer(max(256, 1 << (n - 1).bit_length()))


def _pinned(host: HostSlab | torch.Tensor, pin: bool) -> bool:
    if isinstance(host, HostSlab):
        return host.pinned or (pin and host.pin())
    try:
        return bool(host.is_pinned())
    except RuntimeError:  # no accelerator runtime to ask
        return False
