"""The baseline's CPU copy worker moves exactly the bytes the stock vLLM worker would.

No engine: two fake layer tensors, a real ``SharedOffloadRegion`` (in /dev/shm) and the
``GPULoadStoreSpec`` / ``CPULoadStoreSpec`` pairs the OffloadingConnector hands a worker,
including offloaded chunks of two engine blocks entered mid-chunk.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm")

from vllm.utils.math_utils import round_up  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402

from benchmarks.vllm_fs_baseline import CPUCopyWorker  # noqa: E402

PAGE = 512  # bytes per engine block and layer
LAYERS = 2
BLOCKS = 16
CHUNKS = 8


def _worker(bpc: int, threads: int) -> tuple[CPUCopyWorker, list[torch.Tensor], SharedOffloadRegion]:
    layers = [torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE)
                          for i in range(LAYERS)]])
    row = LAYERS * PAGE * bpc
    region = SharedOffloadRegion(
        engine_id=f"kvstrata-test-{uuid.uuid4().hex}", num_chunks=CHUNKS, rank=0,
        kv_bytes_per_chunk=round_up(row, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT),
        cpu_page_size=row)
    return CPUCopyWorker(caches, bpc, region, copy_threads=threads), layers, region


def _host_page(region: SharedOffloadRegion, bpc: int, layer: int, chunk: int, sub: int) -> bytes:
    row = region.base_tensor[chunk * region._row_stride:][:LAYERS * PAGE * bpc]
    start = layer * PAGE * bpc + sub * PAGE
    return bytes(row[start:start + PAGE].numpy())


@pytest.fixture(params=[(1, 1), (2, 1), (2, 2)], ids=["bpc1", "bpc2", "bpc2-threads"])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[int, CPUCopyWorker, list[torch.Tensor],
                                                            SharedOffloadRegion]]:
    bpc, threads = request.param
    worker, layers, region = _worker(bpc, threads)
    yield bpc, worker, layers, region
    worker.shutdown()


def test_store_then_load_round_trip(setup: tuple[int, CPUCopyWorker, list[torch.Tensor],
                                                 SharedOffloadRegion]) -> None:
    bpc, worker, layers, region = setup
    # Request blocks 1..3 live in engine blocks 5, 6, 7. With two blocks per chunk, request block 1
    # is the second half of its chunk: chunks 3 (sub-block 1) and 6 (sub-blocks 0, 1).
    first_index = 1
    blocks = [5, 6, 7]
    chunks = [3, 6] if bpc == 2 else [3, 6, 2]
    where = ([(3, 1), (6, 0), (6, 1)] if bpc == 2 else [(3, 0), (6, 0), (2, 0)])
    assert worker.submit_store(1, GPULoadStoreSpec(blocks, [3], [first_index]),
                               CPULoadStoreSpec(chunks))
    for layer in range(LAYERS):
        for block, (chunk, sub) in zip(blocks, where, strict=True):
            assert _host_page(region, bpc, layer, chunk, sub) == bytes(layers[layer][block].numpy())

    expected = [t[blocks].clone() for t in layers]
    for t in layers:
        t[10:13] = 0
    assert worker.submit_load(2, CPULoadStoreSpec(chunks),
                              GPULoadStoreSpec([10, 11, 12], [3], [first_index]))
    for layer in range(LAYERS):
        assert torch.equal(layers[layer][10:13], expected[layer])
    done = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in done] == [
        (1, True, 3 * LAYERS * PAGE), (2, True, 3 * LAYERS * PAGE)]
    assert worker.get_finished() == []


def test_empty_group_is_a_no_op(setup: tuple[int, CPUCopyWorker, list[torch.Tensor],
                                             SharedOffloadRegion]) -> None:
    _bpc, worker, _layers, _region = setup
    assert worker.submit_load(7, CPULoadStoreSpec([]), GPULoadStoreSpec([], [0], [0]))
    (result,) = worker.get_finished()
    assert result.job_id == 7 and result.success and result.transfer_size == 0
