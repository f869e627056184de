"""``kvstrata bench disk``: the disk tier against raw file I/O on the same bytes.

Writes N MiB of KV chunks through :class:`~kvstrata.tiers.disk.DiskStore` and the same bytes to a
plain file with fdatasync (the physical baseline), drops the page cache, reads both back cold,
and reports MB/s of uncompressed KV, the compression ratio and the order-0 entropy bound of the
data. Store and load run on a thread pool (chunks in parallel: zstandard releases the GIL).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.tiers.disk import DiskStore

MB = 1e6
_NPY_DTYPES = {  # .npy dtype -> store dtype; bf16 arrives as uint16 (numpy has no bfloat16)
    "uint16": "bfloat16",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "int8": "int8",
    "uint8": "uint8",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-file", type=Path, help=".npy array of real KV (bf16 as uint16, float16 or float32)"
    )
    parser.add_argument("--mib", type=int, default=256, help="MiB of KV to write (default 256)")
    parser.add_argument(
        "--codec", choices=("auto", "raw"), default="auto", help="disk tier codec (default auto)"
    )
    parser.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    parser.add_argument(
        "--dir", type=Path, help="where to put the files (default: a temp dir under $TMPDIR)"
    )
    parser.add_argument("--threads", type=int, default=2, help="store/load threads (default 2)")
    parser.add_argument(
        "--chunk-mib", type=float, default=2.0, help="chunk size in MiB (default 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated KV")
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds; figures are medians (default 3)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the files")


# ---------------------------------------------------------------------------------------------
# Data


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even like torch."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def kv_channel_stats(rng: np.random.Generator, layers: int, channels: int) -> list[Any]:
    """Per layer ``((k_scale, k_mean), (v_scale, v_mean))`` (docs/STORAGE.md §3.1). Keys:
    lognormal channel scales, non-zero channel means and 2% outlier channels x10; values:
    smaller scales, means near zero."""
    stats = []
    for _ in range(layers):
        k_scale = rng.lognormal(0.0, 0.6, channels).astype(np.float32)
        k_scale[rng.choice(channels, max(1, channels // 50), replace=False)] *= 10
        k_mean = rng.normal(0.0, 1.0, channels).astype(np.float32)
        v_scale = rng.lognormal(-0.7, 0.4, channels).astype(np.float32)
        v_mean = rng.normal(0.0, 0.1, channels).astype(np.float32)
        stats.append(((k_scale, k_mean), (v_scale, v_mean)))
    return stats


def synthetic_kv(
    nbytes: int, chunk_bytes: int, seed: int = 0, *, layers: int = 8, channels: int = 1024
) -> np.ndarray:
    """bf16 KV with per-channel structure (``kv_channel_stats``); chunks alternate K and V of
    successive layers."""
    rng = np.random.default_rng(seed)
    rows = max(1, chunk_bytes // (2 * channels))
    n_chunks = max(1, nbytes // (rows * channels * 2))
    stats = kv_channel_stats(rng, layers, channels)
    out = np.empty((n_chunks, rows, channels), dtype=np.uint16)
    for i in range(n_chunks):
        scale, mean = stats[(i // 2) % layers][i % 2]
        out[i] = bf16_bits(rng.standard_normal((rows, channels), dtype=np.float32) * scale + mean)
    return out.reshape(-1)


def load_kv_file(path: Path, nbytes: int) -> tuple[np.ndarray, str]:
    from kvstrata.tools.cli import CLIError

    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read {path} as a .npy array: {exc}") from exc
    dtype = _NPY_DTYPES.get(arr.dtype.name)
    if dtype is None:
        raise CLIError(f"{path}: dtype {arr.dtype} is not one of {sorted(_NPY_DTYPES)}")
    flat = np.ascontiguousarray(arr).reshape(-1)
    count = min(flat.size, max(1, nbytes // flat.itemsize))
    return np.array(flat[:count]), dtype


def entropy_bound(data: np.ndarray) -> float:
    """Order-0 entropy bound of ``data`` taken as byte planes: raw bits / entropy bits."""
    planes = data.view(np.uint8).reshape(-1, data.itemsize)
    bits = 0.0
    for j in range(data.itemsize):
        counts = np.bincount(planes[:, j], minlength=256)
        p = counts[counts > 0] / counts.sum()
        bits += float(-(p * np.log2(p)).sum())
    return 8.0 * data.itemsize / bits if bits else float("inf")


# ---------------------------------------------------------------------------------------------
# Measurement helpers


@contextlib.contextmanager
def _timed(result: dict[str, float]) -> Iterator[None]:
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    yield
    result["s"] = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)


def drop_page_cache(files: list[Path]) -> str:
    """Empty the page cache; returns how ("drop_caches", "fadvise") or "" when impossible."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    # Unprivileged fallback: drop the clean pages of our own files (synced above).
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"
    except (OSError, AttributeError):
        return ""


