"""``StreamStager`` (CUDA/XPU) and the connector worker driving it, on a controlled accelerator.

The real stager and worker code run against ``accel_double.FakeDevice``: copies happen when the
test runs a stream, events complete then, copies can fail part-way, events can raise. Each test is
one rule of vLLM 0.32's offloading worker contract (docs/DESIGN.md "tiers/device/").
"""

from __future__ import annotations

import threading
import time
import types
import weakref

import numpy as np
import pytest
import torch
from accel_double import FakeDevice
from test_device import ALL_MODELS, BPC, Model, _fa, _fill_random, _host, kvi, moved_pages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvstrata.connector.metadata import ChunkCopy, StrataMetadata, TransferJob
from kvstrata.connector.worker import StrataWorker
from kvstrata.tiers.device import StreamStager, Transfer
from kvstrata.tiers.landing import LandingWaiter

MODEL = ALL_MODELS[0].values[0]


def _fake(
    model: Model, host: torch.Tensor, *, pinned: bool = True, per_call: int = 256, pace: int = 4
) -> tuple[StreamStager, FakeDevice]:
    dev = FakeDevice([model.raw], [host], host_pinned=pinned)
    shard = max(len(g) * BPC * p for g, p in zip(model.groups, model.pages, strict=True))
    stager = StreamStager(
        model.caches,
        model.groups,
        host,
        backend=dev,
        num_blocks=model.num_blocks,
        blocks_per_chunk=BPC,
        shard_bytes=shard,
        group_page_bytes=model.pages,
        host_pinned=pinned,
        max_stage_bytes=model.pages[0],  # earlier versions' staging cap: one page
        descriptors_per_call=per_call,
        pace_depth=pace,
    )
    dev.before_run = stager.wait_issued
    return stager, dev


def _streams(dev: FakeDevice):
    # The stager makes its store stream, then its load stream.
    store, load = dev.created_streams
    return store, load


def _slot_pages(model: Model, host: torch.Tensor, g: int, slot: int, n: int) -> list[torch.Tensor]:
    page = model.pages[g]
    return [
        host[slot, (li * BPC + j) * page : (li * BPC + j + 1) * page].view(torch.int8).clone()
        for li in range(len(model.groups[g]))
        for j in range(n)
    ]


def _want_pages(model: Model, g: int, blocks: list[int]) -> list[torch.Tensor]:
    return [model.page(n, g, b).clone() for n in model.groups[g] for b in blocks]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---- copies through the double: every layout, bit-exact ---------------------------------------


@pytest.mark.parametrize("model", ALL_MODELS)
def test_round_trip_is_bit_exact_through_dma_descriptors(model: Model):
    """Whole chunks, partial chunks, null blocks, non-dense pages (LHBNC): the descriptors address
    exactly the reference pages, and a load changes nothing but its pages."""
    _fill_random(model, 6)
    host = _host(model, slots=4)
    stager, dev = _fake(model, host)
    g = len(model.groups) - 1
    src = [[5, 6, 1, 2], [9, 0, 11]]
    dst = [[20, 21, 22, 23], [30, 0, 31]]
    want = moved_pages(model, g, src, dst)
    stager.store(1, [Transfer(g, 0, 0, src[0]), Transfer(g, 1, 1, src[1])])
    dev.run()
    before = model.raw.clone().numpy()
    stager.load(2, [Transfer(g, 0, 0, dst[0]), Transfer(g, 1, 1, dst[1])])
    dev.run()
    assert stager.poll() == [(1, True), (2, True)]
    for (n, d), page in want.items():
        assert torch.equal(model.page(n, g, d), page)
    changed = before != model.raw.numpy()
    assert not (changed & ~model.page_ranges(g, [20, 21, 22, 23, 30, 31])).any()
    assert stager.pending == 0 and stager.bytes_stored == stager.bytes_loaded > 0


