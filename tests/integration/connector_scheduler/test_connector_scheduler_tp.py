"""Tensor parallelism under vLLM 0.32.0's real Scheduler, on CPU: each rank's own shards (and
replicated KV stored once), from the host tier and from disk; stores and loads that end only when
every rank's did."""

from __future__ import annotations

from pathlib import Path

import pytest
from connector_scheduler_helpers import (
    assert_host_tier_released,
    slow_disk_reads,
    store_then_serve,
    token_prompt,
)
from strata_harness import G

pytestmark = pytest.mark.integration


# ---- tensor parallelism: every slot and every stored chunk holds one shard per rank ---------------
TP_SCENARIOS = [
    ("fa", [G("full", 16)], 100),
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], 99),
    ("fa-mamba", [G("full", 16), G("mamba", 16)], 96),
]


@pytest.mark.parametrize(("name", "groups", "expected"), TP_SCENARIOS, ids=[s[0] for s in TP_SCENARIOS])
def test_tensor_parallel_ranks_load_their_own_shards(runners, name, groups, expected) -> None:
    """Two ranks, their KV different: each rank gets back its own pages (byte-checked per rank),
    and the load counts as finished only once both finished (vLLM's KVOutputAggregator)."""
    r = runners(groups, tp=2)
    assert store_then_serve(r, token_prompt(100)) == expected


def test_tensor_parallel_shards_come_back_from_disk_and_need_every_rank(runners, tmp_path: Path) -> None:
    """After a restart both ranks' shards come from disk. A chunk whose rank-1 record is gone is
    not served (the hit stops before it), and a TP=1 engine on the same store finds nothing."""
    import lmdb
    from strata_harness import EOS
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvstrata import semantics

    store = tmp_path / "persist"
    prompt = token_prompt(100)
    first = runners([G("full", 16)], store=store, tp=2)
    first.serve(prompt, 1)
    sched = first.connector.scheduler
    namespaces = sched.hierarchy.namespaces
    assert len(namespaces) == 2 and namespaces[0] != namespaces[1]
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS)
    probe = Request(request_id="probe", prompt_token_ids=prompt, sampling_params=params,
                    pooling_params=None, block_hasher=first._hasher)
    keys = list(semantics.chunk_keys(probe.block_hashes, sched.layout.groups[0]))
    first.close()

    second = runners([G("full", 16)], store=store, tp=2)
    assert second.serve(prompt, 1) == 100
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] == 7  # 6 chunks + the tail
    second.close()

    with lmdb.open(str(store), max_dbs=4) as raw, raw.begin(write=True) as txn:
        for ns in namespaces:
            assert txn.get(ns + keys[3], db=raw.open_db(b"payload", txn=txn)) is not None
        assert txn.delete(namespaces[1] + keys[3], db=raw.open_db(b"payload", txn=txn))
    third = runners([G("full", 16)], store=store, tp=2)
    assert third.serve(prompt, 1) == 48  # chunks 0-2: chunk 3 lacks rank 1's shard
    assert third.load_errors == []
    third.close()

    assert runners([G("full", 16)], store=store, tp=1).serve(prompt, 1) == 0


