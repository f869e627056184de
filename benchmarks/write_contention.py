"""What writing chunks to disk costs a CPU forward running beside it, per way of writing.

A stand-in for a CPU engine's forward (bf16 matmuls on ``--forward-threads`` torch threads, as
vLLM's OpenMP forward) runs in one process; another writes chunk-sized bf16 values at a fixed
rate one way: kvstrata's codec alone (``encode``, ``encode_raw``), kvstrata's disk tier
(``disk``: codec + LMDB, ``disk_raw``), a buffered ``pwrite`` of the raw bytes (``buffered``),
or an ``O_DIRECT`` one as vLLM's fs tier writes (``odirect``); ``none`` writes nothing. Per
variant and repetition (alternating order): the forward's iterations per second and the writer's
CPU milliseconds per chunk. ``--sizes`` adds a sweep of one buffered write per size at the same
rate against ``O_DIRECT``, CPU milliseconds per write: on the Firecracker VMs these benchmarks
ran on, a buffered write of 2 MiB or more costs 10-30x one just below it (docs/BENCHMARKS.md).

    .venv/bin/python -m benchmarks.write_contention
    .venv/bin/python -m benchmarks.write_contention --variants none,disk,odirect --sizes 1998848,2097152
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("none", "encode", "encode_raw", "disk", "disk_raw", "buffered", "odirect")
_DTYPE = "bfloat16"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--chunk-bytes", type=int, default=2_949_120,
                   help="bytes per chunk (default: a 128-token block of SmolLM2-135M in bf16)")
    p.add_argument("--rate", type=float, default=20.0, help="chunks written per second")
    p.add_argument("--seconds", type=float, default=10.0, help="writing time per variant and repetition")
    p.add_argument("--repeat", type=int, default=2, help="repetitions, every other one in reverse order")
    p.add_argument("--forward-threads", type=int, default=2)
    p.add_argument("--sizes", default="", help="comma-separated write sizes for the buffered-write sweep")
    p.add_argument("--dir", help="where to write (default: a temporary directory under the working directory)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(VARIANTS)}")
    args.variant_list = names
    try:
        args.size_list = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes: not a list of integers: {args.sizes!r}")
    if args.chunk_bytes < 2 or args.chunk_bytes % 2 or args.rate <= 0 or args.seconds <= 0 or args.repeat < 1:
        p.error("--chunk-bytes must be even and at least 2; --rate, --seconds and --repeat positive")
    if any(s < 4096 or s % 4096 for s in args.size_list):
        p.error("--sizes: each a positive multiple of 4096 (O_DIRECT needs whole pages)")
    return args


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def forward_stand_in(threads: int, ready: Any, go: Any, stop: Any, out: Any) -> None:
    """In its own process: bf16 matmuls on ``threads`` torch threads from ``go`` until ``stop``;
    puts the iterations per second on ``out``."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(2048, 576, dtype=torch.bfloat16)
    w = torch.randn(576, 1536, dtype=torch.bfloat16)
    (a @ w).sum()
    ready.set()
    go.wait()
    n, t0 = 0, time.perf_counter()
    while not stop.is_set():
        (a @ w).sum()
        n += 1
    out.put(n / (time.perf_counter() - t0))


def _chunks(nbytes: int, count: int = 8) -> list[Any]:
    import torch

    # Activation-like values: bf16 of a normal distribution (the codec's ratio on them is close
    # to real KV's, docs/STORAGE.md).
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(nbytes // 2, generator=gen) * 0.3).to(torch.bfloat16).view(torch.uint8).numpy()
            for _ in range(count)]


