"""What a busy Python thread in the engine-core process does to kvstrata's disk reads and writes.

kvstrata's tiers run in vLLM's engine-core process (the scheduler side): its read threads decode
chunks from LMDB into the host slab (a promotion: what a disk hit's first token waits for), its
write threads compress chunks for the disk. Their C calls (zstd, numpy, xxh3, LMDB) release the
GIL, and each time they want it back they wait for the engine core's own Python threads to let
go of it: up to Python's switch interval (kvstrata sets 0.5 ms, ``python_switch_interval_s``;
Python's default is 5 ms). On a GPU server the engine core's step loop is such a thread.

This measures, on a real LMDB store and host slab, for each switch interval: a thread reading
chunks into slab slots (``DiskStore.get_into``) and one encoding them (the codec a write runs),
alone and beside a busy pure-Python thread (the step loop's stand-in); and the same reads and
encodes done by a child process on the same store and slab, the parent's thread only sending
a batch of chunk indices and waiting for the answer; and promotions by a real hierarchy (host
pool + that store: a lookup's chunks read into host slots and landed) with its reads in its
threads and in ``read_processes``; and writes behind by a real hierarchy, framed in its write
threads and in ``write_processes``. Reports GB/s of raw KV and the busy thread's rate against
running alone. One JSON object on stdout.

    PYTHONPATH=. .venv/bin/python -m benchmarks.gil_contention
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.write_throughput import kv_like
from kvstrata.tiers import codec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.host import HostPool, HostSlab

DTYPE = "bfloat16"
PARTS = {"threads", "promotions", "writes"}
ANSWER_TIMEOUT_S = 60.0  # the child's answer to one chunk, far beyond any read or encode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk-bytes", type=int, default=4 << 20, help="bytes per chunk (default 4 MiB)")
    p.add_argument("--chunks", type=int, default=16, help="distinct chunks stored and read round-robin")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement")
    p.add_argument("--processes", type=int, default=2,
                   help="the hierarchies' read_processes and write_processes (and their read and write threads)")
    p.add_argument("--batch", type=int, default=8,
                   help="chunks per message to the child process (a promotion job reads up to 16)")
    p.add_argument("--switch-intervals", default="0.005,0.0005",
                   help="comma-separated sys.setswitchinterval values (seconds)")
    p.add_argument("--dir", help="where the store and slab go (default: a temporary directory here)")
    p.add_argument("--codec", choices=("auto", "raw"), default="auto",
                   help="the hierarchies' store codec (raw: framing is a copy and a checksum, so the "
                        "puts themselves are most of a write)")
    p.add_argument("--parts", default="threads,promotions,writes",
                   help="which parts to run (comma-separated: threads, promotions, writes)")
    args = p.parse_args(argv)
    try:
        args.intervals = [float(s) for s in args.switch_intervals.split(",")]
    except ValueError:
        p.error(f"--switch-intervals: comma-separated seconds, not {args.switch_intervals!r}")
    if (args.chunk_bytes < 2 or args.chunk_bytes % 2 or args.chunks < 1 or args.seconds <= 0
            or args.batch < 1 or args.processes < 1 or not args.intervals or min(args.intervals) <= 0):
        p.error("--chunk-bytes even, --chunks, --seconds, --batch, --processes and "
                "--switch-intervals positive")
    args.part_names = set(args.parts.split(","))
    if not args.part_names or not args.part_names <= PARTS:
        p.error(f"--parts: comma-separated, of {', '.join(sorted(PARTS))}; not {args.parts!r}")
    return args


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


class Busy:
    """A pure-Python loop on its own thread: the engine core's step loop stand-in."""

    def __init__(self) -> None:
        self.iterations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy", daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            for _ in range(1000):
                n += 1
            self.iterations = n

    def __enter__(self) -> Busy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def busy_rate(seconds: float) -> float:
    """Iterations a second of the busy loop with nothing beside it."""
    with Busy() as busy:
        time.sleep(seconds)
        return busy.iterations / seconds