def test_kernel_block_split_views_through_dma_descriptors():
    """Manager blocks of 32 tokens over attention kernel blocks of 16 (vLLM's view has twice the
    blocks): descriptors address whole manager pages."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    model = Model([kvi.KVCacheGroupSpec(["f0", "f1"], _fa(32))], KVCacheLayout.LBNHC,
                  kernel_block_sizes=[16])
    _fill_random(model, 4)
    host = _host(model)
    stager, dev = _fake(model, host)
    stager.store(1, [Transfer(0, 0, 0, [2, 3])])
    dev.run()  # the scheduler loads a slot only once its store completed
    stager.load(2, [Transfer(0, 0, 0, [5, 6])])
    dev.run()
    assert stager.poll() == [(1, True), (2, True)]
    for name in model.groups[0]:
        assert torch.equal(model.page(name, 0, 5), model.page(name, 0, 2))
        assert torch.equal(model.page(name, 0, 6), model.page(name, 0, 3))


def test_a_group_whose_layers_are_placed_differently_round_trips():
    """One plan per page shape (a dense layer, one with the block dim inside its page, another
    dense one): each layer's descriptors address its own pages, and a load moves exactly them."""
    from kvstrata.tiers.device.layout import layer_pages
    from kvstrata.tiers.device.stream import plan_layers

    blocks, heads, tokens, dim = 12, 2, 4, 8
    raw = torch.randint(-128, 128, (3 * blocks * heads * tokens * dim * 2,), dtype=torch.int8)
    part = raw.view(torch.bfloat16).chunk(3)
    caches = {
        "a": part[0].view(blocks, heads, tokens, dim),
        "b": part[1].view(heads, blocks, tokens, dim).permute(1, 0, 2, 3),  # block dim inside
        "c": part[2].view(blocks, heads, tokens, dim),
    }
    plans = plan_layers([layer_pages(t, blocks, n) for n, t in caches.items()])
    assert [p.index.tolist() for p in plans] == [[0, 2], [1]]
    page = heads * tokens * dim * 2
    host = torch.zeros(2, 3 * BPC * page, dtype=torch.uint8)
    dev = FakeDevice([raw], [host], host_pinned=True)
    stager = StreamStager(caches, [list(caches)], host, backend=dev, num_blocks=blocks,
                          blocks_per_chunk=BPC, shard_bytes=3 * BPC * page, host_pinned=True)
    dev.before_run = stager.wait_issued

    def pages(t: torch.Tensor, ids: list[int]) -> torch.Tensor:  # bytes: random bf16 has NaNs
        return t[ids].contiguous().view(torch.int8)

    want = {n: pages(t, [1, 2, 4]) for n, t in caches.items()}
    before = {n: t.clone() for n, t in caches.items()}
    stager.store(1, [Transfer(0, 0, 0, [1, 2, 0, 4])])
    dev.run()
    stager.load(2, [Transfer(0, 0, 0, [7, 8, 0, 9])])
    dev.run()
    assert stager.poll() == [(1, True), (2, True)]
    for n, t in caches.items():
        assert torch.equal(pages(t, [7, 8, 9]), want[n]), n
        others = [b for b in range(blocks) if b not in (7, 8, 9)]
        assert torch.equal(pages(t, others), pages(before[n], others)), n


def test_adjacent_pages_merge_into_one_copy():
    from kvstrata.tiers.device.stream import merge_adjacent

    src, dst, sizes = (np.array(v, np.int64) for v in ([0, 64, 128, 512], [1000, 1064, 2000, 2064], [64] * 4))
    s, d, n = merge_adjacent(src, dst, sizes)
    assert s.tolist() == [0, 128, 512] and d.tolist() == [1000, 2000, 2064] and n.tolist() == [128, 64, 64]


# ---- the rules ---------------------------------------------------------------------------------


