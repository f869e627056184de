"""``kvstrata bench overhead``: what attaching kvstrata costs a workload, side by side.

The same batches of requests through vLLM without a connector and through kvstrata in several
configurations, each in its own engine process, the configurations alternating within each
round. Two workloads:

* ``no_reuse``: every prompt is new (random token ids); kvstrata stores everything and serves
  nothing. ``no_reuse_time_ratio`` = kvstrata's / vLLM's median seconds per batch (goal <= 1.05
  with the default configuration: a cache that does not hit must cost almost nothing).
* ``mixed``: half of each batch's prompts (the first half) share 7/8 of their tokens with a prompt
  of the first half of the batch before. vLLM's own KV cache holds about half a batch
  (``--device-cache-batches``), so by then it has evicted those prefixes for the second half's
  blocks: the case kvstrata exists for. ``mixed_time_ratio`` (goal <= 0.7: the hits must pay for
  the stores); vLLM without a connector keeps its own prefix caching.

A reference configuration, ``vllm_cache_all`` (not run unless named in ``--configs``), is vLLM
alone with a KV cache large enough for every batch: its own prefix cache then serves every shared
prefix from device memory, with no copy at all, which bounds what any cache can save on the same
workload (``mixed_ideal_time_ratio``; ``mixed_share_of_ideal`` = kvstrata's saving / that one).
Its larger cache also spares vLLM preemptions, which no connector can: its ratio on ``no_reuse``
(``no_reuse_ideal_time_ratio``) says how much of the bound is that. It is 0.98 at the default
sizes; with batches of a few short prompts a half-batch cache makes vLLM thrash (0.28 with 8
prompts of 128 tokens) and the bound says nothing about reuse.

The first batch of each engine is a warm-up and is left out of the medians. Per configuration
also: the disk write rate reached (stored bytes per second of batch time), chunks served, and
the CPU seconds each of the engine process's threads used per batch (where the time went).
Timings only go to the JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstrata.bench.e2e import json_object, smollm2
from kvstrata.tools.engine import EngineOptions
from kvstrata.tools.jobs import run_job_subprocess

GOALS = {"no_reuse_time_ratio": 1.05, "mixed_time_ratio": 0.7}
# Configurations measured by default: name -> kvstrata options (None: vLLM without kvstrata).
CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "default": {},
    "disk_off": {"disk": False},
    "raw": {"codec": "raw"},
    "normal_priority": {"background_priority": "normal"},
    # Writes always at idle priority (the default before "auto"; docs/BENCHMARKS.md).
    "idle_priority": {"background_priority": "idle"},
    # Write a chunk to disk only once it was offered twice (Dynamo KVBM's default).
    "admission2": {"admission": 2},
    # vLLM alone, its KV cache holding every batch of the run: the bound (see the docstring).
    "vllm_cache_all": None,
}
REFERENCE = "vllm_cache_all"
DEFAULT_CONFIGS = [c for c in CONFIGS if c != REFERENCE]
VOCAB_LOW, VOCAB_HIGH = 100, 49000  # inside SmolLM2's vocabulary, clear of special tokens
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # SmolLM2-135M: layers x KV heads x head dim x K,V x bf16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=48, help="prompts per batch (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt (default %(default)s)")
    parser.add_argument("--batches", type=int, default=3,
                        help="batches per engine, the first a warm-up (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds, each running every configuration once (default %(default)s)")
    parser.add_argument("--workload", choices=("no_reuse", "mixed", "both"), default="both")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="NAME",
                        help=f"configurations to compare (default: {' '.join(DEFAULT_CONFIGS)}; 'none' is "
                             f"vLLM alone; also {REFERENCE}: vLLM alone, its cache holding every batch)")
    parser.add_argument("--kvstrata-config", type=json_object, default={}, metavar="JSON",
                        help="options added to every kvstrata configuration")
    parser.add_argument("--store", type=Path, default=None,
                        help="parent directory of the stores (default: a temporary directory)")
    parser.add_argument("--model-cache", type=Path, default=None, help="where SmolLM2 is prepared")
    parser.add_argument("--device-cache-batches", type=float, default=0.5,
                        help="vLLM's KV cache size in batches of KV (default %(default)s: the prefixes "
                             "a mixed batch shares with the batch before are no longer in it)")
    parser.add_argument("--seed", type=int, default=0)


def workload_batches(kind: str, args: argparse.Namespace) -> list[list[list[int]]]:
    """The batches of one workload (identical for every configuration)."""
    rng = random.Random(args.seed * 1000 + (kind == "mixed"))

    def fresh(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    shared = args.prompt_tokens * 7 // 8  # the prefix a mixed prompt shares with an earlier one
    batches: list[list[list[int]]] = []
    for b in range(args.batches):
        if kind == "no_reuse" or b == 0:
            batches.append([fresh(args.prompt_tokens) for _ in range(args.prompts)])
            continue
        half = args.prompts // 2
        earlier = batches[b - 1]
        batch = [earlier[i][:shared] + fresh(args.prompt_tokens - shared) for i in range(half)]
        batches.append(batch + [fresh(args.prompt_tokens) for _ in range(args.prompts - half)])
    return batches


def engine_options(model: Path, extra: dict[str, Any] | None, store: Path, args: argparse.Namespace,
                   *, cache_all: bool = False) -> EngineOptions:
    """``cache_all``: vLLM's KV cache holds every batch of the run (the reference)."""
    tokens = args.prompts * (args.prompt_tokens + args.max_tokens)
    kv_bytes = int(tokens * KV_BYTES_PER_TOKEN * (args.batches + 1 if cache_all else args.device_cache_batches))
    return EngineOptions(
        model=str(model), store=None if extra is None else str(store),
        extra_config={**args.kvstrata_config, **(extra or {})},
        kv_cache_memory_bytes=kv_bytes, max_model_len=args.prompt_tokens + args.max_tokens + 64,
        skip_tokenizer_init=True, host_bytes=1 << 30)


