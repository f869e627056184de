"""How fast the write-behind gets a burst of stored chunks down to disk, per ``write_threads``.

A GPU prefills faster than one thread compresses: an 8B model's KV is 128 KiB per token, so 10k
tokens a second are 1.3 GB/s, and byte-plane shuffle + zstd runs at 0.3-0.5 GB/s per core
(../shared/docs/storage-facts.md 3.3). What the write-behind cannot keep up with waits in the
host tier and, once the host tier evicts it, is never written. This stores a burst of chunks
into a real hierarchy (host slab + LMDB store, the host tier large enough to hold the whole
burst, write threads at normal priority as on an accelerator engine) and times it until the
store has committed every chunk, once per thread count, alternating the order between
repetitions. Chunks hold bf16 values drawn like KV (normal, small), so they compress as KV does.

Reports per thread count: seconds to drain, GB/s of raw KV written (median and each repetition),
CPU seconds of the write threads and of the store's writer thread. One JSON object on stdout.

    PYTHONPATH=. .venv/bin/python -m benchmarks.write_throughput --threads 1,2,4
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.host import HostPool, HostSlab
from kvstrata.tools.engine import thread_cpu_seconds

STEP_CHUNKS = 8  # chunks stored per engine step (a prefill step's worth, as the connector does)
DISTINCT = 8  # distinct chunk contents, reused round-robin (generating KV-like data is slow)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2,4", help="comma-separated write_threads values")
    p.add_argument("--chunk-bytes", type=int, default=4 << 20,
                   help="bytes per chunk and shard (default 4 MiB: 32 tokens of an 8B model)")
    p.add_argument("--shards", type=int, default=1, help="tensor-parallel shards per chunk")
    p.add_argument("--chunks", type=int, default=128, help="chunks in the burst")
    p.add_argument("--repeat", type=int, default=2, help="repetitions, every other one in reverse order")
    p.add_argument("--dir", help="where the stores go (default: a temporary directory here)")
    args = p.parse_args(argv)
    try:
        args.thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        p.error(f"--threads: comma-separated counts, not {args.threads!r}")
    if (not args.thread_counts or min(args.thread_counts) < 1 or args.chunks < 1 or args.shards < 1
            or args.repeat < 1 or args.chunk_bytes < 2 or args.chunk_bytes % 2):
        p.error("--threads, --chunks, --shards, --repeat positive; --chunk-bytes even")
    return args


def kv_like(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """bf16 bit patterns of small normal values, as raw bytes."""
    f = (rng.standard_normal(nbytes // 2) * 0.05).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def drain(threads: int, root: Path, args: argparse.Namespace, contents: list[np.ndarray]) -> dict[str, Any]:
    """Store the burst and wait until the store committed every chunk."""
    namespaces = [f"write-thru-rank{r}".encode().ljust(16, b"!")[:16] for r in range(args.shards)]
    shard = args.chunk_bytes
    disk = DiskStore(root / "store", budget_bytes=1 << 40)
    slab = HostSlab(root / "slab", shard * args.shards, args.chunks + STEP_CHUNKS)
    everything = slab.nbytes
    h = Hierarchy(HostPool(slab), disk, namespaces=namespaces, group_shard_bytes=[shard],
                  group_dtypes=["bfloat16"], idle_writes=False, write_threads=threads,
                  max_deferred_bytes=everything, max_write_pinned_bytes=everything)
    keys = [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(args.chunks)]
    try:
        cpu0 = thread_cpu_seconds()
        t0 = time.perf_counter()
        for start in range(0, len(keys), STEP_CHUNKS):
            step = keys[start:start + STEP_CHUNKS]
            slots = h.prepare_store(step)
            assert slots is not None, "the host tier is full"
            for i, slot in enumerate(slots.values()):
                for r in range(args.shards):
                    slab.array[slot, r * shard:(r + 1) * shard] = contents[(start + i + r) % len(contents)]
            h.complete_store(list(slots))
        deadline = time.monotonic() + 600
        while h.stats()["writes_completed"] < len(keys):
            stats = h.stats()
            if stats["writes_failed"] or stats["writes_lost"] or time.monotonic() > deadline:
                raise RuntimeError(f"the burst was not written: {stats}")
            time.sleep(0.002)
        seconds = time.perf_counter() - t0
        cpu1 = thread_cpu_seconds()
    finally:
        h.close()
        slab.close()
        disk.close()

    def cpu(prefix: str) -> float:
        return round(sum(v - cpu0.get(k, 0.0) for k, v in cpu1.items() if k.startswith(prefix)), 2)

    return {"seconds": seconds, "gbps": len(keys) * shard * args.shards / seconds / 1e9,
            "write_threads_cpu_s": cpu("kvstrata-write"), "disk_writer_cpu_s": cpu("kvstrata-disk-writer")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    contents = [kv_like(rng, args.chunk_bytes) for _ in range(DISTINCT)]
    base = Path(tempfile.mkdtemp(prefix="write-throughput-", dir=args.dir or "."))
    runs: dict[int, list[dict[str, Any]]] = {t: [] for t in args.thread_counts}
    try:
        for rep in range(args.repeat):
            order = args.thread_counts if rep % 2 == 0 else list(reversed(args.thread_counts))
            for threads in order:
                root = base / f"{threads}-{rep}"
                root.mkdir()
                runs[threads].append(drain(threads, root, args, contents))
                shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out: dict[str, Any] = {"chunk_bytes": args.chunk_bytes, "shards": args.shards, "chunks": args.chunks,
                           "burst_bytes": args.chunk_bytes * args.shards * args.chunks, "repeat": args.repeat,
                           "write_threads": {}}
    for threads, rs in runs.items():
        out["write_threads"][str(threads)] = {
            "gbps_median": round(statistics.median(r["gbps"] for r in rs), 3),
            "gbps": [round(r["gbps"], 3) for r in rs],
            "seconds": [round(r["seconds"], 3) for r in rs],
            "write_threads_cpu_s": [r["write_threads_cpu_s"] for r in rs],
            "disk_writer_cpu_s": [r["disk_writer_cpu_s"] for r in rs],
        }
    first = str(args.thread_counts[0])
    for threads in args.thread_counts[1:]:
        out["write_threads"][str(threads)]["vs_first"] = round(
            out["write_threads"][str(threads)]["gbps_median"] / out["write_threads"][first]["gbps_median"], 2)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