def test_copies_happen_on_the_device_not_at_submission():
    """No byte moves on the engine thread: the copy engine moves them when the stream runs."""
    _fill_random(MODEL, 1)
    host = _host(MODEL)
    stager, dev = _fake(MODEL, host)
    stager.store(1, [Transfer(0, 2, 0, [3, 4, 5, 6])])
    assert not host.any(), "bytes moved before the device ran the copy"
    assert stager.poll() == [] and stager.pending == 1
    dev.run()
    assert stager.poll() == [(1, True)]
    assert _same(_slot_pages(MODEL, host, 0, 2, 4), _want_pages(MODEL, 0, [3, 4, 5, 6]))


def test_device_bytes_held_by_the_stager_stay_under_the_cap_with_jobs_in_flight():
    """Jobs in flight hold no device memory: only pooled pinned host descriptors (earlier
    versions kept a staging buffer per batch until the job was polled)."""
    cap = 0  # kvstrata's own device memory: none
    _fill_random(MODEL, 2)
    host = _host(MODEL, slots=6)
    stager, dev = _fake(MODEL, host)
    spy = _AllocationSpy()
    for job in range(1, 5):
        with spy:
            stager.store(job, [Transfer(0, job, 0, [job * 4 + i for i in range(4)])])
        assert spy.held() <= cap, f"{spy.held()} bytes held with {job} jobs in flight"
    assert stager.pending == 4
    assert stager.descriptor_buffers <= 3 * 4
    dev.run()
    assert [ok for _, ok in stager.poll()] == [True] * 4


def test_async_load_never_makes_the_compute_stream_wait():
    """The worker's loads complete by event and are reported in finished_recving; the forward
    never waits on them (earlier versions made the compute stream wait on every load)."""
    _fill_random(MODEL, 3)
    host = _host(MODEL)
    worker, stager, dev = _worker(MODEL, host)
    worker.start_load_kv(StrataMetadata(loads=[_job(7, "r1", False, 0, 1, [20, 21])]))
    assert dev.compute.waits() == 0, "the compute stream waits on a load"
    assert dev.host_syncs == 0
    assert worker.get_finished() == (set(), set(), set())  # not copied yet: not reported
    dev.run()  # the load waits for the compute stream's queued work, never the reverse
    assert worker.get_finished() == (set(), {"r1"}, set())
    assert dev.compute.waits() == 0 and dev.host_syncs == 0


def test_stores_go_out_at_the_next_step_after_their_forward_not_after_sampling():
    """wait_for_save records the forward's event; the copies are issued at the next step's start
    and wait for that forward only: sampling queued after it does not delay them, and the
    copies read what the forward wrote."""
    _fill_random(MODEL, 4)
    host = _host(MODEL)
    worker, stager, dev = _worker(MODEL, host)
    blocks = [8, 9, 10, 11]
    fresh = {n: torch.full_like(MODEL.caches[n][b], 7) for n in MODEL.groups[0] for b in blocks}

    def forward() -> None:  # step N writes the blocks the store reads
        for n in MODEL.groups[0]:
            for b in blocks:
                MODEL.caches[n][b].copy_(fresh[n])

    dev.kernel(forward)
    worker.wait_for_save(StrataMetadata(stores=[_job(3, "r1", True, 1, 0, blocks)]))
    dev.kernel(lambda: None)  # step N's sampling
    store_stream, _ = _streams(dev)
    assert not store_stream.ops and not host.any(), "a store was issued before the next step"
    worker.handle_preemptions(StrataMetadata())  # step N+1 starts
    stager.wait_issued()
    assert store_stream.ops, "the next step's start issues the deferred stores"
    assert dev.run(dev.compute, ops=2) == 2  # the forward and the event after it; not sampling
    dev.run(store_stream)
    assert dev.compute.ops, "sampling still queued"
    assert worker.get_finished() == (set(), set(), set())
    assert worker.build_worker_meta().completed == {3: 1}
    assert _same(_slot_pages(MODEL, host, 0, 1, 4), _want_pages(MODEL, 0, blocks))