def _measure(name: str, model: Path, extra: dict[str, Any] | None, batches: list[list[list[int]]],
             store: Path, args: argparse.Namespace) -> dict[str, Any]:
    steps = [{"op": "generate", "name": f"batch{i}", "prompts": b, "max_tokens": args.max_tokens}
             for i, b in enumerate(batches)]
    opts = engine_options(model, extra, store, args, cache_all=name == REFERENCE)
    result = run_job_subprocess({"engine": asdict(opts), "steps": steps},
                                timeout_s=1800)
    timed = result["steps"][1:]
    stored = [s["metrics"].get("vllm:kvstrata_disk_stored_bytes") for s in result["steps"]]

    def timed_delta(gauge: str) -> int:  # a cumulative gauge's growth over the timed batches
        values = [s["metrics"].get(f"vllm:kvstrata_{gauge}") or 0 for s in result["steps"]]
        return int(values[-1] - values[0])
    seconds = sum(s["wall_s"] for s in timed)
    threads: dict[str, float] = {}
    for s in timed:
        for k, v in s.get("thread_cpu_s", {}).items():
            threads[k] = threads.get(k, 0.0) + v / len(timed)
    io = {k.removeprefix("io:"): int(threads.pop(k)) for k in list(threads) if k.startswith("io:")}
    return {
        "config": name,
        "batch_s": [round(s["wall_s"], 3) for s in timed],
        "hit_tokens": int(sum(s["metrics"].get("vllm:kvstrata_hit_tokens", 0) for s in timed)),
        "vllm_prefix_hits": int(sum(s["metrics"].get("vllm:prefix_cache_hits", 0) for s in timed)),
        "disk_write_MBps": round(((stored[-1] or 0) - (stored[0] or 0)) / seconds / 1e6, 2) if seconds else 0.0,
        # chunks written down by the write-behind, and those it dropped (backlog full, admission);
        # the rest wait in the backlog for idle CPU
        "chunks_written": timed_delta("writes_behind"),
        "chunks_dropped": timed_delta("disk_admission_drops"),
        "thread_cpu_s_per_batch": {k: round(v, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
        "io_bytes_per_batch": io,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or "none" not in args.configs:
        raise SystemExit(f"kvstrata bench overhead: --configs must include 'none' and name only {list(CONFIGS)}")
    if args.batches < 2 or args.rounds < 1 or args.prompts < 2 or args.device_cache_batches <= 0:
        raise SystemExit("kvstrata bench overhead: needs --batches >= 2, --rounds >= 1, --prompts >= 2, "
                         "--device-cache-batches > 0")

    def say(msg: str) -> None:
        print(f"bench overhead: {msg}", file=sys.stderr, flush=True)

    model = smollm2(args, say)
    kinds = ["no_reuse", "mixed"] if args.workload == "both" else [args.workload]
    if args.store is not None:
        args.store.mkdir(parents=True, exist_ok=True)
    parent = Path(tempfile.mkdtemp(prefix="kvstrata-overhead-", dir=args.store))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {k: {c: [] for c in args.configs} for k in kinds}
    try:
        for kind in kinds:
            batches = workload_batches(kind, args)
            for r in range(args.rounds):
                order = args.configs[r % len(args.configs):] + args.configs[: r % len(args.configs)]
                for name in order:
                    store = parent / f"{kind}-{name}-{r}"
                    say(f"{kind} round {r + 1}/{args.rounds}: {name}")
                    runs[kind][name].append(_measure(name, model, CONFIGS[name], batches, store, args))
                    shutil.rmtree(store, ignore_errors=True)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return _report(runs, args)


def _report(runs: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                                        "max_tokens": args.max_tokens, "batches": args.batches,
                                        "rounds": args.rounds,
                                        "device_cache_batches": args.device_cache_batches}}
    for kind, by_config in runs.items():
        base = statistics.median(t for r in by_config["none"] for t in r["batch_s"])
        rows = {}
        for name, rs in by_config.items():
            times = [t for r in rs for t in r["batch_s"]]
            median = statistics.median(times)
            rows[name] = {
                "median_batch_s": round(median, 3),
                "batch_s": times,
                "time_ratio": round(median / base, 3),
                "hit_tokens_per_round": [r["hit_tokens"] for r in rs],
                "vllm_prefix_hits_per_round": [r["vllm_prefix_hits"] for r in rs],
                "disk_write_MBps": [r["disk_write_MBps"] for r in rs],
                "chunks_written_per_round": [r["chunks_written"] for r in rs],
                "chunks_dropped_per_round": [r["chunks_dropped"] for r in rs],
                "thread_cpu_s_per_batch": rs[-1]["thread_cpu_s_per_batch"],
                "io_bytes_per_batch": rs[-1]["io_bytes_per_batch"],
            }
        out[kind] = rows
        if "default" in rows:
            out[f"{kind}_time_ratio"] = rows["default"]["time_ratio"]
        if REFERENCE in rows and kind == "no_reuse":
            out["no_reuse_ideal_time_ratio"] = rows[REFERENCE]["time_ratio"]
        if REFERENCE in rows and kind == "mixed":
            ideal = rows[REFERENCE]["time_ratio"]
            out["mixed_ideal_time_ratio"] = ideal
            if "default" in rows and ideal < 1:
                out["mixed_share_of_ideal"] = round((1 - rows["default"]["time_ratio"]) / (1 - ideal), 3)
    out["goals"] = {k: {"goal": v, "value": out.get(k), "met": out.get(k) is not None and out[k] <= v}
                    for k, v in GOALS.items()}
    return out