def timed(op: Callable[[int], None], seconds: float, nbytes: int, busy: bool) -> tuple[float, float | None]:
    """(GB/s of ``op(i)`` for i = 0, 1, ... on a thread of its own, the busy loop's iterations a
    second beside it or None)."""
    done = [0]
    failed: list[BaseException] = []
    stop = threading.Event()

    def run() -> None:
        i = 0
        try:
            while not stop.is_set():
                op(i)
                i += 1
        except BaseException as exc:  # raised again in the caller's thread
            failed.append(exc)
        done[0] = i

    worker = threading.Thread(target=run, name="op")
    with Busy() if busy else contextlib.nullcontext() as loop:
        start = time.perf_counter()
        worker.start()
        time.sleep(seconds)
        stop.set()
        worker.join()
        elapsed = time.perf_counter() - start
        rate = None if loop is None else loop.iterations / elapsed
    if failed:
        raise failed[0]
    return done[0] * nbytes / elapsed / 1e9, rate


def child(store_path: str, slab_path: str, chunk_bytes: int, chunks: int, conn: Connection) -> None:
    """The child process: reads (or encodes) the chunks each message names; answers whether
    every one was there."""
    store = DiskStore(store_path, budget_bytes=1 << 30, readonly=True)  # no budget to keep: read-only
    slab = HostSlab(slab_path, chunk_bytes, chunks, create=False)
    try:
        while (msg := conn.recv()) is not None:
            what, first, n = msg
            ok = True
            for i in range(first, first + n):
                out = slab.view(i % chunks, 0, chunk_bytes)
                if what == "read":
                    ok &= store.get_into(key(i % chunks), out) is not None
                else:
                    codec.encode(out, DTYPE, key=key(i % chunks))
            conn.send(ok)
    finally:
        slab.close()
        store.close()


NS = b"gil-contention-ns"  # the hierarchy's one namespace (one shard per chunk)


Config = tuple[Hierarchy, Callable[[], None]]  # a hierarchy, and what sets the store up for it