def test_flush_and_shutdown_finish_deferred_stores():
    """Block reuse fences: a store still deferred when its blocks change hands is issued and
    waited for before the step's forward; shutdown issues and waits for the rest."""
    _fill_random(MODEL, 5)
    host = _host(MODEL)
    worker, stager, dev = _worker(MODEL, host)
    worker.wait_for_save(StrataMetadata(stores=[_job(1, "a", True, 0, 0, [2, 3]), _job(2, "b", True, 1, 0, [4])]))
    worker.handle_preemptions(StrataMetadata(flush={1}))
    assert dev.host_syncs >= 1
    assert _same(_slot_pages(MODEL, host, 0, 0, 2), _want_pages(MODEL, 0, [2, 3]))
    worker.wait_for_save(StrataMetadata(stores=[_job(3, "c", True, 2, 0, [5])]))
    worker.shutdown()
    assert dev.idle()
    assert _same(_slot_pages(MODEL, host, 0, 2, 1), _want_pages(MODEL, 0, [5]))


def test_polling_is_in_order_per_stream_and_independent_across_streams():
    """Several jobs in flight: a job is reported once its own copies ran, in submission order on
    its stream; a load finishing first is reported while earlier stores still run."""
    _fill_random(MODEL, 6)
    host = _host(MODEL, slots=6)
    stager, dev = _fake(MODEL, host)
    for job in (1, 2, 3):
        stager.store(job, [Transfer(0, job, 0, [job * 4, job * 4 + 1])])
    stager.load(4, [Transfer(0, 0, 0, [30, 31])])
    store_stream, load_stream = _streams(dev)
    dev.run(dev.compute)
    dev.run(load_stream)
    assert stager.poll() == [(4, True)]
    # Run the store stream one op at a time: each job is a wait, a copy and a record.
    dev.run(store_stream, ops=3)
    assert stager.poll() == [(1, True)]
    assert not host[2].any() and not host[3].any(), "a later job's bytes landed before its copy ran"
    dev.run(store_stream, ops=3)
    assert stager.poll() == [(2, True)] and stager.pending == 1
    dev.run()
    assert stager.poll() == [(3, True)] and stager.poll() == []


def test_wait_blocks_until_the_job_finished_and_poll_still_reports_it_once():
    _fill_random(MODEL, 7)
    host = _host(MODEL)
    stager, dev = _fake(MODEL, host)
    stager.store(1, [Transfer(0, 0, 0, [2])])
    stager.store(2, [Transfer(0, 1, 0, [3])])
    stager.wait([2])
    assert dev.host_syncs == 1
    assert _same(_slot_pages(MODEL, host, 0, 1, 1), _want_pages(MODEL, 0, [3]))
    assert stager.poll() == [(1, True), (2, True)]
    assert stager.poll() == []
    stager.wait([1, 2, 99])  # finished or unknown jobs: nothing to wait for
    assert dev.host_syncs == 1


def test_a_copy_failing_mid_job_fails_the_job_after_its_issued_copies_ran():
    """The driver fails after part of a job was queued: the job is reported failed, not before
    the copies it did queue have run (they still read its descriptors and write its slot), and
    the next job is unaffected."""
    _fill_random(MODEL, 8)
    host = _host(MODEL)
    stager, dev = _fake(MODEL, host)
    dev.fail_next_copy = 1
    stager.store(1, [Transfer(0, 0, 0, [2, 4, 6, 8])])
    stager.store(2, [Transfer(0, 1, 0, [3])])
    assert stager.poll() == []
    dev.run()
    assert dev.copies_run >= 2  # the failed job's one queued copy, and job 2's
    assert stager.poll() == [(1, False), (2, True)]
    assert _same(_slot_pages(MODEL, host, 0, 1, 1), _want_pages(MODEL, 0, [3]))
    assert stager.bytes_stored == MODEL.pages[0] * len(MODEL.groups[0])  # only job 2 counts


