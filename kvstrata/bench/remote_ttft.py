"""``kvstrata bench remote``, part 2: the first token served from the shared tier against the
local disk tier and against recomputing (``remote.py`` has the load-rate part, the server and the
goals; see its docstring for the procedure).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstrata.tools.redis_local import plain_client, strlens


def _generate(name: str, prompt: list[int], max_tokens: int, salt: str,
              bypass: bool = False) -> dict[str, Any]:
    from kvstrata.tools.ttft import BYPASS_KVSTRATA

    step: dict[str, Any] = {"op": "generate", "name": name, "prompts": [prompt],
                            "max_tokens": max_tokens, "cache_salt": salt, "ignore_eos": True}
    if bypass:
        step["kv_transfer_params"] = BYPASS_KVSTRATA
    return step


def _served(step: dict[str, Any]) -> dict[str, Any]:
    """One generate step's TTFT, tokens and where kvstrata says its prefix came from."""
    out, m = step["outputs"][0], step["metrics"]
    return {"ttft_s": out["ttft_s"], "token_ids": out["token_ids"],
            "prompt_tokens": out["prompt_tokens"], "cached_tokens": out["num_cached_tokens"],
            **{f"hit_tokens_{t}": int(m.get(f"vllm:kvstrata_hit_tokens_{t}", 0))
               for t in ("host", "disk", "remote")},
            "hit_tokens": int(m.get("vllm:kvstrata_hit_tokens", 0))}


def first_token(url: str, args: argparse.Namespace, tokens: int,
                say: Callable[[str], None]) -> dict[str, Any]:
    from kvstrata.bench.e2e import smollm2, stores_parent
    from kvstrata.config_values import parse_size
    from kvstrata.tools import ttft
    from kvstrata.tools.cli import CLIError
    from kvstrata.tools.corpus import chat_prompt
    from kvstrata.tools.engine import store_summary
    from kvstrata.tools.jobs import JobError, run_job_subprocess
    from kvstrata.tools.models import check_smollm2_prompt

    try:
        check_smollm2_prompt(tokens, args.max_tokens)
    except ValueError as exc:
        raise CLIError(str(exc).replace("--prompt-tokens", "--tokens")) from None
    model = smollm2(args, say)
    prompt = chat_prompt(model, tokens).token_ids
    salt = f"kvstrata-bench-remote-{os.urandom(4).hex()}"  # nothing of an earlier run is found
    remote_opts = {"remote_url": url, "codec": args.codec, "zstd_level": args.level}
    drop = [] if args.no_drop_caches else [{"op": "drop_page_cache"}]

    def engine(store: Path, extra: dict[str, Any]) -> dict[str, Any]:
        opts = ttft.engine_options(
            str(model), str(store), tokens,
            host_bytes=parse_size("--host-bytes", args.host_bytes),
            kv_cache_bytes=parse_size("--kv-cache-bytes", args.kv_cache_bytes), multiprocess=True)
        opts.extra_config = extra
        return asdict(opts)

    def warm(tag: str) -> dict[str, Any]:  # one-time kernel set-up, nothing stored (ttft.py)
        return _generate("warmup", prompt, 2, f"{salt}-warmup-{tag}", bypass=True)

    def job(name: str, spec: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], int]:
        """The steps of one engine process by name, and the bytes it read from the server."""
        try:
            res = run_job_subprocess(spec, timeout_s=900, progress=lambda m: say(f"  {name}: {m}"))
        except JobError as exc:
            raise CLIError(f"the engine failed ({name}): {exc}") from None
        # A gauge (cumulative, the newest snapshot wins), so the process' largest value.
        read = max((int(s.get("metrics", {}).get("vllm:kvstrata_remote_read_bytes", 0))
                    for s in res["steps"]), default=0)
        return {s["name"]: s for s in res["steps"]}, read

    plain = plain_client(url)
    pattern = b"kvstrata:*"
    new_keys: list[bytes] = []
    with stores_parent(args.store, "kvstrata-bench-remote-") as parent, \
            contextlib.ExitStack() as cleanup:
        cleanup.callback(plain.close)
        cleanup.callback(lambda: new_keys and plain.delete(*new_keys))  # this run's values only
        filled = parent / "filled"
        shutil.rmtree(filled, ignore_errors=True)
        keys_before = set(plain.scan_iter(match=pattern, count=1000))
        say("fill: the prompt computed once, stored to the local disk and the remote tier")
        fill, _ = job("fill", {"engine": engine(filled, remote_opts), "steps": [
            warm("fill"), _generate("fill", prompt, args.max_tokens, salt)]})
        new_keys = sorted(set(plain.scan_iter(match=pattern, count=1000)) - keys_before)
        value_sum = sum(int(n or 0) for n in strlens(plain, new_keys))
        held = store_summary(filled, str(model)).get("model") or {}
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = ["remote", "disk"] if r % 2 == 0 else ["disk", "remote"]
            rr: dict[str, Any] = {"order": order}
            for kind in order:
                say(f"round {r + 1}/{args.rounds}: {kind}")
                if kind == "remote":
                    fresh = parent / f"remote-{r}"
                    shutil.rmtree(fresh, ignore_errors=True)
                    steps, read = job(kind, {"engine": engine(fresh, remote_opts), "steps": [
                        warm("remote"), *drop, _generate("remote", prompt, args.max_tokens, salt),
                        _generate("cold", prompt, args.max_tokens, f"{salt}-cold-{r}", bypass=True)]})
                    rr["remote"], rr["cold"] = _served(steps["remote"]), _served(steps["cold"])
                    rr["remote_process_read_bytes"] = read
                    shutil.rmtree(fresh, ignore_errors=True)
                else:
                    steps, _ = job(kind, {"engine": engine(filled, {"codec": args.codec}), "steps": [
                        warm("disk"), *drop, _generate("disk", prompt, args.max_tokens, salt)]})
                    rr["disk"] = _served(steps["disk"])
                    rr["page_cache_dropped"] = bool(drop) and all(
                        s.get("ok") for s in steps.values() if s["op"] == "drop_page_cache")
            rounds.append(rr)
    return _ttft_summary(_served(fill["fill"]), rounds, len(new_keys), value_sum, held)


