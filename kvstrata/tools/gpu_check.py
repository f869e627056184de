"""One-command GPU check (``kvstrata gpu-check --json`` or ``python -m kvstrata.tools.gpu_check``).

Meant for the first minutes of any session with a CUDA (or XPU) device, in under 8 minutes:

1. ``cuda_tests``: the ``cuda``-marked tests (``pytest -m cuda tests/unit``): the real device path
   on caches vLLM's own code builds (round trips on every layout, a load finishing while compute
   is busy, no device memory held); skipped where vLLM's Python package is not installed;
2. ``stream_contract``: the same rules on synthetic KV (``kvstrata.tools.gpu_contract``): needs
   only torch and vLLM's compiled copy op, so it runs on a machine where vLLM cannot be installed
   (``benchmarks/device/``);
3. ``stager``: ``StreamStager`` store (device -> host) and load (host -> device) throughput of a
   1 GiB job of scattered vLLM-shaped pages into a pinned slab, against a plain pinned
   ``copy_`` (one cudaMemcpyAsync) of the same bytes; goal >= 0.8x each way; and the time the
   engine thread spends submitting one such job (``*_submit_ms``), and how much such a job,
   submitted at a step's start, lengthens a synthetic forward (matmuls on the compute stream,
   ``step_with_*_vs_alone``; goal <= 1.1x: a transfer must not stall a forward);
4. ``demo``: the demo's three TTFTs (cold, host tier, disk tier after a restart) with
   SmolLM2-135M-Instruct (``kvstrata demo --json``);
5. ``decode``: inter-token latency of running requests with and without a concurrent 4k-token
   load from the host tier (``kvstrata.tools.gpu_decode``); goal <= 1.1x.

Prints one JSON object (``status``: ok, failed, or skipped without a device). Sections run in
turn; one that fails is reported and the next still runs; each has its own time limit. A section
that cannot run here (no vLLM engine on the machine) is ``skipped`` with its reason and does not
fail the check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.tools import gpu_contract

if TYPE_CHECKING:
    from kvstrata.tiers.device import DeviceStager, Transfer

ROOT = Path(__file__).resolve().parents[2]
GOALS = {"store_vs_copy": 0.8, "load_vs_copy": 0.8, "itl_ratio": 1.1, "step_with_job_vs_alone": 1.1}
# Per-section limits (seconds): with the stager section (about 20 s) under 8 minutes in all.
LIMITS = {"cuda_tests": 90, "demo": 210, "decode": 140}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--blocks-per-chunk", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=32, help="chunks per job (32 x 32 MiB)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--descriptors-per-call", type=int, default=None,
                        help="the stager's copy-op call size (0: a job in one call; default: "
                             "the stager's own)")
    parser.add_argument("--pace-depth", type=int, default=None,
                        help="copy-op calls a copy thread keeps ahead of the device (0: no "
                             "pacing; default: the stager's own)")
    parser.add_argument("--launch-hold-s", type=float, default=None,
                        help="the longest copies wait for a forward's launch (0: never held; "
                             "default: the stager's own)")
    parser.add_argument("--skip", action="append", default=[],
                        choices=["cuda_tests", "stream_contract", "stager", "demo", "decode"],
                        help="leave a section out (repeatable)")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 without a device")


def _device() -> tuple[str | None, str]:
    try:
        import torch
    except ImportError as exc:
        return None, f"torch cannot be imported: {exc}"
    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu", "xpu"
    return None, (f"no CUDA or XPU device visible (torch {torch.__version__}, CUDA build "
                  f"{torch.version.cuda or 'none'})")


def _timed(fn: Callable[[], object], sync: Callable[[], object], reps: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_stager(args: argparse.Namespace, device: str) -> dict[str, Any]:
    import torch

    from kvstrata.tiers.device import StreamStager
    from kvstrata.tiers.host import HostSlab, default_slab_path
    from kvstrata.tools.synthetic_kv import synthetic_kv

    mod = getattr(torch, device)
    bpc, chunks = args.blocks_per_chunk, args.chunks
    kv = synthetic_kv(layers=args.layers, kv_heads=8, block_tokens=args.block_tokens, head_size=128,
                      blocks_per_chunk=bpc, chunks=chunks, device=device)
    raw, page, nbytes = kv.raw, kv.page, kv.job_bytes
    slab = HostSlab(default_slab_path(f"gpu-check-{os.getpid()}"), kv.shard_bytes, chunks)
    slab.unlink()
    try:
        stager = kv.stager(slab)
        # The numbers are only meaningful for the stream path (not a CPU fallback).
        assert isinstance(stager, StreamStager), f"got {type(stager).__name__} on {device}"
        for knob in ("descriptors_per_call", "pace_depth", "launch_hold_s"):  # default: the stager's
            if getattr(args, knob) is not None:
                setattr(stager, knob, getattr(args, knob))
        transfers = kv.transfers()
        jobs = iter(range(1 << 30))

        def run(submit: Callable[[int, list[Transfer]], None]) -> None:
            job = next(jobs)
            submit(job, transfers)
            stager.wait([job])
            done = stager.poll()
            assert done and all(ok for _, ok in done), f"job failed: {done}"

        # Correctness on this device before timing: store, wipe the job's pages, load them back.
        run(stager.store)
        before = raw.clone()
        ids = [b for t in transfers for b in t.block_ids]
        raw.view(args.layers, kv.num_blocks, page)[:, ids] = 0
        run(stager.load)
        assert torch.equal(raw, before), "a store -> load round trip changed the KV cache"
        allocated = mod.memory_allocated() if hasattr(mod, "memory_allocated") else None

        dev = raw[:nbytes]
        pinned = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
        ref = {
            "d2h": _timed(lambda: pinned.copy_(dev, non_blocking=True), mod.synchronize, args.reps),
            "h2d": _timed(lambda: dev.copy_(pinned, non_blocking=True), mod.synchronize, args.reps),
        }
        t_store = _timed(lambda: run(stager.store), mod.synchronize, args.reps)
        t_load = _timed(lambda: run(stager.load), mod.synchronize, args.reps)
        submit = {d: _submit_seconds(stager, getattr(stager, d), transfers, jobs, args.reps)
                  for d in ("store", "load")}
        steps = forward_steps(stager, transfers, jobs, mod, device, max(args.reps, 7))
        store_gbps, load_gbps = nbytes / t_store / 1e9, nbytes / t_load / 1e9
        d2h, h2d = nbytes / ref["d2h"] / 1e9, nbytes / ref["h2d"] / 1e9
        stager.close()
        return {
            "status": "ok",
            "slab_pinned": slab.pinned,
            "bytes_per_job": nbytes,
            "page_bytes": page,
            "blocks_per_job": chunks * bpc,
            "descriptors_per_call": stager.descriptors_per_call,
            "pace_depth": stager.pace_depth,
            "launch_hold_s": stager.launch_hold_s,
            "store_GBps": round(store_gbps, 2),
            "load_GBps": round(load_gbps, 2),
            "copy_d2h_pinned_GBps": round(d2h, 2),
            "copy_h2d_pinned_GBps": round(h2d, 2),
            "store_submit_ms": round(submit["store"] * 1e3, 2),
            "load_submit_ms": round(submit["load"] * 1e3, 2),
            "store_vs_copy": round(store_gbps / d2h, 3),
            "load_vs_copy": round(load_gbps / h2d, 3),
            "device_bytes_allocated_after_jobs": allocated,
            **steps,
        }
    finally:
        slab.close()


def _submit_seconds(stager: DeviceStager, submit: Callable[[int, list[Transfer]], None],
                    transfers: list[Transfer], jobs: Iterator[int], reps: int) -> float:
    """Engine-thread time of one job: until ``store``/``load`` returns (the copies run after)."""
    best = float("inf")
    for _ in range(reps):
        job = next(jobs)
        t0 = time.perf_counter()
        submit(job, transfers)
        best = min(best, time.perf_counter() - t0)
        stager.wait([job])
        stager.poll()
    return best


def forward_steps(stager: DeviceStager, transfers: list[Transfer], jobs: Iterator[int],
                  mod: Any, device: str, reps: int, size: int = 4096) -> dict[str, Any]:
    """Median time of a synthetic forward (40 bf16 ``size`` x ``size`` matmuls, then waiting for
    the compute stream only) alone, and with a store or a load of the whole job submitted on the
    engine thread just before it, the copies held while the forward is launched, as the
    connector does (``step_*``); ``*_unheld_*``: the same without holding them. ``job_ms_*``:
    from the submission until the job is done. On CUDA the same forward is also timed captured
    as one CUDA graph (``graph_*``): vLLM replays its decode steps as graphs, one launch where
    the eager forward makes 40."""
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(a)
    # torch.cpu's stream has no synchronize (a CPU run only checks this code runs).
    sync = getattr(mod.current_stream(), "synchronize", None) or mod.synchronize

    def eager() -> None:
        for _ in range(40):
            torch.mm(a, a, out=out)

    def step(forward: Callable[[], None], submit: Callable[[int, list[Transfer]], None] | None,
             held: bool) -> tuple[float, float]:
        job = next(jobs)
        t0 = time.perf_counter()
        if held:
            stager.hold_copies()
        if submit is not None:
            submit(job, transfers)
        forward()
        stager.release_copies()
        sync()
        dt = time.perf_counter() - t0
        if submit is not None:
            stager.wait([job])
            stager.poll()
        return dt, time.perf_counter() - t0

    def median(forward: Callable[[], None], submit: Callable[[int, list[Transfer]], None] | None,
               held: bool = True) -> tuple[float, float]:
        step(forward, submit, held)  # warm-up
        times = sorted(step(forward, submit, held) for _ in range(reps))
        mid = times[len(times) // 2]
        return mid[0], sorted(t for _, t in times)[len(times) // 2]

    forwards: dict[str, Callable[[], None]] = {"": eager}
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        eager()  # cuBLAS picks its kernels (and workspace) before the capture
        mod.synchronize()
        with torch.cuda.graph(graph):
            eager()
        forwards["graph_"] = graph.replay
    result: dict[str, Any] = {}
    for prefix, forward in forwards.items():
        alone = median(forward, None)[0]
        (store, store_job), (load, load_job) = median(forward, stager.store), median(forward, stager.load)
        (ustore, ustore_job) = median(forward, stager.store, held=False)
        (uload, uload_job) = median(forward, stager.load, held=False)
        result |= {
            f"{prefix}step_ms_alone": round(alone * 1e3, 2),
            f"{prefix}step_ms_with_store": round(store * 1e3, 2),
            f"{prefix}step_ms_with_load": round(load * 1e3, 2),
            f"{prefix}step_with_job_vs_alone": round(max(store, load) / alone, 3),
            f"{prefix}step_with_job_unheld_vs_alone": round(max(ustore, uload) / alone, 3),
            f"{prefix}job_ms_store_load": [round(store_job * 1e3, 2), round(load_job * 1e3, 2)],
            f"{prefix}job_ms_store_load_unheld": [round(ustore_job * 1e3, 2), round(uload_job * 1e3, 2)],
        }
    return result


def _vllm_missing() -> str | None:
    try:
        found = importlib.util.find_spec("vllm.v1.kv_cache_interface") is not None
    except ImportError:
        found = False
    return None if found else "vLLM's Python package is not installed (the tests build caches with it)"


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _child(name: str, cmd: list[str]) -> dict[str, Any]:
    """Run a section in its own process (its device memory goes back when it ends)."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMITS[name])
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"status": "failed", "error": f"timed out after {LIMITS[name]} s",
                "tail": out[-1500:]}
    return {"exit_code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def run_cuda_tests() -> dict[str, Any]:
    if (why := _vllm_missing()) is not None:
        return {"status": "skipped", "reason": why}
    r = _child("cuda_tests", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs",
                              "-p", "no:cacheprovider", "tests/unit"])
    if "exit_code" not in r:
        return r
    lines = r["stdout"].strip().splitlines() or [r["stderr"].strip()[-300:]]
    ok = r["exit_code"] == 0 and "passed" in lines[-1] and "skipped" not in lines[-1]
    out = {"status": "ok" if ok else "failed", "exit_code": r["exit_code"], "summary": lines[-1]}
    if not ok:
        out["tail"] = (r["stdout"][-3000:] + r["stderr"][-1000:]).strip()
    return out


