"""What storing costs a cold request's first token.

Distinct cold prompts, one after another, on one engine (its engine core in its own process, as
a server runs it), after one warm-up prompt: nothing is ever reused, so every difference between
configurations is what each one's stores cost the forward that runs beside them. kvstrata (with
``--kvstrata-config`` options, or host tier only) against vLLM's tiered fs offloading
(``benchmarks/vllm_fs_baseline.py``) and vLLM alone; each configuration in its own process,
``--rounds`` times in alternating order. Per configuration and round: each prompt's time to first
token (engine-measured), the median, the warm-up prompt's own (``first_ttft_s``), and CPU seconds
per process and thread over the timed prompts (kvstrata's threads carry their names:
``kvs-urgent-disk``, ``kvs-disk-writer``, ...).

    .venv/bin/python -m benchmarks.cold_store_cost --configs kvstrata,vllm_tiered_fs,kvstrata_host_only
    .venv/bin/python -m benchmarks.cold_store_cost --configs kvstrata --kvstrata-config '{"codec": "raw"}'
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = ("kvstrata", "kvstrata_host_only", "vllm_tiered_fs", "vllm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="kvstrata,vllm_tiered_fs",
                   help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    p.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct, as the demo)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama checkpoint instead")
    p.add_argument("--prompts", type=int, default=10, help="timed cold prompts per configuration")
    p.add_argument("--prompt-tokens", type=int, default=2500)
    p.add_argument("--rounds", type=int, default=1, help="configurations run this many times, alternating")
    p.add_argument("--host-bytes", type=int, default=128 << 20)
    p.add_argument("--kv-cache-bytes", type=int, default=208 << 20)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kvstrata-config", default="{}", help="JSON options for kvstrata")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one configuration, in this process
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        p.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(CONFIGS)}")
    if args.prompts < 1 or args.rounds < 1 or args.prompt_tokens < 2:
        p.error("--prompts and --rounds must be at least 1, --prompt-tokens at least 2")
    try:
        extra = json.loads(args.kvstrata_config)
    except json.JSONDecodeError as exc:
        p.error(f"--kvstrata-config: not JSON ({exc})")
    if not isinstance(extra, dict):
        p.error("--kvstrata-config: expected a JSON object")
    args.names, args.extra = names, extra
    return args


def _model(args: argparse.Namespace, work: Path) -> Path:
    from kvstrata.tools import models

    if args.model:
        return Path(args.model).expanduser()
    if args.tiny:
        path = work / "tiny-llama"
        if not (path / "config.json").is_file():
            models.make_tiny_llama(path)
        return path
    return models.prepare_smollm2()


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this process: warm-up, then the timed cold prompts."""
    from kvstrata.bench.peers import vllm_offload_config
    from kvstrata.bench.server import cpu_delta, cpu_seconds
    from kvstrata.tools.engine import EngineOptions, build_llm, generate, shutdown_llm

    name, work = args.child, Path(args.work)
    model = _model(args, work)
    store = work / f"store_{name}"
    extra = dict(args.extra)
    if name == "kvstrata_host_only":
        extra["disk"] = False
    opts = EngineOptions(model=str(model), store=str(store) if name.startswith("kvstrata") else None,
                         host_bytes=args.host_bytes, kv_cache_memory_bytes=args.kv_cache_bytes,
                         max_model_len=args.max_model_len, max_num_seqs=8, multiprocess=True,
                         skip_tokenizer_init=not (model / "tokenizer.json").is_file(),
                         extra_config=extra)
    if name == "vllm_tiered_fs":
        kv, env = vllm_offload_config(args.host_bytes, work / f"fs_{name}")
        os.environ.update(env)
        opts.llm_kwargs["kv_transfer_config"] = kv
    llm = build_llm(opts)
    try:
        vocab = llm.llm_engine.model_config.get_vocab_size()
        rng = random.Random(0)  # the same prompts for every configuration

        def prompt() -> list[int]:
            return [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]

        # Warm-up: the process's first prefill pays one-time setup (reported on its own).
        [first] = generate(llm, [prompt()], 4)
        cpu0 = cpu_seconds(os.getpid())
        ttft: list[float] = []
        for _ in range(args.prompts):
            [done] = generate(llm, [prompt()], 1)
            ttft.append(round(done.ttft_s or 0.0, 4))
        time.sleep(2.0)  # what the stores do after the last first token is part of their cost
        cpu = cpu_delta(cpu0, cpu_seconds(os.getpid()))
    finally:
        shutdown_llm(llm)
    return {"first_ttft_s": round(first.ttft_s or 0.0, 4), "ttft_s": ttft,
            "ttft_median_s": round(statistics.median(ttft), 4), "cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = run_child(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    work = Path(tempfile.mkdtemp(prefix="kvstrata-cold-store-"))
    base = list(argv if argv is not None else sys.argv[1:])  # the child gets the same options
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in args.names}
    try:
        for rnd in range(args.rounds):
            for name in args.names if rnd % 2 == 0 else args.names[::-1]:
                print(f"round {rnd + 1}: {name}", file=sys.stderr, flush=True)
                proc = subprocess.run(
                    [sys.executable, "-m", "benchmarks.cold_store_cost", *base,
                     "--child", name, "--work", str(work)],
                    capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    runs[name].append({"failed": (proc.stderr or proc.stdout)[-1500:]})
                else:
                    runs[name].append(json.loads(lines[-1][len("RESULT "):]))
                for path in work.glob(f"*_{name}"):  # each run starts from an empty store
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {n: [r["ttft_median_s"] for r in rs if "ttft_median_s" in r] for n, rs in runs.items()}
    print(json.dumps({
        "prompt_tokens": args.prompt_tokens, "prompts": args.prompts, "rounds": args.rounds,
        "kvstrata_config": args.extra, "host_bytes": args.host_bytes,
        "ttft_median_s": {n: (round(statistics.median(m), 4) if m else None) for n, m in medians.items()},
        "runs": runs,
    }, indent=1))
    return 0 if all("failed" not in r for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