def test_a_device_error_on_the_event_fails_the_job_without_raising():
    _fill_random(MODEL, 9)
    host = _host(MODEL)
    stager, dev = _fake(MODEL, host)
    stager.load(1, [Transfer(0, 0, 0, [2])])
    dev.run()
    dev.fail_query = True
    assert stager.poll() == [(1, False)]
    stager.store(2, [Transfer(0, 1, 0, [3])])
    stager.wait([2])  # the wait fails on the device: the job fails, nothing raises into vLLM
    assert stager.poll() == [(2, False)]
    assert stager.descriptor_buffers == 0, "buffers a lost job may still be read are never pooled"


def test_descriptor_buffers_live_until_their_job_completes_then_are_reused():
    """A job's descriptors are read by the device until its event completes: a job issued while
    another is in flight gets other buffers; finished jobs' buffers are pooled."""
    _fill_random(MODEL, 10)
    host = _host(MODEL, slots=6)
    stager, dev = _fake(MODEL, host)
    stager.store(1, [Transfer(0, 0, 0, [2, 5])])
    stager.store(2, [Transfer(0, 1, 0, [9, 12])])  # while job 1's descriptors are unread
    dev.run()
    assert stager.poll() == [(1, True), (2, True)]
    assert _same(_slot_pages(MODEL, host, 0, 0, 2), _want_pages(MODEL, 0, [2, 5]))
    made = dev.descriptor_buffers_made
    assert made == 6
    for job in range(3, 13):
        stager.load(job, [Transfer(0, job % 2, 0, [20 + job])])
        dev.run()
        assert stager.poll() == [(job, True)]
    assert dev.descriptor_buffers_made == made, "finished jobs' buffers are reused"


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_copies_are_never_issued_from_the_engine_thread(pinned: bool):
    """The copy op's enqueueing took 8-14 ms per 1 GiB job on an H200, and from pageable memory
    it blocks its caller until the stream reaches it: jobs go
    out from copy threads, the engine thread only hands them over, and jobs still complete by
    poll."""
    _fill_random(MODEL, 11)
    host = _host(MODEL)
    threads_before = set(threading.enumerate())
    stager, dev = _fake(MODEL, host, pinned=pinned)
    stager.store(1, [Transfer(0, 3, 0, [6, 7])])
    stager.load(2, [Transfer(0, 0, 0, [40])])
    assert not host.any(), "bytes moved on the engine thread"
    stager.wait([1, 2])
    assert dev.engine_thread_copies == 0 and dev.engine_thread_blocks == 0
    assert stager.poll() == [(1, True), (2, True)]
    assert _same(_slot_pages(MODEL, host, 0, 3, 2), _want_pages(MODEL, 0, [6, 7]))
    stager.close()
    assert set(threading.enumerate()) <= threads_before, "close() left copy threads running"