def test_a_load_ends_only_when_the_slowest_rank_copied_it(runners, tmp_path: Path, monkeypatch) -> None:
    """Rank 1 copies the landed chunks only once rank 0 has reported the streamed load finished,
    so the ranks report it in different steps. The scheduler must count both: the load job ends
    (its slots unpinned) no earlier than the step rank 1 reports it, and the request runs after."""
    import threading

    from kvstrata.connector.scheduler import StrataScheduler

    if runners.accel:
        pytest.skip("slows the CPU landing copies; accelerators get whole jobs back instead")
    store = tmp_path / "persist"
    prompt = token_prompt(100)
    first = runners([G("full", 16)], store=store, tp=2)
    first.serve(prompt, 1)
    first.close()
    second = runners([G("full", 16)], store=store, tp=2)
    slow_disk_reads(monkeypatch, 0.01)
    landing = second.workers[1].worker.landing
    real_copy = landing._copy
    rank0_reported = threading.Event()

    def copy_after_rank0(transfer):
        assert rank0_reported.wait(60), "rank 0 never reported its load"  # a hang guard
        real_copy(transfer)

    landing._copy = copy_after_rank0
    step = 0
    reported: dict[int, int] = {}  # rank -> step its worker reported the load finished
    for rank, w in enumerate(second.workers):
        real_get_finished = w.worker.get_finished

        def get_finished(rank=rank, real=real_get_finished):
            sending, recving, failed = real()
            if recving:
                reported.setdefault(rank, step)
                if rank == 0:
                    rank0_reported.set()
            return sending, recving, failed

        monkeypatch.setattr(w.worker, "get_finished", get_finished)
    load_ended: list[int] = []
    real_finish = StrataScheduler._finish_job

    def finish_job(self, job_id, job, ok):
        if not job.is_store:
            load_ended.append(step)
        return real_finish(self, job_id, job, ok)

    monkeypatch.setattr(StrataScheduler, "_finish_job", finish_job)
    req = second.add(prompt, 1)
    while not req.is_finished():
        step += 1
        second.step()
        assert step < 1_000_000, f"not finished after {step} steps"  # a hang guard
    second.run_until_idle()
    assert reported[1] > reported[0]  # the ranks did report in different steps
    assert load_ended and load_ended[0] >= reported[1]
    assert second.loaded_tokens[req.request_id] == 100
    assert second.load_errors == []
    assert_host_tier_released(second)


def test_a_store_failed_on_one_rank_is_not_committed_when_another_finishes_later(runners) -> None:
    """Rank 0 reports a store job failed in one step, rank 1 reports it done a step later: the
    chunk would hold a garbage shard for rank 0, so it must not be committed (nor served)."""
    r = runners([G("full", 16)], tp=2)
    rank0, rank1 = (w.worker.stager for w in r.workers)
    stores: set[int] = set()
    real_store, real_poll0, real_poll1 = rank0.store, rank0.poll, rank1.poll

    def store(job_id, copies, **kw):
        stores.add(job_id)
        return real_store(job_id, copies, **kw)

    def poll0():  # every store fails on rank 0
        return [(job, ok and job not in stores) for job, ok in real_poll0()]

    held: list[tuple[int, bool]] = []

    def poll1():  # rank 1 reports each store one poll late
        late, held[:] = list(held), []
        now = []
        for job, ok in real_poll1():
            (held if job in stores else now).append((job, ok))
        return now + late

    rank0.store, rank0.poll, rank1.poll = store, poll0, poll1
    assert r.serve(token_prompt(96), 1) == 0
    assert stores and not held
    r.drop_gpu_prefix_cache()
    assert r.serve(token_prompt(96), 1) == 0  # nothing was committed
    assert r.load_errors == []
    stats = r.connector.scheduler.hierarchy.stats()
    assert stats["stores_completed"] == 0 and stats["stores_failed"] == 12  # 6 chunks, twice


def test_replicated_kv_is_stored_once_and_served_to_every_rank(runners) -> None:
    """MLA under tensor parallelism: every rank holds the same latent. One shard per slot under
    one namespace (host and disk capacity not divided by the TP size), copied by rank 0 only;
    both ranks load it, each checked page by page."""
    r = runners([G("full", 16)], tp=2, replicated=True)
    plan = r.connector.plan
    assert plan.replicated and len(plan.namespaces) == 1 and plan.slot_bytes == plan.shard_bytes
    assert store_then_serve(r, token_prompt(100)) == 100
    rank0, rank1 = (w.worker.stager for w in r.workers)
    assert rank0.bytes_stored > 0 and rank1.bytes_stored == 0
    assert rank0.bytes_loaded == rank1.bytes_loaded > 0
