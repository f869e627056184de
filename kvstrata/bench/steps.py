"""The engine's steps, from a server's log: what ``bench serve`` reports as ``engine_steps``.

Each server runs with vLLM's ``--enable-logging-iteration-details``, which logs one line per
engine step that scheduled tokens (``Engine 000: Iteration(N): C context requests, T context
tokens, G generation requests, ...``). Summed per configuration, the lines say where a run's time
went inside the engine: steps that prefilled (and how many shared a step with another request's
prefill), steps that only decoded, the prompt tokens the engine computed (which should agree with
``computed_tokens`` from vLLM's counters), and how many requests ran at once, the bound a small
device KV cache puts on a workload (docs/BENCHMARKS.md, "Inside the engine's steps").

``decode_step_ms`` is the median decode-only step with a full batch (the most requests any
decode-only step ran): the same model step whatever a cache serves, so it tells how fast the
machine was while a configuration ran; on a shared VM that moves by 10-40 % from minute to minute
(docs/BENCHMARKS.md, "The pair three times, every peer twice, and the VM's slow minutes").
A configuration that keeps more requests running has a larger full batch, so its probe is a
larger step: ``decode_steps_by_running`` gives, per number of requests decoded, how many
decode-only steps there were and their median, to compare configurations at the same batch.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_STEP = re.compile(
    r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, "
    r"(\d+) generation requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms")

SUMMED = ("steps", "prefill_steps", "shared_prefill_steps", "decode_only_steps", "context_tokens",
          "generation_tokens", "prefill_step_s", "decode_only_s")


def summarise_steps(lines: Iterable[str]) -> dict[str, Any] | None:
    """The step figures of one log's lines; None when it has no step line (the server ran
    without iteration details, or served nothing)."""
    out: dict[str, Any] = dict.fromkeys(SUMMED, 0)
    out["max_running"] = 0
    found = False
    decode: list[tuple[int, float]] = []  # (requests, ms) of each decode-only step
    for line in lines:
        m = _STEP.search(line)
        if m is None:
            continue
        found = True
        ctx_reqs, ctx_tokens, gen_reqs, gen_tokens = (int(g) for g in m.groups()[:4])
        elapsed_ms = float(m.group(5))
        elapsed_s = elapsed_ms / 1000.0
        out["steps"] += 1
        out["context_tokens"] += ctx_tokens
        out["generation_tokens"] += gen_tokens
        out["max_running"] = max(out["max_running"], ctx_reqs + gen_reqs)
        if ctx_reqs:
            out["prefill_steps"] += 1
            out["prefill_step_s"] += elapsed_s
            if ctx_reqs > 1:
                out["shared_prefill_steps"] += 1
        else:
            out["decode_only_steps"] += 1
            out["decode_only_s"] += elapsed_s
            decode.append((gen_reqs, elapsed_ms))
    if not found:
        return None
    for key in ("prefill_step_s", "decode_only_s"):
        out[key] = round(out[key], 3)
    by_running: dict[int, list[float]] = {}
    for n, ms in decode:
        by_running.setdefault(n, []).append(ms)
    out["decode_steps_by_running"] = steps = {
        str(n): {"steps": len(ms), "median_ms": round(statistics.median(ms), 2)}
        for n, ms in sorted(by_running.items())}
    full = max(by_running, default=0)
    out["decode_step_running"] = full
    out["decode_step_ms"] = steps[str(full)]["median_ms"] if decode else None
    return out


def log_steps(log: Path) -> dict[str, Any] | None:
    """:func:`summarise_steps` of a server's log file (None if it cannot be read)."""
    try:
        with open(log, errors="replace") as f:
            return summarise_steps(f)
    except OSError:
        return None


def combine(figures: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several servers' or runs' step figures as one: counts and seconds summed, the most
    requests running at once the largest of them, ``decode_step_ms`` the median of theirs (a
    machine-speed probe, not a sum), and per batch size the steps summed and the median of
    their medians. None when none has any."""
    have = [f for f in figures if f]
    if not have:
        return None
    out: dict[str, Any] = {k: sum(f.get(k, 0) for f in have) for k in SUMMED}
    for key in ("prefill_step_s", "decode_only_s"):
        out[key] = round(out[key], 3)
    out["max_running"] = max(int(f.get("max_running", 0)) for f in have)
    out["decode_step_running"] = max(int(f.get("decode_step_running") or 0) for f in have)
    probes = [f["decode_step_ms"] for f in have if f.get("decode_step_ms") is not None]
    out["decode_step_ms"] = round(statistics.median(probes), 2) if probes else None
    by_running: dict[str, list[dict[str, Any]]] = {}
    for f in have:
        for n, fig in (f.get("decode_steps_by_running") or {}).items():
            by_running.setdefault(n, []).append(fig)
    out["decode_steps_by_running"] = {
        n: {"steps": sum(f["steps"] for f in figs),
            "median_ms": round(statistics.median(f["median_ms"] for f in figs), 2)}
        for n, figs in sorted(by_running.items(), key=lambda kv: int(kv[0]))}
    return out
