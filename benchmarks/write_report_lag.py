"""How long a committed disk write waits to be reported while every core is busy.

kvstrata's write threads run at idle CPU priority (``tiers/priority.py``): they compress a chunk
only when serving leaves a core idle. Once the disk's writer thread (normal priority) has
committed the chunk, the write-behind learns it, releases the chunk's host slot and write budget,
marks it resident and journals its KV cache event. Two ways of reporting, side by side on one
real hierarchy (host slab + LMDB store), with ``--busy`` processes spinning at normal priority:

* ``caller``: the tier's ``put_many`` waits in the idle write thread, which reports when it runs
  again after the commit (as a tier without ``put_many_then`` of its own reports);
* ``writer``: ``DiskStore.put_many_then``, whose commit callback reports from the writer thread.

A monitor thread (normal priority) polls every millisecond which stored chunks the store holds
and which the write-behind reported; per chunk, the lag from the first poll that finds it
committed to the first that finds it reported. One JSON object on stdout.

    PYTHONPATH=. .venv/bin/python -m benchmarks.write_report_lag
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.host import HostPool, HostSlab

NS = b"write-report-lag"
VARIANTS = ("caller", "writer")


class ReportsFromCaller:
    """The real store, reporting its writes from the thread that asked for them."""

    def __init__(self, disk: DiskStore) -> None:
        self.disk = disk

    def __getattr__(self, name: str) -> Any:
        return getattr(self.disk, name)

    def put_many_then(self, entries: Sequence[Any], done: Callable[[int], None]) -> None:
        done(self.disk.put_many(entries))


def spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes (default: one per CPU)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--chunks", type=int, default=60, help="chunks stored per variant and repetition")
    p.add_argument("--rate", type=float, default=20.0, help="chunks stored per second")
    p.add_argument("--repeat", type=int, default=2, help="repetitions, every other one in reverse order")
    p.add_argument("--dir", help="where the stores go (default: a temporary directory here)")
    args = p.parse_args(argv)
    if args.busy < 0 or args.chunks < 1 or args.rate <= 0 or args.repeat < 1 or args.chunk_bytes % 2:
        p.error("--busy >= 0; --chunks, --rate, --repeat positive; --chunk-bytes even")
    return args


def run_variant(variant: str, root: Path, args: argparse.Namespace, seed: int) -> list[float]:
    """Per chunk, seconds from its commit seen to its report seen."""
    disk = DiskStore(root / "store", budget_bytes=1 << 40)
    slab = HostSlab(root / "slab", args.chunk_bytes, max(8, args.chunks))
    h = Hierarchy(HostPool(slab), disk if variant == "writer" else ReportsFromCaller(disk),  # type: ignore[arg-type]
                  namespaces=[NS], group_shard_bytes=[args.chunk_bytes], group_dtypes=["bfloat16"],
                  max_write_inflight_bytes=1 << 40, events=True)
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(32) + b"\0\0\0\0" for _ in range(args.chunks)]
    committed: dict[bytes, float] = {}
    reported: dict[bytes, float] = {}
    stored: list[bytes] = []
    lock = threading.Lock()
    stop = threading.Event()

    def monitor() -> None:
        while True:
            with lock:
                waiting = [k for k in stored if k not in reported]
            if not waiting and stop.is_set():
                return
            now = time.perf_counter()
            fresh = [k for k in waiting if k not in committed]
            for k, here in zip(fresh, disk.contains_many([NS + k for k in fresh]), strict=True):
                if here:
                    committed[k] = now
            for tier, removed, ks in h.take_events():
                if tier == "disk" and not removed:
                    for k in ks:
                        reported.setdefault(k, now)
            time.sleep(0.001)

    watcher = threading.Thread(target=monitor)
    watcher.start()
    try:
        for k in keys:
            slots = h.prepare_store([k])
            assert slots is not None, "the host tier is full"
            slab.array[slots[k]] = np.frombuffer(rng.bytes(args.chunk_bytes), np.uint8)
            h.complete_store([k])
            with lock:
                stored.append(k)
            time.sleep(1.0 / args.rate)
        deadline = time.monotonic() + 120
        while len(reported) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        watcher.join()
        h.close()
        slab.close()
        disk.close()
    return [reported[k] - committed.get(k, reported[k]) for k in keys if k in reported]


def summary(lags: list[float]) -> dict[str, float]:
    s = sorted(lags)
    return {"chunks": len(s), "median_ms": round(statistics.median(s) * 1e3, 2),
            "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1e3, 2), "max_ms": round(s[-1] * 1e3, 2),
            "over_100ms": sum(1 for x in s if x > 0.1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="write-report-lag-", dir=args.dir or "."))
    stop = mp.Event()
    spinners = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    lags: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        time.sleep(0.5)
        for rep in range(args.repeat):
            order = VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))
            for v in order:
                root = base / f"{v}-{rep}"
                root.mkdir()
                lags[v] += run_variant(v, root, args, seed=rep)
                shutil.rmtree(root)
    finally:
        stop.set()
        for p in spinners:
            p.join()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"busy_processes": args.busy, "chunk_bytes": args.chunk_bytes, "rate": args.rate,
                      "repeat": args.repeat, "commit_to_report": {v: summary(lags[v]) for v in VARIANTS}},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
