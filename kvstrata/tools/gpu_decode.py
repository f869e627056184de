"""Decode undisturbed by loads: inter-token latency of running requests with and without a
concurrent 4k-token load from kvstrata's host tier (``gpu_check``'s fourth figure).

Run as ``python -m kvstrata.tools.gpu_decode`` (a process of its own, so the device memory goes
back when it ends); prints one JSON object as its last line. On one in-process engine
(SmolLM2-135M-Instruct, as the demo):

1. the 4k-token prompt runs once per load, salted apart (its KV goes to kvstrata), then vLLM's own
   prefix cache is reset, so each next run loads its prefix from kvstrata's host tier;
2. ``--decodes`` short requests decode (kvstrata bypassed for them); after a warm-up, the time
   between their tokens is measured over ``--steps`` tokens: the baseline;
3. ``--loads`` times, a 4k-token prompt (salted apart, stored in step 1) is added while they
   decode; the time between their tokens is measured from then until it produced its first token
   (its load in flight, then its one recomputed token).

``itl_ratio`` = (3) / (2); goal <= 1.1 (issue 30: a load must not stall the forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GOAL = 1.1


def _is(output: Any, name: str) -> bool:
    # vLLM may suffix the request id it was given; outputs carry the given one or the suffixed.
    return output.request_id == name or output.request_id.startswith(name + "-")


def _itl(*windows: list[float]) -> float | None:
    gaps = [b - a for w in windows for a, b in zip(w, w[1:], strict=False)]
    return statistics.mean(gaps) if gaps else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvstrata.tools.corpus import chat_prompt
    from kvstrata.tools.engine import EngineOptions, build_llm, generate, shutdown_llm
    from kvstrata.tools.models import prepare_smollm2
    from kvstrata.tools.ttft import BYPASS_KVSTRATA

    model = prepare_smollm2(Path(args.model_cache) if args.model_cache else None)
    prompt = chat_prompt(model, args.prompt_tokens).token_ids
    store = tempfile.mkdtemp(prefix="kvstrata-gpu-decode-")
    opts = EngineOptions(model=str(model), store=store, host_bytes=1 << 30,
                         kv_cache_memory_bytes=args.kv_cache_bytes, max_model_len=8192,
                         block_size=args.block_size,
                         max_num_seqs=args.decodes + 2, multiprocess=False)
    llm = build_llm(opts)
    try:
        engine = llm.llm_engine
        # One salted copy of the prompt per load: each load is a whole 4k-token prefix.
        salts = [f"gpu-decode-{k}" for k in range(args.loads)]
        generate(llm, [prompt] * args.loads, max_tokens=1, cache_salt=salts)
        llm.reset_prefix_cache()

        bypass = SamplingParams(temperature=0.0,
                                max_tokens=args.warmup + 2 * args.steps + 100 * args.loads,
                                ignore_eos=True,
                                extra_args={"kv_transfer_params": BYPASS_KVSTRATA})
        for i in range(args.decodes):
            # Distinct short prompts: nothing for kvstrata or the prefix cache to serve.
            engine.add_request(f"decode-{i}", TokensPrompt(prompt_token_ids=[100 + i] * 64), bypass)

        def step_until(stop: Callable[[list[Any], list[float]], bool]) -> list[float]:
            stamps: list[float] = []
            while engine.has_unfinished_requests():
                outs = engine.step()
                now = time.perf_counter()
                if any(_is(o, "decode-0") for o in outs):
                    stamps.append(now)
                if stop(outs, stamps):
                    return stamps
            raise RuntimeError("the decode requests finished before the measurement did")

        # Warm-up: also lets the first prompt's last stores complete (they go out at step starts).
        step_until(lambda _o, s: len(s) >= args.warmup)
        base = step_until(lambda _o, s: len(s) >= args.steps)

        load = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        windows: list[list[float]] = []
        cached: list[int] = []
        for k, salt in enumerate(salts):
            engine.add_request(f"load{k}", TokensPrompt(prompt_token_ids=prompt, cache_salt=salt),
                               load)
            first: dict[str, int] = {}

            def loaded(outs: list[Any], stamps: list[float], name: str = f"load{k}",
                       first: dict[str, int] = first) -> bool:
                for o in outs:
                    if _is(o, name) and o.outputs and o.outputs[0].token_ids:
                        first.setdefault("cached", int(o.num_cached_tokens or 0))
                        first.setdefault("at", len(stamps))
                # Two more decode tokens after the load's first one: its own step is included.
                return "at" in first and len(stamps) >= first["at"] + 2

            windows.append(step_until(loaded))
            cached.append(first["cached"])
            step_until(lambda _o, s: len(s) >= 5)  # the request finishes; decodes settle

        base_itl, load_itl = _itl(base), _itl(*windows)
        return {
            "status": "ok",
            "decodes": args.decodes,
            "baseline_itl_ms": round(base_itl * 1e3, 3) if base_itl else None,
            "with_load_itl_ms": round(load_itl * 1e3, 3) if load_itl else None,
            "itl_ratio": round(load_itl / base_itl, 3) if base_itl and load_itl else None,
            "goal_itl_ratio": GOAL,
            "loads": args.loads,
            "tokens_during_loads": sum(len(w) for w in windows),
            # The loads must really come from kvstrata: nearly the whole prompt each.
            "load_prompt_tokens": len(prompt),
            "load_cached_tokens": cached,
        }
    finally:
        shutdown_llm(llm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--loads", type=int, default=4, help="4k-token loads, one after another")
    parser.add_argument("--model-cache", default=None)
    parser.add_argument("--block-size", type=int, default=16, help="(CPU engines: 128)")
    parser.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        result = measure(args)
    except Exception as exc:  # one JSON line whatever happens: gpu_check reads it
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.flush()
    print(json.dumps(result))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
