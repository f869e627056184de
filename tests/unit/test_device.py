"""Device stagers on the real vLLM 0.32 KV layouts (built by vLLM's own placement and view code).

The KV caches come from ``get_kv_cache_config_from_groups`` + ``allocate_kv_cache``: one int8
allocation, per-layer strided ``[B, H, N, C]`` views, groups overlaying the same bytes. Page bytes
are checked against an independent reference: the ``KVCacheTensor`` placement formula
``offset + l * layer_stride + b * block_stride`` on the raw buffer.

``CpuStager`` runs here; ``StreamStager`` runs on a controlled accelerator double in
``test_device_stream.py`` and for real on a CUDA device (the ``cuda`` tests below).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from affinity_helper import PROCESS_CPUS, needs_two_cpus, on_one_cpu, thread_cpus

from kvstrata.tiers.device import (
    CpuStager,
    DeviceStager,
    StreamStager,
    Transfer,
    make_stager,
)
from kvstrata.tiers.device.cpu import _coalesce

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
kv_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
worker_utils = pytest.importorskip("vllm.v1.worker.utils")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

BPC = 4
BLOCK = 16


def _fake_vllm_config(layout: KVCacheLayout) -> types.SimpleNamespace:
    # The only fields get_kv_cache_config_from_groups reads.
    cache = types.SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=None,
        prefix_cache_retention_interval=None,
    )
    return types.SimpleNamespace(
        cache_config=cache, attention_config=types.SimpleNamespace(hisparse_config=None)
    )


def _fa(block: int = BLOCK) -> kvi.FullAttentionSpec:
    return kvi.FullAttentionSpec(
        block_size=block, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
    )


def _sw() -> kvi.SlidingWindowSpec:
    return kvi.SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=32
    )


def _mamba(padded: int) -> kvi.MambaSpec:
    # GDN-like state: conv (bf16) + ssm (fp32), padded to the attention page (Qwen3-Next style).
    return kvi.MambaSpec(
        block_size=BLOCK,
        shapes=((3, 64), (2, 8, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=padded,
        mamba_cache_mode="align",
    )


MODELS = {
    # Gemma-like: sliding window + full attention, same page size, groups alias.
    "sw+fa": lambda: [
        kvi.KVCacheGroupSpec(["s0", "s1"], _sw()),
        kvi.KVCacheGroupSpec(["f0", "f1"], _fa()),
    ],
    # Qwen3-Next-like: GDN (int8 pages padded to the attention page) + full attention.
    "mamba+fa": lambda: [
        kvi.KVCacheGroupSpec(["m0", "m1", "m2"], _mamba(_fa().page_size_bytes)),
        kvi.KVCacheGroupSpec(["f0", "f1", "f2"], _fa()),
    ],
}


class Model:
    """A vLLM-allocated KV cache plus the reference placement of every page."""

    def __init__(self, groups, layout: KVCacheLayout, device="cpu", kernel_block_sizes=None):
        self.layout = layout
        self.config = kv_utils.get_kv_cache_config_from_groups(
            _fake_vllm_config(layout), groups, 1 << 19
        )
        self.caches = worker_utils.allocate_kv_cache(
            self.config, torch.device(device), layout, kernel_block_sizes
        )
        self.num_blocks = self.config.num_blocks
        self.groups = [list(g.layer_names) for g in groups]
        self.pages = [self._unpadded(g.kv_cache_spec) for g in groups]
        any_layer = next(iter(self.caches.values()))
        self.raw = torch.as_strided(
            any_layer.view(torch.int8) if any_layer.dtype != torch.int8 else any_layer,
            (self.config.kv_cache_tensors[0].size,),
            (1,),
            0,
        )
        self.placement = {}
        for t in self.config.kv_cache_tensors:
            for li, name in enumerate(t.layers):
                self.placement[name] = (t.offset + li * t.layer_stride, t.block_stride)

    @staticmethod
    def _unpadded(spec) -> int:
        if isinstance(spec, kvi.MambaSpec):
            return spec.real_page_size_bytes
        return spec.page_size_bytes

    def page(self, name: str, group: int, block: int) -> torch.Tensor:
        """Reference bytes of one page: raw placement for block-compact layouts (physical
        bytes), the logical view's bytes otherwise."""
        if self.layout.is_block_compact:
            start, stride = self.placement[name]
            begin = start + block * stride
            return self.raw[begin : begin + self.pages[group]].cpu()
        view = self.caches[name]
        return view[block].contiguous().view(torch.int8).reshape(-1).cpu()

    def page_ranges(self, group: int, blocks) -> np.ndarray:
        """Mask of the raw bytes that group ``group``'s pages of ``blocks`` occupy."""
        mask = np.zeros(self.raw.numel(), dtype=bool)
        for name in self.groups[group]:
            view = self.caches[name]
            e = view.element_size()
            # Element index of every element of the view, in its own typed storage.
            pos = torch.arange(self.raw.numel() // e).as_strided(
                view.shape, view.stride(), view.storage_offset()
            )
            for b in blocks:
                elems = pos[b].reshape(-1).numpy()
                mask[(elems[:, None] * e + np.arange(e)[None, :]).reshape(-1)] = True
        return mask