def _ttft_summary(fill: dict[str, Any], rounds: list[dict[str, Any]], remote_keys: int,
                  value_sum: int, held: dict[str, Any]) -> dict[str, Any]:
    prompt_tokens = fill["prompt_tokens"]

    def from_remote(s: dict[str, Any]) -> bool:
        # Every token kvstrata served came from the remote tier, and it served the prompt
        # (all of it but the token a request always computes).
        return (s["hit_tokens_remote"] == s["hit_tokens"] == s["cached_tokens"]
                and s["hit_tokens_disk"] == 0 and s["cached_tokens"] >= prompt_tokens - 1)

    def from_disk(s: dict[str, Any]) -> bool:
        return (s["hit_tokens_disk"] == s["hit_tokens"] == s["cached_tokens"]
                and s["hit_tokens_remote"] == 0 and s["cached_tokens"] >= prompt_tokens - 1)

    def cold(s: dict[str, Any]) -> bool:
        return s["cached_tokens"] == 0 and s["hit_tokens"] == 0

    ok = {"remote": all(from_remote(r["remote"]) for r in rounds),
          "disk": all(from_disk(r["disk"]) for r in rounds),
          "cold": all(cold(r["cold"]) for r in rounds)}
    med = {k: round(statistics.median(r[k]["ttft_s"] for r in rounds), 4)
           for k in ("remote", "disk", "cold")}
    ref = rounds[0]["cold"]["token_ids"]

    def ratio(a: str, b: str) -> float | None:  # refused unless both preconditions held
        return round(med[a] / med[b], 4) if ok[a] and ok[b] and med[b] else None

    out: dict[str, Any] = {
        "remote_ttft_vs_disk_ttft": ratio("remote", "disk"),
        "remote_ttft_vs_cold": ratio("remote", "cold"),
        "remote_ttft_s": med["remote"], "disk_ttft_s": med["disk"], "cold_ttft_s": med["cold"],
        "served_from_remote": ok["remote"], "served_from_disk": ok["disk"], "cold_recomputed": ok["cold"],
        "preconditions": {
            "remote": "hit_tokens_remote == hit_tokens == cached tokens >= prompt - 1, "
                      "hit_tokens_disk == 0",
            "disk": "hit_tokens_disk == hit_tokens == cached tokens >= prompt - 1, "
                    "hit_tokens_remote == 0",
            "cold": "no cached tokens (kvstrata bypassed, a cache salt of its own)"},
        "outputs_identical": all(r[k]["token_ids"] == ref for r in rounds
                                 for k in ("remote", "disk", "cold")),
        "page_cache_dropped": all(r.get("page_cache_dropped") for r in rounds),
        "prompt_tokens": prompt_tokens,
        "fill": {"ttft_s": round(fill["ttft_s"], 4), "remote_keys": remote_keys,
                 "remote_value_bytes": value_sum, "disk_stored_bytes": held.get("stored_bytes"),
                 "raw_bytes": held.get("raw_bytes")},
        # The real KV of the engine, as the server holds it (the synthetic KV's is bytes_vs_raw).
        "engine_kv_bytes_vs_raw": (round(value_sum / held["raw_bytes"], 4)
                                   if held.get("raw_bytes") else None),
        "rounds": [{"order": r["order"], **{k: {f: round(r[k][f], 4) if f == "ttft_s" else r[k][f] for f in (
            "ttft_s", "cached_tokens", "hit_tokens_host", "hit_tokens_disk", "hit_tokens_remote")}
            for k in ("remote", "disk", "cold")},
            "remote_process_read_bytes": r["remote_process_read_bytes"]} for r in rounds],
    }
    if not ok["remote"]:
        out["refused"] = "the remote runs were not all served from the remote tier alone: no remote ratio"
    return out