def run_demo() -> dict[str, Any]:
    if (why := _vllm_missing()) is not None:
        return {"status": "skipped", "reason": why}
    store = tempfile.mkdtemp(prefix="kvstrata-gpu-check-demo-")
    r = _child("demo", [sys.executable, "-m", "kvstrata.tools.cli", "demo", "--json",
                        "--store", store])
    if "exit_code" not in r:
        return r
    result = _last_json(r["stdout"])
    if result is None:
        return {"status": "failed", "exit_code": r["exit_code"], "tail": r["stderr"][-2000:]}
    keep = ("prompt_tokens", "cold_ttft_s", "host_ttft_s", "disk_ttft_s", "host_vs_cold",
            "disk_vs_cold", "disk_vs_host", "outputs_identical", "host_hit_tokens",
            "disk_hit_tokens", "page_cache_dropped", "elapsed_s")
    out = {k: result[k] for k in keep if k in result}
    out["status"] = "ok" if r["exit_code"] == 0 and result.get("outputs_identical") else "failed"
    return out


def run_decode() -> dict[str, Any]:
    if (why := _vllm_missing()) is not None:
        return {"status": "skipped", "reason": why}
    r = _child("decode", [sys.executable, "-m", "kvstrata.tools.gpu_decode"])
    if "exit_code" not in r:
        return r
    result = _last_json(r["stdout"])
    if result is None:
        return {"status": "failed", "exit_code": r["exit_code"], "tail": r["stderr"][-2000:]}
    return result


