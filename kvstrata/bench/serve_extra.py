"""The two extra parts of ``kvstrata bench serve``.

**Equivalence under load** (``--equivalence``): the same multi-round workload in float32, greedy,
asking the first token's top-k logprobs of every request. Three runs: vLLM without a connector,
the same again (the control: how much the CPU backend's results move with the batch around a
request when nothing but timing differs, vLLM's own prefix caching included), and kvstrata. For
each request whose prompt is the same token ids in both runs, the largest logprob difference over
the top-k of the reference; kvstrata is equivalent when its largest difference is within 1e-4, or
within the control's own when the control already exceeds that.

**Long-context sweep** (``--sweep``): TTFT against prompt length, one request at a time, for four
cases: cold (a fresh prompt on a kvstrata server), host tier (the same prompt after vLLM's own
prefix cache is reset, ``/reset_prefix_cache`` in vLLM's dev mode), disk after a restart (a new
server on the same store; the host tier starts empty), and vLLM's fs tier after a restart
(``vllm_tiered_fs``'s configuration, a new server on the same directory).
"""

from __future__ import annotations

import argparse
import shutil
import urllib.request
from pathlib import Path
from typing import Any

from kvstrata.bench import report
from kvstrata.bench.configs import BaseSettings, build_setup, min_kv_cache_bytes
from kvstrata.bench.peers import PeerUnavailable
from kvstrata.bench.workload import WorkloadSpec, build_workload, long_prompt

TOP_K = 5
TOLERANCE = 1e-4
SWEEP_CASES = ("cold", "host", "disk_after_restart", "vllm_fs_after_restart")


def _key(r: Any) -> tuple[int, int]:
    return (r.user, r.round)


def logprob_diff(ref: list[Any], other: list[Any]) -> dict[str, Any]:
    """Largest |logprob difference| over the reference's top-k, per request with the same prompt."""
    theirs = {_key(r): r for r in other if r.ok and r.top_logprobs}
    worst = 0.0
    compared = diverged = topk_mismatch = 0
    for r in ref:
        o = theirs.get(_key(r))
        if not r.ok or not r.top_logprobs or o is None:
            continue
        if o.prompt_digest != r.prompt_digest:
            diverged += 1  # an earlier round's greedy answer differed: not the same request
            continue
        compared += 1
        if set(o.top_logprobs) != set(r.top_logprobs):
            topk_mismatch += 1
        for tok, lp in r.top_logprobs.items():
            if tok in o.top_logprobs:
                worst = max(worst, abs(lp - o.top_logprobs[tok]))
    return {"compared": compared, "diverged_prompts": diverged, "topk_set_mismatch": topk_mismatch,
            "max_abs_logprob_diff": worst}


def equivalence(args: argparse.Namespace, model: Path, spec: WorkloadSpec, out: Path,
                progress: Any) -> dict[str, Any]:
    from kvstrata.bench.serve import base_settings, run_config

    base = base_settings(args, model, "float32", args.max_model_len, progress.say)
    if args.kv_cache_bytes == "auto":
        base.kv_cache_bytes = min_kv_cache_bytes(model, "float32", args.max_model_len)
    wl = build_workload(model, spec)
    runs: dict[str, Any] = {}
    figs: dict[str, Any] = {}
    for label, config in (("reference", "vllm"), ("control", "vllm"), ("kvstrata", "kvstrata")):
        fig, results = run_config(config, base, wl, out / "equivalence" / label, progress,
                                  logprobs=TOP_K, keep_stores=args.keep_stores)
        runs[label] = results
        figs[label] = {k: fig.get(k) for k in ("errors", "ttft_mean_s", "hit_tokens",
                                               "clean_stop", "skipped", "failed")}
    control = logprob_diff(runs["reference"], runs["control"])
    mine = logprob_diff(runs["reference"], runs["kvstrata"])
    bound = max(TOLERANCE, control["max_abs_logprob_diff"])
    return {"dtype": "float32", "top_k": TOP_K, "tolerance": TOLERANCE,
            "control_vs_reference": control, "kvstrata_vs_reference": mine,
            "batch_dependent": control["max_abs_logprob_diff"] > TOLERANCE,
            "equivalent": bool(mine["compared"]) and mine["max_abs_logprob_diff"] <= bound
            and mine["topk_set_mismatch"] <= control["topk_set_mismatch"],
            "runs": figs}