def _raw_write(path: Path, chunks: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in chunks:
            view = chunk
            while view:
                view = view[os.write(fd, view) :]
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _raw_read(path: Path, outs: list[memoryview]) -> None:
    with open(path, "rb", buffering=0) as f:
        for out in outs:
            view = out
            while view:
                n = f.readinto(view)
                if not n:
                    raise OSError(f"{path} is shorter than written")
                view = view[n:]


def _mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / MB, 1) if seconds > 0 else 0.0


def _pool_map(threads: int, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-disk") as pool:
        return list(pool.map(fn, items))


# ---------------------------------------------------------------------------------------------


@dataclass
class _Workload:
    chunks: list[memoryview]
    keys: list[bytes]
    dtype: str
    flat: np.ndarray
    step: int

    @property
    def total(self) -> int:
        return int(self.flat.size)


def _workload(args: argparse.Namespace) -> tuple[_Workload, np.ndarray, str]:
    chunk_target = int(args.chunk_mib * (1 << 20))
    nbytes = args.mib << 20
    if args.kv_file is not None:
        data, dtype = load_kv_file(args.kv_file, nbytes)
        source = str(args.kv_file)
    else:
        data, dtype = synthetic_kv(nbytes, chunk_target, args.seed), "bfloat16"
        source = (
            "synthetic bf16 (lognormal channel scales, channel means, 2% outliers, K/V alternating)"
        )
    flat = data.view(np.uint8)
    step = max(data.itemsize, chunk_target - chunk_target % data.itemsize)
    chunks = [flat[i : i + step].data for i in range(0, flat.size, step)]
    # store keys: 16-byte namespace + 32-byte "block hash" + 4-byte group, like the connector's
    keys = [
        b"\x00" * 16 + i.to_bytes(32, "big") + (i % 2).to_bytes(4, "big")
        for i in range(len(chunks))
    ]
    return _Workload(chunks, keys, dtype, flat, step), data, source


def _round(
    work: _Workload, base: Path, args: argparse.Namespace, sink: np.ndarray
) -> dict[str, Any]:
    """One repetition: raw write, store, cold raw read, cold load (same bytes throughout)."""
    raw_path, store_path = base / "raw.bin", base / "store"
    shutil.rmtree(store_path, ignore_errors=True)
    budget = 4 * work.total + (1 << 30)
    raw_w: dict[str, float] = {}
    with _timed(raw_w):
        _raw_write(raw_path, work.chunks)

    store = DiskStore(store_path, budget_bytes=budget, codec=args.codec, level=args.level)
    batches = [
        list(zip(work.keys[i : i + 4], work.chunks[i : i + 4], [work.dtype] * 4, strict=False))
        for i in range(0, len(work.chunks), 4)
    ]
    store_t: dict[str, float] = {}
    with _timed(store_t):
        admitted = sum(_pool_map(args.threads, store.put_many, batches))
        store.sync()  # durable, like the fdatasync of the raw write
    stats = store.stats()
    store.close()

    outs = [sink[i : i + work.step].data for i in range(0, work.total, work.step)]
    dropped = drop_page_cache([raw_path, store_path / "data.mdb"])
    sink.fill(1)  # a touched destination, like the host slab
    raw_r: dict[str, float] = {}
    with _timed(raw_r):
        _raw_read(raw_path, outs)
    raw_ok = bool(np.array_equal(sink, work.flat))

    sink.fill(0)
    drop_page_cache([raw_path, store_path / "data.mdb"])
    store = DiskStore(store_path, budget_bytes=budget, codec=args.codec, create=False)
    load_t: dict[str, float] = {}
    with _timed(load_t):
        got = _pool_map(
            args.threads, lambda i: store.get_into(work.keys[i], outs[i]), list(range(len(outs)))
        )
    store.close()
    sizes_ok = all(g == len(c) for g, c in zip(got, work.chunks, strict=True))
    load_ok = sizes_ok and bool(np.array_equal(sink, work.flat))
    total = work.total
    return {
        "raw_write_MBps": _mbps(total, raw_w["s"]),
        "raw_read_MBps": _mbps(total, raw_r["s"]),
        "store_MBps": _mbps(total, store_t["s"]),
        "load_MBps": _mbps(total, load_t["s"]),
        "store_vs_raw": round(raw_w["s"] / store_t["s"], 3),
        "load_vs_raw": round(raw_r["s"] / load_t["s"], 3),
        "store_MB_per_cpu_s": _mbps(total, store_t["cpu_s"]),
        "load_MB_per_cpu_s": _mbps(total, load_t["cpu_s"]),
        "store_cpus_used": round(store_t["cpu_s"] / store_t["s"], 2),
        "load_cpus_used": round(load_t["cpu_s"] / load_t["s"], 2),
        "_dropped": dropped,
        "_ok": raw_ok and load_ok and admitted == len(work.chunks),
        "_stats": stats,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work, data, source = _workload(args)
    bound = entropy_bound(data)
    base = Path(tempfile.mkdtemp(prefix="kvstrata-bench-", dir=args.dir))
    loadavg_before = os.getloadavg()[0]
    try:
        sink = np.empty(work.total, dtype=np.uint8)
        rounds = [_round(work, base, args, sink) for _ in range(max(1, args.repeat))]
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    stats = rounds[-1]["_stats"]
    ratio = stats["raw_bytes"] / stats["stored_bytes"] if stats["stored_bytes"] else 0.0
    figures = [k for k in rounds[0] if not k.startswith("_")]
    # Medians over rounds; each ratio is taken within a round (raw and store ran back to back,
    # so a noisy neighbour affects both) before the median.
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in rounds), 3) for k in figures}
    dropped = rounds[-1]["_dropped"]
    out.update(
        compression_ratio=round(ratio, 4),
        entropy_bound_ratio=round(bound, 4),
        ratio_vs_bound=round(ratio / bound, 4),
        page_cache_dropped=bool(dropped),
        page_cache_method=dropped or "not permitted: cold reads may be served from the page cache",
        verified=all(r["_ok"] for r in rounds),
        codec=args.codec,
        level=args.level,
        dtype=work.dtype,
        data=source,
        mib=round(work.total / (1 << 20), 1),
        chunks=len(work.chunks),
        chunk_bytes=work.step,
        threads=args.threads,
        repeat=len(rounds),
        file_ratio=round(work.total / stats["file_bytes"], 4) if stats["file_bytes"] else 0.0,
        cpu_count=os.cpu_count(),
        loadavg_1m={"before": round(loadavg_before, 2), "after": round(os.getloadavg()[0], 2)},
        rounds=[{k: r[k] for k in figures} for r in rounds],
    )
    goal = 0.9 if args.codec == "raw" else 0.5
    out["goals"] = {
        "compression_ratio>=0.98*bound": args.codec == "raw" or ratio >= 0.98 * bound,
        "load_vs_raw>=1.0": out["load_vs_raw"] >= 1.0,
        f"store_vs_raw>={goal}": out["store_vs_raw"] >= goal,
    }
    if not out["verified"]:
        out["_exit_code"] = 1
    return out
