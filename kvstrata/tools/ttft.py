"""The cold -> host tier -> restart -> disk tier experiment shared by the demo and ``bench e2e``.

Two engine processes on one store, the same prompt (and cache salt) throughout:

1. process A: the prompt cold (nothing stored yet), then ``reset_prefix_cache()`` (vLLM's device
   prefix cache only) and the prompt again: its prefix now comes from kvstrata's host tier;
2. process B, a real restart (a new Python process): the page cache is dropped where permitted,
   then the prompt once more, the first request kvstrata serves: its prefix comes from the disk
   tier.

Two details keep the comparison fair and the outputs comparable bit for bit:

* **Warm-up.** A process's first prefill of a given size pays one-time kernel and allocator setup
  (measured: 11.7 s against 3.5 s for the same 4k-token prefill later in the process). Each process
  therefore first runs the same prompt under another cache salt with kvstrata bypassed
  (``max_load_tokens`` / ``max_offload_tokens`` 0), so that cost is in none of the timings and
  nothing of the warm-up is stored.
* **Aligned prefill.** A request served from a cache computes only the prompt's tail. In bf16 a
  token computed inside a large prefill chunk rounds differently from the same token computed
  alone, and greedy decoding drifts apart after a few tokens, whatever the cache (vLLM's own
  prefix cache too). :func:`aligned_prefill_chunk` sizes the prefill chunks so that the cold run
  computes that tail as its own last chunk: every run then performs the same computations on the
  same bytes. The tail depends on the cache: vLLM's tiers serve whole blocks and recompute the
  partial last block; kvstrata also serves that partial block on attention-only models (stored
  in the step that completes the prompt) and computes one token whatever the prompt's length.
  Measured at 8176 tokens (block 128) on an AVX2-only machine: a cold prefill ending with the
  112-token chunk vLLM recomputes and kvstrata's one-token tail agreed on 4 of 16 greedy tokens;
  with the cold run ending with a one-token chunk, cold, host-tier and disk-tier outputs were
  identical.

The engine options are a parameter so that other backends (e.g. vLLM's own fs tier) can run through
the same phases and be compared like for like.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvstrata.tools.engine import EngineOptions, ProgressFn
from kvstrata.tools.jobs import run_job_subprocess

BLOCK_SIZE = 128  # vLLM's CPU default, pinned: the aligned chunk depends on it
SOURCE_HOST = "vllm:prompt_tokens_cached_by_source{source=host}"
SOURCE_DISK = "vllm:prompt_tokens_cached_by_source{source=disk}"
BYPASS_KVSTRATA = {"max_load_tokens": 0, "max_offload_tokens": 0}


def aligned_prefill_chunk(prompt_tokens: int, block_size: int, *, serves_partial_blocks: bool) -> int:
    """``max_num_batched_tokens`` that makes a cold prefill end with the chunk a cached run computes.

    A cache of whole blocks (vLLM's) loads them and computes the rest; one that also serves the
    partial last block (kvstrata) computes only the last token. Either way a prompt of whole
    blocks still computes its last token: vLLM never serves the entire prompt from cache.
    """
    tail = 1 if serves_partial_blocks else (prompt_tokens % block_size or 1)
    return max(1, prompt_tokens - tail)


def engine_options(model: str, store: str | None, prompt_tokens: int, *, host_bytes: int,
                   kv_cache_bytes: int, max_model_len: int = 8192,
                   multiprocess: bool = True, serves_partial_blocks: bool = True) -> EngineOptions:
    """Engine settings for one long prompt: pinned block size, aligned prefill chunks.

    ``serves_partial_blocks``: the cache under test serves the prompt's partial last block, as
    kvstrata does (False for vLLM's own tiers and prefix cache): :func:`aligned_prefill_chunk`.

    ``multiprocess`` (vLLM's default, as under ``vllm serve``) keeps the frontend's Python out of
    the engine-core process. In-process, the frontend's output loop shares a GIL with kvstrata's
    I/O threads, presumably why a disk-tier load measured 0.57-0.70 s there against 0.23 s in the
    multiprocess engine (4k tokens, SmolLM2) while the other requests barely changed.
    """
    chunk = aligned_prefill_chunk(prompt_tokens, BLOCK_SIZE, serves_partial_blocks=serves_partial_blocks)
    return EngineOptions(
        model=model, store=store, host_bytes=host_bytes, kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=max_model_len, block_size=BLOCK_SIZE,
        # Too short to align (under two blocks): leave vLLM's default chunking.
        max_num_batched_tokens=chunk if prompt_tokens >= 2 * BLOCK_SIZE else None,
        max_num_seqs=4,
        multiprocess=multiprocess,
    )


def measure(
    opts: EngineOptions,
    prompt: list[int],
    *,
    max_tokens: int,
    cache_salt: str = "kvstrata-ttft",
    ignore_eos: bool = True,
    drop_page_cache: bool = True,
    warmup: bool = True,
    progress: ProgressFn | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run both processes; return the three requests and a flat summary (``summary`` key)."""
    say = progress or (lambda _msg: None)
    gen = {"op": "generate", "prompts": [prompt], "max_tokens": max_tokens,
           "cache_salt": cache_salt, "ignore_eos": ignore_eos}
    warm = [{**gen, "name": "warmup", "max_tokens": 2, "cache_salt": f"{cache_salt}-warmup",
             "kv_transfer_params": BYPASS_KVSTRATA}] if warmup else []
    job_a = {"engine": asdict(opts), "steps": [
        *warm,
        {**gen, "name": "cold"},
        {"op": "reset_prefix_cache"},
        {**gen, "name": "host"},
    ]}
    # The warm-up's blocks are in vLLM's own cache; the disk request's salt shares none of them.
    drop = [{"op": "drop_page_cache"}] if drop_page_cache else []
    job_b = {"engine": asdict(opts), "steps": [*warm, *drop, {**gen, "name": "disk"}]}

    a = run_job_subprocess(job_a, timeout_s=timeout_s, progress=lambda m: say(f"process 1: {m}"))
    b = run_job_subprocess(job_b, timeout_s=timeout_s, progress=lambda m: say(f"process 2: {m}"))
    steps = {s["name"]: s for s in a["steps"] + b["steps"]
             if s["op"] == "generate" and s["name"] != "warmup"}
    dropped = any(s["op"] == "drop_page_cache" and s.get("ok") for s in b["steps"])
    return {"steps": steps, "processes": [_proc_times(a), _proc_times(b)],
            "summary": summarise(steps, dropped)}


def _proc_times(result: dict[str, Any]) -> dict[str, float]:
    return {k: round(result[k], 3) for k in ("import_s", "engine_start_s", "shutdown_s")
            if k in result}


def summarise(steps: dict[str, dict[str, Any]], page_cache_dropped: bool) -> dict[str, Any]:
    """The figures every caller reports, from the three generate steps."""
    cold, host, disk = (steps[n]["outputs"][0] for n in ("cold", "host", "disk"))
    ttft = {n: steps[n]["outputs"][0]["ttft_s"] for n in ("cold", "host", "disk")}
    host_m, disk_m = steps["host"]["metrics"], steps["disk"]["metrics"]
    return {
        "prompt_tokens": cold["prompt_tokens"],
        "cold_ttft_s": _r(ttft["cold"]),
        "host_ttft_s": _r(ttft["host"]),
        "disk_ttft_s": _r(ttft["disk"]),
        "outputs_identical": cold["token_ids"] == host["token_ids"] == disk["token_ids"],
        # Leading tokens equal to the cold run's: where a difference starts, if there is one.
        "matching_tokens": {"host": common_prefix(host["token_ids"], cold["token_ids"]),
                            "disk": common_prefix(disk["token_ids"], cold["token_ids"])},
        "disk_vs_cold": _ratio(ttft["disk"], ttft["cold"]),
        "disk_vs_host": _ratio(ttft["disk"], ttft["host"]),
        "host_vs_cold": _ratio(ttft["host"], ttft["cold"]),
        # What the engine says served the prefix (vLLM's per-tier prefix-cache accounting).
        "host_hit_tokens": int(host_m.get(SOURCE_HOST, 0)),
        "disk_hit_tokens": int(disk_m.get(SOURCE_DISK, 0)),
        "page_cache_dropped": page_cache_dropped,
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)
