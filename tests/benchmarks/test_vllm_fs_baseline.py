"""vLLM's own disk tier, run on CPU by ``benchmarks.vllm_fs_baseline``, works end to end.

It is the baseline ``benchmarks/bench_vs_vllm.py`` compares against, so it must really store
and serve: a tiny random Llama generates through vLLM's CPU + fs tiers, the prompts come back
from the CPU tier after ``reset_prefix_cache()``, and a new process on the same ``root_dir``
serves them from the fs tier, with identical output each time.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_vs_vllm import fs_tier_usage
from benchmarks.vllm_fs_baseline import fs_transfer_config
from kvstrata.tools import models
from kvstrata.tools.engine import EngineOptions
from kvstrata.tools.jobs import run_job_subprocess

BLOCK = 32
MAX_TOKENS = 12
HOST = "vllm:prompt_tokens_cached_by_source{source=host}"
DISK = "vllm:prompt_tokens_cached_by_source{source=disk}"


def _prompts() -> list[list[int]]:
    rng = random.Random(7)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(n)]

    a = ids(700)
    return [a, ids(450), a[:320] + ids(150)]


def _run(opts: EngineOptions, steps: list[dict[str, Any]], log: Path) -> dict[str, dict[str, Any]]:
    # The restarted engine's first request comes mostly from the fs tier: its first attention ran
    # vLLM's AMX kernels before torch had asked for the AMX state, and now and then died of
    # SIGILL, until CPUCopyWorker asked for it at start.
    result = run_job_subprocess({"engine": asdict(opts), "steps": steps}, timeout_s=240.0,
                                log_path=log)
    return {s["name"]: s for s in result["steps"] if s["op"] == "generate"}


def _tokens(step: dict[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for o in step["outputs"]]


@pytest.mark.slow
def test_vllm_fs_tier_on_cpu_stores_and_serves_after_restart(tmp_path: Path) -> None:
    model = models.make_tiny_llama(tmp_path / "model")
    root = tmp_path / "fs"
    opts = EngineOptions(
        model=str(model), store=None, kv_cache_memory_bytes=64 << 20, max_model_len=2048,
        block_size=BLOCK, skip_tokenizer_init=True,
        llm_kwargs={"kv_transfer_config": fs_transfer_config(str(root), cpu_bytes=64 << 20)})
    prompts = _prompts()
    gen = {"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS}
    # Every full block of each prompt's own (unshared) tokens must come back from the tiers.
    distinct_blocks = (700 + 450 + 150) // BLOCK - 1

    first = _run(opts, [{**gen, "name": "cold"}, {"op": "reset_prefix_cache"},
                        {**gen, "name": "host"}], tmp_path / "first.log")
    cold, host = first["cold"], first["host"]
    assert _tokens(host) == _tokens(cold)
    assert host["metrics"].get(HOST, 0) >= distinct_blocks * BLOCK, host["metrics"]

    # The cascade to the fs tier wrote one file per block.
    usage = fs_tier_usage(root)
    assert usage["block_files"] >= distinct_blocks, usage

    restart = _run(opts, [{"op": "drop_page_cache", "required": True}, {**gen, "name": "disk"}],
                   tmp_path / "restart.log")
    disk = restart["disk"]
    assert _tokens(disk) == _tokens(cold)
    assert disk["metrics"].get(DISK, 0) >= distinct_blocks * BLOCK, disk["metrics"]
    assert disk["metrics"].get(HOST, 0) == 0, disk["metrics"]


@pytest.mark.slow
def test_a_one_token_first_prompt_does_not_kill_the_fs_engine(tmp_path: Path) -> None:
    """vLLM's CPU attention runs AMX kernels without asking Linux for the AMX state: an engine
    whose first attention batch is all single-token queries died of SIGILL (return code -4),
    deterministically for a 1-token prompt, and now and then for a restarted engine served from
    the fs tier. CPUCopyWorker asks for it at start, as kvstrata's worker does."""
    model = models.make_tiny_llama(tmp_path / "model")
    opts = EngineOptions(
        model=str(model), store=None, kv_cache_memory_bytes=64 << 20, max_model_len=2048,
        block_size=BLOCK, skip_tokenizer_init=True,
        llm_kwargs={"kv_transfer_config": fs_transfer_config(str(tmp_path / "fs"),
                                                             cpu_bytes=64 << 20)})
    out = _run(opts, [{"op": "generate", "prompts": [[5]], "max_tokens": 4, "name": "one"}],
               tmp_path / "one.log")
    assert len(out["one"]["outputs"][0]["token_ids"]) == 4
