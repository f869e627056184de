"""Synchronous loads (StrataConfig ``sync_loads``) under vLLM 0.32.0's real Scheduler, on CPU.

A hit wholly in the host tier is copied before the forward of the step that computes its request
(vLLM's ``load_kv_async`` False): the request runs in the step its lookup hit instead of waiting
in WAITING_FOR_REMOTE_KVS for the load to be reported. The harness checks every position each
forward attends, so a load that is not in place before the forward fails these tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from strata_harness import G, Runner, write_model_dir
from vllm.v1.request import RequestStatus

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def runners(model_dir: Path, tmp_path: Path) -> Iterator:
    made: list[Runner] = []

    def make(groups: list[G], name: str = "store", **kw: Any) -> Runner:
        r = Runner(groups, model_dir, tmp_path / name, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def _prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 + 10 for i in range(n)]


def _stored_then_dropped(r: Runner, base: list[int]) -> None:
    assert r.serve(base[:130], 1) == 0
    r.run_until_idle()
    r.drop_gpu_prefix_cache()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sched", "async-sched"])
def test_a_host_hit_runs_in_the_step_that_loads_it(runners, async_scheduling: bool) -> None:
    """The same host hit, loaded synchronously (the CPU default) and asynchronously: the
    synchronous one is scheduled at once and finishes steps earlier, with the same pages."""
    base = _prompt(200)
    steps = {}
    for sync in (True, False):
        r = runners([G("full", 16)], name=f"store-{sync}", async_scheduling=async_scheduling,
                    extra={"sync_loads": sync})
        _stored_then_dropped(r, base)
        req = r.add(base, 1)
        r.step()
        steps[sync] = 1
        if sync:
            # Loaded and computed in this step: running, past the hit and the rest of the prompt.
            assert req.status in (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH_CAPPED)
            assert req.num_computed_tokens == 200
        else:
            assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        while not req.is_finished():
            r.step()
            steps[sync] += 1
        r.run_until_idle()
        assert r.loaded_tokens[req.request_id] == 130
        assert r.load_errors == [], r.load_errors
        assert r.stats.data["sync_loads"] == (1 if sync else 0)
        assert r.stats.data["hit_tokens_host"] == 130 and r.stats.data["load_failures"] == 0
        assert r.served[req.request_id] == {"host": 130}
    assert steps[True] < steps[False], steps
    if not async_scheduling:
        assert steps == {True: 1, False: 2}


def test_sync_loads_on_the_accelerator_double_wait_for_their_copies(runners) -> None:
    """``sync_loads: true`` on an accelerator: the copy stream's job is waited for before the
    forward (the double runs queued copies only when waited on or at the step's end)."""
    base = _prompt(200)
    r = runners([G("full", 16)], async_scheduling=True, accel=True, extra={"sync_loads": True})
    _stored_then_dropped(r, base)
    assert r.serve(base, 1) == 130
    assert r.load_errors == [], r.load_errors
    assert r.stats.data["sync_loads"] == 1


def test_several_kv_cache_groups_load_asynchronously(runners) -> None:
    """vLLM recovers from a failed synchronous load only by block ids, which it cannot map with
    several KV cache groups: such engines keep asynchronous loads, even when asked."""
    base = _prompt(200)
    r = runners([G("full", 16), G("sw", 16, window=32)], extra={"sync_loads": True})
    assert r.connector.scheduler.sync_loads is False
    _stored_then_dropped(r, base)
    req = r.add(base, 1)
    r.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    r.run_until_idle()
    assert r.load_errors == [], r.load_errors
    assert r.stats.data["sync_loads"] == 0 and r.stats.data["hit_tokens"] > 0


def test_a_hit_of_the_whole_request_loads_asynchronously(runners) -> None:
    """A hit covering every token leaves vLLM nothing to compute in the step (it asserts so):
    that load stays asynchronous, and vLLM recomputes the last token once it arrived."""
    prompt = _prompt(96)  # six whole blocks
    r = runners([G("full", 16)])
    assert r.serve(prompt, 1) == 0
    r.drop_gpu_prefix_cache()
    assert r.serve(prompt, 1) == 96
    assert r.load_errors == [], r.load_errors
    assert r.stats.data["sync_loads"] == 0


def test_a_failed_sync_load_is_recomputed_and_stores_nothing_of_its_step(runners, monkeypatch) -> None:
    """The copy of a synchronous load fails (a fault injected into the CPU stager): its blocks
    go to vLLM as load errors, which under kv_load_failure_policy "recompute" rolls the request
    back and recomputes it; the stores of that step, whose KV attended the blocks that were not
    loaded, fail instead of being written. A later request is served what the recompute stored."""
    from kvstrata.tiers.device.cpu import CpuStager

    base = _prompt(200)
    r = runners([G("full", 16)])
    _stored_then_dropped(r, base)
    stored_before = r.stats.data["store_jobs"]
    real = CpuStager._load_cpu
    failures = []

    def failing_load(self: CpuStager, t: Any) -> None:
        if not failures:
            failures.append(t)
            raise OSError("injected copy failure")
        real(self, t)

    monkeypatch.setattr(CpuStager, "_load_cpu", failing_load)
    req = r.add(base, 1)
    r.run_until_idle()
    monkeypatch.setattr(CpuStager, "_load_cpu", real)
    assert failures, "the load did not run"
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.stats.data["load_failures"] == 1 and r.stats.data["sync_loads"] == 1
    # The failed step's forward attended unloaded blocks (vLLM discards its output): only that
    # request's first step may show it.
    assert all(e.startswith(f"{req.request_id} ") for e in r.load_errors), r.load_errors
    assert r.stats.data["store_failures"] >= 1
    assert r.stats.data["store_jobs"] > stored_before
    # What is stored now is the recomputed KV: served and checked page by page.
    r.load_errors.clear()
    r.drop_gpu_prefix_cache()
    assert r.serve(base, 1) == 200
    assert r.load_errors == [], r.load_errors


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_disk_hit_after_a_restart_runs_in_one_step_on_cpu(runners, stream: bool) -> None:
    """After a restart the chunks are on disk only. Streamed (kv_load_failure_policy
    "recompute", the harness's): the lookup answers at once and the worker waits for each chunk
    to land before the forward, so the request computes in the step of its first lookup. Not
    streamed (what vLLM's default "fail" gets): the lookup waits for the promotions (a deferral
    per step they take: each empty step waits up to IDLE_WAIT_S for them, one step on an idle
    machine), then the load is synchronous."""
    base = _prompt(200)
    extra = {"sync_loads": True, "stream_loads": stream}
    first = runners([G("full", 16)], name="persist", extra=extra)
    assert first.serve(base[:130], 1) == 0
    first.close()
    second = runners([G("full", 16)], name="persist", extra=extra)
    assert second.connector.scheduler.stream_loads is stream
    req = second.add(base, 1)
    steps = 0
    while not req.is_finished():
        second.step()
        steps += 1
    second.run_until_idle()
    assert second.loaded_tokens[req.request_id] == 130
    assert second.load_errors == [], second.load_errors
    assert second.served[req.request_id] == {"disk": 130}
    assert second.stats.data["sync_loads"] == 1 and second.stats.data["load_failures"] == 0
    deferrals = second.stats.data["lookup_deferrals"]
    if stream:
        assert (deferrals, steps) == (0, 1)
    else:  # every step before the load waited on the promotions; the load's step computed it
        assert deferrals >= 1 and steps == deferrals + 1, (deferrals, steps)
