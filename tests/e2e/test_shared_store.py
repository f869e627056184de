"""Two vLLM engines with kvstrata on one store at the same time: data-parallel replicas, or
several servers on one node sharing its NVMe. Each engine has its own host tier; the disk tier
is one LMDB store that both read and write while the other runs."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest
from e2e_harness import (
    CASES,
    JOB_TIMEOUT_S,
    PROMPTS,
    dump,
    generate_step,
    metric,
    namespaces_of,
    records_of_prompt,
    steps_by_name,
    store_keys,
    token_ids,
)

from kvstrata.tiers.disk import DiskStore
from kvstrata.tools.inspect import inspect_store
from kvstrata.tools.jobs import run_job_subprocess
from kvstrata.tools.verify import find_problems


def _wait(cond, what: str, engines: list[Future], timeout_s: float = JOB_TIMEOUT_S) -> None:
    """Poll ``cond`` until true; an engine that failed meanwhile fails the test with its error."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        for engine in engines:
            if engine.done():
                engine.result()  # raises the engine's JobError, with its log tail
                pytest.fail(f"an engine ended while waiting for {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_two_engines_share_one_store_at_once(tmp_path: Path) -> None:
    case = CASES["llama"]
    model_dir = case.build(tmp_path / "model", 0)
    store = tmp_path / "store"
    opts = asdict(case.options(model_dir, store))
    a_stored, b_may_start, b_done = (tmp_path / n for n in ("a_stored", "b_may_start", "b_done"))
    # A: cold prompts, then it stays up (store open, host tier full) until B has been served
    # from what A wrote; then A's own host tier serves the prompts again and A shuts down last.
    job_a = {"engine": opts, "steps": [
        generate_step("cold"),
        {"op": "signal", "path": str(a_stored)},
        {"op": "wait_for", "path": str(b_done), "timeout_s": JOB_TIMEOUT_S},
        {"op": "reset_prefix_cache"},
        generate_step("host_after_b")]}
    # B: starts while A runs (it opens the store A holds), and waits until A's chunks are on
    # disk before its prompts arrive.
    job_b = {"engine": opts, "steps": [
        {"op": "wait_for", "path": str(b_may_start), "timeout_s": JOB_TIMEOUT_S},
        generate_step("from_a")]}

    with ThreadPoolExecutor(2) as pool:
        engines = [
            pool.submit(run_job_subprocess, job, timeout_s=2 * JOB_TIMEOUT_S, log_path=tmp_path / f"{n}.log")
            for n, job in (("a", job_a), ("b", job_b))]
        try:
            _wait(a_stored.exists, "engine A's cold run", engines)
            # A's write-behind runs in the background: B may start once all A stored is on
            # disk (or B's hits would depend on timing): every whole chunk of every prompt, and
            # one partial tail chunk per prompt (none ends on a chunk boundary).
            model = str(model_dir)
            spaces = namespaces_of(store, model)
            assert len(spaces) == 1
            with DiskStore(store, budget_bytes=1 << 40, readonly=True, create=False) as disk:
                info = disk.namespaces()[next(iter(spaces))]
            chunk_tokens = int(info["block_size"]) * int(info["blocks_per_chunk"])
            assert case.serves_prompt_tails and all(len(p) % chunk_tokens for p in PROMPTS)

            def all_on_disk() -> bool:
                per_prompt = [records_of_prompt(store, model, p) for p in PROMPTS]
                whole = set().union(*per_prompt)  # prompts sharing a prefix share its chunks
                return (all(len(r) == len(p) // chunk_tokens
                                for r, p in zip(per_prompt, PROMPTS, strict=True))
                        and len(store_keys(store, spaces)) == len(whole) + len(PROMPTS))

            _wait(all_on_disk, "A's chunks on disk", engines)
            b_may_start.touch()
            b = steps_by_name(engines[1].result())
            # B has closed the store, A still has it open: B must not have marked it clean.
            clean_while_a_runs = inspect_store(store, None)["clean_shutdown"]
        finally:
            b_done.touch()  # lets A go on (also when B failed: A must not wait for nothing)
        a = steps_by_name(engines[0].result())

    cold, from_a, host_after_b = a["cold"], b["from_a"], a["host_after_b"]
    prompt_tokens = sum(map(len, PROMPTS))
    # B computed nothing A had stored: every prompt token came from vLLM's own prefix cache
    # (the prompt sharing a prefix with one before it in the batch) or from the shared disk tier.
    assert token_ids(from_a) == token_ids(cold)
    assert [o["num_cached_tokens"] for o in from_a["outputs"]] == [len(p) for p in PROMPTS]
    assert metric(from_a, "kvstrata_hit_tokens_host") == 0, dump(from_a["metrics"])
    assert (metric(from_a, "kvstrata_hit_tokens_disk") + metric(from_a, "prefix_cache_hits")
            == prompt_tokens), dump(from_a["metrics"])
    # A's host tier was untouched by B's start and B's reads: it serves A again.
    assert token_ids(host_after_b) == token_ids(cold)
    assert [o["num_cached_tokens"] for o in host_after_b["outputs"]] == [len(p) for p in PROMPTS]
    assert (metric(host_after_b, "kvstrata_hit_tokens_host")
            + metric(host_after_b, "prefix_cache_hits") == prompt_tokens), dump(host_after_b["metrics"])
    # A, closing last, marked the store clean; B, closing first, had not.
    assert clean_while_a_runs is False
    assert inspect_store(store, None)["clean_shutdown"] is True
    # Two writers had the store open: every record still decodes to its checksum, totals agree.
    found = find_problems(store, threads=2)
    assert found.checked >= len(records_of_prompt(store, model, PROMPTS[0])) and not found.bad
    assert found.totals_consistent
