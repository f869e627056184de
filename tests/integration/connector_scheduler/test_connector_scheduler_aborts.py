"""Aborts, preemption and prefix-cache resets under vLLM 0.32.0's real Scheduler, on CPU: nothing
stays pinned, nothing is served wrong afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
from connector_scheduler_helpers import (
    assert_host_tier_released,
    slow_disk_reads,
    token_prompt,
)
from strata_harness import G

pytestmark = pytest.mark.integration


def test_reset_with_transfers_in_flight_releases_their_slots(runners) -> None:
    """reset_prefix_cache() while stores are in flight: when they finish their slots are given
    back (not left pinned and "being stored" forever) and their KV is not served."""
    r = runners([G("full", 16)], extra={"disk": False})
    hierarchy = r.connector.scheduler.hierarchy
    r.add(token_prompt(100), 4)
    seen = {}

    def reset_mid_step() -> None:
        seen.update(hierarchy.stats())
        r.connector.reset_cache()

    r.step(before_output=reset_mid_step)  # the prefill's stores are in flight at the reset
    assert seen["stores_inflight"] > 0
    r.run_until_idle()
    st = hierarchy.stats()
    assert st["stores_inflight"] == 0 and st["host"]["not_ready"] == 0 and st["host"]["referenced"] == 0
    assert st["stores_failed"] >= seen["stores_inflight"]  # dropped, as the reset asked
    assert r.load_errors == []


# ---- aborts and preemption: nothing stays pinned, nothing is served wrong afterwards -------------
def test_abort_while_a_disk_load_streams(runners, tmp_path: Path, monkeypatch) -> None:
    """A client disconnects while its prefix still streams in from disk: vLLM keeps the blocks
    until the load reports finished (R39); kvstrata finishes the load, releases every slot, and
    the next request with that prefix is served whole."""
    from vllm.v1.request import RequestStatus

    store = tmp_path / "persist"
    prompt = token_prompt(100)
    first = runners([G("full", 16)], store=store)
    first.serve(prompt, 1)
    first.close()
    second = runners([G("full", 16)], store=store)
    slow_disk_reads(monkeypatch, 0.03)
    req = second.add(prompt, 4)
    second.step()
    assert req.request_id in second.loaded_tokens  # the streamed load is under way
    assert second.connector.scheduler.hierarchy.stats()["promotions_inflight"] > 0
    second.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    second.run_until_idle()
    assert req.status == RequestStatus.FINISHED_ABORTED and req.num_output_tokens == 0
    assert_host_tier_released(second)
    assert second.serve(prompt, 1) == 100
    assert second.load_errors == []


def test_abort_mid_prefill_keeps_the_chunks_it_computed(runners) -> None:
    """Aborted after its first prefill chunk (64 of 100 tokens): the 4 chunks computed are stored
    and served; nothing of the rest is, and nothing stays pinned."""
    from vllm.v1.request import RequestStatus

    r = runners([G("full", 16)], max_num_batched_tokens=64)
    prompt = token_prompt(100)
    req = r.add(prompt, 4)
    r.step()
    assert req.num_computed_tokens == 64
    r.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    r.run_until_idle()
    assert_host_tier_released(r)
    r.drop_gpu_prefix_cache()
    assert r.serve(prompt, 1) == 64
    assert r.load_errors == []


def test_preempted_requests_store_and_serve_correctly(runners) -> None:
    """Two decoding requests that do not both fit in 17 blocks (7 each for the prompts, 10 each
    once decoded): vLLM preempts one (its blocks are freed and later recomputed or reloaded). Both finish; both prompts are then served whole
    from kvstrata, byte-checked, and no slot stays pinned."""
    r = runners([G("full", 16)], num_blocks=18)
    a, b = token_prompt(100, seed=1), token_prompt(100, seed=2)
    ra, rb = r.add(a, 60), r.add(b, 60)
    r.run_until_idle()
    assert ra.num_output_tokens == rb.num_output_tokens == 60
    assert ra.num_preemptions + rb.num_preemptions > 0
    assert_host_tier_released(r)
    r.drop_gpu_prefix_cache()
    assert r.serve(a, 1) == 100
    r.drop_gpu_prefix_cache()
    assert r.serve(b, 1) == 100
    assert r.load_errors == []
