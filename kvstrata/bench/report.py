"""Figures and charts of ``kvstrata bench serve``: per-configuration statistics, the top-level
ratios the issue's goals name, and the PNG charts (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstrata.bench import steps
from kvstrata.bench.client import RequestResult

KVSTRATA = "kvstrata"
VLLM = "vllm"
LMCACHE = "lmcache"
NATIVE = ("vllm_cpu_offload", "vllm_tiered_fs")  # vLLM's own offloading
PEERS = (*NATIVE, LMCACHE)  # "the better of vLLM's native offloading configurations and LMCache"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def floor_tokens(results: Sequence[RequestResult]) -> int:
    """Prompt tokens that no cache could have served: each prompt past the longest prefix an
    earlier request had already sent, and at least the one token vLLM always computes."""
    return sum(max(1, r.prompt_tokens - r.reusable_tokens) for r in results)


def computed_tokens(prompt_tokens: int, hits: dict[str, float]) -> int | None:
    """Prompt tokens the engine computed: those neither its own prefix cache nor a connector
    served (vLLM's counters); None when the server did not report them."""
    if "vllm_prefix_cache" not in hits:
        return None
    return int(prompt_tokens - hits["vllm_prefix_cache"] - hits.get("external", 0.0))


def summarise(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """TTFT mean/p50/p90/p99, ITL p50/p99, output tokens/s, errors, TTFT by round, and the
    workload's floor of prompt tokens to compute (``floor_tokens``)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)
    by_round: dict[str, float | None] = {}
    for rnd in sorted({r.round for r in results}):
        vals = [r.ttft_s for r in ok if r.round == rnd and r.ttft_s is not None]
        by_round[str(rnd + 1)] = _r(statistics.fmean(vals)) if vals else None
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
        "ttft_mean_s": _r(statistics.fmean(ttft)) if ttft else None,
        "ttft_p50_s": _r(percentile(ttft, 50)),
        "ttft_p90_s": _r(percentile(ttft, 90)),
        "ttft_p99_s": _r(percentile(ttft, 99)),
        "itl_p50_s": _r(percentile(itl, 50)),
        "itl_p99_s": _r(percentile(itl, 99)),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "floor_tokens": floor_tokens(results),
        "wall_s": _r(wall_s, 2),
        "output_tok_per_s": _r(out_tokens / wall_s, 2) if wall_s > 0 else None,
        "ttft_mean_by_round_s": by_round,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def ratios(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The top-level ratios: kvstrata (defaults) against vLLM alone, the best peer and LMCache.
    A ratio whose configurations did not both run is None."""

    def fig(name: str, key: str) -> float | None:
        c = configs.get(name) or {}
        if c.get("skipped") or c.get("failed"):
            return None
        value = c.get(key)
        return float(value) if isinstance(value, (int, float)) else None

    peers_ttft = [v for v in (fig(p, "ttft_mean_s") for p in PEERS) if v is not None]
    peers_p99 = [v for v in (fig(p, "ttft_p99_s") for p in PEERS) if v is not None]
    peers_tput = [v for v in (fig(p, "output_tok_per_s") for p in PEERS) if v is not None]
    peers_computed = [v for v in (fig(p, "computed_tokens") for p in PEERS) if v is not None]
    mine = {k: fig(KVSTRATA, k) for k in ("ttft_mean_s", "ttft_p99_s", "output_tok_per_s", "computed_tokens")}
    errors = sum(int(c.get("errors", 0) or 0) for c in configs.values())
    return {
        "ttft_mean_vs_vllm": _ratio(mine["ttft_mean_s"], fig(VLLM, "ttft_mean_s")),
        "ttft_mean_vs_native_best": _ratio(mine["ttft_mean_s"], min(peers_ttft, default=None)),
        "ttft_p99_vs_native_best": _ratio(mine["ttft_p99_s"], min(peers_p99, default=None)),
        "throughput_vs_vllm": _ratio(mine["output_tok_per_s"], fig(VLLM, "output_tok_per_s")),
        "throughput_vs_native_best": _ratio(mine["output_tok_per_s"], max(peers_tput, default=None)),
        "ttft_mean_vs_lmcache": _ratio(mine["ttft_mean_s"], fig(LMCACHE, "ttft_mean_s")),
        # Not a goal: how many prompt tokens kvstrata computed against the peer that computed
        # the fewest. Where both are near the workload's floor, no cache can make kvstrata's
        # TTFT much lower than that peer's (docs/BENCHMARKS.md, "How far from the floor").
        "computed_tokens_vs_native_best": _ratio(mine["computed_tokens"], min(peers_computed, default=None)),
        "errors": errors,
    }


RATIOS = ("ttft_mean_vs_vllm", "ttft_mean_vs_native_best", "ttft_p99_vs_native_best",
          "throughput_vs_vllm", "throughput_vs_native_best", "ttft_mean_vs_lmcache",
          "computed_tokens_vs_native_best")


def pooled(runs: Sequence[tuple[dict[str, Any], Sequence[RequestResult]]]) -> dict[str, Any]:
    """One configuration's figures over several runs of the workload (``--repeat``): the
    statistics of every request of every run together (a p99 over all of them), output tokens/s
    over the runs' summed wall time, counters summed, stops clean only if every one was. A run
    that was skipped or failed is left out (``runs_failed``); none that ran gives the first
    run's figures."""
    ran = [(f, r) for f, r in runs if not f.get("skipped") and not f.get("failed")]
    if not ran:
        return dict(runs[0][0]) if runs else {}
    figs = [f for f, _ in ran]
    out: dict[str, Any] = {"description": figs[0].get("description"), "runs": len(ran),
                           "runs_failed": len(runs) - len(ran)}
    out.update(summarise([x for _, r in ran for x in r], sum(float(f.get("wall_s") or 0.0) for f in figs)))
    out["ttft_samples_s"] = [x for f in figs for x in f.get("ttft_samples_s", [])]
    computed = [f.get("computed_tokens") for f in figs]
    out["computed_tokens"] = None if None in computed else sum(computed)
    for key in ("hit_tokens", "kvstrata"):
        summed: dict[str, float] = {}
        for f in figs:
            for k, v in (f.get(key) or {}).items():
                summed[k] = summed.get(k, 0.0) + v
        if summed:
            out[key] = summed
    out["engine_steps"] = steps.combine(f.get("engine_steps") for f in figs)
    out["clean_stop"] = all(f.get("clean_stop") is not False for f in figs)
    out["tracebacks"] = sum(int(f.get("tracebacks", 0)) for f in figs)
    out["shutdown_tracebacks"] = sum(int(f.get("shutdown_tracebacks", 0)) for f in figs)
    stores = [f.get("stores_clean_shutdown") for f in figs if f.get("stores_clean_shutdown") is not None]
    out["stores_clean_shutdown"] = all(stores) if stores else None
    return out


def spread(by_run: Sequence[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """Each goal ratio's min / median / max over the runs that had it."""
    out: dict[str, dict[str, float] | None] = {}
    for key in RATIOS:
        values = [float(r[key]) for r in by_run if isinstance(r.get(key), (int, float))]
        out[key] = None if not values else {
            "min": min(values), "median": round(statistics.median(values), 3), "max": max(values)}
    return out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def serve_chart(path: Path, ttfts: dict[str, list[float]],
                by_round: dict[str, dict[str, float | None]], title: str) -> str | None:
    """TTFT distribution per configuration (box plot) and mean TTFT by round; the PNG's path,
    or None without matplotlib."""
    try:
        plt = _pyplot()
    except ImportError:
        return None
    names = [n for n in ttfts if ttfts[n]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    if names:
        ax1.boxplot([ttfts[n] for n in names], showfliers=True)
        ax1.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("time to first token (s)")
    ax1.set_title("TTFT per configuration")
    return _rounds_panel_and_save(plt, fig, ax2, by_round, title, path)


def _rounds_panel_and_save(plt: Any, fig: Any, ax: Any, by_round: dict[str, dict[str, float | None]],
                           title: str, path: Path) -> str:
    """Both serve charts' right panel (mean TTFT by round per configuration), then the PNG."""
    for name, rounds in by_round.items():
        xs = [int(k) for k, v in rounds.items() if v is not None]
        if xs:
            ax.plot(xs, [v for v in rounds.values() if v is not None], marker="o", label=name)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("round")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("TTFT by round")
    if ax.get_lines():
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def percentile_chart(path: Path, configs: dict[str, dict[str, Any]], title: str) -> str | None:
    """The same two panels from a finished run's JSON (``serve.json`` or the partial file):
    TTFT mean/p50/p90/p99 per configuration, and mean TTFT by round."""
    try:
        plt = _pyplot()
    except ImportError:
        return None
    names = [n for n, c in configs.items() if c.get("ttft_mean_s") is not None]
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ax1.bar([j + i * width for j in range(len(names))],
                [configs[n][key] for n in names], width, label=key.removeprefix("ttft_")[:-2])
    ax1.set_xticks([j + 1.5 * width for j in range(len(names))], names, rotation=30, ha="right",
                   fontsize=8)
    ax1.set_ylabel("time to first token (s)")
    ax1.set_title("TTFT per configuration")
    ax1.legend(fontsize=7)
    by_round = {n: configs[n].get("ttft_mean_by_round_s") or {} for n in names}
    return _rounds_panel_and_save(plt, fig, ax2, by_round, title, path)


def sweep_chart(path: Path, series: dict[str, dict[str, float | None]], title: str) -> str | None:
    """TTFT against prompt length, one line per case (log-log)."""
    try:
        plt = _pyplot()
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, points in series.items():
        xs = [int(k) for k, v in points.items() if v is not None]
        ys = [v for v in points.values() if v is not None]
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title, fontsize=9)
    if ax.get_lines():
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