def _reset_prefix_cache(base_url: str) -> bool:
    req = urllib.request.Request(f"{base_url}/reset_prefix_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _sweep_server(name: str, base: BaseSettings, setup_dir: Path, log: Path) -> Any:
    from kvstrata.bench.server import ApiServer, wait_healthy

    setup = build_setup(name, base, setup_dir)
    spec = setup.specs[0]
    spec.env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    return spec, setup, lambda tag: _started(ApiServer(f"{name}_{tag}", spec, log.with_name(
        f"{log.stem}_{tag}.log")), wait_healthy)


def _started(server: Any, wait: Any) -> Any:
    try:
        wait([server])
    except Exception:
        server.stop()
        raise
    return server


def sweep(args: argparse.Namespace, model: Path, lengths: list[int], out: Path,
          progress: Any) -> dict[str, Any]:
    from kvstrata.bench.client import one_request
    from kvstrata.bench.serve import base_settings
    from kvstrata.bench.server import ServerError
    from kvstrata.tools.engine import drop_page_cache

    longest = max(lengths) + args.max_tokens + 16
    base = base_settings(args, model, args.dtype, longest, progress.say)
    # One prompt of the longest length must fit vLLM's cache (the sweep is about the tiers).
    base.kv_cache_bytes = max(base.kv_cache_bytes, min_kv_cache_bytes(model, args.dtype, longest))
    series: dict[str, dict[str, float | None]] = {c: {} for c in SWEEP_CASES}
    notes: dict[str, Any] = {"max_model_len": longest}
    prompts = {n: long_prompt(model, n, seed=1000 + n) for n in lengths}

    def ttft(server: Any, n: int) -> float | None:
        r = one_request(server.base, str(model), prompts[n], max_tokens=1)
        progress.step()
        return None if not r.ok else round(r.ttft_s or 0.0, 4)

    work = out / "sweep"
    try:
        _, _, start = _sweep_server("kvstrata", base, work / "kvstrata", work / "kvstrata.log")
        s = start("first")
        try:
            for n in lengths:
                series["cold"][str(n)] = ttft(s, n)
            for n in lengths:
                notes.setdefault("reset_prefix_cache", _reset_prefix_cache(s.base))
                _reset_prefix_cache(s.base)
                series["host"][str(n)] = ttft(s, n)
        finally:
            s.stop()
        # Same store, page cache dropped (when allowed): the host tier starts empty, the disk
        # holds the prompts.
        notes["page_cache_dropped"] = drop_page_cache()
        s = start("restart")
        try:
            for n in lengths:
                _reset_prefix_cache(s.base)
                series["disk_after_restart"][str(n)] = ttft(s, n)
        finally:
            s.stop()
            notes["kvstrata_clean_stop"] = s.clean_stop
    except (ServerError, PeerUnavailable) as exc:
        notes["kvstrata_failed"] = str(exc)[-400:]
    try:
        spec, _, start = _sweep_server("vllm_tiered_fs", base, work / "vllm_fs",
                                       work / "vllm_fs.log")
        s = start("first")
        try:
            for n in lengths:
                one_request(s.base, str(model), prompts[n], max_tokens=1)  # stores it
        finally:
            s.stop()
        drop_page_cache()
        s = start("restart")
        try:
            for n in lengths:
                series["vllm_fs_after_restart"][str(n)] = ttft(s, n)
        finally:
            s.stop()
    except (ServerError, PeerUnavailable) as exc:
        notes["vllm_fs_failed"] = str(exc)[-400:]
    if not args.keep_stores:  # the logs beside them stay
        for store in (work / "kvstrata", work / "vllm_fs"):
            shutil.rmtree(store, ignore_errors=True)
    chart = report.sweep_chart(out / "sweep_ttft.png", series,
                               f"{model.name}: TTFT against prompt length (one request at a time)")
    return {"ttft_s": series, "chart": chart, **notes}
