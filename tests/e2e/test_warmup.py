"""``kvstrata warmup`` on a real vLLM engine (CPU, tiny random Llama).

warmup fills a store; a new engine on that store serves the prefixes from its first request, with
the same output as an engine without kvstrata (first-token logprobs too: float32); a second warmup
skips every prompt. Isolation: the warmed store gives nothing to the same prompts under a
``cache_salt`` (the tool warms unsalted prompts only: its corpus has no salt field). The same for a
Gated-DeltaNet hybrid (Qwen3-Next) hashed finer than its blocks, whose prompts end in partial tails.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import kvstrata_hits
from equivalence import TOP_K, compare_step, divergences, reference_step, references_of
from equivalence import summary as eq_summary

from kvstrata.tools import models
from kvstrata.tools.engine import EngineOptions
from kvstrata.tools.jobs import run_job_subprocess

BLOCK = 128  # vLLM's default block size on CPU
KVSTRATA = [sys.executable, "-c", "import sys; from kvstrata.tools.cli import main; sys.exit(main())"]


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    a = [rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(700)]
    b = [rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(450)]
    c = a[:500] + [rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(150)]
    return [a, b, c]


def _questions() -> list[list[int]]:
    """Each prompt with a question of its own after it."""
    rng = random.Random(11)
    return [p + [rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(20)] for p in _prompts()]


def _make_setup(root: Path, make_model: Callable[[Path], Path]) -> dict[str, Any]:
    """A model, the prompts as a JSONL corpus (blank lines between them) and a store path."""
    model = make_model(root / "model")
    corpus = root / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n\n" for p in _prompts()))
    return {"root": root, "model": model, "corpus": corpus, "store": root / "store", "engine": {},
            "warmup_args": ()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # float32 in the tool and the engines: vLLM's "auto" runs this checkpoint in bf16, where the
    # KV a forward writes depends on its batch, and first-token logprobs of a reload could then
    # differ from a recomputation by more than the equivalence oracle's tolerance.
    return {**_make_setup(tmp_path_factory.mktemp("warmup"), models.make_tiny_llama),
            "engine": {"dtype": "float32"}, "warmup_args": ("--dtype", "float32")}


def _warmup(setup: dict[str, Any], *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [*KVSTRATA, "warmup", "--json", "--model", str(setup["model"]), "--prompts",
         str(setup["corpus"]), "--store", str(setup["store"]), "--max-model-len", "2048",
         "--kv-cache-memory", "64MiB", "--host-bytes", "64MiB", "--batch-size", "2",
         "--log", str(setup["root"] / "warmup.log"), *setup["warmup_args"], *extra],
        capture_output=True, text=True, timeout=600, check=False,
        # The serving engines run without PYTHONHASHSEED (engine.child_env): so must warmup,
        # which hashes with whatever seed the user's environment has.
        env={k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"},
    )
    assert proc.returncode == 0, proc.stderr + (setup["root"] / "warmup.log").read_text()[-4000:]
    return json.loads(proc.stdout)


def _engine(setup: dict[str, Any], store: Path | None, name: str,
            steps: list[dict[str, Any]] | None = None, **engine: Any) -> dict[str, dict[str, Any]]:
    """The steps (default: ``first``, the prompts) of a new engine on ``store``, by name."""
    opts = EngineOptions(model=str(setup["model"]), store=str(store) if store else None,
                         host_bytes=64 << 20, kv_cache_memory_bytes=64 << 20, max_model_len=2048,
                         skip_tokenizer_init=True, **setup["engine"], **engine)
    steps = steps or [{"op": "generate", "name": "first", "prompts": _prompts(), "max_tokens": 8}]
    result = run_job_subprocess({"engine": asdict(opts), "steps": steps}, timeout_s=600,
                                log_path=setup["root"] / f"{name}.log")
    return {s["name"]: s for s in result["steps"]}


@pytest.mark.slow
def test_warmup_then_a_new_engine_serves_the_prefixes_from_its_first_request(
    setup: dict[str, Any],
) -> None:
    prompts = _prompts()
    summary = _warmup(setup)
    assert summary["prompts"] == 3 and summary["prompts_run"] == 3
    assert summary["prompts_skipped_already_stored"] == 0
    assert summary["prompts_fully_stored"] == 3, summary
    assert summary["tokens"] == sum(map(len, prompts))
    # a: 5 full blocks, b: 3; c shares a's first 3 blocks and adds 2 of its own; and each
    # prompt's partial last block (its prompt tail).
    assert summary["chunks"] == summary["chunks_added"] == 5 + 3 + 2 + 3, summary
    assert summary["stored_bytes"] < summary["raw_bytes"]

    gen = {"op": "generate", "prompts": prompts, "max_tokens": 8, "logprobs": TOP_K}
    steps = [
        # First, on the store as the tool left it (nothing in the host tier or vLLM's cache):
        # a salt enters the first block's hash, so nothing warmed is a salted request's. One salt
        # per prompt: under one salt, the third prompt could share the first's blocks in vLLM's
        # cache (legitimately), and vLLM's cache alone must count nothing here.
        {**gen, "name": "salted", "cache_salt": [f"another-tenant-{i}" for i in range(len(prompts))]},
        {**gen, "name": "first"},
        # Then each warmed prompt with a question after it (a document, then what is asked of
        # it): the warmed prompt's tail serves it to that prompt's end (docs/SEMANTICS.md R21a).
        {"op": "reset_prefix_cache"},
        {**gen, "name": "questions", "prompts": _questions()},
    ]
    run = _engine(setup, setup["store"], "served", steps)
    salted, served = run["salted"], run["first"]
    baseline = _engine(setup, None, "baseline", [reference_step("ref", prompts + _questions(), 8)])["ref"]
    # The salted requests (the engine's first) got nothing from kvstrata, nor from vLLM's cache.
    assert kvstrata_hits(salted) == 0, salted["metrics"]
    assert [o["num_cached_tokens"] for o in salted["outputs"]] == [0, 0, 0], salted["outputs"]
    assert [o["token_ids"] for o in served["outputs"]] == [o["token_ids"] for o in baseline["outputs"][:3]]
    for prompt, out in zip(prompts, served["outputs"], strict=True):
        # The whole prompt is loaded (its full blocks and its tail), from disk, in the engine's
        # first batch of these prompts (vLLM then recomputes the last token).
        assert out["num_cached_tokens"] == len(prompt), out
    assert served["metrics"].get("vllm:kvstrata_hit_tokens_disk", 0) > 0, served["metrics"]
    assert [o["num_cached_tokens"] for o in run["questions"]["outputs"]] == [len(p) for p in prompts]
    assert run["questions"]["metrics"].get("vllm:kvstrata_tail_extensions", 0) == len(prompts)
    # The equivalence oracle: what was served (and what was not) equals vLLM alone.
    refs = references_of([(prompts + _questions(), baseline)])
    for step, asked in ((served, prompts), (salted, prompts), (run["questions"], _questions())):
        verdicts = compare_step(refs, step, asked)
        assert not divergences(verdicts), "\n".join(divergences(verdicts))
        print(f"{step['name']}: {eq_summary(verdicts)}")


@pytest.mark.slow
def test_warmup_again_skips_what_is_stored(setup: dict[str, Any]) -> None:
    if not (setup["store"] / "data.mdb").exists():
        _warmup(setup)
    again = _warmup(setup)
    assert again["resume_check"] == "exact"
    assert again["prompts_skipped_already_stored"] == 3 and again["prompts_run"] == 0
    assert again["chunks_added"] == 0 and again["prompts_fully_stored"] == 3


HYBRID_UNIT = 128  # prefix_match_unit: hashes every 128 tokens, inside the 384-token GDN blocks
# As tests/e2e/e2e_harness.py's Qwen3-Next case: prefill chunks on the block, one sequence per step.
HYBRID_ENGINE = {"max_num_batched_tokens": 384, "max_num_seqs": 1,
                 "llm_kwargs": {"prefix_match_unit": HYBRID_UNIT}}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _make_setup(tmp_path_factory.mktemp("warmup-hybrid"), models.make_tiny_qwen3_next)


@pytest.mark.slow
def test_warmup_stores_partial_tails_of_a_hybrid_model(hybrid: dict[str, Any]) -> None:
    """warmup stores each prompt's partial tail (the state at its last hash boundary, inside a
    block); a new engine serves every prompt up to there, from disk, with the output of an engine
    without kvstrata; a second warmup finds every prompt fully stored, tails included."""
    args = ("--max-num-batched-tokens", "384", "--max-num-seqs", "1",
            "--vllm-arg", f"prefix_match_unit={HYBRID_UNIT}")
    summary = _warmup(hybrid, *args)
    assert summary["prompts_run"] == 3 and summary["prompts_fully_stored"] == 3, summary

    served = _engine(hybrid, hybrid["store"], "served", **HYBRID_ENGINE)["first"]
    baseline = _engine(hybrid, None, "baseline", **HYBRID_ENGINE)["first"]
    assert [o["token_ids"] for o in served["outputs"]] == [o["token_ids"] for o in baseline["outputs"]]
    for prompt, out in zip(_prompts(), served["outputs"], strict=True):
        assert out["num_cached_tokens"] == (len(prompt) - 1) // HYBRID_UNIT * HYBRID_UNIT, out
    assert served["metrics"].get("vllm:kvstrata_hit_tokens_disk", 0) > 0, served["metrics"]

    again = _warmup(hybrid, *args)
    assert again["prompts_skipped_already_stored"] == 3 and again["chunks_added"] == 0, again