def check(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    device, name = _device()
    if device is None:
        return {"status": "skipped", "reason": name, "_exit_code": 1 if args.require_gpu else 0}
    result: dict[str, Any] = {"status": "ok", "device": name, "goals": GOALS}
    sections = {
        "cuda_tests": run_cuda_tests,
        "stream_contract": lambda: gpu_contract.check(device),
        "stager": lambda: measure_stager(args, device),
        "demo": run_demo,
        "decode": run_decode,
    }
    for section, fn in sections.items():
        if section in args.skip:
            continue
        s0 = time.monotonic()
        try:
            out = fn()
        except Exception as exc:  # report it; the next section still runs
            out = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        out["seconds"] = round(time.monotonic() - s0, 1)
        result[section] = out
        if out.get("status") not in ("ok", "skipped"):
            result["status"] = "failed"
    stager, decode = result.get("stager", {}), result.get("decode", {})
    result["meets_goals"] = {
        k: (v >= GOALS[k] if k.endswith("_vs_copy") else v <= GOALS[k])
        for k, v in (("store_vs_copy", stager.get("store_vs_copy")),
                     ("load_vs_copy", stager.get("load_vs_copy")),
                     ("step_with_job_vs_alone", stager.get("step_with_job_vs_alone")),
                     ("itl_ratio", decode.get("itl_ratio")))
        if isinstance(v, (int, float))
    }
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    result["_exit_code"] = 0 if result["status"] == "ok" else 1
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``kvstrata gpu-check``."""
    return check(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    result = check(parser.parse_args(argv))
    code = int(result.pop("_exit_code", 0))
    print(json.dumps(result, indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