def compared(args: argparse.Namespace, configs: dict[str, Config], op_for: Callable[[Hierarchy], Callable[[int], None]],
             nbytes: int, failures: str, ratios: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Per switch interval, for each named configuration (its setup run first): GB/s of its
    hierarchy's ``op_for(h)`` (``nbytes`` each) alone and beside the busy thread, and the busy
    thread's rate beside it against alone; ``ratios``: name -> (configuration, against which),
    beside the busy thread. Raises if a hierarchy counted ``failures``."""
    def row_for(busy_alone: float) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for name, (h, setup) in configs.items():
            setup()
            op = op_for(h)
            alone, _ = timed(op, args.seconds, nbytes, busy=False)
            beside, rate = timed(op, args.seconds, nbytes, busy=True)
            assert rate is not None
            failed = h.stats()[failures]
            if failed:
                raise RuntimeError(f"{failed} {failures}")
            row[name] = {"alone_gbps": round(alone, 3), "beside_busy_gbps": round(beside, 3),
                         "busy_rate_vs_alone": round(rate / busy_alone, 3)}
        for ratio, (name, base) in ratios.items():
            row[ratio] = round(row[name]["beside_busy_gbps"] / row[base]["beside_busy_gbps"], 3)
        return row

    return per_interval(args, row_for)


def nothing() -> None:
    """A configuration that needs no setup."""


def per_interval(args: argparse.Namespace, row_for: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
    """``row_for(the busy loop's iterations a second alone)`` at each ``--switch-intervals``
    value, keyed by it; the process's switch interval restored after."""
    out: dict[str, Any] = {}
    previous = sys.getswitchinterval()
    try:
        for interval in args.intervals:
            sys.setswitchinterval(interval)
            out[f"{interval:g}"] = row_for(busy_rate(args.seconds))
    finally:
        sys.setswitchinterval(previous)
    return out


class Rig:
    """A real disk store and the hierarchies (each with a host slab of its own) built over it;
    closed in that order's reverse: hierarchies, the store (its processes map the slabs), slabs."""

    def __init__(self, args: argparse.Namespace, store_path: Path, slab_dir: Path, budget_chunks: int) -> None:
        self.args, self.slab_dir = args, slab_dir
        self.disk = DiskStore(store_path, budget_bytes=budget_chunks * args.chunks * args.chunk_bytes + (64 << 20),
                              codec=args.codec)
        self.slabs: list[HostSlab] = []
        self.made: list[Hierarchy] = []

    def hierarchy(self, name: str, fill: np.random.Generator | None = None, **kw: Any) -> Hierarchy:
        """A hierarchy over the store with ``kw``; ``fill``: every slot holds KV-like bytes."""
        args = self.args
        slab = HostSlab(self.slab_dir / f"{name}-slab", args.chunk_bytes, args.chunks)
        self.slabs.append(slab)
        if fill is not None:
            for i in range(args.chunks):
                slab.slot(i)[:] = kv_like(fill, args.chunk_bytes)
        h = Hierarchy(HostPool(slab), self.disk, namespaces=[NS], group_shard_bytes=[args.chunk_bytes],
                      group_dtypes=[DTYPE], **kw)
        self.made.append(h)
        return h

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.made:
            h.close()
        self.disk.close()
        for slab in self.slabs:
            slab.close()


def promotions(args: argparse.Namespace, root: Path, slab_dir: Path) -> dict[str, Any]:
    """Per switch interval and ``read_processes`` (0, then ``--processes``): GB/s of a real
    hierarchy promoting every chunk of its disk into its host tier (one lookup's worth, waited
    for, then the host tier reset), alone and beside the busy thread (``compared``)."""
    rng = np.random.default_rng(1)
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(args.chunks)]  # group 0
    n = args.processes
    with Rig(args, root / "hierarchy-store", slab_dir, budget_chunks=4) as rig:
        rig.disk.put_many([(NS + k, kv_like(rng, args.chunk_bytes), DTYPE) for k in keys])
        # Threads first: once the store has read processes it keeps them (a hierarchy asking
        # for none reads in its threads all the same).
        configs = {f"read_processes_{p}": (rig.hierarchy(f"read-{p}", read_threads=n, max_concurrent_reads=n,
                                                         read_processes=p), nothing) for p in (0, n)}

        def promote_all(h: Hierarchy) -> Callable[[int], None]:
            def op(i: int) -> None:
                h.promote(keys)
                if not h.wait_promotions(keys, ANSWER_TIMEOUT_S) or not h.reset():
                    raise RuntimeError("the promotions did not land")
            return op

        return compared(args, configs, promote_all, args.chunks * args.chunk_bytes, "promotions_failed",
                        {"processes_vs_threads_beside_busy": (f"read_processes_{n}", "read_processes_0")})


def writes(args: argparse.Namespace, root: Path, slab_dir: Path) -> dict[str, Any]:
    """Per switch interval and ``write_processes`` (0, then ``--processes``): GB/s of a real
    hierarchy writing fresh host chunks behind to its disk (``--chunks`` stored, each written,
    compressed and committed, waited for), alone and beside the busy thread, and the busy
    thread's rate beside them against alone (the engine core's loop beside the writes). The
    write threads run at normal priority (a GPU engine's ``background_priority: auto``). With
    write processes, what they framed is put by the put process, and once more by the store's
    writer thread (``DiskStore.use_write_processes(put_process=False)``)."""
    rng = np.random.default_rng(2)
    n = args.processes
    nbytes = args.chunks * args.chunk_bytes
    written = [0]
    with Rig(args, root / "write-store", slab_dir, budget_chunks=8) as rig:
        by_processes = {p: rig.hierarchy(f"write-{p}", fill=rng, write_threads=n, idle_writes=False,
                                         max_write_inflight_bytes=nbytes, write_processes=p)
                        for p in (0, n)}

        def put_process(on: bool) -> Callable[[], None]:
            return lambda: rig.disk.use_write_processes(by_processes[n].slab, n, put_process=on)

        configs = {"write_processes_0": (by_processes[0], nothing),
                   f"write_processes_{n}_writer_thread": (by_processes[n], put_process(False)),
                   f"write_processes_{n}": (by_processes[n], put_process(True))}

        def write_all(h: Hierarchy) -> Callable[[int], None]:
            def op(i: int) -> None:
                first = written[0]
                written[0] += args.chunks
                keys = [k.to_bytes(32, "big") + bytes(4) for k in range(first, written[0])]
                target = h.stats()["writes_completed"] + len(keys)
                if h.prepare_store(keys) is None:
                    raise RuntimeError("no host slots for the chunks")
                h.complete_store(keys)
                deadline = time.monotonic() + ANSWER_TIMEOUT_S
                while h.stats()["writes_completed"] < target:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the writes did not complete: {h.stats()}")
                    time.sleep(0.001)
                if not h.reset():
                    raise RuntimeError("the host tier did not reset")
            return op

        out = compared(args, configs, write_all, nbytes, "writes_failed", {
            "processes_vs_threads_beside_busy": (f"write_processes_{n}", "write_processes_0"),
            "put_process_vs_writer_thread_beside_busy": (f"write_processes_{n}", f"write_processes_{n}_writer_thread")})
        stats = rig.disk.stats()
        out["framed_by_processes"], out["put_by_the_put_process"] = stats["process_framed"], stats["process_puts"]
        return out


def measure(args: argparse.Namespace, root: Path, slab_dir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    store_path, slab_path = root / "store", slab_dir / "slab"
    store = DiskStore(store_path, budget_bytes=4 * args.chunks * args.chunk_bytes + (64 << 20))
    slab = HostSlab(slab_path, args.chunk_bytes, args.chunks)
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    proc = ctx.Process(target=child, args=(str(store_path), str(slab_path), args.chunk_bytes, args.chunks,
                                           child_end), daemon=True)
    try:
        for i in range(args.chunks):
            store.put_many([(key(i), kv_like(rng, args.chunk_bytes), DTYPE)])
            slab.slot(i)[:] = kv_like(rng, args.chunk_bytes)
        proc.start()

        def remote(what: str) -> Callable[[int], None]:
            def op(i: int) -> None:
                parent.send((what, i * args.batch, args.batch))
                if not parent.poll(ANSWER_TIMEOUT_S) or not parent.recv():  # EOFError if it died
                    raise RuntimeError(f"the child's {what} of chunks from {i * args.batch % args.chunks} failed")
            return op

        def read(i: int) -> None:
            if store.get_into(key(i % args.chunks), slab.view(i % args.chunks, 0, args.chunk_bytes)) is None:
                raise RuntimeError(f"chunk {i % args.chunks} is not in the store")

        def encode(i: int) -> None:
            codec.encode(slab.view(i % args.chunks, 0, args.chunk_bytes), DTYPE, key=key(i % args.chunks))

        remote("read")(0)  # the child is up

        def row_for(alone: float) -> dict[str, Any]:
            row: dict[str, Any] = {"busy_iterations_per_s": round(alone)}
            for name, local in (("read", read), ("encode", encode)):
                thread_alone, _ = timed(local, args.seconds, args.chunk_bytes, busy=False)
                thread_beside, rate_thread = timed(local, args.seconds, args.chunk_bytes, busy=True)
                process_beside, rate_process = timed(remote(name), args.seconds,
                                                     args.batch * args.chunk_bytes, busy=True)
                assert rate_thread is not None and rate_process is not None
                row[name] = {
                    "thread_alone_gbps": round(thread_alone, 3),
                    "thread_beside_busy_gbps": round(thread_beside, 3),
                    "process_beside_busy_gbps": round(process_beside, 3),
                    "thread_beside_vs_alone": round(thread_beside / thread_alone, 3),
                    "process_beside_vs_thread_beside": round(process_beside / thread_beside, 3),
                    "busy_rate_vs_alone": {"thread": round(rate_thread / alone, 3),
                                           "process": round(rate_process / alone, 3)},
                }
            return row

        return per_interval(args, row_for)
    finally:
        if proc.is_alive():
            parent.send(None)
            proc.join(30)
        if proc.is_alive():
            proc.kill()
        parent.close()
        slab.close()
        store.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="gil-contention-", dir=args.dir))
    # The slab in shared memory, as the host tier's (HostSlab's default place).
    slab_dir = Path(tempfile.mkdtemp(prefix="gil-contention-", dir="/dev/shm" if Path("/dev/shm").is_dir() else root))
    try:
        parts = args.part_names
        intervals = measure(args, root, slab_dir) if "threads" in parts else None
        promoted = promotions(args, root, slab_dir) if "promotions" in parts else None
        written = writes(args, root, slab_dir) if "writes" in parts else None
    finally:
        shutil.rmtree(slab_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"chunk_bytes": args.chunk_bytes, "chunks": args.chunks, "seconds": args.seconds,
                      "codec": args.codec,
                      "batch": args.batch, "processes": args.processes,
                      "switch_intervals": intervals, "promotions": promoted,
                      "writes_behind": written}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