def test_a_job_goes_out_in_paced_calls_of_bounded_size_and_a_failing_call_ends_it():
    """The driver holds a lock while the copy op enqueues and the engine thread's kernel launches
    wait for it (on an H200 a 6.9 ms forward took 13-20 ms while a 16k-descriptor job was
    issued): a job goes out in calls of at most ``descriptors_per_call``, at most ``pace_depth``
    of them queued ahead of the device (on events reused across jobs), bit-exact; a call failing
    part-way fails the job once its queued copies ran, and the job makes no later call."""
    _fill_random(MODEL, 12)
    host = _host(MODEL, slots=4)
    stager, dev = _fake(MODEL, host, per_call=3, pace=2)
    blocks = [2, 5, 9, 12]  # not adjacent: one descriptor per block and layer, nothing merged
    stager.store(1, [Transfer(0, 0, 0, blocks)])
    dev.run()
    total = len(blocks) * len(MODEL.groups[0])
    assert sum(dev.call_sizes) == total and max(dev.call_sizes) == 3
    assert len(dev.call_sizes) == -(-total // 3)
    assert dev.paced_waits >= len(dev.call_sizes) - 2 > 0 and dev.most_calls_queued == 2
    assert stager.poll() == [(1, True)]
    assert _same(_slot_pages(MODEL, host, 0, 0, 4), _want_pages(MODEL, 0, blocks))
    calls = len(dev.call_sizes)
    dev.fail_next_copy = 1
    stager.store(2, [Transfer(0, 1, 0, blocks)])
    stager.store(3, [Transfer(0, 2, 0, blocks)])
    dev.run()
    assert stager.poll() == [(2, False), (3, True)]
    assert len(dev.call_sizes) == calls + 1 + calls, "job 2 went on after its failed call"
    assert dev.blocking_events_made == 2, "pacing events are reused, job after job"
    assert _same(_slot_pages(MODEL, host, 0, 2, 4), _want_pages(MODEL, 0, blocks))


@pytest.fixture
def releasing():
    """Registers stagers whose holds the test sets long: released at teardown even when the test
    fails, so no copy thread stays blocked (the interpreter joins them at exit)."""
    stagers: list[StreamStager] = []
    yield stagers.append
    for stager in stagers:
        stager.launch_hold_s = 0.0
        stager.release_copies()


def test_no_copy_call_is_made_while_a_forward_is_launched(releasing):
    """On an H200 a 7 ms forward of 40 launches took 1.07-1.16x as long with a job submitted
    at its start (each copy call holds the driver's lock the launches take, and building the
    descriptors holds the GIL): between ``hold_copies`` and ``release_copies`` the copy threads
    do neither; then the jobs go out, bit-exact."""
    _fill_random(MODEL, 13)
    host = _host(MODEL)
    stager, dev = _fake(MODEL, host)
    releasing(stager)
    stager.launch_hold_s = 60.0
    stager.hold_copies()
    assert stager.copies_held
    stager.store(1, [Transfer(0, 3, 0, [6, 7])])
    stager.load(2, [Transfer(0, 0, 0, [40])])
    time.sleep(0.1)  # an unheld copy thread builds and calls within a millisecond
    assert dev.call_sizes == [], "a copy call was made while the forward was being launched"
    assert dev.descriptor_buffers_made == 0, "descriptors (Python, under the GIL) were built"
    stager.release_copies()
    assert not stager.copies_held
    stager.wait_issued()
    assert len(dev.call_sizes) == 2
    stager.wait([1, 2])
    assert stager.poll() == [(1, True), (2, True)]
    assert _same(_slot_pages(MODEL, host, 0, 3, 2), _want_pages(MODEL, 0, [6, 7]))
    assert _same(_want_pages(MODEL, 0, [40]), _slot_pages(MODEL, host, 0, 0, 1))
    stager.close()


def test_a_job_under_way_keeps_the_copy_engine_fed_through_a_hold_and_the_next_one_waits(releasing):
    """Holding a job's copy calls did not shorten the stall on an H200 (holding its start did):
    a hold arriving mid-job lets that job's calls go on, and only the next job waits."""
    _fill_random(MODEL, 16)
    host = _host(MODEL, slots=4)
    stager, dev = _fake(MODEL, host, per_call=3, pace=2)
    releasing(stager)
    stager.launch_hold_s = 3600.0
    issue = dev.copy_batch

    def next_step_starts_after_the_first_call(*args, **kwargs):
        issue(*args, **kwargs)
        if len(dev.call_sizes) == 1:
            stager.hold_copies()

    dev.copy_batch = next_step_starts_after_the_first_call
    blocks = [2, 5, 9, 12]  # not adjacent: one descriptor per block and layer
    calls = -(-len(blocks) * len(MODEL.groups[0]) // 3)
    assert calls > 2
    stager.store(1, [Transfer(0, 0, 0, blocks)])
    stager.store(2, [Transfer(0, 1, 0, blocks)])
    deadline = time.monotonic() + 30
    while len(dev.call_sizes) < calls and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(dev.call_sizes) == calls, "the job under way stopped at the hold"
    time.sleep(0.1)
    assert stager.copies_held and len(dev.call_sizes) == calls, "the next job started held"
    stager.release_copies()
    stager.wait([1, 2])
    assert stager.poll() == [(1, True), (2, True)]
    assert len(dev.call_sizes) == 2 * calls
    assert _same(_slot_pages(MODEL, host, 0, 1, 4), _want_pages(MODEL, 0, blocks))
    stager.close()


def test_a_hold_never_outlasts_its_limit_nor_an_engine_thread_waiting_for_copies(releasing):
    _fill_random(MODEL, 14)
    host = _host(MODEL)
    stager, dev = _fake(MODEL, host)
    releasing(stager)
    stager.launch_hold_s = 0.05
    stager.hold_copies()  # never released: the hold lapses
    stager.store(1, [Transfer(0, 3, 0, [6, 7])])
    stager.wait_issued()
    assert dev.call_sizes and not stager.copies_held
    stager.launch_hold_s = 3600.0
    stager.hold_copies()
    stager.store(2, [Transfer(0, 2, 0, [8])])
    waiter = threading.Thread(target=stager.wait, args=([1, 2],))
    waiter.start()  # would wait an hour if waiting kept the hold
    waiter.join(timeout=60)
    assert not waiter.is_alive(), "an engine thread waiting for copies kept them held"
    assert stager.poll() == [(1, True), (2, True)]
    stager.launch_hold_s = 0.0
    stager.hold_copies()  # 0: copies are never held
    assert not stager.copies_held
    stager.close()


def test_the_worker_holds_copies_from_a_step_start_until_its_forward_is_launched(releasing):
    """vLLM 0.32's runner: handle_preemptions at the step's start, then the forward's launch,
    with start_load_kv before it when the step has synchronous loads and after it otherwise,
    then wait_for_save (kv_connector_model_runner_mixin.py)."""
    _fill_random(MODEL, 15)
    host = _host(MODEL)
    worker, stager, dev = _worker(MODEL, host)
    releasing(stager)
    stager.launch_hold_s = 60.0
    worker.wait_for_save(StrataMetadata(stores=[_job(1, "a", True, 0, 0, [2, 3])]))
    worker.handle_preemptions(StrataMetadata())  # issues the deferred store
    assert stager.copies_held, "the step's forward is launched next"
    time.sleep(0.1)
    assert dev.call_sizes == [] and dev.descriptor_buffers_made == 0
    worker.start_load_kv(StrataMetadata(loads=[_job(2, "b", False, 1, 0, [9])]))  # after the forward
    assert not stager.copies_held
    stager.wait_issued()
    assert len(dev.call_sizes) == 2
    worker.wait_for_save(StrataMetadata())
    worker.handle_preemptions(StrataMetadata())
    syncs = dev.host_syncs
    sync = TransferJob(3, "c", False, [ChunkCopy(0, 1, 0, (9,))], sync=True)
    worker.start_load_kv(StrataMetadata(loads=[sync]))  # before the forward: waits for it
    assert dev.host_syncs > syncs, "the synchronous load was waited for"
    assert stager.copies_held, "and the forward is launched next"
    worker.wait_for_save(StrataMetadata())
    assert not stager.copies_held
    worker.shutdown()


def test_a_synchronous_load_counts_what_the_forward_waited_not_the_forward():
    """``load_seconds`` of a synchronous load ends when start_load_kv took its result, before
    the forward; get_finished reports it only after the forward (earlier versions counted the
    forward as load time)."""
    _fill_random(MODEL, 16)
    host = _host(MODEL)
    worker, stager, dev = _worker(MODEL, host)
    sync = TransferJob(4, "d", False, [ChunkCopy(0, 1, 0, (9, 10))], sync=True)
    t0 = time.perf_counter()
    worker.start_load_kv(StrataMetadata(loads=[sync]))
    waited = time.perf_counter() - t0
    time.sleep(0.3)  # the forward
    worker.wait_for_save(StrataMetadata())
    assert worker.get_finished() == (set(), set(), set())  # vLLM runs it at once: no recving
    meta = worker.build_worker_meta()
    assert meta.completed == {4: 1} and meta.bytes_loaded > 0
    assert 0 < meta.load_seconds <= waited, (meta.load_seconds, waited)
    worker.shutdown()


def test_a_build_without_the_copy_primitives_is_refused_at_start_up():
    """XPU or CUDA builds lacking vLLM's swap_blocks_batch (this CPU wheel has none) are refused
    with the missing primitive named, not failed at the first transfer."""
    from kvstrata.tiers.device import TorchCopyDevice

    for kind in ("cuda", "xpu"):
        with pytest.raises(ValueError, match="swap_blocks_batch"):
            TorchCopyDevice(torch.device(kind))


# ---- replicated KV (MLA under tensor parallelism) -----------------------------------------------


def test_replicated_kv_is_written_by_rank_zero_and_read_by_every_rank():
    from kvstrata.connector.plan import KVPlan, replicated_kv

    def cfg(mla: bool, tp: int, replicas: int):
        vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(use_mla=mla),
            parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        )
        return vllm_config, types.SimpleNamespace(kv_tp_replicas=replicas)

    assert replicated_kv(*cfg(True, 2, 2))
    assert not replicated_kv(*cfg(True, 1, 1))
    assert not replicated_kv(*cfg(False, 2, 1))
    assert not replicated_kv(*cfg(True, 2, 1))  # vLLM did not certify the ranks as replicas

    group = types.SimpleNamespace(shard_bytes=lambda bpc: 100 * bpc)
    common = dict(layout=None, groups=(group,), blocks_per_chunk=4, tokens_per_hash=16, world_size=2,
                  identity=None, persistent=True, slab_path=None, num_slots=2)
    ranks = [KVPlan(rank=r, namespaces=(b"n0",), replicated=True, **common) for r in (0, 1)]
    assert [p.shard_index for p in ranks] == [0, 0] and [p.writes_stores for p in ranks] == [True, False]
    assert ranks[0].slot_bytes == 400  # one shard per slot, not one per rank
    split = KVPlan(rank=1, namespaces=(b"n0", b"n1"), **common)
    assert split.shard_index == 1 and split.writes_stores and split.slot_bytes == 800

    # A non-writer rank acknowledges stores without copying; it loads like every rank.
    host = _host(MODEL)
    worker, stager, dev = _worker(MODEL, host, writes=False)
    worker.wait_for_save(StrataMetadata(stores=[_job(5, "r", True, 0, 0, [2])]))
    worker.handle_preemptions(StrataMetadata())
    assert stager.pending == 0 and not host.any()
    worker.get_finished()
    meta = worker.build_worker_meta()
    assert meta.completed == {5: 1} and meta.bytes_stored == 0


# ---- helpers -----------------------------------------------------------------------------------


def _job(job_id: int, req: str, store: bool, slot: int, first: int, blocks: list[int]) -> TransferJob:
    return TransferJob(job_id, req, store, [ChunkCopy(0, slot, first, tuple(blocks))])


def _worker(model: Model, host: torch.Tensor, *, writes: bool = True):
    stager, dev = _fake(model, host)
    plan = types.SimpleNamespace(
        writes_stores=writes,
        group=lambda i: types.SimpleNamespace(
            layer_names=model.groups[i], page_bytes=model.pages[i]
        ),
    )
    worker = StrataWorker(plan, kv_cache_config=None)  # type: ignore[arg-type]
    worker.stager = stager
    worker.landing = LandingWaiter(np.zeros(host.shape[0], np.int64), None)
    return worker, stager, dev


class _AllocationSpy(TorchDispatchMode):
    """Bytes of new tensors created by torch ops while active, still alive (views excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[weakref.ref[torch.Tensor], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs or {}))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.made.append((weakref.ref(t), t.untyped_storage().nbytes()))
        return out

    def held(self) -> int:
        return sum(n for ref, n in self.made if ref() is not None)