def _stager(model: Model, host: torch.Tensor, shard_index: int = 0, **kw) -> DeviceStager:
    shard = max(len(g) * BPC * p for g, p in zip(model.groups, model.pages, strict=True))
    return make_stager(
        model.caches,
        model.groups,
        host,
        num_blocks=model.num_blocks,
        blocks_per_chunk=BPC,
        shard_bytes=shard,
        shard_index=shard_index,
        group_page_bytes=model.pages,
        **kw,
    )


def _host(model: Model, slots: int = 6, shards: int = 1) -> torch.Tensor:
    shard = max(len(g) * BPC * p for g, p in zip(model.groups, model.pages, strict=True))
    return torch.zeros((slots, shard * shards), dtype=torch.uint8)


def _fill_random(model: Model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model.raw.copy_(torch.randint(-128, 128, model.raw.shape, dtype=torch.int8, generator=g))


def _models():
    for name, make in MODELS.items():
        for layout in KVCacheLayout:
            try:
                model = Model(make(), layout)
            except (ValueError, AssertionError):
                continue  # vLLM refuses this layout for this model (mixed page sizes)
            yield pytest.param(model, id=f"{name}-{layout.name}")


ALL_MODELS = list(_models())


def test_every_model_has_layouts():
    ids = {p.id.split("-")[0] for p in ALL_MODELS}
    assert ids == set(MODELS)
    assert len(ALL_MODELS) >= 8


@pytest.mark.parametrize("model", ALL_MODELS)
def test_store_writes_reference_pages_in_shard_layout(model: Model):
    _fill_random(model, 1)
    host = _host(model, shards=2)
    stager = _stager(model, host, shard_index=1)
    shard = host.shape[1] // 2
    g = len(model.groups) - 1  # last group: pages alias the first group's
    ids = [3, 7, 2, 9]
    stager.store(11, [Transfer(g, 4, 0, ids)])
    assert stager.poll() == [(11, True)]
    page = model.pages[g]
    for li, name in enumerate(model.groups[g]):
        for j, b in enumerate(ids):
            off = shard + (li * BPC + j) * page
            assert torch.equal(host[4, off : off + page].view(torch.int8), model.page(name, g, b))
    assert not host[:, :shard].any(), "shard 0 of every slot must be untouched"
    assert not host[:4].any() and not host[5:].any(), "other slots must be untouched"


@pytest.mark.parametrize("model", ALL_MODELS)
def test_round_trip_is_bit_exact_and_touches_only_its_pages(model: Model):
    _fill_random(model, 2)
    host = _host(model)
    stager = _stager(model, host)
    for g in range(len(model.groups)):
        src = [5, 6, 1]  # a run of adjacent blocks (one copy where pages are adjacent too)
        dst = [12, 13, 4]
        expected = {
            (name, d): model.page(name, g, s).clone()
            for name in model.groups[g]
            for s, d in zip(src, dst, strict=True)
        }
        # A partial chunk (positions 1..3) and a multi-transfer job.
        stager.store(1, [Transfer(g, 2, 1, src), Transfer(g, 3, 0, [6])])
        before = model.raw.clone().numpy()
        stager.load(2, [Transfer(g, 2, 1, dst)])
        assert stager.poll() == [(1, True), (2, True)]
        for (name, d), want in expected.items():
            assert torch.equal(model.page(name, g, d), want)
        changed = before != model.raw.numpy()
        allowed = model.page_ranges(g, dst)
        assert not (changed & ~allowed).any(), "bytes outside the loaded pages changed"


@pytest.mark.parametrize("model", ALL_MODELS)
def test_parallel_cpu_copies_match_sequential_ones(model: Model):
    """A job's chunk copies spread over threads land exactly where one thread puts them."""
    _fill_random(model, 3)
    chunks = [[1, 2], [3, 4], [5], [6, 7], [8, 9], [10]]
    results = []
    for threads in (1, 3):
        host = _host(model, slots=len(chunks))
        stager = _stager(model, host, copy_threads=threads)
        for g in range(len(model.groups)):
            stager.store(1, [Transfer(g, s, 0, ids) for s, ids in enumerate(chunks)])
            assert stager.poll() == [(1, True)]
        stored = host.clone()
        before = model.raw.clone()
        for g in range(len(model.groups)):
            # Back into other blocks, several chunks per job.
            stager.load(2, [Transfer(g, s, 0, [b + 20 for b in ids]) for s, ids in enumerate(chunks)])
            assert stager.poll() == [(2, True)]
        results.append((stored, model.raw.clone()))
        assert stager.bytes_loaded == stager.bytes_stored > 0
        stager.close()
        model.raw.copy_(before)
    (host1, raw1), (host3, raw3) = results
    assert host1.any() and not torch.equal(raw1, model.raw)  # both directions moved bytes
    assert torch.equal(host1, host3) and torch.equal(raw1, raw3)


@pytest.mark.parametrize("model", ALL_MODELS[:4])
def test_null_block_is_skipped(model: Model):
    _fill_random(model, 3)
    host = _host(model)
    stager = _stager(model, host)
    g = 0
    host[1].fill_(0x55)
    # Sliding-window style: blocks outside the window are the null block 0.
    stager.store(1, [Transfer(g, 1, 0, [0, 0, 6, 7])])
    page = model.pages[g]
    for li, name in enumerate(model.groups[g]):
        for j in (0, 1):
            off = (li * BPC + j) * page
            assert not host[1, off : off + page].any(), "null positions are zeroed"
        off = (li * BPC + 2) * page
        assert torch.equal(host[1, off : off + page].view(torch.int8), model.page(name, g, 6))
    null_before = {name: model.page(name, g, 0).clone() for name in model.groups[g]}
    before = model.raw.clone().numpy()
    stager.load(2, [Transfer(g, 1, 0, [0, 0, 13, 14])])
    assert stager.poll() == [(1, True), (2, True)]
    for name in model.groups[g]:
        assert torch.equal(model.page(name, g, 0), null_before[name])
        assert torch.equal(model.page(name, g, 13), model.page(name, g, 6))
    changed = before != model.raw.numpy()
    assert not (changed & ~model.page_ranges(g, [13, 14])).any()


def test_kernel_block_split_views_are_regrouped():
    # Manager block 32 tokens, attention kernel blocks of 16: vLLM's view has 2x the blocks.
    model = Model(
        [kvi.KVCacheGroupSpec(["f0", "f1"], _fa(32))], KVCacheLayout.LBNHC, kernel_block_sizes=[16]
    )
    assert model.caches["f0"].shape[0] == 2 * model.num_blocks
    _fill_random(model, 4)
    host = _host(model)
    stager = _stager(model, host)
    stager.store(1, [Transfer(0, 0, 0, [2, 3])])
    stager.load(2, [Transfer(0, 0, 0, [5, 6])])
    assert stager.poll() == [(1, True), (2, True)]
    for name in model.groups[0]:
        assert torch.equal(model.page(name, 0, 5), model.page(name, 0, 2))
        assert torch.equal(model.page(name, 0, 6), model.page(name, 0, 3))


def test_coalesce_merges_only_adjacent_pages():
    assert _coalesce([3, 4, 5, 9, 10, 2], 64, 64) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert _coalesce([3, 4], 128, 64) == [(0, 3, 1), (1, 4, 1)]  # padded stride: never merged


def test_bad_transfers_fail_the_job_without_raising():
    model = ALL_MODELS[0].values[0]
    stager = _stager(model, _host(model))
    stager.store(1, [Transfer(0, 0, 0, [model.num_blocks])])  # block id out of range
    stager.load(2, [Transfer(0, 99, 0, [1])])  # slot out of range
    stager.store(3, [Transfer(0, 0, BPC - 1, [1, 2])])  # past the chunk end
    assert stager.poll() == [(1, False), (2, False), (3, False)]
    assert stager.poll() == []


def test_page_size_mismatch_is_rejected():
    model = ALL_MODELS[0].values[0]
    with pytest.raises(ValueError, match="page"):
        make_stager(
            model.caches,
            model.groups,
            _host(model),
            num_blocks=model.num_blocks,
            blocks_per_chunk=BPC,
            shard_bytes=_host(model).shape[1],
            group_page_bytes=[p + 2 for p in model.pages],
        )


def test_unusable_groups_fail_their_jobs_only():
    """vLLM hands every group; one that cannot be staged must not take the others down."""
    model = ALL_MODELS[0].values[0]
    _fill_random(model, 7)
    host = _host(model)
    stager = make_stager(
        model.caches,
        [*model.groups, []],  # plus a group without layers
        host,
        num_blocks=model.num_blocks,
        blocks_per_chunk=BPC,
        shard_bytes=host.shape[1],
        group_page_bytes=[model.pages[0] + 2, *model.pages[1:], 0],  # group 0: wrong page size
    )
    assert set(stager.group_errors) == {0, len(model.groups)}
    stager.store(1, [Transfer(0, 0, 0, [1])])
    stager.store(2, [Transfer(len(model.groups), 0, 0, [1])])
    stager.store(3, [Transfer(1, 0, 0, [4])])
    assert stager.poll() == [(1, False), (2, False), (3, True)]


# ---- backend choice ----------------------------------------------------------------------------


@needs_two_cpus
def test_cpu_copy_threads_spread_over_the_cores_even_when_started_from_one():
    """In a vLLM CPU worker the stager is built, and its jobs submitted, on the main thread,
    which vLLM binds to OpenMP thread 0's core: the pool's threads (started by the submitting
    thread, inheriting its binding) still run on every core of the process, so a job's copies
    spread over the cores as ``copy_threads`` says instead of queueing on one."""
    model = ALL_MODELS[0].values[0]
    _fill_random(model, 5)
    chunks = [[1, 2], [3, 4], [5], [6, 7]]
    host = _host(model, slots=len(chunks))
    others = set(thread_cpus("kvs-copy"))  # other stagers' threads, if any are still alive
    stager = on_one_cpu(lambda: _stager(model, host, copy_threads=2))
    try:
        on_one_cpu(lambda: stager.store(1, [Transfer(0, s, 0, ids) for s, ids in enumerate(chunks)]))
        assert stager.poll() == [(1, True)]
        mine = {tid: cpus for tid, cpus in thread_cpus("kvs-copy").items() if tid not in others}
    finally:
        stager.close()
    assert mine and all(cpus == PROCESS_CPUS for cpus in mine.values()), mine


def test_make_stager_picks_the_cpu_backend_for_cpu_tensors():
    model = ALL_MODELS[0].values[0]
    # The stream backend's options are accepted and ignored, so one call site serves every device.
    stager = _stager(model, _host(model), max_stage_bytes=1 << 20, pin=False, copy_threads=2)
    assert type(stager) is CpuStager and stager.copies_on_host
    stager.close()


def test_calling_the_base_builds_the_backend():
    """``DeviceStager(...)`` (the single class callers used to build) still returns a working
    stager for the tensors' device; the backends construct normally."""
    model = ALL_MODELS[0].values[0]
    host = _host(model)
    stager = DeviceStager(
        model.caches,
        model.groups,
        host,
        num_blocks=model.num_blocks,
        blocks_per_chunk=BPC,
        shard_bytes=host.shape[1],
        group_page_bytes=model.pages,
        copy_threads=1,
    )
    assert type(stager) is CpuStager and isinstance(stager, DeviceStager)
    stager.store(1, [Transfer(0, 0, 0, [1])])
    assert stager.poll() == [(1, True)]


def test_unsupported_device_is_rejected():
    caches = {"l0": torch.empty((4, 2, 16, 64), dtype=torch.bfloat16, device="meta")}
    with pytest.raises(ValueError, match="meta"):
        make_stager(caches, [["l0"]], torch.zeros((1, 1 << 16), dtype=torch.uint8),
                    num_blocks=4, blocks_per_chunk=BPC, shard_bytes=1 << 16)
    with pytest.raises(ValueError, match="no KV cache tensors"):
        make_stager({}, [], torch.zeros((1, 16), dtype=torch.uint8),
                    num_blocks=4, blocks_per_chunk=BPC, shard_bytes=16)


@pytest.mark.parametrize("model", ALL_MODELS[:4])
def test_cpu_load_now_copies_one_chunk_synchronously(model: Model):
    """The landing waiter's per-chunk copy: same bytes as ``load``, nothing left to wait for."""
    _fill_random(model, 8)
    host = _host(model)
    stager = _stager(model, host)
    g = len(model.groups) - 1
    stager.store(1, [Transfer(g, 2, 1, [5, 6, 0])])
    assert stager.poll() == [(1, True)]
    want = {n: (model.page(n, g, 5).clone(), model.page(n, g, 6).clone()) for n in model.groups[g]}
    stager.load_now((g, 2, 1, [9, 10, 0]))  # a plain tuple, as the landing waiter passes it
    for n, (p5, p6) in want.items():
        assert torch.equal(model.page(n, g, 9), p5) and torch.equal(model.page(n, g, 10), p6)
    assert stager.poll() == [] and stager.pending == 0
    stager.wait([1])  # a no-op on CPU: the copies are already done
    assert stager.mark_compute() is None
    with pytest.raises(IndexError):
        stager.load_now(Transfer(g, stager.num_slots, 0, [1]))
    stager.close()


def test_stream_stager_has_no_load_now():
    from accel_double import FakeDevice

    model = ALL_MODELS[0].values[0]
    host = _host(model)
    stager = StreamStager(model.caches, model.groups, host, backend=FakeDevice([model.raw], [host]),
                          num_blocks=model.num_blocks, blocks_per_chunk=BPC,
                          shard_bytes=host.shape[1], group_page_bytes=model.pages)
    assert not stager.copies_on_host
    with pytest.raises(RuntimeError, match="load_now"):
        stager.load_now(Transfer(0, 0, 0, [1]))


# ---- accelerator -------------------------------------------------------------------------------

def moved_pages(model: Model, g: int, src: list[list[int]], dst: list[list[int]]) -> dict:
    """What a store of blocks ``src`` then a load into blocks ``dst`` (same chunk positions)
    must leave in the destination pages of group ``g``: ``{(layer, dst block): page}``."""
    return {
        (n, d): model.page(n, g, s).clone()
        for n in model.groups[g]
        for a, b in zip(src, dst, strict=True)
        for s, d in zip(a, b, strict=True)
        if s
    }


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.LHBNC])
def test_cuda_round_trip(layout: KVCacheLayout):
    model = Model(MODELS["sw+fa"](), layout, device="cuda")
    _fill_random(model, 5)
    shard = max(len(g) * BPC * p for g, p in zip(model.groups, model.pages, strict=True))
    slab = _device_slab(shard, 8)
    try:
        stager = make_stager(
            model.caches,
            model.groups,
            slab,
            num_blocks=model.num_blocks,
            blocks_per_chunk=BPC,
            shard_bytes=shard,
        )
        assert isinstance(stager, StreamStager) and not stager.copies_on_host
        assert slab.pinned
        g = 1
        src = [[5, 1, 8, 2], [9, 0, 11]]  # a whole chunk and a partial one with a null block
        dst = [[20, 21, 22, 23], [30, 0, 31]]
        want = moved_pages(model, g, src, dst)
        stager.store(1, [Transfer(g, 0, 0, src[0]), Transfer(g, 1, 1, src[1])])
        stager.wait([1])
        before = model.raw.cpu().numpy().copy()
        stager.load(2, [Transfer(g, 0, 0, dst[0]), Transfer(g, 1, 1, dst[1])])
        stager.wait([2])
        assert stager.poll() == [(1, True), (2, True)]
        for (n, d), page in want.items():
            assert torch.equal(model.page(n, g, d), page)
        changed = before != model.raw.cpu().numpy()
        assert not (changed & ~model.page_ranges(g, [20, 21, 22, 23, 30, 31])).any()
        stager.close()
    finally:
        slab.close()