def write_chunks(variant: str, chunk_bytes: int, rate: float, seconds: float, where: str,
            ready: Any, go: Any, out: Any) -> None:
    """In its own process: write a chunk ``rate`` times a second for ``seconds`` the way
    ``variant`` names, into ``where``; puts the chunks written and CPU ms per chunk on ``out``."""
    from kvstrata.tiers import codec
    from kvstrata.tiers.disk.store import DiskStore

    chunks = _chunks(chunk_bytes)
    store = None
    fd = -1
    aligned = None
    if variant in ("disk", "disk_raw"):
        store = DiskStore(where, budget_bytes=1 << 40, codec="raw" if variant == "disk_raw" else "auto")
    elif variant in ("buffered", "odirect"):
        flags = os.O_CREAT | os.O_WRONLY | (os.O_DIRECT if variant == "odirect" else 0)
        fd = os.open(os.path.join(where, "chunks"), flags, 0o600)
        aligned = mmap.mmap(-1, -(-chunk_bytes // 4096) * 4096)  # page-aligned, as O_DIRECT needs
    ready.set()
    go.wait()
    c0, t0, i = _cpu_s(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        data = chunks[i % len(chunks)]
        key = i.to_bytes(16, "big")
        if variant in ("encode", "encode_raw"):
            codec.encode(data, _DTYPE, key=key, mode="raw" if variant == "encode_raw" else "auto")
        elif store is not None:
            store.put_many([(key, data, _DTYPE)])
        elif variant == "buffered":
            os.pwrite(fd, data, i * chunk_bytes)
        elif variant == "odirect":
            assert aligned is not None
            aligned[:chunk_bytes] = data.tobytes()
            os.pwrite(fd, aligned, i * len(aligned))
        i += 1
    cpu = _cpu_s() - c0
    if store is not None:
        store.close()
    if fd >= 0:
        os.close(fd)
    out.put({"chunks": i, "cpu_ms_per_chunk": round(1000 * cpu / max(i, 1), 3)})


def run_variant(variant: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    where = tempfile.mkdtemp(dir=work)
    ready_f, ready_w, go, stop = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    fwd_out, w_out = ctx.Queue(), ctx.Queue()
    fwd = ctx.Process(target=forward_stand_in, args=(args.forward_threads, ready_f, go, stop, fwd_out))
    fwd.start()
    writer = None
    if variant != "none":
        writer = ctx.Process(target=write_chunks, args=(variant, args.chunk_bytes, args.rate, args.seconds,
                                                    where, ready_w, go, w_out))
        writer.start()
        ready_w.wait(120)
    ready_f.wait(120)
    go.set()
    result: dict[str, Any] = {}
    if writer is not None:
        result.update(w_out.get(timeout=args.seconds + 300))
        writer.join()
    else:
        time.sleep(args.seconds)
    stop.set()
    result["forward_it_per_s"] = round(fwd_out.get(timeout=300), 2)
    fwd.join()
    shutil.rmtree(where, ignore_errors=True)
    return result


def size_sweep(sizes: list[int], rate: float, count: int, work: Path) -> dict[str, dict[str, float]]:
    """CPU ms per write: one buffered (page cache) and one O_DIRECT write per size, paced."""
    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        buf = mmap.mmap(-1, size)
        buf[:] = os.urandom(size)
        row: dict[str, float] = {}
        for name, flag in (("buffered", 0), ("odirect", os.O_DIRECT)):
            path = work / f"sweep-{size}-{name}"
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | flag, 0o600)
            c0, t0 = _cpu_s(), time.perf_counter()
            for i in range(count):
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                os.pwrite(fd, buf, i * size)
            row[f"{name}_cpu_ms_per_write"] = round(1000 * (_cpu_s() - c0) / count, 3)
            os.close(fd)
            path.unlink()
        out[str(size)] = row
        buf.close()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvstrata-write-contention-", dir=args.dir or Path.cwd()))
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for rep in range(args.repeat):
            order = args.variant_list if rep % 2 == 0 else args.variant_list[::-1]
            for variant in order:
                print(f"repetition {rep + 1}: {variant}", file=sys.stderr, flush=True)
                runs.setdefault(variant, []).append(run_variant(variant, args, work))
        sweep = size_sweep(args.size_list, args.rate, max(20, int(args.rate * args.seconds)), work) \
            if args.size_list else {}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    control = [r["forward_it_per_s"] for r in runs.get("none", [])]
    summary: dict[str, dict[str, float]] = {}
    for variant, rs in runs.items():
        row = {"forward_it_per_s": round(statistics.median(r["forward_it_per_s"] for r in rs), 2)}
        if control:
            row["forward_vs_none"] = round(row["forward_it_per_s"] / statistics.median(control), 3)
        if variant != "none":
            row["cpu_ms_per_chunk"] = round(statistics.median(r["cpu_ms_per_chunk"] for r in rs), 3)
        summary[variant] = row
    print(json.dumps({"chunk_bytes": args.chunk_bytes, "rate": args.rate, "seconds": args.seconds,
                      "forward_threads": args.forward_threads, "summary": summary, "runs": runs,
                      "size_sweep": sweep}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
