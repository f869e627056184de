"""One-command GPU check for device staging (``python -m kvstrata.tools.gpu_check``).

On a machine with a CUDA (or XPU) device, in under five minutes:

1. measures the ``StreamStager``'s device -> host (store) and host -> device (load) throughput
   on a vLLM-like KV cache (one int8 allocation, per-layer ``[B, H, N, 2D]`` bf16 views,
   scattered block ids) into a pinned shared slab, against a plain pinned ``copy_`` of the same
   number of bytes in the same run (a contiguous device tensor <-> a pinned host tensor);
2. runs the ``cuda``-marked tests (``pytest -m cuda``).

Prints one JSON object. Without a device it says so and exits 0 (``--require-gpu``: exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any


def _device() -> str | None:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return None


def _timed(fn, sync, reps: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(args: argparse.Namespace, device: str) -> dict[str, Any]:
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
        transfers = kv.transfers()
        jobs = iter(range(1 << 30))

        def sync() -> None:
            mod.synchronize()

        def store() -> None:
            job = next(jobs)
            stager.store(job, transfers)
            stager.wait([job])
            assert all(ok for _, ok in stager.poll())

        def load() -> None:
            job = next(jobs)
            stager.load(job, transfers)
            stager.wait([job])
            assert all(ok for _, ok in stager.poll())

        # Correctness on this device before timing: a store/load round trip.
        store()
        before = raw.clone()
        load()
        assert torch.equal(raw, before), "a store -> load round trip changed the KV cache"

        dev = raw[:nbytes]
        pinned = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
        slab_flat = slab.tensor.view(-1).view(torch.int8)
        ref = {
            "d2h_pinned": _timed(lambda: pinned.copy_(dev, non_blocking=True), sync, args.reps),
            "h2d_pinned": _timed(lambda: dev.copy_(pinned, non_blocking=True), sync, args.reps),
            "d2h_slab": _timed(lambda: slab_flat.copy_(dev, non_blocking=True), sync, args.reps),
        }
        t_store = _timed(store, sync, args.reps)
        t_load = _timed(load, sync, args.reps)
        gbps = {k: nbytes / v / 1e9 for k, v in ref.items()}
        store_gbps, load_gbps = nbytes / t_store / 1e9, nbytes / t_load / 1e9
        return {
            "device": torch.cuda.get_device_name() if device == "cuda" else device,
            "slab_pinned": slab.pinned,
            "bytes_per_job": nbytes,
            "page_bytes": page,
            "blocks_per_job": chunks * bpc,
            "store_d2h_GBps": round(store_gbps, 2),
            "load_h2d_GBps": round(load_gbps, 2),
            "copy_d2h_pinned_GBps": round(gbps["d2h_pinned"], 2),
            "copy_h2d_pinned_GBps": round(gbps["h2d_pinned"], 2),
            "copy_d2h_into_slab_GBps": round(gbps["d2h_slab"], 2),
            "store_vs_copy": round(store_gbps / gbps["d2h_pinned"], 3),
            "load_vs_copy": round(load_gbps / gbps["h2d_pinned"], 3),
        }
    finally:
        slab.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--blocks-per-chunk", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=32, help="chunks per job (32 x 32 MiB)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 without a device")
    args = parser.parse_args(argv)

    device = _device()
    if device is None:
        print(json.dumps({"status": "skipped", "reason": "no CUDA or XPU device visible"}))
        return 1 if args.require_gpu else 0

    result: dict[str, Any] = {"status": "ok"}
    try:
        result.update(measure(args, device))
    except Exception as exc:  # report, then still run the tests
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    if not args.skip_tests:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "cuda",
                "-q",
                "-rs",
                "tests/unit/test_device.py",
            ],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=240,
        )
        tail = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()[-300:]]
        result["cuda_tests"] = {"exit_code": proc.returncode, "summary": tail[0]}
        if proc.returncode != 0:
            result["status"] = "failed"
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-2000:])
    print(json.dumps(result, indent=1))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
