"""Child process for the multi-process tests of kvstrata.tiers.disk (run as a script).

Modes (each prints one line per step so that the parent can follow; JSON at the end):
  writer DIR FIRST COUNT [--forever] [--map-size N] [--size B] [--budget B]
                                                 put entries FIRST.. one per call
  reader DIR FIRST COUNT [--timeout S]          read-only: wait until all are readable, verify
  fsize DIR COUNT LIMIT                          put COUNT 1 MiB entries under RLIMIT_FSIZE=LIMIT

Also what the disk tests share in-process: ``key``, ``payload``, ``writer_held``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, when run from anywhere

from kvstrata.tiers.disk import DiskStore  # noqa: E402

BUDGET = 1 << 40


def key(i: int) -> bytes:
    return b"N" * 16 + i.to_bytes(32, "big") + (i % 3).to_bytes(4, "big")


def payload(i: int, nbytes: int = 256 << 10) -> bytes:
    """Deterministic fp16 "KV" for entry i (compressible, so the codec path is exercised)."""
    rng = np.random.default_rng(i)
    return (rng.standard_normal(nbytes // 2) * (1 + i % 7)).astype(np.float16).tobytes()


@contextlib.contextmanager
def writer_held(store: DiskStore) -> Iterator[None]:
    """Hold the store's writer in a transaction of its own while the body queues puts, so that
    they share the writer's next transactions."""
    holding, release = threading.Event(), threading.Event()

    def hold(txn: object, h: object) -> None:
        holding.set()
        assert release.wait(30)

    holder = threading.Thread(target=store.write, args=(hold,))
    holder.start()
    assert holding.wait(30)
    try:
        yield
    finally:
        release.set()
        holder.join(30)


def writer(args: argparse.Namespace) -> None:
    store = DiskStore(args.dir, budget_bytes=args.budget, map_size=args.map_size, sync_interval_s=0.05)
    i = args.first
    while args.forever or i < args.first + args.count:
        n = store.put_many([(key(i), payload(i, args.size), "float16")])
        print(f"put {i} {n}", flush=True)
        i += 1
    print(json.dumps({"stats": store.stats()}), flush=True)
    store.close()


def reader(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.timeout
    while True:  # the writer may not have created the store yet
        try:
            store = DiskStore(args.dir, budget_bytes=BUDGET, readonly=True, create=False)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    pending = set(range(args.first, args.first + args.count))
    out = bytearray(256 << 10)
    wrong = 0
    reads = 0
    while pending and time.monotonic() < deadline:
        for i in sorted(pending):
            n = store.get_into(key(i), out)
            reads += 1
            if n is None:
                continue
            if bytes(out[:n]) != payload(i):
                wrong += 1
            pending.discard(i)
        time.sleep(0.01)
    print(json.dumps({"missing": len(pending), "wrong": wrong, "reads": reads}), flush=True)
    store.close()


def fsize(args: argparse.Namespace) -> None:
    # Writes past RLIMIT_FSIZE fail with EFBIG instead of killing us: the "disk is full" case.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.limit, args.limit))
    store = DiskStore(args.dir, budget_bytes=BUDGET, full_retry_s=0.0)
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() for _ in range(args.count)]
    admitted = [store.put_many([(key(i), blobs[i], "uint8")]) for i in range(args.count)]
    out = bytearray(1 << 20)
    readable = sum(
        1
        for i, ok in enumerate(admitted)
        if ok and store.get_into(key(i), out) == len(out) and bytes(out) == blobs[i]
    )
    stats = store.stats()
    print(json.dumps({"admitted": sum(admitted), "readable": readable, "stats": stats}), flush=True)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("writer")
    w.add_argument("dir")
    w.add_argument("first", type=int)
    w.add_argument("count", type=int)
    w.add_argument("--forever", action="store_true")
    w.add_argument("--map-size", type=int, default=1 << 40)
    w.add_argument("--size", type=int, default=256 << 10, help="bytes per entry")
    w.add_argument("--budget", type=int, default=BUDGET, help="store budget: puts past it evict")
    r = sub.add_parser("reader")
    r.add_argument("dir")
    r.add_argument("first", type=int)
    r.add_argument("count", type=int)
    r.add_argument("--timeout", type=float, default=30.0)
    f = sub.add_parser("fsize")
    f.add_argument("dir")
    f.add_argument("count", type=int)
    f.add_argument("limit", type=int)
    args = parser.parse_args()
    {"writer": writer, "reader": reader, "fsize": fsize}[args.mode](args)


if __name__ == "__main__":
    main()
