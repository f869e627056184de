"""kvstrata with vLLM's default multiprocess engine: frontend, engine core (scheduler-side
connector) and worker (worker-side connector) in three different processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_harness import CASES, PROMPTS, dump, generate_step, metric, run_phase, token_ids


@pytest.mark.slow
def test_multiprocess_engine_host_tier_and_restart(tmp_path: Path) -> None:
    case = CASES["llama"]
    model_dir = case.build(tmp_path / "model", 0)
    opts = case.options(model_dir, tmp_path / "store", multiprocess=True,
                        distributed_executor_backend="mp")
    first = run_phase(opts, [generate_step("cold"), {"op": "reset_prefix_cache"},
                             generate_step("host")], tmp_path / "first.log")
    restart = run_phase(opts, [{"op": "drop_page_cache"}, generate_step("disk")],
                        tmp_path / "restart.log")
    cold, host, disk = first["cold"], first["host"], restart["disk"]
    assert token_ids(host) == token_ids(cold)
    assert token_ids(disk) == token_ids(cold)
    assert metric(host, "kvstrata_hit_tokens_host") >= len(PROMPTS[1]) // 2, dump(host["metrics"])
    assert metric(disk, "kvstrata_hit_tokens_disk") >= len(PROMPTS[1]) // 2, dump(disk["metrics"])
    # The tier gauges cross from the engine-core process to the frontend's metrics too. (They
    # refresh at most once a second while the engine steps; the first step of a process always
    # refreshes, and by then the store holds what process 1 wrote.)
    assert metric(disk, "kvstrata_disk_entries") > 0, dump(disk["metrics"])