def _device_slab(shard: int, slots: int):
    """A slab where the stager's would be (/dev/shm): on the H200 lent to this project,
    cudaHostRegister failed on a file mapping under /tmp (docs/BENCHMARKS.md "GPU")."""
    import uuid

    from kvstrata.tiers.host import HostSlab, default_slab_path

    slab = HostSlab(default_slab_path(f"test-{uuid.uuid4().hex}"), shard, slots)
    slab.unlink()  # the mapping stays; nothing is left behind
    return slab


def _cuda_stager(slots: int = 8):
    model = Model(MODELS["sw+fa"](), KVCacheLayout.LBNHC, device="cuda")
    _fill_random(model, 9)
    shard = max(len(g) * BPC * p for g, p in zip(model.groups, model.pages, strict=True))
    slab = _device_slab(shard, slots)
    stager = make_stager(model.caches, model.groups, slab, num_blocks=model.num_blocks,
                         blocks_per_chunk=BPC, shard_bytes=shard, group_page_bytes=model.pages)
    return model, slab, stager


# Long enough (about a second of GPU clock) that the copies of a few pages finish well inside it.
_BUSY_CYCLES = 2_000_000_000


@pytest.mark.cuda
@needs_cuda
def test_cuda_load_completes_while_the_compute_stream_is_busy():
    """A load never makes compute wait and never waits for compute queued after it."""
    model, slab, stager = _cuda_stager()
    try:
        stager.store(1, [Transfer(1, 0, 0, [5, 6, 7, 8])])
        stager.wait([1])
        stager.load(2, [Transfer(1, 0, 0, [20, 21, 22, 23])])
        compute = torch.cuda.current_stream()
        torch.cuda._sleep(_BUSY_CYCLES)  # the next forward
        stager.wait([2])
        assert not compute.query(), "the load waited for the compute work queued after it"
        # And the store waits for the forward it follows (mark), not for later work.
        torch.cuda._sleep(1000)
        mark = stager.mark_compute()
        torch.cuda._sleep(_BUSY_CYCLES)  # the step's sampling and the next forward
        stager.store(3, [Transfer(1, 1, 0, [9, 10])], after=mark)
        stager.wait([3])
        assert not compute.query(), "the store waited for work queued after its forward"
        assert sorted(stager.poll()) == [(1, True), (2, True), (3, True)]
        for n in model.groups[1]:
            for s, d in zip([5, 6, 7, 8], [20, 21, 22, 23], strict=True):
                assert torch.equal(model.page(n, 1, d), model.page(n, 1, s))
        torch.cuda.synchronize()
        stager.close()
    finally:
        slab.close()


@pytest.mark.cuda
@needs_cuda
def test_cuda_jobs_in_flight_hold_no_device_memory():
    model, slab, stager = _cuda_stager(slots=16)
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda._sleep(_BUSY_CYCLES)  # keeps every store below in flight
        mark = stager.mark_compute()
        for job in range(8):
            stager.store(job, [Transfer(1, job, 0, [4 * job + 1 + i for i in range(4)])], after=mark)
        assert stager.pending == 8
        assert torch.cuda.memory_allocated() == before
        stager.wait(range(8))
        assert [ok for _, ok in stager.poll()] == [True] * 8
        stager.close()
    finally:
        slab.close()
