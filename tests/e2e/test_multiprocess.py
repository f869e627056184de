"""kvstrata with vLLM's multiprocess engine and two tensor-parallel workers: frontend, engine core
(scheduler-side connector) and two workers (worker-side connector, one KV shard each) in four
processes. (One engine covers both: a TP=1 multiprocess engine ran the same phases in a test of
its own, a minute and a half of CI for nothing this one does not check.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from e2e_harness import CASES, PROMPTS, dump, generate_step, metric, run_phase, token_ids

from kvstrata.tools.engine import EngineOptions


def _host_tier_then_restart(opts: EngineOptions, tmp_path: Path) -> dict[str, Any]:
    """Process 1: cold, reset, again (host tier); process 2 after the page cache is dropped
    (disk tier). Both served runs give the cold tokens and hit kvstrata; returns the disk run."""
    first = run_phase(opts, [generate_step("cold"), {"op": "reset_prefix_cache"},
                             generate_step("host")], tmp_path / "first.log")
    restart = run_phase(opts, [{"op": "drop_page_cache", "required": True}, generate_step("disk")],
                        tmp_path / "restart.log")
    cold, host, disk = first["cold"], first["host"], restart["disk"]
    assert token_ids(host) == token_ids(cold)
    assert token_ids(disk) == token_ids(cold)
    assert metric(host, "kvstrata_hit_tokens_host") >= len(PROMPTS[1]) // 2, dump(host["metrics"])
    assert metric(disk, "kvstrata_hit_tokens_disk") >= len(PROMPTS[1]) // 2, dump(disk["metrics"])
    return disk


@pytest.mark.slow
def test_tensor_parallel_engine_host_tier_and_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real TP=2 engine (two worker processes, one KV head each): every rank stores its own
    shard under its own namespace, and both the host-tier hit and the restarted engine's disk hit
    give the cold run's tokens."""
    from e2e_harness import namespaces_of, store_keys

    from kvstrata.connector.keys import NAMESPACE_BYTES
    from kvstrata.tiers.disk import DiskStore

    # vLLM's CPU workers bind their OpenMP threads per NUMA node by default; one node here.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    case = CASES["llama"]
    model_dir = case.build(tmp_path / "model", 0)
    store = tmp_path / "store"
    opts = case.options(model_dir, store, multiprocess=True, distributed_executor_backend="mp",
                        llm_kwargs={"tensor_parallel_size": 2})
    disk = _host_tier_then_restart(opts, tmp_path)
    # The tier gauges cross from the engine-core process to the frontend's metrics too. (They
    # refresh at most once a second while the engine steps; the first step of a process always
    # refreshes, and by then the store holds what process 1 wrote.)
    assert metric(disk, "kvstrata_disk_entries") > 0, dump(disk["metrics"])
    spaces = namespaces_of(store, str(model_dir))
    with DiskStore(store, budget_bytes=1 << 40, readonly=True, create=False) as d:
        ranks = sorted(int(d.namespaces()[ns]["tp_rank"]) for ns in spaces)
    assert ranks == [0, 1]
    per_rank = [sum(1 for k in store_keys(store, spaces) if k[:NAMESPACE_BYTES] == ns) for ns in spaces]
    assert per_rank[0] == per_rank[1] > 0
